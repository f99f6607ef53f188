"""The measured budget chooser: argmax of expected tokens per second, exact counterfactual acceptance."""

import torch

import pytest

import modeling_jetspec.verifiers as verifiers
from modeling_jetspec.budget import BudgetController, choose_budget, committed_under_budgets
from modeling_jetspec.state import resolve_tree_shape
from modeling_jetspec.verifiers import measure_verify_seconds
from modeling_jetspec.tree import build_tree, entropy, marginal_children
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target


def test_choose_budget_is_the_argmax_of_tokens_per_second():
    tau = {8: 3.0, 16: 4.0, 32: 4.6, 64: 5.0}
    verify = {8: 1.2, 16: 1.4, 32: 2.0, 64: 3.5}
    # tokens per second: 8 -> 3/1.4=2.14, 16 -> 4/1.6=2.5, 32 -> 4.6/2.2=2.09, 64 -> 5/3.7=1.35
    assert choose_budget(tau, verify, outside_verify_seconds=0.2) == 16
    # free verification makes the largest tree best
    assert choose_budget(tau, {b: 1.0 for b in tau}, outside_verify_seconds=0.0) == 64
    # a costly draft flattens differences in verify cost: 32 wins at draft 10 (4.6/12 > 4/11.4 > 5/13.5)
    assert choose_budget(tau, verify, outside_verify_seconds=10.0) == 32


def test_smaller_best_first_trees_are_prefixes_of_larger_ones():
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(6, 40, generator=g) * 2, dim=-1)
    top_lp, top_tok = logp.topk(4, dim=-1)
    children = marginal_children(top_lp, top_tok, entropy(logp))
    big = build_tree(children, 64, 6)
    for b in (1, 8, 16, 32):
        small = build_tree(children, b, 6)
        assert small.tokens == big.tokens[:b] and small.parents == big.parents[:b]


def test_committed_under_budgets_counts_the_surviving_prefix():
    # accepted path: root, node 2, node 9, node 40 -> under budget 8 only node 2 survives
    assert committed_under_budgets([0, 2, 9, 40], (1, 8, 16, 64)) == {1: 1, 8: 2, 16: 3, 64: 4}


def test_controller_explores_then_exploits():
    controller = BudgetController([8, 16, 32], {8: 1.0, 16: 1.1, 32: 3.0}, explore_every=4)
    used = []
    for _ in range(8):
        b = controller.next_budget()
        used.append(b)
        # every accepted path reaches node 12 at most: budgets >= 16 commit 3 tokens, budget 8 commits 2
        controller.update([[0, 3, 12]], b, other_seconds=0.1)
    assert used[:2] == [32, 32]  # warm-up: the largest budget informs every smaller one
    assert used[2] == used[3] == 16  # 3/1.2 beats 2/1.1 and 3/3.1
    assert used[4] == 32  # exploration: one step above the choice (16)


def test_choose_budget_breaks_ties_towards_the_smaller_budget_and_refuses_gaps():
    # 8 and 16 give the same tokens per second (2 / 1.0 == 4 / 2.0): the smaller tree is as fast and cheaper
    assert choose_budget({8: 2.0, 16: 4.0}, {8: 0.9, 16: 1.9}, outside_verify_seconds=0.1) == 8
    with pytest.raises(ValueError, match=r"verify cost for every candidate budget, got none for \[32\]"):
        choose_budget({8: 2.0, 32: 3.0}, {8: 1.0}, outside_verify_seconds=0.0)
    with pytest.raises(ValueError, match="at least one candidate budget"):
        choose_budget({}, {8: 1.0}, outside_verify_seconds=0.0)


def test_controller_converges_to_the_best_budget_as_acceptance_changes():
    """Early paths stop at node 5 (budget 8 commits as much as 32 and is cheaper); later paths run through node 20,
    which only budget 32 holds: once the window forgets the short paths, the controller moves to 32. Exploration
    steps one budget above the choice every `explore_every` rounds (16 above 8 sees no gain: node 20 is past it)
    and verifies the largest every `explore_every * climb_every` rounds, which finds the gain two steps up."""
    controller = BudgetController([8, 16, 32], {8: 1.0, 16: 1.1, 32: 1.3}, explore_every=4, window=4, climb_every=2)
    used = []
    for round_ in range(24):
        b = controller.next_budget()
        used.append(b)
        path = [0, 5] if round_ < 8 else [0, 5, 20, 30]
        controller.update([path], b, other_seconds=0.0)
    assert used[:2] == [32, 32] and used[2] == used[3] == 8  # 2 tokens at every budget: the cheapest verify
    assert used[4] == 16  # exploration one step above 8
    assert used[8] == 32  # every explore_every * climb_every rounds: the largest
    first = used.index(32, 9)
    assert first <= 12 and used[-3:] == [32, 32, 32]  # 4 tokens / 1.3 s beats 2 / 1.0 and 2 / 1.1


def test_verify_costs_time_the_round_s_own_verify_over_the_head_s_trees(monkeypatch):
    target = tiny_target("llama")
    head = tiny_head(target, tree_depth=4, tree_width=3)
    verified = []
    verify = verifiers.verify

    def spy(target, head, state, trees, *args, **kwargs):
        verified.append((tuple(trees.tokens.shape), state.valid.shape))
        return verify(target, head, state, trees, *args, **kwargs)

    monkeypatch.setattr(verifiers, "verify", spy)
    shape = resolve_tree_shape(head.config)
    seconds = measure_verify_seconds(target, head, shape, [4, 12], batch_size=2, context_length=16, repeats=1)
    assert sorted(seconds) == [4, 12]
    # one warm-up and one timed forward per budget, over trees of exactly b nodes per row, after the 16-token context
    assert verified == [((2, 4), (2, 16))] * 2 + [((2, 12), (2, 16))] * 2


def test_auto_budget_decodes_losslessly():
    target = tiny_target("qwen3")
    ids, mask = prompts(3)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    head = oracle_head(target, plain, mask, tree_depth=5, tree_width=3)
    tree = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=head, tree_budget="auto"
    )
    assert torch.equal(tree, plain)
    budgets = head.last_stats.budgets
    assert set(budgets) <= {8, 16, 32, 64} and budgets[:2] == [64, 64]  # warm-up rounds verify the largest tree
    # the always-right drafter accepts whole paths whatever the budget: the cheapest verify then wins
    # after the warm-up the measured costs move it off the largest tree (which smaller one first depends on timings)
    assert min(budgets[2:]) < 64 and head.last_stats.tau > 4.0


def test_median_seconds_is_the_median_of_the_timed_calls():
    from modeling_jetspec.timing import median_seconds

    calls, naps = [], iter([0.0, 0.03, 0.001, 0.06, 0.002, 0.09])  # one untimed warm-up, then five timed calls

    def nap():
        import time

        calls.append(1)
        time.sleep(next(naps))

    seconds = median_seconds(nap, repeats=5, warmup=1)
    assert len(calls) == 6
    assert 0.03 <= seconds < 0.06  # the median of 0.03, 0.001, 0.06, 0.002, 0.09, whatever the clock's overhead


def test_bench_costs_time_the_round_s_own_draft_and_verify(monkeypatch):
    """`jetspec bench`'s costs come from the functions `generate` runs: the verify forwards are the round's `verify`
    over the head's `draft` trees of each budget, and the chain of the chain baseline."""
    from jetspec import bench

    target = tiny_target("llama")
    head = tiny_head(target, tree_depth=4, tree_width=3)
    verified = []
    verify = verifiers.verify

    def spy(target, head, state, trees, *args, **kwargs):
        verified.append(tuple(trees.tokens.shape))
        return verify(target, head, state, trees, *args, **kwargs)

    monkeypatch.setattr(verifiers, "verify", spy)
    ids, _ = prompts(1)
    costs = bench.measure_costs(target, head, ids, [4, 12], chain_depth=3, repeats=1)
    # per budget and for the chain: 2 untimed and 1 timed forward over one tree of exactly that many nodes
    assert verified == [(1, 4)] * 3 + [(1, 12)] * 3 + [(1, 3)] * 3
    assert [costs["verify"][b]["nodes"] for b in ("4", "12")] == [4, 12] and costs["chain"]["nodes"] == 3


def test_controller_counts_the_round_work_that_grows_with_the_tree():
    """Paths reach node 20, which only budget 32 holds (4 tokens against 2). Verify costs alone favour 32
    (4 / 1.3 s > 2 / 1.0 s); when the call's rounds at 32 also spend 1 s outside the verify (tree building,
    compaction) and those at 8 nothing, 32 costs 2.3 s a round and 8 wins (2 / 1.0 s > 4 / 2.3 s)."""
    verify = {8: 1.0, 16: 1.1, 32: 1.3}
    choices = {}
    for other_at_32 in (0.0, 1.0):
        controller = BudgetController([8, 16, 32], verify, explore_every=100, climb_every=100)
        for _ in range(2):  # warm-up: the largest budget
            assert controller.next_budget() == 32
            controller.update([[0, 5, 20, 30]], 32, other_seconds=other_at_32)
        controller.update([[0, 5, 20, 30]], 8, other_seconds=0.0)  # a round at 8, as an earlier choice would run
        choices[other_at_32] = controller.next_budget()
    assert choices == {0.0: 32, 1.0: 8}


def test_round_seconds_of_unobserved_budgets_scale_the_nearest_observed_per_node():
    controller = BudgetController([8, 16, 32], {8: 1.0, 16: 1.1, 32: 1.3})
    assert controller.round_seconds() == {8: 1.0, 16: 1.1, 32: 1.3}  # nothing observed: the verify alone
    controller.update([[0]], 32, other_seconds=0.8)
    assert controller.round_seconds() == pytest.approx({8: 1.2, 16: 1.5, 32: 2.1})  # 0.8 s per 32 nodes
    controller.update([[0]], 8, other_seconds=0.4)
    assert controller.round_seconds() == pytest.approx({8: 1.4, 16: 1.9, 32: 2.1})  # 16 scales 8's, the nearer
    # a verify timed in the call's own rounds replaces the up-front measurement of that budget
    controller.update([[0]], 32, other_seconds=0.8, verify_seconds=2.0)
    assert controller.round_seconds() == pytest.approx({8: 1.4, 16: 1.9, 32: 2.8})
