"""The attention function of the verify forward: [`verify_attention_of`] picks it once per call.

- sdpa targets with grouped key/value heads: [`sdpa_grouped`] (`grouped_attention.py`), the cache read in place.
- flex_attention targets on CPU: [`flex_attention_uncompiled`], below.
- every other target: its own implementation.

A flex_attention target's verify forward on CPU runs the flex op as itself, not through `torch.compile`.

transformers runs `flex_attention` compiled (`compile_friendly_flex_attention`); on CPU, inductor turns it into a
C++ template. With torch 2.13 that template computes wrong attention for some query/key shapes, measured on an
AVX2-only AMD host against `scaled_dot_product_attention` under the same boolean mask (one thread, 4 heads of 16,
six random inputs per shape): 3 queries after 5 cached keys gave NaN every time; a causal 40-token prefill was off
by up to 2.4 in 4 of 6 inputs; 13 tree queries after 27 cached keys were off by up to 1.1, mostly in the first
eight query rows, with the same inputs giving different outputs from call to call. One query after 27 or 100 keys
(plain decoding's step) was right to float32 rounding every time. On the CI host the tree test decoded wrong tokens
(ids 0 with NaN logits, then a token plain greedy does not take) while plain greedy repeated itself and agreed with
sdpa.

So on CPU the verify forward of a flex_attention target (root + every tree node, one query each) runs
[`flex_attention_uncompiled`], registered in transformers' `AttentionInterface` as [`FLEX_UNCOMPILED`]: the same
`torch.nn.attention.flex_attention.flex_attention` call on the same query, keys, values and `BlockMask`, run by
torch's own unfused implementation (the scores materialized, softmax, weighted sum), which agrees with sdpa to
float32 rounding. The prefill and plain `generate` keep transformers' compiled kernel, so the tree loop reads the
cache plain `generate` writes. Other devices (CUDA's Triton kernel) keep the compiled op.
"""

import contextlib
import warnings

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compat import decoder_attention_implementation, set_attention_implementation
from .grouped_attention import GROUPED_SDPA, uses_grouped_attention

__all__ = [
    "FLEX_UNCOMPILED",
    "attention_function",
    "flex_attention_uncompiled",
    "runs_flex_uncompiled",
    "verify_attention_of",
]

FLEX_UNCOMPILED = "jetspec_flex_uncompiled"
_UNFUSED_WARNING = ".*flex_attention called without torch.compile.*"


def flex_attention_uncompiled(
    module, query, key, value, attention_mask, scaling=None, softcap=None, position_bias=None, **kwargs
):
    """transformers' flex_attention function with the flex op run uncompiled.

    `query` `(B, h, L, D)`, `key` / `value` `(B, h_kv, S, D)`, `attention_mask` a `BlockMask` of shape
    `(B, 1, L, S)`; a soft cap and a position bias become the op's `score_mod`, as in transformers. Returns
    `(B, L, h, D)` and no weights. A float mask, attention sinks (`s_aux`) or dropout go to transformers' function
    unchanged.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask) or kwargs.get("s_aux") is not None or kwargs.get("dropout", 0.0):
        return ALL_ATTENTION_FUNCTIONS["flex_attention"](
            module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, position_bias=position_bias,
            **kwargs,
        )  # fmt: skip

    def score_mod(score, batch, head, q, kv):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if position_bias is not None:
            score = score + position_bias[batch, head, q, kv]
        return score

    plain = softcap is None and position_bias is None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNFUSED_WARNING)  # unfused on purpose
        out = flex_attention(
            query,
            key,
            value,
            score_mod=None if plain else score_mod,
            block_mask=attention_mask,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_UNCOMPILED, flex_attention_uncompiled)


def runs_flex_uncompiled(target) -> bool:
    """Whether the verify forward of `target` runs [`flex_attention_uncompiled`]: its decoder attention is
    flex_attention and it sits on the CPU."""
    return decoder_attention_implementation(target) == "flex_attention" and target.device.type == "cpu"


def verify_attention_of(target) -> str | None:
    """The name of the attention function `target`'s layers run in a verify forward: [`GROUPED_SDPA`],
    [`FLEX_UNCOMPILED`], or `None` (the target's own)."""
    if uses_grouped_attention(target):
        return GROUPED_SDPA
    if runs_flex_uncompiled(target):
        return FLEX_UNCOMPILED
    return None


@contextlib.contextmanager
def attention_function(target, implementation: str | None):
    """Inside the block the target's attention layers run `implementation` (a name in `AttentionInterface`; `None`:
    leave them as they are); the implementation they ran before is restored on leaving."""
    if implementation is None:
        yield
        return
    before = set_attention_implementation(target, implementation)
    try:
        yield
    finally:
        set_attention_implementation(target, before)
