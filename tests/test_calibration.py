"""Calibrated node scores (modeling_jetspec/calibration.py): a map read from a config is checked by name, ranks a
tree's children by their measured acceptance, and is built from the evaluator's fitted table."""

import math
from collections import Counter

import pytest

from modeling_jetspec.calibration import (
    BINS,
    calibrated_children,
    calibrated_logprob,
    check_calibration,
    node_source,
    to_config,
)
from modeling_jetspec.continuations import merge_children, trie_children
from modeling_jetspec.tree import build_tree, marginal_children


def rates(value_by_bin: dict, default: float = 0.5) -> list:
    return [value_by_bin.get(b, default) for b in range(BINS)]


@pytest.mark.parametrize(
    "bad, message",
    [
        ([0.5] * BINS, "as a dict"),
        ({"0:head": [0.5] * BINS}, "keys '<depth >= 1>"),
        ({"1:model": [0.5] * BINS}, "keys '<depth >= 1>"),
        ({"1:head": [0.5] * (BINS - 1)}, "10 acceptance rates"),
        ({"1:head": [1.5] + [0.5] * (BINS - 1)}, "10 acceptance rates"),
    ],
)
def test_a_bad_map_is_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        check_calibration(bad)


def test_no_map_means_raw_scores():
    assert check_calibration(None) is None and check_calibration({}) is None
    table = check_calibration({"2:head": rates({})})
    assert calibrated_logprob(table, 1, "head", -0.7) == -0.7  # depth 1 not in the map: raw
    assert calibrated_logprob(table, 2, "lookup", -0.7) == -0.7  # source not in the map: raw
    assert calibrated_logprob(table, 2, "head", math.log(0.95)) == pytest.approx(math.log(0.5))


def test_sources_follow_who_proposed_the_token():
    head_tokens = [{5, 6}, {7}]
    trie = {(): {6: 3, 9: 1}, (6,): {7: 2}}
    assert node_source(head_tokens, trie, (), 5) == "head"
    assert node_source(head_tokens, trie, (), 6) == "both"
    assert node_source(head_tokens, trie, (), 9) == "lookup"
    assert node_source(head_tokens, trie, (6,), 7) == "both"
    assert node_source(head_tokens, None, (6,), 7) == "head"


def test_calibration_reranks_the_tree_by_measured_acceptance():
    """Raw, the trie's first continuation (score 0) enters before the head's best; a map saying the trie's depth-1
    nodes are accepted 10% of the time and the head's confident ones 90% puts the head's node first."""
    head = marginal_children([[math.log(0.8), math.log(0.1)]], [[5, 6]], [0.0])
    trie = {(): Counter({9: 1})}
    merged = merge_children(head, trie_children(trie, None, 1))
    raw = build_tree(merged, 2, 1)
    assert raw.tokens == [9, 5]
    table = check_calibration({"1:head": rates({8: 0.9}, 0.05), "1:lookup": rates({}, 0.1)})
    head_tokens = [{5, 6}]
    calibrated = calibrated_children(merged, table, lambda path, token: node_source(head_tokens, trie, path, token))
    tree = build_tree(calibrated, 2, 1)
    assert tree.tokens == [5, 9]
    assert tree.scores == pytest.approx([math.log(0.9), math.log(0.1)])


def test_a_map_from_the_fitted_table_is_monotone_and_filled():
    fitted = [
        {"depth": 1, "source": "head", "bin": [0.0, 0.1], "trials": 50, "fitted": 0.2},
        {"depth": 1, "source": "head", "bin": [0.5, 0.6], "trials": 50, "fitted": 0.1},  # below bin 0: raised
        {"depth": 1, "source": "head", "bin": [0.9, 1.0], "trials": 3, "fitted": 1.0},  # too few trials: middle
        {"depth": 2, "source": "lookup", "bin": [0.9, 1.0], "trials": 40, "fitted": 0.4},
        {"depth": 3, "source": "both", "bin": [0.9, 1.0], "trials": 2, "fitted": 0.4},  # nothing measured: left out
    ]
    table = to_config(fitted, min_trials=10)
    assert sorted(table) == ["1:head", "2:lookup"]
    head = table["1:head"]
    assert head[0] == 0.2 and head[5] == 0.2  # the fitted 0.1 cannot rank a higher score below a lower one
    assert head[9] == 0.2  # three trials: the nearest measured bin's rate
    assert all(a <= b for a, b in zip(head, head[1:]))
    assert table["2:lookup"] == [0.4] * BINS
    assert check_calibration(table) is not None  # what it writes, a config reads


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_calibrated_head_decodes_exactly_as_plain_generate(arch):
    """A map changes which nodes the tree holds, never which tokens are committed: even a map that reverses the head's
    order and puts the model-free branch last writes plain greedy's tokens, in a padded batch, with the trie on; and it
    does change the trees (a call with the map switched off per call drafts others)."""
    import torch

    import modeling_jetspec.decode as decode
    from jetspec.tiny import prompts, tiny_head, tiny_target

    target = tiny_target(arch, vocab_size=16)  # a small vocabulary: earlier continuations abound
    reversed_map = {f"{d}:{s}": [0.9 - 0.08 * b for b in range(BINS)] for d in range(1, 5) for s in ("head", "both")}
    reversed_map.update({f"{d}:lookup": [0.02] * BINS for d in range(1, 9)})
    head = tiny_head(target, tree_lookup=6, tree_lookup_branches="trie", tree_calibration=reversed_map)
    ids, mask = prompts(2, vocab_size=16)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    drafted = {}
    original = decode.draft
    for label, extra in (("calibrated", {}), ("raw", {"tree_calibration": False})):
        trees = drafted.setdefault(label, [])

        def spy(*args, trees=trees, **kwargs):
            out = original(*args, **kwargs)
            trees.append([tuple(t.tokens) for t in out.host])
            return out

        decode.draft = spy
        try:
            ours = target.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=24,
                pad_token_id=0,
                assistant_model=head,
                **extra,
            )
        finally:
            decode.draft = original
        assert torch.equal(ours, plain), label
    assert drafted["calibrated"][0] != drafted["raw"][0]  # the same first round, other trees
