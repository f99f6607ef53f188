"""training/tau_table.py: the head's tau per draft sources and budget, replayed offline over a feature store's
held-out rows, equal to what real decoding at that point reaches, written into the head's config.json."""

import json

import pytest

from modeling_jetspec import JetSpecConfig, JetSpecDraftModel
from test_evaluate_head import cli, real_tau, saved_setup
from test_training import sharp_target
from training import tau_table
from training.rows import load_rows, split_train_eval


@pytest.fixture
def setup(tmp_path):
    return saved_setup(tmp_path, count=10)


def arguments(tmp_path, data, *extra):
    return cli(tmp_path, data, *extra, eval_fraction="0.4")


def test_the_table_is_what_real_decoding_reaches_and_is_written_to_the_config(setup):
    tmp_path, rows, data = setup
    before = json.loads((tmp_path / "head" / "config.json").read_text())
    table = tau_table.main(arguments(tmp_path, data, "--budgets", "4,8", "--json", str(tmp_path / "t.json"), "--write"))
    assert set(table) == {"head", "head+lookup", "head+lookup+trie"} and all(set(by) == {4, 8} for by in table.values())
    _, held = split_train_eval(load_rows([str(data)]), 0.4, 0)
    held_rows = [row for row in rows if row["id"] in set(held["id"])]
    head = JetSpecDraftModel.from_pretrained(tmp_path / "head").eval()
    target = sharp_target()
    # each point is the tau of real `generate` at that budget and with those sources on the held-out rows
    assert table["head"][4] == pytest.approx(real_tau(target, head, held_rows, 4, tree_lookup=0))
    assert table["head+lookup"][8] == pytest.approx(
        real_tau(target, head, held_rows, 8, tree_lookup=8, tree_lookup_branches="chain")
    )
    assert table["head+lookup+trie"][8] == pytest.approx(real_tau(target, head, held_rows, 8))
    # written: the config loads with the table, every other field as it was
    after = json.loads((tmp_path / "head" / "config.json").read_text())
    assert before.get("tau_by_budget") is None
    assert {k: v for k, v in after.items() if k != "tau_by_budget"} == {
        k: v for k, v in before.items() if k != "tau_by_budget"
    }
    assert JetSpecConfig.from_pretrained(tmp_path / "head").tau_by_budget == {
        name: {str(b): round(t, 4) for b, t in by.items()} for name, by in table.items()
    }
    assert json.loads((tmp_path / "t.json").read_text())["tau_by_budget"]["head"]["4"] == table["head"][4]


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--budgets", "4,32"), r"expected --budgets among \(4, 6, 8, 10, 12, 16\) .*got \[4, 32\]"),
        (("--budgets", "x"), "expected --budgets as comma-separated integers >= 1, got 'x'"),
        (("--rows", "0"), "expected --rows >= 1, got 0"),
        (("--eval_fraction", "1.0"), r"expected --eval_fraction in \(0, 1\) and --batch_size >= 1, got 1.0 and 32"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(setup, extra, message, monkeypatch):
    tmp_path, _, data = setup
    monkeypatch.setattr(tau_table, "tau_table", lambda *a, **k: pytest.fail("worked before refusing"))
    with pytest.raises(ValueError, match=message):
        tau_table.main(arguments(tmp_path, data, *extra))


def test_a_table_that_would_not_load_is_never_written(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="to be a number >= 1"):
        tau_table.write_table(tmp_path, {"head": {4: 0.0}})
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}
