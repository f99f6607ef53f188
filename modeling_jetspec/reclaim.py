"""Reclaiming cache columns nothing will read again: the holes of uneven acceptance and, when every layer of the
target slides, the entries that fell out of the window (`docs/design.md`, "§2 The round").

Rows of a batch share one rectangular cache. Each round every row's cache grows by the batch's longest acceptance K;
a row that accepted fewer tokens keeps holes (`RoundState.valid` False), and nothing else removes them. A row's
columns can move: every entry carries its position id (`RoundState.positions`), its keys were rotated when written,
and the verify mask is built from `valid` and `positions`, never from a column's index. So [`reclaim`] packs every
row's live columns to the right, in their order, and cuts the columns no row needs:

- a hole (invalid in that row);
- with a sliding window on every layer (`verify_windows` returns `{None: window}`, Mistral-style), an entry whose
  position is at most `anchor_pos - window`: every later query sits at `anchor_pos` or beyond and cannot see it.

The head's context has its own columns (it attends to every earlier position, window or not); its holes are packed
the same way. A pack gathers the whole cache, so it runs only when it frees at least a quarter of the columns (and
`MIN_RECLAIM` of them): its cost is amortized over the rounds that made the holes, and the cache stays within 4/3 of
its live width (or `MIN_RECLAIM` above it) however long the output and however uneven the acceptance. The decision
reads nothing from the device: the live width is bounded from the rows' committed lengths, which the host keeps
(left padding counts as live there, so a row's padding may stay).

Targets with both sliding and full-attention layers (one cache width for all layers) keep every entry of their
sliding layers: only the holes are reclaimed there; the verify mask hides what lies outside the window.
"""

from dataclasses import replace

import torch

from .compat import kv_layer_entries, set_kv_layer_entries
from .state import RoundState

MIN_RECLAIM = 64  # columns a pack must free at least (below, the gather costs more than the columns it frees)


def live_columns(state: RoundState, window: int | None) -> torch.Tensor:
    """`(A, S)` bool: the target cache entries a later verify can attend to (valid, and inside the window)."""
    live = state.valid
    if window is not None:
        live = live & (state.positions > (state.anchor_pos[:, None] - window))
    return live


def packed_order(live: torch.Tensor, width: int) -> torch.Tensor:
    """Per row, the `width` columns that keep its live entries right-aligned in their order, `(A, width)`; `width`
    is at least any row's live entries, and a row with fewer takes dead columns in front (they stay masked)."""
    order = torch.sort(live.to(torch.int8), dim=1, stable=True).indices  # dead first, then live, each in order
    return order[:, order.shape[1] - width :]


def should_pack(width: int, packed: int) -> bool:
    freed = width - packed
    return freed >= MIN_RECLAIM and 4 * freed >= width


def reclaim(
    state: RoundState, window: int | None = None, live_bound: int | None = None, force: bool = False
) -> RoundState:
    """Packs the target cache (and the head's context) when that frees enough columns; see the module's text.

    Args:
        state (`RoundState`): after [`steps.compact`]; its cache holds `state.valid.shape[1]` entries per layer.
        window (`int`, *optional*): the sliding window of *every* target layer, `None` when some layer attends to
            everything.
        live_bound (`int`, *optional*): at least the valid entries of any row, known on the host (the rounds pass
            the longest row's committed length - 1, left padding included), so that deciding reads nothing back
            from the device; `None`: counted on the device (one read).
        force (`bool`, *optional*): pack whatever it frees (tests).
    """
    width = state.valid.shape[1]
    if not width or not state.rows.numel():
        return state
    bound = int(state.valid.sum(1).max()) if live_bound is None else live_bound
    packed = min(bound, width, window - 1 if window is not None else width)
    if packed < width and (force or should_pack(width, packed)):
        live = live_columns(state, window)
        index = packed_order(live, packed)
        for layer in state.cache.layers:
            entries = kv_layer_entries(layer)
            if entries is None:
                continue
            keys, values = entries
            if keys.shape[-2] != width:
                raise ValueError(f"expected {width} cache entries per layer to pack, got {keys.shape[-2]}")
            set_kv_layer_entries(layer, _gather_columns(keys, index), _gather_columns(values, index))
        # new tensors: the next round grows them into new columns (and builds its verify mask anew)
        state = replace(state, valid=live.gather(1, index), positions=state.positions.gather(1, index), columns=None)
    context = state.context
    if context is not None and context.valid.shape[1]:
        packed = min(bound, context.valid.shape[1])  # the context holds the same positions, window or not
        if packed < context.valid.shape[1] and (force or should_pack(context.valid.shape[1], packed)):
            index = packed_order(context.valid, packed)
            state = replace(
                state,
                context=replace(
                    context,
                    keys=[_gather_columns(k, index) for k in context.keys],
                    values=[_gather_columns(v, index) for v in context.values],
                    valid=context.valid.gather(1, index),
                    positions=None if context.positions is None else context.positions.gather(1, index),
                    columns=None,
                ),
            )
    return state


def _gather_columns(entries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Columns `index` `(A, S')` of `entries` `(A, H, S, D)`: `(A, H, S', D)`, a new contiguous tensor."""
    return entries.gather(2, index[:, None, :, None].expand(-1, entries.shape[1], -1, entries.shape[-1]))
