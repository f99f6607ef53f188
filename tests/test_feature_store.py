"""The on-disk feature store (training/feature_store.py): it holds exactly the target's features, builds resumably,
grows by an append-only index, reads batches and the first format, serves the trainer so the target never runs,
trains the same head as the live target, and refuses a mismatch."""

import json

import datasets
import numpy as np
import pytest
import torch

from test_training import losses_of, regenerated_rows, sharp_target, training_args
from jetspec.tiny import tiny_head, tiny_target
from training.feature_store import (
    DATA_NAME,
    INDEX_NAME,
    INDEX_RECORD,
    META_NAME,
    FeatureStore,
    StoreWriter,
    build_feature_store,
    stack_states,
)
from training.rows import row_key
from training.trainer import JetSpecTrainer


def test_store_holds_the_targets_features_and_final_states(tmp_path):
    target = sharp_target()
    head = tiny_head(target)
    rows = regenerated_rows(target, count=6)
    store = build_feature_store(
        target, head.config.target_layer_ids, rows, tmp_path / "store", batch_tokens=64, chunk_rows=4, progress=False
    )
    assert len(store) == 6
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            out = target.get_decoder()(input_ids=ids, output_hidden_states=True)
        features, final = store.get(row_key(row["id"]), len(row["input_ids"]))
        expected = head.target_features(out.hidden_states)[0].to(torch.bfloat16)
        # rows are batched with others (padded right): equal to a lone forward up to float rounding
        torch.testing.assert_close(features.float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(
            final.float(), out.last_hidden_state[0].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2
        )
        assert store.covers(row_key(row["id"]), len(row["input_ids"]))
        assert not store.covers(row_key(row["id"]), len(row["input_ids"]) + 1)


def test_store_resumes_and_extends_to_the_same_bytes(tmp_path):
    target = sharp_target()
    layers = tiny_head(target).config.target_layer_ids
    rows = regenerated_rows(target, count=10)
    whole = build_feature_store(target, layers, rows, tmp_path / "whole", chunk_rows=3, progress=False)
    part = build_feature_store(target, layers, rows[:4], tmp_path / "part", chunk_rows=3, progress=False)
    with open(tmp_path / "part" / "features.bin", "ab") as handle:  # an interrupted chunk's bytes, never named
        handle.write(b"\x01" * 1000)
    part = build_feature_store(target, layers, rows, tmp_path / "part", chunk_rows=3, progress=False)
    assert len(part) == len(whole) == 10
    for row in rows:
        key, n = row_key(row["id"]), len(row["input_ids"])
        for a, b in zip(part.get(key, n), whole.get(key, n)):
            assert torch.equal(a, b)


def test_trainer_reads_the_store_and_never_runs_the_target(tmp_path):
    target = sharp_target()
    rows = regenerated_rows(target)
    dataset = datasets.Dataset.from_list(rows)
    build_feature_store(target, tiny_head(target).config.target_layer_ids, rows, tmp_path / "store", progress=False)
    curves = []
    for store in (None, FeatureStore(tmp_path / "store")):
        head = tiny_head(target, last_context_input=True).train()
        calls = []
        hook = target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
        trainer = JetSpecTrainer(
            model=head,
            train_dataset=dataset,
            target=target,
            args=training_args(tmp_path / str(store is not None), max_steps=6, num_blocks_per_sequence=3),
            feature_store=store,
        )
        trainer.train()
        hook.remove()
        assert (len(calls) == 0) == (store is not None)
        curves.append(losses_of(trainer.state.log_history))
    # the live target runs in float32, the store holds bf16: the same head learns along the same curve
    assert curves[1] == pytest.approx(curves[0], rel=0.05)
    assert curves[1][-1] < curves[1][0]


def test_dataloader_workers_read_the_store_ahead_and_train_the_same_curve(tmp_path):
    """With dataloader workers the collator reads each batch's features from the store (ahead of the step, in the
    worker); the steps see exactly the features the step would have read itself: the same losses, bit for bit, and
    the target never runs."""
    target = sharp_target()
    rows = regenerated_rows(target)
    dataset = datasets.Dataset.from_list(rows)
    build_feature_store(target, tiny_head(target).config.target_layer_ids, rows, tmp_path / "store", progress=False)
    curves = []
    for workers in (0, 1):
        head = tiny_head(target, last_context_input=True).train()
        calls = []
        hook = target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
        trainer = JetSpecTrainer(
            model=head,
            train_dataset=dataset,
            target=target,
            args=training_args(
                tmp_path / str(workers), max_steps=5, num_blocks_per_sequence=3, dataloader_num_workers=workers
            ),
            feature_store=FeatureStore(tmp_path / "store"),
        )
        assert (trainer.data_collator.feature_store is not None) == (workers > 0)
        trainer.train()
        hook.remove()
        assert not calls
        curves.append(losses_of(trainer.state.log_history))
    assert curves[1] == curves[0]


def test_store_refuses_other_layers_and_bad_input(tmp_path):
    target = sharp_target()
    head = tiny_head(target)
    rows = regenerated_rows(target, count=3)
    build_feature_store(target, [0], rows, tmp_path / "store", progress=False)
    with pytest.raises(ValueError, match="expected a feature store of target layers"):
        JetSpecTrainer(
            model=head,
            args=training_args(tmp_path),
            train_dataset=datasets.Dataset.from_list(rows),
            target=target,
            feature_store=FeatureStore(tmp_path / "store"),
        )
    with pytest.raises(ValueError, match="expected the settings of the store"):
        build_feature_store(target, [1], rows, tmp_path / "store", progress=False)
    with pytest.raises(ValueError, match="expected target layer ids"):
        build_feature_store(target, [99], rows, tmp_path / "other", progress=False)
    with pytest.raises(ValueError, match=f"holding {META_NAME}"):
        FeatureStore(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="at most"):
        FeatureStore(tmp_path / "store").get(row_key(rows[0]["id"]), 10_000)


def test_regeneration_captures_the_same_features_as_a_forward(tmp_path):
    """Features kept while generating (left-padded batches, EOS at varied steps) match a later forward over the
    finished rows, position by position; the last position of a row, never fed to the target, is zero."""
    from test_regenerate import RUN, tiny_model, tiny_tokenizer, write_prompts
    from training.feature_store import StoreWriter, store_settings
    from training.answers import read_prompts, regenerate
    from training.rows import load_regenerated

    model, tokenizer = tiny_model(), tiny_tokenizer()
    write_prompts(tmp_path / "prompts.jsonl", 11)
    prompts = read_prompts(tmp_path / "prompts.jsonl")
    writer = StoreWriter(tmp_path / "captured", store_settings(model, [0, 1], max_length=512))
    regenerate(model, tokenizer, prompts, tmp_path / "regen", feature_store=writer, **RUN)
    rows = list(load_regenerated(tmp_path / "regen"))
    regenerate(model, tokenizer, prompts, tmp_path / "plain", **RUN)
    assert [r["input_ids"] for r in load_regenerated(tmp_path / "plain")] == [r["input_ids"] for r in rows]
    lengths = {len(r["input_ids"]) - r["prompt_length"] for r in rows}
    assert len(lengths) > 1  # some answers stopped at EOS, others ran to max_new_tokens
    captured = FeatureStore(tmp_path / "captured")
    forward = build_feature_store(model, [0, 1], rows, tmp_path / "forward", progress=False)
    assert len(captured) == len(forward) == len(rows)
    for row in rows:
        key, n = row_key(row["id"]), len(row["input_ids"])
        for got, want in zip(captured.get(key, n), forward.get(key, n)):
            torch.testing.assert_close(got[:-1].float(), want[:-1].float(), atol=1e-2, rtol=1e-2)
            assert not got[-1].any()


TINY_SETTINGS = {"target": "", "target_layer_ids": [0], "hidden_size": 2, "dtype": "bfloat16", "max_length": 6}


def tiny_rows(count: int, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    """`count` rows of 1..6 positions of width (1 + 1) * 2, keyed 10, 11, ..., holding bf16-exact values."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (count,), generator=g).tolist()
    return [(10 + i, torch.randint(-64, 64, (n, 4), generator=g).float()) for i, n in enumerate(lengths)]


def test_ten_thousand_rows_append_to_the_index_and_never_rewrite_it(tmp_path):
    """Each chunk appends 24 bytes per row to index.bin and nothing else to the index: store.json is written once.
    (Writing the whole index at every chunk, as the first format did, costs time quadratic in the rows.)"""
    rows = tiny_rows(10_000)
    writer = StoreWriter(tmp_path / "store", TINY_SETTINGS)
    meta = (tmp_path / "store" / META_NAME).stat()
    index = tmp_path / "store" / INDEX_NAME
    for begin in range(0, len(rows), 128):
        before = index.read_bytes()
        chunk = rows[begin : begin + 128]
        writer.append(chunk + rows[:2])  # rows already stored are skipped
        after = index.read_bytes()
        assert len(after) - len(before) == INDEX_RECORD.itemsize * len(chunk) and after.startswith(before)
    after = (tmp_path / "store" / META_NAME).stat()
    assert (after.st_mtime_ns, after.st_size) == (meta.st_mtime_ns, meta.st_size)
    assert index.stat().st_size == INDEX_RECORD.itemsize * 10_000
    store = FeatureStore(tmp_path / "store")
    assert len(store) == 10_000 and store.total == sum(len(block) for _, block in rows)
    picked = [rows[i] for i in (9_999, 3, 5_000, 17)]  # not in file order
    lengths = [len(block) - (i % 2) or 1 for i, (_, block) in enumerate(picked)]
    features, final = store.get_batch([key for key, _ in picked], lengths, width=8)
    assert features.shape == (4, 8, 2) and final.shape == (4, 8, 2)
    for i, ((key, block), n) in enumerate(zip(picked, lengths)):
        assert torch.equal(torch.cat([features[i], final[i]], -1)[:n], block[:n].to(torch.bfloat16))
        assert not features[i, n:].any() and not final[i, n:].any()  # right padding
        one = store.get(key, n)
        assert torch.equal(one[0], features[i, :n]) and torch.equal(one[1], final[i, :n])
    assert store.covers_all([10, 11], [1, 1]) and not store.covers_all([10, 9], [1, 1])
    with pytest.raises(ValueError, match="expected at most 0 positions of row 9"):
        store.get_batch([10, 9], [1, 1])


def test_an_interrupted_append_is_dropped_and_the_build_goes_on(tmp_path):
    rows = tiny_rows(20)
    writer = StoreWriter(tmp_path / "store", TINY_SETTINGS)
    writer.append(rows[:10])
    with open(tmp_path / "store" / DATA_NAME, "ab") as handle:  # a chunk's features, never indexed ...
        handle.write(b"\x01" * 100)
    with open(tmp_path / "store" / INDEX_NAME, "ab") as handle:  # ... and a record cut short
        handle.write(b"\x02" * 7)
    assert len(FeatureStore(tmp_path / "store")) == 10  # a reader sees only whole records
    StoreWriter(tmp_path / "store", TINY_SETTINGS).append(rows)
    store = FeatureStore(tmp_path / "store")
    assert len(store) == 20
    for key, block in rows:
        features, final = store.get(key, len(block))
        assert torch.equal(torch.cat([features, final], -1), block.to(torch.bfloat16))


def test_a_first_format_store_is_read_as_it_is_and_moved_to_the_index_when_extended(tmp_path):
    """The first format kept its index in store.json (`rows` {key: [start, length]} and `total`)."""
    rows = tiny_rows(6)
    folder = tmp_path / "old"
    folder.mkdir()
    starts = np.cumsum([0] + [len(block) for _, block in rows])
    index = {str(key): [int(starts[i]), len(block)] for i, (key, block) in enumerate(rows[:5])}
    (folder / META_NAME).write_text(json.dumps({**TINY_SETTINGS, "rows": index, "total": int(starts[5])}))
    data = torch.cat([block for _, block in rows[:5]]).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()
    (folder / DATA_NAME).write_bytes(data)
    old = FeatureStore(folder)
    assert len(old) == 5 and not (folder / INDEX_NAME).exists()
    for key, block in rows[:5]:
        assert torch.equal(torch.cat(old.get(key, len(block)), -1), block.to(torch.bfloat16))
    StoreWriter(folder, TINY_SETTINGS).append(rows)
    meta = json.loads((folder / META_NAME).read_text())
    assert meta["format"] == 2 and "rows" not in meta and "total" not in meta
    new = FeatureStore(folder)
    assert len(new) == 6
    for key, block in rows:
        assert torch.equal(torch.cat(new.get(key, len(block)), -1), block.to(torch.bfloat16))


def test_the_store_keeps_only_the_stored_layers_and_the_same_bytes_as_a_full_forward(tmp_path):
    """The build asks the target for the stored layers and the final state only (`output_hidden_states` as a list);
    each row, forwarded alone (`batch_tokens=1`), holds the bytes of a forward that keeps every layer."""
    target = tiny_target("llama", num_hidden_layers=4)
    rows = regenerated_rows(target, count=4)
    seen = []
    hook = target.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: seen.append((kwargs["output_hidden_states"], out.hidden_states)),
        with_kwargs=True,
    )
    store = build_feature_store(target, [1, 2], rows, tmp_path / "store", batch_tokens=1, progress=False)
    hook.remove()
    assert len(seen) == 4 and all(asked == [2, 3, -1] for asked, _ in seen)
    assert all([i for i, s in enumerate(states) if s is not None] == [2, 3, 4] for _, states in seen)
    for row in rows:
        with torch.no_grad():
            full = target.get_decoder()(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
        want = stack_states(full.hidden_states, [1, 2])[0]
        got = torch.cat(store.get(row_key(row["id"]), len(row["input_ids"])), -1)
        assert torch.equal(got.view(torch.uint16), want.view(torch.uint16))


def test_held_out_rows_can_be_stored_first_or_alone(tmp_path, monkeypatch):
    """`--held_out only` stores exactly the trainer's held-out rows (what offline evaluation reads); `first` then
    extends the same store with the rest, skipping the rows it holds."""
    from test_evaluate_head import write_npz

    from training import feature_store
    from training.evaluate_head import held_out_rows

    target = sharp_target()
    rows = regenerated_rows(target, count=40)
    data = str(write_npz(tmp_path / "rows.npz", rows))
    monkeypatch.setattr(feature_store, "load_target", lambda *a, **k: (target, None))
    common = ["--data", data, "--out", str(tmp_path / "store"), "--dtype", "float32", "--eval_fraction", "0.2"]
    layers = ["--target_layer_ids", *map(str, tiny_head(target).config.target_layer_ids)]
    store = feature_store.main([*common, *layers, "--held_out", "only"])
    held = {row_key(i) for i in held_out_rows([data], 0.2, 0)["id"]}
    assert 0 < len(held) < len(rows)
    assert all(store.covers(key, 1) for key in held)
    assert len(store) == len(held)
    store = feature_store.main([*common, *layers, "--held_out", "first"])
    assert len(store) == len(rows)
    with pytest.raises(ValueError, match="expected --held_out among"):
        feature_store.main([*common, "--held_out", "last"])
