"""A tree budget chosen from measured costs and acceptance (the paper's "load-adaptive budget", left as future work;
`docs/design.md`, "§6 Measured costs").

Expected tokens per second at budget b is `tau(b) / (t(b) + r(b))`, with `t(b)` the target's verify forward over
b + 1 tokens at the current batch size, as timed in the call's own rounds at that budget, else as measured once per
(target, batch size) by `verifiers.measure_verify_seconds` (it times the round's own `draft` trees and `verify` on a
short random context), `r(b)` the rest of a round
at that budget (draft, tree building, accept, commit, compaction: work that grows with the tree), observed in the
call's own rounds, and `tau(b)` the mean committed tokens per round. Best-first trees are nested (the tree of budget b is the first b nodes of any larger
tree), so a round verified at budget B tells exactly how many tokens every budget b <= B would have committed: the
accepted path's nodes are numbered in pop order, and under budget b only the path's nodes numbered <= b survive.
"""

from collections import deque

DEFAULT_CANDIDATES = (8, 16, 32, 64)


def choose_budget(expected_tau: dict, verify_seconds: dict, outside_verify_seconds: float) -> int:
    """The budget maximising `expected_tau[b] / (verify_seconds[b] + outside_verify_seconds)` (ties: the smaller
    budget); `outside_verify_seconds` is the rest of a round, the same at every budget."""
    if not expected_tau:
        raise ValueError("expected at least one candidate budget with an acceptance estimate, got none")
    missing = [b for b in expected_tau if b not in verify_seconds]
    if missing:
        raise ValueError(f"expected a verify cost for every candidate budget, got none for {missing}")
    return max(sorted(expected_tau), key=lambda b: expected_tau[b] / (verify_seconds[b] + outside_verify_seconds))


def committed_under_budgets(accepted: list, budgets) -> dict:
    """Tokens a round would have committed at each budget, from its accepted node indices (root 0 first)."""
    return {b: 1 + sum(1 for node in accepted[1:] if node <= b) for b in budgets}


class BudgetController:
    """Picks each round's budget. The first two rounds verify the largest candidate (one such round informs every
    smaller budget exactly); then every `explore_every` rounds it verifies the candidate just above the current
    choice, and every `explore_every * climb_every` rounds the largest, so that estimates stay fresh while
    exploration costs little: on a CPU a verify of the largest tree costs several times the chosen one's."""

    def __init__(
        self, candidates, verify_seconds: dict, explore_every: int = 8, window: int = 64, climb_every: int = 4
    ):
        self.candidates = sorted(candidates)
        self.verify_seconds = verify_seconds
        self.explore_every = explore_every
        self.climb_every = climb_every
        self.observed = {b: deque(maxlen=window) for b in self.candidates}
        self.other_seconds = {b: deque(maxlen=window) for b in self.candidates}  # r(b): the round minus its verify
        self.verify_observed = {b: deque(maxlen=window) for b in self.candidates}  # t(b) in this call's rounds
        self.rounds = 0

    def next_budget(self) -> int:
        largest = self.candidates[-1]
        if self.rounds < 2 or self.rounds % (self.explore_every * self.climb_every) == 0:
            budget = largest
        else:
            tau = {b: sum(obs) / len(obs) for b, obs in self.observed.items() if obs}
            budget = choose_budget(tau, self.round_seconds(), 0.0)
            if self.rounds % self.explore_every == 0:  # one step up: informs the choice and the one above it
                budget = self.candidates[min(self.candidates.index(budget) + 1, len(self.candidates) - 1)]
        self.rounds += 1
        return budget

    def round_seconds(self) -> dict:
        """Expected seconds of a round per candidate: the verify `t(b)` (as timed in this call's rounds at `b`, else
        as measured up front) plus `r(b)`, the rest of the round as observed at `b`, else the nearest observed
        budget's scaled per tree node (the smaller of two equally near); the measured verify alone before any
        round."""
        verify = {b: sum(obs) / len(obs) if obs else self.verify_seconds[b] for b, obs in self.verify_observed.items()}
        seen = {b: sum(obs) / len(obs) for b, obs in self.other_seconds.items() if obs}
        if not seen:
            return verify
        nearest = {b: min(seen, key=lambda s: (abs(s - b), s)) for b in self.candidates}
        return {b: verify[b] + seen[nearest[b]] * b / nearest[b] for b in self.candidates}

    def update(
        self, accepted_per_row: list, used_budget: int, other_seconds: float, verify_seconds: float | None = None
    ):
        """Record one round at budget `used_budget`: accepted node indices per row (root first), the seconds the
        round spent outside its verify forward and, when given, in it."""
        self.other_seconds[used_budget].append(other_seconds)
        if verify_seconds is not None:
            self.verify_observed[used_budget].append(verify_seconds)
        usable = [b for b in self.candidates if b <= used_budget]
        for accepted in accepted_per_row:
            for b, tokens in committed_under_budgets(accepted, usable).items():
                self.observed[b].append(tokens)
