"""The lookup prior (`training/lookup_prior.py`): survival fractions of prompt-lookup chains per match order."""

import pytest

from training.lookup_prior import measure_lookup_prior


def test_fractions_count_accepted_chain_tokens_per_order():
    # prompt [1, 2, 3, 1, 2], answer 3, 9: at the anchor 2 (position 4) the trigram 3-1-2? no; the bigram 1-2 matched
    # at 0..1 drafts [3, 1, 2] and the answer is 3, 9: one token accepted (order 2).
    # At the anchor 3 (position 5) the trigram 1-2-3 matched at 0..2 drafts [1, 2, 3] against [9]: none accepted.
    rows = [([1, 2, 3, 1, 2, 3, 9], 5)]
    result = measure_lookup_prior(rows, depth=3)
    assert result["positions"] == 2 and result["matches"] == [0, 1, 1]
    assert result["prior"][1] == pytest.approx([1.0, 1e-4, 1e-4])  # order 2: one chain, 1 token accepted
    assert result["prior"][2] == pytest.approx([1e-4, 1e-4, 1e-4])  # order 3: one chain, nothing accepted
    assert result["prior"][0] == pytest.approx([0.5, 1e-4, 1e-4])  # never matched: pooled over the orders


def test_a_repeating_answer_gives_long_trigram_chains():
    rows = [([5, 6, 7, 8] * 10, 4)]
    prior = measure_lookup_prior(rows, depth=4)["prior"]
    assert prior[2][0] == 1.0 and prior[2][-1] > 0.9  # accepted to the end except near the end of the row
    assert all(b <= a for row in prior for a, b in zip(row, row[1:]))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="expected depth >= 1, got 0"):
        measure_lookup_prior([([1, 2], 1)], depth=0)
    with pytest.raises(ValueError, match=r"expected a prompt length in \[1, 2\], got 5"):
        measure_lookup_prior([([1, 2], 5)], depth=2)
    # no match at all: nothing to score by
    assert measure_lookup_prior([([1, 2, 3, 4], 2)], depth=2) == {"prior": None, "matches": [0, 0, 0], "positions": 2}


def test_the_command_writes_the_odds_into_a_saved_head_s_config(tmp_path, capsys):
    from test_training import regenerated_rows, sharp_target, write_shards
    from jetspec.tiny import tiny_head

    from modeling_jetspec import JetSpecDraftModel
    from training.lookup_prior import main

    target = sharp_target()
    data = write_shards(tmp_path / "regen", regenerated_rows(target, count=12))
    tiny_head(target).save_pretrained(tmp_path / "head")
    assert main(["--data", str(data), "--head", str(tmp_path / "head"), "--depth", "5"]) == 0
    head = JetSpecDraftModel.from_pretrained(tmp_path / "head")
    prior = head.config.tree_lookup_prior
    assert len(prior) == 3 and all(len(row) == 5 for row in prior)
    assert all(0 < b <= a <= 1 for row in prior for a, b in zip(row, row[1:]))
    assert '"tree_lookup_prior"' in capsys.readouterr().out
