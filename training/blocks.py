"""How a training row becomes the head's input: anchors drawn, blocks packed, and a batch collated (arXiv 2606.18394,
section 3.3; see `docs/design.md`, §5 Training).

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
"""

from dataclasses import dataclass, field

import torch

from .rows import row_key


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
