"""The paper's claims, made runnable (issue 33): the ablation's new variants train and are scored offline on the same
held-out rows, the data cap by answer tokens, the tree-key mode, the results tables, and gpu_check's measured verify ratios."""

import gzip
import json
import types

import datasets
import pytest
import torch

from modeling_jetspec import JetSpecDraftModel
from test_evaluate_head import LOOKUP, real_tau
from test_scripts import ablation_config, load_script
from test_training import sharp_target
from jetspec.tiny import tiny_head
from training import evaluate_head
from training.rows import answer_lengths, answer_token_cap, load_rows, split_train_eval


def synthetic_rows(count: int = 40) -> datasets.Dataset:
    """Rows of varied answer lengths (no model needed: the cap reads only ids and lengths)."""
    return datasets.Dataset.from_list(
        [
            {"id": f"row-{i}", "input_ids": list(range(1, 5 + 3 + (i * 7) % 23)), "prompt_length": 4}
            for i in range(count)
        ]
    )


def test_answer_token_cap_takes_the_requested_tokens_and_never_a_held_out_row():
    train, held = split_train_eval(synthetic_rows(), 0.25, 0)
    lengths = dict(zip(train["id"], answer_lengths(train)))
    total = sum(lengths.values())
    small, small_tokens = answer_token_cap(train, 60, seed=0)
    large, large_tokens = answer_token_cap(train, 150, seed=0)
    for cap, subset, tokens in ((60, small, small_tokens), (150, large, large_tokens)):
        assert tokens == sum(lengths[i] for i in subset["id"])  # the count is the rows' own
        assert cap <= tokens < cap + max(lengths.values())  # reaches the cap, over it by less than one row
        assert not set(subset["id"]) & set(held["id"])
        assert subset["id"] == [i for i in train["id"] if i in set(subset["id"])]  # the data's order kept
    assert set(small["id"]) < set(large["id"])  # a smaller cap's rows are a prefix of the same draw
    assert answer_token_cap(train, 60, seed=0)[0]["id"] == small["id"]  # deterministic
    assert answer_token_cap(train, 60, seed=1)[0]["id"] != small["id"]  # the draw follows the seed
    everything, count = answer_token_cap(train, 10 * total, seed=0)
    assert count == total and len(everything) == len(train)
    with pytest.raises(ValueError, match="expected max_tokens"):
        answer_token_cap(train, 0)


def test_the_trainer_caps_training_rows_and_keeps_the_held_out_rows(tmp_path):
    from training.run_trainer import DataArguments, load_data

    rows = synthetic_rows()
    rows.save_to_disk(str(tmp_path / "rows"))
    plain_train, plain_held = load_data(DataArguments(data=[str(tmp_path / "rows")], eval_fraction=0.25), seed=0)
    capped_train, capped_held = load_data(
        DataArguments(data=[str(tmp_path / "rows")], eval_fraction=0.25, max_train_answer_tokens=60), seed=0
    )
    assert capped_held["id"] == plain_held["id"]
    assert set(capped_train["id"]) < set(plain_train["id"]) and sum(answer_lengths(capped_train)) >= 60
    with pytest.raises(ValueError, match="max_train_answer_tokens"):
        DataArguments(data=["x"], streaming=True, max_train_answer_tokens=10)
    with pytest.raises(ValueError, match="max_train_answer_tokens"):
        DataArguments(data=["x"], max_train_answer_tokens=0)


def test_new_variants_train_and_are_scored_on_the_same_held_out_rows(tmp_path):
    """bidir_gamma7, fkl and the data variants train two steps each; each head is scored by the evaluator on the same
    held-out rows at every budget, branch on and off, with first-round statistics; the data variants train on the
    capped rows."""
    config = ablation_config(tmp_path, "gamma: 4.0\n")
    tiny_head(sharp_target(), **LOOKUP).save_pretrained(tmp_path / "lookup")
    ablate_head = load_script("ablate_head")
    variants = ["bidir_gamma7", "fkl", "data_60", "data_all"]
    scoring = ["--config", str(config), "--store", str(tmp_path / "store"), "--budgets", "4,8"]
    scoring += ["--eval_new_tokens", "16", "--lookup_settings", str(tmp_path / "lookup")]
    argv = [*scoring, "--steps", "2", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")]
    argv += ["--variants", *variants]
    summary = ablate_head.main(argv)
    assert list(summary) == variants
    assert summary["bidir_gamma7"]["settings"]["block_attention"] == "bidirectional"
    assert summary["bidir_gamma7"]["settings"]["gamma"] == 7.0 and summary["fkl"]["settings"]["loss"] == "fkl"
    assert summary["data_60"]["settings"]["max_train_answer_tokens"] == 60
    assert 60 <= summary["data_60"]["train_answer_tokens"] < summary["data_all"]["train_answer_tokens"]
    crcs = {row["offline"]["rows_crc"] for row in summary.values()}
    assert len(crcs) == 1  # every head on the same rows
    target, data = sharp_target(), {row["id"]: row for row in load_rows(summary["fkl"]["settings"]["data"])}
    sides = {"lookup_on": LOOKUP, "lookup_off": {"tree_lookup": 0}}
    for name, row in summary.items():
        scored = row["offline"]["by_key"]["None"]
        assert row["offline"]["rows"] >= 1 and row["offline"]["budgets"] == [4, 8]
        head = JetSpecDraftModel.from_pretrained(tmp_path / "runs" / name).eval()
        with gzip.open(tmp_path / "out" / "offline" / f"{name}.json.gz", "rt", encoding="utf-8") as file:
            full = json.load(file)  # every row, compressed
        for side in ("lookup_on", "lookup_off"):
            for budget in ("4", "8"):
                entry = scored[side][budget]
                assert entry["rows"] == row["offline"]["rows"]
                # the score is what real decoding with the trained head reaches on the held-out rows scored
                held = [data[r["id"]] for r in full["None"][side][budget]["per_row"]]
                assert len(held) == entry["rows"]
                expected = real_tau(target, head, held, int(budget), 16, **sides[side])
                assert entry["tau"] == pytest.approx(expected), (name, side, budget)
                assert all(0.0 <= a <= 1.0 for a in entry["acceptance_per_depth"])
                assert entry["first_round"]["rows"] == row["offline"]["rows"]
        assert scored["lookup_on"]["4"]["lookup"] == LOOKUP["tree_lookup"] and scored["lookup_off"]["4"]["lookup"] == 0
        assert full["None"]["lookup_off"]["8"]["tau"] == scored["lookup_off"]["8"]["tau"]
    # the evaluator's own command line on the same head and rows gives the same numbers
    out = tmp_path / "direct.json"
    settings = summary["fkl"]["settings"]
    evaluate_head.main(
        [
            "--head",
            str(tmp_path / "runs" / "fkl"),
            "--data",
            *settings["data"],
            "--feature_store",
            str(tmp_path / "store"),
            "--target",
            settings["target"],
            "--eval_fraction",
            str(settings["eval_fraction"]),
            "--seed",
            str(settings["seed"]),
            "--rows",
            "300",
            "--max_new_tokens",
            "16",
            "--budgets",
            "4,8",
            "--lookup",
            "off",
            "--json",
            str(out),
        ]
    )
    direct = json.loads(out.read_text())["heads"][str(tmp_path / "runs" / "fkl")]
    assert direct["8"]["tau"] == summary["fkl"]["offline"]["by_key"]["None"]["lookup_off"]["8"]["tau"]
    table = (tmp_path / "out" / "ablation.md").read_text()
    assert "| bidir_gamma7 |" in table and "off @8" in table
    assert ablate_head.main(argv) == summary  # measured and scored: nothing again

    key_argv = [*scoring, "--out", str(tmp_path / "keys"), "--tree_keys", "logprob", "entropy"]
    key_argv += ["--head", str(tmp_path / "runs" / "fkl")]
    keys = ablate_head.main(key_argv)
    assert list(keys["by_key"]) == ["logprob", "entropy"] and keys["rows_crc"] in crcs
    assert keys["by_key"]["entropy"]["lookup_off"]["8"]["scoring"] == "entropy"
    assert keys["by_key"]["logprob"]["lookup_off"]["8"]["tau"] == direct["8"]["tau"]  # the head's key is logprob
    assert "| entropy |" in (tmp_path / "keys" / "tree_keys.md").read_text()
    assert ablate_head.main(key_argv) == keys  # scored with these settings: skipped on a rerun
    assert ablate_head.main(key_argv[:-3] + ["--head", key_argv[-1]])["by_key"].keys() == {"logprob"}  # the one asked
    # a scoring cut off after its first key resumes there: the key written is kept as it is, the missing one scored
    stored = json.loads((tmp_path / "keys" / "tree_keys.json").read_text())
    assert list(stored["by_key"]) == ["logprob", "entropy"]
    del stored["by_key"]["entropy"]
    stored["by_key"]["logprob"]["lookup_off"]["8"]["tau"] = -1.0  # a marker: rescoring would overwrite it
    (tmp_path / "keys" / "tree_keys.json").write_text(json.dumps(stored))
    resumed = ablate_head.main(key_argv)
    assert resumed["by_key"]["logprob"]["lookup_off"]["8"]["tau"] == -1.0
    assert resumed["by_key"]["entropy"] == keys["by_key"]["entropy"]
    assert json.loads((tmp_path / "keys" / "tree_keys.json").read_text())["by_key"] == resumed["by_key"]


def test_ablate_head_refuses_bad_arguments_before_training(tmp_path):
    ablate_head = load_script("ablate_head")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "store.json").write_text("{}")
    base = ["--store", str(tmp_path / "store"), "--lookup_settings", "none"]
    for extra, message in (
        (["--variants", "data_x"], "expected variants"),
        (["--variants", "fkl", "fkl"], "each variant once"),
        (["--budgets", "0"], "expected --budgets"),
        (["--tree_keys", "logprob"], "expected --head"),
        (["--tree_keys", "gap", "--variants", "fkl"], "either --variants"),
    ):
        with pytest.raises(ValueError, match=message):
            ablate_head.main(base + extra)
    assert ablate_head.data_tokens("data_0.5M") == 500_000 and ablate_head.data_tokens("data_all") is None


def scored(tau_off: float, tau_on: float, share=None, inflation=None) -> dict:
    first = {
        "rows": 10,
        "rows_with_target_logprob": 10,
        "complete_paths": 3,
        "share_below_-20_nats": share,
        "mean_inflation": inflation,
        "mean_draft_score": -3.0,
    }

    def side(tau):
        return {
            b: {"tau": tau + 0.1 * i, "acceptance_per_depth": [0.5], "first_round": first}
            for i, b in enumerate(("8", "16", "32", "64"))
        }

    return {"by_key": {"None": {"lookup_off": side(tau_off), "lookup_on": side(tau_on)}}}


def ablation_row(attention: str, gamma, loss: str = "fkl", acc: float = 0.3, offline=None, **extra) -> dict:
    row = {
        "acc_per_depth": [acc, 0.2, 0.1],
        "tau_chain": 1.5,
        "steps": 100,
        "settings": {"block_attention": attention, "gamma": gamma, "loss": loss, "max_train_answer_tokens": None},
        **extra,
    }
    if offline is not None:
        row["offline"] = offline
    return row


def test_results_tables_render_the_given_numbers_beside_the_papers(tmp_path):
    tables = load_script("campaigns/results_tables")
    ablation = {
        "gamma4": ablation_row("causal", 4.0, acc=0.41, offline=scored(2.0, 2.5, share=0.0, inflation=3.5)),
        "bidir_gamma0": ablation_row(
            "bidirectional", None, acc=0.22, offline=scored(1.25, 1.75, share=0.25, inflation=9.75)
        ),
        "reverse_kl": ablation_row("causal", 4.0, loss="rkl", offline=scored(1.5, 1.6)),
        "data_0.5M": ablation_row("causal", 4.0, acc=0.19, train_answer_tokens=500_123),
        "data_all": ablation_row("causal", 4.0, acc=0.31, offline=scored(1.25, 1.5), train_answer_tokens=2_800_000),
        "raw_sharegpt": ablation_row("causal", 4.0, acc=0.15, offline=scored(0.8, 1.5), train_answer_tokens=500_236),
        "regen_sharegpt": ablation_row("causal", 4.0, acc=0.18, offline=scored(1.05, 1.5), train_answer_tokens=500_236),
    }
    (tmp_path / "a.json").write_text(json.dumps(ablation))
    keys = {"head": "runs/x", "rows": 10, "by_key": {"entropy": scored(1.125, 1.5)["by_key"]["None"]}}
    (tmp_path / "k.json").write_text(json.dumps(keys))
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nkept\n")
    tables.main(["--ablation", str(tmp_path / "a.json"), "--tree_keys", str(tmp_path / "k.json"), "--write", str(doc)])
    text = doc.read_text()
    lines = text.splitlines()

    def row(prefix: str) -> list:
        [line] = [line for line in lines if line.startswith(prefix)]
        return [cell.strip() for cell in line.strip("|").split("|")]

    causal4 = row("| causal | 4 | 8.50x")
    assert causal4[3:8] == ["gamma4", "0.410", "1.500", "2.000", "2.100"] and causal4[13] == "2.800"  # tau@64 on
    assert row("| causal | 0 | 8.29x")[3:] == ["not run yet"] * 12 + ["-"]
    assert row("| bidirectional | 0 | 5.46x")[3:6] == ["bidir_gamma0", "0.220", "1.500"]
    assert row("| bidirectional | 0 | 26%")[4:7] == ["bidir_gamma0", "25.0%", "+9.75"]
    assert row("| causal | 4 | no figure")[4:7] == ["gamma4", "0.0%", "+3.50"]
    assert row("| 32 | off |")[1:] == [
        "off",
        "not run yet",
        "2.200",
        "not run yet",
        "1.450",
        "not run yet",
        "not run yet",
    ]
    assert row("| reverse KL |")[1:3] == ["36-46% below forward KL", "reverse_kl"]
    assert row("| reverse KL |")[-1] == f"{100 * (1.7 / 2.2 - 1):+.1f}%"  # at budget 32, against gamma4's
    assert row("| SFT")[2:] == ["not run yet"] * 8
    assert row("| entropy | 4.76x |")[2:4] == ["1.125", "1.225"]
    assert row("| logprob | 8.15x |")[2:] == ["not run yet"] * 8
    assert row("| 0.5M |")[1:5] == ["data_0.5M", "500,123", "100", "0.190"]
    assert row("| all (2M+) |")[4] == "0.310"
    # raw against regenerated: the paired variants' rows, the raw one read against the regenerated one
    raw = row("| ShareGPT's own replies (raw) |")
    assert raw[1:6] == ["below regenerated", "raw_sharegpt", "500,236", "0.150", "1.500"]
    assert raw[-1] == f"{100 * (1.0 / 1.25 - 1):+.1f}%"  # tau@32 off: 1.0 against 1.25
    regen = row("| the target's own answers (regenerated) |")
    assert regen[2:5] == ["regen_sharegpt", "500,236", "0.180"] and regen[-1] == "reference"
    assert text.startswith("# Results\n\nkept\n") and text.count("<!-- claims:begin -->") == 1
    assert "Nothing in this section has been run yet" not in text
    # written again, the section is replaced, not appended; with no results, every cell of ours is empty
    tables.main(["--write", str(doc)])
    text = doc.read_text()
    assert text.count("<!-- claims:begin -->") == 1 and "Nothing in this section has been run yet" in text
    assert "0.410" not in text and "8.29x" in text
    with pytest.raises(ValueError, match="expected a results JSON file"):
        tables.main(["--ablation", str(tmp_path / "missing.json")])


def test_results_tables_state_gaps_against_the_seed_spread(tmp_path):
    """Seed variants (`<variant>_seed<N>`) make the seed spread table; the gaps of the other tables are read on means
    over seeds, and one no larger than the spread of its figure says "tie"."""
    tables = load_script("campaigns/results_tables")
    ablation = {
        "gamma4": ablation_row("causal", 4.0, acc=0.41, offline=scored(2.0, 2.5)),
        "gamma4_seed1": ablation_row("causal", 4.0, acc=0.40, offline=scored(1.956, 2.45)),
        "gamma7": ablation_row("causal", 7.0, offline=scored(2.0, 2.5)),
        "bidir_gamma4": ablation_row("bidirectional", 4.0, offline=scored(2.0, 2.49)),
        "bidir_gamma7": ablation_row("bidirectional", 7.0, offline=scored(2.0, 2.6)),
        "kl_tv": ablation_row("causal", 4.0, loss="kl_tv", offline=scored(1.98, 2.5)),
        "reverse_kl": ablation_row("causal", 4.0, loss="rkl", offline=scored(1.5, 1.6)),
        "sft_seed1": ablation_row("causal", 4.0, loss="sft", offline=scored(1.0, 1.0)),  # no seed 0 run: no group
    }
    (tmp_path / "a.json").write_text(json.dumps(ablation))
    text = tables.main(["--ablation", str(tmp_path / "a.json")])

    def row(prefix: str) -> list:
        [line] = [line for line in text.splitlines() if line.startswith(prefix)]
        return [cell.strip() for cell in line.strip("|").split("|")]

    # the spread table: gamma4's two seeds; the largest spread (2.5 - 2.45) / 2.475 at tau@8 on, and at tau@32 off
    # (2.2 - 2.156) / 2.178: both 2.0%
    assert row("| gamma4 | 2 |")[2:4] == ["0.410 / 0.400", "2.500 / 2.450"]
    spread = row("| largest spread |")
    assert spread[3] == spread[6] == "2.0%" and spread[4] == f"{100 * 0.05 / 2.775:.1f}%"  # tau@64 on: 2.8 / 2.75
    assert not [line for line in text.splitlines() if line.startswith("| sft")]
    # block x gamma, tau@8 on against causal gamma 4's mean over seeds (2.475) and causal at the same gamma
    assert row("| bidirectional | 7 | 8.36x")[-2:] == [
        f"{100 * (2.6 / 2.475 - 1):+.1f}%",
        f"{100 * (2.6 / 2.5 - 1):+.1f}%",
    ]
    assert (
        row("| bidirectional | 4 | no figure at 4")[-2] == f"tie ({100 * (2.49 / 2.475 - 1):+.1f}%)"
    )  # +0.6%, within 2.0%
    assert row("| causal | 7 | 8.40x")[-2:] == [f"tie ({100 * (2.5 / 2.475 - 1):+.1f}%)", "-"]
    assert row("| causal | 4 | 8.50x")[-2:] == ["reference", "-"]
    # losses at tau@32 off against forward KL's mean over seeds (2.178)
    assert row("| forward KL + total variation |")[-1] == f"tie ({100 * (2.18 / 2.178 - 1):+.1f}%)"
    assert row("| reverse KL |")[-1] == f"{100 * (1.7 / 2.178 - 1):+.1f}%"


def test_gpu_check_ratios_are_measured_on_both_sides(monkeypatch):
    """The ratios come from timing both forwards: on a clock that a forward advances by a known cost (1 per token
    read, plus 0.5 when it builds a 4D tree mask, as a verify does and a plain step does not), the verify of the root
    alone costs 1.5 plain steps and a verify over B tokens B + 0.5, whatever the host's real speed."""
    from modeling_jetspec import timing

    gpu_check = load_script("gpu_check")
    target, head, _ = gpu_check.build("tiny-qwen3", "cpu", torch.float32)
    now = [0.0]

    def cost(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        now[0] += kwargs["input_ids"].shape[1] + (0.5 if mask is not None and mask.dim() == 4 else 0.0)

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    handle = target.register_forward_pre_hook(cost, with_kwargs=True)
    try:
        ratios = gpu_check.verify_ratios(target, head, [1, 2, 4], context_length=16, repeats=1)
    finally:
        handle.remove()
    assert ratios == {1: 1.5, 2: 2.5, 4: 4.5}
    with pytest.raises(ValueError, match="including 1"):
        gpu_check.verify_ratios(target, head, [2, 4])


def test_all_data_row_is_the_reference_run_when_data_all_was_not_trained(tmp_path):
    """data_all's flags are gamma4's: without a data_all row the data table's all-data row (and the regenerated-data
    row) show the forward-KL reference run, never a variant of another loss, gamma or data cap."""
    tables = load_script("campaigns/results_tables")
    ablation = {
        "gamma4": ablation_row("causal", 4.0, acc=0.41, offline=scored(2.0, 2.5), train_answer_tokens=2_700_000),
        "data_1M": ablation_row("causal", 4.0, acc=0.30, train_answer_tokens=1_000_321),
    }
    (tmp_path / "a.json").write_text(json.dumps(ablation))
    doc = tmp_path / "results.md"
    tables.main(["--ablation", str(tmp_path / "a.json"), "--write", str(doc)])
    lines = doc.read_text().splitlines()
    [everything] = [line for line in lines if line.startswith("| all (2M+) |")]
    assert [cell.strip() for cell in everything.strip("|").split("|")][1:5] == ["gamma4", "2,700,000", "100", "0.410"]
    # a gamma4 row with a data cap is not the reference: the cell stays empty
    ablation["gamma4"]["settings"]["max_train_answer_tokens"] = 500_000
    (tmp_path / "a.json").write_text(json.dumps(ablation))
    tables.main(["--ablation", str(tmp_path / "a.json"), "--write", str(doc)])
    [everything] = [line for line in doc.read_text().splitlines() if line.startswith("| all (2M+) |")]
    assert "gamma4" not in everything and "not run yet" in everything


def test_eval_data_judges_a_run_on_another_datasets_held_out_rows(tmp_path):
    """With --eval_data the training rows are --data's own training side and the evaluation rows the held-out side of
    the other data's split (same fraction and seed); a row sharing an id with an evaluation row is never trained on."""
    from training.rows import held_draw
    from training.run_trainer import DataArguments, load_data

    rows = synthetic_rows()
    rows.save_to_disk(str(tmp_path / "rows"))
    other = datasets.Dataset.from_list([{**r, "id": f"raw:{r['id']}"} for r in rows])
    other.save_to_disk(str(tmp_path / "other"))
    _, held = load_data(DataArguments(data=[str(tmp_path / "rows")], eval_fraction=0.25), seed=0)
    own_train, _ = load_data(DataArguments(data=[str(tmp_path / "other")], eval_fraction=0.25), seed=0)
    args = DataArguments(data=[str(tmp_path / "other")], eval_data=str(tmp_path / "rows"), eval_fraction=0.25)
    train, evaluated = load_data(args, seed=0)
    assert evaluated["id"] == held["id"] and train["id"] == own_train["id"]
    assert args.sources() == [str(tmp_path / "other"), str(tmp_path / "rows")]
    # a split with no draw below the fraction holds out its lowest-draw row: row-i's is row 0..39's lowest; in a
    # larger dataset with a row drawn below 0.01 that row would be a training row, and it is kept out
    lowest = min(rows["id"], key=lambda name: held_draw(name, 0))
    extra = {"id": "extra-69", "input_ids": [1, 2, 3, 4, 5, 6], "prompt_length": 4}
    assert held_draw("extra-69", 0) < 0.01 <= held_draw(lowest, 0)
    datasets.concatenate_datasets([rows, datasets.Dataset.from_list([extra], features=rows.features)]).save_to_disk(
        str(tmp_path / "larger")
    )
    for streaming in (False, True):
        args = DataArguments(
            data=[str(tmp_path / "larger")], eval_data=[str(tmp_path / "rows")], eval_fraction=0.01, streaming=streaming
        )
        train, evaluated = load_data(args, seed=0)
        assert evaluated["id"] == [lowest]
        trained = [row["id"] for row in train] if streaming else train["id"]
        assert lowest not in trained and "extra-69" not in trained and len(trained) == 39
    with pytest.raises(ValueError, match="eval_fraction > 0 with --eval_data"):
        DataArguments(data=["x"], eval_data=["y"], eval_fraction=0.0)


def test_paired_data_variants_train_on_their_file_and_are_judged_on_the_configs_held_out_rows(tmp_path):
    """raw_sharegpt and regen_sharegpt train on their own files (features from the same store) and are scored on the
    same held-out rows as a variant of the config's data."""
    from test_scripts import regenerated_rows, sharp_target
    from training.answers import write_compact
    from training.feature_store import build_feature_store

    config = ablation_config(tmp_path)
    target = sharp_target()
    rows = regenerated_rows(target)  # the rows ablation_config wrote and stored
    train_ids = set(split_train_eval(datasets.Dataset.from_list(rows), 0.25, 0)[0]["id"])
    regen = [{k: r[k] for k in ("id", "input_ids", "prompt_length")} for r in rows if r["id"] in train_ids]
    raw = [
        {
            **r,
            "id": f"raw:{r['id']}",
            "input_ids": r["input_ids"][: r["prompt_length"]]
            + r["input_ids"][: r["prompt_length"] - 1 : -1][: len(r["input_ids"]) - r["prompt_length"]],
        }
        for r in regen
    ]
    assert all(len(a["input_ids"]) == len(b["input_ids"]) for a, b in zip(raw, regen))
    paired = tmp_path / "paired"
    paired.mkdir()
    write_compact(paired / "regen.npz", regen, {})
    write_compact(paired / "raw.npz", raw, {})
    build_feature_store(target, tiny_head(target).config.target_layer_ids, raw, tmp_path / "store", progress=False)
    ablate_head = load_script("ablate_head")
    ablate_head.PAIRED_DIR = paired
    runs = f"--steps 2 --out {tmp_path / 'out'} --runs {tmp_path / 'runs'} --lookup_settings none".split()
    argv = ["--config", str(config), "--store", str(tmp_path / "store"), "--budgets", "4", "--eval_new_tokens", "8"]
    argv += runs
    summary = ablate_head.main(argv + ["--variants", "raw_sharegpt", "regen_sharegpt", "fkl"])
    config_data = summary["fkl"]["settings"]["data"]
    for name, file in (("raw_sharegpt", "raw.npz"), ("regen_sharegpt", "regen.npz")):
        settings = summary[name]["settings"]
        assert settings["data"] == [str(paired / file)] and settings["eval_data"] == config_data
        assert summary[name]["offline"]["rows_crc"] == summary["fkl"]["offline"]["rows_crc"]
    assert summary["fkl"]["settings"]["eval_data"] is None
    ablate_head.PAIRED_DIR = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="scripts.campaigns.raw_answers"):
        ablate_head.main(argv + ["--variants", "raw_sharegpt"])


def test_raw_answers_pairs_each_prompt_with_the_corpus_reply_cut_to_the_targets_answer(tmp_path):
    """Only training rows (under both ids) whose prompt tokens match the conversation's first turn and whose reply is
    at least as long as the target's answer; the reply cut to that length, in both files the same prompts and
    answer tokens per row; the cap on answer tokens reached in the draw's order."""
    from test_bench import char_tokenizer

    from jetspec.targets import apply_chat_template
    from training.rows import held_draw

    raw_answers = load_script("campaigns/raw_answers")
    tok = char_tokenizer()
    eos = tok.eos_token_id

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    rows, exchanges = [], {}
    for i in range(40):
        prompt = f"question {i}?"
        answer = encode(f"ans{i}" + "z" * (i % 7)) + [eos]
        rows.append(
            {
                "id": f"sharegpt-c{i}",
                "input_ids": encode(apply_chat_template(tok, prompt)) + answer,
                "prompt_length": len(encode(apply_chat_template(tok, prompt))),
            }
        )
        reply = f"reply number {i} " * (1 + i % 3)
        if i % 10 == 3:
            reply = "no"  # shorter than the target's answer
        if i % 10 == 5:
            prompt = f"another question {i}?"  # the conversation's turn is not the row's prompt
        if i % 10 != 7:  # no conversation for these
            exchanges[f"c{i}"] = (f"  {prompt} ", reply)
    rows.append({"id": "math-1", "input_ids": [5, 6, 7, 8], "prompt_length": 2})  # not a ShareGPT row
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "rows"))
    regen, raw, counts = raw_answers.build([str(tmp_path / "rows")], exchanges, tok, 10**6, 0.1, 0, eos)
    by_id = {r["id"]: r for r in rows}
    assert counts["sharegpt_rows"] == 40 and counts["rows"] == len(regen) == len(raw) > 0
    assert (
        counts["no_reply"] + counts["prompt_differs"] + counts["reply_shorter"] + counts["held_out"] + counts["paired"]
        == 40
    )
    assert counts["prompt_differs"] >= 1 and counts["reply_shorter"] >= 1 and counts["no_reply"] >= 1
    for a, b in zip(regen, raw):
        assert b["id"] == "raw:" + a["id"] and a == {k: by_id[a["id"]][k] for k in ("id", "input_ids", "prompt_length")}
        p = a["prompt_length"]
        assert b["prompt_length"] == p and b["input_ids"][:p] == a["input_ids"][:p]
        assert len(b["input_ids"]) == len(a["input_ids"])
        reply = encode(exchanges[a["id"][len("sharegpt-") :]][1]) + [eos]
        assert b["input_ids"][p:] == reply[: len(a["input_ids"]) - p]
        assert held_draw(a["id"], 0) >= 0.1 and held_draw(b["id"], 0) >= 0.1  # training rows under both ids
    answers = [len(r["input_ids"]) - r["prompt_length"] for r in regen]
    assert counts["answer_tokens"] == sum(answers)
    capped, _, c = raw_answers.build([str(tmp_path / "rows")], exchanges, tok, 30, 0.1, 0, eos)
    assert {r["id"] for r in capped} < {r["id"] for r in regen}  # the same draw, cut earlier
    assert 30 <= c["answer_tokens"] < 30 + max(answers)
