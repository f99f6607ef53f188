"""The operating point of `tree_budget="auto"`: the chooser (the argmax of expected speed over budgets and draft
sources), the head's `tau_by_budget` field, and the verify costs it is weighed against."""

import json
import math

import pytest
import torch

import modeling_jetspec.verifiers as verifiers
from modeling_jetspec import JetSpecConfig
from modeling_jetspec.budget import (
    CANDIDATE_BUDGETS,
    LOOKUP_TOKENS,
    candidates,
    check_tau_by_budget,
    choose_point,
    fallback_point,
    sources_shape,
)
from modeling_jetspec.state import TreeShape, resolve_tree_shape
from modeling_jetspec.verifiers import measure_verify_seconds
from modeling_jetspec.tree import build_tree, entropy, marginal_children
from jetspec.tiny import prompts, tiny_head, tiny_target

TABLE = {
    "head": {4: 2.0, 8: 2.3, 16: 2.5},
    "head+lookup+trie": {4: 2.2, 8: 2.9, 16: 3.4},
}
SHAPE = TreeShape(depth=7, width=4, budget="auto", scoring="logprob", path_conditioning=False, lookup=16)


def test_the_head_alone_wins_on_a_costly_host_and_the_full_tree_on_a_cheap_one():
    """The same head's table on two hosts. Where a verify of 16 nodes costs 3.5 plain steps and the trie's host work
    0.6 of one (an AVX2 host in float32), the head alone at budget 4 is fastest: 2.0 / (1.5 + 0.1) = 1.25 against
    at most 2.9 / (2.0 + 0.6) = 1.12 with the trie. Where verifies are nearly free (bf16 on AMX), the trie at budget
    16 is: 3.4 / (1.05 + 0.2) = 2.72 against 2.5 / (1.05 + 0.15) = 2.08 for the head alone."""
    costly = choose_point(TABLE, {4: 1.5, 8: 2.0, 16: 3.5}, {"head": 0.1, "head+lookup+trie": 0.6}, SHAPE)
    cheap = choose_point(TABLE, {4: 1.0, 8: 1.0, 16: 1.05}, {"head": 0.15, "head+lookup+trie": 0.2}, SHAPE)
    assert (costly.budget, costly.sources) == (4, "head")
    assert (cheap.budget, cheap.sources) == (16, "head+lookup+trie")
    assert costly.expected_speedup == pytest.approx(1.25) and cheap.expected_speedup == pytest.approx(2.72)
    # every candidate's figures are recorded, and none beats the chosen one
    assert set(cheap.figures) == {f"{s}@{b}" for s in TABLE for b in (4, 8, 16)}
    assert cheap.figures["head@16"]["tau"] == 2.5 and cheap.figures["head@16"]["verify_ratio"] == 1.05
    assert max(f["expected_speedup"] for f in costly.figures.values()) == costly.expected_speedup
    assert cheap.reason == "chosen" and cheap.as_dict()["sources"] == "head+lookup+trie"


def test_ties_go_to_the_smaller_budget_and_the_fewer_sources():
    table = {"head": {4: 2.0, 8: 3.0}, "head+lookup": {4: 2.0}}
    point = choose_point(table, {4: 1.0, 8: 1.5}, {"head": 0.0, "head+lookup": 0.0}, SHAPE)
    assert (point.budget, point.sources) == (4, "head")  # 2 / 1 == 3 / 1.5, and head+lookup@4 ties too


def test_only_budgets_the_tree_can_hold_are_weighed():
    """Depth 2, width 3: the head's full tree has 12 nodes, so its 16 is left out; a lookup branch adds up to 16
    nodes, so the sources with lookup keep 16. Budgets outside the candidate set are never weighed."""
    shape = TreeShape(depth=2, width=3, budget="auto", scoring="logprob", path_conditioning=False)
    table = {"head": {4: 2.0, 16: 9.0, 20: 9.0}, "head+lookup": {16: 3.0}}
    assert candidates(table, shape) == {"head": [4], "head+lookup": [16]}
    point = choose_point(table, {4: 1.0, 16: 1.0}, {"head": 0.0, "head+lookup": 0.0}, shape)
    assert (point.budget, point.sources) == (16, "head+lookup")
    with pytest.raises(ValueError, match="expected tau_by_budget budgets among .* got"):
        choose_point({"head": {20: 3.0}}, {}, {}, shape)
    with pytest.raises(ValueError, match="expected host costs for budget 4 and sources 'head', got none"):
        choose_point({"head": {4: 3.0}}, {}, {}, shape)
    assert max(CANDIDATE_BUDGETS) == 16


def test_sources_switch_the_lookup_branch_and_keep_the_rest_of_the_shape():
    shape = TreeShape(
        depth=5, width=3, budget="auto", scoring="logprob", path_conditioning=False, lookup=8, lookup_branches="trie"
    )
    alone, chain, trie = (sources_shape(shape, s, 6) for s in ("head", "head+lookup", "head+lookup+trie"))
    assert (alone.budget, alone.lookup) == (6, 0)
    assert (chain.lookup, chain.lookup_branches) == (8, "chain") and (trie.lookup, trie.lookup_branches) == (8, "trie")
    assert (trie.depth, trie.width, trie.scoring) == (5, 3, "logprob")
    no_lookup = TreeShape(depth=5, width=3, budget="auto", scoring="logprob", path_conditioning=False)
    assert sources_shape(no_lookup, "head+lookup", 4).lookup == LOOKUP_TOKENS
    assert fallback_point(shape).as_dict() == {
        "budget": 8,
        "sources": "head+lookup+trie",
        "expected_speedup": None,
        "reason": "fallback: no tau_by_budget",
        "figures": {},
        "host_costs": None,
    }
    assert fallback_point(no_lookup).sources == "head"
    with pytest.raises(ValueError, match="expected sources among"):
        sources_shape(shape, "trie", 4)


@pytest.mark.parametrize(
    "table, message",
    [
        ([2.0], r"expected tau_by_budget to be a non-empty dict .*got \[2.0\]"),
        ({}, "expected tau_by_budget to be a non-empty dict .*got {}"),
        ({"trie": {"8": 2.0}}, r"expected tau_by_budget's sources among .*got 'trie'"),
        ({"head": 2.0}, r"expected tau_by_budget\['head'\] to be a non-empty dict .*got 2.0"),
        ({"head": {"eight": 2.0}}, r"expected tau_by_budget budgets among \(4, 6, 8, 10, 12, 16\) .*got 'eight'"),
        ({"head": {"0": 2.0}}, "expected tau_by_budget budgets among .*got '0'"),
        ({"head": {"32": 2.0}}, "expected tau_by_budget budgets among .*got '32'"),
        ({"head": {"8": 0.5}}, r"expected tau_by_budget\['head'\]\['8'\] to be a number >= 1 .*got 0.5"),
        ({"head": {"8": math.nan}}, "to be a number >= 1 .*got nan"),
        ({"head": {"8": "2.0"}}, "to be a number >= 1 .*got '2.0'"),
    ],
)
def test_bad_tables_are_refused_when_the_config_loads(table, message, tmp_path):
    target = tiny_target("llama")
    tiny_head(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tau_by_budget"] = table
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        JetSpecConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        check_tau_by_budget(table)


def test_a_table_survives_its_json_round_trip(tmp_path):
    target = tiny_target("llama")
    head = tiny_head(target, tau_by_budget={"head": {4: 2, 8: 2.5}})  # kept as given
    assert check_tau_by_budget(head.config.tau_by_budget) == {"head": {4: 2.0, 8: 2.5}}
    head.save_pretrained(tmp_path)
    assert JetSpecConfig.from_pretrained(tmp_path).tau_by_budget == {"head": {"4": 2, "8": 2.5}}  # JSON keys
    assert tiny_head(target).config.tau_by_budget is None


def test_smaller_best_first_trees_are_prefixes_of_larger_ones():
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(6, 40, generator=g) * 2, dim=-1)
    top_lp, top_tok = logp.topk(4, dim=-1)
    children = marginal_children(top_lp, top_tok, entropy(logp))
    big = build_tree(children, 64, 6)
    for b in (1, 8, 16, 32):
        small = build_tree(children, b, 6)
        assert small.tokens == big.tokens[:b] and small.parents == big.parents[:b]


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
