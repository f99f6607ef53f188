"""Distillation of a JetSpec draft head with the transformers `Trainer` (arXiv 2606.18394, section 3.3; see
`docs/design.md`, §5 Training).

Per training row x (a prompt and the target's own answer), `num_blocks_per_sequence` anchors a are drawn,
preferably in the answer. Each anchor yields a block `[x_a, MASK x (bs - 1)]` at positions a..a+bs-1 that sees
the target's hidden states h_0..h_{a-1} and, causally, its own slots. All blocks of a row are packed into one
head forward with a block-diagonal mask. Slot k predicts x_{a+k}; its teacher is the target's softmax at position
a + k - 1. Optionally some slots are revealed as their real token (training for path-conditioned drafting,
`docs/design.md`, §3 Trees and masks); revealed slots carry no loss.

The collator draws the anchors and packs the blocks, with a generator seeded by the row's id and the epoch: a row
gets the same blocks whichever process, batch or micro-batch it lands in, and fresh ones every epoch. Its `labels`
hold the token of every slot that carries loss and -100 elsewhere, so the `Trainer`'s own count of them
(`num_items_in_batch`, over the micro-batches of a step and over processes) is the denominator of the step's loss.

Only the head trains. The target is frozen; its embeddings and LM head are borrowed by the head, not saved with it.

Checkpoints. The `Trainer` writes a `checkpoint-N` folder file by file; a process killed meanwhile leaves half of one.
[`JetSpecTrainer`] writes a marker last, `checkpoint_complete.json` (every file's size, written once every process
has saved its part), and rotates (`save_total_limit`) only complete checkpoints, never the one just completed:
[`last_complete_checkpoint`] resumes from the newest checkpoint whose marker matches its files and skips the others,
saying so.
"""

import dataclasses
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from jetspec.host import host_kind
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from .losses import (
    LOSS_CHUNK_SLOTS,
    LOSS_KINDS,
    chain_accept_length,
    check_loss_kind,
    chunked_argmax,
    chunked_block_loss_terms,
)
from .rows import row_key


TRAIN_PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class JetSpecTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus how blocks are drawn and scored, where the target's features come from, and what the
    run measures when it ships the head."""

    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Block length [anchor, MASK x (block_size - 1)] trained. A new head is built with it (16 by "
            "default); a saved head's may be longer (its block_size bounds it)."
        },
    )
    num_blocks_per_sequence: int = field(
        default=4, metadata={"help": "Anchors drawn per row and epoch, packed into one head forward."}
    )
    loss: str = field(
        default="fkl",
        metadata={
            "help": f"Distillation loss, one of {LOSS_KINDS}: forward KL (paper), hard-label CE on the target's "
            "greedy token, reverse KL, forward KL + total variation (1 - acceptance, as the LK losses), "
            "forward KL + a ranking loss on the target's top-8 tokens (HASS)."
        },
    )
    gamma: float | None = field(
        default=None,
        metadata={"help": "Position decay w_k ~ exp(-(k-1)/gamma) over depths (scaled to mean 1); none by default."},
    )
    reveal_prob: float = field(
        default=0.0,
        metadata={
            "help": "Probability that a block slot is fed its real token instead of MASK (no loss there); "
            "trains path-conditioned drafting. Evaluation never reveals."
        },
    )
    answer_anchor_prob: float = field(
        default=1.0,
        metadata={
            "help": "Probability that an anchor is drawn in the answer part (a >= prompt_length - 1) rather "
            "than anywhere in the row (a >= 1)."
        },
    )
    max_length: int = field(default=1024, metadata={"help": "Rows are truncated to this many tokens."})
    loss_chunk_slots: int = field(
        default=LOSS_CHUNK_SLOTS,
        metadata={
            "help": "Block slots whose logits over the vocabulary exist at once (the LM head, the loss and its "
            "gradient go chunk by chunk): memory about 8 x chunk x vocabulary x 4 bytes, not per step."
        },
    )
    cache_features: bool = field(
        default=False,
        metadata={
            "help": "Keep each row's target features in memory after its first target forward, so later "
            "epochs cost only the head (bf16, about (k + 1) * hidden * 2 bytes per token)."
        },
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Stop training after this many minutes of wall time (and evaluate once more); the "
            "schedule still follows max_steps."
        },
    )
    train_precision: str = field(
        default="fp32",
        metadata={
            "help": "The head's training step: `fp32`, `bf16` (autocast, the Trainer's `bf16`) or `auto`: bf16 "
            "where jetspec.host measures bf16 matmuls faster than float32 on this host (native bf16: "
            "AVX-512 BF16, AMX, a GPU), else fp32 (the committed config's choice). An explicit `--bf16 true` always "
            "wins."
        },
    )
    keep_head_dir: str | None = field(
        default="auto",
        metadata={
            "help": "A tracked folder that receives the final head (bf16 weights, config, metrics, learning "
            "curve, about 11 MB) whether or not it ships: `auto` = training/checkpoints/<output_dir's "
            "name> for runs of keep_head_minutes or more, a path = always there, `none` = never."
        },
    )
    keep_head_every_save: bool = field(
        default=False,
        metadata={
            "help": "Also keep the head of every complete checkpoint in the keep_head_dir folder (bf16, with the "
            "trainer state: step and curve), so a run that outlasts its working session leaves a tracked head at "
            "each save, and `--resume_from_checkpoint true` can continue from it where output_dir is gone."
        },
    )
    keep_head_minutes: float = field(
        default=20.0,
        metadata={"help": "With keep_head_dir=auto: the training minutes from which a run keeps its head."},
    )
    offline_tau_rows: int = field(
        default=32,
        metadata={
            "help": "With a feature store: at every evaluation, the head's offline tau at its defaults on this "
            "many held-out rows (training.evaluate_head: the decoder's own draft, tree and trie over the "
            "stored answers, no target forward), logged as eval_offline_tau beside the agreement; 0 "
            "skips it."
        },
    )
    offline_tau_new_tokens: int = field(
        default=128, metadata={"help": "Answer tokens per row of the offline tau at each evaluation."}
    )
    measure_tau_prompts: int = field(
        default=0,
        metadata={
            "help": "After training, decode this many held-out prompts with the head and report the "
            "measured tau (0 skips it)."
        },
    )
    measure_tau_new_tokens: int = field(default=64, metadata={"help": "max_new_tokens of the tau measurement."})
    base_model_id: str | None = field(
        default=None,
        metadata={"help": "Hub id of the target for the model card; defaults to the target's own name."},
    )
    card_template: str | None = field(
        default=None,
        metadata={"help": "Model card template written as README.md; defaults to hub_cards/jetspec-head.md."},
    )
    include_num_input_tokens_seen: str = field(
        default="non_padding",
        metadata={
            "help": "The Trainer's count of the rows' tokens that the target read, over all processes, logged as "
            "`num_input_tokens_seen` and `train_tokens_per_second`: `non_padding` (`attention_mask`), "
            "`all` or `no`."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: the collator reads `id` and `prompt_length`, which the head's forward "
            "does not take."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_loss_kind(self.loss)
        if self.remove_unused_columns:
            raise ValueError(
                "expected remove_unused_columns=False (the collator needs `prompt_length` and `id`, which the head's "
                "forward does not take), got True"
            )
        if self.num_blocks_per_sequence < 1:
            raise ValueError(f"expected num_blocks_per_sequence >= 1, got {self.num_blocks_per_sequence}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"expected block_size >= 2 (anchor plus at least one MASK), got {self.block_size}")
        if not 0.0 <= self.reveal_prob < 1.0:
            raise ValueError(f"expected reveal_prob in [0, 1), got {self.reveal_prob}")
        if not 0.0 <= self.answer_anchor_prob <= 1.0:
            raise ValueError(f"expected answer_anchor_prob in [0, 1], got {self.answer_anchor_prob}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"expected gamma > 0 or None, got {self.gamma}")
        if self.max_train_minutes is not None and not self.max_train_minutes > 0:
            raise ValueError(f"expected max_train_minutes > 0 or None, got {self.max_train_minutes}")
        if self.loss_chunk_slots < 1:
            raise ValueError(f"expected loss_chunk_slots >= 1, got {self.loss_chunk_slots}")
        if self.train_precision not in TRAIN_PRECISIONS:
            raise ValueError(f"expected train_precision in {TRAIN_PRECISIONS}, got {self.train_precision!r}")
        if self.train_precision == "fp32" and self.bf16:
            raise ValueError("expected bf16=False with train_precision='fp32', got bf16=True")
        if self.offline_tau_rows < 0 or self.offline_tau_new_tokens < 1:
            raise ValueError(
                f"expected offline_tau_rows >= 0 and offline_tau_new_tokens >= 1, got "
                f"{self.offline_tau_rows} and {self.offline_tau_new_tokens}"
            )
        if not self.keep_head_minutes >= 0:
            raise ValueError(f"expected keep_head_minutes >= 0, got {self.keep_head_minutes}")
        if self.max_length < 3:
            raise ValueError(
                f"expected max_length >= 3 (an anchor needs a token before and after it), got {self.max_length}"
            )
        if self.dataloader_persistent_workers and self.dataloader_num_workers > 0:
            raise ValueError(
                "expected dataloader_persistent_workers=False (persistent workers keep the collator of "
                "the first epoch, and with it its anchors), got True"
            )


class TimeBudgetCallback(TrainerCallback):
    """Ends training (and evaluates once more) once `minutes` of wall time have passed since training began."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.started = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.started >= self.seconds:
            control.should_training_stop = True
            control.should_evaluate = args.eval_strategy != "no"
        return control


class ScheduleCatchUpCallback(TrainerCallback):
    """A run resumed from weights and trainer state without the optimizer's and scheduler's files (a kept head,
    `run_trainer.checkpoint_from_kept`) starts its learning-rate schedule at its resumed step, not at step 0: the
    scheduler is stepped up to `state.global_step` before the first update. A no-op otherwise (a new run is at step
    0; a full checkpoint restores the scheduler at its step)."""

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        behind = state.global_step - getattr(lr_scheduler, "last_epoch", state.global_step)
        if behind > 0:
            with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step
                warnings.simplefilter("ignore")
                for _ in range(behind):
                    lr_scheduler.step()


class EpochCallback(TrainerCallback):
    """Tells the training collator which epoch begins, so each epoch draws fresh anchors for every row.

    The Trainer builds each epoch's batch iterator (and its dataloader workers) after `on_epoch_begin`. A resumed
    run starts inside the epoch its checkpoint was saved in (`state.epoch` holds its fraction).
    """

    def __init__(self, collator: "JetSpecCollator"):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)


@dataclass
class PackedBlocks:
    """Blocks of a batch packed along T: one head forward per batch."""

    input_ids: torch.Tensor  # (B, T) with T = n * bs; anchors, MASKs and revealed tokens
    position_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, 1, T, L + T) bool
    teacher_index: torch.Tensor  # (B, n, D) target position a + k - 1 predicting slot k (clamped in range)
    labels: torch.Tensor  # (B, n, D) x_{a+k} at MASK slots inside the row, -100 elsewhere (revealed, past the end)
    last_context_index: torch.Tensor  # (B, T) a - 1: the context position just before each slot's anchor


def draw_anchors(lengths, prompt_lengths, keys, n, seed, answer_prob, generator_offset=0):
    """Anchors per row, drawn with a generator seeded by `(seed, generator_offset, row key)`: reproducible and the
    same for a row whatever process or batch it lands in. The collator passes `epoch + 1` as the offset in training
    and 0 in evaluation.

    Returns:
        `(anchors, generators)`: `torch.LongTensor` of shape `(B, n)` (a in [1, length - 2]; rows shorter than 3
        tokens get a = 1 and no valid slot), and the per-row generators (for the reveal draw).
    """
    anchors, generators = [], []
    for length, prompt_length, key in zip(lengths.tolist(), prompt_lengths.tolist(), keys.tolist()):
        g = torch.Generator().manual_seed((seed * 1_000_003 + generator_offset) * 1_000_033 + key)
        generators.append(g)
        hi = length - 2  # the anchor needs at least its next token inside the sequence
        if hi < 1:
            anchors.append(torch.ones(n, dtype=torch.long))
            continue
        lo_answer = min(max(1, prompt_length - 1), hi)
        in_answer = torch.rand(n, generator=g) < answer_prob
        lo = torch.where(in_answer, torch.tensor(lo_answer), torch.tensor(1))  # (n,)
        u = torch.rand(n, generator=g)
        anchors.append(lo + (u * (hi - lo + 1).float()).long().clamp_max(hi - lo))
    return torch.stack(anchors), generators


def pack_blocks(
    input_ids, lengths, anchors, block_size, mask_token_id, causal=True, reveal_prob=0.0, generators=None
) -> PackedBlocks:
    """Build the packed blocks, their positions, their attention mask over `[context ; blocks]` and the targets.

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L)`): the rows, right padded.
        lengths (`torch.LongTensor` of shape `(B,)`): valid lengths.
        anchors (`torch.LongTensor` of shape `(B, n)`): from [`draw_anchors`].
        block_size (`int`): bs; D = bs - 1 MASK slots per block.
        mask_token_id (`int`): the head's MASK id.
        causal (`bool`, *optional*, defaults to `True`): causal (JetSpec) or bidirectional (DFlash) block.
        reveal_prob (`float`, *optional*, defaults to 0): probability that a slot holds its real token.
        generators (`list[torch.Generator]`, *optional*): per-row generators for the reveal draw.
    """
    b, length = input_ids.shape
    n = anchors.shape[1]
    device = input_ids.device
    slots = torch.arange(block_size, device=device)  # (bs,)
    positions = anchors.unsqueeze(-1) + slots  # (B, n, bs): a + i
    inside = positions < lengths.view(b, 1, 1)  # (B, n, bs)
    real = input_ids.gather(1, positions.clamp_max(length - 1).view(b, -1)).view(b, n, block_size)
    real = real.masked_fill(~inside, 0)
    reveal = torch.zeros(b, n, block_size, dtype=torch.bool, device=device)
    if reveal_prob > 0:
        draws = torch.stack([torch.rand(n, block_size, generator=g) for g in generators]).to(device)
        reveal = (draws < reveal_prob) & inside
    reveal[..., 0] = True  # the anchor is always a real token
    block_ids = torch.where(reveal, real, torch.full_like(real, mask_token_id))  # (B, n, bs)
    counted = inside[..., 1:] & ~reveal[..., 1:]  # (B, n, D): MASK slots inside the row carry the loss
    t = n * block_size
    return PackedBlocks(
        input_ids=block_ids.view(b, t),
        position_ids=positions.view(b, t),
        attention_mask=_block_attention_mask(anchors, lengths, length, block_size, causal),
        teacher_index=(positions[..., 1:] - 1).clamp_max(length - 1),
        labels=real[..., 1:].masked_fill(~counted, -100),
        last_context_index=(anchors.unsqueeze(-1) - 1).expand(b, n, block_size).reshape(b, t),
    )


def _block_attention_mask(anchors, lengths, length: int, block_size: int, causal: bool) -> torch.Tensor:
    """`(B, 1, T, L + T)` bool: each slot sees the context before its anchor (never padding), then its own block."""
    b, n = anchors.shape
    device = anchors.device
    t = n * block_size
    ctx_pos = torch.arange(length, device=device)
    ctx_ok = (ctx_pos.view(1, 1, length) < anchors.unsqueeze(-1)) & (
        ctx_pos.view(1, 1, length) < lengths.view(b, 1, 1)
    )  # (B, n, L): context j < a, never padding
    ctx_mask = ctx_ok.unsqueeze(2).expand(b, n, block_size, length).reshape(b, 1, t, length)
    inner = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    inner = inner.tril() if causal else inner
    block_diag = torch.block_diag(*([inner] * n)).expand(b, 1, t, t)  # each block sees only itself
    return torch.cat([ctx_mask, block_diag], dim=-1)  # (B, 1, T, L + T)


@dataclass
class JetSpecCollator:
    """Right-pads the rows (truncated to `max_length`), draws their anchors and packs their blocks.

    Anchors and revealed slots come from a generator seeded by the row's id, `seed` and the epoch: the same for a row
    in any batch, micro-batch or process, fresh in every epoch. `epoch=None` is evaluation: the same anchors at every
    evaluation (build the evaluation collator with `reveal_prob=0`).

    Returns a dict of `input_ids` `(B, L)` and `attention_mask` `(B, L)` (the rows, what the target reads),
    `sample_key` `(B,)` (the row keys, [`training.rows.row_key`]), and the packed blocks ([`PackedBlocks`]):
    `block_ids` `(B, T)`, `block_position_ids` `(B, T)`, `block_attention_mask` `(B, 1, T, L + T)`,
    `teacher_index` `(B, n, D)`, `labels` `(B, n, D)` and `last_context_index` `(B, T)`.
    """

    mask_token_id: int
    block_size: int = 16
    num_blocks: int = 4
    causal: bool = True
    max_length: int = 1024
    pad_token_id: int = 0
    seed: int = 0
    answer_anchor_prob: float = 1.0
    reveal_prob: float = 0.0
    epoch: int | None = 0
    # a `FeatureStore` to read the batch's target features from while collating: with dataloader workers the read
    # of batch i + 1 overlaps the step of batch i (set by the trainer; rows it does not hold are left to the step)
    feature_store: object = field(default=None, repr=False, compare=False)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("expected at least one row in a batch, got none")
        rows = [list(f["input_ids"])[: self.max_length] for f in features]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)  # (B, L)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, : len(r)] = 1
        lengths = attention_mask.sum(-1)  # (B,)
        prompt_length = torch.tensor([int(f.get("prompt_length", 0)) for f in features], dtype=torch.long)
        keys = torch.tensor(
            [row_key(f["id"] if "id" in f else list(f["input_ids"])) for f in features], dtype=torch.long
        )  # (B,)
        offset = 0 if self.epoch is None else self.epoch + 1
        anchors, generators = draw_anchors(
            lengths, prompt_length, keys, self.num_blocks, self.seed, self.answer_anchor_prob, generator_offset=offset
        )
        blocks = pack_blocks(
            input_ids,
            lengths,
            anchors,
            self.block_size,
            self.mask_token_id,
            causal=self.causal,
            reveal_prob=self.reveal_prob,
            generators=generators,
        )
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "sample_key": keys,
            "block_ids": blocks.input_ids,
            "block_position_ids": blocks.position_ids,
            "block_attention_mask": blocks.attention_mask,
            "teacher_index": blocks.teacher_index,
            "labels": blocks.labels,
            "last_context_index": blocks.last_context_index,
        }
        store = self.feature_store
        if store is not None and store.covers_all(keys.tolist(), lengths.tolist()):
            batch["stored_features"], batch["stored_final"] = store.get_batch(
                keys.tolist(), lengths.tolist(), width=width
            )
        return batch


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def unwrap_head(model):
    """The `JetSpecDraftModel` inside whatever wrapper accelerate can return (DDP, FSDP, a DeepSpeed engine,
    `torch.compile`'s module, through accelerate's own `extract_model_from_parallel`) and a PEFT model."""
    from accelerate.utils import extract_model_from_parallel
    from peft import PeftModel

    model = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
    if isinstance(model, PeftModel):
        model = extract_model_from_parallel(model.get_base_model(), keep_torch_compile=False)
    return model


def draft_labels(head, labels: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as draft-vocabulary ids, and the slots the loss sums over.

    Args:
        head (`JetSpecDraftModel`): its `d2t` (reduced draft vocabulary) or None (the full vocabulary).
        labels (`torch.LongTensor` of shape `(N, D)`): target ids, -100 where a slot carries no loss.
        kind (`str`): the loss; the hard-label one (`"sft"`) cannot score a token outside the draft vocabulary, so
            such a slot is left out of its sum (it still counts in the denominator, as a slot the head cannot win).

    Returns:
        `(labels, summed)`: `torch.LongTensor` of shape `(N, D)` (draft ids, -100 where not drafted) and
        `torch.BoolTensor` of shape `(N, D)`.
    """
    counted = labels != -100
    if head.d2t is None:
        return labels, counted
    ids = head.draft_token_ids().to(labels.device)
    table = torch.full((head.config.vocab_size,), -100, dtype=torch.long, device=labels.device)
    table[ids] = torch.arange(ids.numel(), device=labels.device)
    mapped = table[labels.clamp_min(0)].masked_fill(~counted, -100)
    return mapped, (counted & (mapped >= 0)) if kind == "sft" else counted


def distillation_terms(
    model,
    batch: dict,
    features: torch.Tensor,
    final: torch.Tensor,
    kind: str = "fkl",
    gamma: float | None = None,
    chunk_slots: int = LOSS_CHUNK_SLOTS,
):
    """One head forward over a collated batch and the numerator and denominator of its loss. The LM head is applied
    to the head's and the target's final states `chunk_slots` slots at a time, inside the loss
    ([`training.losses.chunked_block_loss_terms`]): no `(slots, vocabulary)` tensor exists whole.

    Args:
        model (`JetSpecDraftModel`, possibly wrapped: see [`unwrap_head`]): the head.
        batch (`dict`): from [`JetSpecCollator`].
        features (`torch.Tensor` of shape `(B, L, k * H)`): the target's selected-layer features of the rows.
        final (`torch.Tensor` of shape `(B, L, H)`): the target's final (post-norm) hidden states of the rows.
        kind (`str`, *optional*, defaults to `"fkl"`): the loss ([`training.losses.slot_losses`]).
        gamma (`float`, *optional*): position decay ([`training.losses.depth_weights`]).
        chunk_slots (`int`, *optional*, defaults to `LOSS_CHUNK_SLOTS`): slots per chunk of the LM head and loss.

    Returns:
        `(weighted_sum, count, student_hidden, teacher_hidden)`: the depth-weighted loss summed over the slots, the
        number of slots that carry loss (`labels != -100`, what the Trainer counts), the head's final states at the
        MASK slots `(B*n, D, H_head)` and the target's final states predicting each slot `(B*n, D, H)`.
    """
    head = unwrap_head(model)
    b, n, d = batch["labels"].shape
    teacher_hidden = final.gather(
        1, batch["teacher_index"].reshape(b, n * d, 1).expand(b, n * d, final.shape[-1])
    ).view(b * n, d, -1)  # (B*n, D, H): the target's state predicting each slot's token
    extra = {"last_context_index": batch["last_context_index"]} if head.config.last_context_input else {}
    output = model(
        input_ids=batch["block_ids"],
        position_ids=batch["block_position_ids"],
        attention_mask=batch["block_attention_mask"],
        context_features=features,
        context_valid=batch["attention_mask"].bool(),
        return_logits=False,
        **extra,
    )
    student_hidden = output.hidden_states.view(b, n, d + 1, -1)[:, :, 1:].reshape(b * n, d, -1)  # slot 0: anchor
    # the target's logits over the head's draft vocabulary: with a reduced vocabulary its softmax restricted to the
    # draft tokens (renormalised by the loss's log-softmax), so the head learns to rank exactly what it can draft
    weight, bias = head.draft_lm_head()
    labels, summed = draft_labels(head, batch["labels"].view(b * n, d), kind)
    total, _ = chunked_block_loss_terms(
        student_hidden, teacher_hidden, weight, bias, labels, summed, kind, gamma, chunk_slots
    )
    count = (batch["labels"] != -100).sum().float()
    return total, count, student_hidden, teacher_hidden


CHECKPOINT_MARKER = "checkpoint_complete.json"
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's `checkpoint-{global_step}` folders


def write_checkpoint_marker(folder: Path, step: int) -> None:
    """Marks `folder` complete: `CHECKPOINT_MARKER` lists the size of every file in it, written atomically, last."""
    files = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != CHECKPOINT_MARKER
    }
    tmp = folder / f".{CHECKPOINT_MARKER}.tmp"
    tmp.write_text(json.dumps({"global_step": step, "files": files}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / CHECKPOINT_MARKER)


def checkpoint_problem(folder) -> str | None:
    """Why `folder` is not a complete checkpoint (no marker, an unreadable one, a file missing or of another size
    than recorded), or None when it is."""
    marker = Path(folder) / CHECKPOINT_MARKER
    if not marker.is_file():
        return f"no {CHECKPOINT_MARKER}: it was being written when the run stopped"
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
        assert isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{CHECKPOINT_MARKER} is unreadable"
    for name, size in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, not the {size} recorded"
    return None


def checkpoint_folders(output_dir) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, by step N."""
    found = [path for path in Path(output_dir).iterdir() if path.is_dir() and CHECKPOINT_PATTERN.match(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT_PATTERN.match(path.name).group(1)))


def last_complete_checkpoint(output_dir, report: Callable[[str], None] = print) -> str | None:
    """The newest complete `checkpoint-N` of `output_dir` (highest N), None when there is none; each newer one that
    is not complete is skipped and reported (never loaded)."""
    for folder in reversed(checkpoint_folders(output_dir)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        report(f"jetspec: skipping {folder}, an incomplete checkpoint ({problem}); it is not loaded")
    return None


def rotate_complete_checkpoints(output_dir, limit: int | None, keep: list) -> list[Path]:
    """Deletes checkpoints beyond `limit` (the `save_total_limit`): the incomplete ones (never loadable) and the
    oldest complete ones by completion time, never those in `keep` (the one just completed, the best one). The
    Trainer's own rotation counts half-written folders and protects the highest step, which may be one of them.
    Returns the deleted folders."""
    if limit is None or limit <= 0:
        return []
    keep = {Path(path).resolve() for path in keep if path is not None}
    complete, deleted = [], []
    for folder in checkpoint_folders(output_dir):
        if checkpoint_problem(folder) is None:
            complete.append(folder)
        elif folder.resolve() not in keep:
            print(f"jetspec: deleting {folder}, an incomplete checkpoint left by a stopped run")
            deleted.append(folder)
    complete.sort(key=lambda folder: (folder / CHECKPOINT_MARKER).stat().st_mtime_ns)
    kept = [folder for folder in complete if folder.resolve() in keep]
    for folder in reversed(complete):  # the most recent first
        if folder not in kept and len(kept) < limit:
            kept.append(folder)
    deleted += [folder for folder in complete if folder not in kept]
    for folder in deleted:
        shutil.rmtree(folder, ignore_errors=True)
    return deleted


def resolve_precision(args: JetSpecTrainingArguments) -> str:
    """Sets `args.bf16` from `args.train_precision` and says why: `auto` takes bf16 autocast where the host probe
    (jetspec.host) finds bf16 matmuls faster than float32 (or on a CUDA device), float32 elsewhere. An explicit
    `bf16=True` is kept. [`JetSpecTrainer`] calls it before `Trainer.__init__`, which builds the accelerator from
    `mixed_precision`; calling it again changes nothing."""
    if args.bf16:
        reason = "bf16 autocast (bf16=True given)"
    elif args.train_precision == "bf16":
        args.bf16, reason = True, "bf16 autocast (train_precision=bf16)"
    elif args.train_precision == "fp32":
        reason = "float32 (train_precision=fp32)"
    elif torch.cuda.is_available() and not args.use_cpu:
        args.bf16, reason = True, "bf16 autocast (auto: a CUDA device)"
    else:
        host = host_kind()
        args.bf16 = host.torch_dtype == torch.bfloat16
        reason = f"{'bf16 autocast' if args.bf16 else 'float32'} (auto: {host.reason}; host kind {host.name})"
    if args.bf16:
        # `TrainingArguments.__post_init__` derived `mixed_precision` from `bf16` already; the Trainer's accelerator
        # reads `mixed_precision`, so it must follow
        args.mixed_precision = "bf16"
    return reason


class JetSpecTrainer(Trainer):
    """`Trainer` that distills `target` into a JetSpec head (`model`). See the module docstring.

    Args:
        model (`JetSpecDraftModel` or a PEFT model around one): the head; the target's embeddings and LM head must
            be attached to it.
        args ([`JetSpecTrainingArguments`]): the Trainer's arguments and the block, anchor and loss settings.
        target (`PreTrainedModel`): the frozen target.
        feature_store ([`training.feature_store.FeatureStore`], *optional*): the target's features of the rows it
            holds, read instead of running the target.
        **kwargs: `Trainer`'s other arguments (`train_dataset`, `eval_dataset`, `processing_class`, ...), except
            `data_collator`: batches always come from [`JetSpecCollator`]. `compute_metrics` defaults to per-depth
            top-1 agreement with the target.
    """

    # `compute_loss` divides by the whole step's `num_items_in_batch`: the Trainer must not divide again by the
    # gradient-accumulation steps
    loss_is_scaled_for_ga = True

    def __init__(self, model, args: JetSpecTrainingArguments, *, target: PreTrainedModel, feature_store=None, **kwargs):
        if not isinstance(args, JetSpecTrainingArguments):
            raise ValueError(f"expected args of type JetSpecTrainingArguments, got {type(args).__name__}")
        if kwargs.get("data_collator") is not None:
            raise ValueError("expected no data_collator (the trainer packs blocks with its JetSpecCollator), got one")
        head = unwrap_head(model)
        head.check_target(target)
        block_size = args.block_size or head.config.block_size
        if block_size > head.config.block_size:
            raise ValueError(
                f"expected block_size <= {head.config.block_size} (the head's block_size, which sets its maximum "
                f"depth), got {block_size}"
            )
        for name in ("train_dataset", "eval_dataset"):
            dataset = kwargs.get(name)
            # a stream (`IterableDataset`) has no length; run_trainer checks that it yields a row
            if dataset is not None and not isinstance(dataset, torch.utils.data.IterableDataset) and len(dataset) == 0:
                raise ValueError(f"expected a non-empty {name}, got an empty dataset")
        pad = getattr(kwargs.get("processing_class"), "pad_token_id", None)
        collator = JetSpecCollator(
            mask_token_id=head.config.mask_id,
            block_size=block_size,
            num_blocks=args.num_blocks_per_sequence,
            causal=head.config.block_attention == "causal",
            max_length=args.max_length,
            pad_token_id=pad or 0,
            seed=args.seed,
            answer_anchor_prob=args.answer_anchor_prob,
            reveal_prob=args.reveal_prob,
            epoch=0,
        )
        if feature_store is not None and args.dataloader_num_workers > 0:
            collator.feature_store = feature_store  # workers read the store ahead of the compute
        self.eval_collator = dataclasses.replace(collator, reveal_prob=0.0, epoch=None)
        if kwargs.get("compute_metrics") is None:
            kwargs["compute_metrics"] = self._agreement_metrics
        self.precision = resolve_precision(args)  # `train_precision` decides the autocast, however the trainer is made
        super().__init__(model=model, args=args, data_collator=collator, **kwargs)
        # the head's forward takes no loss arguments, but `compute_loss` divides by `num_items_in_batch`: the Trainer
        # counts it from the collator's `labels` only for a model that says it accepts them
        self.model_accepts_loss_kwargs = True
        self.add_callback(EpochCallback(collator))
        self.add_callback(ScheduleCatchUpCallback())
        if args.max_train_minutes is not None:
            self.add_callback(TimeBudgetCallback(args.max_train_minutes))
        self.target = freeze(target).to(self.args.device)
        self.feature_store = feature_store
        if feature_store is not None:
            feature_store.check(head.config.target_layer_ids, head.config.target_hidden_size)
        self._feature_cache = {} if args.cache_features else None  # row key -> (features, final)

    def get_eval_dataloader(self, eval_dataset=None):
        """Evaluation batches from the evaluation collator: the same anchors at every evaluation, nothing revealed."""
        training_collator, self.data_collator = self.data_collator, self.eval_collator
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = training_collator

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, then its completeness marker (once every process has written its part), then
        the rotation of complete checkpoints ([`rotate_complete_checkpoints`]) instead of the Trainer's."""
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            (folder / CHECKPOINT_MARKER).unlink(missing_ok=True)  # a folder rewritten is incomplete until marked
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # each process's RNG state is in the folder
        if self.args.should_save:
            write_checkpoint_marker(folder, self.state.global_step)
            rotate_complete_checkpoints(folder.parent, limit, keep=[folder, self.state.best_model_checkpoint])

    # ------------------------------------------------------------------------------------------------ one batch
    def _target_states(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen target's selected-layer features `(B, L, k*H)` and final (post-norm) hidden states `(B, L, H)`.

        Rows held by the `feature_store` come from disk. Otherwise, with `cache_features`, rows seen before come from
        memory (bf16) and the target runs only on a batch that holds an unseen row; the head needs nothing else from
        the target, so later epochs skip it entirely.
        """
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]  # (B, L)
        if "stored_features" in inputs:  # read from the store by the collator (a dataloader worker), ahead of the step
            return inputs["stored_features"], inputs["stored_final"]
        keys = inputs["sample_key"].tolist()
        lengths = attention_mask.sum(-1).tolist()
        cache, store = self._feature_cache, self.feature_store
        if store is not None and store.covers_all(keys, lengths):
            features, final = store.get_batch(keys, lengths, width=input_ids.shape[1])  # one pass over the rows
            return features.to(input_ids.device), final.to(input_ids.device)
        if cache is not None and all(key in cache for key in keys):
            rows = [cache[key] for key in keys]
            width = input_ids.shape[1]
            features = torch.zeros(len(rows), width, rows[0][0].shape[-1], dtype=rows[0][0].dtype)
            final = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=rows[0][1].dtype)
            for i, (f, h) in enumerate(rows):
                features[i, : len(f)], final[i, : len(h)] = f[:width], h[:width]
            return features.to(input_ids.device), final.to(input_ids.device)
        head = unwrap_head(self.model)
        with torch.no_grad():
            # only the layers the head reads are kept (the tuple holds None for the others); the final state is
            # `last_hidden_state`
            out = self.target.get_decoder()(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                output_hidden_states=[i + 1 for i in head.config.target_layer_ids],
            )
        features = head.target_features(out.hidden_states)  # (B, L, k*H)
        final = out.last_hidden_state  # (B, L, H), what the target's LM head reads
        if cache is not None:
            for i, (key, length) in enumerate(zip(keys, lengths)):
                cache[key] = (
                    features[i, :length].to("cpu", torch.bfloat16),
                    final[i, :length].to("cpu", torch.bfloat16),
                )
        return features, final

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Distillation loss of one batch: the depth-weighted loss summed over its slots that carry loss, divided by
        the number of such slots in the whole optimizer step (`num_items_in_batch`, the Trainer's count of `labels`
        over all micro-batches of gradient accumulation and all processes).

        With the step's count summed over processes, each process's loss is scaled by the process count, so the
        gradient average of DDP equals the single-process gradient of the concatenated batch (the Trainer's
        convention for token-level losses). Evaluation (no `num_items_in_batch`) averages over the batch's slots.
        """
        features, final = self._target_states(inputs)
        total, count, student_hidden, teacher_hidden = distillation_terms(
            model, inputs, features, final, self.args.loss, self.args.gamma, self.args.loss_chunk_slots
        )
        if num_items_in_batch is not None:
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=total.device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                count = count / self.accelerator.num_processes
        loss = total / count if count > 0 else total * 0.0
        return (loss, (student_hidden, teacher_hidden)) if return_outputs else loss

    # --------------------------------------------------------------------------------------------------- eval
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Loss, and per row the top-1 agreement counts `(B, 2, D)` ([matches, slots] per depth) of head and target.

        The batch is already on the device (the prepared dataloader places it). The dummy labels `(B, 1)` only make
        `evaluation_loop` call `compute_metrics`.
        """
        with torch.no_grad():
            loss, (student_hidden, teacher_hidden) = self.compute_loss(model, inputs, return_outputs=True)
            if prediction_loss_only:
                return loss.detach(), None, None
            head = unwrap_head(self.model)
            lm_head = head.target_lm_head()
            chunk = self.args.loss_chunk_slots
            # agreement with the target's argmax over the full vocabulary: a token outside the draft vocabulary
            # counts as a miss, as it does when decoding
            target_top = chunked_argmax(
                teacher_hidden, lm_head.weight, getattr(lm_head, "bias", None), chunk
            )  # (B*n, D)
            draft_top = head.draft_to_target(chunked_argmax(student_hidden, *head.draft_lm_head(), chunk))  # (B*n, D)
        b, n, d = inputs["labels"].shape
        slots = inputs["labels"] != -100  # (B, n, D)
        agree = (draft_top == target_top).view(b, n, d) & slots
        counts = torch.stack([agree.sum(1), slots.sum(1)], dim=1).float()  # (B, 2, D)
        return loss.detach(), counts, torch.zeros(b, 1, device=counts.device)

    @staticmethod
    def _agreement_metrics(prediction: EvalPrediction) -> dict[str, float]:
        counts = np.asarray(prediction.predictions).reshape(-1, 2, np.asarray(prediction.predictions).shape[-1])
        matches, slots = counts[:, 0].sum(0), counts[:, 1].sum(0)  # (D,)
        acceptance = [float(m / s) if s > 0 else 0.0 for m, s in zip(matches, slots)]
        metrics = {f"acc_depth_{k + 1}": a for k, a in enumerate(acceptance)}
        metrics["tau_chain"] = chain_accept_length(acceptance)
        return metrics
