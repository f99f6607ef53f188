"""Tensors that grow by columns every round, written in place (`docs/design.md`, "§2 The round").

A round appends the accepted nodes' columns to the round state's validity and positions and to the head's context
(keys and values per head layer, validity, positions). Concatenating copies the whole history every round, so a
round would cost more as the answer grows. [`Columns`] holds the buffers these tensors live in instead: a tensor of
S columns is a view of the first S columns of its buffer, and an append writes the new columns after them; a full
buffer doubles (at least `MIN_COLUMNS` more), as `state.Call` grows its sequences, so the copies cost O(1) per
column on average.

Only the newest view may append or borrow the room after it: `used` is the width of the newest view, and a view of
fewer columns (an earlier round's state, kept by a caller) cannot write there, so no view ever sees its columns
change. Everything else (selecting rows, packing columns in `reclaim.py`) builds new tensors as before.

[`Columns`] also keeps masks derived from its columns (`masks`, see `kept_masks.py`): they depend only on columns
that never change once written, so a round extends them by its new columns instead of rebuilding them.
"""

import torch

MIN_COLUMNS = 64  # a buffer grows by at least this many columns


class Columns:
    """Buffers of tensors that share a column axis (the rows' entries by position), grown in place.

    Args:
        buffers (`list` of `torch.Tensor`): each holds `capacity` columns along its axis `dims[i]`; the first `used`
            are the newest views'.
        dims (`list[int]`): the column axis of each buffer.
        used (`int`): the columns of the newest views.
    """

    def __init__(self, buffers: list, dims: list, used: int):
        self.buffers, self.dims, self.used = buffers, dims, used
        self.masks = {}  # name -> a mask built over these columns (`kept_masks.py`)

    @classmethod
    def start(cls, tensors: list) -> tuple["Columns", list]:
        """Columns holding `tensors` (`(B, ..., S, ...)`, the column axis second for 2-D tensors, else third), with
        no room yet (the first append doubles them). Returns the columns and the tensors, as views of them."""
        dims = [1 if t.dim() == 2 else 2 for t in tensors]
        width = tensors[0].shape[dims[0]]
        return cls(list(tensors), dims, width), list(tensors)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[self.dims[0]]

    def views(self, width: int) -> list:
        """The first `width` columns of every buffer."""
        return [b.narrow(d, 0, width) for b, d in zip(self.buffers, self.dims)]

    def owns(self, width: int) -> bool:
        """Whether views of `width` columns are the newest (they may write after their columns), outside autograd
        (a write in place would enter the graph)."""
        return width == self.used and not torch.is_grad_enabled()

    def append(self, width: int, new: list) -> tuple["Columns", list]:
        """Views of `width` columns (the newest) followed by `new` (one tensor per buffer, `s` columns each).

        Returns `(columns, views)`: these columns, grown in place where they have room, else new buffers of
        doubled capacity (this object is then left to the older views). Views of fewer columns than the newest are
        copied into new columns."""
        s = new[0].shape[self.dims[0]]
        if not self.owns(width):
            return self._grown(width, new, {})
        if width + s > self.capacity:
            # the masks read only the columns kept (below `width`), which are unchanged
            return self._grown(width, new, self.masks)
        for buffer, d, part in zip(self.buffers, self.dims, new):
            buffer.narrow(d, width, s).copy_(part)
        self.used = width + s
        return self, self.views(self.used)

    def _grown(self, width: int, new: list, masks: dict) -> tuple["Columns", list]:
        s = new[0].shape[self.dims[0]]
        capacity = max(width + s, 2 * width, width + MIN_COLUMNS)
        buffers = []
        for buffer, d, part in zip(self.buffers, self.dims, new):
            shape = list(buffer.shape)
            shape[d] = capacity
            grown = buffer.new_empty(shape)
            grown.narrow(d, 0, width).copy_(buffer.narrow(d, 0, width))
            grown.narrow(d, width, s).copy_(part)
            buffers.append(grown)
        columns = Columns(buffers, self.dims, width + s)
        columns.masks = masks
        return columns, columns.views(width + s)

    def scratch(self, index: int, width: int, new: torch.Tensor) -> torch.Tensor | None:
        """Buffer `index`'s first `width` columns followed by `new`, written in the room after them (which the next
        append overwrites), as one view; `None` when the views are not the newest or there is no room (the caller
        concatenates)."""
        d, s = self.dims[index], new.shape[self.dims[index]]
        if not self.owns(width) or width + s > self.capacity:
            return None
        buffer = self.buffers[index]
        buffer.narrow(d, width, s).copy_(new)
        return buffer.narrow(d, 0, width + s)

    def rows(self, index: torch.Tensor, width: int) -> tuple["Columns", list]:
        """The rows `index` `(A',)` of views of `width` columns, as new columns of the same capacity (a copy of
        each buffer; derived masks are dropped)."""
        columns = Columns([b[index] for b in self.buffers], self.dims, width)
        return columns, columns.views(width)
