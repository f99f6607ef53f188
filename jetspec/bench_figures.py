"""The benchmark's figures: one method on one prompt ([`PromptRow`]), a method's aggregates over prompts, and where
its rounds spend their time ([`RoundPhases`], the round hook; [`phase_lines`], their table in `results.md`)
(`docs/design.md`, "§6 Measured costs"; `jetspec.bench` measures the rows, `jetspec.report` draws the rest of the
report)."""

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from modeling_jetspec import JetSpecStats, RoundRecord
from modeling_jetspec.round_hook import FORWARD_PHASES, PHASES

from .bench_methods import Method
from .equality import VERDICTS, Verdict


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
    phases: Optional[dict] = None  # seconds of each round phase over the call's rounds ([`RoundPhases`]), head methods
    # a conversation's second turn: the same method's row of turn 1 (`jetspec.bench_conversations`), None otherwise
    turn1: Optional["PromptRow"] = None

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
        if self.phases is not None:
            row["phase_seconds"] = dict(self.phases)
        if self.turn1 is not None:
            first = {k: v for k, v in self.turn1.as_dict().items() if k not in ("suite", "prompt_id", "method")}
            # turn 2's chat holds plain greedy's answer 1 whatever this method's was (a bf16 tie may change it)
            row["turn1"] = {**first, "answer_differs_from_plain": self.turn1.verdict.kind != "exact"}
        return row


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
        limit speedup. Rows of conversations' second turns add `turn1`: their first turns' prompts, tokens, median
        tokens/s and speedup, mean tau (head methods) and how many of the method's answers 1 differed from plain
        greedy's.
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
    firsts = [r.turn1 for r in rows if r.turn1 is not None]
    if firsts:  # conversations: the figures above are the second turns', these the first turns'
        result["turn1"] = {
            "prompts": len(firsts),
            "new_tokens": int(sum(r.new_tokens for r in firsts)),
            "tokens_per_s_median": float(np.median([r.tokens_per_s for r in firsts])),
            "speedup_median": float(np.median([r.speedup for r in firsts])),
            "tau_mean": float(np.mean([r.stats.tau for r in firsts])) if method.uses_head else None,
            "answers_differing_from_plain": sum(r.verdict.kind != "exact" for r in firsts),
        }
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
        **phase_figures(rows, costs),
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


# ------------------------------------------------------------------------------------------------ round phases
class RoundPhases:
    """A call's round hook (`jetspec_round_hook=RoundPhases()`, `modeling_jetspec/round_hook.py`): the seconds of
    each phase, summed over the call's rounds (`seconds`, `{phase: seconds}`), and the rounds seen."""

    def __init__(self):
        self.seconds, self.rounds = dict.fromkeys(PHASES, 0.0), 0

    def __call__(self, record: RoundRecord):
        self.rounds += 1
        for phase, seconds in record.phases.items():
            self.seconds[phase] += seconds


def phase_figures(rows: Sequence[PromptRow], costs: Optional[dict]) -> dict:
    """Where a method's rounds spent their time, over the rows that timed their phases: `phase_shares` (each
    phase's fraction of the rounds' time), `outside_forwards_seconds_per_round` (the rounds outside their head and
    target forwards, the `draft` and `verify` phases) and `outside_forwards_per_target_step` (the same over one
    target step t(1) of `costs`); `None` each where nothing was timed."""
    timed = [r for r in rows if r.phases is not None]
    whole = sum(sum(r.phases.values()) for r in timed)
    if not timed or whole <= 0.0:
        return dict.fromkeys(("phase_shares", "outside_forwards_seconds_per_round", "outside_forwards_per_target_step"))
    rounds = max(sum(r.stats.rounds for r in timed), 1)
    spent = {phase: sum(r.phases[phase] for r in timed) for phase in PHASES}
    outside = (whole - sum(spent[phase] for phase in FORWARD_PHASES)) / rounds
    return {
        "phase_shares": {phase: seconds / whole for phase, seconds in spent.items()},
        "outside_forwards_seconds_per_round": outside,
        "outside_forwards_per_target_step": outside / costs["target_step_seconds"] if costs is not None else None,
    }


def phase_lines(aggregates: dict) -> list[str]:
    """The round phases' table of `results.md`: per head method over every prompt, each phase's share of the
    rounds' time and the time outside the two forwards per round, in target steps t(1); `[]` when no method timed
    its phases."""
    groups = list(aggregates.values())
    every = aggregates.get("all", groups[0] if len(groups) == 1 else {})
    timed = {name: f for name, f in every.items() if f.get("phase_shares") is not None}
    if not timed:
        return []
    lines = [
        "",
        "## Round phases",
        "",
        "Share of the rounds' time in each phase, over every prompt (the round hook, `jetspec_round_hook`): draft "
        "(the head's forward), tree (building the trees), verify (the target's forward and its mask), accept, "
        "commit, compact. Outside: the round outside its two forwards (draft and verify), per round, in target "
        "steps t(1).",
        "",
        "| method | " + " | ".join(PHASES) + " | outside / t(1) | outside ms |",
        "| --- |" + " ---: |" * (len(PHASES) + 2),
    ]
    for name, f in timed.items():
        shares = " | ".join(f"{f['phase_shares'][phase]:.1%}" for phase in PHASES)
        step = f["outside_forwards_per_target_step"]
        lines.append(
            f"| {name} | {shares} | {'-' if step is None else f'{step:.3f}'} | "
            f"{f['outside_forwards_seconds_per_round'] * 1e3:.2f} |"
        )
    return lines


def turn1_lines(aggregates: dict) -> list[str]:
    """The first turns' tables of `results.md`, one per conversation suite: per method, the first turns' median
    speedup and tokens/s, mean tau and the answers 1 that differed from plain greedy's (the suite's own table holds
    the second turns'); `[]` when the run decoded no conversation."""
    lines = []
    for group, methods in aggregates.items():
        firsts = {name: f["turn1"] for name, f in methods.items() if "turn1" in f}
        if group == "all" or not firsts:
            continue
        lines += [
            "",
            f"## {group}: first turns",
            "",
            "Every method decodes a conversation's first turn before its second; the table of the suite gives the "
            "second turns (whose chat holds plain greedy's answer 1), this one the first turns.",
            "",
            "| method | prompts | speedup median | tok/s median | tau | answer 1 differs |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, f in firsts.items():
            tau = "-" if f["tau_mean"] is None else f"{f['tau_mean']:.2f}"
            lines.append(
                f"| {name} | {f['prompts']} | {f['speedup_median']:.2f}x | {f['tokens_per_s_median']:.1f} | {tau} | "
                f"{f['answers_differing_from_plain']} |"
            )
    return lines
