"""The `jetspec` command (`jetspec.cli`): bad input exits with status 2 and one line; a tiny target saved to disk
runs `generate` and `bench` end to end, and the bench's results name that target and head without absolute paths.
"""

import json
import re
import subprocess
import sys

import pytest
from test_bench import char_tokenizer, tiny_pair

from jetspec import cli


def cli_error(capsys, argv) -> str:
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jetspec") and "error:" in err and "\n" not in err  # one line
    return err


@pytest.fixture
def saved_head(tmp_path):
    _, head = tiny_pair()
    head.save_pretrained(tmp_path / "head")
    return tmp_path / "head"


@pytest.fixture
def saved_target(tmp_path):
    target, _ = tiny_pair()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    return tmp_path / "target"


def test_cli_rejects_an_unknown_suite(capsys, saved_head):
    err = cli_error(capsys, ["bench", "--suite", "gsm8k,nope", "--head", str(saved_head)])
    assert "'nope'" in err and "gsm8k, humaneval, mtbench" in err
    assert "at least one suite" in cli_error(capsys, ["bench", "--suite", ",", "--head", str(saved_head)])


@pytest.mark.parametrize(
    "budgets,message",
    [
        ("", "at least one tree budget"),
        (",", "at least one tree budget"),
        ("8,x", "integers >= 1, got 'x'"),
        ("0", "integers >= 1, got \\[0\\]"),
        ("8,-4", "integers >= 1, got \\[-4\\]"),
        ("8,8", "distinct tree budgets"),
    ],
    ids=["empty", "comma", "word", "zero", "negative", "twice"],
)
def test_cli_rejects_bad_budgets(capsys, saved_head, budgets, message):
    err = cli_error(capsys, ["bench", "--budgets", budgets, "--head", str(saved_head)])
    assert re.search(message, err), err


def test_cli_rejects_a_missing_head(capsys, tmp_path, monkeypatch):
    missing = tmp_path / "no-head"
    err = cli_error(capsys, ["generate", "hi", "--head", str(missing)])
    assert str(missing) in err and "train one" in err
    # the embedded default head, when it is not committed yet
    monkeypatch.setitem(cli.DEFAULT_HEADS, cli.DEFAULT_TARGET, missing)
    err = cli_error(capsys, ["bench", "--suite", "gsm8k"])
    assert str(missing) in err and "run_trainer.py" in err
    err = cli_error(capsys, ["generate", "hi", "--target", "some/other-model"])
    assert "--head" in err


def test_cli_rejects_an_unknown_dtype(capsys, saved_head):
    err = cli_error(capsys, ["generate", "hi", "--dtype", "float16", "--head", str(saved_head)])
    assert "expected --dtype in auto, float32, bfloat16, got 'float16'" in err


def test_cli_rejects_a_draft_vocabulary_the_head_cannot_restrict_to(capsys, saved_target, saved_head):
    err = cli_error(
        capsys,
        [
            "generate",
            "hi",
            "--target",
            str(saved_target),
            "--head",
            str(saved_head),
            "--draft-vocab-size",
            "50",
            "--dtype",
            "float32",
        ],
    )
    assert "drafting from the full vocabulary" in err


def test_cli_rejects_bad_numbers_and_methods(capsys, saved_head):
    assert "integer >= 1" in cli_error(capsys, ["generate", "hi", "--budget", "0", "--head", str(saved_head)])
    assert "integer >= 1" in cli_error(capsys, ["bench", "--limit", "x", "--head", str(saved_head)])
    assert "'plain' among the methods" in cli_error(capsys, ["bench", "--methods", "tree", "--head", str(saved_head)])
    assert "got beam" in cli_error(capsys, ["bench", "--methods", "plain,beam", "--head", str(saved_head)])


def test_python_m_jetspec_reports_bad_input_on_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "jetspec", "bench", "--suite", "nope"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jetspec: error: unknown suite 'nope': expected one of gsm8k, humaneval, mtbench, repeated, mtbench_turn2 "
        "(see --help)"
    ]


def test_cli_generate_end_to_end(capsys, saved_target, saved_head):
    assert (
        cli.main(
            [
                "generate",
                "What is 17 * 23?",
                "--target",
                str(saved_target),
                "--head",
                str(saved_head),
                "--max-new-tokens",
                "8",
                "--budget",
                "4",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "plain greedy:" in printed and "jetspec (B=4):" in printed
    assert "same tokens as plain greedy" in printed  # float32: bitwise, or the command fails
    # tau from the call's own statistics: 8 tokens, the prefill commits one, each verify forward tau on average
    forwards = int(printed.split(" target forwards")[0].rsplit("(", 1)[1])
    assert f"tau {7 / (forwards - 1):.2f}" in printed


def test_cli_bench_end_to_end(capsys, tmp_path, saved_target, saved_head):
    out = tmp_path / "results"
    assert (
        cli.main(
            [
                "bench",
                "--target",
                str(saved_target),
                "--head",
                str(saved_head),
                "--suite",
                "gsm8k",
                "--budgets",
                "4",
                "--max-new-tokens",
                "6",
                "--limit",
                "1",
                "--out",
                str(out),
                "--methods",
                "plain,tree",
                "--threads",
                "1",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    text = (out / "results.json").read_text()
    results = json.loads(text)
    assert results["config"]["methods"] == ["plain", "tree-4"]
    assert results["config"]["target_dtype"] == "torch.bfloat16" and results["config"]["dtype_reason"] == "requested"
    assert all(r["equality"] in ("exact", "tie") for r in results["prompts"])
    # bfloat16: every emitted token of both methods, plain greedy's included, judged against the float32 target
    assert [(r["method"], r["judged"]["tokens"], r["judged"]["violations"]) for r in results["prompts"]] == [
        (r["method"], r["new_tokens"], 0) for r in results["prompts"]
    ]
    assert {m: a["judged"]["tokens"] for m, a in results["aggregates"]["gsm8k"].items()} == {
        r["method"]: r["new_tokens"] for r in results["prompts"]
    }
    # models and folders by their names, never by the absolute paths of this machine
    assert (results["config"]["target"], results["config"]["head"]) == ("target", "head")
    assert results["command"] == (
        "jetspec bench --target target --head head --suite gsm8k --budgets 4 "
        "--max-new-tokens 6 --limit 1 --out results --methods plain,tree --threads 1 "
        "--dtype bfloat16"
    )
    assert str(tmp_path) not in text
    printed = capsys.readouterr().out
    assert "| tree-4 |" in printed and f"wrote {out / 'results.json'}" in printed


def test_cli_rejects_a_missing_target_folder_in_one_line(capsys, tmp_path, saved_head):
    missing = tmp_path / "no-target"
    for command in (["generate", "hi"], ["bench", "--suite", "gsm8k"]):
        err = cli_error(capsys, [*command, "--target", str(missing), "--head", str(saved_head)])
        assert f"got {str(missing)!r}: no such folder" in err
    (tmp_path / "file").write_text("")
    err = cli_error(capsys, ["generate", "hi", "--target", str(tmp_path / "file"), "--head", str(saved_head)])
    assert "a file, not a folder" in err


def test_cli_reports_a_target_that_cannot_load_in_one_line(capsys, tmp_path, saved_head, monkeypatch):
    # a Hub id that cannot be fetched (offline here) or a folder without weights: transformers' OSError, one line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            ["generate", "hi", "--target", str(tmp_path / "empty"), "--head", str(saved_head), "--dtype", "float32"]
        )
    assert exit_info.value.code == 2
    info, error = capsys.readouterr().err.strip().split("\n")  # the dtype line, then one error line
    assert info.startswith("jetspec: target dtype") and error.startswith("jetspec: error:")
    assert str(tmp_path / "empty") in error and "Traceback" not in error


def test_cli_generate_shows_where_tokens_came_from(capsys, saved_target, saved_head):
    """Plain-text marks (stdout is not a terminal here): every token is counted under exactly one source."""
    assert (
        cli.main(
            [
                "generate",
                "abcabcabcabc",
                "--target",
                str(saved_target),
                "--head",
                str(saved_head),
                "--max-new-tokens",
                "12",
                "--dtype",
                "float32",
                "--show-drafts",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "\033[" not in printed
    legend = next(
        line for line in printed.splitlines() if line.startswith("[head]  {lookup}  <both>  target (bonus): ")
    )
    counted = [int(n) for n in re.findall(r"(?:head|lookup|both|target) (\d+) \(", legend)]
    assert len(counted) == 4 and sum(counted) == 12


def run_generate(saved_target, head, *extra) -> str:
    argv = ["generate", "abcabc", "--target", str(saved_target), "--head", str(head), "--max-new-tokens", "8"]
    assert cli.main([*argv, "--dtype", "float32", *extra]) == 0
    return argv


def test_cli_generate_prints_the_operating_point_and_costs_lists_and_clears_its_figures(
    capsys, tmp_path, monkeypatch, saved_target, saved_head
):
    """`--budget auto`: the chosen budget and sources with the figures behind them; `jetspec costs` then lists the
    host costs the choice measured (one entry: this host, target, dtype and batch 1) and `--clear` deletes them."""
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(tmp_path / "costs.json"))
    config = json.loads((saved_head / "config.json").read_text())
    config["tau_by_budget"] = {"head": {"4": 1.4, "8": 1.6}, "head+lookup+trie": {"6": 1.7}}
    (saved_head / "config.json").write_text(json.dumps(config))
    assert cli.main(["costs"]) == 0
    assert "no host costs cached in" in capsys.readouterr().out
    run_generate(saved_target, saved_head, "--budget", "auto")
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("operating point: "))
    chosen = re.match(r"operating point: budget (\d+), sources (\S+): expected [\d.]+x = tau ([\d.]+) ", line)
    assert chosen and f"jetspec (B={chosen[1]}):" in printed
    assert config["tau_by_budget"][chosen[2]][chosen[1]] == float(chosen[3]) and "next best" in line
    assert cli.main(["costs"]) == 0
    listed = capsys.readouterr().out
    assert "| float32 | batch 1 |" in listed and "t(B)/t(1): 4: " in listed and "head+lookup+trie" in listed
    assert cli.main(["costs", "--clear"]) == 0
    assert "cleared 1 cached host cost entries" in capsys.readouterr().out
    assert not (tmp_path / "costs.json").exists()


def test_cli_generate_auto_without_a_table_names_the_fallback(capsys, tmp_path, monkeypatch, saved_target, saved_head):
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(tmp_path / "costs.json"))
    run_generate(saved_target, saved_head, "--budget", "auto")
    printed = capsys.readouterr().out
    assert "operating point: budget 8, sources head+lookup (fallback: no tau_by_budget)" in printed
    assert "jetspec (B=8):" in printed and not (tmp_path / "costs.json").exists()


def test_cli_generate_names_the_chosen_budget_of_a_call_that_ran_no_round(
    capsys, tmp_path, monkeypatch, saved_target, saved_head
):
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(tmp_path / "costs.json"))
    run_generate(saved_target, saved_head, "--budget", "auto", "--max-new-tokens", "1")  # the prefill's token only
    printed = capsys.readouterr().out
    assert "operating point: budget 8, sources head+lookup (fallback: no tau_by_budget)" in printed
    assert "jetspec (B=8):" in printed and "B=auto" not in printed


def test_cli_serve_refuses_a_bad_answer_cache_by_name_before_serving(capsys, saved_target, saved_head):
    argv = ["serve", "--model", str(saved_target), "--head", str(saved_head), "--dtype", "float32", "--device", "cpu"]
    err = cli_error(capsys, [*argv, "--answer-cache", "-1"])
    assert "argument --answer-cache: expected an integer >= 0, got '-1'" in err
    config = json.loads((saved_head / "config.json").read_text())
    config["tree_lookup"] = 0  # a head without a lookup branch: nothing for the cached answers to draft in
    (saved_head / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:  # after the target loads (its progress lines), before serving
        cli.main([*argv, "--answer-cache", "4"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("jetspec") and "error: expected a head with a lookup branch (tree_lookup >= 1) " in last
    assert "for --answer-cache 4" in last


def test_cli_serve_does_all_its_torch_work_on_its_one_inference_thread(monkeypatch, saved_target, saved_head):
    """Loading, the batch cap, the host costs and the requests' calls run on one thread, not the main thread: two
    threads that run torch kernels hold two OpenMP teams, and libgomp then lets idle workers sleep almost at once
    (`jetspec.serve.inference_thread`)."""
    import threading

    import uvicorn

    import jetspec.serve as serve_module
    import jetspec.targets as targets

    seen = {}

    def on_thread(name, function):
        def wrapped(*args, **kwargs):
            seen[name] = threading.current_thread()
            return function(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(targets, "load_target", on_thread("load", targets.load_target))
    monkeypatch.setattr(serve_module, "measure_batch_cap", on_thread("batch cap", serve_module.measure_batch_cap))
    monkeypatch.setattr(serve_module, "time_host_costs", on_thread("host costs", serve_module.time_host_costs))
    build_app = serve_module.build_app

    def built(*args, **kwargs):
        app = build_app(*args, **kwargs)
        seen["app thread"] = args[-1].submit(threading.current_thread).result()
        return app

    monkeypatch.setattr(serve_module, "build_app", built)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.setdefault("served", app))
    argv = ["serve", "--model", str(saved_target), "--head", str(saved_head), "--dtype", "float32", "--device", "cpu"]
    assert cli.main(argv) == 0
    threads = {seen[name] for name in ("load", "batch cap", "host costs", "app thread")}
    assert len(threads) == 1 and threads != {threading.main_thread()} and "served" in seen


def test_no_function_of_the_cli_is_over_80_lines():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cli))
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    assert max(lengths.values()) <= 80, lengths


def test_cli_costs_reports_a_broken_cache_file_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(tmp_path / "costs.json"))
    (tmp_path / "costs.json").write_text("[1, 2]")
    assert "expected a JSON object of host keys" in cli_error(capsys, ["costs"])
    (tmp_path / "costs.json").write_text("{not json")
    assert "Expecting property name" in cli_error(capsys, ["costs"])
