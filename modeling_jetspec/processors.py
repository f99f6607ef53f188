"""The call's logits processors as they act on one row of the tree loop (`docs/design.md`, "§2 The round").

Rows advance by different amounts per round, so the walk of [`steps.accept`] processes each node's scores on its
own row, with exactly the committed tokens plus the node's path before it: [`check_processors`] refuses what cannot
run that way, [`processors_per_row`] adapts the rest to one row, and [`choose_token`] is the target's token after a
path as plain `generate` would pick it (what `Call.choose` calls).
"""

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .compat import ROW_WISE_PROCESSORS, repetition_penalty_for_row
from .state import Call


def choose_token(row_processors: list, do_sample: bool, call: Call, row: int, logits: torch.Tensor, path: list):
    """The target's token after row `row`'s committed tokens plus `path`, as plain `generate` would pick it.

    Returns:
        `(token, scores)`: the token and the processed scores it was picked from, `(V,)`.
    """
    ids = call.sequences[row : row + 1, : call.lengths[row]]
    if path:
        ids = torch.cat([ids, torch.tensor([path], dtype=torch.long, device=ids.device)], dim=1)  # (1, L + len)
    # (1, V) in fp32, as plain decoding hands processors; a copy: processors may write in place
    scores = row_processors[row](ids, logits[None].to(dtype=torch.float32, copy=True))
    return int(pick_token(scores, do_sample)[0]), scores[0]


def check_processors(processors, batch: int):
    """Raise a `ValueError` naming every logits processor of the call that the tree loop cannot run exactly.

    The tree loop processes each node's scores on its own row, once per committed token, rows at different lengths.
    Honoured, each exactly as in plain decoding:

    - `compat.ROW_WISE_PROCESSORS` (temperature, top-k/p/h, min-p, typical, epsilon, eta, min length / new tokens,
      no-repeat n-gram, bad words, sequence bias, suppress tokens, forced BOS/EOS, inf/nan removal, exponential
      decay, renormalization): a row's scores depend on that row alone and on nothing kept between calls;
    - `RepetitionPenaltyLogitsProcessor`, given the row's own left-padding length;
    - `PrefixConstrainedLogitsProcessor` (`prefix_allowed_tokens_fn`), told the row's batch index;
    - `UnbatchedClassifierFreeGuidanceLogitsProcessor` (`guidance_scale`) at batch size 1: it keeps a cache of the
      unconditional branch and advances it on every call, which the walk does once per committed token, in order;
      at batch size > 1 plain decoding advances that cache for every row at once, which rows at different lengths
      cannot.

    Anything else (a user's processor, watermarking, subclasses of the above) may keep state across calls or mix
    rows, and is refused. Processors are matched by exact type.
    """
    refused = sorted(
        {
            type(p).__name__
            for p in processors
            if type(p) not in (*ROW_WISE_PROCESSORS, RepetitionPenaltyLogitsProcessor, PrefixConstrainedLogitsProcessor)
            and not (type(p) is UnbatchedClassifierFreeGuidanceLogitsProcessor and batch == 1)
        }
    )
    if refused:
        raise ValueError(
            f"expected logits processors the tree loop runs exactly (those transformers builds from generation "
            f"settings; guidance_scale at batch size 1 only), got {', '.join(refused)} at batch size {batch}: it may "
            "keep state across calls or mix rows, and the tree loop processes each row alone, once per node"
        )


def processors_per_row(processors, batch: int) -> list:
    """Per batch row, the call's logits processors as they act on that row alone: `(1, L)` tokens, `(1, V)` scores.

    Rows advance by different amounts per round, so each node is processed on its own row. Only processors
    [`check_processors`] admits: a row-wise processor runs on the row as it is (cost V per node); a repetition
    penalty that skips each row's left padding gets that row's padding length; `prefix_allowed_tokens_fn` sees the
    row repeated to the caller's batch size, its layout in plain decoding, and row `row` is read back (cost B x V per
    node); guidance (batch size 1) runs as it is.
    """
    return [LogitsProcessorList([_for_row(p, row, batch) for p in processors]) for row in range(batch)]


def _for_row(processor, row: int, batch: int):
    if type(processor) is RepetitionPenaltyLogitsProcessor:
        return repetition_penalty_for_row(processor, row) or processor
    if type(processor) is PrefixConstrainedLogitsProcessor:
        return _InBatchLayout(processor, row, batch)
    return processor


class _InBatchLayout(LogitsProcessor):
    """A processor called on one row `(1, L)` / `(1, V)` repeated to the batch size; row `row` of its output."""

    def __init__(self, processor, row: int, batch: int):
        self.processor, self.row, self.batch = processor, row, batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = self.processor(input_ids.expand(self.batch, -1), scores.repeat(self.batch, 1))  # (B, V)
        return out[self.row : self.row + 1]


def pick_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """`(B,)` tokens from processed scores `(B, V)`: a sample of their softmax, or their argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
    return scores.argmax(-1)
