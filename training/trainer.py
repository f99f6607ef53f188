"""Distillation of a JetSpec draft head with the transformers `Trainer` (arXiv 2606.18394, section 3.3).

Per training sequence x (a prompt and the target's own answer), `num_blocks_per_sequence` anchors a are drawn,
preferably in the answer. Each anchor yields a block `[x_a, MASK x (bs - 1)]` at positions a..a+bs-1 that sees
the target's hidden states h_0..h_{a-1} and, causally, its own slots. All blocks of a sequence are packed into one
head forward with a block-diagonal mask. Slot k predicts x_{a+k}; its teacher is the target's softmax at position
a + k - 1. Optionally some slots are revealed as their real token (training for path-conditioned drafting,
section 3 of DESIGN.md); revealed slots carry no loss.

Only the head trains. The target is frozen; its embeddings and LM head are borrowed by the head, not saved with it.
"""

import math
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback

from .losses import LOSS_KINDS, block_loss_terms, chain_accept_length, check_loss_kind, depth_weights


@dataclass
class JetSpecArguments:
    """What to distill into which head. Parsed with `TrainingArguments` by `HfArgumentParser`."""

    target: str = field(
        default="smollm2-135m",
        metadata={"help": "Target model: the alias 'smollm2-135m', a local folder or a Hub id (see load_target)."},
    )
    data: list[str] = field(
        default_factory=lambda: ["data/regen"],
        metadata={"help": "Folder(s) written by training/regenerate.py (shard-*.jsonl), or compact .npz files from "
                          "`regenerate.py --export`; concatenated in order."},
    )
    base_model_id: str | None = field(
        default=None,
        metadata={"help": "Hub id of the target for the model card; defaults to the target's own name."},
    )
    init_head: str | None = field(
        default=None,
        metadata={"help": "Start from this saved head folder instead of a new head (fine-tuning, LoRA)."},
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Block length [anchor, MASK x (block_size - 1)]; defaults to the head's block_size "
                          "(16 for a new head). May not exceed the head's."},
    )
    num_blocks_per_sequence: int = field(
        default=4, metadata={"help": "Anchors drawn per sequence and training step, packed into one head forward."}
    )
    loss: str = field(
        default="fkl",
        metadata={"help": f"Distillation loss, one of {LOSS_KINDS}: forward KL (paper), hard-label CE, reverse KL."},
    )
    gamma: float | None = field(
        default=None, metadata={"help": "Position decay w_k = exp(-(k-1)/gamma) over depths; none by default."}
    )
    reveal_prob: float = field(
        default=0.0,
        metadata={"help": "Probability that a block slot is fed its real token instead of MASK (no loss there); "
                          "trains path-conditioned drafting."},
    )
    answer_anchor_prob: float = field(
        default=1.0,
        metadata={"help": "Probability that an anchor is drawn in the answer part (a >= prompt_length - 1) rather "
                          "than anywhere in the sequence (a >= 1)."},
    )
    max_length: int = field(default=1024, metadata={"help": "Sequences are truncated to this many tokens."})
    eval_fraction: float = field(
        default=0.02, metadata={"help": "Fraction of the sequences held out for evaluation (at least one if > 0)."}
    )
    num_hidden_layers: int | None = field(default=None, metadata={"help": "Head layers (new head only)."})
    intermediate_size: int | None = field(default=None, metadata={"help": "Head MLP width (new head only)."})
    block_attention: str | None = field(
        default=None, metadata={"help": "'causal' (JetSpec) or 'bidirectional' (DFlash ablation); new head only."}
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers feeding the head (new head only); evenly spaced by default."}
    )
    tree_depth: int | None = field(default=None, metadata={"help": "Default tree depth stored in the head."})
    tree_width: int | None = field(default=None, metadata={"help": "Default tree width stored in the head."})
    tree_budget: int | None = field(default=None, metadata={"help": "Default tree budget stored in the head."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "New head only: draft from the N most frequent answer tokens of the training data "
                          "(reduced LM head and loss); the full vocabulary by default."},
    )
    last_context_input: bool = field(
        default=False,
        metadata={"help": "New head only: add the last context position's fused features to every block slot."},
    )
    cache_features: bool = field(
        default=False,
        metadata={"help": "Keep each row's target features in memory after its first target forward, so later "
                          "epochs cost only the head (bf16, about (k + 1) * hidden * 2 bytes per token)."},
    )
    feature_store: str | None = field(
        default=None,
        metadata={"help": "Folder written by training/feature_store.py: rows it holds read their target features from "
                          "disk and the target never runs for them (any run, any epoch)."},
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={"help": "Stop training after this many minutes of wall time (a checkpoint-free run still saves "
                          "its head); the schedule still follows max_steps."},
    )
    target_dtype: str = field(
        default="float32",
        metadata={"help": "Dtype of the frozen target during training: float32 or bfloat16 (features are cached "
                          "in bfloat16 either way when cache_features is on)."},
    )
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters on the head's linear layers only."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"],
        metadata={"help": "Head linear layers that get LoRA adapters."},
    )
    measure_tau_prompts: int = field(
        default=0,
        metadata={"help": "After training, decode this many held-out prompts with the head and report the "
                          "measured tau (0 skips it)."},
    )
    measure_tau_new_tokens: int = field(default=64, metadata={"help": "max_new_tokens of the tau measurement."})
    card_template: str | None = field(
        default=None, metadata={"help": "Model card template written as README.md; defaults to hub_cards/jetspec-head.md."}
    )

    def __post_init__(self):
        check_loss_kind(self.loss)
        if isinstance(self.data, str):
            self.data = [self.data]
        if not self.data:
            raise ValueError("expected at least one data folder, got none")
        if self.num_blocks_per_sequence < 1:
            raise ValueError(f"expected num_blocks_per_sequence >= 1, got {self.num_blocks_per_sequence}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"expected block_size >= 2 (anchor plus at least one MASK), got {self.block_size}")
        if not 0.0 <= self.reveal_prob < 1.0:
            raise ValueError(f"expected reveal_prob in [0, 1), got {self.reveal_prob}")
        if not 0.0 <= self.answer_anchor_prob <= 1.0:
            raise ValueError(f"expected answer_anchor_prob in [0, 1], got {self.answer_anchor_prob}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"expected eval_fraction in [0, 1), got {self.eval_fraction}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"expected gamma > 0 or None, got {self.gamma}")
        if self.max_train_minutes is not None and not self.max_train_minutes > 0:
            raise ValueError(f"expected max_train_minutes > 0 or None, got {self.max_train_minutes}")
        if self.target_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"expected target_dtype 'float32' or 'bfloat16', got {self.target_dtype!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"expected draft_vocab_size >= 1 or None (full vocabulary), got {self.draft_vocab_size}")
        if self.max_length < 3:
            raise ValueError(f"expected max_length >= 3 (an anchor needs a token before and after it), got "
                             f"{self.max_length}")

    def head_overrides(self) -> dict:
        """Config fields given for a new head (None means the `from_target` default)."""
        names = ("num_hidden_layers", "intermediate_size", "block_attention", "target_layer_ids", "block_size",
                 "tree_depth", "tree_width", "tree_budget", "draft_vocab_size")
        overrides = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.last_context_input:
            overrides["last_context_input"] = True
        if "tree_depth" not in overrides and "block_size" in overrides:
            overrides["tree_depth"] = min(7, overrides["block_size"] - 1)  # keep the default depth servable
        return overrides


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


def sample_key(sample_id) -> int:
    """A stable integer for a row id (same on every process and run), seeding that row's anchors."""
    return zlib.crc32(str(sample_id).encode("utf-8"))


@dataclass
class JetSpecCollator:
    """Right-pads `input_ids`, truncating to `max_length`; keeps `prompt_length` and a per-row seed key.

    Returns a dict of `input_ids` `(B, L)`, `attention_mask` `(B, L)`, `prompt_length` `(B,)`, `sample_key` `(B,)`.
    """

    pad_token_id: int = 0
    max_length: int = 1024

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
        prompt_length = torch.tensor([int(f.get("prompt_length", 0)) for f in features], dtype=torch.long)
        keys = torch.tensor(
            [sample_key(f["id"]) if "id" in f else sample_key(list(f["input_ids"])) for f in features],
            dtype=torch.long,
        )
        return {"input_ids": input_ids, "attention_mask": attention_mask, "prompt_length": prompt_length,
                "sample_key": keys}


@dataclass
class PackedBlocks:
    """Blocks of a batch packed along T: one head forward per batch."""

    input_ids: torch.Tensor  # (B, T) with T = n * bs; anchors, MASKs and revealed tokens
    position_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, 1, T, L + T) bool
    teacher_index: torch.Tensor  # (B, n, D) target position a + k - 1 predicting slot k (clamped in range)
    labels: torch.Tensor  # (B, n, D) x_{a+k}, -100 past the end
    loss_mask: torch.Tensor  # (B, n, D) bool: MASK slot inside the sequence
    valid: torch.Tensor  # (B, n, D) bool: slot inside the sequence (revealed or not)
    last_context_index: torch.Tensor  # (B, T) a - 1: the context position just before each slot's anchor


def draw_anchors(lengths, prompt_lengths, keys, n, seed, answer_prob, generator_offset=0):
    """Anchors per row, drawn with a generator seeded by `(seed, step offset, row key)`: reproducible and the same
    for a row whatever process or batch it lands in.

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


def pack_blocks(input_ids, lengths, anchors, block_size, mask_token_id, causal=True, reveal_prob=0.0,
                generators=None, attention=True) -> PackedBlocks:
    """Build the packed blocks, their positions, their attention mask over `[context ; blocks]` and the targets.

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L)`): the sequences, right padded.
        lengths (`torch.LongTensor` of shape `(B,)`): valid lengths.
        anchors (`torch.LongTensor` of shape `(B, n)`): from [`draw_anchors`].
        block_size (`int`): bs; D = bs - 1 MASK slots per block.
        mask_token_id (`int`): the head's MASK id.
        causal (`bool`, *optional*, defaults to `True`): causal (JetSpec) or bidirectional (DFlash) block.
        reveal_prob (`float`, *optional*, defaults to 0): probability that a slot holds its real token.
        generators (`list[torch.Generator]`, *optional*): per-row generators for the reveal draw.
        attention (`bool`, *optional*, defaults to `True`): build the attention mask; without it (counting slots
            only) `attention_mask` is None.
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

    t = n * block_size
    attention_mask = None
    if attention:
        attention_mask = _block_attention_mask(anchors, lengths, length, block_size, causal)

    depth_pos = positions[..., 1:]  # (B, n, D)
    valid = inside[..., 1:]
    labels = real[..., 1:].masked_fill(~valid, -100)
    return PackedBlocks(
        input_ids=block_ids.view(b, t),
        position_ids=positions.view(b, t),
        attention_mask=attention_mask,
        teacher_index=(depth_pos - 1).clamp_max(length - 1),
        labels=labels,
        loss_mask=valid & ~reveal[..., 1:],
        valid=valid,
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


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def unwrap_head(model):
    """The `JetSpecDraftModel` inside a DDP / PEFT wrapper."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


class JetSpecTrainer(Trainer):
    """`Trainer` that distills `target` into a JetSpec head (`model`). See the module docstring.

    Args:
        target (`PreTrainedModel`): the frozen target; its embeddings and LM head must be attached to the head.
        jetspec_args (`JetSpecArguments`): block, anchor and loss settings.
        All other arguments are `Trainer`'s; `data_collator` defaults to [`JetSpecCollator`] and `compute_metrics`
        to per-depth agreement with the target.
    """

    # `compute_loss` divides by the whole step's `num_items_in_batch` (see `_get_num_items_in_batch`): the Trainer must
    # not divide again by the gradient-accumulation steps
    loss_is_scaled_for_ga = True

    def __init__(self, *args, target: PreTrainedModel, jetspec_args: JetSpecArguments, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if model is None or training_args is None:
            raise ValueError("expected `model` (the head) and `args` (TrainingArguments), got None")
        if training_args.remove_unused_columns:
            raise ValueError(
                "expected TrainingArguments.remove_unused_columns=False (the collator needs `prompt_length` and "
                "`id`, which the head's forward does not take), got True"
            )
        head = unwrap_head(model)
        head.check_target(target)
        self.head_config = head.config
        self.jetspec_args = jetspec_args
        self.block_size = jetspec_args.block_size or head.config.block_size
        if self.block_size > head.config.block_size:
            raise ValueError(
                f"expected block_size <= {head.config.block_size} (the head's block_size, which sets its maximum "
                f"depth), got {self.block_size}"
            )
        for name in ("train_dataset", "eval_dataset"):
            dataset = kwargs.get(name)
            if dataset is not None and len(dataset) == 0:
                raise ValueError(f"expected a non-empty {name}, got an empty dataset")
        if kwargs.get("data_collator") is None:
            pad = getattr(kwargs.get("processing_class"), "pad_token_id", None)
            kwargs["data_collator"] = JetSpecCollator(pad_token_id=pad or 0, max_length=jetspec_args.max_length)
        if kwargs.get("compute_metrics") is None:
            kwargs["compute_metrics"] = self._agreement_metrics
        super().__init__(*args, **kwargs)
        if jetspec_args.max_train_minutes is not None:
            self.add_callback(TimeBudgetCallback(jetspec_args.max_train_minutes))
        self.target = freeze(target).to(self.args.device)
        self._feature_cache = {} if jetspec_args.cache_features else None  # sample_key -> (features, final)
        self._feature_store = None
        if jetspec_args.feature_store is not None:
            from .feature_store import FeatureStore

            self._feature_store = FeatureStore(jetspec_args.feature_store)
            self._feature_store.check(head.config.target_layer_ids, head.config.target_hidden_size)
        self._draft_table = None  # (target id -> draft id table, the d2t it was built from)
        self._tokens_seen = 0
        self._last_log = (time.perf_counter(), 0)

    # ------------------------------------------------------------------------------------------------ one batch
    def _target_states(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen target's selected-layer features `(B, L, k*H)` and final (post-norm) hidden states `(B, L, H)`.

        Rows held by the `feature_store` come from disk. Otherwise, with `cache_features`, rows seen before come from
        memory (bf16) and the target runs only on a batch that holds an unseen row; the head needs nothing else from
        the target, so later epochs skip it entirely.
        """
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]  # (B, L)
        keys = inputs["sample_key"].tolist()
        cache, store = self._feature_cache, self._feature_store
        rows = None
        if store is not None:
            lengths = attention_mask.sum(-1).tolist()
            if all(store.covers(key, length) for key, length in zip(keys, lengths)):
                rows = [store.get(key, length) for key, length in zip(keys, lengths)]
        if rows is None and cache is not None and all(key in cache for key in keys):
            rows = [cache[key] for key in keys]
        if rows is not None:
            width = input_ids.shape[1]
            features = torch.zeros(len(rows), width, rows[0][0].shape[-1], dtype=rows[0][0].dtype)
            final = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=rows[0][1].dtype)
            for i, (f, h) in enumerate(rows):
                features[i, : len(f)], final[i, : len(h)] = f[:width], h[:width]
            return features.to(input_ids.device), final.to(input_ids.device)
        with torch.no_grad():
            out = self.target.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
            )
        features = unwrap_head(self.model).target_features(out.hidden_states)  # (B, L, k*H)
        final = out.last_hidden_state  # (B, L, H), what the target's LM head reads
        if cache is not None:
            for i, (key, length) in enumerate(zip(keys, attention_mask.sum(-1).tolist())):
                cache[key] = (features[i, :length].to("cpu", torch.bfloat16), final[i, :length].to("cpu", torch.bfloat16))
        return features, final

    def _blocks_and_teacher(self, inputs: dict, training: bool):
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]  # (B, L)
        lengths = attention_mask.sum(-1)
        features, final = self._target_states(inputs)
        # training steps draw fresh anchors each step; evaluation always draws the same ones
        offset = self.state.global_step + 1 if training else 0
        anchors, generators = draw_anchors(
            lengths.cpu(), inputs["prompt_length"].cpu(), inputs["sample_key"].cpu(),
            self.jetspec_args.num_blocks_per_sequence, self.args.seed, self.jetspec_args.answer_anchor_prob,
            generator_offset=offset,
        )
        blocks = pack_blocks(
            input_ids, lengths, anchors.to(input_ids.device), self.block_size, self.head_config.mask_token_id,
            causal=self.head_config.block_attention == "causal",
            reveal_prob=self.jetspec_args.reveal_prob if training else 0.0, generators=generators,
        )
        b, n, d = blocks.labels.shape
        teacher_hidden = final.gather(
            1, blocks.teacher_index.reshape(b, n * d, 1).expand(b, n * d, final.shape[-1])
        ).view(b * n, d, -1)  # (B*n, D, H): the target's state predicting each slot's token
        return blocks, teacher_hidden, features, lengths

    def _teacher_logits(self, teacher_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over the head's draft vocabulary, `(N, D, V_draft)` float32.

        With a reduced vocabulary this is the target's softmax restricted to the draft tokens (renormalised by the
        loss's log-softmax): the head is trained to rank exactly the tokens it can draft.
        """
        weight, bias = unwrap_head(self.model)._draft_lm_head()
        return torch.nn.functional.linear(teacher_hidden.to(weight.dtype), weight, bias).float()

    def _head_logits(self, model, blocks: PackedBlocks, features, lengths):
        b, length = features.shape[:2]
        context_valid = torch.arange(length, device=features.device) < lengths.unsqueeze(-1)  # (B, L)
        extra = {"last_context_index": blocks.last_context_index} if self.head_config.last_context_input else {}
        output = model(
            input_ids=blocks.input_ids, position_ids=blocks.position_ids, attention_mask=blocks.attention_mask,
            context_features=features, context_valid=context_valid, **extra,
        )
        n, d = blocks.labels.shape[1:]
        logits = output.logits.view(b, n, d + 1, -1)[:, :, 1:]  # slot 0 is the anchor: (B, n, D, V_draft)
        return logits.reshape(b * n, d, -1), output

    def _draft_labels(self, labels: torch.Tensor, loss_mask: torch.Tensor):
        """Labels as draft-vocabulary ids, and the loss mask without slots whose token the head cannot draft."""
        head = unwrap_head(self.model)
        if head.d2t is None:
            return labels, loss_mask
        key = (id(head.d2t), head.d2t._version, labels.device)  # rebuilt only if the vocabulary changes
        if self._draft_table is None or self._draft_table[1] != key:
            ids = head.draft_token_ids().to(labels.device)
            table = torch.full((head.config.vocab_size,), -100, dtype=torch.long, device=labels.device)
            table[ids] = torch.arange(ids.numel(), device=labels.device)
            self._draft_table = (table, key)
        table, _ = self._draft_table
        mapped = table[labels.clamp_min(0)].masked_fill(labels < 0, -100)
        if self.jetspec_args.loss == "sft":
            loss_mask = loss_mask & (mapped >= 0)
        return mapped, loss_mask

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """The loss weight (depth-weighted counted MASK slots) of every micro-batch of one optimizer step, summed
        over processes when `average_tokens_across_devices`: the Trainer's `num_items_in_batch`.

        The blocks are drawn exactly as [`compute_loss`] will draw them (same step offset, same row keys), so the
        loss of a step is the weighted mean over all its slots however the rows are split into micro-batches.
        """
        offset = self.state.global_step + 1
        total = torch.zeros((), dtype=torch.float32)
        for batch in batch_samples:
            lengths = batch["attention_mask"].sum(-1).cpu()
            anchors, generators = draw_anchors(
                lengths, batch["prompt_length"].cpu(), batch["sample_key"].cpu(),
                self.jetspec_args.num_blocks_per_sequence, self.args.seed, self.jetspec_args.answer_anchor_prob,
                generator_offset=offset,
            )
            blocks = pack_blocks(
                batch["input_ids"].cpu(), lengths, anchors, self.block_size, self.head_config.mask_token_id,
                causal=self.head_config.block_attention == "causal", reveal_prob=self.jetspec_args.reveal_prob,
                generators=generators, attention=False,
            )
            b, n, d = blocks.labels.shape
            _, loss_mask = self._draft_labels(blocks.labels.view(b * n, d), blocks.loss_mask.view(b * n, d))
            total += (depth_weights(d, self.jetspec_args.gamma) * loss_mask.float()).sum()
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            total = self.accelerator.gather(total.to(device)[None]).sum()
        return total.to(device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Distillation loss of one batch: the weighted sum over its counted MASK slots divided by the weight of the
        whole optimizer step (`num_items_in_batch`: all micro-batches of gradient accumulation, all processes).

        With the step's weight summed over processes, each process's loss is scaled by the process count, so the
        gradient average of DDP equals the single-process gradient of the concatenated batch (the Trainer's
        convention for token-level losses). Evaluation (no `num_items_in_batch`) averages over the batch's slots.
        """
        training = model.training
        blocks, teacher_hidden, features, lengths = self._blocks_and_teacher(inputs, training)
        teacher = self._teacher_logits(teacher_hidden)  # (B*n, D, V_draft)
        logits, output = self._head_logits(model, blocks, features, lengths)
        b, n, d = blocks.labels.shape
        labels, loss_mask = self._draft_labels(blocks.labels.view(b * n, d), blocks.loss_mask.view(b * n, d))
        total, weight = block_loss_terms(
            logits, teacher, labels, loss_mask, self.jetspec_args.loss, self.jetspec_args.gamma,
        )
        if num_items_in_batch is not None:
            weight = num_items_in_batch.to(total.device).float()
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                weight = weight / self.accelerator.num_processes
        loss = total / weight if weight > 0 else total * 0.0
        if training:
            self._tokens_seen += int(lengths.sum())
        if return_outputs:
            return loss, (output, blocks, teacher_hidden, logits)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: add target tokens/s since the previous one (all processes)
            now, seen = time.perf_counter(), self._tokens_seen
            elapsed = now - self._last_log[0]
            if elapsed > 0:
                logs["tokens_per_second"] = round(
                    (seen - self._last_log[1]) * self.accelerator.num_processes / elapsed, 2
                )
            self._last_log = (now, seen)
        super().log(logs, start_time)

    # --------------------------------------------------------------------------------------------------- eval
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Loss, and per row the top-1 agreement counts `(B, 2, D)` ([matches, slots] per depth) of head and target.

        The dummy labels `(B, 1)` only make `evaluation_loop` call `compute_metrics`.
        """
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, (_, blocks, teacher_hidden, logits) = self.compute_loss(model, inputs, return_outputs=True)
            if prediction_loss_only:
                return loss.detach(), None, None
            head = unwrap_head(self.model)
            _, lm_head = head._io()
            # agreement with the target's argmax over the full vocabulary: a token outside the draft vocabulary
            # counts as a miss, as it does when decoding
            target_top = lm_head(teacher_hidden.to(lm_head.weight.dtype)).argmax(-1)  # (B*n, D)
            draft_top = head.draft_to_target(logits.argmax(-1))  # (B*n, D)
        b, n, d = blocks.labels.shape
        agree = (draft_top == target_top).view(b, n, d) & blocks.loss_mask  # (B, n, D)
        counts = torch.stack([agree.sum(1), blocks.loss_mask.sum(1)], dim=1).float()  # (B, 2, D)
        return loss.detach(), counts, torch.zeros(b, 1, device=counts.device)

    @staticmethod
    def _agreement_metrics(prediction: EvalPrediction) -> dict[str, float]:
        counts = np.asarray(prediction.predictions).reshape(-1, 2, np.asarray(prediction.predictions).shape[-1])
        matches, slots = counts[:, 0].sum(0), counts[:, 1].sum(0)  # (D,)
        acceptance = [float(m / s) if s > 0 else 0.0 for m, s in zip(matches, slots)]
        metrics = {f"acc_depth_{k + 1}": a for k, a in enumerate(acceptance)}
        metrics["tau_chain"] = chain_accept_length(acceptance)
        return metrics


def split_train_eval(dataset, eval_fraction: float, seed: int):
    """`(train, eval)`: the rows whose seeded id hash falls below `eval_fraction` are held out (at least one; None if
    0). A row's side depends only on its id and the seed, so data regenerated later never moves a held-out row into
    training (a random split of the grown dataset would)."""
    if len(dataset) == 0:
        raise ValueError("expected a non-empty training dataset, got an empty dataset")
    if eval_fraction == 0:
        return dataset, None
    names = dataset["id"] if "id" in dataset.column_names else [str(ids) for ids in dataset["input_ids"]]
    draws = [zlib.crc32(f"{seed}:{name}".encode("utf-8")) / 2**32 for name in names]
    held = [i for i, u in enumerate(draws) if u < eval_fraction] or [int(np.argmin(draws))]
    if len(held) >= len(dataset):
        raise ValueError(
            f"expected more than {len(held)} rows so that eval_fraction={eval_fraction} leaves training rows, "
            f"got {len(dataset)}"
        )
    held_set = set(held)
    return dataset.select([i for i in range(len(dataset)) if i not in held_set]), dataset.select(held)
