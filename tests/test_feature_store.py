"""The on-disk feature store (training/feature_store.py): it holds exactly the target's features, builds resumably,
serves the trainer so the target never runs, trains the same head as the live target, and refuses a mismatch."""

import datasets
import pytest
import torch

from test_training import losses_of, regenerated_rows, sharp_target, training_args
from tiny import tiny_head
from training.feature_store import META_NAME, FeatureStore, build_feature_store
from training.rows import row_key
from training.trainer import JetSpecTrainer


def test_store_holds_the_targets_features_and_final_states(tmp_path):
    target = sharp_target()
    head = tiny_head(target)
    rows = regenerated_rows(target, count=6)
    store = build_feature_store(target, head.config.target_layer_ids, rows, tmp_path / "store", batch_tokens=64,
                                chunk_rows=4, progress=False)
    assert len(store) == 6
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            out = target.get_decoder()(input_ids=ids, output_hidden_states=True)
        features, final = store.get(row_key(row["id"]), len(row["input_ids"]))
        expected = head.target_features(out.hidden_states)[0].to(torch.bfloat16)
        # rows are batched with others (padded right): equal to a lone forward up to float rounding
        torch.testing.assert_close(features.float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(final.float(), out.last_hidden_state[0].to(torch.bfloat16).float(),
                                   atol=2e-2, rtol=2e-2)
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
    build_feature_store(target, tiny_head(target).config.target_layer_ids, rows, tmp_path / "store",
                        progress=False)
    curves = []
    for store in (None, FeatureStore(tmp_path / "store")):
        head = tiny_head(target, last_context_input=True).train()
        calls = []
        hook = target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
        trainer = JetSpecTrainer(model=head, train_dataset=dataset, target=target,
                                 args=training_args(tmp_path / str(store is not None), max_steps=6,
                                                    num_blocks_per_sequence=3),
                                 feature_store=store)
        trainer.train()
        hook.remove()
        assert (len(calls) == 0) == (store is not None)
        curves.append(losses_of(trainer.state.log_history))
    # the live target runs in float32, the store holds bf16: the same head learns along the same curve
    assert curves[1] == pytest.approx(curves[0], rel=0.05)
    assert curves[1][-1] < curves[1][0]


def test_store_refuses_other_layers_and_bad_input(tmp_path):
    target = sharp_target()
    head = tiny_head(target)
    rows = regenerated_rows(target, count=3)
    build_feature_store(target, [0], rows, tmp_path / "store", progress=False)
    with pytest.raises(ValueError, match="expected a feature store of target layers"):
        JetSpecTrainer(model=head, args=training_args(tmp_path), train_dataset=datasets.Dataset.from_list(rows),
                       target=target, feature_store=FeatureStore(tmp_path / "store"))
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
