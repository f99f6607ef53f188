"""The benchmark and the `jetspec` command, on tiny random targets with an in-process character tokenizer.

The benchmark's headline guarantee is checked from outside: every `generate` call it makes is recorded, and on
every prompt each method's tokens must equal plain greedy's. Bracketing it, a method that returns a wrong token
must fail the run.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jetspec import cli
from jetspec.bench import LosslessError, run_benchmark
from jetspec.prompts import SUITES
from modeling_jetspec import JetSpecDraftModel
from tiny import tiny_head, tiny_target

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUDGETS = [4, 12]
MAX_NEW = 10
HEAD_METHODS = ("chain", "tree-4", "tree-12", "auto", "tree-12-pc", "tree-4-lookup", "tree-12-lookup",
                "tree-4-lookup-first", "tree-12-lookup-first")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline (ids < 100), anything else is `<unk>`."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
        additional_special_tokens=SPECIALS[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer




def tiny_pair():
    # suite prompts run to ~1,400 characters (one token each): room for them plus the answer
    target = tiny_target("llama", max_position_embeddings=4096)
    # a default prompt-lookup branch, as the shipped head has: the head-only methods must switch it off
    # and a chain (6) longer than the head's depth (4): the lookup methods take the head's chain length
    return target, tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12, tree_lookup=6,
                             tree_lookup_prior=[[0.2, 0.1], [0.5, 0.3], [0.9, 0.8]])


def spy_generate(monkeypatch, target):
    """Record `(prompt ids, method arguments, new tokens)` of every outer `target.generate` call."""
    calls = []
    original = target.generate

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        if "custom_generate" not in kwargs:  # the tree loop re-enters generate with a callable: not an outer call
            ids = kwargs["input_ids"]
            key = {k: kwargs[k] for k in ("prompt_lookup_num_tokens", "tree_budget", "tree_width", "tree_lookup", "tree_lookup_prior") if k in kwargs}
            calls.append((tuple(ids[0].tolist()), key, "assistant_model" in kwargs, out[0, ids.shape[1]:].tolist()))
        return out

    monkeypatch.setattr(target, "generate", generate)
    return calls


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One benchmark run over every suite and method (2 prompts each), with its generate calls recorded."""
    monkeypatch = pytest.MonkeyPatch()
    target, head = tiny_pair()
    calls = spy_generate(monkeypatch, target)
    out = tmp_path_factory.mktemp("bench")
    results = run_benchmark(
        target, char_tokenizer(), head, list(SUITES), BUDGETS, MAX_NEW, 2, out,
        cost_repeats=2, command="pytest", progress=False,
    )
    monkeypatch.undo()
    return results, calls, out


def test_every_method_reproduces_plain_greedy(run):
    results, calls, _ = run
    plain = {}
    for prompt, key, assisted, tokens in calls:
        if not assisted and not key:
            plain.setdefault(prompt, set()).add(tuple(tokens))
    assert all(len(outputs) in (1, 2) for outputs in plain.values())  # warm-up prompt: a short and a full run
    measured = [c for c in calls if len(c[3]) == MAX_NEW]
    assert len({c[0] for c in measured}) == 2 * len(SUITES)  # every prompt reached the methods
    for prompt, key, assisted, tokens in measured:
        reference = [o for o in plain[prompt] if len(o) == MAX_NEW]
        assert [tuple(tokens)] == reference, (key, assisted)
    # every method ran on every prompt, path conditioning at the head's default budget (12)
    methods = {r["method"] for r in results["prompts"]}
    assert methods == {"plain", "prompt_lookup", "chain", "tree-4", "tree-12", "auto", "tree-12-pc", "tree-4-lookup",
                       "tree-12-lookup", "tree-4-lookup-first", "tree-12-lookup-first"}
    arguments = results["config"]["method_arguments"]
    assert arguments["tree-12-pc"] == {"tree_budget": 12, "path_conditioning": True, "tree_lookup": 0}
    assert arguments["tree-4-lookup"] == {"tree_budget": 4, "tree_lookup": 6}  # the head's prior scores the chain
    assert arguments["tree-4-lookup-first"] == {"tree_budget": 4, "tree_lookup": 6, "tree_lookup_prior": False}
    # chain, tree-B, auto and tree-B-pc measure the head alone although the head's default has a lookup branch
    for name in ("chain", "tree-4", "tree-12", "auto", "tree-12-pc"):
        assert arguments[name]["tree_lookup"] == 0, name
    assisted_lookups = {key.get("tree_lookup") for _, key, assisted, _ in calls if assisted}
    assert assisted_lookups == {0, 6}
    assert all(r["equality"] == "exact" for r in results["prompts"])  # float32: bitwise
    for name in methods:
        assert sum(r["method"] == name for r in results["prompts"]) == 2 * len(SUITES)


def test_results_json_has_every_field(run):
    results, _, out = run
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    for key in ("started_at", "wall_seconds", "command", "machine", "versions", "config", "notes",
                "costs", "aggregates", "prompts", "plots"):
        assert key in on_disk, key
    assert on_disk["command"] == "pytest"
    assert {"platform", "cpu_count", "torch_threads", "python"} <= set(on_disk["machine"])
    assert {"torch", "transformers", "jetspec", "git_commit"} <= set(on_disk["versions"])
    assert "muse_glimmer" in on_disk["notes"]["chain"]
    config = on_disk["config"]
    assert config["budgets"] == BUDGETS and config["max_new_tokens"] == MAX_NEW and config["chain_depth"] == 4
    assert config["method_arguments"]["chain"] == {"tree_depth": 4, "tree_width": 1, "tree_budget": 4, "tree_lookup": 0}

    costs = on_disk["costs"]
    assert costs["draft_cost_c"] == pytest.approx(costs["draft_forward_seconds"] / costs["target_step_seconds"])
    assert set(costs["verify"]) == {"4", "12"}
    assert [costs["verify"][b]["nodes"] for b in ("4", "12")] == BUDGETS  # depth 4, width 3 holds 120 nodes
    assert costs["chain"]["nodes"] == 4
    for entry in list(costs["verify"].values()) + [costs["chain"]]:
        assert entry["seconds"] > 0 and entry["ratio_to_step"] > 0

    assert set(on_disk["aggregates"]) == set(SUITES) | {"all"}
    for suite, methods in on_disk["aggregates"].items():
        assert methods["plain"]["speedup_median"] == pytest.approx(1.0)
        for name, agg in methods.items():
            for field in ("prompts", "tokens_per_s_median", "speedup_median", "speedup_q25", "speedup_q75",
                          "speedup_iqr", "tau_mean", "acceptance_per_depth", "limit_speedup"):
                assert field in agg, (suite, name, field)
            assert agg["speedup_q25"] <= agg["speedup_median"] <= agg["speedup_q75"]
            if name in HEAD_METHODS:
                rows = [r for r in on_disk["prompts"] if r["method"] == name and (suite == "all" or r["suite"] == suite)]
                assert agg["tau_mean"] == pytest.approx(sum(r["tau"] for r in rows) / len(rows))
                deepest = 6 if "lookup" in name else 4  # the lookup chain (6) runs past the head's depth (4)
                assert 1 <= len(agg["acceptance_per_depth"]) <= deepest and agg["budget_mean"] >= 1
                if name != "auto":
                    assert agg["limit_speedup"] > 0 and len(agg["acceptance_per_depth"]) == deepest
                    assert agg["budget_mean"] == (4 if name == "chain" else int(name.split("-")[1]))
            else:
                assert agg["tau_mean"] is None

    for row in on_disk["prompts"]:
        assert row["new_tokens"] == MAX_NEW and row["seconds"] > 0
        assert row["tokens_per_s"] == pytest.approx(MAX_NEW / row["seconds"])
        if row["method"] in HEAD_METHODS:
            # the prefill commits one token, each verify round (one target forward each) commits tau on average
            assert row["tau"] == pytest.approx((MAX_NEW - 1) / (row["target_forwards"] - 1))
            assert row["draft_seconds"] > 0 and row["verify_seconds"] > 0
            assert 1 <= len(row["acceptance_per_depth"]) <= (6 if "lookup" in row["method"] else 4)
    # rotating order: over the prompts, plain runs in more than one slot
    assert len({r["slot"] for r in on_disk["prompts"] if r["method"] == "plain"}) > 1


def test_report_and_plots_are_written(run):
    results, _, out = run
    assert sorted(results["plots"]) == ["acceptance_per_depth.png", "speedup_vs_budget.png"]
    for name in results["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    report = (out / "results.md").read_text()
    for text in ["## gsm8k", "## humaneval", "## mtbench", "| tree-12 |", "| chain |", "draft cost c", "muse_glimmer"]:
        assert text in report


def test_a_wrong_token_fails_the_run(monkeypatch, tmp_path):
    """A drafter path that returns one wrong token must make the benchmark raise, not report a speedup."""
    target, head = tiny_pair()
    original = JetSpecDraftModel.tree_generate

    def wrong_last_token(self, *args, **kwargs):
        out = original(self, *args, **kwargs).clone()
        out[:, -1] = (out[:, -1] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(JetSpecDraftModel, "tree_generate", wrong_last_token)
    with pytest.raises(LosslessError, match="tree-4.*gsm8k"):
        run_benchmark(
            target, char_tokenizer(), head, ["gsm8k"], [4], 6, 1, tmp_path,
            methods=("plain", "tree"), warmup=False, cost_repeats=1, progress=False,
        )
    assert not (tmp_path / "results.json").exists()


def test_a_failing_auto_budget_fails_the_run(monkeypatch, tmp_path):
    """No method is optional: a broken `auto` is a failure, not a row marked unavailable."""
    target, head = tiny_pair()
    original = JetSpecDraftModel.tree_generate

    def no_auto(self, *args, **kwargs):
        if kwargs.get("tree_budget") == "auto":
            raise NotImplementedError("tree_budget='auto' broke")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JetSpecDraftModel, "tree_generate", no_auto)
    with pytest.raises(NotImplementedError, match="auto' broke"):
        run_benchmark(
            target, char_tokenizer(), head, ["gsm8k"], [4], 6, 2, tmp_path,
            methods=("plain", "tree", "auto"), cost_repeats=1, progress=False,
        )


# ------------------------------------------------------------------------------------------------ the command
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
    target, head = tiny_pair()
    head.save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def test_cli_rejects_an_unknown_suite(capsys, saved_head):
    err = cli_error(capsys, ["bench", "--suite", "gsm8k,nope", "--head", str(saved_head)])
    assert "'nope'" in err and "gsm8k, humaneval, mtbench" in err
    assert "at least one suite" in cli_error(capsys, ["bench", "--suite", ",", "--head", str(saved_head)])


@pytest.mark.parametrize("budgets", ["", ",", "8,x", "0", "8,-4"], ids=["empty", "comma", "word", "zero", "negative"])
def test_cli_rejects_bad_budgets(capsys, saved_head, budgets):
    err = cli_error(capsys, ["bench", "--budgets", budgets, "--head", str(saved_head)])
    assert "tree budget" in err


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


def test_cli_rejects_a_draft_vocabulary_the_head_cannot_restrict_to(capsys, tmp_path, saved_head):
    target, _ = tiny_pair()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    err = cli_error(capsys, ["generate", "hi", "--target", str(tmp_path / "target"), "--head", str(saved_head),
                             "--draft-vocab-size", "50", "--dtype", "float32"])
    assert "drafting from the full vocabulary" in err


def test_cli_rejects_bad_numbers(capsys, saved_head):
    assert "integer >= 1" in cli_error(capsys, ["generate", "hi", "--budget", "0", "--head", str(saved_head)])
    assert "integer >= 1" in cli_error(capsys, ["bench", "--limit", "x", "--head", str(saved_head)])
    assert "methods" in cli_error(capsys, ["bench", "--methods", "tree", "--head", str(saved_head)])


def test_python_m_jetspec_reports_bad_input_on_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "jetspec", "bench", "--suite", "nope"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jetspec: error: unknown suite 'nope': expected one of gsm8k, humaneval, mtbench (see --help)"
    ]


def test_cli_end_to_end_on_a_saved_tiny_target(capsys, tmp_path, saved_head):
    target, _ = tiny_pair()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    folder = str(tmp_path / "target")

    assert cli.main(["generate", "What is 17 * 23?", "--target", folder, "--head", str(saved_head),
                     "--max-new-tokens", "8", "--budget", "4", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "plain greedy:" in printed and "jetspec (B=4):" in printed and "tau" in printed

    out = tmp_path / "results"
    assert cli.main(["bench", "--target", folder, "--head", str(saved_head), "--suite", "gsm8k", "--budgets", "4",
                     "--max-new-tokens", "6", "--limit", "1", "--out", str(out), "--methods", "plain,tree",
                     "--threads", "1", "--dtype", "bfloat16"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["methods"] == ["plain", "tree-4"]
    assert results["config"]["target_dtype"] == "torch.bfloat16" and results["config"]["dtype_reason"] == "requested"
    assert all(r["equality"] in ("exact", "tie") for r in results["prompts"])
    assert results["command"].startswith("jetspec bench --target")
    assert (out / "results.md").is_file() and (out / "speedup_vs_budget.png").is_file()
