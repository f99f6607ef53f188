"""A multi-branch model-free drafter: every earlier continuation of the row's last n tokens, counted, as a tree.

Prompt lookup ([`tree.lookup_match`]) drafts one chain, the continuation of the *most recent* earlier occurrence of
the row's last 3, 2 or 1 tokens. Repetitive text often has several: a loop that ended differently each time, a list
whose items share a prefix. The continuation trie keeps all of them (as SuffixDecoding keeps suffix trees over the
prompt and the output, scored by count ratios), and [`merge_children`] lays them into the head's best-first tree, so
one verify forward checks the head's branches and every earlier continuation.

Scores: a trie child's conditional log-prob is the measured survival ratio of a lookup chain of that order at that
depth (the head's `tree_lookup_prior`, as for the single chain) times the child's share of its parent's count.
With a single earlier occurrence this is exactly the single chain's score.

The same counts over the answers of earlier calls (`answer_cache.AnswerCache`, `jetspec_answer_cache=`) are merged
the same way and scored by the same prior ([`RowIndexes.answer_branch`]).

[`LookupRecord`] (`tree_lookup_record=True`) lets the branch's record in the call move those survival ratios: per
row and match order, how often the target continued along the branch at each depth in recent rounds, mixed with the
prior. A row stuck in a loop, whose chain the target keeps following, thus scores its chain above the prior.
"""

from __future__ import annotations

import math
from collections import Counter

from .tree import LOOKUP_MAX_NGRAM, ChildrenFn, lookup_logprobs

MAX_OCCURRENCES = 64  # earlier occurrences read per round (most recent first), bounding the trie's work
RECORD_PRIOR_WEIGHT = 4.0  # the prior counts as this many observations of each depth's ratio
RECORD_DECAY = 0.8  # per observed round, older observations of a row's record weigh this much less


class NgramIndex:
    """Where every n-gram (n = 1 .. `max_ngram`) of one row's committed tokens starts, grown only by the tokens
    committed since the last [`update`]: a round's trie or chain costs what it reads (at most `max_occurrences`
    continuations of `length` tokens), not a scan of the history.

    [`trie`] is the continuation trie of the indexed tokens, and [`chain`] the prompt-lookup chain
    ([`tree.lookup_match`]): the same counts, in the same order, as a scan of the whole history would give.
    """

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM):
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"expected max_ngram to be an integer >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.tokens: list = []  # the indexed tokens, a copy of the row's history
        self.starts = [{} for _ in range(max_ngram)]  # starts[n - 1][n-gram] -> its start positions, ascending

    def update(self, history: list) -> "NgramIndex":
        """Index `history[len(self.tokens):]`, the tokens committed since the last update (`history`: the row's
        committed tokens, of which the indexed ones are a prefix)."""
        tokens = self.tokens
        for token in history[len(tokens) :]:
            tokens.append(token)
            end = len(tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.starts[n - 1].setdefault(tuple(tokens[end - n :]), []).append(end - n)
        return self

    def _earlier(self, max_occurrences: int):
        """`(n, starts)`: the longest n whose suffix occurred earlier, and those occurrences' starts, most recent
        first (at most `max_occurrences`); `(0, [])` without one. An occurrence must end before the last token."""
        total = len(self.tokens)
        for n in range(min(self.max_ngram, total - 1), 0, -1):
            found = self.starts[n - 1].get(tuple(self.tokens[total - n :]))  # its last entry is the suffix itself
            if found is not None and len(found) > 1:
                return n, found[-1 - max_occurrences : -1][::-1]
        return 0, []

    def trie(self, length: int, max_occurrences: int = MAX_OCCURRENCES) -> tuple[dict, int]:
        """Counts of every earlier continuation of the indexed tokens' last n tokens (n = `max_ngram` down to 1; the
        first n with a match), up to `length` tokens each: `({path: Counter(next token)}, n)`, `({}, 0)` without a
        match."""
        n, starts = self._earlier(max_occurrences)
        return count_continuations([self.tokens[start + n : start + n + length] for start in starts]), n

    def chain(self, count: int) -> tuple[list, int]:
        """The `count` tokens after the most recent earlier occurrence of the longest matching suffix, and its
        order: [`tree.lookup_match`] of the indexed tokens."""
        n, starts = self._earlier(1)
        if not n:
            return [], 0
        return self.tokens[starts[0] + n : starts[0] + n + count], n


def count_continuations(follows: list) -> dict:
    """The trie `{path: Counter(next token)}` of the continuations `follows` (lists of tokens), each counted once
    along its path."""
    trie: dict = {}
    for follow, count in Counter(map(tuple, follows)).items():  # repeated continuations are walked once
        path = ()
        for token in follow:
            counts = trie.get(path)
            if counts is None:
                counts = trie[path] = Counter()
            counts[token] += count
            path += (token,)
    return trie


class RowIndexes(dict):
    """`{batch row: NgramIndex}` of one `generate` call, kept across its rounds (`state.Call.lookup_index`), and the
    call's answer cache (`answers`: an `answer_cache.AnswerCache` shared across calls, or None).

    Args:
        answers (`AnswerCache`, *optional*): the earlier answers the rows' trees also draft from ([`answer_branch`]).
    """

    def __init__(self, answers=None):
        super().__init__()
        self.answers = answers

    def answer_branch(self, history: list, length: int, prior) -> tuple[dict, list | None, int]:
        """The answer cache's branch for a row whose committed tokens are `history`, as `steps._lookup_branch`
        gives the row's own: `(trie, prior, order)`, the trie of the answers' continuations of the row's last n
        tokens (up to `length` tokens each; `{}` without a cache or a match), scored by the lookup `prior` as the
        row's own trie is ([`trie_children`])."""
        if self.answers is None:
            return {}, None, 0
        trie, order = self.answers.trie(history, length, len(prior) if prior else LOOKUP_MAX_NGRAM)
        return trie, prior or None, order

    def updated(self, row: int, history: list, max_ngram: int) -> NgramIndex:
        """Row `row`'s index brought up to `history`; built anew when the history is not an extension of what it
        indexed (another order, a shorter history)."""
        index = self.get(row)
        stale = (
            index is None
            or index.max_ngram != max_ngram
            or len(history) < len(index.tokens)
            or (index.tokens and history[len(index.tokens) - 1] != index.tokens[-1])
        )
        if stale:
            index = self[row] = NgramIndex(max_ngram)
        return index.update(history)


def continuation_trie(
    sequence: list, length: int, max_ngram: int = LOOKUP_MAX_NGRAM, max_occurrences: int = MAX_OCCURRENCES
) -> tuple[dict, int]:
    """Counts of every earlier continuation of the sequence's last n tokens (n = `max_ngram` down to 1; the first n
    with a match), up to `length` tokens each: `({path: Counter(next token)}, n)`, `({}, 0)` without a match.

    A one-off: it indexes the whole sequence. The rounds of a call keep an [`NgramIndex`] per row instead.

    Args:
        sequence (`list[int]`): the committed tokens, prompt included, ending with the anchor.
        length (`int`): the longest continuation read.
        max_ngram (`int`, *optional*, defaults to 3): the longest suffix matched.
        max_occurrences (`int`, *optional*, defaults to 64): the most recent occurrences read.
    """
    return NgramIndex(max_ngram).update(sequence).trie(length, max_occurrences)


def trie_children(trie: dict, prior, order: int) -> ChildrenFn:
    """Children of a [`continuation_trie`]: tokens sorted by score, `(log-probs, tokens, 0.0)`, `None` off the trie.

    Args:
        prior (`list[list[float]]`, *optional*): the head's `tree_lookup_prior`; without it a continuation's
            first-ranked child scores log-prob 0 (it enters the tree first, as the unscored lookup chain does).
        order (`int`): the match's n-gram order.
    """
    depth_logps = {}

    def depth_logp(depth: int) -> float:
        if prior is None:
            return 0.0
        if depth not in depth_logps:
            depth_logps[depth] = lookup_logprobs(prior, order, depth + 1)[depth]
        return depth_logps[depth]

    def children(path):
        counts = trie.get(tuple(path))
        if not counts:
            return None
        total = sum(counts.values())
        ranked = counts.most_common()
        base = depth_logp(len(path))
        top = ranked[0][1]
        # without a prior the most frequent child keeps log-prob 0 (first), the others their share relative to it
        scale = total if prior is not None else top
        return [base + math.log(c / scale) for _, c in ranked], [t for t, _ in ranked], 0.0

    return children


def merge_children(head: ChildrenFn, extra: ChildrenFn) -> ChildrenFn:
    """The union of two drafters' children at every path: a token both propose keeps the higher log-prob, and the
    list stays sorted by log-prob (best-first expansion reads it in order). The head's entropy is kept."""

    def merged(path):
        mine, theirs = head(path), extra(path)
        if theirs is None:
            return mine
        if mine is None:
            return theirs
        best: dict = {}
        for lp, token in zip(*theirs[:2]):
            best[int(token)] = float(lp)
        for lp, token in zip(*mine[:2]):
            best[int(token)] = max(best.get(int(token), -math.inf), float(lp))
        order = sorted(best.items(), key=lambda item: -item[1])  # stable: ties keep the extra drafter's order
        return [lp for _, lp in order], [t for t, _ in order], mine[2]

    return merged


def chain_trie(chain: list) -> dict:
    """A single chain (a [`tree.lookup_match`] continuation) as a [`continuation_trie`] of one occurrence."""
    return {tuple(chain[:depth]): Counter({token: 1}) for depth, token in enumerate(chain)}


class LookupRecord:
    """Per row and match order, a decayed count of how often the target continued along the model-free branch at
    each depth, which [`LookupRecord.prior`] mixes with the head's lookup prior.

    What a round drafted from the branch (a trie, [`chain_trie`] for the chain) is compared, at the next round,
    with the tokens the round committed (accepted path and bonus, the target's own choices). Depth d of the branch
    is a *hit* when the first d committed tokens are a path of the branch, a *miss* when the first d - 1 are and the
    d-th leaves it; past the committed tokens nothing is known (censored). This counts what the target would have
    accepted along the branch whatever budget the tree gave it. The mixed conditional ratio at depth d is
    `(w * r(d) + hits(d)) / (w + trials(d))`, `r(d)` the prior's survival ratio `s(d) / s(d - 1)`, `w` =
    `prior_weight`; scores change, never which tokens are committed, so decoding stays lossless.
    """

    def __init__(self, prior_weight: float = RECORD_PRIOR_WEIGHT, decay: float = RECORD_DECAY):
        self.prior_weight, self.decay = prior_weight, decay
        self.counts = {}  # (row, order) -> [hits per depth, trials per depth]
        self.offers = {}  # row -> (trie, order, committed length when drafted)

    def observe(self, row: int, history: list):
        """Score the row's last offer against the tokens committed since (`history`: the row's committed tokens)."""
        offer = self.offers.pop(row, None)
        if offer is None:
            return
        trie, order, length = offer
        new = history[length:]
        hits, trials = self.counts.setdefault((row, order), ([], []))
        for k in range(len(hits)):
            hits[k] *= self.decay
            trials[k] *= self.decay
        depth = 0
        while depth < len(new) and trie.get(tuple(new[:depth])):
            while len(hits) <= depth:
                hits.append(0.0)
                trials.append(0.0)
            trials[depth] += 1.0
            if new[depth] not in trie[tuple(new[:depth])]:
                break
            hits[depth] += 1.0
            depth += 1

    def offer(self, row: int, trie: dict, order: int, length: int):
        """What the row's tree drew from the branch this round (`order`: its match's n-gram order; `length`: the
        row's committed tokens when drafted)."""
        if trie:
            self.offers[row] = (trie, order, length)

    def prior(self, row: int, prior: list, order: int, length: int) -> list:
        """`prior` (the head's `tree_lookup_prior`) with the row's order-`order` survival mixed with its record,
        `length` depths long; the other orders as they were."""
        hits, trials = self.counts.get((row, order), ([], []))
        if not trials:
            return prior
        survival, previous = [], 1.0
        for depth, logp in enumerate(lookup_logprobs(prior, order, length)):
            ratio = math.exp(logp)
            if depth < len(trials):
                ratio = (self.prior_weight * ratio + hits[depth]) / (self.prior_weight + trials[depth])
            previous *= min(max(ratio, 1e-6), 1.0)
            survival.append(previous)
        return [survival if n == order - 1 else row_prior for n, row_prior in enumerate(prior)]
