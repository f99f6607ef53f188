"""The head's building blocks (arXiv 2606.18394, section 3.1): rotary embedding, an attention layer whose keys and
values are the fused target context followed by the block's own slots, the MLP, the decoder layer, and
[`JetSpecContext`], the per-layer context keys/values a decoding call keeps across rounds.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .columns import Columns
from .configuration_jetspec import JetSpecConfig


class JetSpecRotary(nn.Module):
    """Rotary tables for absolute positions, from transformers' rope utilities: the head follows the target's
    `rope_parameters` (default, linear, llama3, yarn, ...; types that depend on the sequence length use their values
    at `max_position_embeddings`). No weights and no buffers: the head's state dict does not change.
    """

    def __init__(self, config: JetSpecConfig):
        super().__init__()
        self.rope_config = config  # what transformers' rope functions read: rope_parameters, head_dim, ...
        self._tables = None  # (inv_freq of shape (D/2,), attention scaling), computed on first use on its device

    def _inverse_frequencies(self, device: torch.device):
        if self._tables is None or self._tables[0].device != device:
            config = self.rope_config
            rope_type = config.rope_parameters.get("rope_type", "default")
            if rope_type == "default":
                dim = config.head_dim
                theta = config.rope_parameters["rope_theta"]
                inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
                self._tables = (inv_freq, 1.0)
            elif rope_type in ROPE_INIT_FUNCTIONS:
                self._tables = ROPE_INIT_FUNCTIONS[rope_type](config, device)
            else:
                raise ValueError(
                    f"expected a rope_type among default, {', '.join(ROPE_INIT_FUNCTIONS)}, got {rope_type!r}"
                )
        return self._tables

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """
        Args:
            position_ids (`torch.LongTensor` of shape `(B, T)`).

        Returns:
            `(cos, sin)`, each of shape `(B, 1, T, head_dim)`.
        """
        inv_freq, scaling = self._inverse_frequencies(position_ids.device)
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, T, D)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class JetSpecAttention(nn.Module):
    """Attention of the block over `[fused context ; block]` keys/values, with Qwen3-style q/k norms."""

    def __init__(self, config: JetSpecConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, config.rms_norm_eps)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys/values of `x` of shape `(B, S, H)`, each returned of shape `(B, H_kv, S, D)`."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, context: "JetSpecContext", layer: int, mask):
        """`x` of shape `(B, T, H)` after head layer `layer`'s keys/values of `context` `(B, H_kv, S, D)`; `mask`
        `(B, 1, T, S + T)`, boolean or additive."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)  # (B, h, T, D)
        k, v = context.joined(layer, *self.key_values(x, cos, sin))  # (B, H_kv, S + T, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class JetSpecMLP(nn.Module):
    def __init__(self, config: JetSpecConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class JetSpecDecoderLayer(nn.Module):
    def __init__(self, config: JetSpecConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = JetSpecAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = JetSpecMLP(config)

    def forward(self, x, cos, sin, context: "JetSpecContext", layer: int, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class JetSpecContext:
    """Per-layer keys/values of the fused target context, grown by the accepted positions of each round.

    Built by `JetSpecDraftModel.extend_context`, the tensors are views of [`Columns`] buffers that each round's
    positions are written into in place (`columns.py`); `columns` is `None` for a context built from tensors of its
    own (the static path's buffers, a packed context), which a round's extension copies.
    """

    keys: list  # num_hidden_layers x (B, H_kv, S, D)
    values: list  # num_hidden_layers x (B, H_kv, S, D)
    valid: torch.Tensor  # (B, S) bool, False for padding and holes
    last: torch.Tensor | None = None  # (B, H) fused features of each row's last valid position
    positions: torch.Tensor | None = None  # (B, S) absolute positions, read by sliding-window layers
    columns: Columns | None = None  # the buffers the tensors above are views of

    @classmethod
    def of_columns(cls, columns: Columns, views: list, last: torch.Tensor | None) -> "JetSpecContext":
        """The context whose tensors are `views` of `columns`: keys, values (one per layer), validity, positions."""
        n = (len(views) - 1) // 2
        positions = views[2 * n + 1] if len(views) > 2 * n + 1 else None
        return cls(views[:n], views[n : 2 * n], views[2 * n], last, positions, columns)

    def tensors(self) -> list:
        """Keys, values, validity and (when kept) positions, in the order of [`of_columns`]."""
        return [*self.keys, *self.values, self.valid] + ([self.positions] if self.positions is not None else [])

    def extended(self, keys: list, values: list, valid: torch.Tensor, positions, last) -> "JetSpecContext":
        """This context followed by `s` new columns (keys/values `(B, H_kv, s, D)` per layer, validity and positions
        `(B, s)`), written in place after it where its buffers have room."""
        new = [*keys, *values, valid] + ([positions] if self.positions is not None else [])
        columns = self.columns if self.columns is not None else Columns.start(self.tensors())[0]
        columns, views = columns.append(self.valid.shape[1], new)
        return JetSpecContext.of_columns(columns, views, last)

    def joined(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        """Head layer `layer`'s context keys/values followed by a block's `keys` / `values` `(B, H_kv, T, D)`, each
        `(B, H_kv, S + T, D)`: written in the room after the context where its buffers have one (the next extension
        overwrites it), else concatenated."""
        if self.columns is not None:
            width = self.valid.shape[1]
            k = self.columns.scratch(layer, width, keys)
            if k is not None:
                return k, self.columns.scratch(len(self.keys) + layer, width, values)
        return torch.cat([self.keys[layer], keys], dim=2), torch.cat([self.values[layer], values], dim=2)

    def select_rows(self, rows: torch.Tensor) -> "JetSpecContext":
        last = None if self.last is None else self.last[rows]
        if self.columns is not None:
            return JetSpecContext.of_columns(*self.columns.rows(rows, self.valid.shape[1]), last)
        return JetSpecContext(
            [k[rows] for k in self.keys],
            [v[rows] for v in self.values],
            self.valid[rows],
            last,
            None if self.positions is None else self.positions[rows],
        )
