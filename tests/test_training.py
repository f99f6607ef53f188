"""Distillation of a JetSpec head with the HF Trainer (training/): losses, packed blocks, a real (tiny) training run
that reloads and decodes losslessly, LoRA, 1 vs 2 processes, shipping, and bad input."""

import json
import shutil
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedTokenizerFast, TrainingArguments

from jetspec.targets import load_target
from jetspec.tiny import tiny_head, tiny_target
from training import run_setup, run_trainer
from training import trainer as trainer_module
from training.arguments import DataArguments, HeadArguments, JetSpecTrainingArguments, parse_args
from training.blocks import JetSpecCollator
from training.checkpointing import keep_folder
from training.losses import block_loss, chain_accept_length, depth_weights
from training.feature_store import FeatureStore
from training.rows import split_train_eval
from training.shipping import push_folder, render_card, write_card
from training.trainer import JetSpecTrainer, unwrap_head

REPO = Path(__file__).resolve().parents[1]
VOCAB = 128


# ------------------------------------------------------------------------------------------------------ fixtures
def sharp_target(seed: int = 0):
    """A tiny random Llama whose LM head is scaled up: peaked next-token distributions, so distillation has
    something to learn within a few steps (a plain random target is almost uniform, with KL ~ 0.01)."""
    target = tiny_target("llama", vocab_size=VOCAB, seed=seed)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target


def regenerated_rows(target, count: int = 16, prompt_length: int = 6, seed: int = 0):
    """Rows in `load_regenerated`'s format: random prompts answered greedily by the target, of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (count, prompt_length), generator=g)
    out = target.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=30, pad_token_id=0
    )  # (count, prompt_length + 30)
    return [
        {
            "id": f"row-{i}",
            "prompt": f"prompt {i}",
            "input_ids": out[i, : prompt_length + 12 + (i * 5) % 19].tolist(),
            "prompt_length": prompt_length,
            "answer": "",
        }
        for i in range(count)
    ]


def write_shards(folder: Path, rows) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def save_target_folder(target, folder: Path) -> Path:
    """The tiny target and a word-level tokenizer over its ids, so `load_target(folder)` works offline."""
    target.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", unk_token="t1").save_pretrained(folder)
    return folder


def training_args(tmp_path, **overrides):
    fields = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=12,
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        disable_tqdm=True,
        save_strategy="no",
        seed=0,
        lr_scheduler_type="constant",
    )
    fields.update(overrides)
    return JetSpecTrainingArguments(**fields)


def losses_of(log_history):
    return [entry["loss"] for entry in log_history if "loss" in entry]


# -------------------------------------------------------------------------------------------------------- losses
def test_losses_match_hand_computed_values():
    # two depths, vocabulary of 2; the draft is uniform, the target puts 0.75 / 0.25
    student = torch.zeros(1, 2, 2)
    teacher = torch.log(torch.tensor([[[0.75, 0.25], [0.25, 0.75]]]))
    labels = torch.tensor([[0, 1]])
    everything = torch.ones(1, 2, dtype=torch.bool)
    fkl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    rkl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    # (exact up to fp32 rounding of the logs)
    torch.testing.assert_close(block_loss(student, teacher, labels, everything, "fkl"), torch.tensor(fkl))
    torch.testing.assert_close(block_loss(student, teacher, labels, everything, "rkl"), torch.tensor(rkl))
    torch.testing.assert_close(block_loss(student, None, labels, everything, "sft"), torch.tensor(math.log(2.0)))
    # the draft equals the target: zero KL both ways
    torch.testing.assert_close(block_loss(teacher, teacher, labels, everything, "fkl"), torch.tensor(0.0))

    # depth 1 has loss l1, depth 2 loss l2 (sft on a skewed draft); gamma weights them in the ratio 1 : exp(-1/gamma),
    # scaled to mean 1: w1 = 2 / (1 + e), w2 = 2e / (1 + e), and the loss is the mean over the 2 slots
    student = torch.log(torch.tensor([[[0.9, 0.1], [0.9, 0.1]]]))
    l1, l2 = -math.log(0.9), -math.log(0.1)
    for gamma in (1.0, 4.0):
        e = math.exp(-1.0 / gamma)
        expected = (l1 + e * l2) / (1.0 + e)
        torch.testing.assert_close(
            block_loss(student, None, labels, everything, "sft", gamma=gamma), torch.tensor(expected)
        )
    # a masked-out slot does not count, whatever its loss: one slot left, weighted w1 = 2 / (1 + exp(-1))
    only_first = torch.tensor([[True, False]])
    torch.testing.assert_close(
        block_loss(student, None, labels, only_first, "sft", gamma=1.0), torch.tensor(2.0 / (1.0 + math.exp(-1.0)) * l1)
    )
    decay = torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)])
    torch.testing.assert_close(depth_weights(3, 2.0), decay * 3.0 / decay.sum())
    torch.testing.assert_close(depth_weights(3), torch.ones(3))
    assert chain_accept_length([1.0, 0.5, 0.5]) == 1 + 1 + 0.5 + 0.25


def test_unknown_loss_name_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match=r"expected loss in \('fkl', 'sft', 'rkl', 'kl_tv', 'topk_rank'\).*got 'mse'"):
        JetSpecTrainingArguments(output_dir="unused", loss="mse")
    with pytest.raises(ValueError, match="fkl"):
        block_loss(
            torch.zeros(1, 1, 2),
            torch.zeros(1, 1, 2),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, 1, dtype=torch.bool),
            kind="kl",
        )


# ------------------------------------------------------------------------------------------------- packed blocks
def test_packed_blocks_equal_one_forward_per_block():
    """One packed forward gives each block exactly the logits it gets alone, with only the context before its
    anchor: the block-diagonal mask leaks nothing between blocks, nor from the future of the sequence."""
    target = sharp_target()
    head = tiny_head(target)
    rows = regenerated_rows(target, count=2)
    collator = JetSpecCollator(
        mask_token_id=head.config.mask_id, block_size=8, num_blocks=3, max_length=64, answer_anchor_prob=0.5
    )
    batch = collator(rows)
    lengths = batch["attention_mask"].sum(-1)
    anchors = batch["block_position_ids"].view(2, 3, 8)[..., 0]  # slot 0 of each block sits at its anchor
    with torch.no_grad():
        hidden = target(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
        features = head.target_features(hidden.hidden_states)  # (B, L, k*H)
        valid = torch.arange(features.shape[1]) < lengths.unsqueeze(-1)
        packed = head(
            batch["block_ids"],
            batch["block_position_ids"],
            batch["block_attention_mask"],
            context_features=features,
            context_valid=valid,
        ).logits.view(2, 3, 8, -1)
        for b in range(2):
            for j, a in enumerate(anchors[b].tolist()):
                assert 1 <= a <= int(lengths[b]) - 2
                ids = batch["block_ids"][b, j * 8 : (j + 1) * 8].unsqueeze(0)
                assert int(ids[0, 0]) == int(batch["input_ids"][b, a])  # the anchor is the real token
                assert (ids[0, 1:] == head.config.mask_id).all()
                alone = head(ids, torch.arange(a, a + 8).unsqueeze(0), context_features=features[b : b + 1, :a])
                # same math, different key counts: only summation order differs (fp32)
                torch.testing.assert_close(packed[b, j], alone.logits[0], atol=1e-5, rtol=1e-5)


def test_revealed_slots_carry_real_tokens_and_get_no_loss():
    target = sharp_target()
    head = tiny_head(target)
    mask_id = head.config.mask_id
    rows = regenerated_rows(target, count=4)
    batch = JetSpecCollator(mask_token_id=mask_id, block_size=8, num_blocks=4, reveal_prob=0.5)(rows)
    ids = batch["block_ids"].view(4, 4, 8)[..., 1:]  # the D slots after each anchor
    positions = batch["block_position_ids"].view(4, 4, 8)[..., 1:]  # (B, n, D)
    inside = positions < batch["attention_mask"].sum(-1).view(4, 1, 1)
    real = batch["input_ids"].gather(1, positions.clamp_max(batch["input_ids"].shape[1] - 1).view(4, -1)).view(4, 4, 7)
    revealed = (ids != mask_id) & inside
    labels = batch["labels"]  # (B, n, D)
    assert revealed.any() and (inside & ~revealed).any()  # p = 0.5 over 112 slots: both kinds occur
    assert torch.equal(ids[revealed], real[revealed])  # a revealed slot holds its real token ...
    assert (labels[revealed] == -100).all()  # ... and carries no loss
    assert torch.equal(labels != -100, inside & (ids == mask_id))  # every MASK slot inside the row does
    assert torch.equal(labels[labels != -100], real[labels != -100])  # with its real token as label
    assert (labels[~inside] == -100).all()
    # the loss ignores whatever the head predicts at revealed slots
    student = torch.randn(16, 7, VOCAB)
    teacher = torch.randn(16, 7, VOCAB)
    flat, loss_mask = labels.view(16, 7), (labels != -100).view(16, 7)
    changed = student.clone()
    changed[revealed.view(16, 7)] += 5 * torch.randn(int(revealed.sum()), VOCAB)
    torch.testing.assert_close(
        block_loss(changed, teacher, flat, loss_mask), block_loss(student, teacher, flat, loss_mask)
    )


def test_collator_draws_per_row_and_epoch():
    """A row's blocks depend on its id, the seed and the epoch only: the same in any batch (so in any micro-batch or
    process), the same when drawn again, fresh in the next epoch; evaluation (epoch None) draws its own fixed ones."""
    target = sharp_target()
    rows = regenerated_rows(target, count=6)
    collator = JetSpecCollator(mask_token_id=VOCAB - 1, block_size=6, num_blocks=3, reveal_prob=0.3, epoch=0)

    def blocks_of(batch, i):
        return batch["block_ids"][i], batch["block_position_ids"][i], batch["labels"][i]

    first = collator(rows)
    again = collator(rows)
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(first, 2), blocks_of(again, 2)))
    # row 2 in another batch, at another index, beside other rows: its blocks are the same
    other = collator([rows[5], rows[2]])
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(first, 2), blocks_of(other, 1)))
    collator.epoch = 1
    later = collator(rows)
    moved = [not torch.equal(first["block_position_ids"][i], later["block_position_ids"][i]) for i in range(6)]
    assert all(moved)  # 3 anchors over 10+ positions: every row's draw changes with the epoch
    evaluation = JetSpecCollator(mask_token_id=VOCAB - 1, block_size=6, num_blocks=3, epoch=None)
    assert torch.equal(evaluation(rows)["block_ids"], evaluation(rows[::-1])["block_ids"].flip(0))
    assert not torch.equal(evaluation(rows)["block_position_ids"], first["block_position_ids"])


def test_answer_anchor_prob_below_one_draws_anchors_in_the_prompt(tmp_path):
    """By default every anchor lies in the answer (a >= prompt_length - 1); answer_anchor_prob < 1 lets a share of
    them fall anywhere in the row, prompt included. Checked on the blocks the trainer's collator packs."""
    target = sharp_target()
    rows = datasets.Dataset.from_list(regenerated_rows(target, count=8))  # prompts of 6 tokens, rows of 18-36
    shares = {}
    for prob in (1.0, 0.5, 0.0):
        trainer = JetSpecTrainer(
            model=tiny_head(target),
            train_dataset=rows,
            target=target,
            args=training_args(tmp_path, num_blocks_per_sequence=64, answer_anchor_prob=prob),
        )
        batch = trainer.data_collator(list(rows))
        anchors = batch["block_position_ids"].view(8, 64, -1)[..., 0]  # (B, n)
        shares[prob] = float((anchors < 6 - 1).float().mean())
    assert shares[1.0] == 0.0
    # anchors uniform over a >= 1 put about 4 / 25 of them before the answer (positions 1-4 of rows 18-36 long);
    # with half of them drawn in the answer, about half as many (512 draws each: a standard error near 0.015)
    assert 0.1 < shares[0.0] < 0.25 and 0.3 * shares[0.0] < shares[0.5] < 0.7 * shares[0.0], shares


# ------------------------------------------------------------------------------------------------------ training
def test_training_lowers_the_loss_changes_every_head_parameter_and_leaves_the_target(tmp_path):
    target = sharp_target()
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    head = tiny_head(target).train()
    head_before = {n: p.detach().clone() for n, p in head.named_parameters()}
    rows = datasets.Dataset.from_list(regenerated_rows(target))
    trainer = JetSpecTrainer(
        model=head,
        args=training_args(tmp_path, num_blocks_per_sequence=3, reveal_prob=0.2),
        train_dataset=rows,
        eval_dataset=rows.select(range(4)),
        target=target,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()

    losses = losses_of(trainer.state.log_history)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses  # fell by more than step-to-step noise
    assert after["eval_loss"] < before["eval_loss"]
    assert 1.0 <= after["eval_tau_chain"] <= 8.0 and set(f"eval_acc_depth_{k}" for k in range(1, 8)) <= set(after)
    trainable = [n for n, p in head.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in head.named_parameters()]  # the whole head trains
    unchanged = [n for n in trainable if torch.equal(head_before[n], dict(head.named_parameters())[n])]
    assert unchanged == []
    for k, v in target.state_dict().items():
        assert torch.equal(v, target_before[k]), k  # bit-identical, and never part of the head
    assert not any(p.requires_grad for p in target.parameters())


def test_the_trainers_item_count_is_the_number_of_slots_that_carry_loss(tmp_path):
    """`num_items_in_batch`, which the Trainer counts from the collator's labels over a step's micro-batches, is the
    number of MASK slots inside the rows (revealed slots and slots past a row's end excluded), counted here from the
    packed blocks themselves; and a training step's loss over it equals the evaluation loss of the same batch."""
    target = sharp_target()
    head = tiny_head(target)
    rows = datasets.Dataset.from_list(regenerated_rows(target, count=8))
    trainer = JetSpecTrainer(
        model=head,
        train_dataset=rows,
        target=target,
        args=training_args(tmp_path, num_blocks_per_sequence=5, reveal_prob=0.3),
    )
    batches = [
        trainer.data_collator(list(rows.select(range(0, 4)))),
        trainer.data_collator(list(rows.select(range(4, 8)))),
    ]
    _, num_items = trainer.get_batch_samples(iter(batches), 2, torch.device("cpu"))
    slots = 0
    for batch in batches:
        b = batch["block_ids"].shape[0]
        ids = batch["block_ids"].view(b, 5, 8)[..., 1:]
        inside = batch["block_position_ids"].view(b, 5, 8)[..., 1:] < batch["attention_mask"].sum(-1).view(b, 1, 1)
        slots += int(((ids == head.config.mask_id) & inside).sum())
    assert int(num_items) == slots and slots < 2 * 4 * 5 * 7  # some slots revealed or past the end
    with torch.no_grad():
        head.eval()
        mean = trainer.compute_loss(head, batches[0])
        over_step = trainer.compute_loss(head, batches[0], num_items_in_batch=num_items)
    counted = int((batches[0]["labels"] != -100).sum())
    # the same sum over a larger count: exactly the ratio of the counts (fp32 division)
    torch.testing.assert_close(over_step, mean * counted / slots)


def test_time_budget_stops_training_and_evaluates_once_more(tmp_path):
    """max_train_minutes ends the run at the first step past the budget (here: the first step), whatever max_steps
    says, and evaluates then; the head has trained for that step."""
    target = sharp_target()
    head = tiny_head(target).train()
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    rows = datasets.Dataset.from_list(regenerated_rows(target))
    trainer = JetSpecTrainer(
        model=head,
        train_dataset=rows,
        eval_dataset=rows.select(range(4)),
        target=target,
        args=training_args(
            tmp_path,
            max_steps=50,
            max_train_minutes=1e-6,
            eval_strategy="steps",
            eval_steps=1000,
            num_blocks_per_sequence=2,
        ),
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert len(losses_of(trainer.state.log_history)) == 1
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evals] == [1]  # eval_steps=1000 alone would never have evaluated
    assert all(not torch.equal(before[n], p) for n, p in head.named_parameters())


def test_run_trainer_saves_a_head_that_reloads_and_decodes_losslessly(tmp_path):
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    data = write_shards(tmp_path / "regen", regenerated_rows(target))
    out = tmp_path / "head"
    metrics = run_trainer.main(
        [
            "--target",
            str(target_dir),
            "--data",
            str(data),
            "--output_dir",
            str(out),
            "--max_steps",
            "6",
            "--learning_rate",
            "3e-3",
            "--per_device_train_batch_size",
            "4",
            "--logging_steps",
            "1",
            "--eval_fraction",
            "0.25",
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
            "--measure_tau_prompts",
            "2",
            "--measure_tau_new_tokens",
            "12",
        ]
    )
    assert metrics["train_tokens_per_second"] > 0 and "eval_tau_chain" in metrics
    log = json.loads((out / "training_log.json").read_text())
    assert len(losses_of(log)) == 6
    # the Trainer counts the rows' real tokens the target read: 4 rows of at least 3 tokens per step
    seen = [entry["num_input_tokens_seen"] for entry in log if "loss" in entry]
    assert (
        seen[0] >= 4 * 3 and all(b > a for a, b in zip(seen, seen[1:])) and seen[-1] == metrics["num_input_tokens_seen"]
    )
    card = (out / "README.md").read_text()
    assert "base_model: " + str(target_dir) in card and "{{" not in card and "| tau, tree decoding" in card

    head = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert head.config.block_size == 6
    # the lookup odds measured on the training answers ride with the head: one non-increasing row per match order
    prior = head.config.tree_lookup_prior
    assert len(prior) == 3 and all(len(row) == head.config.tree_depth for row in prior)
    assert all(0 < b <= a <= 1 for row in prior for a, b in zip(row, row[1:]))
    assert sum(metrics["lookup_matches_per_order"]) > 0
    prompt = torch.tensor([regenerated_rows(target, count=1, seed=7)[0]["input_ids"][:6]])
    mask = torch.ones_like(prompt)
    plain = target.generate(input_ids=prompt, attention_mask=mask, do_sample=False, max_new_tokens=20)
    tree = target.generate(
        input_ids=prompt, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=head
    )
    assert tree.tolist() == plain.tolist()


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    """Steps 3-4 resumed from checkpoint-2 log the losses of the uninterrupted run: the weights, optimizer, data
    position and anchor draws (seeded by row and epoch) all come back."""
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    data = write_shards(tmp_path / "regen", regenerated_rows(target))
    out = tmp_path / "run"
    args = [
        "--target",
        str(target_dir),
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
        "--use_cpu",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
    ]
    run_trainer.main(args)
    full = losses_of(json.loads((out / "training_log.json").read_text()))
    assert (out / "checkpoint-2" / "config.json").is_file()
    run_trainer.main([*args, "--resume_from_checkpoint", str(out / "checkpoint-2")])
    log = json.loads((out / "training_log.json").read_text())
    resumed = [(e["step"], e["loss"]) for e in log if "loss" in e and e["step"] > 2]
    assert [step for step, _ in resumed] == [3, 4]
    # same computation in the same order, in a process that reloaded fp32 weights: equal to fp32 rounding
    torch.testing.assert_close(torch.tensor([loss for _, loss in resumed]), torch.tensor(full[2:]), rtol=1e-5, atol=0.0)


def test_a_head_kept_at_each_save_resumes_the_run_where_output_dir_is_gone(tmp_path):
    """`keep_head_every_save`: each checkpoint's head lands in the tracked folder with its trainer state; with the
    run folder deleted, `--resume_from_checkpoint true` continues from it at the kept step, on the uninterrupted
    run's learning-rate schedule and data position (the optimizer's moments start afresh, so the losses differ)."""
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    data = write_shards(tmp_path / "regen", regenerated_rows(target))
    out, kept = tmp_path / "run", tmp_path / "kept"
    args = [
        "--target", str(target_dir), "--data", str(data), "--output_dir", str(out), "--max_steps", "6",
        "--learning_rate", "3e-3", "--warmup_steps", "1", "--per_device_train_batch_size", "4", "--logging_steps",
        "1", "--eval_fraction", "0", "--block_size", "6", "--use_cpu", "--report_to", "none", "--disable_tqdm",
        "true", "--save_strategy", "steps", "--save_steps", "2", "--keep_head_dir", str(kept),
        "--keep_head_every_save", "true",
    ]  # fmt: skip
    run_trainer.main(args)
    full = json.loads((out / "training_log.json").read_text())
    rates = {e["step"]: e["learning_rate"] for e in full if "learning_rate" in e}
    state = json.loads((kept / "trainer_state.json").read_text())
    assert state["global_step"] == 6  # the last save's head replaced the earlier ones
    assert not any((kept / name).exists() for name in ("optimizer.pt", "scheduler.pt", "checkpoint_complete.json"))

    # as a stop at step 4 leaves it: the head kept at step 4, and no run folder
    shutil.rmtree(out)
    shutil.rmtree(kept)
    run_trainer.main([*args[: args.index("--max_steps") + 1], "4", *args[args.index("--max_steps") + 2 :]])
    assert json.loads((kept / "trainer_state.json").read_text())["global_step"] == 4
    shutil.rmtree(out)
    run_trainer.main([*args, "--resume_from_checkpoint", "true"])
    resumed = json.loads((out / "training_log.json").read_text())
    steps = [e["step"] for e in resumed if "loss" in e and e["step"] > 4]
    assert steps == [5, 6]  # continued at step 5, not from 1
    for entry in resumed:
        if "learning_rate" in entry and entry["step"] > 4:
            assert entry["learning_rate"] == pytest.approx(rates[entry["step"]])  # the same schedule, not restarted


def test_lora_trains_only_the_adapters(tmp_path):
    target = sharp_target()
    model = run_setup.build_head(HeadArguments(use_lora=True, lora_r=4, num_hidden_layers=1), target, block_size=8)
    # a peft model around a new head
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".fc." in n for n in trainable) and any("q_proj" in n for n in trainable)
    trainer = JetSpecTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=4, num_blocks_per_sequence=2),
        train_dataset=datasets.Dataset.from_list(regenerated_rows(target)),
        target=target,
    )
    trainer.train()
    after = dict(model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == trainable  # every adapter moved (lora_B from zero at step 1, lora_A from step 2) ...
    # ... and nothing else: the head's own weights, norms and MASK vector are as initialised


def test_head_layers_can_start_as_the_targets_last_layers():
    target = sharp_target()  # 2 Llama layers
    head = run_setup.build_head(HeadArguments(num_hidden_layers=1, init_layers_from_target=True), target, 8)
    last = dict(target.model.layers[-1].named_parameters())
    layer = dict(head.layers[0].named_parameters())
    shared = {n for n in layer if n in last and last[n].shape == layer[n].shape}
    assert {"self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"} <= shared
    assert all(torch.equal(layer[n], last[n]) for n in shared)
    # the head's q/k norms have no Llama counterpart and keep their init
    assert all(
        torch.equal(layer[n], torch.ones_like(layer[n]))
        for n in layer
        if n.endswith("_norm.weight") and n not in shared
    )
    random = run_setup.build_head(HeadArguments(num_hidden_layers=1), target, 8)
    assert not torch.equal(
        dict(random.layers[0].named_parameters())["self_attn.q_proj.weight"], last["self_attn.q_proj.weight"]
    )
    # two head layers copy the target's two layers, in order
    two = run_setup.build_head(HeadArguments(num_hidden_layers=2, init_layers_from_target=True), target, 8)
    for head_layer, target_layer in zip(two.layers, target.model.layers):
        assert torch.equal(head_layer.mlp.up_proj.weight, target_layer.mlp.up_proj.weight)
    with pytest.raises(ValueError, match="expected a target with at least the head's 3 layers to copy, got 2"):
        run_setup.build_head(HeadArguments(num_hidden_layers=3, init_layers_from_target=True), target, 8)


# ---------------------------------------------------------------------------------------------- 1 vs 2 processes
# relative; the two runs add the same fp32 numbers in other orders (padding widths, all-reduce): measured ~2e-6
TWO_PROCESS_TOLERANCE = 1e-4


@pytest.mark.multiprocess
def test_two_process_run_matches_one_process_with_the_doubled_batch(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (gloo DDP) with 2 rows per process follows the same loss
    curve as one process with 4 rows: same rows per step, same anchors per row (seeded by row id and epoch), and the loss
    normalised by the slot count of all processes. The run must also end: every process leaves the process group at
    the same point, and a collective stuck for a minute (`--ddp_timeout 60`) fails instead of hanging."""
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    data = write_shards(tmp_path / "regen", regenerated_rows(target))
    common = [
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--max_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--logging_steps",
        "1",
        "--eval_fraction",
        "0",
        "--use_cpu",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--save_strategy",
        "no",
        "--seed",
        "0",
        "--num_blocks_per_sequence",
        "2",
        "--ddp_find_unused_parameters",
        "false",
        "--ddp_timeout",
        "60",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "ACCELERATE_USE_CPU": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # accelerate 1.15: `--cpu` runs a single process whatever --num_processes says; `--multi_gpu` starts torchrun,
    # and ACCELERATE_USE_CPU=1 with --use_cpu makes it a gloo process group on CPU
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(REPO / "training" / "run_trainer.py"),
        *common,
        "--output_dir",
        str(tmp_path / "two"),
        "--per_device_train_batch_size",
        "2",
    ]
    result = run_bounded(command, env, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    two = losses_of(json.loads((tmp_path / "two" / "training_log.json").read_text()))

    run_trainer.main([*common, "--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "4"])
    one = losses_of(json.loads((tmp_path / "one" / "training_log.json").read_text()))
    assert len(one) == len(two) == 4
    assert "world size 2" in result.stdout + result.stderr  # really two processes, not one of each
    assert len(set(one)) > 1  # the head learns; a flat curve would match trivially
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=TWO_PROCESS_TOLERANCE, atol=0.0)


def run_bounded(command, env, timeout: int) -> subprocess.CompletedProcess:
    """Run `command` in its own process group. If it outlives `timeout`, every process of the group (launcher and
    workers) gets SIGABRT, so faulthandler prints where each one hung, then SIGKILL: no worker is left behind holding
    the rendezvous port, and the failure shows the stacks."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        pytest.fail(f"expected the launch to finish within {timeout} s, it hung; stacks:\n{(err or '')[-8000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


# -------------------------------------------------------------------------------------------------------- shipping
class FakeApi:
    """Records what `upload_folder` would send."""

    def __init__(self):
        self.created, self.uploaded = [], None

    def create_repo(self, repo_id, exist_ok=False, private=None):
        self.created.append(repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message=None, allow_patterns=None):
        root = Path(folder_path)
        files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
        self.uploaded = (repo_id, set(filter_repo_objects(files, allow_patterns=allow_patterns)))
        return "commit"


CARD_VALUES = dict(
    base_model="org/target",
    repo_id="org/head",
    max_depth=7,
    num_hidden_layers=1,
    block_size=8,
    training_data="data/regen",
    loss="fkl",
    steps=10,
    num_train_rows=9,
    num_eval_rows=1,
    tau_table="| a | b |",
    licence="Apache-2.0",
)


def test_push_uploads_exactly_the_head_files(tmp_path):
    head = tiny_head(tiny_target("llama"))
    folder = tmp_path / "head"
    head.save_pretrained(folder)
    write_card(folder, **CARD_VALUES)
    (folder / "training_log.json").write_text("[]")  # outputs of the run that are not shipped
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "model.safetensors").write_text("x")
    api = FakeApi()
    push_folder(folder, "org/head", api=api)
    code = {p.name for p in folder.glob("*.py")}  # the flat code files save_pretrained copied
    assert {"configuration_jetspec.py", "modeling_jetspec.py", "steps.py", "tree.py"} <= code
    assert api.created == ["org/head"]
    assert api.uploaded[0] == "org/head"
    assert api.uploaded[1] == code | {"config.json", "model.safetensors", "custom_generate/generate.py", "README.md"}
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\nlicense: apache-2.0\nbase_model: org/target\n")
    assert 'AutoModel.from_pretrained("org/head", trust_remote_code=True)' in card
    assert 'custom_generate="org/head"' in card and "assistant_model=head" in card


def test_push_offline_raises_instead_of_hanging(tmp_path):
    head = tiny_head(tiny_target("llama"))
    folder = tmp_path / "head"
    head.save_pretrained(folder)
    write_card(folder, **CARD_VALUES)
    script = (
        "import sys; from training.shipping import push_folder\n"
        "try:\n    push_folder(sys.argv[1], 'org/head')\n"
        "except Exception as e:\n    print(type(e).__name__, str(e)[:200]); sys.exit(3)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_fake"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 3, (result.stdout, result.stderr[-2000:])
    assert "offline" in result.stdout.lower()


def test_card_needs_every_placeholder(tmp_path):
    values = dict(CARD_VALUES)
    del values["tau_table"]
    with pytest.raises(ValueError, match=r"placeholders \['tau_table'\]"):
        render_card(REPO / "hub_cards" / "jetspec-head.md", **values)
    with pytest.raises(ValueError, match="missing"):
        push_folder(tmp_path, "org/head", api=FakeApi())  # not a saved head


# ----------------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_with_clear_messages(tmp_path):
    target = sharp_target()
    head = tiny_head(target)
    head.save_pretrained(tmp_path / "head")
    rows = datasets.Dataset.from_list(regenerated_rows(target, count=4))

    # a head built for another target (vocabulary 99) cannot resume on this one
    other = tiny_target("llama", vocab_size=99)
    with pytest.raises(ValueError, match="built for a target with vocab size 128, got a target with vocab size 99"):
        run_setup.build_head(HeadArguments(init_head=str(tmp_path / "head")), other)

    # a block longer than the head's
    with pytest.raises(ValueError, match=r"expected block_size <= 8 .*got 16"):
        run_setup.build_head(HeadArguments(init_head=str(tmp_path / "head")), target, block_size=16)
    with pytest.raises(ValueError, match=r"expected block_size <= 8 .*got 16"):
        JetSpecTrainer(model=head, args=training_args(tmp_path, block_size=16), train_dataset=rows, target=target)

    # no data
    empty = rows.select([])
    with pytest.raises(ValueError, match="expected a non-empty train_dataset, got an empty dataset"):
        JetSpecTrainer(model=head, args=training_args(tmp_path), train_dataset=empty, target=target)
    (tmp_path / "regen").mkdir()
    (tmp_path / "regen" / "shard-00000.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"expected regenerated rows in .*regen, got an empty dataset \(1 empty"):
        run_setup.load_data(DataArguments(data=[str(tmp_path / "regen")]), seed=0)

    # the Trainer's own arguments lack the distillation fields; the collator needs the `id` and `prompt_length`
    # columns that remove_unused_columns would drop; the trainer packs its own batches
    plain = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="expected args of type JetSpecTrainingArguments, got TrainingArguments"):
        JetSpecTrainer(model=head, args=plain, train_dataset=rows, target=target)
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        training_args(tmp_path, remove_unused_columns=True)
    with pytest.raises(ValueError, match="expected no data_collator"):
        JetSpecTrainer(
            model=head, args=training_args(tmp_path), train_dataset=rows, target=target, data_collator=lambda rows: rows
        )
    with pytest.raises(ValueError, match=r"expected answer_anchor_prob in \[0, 1\], got 1.5"):
        training_args(tmp_path, answer_anchor_prob=1.5)


def test_cached_features_run_the_target_once_per_row_and_train_a_subset_head(tmp_path):
    """cache_features: epoch 1 runs the target on every batch, later epochs never; the reduced-vocabulary,
    last-context head still learns (loss falls, every parameter moves, the slot projection included)."""
    target = sharp_target()
    head = tiny_head(target, draft_vocab_size=64, last_context_input=True).train()
    rows = datasets.Dataset.from_list(regenerated_rows(target))  # 16 rows: 4 batches of 4 per epoch
    calls = []
    target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    head.set_draft_vocab(torch.arange(0, 128, 2))
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    trainer = JetSpecTrainer(
        model=head,
        train_dataset=rows,
        target=target,
        args=training_args(tmp_path, max_steps=-1, num_train_epochs=3, num_blocks_per_sequence=3, cache_features=True),
    )
    trainer.train()
    assert len(calls) == 4  # the first epoch's batches; epochs 2 and 3 read the cache
    assert trainer.data_collator.epoch == 2  # the collator drew the third epoch's anchors
    losses = losses_of(trainer.state.log_history)
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert [n for n, p in head.named_parameters() if torch.equal(before[n], p)] == []


def test_run_trainer_picks_the_most_frequent_answer_tokens_as_draft_vocabulary(tmp_path):
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    rows = regenerated_rows(target)
    data = write_shards(tmp_path / "regen", rows)
    out = tmp_path / "head"
    metrics = run_trainer.main(
        [
            "--target",
            str(target_dir),
            "--data",
            str(data),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--eval_fraction",
            "0",
            "--block_size",
            "6",
            "--use_cpu",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--save_strategy",
            "no",
            "--draft_vocab_size",
            "8",
            "--last_context_input",
            "--cache_features",
            "--target_dtype",
            "bfloat16",
        ]
    )
    counts = {}
    for row in rows:  # every row trains (no eval split): count their answer tokens by hand
        for token in row["input_ids"][row["prompt_length"] :]:
            counts[token] = counts.get(token, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    head = AutoModel.from_pretrained(out, trust_remote_code=True)
    chosen = head.draft_token_ids().tolist()
    assert len(chosen) == 8 and sorted(counts[t] for t in chosen) == sorted(ranked[:8])
    assert metrics["draft_vocab_coverage"] == pytest.approx(sum(ranked[:8]) / sum(ranked))
    assert head.config.last_context_input


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    """Batch 4 in one step and batch 2 x 2 accumulation steps give the same loss curve and the same head: the loss
    is normalised by the step's whole slot count (`num_items_in_batch`), not averaged per micro-batch."""
    target = sharp_target()
    rows = datasets.Dataset.from_list(regenerated_rows(target))
    heads, curves = [], []
    for batch, accumulation in ((4, 1), (2, 2)):
        head = tiny_head(target).train()
        trainer = JetSpecTrainer(
            model=head,
            args=training_args(
                tmp_path / f"b{batch}",
                max_steps=3,
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation,
                num_blocks_per_sequence=3,
                gamma=2.0,
            ),
            train_dataset=rows,
            target=target,
        )
        trainer.train()
        heads.append(head)
        curves.append(losses_of(trainer.state.log_history))
    # float32 sums in a different order: agreement to rounding, far below a per-micro-batch mean's error
    assert curves[0] == pytest.approx(curves[1], rel=1e-4)
    for (name, a), b in zip(heads[0].named_parameters(), heads[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_eval_split_is_stable_as_the_data_grows():
    """A row's side of the split depends on its id only: rows held out before stay held out once more data is
    regenerated, and no held-out row ever reaches training."""
    rows = datasets.Dataset.from_list([{"id": f"r{i}", "input_ids": [1, 2, 3], "prompt_length": 1} for i in range(400)])
    small_train, small_eval = split_train_eval(rows.select(range(150)), 0.05, seed=0)
    big_train, big_eval = split_train_eval(rows, 0.05, seed=0)
    assert set(small_eval["id"]) == set(big_eval["id"]) & {f"r{i}" for i in range(150)}
    assert not set(big_train["id"]) & set(big_eval["id"]) and len(big_train) + len(big_eval) == 400
    assert 5 <= len(big_eval) <= 40  # about 5% of 400
    _, one = split_train_eval(rows.select(range(3)), 0.01, seed=0)
    assert len(one) == 1  # at least one row
    with pytest.raises(ValueError, match="leaves training rows"):
        split_train_eval(rows.select(range(1)), 0.5, seed=0)


@pytest.mark.parametrize(
    "name,content,message",
    [
        # a) a 0-byte file (numpy would raise EOFError), b) bytes that are not an archive, c) a truncated archive,
        # d) a shard line that is not JSON, e) a shard row without the training fields
        ("rows.npz", b"", r"got .*rows\.npz, an empty file"),
        ("rows.npz", b"not an archive" * 8, r"got .*rows\.npz, which cannot be read \("),
        ("rows.npz", "truncated", r"got .*rows\.npz, which cannot be read \(BadZipFile"),
        (
            "regen/shard-00000.jsonl",
            b'{"id": "a", "input_ids": [1, 2]\n',
            r"expected a JSON row at .*shard-00000\.jsonl line 1",
        ),
        ("regen/shard-00000.jsonl", b'{"id": "a"}\n', r"expected a row with fields .* at .*shard-00000\.jsonl line 1"),
    ],
)
def test_an_empty_or_corrupt_data_file_is_one_line_naming_it(tmp_path, name, content, message):
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    if content == "truncated":
        committed = (REPO / "training" / "data" / "smollm2-135m-mix.npz").read_bytes()
        content = committed[: len(committed) // 2]
    path.write_bytes(content)
    source = str(path if path.suffix == ".npz" else path.parent)
    with pytest.raises(ValueError, match=message) as raised:
        run_setup.load_data(DataArguments(data=[source]), seed=0)
    assert "\n" not in str(raised.value)


def test_a_corrupt_feature_store_is_named(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "store.json").write_text('{"target_layer_ids": [0, 1]')
    with pytest.raises(ValueError, match=r"expected a feature store index .* in .*store\.json"):
        FeatureStore(tmp_path / "store")
    (tmp_path / "store" / "store.json").write_text(
        json.dumps({"target_layer_ids": [0, 1], "hidden_size": 4, "rows": {"7": [0, 2]}, "total": 2})
    )
    (tmp_path / "store" / "features.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"expected 2 rows of 12 bfloat16 values \(48 bytes\) in .*features\.bin"):
        FeatureStore(tmp_path / "store")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num_hidden_layers", "0"], "expected num_hidden_layers >= 1, got 0"),
        (["--block_attention", "sideways"], "expected block_attention in .*got 'sideways'"),
        (["--target_layer_ids", "-1"], r"expected target_layer_ids of layers >= 0, got \[-1\]"),
        (["--loss", "mse"], "mse"),
        (["--data", "missing.npz"], r"got missing\.npz which does not exist"),
    ],
)
def test_training_arguments_are_checked_before_the_target_loads(tmp_path, monkeypatch, flags, message):
    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr(run_trainer, "load_target", load_target)
    data = write_shards(
        tmp_path / "regen", [{"id": "a", "prompt": "", "input_ids": [1, 2, 3], "prompt_length": 1, "answer": ""}]
    )
    with pytest.raises(ValueError, match=message):
        run_trainer.main(
            ["--data", str(data), "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none", *flags]
        )


def test_a_config_file_is_overridden_by_the_flags_after_it(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "num_hidden_layers: 2\nmax_steps: 7\nlearning_rate: 1.0e-3\ndata: [a.npz]\nuse_cpu: true\noutput_dir: out\n"
    )
    head_args, data_args, args = parse_args([str(config), "--max_steps", "3", "--data", "b.npz", "c"])
    assert (head_args.num_hidden_layers, args.max_steps, args.learning_rate) == (2, 3, 1.0e-3)
    assert data_args.data == ["b.npz", "c"] and args.use_cpu
    config.write_text("num_hidden_layerz: 2\n")
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['num_hidden_layerz'\]"):
        parse_args([str(config)])


# ------------------------------------------------------------------------------- memory, hidden states, wrappers
class FreshVocabularyRows(TorchDispatchMode):
    """The most rows of any tensor an op allocates (not a view of its inputs) whose last dimension is the vocabulary,
    forward and backward alike: `(slots, V)` logits show up as `slots` rows."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.most = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in leaves}
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.vocab_size
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.most = max(self.most, t.numel() // self.vocab_size)
        return out


def test_a_training_step_never_holds_the_logits_of_all_its_slots(tmp_path):
    """With `loss_chunk_slots=8`, a training step (target features, head forward, chunked LM head and loss,
    backward) never allocates more than 8 rows over the vocabulary, where the step has 4 rows x 3 blocks x 7 slots;
    the same counter sees all of them in the whole-logit loss (so it can fail)."""
    vocab = 997  # no other dimension of the tiny models has this size
    target = tiny_target("llama", vocab_size=vocab)
    head = tiny_head(target).train()
    rows = datasets.Dataset.from_list(regenerated_rows(target, count=4))
    trainer = JetSpecTrainer(
        model=head,
        train_dataset=rows,
        target=target,
        args=training_args(tmp_path, num_blocks_per_sequence=3, loss_chunk_slots=8),
    )
    batch = trainer.data_collator(list(rows))
    chunked = FreshVocabularyRows(vocab)
    with chunked:
        trainer.compute_loss(head, batch).backward()
    assert 0 < chunked.most <= 8
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())

    whole = FreshVocabularyRows(vocab)
    features, final = trainer._target_states(batch)
    with whole:
        logits = head(
            input_ids=batch["block_ids"],
            position_ids=batch["block_position_ids"],
            attention_mask=batch["block_attention_mask"],
            context_features=features,
            context_valid=batch["attention_mask"].bool(),
        ).logits
        block_loss(
            logits.view(4, 3, 8, vocab)[:, :, 1:].reshape(12, 7, vocab),
            torch.randn(12, 7, vocab),
            batch["labels"].view(12, 7),
            batch["labels"].view(12, 7) != -100,
        ).backward()
    assert whole.most >= 4 * 3 * 7


def test_the_target_returns_only_the_layers_the_head_reads_and_the_same_features(tmp_path):
    """`_target_states` asks the target for the head's layers only (`output_hidden_states` as a list of indices): the
    others come back as None, and the features and final states are bit-identical to a forward that keeps every
    layer."""
    target = tiny_target("llama", num_hidden_layers=4)
    head = tiny_head(target, target_layer_ids=[1, 2])
    rows = datasets.Dataset.from_list(regenerated_rows(target, count=4))
    trainer = JetSpecTrainer(model=head, train_dataset=rows, target=target, args=training_args(tmp_path))
    batch = trainer.data_collator(list(rows))
    seen = {}
    hook = target.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: seen.update(asked=kwargs["output_hidden_states"], states=out.hidden_states),
        with_kwargs=True,
    )
    features, final = trainer._target_states(batch)
    hook.remove()
    assert seen["asked"] == [2, 3]
    assert [i for i, state in enumerate(seen["states"]) if state is not None] == [2, 3]
    with torch.no_grad():
        full = target.get_decoder()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
    assert torch.equal(features, head.target_features(full.hidden_states))
    assert torch.equal(final, full.last_hidden_state)


def test_unwrap_head_finds_the_head_in_every_wrapper_accelerate_returns(tmp_path):
    """DDP, FSDP (both APIs), `torch.compile` over DDP and PEFT, alone or nested. (A DeepSpeed engine is unwrapped by
    the same accelerate function when deepspeed is installed; it is not here.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    target = sharp_target()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        head = tiny_head(target)
        assert unwrap_head(head) is head
        assert unwrap_head(DistributedDataParallel(head)) is head
        assert unwrap_head(torch.compile(DistributedDataParallel(head))) is head
        sharded = tiny_head(target)
        assert unwrap_head(FullyShardedDataParallel(sharded, device_id=torch.device("cpu"))) is sharded
        composable = tiny_head(target)
        fully_shard(composable)  # FSDP2 changes the module's class in place
        assert unwrap_head(composable) is composable
        lora = run_setup.build_head(HeadArguments(use_lora=True, lora_r=4, num_hidden_layers=1), target, 8)
        inner = lora.get_base_model()
        assert type(inner).__name__ == "JetSpecDraftModel"
        assert unwrap_head(lora) is inner
        assert unwrap_head(DistributedDataParallel(lora)) is inner
        assert unwrap_head(torch.compile(lora)) is inner
    finally:
        torch.distributed.destroy_process_group()


def test_each_process_loads_the_target_straight_to_its_device(tmp_path, monkeypatch):
    target = sharp_target()
    folder = save_target_folder(target, tmp_path / "target")
    calls = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        calls.append(kwargs.get("device_map"))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    loaded, _ = load_target(str(folder), device="cpu")
    assert calls == [{"": torch.device("cpu")}]
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), target.state_dict().values()))

    asked = []

    def stop(*args, **kwargs):
        asked.append(kwargs.get("device"))
        raise RuntimeError("stop after the target's placement")

    monkeypatch.setattr(run_trainer, "load_target", stop)
    data = write_shards(tmp_path / "regen", regenerated_rows(target, count=2))
    with pytest.raises(RuntimeError, match="stop after"):
        run_trainer.main(
            [
                "--data",
                str(data),
                "--output_dir",
                str(tmp_path / "out"),
                "--use_cpu",
                "--report_to",
                "none",
                "--target",
                str(folder),
                "--eval_fraction",
                "0",
            ]
        )
    assert asked == [torch.device("cpu")]  # the Trainer's device of this process


def test_a_store_missing_rows_is_refused_by_file_and_a_covered_run_keeps_its_head_in_bf16(tmp_path):
    """The trainer refuses a feature store that misses rows of a data source, naming the source and the count,
    before the target loads; with every row stored it trains, and `keep_head_dir` receives the final head with bf16
    weights that reload and decode exactly as plain generate."""
    target = sharp_target()
    target_dir = save_target_folder(target, tmp_path / "target")
    rows = regenerated_rows(target)
    first, second = write_shards(tmp_path / "a", rows[:10]), write_shards(tmp_path / "b", rows[10:])
    from modeling_jetspec import JetSpecDraftModel

    head = JetSpecDraftModel.from_target(target, num_hidden_layers=1, block_size=6)
    from training.feature_store import build_feature_store
    from training.rows import load_regenerated

    only_first = [
        {"id": r["id"], "input_ids": r["input_ids"], "prompt_length": r["prompt_length"]}
        for r in load_regenerated(first)
    ]
    build_feature_store(target, head.config.target_layer_ids, only_first, tmp_path / "store", progress=False)
    common = [
        "--target",
        str(target_dir),
        "--data",
        str(first),
        str(second),
        "--feature_store",
        str(tmp_path / "store"),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
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
        "--eval_fraction",
        "0.2",
        "--train_precision",
        "fp32",
    ]
    with pytest.raises(ValueError, match=rf"{second}: 6 of 6 rows") as raised:
        run_trainer.main(common + ["--output_dir", str(tmp_path / "refused")])
    assert str(first) not in str(raised.value).split("got rows missing from it:")[1].split(". Add")[0]
    assert not (tmp_path / "refused").exists()  # refused before any work

    build_feature_store(
        target,
        head.config.target_layer_ids,
        [
            {"id": r["id"], "input_ids": r["input_ids"], "prompt_length": r["prompt_length"]}
            for r in load_regenerated(second)
        ],
        tmp_path / "store",
        progress=False,
    )
    kept = tmp_path / "kept" / "head"
    run_trainer.main(common + ["--output_dir", str(tmp_path / "out"), "--keep_head_dir", str(kept)])
    from safetensors.torch import load_file

    weights = load_file(kept / "model.safetensors")
    assert weights and all(v.dtype == torch.bfloat16 for v in weights.values() if v.is_floating_point())
    args = json.loads((kept / "training_args.json").read_text())
    assert args["training"]["train_precision"] == "fp32" and args["training"]["bf16"] is False
    assert (kept / "metrics.json").is_file() and not list(kept.parent.glob("*.partial"))
    # the offline tau of the held-out rows rides on the log beside the agreement (the store holds their features):
    # the last one is the final head's (saved in float32 to the output folder), scored again here on the same rows
    log = json.loads((kept / "training_log.json").read_text())
    offline = [entry["eval_offline_tau"] for entry in log if "eval_offline_tau" in entry]
    assert not list(kept.glob("*.py"))  # the package's code is not copied into a kept head
    from jetspec.targets import load_target, resolve_dtype
    from modeling_jetspec import JetSpecDraftModel as Head
    from training.evaluate_head import offline_tau
    from training.feature_store import FeatureStore
    from training.rows import load_rows, split_train_eval

    final = Head.from_pretrained(tmp_path / "out").eval()
    final.attach_target(load_target(str(target_dir), dtype=resolve_dtype(args["head"]["target_dtype"])[0])[0])
    _, held = split_train_eval(load_rows([str(first), str(second)]), 0.2, args["training"]["seed"])
    limit = args["training"]["offline_tau_rows"]
    again = offline_tau(
        final,
        held.select(range(min(limit, len(held)))),
        FeatureStore(tmp_path / "store"),
        max_new_tokens=args["training"]["offline_tau_new_tokens"],
        max_rows=limit,
    )
    assert again["rows"] >= 1 and offline[-1] == again["tau"]

    reloaded = Head.from_pretrained(kept).eval()
    prompt = torch.tensor([rows[0]["input_ids"][:6]])
    mask = torch.ones_like(prompt)
    plain = target.generate(input_ids=prompt, attention_mask=mask, do_sample=False, max_new_tokens=16)
    tree = target.generate(
        input_ids=prompt, attention_mask=mask, do_sample=False, max_new_tokens=16, assistant_model=reloaded
    )
    assert tree.tolist() == plain.tolist()


def test_train_precision_follows_the_host_probe_and_explicit_choices(tmp_path, monkeypatch):
    """`auto` takes bf16 autocast exactly where the host probe picks bfloat16; `fp32`/`bf16` are obeyed; `fp32`
    with `bf16=True` is a contradiction refused by name."""
    from jetspec.host import HostKind

    assert training_args(tmp_path).train_precision == "fp32"  # the dataclass default; the config says auto
    for dtype, expected in (("bfloat16", True), ("float32", False)):
        kind = HostKind(name="test host", dtype=dtype, reason=f"probe says {dtype}", capability="AVX512")
        monkeypatch.setattr(trainer_module, "host_kind", lambda kind=kind: kind)
        args = training_args(tmp_path, train_precision="auto")
        reason = trainer_module.resolve_precision(args)
        assert args.bf16 is expected and "test host" in reason
        # the Trainer's accelerator reads `mixed_precision`, derived from `bf16` when the arguments were made
        assert args.mixed_precision == ("bf16" if expected else "no")
        # a JetSpecTrainer made directly, without run_trainer, honours train_precision itself
        fresh = training_args(tmp_path, train_precision="auto")
        trainer = JetSpecTrainer(
            model=tiny_head(sharp_target()),
            args=fresh,
            target=sharp_target(),
            train_dataset=datasets.Dataset.from_list(regenerated_rows(sharp_target())),
        )
        assert "test host" in trainer.precision
        assert trainer.accelerator.mixed_precision == ("bf16" if expected else "no")
    args = training_args(tmp_path, train_precision="bf16")
    trainer_module.resolve_precision(args)
    assert args.bf16 is True
    with pytest.raises(ValueError, match="train_precision"):
        training_args(tmp_path, train_precision="fp16")
    with pytest.raises(ValueError, match="bf16=False with train_precision='fp32'"):
        training_args(tmp_path, train_precision="fp32", bf16=True)


def test_the_auto_keep_writes_long_runs_heads_outside_the_tracked_tree(tmp_path):
    """`keep_head_dir: auto` keeps the head of a run of `keep_head_minutes` (20) or more under `runs/kept/<run>`,
    which git ignores: committing a head is a deliberate act, never a side effect of a long run."""
    args = training_args(tmp_path, output_dir=str(tmp_path / "run-x"))
    assert args.keep_head_dir == "auto" and args.keep_head_minutes == 20.0  # the defaults the docs describe
    assert keep_folder(args, 19.0) is None
    kept = keep_folder(args, 25.0)
    assert kept == Path("runs/kept/run-x")
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "-q", str(kept / "model.safetensors")], capture_output=True
    )
    assert ignored.returncode == 0, "runs/kept/ must be git-ignored"  # 1: tracked-tree material
    assert keep_folder(training_args(tmp_path, keep_head_dir="none"), 90.0) is None
    assert keep_folder(training_args(tmp_path, keep_head_dir=str(tmp_path / "here")), 1.0) == tmp_path / "here"


@pytest.mark.parametrize("config", sorted((REPO / "training" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_committed_configs_parse_and_name_committed_data(config):
    """Every committed config is read by the trainer's own parser, and every data file it names is committed; each
    long run keeps a head at every save and ends by its schedule, not by one session's clock."""
    head_args, data_args, args = parse_args([str(config)])
    assert data_args.data and all((REPO / path).is_file() for path in data_args.data), data_args.data
    if config.name.startswith("smollm2-135m-long"):  # the long runs (the first and its warm-started successor)
        assert args.keep_head_every_save and args.max_train_minutes is None
        assert args.save_steps < args.max_steps and args.lr_scheduler_type == "cosine"
        # the warm-start base is committed, or (a finished run's base that left the tree) recorded in results/heads.json
        assert head_args.init_head is not None
        left = json.loads((REPO / "results" / "heads.json").read_text())["heads"]
        assert (REPO / head_args.init_head / "config.json").is_file() or Path(head_args.init_head).name in left
