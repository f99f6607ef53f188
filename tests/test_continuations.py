"""The continuation trie: every earlier continuation of the row's last n tokens, counted, merged into the head's tree."""

import math

from modeling_jetspec.continuations import continuation_trie, merge_children, trie_children
from modeling_jetspec.tree import build_tree, lookup_logprobs, lookup_match, marginal_children, with_lookup

import torch

PRIOR = [[0.2, 0.1], [0.5, 0.3], [0.8, 0.6, 0.5]]
# "5 6 7" occurs three times; the first two continue "1 2 3 9" and "1 2 4 8"
LOOP = [5, 6, 7, 1, 2, 3, 9, 5, 6, 7, 1, 2, 4, 8, 5, 6, 7]


def test_trie_counts_every_earlier_continuation():
    trie, order = continuation_trie(LOOP, 4)
    assert order == 3
    assert trie[()] == {1: 2}
    assert trie[(1, 2)] == {3: 1, 4: 1}
    assert trie[(1, 2, 3)] == {9: 1} and trie[(1, 2, 4)] == {8: 1}
    # the single chain sees only the most recent continuation
    assert lookup_match(LOOP, 4) == ([1, 2, 4, 8], 3)


def test_trie_falls_back_to_shorter_orders_and_to_nothing():
    trie, order = continuation_trie([1, 2, 3, 4, 2], 3)
    assert order == 1 and trie == {(): {3: 1}, (3,): {4: 1}, (3, 4): {2: 1}}
    assert continuation_trie([1, 2, 3], 3) == ({}, 0)


def test_single_occurrence_scores_as_the_single_chain():
    sequence = [4, 5, 6, 7, 8, 4, 5, 6]
    trie, order = continuation_trie(sequence, 4)
    chain, chain_order = lookup_match(sequence, 4)
    assert order == chain_order
    children = trie_children(trie, PRIOR, order)
    expected = lookup_logprobs(PRIOR, order, len(chain))
    path = ()
    for token, lp in zip(chain, expected):
        lps, tokens, _ = children(path)
        assert tokens == [token] and math.isclose(lps[0], lp)
        path += (token,)


def test_branch_shares_split_the_survival_ratio():
    trie, order = continuation_trie(LOOP, 4)
    lps, tokens, _ = trie_children(trie, PRIOR, order)((1, 2))
    depth_lp = lookup_logprobs(PRIOR, order, 3)[2]
    assert sorted(tokens) == [3, 4]
    assert all(math.isclose(lp, depth_lp + math.log(0.5)) for lp in lps)
    # without a prior the most frequent child enters first (log-prob 0), as the unscored chain does
    lps, _, _ = trie_children(trie, None, order)(())
    assert lps == [0.0]


def test_merge_keeps_the_higher_score_and_sorted_order():
    head = marginal_children(torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]), torch.tensor([[1, 7], [2, 3]]),
                             torch.zeros(2))
    trie, order = continuation_trie(LOOP, 4)
    merged = merge_children(head, trie_children(trie, PRIOR, order))
    lps, tokens, _ = merged(())
    assert tokens == [1, 7] and math.isclose(lps[0], -0.1, rel_tol=1e-6)  # float32: the head's -0.1 beats the trie's log(0.8)
    lps, tokens, _ = merged((1,))
    assert tokens == [2, 3] and lps == sorted(lps, reverse=True)
    lps, tokens, _ = merged((1, 2))  # past the head's depths, only the trie proposes
    assert sorted(tokens) == [3, 4]


def test_trie_tree_holds_both_branches_where_the_chain_holds_one():
    """At equal budget the trie's tree contains both earlier endings; the single-chain tree only the latest."""
    never = marginal_children(torch.full((4, 1), -20.0), torch.full((4, 1), 99), torch.zeros(4))
    trie, order = continuation_trie(LOOP, 4)
    trie_tree = build_tree(merge_children(never, trie_children(trie, PRIOR, order)), budget=6, depth=4)
    chain, chain_order = lookup_match(LOOP, 4)
    chain_tree = build_tree(with_lookup(never, chain, lookup_logprobs(PRIOR, chain_order, len(chain))), 6, 4)
    assert {3, 4} <= set(trie_tree.tokens)
    assert 4 in chain_tree.tokens and 3 not in chain_tree.tokens
