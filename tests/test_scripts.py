"""The command-line scripts on tiny inputs: the head ablation (scripts/ablate_head.py), the decoding ablation
(scripts/ablate_decoding.py), the draft cost (scripts/measure_draft_cost.py), the training-step timer
(scripts/campaigns/train_step_speed.py), and the module entry points of `training/` (run from the repository root)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from test_training import regenerated_rows, save_target_folder, sharp_target, write_shards
from jetspec.tiny import tiny_head
from training.feature_store import build_feature_store
from training.rows import split_train_eval

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """A script of scripts/ as a module, by its path under scripts/ (`"ablate_head"`, `"campaigns/depth_table"`):
    `scripts` is not a package, and a distribution on the path could own that name."""
    module_name = "jetspec_script_" + name.replace("/", "_")
    spec = importlib.util.spec_from_file_location(module_name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ablate_head_trains_each_variant_once_with_its_one_change(tmp_path, capsys):
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    rows = regenerated_rows(target)
    data = write_shards(tmp_path / "regen", rows)
    head = tiny_head(target)
    build_feature_store(target, head.config.target_layer_ids, rows, tmp_path / "store", progress=False)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"target: {target_dir}\ndata: [{data}]\nblock_size: 6\nnum_hidden_layers: 1\neval_fraction: 0.25\n"
        "num_blocks_per_sequence: 2\nper_device_train_batch_size: 4\nlearning_rate: 3.0e-3\nuse_cpu: true\n"
        "report_to: none\ndisable_tqdm: true\nlogging_steps: 1\neval_strategy: steps\n"
    )
    ablate_head = load_script("ablate_head")
    argv = [
        "--config",
        str(config),
        "--store",
        str(tmp_path / "store"),
        "--steps",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--runs",
        str(tmp_path / "runs"),
        "--offline",
        "off",
        "--variants",
        "baseline",
        "layers2",
    ]
    summary = ablate_head.main(argv)

    assert list(summary) == ["baseline", "layers2"]
    assert summary["layers2"]["change"] == "--num_hidden_layers 2" and summary["baseline"]["steps"] == 2
    assert all(len(row["acc_per_depth"]) == 5 for row in summary.values())  # block 6: depths 1..5 evaluated
    # the variant's one change reached the head it trained; the baseline kept the config's
    layers = {
        name: json.loads((tmp_path / "runs" / name / "config.json").read_text())["num_hidden_layers"]
        for name in summary
    }
    assert layers == {"baseline": 1, "layers2": 2}
    table = (tmp_path / "out" / "ablation.md").read_text()
    assert "| baseline |" in table and "| layers2 | `--num_hidden_layers 2` |" in table
    # a second call finds both measured and trains nothing
    stamp = (tmp_path / "runs" / "baseline" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert ablate_head.main(argv) == summary
    assert capsys.readouterr().out.count("already measured, skipped") == 2
    assert (tmp_path / "runs" / "baseline" / "model.safetensors").stat().st_mtime_ns == stamp


def ablation_config(tmp_path, extra: str = "") -> Path:
    """A tiny target saved to disk, its regenerated rows, their feature store and a config file for ablate_head."""
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    rows = regenerated_rows(target)
    data = write_shards(tmp_path / "regen", rows)
    build_feature_store(target, tiny_head(target).config.target_layer_ids, rows, tmp_path / "store", progress=False)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"target: {target_dir}\ndata: [{data}]\nblock_size: 6\nnum_hidden_layers: 1\neval_fraction: 0.25\n"
        "num_blocks_per_sequence: 2\nper_device_train_batch_size: 4\nlearning_rate: 3.0e-3\nuse_cpu: true\n"
        "report_to: none\ndisable_tqdm: true\nlogging_steps: 1\neval_strategy: steps\n" + extra
    )
    return config


def test_ablate_head_gives_each_variant_the_same_wall_clock(tmp_path, capsys):
    config = ablation_config(tmp_path)
    ablate_head = load_script("ablate_head")
    argv = [
        "--config",
        str(config),
        "--store",
        str(tmp_path / "store"),
        "--minutes",
        "0.05",
        "--out",
        str(tmp_path / "out"),
        "--runs",
        str(tmp_path / "runs"),
        "--offline",
        "off",
        "--variants",
        "baseline",
        "init_target",
    ]
    summary = ablate_head.main(argv)
    out = capsys.readouterr().out
    for name in ("baseline", "init_target"):
        row = summary[name]
        assert row["minutes"] == 0.05 and row["steps"] >= 1
        # the steps fill 0.05 minutes (3 s) at the pace of the variant's own probe
        assert f"ablation: {name} at " in out and f"s/step gets {row['steps']} steps" in out
        assert (tmp_path / "runs" / f"{name}-probe" / "config.json").is_file()
    assert "| 0.05 min |" in (tmp_path / "out" / "ablation.md").read_text()
    assert ablate_head.main(argv) == summary  # measured at this budget: skipped
    other_budget = [("0.1" if arg == "0.05" else arg) for arg in argv]
    assert ablate_head.main(other_budget)["baseline"]["minutes"] == 0.1  # another budget: rerun


def test_depth_table_times_each_trained_head_beside_its_offline_tau(tmp_path, capsys):
    config = ablation_config(tmp_path)
    runs, out = tmp_path / "runs", tmp_path / "out"
    summary = load_script("ablate_head").main(
        ["--config", str(config), "--store", str(tmp_path / "store"), "--steps", "2", "--out", str(out)]
        + ["--runs", str(runs), "--offline", "off", "--variants", "baseline", "layers2"]
    )
    # an offline tau at the defaults for one head (what ablate_head's scorer records), none for the other
    summary["baseline"]["offline"] = {"by_key": {"None": {"lookup_on": {"8": {"tau": 2.5}}}}}
    (out / "ablation.json").write_text(json.dumps(summary))
    depth_table = load_script("campaigns/depth_table")
    argv = ["--ablation", str(out / "ablation.json"), "--runs", str(runs), "--variants", "baseline", "layers2"]
    argv += ["--dtype", "float32", "--prompt_tokens", "16", "--repeats", "2", "--out", str(tmp_path / "depth")]
    result = depth_table.main(argv)

    rows = {row["variant"]: row for row in result["rows"]}
    assert [rows[name]["head_layers"] for name in ("baseline", "layers2")] == [1, 2]
    for row in rows.values():
        costs = row["costs"]
        assert row["c"] == costs["draft_forward_seconds"] / costs["target_step_seconds"] > 0
        assert row["verify_ratio"] == costs["verify"]["8"]["ratio_to_step"] > 0
    base = rows["baseline"]
    # one verify ratio for every head (the target's forward): the median of the rows' timings
    shared = sorted(row["verify_ratio"] for row in rows.values())
    assert base["verify_ratio_shared"] == rows["layers2"]["verify_ratio_shared"] == pytest.approx(sum(shared) / 2)
    assert base["expected_speedup"] == pytest.approx(2.5 / (base["verify_ratio_shared"] + base["c"]))
    assert rows["layers2"]["tau_defaults"] is None and rows["layers2"]["expected_speedup"] is None
    # the minutes each really trained: its steps at its measured pace
    assert base["train_minutes"] == pytest.approx(2 * summary["baseline"]["seconds_per_step"] / 60)
    assert json.loads((tmp_path / "depth" / "depth.json").read_text())["rows"][0]["variant"] == "baseline"
    table = (tmp_path / "depth" / "depth.md").read_text()
    assert "| baseline | 1 | 6 |" in table and "| layers2 | 2 | 6 |" in table and "| 2.500 |" in table
    with pytest.raises(ValueError, match="expected every variant"):
        depth_table.main(argv[:5] + ["layers3"] + argv[6:])


def test_ablate_head_loss_and_block_attention_variants_reach_the_runs(tmp_path):
    """A smoke run of the loss and block-attention variants: each run's card names its loss and its gamma, and its
    head its block attention; the gamma-0 variants train from a copy of the config without `gamma`."""
    config = ablation_config(tmp_path, "gamma: 4.0\n")
    ablate_head = load_script("ablate_head")
    variants = ["kl_tv", "topk_rank", "reverse_kl", "gamma0", "bidir_gamma4", "bidir_gamma0"]
    summary = ablate_head.main(
        [
            "--config",
            str(config),
            "--store",
            str(tmp_path / "store"),
            "--steps",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--runs",
            str(tmp_path / "runs"),
            "--offline",
            "off",
            "--variants",
            *variants,
        ]
    )
    assert list(summary) == variants
    runs = tmp_path / "runs"
    cards = {name: (runs / name / "README.md").read_text() for name in variants}
    assert "total variation" in cards["kl_tv"] and "ranking loss" in cards["topk_rank"]
    assert "reverse KL" in cards["reverse_kl"]
    decayed = {name for name, card in cards.items() if "position decay gamma=4.0" in card}
    assert decayed == {"kl_tv", "topk_rank", "reverse_kl", "bidir_gamma4"}
    attention = {name: json.loads((runs / name / "config.json").read_text())["block_attention"] for name in variants}
    assert {name for name, kind in attention.items() if kind == "bidirectional"} == {"bidir_gamma4", "bidir_gamma0"}
    assert summary["gamma0"]["change"] == "(no gamma)" and summary["gamma0"]["host_kind"]
    assert "host kind" in (tmp_path / "out" / "ablation.md").read_text()


def test_ablate_decoding_decodes_held_out_prompts_like_plain_greedy(tmp_path):
    """Every setting decodes the held-out prompts exactly as plain greedy does (float32), and its tau is reported."""
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    rows = regenerated_rows(target, count=40)
    data = write_shards(tmp_path / "regen", rows)
    tiny_head(target).save_pretrained(tmp_path / "head")
    ablate_decoding = load_script("ablate_decoding")
    summary = ablate_decoding.main(
        [
            "--target",
            str(target_dir),
            "--head",
            str(tmp_path / "head"),
            "--data",
            str(data),
            "--prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--dtype",
            "float32",
            "--settings",
            "tree-16",
            "tree-8-lookup12",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    _, held_out = split_train_eval(datasets.Dataset.from_list(rows), 0.02, 0)
    prompts = min(2, len(held_out))
    assert summary["prompts"] == prompts
    results = summary["results"]
    assert list(results) == ["plain", "tree-16", "tree-8-lookup12"]
    assert all(r["outputs_equal_plain"] == prompts for r in results.values())
    assert results["plain"]["tau_mean"] is None
    assert all(1.0 <= results[name]["tau_mean"] <= 11.0 for name in ("tree-16", "tree-8-lookup12"))
    assert json.loads((tmp_path / "out" / "decoding.json").read_text())["results"] == results


def test_measure_draft_cost_times_one_head_per_draft_vocabulary(capsys):
    measure_draft_cost = load_script("measure_draft_cost")
    measure_draft_cost.main(
        ["--target", "tiny", "--depth", "3", "--context", "16", "--repeats", "2", "--draft-vocab-sizes", "128,32"]
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["draft_vocab_size"] for r in records] == [128, 32]
    assert all(r["depth"] == 3 and r["context"] == 16 and r["target"] == "tiny" for r in records)
    assert all(0 < r["draft_s"] < 10 and 0 < r["target_step_s"] < 10 for r in records)


def test_train_step_speed_trains_every_mode_from_the_same_start(tmp_path):
    """fp32 and bf16 autocast train copies of one head on one batch: the same first loss (the bf16 forward within
    bf16 rounding), and each table row is reported. torch.compile is left to the smoke run (minutes to compile)."""
    train_step_speed = load_script("campaigns/train_step_speed")
    out = tmp_path / "speed.json"
    results = train_step_speed.main(
        [
            "--steps",
            "1",
            "--warmup",
            "0",
            "--modes",
            "fp32,bf16",
            "--hidden_size",
            "64",
            "--intermediate_size",
            "128",
            "--num_layers",
            "4",
            "--num_heads",
            "4",
            "--num_kv_heads",
            "2",
            "--vocab_size",
            "256",
            "--draft_vocab_size",
            "64",
            "--anchors",
            "4",
            "--batch_size",
            "2",
            "--max_length",
            "32",
            "--out",
            str(out),
        ]
    )
    assert list(results) == ["fp32", "bf16"]
    assert results["fp32"]["speedup_over_fp32"] == 1.0
    # one step from the same head on the same batch: the reported losses are those of the first forward
    torch.testing.assert_close(
        torch.tensor(results["bf16"]["last_loss"]), torch.tensor(results["fp32"]["last_loss"]), rtol=2e-2, atol=0.0
    )  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding
    written = json.loads(out.read_text())
    assert written["settings"]["modes"] == "fp32,bf16" and written["host_kind"] and written["host_dtype"]


def test_training_entry_points_run_from_the_repository_root():
    """`python -m training.<cli>` (the command-line modules import their siblings as a package), and
    `python training/run_trainer.py` (as `docs/training.md` and `accelerate launch` run it) via its one bootstrap."""
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    commands = [
        [sys.executable, "-m", "training.regenerate", "--help"],
        [sys.executable, str(Path("training") / "run_trainer.py"), "--help"],
    ]
    for command in commands:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert "usage:" in result.stdout


def chat_target_and_head(tmp_path) -> Path:
    """A tiny target folder whose tokenizer has a chat template, and a random head saved at `tmp_path / "head"`."""
    from transformers import AutoTokenizer

    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(target_dir)
    tiny_head(target).save_pretrained(tmp_path / "head")
    return target_dir


def test_round_stats_prints_the_same_lines_on_every_run(tmp_path, capsys):
    """The float32 round statistics are deterministic (what makes the before/after diff meaningful), one line per
    prompt and method, each with its own tau (the first token comes from the prefill, the rest from rounds)."""
    target_dir = chat_target_and_head(tmp_path)
    round_stats = load_script("round_stats")
    runs = []
    for _ in range(2):
        round_stats.main(
            ["--target", str(target_dir), "--head", str(tmp_path / "head"), "--limit", "1", "--max-new-tokens", "12"]
        )
        runs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3 * len(round_stats.METHODS)  # 1 prompt per suite
    for line in runs[0]:
        assert line["tokens"] == 12 and line["tau"] == round(11 / line["rounds"], 4)


def test_transformers_loop_counts_every_route_against_plain_greedy(tmp_path):
    """Each route's output equals plain greedy (float32) and its tau is new tokens over the target forwards the hook
    counted; the hook is back after the unhooked route."""
    from transformers import GenerationMixin

    target_dir = chat_target_and_head(tmp_path)
    hooked = GenerationMixin.generate
    load_script("transformers_loop").main(
        [
            "--target",
            str(target_dir),
            "--head",
            str(tmp_path / "head"),
            "--limit",
            "1",
            "--max-new-tokens",
            "10",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert GenerationMixin.generate.__wrapped__ is hooked.__wrapped__  # wrapped again, once
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["routes"]) == {"dflash", "chain", "chain+lookup", "tree (defaults)"}
    for route in report["routes"].values():
        assert route["prompts"] == 3 and route["equal"] == 3  # 1 prompt per suite
        assert route["tokens"] == 30 and route["forwards"] >= 3  # at least a prefill per prompt
        assert route["tau"] == round(30 / route["forwards"], 3)


def test_compile_trial_runs_the_same_training_eager_and_compiled(tmp_path, capsys):
    """Both runs train the same rows from the same seed, the second through the Trainer's `torch_compile` (the
    `eager` dynamo backend here: the inductor build takes minutes), and the verdict follows from their numbers."""
    config = ablation_config(tmp_path)
    compile_trial = load_script("campaigns/compile_trial")
    out = tmp_path / "trial"
    argv = ["--config", str(config), "--store", str(tmp_path / "store"), "--steps", "3", "--skip", "1"]
    result = compile_trial.main(argv + ["--backend", "eager", "--out", str(out)])
    eager, compiled = result["runs"]["eager"], result["runs"]["compiled"]
    assert (eager["torch_compile"], compiled["torch_compile"]) == (False, True)
    assert eager["steps"] == compiled["steps"] == 3 and eager["precision"] == compiled["precision"]
    # the eager backend runs the same operations: the same rows and seed give the same held-out loss
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-4)
    verdict = result["verdict"]
    assert verdict["loss_within_tolerance"] and verdict["keep"] == verdict["faster"]
    assert verdict["speedup"] == pytest.approx(eager["seconds_per_step"] / compiled["seconds_per_step"])
    assert json.loads((out / "compile_trial.json").read_text()) == result
    assert ("do not keep" in (out / "compile_trial.md").read_text()) != verdict["keep"]
    with pytest.raises(ValueError, match="expected 0 <= --skip < --steps"):
        compile_trial.main(argv[:-2] + ["--skip", "3", "--out", str(out)])
    with pytest.raises(ValueError, match="feature store folder"):
        compile_trial.main(["--config", str(config), "--store", str(tmp_path / "none"), "--out", str(out)])


def test_eval_curve_keeps_one_row_per_step_and_rewrites_its_own_table(tmp_path):
    curve = load_script("eval_curve")
    history = [
        {"loss": 2.5, "step": 10},
        {"eval_acc_depth_1": 0.5, "eval_acc_depth_2": 0.25, "eval_loss": 2.4, "step": 1800},
        {"eval_acc_depth_1": 0.4, "eval_acc_depth_2": 0.2, "eval_loss": 2.6, "eval_tau_chain": 1.5, "step": 0},
        {"eval_acc_depth_1": 0.55, "eval_acc_depth_2": 0.3, "eval_loss": 2.3, "step": 1800},  # logged again on resume
    ]
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": history}))
    doc = tmp_path / "results.md"
    doc.write_text("before\n<!-- curve -->\n\nafter\n")
    first = curve.main([str(state), "--write", str(doc), "--marker", "curve"])
    rows = first.splitlines()[2:]
    assert rows == ["| 0 | 40.0% | 20.0% | 2.600 | 1.500 |", "| 1,800 | 55.0% | 30.0% | 2.300 | - |"]
    history.append({"eval_acc_depth_1": 0.6, "eval_acc_depth_2": 0.35, "eval_loss": 2.2, "step": 3600})
    state.write_text(json.dumps({"log_history": history}))
    second = curve.main([str(state), "--write", str(doc), "--marker", "curve"])
    assert doc.read_text() == "before\n<!-- curve -->\n\n" + second + "\nafter\n"  # one table, the newer one
    with pytest.raises(ValueError, match="evaluation entries"):
        curve.eval_rows([{"loss": 1.0, "step": 1}])
    with pytest.raises(ValueError, match="expected the line"):
        curve.write_after_marker(doc, "elsewhere", second)


def test_step_timer_refuses_a_mean_over_no_steps():
    """`training.step_timer.StepTimer`: a mean needs a started run and at least one step after the skipped ones."""
    import types

    from training.step_timer import StepTimer

    timer = StepTimer()
    with pytest.raises(ValueError, match="never started"):
        timer.seconds_per_step(0)
    timer.on_train_begin(types.SimpleNamespace(bf16=True, torch_compile=False), None, None)
    assert (timer.precision, timer.compiled) == ("bf16 autocast", False)
    timer.on_step_end(None, None, None)
    timer.on_step_end(None, None, None)
    assert timer.seconds_per_step(1) >= 0 and timer.first_seconds(2) >= timer.first_seconds(1)
    with pytest.raises(ValueError, match="expected 0 <= skip < the 2 timed steps"):
        timer.seconds_per_step(2)


def test_a_seed_variant_keeps_its_bases_rows_and_resumes_from_its_last_checkpoint(tmp_path, capsys):
    """`<variant>_seed<N>` trains the variant from seed N on the same split as the config's seed (the same held-out
    rows judge it); with `--save_every` a run cut off before its row was written resumes from its checkpoint."""
    config = ablation_config(tmp_path, "seed: 5\n")
    ablate_head = load_script("ablate_head")
    argv = ["--config", str(config), "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out")]
    argv += ["--runs", str(tmp_path / "runs"), "--offline", "off", "--save_every", "1"]
    summary = ablate_head.main([*argv, "--steps", "1", "--variants", "baseline_seed3"])
    row = summary["baseline_seed3"]
    assert row["settings"]["seed"] == 5 and row["settings"]["train_seed"] == 3 and not row["resumed"]
    assert row["change"] == "--seed 3"
    _, data_args, train_args = ablate_head.run_trainer.parse_args(
        ablate_head.trainer_arguments(ablate_head.build_parser().parse_args(argv), "baseline_seed3", 1, "x")
    )
    assert (data_args.split_seed, train_args.seed) == (5, 3)
    # the run stopped after its first step's checkpoint, before its row: a rerun at 2 steps resumes it
    (tmp_path / "out" / "ablation.json").write_text("{}")
    capsys.readouterr()
    summary = ablate_head.main([*argv, "--steps", "2", "--variants", "baseline_seed3"])
    assert summary["baseline_seed3"]["resumed"] and "resuming from" in capsys.readouterr().out
    with pytest.raises(ValueError, match="_seed<N>"):
        ablate_head.main([*argv, "--variants", "nonsense_seed1"])
