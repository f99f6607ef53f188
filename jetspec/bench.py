"""Benchmark of lossless tree decoding against plain greedy decoding (`docs/design.md`, "§6 Measured costs").

Every method decodes the same prompts with the same target, greedily, for the same `max_new_tokens`, in one
process. For each prompt every method runs once, in an order that rotates from prompt to prompt, so that slow
drifts of a shared machine fall on every method alike. Wall-clock time (`modeling_jetspec.timing.clock`, which
waits for the accelerator) spans the whole `generate` call, prefill included. The head's statistics (tau,
acceptance per depth, rounds) come from the `jetspec_stats` of each call's output.

Methods:

- `plain`: `target.generate` (the reference; always measured).
- `prompt_lookup`: `target.generate(..., prompt_lookup_num_tokens=10)`, transformers' n-gram drafter.
- `chain`: the head decoding a single chain (`tree_width=1`, `tree_depth=D`, `tree_budget=D`), the DFlash-style
  chain baseline. transformers' own `speculation_type="dflash"` is not run: it needs a head honouring the
  `muse_glimmer_assistant` contract (`noise_embeds`, `context_hidden_states`, ...), which the JetSpec head does not.
- `tree-B`: the head with a best-first tree of `B` draft nodes, one method per budget.
- `auto`: the head with `tree_budget="auto"`; `auto_lookup` (`auto-lookup`): the same with the lookup branch.
- `trie`: the tree with the trie of every earlier continuation (`tree_lookup_branches="trie"`, `tree-B-trie`).
- `path_conditioning`: the tree at the head's default budget with `path_conditioning=True` (`tree-B-pc`), next to
  `tree-B` without it.
- `lookup`: the tree with a prompt-lookup branch of L tokens (`tree_lookup=L`, the head's default, else the tree
  depth; `tree-B-lookup`), one method per budget: the head and transformers-style n-gram drafting in one verify
  forward. With the head's `tree_lookup_prior` the chain's tokens compete with the head's nodes at their measured
  odds.
- `lookup_first`: the same with `tree_lookup_prior=False` (`tree-B-lookup-first`): the whole chain first, whatever
  its odds (the ablation of the prior).

Equality (`docs/design.md`, "§4 Lossless: exactness and the bf16 tie rule"): every output is judged against plain
greedy's by [`jetspec.equality.check_lossless`]; in float32 it must be equal token for token, in bfloat16/float16
it may leave plain greedy at a numerical tie, and every emitted token of every method, plain greedy's included, is
judged on its own prefix through the float32 target (one teacher-forced forward per distinct output). Each prompt
is `exact` or `tie`; per method the tokens judged, the near-ties (not the float32 argmax, within the tolerance) and
the violations are reported; a mismatch or a violation raises [`LosslessError`] and fails the run.

Costs, measured once per run on the first prompt's prefilled cache (median of repeats):

- t(1): one target decode step, a forward of 1 token as plain decoding runs it;
- t(B): one verify forward over the root + B tree nodes under the tree-causal 4D mask, as tree decoding runs it
  (hidden states out, logits of every node);
- t_draft: one draft, the head's forward over the block `[anchor, MASK x D]` and its best-first tree (the round's
  own `draft`); the draft cost is c = t_draft / t(1);
- limit speedup tau * t(1) / (t(B) + t_draft): what the measured tau would give without any other overhead.

Speedup is the ratio of tokens/s to plain greedy on the same prompt. On a shared CPU only ratios hold. The
markdown report and the plots are drawn by `jetspec.report`.
"""

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from modeling_jetspec import JetSpecDraftModel, JetSpecGenerateOutput, JetSpecStats, resolve_tree_shape
from modeling_jetspec.compat import attn_implementation
from modeling_jetspec.configuration_jetspec import TREE_FIELDS
from modeling_jetspec.steps import draft, logits_to_keep
from modeling_jetspec.verifiers import verifier_for, verify_seconds
from modeling_jetspec.timing import clock, median_seconds, timed_rounds

from .equality import DEFAULT_TIE_TOLERANCE, VERDICTS, LosslessError, Verdict, check_lossless, strict_for
from .host import host_kind
from .prompts import check_suites, load_prompts
from .provenance import weights_identity
from .report import markdown, write_plots
from .targets import apply_chat_template

__all__ = ["BenchConfig", "LosslessError", "Method", "PromptRow", "aggregate", "build_methods", "run_benchmark"]


METHOD_KINDS = (
    "plain",
    "prompt_lookup",
    "chain",
    "tree",
    "auto",
    "path_conditioning",
    "lookup",
    "lookup_first",
    "gap",
    "lookup_gap",
    "trie",
    "auto_lookup",
)
DEFAULT_METHODS = METHOD_KINDS[:-2]  # the trie and auto with the lookup branch are asked for by name
PROMPT_LOOKUP_TOKENS = 10
REPO_ROOT = Path(__file__).resolve().parents[1]
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


# ------------------------------------------------------------------------------------------------ settings
def check_budgets(budgets: Sequence[int]) -> list[int]:
    """Validated list of tree budgets (integers >= 1, at least one, distinct)."""
    budgets = list(budgets)
    if not budgets:
        raise ValueError("expected at least one tree budget, got an empty list")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"expected tree budgets that are integers >= 1, got {bad}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"expected distinct tree budgets, got {budgets}")
    return budgets


def check_method_kinds(kinds: Sequence[str]) -> list[str]:
    """Validated method kinds: known, each once, `"plain"` among them (every output is checked against it)."""
    kinds = list(kinds)
    unknown = [k for k in kinds if k not in METHOD_KINDS]
    if unknown:
        raise ValueError(f"expected methods among {', '.join(METHOD_KINDS)}, got {', '.join(map(str, unknown))}")
    if "plain" not in kinds:
        raise ValueError(f"expected 'plain' among the methods (every output is checked against it), got {kinds}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"expected each method once, got {kinds}")
    return kinds


@dataclass
class BenchConfig:
    """What one benchmark run measures; validated on construction (bad values raise `ValueError`)."""

    suites: Sequence[str]  # prompt suites among `jetspec.prompts.SUITES`
    budgets: Sequence[int]  # tree budgets B; one `tree-B` method each (and one `tree-B-lookup`, ...)
    max_new_tokens: int = 256  # tokens generated per prompt (fewer when the target stops)
    limit: Optional[int] = 10  # the first `limit` prompts of each suite; None for all
    methods: Sequence[str] = DEFAULT_METHODS  # method kinds among METHOD_KINDS, "plain" included
    warmup: bool = True  # run every method once, untimed, on the first prompt (at most 8 new tokens)
    cost_repeats: int = 10  # timed repeats of each forward in `measure_costs`
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE  # float32 logit gap still called a tie (half precisions)

    def __post_init__(self):
        self.suites = check_suites(self.suites)
        self.budgets = check_budgets(self.budgets)
        self.methods = check_method_kinds(self.methods)
        for name in ("max_new_tokens", "cost_repeats") + (("limit",) if self.limit is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} to be an integer >= 1, got {value!r}")


@dataclass
class Method:
    name: str  # row label: "plain", "prompt_lookup", "chain", "tree-16", "auto", "tree-16-lookup", ...
    kind: str  # one of METHOD_KINDS
    generate_kwargs: dict = field(default_factory=dict)  # extra arguments of `target.generate`
    uses_head: bool = False
    budget: Optional[int] = None  # draft nodes per round, when fixed
    baseline: bool = False  # drafted by the run's baseline head (`name` ends in "@baseline") instead of its head


def with_baseline(plan: Sequence[Method]) -> list[Method]:
    """`plan` followed by a copy of each of its head methods drafted by the baseline head, named `<name>@baseline`,
    with the same `generate` arguments: two heads side by side in one process, on the same prompts and plain run."""
    copies = [dataclasses.replace(m, name=f"{m.name}@baseline", baseline=True) for m in plan if m.uses_head]
    return list(plan) + copies


def build_methods(
    kinds: Sequence[str],
    budgets: Sequence[int],
    chain_depth: int,
    default_budget: int = 32,
    lookup_tokens: Optional[int] = None,
) -> list[Method]:
    """The measured methods, in the order of `kinds`.

    `"tree"`, `"lookup"`, `"lookup_first"`, `"gap"` and `"lookup_gap"` expand to one method per budget (the `gap`
    kinds shape the tree with `tree_scoring="gap"`, see docs/design.md); `"path_conditioning"` is the tree at
    `default_budget`; the lookup branch holds `lookup_tokens` tokens, by default `chain_depth`. `chain`, `tree-B`,
    `auto` and `tree-B-pc` measure the head alone: they set `tree_lookup=0` whatever the head's default.
    """
    lookup_tokens = lookup_tokens or chain_depth
    per_budget = {  # kind -> (name suffix, arguments besides the budget)
        "tree": ("", {"tree_lookup": 0}),
        "lookup": ("-lookup", {"tree_lookup": lookup_tokens}),
        "lookup_first": ("-lookup-first", {"tree_lookup": lookup_tokens, "tree_lookup_prior": False}),
        "gap": ("-gap", {"tree_lookup": 0, "tree_scoring": "gap"}),
        "lookup_gap": ("-lookup-gap", {"tree_lookup": lookup_tokens, "tree_scoring": "gap"}),
        # every earlier continuation of the matched n-gram (continuations.py) instead of the latest one
        "trie": ("-trie", {"tree_lookup": lookup_tokens, "tree_lookup_branches": "trie"}),
    }
    chain = {"tree_depth": chain_depth, "tree_width": 1, "tree_budget": chain_depth, "tree_lookup": 0}
    single = {
        "plain": Method("plain", "plain"),
        "prompt_lookup": Method("prompt_lookup", "prompt_lookup", {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        "chain": Method("chain", "chain", chain, uses_head=True, budget=chain_depth),
        "auto": Method("auto", "auto", {"tree_budget": "auto", "tree_lookup": 0}, uses_head=True),
        "auto_lookup": Method(
            "auto-lookup", "auto_lookup", {"tree_budget": "auto", "tree_lookup": lookup_tokens}, uses_head=True
        ),
        "path_conditioning": Method(
            f"tree-{default_budget}-pc",
            "path_conditioning",
            {"tree_budget": default_budget, "path_conditioning": True, "tree_lookup": 0},
            uses_head=True,
            budget=default_budget,
        ),
    }
    methods = []
    for kind in check_method_kinds(kinds):
        if kind in single:
            methods.append(single[kind])
            continue
        suffix, extra = per_budget[kind]
        methods += [
            Method(f"tree-{b}{suffix}", kind, {"tree_budget": b, **extra}, uses_head=True, budget=b) for b in budgets
        ]
    return methods


def portable_name(name_or_path: Optional[str]) -> Optional[str]:
    """How `results.json` names a model: a Hub id as given, a local folder relative to the repository when inside
    it, else by its own name (never an absolute path, which would only hold on the machine that ran)."""
    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if not path.is_absolute() and not path.exists():
        return name_or_path  # a Hub id
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.resolve().name


# ------------------------------------------------------------------------------------------------ per-prompt rows
HEAD_FIELDS = (
    "tau",
    "acceptance_per_depth",
    "target_forwards",
    "rounds",
    "outside_verify_seconds",
    "verify_seconds",
    "operating_point",  # tree_budget="auto": the budget and sources chosen, and the figures behind them
)


@dataclass
class PromptRow:
    """One method on one prompt: an entry of `results.json`'s `prompts`."""

    suite: str
    prompt_id: str
    method: str  # `Method.name`
    prompt_tokens: int
    new_tokens: int
    seconds: float  # the whole `generate` call, prefill included
    speedup: float  # tokens/s over plain greedy's on the same prompt
    slot: int  # the method's place in this prompt's rotating order
    verdict: Verdict  # equality with plain greedy: `exact` or `tie`
    stats: Optional[JetSpecStats] = None  # the call's `jetspec_stats`, for methods that use the head

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def budget_mean(self) -> Optional[float]:
        """Mean tree budget verified per round, None without a head or without a verify round."""
        return float(np.mean(self.stats.budgets)) if self.stats is not None and self.stats.budgets else None

    def as_dict(self) -> dict:
        row = {
            "suite": self.suite,
            "prompt_id": self.prompt_id,
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "speedup": self.speedup,
            "slot": self.slot,
            "equality": self.verdict.kind,
        }
        if self.verdict.kind != "exact":
            row["tie"] = {k: v for k, v in self.verdict.as_dict().items() if k != "judged"}
        if self.verdict.judged is not None:
            row["judged"] = self.verdict.judged.as_dict()
        if self.stats is not None:
            figures = self.stats.as_dict()
            row.update({k: figures[k] for k in HEAD_FIELDS}, budget_mean=self.budget_mean)
        return row


@dataclass
class Bench:
    """The constants of one benchmark run: the models, the methods and the arguments every `generate` shares."""

    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    head: JetSpecDraftModel
    plan: list  # `Method`s, "plain" among them
    common: dict  # `generate` arguments of every method (greedy, max_new_tokens, pad id, return_dict_in_generate)
    float32_logits: Optional[Callable]  # the tie check's float32 reference, None for a float32 target
    tie_tolerance: float
    baseline_head: Optional[JetSpecDraftModel] = None  # drafts the `@baseline` methods

    def encode(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)`, each of shape `(1, L)`: the chat template already holds the special
        tokens, so none is added (the same encoding for every method)."""
        text = apply_chat_template(self.tokenizer, prompt)
        enc = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"].to(self.target.device), enc["attention_mask"].to(self.target.device)

    def generate(self, method: Method, input_ids, attention_mask, **overrides) -> tuple:
        """Runs one method on one prompt: `(new tokens of shape (n,), seconds, jetspec_stats or None)`."""
        kwargs = {**self.common, **method.generate_kwargs, **overrides}
        if method.uses_head:
            kwargs["assistant_model"] = self.baseline_head if method.baseline else self.head
        started = clock()
        with timed_rounds():  # the head's rounds are timed for its statistics
            out = self.target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        seconds = clock() - started
        if method.uses_head and not isinstance(out, JetSpecGenerateOutput):
            raise ValueError(f"expected a JetSpecGenerateOutput from method {method.name!r}, got {type(out).__name__}")
        stats = out.jetspec_stats if method.uses_head else None
        return out.sequences[0, input_ids.shape[1] :].cpu(), seconds, stats

    def measure_prompt(self, suite: str, prompt: dict, turn: int) -> list[PromptRow]:
        """Every method once on one prompt, in an order rotated by `turn`; each output judged against plain's."""
        input_ids, attention_mask = self.encode(prompt["prompt"])
        shift = turn % len(self.plan)
        order = self.plan[shift:] + self.plan[:shift]  # each method takes every slot in turn
        runs = {m.name: self.generate(m, input_ids, attention_mask) for m in order}
        reference, plain_seconds, _ = runs["plain"]
        rows, memo = [], {}  # memo: an output several methods share is teacher-forced once
        for method in self.plan:  # plain among them: in half precisions its own tokens are judged too
            tokens, seconds, stats = runs[method.name]
            verdict = check_lossless(
                input_ids[0].cpu(),
                reference,
                tokens,
                self.target.dtype,
                self.float32_logits,
                self.tie_tolerance,
                label=f"method {method.name!r} on {suite} prompt {prompt['id']!r}",
                memo=memo,
            )
            speedup = (len(tokens) / seconds) / (len(reference) / plain_seconds)
            rows.append(
                PromptRow(
                    suite,
                    prompt["id"],
                    method.name,
                    input_ids.shape[1],
                    len(tokens),
                    seconds,
                    speedup,
                    order.index(method),
                    verdict,
                    stats,
                )
            )
        return rows


# ------------------------------------------------------------------------------------------------ costs
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
    Draft cost c and verify costs t(B)/t(1) on the prefilled cache of one prompt, timing the round's own functions:
    [`draft`] and the verifier's [`verify`] as `generate` calls them (`modeling_jetspec/steps.py`, `verifiers.py`).

    Args:
        target (`PreTrainedModel`): the target, with sdpa or eager attention.
        head (`JetSpecDraftModel`): the draft head (tree depth, width and scoring from its config; no lookup branch).
        input_ids (`torch.LongTensor` of shape `(1, L)`): the prompt.
        budgets (`Sequence[int]`): tree budgets B to time.
        chain_depth (`int`): depth D of the chain baseline (a chain of D nodes is timed as well).
        repeats (`int`, *optional*, defaults to 10): timed repeats per call (after 2 untimed ones).

    Returns:
        `dict` with the seconds of a target step, a draft (head forward and best-first tree, at the smallest budget),
        each verify forward, and their ratios.
    """
    head.attach_target(target)
    verifier = verifier_for(target, head)
    state, _ = verifier.prefill(input_ids, None)
    past = input_ids.shape[1]
    # t(1): one decode step as plain greedy runs it (2D mask, last logits), the cache cropped back after each
    step_mask = torch.ones(1, past + 1, dtype=torch.long, device=target.device)

    def step():
        target(
            input_ids=state.anchors[:, None],
            attention_mask=step_mask,
            position_ids=state.anchor_pos[:, None],
            past_key_values=state.cache,
            use_cache=True,
            **logits_to_keep(target, 1),
        )
        state.cache.crop(-1)

    t_step = median_seconds(step, repeats=repeats, warmup=2)
    alone = dict(tree_lookup=0, path_conditioning=False)  # the head's own trees
    shape = resolve_tree_shape(head.config, tree_budget=min(budgets), **alone)
    t_draft = median_seconds(lambda: draft(head, state, shape, shape.budget), repeats=repeats, warmup=2)

    def verify_cost(tree_shape) -> dict:
        trees = draft(head, state, tree_shape, tree_shape.budget)
        seconds = verify_seconds(verifier, state, trees, repeats=repeats, warmup=2)
        return {"nodes": trees.tokens.shape[1], "seconds": seconds, "ratio_to_step": seconds / t_step}

    chain = resolve_tree_shape(head.config, tree_depth=chain_depth, tree_width=1, tree_budget=chain_depth, **alone)
    return {
        "prompt_tokens": past,
        "repeats": repeats,
        "tree_depth": shape.depth,
        "tree_width": shape.width,
        "target_step_seconds": t_step,
        "draft_forward_seconds": t_draft,
        "draft_cost_c": t_draft / t_step,
        "verify": {str(b): verify_cost(resolve_tree_shape(head.config, tree_budget=b, **alone)) for b in budgets},
        "chain": verify_cost(chain),
    }


def limit_speedup(tau: Optional[float], budget_costs: Optional[dict], costs: dict) -> Optional[float]:
    """tau * t(1) / (t(B) + t_draft), or `None` when tau or t(B) is unknown."""
    if tau is None or budget_costs is None:
        return None
    return tau * costs["target_step_seconds"] / (budget_costs["seconds"] + costs["draft_forward_seconds"])


# ------------------------------------------------------------------------------------------------ aggregates
def _quartiles(values: list) -> dict:
    q25, q50, q75 = np.percentile(values, [25, 50, 75])
    return {
        "median": float(q50),
        "q25": float(q25),
        "q75": float(q75),
        "iqr": float(q75 - q25),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def aggregate(rows: Sequence[PromptRow], method: Method, costs: Optional[dict]) -> dict:
    """
    Figures of one method over its per-prompt rows (one suite, or all).

    Args:
        rows (`Sequence[PromptRow]`): the method's rows, at least one.
        method (`Method`): the method they measured.
        costs (`dict`, *optional*): [`measure_costs`]'s result, for the limit speedup of head methods.

    Returns:
        `dict`: prompts, tokens and seconds, median tokens/s, speedup quartiles, equality counts, and for head
        methods the mean tau, budget and target forwards, mean acceptance per depth, seconds per round and the
        limit speedup.
    """
    speedup = _quartiles([r.speedup for r in rows])
    result = {
        "prompts": len(rows),
        "budget": method.budget,
        "new_tokens": int(sum(r.new_tokens for r in rows)),
        "seconds": float(sum(r.seconds for r in rows)),
        "tokens_per_s_median": float(np.median([r.tokens_per_s for r in rows])),
        **{f"speedup_{name}": value for name, value in speedup.items()},
        "equality": {kind: sum(r.verdict.kind == kind for r in rows) for kind in VERDICTS},
        "judged": judged_counts(rows),
    }
    if method.uses_head:
        result.update(_head_figures(rows, method, costs))
    return result


def judged_counts(rows: Sequence[PromptRow]) -> Optional[dict]:
    """Every emitted token judged on its own prefix (half precisions): `{"tokens", "near_ties", "violations"}`
    summed over the rows, `None` under the bitwise float32 rule (nothing is judged token by token there)."""
    judged = [r.verdict.judged for r in rows if r.verdict.judged is not None]
    if not judged:
        return None
    return {name: int(sum(getattr(j, name) for j in judged)) for name in ("tokens", "near_ties", "violations")}


def _head_figures(rows: Sequence[PromptRow], method: Method, costs: Optional[dict]) -> dict:
    """Means over prompts of the head's per-call statistics (each prompt weighs the same), seconds per round."""
    stats = [r.stats for r in rows]
    rounds = max(sum(s.rounds for s in stats), 1)
    depth = max(len(s.accepted_at_depth) for s in stats)
    # (prompts, N); a prompt decoded with a shallower tree accepted nothing deeper
    acceptance = np.array([s.acceptance_per_depth + [0.0] * (depth - len(s.accepted_at_depth)) for s in stats])
    budgets = [r.budget_mean for r in rows if r.budget_mean is not None]
    figures = {
        "budget_mean": float(np.mean(budgets)) if budgets else method.budget,
        "tau_mean": float(np.mean([s.tau for s in stats])),
        "acceptance_per_depth": acceptance.mean(0).tolist(),
        "target_forwards_mean": float(np.mean([s.target_forwards for s in stats])),
        "outside_verify_seconds_per_round": sum(s.outside_verify_seconds for s in stats) / rounds,
        "verify_seconds_per_round": sum(s.verify_seconds for s in stats) / rounds,
        "limit_speedup": None,
    }
    if costs is not None:
        budget_costs = costs["chain"] if method.kind == "chain" else costs["verify"].get(str(method.budget))
        figures["limit_speedup"] = limit_speedup(figures["tau_mean"], budget_costs, costs)
    return figures


def aggregate_groups(rows: Sequence[PromptRow], plan: Sequence[Method], suites: Sequence[str], costs) -> dict:
    """`{group: {method name: figures}}`: one group per suite, and `all` when there are several."""
    groups = {suite: [suite] for suite in suites}
    if len(suites) > 1:
        groups["all"] = list(suites)
    aggregates = {}
    for group, members in groups.items():
        aggregates[group] = {}
        for method in plan:
            mine = [r for r in rows if r.method == method.name and r.suite in members]
            if mine:
                aggregates[group][method.name] = aggregate(mine, method, costs)
    return aggregates


# ------------------------------------------------------------------------------------------------ environment
def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "host_kind": host_kind().name,  # e.g. "AVX-512 + AMX": which kernels this CPU runs (jetspec.host)
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
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
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
    config: BenchConfig,
    out_dir,
    float32_logits: Optional[Callable] = None,
    command: Optional[str] = None,
    dtype_reason: Optional[str] = None,
    progress: bool = True,
    baseline_head: Optional[JetSpecDraftModel] = None,
) -> dict:
    """
    Measures every method on the prompts of `config.suites` and writes `results.json`, `results.md` and plots.

    Args:
        target (`PreTrainedModel`): the target model, eval mode.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template.
        head (`JetSpecDraftModel`): the draft head; tree depth, width and lookup length come from its config.
        config ([`BenchConfig`]): suites, budgets, methods, lengths and repeats.
        out_dir (`str` or `os.PathLike`): output folder, created if missing.
        float32_logits (`Callable`, *optional*): the target's float32 next-token logits for a prefix (see
            `jetspec.equality.float32_logits_fn`), to judge divergences of a bfloat16/float16 target as ties.
            Required unless the target runs in float32, where any divergence fails.
        command (`str`, *optional*): the command line recorded in the results, defaults to `sys.argv`.
        dtype_reason (`str`, *optional*): why the target runs in its dtype, recorded in the results.
        progress (`bool`, *optional*, defaults to `True`): show a tqdm bar over the prompts.
        baseline_head (`JetSpecDraftModel`, *optional*): a second head for the same target (e.g. the committed one
            against a retrained one): every head method runs once more with it, as `<name>@baseline`. Its limit
            speedup uses the head's measured costs, which hold for a head of the same architecture.

    Returns:
        `dict`: the content of `results.json`.

    Raises:
        `LosslessError`: when a method's tokens differ from plain greedy's on any prompt (float32), or differ at a
        position that is not a numerical tie (bfloat16/float16). Nothing is written then.
    """
    if not strict_for(target.dtype) and float32_logits is None:
        raise ValueError(
            f"expected float32_logits (the tie check) for a {target.dtype} target, got None; only a float32 target "
            "is held to bitwise equality without it"
        )
    head.attach_target(target)
    if baseline_head is not None:
        baseline_head.attach_target(target)
    bench = _bench(target, tokenizer, head, config, float32_logits, baseline_head)
    prompts = [(suite, row) for suite in config.suites for row in load_prompts(suite, config.limit)]
    if not prompts:
        raise ValueError(f"expected prompts in suites {config.suites}, got none")
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    wall = time.perf_counter()
    first_ids, first_mask = bench.encode(prompts[0][1]["prompt"])
    if config.warmup:
        for method in bench.plan:
            bench.generate(method, first_ids, first_mask, max_new_tokens=min(8, config.max_new_tokens))
    costs = None
    if any(m.uses_head for m in bench.plan):
        costs = measure_costs(
            target, head, first_ids, config.budgets, head.config.tree_depth, repeats=config.cost_repeats
        )
    rows = _measure_prompts(bench, prompts, progress)
    results = {
        "started_at": started_at,
        "wall_seconds": time.perf_counter() - wall,
        "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine_info(),
        "versions": versions(),
        "config": _run_config(bench, config, dtype_reason),
        "notes": NOTES,
        "costs": costs,
        "aggregates": aggregate_groups(rows, bench.plan, config.suites, costs),
        "prompts": [row.as_dict() for row in rows],
    }
    write_results(results, out_dir)
    return results


def _bench(target, tokenizer, head, config: BenchConfig, float32_logits, baseline_head=None) -> Bench:
    """The run's constants; the lookup methods use the head's own chain length when it has one."""
    plan = build_methods(
        config.methods, config.budgets, head.config.tree_depth, head.config.tree_budget, head.config.tree_lookup
    )
    if baseline_head is not None:
        plan = with_baseline(plan)
    common = {"max_new_tokens": config.max_new_tokens, "do_sample": False, "return_dict_in_generate": True}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is not None:
        common["pad_token_id"] = pad
    return Bench(target, tokenizer, head, plan, common, float32_logits, config.tie_tolerance, baseline_head)


def _measure_prompts(bench: Bench, prompts: list, progress: bool) -> list[PromptRow]:
    rows = []
    with tqdm(prompts, desc="bench", unit="prompt", disable=not progress) as bar:
        for turn, (suite, prompt) in enumerate(bar):
            bar.set_postfix_str(f"{suite} {prompt['id']}")
            rows += bench.measure_prompt(suite, prompt, turn)
    return rows


def _run_config(bench: Bench, config: BenchConfig, dtype_reason: Optional[str]) -> dict:
    """The settings `results.json` records: models (by portable names), dtype, equality rule, methods."""
    target, head = bench.target, bench.head
    strict = strict_for(target.dtype)
    return {
        "target": portable_name(target.name_or_path),
        "target_dtype": str(target.dtype),
        "dtype_reason": dtype_reason,
        "equality": "bitwise (float32)" if strict else f"tie-aware, tolerance {config.tie_tolerance} float32 logits",
        "attn_implementation": attn_implementation(target),
        "head": portable_name(head.name_or_path),
        "baseline_head": portable_name(bench.baseline_head.name_or_path) if bench.baseline_head is not None else None,
        # the weights behind those names (a shipped folder's contents change with the next ship)
        "head_identity": weights_identity(head.name_or_path),
        "baseline_head_identity": weights_identity(bench.baseline_head.name_or_path)
        if bench.baseline_head is not None
        else None,
        "head_config": {k: getattr(head.config, k) for k in RECORDED_HEAD_CONFIG},
        # whether each head ranked its tree through a calibration map of its config (a shipped head carries one)
        "head_calibration_map": bool(head.config.tree_calibration),
        "baseline_head_calibration_map": bool(bench.baseline_head.config.tree_calibration)
        if bench.baseline_head is not None
        else None,
        "suites": config.suites,
        "budgets": config.budgets,
        "max_new_tokens": config.max_new_tokens,
        "limit": config.limit,
        "methods": [m.name for m in bench.plan],
        "method_arguments": {m.name: dict(m.generate_kwargs) for m in bench.plan},
        "chain_depth": head.config.tree_depth,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "greedy": True,
        "warmup": config.warmup,
        "order": "rotating per prompt",
    }


RECORDED_HEAD_CONFIG = (
    "num_hidden_layers",
    "block_size",
    "block_attention",
    "target_layer_ids",
    *TREE_FIELDS,
    "draft_vocab_size",
    "last_context_input",
)


def write_results(results: dict, out_dir) -> list[Path]:
    """Writes the plots, `results.json` (with the plots' names) and `results.md` to `out_dir`; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out_dir)
    results["plots"] = [p.name for p in plots]
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown(results))
    return [out_dir / "results.json", out_dir / "results.md", *plots]
