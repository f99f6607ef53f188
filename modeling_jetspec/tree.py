"""Candidate trees: best-first construction, tree-causal masks, argument checks (arXiv 2606.18394, sections 3.2-3.3).

Node numbering used throughout: node 0 is the root (the anchor, the last committed token, not yet seen by the
target); draft nodes are 1..n. `parents[i - 1]` is the parent of node i and always lies in [0, i). The root is
*not* counted in the budget: a tree of budget B has B draft nodes and the verify forward covers B + 1 tokens.
"""

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .kept_masks import PastMask, WindowMask

TREE_SCORINGS = ("logprob", "entropy", "mixed", "gap")
ENTROPY_SCORINGS = ("entropy", "mixed")  # the keys that read a depth's entropy; the others need not compute it
# `gap` scoring (JetSpec's low-budget "top-2-gap fanout"): a node keeps only the candidates whose log-prob is within
# this many nats of its best one, so a confident depth (top-1 far above top-2) spends no budget on siblings and the
# budget goes deeper along the likely path instead. 2 nats: a sibling must be at least 1/e^2 (~14%) as likely.
GAP_FANOUT_NATS = 2.0

# children(path) -> (log-probs, tokens, entropy) of the candidates below the branch `path` (tuple of tokens, root
# excluded), sorted by decreasing log-prob; None when the branch cannot be expanded.
ChildrenFn = Callable[[tuple[int, ...]], "tuple[Sequence[float], Sequence[int], float] | None"]


@dataclass
class Tree:
    """One candidate tree (root excluded from the lists)."""

    tokens: list[int]  # (n,) token of node i + 1
    parents: list[int]  # (n,) parent of node i + 1, 0 is the root
    depths: list[int]  # (n,) depth of node i + 1, the root has depth 0
    scores: list[float]  # (n,) best-first key of node i + 1


MAX_TREE_LOOKUP = 64  # the longest prompt-lookup chain (transformers' prompt lookup drafts 10 tokens by default)
LOOKUP_MAX_NGRAM = 3  # prompt lookup matches the last 3, else 2, else 1 tokens; a lookup prior has a row per order
# the model-free branch: "chain", the continuation of the most recent match (`lookup_match`); "trie", every earlier
# continuation counted (`continuations.continuation_trie`)
LOOKUP_BRANCHES = ("chain", "trie")


def check_tree_shape(
    depth,
    width,
    budget,
    scoring,
    block_size: int,
    path_conditioning: bool = False,
    lookup: int = 0,
    lookup_branches: str = "chain",
    lookup_record: bool = False,
):
    """The one validation of tree arguments (per call and on the head's config); raises a `ValueError`.

    Args:
        depth (`int`): maximum depth N, in `[1, block_size - 1]`.
        width (`int`): candidates W per node, >= 1.
        budget (`int` or `"auto"`): draft nodes B per tree, >= 1, or `"auto"` (see `budget.py`).
        scoring (`str`): one of `TREE_SCORINGS`.
        block_size (`int`): the head's block length.
        path_conditioning (`bool`, *optional*, defaults to `False`): the second, path-conditioned draft pass. It
            rebuilds the tree from probes placed under the first tree. Rejected with `"auto"`: the operating point's
            acceptance table and host costs are measured without it, and two of its three sources add a lookup branch.
        lookup (`int`, *optional*, defaults to 0): tokens of the prompt-lookup branch, in `[0, MAX_TREE_LOOKUP]`
            (0: none). It may run deeper than `depth`: past the head's depths the chain alone continues. Its nodes
            are placed before the head's ranks would put them, which path conditioning would rebuild away: also
            rejected together.
        lookup_branches (`str`, *optional*, defaults to `"chain"`): one of `LOOKUP_BRANCHES`.
        lookup_record (`bool`, *optional*, defaults to `False`): mix the lookup prior with the branch's record in
            this call (`continuations.LookupRecord`); needs a lookup prior, see [`check_lookup_prior`].
    """
    if not isinstance(depth, int) or not 1 <= depth <= block_size - 1:
        raise ValueError(f"expected tree_depth in [1, {block_size - 1}] (block_size - 1 of this head), got {depth!r}")
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"expected tree_width >= 1, got {width!r}")
    if budget != "auto" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(f"expected tree_budget >= 1 draft node or 'auto', got {budget!r}")
    if scoring not in TREE_SCORINGS:
        raise ValueError(f"expected tree_scoring in {TREE_SCORINGS}, got {scoring!r}")
    if not isinstance(lookup, int) or isinstance(lookup, bool) or not 0 <= lookup <= MAX_TREE_LOOKUP:
        raise ValueError(f"expected tree_lookup in [0, {MAX_TREE_LOOKUP}] (tokens of the lookup chain), got {lookup!r}")
    if lookup_branches not in LOOKUP_BRANCHES:
        raise ValueError(f"expected tree_lookup_branches in {LOOKUP_BRANCHES}, got {lookup_branches!r}")
    if not isinstance(lookup_record, bool):
        raise ValueError(f"expected tree_lookup_record True or False, got {lookup_record!r}")
    if lookup and path_conditioning:
        raise ValueError(
            "expected tree_lookup=0 with path_conditioning=True (the second pass rebuilds the tree from the head's "
            f"probes only), got tree_lookup={lookup}"
        )
    if budget == "auto" and path_conditioning:
        raise ValueError(
            "expected a fixed tree_budget with path_conditioning=True (tree_budget='auto' weighs a tau table and "
            "host costs measured without it), got tree_budget='auto'"
        )


def check_lookup_prior(prior, record: bool = False):
    """Raise a `ValueError` unless `prior` is None or 1-3 non-empty lists (match orders 1, 2, 3) of acceptance
    fractions in (0, 1], non-increasing along each list; with `record` (`tree_lookup_record`), a prior is needed: the
    record mixes the call's observed acceptance with it."""
    if prior is None:
        if record:
            raise ValueError(
                "expected a tree_lookup_prior with tree_lookup_record=True (the record mixes what the "
                "call observes with the prior), got none"
            )
        return
    expected = "None or 1-3 lists (n-gram orders 1, 2, 3) of non-increasing fractions in (0, 1]"
    if not isinstance(prior, (list, tuple)) or not 1 <= len(prior) <= LOOKUP_MAX_NGRAM:
        raise ValueError(f"expected tree_lookup_prior {expected}, got {prior!r}")
    for row in prior:
        ok = (
            isinstance(row, (list, tuple))
            and len(row) > 0
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1 for x in row)
        )
        if not ok or any(b > a for a, b in zip(row, row[1:])):
            raise ValueError(f"expected tree_lookup_prior {expected}, got the row {row!r}")


def tree_key(scoring: str, logprob: float, entropy: float) -> float:
    """Best-first key of a path from its cumulative draft log-prob and the summed entropies of its depths.

    `logprob` (the paper's choice) ranks by cumulative log-prob; `entropy` by minus the summed entropy of the
    distributions the path's tokens were drawn from (siblings tie and keep rank order); `mixed` adds both; `gap`
    ranks by cumulative log-prob too, over children capped by [`cap_by_gap`] (see `build_tree`).
    Every key is non-increasing along a path, so best-first trees are closed under prefixes.
    """
    if scoring in ("logprob", "gap"):
        return logprob
    if scoring == "entropy":
        return -entropy
    return logprob - entropy  # "mixed"; `check_tree_shape` admits nothing else


def max_tree_nodes(depth: int, width: int) -> int:
    """Number of nodes of the full `width`-ary tree of depth `depth`, root excluded."""
    return sum(width**d for d in range(1, depth + 1))


def cap_by_gap(found, nats: float = GAP_FANOUT_NATS):
    """Top-2-gap fanout: the candidates `(log-probs, tokens, entropy)` (sorted, best first) cut to those within `nats`
    of the best; the best one always stays. A wide gap between the top two leaves a single child."""
    if found is None:
        return None
    lps, toks, ent = found
    best = float(lps[0])
    keep = 1 + sum(1 for lp in list(lps)[1:] if best - float(lp) <= nats)
    return list(lps)[:keep], list(toks)[:keep], ent


def build_tree(children: ChildrenFn, budget: int, depth: int, scoring: str = "logprob") -> Tree:
    """Best-first tree: pop the best open node, attach it, open its next sibling and its first child; stop at `budget`.

    With the `logprob` key this returns exactly the `budget` highest-scoring paths (ties aside), because keys never
    increase from a node to its child or to its next sibling. `gap` does the same over children capped by
    [`cap_by_gap`]: the `budget` best paths among those the fanout cap admits.
    """
    tokens, parents, depths, scores, paths = [], [], [], [], [()]
    acc = [(0.0, 0.0)]  # (cumulative log-prob, cumulative entropy) per node, root first
    lists = {}  # node -> (log-probs, tokens, entropy) of its candidate children
    heap, tick = [], 0

    def open_child(parent: int, rank: int):
        nonlocal tick
        lps, toks, ent = lists[parent]
        if rank >= len(toks):
            return
        lp, en = acc[parent][0] + float(lps[rank]), acc[parent][1] + float(ent)
        heapq.heappush(heap, (-tree_key(scoring, lp, en), tick, parent, rank, lp, en))
        tick += 1

    def open_first_child(node: int):
        if len(paths[node]) >= depth:
            return
        found = children(paths[node])
        if scoring == "gap":
            found = cap_by_gap(found)
        if found is not None:
            lists[node] = found
            open_child(node, 0)

    open_first_child(0)
    while heap and len(tokens) < budget:
        neg_key, _, parent, rank, lp, en = heapq.heappop(heap)
        token = int(lists[parent][1][rank])
        tokens.append(token)
        parents.append(parent)
        depths.append(len(paths[parent]) + 1)
        scores.append(-neg_key)
        paths.append(paths[parent] + (token,))
        acc.append((lp, en))
        open_child(parent, rank + 1)
        open_first_child(len(tokens))
    return Tree(tokens, parents, depths, scores)


def marginal_children(topk_logprobs, topk_tokens, entropies) -> ChildrenFn:
    """Children from per-depth marginals (one draft block): every branch at depth d gets the depth-(d+1) top-W.

    Args:
        topk_logprobs (`list` or `torch.Tensor` of shape `(N, W)`): top-W draft log-probs per depth 1..N.
        topk_tokens (`list` or `torch.Tensor` of shape `(N, W)`): their tokens.
        entropies (`list` or `torch.Tensor` of shape `(N,)`): entropy of each depth's distribution.
    """
    lps, toks, ents = (
        x.tolist() if isinstance(x, torch.Tensor) else x for x in (topk_logprobs, topk_tokens, entropies)
    )

    def children(path):
        d = len(path)
        return (lps[d], toks[d], ents[d]) if d < len(lps) else None

    return children


def lookup_match(sequence: list, count: int, max_ngram: int = LOOKUP_MAX_NGRAM) -> tuple[list, int]:
    """Prompt lookup (n-gram) drafting over a row's own tokens: the `count` tokens that followed the most recent
    earlier occurrence of the sequence's last n tokens, trying n = `max_ngram` down to 1, and that n (the match's
    order); `([], 0)` without a match.

    Args:
        sequence (`list[int]`): the committed tokens, prompt included, ending with the anchor.
        count (`int`): the longest continuation returned.
        max_ngram (`int`, *optional*, defaults to 3): the longest suffix matched.
    """
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = sequence[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first; the suffix itself is excluded
            if sequence[start : start + n] == suffix:
                return list(sequence[start + n : start + n + count]), n
    return [], 0


def lookup_survival(prior, order: int, length: int) -> list:
    """How often a lookup chain from a match of order `order` has at least k tokens accepted, k = 1..`length`: the
    one estimate of a lookup chain's odds (the tree's scores, the trie's, the call's record and the chain drafter's
    choice all start from it).

    Args:
        prior (`list[list[float]]`): `prior[n - 1][k - 1]` is how often a chain from an order-n match had at least k
            tokens accepted (non-increasing in k, in (0, 1], [`check_lookup_prior`]); the head's `tree_lookup_prior`,
            measured on the target's own answers.
        order (`int`): the match's n-gram order, in `[1, len(prior)]`.
        length (`int`): tokens in the chain.

    Returns:
        `list[float]` of `length` survival fractions: the measured ones, then past the measured depths each the one
        before times the last measured ratio `s(K) / s(K - 1)` (`s(1)` when one depth is measured), so a long chain
        keeps losing odds at the rate the deepest measurements lose them.
    """
    measured = list(prior[order - 1])
    ratio = measured[-1] / measured[-2] if len(measured) > 1 else measured[-1]
    survival = []
    for k in range(length):
        survival.append(measured[k] if k < len(measured) else survival[-1] * ratio)
    return survival


def lookup_logprobs(prior, order: int, length: int) -> list:
    """Per-token conditional log-probs of a lookup chain of `length` tokens from a match of order `order`: the log
    of each [`lookup_survival`] ratio `s(k) / s(k - 1)` (`s(0)` = 1), held in [1e-6, 1]."""
    survival = lookup_survival(prior, order, length)
    return [
        math.log(min(max(s / p, 1e-6), 1.0)) if p > 0 else math.log(1e-6) for p, s in zip([1.0] + survival, survival)
    ]


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Tree-causal mask: node i sees node j iff j is i or one of its ancestors (root included).

    Args:
        parents (`torch.Tensor` of shape `(B, n)`): parent of nodes 1..n, 0 being the root.

    Returns:
        `torch.BoolTensor` of shape `(B, n + 1, n + 1)`, root first.
    """
    batch, n = parents.shape
    eye = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    anc = eye.unsqueeze(0).repeat(batch, 1, 1)  # (B, n+1, n+1)
    rows = torch.arange(batch, device=parents.device)
    for i in range(1, n + 1):  # parents precede children, so row parents[i] is complete when row i is built
        anc[:, i] |= anc[rows, parents[:, i - 1]]
    return anc


_MASK_WORD = 62  # bits of one int64 word of a host-built ancestor mask (sign bit and one spare left clear)


def ancestor_mask_of(parents: list, device=None) -> torch.Tensor:
    """[`ancestor_mask`] of trees whose parents are host lists (`Tree.parents`, all of one length n): each node's
    ancestor set is its parent's plus itself, built as an integer bit set per node on the host, then unpacked into
    the `(B, n + 1, n + 1)` boolean mask by three tensor ops instead of n rounds of indexing (the round builds its
    trees' lists anyway: about a quarter of a millisecond less a round at budget 16 on a CPU).

    Args:
        parents (`list[list[int]]`): per tree, the parent of nodes 1..n, 0 being the root; a parent precedes its child.
    """
    n = len(parents[0]) if parents else 0
    if any(len(row) != n for row in parents):
        raise ValueError(f"expected trees of one size, got sizes {[len(row) for row in parents]}")
    words = -(-(n + 1) // _MASK_WORD)
    full = (1 << _MASK_WORD) - 1
    packed = []
    for row in parents:
        sets = [1]  # the root sees itself
        for node, parent in enumerate(row, start=1):
            if not 0 <= parent < node:
                raise ValueError(f"expected each parent in [0, node), got parent {parent} for node {node}")
            sets.append(sets[parent] | (1 << node))
        packed.append([[(bits >> (_MASK_WORD * w)) & full for w in range(words)] for bits in sets])
    words_tensor = torch.tensor(packed, dtype=torch.long, device=device)  # (B, n + 1, words)
    shifts = torch.arange(_MASK_WORD, device=device)
    bits = (words_tensor[..., None] >> shifts) & 1  # (B, n + 1, words, 62)
    return bits.flatten(-2)[..., : n + 1].bool()


def verification_allowed(
    past_valid: torch.Tensor,
    ancestors: torch.Tensor,
    window: int | None = None,
    past_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    causal_past: bool = False,
) -> torch.Tensor:
    """Where the target's verify forward over the tree (root first) may attend after a cache.

    Args:
        past_valid (`torch.BoolTensor` of shape `(B, S)`): cache entries each row may see (False: padding, holes).
        ancestors (`torch.BoolTensor` of shape `(B, T, T)`): from [`ancestor_mask`].
        window (`int`, *optional*): a sliding window: a query at position p sees keys at positions > p - window
            (transformers' rule), on top of the rest. Needs the positions below.
        past_positions (`torch.LongTensor` of shape `(B, S)`, *optional*): position id of every cache entry.
        positions (`torch.LongTensor` of shape `(B, T)`, *optional*): position id of every tree node.
        causal_past (`bool`, *optional*, defaults to `False`): a query sees a cache entry only at a position up to its
            own (needs the positions): for new tokens that re-read committed ones whose entries the cache holds.

    Returns:
        `torch.BoolTensor` of shape `(B, T, S + T)`: node i sees the valid cache entries, its ancestors and itself.
    """
    b, t, _ = ancestors.shape
    if (window is not None or causal_past) and (past_positions is None or positions is None):
        raise ValueError("expected past_positions and positions with a sliding window or causal_past, got none")
    past = past_valid[:, None, :].expand(b, t, -1)  # (B, T, S)
    if causal_past:
        past = past & (past_positions[:, None, :] <= positions[:, :, None])
    allowed = torch.cat([past, ancestors], dim=-1)  # (B, T, S+T)
    if window is not None:
        keys = torch.cat([past_positions, positions], dim=1)  # (B, S+T)
        allowed = allowed & (positions[:, :, None] - keys[:, None, :] < window)
    return allowed


def verification_mask(
    past_valid: torch.Tensor,
    ancestors: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
    past_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    causal_past: bool = False,
) -> torch.Tensor:
    """Additive 4D mask for the target's verify forward over the tree (root first) after a cache: the
    [`verification_allowed`] entries (see there for the arguments) in the target's floating `dtype`.

    Returns:
        `torch.Tensor` of shape `(B, 1, T, S + T)`: 0 where attention is allowed, the dtype's minimum elsewhere
        (an additive float mask: a boolean one would be added to the scores by eager attention).
    """
    allowed = verification_allowed(past_valid, ancestors, window, past_positions, positions, causal_past)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def verification_block_mask(
    past_valid: torch.Tensor,
    ancestors: torch.Tensor,
    window: int | None = None,
    past_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
):
    """The verify mask of a flex_attention target: the [`verification_allowed`] entries (see there for the
    arguments) as a `BlockMask` of shape `(B, 1, T, S + T)`: node i attends to the row's valid cache entries, its
    ancestors and itself, and flex_attention skips the key blocks no node of a query block sees."""
    from torch.nn.attention.flex_attention import create_block_mask  # torch >= 2.5; only flex targets come here

    allowed = verification_allowed(past_valid, ancestors, window, past_positions, positions)
    b, t, kv = allowed.shape

    def mask_mod(batch, head, query, key):
        return allowed[batch, query, key]

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=t, KV_LEN=kv, device=allowed.device)


def verify_attention_mask(
    past_valid: torch.Tensor,
    seen: torch.Tensor,
    dtype: torch.dtype,
    windows: dict | None = None,
    past_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    layer_types: list | None = None,
    unmasked: tuple = (),
    causal_past: bool = False,
    flex: bool = False,
    kept: dict | None = None,
):
    """The `attention_mask` a verify forward hands the target: the one place it is built (`steps.verify`, `hybrid.py`).

    Args:
        past_valid, seen, past_positions, positions, causal_past: as in [`verification_mask`] (`seen`, the
            new tokens' `ancestors`: which new token each new token sees).
        dtype (`torch.dtype`): the target's floating dtype.
        windows (`dict`, *optional*): sliding windows, from `verifiers.verify_windows`: `{layer type: window}`, or
            `{None: window}` when every layer slides; `None` when no layer slides.
        layer_types (`list`, *optional*): the target's layer types. When given, the result is a dict over them
            (a layer type missing from `windows` takes the `None` entry's window, else none).
        unmasked (`tuple`, *optional*): layer types that get `None` (no padding among the new tokens: recurrent,
            convolution and cacheless layers).
        flex (`bool`, *optional*): a flex_attention target: `BlockMask`s ([`verification_block_mask`]) instead of
            additive masks (attention targets only: no `causal_past`).
        kept (`dict`, *optional*): the `masks` of the columns the past is the newest view of (`kept_masks.py`);
            without it (or with `causal_past` or `flex`) every mask is built whole, at a cost that grows with S.

    Returns:
        One additive mask `(B, 1, T, S + T)` when no layer type needs its own (no `layer_types`, and `windows` is
        `None` or `{None: window}`), else `{layer type: mask or None}`: the model hands each layer the one of its
        type. Types with the same window share one mask.
    """
    if flex and causal_past:
        raise ValueError("expected no causal_past with a flex_attention BlockMask, got causal_past=True")
    built = {}

    def one(window):
        if window in built:
            return built[window]
        if flex:
            built[window] = verification_block_mask(past_valid, seen, window, past_positions, positions)
        elif kept is not None and not causal_past:
            built[window] = _kept(kept, dtype, window)(past_valid, seen, past_positions, positions)
        else:
            built[window] = verification_mask(past_valid, seen, dtype, window, past_positions, positions, causal_past)
        return built[window]

    if layer_types is None:
        if windows is None:
            return one(None)
        if None in windows:  # every layer slides (Mistral): one mask
            return one(windows[None])
        return {layer_type: one(window) for layer_type, window in windows.items()}
    return {
        t: None if t in unmasked else one(None if windows is None else windows.get(t, windows.get(None)))
        for t in sorted(set(layer_types))
    }


def _kept(kept: dict, dtype: torch.dtype, window: int | None):
    """The verify mask of `window` kept in `kept`, made on first use."""
    key = ("verify", dtype, window)
    if key not in kept:
        kept[key] = PastMask(dtype) if window is None else WindowMask(dtype, window)
    return kept[key]


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) over the last dim of log-probabilities; `-inf` entries contribute zero."""
    p = logprobs.exp()
    return -(p * torch.where(torch.isfinite(logprobs), logprobs, torch.zeros_like(logprobs))).sum(-1)
