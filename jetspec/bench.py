"""Benchmark of lossless tree decoding against plain greedy decoding (DESIGN section 4, "Measures").

Every method decodes the same prompts with the same target, greedily, for the same `max_new_tokens`, in one
process. For each prompt every method runs once, in an order that rotates from prompt to prompt, so that slow
drifts of a shared machine fall on every method alike. Wall-clock time (`time.perf_counter`) spans the whole
`generate` call, prefill included. Every method's tokens must equal plain greedy's on every prompt: a mismatch
raises [`LosslessError`] and fails the run.

Methods:

- `plain`: `target.generate` (the reference; always measured).
- `prompt_lookup`: `target.generate(..., prompt_lookup_num_tokens=10)`, transformers' n-gram drafter.
- `chain`: the head decoding a single chain (`tree_width=1`, `tree_depth=D`, `tree_budget=D`), the DFlash-style
  chain baseline. transformers' own `speculation_type="dflash"` is not run: it needs a head honouring the
  `muse_glimmer_assistant` contract (`noise_embeds`, `context_hidden_states`, ...), which the JetSpec head does not.
- `tree-B`: the head with a best-first tree of `B` draft nodes, one method per budget.
- `auto`: the head with `tree_budget="auto"`.
- `path_conditioning`: the tree at the head's default budget with `path_conditioning=True` (`tree-B-pc`), next to
  `tree-B` without it.
- `lookup`: the tree with a prompt-lookup branch of L tokens (`tree_lookup=L`, the head's default, else the tree
  depth; `tree-B-lookup`), one method per budget: the head and transformers-style n-gram drafting in one verify
  forward. With the head's `tree_lookup_prior` the chain's tokens compete with the head's nodes at their measured
  odds.
- `lookup_first`: the same with `tree_lookup_prior=False` (`tree-B-lookup-first`): the whole chain first, whatever
  its odds (the ablation of the prior).

Equality: in float32 every output must equal plain greedy's token for token. In bfloat16/float16 an output may
leave plain greedy at a numerical tie (see `jetspec.equality`); each prompt is classified `exact`, `tie` or
`mismatch`, the counts are reported, and any `mismatch` fails the run.

Costs, measured once per run on the first prompt's prefilled cache (median of repeats):

- t(1): one target decode step, a forward of 1 token as plain decoding runs it;
- t(B): one verify forward over the root + B tree nodes under the tree-causal 4D mask, as tree decoding runs it
  (hidden states out, logits of every node);
- t_draft: one head forward over the block `[anchor, MASK x D]`; the draft cost is c = t_draft / t(1);
- limit speedup tau * t(1) / (t(B) + t_draft): what the measured tau would give without any other overhead.

Speedup is the ratio of tokens/s to plain greedy on the same prompt. On a shared CPU only ratios hold.
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache

from modeling_jetspec import JetSpecDraftModel, ancestor_mask, build_tree, marginal_children
from modeling_jetspec.tree import verification_mask

from modeling_jetspec.timing import clock, median_seconds

from .equality import DEFAULT_TIE_TOLERANCE, VERDICTS, Verdict, classify_outputs, first_difference
from .prompts import check_suites, load_prompts
from .targets import apply_chat_template


METHOD_KINDS = ("plain", "prompt_lookup", "chain", "tree", "auto", "path_conditioning", "lookup", "lookup_first")
DEFAULT_METHODS = METHOD_KINDS
PROMPT_LOOKUP_TOKENS = 10
NOTES = {
    "chain": (
        "The JetSpec head decoding a single chain (tree_width=1, tree_depth=D, tree_budget=D): the DFlash-style "
        "chain baseline. transformers' own speculation_type='dflash' is not measured: it needs a head honouring "
        "the muse_glimmer_assistant contract (noise_embeds, context_hidden_states, position_ids, attention_mask, "
        "cache), which the JetSpec head does not."
    ),
    "speedup": "tokens/s of the method over tokens/s of plain greedy on the same prompt; prefill included.",
    "limit_speedup": "tau * t(1) / (t(B) + t_draft), with the costs below; ignores prefill and host overheads.",
    "costs": (
        "t(1): target forward of 1 token on the prefilled cache (as plain decoding); t(B): target forward of root "
        "+ B tree nodes under a 4D tree mask on the same cache, hidden states and all logits out (as tree "
        "verification); t_draft: one head forward over [anchor, MASK x D]; medians of repeats."
    ),
}


class LosslessError(RuntimeError):
    """A speculative method's output differs from plain greedy decoding: the decoding is not lossless."""


@dataclass
class Method:
    name: str  # row label: "plain", "prompt_lookup", "chain", "tree-16", "auto"
    kind: str  # one of METHOD_KINDS
    generate_kwargs: dict = field(default_factory=dict)  # extra arguments of `target.generate`
    uses_head: bool = False
    budget: Optional[int] = None  # draft nodes per round, when fixed


def build_methods(
    kinds: Sequence[str], budgets: Sequence[int], chain_depth: int, default_budget: int = 32,
    lookup_tokens: Optional[int] = None,
) -> list[Method]:
    """The measured methods, in the order of `kinds` (`"tree"` expands to one method per budget;
    `"path_conditioning"` is the tree at `default_budget` with path-conditioned drafting; `"lookup"` expands to one
    tree per budget with a prompt-lookup branch of `lookup_tokens` tokens, by default `chain_depth`). `chain`,
    `tree-B`, `auto` and `tree-B-pc` measure the head alone: they set `tree_lookup=0` whatever the head's default."""
    unknown = [k for k in kinds if k not in METHOD_KINDS]
    if unknown:
        raise ValueError(f"expected methods among {', '.join(METHOD_KINDS)}, got {', '.join(map(str, unknown))}")
    if "plain" not in kinds:
        raise ValueError(f"expected 'plain' among the methods (every output is checked against it), got {list(kinds)}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"expected each method once, got {list(kinds)}")
    lookup_tokens = lookup_tokens or chain_depth
    methods = []
    for kind in kinds:
        if kind == "plain":
            methods.append(Method("plain", kind))
        elif kind == "prompt_lookup":
            methods.append(Method("prompt_lookup", kind, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}))
        elif kind == "chain":
            shape = {"tree_depth": chain_depth, "tree_width": 1, "tree_budget": chain_depth, "tree_lookup": 0}
            methods.append(Method("chain", kind, shape, uses_head=True, budget=chain_depth))
        elif kind == "tree":
            for b in budgets:
                methods.append(Method(f"tree-{b}", kind, {"tree_budget": b, "tree_lookup": 0}, uses_head=True,
                                      budget=b))
        elif kind == "auto":
            methods.append(Method("auto", kind, {"tree_budget": "auto", "tree_lookup": 0}, uses_head=True))
        elif kind == "path_conditioning":
            methods.append(Method(
                f"tree-{default_budget}-pc", kind,
                {"tree_budget": default_budget, "path_conditioning": True, "tree_lookup": 0},
                uses_head=True, budget=default_budget,
            ))
        elif kind == "lookup":
            for b in budgets:
                methods.append(Method(f"tree-{b}-lookup", kind, {"tree_budget": b, "tree_lookup": lookup_tokens},
                                      uses_head=True, budget=b))
        elif kind == "lookup_first":
            for b in budgets:
                methods.append(Method(
                    f"tree-{b}-lookup-first", kind,
                    {"tree_budget": b, "tree_lookup": lookup_tokens, "tree_lookup_prior": False}, uses_head=True,
                    budget=b,
                ))
    return methods


def check_budgets(budgets: Sequence[int]) -> list[int]:
    """Validated list of tree budgets (integers >= 1, at least one)."""
    budgets = list(budgets)
    if not budgets:
        raise ValueError("expected at least one tree budget, got an empty list")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"expected tree budgets that are integers >= 1, got {bad}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"expected distinct tree budgets, got {budgets}")
    return budgets


# ------------------------------------------------------------------------------------------------ one generate call
def _generate(target, head, method: Method, input_ids, attention_mask, common: dict):
    """Runs one method on one prompt. Returns `(new tokens of shape (n,), seconds, head stats or None)`."""
    kwargs = dict(common, **method.generate_kwargs)
    if method.uses_head:
        head.last_stats = None
        kwargs["assistant_model"] = head
    started = clock()
    out = target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    seconds = clock() - started
    stats = None
    if method.uses_head:
        if head.last_stats is None:
            raise ValueError(f"expected head statistics after method {method.name!r}, got none")
        stats = head.last_stats
    return out[0, input_ids.shape[1] :].cpu(), seconds, stats


# ------------------------------------------------------------------------------------------------ costs
def _median_seconds(fn, repeats: int) -> float:
    return median_seconds(fn, repeats=repeats, warmup=2)


@torch.no_grad()
def measure_costs(
    target: PreTrainedModel,
    head: JetSpecDraftModel,
    input_ids: torch.Tensor,
    budgets: Sequence[int],
    chain_depth: int,
    repeats: int = 10,
) -> dict:
    """
    Draft cost c and verify costs t(B)/t(1) on the prefilled cache of one prompt.

    Args:
        target (`PreTrainedModel`): the target, with sdpa or eager attention.
        head (`JetSpecDraftModel`): the draft head (tree depth and width from its config).
        input_ids (`torch.LongTensor` of shape `(1, L)`): the prompt.
        budgets (`Sequence[int]`): tree budgets B to time.
        chain_depth (`int`): depth D of the chain baseline (a chain of D nodes is timed as well).
        repeats (`int`, *optional*, defaults to 10): timed repeats per forward (after 2 untimed ones).

    Returns:
        `dict` with the seconds of a target step, a draft forward, each verify forward, and their ratios.
    """
    head.attach_target(target)
    device = target.device
    cache = DynamicCache()
    past = input_ids.shape[1]
    positions = torch.arange(past, device=device)[None]  # (1, L)
    keep = {"logits_to_keep": 1} if target._supports_logits_to_keep() else {}
    keep_all = {"logits_to_keep": 0} if target._supports_logits_to_keep() else {}
    out = target(
        input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
        output_hidden_states=True, **keep,
    )
    anchor = out.logits[:, -1].argmax(-1)  # (1,)
    valid = torch.ones(1, past, dtype=torch.bool, device=device)
    context = head.extend_context(None, head.target_features(out.hidden_states), positions, valid)
    del out

    # t(1): one decode step as plain greedy runs it (2D mask, last logits), the cache cropped back after each
    step_mask = torch.ones(1, past + 1, dtype=torch.long, device=device)

    def step():
        target(
            input_ids=anchor[:, None], attention_mask=step_mask, position_ids=torch.tensor([[past]], device=device),
            past_key_values=cache, use_cache=True, **keep,
        )
        cache.crop(-1)

    t_step = _median_seconds(step, repeats)

    # t_draft: one head forward over [anchor, MASK x D] (the causal block; the whole block when bidirectional)
    depth, width = head.config.tree_depth, head.config.tree_width
    length = depth + 1 if head.config.block_attention == "causal" else head.config.block_size
    block = torch.full((1, length), head.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = anchor
    block_pos = past + torch.arange(length, device=device)[None]
    t_draft = _median_seconds(lambda: head(block, block_pos, context=context), repeats)
    logp = torch.log_softmax(head(block, block_pos, context=context).logits[0, 1 : depth + 1], dim=-1)  # (N, V)

    def tree_of(budget: int, tree_depth: int, tree_width: int):
        top_lp, top_tok = logp[:tree_depth].topk(tree_width, dim=-1)  # (N, W)
        return build_tree(marginal_children(top_lp, top_tok, torch.zeros(tree_depth)), budget, tree_depth)

    def verify_seconds(tree) -> float:
        n = len(tree.tokens)
        tokens = torch.tensor([tree.tokens], dtype=torch.long, device=device)  # (1, n)
        parents = torch.tensor([tree.parents], dtype=torch.long, device=device)  # (1, n)
        depths = torch.tensor([[0] + tree.depths], dtype=torch.long, device=device)  # (1, n+1)
        dtype = target.dtype if target.dtype.is_floating_point else torch.float32
        mask = verification_mask(valid, ancestor_mask(parents), dtype)  # (1, 1, n+1, S+n+1), as the tree loop
        ids = torch.cat([anchor[:, None], tokens], dim=1)

        def verify():
            target(
                input_ids=ids, attention_mask=mask, position_ids=past + depths, past_key_values=cache,
                use_cache=True, output_hidden_states=True, **keep_all,
            )
            cache.crop(-(n + 1))

        return _median_seconds(verify, repeats)

    verify = {}
    for b in budgets:
        tree = tree_of(b, depth, width)
        seconds = verify_seconds(tree)
        verify[str(b)] = {"nodes": len(tree.tokens), "seconds": seconds, "ratio_to_step": seconds / t_step}
    chain = tree_of(chain_depth, chain_depth, 1)
    chain_seconds = verify_seconds(chain)
    return {
        "prompt_tokens": past,
        "repeats": repeats,
        "tree_depth": depth,
        "tree_width": width,
        "target_step_seconds": t_step,
        "draft_forward_seconds": t_draft,
        "draft_cost_c": t_draft / t_step,
        "verify": verify,
        "chain": {"nodes": len(chain.tokens), "seconds": chain_seconds, "ratio_to_step": chain_seconds / t_step},
    }


def limit_speedup(tau: Optional[float], budget_costs: Optional[dict], costs: dict) -> Optional[float]:
    """tau * t(1) / (t(B) + t_draft), or `None` when tau or t(B) is unknown."""
    if tau is None or budget_costs is None:
        return None
    return tau * costs["target_step_seconds"] / (budget_costs["seconds"] + costs["draft_forward_seconds"])


# ------------------------------------------------------------------------------------------------ aggregates
def _quartiles(values: list) -> dict:
    q25, q50, q75 = np.percentile(values, [25, 50, 75])
    return {"median": float(q50), "q25": float(q25), "q75": float(q75), "iqr": float(q75 - q25),
            "min": float(min(values)), "max": float(max(values))}


def aggregate(rows: list[dict], method: Method, costs: Optional[dict]) -> dict:
    """Per-suite figures of one method from its per-prompt rows."""
    speedup = _quartiles([r["speedup"] for r in rows])
    tps = _quartiles([r["tokens_per_s"] for r in rows])
    result = {
        "prompts": len(rows),
        "budget": method.budget,
        "new_tokens": int(sum(r["new_tokens"] for r in rows)),
        "seconds": float(sum(r["seconds"] for r in rows)),
        "tokens_per_s_median": tps["median"],
        "speedup_median": speedup["median"],
        "speedup_q25": speedup["q25"],
        "speedup_q75": speedup["q75"],
        "speedup_iqr": speedup["iqr"],
        "speedup_min": speedup["min"],
        "speedup_max": speedup["max"],
        "budget_mean": None,
        "tau_mean": None,
        "acceptance_per_depth": None,
        "target_forwards_mean": None,
        "draft_seconds_per_round": None,
        "verify_seconds_per_round": None,
        "limit_speedup": None,
        "equality": {kind: sum(r["equality"] == kind for r in rows) for kind in VERDICTS},
    }
    if method.uses_head:
        rounds = sum(r["rounds"] for r in rows)
        # (prompts, N); a prompt decoded with a shallower tree accepted nothing deeper
        depth = max(len(r["acceptance_per_depth"]) for r in rows)
        acceptance = np.array([r["acceptance_per_depth"] + [0.0] * (depth - len(r["acceptance_per_depth"]))
                               for r in rows], dtype=float)
        budgets = [r["budget_mean"] for r in rows if r["budget_mean"] is not None]
        result.update(
            budget_mean=float(np.mean(budgets)) if budgets else None,
            tau_mean=float(np.mean([r["tau"] for r in rows])),
            acceptance_per_depth=acceptance.mean(0).tolist(),
            target_forwards_mean=float(np.mean([r["target_forwards"] for r in rows])),
            draft_seconds_per_round=float(sum(r["draft_seconds"] for r in rows) / max(rounds, 1)),
            verify_seconds_per_round=float(sum(r["verify_seconds"] for r in rows) / max(rounds, 1)),
        )
        if costs is not None:
            budget_costs = costs["chain"] if method.kind == "chain" else costs["verify"].get(str(method.budget))
            result["limit_speedup"] = limit_speedup(result["tau_mean"], budget_costs, costs)
    return result


# ------------------------------------------------------------------------------------------------ environment
def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
    }


def versions() -> dict:
    import tokenizers
    import transformers
    from importlib.metadata import PackageNotFoundError, version

    try:
        jetspec_version = version("jetspec")
    except PackageNotFoundError:
        jetspec_version = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "jetspec": jetspec_version,
        "git_commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }


# ------------------------------------------------------------------------------------------------ the run
def run_benchmark(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    head: JetSpecDraftModel,
    suites: Sequence[str],
    budgets: Sequence[int],
    max_new_tokens: int,
    limit: Optional[int],
    out_dir,
    methods: Sequence[str] = DEFAULT_METHODS,
    warmup: bool = True,
    cost_repeats: int = 10,
    command: Optional[str] = None,
    progress: bool = True,
    float32_logits=None,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    dtype_reason: Optional[str] = None,
) -> dict:
    """
    Measures every method on the prompts of `suites` and writes `results.json`, `results.md` and plots to `out_dir`.

    Args:
        target (`PreTrainedModel`): the target model, eval mode.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template.
        head (`JetSpecDraftModel`): the draft head; tree depth and width come from its config.
        suites (`Sequence[str]`): prompt suites among `jetspec.prompts.SUITES`.
        budgets (`Sequence[int]`): tree budgets B; one `tree-B` method each.
        max_new_tokens (`int`): tokens generated per prompt (fewer when the target stops).
        limit (`int`, *optional*): the first `limit` prompts of each suite; `None` for all.
        out_dir (`str` or `os.PathLike`): output folder, created if missing.
        methods (`Sequence[str]`, *optional*, defaults to all of `METHOD_KINDS`):
            method kinds to measure; must include `"plain"`; `"tree"` stands for every `tree-B`.
        warmup (`bool`, *optional*, defaults to `True`):
            Run every method once, untimed, on the first prompt (at most 8 new tokens) before measuring.
        cost_repeats (`int`, *optional*, defaults to 10): timed repeats of each forward in [`measure_costs`].
        command (`str`, *optional*): the command line recorded in the results, defaults to `sys.argv`.
        progress (`bool`, *optional*, defaults to `True`): show a tqdm bar over (suite, prompt).
        float32_logits (`Callable`, *optional*): the target's float32 next-token logits for a prefix (see
            `jetspec.equality.float32_logits_fn`), used to judge divergences of a bfloat16/float16 target as ties.
            Required unless the target runs in float32, where any divergence fails.
        tie_tolerance (`float`, *optional*): float32 logit gap still called a tie.
        dtype_reason (`str`, *optional*): why the target runs in its dtype, recorded in the results.

    Returns:
        `dict`: the content of `results.json`.

    Raises:
        `LosslessError`: when a method's tokens differ from plain greedy's on any prompt (float32), or differ at a
        position that is not a numerical tie (bfloat16/float16).
    """
    from tqdm.auto import tqdm

    suites = check_suites(suites)
    budgets = check_budgets(budgets)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"expected max_new_tokens >= 1, got {max_new_tokens!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"expected limit >= 1 prompts per suite (or None for all), got {limit!r}")
    strict = target.dtype == torch.float32
    if not strict and float32_logits is None:
        raise ValueError(
            f"expected float32_logits (the tie check) for a {target.dtype} target, got None; only a float32 target "
            "is held to bitwise equality without it"
        )
    head.attach_target(target)
    chain_depth = head.config.tree_depth
    # the lookup methods use the head's own chain length when it has one
    plan = build_methods(list(methods), budgets, chain_depth, head.config.tree_budget, head.config.tree_lookup)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    wall = time.perf_counter()

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": max_new_tokens, "do_sample": False}
    if pad is not None:
        common["pad_token_id"] = pad
    device = target.device

    def encode(prompt: str):
        # the chat template already holds the special tokens: add none (same encoding for every method)
        enc = tokenizer(apply_chat_template(tokenizer, prompt), return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)

    prompts = {suite: load_prompts(suite, limit) for suite in suites}
    first = next((rows[0] for rows in prompts.values() if rows), None)
    if first is None:
        raise ValueError(f"expected prompts in suites {suites}, got none")
    first_ids, first_mask = encode(first["prompt"])

    def run(method: Method, ids, mask, kwargs):
        return _generate(target, head, method, ids, mask, kwargs)

    if warmup:
        warm = dict(common, max_new_tokens=min(8, max_new_tokens))
        for method in plan:
            run(method, first_ids, first_mask, warm)

    costs = None
    if any(m.uses_head for m in plan):
        costs = measure_costs(target, head, first_ids, budgets, chain_depth, repeats=cost_repeats)

    rows = []
    total = sum(len(p) for p in prompts.values())
    bar = tqdm(total=total, desc="bench", unit="prompt", disable=not progress)
    turn = 0
    try:
        for suite in suites:
            for prompt in prompts[suite]:
                bar.set_postfix_str(f"{suite} {prompt['id']}")
                ids, mask = encode(prompt["prompt"])
                shift = turn % len(plan)
                order = plan[shift:] + plan[:shift]  # rotating order: each method takes every slot in turn
                turn += 1
                outputs = {method.name: run(method, ids, mask, common) for method in order}
                reference = outputs["plain"][0]
                verdicts = {}
                for method in plan:
                    tokens = outputs[method.name][0]
                    if torch.equal(tokens, reference):
                        verdict = Verdict("exact")
                    elif strict:  # float32: bitwise, no ties
                        verdict = Verdict("mismatch", first_difference(reference, tokens))
                    else:
                        verdict = classify_outputs(float32_logits, ids[0].cpu(), reference, tokens, tie_tolerance)
                    if verdict.kind == "mismatch":
                        at = verdict.position
                        raise LosslessError(
                            f"expected method {method.name!r} to reproduce plain greedy decoding on {suite} prompt "
                            f"{prompt['id']!r} ({target.dtype}), got a difference at new token {at} "
                            f"({tokens[at:at + 5].tolist()} vs plain {reference[at:at + 5].tolist()}; lengths "
                            f"{len(tokens)} vs {len(reference)})"
                            + ("" if verdict.gap is None else f" that is no tie: float32 logit gap {verdict.gap:.3f} "
                               f"> tolerance {tie_tolerance}")
                        )
                    verdicts[method.name] = verdict
                plain_tps = len(reference) / outputs["plain"][1]
                for method in plan:
                    tokens, seconds, stats = outputs[method.name]
                    row = {
                        "suite": suite,
                        "prompt_id": prompt["id"],
                        "method": method.name,
                        "prompt_tokens": int(ids.shape[1]),
                        "new_tokens": len(tokens),
                        "seconds": seconds,
                        "tokens_per_s": len(tokens) / seconds,
                        "speedup": (len(tokens) / seconds) / plain_tps,
                        "slot": order.index(method),
                        "tau": None,
                        "acceptance_per_depth": None,
                        "target_forwards": None,
                        "rounds": None,
                        "draft_seconds": None,
                        "verify_seconds": None,
                        "budget_mean": None,
                        "equality": verdicts[method.name].kind,
                        "tie": verdicts[method.name].as_dict() if verdicts[method.name].kind == "tie" else None,
                    }
                    if stats is not None:
                        figures = stats.as_dict()
                        row.update({k: figures[k] for k in (
                            "tau", "acceptance_per_depth", "target_forwards", "rounds", "draft_seconds",
                            "verify_seconds",
                        )})
                        # budgets verified per round (recorded by the core since tree_budget="auto")
                        verified = figures.get("budgets") or []
                        row["budget_mean"] = float(np.mean(verified)) if verified else method.budget
                    rows.append(row)
                bar.update(1)
    finally:
        bar.close()

    aggregates = {}
    groups = {suite: [suite] for suite in suites}
    if len(suites) > 1:
        groups["all"] = suites
    for group, members in groups.items():
        aggregates[group] = {}
        for method in plan:
            mine = [r for r in rows if r["method"] == method.name and r["suite"] in members]
            if mine:
                aggregates[group][method.name] = aggregate(mine, method, costs)

    results = {
        "started_at": started_at,
        "wall_seconds": time.perf_counter() - wall,
        "command": command if command is not None else " ".join(sys.argv),
        "machine": machine_info(),
        "versions": versions(),
        "config": {
            "target": target.name_or_path or None,
            "target_dtype": str(target.dtype),
            "dtype_reason": dtype_reason,
            "equality": "bitwise (float32)" if strict else f"tie-aware, tolerance {tie_tolerance} float32 logits",
            "attn_implementation": target.config._attn_implementation,
            "head": head.name_or_path or None,
            "head_config": {
                k: getattr(head.config, k)
                for k in ("num_hidden_layers", "block_size", "block_attention", "target_layer_ids", "tree_depth",
                          "tree_width", "tree_budget", "tree_scoring", "path_conditioning", "tree_lookup",
                          "tree_lookup_prior", "draft_vocab_size", "last_context_input")
            },
            "suites": suites,
            "budgets": budgets,
            "max_new_tokens": max_new_tokens,
            "limit": limit,
            "methods": [m.name for m in plan],
            "method_arguments": {m.name: {k: v for k, v in m.generate_kwargs.items()} for m in plan},
            "chain_depth": chain_depth,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
            "greedy": True,
            "warmup": warmup,
            "order": "rotating per prompt",
        },
        "notes": NOTES,
        "costs": costs,
        "aggregates": aggregates,
        "prompts": rows,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plots = write_plots(results, out_dir)
    results["plots"] = [p.name for p in plots]
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown(results))
    return results


# ------------------------------------------------------------------------------------------------ reports
def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(results: dict) -> str:
    """The `results.md` report: settings, costs and one table per suite."""
    config, costs = results["config"], results["costs"]
    lines = [
        "# jetspec benchmark",
        "",
        f"Command: `{results['command']}`  ",
        f"Started {results['started_at']}, {results['wall_seconds']:.0f} s; machine: {results['machine']['platform']}, "
        f"{results['machine']['cpu_count']} CPUs ({results['machine']['torch_threads']} torch threads)"
        + (f", {results['machine']['cuda']}" if results["machine"]["cuda"] else "") + "  ",
        f"torch {results['versions']['torch']}, transformers {results['versions']['transformers']}, "
        f"jetspec {results['versions']['jetspec']} ({results['versions']['git_commit'] or 'no git commit'})  ",
        f"Target `{config['target']}` ({config['target_dtype']}, {config['attn_implementation']}); head "
        f"`{config['head']}` (tree depth {config['head_config']['tree_depth']}, width "
        f"{config['head_config']['tree_width']}); greedy, max_new_tokens {config['max_new_tokens']}, "
        f"{'at most ' + str(config['limit']) if config['limit'] else 'all'} prompts per suite, methods "
        "alternated per prompt in rotating order.",
        "",
        "Speedup: tokens/s over plain greedy on the same prompt (prefill included), median [q25, q75] over prompts. "
        "Limit: tau * t(1) / (t(B) + t_draft). Equality with plain greedy: "
        f"{config.get('equality', 'bitwise (float32)')}; the `=/tie` column counts prompts equal to plain greedy "
        "and prompts that left it at a numerical tie (a mismatch fails the run).",
        "",
        f"Note: {NOTES['chain']}",
    ]
    if costs is not None:
        lines += [
            "",
            "## Costs",
            "",
            f"On a prompt of {costs['prompt_tokens']} tokens, median of {costs['repeats']} repeats: target step "
            f"t(1) = {costs['target_step_seconds'] * 1e3:.2f} ms, head draft forward "
            f"{costs['draft_forward_seconds'] * 1e3:.2f} ms, draft cost c = {costs['draft_cost_c']:.3f}.",
            "",
            "| verify | nodes | t(B) ms | t(B)/t(1) |",
            "| --- | ---: | ---: | ---: |",
        ]
        entries = [(f"tree-{b}", v) for b, v in costs["verify"].items()] + [("chain", costs["chain"])]
        for name, v in entries:
            lines.append(f"| {name} | {v['nodes']} | {v['seconds'] * 1e3:.2f} | {v['ratio_to_step']:.2f} |")
    for group, methods in results["aggregates"].items():
        depth = max((len(a["acceptance_per_depth"] or []) for a in methods.values()), default=0)
        shown = min(depth, 8)
        lines += [
            "",
            f"## {group}",
            "",
            "| method | B | prompts | =/tie | tok/s | speedup median [q25, q75] | tau | limit | "
            + " | ".join(f"acc d{d + 1}" for d in range(shown)) + (" |" if shown else ""),
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |" + " ---: |" * shown,
        ]
        for name, a in methods.items():
            acc = a["acceptance_per_depth"] or [None] * shown
            lines.append(
                f"| {name} | {_fmt(a['budget_mean'], 1)} | {a['prompts']} | "
                f"{a['equality']['exact']}/{a['equality']['tie']} | {a['tokens_per_s_median']:.1f} | "
                f"{a['speedup_median']:.2f}x "
                f"[{a['speedup_q25']:.2f}, {a['speedup_q75']:.2f}] | {_fmt(a['tau_mean'])} | "
                f"{_fmt(a['limit_speedup'], suffix='x')} | "
                + " | ".join(_fmt(x) for x in (acc + [None] * shown)[:shown]) + (" |" if shown else "")
            )
    if results.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]]
    return "\n".join(lines) + "\n"


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """Speedup vs budget and per-depth acceptance, one panel per suite (matplotlib's Agg canvas, no pyplot)."""
    from matplotlib.figure import Figure

    suites = results["config"]["suites"]
    budgets = results["config"]["budgets"]
    written = []

    def panels(title: str):
        fig = Figure(figsize=(4.2 * len(suites), 3.6), layout="constrained")
        axes = fig.subplots(1, len(suites), squeeze=False)[0]
        fig.suptitle(title)
        return fig, axes

    fig, axes = panels("Speedup over plain greedy vs tree budget (median, bars: q25-q75)")
    for ax, suite in zip(axes, suites):
        agg = results["aggregates"].get(suite, {})
        tree = [(b, agg[f"tree-{b}"]) for b in budgets if f"tree-{b}" in agg]
        if tree:
            xs = [b for b, _ in tree]
            med = np.array([a["speedup_median"] for _, a in tree])
            err = np.array([[a["speedup_median"] - a["speedup_q25"] for _, a in tree],
                            [a["speedup_q75"] - a["speedup_median"] for _, a in tree]])
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label="tree (measured)")
            limits = [a["limit_speedup"] for _, a in tree]
            if all(v is not None for v in limits):
                ax.plot(xs, limits, linestyle="--", marker="x", label="tree (limit)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
        if "chain" in agg:
            a = agg["chain"]
            ax.errorbar([a["budget"]], [a["speedup_median"]], marker="s", capsize=3, linestyle="none",
                        yerr=[[a["speedup_median"] - a["speedup_q25"]], [a["speedup_q75"] - a["speedup_median"]]],
                        label=f"chain (D={a['budget']})")
        if "auto" in agg and agg["auto"]["budget_mean"] is not None:
            a = agg["auto"]
            ax.errorbar([a["budget_mean"]], [a["speedup_median"]], marker="D", capsize=3, linestyle="none",
                        yerr=[[a["speedup_median"] - a["speedup_q25"]], [a["speedup_q75"] - a["speedup_median"]]],
                        label=f"auto (mean B={a['budget_mean']:.1f})")
        if "prompt_lookup" in agg:
            ax.axhline(agg["prompt_lookup"]["speedup_median"], linestyle=":", color="gray", label="prompt_lookup")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(suite)
        ax.set_xlabel("tree budget B (draft nodes)")
        ax.set_ylabel("speedup (x)")
        ax.legend(fontsize="small")
    path = out_dir / "speedup_vs_budget.png"
    fig.savefig(path, dpi=120)
    written.append(path)

    fig, axes = panels("Acceptance per depth (fraction of rounds whose accepted path reaches depth d)")
    for ax, suite in zip(axes, suites):
        agg = results["aggregates"].get(suite, {})
        for name, a in agg.items():
            acc = a["acceptance_per_depth"]
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {a['tau_mean']:.2f})")
        ax.set_title(suite)
        ax.set_xlabel("depth d")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize="small")
    path = out_dir / "acceptance_per_depth.png"
    fig.savefig(path, dpi=120)
    written.append(path)
    return written
