"""This host's costs (`modeling_jetspec/host_costs.py`): measured once per host, target, dtype and batch, cached in a
file, and the operating point of `tree_budget="auto"` they choose; decoding at it stays lossless."""

import copy
import json

import pytest
import torch

import modeling_jetspec.decode as decode
from modeling_jetspec import host_costs
from modeling_jetspec.host_costs import clear_costs, costs_key, costs_path, head_identity, read_costs
from modeling_jetspec.state import resolve_tree_shape
from jetspec.tiny import prompts, tiny_head, tiny_target

TABLE = {"head": {"4": 1.6, "8": 1.9}, "head+lookup": {"6": 1.8}, "head+lookup+trie": {"4": 1.7, "8": 2.1}}
LOOKUP = dict(tree_lookup=8, tree_lookup_branches="trie")


@pytest.fixture
def costs_file(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(path))
    return path


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)


def drafted_shapes(monkeypatch) -> list:
    """The (budget, lookup, branches) of every round's draft."""
    shapes = []
    original = decode.draft

    def spy(head, state, shape, budget, *args, **kwargs):
        shapes.append((budget, shape.lookup, shape.lookup_branches if shape.lookup else None))
        return original(head, state, shape, budget, *args, **kwargs)

    monkeypatch.setattr(decode, "draft", spy)
    return shapes


@pytest.mark.parametrize("batch", [1, 2])
def test_an_auto_head_with_a_table_decodes_as_plain_greedy(batch, costs_file, monkeypatch):
    target = tiny_target("qwen3")
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    head = tiny_head(target, tree_budget="auto", tau_by_budget=TABLE, **LOOKUP)
    out = greedy(target, ids, mask, max_new_tokens=24, assistant_model=head, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    point = out.jetspec_stats.operating_point
    assert point["reason"] == "chosen" and point["sources"] in TABLE and str(point["budget"]) in TABLE[point["sources"]]
    assert set(point["figures"]) == {f"{s}@{b}" for s, by in TABLE.items() for b in by}
    assert set(out.jetspec_stats.budgets) == {point["budget"]}  # one point for the whole call
    assert point["host_costs"] == costs_key(target, batch)
    # measured once for this host, target, dtype and batch, and written to the file
    (entry,) = read_costs(costs_file).values()
    assert sorted(entry["verify_ratio"]) == ["4", "6", "8"] and len(entry["overhead"]) == 3
    assert all(r > 0 for r in entry["verify_ratio"].values()) and entry["step_seconds"] > 0


def test_costs_come_from_the_file_once_measured(costs_file, monkeypatch):
    """A second head (nothing kept on it) reads the file and measures nothing; another batch size is measured anew."""
    target = tiny_target("llama")
    ids, mask = prompts(1)
    greedy(
        target, ids, mask, max_new_tokens=4, assistant_model=tiny_head(target, tree_budget="auto", tau_by_budget=TABLE)
    )
    measured = []
    for name in ("measure_step_seconds", "measure_verify_seconds", "measure_overhead_seconds"):
        original = getattr(host_costs, name)
        monkeypatch.setattr(host_costs, name, lambda *a, _f=original, _n=name, **k: measured.append(_n) or _f(*a, **k))
    head = tiny_head(target, tree_budget="auto", tau_by_budget=TABLE)
    out = greedy(target, ids, mask, max_new_tokens=4, assistant_model=head, return_dict_in_generate=True)
    assert measured == [] and out.jetspec_stats.operating_point["reason"] == "chosen"
    ids2, mask2 = prompts(2)
    greedy(target, ids2, mask2, max_new_tokens=4, assistant_model=head)
    assert measured[0] == "measure_step_seconds" and "measure_overhead_seconds" in measured
    assert len(read_costs(costs_file)) == 2  # batch 1 and batch 2
    assert clear_costs(costs_file) == 2 and read_costs(costs_file) == {} and not costs_file.exists()


@pytest.mark.parametrize(
    "ratios, overhead, expected",
    [
        # verifies that cost more steps with every node, a cheap head and a costly trie: the head alone, budget 4
        ({"4": 1.2, "6": 1.8, "8": 2.5}, {"head": 0.1, "head+lookup": 0.5, "head+lookup+trie": 0.9}, (4, 0, None)),
        # verifies that cost one step whatever the nodes: the largest tree with the trie
        ({"4": 1.0, "6": 1.0, "8": 1.0}, {"head": 0.1, "head+lookup": 0.1, "head+lookup+trie": 0.1}, (8, 8, "trie")),
    ],
)
def test_the_file_s_figures_decide_the_budget_and_sources_the_call_drafts(
    ratios, overhead, expected, costs_file, monkeypatch
):
    target = tiny_target("llama")
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    head = tiny_head(target, tree_budget="auto", tau_by_budget=TABLE, **LOOKUP)
    entry = {
        "step_seconds": 0.01,
        "verify_ratio": ratios,
        "overhead": {f"{head_identity(head)} {s}": c for s, c in overhead.items()},
    }
    costs_file.write_text(json.dumps({costs_key(target, 2): entry}))
    shapes = drafted_shapes(monkeypatch)
    out = greedy(target, ids, mask, max_new_tokens=16, assistant_model=head, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert set(shapes) == {expected}
    point = out.jetspec_stats.operating_point
    assert point["figures"]["head@4"]["verify_ratio"] == ratios["4"]


def test_a_head_without_a_table_decodes_exactly_as_budget_8(costs_file, monkeypatch):
    """The fallback: the same rounds, trees and tokens as the fixed default, and nothing measured or written."""
    target = tiny_target("qwen3")
    ids, mask = prompts(2)
    runs = {}
    for budget in ("auto", 8):
        head = tiny_head(target, tree_budget=budget, **LOOKUP)
        trees = []
        original = decode.draft

        def spy(*args, **kwargs):
            drafted = original(*args, **kwargs)
            trees.append((drafted.tokens.clone(), drafted.parents.clone()))
            return drafted

        monkeypatch.setattr(decode, "draft", spy)
        out = greedy(target, ids, mask, max_new_tokens=20, assistant_model=head, return_dict_in_generate=True)
        monkeypatch.setattr(decode, "draft", original)
        runs[budget] = (out, trees)
    (auto, auto_trees), (fixed, fixed_trees) = runs["auto"], runs[8]
    assert torch.equal(auto.sequences, fixed.sequences)
    assert len(auto_trees) == len(fixed_trees) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(auto_trees, fixed_trees)
    )
    assert auto.jetspec_stats.budgets == fixed.jetspec_stats.budgets == [8] * len(fixed_trees)
    assert auto.jetspec_stats.operating_point["reason"] == "fallback: no tau_by_budget"
    assert fixed.jetspec_stats.operating_point is None
    assert not costs_file.exists()


def test_the_key_names_the_host_target_dtype_and_batch():
    target = tiny_target("llama")
    keys = {costs_key(target, 1), costs_key(target, 2), costs_key(target.to(torch.bfloat16), 1)}
    assert len(keys) == 3
    other = tiny_target("llama", hidden_size=32, intermediate_size=64)
    assert costs_key(other, 1) != costs_key(tiny_target("llama"), 1)
    assert f"threads {torch.get_num_threads()}" in costs_key(other, 1)
    # the config's digest is kept per target and config object: another config object is read again
    before = costs_key(target, 1)
    changed = copy.deepcopy(target.config)
    changed.rms_norm_eps = 1e-3
    target.config = changed
    assert costs_key(target, 1) != before


def test_the_file_lives_beside_the_host_cache_unless_named(tmp_path, monkeypatch):
    monkeypatch.delenv("JETSPEC_HOST_COSTS", raising=False)
    monkeypatch.setenv("JETSPEC_HOST_CACHE", str(tmp_path / "facts" / "host.json"))
    assert costs_path() == tmp_path / "facts" / "host_costs.json"
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(tmp_path / "mine.json"))
    assert costs_path() == tmp_path / "mine.json"


def test_a_plain_step_is_one_token_after_the_context(monkeypatch):
    target = tiny_target("llama")
    lengths = []
    forward = type(target).forward

    def spy(self, input_ids=None, past_key_values=None, **kwargs):
        lengths.append((input_ids.shape, 0 if past_key_values is None else past_key_values.get_seq_length()))
        return forward(self, input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    monkeypatch.setattr(type(target), "forward", spy)
    seconds = host_costs.measure_step_seconds(target, 3, context_length=16, repeats=2)
    assert seconds > 0
    # the context once, then a warm-up and two timed steps, each after a fresh copy of the 16-token cache
    assert lengths == [(torch.Size([3, 16]), 0)] + [(torch.Size([3, 1]), 16)] * 3


def test_the_overhead_is_timed_in_a_real_call_with_the_sources(monkeypatch):
    """c: a short greedy call at budget 8 with the sources asked for, its rounds timed; seconds per round outside
    the verify forward."""
    target = tiny_target("llama")
    head = tiny_head(target, tree_budget="auto", **LOOKUP)
    shape = resolve_tree_shape(head.config)
    shapes = drafted_shapes(monkeypatch)
    seconds = host_costs.measure_overhead_seconds(target, head, shape, "head+lookup", 2, new_tokens=6)
    assert seconds > 0 and shapes and set(shapes) == {(8, 8, "chain")}
    shapes.clear()
    host_costs.measure_overhead_seconds(target, head, shape, "head", 1, new_tokens=6)
    assert set(shapes) == {(8, 0, None)}


@pytest.mark.parametrize("mode", ["auto", "chain", "tree"])
def test_a_hybrid_target_prices_the_verify_mode_it_runs_and_stays_lossless(mode, costs_file):
    """Recurrent layers: the plain step copies their state, the verify is timed in the call's mode (a key of its
    own), and decoding at the chosen point equals plain greedy."""
    from test_hybrid import VOCAB, hybrid_target

    target = hybrid_target("qwen3_next")
    ids, mask = prompts(2, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=12)
    head = tiny_head(target, tree_budget="auto", tau_by_budget=TABLE, **LOOKUP)
    out = greedy(
        target, ids, mask, max_new_tokens=12, assistant_model=head, tree_verify=mode, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    assert out.jetspec_stats.operating_point["host_costs"].endswith(f"| verify {mode}")
    assert list(read_costs(costs_file)) == [costs_key(target, 2, mode)]


@pytest.mark.parametrize("budget", ["auto", 8])
def test_jetspec_serve_times_the_costs_before_its_first_request(budget, costs_file):
    """`jetspec serve` (`serve.time_host_costs`, at start-up) measures an "auto" head's host costs for every batch up to
    its cap, so that no request waits for them; a head of a fixed budget needs none, and nothing is measured."""
    from test_bench import char_tokenizer

    from jetspec.serve import time_host_costs

    target = tiny_target("llama")
    head = tiny_head(target, tree_budget=budget, tau_by_budget=TABLE)
    time_host_costs(target, char_tokenizer(), head, max_batch=3)
    written = read_costs(costs_file)
    assert sorted(written) == (sorted(costs_key(target, b) for b in (1, 2, 3)) if budget == "auto" else [])
