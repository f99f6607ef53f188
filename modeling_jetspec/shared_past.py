"""Forward rows that share their attention past (`docs/design.md`, "§7 Targets and checkpoint formats").

A hybrid target's tree round runs each root-to-leaf path as a batch row of its own (`hybrid_tree.py`), because a
recurrent state holds one path; its fold and the chain's replays run a few rows of the batch again. Every such row
reads the same past keys/values as its batch row: copied per row, the past would cost leaves x history, and the
forward would split into more chunks as the answer grows. Here the past stays where it is, once per source row:

- [`SharedPastLayer`] stands for an attention layer in the forward's cache. Its past is the source rows' keys/values
  `(A', H, S, D)`; it lays the forward rows' new keys out per source row, `slots x L` columns after the past (forward
  row r in slot `slot[r]` of row `source[r]`), and returns `[past ; laid-out keys]` `(A', H, S + slots x L, D)` to
  the attention without keeping it (one layer's copy at a time, never one per forward row);
- [`SharedRows`] is the layer type's `attention_mask` in that forward: it lays the queries out the same way, and its
  `mask` `(A', 1, slots x L, S + slots x L)` lets each slot's queries see what the row's own mask allows (the past
  as the verify mask says, causally within the slot) and no other slot's keys;
- [`shared_rows_attention`] is registered as an attention implementation of transformers (`AttentionInterface`): it
  runs the target's own implementation (sdpa or eager) on the laid-out queries, keys and mask, and hands each forward
  row its outputs back. [`rows_attention`] makes the target's attention layers run it for one forward.

Lossless: each query sees exactly the keys its row would see with a copied past, and masked keys weigh exactly 0.
Whatever the target does between its cache and its attention function is done on the laid-out tensors as on any
batch (multi-head latent attention expands the cached latents into keys and values there).
"""

import contextlib
from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compat import DynamicLayer, eager_attention_of, set_attention_implementation
from .grouped_attention import sdpa_grouped

# the attention implementation's name, per copy of this module (a head loaded as remote code brings its own copy,
# whose `SharedRows` its function must be handed)
SHARED_ROWS_ATTENTION = f"jetspec_shared_rows:{__name__}"


@dataclass
class SharedRows:
    """How the R rows of a forward read the past of A' source rows (see the module).

    `source` and `slot` are `(R,)` long tensors; `mask` is the additive mask of one layer type, `(A', 1, slots x L,
    S + slots x L)`; `implementation` is the target's own attention implementation ("sdpa" or "eager")."""

    source: torch.Tensor  # (R,) long, the source row (index into the past's rows) of every forward row
    slot: torch.Tensor  # (R,) long, its slot among the source row's forward rows
    sources: int  # A'
    slots: int  # the most forward rows of one source row
    length: int  # L, tokens per forward row
    implementation: str = "sdpa"
    mask: torch.Tensor | None = None  # (A', 1, slots x L, S + slots x L), one layer type's

    @classmethod
    def of(cls, source: list, sources: int, length: int, device, implementation: str = "sdpa") -> "SharedRows":
        """The layout of forward rows whose source rows are `source` (`(R,)` ints in `[0, sources)`): each takes the
        next free slot of its source row."""
        slots, taken = [], {}
        for row in source:
            slots.append(taken.get(row, 0))
            taken[row] = slots[-1] + 1
        source, slots = (torch.tensor(x, dtype=torch.long, device=device) for x in (source, slots))
        return cls(source, slots, sources, max(taken.values()), length, implementation)

    def lay_out(self, x: torch.Tensor) -> torch.Tensor:
        """`(R, H, L, D)` per forward row -> `(A', H, slots x L, D)` per source row (zeros in empty slots)."""
        r, h, length, d = x.shape
        out = x.new_zeros(self.sources, h, self.slots, length, d)
        out[self.source, :, self.slot] = x
        return out.view(self.sources, h, self.slots * length, d)

    def rows_of(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output `(A', slots x L, h, D)` per source row -> `(R, L, h, D)` per forward row."""
        return out.reshape(self.sources, self.slots, self.length, *out.shape[2:])[self.source, self.slot]

    def with_mask(self, mask: torch.Tensor) -> "SharedRows":
        """This layout with the mask of one layer type: `mask` `(A', 1, L, S + L)`, what each source row's forward
        rows see (the past as the verify mask allows, then each other within a row), laid out over the slots."""
        a, _, length, total = mask.shape
        past, own = mask[..., : total - length], mask[..., total - length :]
        past = past[:, :, None].expand(a, 1, self.slots, length, past.shape[-1])  # (A', 1, slots, L, S)
        eye = torch.eye(self.slots, dtype=torch.bool, device=mask.device)[None, None, :, None, :, None]
        low = torch.finfo(mask.dtype).min
        within = torch.where(eye, own[:, :, None, :, None, :], low)  # (A', 1, slots, L, slots, L): own slot only
        n = self.slots * length
        return replace(self, mask=torch.cat([past.reshape(a, 1, n, -1), within.reshape(a, 1, n, n)], dim=-1))


class SharedPastLayer(DynamicLayer):
    """An attention layer of a forward's cache whose rows share the past `keys` / `values` `(A', H, S, D)` of their
    source rows (laid out by `rows`). After the forward, `new` holds the forward rows' keys and values laid out per
    source row, `(A', H, slots x L, D)` each."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: SharedRows):
        super().__init__()
        self.past, self.rows, self.new = (keys, values), rows, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """`[past ; laid-out new entries]` of the source rows, each `(A', H, S + slots x L, D)`; only the new entries
        are kept."""
        self.new = (self.rows.lay_out(key_states), self.rows.lay_out(value_states))
        return tuple(torch.cat([past, new], dim=2) for past, new in zip(self.past, self.new))

    def get_seq_length(self) -> int:
        return self.past[0].shape[-2]

    def entries(self, source: torch.Tensor, slot: torch.Tensor, offset: torch.Tensor) -> tuple:
        """The new keys and values of forward rows' tokens: row `(source, slot)` at `offset`, each index `(N,)`;
        returns `(N, H, D)` each."""
        column = slot * self.rows.length + offset
        return tuple(new[source, :, column] for new in self.new)


def shared_rows_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention of forward rows sharing their past (see the module): `query` `(R, h, L, D)`, `key` / `value`
    `(A', H_kv, S + slots x L, D)` from [`SharedPastLayer`], `attention_mask` a [`SharedRows`]; returns the
    attention output `(R, L, h, D)` of the target's own implementation and no weights."""
    rows = attention_mask
    if not isinstance(rows, SharedRows):
        raise ValueError(
            f"expected the {SHARED_ROWS_ATTENTION} attention to be handed a SharedRows mask, got {type(rows).__name__}"
        )
    if rows.implementation == "eager":
        attention = eager_attention_of(module)
    elif rows.implementation == "sdpa":
        attention = sdpa_grouped  # grouped keys/values read in place, not copied (`grouped_attention.py`)
    else:
        attention = ALL_ATTENTION_FUNCTIONS[rows.implementation]
    out, _ = attention(module, rows.lay_out(query), key, value, rows.mask, **kwargs)
    return rows.rows_of(out), None


AttentionInterface.register(SHARED_ROWS_ATTENTION, shared_rows_attention)


@contextlib.contextmanager
def rows_attention(target):
    """The target's attention layers run [`shared_rows_attention`] inside the block."""
    before = set_attention_implementation(target, SHARED_ROWS_ATTENTION)
    try:
        yield
    finally:
        set_attention_implementation(target, before)
