"""Training from `datasets` sources (training/rows.py, training/run_trainer.py): a `save_to_disk` folder and a
streamed jsonl file (an `IterableDataset`), split by id hash exactly as a map-style dataset, trained on a tiny
target and shipped without random access. No network: every source is a local file."""

import json

import datasets
import pytest
import torch
from transformers import AutoModel, set_seed

from test_training import losses_of, regenerated_rows, save_target_folder, sharp_target
from training import run_trainer
from training.rows import first_rows, load_rows, split_train_eval
from training.run_trainer import HeadArguments, build_head


def training_command(target_dir, data, out, *extra):
    return [
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "5",
        "--learning_rate",
        "3e-3",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--eval_fraction",
        "0.2",
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
        "no",
        "--seed",
        "0",
        *extra,
    ]


def write_jsonl(path, rows):
    path.write_text(
        "".join(json.dumps({key: row[key] for key in ("id", "input_ids", "prompt_length")}) + "\n" for row in rows)
    )
    return path


@pytest.fixture(scope="module")
def target():
    return sharp_target()


@pytest.fixture(scope="module")
def rows(target):
    return regenerated_rows(target, count=24)


def initial_head(target):
    """The head `run_trainer.main` starts from: built after `set_seed(0)` with the command's architecture."""
    set_seed(0)
    return build_head(HeadArguments(num_hidden_layers=1), target, block_size=6)


def check_trained(out, target, before_target):
    """Training happened and shipped: a loss per step that moves, every head weight changed, the target untouched,
    and the saved head reloads with the lookup prior measured on the training rows."""
    log = json.loads((out / "training_log.json").read_text())
    losses = losses_of(log)
    assert len(losses) == 5 and len(set(losses)) > 1
    trained = AutoModel.from_pretrained(out, trust_remote_code=True)
    start = dict(initial_head(target).named_parameters())
    for name, param in trained.named_parameters():
        if name in start:  # the head's own weights (the target's embeddings and LM head are borrowed, not saved)
            assert not torch.equal(param, start[name]), name
    for name, param in target.named_parameters():
        assert torch.equal(param, before_target[name]), name
    assert len(trained.config.tree_lookup_prior) == 3
    return (out / "README.md").read_text()


def test_a_saved_to_disk_dataset_trains_and_ships(tmp_path, target, rows):
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))  # also holds `prompt` and `answer`, left unread
    target_dir = save_target_folder(target, tmp_path / "target")
    before = {name: p.clone() for name, p in target.named_parameters()}
    metrics = run_trainer.main(training_command(target_dir, folder, tmp_path / "head"))
    card = check_trained(tmp_path / "head", target, before)
    _, held_out = split_train_eval(load_rows([str(folder)]), 0.2, seed=0)
    assert f"Training sequences: {24 - len(held_out)}, held out: {len(held_out)}" in card
    assert "eval_acc_depth_1" in metrics


def test_a_streamed_jsonl_trains_and_ships_without_random_access(tmp_path, target, rows):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    target_dir = save_target_folder(target, tmp_path / "target")
    before = {name: p.clone() for name, p in target.named_parameters()}
    command = training_command(
        target_dir, path, tmp_path / "head", "--streaming", "--shuffle_buffer", "8", "--draft_vocab_size", "64"
    )
    metrics = run_trainer.main(command)
    card = check_trained(tmp_path / "head", target, before)
    _, held_out = split_train_eval(load_rows([str(path)]), 0.2, seed=0)
    # a stream has no length to put on the card
    assert f"Training sequences: streamed, held out: {len(held_out)}" in card
    assert 0 < metrics["draft_vocab_coverage"] <= 1 and "eval_acc_depth_1" in metrics


def test_a_stream_splits_as_the_map_style_dataset(tmp_path, rows):
    """The same rows are held out whether the source is streamed or not, and no held-out row reaches the training
    stream; the stream's first rows stand in for random access."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    train, held_out = split_train_eval(load_rows([str(path)]), 0.2, seed=0)
    stream_train, stream_held_out = split_train_eval(load_rows([str(path)], streaming=True), 0.2, seed=0)
    assert isinstance(stream_train, datasets.IterableDataset) and isinstance(stream_held_out, datasets.Dataset)
    assert 0 < len(held_out) < len(rows)
    assert stream_held_out.to_list() == held_out.to_list()
    assert [row["id"] for row in stream_train] == train["id"]
    assert first_rows(stream_train, 3).to_list() == train.select(range(3)).to_list()
    # a cap on the stream's held-out rows keeps its first ones; the rest are neither trained nor evaluated
    _, capped = split_train_eval(load_rows([str(path)], streaming=True), 0.2, seed=0, stream_eval_rows=1)
    assert capped["id"] == held_out["id"][:1]


def test_a_stream_holds_out_one_row_when_the_hash_holds_none(tmp_path, rows):
    path = write_jsonl(tmp_path / "rows.jsonl", rows[:3])
    train, held_out = split_train_eval(load_rows([str(path)]), 0.01, seed=0)
    stream_train, stream_held_out = split_train_eval(load_rows([str(path)], streaming=True), 0.01, seed=0)
    assert len(held_out) == 1 and stream_held_out["id"] == held_out["id"]
    assert [row["id"] for row in stream_train] == train["id"]


def test_streaming_needs_max_steps_before_the_target_loads(tmp_path, rows, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load for a refused command")

    monkeypatch.setattr(run_trainer, "load_target", no_target)
    command = [arg for arg in training_command("unused", path, tmp_path / "head", "--streaming")]
    at = command.index("--max_steps")
    del command[at : at + 2]
    with pytest.raises(ValueError, match="expected --max_steps > 0 with --streaming"):
        run_trainer.main(command)


def test_a_source_without_the_training_columns_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    for streaming in (False, True):
        with pytest.raises(
            ValueError,
            match=r"expected the columns \['id', 'input_ids', 'prompt_length'\] in .*"
            r"prompts\.jsonl, got \['id', 'prompt'\]",
        ):
            load_rows([str(path)], streaming=streaming)


def test_a_prompt_in_two_sources_is_refused_by_name(tmp_path):
    """No prompt twice: a file regenerated without --exclude naming the committed ones repeats their ids."""
    rows = [{"id": f"p{i}", "input_ids": [1, 2, 3 + i], "prompt_length": 1} for i in range(6)]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    second.write_text("".join(json.dumps(r) + "\n" for r in rows[3:]))  # p3 in both
    with pytest.raises(ValueError, match=r"got 'p3' in .*first\.jsonl and in .*second\.jsonl"):
        load_rows([str(first), str(second)])
    second.write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    assert load_rows([str(first), str(second)])["id"] == [r["id"] for r in rows]
