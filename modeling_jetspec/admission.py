"""Rows that join a running call and leave it on their own (`docs/design.md`, "§2 The round"; `docs/serve.md`,
"Several clients"): continuous batching of the tree loop.

A call given a [`RowSource`] (`generate(..., jetspec_rows=source)`) asks it between rounds for newcomers
([`RowSource.admit`]). A newcomer is prefilled alone (its own prompt, batch 1, through the call's verifier), its
first token is the prefill's greedy choice, and its target cache entries, head context and round state join the
running batch as one more row, the running rows or the newcomer left-padded with masked columns to the wider of the
two. Every entry carries its position id and the masks are built from validity and positions, never from a column's
index (`reclaim.py` moves columns the same way), so each row attends to exactly what its lone call attends to. The
newcomer's sequence row holds its own prompt without padding, and its own stopping criteria judge it on its own
tokens (`Call.row_stopping`). Each row's committed tokens go to the source after every round
([`RowSource.committed`]), and a row that finishes leaves with its tokens and the statistics of the rounds it took
part in ([`RowSource.left`]), at once, while the others decode on (its answer enters the call's answer cache, if
any, as it leaves).

Lossless: a row's tokens are the target's greedy choices after exactly its own committed tokens, whatever rows
share its rounds; in float32 the batch's padded shapes may round a near-tie of two top logits the other way, as in
any batched call.

A call reports to its source ([`admission_for`]) when its rows leave it on their own: an EOS criterion (a finished
row leaves the batch), no streamer (the source receives the tokens) and no per-step scores or logits; without these
it runs as without a source. It asks for newcomers only where the merge is exact: greedy without logits processors
(a processor may read the batch's layout), an attention-only target on the default path (`verifiers.TreeVerifier`;
a hybrid target's recurrent state and the static path's fixed buffers are not merged). Elsewhere its own rows still
leave with their answers, and no row joins.
"""

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import StoppingCriteriaList

from .acceptance import commit
from .compat import kv_layer_entries, set_kv_layer_entries
from .layers import JetSpecContext
from .state import Acceptance, Call, JetSpecStats, RoundState
from .verifiers import TreeVerifier


@dataclass
class Newcomer:
    """A request that joins a running call.

    Args:
        input_ids (`torch.LongTensor` of shape `(1, P)`): its prompt, without padding, on the target's device.
        stopping (`StoppingCriteriaList`): its own stopping criteria (its EOS, its `max_length` of P + its new
            tokens, ...), judged on its own tokens `(1, L)` as its lone `generate` call judges them.
    """

    input_ids: torch.Tensor  # (1, P)
    stopping: StoppingCriteriaList


class RowSource(Protocol):
    """What a call with `jetspec_rows` asks between rounds and tells as rows commit and leave. Batch rows are
    numbered as the call's rows (0 .. B - 1), then the newcomers in the order they joined (B, B + 1, ...)."""

    def admit(self, active: int) -> list:
        """Newcomers (a `list` of [`Newcomer`]) that join the call now, `active` rows decoding in it."""

    def committed(self, row: int, tokens: list):
        """`row` committed `tokens` (its new tokens since the last call, as ints)."""

    def left(self, row: int, tokens: list, stats: JetSpecStats):
        """`row` has finished: every token it committed (its prompt excluded) and its statistics, those of the
        rounds it took part in as a batch-1 call counts them."""


def admission_for(source, call: Call, generation_config, stats: JetSpecStats, width: int, rebudget=None):
    """The call's [`Admission`] when `source` is given and the call's rows leave it on their own (an EOS criterion,
    no streamer, no per-step scores or logits), else [`NO_ADMISSION`]; it admits newcomers only where the call can
    merge a row exactly (module docstring). `width`: the call's padded prompt length P. `rebudget`: for a
    `tree_budget="auto"` call, `rows -> budget`, asked before a round whose batch changed."""
    if source is None or not call.pads_finished or call.records is not None or call.streamer is not None:
        return NO_ADMISSION
    merges = type(call.verifier) is TreeVerifier and not generation_config.do_sample and call.choose is None
    return Admission(source, call, stats, width, merges, rebudget)


class NoAdmission:
    """A call without a row source: nothing joins it, and its rows leave with the call's output."""

    reports_rows = False  # its rows' answers go out with the call's output, not one by one

    def hook(self, user_hook=None):
        return user_hook

    def started(self):
        pass

    def before_round(self):
        pass

    def admit(self, head, state: RoundState) -> RoundState:
        return state


NO_ADMISSION = NoAdmission()


class Admission:
    """A call's newcomers and its rows' own statistics, kept between rounds ([`admit`], [`hook`])."""

    reports_rows = True  # each row is handed to its source as it leaves (`_report`)

    def __init__(
        self, source: RowSource, call: Call, stats: JetSpecStats, width: int, merges: bool = True, rebudget=None
    ):
        self.source, self.call, self.stats, self.merges = source, call, stats, merges
        self.rebudget = rebudget if merges else None  # a call that merges no row keeps its shape (the static path)
        self.budget_rows = len(call.lengths)  # the batch the call's budget was chosen for
        self.starts = [width] * len(call.lengths)  # (rows,) where each row's new tokens begin in its history
        self.rows = [self._row_stats() for _ in call.lengths]  # (rows,) each row's own statistics
        self.seen = list(self.starts)  # (rows,) the length each row had when the source last heard of it
        self._before = []  # the rows of the round that runs (`before_round`)

    def _row_stats(self) -> JetSpecStats:
        """A row's statistics after its prefill: one forward, one token."""
        depth = len(self.stats.accepted_at_depth)
        row = JetSpecStats(target_forwards=1, new_tokens=1, accepted_at_depth=[0] * depth)
        row.operating_point = self.stats.operating_point
        return row

    def started(self):
        """After the call's first tokens: tell the source, and let go the rows they finished."""
        self._report(range(len(self.call.lengths)))

    def hook(self, user_hook=None):
        """The round hook of the call: each round's rows get their statistics and tokens, then `user_hook` (the
        call's `jetspec_round_hook`, or `None`) gets the record."""

        def record_round(record):
            rows = self._before
            for row, accepted in zip(rows, record.accepted):
                took = self.call.lengths[row] - self.seen[row]
                self.rows[row].add_round(record.budget, [accepted + 1], took, 0.0, 0.0, record.target_forwards)
            self._report(rows)
            if user_hook is not None:
                user_hook(record)

        return record_round

    def before_round(self):
        """Note the rows of the round about to run (what its record's per-row lists follow); where their number
        changed since the budget was chosen, a `tree_budget="auto"` call re-weighs it for this batch (lossless: the
        tree's size changes which drafts are verified, never which tokens are committed)."""
        self._before = list(self.call.active)
        rows = len(self._before)
        if self.rebudget is None or rows == self.budget_rows or not rows:
            return
        self.budget_rows = rows
        budget = self.rebudget(rows)
        if budget != self.call.shape.budget:
            self.call.shape = replace(self.call.shape, budget=budget)
        if self.stats.operating_point is not None:  # the budget at each batch the call ran (its rows share the dict)
            self.stats.operating_point.setdefault("budget_by_batch", {})[rows] = self.call.shape.budget

    def _report(self, rows):
        """Hand the source each of `rows`' new tokens, and let go those that finished."""
        call = self.call
        for row in rows:
            new = call.history[row][self.seen[row] : call.lengths[row]]
            self.seen[row] = call.lengths[row]
            if new:
                self.source.committed(row, new)
            if call.finished(row):
                stats, tokens = self.rows[row], call.history[row][self.starts[row] : call.lengths[row]]
                stats.token_sources = [list(self.stats.token_sources[row])]
                if call.lookup_index.answers is not None:  # kept before it is answered (`answer_cache.py`)
                    call.lookup_index.answers.add(tokens)
                self.source.left(row, tokens, stats)

    def admit(self, head, state: RoundState) -> RoundState:
        """Between rounds: every newcomer the source offers joins `state` (`(A, ...)` -> `(A + k, ...)`); a call
        that cannot merge rows exactly does not ask."""
        if not self.merges:
            return state
        for newcomer in self.source.admit(len(self.call.active)):
            state = self._join(head, state, newcomer)
        return state

    def _join(self, head, state: RoundState, newcomer: Newcomer) -> RoundState:
        """Prefill `newcomer` alone, commit its first token, and merge it into `state` unless that token ended it."""
        ids = _checked(newcomer, state.anchors.device)
        call, before = self.call, self.call.verifier.target_forwards
        alone, logits = call.verifier.prefill(ids, None)  # (1, V) fp32
        self.stats.target_forwards += call.verifier.target_forwards - before
        row = call.add_row(ids[0].tolist(), newcomer.stopping)
        self.starts.append(ids.shape[1])
        self.seen.append(ids.shape[1])
        self.rows.append(self._row_stats())
        first = logits.argmax(-1)  # (1,): greedy without processors, as `processors.pick_token`
        acc = Acceptance(nodes=torch.zeros_like(first)[:, None], tokens=first[:, None], count=torch.ones_like(first))
        running, call.active = call.active, [row]
        done = commit(call, acc, logits[:, None])
        call.active = running + call.active  # the newcomer joins unless its first token ended it
        self.stats.new_tokens += done.tokens
        self.stats.add_sources(row, ["target"] * done.tokens)  # the prefill's token is the target's own
        self._report([row])
        if not call.active or call.active[-1] != row:
            return state
        return merge_rows(state, replace(alone, rows=torch.full_like(first, row), anchors=first))


def _checked(newcomer, device) -> torch.Tensor:
    """The newcomer's prompt `(1, P)` on `device`, refused unless a [`Newcomer`] with a non-empty prompt."""
    if not isinstance(newcomer, Newcomer):
        raise ValueError(f"expected a Newcomer from the row source, got {type(newcomer).__name__}")
    ids = newcomer.input_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"expected a newcomer's input_ids of shape (1, P) with P >= 1, got {shape}")
    if not isinstance(newcomer.stopping, StoppingCriteriaList):
        raise ValueError(f"expected a StoppingCriteriaList for a newcomer, got {type(newcomer.stopping).__name__}")
    return ids.to(device)


def merge_rows(state: RoundState, joined: RoundState) -> RoundState:
    """`state`'s rows `(A, ...)` then `joined`'s `(A', ...)`, as one round state: the target cache's entries, the
    validity and positions, and the head's context, each left-padded with masked columns (zeros, invalid, position
    0) to the wider of the two. The result holds tensors of its own (no `Columns`): the next round grows them."""
    width = max(state.valid.shape[1], joined.valid.shape[1])
    for layer, other in zip(state.cache.layers, joined.cache.layers):
        entries, more = kv_layer_entries(layer), kv_layer_entries(other)
        if entries is None or more is None:  # a layer that reads another layer's keys/values holds none
            continue
        keys = torch.cat([_left_padded(entries[0], width, 2), _left_padded(more[0], width, 2)])  # (A + A', H, S, D)
        values = torch.cat([_left_padded(entries[1], width, 2), _left_padded(more[1], width, 2)])
        set_kv_layer_entries(layer, keys, values)
    return replace(
        state,
        rows=torch.cat([state.rows, joined.rows]),
        valid=torch.cat([_left_padded(state.valid, width, 1), _left_padded(joined.valid, width, 1)]),
        positions=torch.cat([_left_padded(state.positions, width, 1), _left_padded(joined.positions, width, 1)]),
        context=_merged_context(state.context, joined.context),
        anchors=torch.cat([state.anchors, joined.anchors]),
        anchor_pos=torch.cat([state.anchor_pos, joined.anchor_pos]),
        columns=None,
    )


def _merged_context(context: JetSpecContext, other: JetSpecContext) -> JetSpecContext:
    """Two heads' contexts as one, rows of `context` first, each left-padded with masked columns."""
    width = max(context.valid.shape[1], other.valid.shape[1])

    def both(a, b, dim):
        return torch.cat([_left_padded(a, width, dim), _left_padded(b, width, dim)])

    positions = None if context.positions is None else both(context.positions, other.positions, 1)
    last = None if context.last is None else torch.cat([context.last, other.last])  # (A + A', H)
    return JetSpecContext(
        [both(a, b, 2) for a, b in zip(context.keys, other.keys)],
        [both(a, b, 2) for a, b in zip(context.values, other.values)],
        both(context.valid, other.valid, 1),
        last,
        positions,
    )


def _left_padded(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` with zeros (False for a mask) in front along `dim`, to `width` columns there."""
    missing = width - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
