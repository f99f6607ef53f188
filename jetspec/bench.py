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
- `auto`: the head with `tree_budget="auto"`: the budget and the draft sources chosen from the head's `tau_by_budget`
  and this host's measured costs (`modeling_jetspec/budget.py`), recorded per prompt as `operating_point`.
- `trie`: the tree with the trie of every earlier continuation (`tree_lookup_branches="trie"`, `tree-B-trie`).
- `path_conditioning`: the tree at the head's default budget with `path_conditioning=True` (`tree-B-pc`), next to
  `tree-B` without it. A head whose default is `tree_budget="auto"` runs it at the largest of the run's budgets
  instead ([`path_conditioning_budget`]): path conditioning needs a fixed budget (its trees are not nested).
- `lookup`: the tree with a prompt-lookup branch of L tokens (`tree_lookup=L`, the head's default, else the tree
  depth; `tree-B-lookup`), one method per budget: the head and transformers-style n-gram drafting in one verify
  forward. With the head's `tree_lookup_prior` the chain's tokens compete with the head's nodes at their measured
  odds.
- `lookup_first`: the same with `tree_lookup_prior=False` (`tree-B-lookup-first`): the whole chain first, whatever
  its odds (the ablation of the prior).
- `answers`: the head's defaults with an answer cache (`modeling_jetspec.AnswerCache`) shared across the run's
  prompts: each prompt drafts also from the answers of the prompts before it (`jetspec_answer_cache`).

Conversations (`--suite mtbench_turn2`, `jetspec.prompts.CONVERSATIONS`, `jetspec.bench_conversations`): each
MT-Bench conversation is decoded as MT-Bench runs it. Every method decodes turn 1 (the user's first turn), then turn 2,
the chat of [user turn 1, answer 1, user turn 2]; answer 1 is plain greedy's for every method, so every method's turn
2 decodes the same prompt. A method decodes its own turn 1, so the `answers` cache holds answer 1 when turn 2 is
drafted. The suite's figures (time, tokens/s, speedup, tau, equality) are turn 2's; each row holds its turn 1's as
`turn1` (with whether the method's own answer 1 differed from plain's, a bf16 tie), and `results.md` tables them.

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

Round phases: every head method's call runs with the round hook (`jetspec_round_hook`,
`modeling_jetspec/round_hook.py`), which times each round's draft (the head's forward), tree, verify (the target's
forward), accept, commit and compact phases; per method, each phase's share of the rounds' time and the time outside
the two forwards per round, over t(1) (`jetspec.bench_figures.phase_figures`).

Speedup is the ratio of tokens/s to plain greedy on the same prompt. On a shared CPU only ratios hold.

The rooms: this module runs the benchmark (the prompts, the methods' calls, the costs, `results.json`);
`jetspec.bench_methods` holds its settings (which methods, with which arguments); `jetspec.bench_figures` the
per-prompt rows and their aggregates; `jetspec.bench_conversations` the chats of conversations' second turns;
`jetspec.report` draws the markdown report and the plots.
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

from modeling_jetspec import AnswerCache, JetSpecDraftModel, JetSpecGenerateOutput, resolve_tree_shape
from modeling_jetspec.compat import attn_implementation
from modeling_jetspec.configuration_jetspec import TREE_FIELDS
from modeling_jetspec.steps import draft, logits_to_keep
from modeling_jetspec.verifiers import verifier_for, verify_seconds
from modeling_jetspec.timing import clock, median_seconds

from .bench_figures import (
    PromptRow,
    RoundPhases,
    aggregate,
    aggregate_groups,
    judged_counts,
    limit_speedup,
    phase_figures,
    phase_lines,
    turn1_lines,
)
from .bench_methods import (
    DEFAULT_METHODS,
    METHOD_KINDS,
    PROMPT_LOOKUP_TOKENS,
    BenchConfig,
    Method,
    build_methods,
    check_budgets,
    check_method_kinds,
    with_baseline,
)
from .bench_conversations import answer_text, conversation_turns, first_prompt, second_turn_chat
from .equality import LosslessError, check_lossless, strict_for
from .host import host_kind
from .prompts import CONVERSATIONS, load_suite
from .provenance import weights_identity
from .report import markdown, write_plots
from .targets import apply_chat_template

__all__ = [
    "DEFAULT_METHODS",
    "METHOD_KINDS",
    "BenchConfig",
    "LosslessError",
    "Method",
    "PromptRow",
    "aggregate",
    "aggregate_groups",
    "build_methods",
    "check_budgets",
    "check_method_kinds",
    "judged_counts",
    "limit_speedup",
    "phase_figures",
    "measure_costs",
    "path_conditioning_budget",
    "portable_name",
    "run_benchmark",
    "with_baseline",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTES = {
    "chain": (
        "The JetSpec head decoding a single chain (tree_width=1, tree_depth=D, tree_budget=D): the DFlash-style "
        "chain baseline. transformers' own speculation_type='dflash' is not measured: it needs a head honouring "
        "the muse_glimmer_assistant contract (noise_embeds, context_hidden_states, position_ids, attention_mask, "
        "cache), which the JetSpec head does not."
    ),
    "conversations": (
        "mtbench_turn2: every figure is the second turn's, decoded on the chat of [user turn 1, plain greedy's "
        "answer 1, user turn 2] after the same method decoded turn 1; turn 1's figures are each row's turn1."
    ),
    "speedup": "tokens/s of the method over tokens/s of plain greedy on the same prompt; prefill included.",
    "limit_speedup": "tau * t(1) / (t(B) + t_draft), with the costs below; ignores prefill and host overheads.",
    "costs": (
        "t(1): target forward of 1 token on the prefilled cache (as plain decoding); t(B): target forward of root "
        "+ B tree nodes under a 4D tree mask on the same cache, hidden states and all logits out (as tree "
        "verification); t_draft: one head forward over [anchor, MASK x D]; medians of repeats."
    ),
}


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
    answer_caches: dict = field(default_factory=dict)  # `answers` method name -> the cache its prompts share

    def encode(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)`, each of shape `(1, L)`, of one user turn under the chat template."""
        return self.tokenize(apply_chat_template(self.tokenizer, prompt))

    def tokenize(self, chat: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)`, each of shape `(1, L)`, of a chat text: the chat template already holds the
        special tokens, so none is added (the same encoding for every method)."""
        enc = self.tokenizer(chat, return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"].to(self.target.device), enc["attention_mask"].to(self.target.device)

    def generate(self, method: Method, input_ids, attention_mask, **overrides) -> tuple:
        """Runs one method on one prompt: `(new tokens of shape (n,), seconds, jetspec_stats or None, seconds per
        round phase or None)`. A head method's rounds are timed by the round hook ([`RoundPhases`]), which also
        fills the statistics' verify and outside-verify seconds."""
        kwargs = {**self.common, **method.generate_kwargs, **overrides}
        phases = RoundPhases() if method.uses_head else None
        if method.uses_head:
            kwargs["assistant_model"] = self.baseline_head if method.baseline else self.head
            kwargs["jetspec_round_hook"] = phases
        if method.kind == "answers":
            kwargs["jetspec_answer_cache"] = self.answer_caches.setdefault(method.name, AnswerCache())
        started = clock()
        out = self.target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        seconds = clock() - started
        if method.uses_head and not isinstance(out, JetSpecGenerateOutput):
            raise ValueError(f"expected a JetSpecGenerateOutput from method {method.name!r}, got {type(out).__name__}")
        stats = out.jetspec_stats if method.uses_head else None
        return out.sequences[0, input_ids.shape[1] :].cpu(), seconds, stats, None if phases is None else phases.seconds

    def run_methods(self, input_ids, attention_mask, rotation: int) -> tuple[list, dict]:
        """Every method once on one prompt, in the plan's order rotated by `rotation` (each method takes every slot
        in turn): `(order, {method name: [`generate`]'s result})`."""
        shift = rotation % len(self.plan)
        order = self.plan[shift:] + self.plan[:shift]
        return order, {m.name: self.generate(m, input_ids, attention_mask) for m in order}

    def judge(self, suite: str, prompt_id, input_ids, order: list, runs: dict, label: str = "") -> list[PromptRow]:
        """The rows of one prompt's runs ([`run_methods`]), in the plan's order: each output judged against plain's
        (`label` opens the name a failure gives the prompt, e.g. `"turn 1 of "`)."""
        reference, plain_seconds, _, _ = runs["plain"]
        rows, memo = [], {}  # memo: an output several methods share is teacher-forced once
        for method in self.plan:  # plain among them: in half precisions its own tokens are judged too
            tokens, seconds, stats, phases = runs[method.name]
            verdict = check_lossless(
                input_ids[0].cpu(),
                reference,
                tokens,
                self.target.dtype,
                self.float32_logits,
                self.tie_tolerance,
                label=f"method {method.name!r} on {label}{suite} prompt {prompt_id!r}",
                memo=memo,
            )
            speedup = (len(tokens) / seconds) / (len(reference) / plain_seconds)
            slot = order.index(method)
            rows.append(
                PromptRow(
                    suite,
                    prompt_id,
                    method.name,
                    input_ids.shape[1],
                    len(tokens),
                    seconds,
                    speedup,
                    slot,
                    verdict,
                    stats,
                    phases,
                )
            )
        return rows

    def measure_prompt(self, suite: str, prompt: dict, rotation: int) -> list[PromptRow]:
        """Every method once on one prompt, in an order rotated by `rotation`; each output judged against plain's."""
        input_ids, attention_mask = self.encode(prompt["prompt"])
        order, runs = self.run_methods(input_ids, attention_mask, rotation)
        return self.judge(suite, prompt["id"], input_ids, order, runs)

    def measure_conversation(self, suite: str, conversation: dict, rotation: int) -> list[PromptRow]:
        """Both turns of one conversation (`jetspec.bench_conversations`), every method decoding each, in an order
        rotated by `turn`: turn 2's rows, each holding its method's turn-1 row (`PromptRow.turn1`). Turn 2's chat
        holds plain greedy's answer 1 for every method."""
        first, second = conversation_turns(conversation)
        input_ids, attention_mask = self.encode(first)
        order, runs = self.run_methods(input_ids, attention_mask, rotation)
        firsts = self.judge(suite, conversation["id"], input_ids, order, runs, label="turn 1 of ")
        answer = answer_text(self.tokenizer, runs["plain"][0])
        input_ids, attention_mask = self.tokenize(second_turn_chat(self.tokenizer, first, answer, second))
        order, runs = self.run_methods(input_ids, attention_mask, rotation)
        rows = self.judge(suite, conversation["id"], input_ids, order, runs, label="turn 2 of ")
        return [dataclasses.replace(row, turn1=first_row) for row, first_row in zip(rows, firsts)]


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
    prompts = [(suite, row) for suite in config.suites for row in load_suite(suite, config.limit)]
    if not prompts:
        raise ValueError(f"expected prompts in suites {config.suites}, got none")
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    wall = time.perf_counter()
    first_ids, first_mask = bench.encode(first_prompt(prompts[0][1]))
    if config.warmup:
        for method in bench.plan:
            bench.generate(method, first_ids, first_mask, max_new_tokens=min(8, config.max_new_tokens))
        bench.answer_caches.clear()  # the measured prompts start from an empty answer cache
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
        config.methods,
        config.budgets,
        head.config.tree_depth,
        path_conditioning_budget(head.config.tree_budget, config.budgets),
        head.config.tree_lookup,
    )
    if baseline_head is not None:
        plan = with_baseline(plan)
    common = {"max_new_tokens": config.max_new_tokens, "do_sample": False, "return_dict_in_generate": True}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is not None:
        common["pad_token_id"] = pad
    return Bench(target, tokenizer, head, plan, common, float32_logits, config.tie_tolerance, baseline_head)


def path_conditioning_budget(default, budgets) -> int:
    """The budget of the `path_conditioning` method: the head's default `tree_budget`, or, where the default is
    `"auto"` (a point chosen per call, which path conditioning refuses: its trees are not nested), the largest of the
    run's `budgets`."""
    return max(budgets) if default == "auto" else default


def _measure_prompts(bench: Bench, prompts: list, progress: bool) -> list[PromptRow]:
    rows = []
    with tqdm(prompts, desc="bench", unit="prompt", disable=not progress) as bar:
        for rotation, (suite, prompt) in enumerate(bar):
            bar.set_postfix_str(f"{suite} {prompt['id']}")
            measure = bench.measure_conversation if suite in CONVERSATIONS else bench.measure_prompt
            rows += measure(suite, prompt, rotation)
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
    (out_dir / "results.md").write_text(
        markdown(results)
        + "".join(f"{line}\n" for line in phase_lines(results["aggregates"]) + turn1_lines(results["aggregates"]))
    )
    return [out_dir / "results.json", out_dir / "results.md", *plots]
