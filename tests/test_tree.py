"""Tree construction, tree masks and the acceptance walk, against brute-force references."""

import pytest
import torch

from modeling_jetspec.tree import (
    accept_walk,
    ancestor_mask,
    build_tree,
    children_map,
    entropy,
    marginal_children,
    max_tree_nodes,
    tree_key,
    tree_paths,
)


def brute_force_tree(children, budget, depth, scoring="logprob"):
    """Every path up to `depth`, ranked by its key; the best `budget` as a set of token paths."""
    found, frontier = [], [((), 0.0, 0.0)]
    while frontier:
        path, lp, en = frontier.pop()
        if len(path) >= depth:
            continue
        lps, toks, ent = children(path)
        for clp, tok in zip(lps, toks):
            child = (path + (int(tok),), lp + float(clp), en + float(ent))
            found.append((tree_key(scoring, child[1], child[2]), child[0]))
            frontier.append(child)
    found.sort(key=lambda item: -item[0])
    return {path for _, path in found[:budget]}


def random_depth_logits(depth, vocab, width, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 3, dim=-1)
    top_lp, top_tok = logp.topk(width, dim=-1)
    return top_lp, top_tok, entropy(logp)


@pytest.mark.parametrize("scoring", ["logprob", "mixed"])
@pytest.mark.parametrize("depth,width,budget", [(1, 4, 3), (3, 2, 5), (4, 3, 12), (5, 4, 40), (3, 3, 39)])
@pytest.mark.parametrize("seed", range(5))
def test_best_first_matches_brute_force(scoring, depth, width, budget, seed):
    children = marginal_children(*random_depth_logits(depth, vocab=50, width=width, seed=seed))
    tree = build_tree(children, budget, depth, scoring)
    assert len(tree.tokens) == min(budget, max_tree_nodes(depth, width))
    assert tree_paths(tree) == brute_force_tree(children, budget, depth, scoring)


def test_tree_is_well_formed_under_every_scoring():
    children = marginal_children(*random_depth_logits(6, vocab=40, width=3, seed=7))
    for scoring in ("logprob", "entropy", "mixed"):
        tree = build_tree(children, 30, 6, scoring)
        assert len(tree.tokens) == 30
        for i, (parent, depth) in enumerate(zip(tree.parents, tree.depths), start=1):
            assert 0 <= parent < i  # parents come first
            assert depth == (tree.depths[parent - 1] + 1 if parent else 1)
            assert depth <= 6
        # best-first keys never increase from a parent to its child
        for i, parent in enumerate(tree.parents):
            if parent:
                assert tree.scores[i] <= tree.scores[parent - 1] + 1e-9


def test_budget_larger_than_full_tree_gives_full_tree():
    children = marginal_children(*random_depth_logits(2, vocab=30, width=3, seed=0))
    tree = build_tree(children, 100, 2)
    assert len(tree.tokens) == 3 + 9


def test_path_conditioned_children_are_used():
    # root's children from one list, branch (5,) gets its own list: the tree must follow the per-branch lists
    lists = {(): ([-0.1, -3.0], [5, 6], 0.0), (5,): ([-0.2, -0.3], [7, 8], 0.0)}
    tree = build_tree(lambda path: lists.get(path), budget=4, depth=3)
    assert tree_paths(tree) == {(5,), (5, 7), (5, 8), (6,)}


def test_ancestor_mask_matches_parent_chains():
    parents = torch.tensor([[0, 0, 1, 3, 2], [0, 1, 2, 3, 4]])
    anc = ancestor_mask(parents)
    for b in range(2):
        for node in range(6):
            chain, cur = {node}, node
            while cur:
                cur = int(parents[b, cur - 1])
                chain.add(cur)
            expected = torch.tensor([j in chain for j in range(6)])
            assert torch.equal(anc[b, node], expected)


def test_accept_walk_follows_target_choices_and_appends_bonus():
    # tree: 1:(a=10), 2:(b=11), 3: 10->12, 4: 12->13
    tree = build_tree(lambda p: {(): ([-0.1, -0.2], [10, 11], 0), (10,): ([-0.1], [12], 0), (10, 12): ([-0.1], [13], 0)}.get(p), 4, 3)
    kids = children_map(tree)
    # (a) target agrees down to depth 2, then says 99: accepted root, 10, 12; committed 10, 12, 99
    choices = {0: 10, 1: 12, 3: 99}
    committed, accepted = accept_walk(kids, lambda node, path: choices.get(node, -1))
    assert committed == [10, 12, 99]
    assert [tree.tokens[i - 1] for i in accepted[1:]] == [10, 12]
    # (b) target disagrees at the root: only the bonus token
    committed, accepted = accept_walk(kids, lambda node, path: 42)
    assert committed == [42] and accepted == [0]
