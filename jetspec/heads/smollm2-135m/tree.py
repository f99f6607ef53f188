"""Candidate trees: best-first construction, tree-causal masks and acceptance (arXiv 2606.18394, sections 3.2-3.3).

Node numbering used throughout: node 0 is the root (the anchor, the last committed token, not yet seen by the
target); draft nodes are 1..n. `parents[i - 1]` is the parent of node i and always lies in [0, i). The root is
*not* counted in the budget: a tree of budget B has B draft nodes and the verify forward covers B + 1 tokens.
"""

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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


def tree_key(scoring: str, logprob: float, entropy: float) -> float:
    """Best-first key of a path from its cumulative draft log-prob and the summed entropies of its depths.

    `logprob` (the paper's choice) ranks by cumulative log-prob; `entropy` by minus the summed entropy of the
    distributions the path's tokens were drawn from (siblings tie and keep rank order); `mixed` adds both.
    Every key is non-increasing along a path, so best-first trees are closed under prefixes.
    """
    if scoring == "logprob":
        return logprob
    if scoring == "entropy":
        return -entropy
    if scoring == "mixed":
        return logprob - entropy
    raise ValueError(f"expected tree scoring 'logprob', 'entropy' or 'mixed', got {scoring!r}")


def max_tree_nodes(depth: int, width: int) -> int:
    """Number of nodes of the full `width`-ary tree of depth `depth`, root excluded."""
    return sum(width**d for d in range(1, depth + 1))


def build_tree(children: ChildrenFn, budget: int, depth: int, scoring: str = "logprob") -> Tree:
    """Best-first tree: pop the best open node, attach it, open its next sibling and its first child; stop at `budget`.

    With the `logprob` key this returns exactly the `budget` highest-scoring paths (ties aside), because keys never
    increase from a node to its child or to its next sibling.
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


def marginal_children(topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, entropies: torch.Tensor) -> ChildrenFn:
    """Children from per-depth marginals (one draft block): every branch at depth d gets the depth-(d+1) top-W.

    Args:
        topk_logprobs (`torch.Tensor` of shape `(N, W)`): top-W draft log-probs per depth 1..N.
        topk_tokens (`torch.Tensor` of shape `(N, W)`): their tokens.
        entropies (`torch.Tensor` of shape `(N,)`): entropy of each depth's distribution.
    """
    lps, toks, ents = topk_logprobs.tolist(), topk_tokens.tolist(), entropies.tolist()

    def children(path):
        d = len(path)
        return (lps[d], toks[d], ents[d]) if d < len(lps) else None

    return children


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


def verification_mask(past_valid: torch.Tensor, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask for the target's verify forward over the tree (root first) after a cache.

    Args:
        past_valid (`torch.BoolTensor` of shape `(B, S)`): cache entries each row may see (False: padding, holes).
        ancestors (`torch.BoolTensor` of shape `(B, T, T)`): from [`ancestor_mask`].
        dtype (`torch.dtype`): the target's floating dtype.

    Returns:
        `torch.Tensor` of shape `(B, 1, T, S + T)`: 0 where attention is allowed, the dtype's minimum elsewhere
        (an additive float mask: a boolean one would be added to the scores by eager attention).
    """
    b, t, _ = ancestors.shape
    allowed = torch.cat([past_valid[:, None, :].expand(b, t, -1), ancestors], dim=-1)  # (B, T, S+T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def children_map(tree: Tree) -> list[dict[int, int]]:
    """For each node (root first), a map from a child's token to the child's node index."""
    kids = [{} for _ in range(len(tree.tokens) + 1)]
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents), start=1):
        kids[parent].setdefault(token, i)
    return kids


def accept_walk(kids: list[dict[int, int]], choose: Callable[[int, list[int]], int]) -> tuple[list[int], list[int]]:
    """Walk the tree from the root following the target's own choices.

    `choose(node, path_tokens)` returns the target's token at `node` (its argmax, or its sample after the
    logits processors saw the node's own path). The walk moves to the child holding that token and stops at
    the first node with no such child. Lossless: every committed token is the target's own choice given
    exactly the tokens before it.

    Returns:
        `(committed, accepted)`: the committed tokens (accepted path tokens, then the bonus token), and the
        accepted node indices (root first, so `len(accepted) == len(committed)`).
    """
    node, committed, accepted = 0, [], [0]
    while True:
        token = choose(node, committed)
        committed.append(token)
        child = kids[node].get(token)
        if child is None:
            return committed, accepted
        node = child
        accepted.append(child)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) over the last dim of log-probabilities; `-inf` entries contribute zero."""
    p = logprobs.exp()
    return -(p * torch.where(torch.isfinite(logprobs), logprobs, torch.zeros_like(logprobs))).sum(-1)


def tree_paths(tree: Tree) -> set[tuple[int, ...]]:
    """The set of root-to-node token paths of a tree (root excluded)."""
    paths = [()]
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append(paths[parent] + (token,))
    return set(paths[1:])

