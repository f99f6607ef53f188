"""The operating point of a `tree_budget="auto"` call: one budget and one set of draft sources, chosen before the
rounds from the head's acceptance and this host's costs (the paper's "load-adaptive budget", left as future work;
`docs/design.md`, "§6 Measured costs").

The expected speed of a point, over plain greedy decoding, is

    tau(B, sources) / (t(B) / t(1) + c(sources))

with `tau(B, sources)` the head's committed tokens per round at budget B with those sources (the config field
`tau_by_budget`, measured offline by `training/tau_table.py`), `t(B) / t(1)` the target's verify forward over a tree
of B nodes over one plain decode step, and `c(sources)` the rest of a round (the head's draft, the tree, accept,
commit, compaction) in plain decode steps; both measured on this host for this target, dtype and batch size
(`host_costs.py`). [`choose_point`] takes the largest. A head without `tau_by_budget` keeps the fixed default:
budget [`FALLBACK_BUDGET`] with its own sources.

The sources ([`SOURCES`]): the head alone; the head and the prompt-lookup chain (`tree_lookup_branches="chain"`); the
head, lookup and the trie of every earlier continuation (`tree_lookup_branches="trie"`). This module only chooses:
decoding at the chosen point is decoding at that fixed budget and those sources, so it stays lossless.
"""

import math
from dataclasses import dataclass, field, replace

from .state import TreeShape
from .tree import max_tree_nodes

CANDIDATE_BUDGETS = (4, 6, 8, 10, 12, 16)
DEFAULT_CANDIDATES = CANDIDATE_BUDGETS  # the largest bounds a call's memory check (`integration.check_tree_bounds`)
FALLBACK_BUDGET = 8  # a head without `tau_by_budget`: the shipped default
SOURCES = ("head", "head+lookup", "head+lookup+trie")
LOOKUP_TOKENS = 16  # the lookup branch's length when the head's own config has none


@dataclass
class OperatingPoint:
    """The point a call decodes at, and the figures it was chosen from (`JetSpecStats.operating_point`).

    Args:
        budget (`int`): draft nodes per tree.
        sources (`str`): one of [`SOURCES`].
        expected_speedup (`float`, *optional*): `tau / (t(B) / t(1) + c)` at the point; `None` for the fallback.
        reason (`str`): `"chosen"`, or why the fallback was taken.
        figures (`dict`): per candidate `"<sources>@<budget>"`, its `tau`, `verify_ratio`, `overhead` and
            `expected_speedup`; `{}` for the fallback.
        host_costs (`str`, *optional*): the key the host costs are cached under (`host_costs.costs_key`: the host,
            threads, target, dtype, batch size); `None` for the fallback.
    """

    budget: int
    sources: str
    expected_speedup: float | None = None
    reason: str = "chosen"
    figures: dict = field(default_factory=dict)
    host_costs: str | None = None

    def as_dict(self) -> dict:
        return {
            "budget": self.budget,
            "sources": self.sources,
            "expected_speedup": self.expected_speedup,
            "reason": self.reason,
            "figures": self.figures,
            "host_costs": self.host_costs,
        }


def check_tau_by_budget(table) -> dict:
    """`tau_by_budget` (`{sources: {budget: tau}}`, budgets among [`CANDIDATE_BUDGETS`] as ints or their strings, as
    JSON keeps them) with int budgets; a `ValueError` naming what was expected and what was found otherwise. `None`
    stays `None`."""
    if table is None:
        return None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"expected tau_by_budget to be a non-empty dict {{sources: {{budget: tau}}}}, got {table!r}")
    out = {}
    for sources, by_budget in table.items():
        if sources not in SOURCES:
            raise ValueError(f"expected tau_by_budget's sources among {SOURCES}, got {sources!r}")
        if not isinstance(by_budget, dict) or not by_budget:
            raise ValueError(
                f"expected tau_by_budget[{sources!r}] to be a non-empty dict {{budget: tau}}, got {by_budget!r}"
            )
        out[sources] = {}
        for budget, tau in by_budget.items():
            number = int(budget) if isinstance(budget, str) and budget.isdigit() else budget
            if number not in CANDIDATE_BUDGETS or isinstance(number, bool):
                raise ValueError(
                    f"expected tau_by_budget budgets among {CANDIDATE_BUDGETS} (the budgets auto weighs), got "
                    f"{budget!r} ({sources})"
                )
            if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not math.isfinite(tau) or tau < 1:
                raise ValueError(
                    f"expected tau_by_budget[{sources!r}][{budget!r}] to be a number >= 1 (committed tokens per "
                    f"round, the bonus included), got {tau!r}"
                )
            out[sources][number] = float(tau)
    return out


def sources_shape(shape: TreeShape, sources: str, budget: int) -> TreeShape:
    """`shape` at `budget` with `sources`: lookup off for the head alone; else the shape's lookup length (or
    [`LOOKUP_TOKENS`]) as a chain or a trie. The lookup prior, record (where it has a prior) and calibration stay
    the shape's."""
    if sources not in SOURCES:
        raise ValueError(f"expected sources among {SOURCES}, got {sources!r}")
    if sources == "head":
        return replace(shape, budget=budget, lookup=0)
    branches = "trie" if sources == "head+lookup+trie" else "chain"
    record = shape.lookup_record and shape.lookup_prior is not None  # a record mixes a prior: none, no record
    lookup = shape.lookup or LOOKUP_TOKENS
    return replace(shape, budget=budget, lookup=lookup, lookup_branches=branches, lookup_record=record)


def candidates(table: dict, shape: TreeShape) -> dict:
    """`{sources: [budgets]}` the chooser weighs: the table's budgets among [`CANDIDATE_BUDGETS`] that a tree of
    `shape` can hold (the head's full tree, plus the lookup branch when it runs)."""
    full = max_tree_nodes(shape.depth, shape.width)
    out = {}
    for sources, by_budget in table.items():
        largest = full + (0 if sources == "head" else shape.lookup or LOOKUP_TOKENS)
        budgets = sorted(b for b in by_budget if b in CANDIDATE_BUDGETS and b <= largest)
        if budgets:
            out[sources] = budgets
    return out


def choose_point(table: dict, verify_ratio: dict, overhead: dict, shape: TreeShape) -> OperatingPoint:
    """The candidate of [`candidates`] with the highest `table[s][b] / (verify_ratio[b] + overhead[s])` (ties: the
    smaller budget, then the fewer sources), with every candidate's figures.

    Args:
        table (`dict`): `{sources: {budget: tau}}`, as [`check_tau_by_budget`] returns it.
        verify_ratio (`dict`): `{budget: t(B) / t(1)}`.
        overhead (`dict`): `{sources: c}`, the rest of a round in plain decode steps.
        shape (`TreeShape`): the call's tree (its depth and width bound the budgets).
    """
    weighed = candidates(table, shape)
    if not weighed:
        given = {s: sorted(b) for s, b in table.items()}
        raise ValueError(
            f"expected tau_by_budget budgets among {CANDIDATE_BUDGETS} that the tree can hold (depth {shape.depth}, "
            f"width {shape.width}), got {given}"
        )
    figures, best = {}, None
    for b in sorted({b for budgets in weighed.values() for b in budgets}):
        for sources in SOURCES:
            if b not in weighed.get(sources, ()):
                continue
            if b not in verify_ratio or sources not in overhead:
                raise ValueError(f"expected host costs for budget {b} and sources {sources!r}, got none")
            speed = table[sources][b] / (verify_ratio[b] + overhead[sources])
            figures[f"{sources}@{b}"] = {
                "tau": table[sources][b],
                "verify_ratio": verify_ratio[b],
                "overhead": overhead[sources],
                "expected_speedup": speed,
            }
            if best is None or speed > best.expected_speedup:
                best = OperatingPoint(b, sources, speed)
    best.figures = figures
    return best


def fallback_point(shape: TreeShape) -> OperatingPoint:
    """The point of a head without `tau_by_budget`: [`FALLBACK_BUDGET`] with the shape's own sources."""
    if not shape.lookup:
        sources = "head"
    else:
        sources = "head+lookup+trie" if shape.lookup_branches == "trie" else "head+lookup"
    return OperatingPoint(FALLBACK_BUDGET, sources, None, "fallback: no tau_by_budget")
