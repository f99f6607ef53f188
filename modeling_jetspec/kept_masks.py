"""Masks kept from one round to the next, so that a round's mask costs the same at token 8,000 as at token 200
(`docs/design.md`, "§3 Trees and masks").

Built whole, the mask of T new tokens after S cache entries costs O(T x S) every round. A cache entry's column of it
depends only on whether the entry is valid (and, under a sliding window, on its position), which never changes once
written: an appended column keeps its entry until a pack builds new columns, and with them new masks
(`columns.Columns`, which holds these masks). [`PastMask`] (no window) writes, each round, the columns added since
the last one and the T x T part of the new tokens; [`WindowMask`] also hides, once, the columns that fell out of the
window of every later query, and rewrites the few columns near the window's edge, which depend on the query's
position. Each returns a view of its buffer `(A, 1, T_cap, C)`, rebuilt (C doubled) when it lacks rows or columns.

Every value is made in the mask's own dtype ([`_additive`]): a float64 mask's minimum does not fit the float32 that
`torch.where` of two Python numbers would make.
"""

import torch


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, the minimum of `dtype` elsewhere, in `dtype` (of `allowed`'s shape)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)  # a tensor: the result takes its dtype
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class PastMask:
    """The additive mask `(A, 1, T, S + T)` of T new tokens after S cache entries that every new token sees when
    valid (no sliding window, no causal past), kept across rounds (see the module): each call writes the columns
    added since the last one (for every query row), then the T x T part of the new tokens.

    Args:
        dtype (`torch.dtype`): the floating dtype of the mask (the model's).
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.buffer, self.filled = dtype, None, 0

    def __call__(self, past_valid: torch.Tensor, seen: torch.Tensor, *positions) -> torch.Tensor:
        """The mask of new tokens seeing `seen` `(A, T, T)` of each other after the entries `past_valid` `(A, S)`:
        0 where attention is allowed, the dtype's minimum elsewhere, as `tree.verification_mask` builds it whole
        (`positions`, the past's and the new tokens', are [`WindowMask`]'s)."""
        a, s = past_valid.shape
        t = seen.shape[1]
        buffer = self.buffer
        if buffer is None or buffer.shape[0] != a or buffer.shape[2] < t or buffer.shape[3] < s + t or self.filled > s:
            rows, columns = (0, 0) if buffer is None else buffer.shape[2:]
            rows, columns = max(t, rows), columns if columns >= s + t else max(s + t, 2 * columns)
            self.buffer = buffer = torch.empty(a, 1, rows, columns, dtype=self.dtype, device=past_valid.device)
            self.filled = 0
        if self.filled < s:  # the columns added since the last call, for every query row
            added = past_valid[:, None, self.filled : s].expand(a, buffer.shape[2], -1)
            buffer[:, 0, :, self.filled : s] = _additive(added, self.dtype)
            self.filled = s
        buffer[:, 0, :t, s : s + t] = _additive(seen, self.dtype)
        return buffer[:, :, :t, : s + t]


class WindowMask(PastMask):
    """[`PastMask`] under a sliding window: a new token at position p sees a valid cache entry at position k only if
    `p - k < window` (transformers' rule), and a new token only if it is within the window too.

    The tree loop's columns hold a row's positions in order, but for holes: a hole takes its round's anchor position,
    at most every later valid position. So every column before the first one whose running maximum of positions
    (`top`) exceeds `p - window` is either out of the window or a hole, and every valid column from there on is in
    it: the columns a query does not see are a prefix (by `top`, [`torch.searchsorted`]) plus the holes. Queries sit
    at the anchor's position or after it, and anchors only grow, so the prefix of the root (node 0) is hidden once
    for good in every query row (`hidden`); each call rewrites only the band between it and the deepest query's
    prefix, per query, and restores the previous call's band first.
    """

    def __init__(self, dtype: torch.dtype, window: int):
        super().__init__(dtype)
        self.window = window
        self.top = self.hidden = self.band = None  # (A, C) running maximum, (A,) hidden prefix, the last band
        self.topped = 0  # columns of `top` written

    def __call__(self, past_valid, seen, past_positions, positions):
        """As [`PastMask`], with the positions of the past `(A, S)` and of the new tokens `(A, T)` (root first)."""
        before = self.buffer
        near = positions[:, :, None] - positions[:, None, :] < self.window  # (A, T, T)
        mask = super().__call__(past_valid, seen & near)
        if self.buffer is not before:  # rebuilt: nothing hidden yet
            self.top = torch.full(self.buffer.shape[::3], torch.iinfo(torch.long).max, device=positions.device)
            self.hidden, self.band, self.topped = torch.zeros_like(positions[:, 0]), None, 0
        self._extend_top(past_positions)
        if self.band is not None:  # the previous call's band back to the columns' own values
            start, width = self.band
            self._write(past_valid, start, width, None)
        hidden = torch.searchsorted(self.top, positions[:, :1] - self.window, right=True)[:, 0]  # (A,)
        self._write(past_valid, self.hidden, int((hidden - self.hidden).max()), (hidden - self.hidden)[:, None])
        self.hidden = torch.maximum(self.hidden, hidden)
        ends = torch.searchsorted(self.top, positions - self.window, right=True) - self.hidden[:, None]  # (A, T)
        width = int(ends.max())
        self._write(past_valid, self.hidden, width, ends, rows=positions.shape[1])
        self.band = (self.hidden, width)
        return mask

    def _extend_top(self, past_positions):
        """`top` over the columns added since the last call: the running maximum of the past positions."""
        s = past_positions.shape[1]
        if self.topped < s:
            running = torch.cummax(past_positions[:, self.topped : s], dim=1).values
            if self.topped:
                running = torch.maximum(running, self.top[:, self.topped - 1 : self.topped])
            self.top[:, self.topped : s] = running
            self.topped = s

    def _write(self, past_valid, start, width: int, hide, rows: int | None = None):
        """Columns `start + j` (`start` `(A,)`, j < `width`) of the first `rows` query rows (default: all): the
        dtype's minimum where `j < hide` (`(A, 1)` or `(A, T)`; `None`: nowhere), else the column's own value (0
        when valid, the minimum when not); columns past the cache's are left as they are (past the buffer, every
        one is the last column rewritten with its own value)."""
        if width <= 0:
            return
        s, buffer = past_valid.shape[1], self.buffer[:, 0]  # (A, T_cap, C)
        rows = buffer.shape[1] if rows is None else rows
        j = torch.arange(width, device=start.device)
        columns = start[:, None] + j  # (A, width)
        inside = columns < s
        index = columns.clamp(max=buffer.shape[-1] - 1)[:, None, :].expand(-1, rows, -1)  # (A, rows, width)
        current = buffer[:, :rows].gather(2, index)
        low = torch.finfo(self.dtype).min
        own = _additive(past_valid.gather(1, columns.clamp(max=s - 1)), self.dtype)[:, None, :]
        value = own if hide is None else torch.where(j < hide[..., None], low, own)
        buffer[:, :rows].scatter_(2, index, torch.where(inside[:, None, :], value, current).to(self.dtype))
