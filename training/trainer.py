"""Distillation of a JetSpec draft head with the transformers `Trainer` (arXiv 2606.18394, section 3.3; see
`docs/design.md`, §5 Training).

Each batch holds rows packed into blocks by [`training.blocks.JetSpecCollator`]: per row, anchors, and per anchor a
block `[x_a, MASK x (bs - 1)]` whose slot k predicts x_{a+k}, its teacher the target's softmax at position a + k - 1.
The collator's `labels` hold the token of every slot that carries loss and -100 elsewhere, so the `Trainer`'s own
count of them (`num_items_in_batch`, over the micro-batches of a step and over processes) is the denominator of the
step's loss.

Only the head trains. The target is frozen; its embeddings and LM head are borrowed by the head, not saved with it.

Checkpoints are marked complete once written and rotated among complete ones only
([`training.checkpointing`]).
"""

import dataclasses
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from jetspec.host import host_kind
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback

from .arguments import JetSpecTrainingArguments
from .blocks import JetSpecCollator
from .checkpointing import CHECKPOINT_MARKER, rotate_complete_checkpoints, write_checkpoint_marker
from .losses import LOSS_CHUNK_SLOTS, chain_accept_length, chunked_argmax, chunked_block_loss_terms


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
    [`training.checkpointing.checkpoint_from_kept`]) starts its learning-rate schedule at its resumed step, not at
    step 0: the scheduler is stepped up to `state.global_step` before the first update. A no-op otherwise (a new run
    is at step 0; a full checkpoint restores the scheduler at its step)."""

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
