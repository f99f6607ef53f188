"""The verify forward's attention reads grouped keys/values in place (issue 41, "a round flat in the history").

transformers' sdpa function (5.23) asks `torch.nn.functional.scaled_dot_product_attention` to broadcast grouped
key/value heads (`enable_gqa=True`) only when no attention mask is passed (on CPU and CUDA); with a mask it copies
every key/value head `num_key_value_groups` times (`repeat_kv`) before attending. A verify forward always passes a
mask (the tree-causal one), so each round copied the whole key/value cache of every layer: on SmolLM2-135M (9 query
heads over 3 key/value heads, float32, AVX2) the round's growth from 256 to 4,096 tokens of history fell from +203 to
+123 ms with the copy gone (`scripts/long_rounds.py`, `docs/results.md`, "A round against the history").

The verifier makes the target's attention layers run [`sdpa_grouped`] during the verify forward only
(registered in transformers' `AttentionInterface` as [`GROUPED_SDPA`]): the same `scaled_dot_product_attention`
call on the same query, keys, values and mask, with `enable_gqa=True` instead of the copy. Every case it does not
cover (no mask, no grouping, a position bias, a soft cap, a paged cache, attention sinks) goes to transformers' own
sdpa function unchanged. Targets running another implementation (eager, flex attention, flash attention) are not
touched.

Exactness: the kernel computes the same dot products and softmax over the same entries; where the kernel blocks the
work differently the float32 logits differ by rounding only, as a verify forward already differs from a one-row
decoding step. The output equals plain `generate` token for token, as `tests/test_grouped_attention.py` checks over
the test architectures, batch sizes and tree shapes.
"""

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compat import decoder_attention_implementation, key_value_groups

__all__ = ["GROUPED_SDPA", "sdpa_grouped", "uses_grouped_attention"]

GROUPED_SDPA = "jetspec_sdpa_grouped"
# keyword arguments of transformers' sdpa function that change what it computes beyond the plain masked call
_DELEGATED = ("position_bias", "softcap", "cache", "s_aux", "sinks")


def sdpa_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention with grouped key/value heads broadcast by the kernel (`enable_gqa`), not copied.

    `query` `(B, h, L, D)`, `key` / `value` `(B, h_kv, S, D)`, `attention_mask` an additive or boolean mask
    broadcastable to `(B, h, L, S)`; returns `(B, L, h, D)` and no weights, as transformers' sdpa function does.
    """
    groups = key_value_groups(module)
    if groups == 1 or attention_mask is None or any(kwargs.get(name) is not None for name in _DELEGATED):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, sdpa_grouped)


def uses_grouped_attention(target) -> bool:
    """Whether the verify forward of `target` runs [`sdpa_grouped`]: its decoder attention is transformers' sdpa and
    its text config groups query heads over fewer key/value heads."""
    text = target.config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return decoder_attention_implementation(target) == "sdpa" and heads is not None and kv_heads < heads
