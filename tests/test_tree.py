"""Tree construction, tree masks and acceptance, against brute-force references."""

import itertools
import math
import random

import pytest
import torch

from modeling_jetspec.candidate_generator import _expected_accepted
from modeling_jetspec.continuations import LookupRecord, chain_trie, merge_children, trie_children
from modeling_jetspec.state import DraftTrees
from modeling_jetspec.steps import accept
from modeling_jetspec.tree import (
    GAP_FANOUT_NATS,
    ancestor_mask,
    ancestor_mask_of,
    build_tree,
    cap_by_gap,
    check_tree_shape,
    entropy,
    lookup_logprobs,
    lookup_match,
    lookup_survival,
    marginal_children,
    max_tree_nodes,
    tree_key,
)


def with_chain(children, chain: list, survival: list | None = None):
    """The head's children with a lookup `chain` laid in as the round lays it (a trie of one continuation, merged):
    scored from `survival` (an order-1 prior: the fraction of such chains accepted to each depth), else first."""
    return merge_children(children, trie_children(chain_trie(chain), [survival] if survival else None, 1))


def tree_paths(tree):
    """The set of root-to-node token paths of a tree (root excluded)."""
    paths = [()]
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append(paths[parent] + (token,))
    return set(paths[1:])


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


def test_cap_by_gap_keeps_the_candidates_within_the_gap_of_the_best():
    lps, toks = [-0.1, -1.5, -2.2, -9.0], [5, 6, 7, 8]
    # (a) siblings within 2 nats of the best stay, the rest go; the best always stays
    assert cap_by_gap((lps, toks, 0.3), nats=2.0) == ([-0.1, -1.5], [5, 6], 0.3)
    assert cap_by_gap((lps, toks, 0.3), nats=2.5) == ([-0.1, -1.5, -2.2], [5, 6, 7], 0.3)
    # (b) a wide top-2 gap leaves one child: a confident depth spends no budget on siblings
    assert cap_by_gap(([-0.01, -6.0], [1, 2], 0.0), nats=2.0) == ([-0.01], [1], 0.0)
    assert cap_by_gap(None) is None


@pytest.mark.parametrize("depth,width,budget", [(3, 2, 5), (4, 3, 12), (5, 4, 40)])
@pytest.mark.parametrize("seed", range(5))
def test_gap_tree_is_the_best_first_tree_over_capped_children(depth, width, budget, seed):
    children = marginal_children(*random_depth_logits(depth, vocab=50, width=width, seed=seed))

    def capped(path):
        return cap_by_gap(children(path), GAP_FANOUT_NATS)

    tree = build_tree(children, budget, depth, "gap")
    assert tree_paths(tree) == brute_force_tree(capped, budget, depth, "logprob")
    # every node's children are within the gap of that node's best candidate
    for node in range(len(tree.tokens) + 1):
        kids = [tok for tok, parent in zip(tree.tokens, tree.parents) if parent == node]
        if kids:
            d = 0 if node == 0 else tree.depths[node - 1]
            lps, toks, _ = children((0,) * d)
            allowed = {int(t) for lp, t in zip(lps, toks) if float(lps[0]) - float(lp) <= GAP_FANOUT_NATS}
            assert set(kids) <= allowed


def test_gap_tree_goes_deeper_than_logprob_when_the_top_two_are_far_apart():
    # every depth: top-1 at -0.9, top-2 at -2.95 (a 2.05-nat gap): the depth-1 sibling (-2.95) outscores the depth-4
    # chain node (-3.6), so the logprob tree takes the sibling; the gap cap leaves one child per node
    lps = torch.tensor([[-0.9, -2.95, -3.0]] * 4)
    toks = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    children = marginal_children(lps, toks, torch.zeros(4))
    gap, plain = build_tree(children, 4, 4, "gap"), build_tree(children, 4, 4, "logprob")
    assert gap.tokens == [1, 4, 7, 10] and max(gap.depths) == 4
    assert max(plain.depths) < 4


def test_tree_is_well_formed_under_every_scoring():
    children = marginal_children(*random_depth_logits(6, vocab=40, width=3, seed=7))
    for scoring in ("logprob", "entropy", "mixed", "gap"):
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


@pytest.mark.parametrize("size", [0, 1, 16, 61, 62, 63, 130])
def test_ancestor_mask_of_host_lists_is_the_tensor_mask(size):
    # random trees of every shape, sizes on both sides of the 62-bit words the host mask packs
    rng = random.Random(size)
    parents = [[rng.randrange(node) for node in range(1, size + 1)] for _ in range(3)]
    parents.append(list(range(size)))  # one chain: the deepest tree of this size
    expected = ancestor_mask(torch.tensor(parents, dtype=torch.long).reshape(4, size))
    got = ancestor_mask_of(parents)
    assert got.dtype == torch.bool and got.shape == (4, size + 1, size + 1)
    assert torch.equal(got, expected)


def test_ancestor_mask_of_refuses_ragged_trees_and_forward_parents():
    with pytest.raises(ValueError, match="trees of one size"):
        ancestor_mask_of([[0, 0], [0]])
    with pytest.raises(ValueError, match=r"parent in \[0, node\), got parent 2 for node 2"):
        ancestor_mask_of([[0, 2]])


def stacked(trees):
    parents = torch.tensor([t.parents for t in trees])
    return DraftTrees(
        tokens=torch.tensor([t.tokens for t in trees]),
        parents=parents,
        depths=torch.tensor([[0] + t.depths for t in trees]),
        ancestors=ancestor_mask(parents),
        budget=len(trees[0].tokens),
    )


def walk(tree, choice):
    """Reference acceptance: from the root, move to the child holding the target's choice; stop when none does."""
    node, nodes, committed = 0, [0], []
    while True:
        committed.append(choice[node])
        child = next(
            (i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents), 1) if p == node and t == choice[node]), None
        )
        if child is None:
            return nodes, committed
        node = child
        nodes.append(child)


def test_accept_follows_target_choices_and_appends_bonus():
    # tree: 1:(10), 2:(11), 3: 10->12, 4: 12->13
    lists = {(): ([-0.1, -0.2], [10, 11], 0), (10,): ([-0.1], [12], 0), (10, 12): ([-0.1], [13], 0)}
    tree = build_tree(lists.get, 4, 3)
    assert tree.tokens == [10, 11, 12, 13] and tree.parents == [0, 0, 1, 3]
    for choice, nodes, committed in (
        ({0: 10, 1: 12, 3: 99}, [0, 1, 3], [10, 12, 99]),  # (a) agrees down to depth 2, then the bonus 99
        ({0: 11, 2: 5}, [0, 2], [11, 5]),  # (b) the second child of the root
        ({0: 42}, [0], [42]),  # (c) disagrees at the root: the bonus only
    ):
        logits = torch.zeros(1, 5, 200)
        for node in range(5):
            logits[0, node, choice.get(node, 150)] = 1.0
        acc = accept(logits, stacked([tree]), torch.arange(1))
        assert acc.paths() == [nodes]
        assert acc.tokens[0, : int(acc.count[0])].tolist() == committed


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_greedy_acceptance_equals_the_walk(seed):
    """Random trees and random target choices that often agree with the draft, several rows at once; the
    vectorized acceptance must pick the same nodes and tokens as walking each tree, and the per-row walk with an
    argmax chooser (the sampling/processor path) must agree too."""
    g = torch.Generator().manual_seed(seed)
    trees, choices = [], []
    for row in range(5):
        children = marginal_children(*random_depth_logits(4, vocab=12, width=3, seed=seed * 10 + row))
        tree = build_tree(children, 20, 4)
        trees.append(tree)
        choice = torch.randint(0, 12, (21,), generator=g)
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents), 1):  # agree often, not always
            if torch.rand(1, generator=g) < 0.4:
                choice[parent] = token
        choices.append(choice.tolist())
    logits = torch.full((5, 21, 12), -1.0)
    for row, choice in enumerate(choices):
        logits[row, torch.arange(21), torch.tensor(choice)] = 1.0
    batch = stacked(trees)
    fast = accept(logits, batch, torch.arange(5))

    def chooser(row, node_logits, path):
        return int(node_logits.argmax()), node_logits

    slow = accept(logits, batch, torch.arange(5), chooser)
    for row, tree in enumerate(trees):
        nodes, committed = walk(tree, choices[row])
        assert fast.paths()[row] == slow.paths()[row] == nodes
        assert fast.tokens[row, : len(committed)].tolist() == committed
        assert slow.tokens[row, : len(committed)].tolist() == committed
    assert any(len(p) > 1 and p != list(range(len(p))) for p in fast.paths()), "no non-contiguous path drawn"


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 3, 8, "logprob", 8), r"tree_depth in \[1, 7\]"),
        ((8, 3, 8, "logprob", 8), r"tree_depth in \[1, 7\] \(block_size - 1 of this head\), got 8"),
        ((4, 0, 8, "logprob", 8), "tree_width >= 1, got 0"),
        ((4, 3, 0, "logprob", 8), "tree_budget >= 1 draft node or 'auto', got 0"),
        ((4, 3, True, "logprob", 8), "tree_budget >= 1 draft node or 'auto', got True"),
        ((4, 3, 8, "random", 8), "tree_scoring in .*got 'random'"),
        ((4, 3, 8, "logprob", 8, False, 65), r"tree_lookup in \[0, 64\] \(tokens of the lookup chain\), got 65"),
        ((4, 3, 8, "logprob", 8, False, -1), r"tree_lookup in \[0, 64\]"),
        ((4, 3, 8, "logprob", 8, True, 2), "tree_lookup=0 with path_conditioning=True"),
    ],
)
def test_tree_shape_checks(args, message):
    with pytest.raises(ValueError, match=message):
        check_tree_shape(*args)
    check_tree_shape(4, 3, "auto", "mixed", 8)  # and a valid shape passes


def test_lookup_match_takes_the_most_recent_longest_match():
    # last 3 tokens (7, 8, 9) occurred at 1..3 and 6..8: the most recent one wins, continuation 4, 5, 6
    seq = [1, 7, 8, 9, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8, 9]
    assert lookup_match(seq, 2)[0] == [4, 5]
    assert lookup_match(seq, 10)[0] == [4, 5, 6, 7, 8, 9]  # runs up to the end of the sequence
    assert lookup_match([5, 1, 2, 6, 2], 3)[0] == [6, 2]  # no 3- or 2-gram match: the last 1-gram
    assert lookup_match([1, 2, 3], 4)[0] == []
    assert lookup_match([4], 4)[0] == []
    # the match's order comes with it
    assert lookup_match(seq, 2) == ([4, 5], 3)
    assert lookup_match([5, 1, 2, 6, 2], 3) == ([6, 2], 1)
    assert lookup_match([5, 1, 2, 6, 1, 2], 3) == ([6, 1, 2], 2)
    assert lookup_match([1, 2, 3], 4) == ([], 0)


def test_lookup_logprobs_are_the_prior_s_conditional_odds():
    prior = [[0.25, 0.125], [0.5, 0.4, 0.3], [0.9, 0.81]]
    assert lookup_logprobs(prior, 1, 2) == pytest.approx([math.log(0.25), math.log(0.5)])
    assert lookup_logprobs(prior, 2, 3) == pytest.approx([math.log(0.5), math.log(0.8), math.log(0.75)])
    # past the measured depths: the last ratio again; their sum is the chain's whole log-odds
    assert lookup_logprobs(prior, 3, 4) == pytest.approx([math.log(0.9)] * 4)
    assert lookup_logprobs(prior, 3, 0) == []


def test_one_lookup_survival_serves_the_tree_the_trie_the_record_and_the_chain_drafter():
    prior = [[0.5], [0.6, 0.3], [0.9, 0.72, 0.36]]
    # measured depths as they are; past them the last measured ratio again (s(1) itself with one depth measured)
    assert lookup_survival(prior, 1, 3) == pytest.approx([0.5, 0.25, 0.125])
    assert lookup_survival(prior, 2, 4) == pytest.approx([0.6, 0.3, 0.15, 0.075])
    assert lookup_survival(prior, 3, 5) == pytest.approx([0.9, 0.72, 0.36, 0.18, 0.09])
    assert lookup_survival(prior, 3, 2) == pytest.approx([0.9, 0.72])
    # the tree's conditional log-odds add up to the survival's log at every depth
    assert list(itertools.accumulate(lookup_logprobs(prior, 2, 4))) == pytest.approx(
        [math.log(s) for s in lookup_survival(prior, 2, 4)]
    )
    # the chain drafter's expected accepted length of a 4-token chain: its survivals summed
    assert _expected_accepted(prior, 2, 4) == pytest.approx(0.6 + 0.3 + 0.15 + 0.075)
    # a trie of one occurrence scores each depth as the chain does (its child holds the whole count)
    trie_scores = trie_children(chain_trie([4, 5, 6]), prior, 3)
    assert [trie_scores(path)[0][0] for path in [(), (4,), (4, 5)]] == pytest.approx(lookup_logprobs(prior, 3, 3))
    # a record without observations of a row leaves the prior as it is
    assert LookupRecord().prior(0, prior, 2, 4) is prior


def test_lookup_chain_comes_first_and_the_head_fills_the_budget():
    top_lp = torch.log(torch.tensor([[0.6, 0.3, 0.1]] * 3))
    top_tok = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    children = marginal_children(top_lp, top_tok, torch.zeros(3))
    chain = [11, 99, 30]  # depth 1 shares the head's second candidate; 99 is not among the head's
    tree = build_tree(with_chain(children, chain), budget=6, depth=3)
    paths = [p for p in sorted(tree_paths(tree), key=len)]
    assert {(11,), (11, 99), (11, 99, 30)} <= set(paths)
    assert tree.tokens[:3] == chain and tree.parents[:3] == [0, 1, 2]  # the chain is built first
    # the rest is the head's best-first tree: (10,), (10, 20) and (11, 20), without a second (11,)
    head_only = build_tree(children, budget=3, depth=3)
    assert tree_paths(head_only) | {(11,), (11, 99), (11, 99, 30)} >= set(paths) - {(11, 20)}
    assert sum(1 for p in paths if p == (11,)) == 1 and len(tree.tokens) == 6
    # no chain: the head's own tree
    plain = build_tree(with_chain(children, []), budget=6, depth=3)
    assert plain.tokens == build_tree(children, budget=6, depth=3).tokens


def test_a_scored_lookup_chain_takes_only_the_nodes_it_earns():
    top_lp = torch.log(torch.tensor([[0.6, 0.3, 0.1]] * 3))
    top_tok = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    children = marginal_children(top_lp, top_tok, torch.zeros(3))
    chain = [12, 99, 98]
    # a likely chain (0.95 per token) outranks everything: built first, as an unscored one
    sure = build_tree(with_chain(children, chain, [0.95, 0.95**2, 0.95**3]), budget=5, depth=3)
    assert sure.tokens[:3] == chain and sure.parents[:3] == [0, 1, 2]
    # an unlikely one (0.05 at depth 1) loses to the head's nodes: a budget of 3 holds none of it
    weak = with_chain(children, chain, [0.05, 0.05 * 0.9, 0.05 * 0.9 * 0.9])
    assert build_tree(weak, budget=3, depth=3).tokens == build_tree(children, budget=3, depth=3).tokens
    # children lists stay sorted, and a chain token the head also proposes keeps the higher of the two scores
    lps, toks, _ = weak(())
    assert list(lps) == sorted(lps, reverse=True) and toks.count(12) == 1
    assert lps[toks.index(12)] == pytest.approx(math.log(0.1))
    lps, toks, _ = weak((12,))
    assert toks[0] == 99 and lps[0] == pytest.approx(math.log(0.9)) and len(toks) == 4
    # off the chain's path: the head's candidates only
    assert weak((10,))[1] == children((10,))[1]


def test_the_lookup_prior_comes_from_the_head_unless_the_call_sets_it():
    from modeling_jetspec import JetSpecConfig
    from modeling_jetspec.state import resolve_tree_shape

    prior = [[0.2], [0.5], [0.9]]
    config = JetSpecConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_num_hidden_layers=4,
        block_size=8,
        tree_lookup=3,
        tree_lookup_prior=prior,
    )
    assert resolve_tree_shape(config).lookup_prior == prior
    assert resolve_tree_shape(config, tree_lookup_prior=False).lookup_prior is None  # the chain first, this call
    assert resolve_tree_shape(config, tree_lookup_prior=[[0.1]]).lookup_prior == [[0.1]]
    assert JetSpecConfig.from_dict(config.to_dict()).tree_lookup_prior == prior  # saved with the head


def test_each_tree_setting_is_a_head_default_and_a_per_call_override():
    """`TREE_FIELDS` names the tree settings once (the config stores them, `generate` takes them per call, the bench
    records them): a value of each, as the head's default or as the call's, reaches the call's tree shape and changes
    nothing else in it. A setting some lookups need is given with its companions (`companions`) on both sides."""
    from dataclasses import asdict

    from modeling_jetspec import JetSpecConfig
    from modeling_jetspec.configuration_jetspec import TREE_FIELDS
    from modeling_jetspec.state import resolve_tree_shape

    other = {
        "tree_depth": 3,
        "tree_width": 2,
        "tree_budget": 5,
        "tree_scoring": "entropy",
        "path_conditioning": True,
        "tree_lookup": 6,
        "tree_lookup_prior": [[0.5, 0.4], [0.9]],
        "tree_lookup_branches": "trie",
        "tree_lookup_record": True,
        "tree_calibration": {"1:head": [0.1 * b for b in range(10)]},
    }
    companions = {"tree_lookup_record": {"tree_lookup": 4, "tree_lookup_prior": [[0.3]]}}
    assert sorted(other) == sorted(TREE_FIELDS)
    sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, target_num_hidden_layers=4)
    for name, value in other.items():
        given = companions.get(name, {})
        before = asdict(resolve_tree_shape(JetSpecConfig(block_size=8, **sizes, **given)))
        for shape in (
            resolve_tree_shape(JetSpecConfig(block_size=8, **sizes, **given, **{name: value})),  # the head's default
            resolve_tree_shape(JetSpecConfig(block_size=8, **sizes, **given), **{name: value}),  # the call's
        ):
            changed = {field: v for field, v in asdict(shape).items() if v != before[field]}
            assert list(changed.values()) == [value], (name, changed)
