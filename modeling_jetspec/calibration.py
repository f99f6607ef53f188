"""Calibrated node scores: what a draft node's conditional probability says about its acceptance.

The tree ranks nodes best-first by their cumulative log-prob (`tree.build_tree`). A node's conditional log-prob
comes from the head's block (`tree.marginal_children`), from the model-free branch (`continuations.trie_children`:
the lookup prior, or 0 for the first continuation), or from both when they propose the same token
(`continuations.merge_children` keeps the higher). The two scales are not the same thing: a head probability of 0.6
at depth 3 and a trie count share of 0.6 are accepted at different rates, and neither is accepted at 0.6.

A calibration maps, per depth and per source ("head", "lookup", "both", "answers": see [`node_source`]), a node's conditional draft probability
(binned into 10 bins of width 0.1) to the acceptance rate measured offline on held-out rows
(`python -m training.evaluate_head --fit_calibration`): a monotone (isotonic) fit per (depth, source). The tree then
ranks nodes by the log of their calibrated acceptance instead of their raw score. Scores choose which nodes enter
the tree, never which tokens are committed: decoding stays lossless whatever the map says.

In a head's config the map is `tree_calibration`: `{"<depth>:<source>": [10 acceptance rates]}`; a (depth, source)
the map does not name keeps its raw score, except an "answers" node (earlier calls' answers, `answer_cache.py`), mapped as a
"lookup" node of its depth until the map names "answers".

[`node_source`] is the one rule for who proposed a token; the round applies it again to what it commits
([`committed_sources`], `JetSpecStats.token_sources`), so the calibration's sources, `jetspec generate
--show-drafts` and the serve statistics name a token's source alike. "lookup" is the model-free branch in either
form (`tree_lookup_branches`: the prompt-lookup chain, or the trie of every earlier continuation); a committed token
the target chose itself, the round's bonus token or the prefill's, is "target".
"""

import math

SOURCES = ("head", "lookup", "both", "answers")
TOKEN_SOURCES = SOURCES + ("target",)  # a committed token's source (`JetSpecStats.token_sources`)
BINS = 10
FLOOR = 1e-6  # the smallest calibrated probability (a measured acceptance of 0 still ranks, last)


def check_calibration(table) -> dict | None:
    """A config's `tree_calibration` checked: the table itself (`{"<depth>:<source>": [BINS rates]}`, the form
    [`calibrated_logprob`] reads), or None for none; a `ValueError` (expected, got) for anything else."""
    if table is None or table == {}:
        return None
    if not isinstance(table, dict):
        raise ValueError(f"expected tree_calibration as a dict {{'<depth>:<source>': [{BINS} rates]}}, got {table!r}")
    for key, rates in table.items():
        depth, _, source = str(key).partition(":")
        if not depth.isdigit() or int(depth) < 1 or source not in SOURCES:
            raise ValueError(f"expected tree_calibration keys '<depth >= 1>:<one of {SOURCES}>', got {key!r}")
        if (
            not isinstance(rates, (list, tuple))
            or len(rates) != BINS
            or not all(isinstance(r, (int, float)) and 0.0 <= r <= 1.0 for r in rates)
        ):
            raise ValueError(f"expected {BINS} acceptance rates in [0, 1] for tree_calibration[{key!r}], got {rates!r}")
    return table


def node_source(head_tokens, trie: dict | None, path: tuple, token: int, answers: dict | None = None) -> str:
    """Who proposed `token` after `path`: "head" (among the head's candidates at that depth, `head_tokens[len(path)]`),
    "lookup" (a child of `path` in the model-free branch's `trie`), "both", or "answers" (a child of `path` in the
    answer cache's trie `answers`, `answer_cache.py`, and proposed by neither of the others). The row's own arguments
    come first, so `functools.partial(node_source, head_tokens, trie)` is the row's `(path, token) -> source`."""
    depth = len(path)
    by_head = head_tokens is not None and depth < len(head_tokens) and token in head_tokens[depth]
    counts = trie.get(tuple(path)) if trie else None
    by_lookup = bool(counts) and token in counts
    if by_head and by_lookup:
        return "both"
    if not by_head and not by_lookup and answers and token in answers.get(tuple(path), ()):
        return "answers"
    return "lookup" if by_lookup else "head"


def committed_sources(head_tokens, trie: dict | None, tokens: list, answers: dict | None = None) -> list:
    """The source of each of a round's committed `tokens` (the accepted path, then the target's bonus token):
    [`node_source`] of every accepted draft token after the path before it, "target" for the last one.

    Args:
        head_tokens (`list`, *optional*): the row's top-W target tokens of the head per depth
            (`DraftTrees.head_tokens`); None: the head's drafts are not at hand, a draft token is the head's unless
            the branch proposed it.
        trie (`dict`, *optional*): the row's model-free branch (`DraftTrees.branches`); None: no branch.
        tokens (`list[int]`): what the round commits for the row, at least its bonus token.
        answers (`dict`, *optional*): the row's answer-cache trie (`DraftTrees.answers`); None: no cache.
    """
    path = tokens[:-1]
    sources = [node_source(head_tokens, trie, tuple(path[:d]), token, answers) for d, token in enumerate(path)]
    return sources + ["target"]


def probability_bin(probability: float) -> int:
    """The bin of a conditional draft probability: [0, 0.1) -> 0, ..., [0.9, 1] -> 9."""
    return min(max(int(probability * BINS), 0), BINS - 1)


def calibrated_logprob(table: dict, depth: int, source: str, logprob: float) -> float:
    """A node's score under `table` (a config's `tree_calibration`): the log of the measured acceptance of its bin, or
    its own `logprob` where the table has no entry for (depth, source)."""
    rates = table.get(f"{depth}:{source}")
    if rates is None and source == "answers":  # scored by the lookup prior as the trie is: its map until one is fitted
        rates = table.get(f"{depth}:lookup")
    if rates is None:
        return logprob
    return math.log(max(rates[probability_bin(math.exp(min(logprob, 0.0)))], FLOOR))


def calibrated_children(children, table: dict, source_of):
    """`children` (a tree's children function) with every child's log-prob calibrated and the list sorted again
    (best-first expansion reads it in order; a stable sort keeps ties in their order).

    Args:
        source_of (`Callable`): `(path, token) -> source` for a child of `path`.
    """

    def calibrated(path):
        found = children(path)
        if found is None:
            return None
        lps, tokens, entropy = found
        depth = len(path) + 1
        scored = [
            (calibrated_logprob(table, depth, source_of(path, int(t)), float(lp)), int(t)) for lp, t in zip(lps, tokens)
        ]
        scored.sort(key=lambda item: -item[0])
        return [lp for lp, _ in scored], [t for _, t in scored], entropy

    return calibrated


def to_config(fitted: list, min_trials: int = 0) -> dict:
    """A config's `tree_calibration` from the evaluator's calibration table (rows with `depth`, `source`, `bin`,
    `trials`, `fitted`): per (depth, source), the fitted rate of each bin; a bin with fewer than `min_trials` trials,
    or none, takes the rate of the nearest measured bin (below it first), and the rates are made non-decreasing. A
    (depth, source) without a measured bin is left out (its nodes keep their raw scores)."""
    groups: dict = {}
    for row in fitted:
        key = f"{row['depth']}:{row['source']}"
        rates = groups.setdefault(key, [None] * BINS)
        if row["trials"] >= min_trials:
            rates[probability_bin(row["bin"][0] + 0.5 / BINS)] = float(row["fitted"])
    table = {}
    for key, rates in sorted(groups.items()):
        measured = [b for b, rate in enumerate(rates) if rate is not None]
        if not measured:
            continue
        # a bin without enough trials takes its nearest measured neighbour's rate (below first)
        filled = [rates[max([m for m in measured if m <= b] or [min(measured)])] for b in range(BINS)]
        table[key] = [max(filled[: b + 1]) for b in range(BINS)]  # non-decreasing: a higher score never ranks lower
    return table
