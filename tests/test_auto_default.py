"""A head whose config says `tree_budget="auto"` (the shipped default to be) works on every path: the static path
decodes at the call's operating point, the bench's path-conditioning method runs a fixed budget, offline scoring and
the shipping judgement take the fallback point (budget 8, the head's own sources), serve and `jetspec generate`
report the point, the transformers-loop chain generator ignores the budget; every output equals plain greedy.

Host costs go to a file of this module (`JETSPEC_HOST_COSTS`), measured once per host, target, dtype and batch.
"""

import json

import pytest
import torch

import modeling_jetspec.integration as integration
from jetspec.bench import BenchConfig, path_conditioning_budget, run_benchmark
from jetspec.serve_batching import split_stats
from jetspec.serve_requests import tree_report
from jetspec.tiny import prompts, tiny_head, tiny_target
from modeling_jetspec.budget import FALLBACK_BUDGET, sources_shape
from modeling_jetspec.candidate_generator import chain_generate
from modeling_jetspec.host_costs import costs_key
from modeling_jetspec.state import resolve_tree_shape
from modeling_jetspec.static import tree_nodes
from test_bench import char_tokenizer
from test_evaluate_head import LOOKUP, greedy_rows, real_tau
from test_static import eos_case, greedy
from test_training import sharp_target
from training import evaluate_head
from training.eval_rows import forward_features, prepare_rows
from training.offline_scorer import OfflineScorer
from training.shipping import shipped_tree_budget, stage_head
from training.tau_table import tau_table

TABLE = {"head": {"4": 1.6, "8": 1.9}, "head+lookup": {"6": 1.8}, "head+lookup+trie": {"4": 1.7, "8": 2.1}}
TRIE = dict(tree_lookup=8, tree_lookup_branches="trie")
FORCED = {  # a table of one candidate: the point it chooses, whatever this host's costs
    "head": {"head": {"4": 2.0}},
    "head+lookup": {"head+lookup": {"6": 2.0}},
    "head+lookup+trie": {"head+lookup+trie": {"8": 2.0}},
}


@pytest.fixture(autouse=True)
def costs_file(tmp_path_factory, monkeypatch):
    """One host-costs file for the module: a point measured once serves the later tests of the same batch."""
    path = tmp_path_factory.getbasetemp() / "auto-default-costs.json"
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(path))
    return path


def auto_head(target, table=TABLE, **fields):
    return tiny_head(target, tree_budget="auto", tau_by_budget=table, **{**TRIE, **fields})


# ------------------------------------------------------------------------------------------------ (1) the static path
@pytest.mark.parametrize("sources", list(FORCED))
def test_the_static_path_decodes_an_auto_head_at_its_point_with_rows_finishing_apart(sources, verifiers):
    target = tiny_target("llama")
    ids, mask, _, plain, eos = eos_case(target, 2, 24)
    head = auto_head(target, FORCED[sources])
    out = greedy(
        target,
        ids,
        mask,
        max_new_tokens=24,
        eos_token_id=eos,
        assistant_model=head,
        jetspec_static="eager",
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    point = out.jetspec_stats.operating_point
    (budget,) = (int(b) for b in FORCED[sources][sources])
    assert (point["sources"], point["budget"], point["reason"]) == (sources, budget, "chosen")
    assert point["host_costs"] == costs_key(target, 2)  # chosen for this call's batch
    (verifier,) = verifiers
    chosen = sources_shape(resolve_tree_shape(head.config), sources, budget)
    assert verifier.shape == chosen and verifier.nodes == tree_nodes(chosen)
    assert set(out.jetspec_stats.budgets) == {budget}  # one point for the whole call


def test_the_static_and_default_paths_choose_the_same_point_and_cache_implementation_static_takes_it(verifiers):
    target = tiny_target("qwen3")
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    head = auto_head(target)
    kwargs = dict(max_new_tokens=16, assistant_model=head, return_dict_in_generate=True)
    default = greedy(target, ids, mask, **kwargs)
    static = greedy(target, ids, mask, cache_implementation="static", **kwargs)
    for out in (default, static):
        assert torch.equal(out.sequences, plain)
    assert static.jetspec_stats.operating_point == default.jetspec_stats.operating_point  # the same cached costs
    point = static.jetspec_stats.operating_point
    assert point["reason"] == "chosen" and verifiers[0].shape.budget == point["budget"]


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_the_static_path_runs_a_head_without_a_table_at_the_fallback_point(mode, verifiers):
    target = tiny_target("llama")
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=12)
    head = tiny_head(target, tree_budget="auto", **TRIE)
    out = greedy(
        target, ids, mask, max_new_tokens=12, assistant_model=head, jetspec_static=mode, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain) and verifiers[0].compiled == (mode == "compile")
    point = out.jetspec_stats.operating_point
    assert (point["budget"], point["sources"]) == (FALLBACK_BUDGET, "head+lookup+trie")
    assert point["reason"].startswith("fallback") and verifiers[0].nodes == FALLBACK_BUDGET


def test_a_static_verifier_is_not_planned_at_auto():
    target = tiny_target("llama")
    head = auto_head(target)
    shape = resolve_tree_shape(head.config)
    verifier = integration.static_verifier(target, head, shape, integration.verifier_for(target, head), "eager")
    assert verifier.nodes is None  # sized when the point is chosen
    with pytest.raises(ValueError, match="expected the call's tree at its operating point .* got budget 'auto'"):
        verifier.plan(1, target.generation_config)


# ------------------------------------------------------------------------------------------------ (2) the bench
def test_the_bench_of_an_auto_head_runs_path_conditioning_at_the_largest_budget(tmp_path):
    target = tiny_target("llama", max_position_embeddings=4096)
    head = auto_head(target, tree_depth=4, tree_width=3, tree_lookup=6, tree_lookup_branches="chain")
    methods = ("plain", "tree", "auto", "path_conditioning", "lookup")
    config = BenchConfig(["gsm8k"], [4, 12], 8, limit=1, methods=methods, warmup=False, cost_repeats=1)
    results = run_benchmark(target, char_tokenizer(), head, config, tmp_path, progress=False)  # raises on a mismatch
    arguments = results["config"]["method_arguments"]
    assert arguments["tree-12-pc"] == {"tree_budget": 12, "path_conditioning": True, "tree_lookup": 0}
    assert arguments["auto"] == {"tree_budget": "auto"}
    assert all(row["equality"] == "exact" for row in results["prompts"])
    auto = next(row for row in results["prompts"] if row["method"] == "auto")
    assert auto["operating_point"]["reason"] == "chosen"
    assert results["config"]["head_config"]["tree_budget"] == "auto"


def test_the_path_conditioning_budget_is_the_head_s_own_when_fixed():
    assert path_conditioning_budget(32, [8, 16]) == 32
    assert path_conditioning_budget("auto", [8, 16, 4]) == 16


# ------------------------------------------------------------------------------------------------ (3) offline defaults
def test_offline_defaults_of_an_auto_head_are_its_fallback_point_as_real_decoding_runs_it():
    """`offline_tau` at the defaults of an "auto" head scores budget 8 with its own sources (and says so): the tau
    real decoding of that head reaches without a table, and what a fixed 8 reaches; an explicit budget wins."""
    target = sharp_target()
    rows = greedy_rows(target, count=4, new_tokens=16)
    head = tiny_head(target, **{**LOOKUP, "tree_budget": "auto"}).eval()
    fetch = forward_features(target, head)
    result = evaluate_head.offline_tau(head, rows, fetch=fetch, max_new_tokens=16)
    assert result["budget"] == FALLBACK_BUDGET
    assert result["tau"] == pytest.approx(real_tau(target, head, rows, "auto", 16))  # no table: the fallback
    assert result["tau"] == pytest.approx(real_tau(target, head, rows, FALLBACK_BUDGET, 16))
    with_table = tiny_head(target, **{**LOOKUP, "tree_budget": "auto"}, tau_by_budget=TABLE).eval()
    assert evaluate_head.offline_tau(with_table, rows, fetch=fetch, max_new_tokens=16)["tau"] == result["tau"]
    assert evaluate_head.tree_shape(head, 4).budget == 4
    assert evaluate_head.tree_shape(head).lookup_branches == "trie"  # its own sources
    with pytest.raises(ValueError, match="expected a fixed tree budget for offline evaluation .*got 'auto'"):
        evaluate_head.tree_shape(head, "auto")


def test_the_tau_table_of_an_auto_head_is_the_fixed_head_s(tmp_path):
    target = sharp_target()
    rows = greedy_rows(target, count=3, new_tokens=12)
    fixed = tiny_head(target, **LOOKUP).eval()
    auto = tiny_head(target, **{**LOOKUP, "tree_budget": "auto"}).eval()
    prepared, _ = prepare_rows(rows, forward_features(target, fixed), 12, fixed.config.tree_depth)
    sources = ("head", "head+lookup+trie")
    assert tau_table(auto, prepared, (4, 8), sources) == tau_table(fixed, prepared, (4, 8), sources)


@pytest.mark.parametrize("budgets", [["auto"], [8, "auto"], [], [0]], ids=["auto", "mixed", "none", "zero"])
def test_the_offline_scorer_refuses_budgets_it_cannot_score_before_work(budgets, tmp_path):
    with pytest.raises(ValueError, match="expected fixed tree budgets, integers >= 1, to score offline, got"):
        OfflineScorer(tmp_path / "no-store", budgets, rows=4, new_tokens=8, lookup_settings=None, batch_size=2)


def test_an_auto_shipped_head_is_judged_at_its_fallback_budget_and_stays_auto_when_replaced(tmp_path):
    """The judgement reads budget 8 (the fallback point) for an "auto" head and records it; the new head ships with
    `tree_budget="auto"` (its candidate too), without the old head's table; a fixed shipped budget is not carried."""
    from test_scripts import load_script
    from test_ship_decision import bench_results, write_results

    ship = load_script("ship_decision")
    target = tiny_target()
    new, shipped = tmp_path / "new", tmp_path / "shipped"
    tiny_head(target, seed=1).save_pretrained(new)
    tiny_head(target, seed=2, tree_budget="auto", tau_by_budget=TABLE).save_pretrained(shipped)
    assert shipped_tree_budget(shipped) == "auto" and shipped_tree_budget(new) is None
    new, shipped = str(new), str(shipped)
    out = tmp_path / "results"
    write_results(out, new, shipped, bench_results(tmp_path / "bench", new, shipped, target))
    common = ["--results", str(out), "--new", new, "--shipped", shipped]
    ship.main([*common, "--candidate", str(tmp_path / "candidate")])
    assert json.loads((tmp_path / "candidate" / "config.json").read_text())["tree_budget"] == "auto"
    decision = ship.main([*common, "--apply"])
    assert decision["ships"] and decision["defaults_budget"] == FALLBACK_BUDGET == 8
    config = json.loads((tmp_path / "shipped" / "config.json").read_text())
    assert config["tree_budget"] == "auto" and config.get("tau_by_budget") is None  # the table measured the old head
    with pytest.raises(ValueError, match="expected tree_budget 'auto' or None to stage a head with, got 8"):
        stage_head(new, tmp_path / "elsewhere", tree_budget=8)


# ------------------------------------------------------------------------------------------------ (4) other readers
def test_the_chain_generator_decodes_an_auto_head_as_plain_greedy():
    target = tiny_target("llama")
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    head = auto_head(target)
    chained = target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=16,
        custom_generate=chain_generate,
        jetspec_head=head,
    )
    assert torch.equal(chained, plain)
    assert head.last_candidate_generator.depth == head.config.tree_depth


def test_the_memory_bound_of_an_auto_call_counts_the_lookup_branch_it_may_choose(monkeypatch):
    """A head without a lookup branch of its own may decode at a point with one (`budget.LOOKUP_TOKENS`): a 1-node
    tree (depth 1, width 1) is bounded as the 16 nodes such a point can verify."""
    target = tiny_target("llama")
    head = tiny_head(target, tree_budget="auto", tree_depth=1, tree_width=1, tree_lookup=0)
    monkeypatch.setattr(integration, "device_memory", lambda device: 1)
    shape = resolve_tree_shape(head.config)
    with pytest.raises(ValueError, match=r"got tree_budget='auto' \(up to 16 nodes per row"):
        integration.check_tree_bounds(shape, head, target, 1, 8)
    fixed = resolve_tree_shape(head.config, tree_budget=8)
    with pytest.raises(ValueError, match=r"got tree_budget=8 \(up to 1 nodes per row"):
        integration.check_tree_bounds(fixed, head, target, 1, 8)


# ------------------------------------------------------------------------------------------------ (5) serve, generate
def test_serve_rows_of_one_batched_call_report_its_operating_point():
    from test_serve_batching import decode_together, one_client

    target = tiny_target("llama", vocab_size=100, max_position_embeddings=1024)
    served = (target, char_tokenizer(), auto_head(target, tree_depth=4, tree_width=3, tree_lookup=6))
    specs = [dict(text="abc abc abc", max_tokens=10), dict(text="Name a colour.", max_tokens=6)]
    rows, _ = decode_together(served, specs)
    for row, spec in zip(rows, specs):
        assert row.job.new_ids == one_client(served, spec["text"], spec["max_tokens"])[0]
        point = row.job.report["operating_point"]
        assert point["reason"] == "chosen" and point["host_costs"] == costs_key(target, 2)


def test_tree_report_and_split_stats_carry_the_point():
    target = tiny_target("llama")
    ids, mask = prompts(2)
    out = greedy(target, ids, mask, max_new_tokens=6, assistant_model=auto_head(target), return_dict_in_generate=True)
    stats = out.jetspec_stats
    point = stats.operating_point
    assert tree_report(stats, out.sequences[0, ids.shape[1] :].tolist(), 0.1)["operating_point"] == point
    assert [row.operating_point for row in split_stats(stats, [6, 6])] == [point, point]


def test_jetspec_generate_with_an_auto_head_prints_its_point(capsys, tmp_path):
    from test_cli import run_generate

    target = tiny_target("llama", max_position_embeddings=4096)
    head = auto_head(target)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["tree_budget"] == "auto"
    run_generate(tmp_path / "target", tmp_path / "head")  # no --budget: the head's default
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("operating point: budget "))
    budget = line.split()[3].rstrip(",")
    assert f"jetspec (B={budget}):" in printed and "same tokens as plain greedy" in printed
