"""Long jobs killed with SIGKILL and resumed with the same command (tests/kill_points.py stops the command at a named
point, the test kills it there):

a) Regeneration, with the tiny float32 target in a subprocess and through the fake completions server: killed while a
   shard is half answered, while its file is half written, and between its file and the manifest. The resumed
   run's export equals an uninterrupted run's: the same ids in the same order, none twice, none missing, the same
   tokens.
b) Training (training/run_trainer.py on a tiny target): killed while a checkpoint is half written, and after a
   complete one. `--resume_from_checkpoint true` skips the half-written one, saying so, and continues from the last
   complete one with the uninterrupted run's losses; `save_total_limit` never deletes the last complete one.
"""

import json
import os
import re
import shutil

import pytest

from fake_openai_server import FakeOpenAIServer, hashed_answer
from kill_points import run_until_killed
from test_regenerate import tiny_model, tiny_tokenizer, write_prompts
from training.rows import load_compact, load_regenerated

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = 11  # shards of 4: 4 + 4 + 3


# ------------------------------------------------------------------------------------------------- regeneration
@pytest.fixture(scope="module")
def regen(tmp_path_factory):
    """The tiny target's folder, the prompts, and the command's common flags."""
    folder = tmp_path_factory.mktemp("regen")
    tiny_model().save_pretrained(folder / "tiny")
    tiny_tokenizer().save_pretrained(folder / "tiny")
    write_prompts(folder / "prompts.jsonl", PROMPTS)
    flags = [
        "--target",
        str(folder / "tiny"),
        "--prompts",
        str(folder / "prompts.jsonl"),
        "--max_new_tokens",
        "6",
        "--batch_size",
        "3",
        "--shard_size",
        "4",
        "--dtype",
        "float32",
    ]
    return folder, flags


def command(flags, folder, name, *extra) -> list[str]:
    return [*flags, "--out", str(folder / name), "--export", str(folder / f"{name}.npz"), *extra]


@pytest.fixture(scope="module")
def uninterrupted(regen):
    """The rows an uninterrupted in-process run exports."""
    from training.regenerate import main

    folder, flags = regen
    main(command(flags, folder, "whole"))
    return load_compact(folder / "whole.npz").to_list()


@pytest.mark.parametrize("point", ["rows=7", "shard-write=1", "manifest=1"])
def test_regeneration_killed_in_a_shard_resumes_to_the_uninterrupted_rows(regen, uninterrupted, tmp_path, point):
    from training.regenerate import main

    _, flags = regen
    killed = command(flags, tmp_path, "out")
    run_until_killed(point, ["-m", "training.regenerate", *killed], tmp_path, ENV)
    out = tmp_path / "out"
    # what the kill left: shard 0 whole; shard 1 half answered (in memory only), half written (a temporary file),
    # or written but not yet in the manifest; no export
    manifest = json.loads((out / "progress.json").read_text())
    assert [shard["file"] for shard in manifest["shards"]] == ["shard-00000.jsonl"]
    assert os.path.exists(out / ".shard-00001.jsonl.tmp") == (point == "shard-write=1")
    assert os.path.exists(out / "shard-00001.jsonl") == (point == "manifest=1")
    assert len(load_regenerated(out)) == (8 if point == "manifest=1" else 4)
    assert not (tmp_path / "out.npz").exists()

    main(killed)  # the same command resumes
    resumed = load_compact(tmp_path / "out.npz").to_list()
    assert [row["id"] for row in resumed] == [f"p{i}" for i in range(PROMPTS)]  # in order, none twice, no gap
    assert resumed == uninterrupted  # float32: the same tokens
    assert json.loads((out / "progress.json").read_text())["rows"] == PROMPTS
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("point", ["rows=6", "shard-write=1"])
def test_server_regeneration_killed_in_a_shard_resumes_to_the_uninterrupted_rows(regen, tmp_path, point):
    """Through the fake server, whose first answer to every prompt is HTTP 500 and which never answers p5 usably:
    the killed and resumed run exports what an uninterrupted one does, p5 in neither and recorded as failed in
    both."""
    from jetspec.targets import apply_chat_template
    from training.regenerate import main

    folder, flags = regen
    tokenizer = tiny_tokenizer()
    p5 = next(
        json.loads(line)
        for line in (folder / "prompts.jsonl").read_text().splitlines()
        if json.loads(line)["id"] == "p5"
    )
    broken = tuple(tokenizer(apply_chat_template(tokenizer, p5["prompt"]), add_special_tokens=False)["input_ids"])

    def script(key):
        return [500] + ["malformed"] * 20 if key == broken else [500]

    retries = ["--server_attempts", "3", "--server_retry_delay", "0.01", "--server_timeout", "60"]
    exports = {}
    for name, kill in (("whole", None), ("out", point)):
        with FakeOpenAIServer(hashed_answer(), script) as server:
            run = command(flags, tmp_path, name, "--server", server.url, *retries)
            if kill is not None:
                run_until_killed(kill, ["-m", "training.regenerate", *run], tmp_path, ENV)
                assert not (tmp_path / "out.npz").exists()
                assert load_regenerated(tmp_path / "out")["id"] == ["p0", "p1", "p2", "p3"]
            main(run)  # uninterrupted, or the same command resuming
            assert server.overflow == 0 and not server.expired
        exports[name] = load_compact(tmp_path / f"{name}.npz").to_list()
        failed = json.loads((tmp_path / name / "progress.json").read_text())["failed"]
        assert list(failed) == ["p5"] and "malformed body (expected one choice)" in failed["p5"]
    assert [row["id"] for row in exports["out"]] == [f"p{i}" for i in range(PROMPTS) if i != 5]
    assert exports["out"] == exports["whole"]


# ----------------------------------------------------------------------------------------------------- training
def training_command(data, target, out, *extra) -> list[str]:
    return [
        "--target",
        str(target),
        "--data",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--eval_fraction",
        "0",
        "--block_size",
        "6",
        "--num_hidden_layers",
        "1",
        "--use_cpu",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        *extra,
    ]


def step_losses(out) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in json.loads((out / "training_log.json").read_text()) if "loss" in e}


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """The tiny target's folder, rows, and the losses of an uninterrupted run."""
    from test_training import regenerated_rows, save_target_folder, sharp_target, write_shards
    from training import run_trainer

    folder = tmp_path_factory.mktemp("train")
    target = sharp_target()
    target_dir = save_target_folder(target, folder / "target")
    data = write_shards(folder / "regen", regenerated_rows(target))
    run_trainer.main(training_command(data, target_dir, folder / "whole"))
    return data, target_dir, step_losses(folder / "whole")


@pytest.mark.parametrize("point, limit", [("save=4", "1"), ("step=2", "2")])
def test_training_killed_resumes_from_the_last_complete_checkpoint(training, tmp_path, capsys, point, limit):
    import torch

    from training import run_trainer
    from training.checkpointing import CHECKPOINT_MARKER, checkpoint_problem

    data, target_dir, whole = training
    out = tmp_path / "run"
    run = training_command(data, target_dir, out, "--save_total_limit", limit)
    run_until_killed(point, ["-m", "training.run_trainer", *run], tmp_path, ENV)
    assert checkpoint_problem(out / "checkpoint-2") is None
    if point == "save=4":  # half written: weights, optimizer and scheduler, and no marker
        assert {"model.safetensors", "optimizer.pt"} <= {p.name for p in (out / "checkpoint-4").iterdir()}
        assert not (out / "checkpoint-4" / CHECKPOINT_MARKER).exists()
        with pytest.raises(
            ValueError,
            match=r"expected a complete checkpoint to resume from, got .*checkpoint-4, an "
            r"incomplete one \(no checkpoint_complete.json",
        ):
            run_trainer.main([*run, "--resume_from_checkpoint", str(out / "checkpoint-4")])
    else:
        assert not (out / "checkpoint-4").exists()

    run_trainer.main([*run, "--resume_from_checkpoint", "true"])
    printed = capsys.readouterr().out
    skipped = re.search(
        r"jetspec: skipping \S*checkpoint-4, an incomplete checkpoint \(no checkpoint_complete.json", printed
    )
    assert (skipped is not None) == (point == "save=4")
    assert re.search(r"jetspec: resuming from \S*checkpoint-2\n", printed)
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4]  # steps 1-2 from the killed run's checkpoint, 3-4 from the resumed one
    torch.testing.assert_close(
        torch.tensor([losses[3], losses[4]]), torch.tensor([whole[3], whole[4]]), rtol=1e-5, atol=0.0
    )
    # the rotation kept the newest complete checkpoints only, the last one whole
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == (["checkpoint-4"] if limit == "1" else ["checkpoint-2", "checkpoint-4"])
    assert checkpoint_problem(out / "checkpoint-4") is None


def test_incomplete_checkpoints_are_told_apart_and_never_kept_by_the_rotation(tmp_path, capsys):
    """Folders as a killed run leaves them: a checkpoint whose marker is missing or whose file was cut after it was
    marked counts as incomplete; `true` resumes from the newest complete one; the rotation deletes the incomplete ones
    and the oldest complete ones, never the one just completed, even when a half-written one has a higher step."""
    from training.checkpointing import (
        CHECKPOINT_MARKER,
        checkpoint_problem,
        last_complete_checkpoint,
        rotate_complete_checkpoints,
        write_checkpoint_marker,
    )

    def checkpoint(step: int, marked: bool = True):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"w" * 64)
        (folder / "trainer_state.json").write_text("{}")
        if marked:
            write_checkpoint_marker(folder, step)
        return folder

    checkpoint(2)
    checkpoint(4)
    cut = checkpoint(6)
    (cut / "model.safetensors").write_bytes(b"w" * 10)  # cut after the marker
    half = checkpoint(8, marked=False)
    assert checkpoint_problem(cut) == "model.safetensors holds 10 bytes, not the 64 recorded"
    assert checkpoint_problem(half).startswith(f"no {CHECKPOINT_MARKER}")
    (tmp_path / "checkpoint-9").mkdir()
    (tmp_path / "checkpoint-9" / CHECKPOINT_MARKER).write_text("{")
    assert checkpoint_problem(tmp_path / "checkpoint-9") == f"{CHECKPOINT_MARKER} is unreadable"
    reports = []
    assert last_complete_checkpoint(tmp_path, reports.append) == str(tmp_path / "checkpoint-4")
    assert [re.search(r"checkpoint-\d+", line).group() for line in reports] == [
        "checkpoint-9",
        "checkpoint-8",
        "checkpoint-6",
    ]
    # a resumed run completes checkpoint-5 (a lower step than the debris): with a limit of 1 it alone remains
    current = checkpoint(5)
    deleted = rotate_complete_checkpoints(tmp_path, 1, keep=[current, None])
    assert sorted(p.name for p in deleted) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
        "checkpoint-9",
    ]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-5"]
    assert "deleting" in capsys.readouterr().out
    shutil.rmtree(current)
    assert last_complete_checkpoint(tmp_path) is None
