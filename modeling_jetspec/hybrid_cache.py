"""A hybrid target's cache, its rows' linear states, and the forwards both hybrid verifiers run (`docs/design.md`,
"§7 Targets and checkpoint formats").

[`HybridCache`] holds key/value layers (every entry kept: sliding windows are applied by the mask) next to
linear-attention layers (a recurrent and/or a convolution state per row, [`LinearState`]). [`HybridForwards`] runs
the target's forwards and counts them: on the round's cache (a chain verify), and on a new cache for some rows (a
tree's leaf paths, a fold, a chain's replays) whose linear states are the rows' own copies and whose attention layers
read the batch's past in place, shared by every forward row of a batch row (`shared_past.py`). It also keeps the
tokens a tree round left outside the rows' linear states (`unfolded`) and folds them in.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from .compat import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    decoder_attention_implementation,
    fill_linear_state,
    kv_layer_entries,
    linear_state,
    linear_state_count,
    set_linear_state,
)
from .shared_past import SharedPastLayer, SharedRows, rows_attention
from .state import RoundState
from .steps import feature_layers, float_dtype, logits_to_keep
from .tree import verify_attention_mask

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # keys/values; windows are applied by the mask
STATE_LAYER_TYPES = ("linear_attention", "conv")  # a recurrent and/or convolution state per row
CACHELESS_LAYER_TYPES = ("moe", "mlp")  # no token mixing, nothing cached (Nemotron-H's MoE layers)


def layer_types(target) -> list:
    """The target's `layer_types` (text config), or `[]` when it has none."""
    return list(getattr(target.config.get_text_config(decoder=True), "layer_types", None) or [])


class HybridCache(DynamicCache):
    """A [`DynamicCache`] of key/value layers (every entry kept: sliding windows are applied by the verify mask) and
    linear-attention layers, whose rows can be selected like the key/value layers'."""

    def __init__(self, types: list):
        super().__init__()
        self.layers = [
            LinearAttentionLayer()
            if t in STATE_LAYER_TYPES
            else DummyLayer()
            if t in CACHELESS_LAYER_TYPES
            else DynamicLayer()
            for t in types
        ]

    def batch_select_indices(self, indices: torch.Tensor):
        """Keep the rows `indices` `(A',)` of every layer, in place (transformers' linear-attention layers lack this
        method; their `reorder_cache` selects rows)."""
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.reorder_cache(indices)  # an index_select of every state over rows
            else:
                layer.batch_select_indices(indices)


@dataclass
class LinearState:
    """One state of one linear-attention layer, for a batch of rows (or rows x nodes)."""

    conv: torch.Tensor | None  # (A, C, K) the last K inputs of the causal convolution
    recurrent: torch.Tensor | None  # (A, ...) the recurrent state

    def map(self, fn) -> "LinearState":
        """`fn` applied to each state tensor that exists."""
        return LinearState(*(fn(t) if t is not None else None for t in (self.conv, self.recurrent)))

    def tensors(self) -> list:
        return [t for t in (self.conv, self.recurrent) if t is not None]


def read_states(cache: DynamicCache, copy: bool = True) -> dict:
    """Every linear-attention state, `{(layer, state index): LinearState}`: copies, or with `copy=False` the cache's
    own tensors."""
    states = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for s in range(linear_state_count(layer)):
                state = LinearState(*linear_state(layer, s))
                states[index, s] = state.map(torch.clone) if copy else state
    return states


def write_states(cache: DynamicCache, states: dict):
    """Make the linear-attention layers of a filled cache hold `states` (rows already matching)."""
    for (index, s), state in states.items():
        set_linear_state(cache.layers[index], s, state.conv, state.recurrent)


def fill_states(cache: DynamicCache, states: dict):
    """Allocate the linear states of a new cache's layers holding `states`, through the layers' own update methods
    (a linear layer's first update is its prefill)."""
    for (index, s), state in states.items():
        fill_linear_state(cache.layers[index], s, state.conv, state.recurrent)


def rows_of_states(states: dict, rows: torch.Tensor) -> dict:
    """The rows `rows` `(R,)` of every state (a row may repeat): copies."""
    return {key: s.map(lambda t: t[rows]) for key, s in states.items()}


class HybridForwards:
    """The forwards a hybrid verifier runs on the target, counted in `target_forwards`, and the committed tokens a
    tree round left outside the rows' linear states (`unfolded`, `{batch row: tokens}`: the tokens after the point a
    row's linear states stand at, before its anchor).

    Args:
        windows (`dict`, *optional*): sliding windows per layer type, from `verifiers.verify_windows`.
    """

    def __init__(self, target, head, windows: dict | None):
        self.target, self.head, self.windows = target, head, windows
        self.types = layer_types(target)
        self.attention = [i for i, t in enumerate(self.types) if t in ATTENTION_LAYER_TYPES]
        self.target_forwards = 0
        self.unfolded = {}
        self.recurrent = None  # whether some layer keeps a recurrent state (known after the prefill)

    def forward(self, cache, tokens, positions, masks, hidden: bool = True, **kwargs):
        """One target forward (counted); over rows that share their past ([`rows_cache`]) when the masks are
        [`SharedRows`]."""
        self.target_forwards += 1
        shared = any(isinstance(m, SharedRows) for m in masks.values())
        with rows_attention(self.target) if shared else nullcontext():
            return self.target(
                input_ids=tokens,
                attention_mask=masks,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=feature_layers(self.head) if hidden else False,
                **kwargs,
            )

    def masks(self, valid, past_positions, seen, positions, causal_past: bool = False, kept: dict | None = None):
        """`{layer type: mask}` (`tree.verify_attention_mask`): the verify mask `(A, 1, T, S + T)` of new tokens at
        `positions` `(A, T)` seeing `seen` `(A, T, T)` of each other, for attention layer types (with their sliding
        windows), None for linear and cacheless ones."""
        return verify_attention_mask(
            valid,
            seen,
            float_dtype(self.target),
            self.windows,
            past_positions,
            positions,
            layer_types=self.types,
            unmasked=STATE_LAYER_TYPES + CACHELESS_LAYER_TYPES,
            causal_past=causal_past,
            kept=kept,
        )

    def rows_cache(self, state: RoundState, rows: list, length: int, states: dict) -> tuple:
        """A new cache for forward rows that continue the active rows `rows` (`(R,)` ints; a row may repeat), `length`
        tokens each: their linear `states` `{(layer, s): LinearState (R, ...)}`, and attention layers that read the
        rows' past (the round's first `state.valid.shape[1]` entries) where it lies ([`SharedPastLayer`]).

        Returns:
            `(cache, layout, used)`: the cache, the forward rows' [`SharedRows`] and the active rows whose past they
            read, `(A',)` (a source row's index in it is its index in the layout).
        """
        used = sorted(set(rows))
        where = {row: k for k, row in enumerate(used)}
        device = state.anchors.device
        implementation = decoder_attention_implementation(self.target)
        layout = SharedRows.of([where[r] for r in rows], len(used), length, device, implementation)
        index = torch.tensor(used, device=device)
        everyone, width = len(used) == state.rows.shape[0], state.valid.shape[1]
        cache = HybridCache(self.types)
        for i in self.attention:
            entries = kv_layer_entries(state.cache.layers[i])
            keys, values = (t[:, :, :width] if everyone else t[index, :, :width] for t in entries)
            cache.layers[i] = SharedPastLayer(keys, values, layout)
        fill_states(cache, states)
        return cache, layout, index

    def shared_masks(self, layout: SharedRows, state: RoundState, used, seen, positions, causal_past: bool) -> dict:
        """The masks of a forward over [`rows_cache`]'s rows: each source row's verify mask (`seen` `(A', L, L)`,
        `positions` `(A', L)`) laid out over its forward rows, one [`SharedRows`] per attention layer type."""
        masks = self.masks(state.valid[used], state.positions[used], seen, positions, causal_past)
        return {t: None if m is None else layout.with_mask(m) for t, m in masks.items()}

    def fold(self, state: RoundState, rows: list, tokens: list, starts: list):
        """Forward 2 of a tree round: active rows `rows` fold `tokens` (one list per row, all of one length,
        committed and already held by the attention layers) into their linear states, from the positions
        `starts`. Their queries see the cache up to their own position and none of their new entries."""
        if not rows:
            return
        device = state.anchors.device
        index = torch.tensor(rows, device=device)
        ids = torch.tensor(tokens, device=device)
        r, v = ids.shape
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(v, device=device)
        seen = torch.zeros(r, v, v, dtype=torch.bool, device=device)
        linear = read_states(state.cache, copy=False)
        cache, layout, used = self.rows_cache(state, rows, v, rows_of_states(linear, index))
        masks = self.shared_masks(layout, state, used, seen, positions, causal_past=True)
        self.forward(cache, ids, positions, masks, hidden=False, **logits_to_keep(self.target, 1))
        put_states(linear, index, cache, conv=True)

    def fold_all(self, state: RoundState):
        """Fold every row's `unfolded` tokens (one forward per distinct count): before a chain round, which starts
        from the states after every committed token but the anchor. Only "auto" leaves any for a chain round."""
        if not self.unfolded:
            return
        rows = state.rows.tolist()
        waiting = {k: self.unfolded[r] for k, r in enumerate(rows) if r in self.unfolded}
        anchor_pos = state.anchor_pos.tolist()
        for v in sorted({len(t) for t in waiting.values()}):
            group = [k for k, t in waiting.items() if len(t) == v]
            self.fold(state, group, [waiting[k] for k in group], [anchor_pos[k] - v for k in group])
        self.unfolded = {}


def put_states(states: dict, rows: torch.Tensor, cache, conv: bool):
    """Write the linear states of `cache` (one per row of `rows` `(R,)`) into rows `rows` of `states`
    `{(layer, s): LinearState (A, ...)}`: the recurrent states, and with `conv` the convolution states."""
    for (index, s), out in states.items():
        new_conv, new_recurrent = linear_state(cache.layers[index], s)
        if out.recurrent is not None:
            out.recurrent[rows] = new_recurrent
        if conv and out.conv is not None:
            out.conv[rows] = new_conv
