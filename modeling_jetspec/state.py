"""What a `generate` call and a round of tree decoding hold, and the statistics they report (arXiv 2606.18394,
sections 3.2-3.4; `docs/design.md`, "§2 The round").

[`TreeShape`] is the tree a call drafts, [`Call`] what one call fixes at its start and the tokens it has committed,
[`RoundState`] the tensors a round replaces, [`DraftTrees`] and [`Acceptance`] what a round's steps hand each other
(`steps.py`), [`JetSpecStats`] what a call reports. [`Verifier`] is the interface through which a round reaches the
target: `verifiers.TreeVerifier` for attention targets, `hybrid.HybridVerifier` for targets with recurrent or
convolution layers.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .columns import Columns
from .continuations import LookupRecord, RowIndexes
from .calibration import check_calibration
from .tree import check_lookup_prior, check_tree_shape


@dataclass
class TreeShape:
    depth: int  # N, maximum depth of a draft node
    width: int  # W, candidates per node
    budget: int | str  # B, draft nodes per tree (root excluded), or "auto" (chosen per call, see `budget.py`)
    scoring: str  # best-first key, see `tree.tree_key`
    path_conditioning: bool  # second draft pass with MASK probes under the tree's real tokens
    lookup: int = 0  # tokens of the prompt-lookup branch in every tree (0: none); may exceed `depth`
    lookup_prior: list | None = None  # acceptance odds of lookup chains per match order; None: the chain goes first
    lookup_branches: str = "chain"  # "chain": the most recent match's continuation; "trie": every earlier one
    lookup_record: bool = False  # mix the prior with the branch's record in this call (`continuations.LookupRecord`)
    calibration: dict | None = None  # the head's `tree_calibration` (`calibration.py`); None: raw node scores


@dataclass
class JetSpecStats:
    """Statistics of one `generate` call. tau counts committed tokens per verify forward and row, bonus included."""

    target_forwards: int = 0  # every target forward: the prefill, verifies, scan steps, replays
    rounds: int = 0  # verify rounds
    row_rounds: int = 0  # sum over rounds of the rows in the batch
    new_tokens: int = 0  # committed tokens, all rows
    round_tokens: int = 0  # committed tokens produced by verify rounds
    accepted_at_depth: list = field(default_factory=list)  # (N,) row-rounds whose accepted path reached depth d
    budgets: list = field(default_factory=list)  # budget verified in each round
    accepted: list = field(default_factory=list)  # per round, (rows,) draft tokens accepted per active row
    # (B,) per row, the source of each of its new tokens in the output, in order: "head", "lookup", "both" (the head
    # and the model-free branch proposed it) or "target" (`calibration.TOKEN_SOURCES`); recorded by `steps.commit`
    token_sources: list = field(default_factory=list)
    # seconds of the rounds outside their verify forward (draft, tree, accept, commit, compaction) and in it; timed
    # only in timed rounds (inside `timing.timed_rounds()`, or with a `jetspec_round_hook`), else 0
    outside_verify_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0  # the whole call, up to its last host read (synchronized in timed rounds)
    # `tree_budget="auto"`: the budget and sources the call decoded at, and why (`budget.OperatingPoint.as_dict`)
    operating_point: dict | None = None

    @property
    def tau(self) -> float:
        return self.round_tokens / max(self.row_rounds, 1)

    @property
    def acceptance_per_depth(self) -> list:
        return [count / max(self.row_rounds, 1) for count in self.accepted_at_depth]

    def add_round(
        self, budget: int, counts: list, committed: int, outside_verify_s: float, verify_s: float, forwards: int
    ):
        """Record one verify round; `counts` holds each active row's accepted nodes (root included, host ints),
        `committed` the tokens the stopping criteria let through, `forwards` the target forwards the round's
        verifier ran (one for a tree verify; a scan or a replay runs more)."""
        self.target_forwards += forwards
        self.rounds += 1
        self.row_rounds += len(counts)
        self.new_tokens += committed
        self.round_tokens += committed
        self.budgets.append(budget)
        self.accepted.append([count - 1 for count in counts])
        self.outside_verify_seconds += outside_verify_s
        self.verify_seconds += verify_s
        for count in counts:
            for depth in range(min(count - 1, len(self.accepted_at_depth))):
                self.accepted_at_depth[depth] += 1

    def add_sources(self, row: int, sources: list):
        """Record the sources of the tokens `row` (a batch row) committed, in order."""
        while len(self.token_sources) <= row:
            self.token_sources.append([])
        self.token_sources[row] += sources

    def cut_sources(self, lengths: list, end: int):
        """Once, when the call has finished: keep, per row, the sources of the tokens in the output; a row of
        committed length `lengths[row]` loses those past `end` (the output's length), as the output cuts its
        tokens."""
        for row, length in enumerate(lengths):
            if length > end and row < len(self.token_sources):
                del self.token_sources[row][len(self.token_sources[row]) - (length - end) :]

    def as_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "tau": self.tau,
            "acceptance_per_depth": self.acceptance_per_depth,
            "budgets": self.budgets,
            "outside_verify_seconds": self.outside_verify_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "operating_point": self.operating_point,
        }


@dataclass
class JetSpecGenerateOutput(GenerateDecoderOnlyOutput):
    """[`GenerateDecoderOnlyOutput`] of a tree-decoding call (`return_dict_in_generate=True`), with its statistics.

    `scores` / `logits` hold, per generated step, a `(batch, vocab)` tensor; a row that has already finished holds
    zeros there (plain `generate` keeps computing a finished row on padding; the tree loop does not).
    """

    jetspec_stats: JetSpecStats | None = None


def resolve_tree_shape(config, **given) -> TreeShape:
    """Tree shape from per-call values, falling back to the head's config; validated by [`tree.check_tree_shape`]."""

    def pick(name, default):
        return given[name] if given.get(name) is not None else default

    shape = TreeShape(
        depth=pick("tree_depth", config.tree_depth),
        width=pick("tree_width", config.tree_width),
        budget=pick("tree_budget", config.tree_budget),
        scoring=pick("tree_scoring", config.tree_scoring),
        path_conditioning=pick("path_conditioning", config.path_conditioning),
        lookup=pick("tree_lookup", getattr(config, "tree_lookup", 0)),
        # False switches the head's prior off for this call (the whole chain first)
        lookup_prior=None
        if given.get("tree_lookup_prior") is False
        else pick("tree_lookup_prior", getattr(config, "tree_lookup_prior", None)),
        lookup_branches=pick("tree_lookup_branches", getattr(config, "tree_lookup_branches", "chain")),
        lookup_record=pick("tree_lookup_record", getattr(config, "tree_lookup_record", False)),
        # False switches the head's calibration off for this call (raw scores)
        calibration=None
        if given.get("tree_calibration") is False
        else pick("tree_calibration", getattr(config, "tree_calibration", None)) or None,
    )
    check_calibration(shape.calibration)
    check_lookup_prior(shape.lookup_prior, shape.lookup_record and bool(shape.lookup))
    check_tree_shape(
        shape.depth,
        shape.width,
        shape.budget,
        shape.scoring,
        config.block_size,
        shape.path_conditioning,
        shape.lookup,
        shape.lookup_branches,
        shape.lookup_record,
    )
    return shape


# ------------------------------------------------------------------------------------------------ one round: data
@dataclass
class RoundState:
    """The tensors a round reads and replaces. B rows were asked for; the A rows still decoding are `rows`.

    Invariant between rounds: for active row i, the target cache holds the committed sequence of row `rows[i]` except
    its last token (the anchor), and the head's context holds the target features of the same positions.
    """

    rows: torch.Tensor  # (A,) long, batch row of each active row
    cache: Cache  # target cache of the A active rows: keys (A, H_kv, S, D_k) and values (A, H_kv, S, D_v) per layer
    # (D_k != D_v under multi-head latent attention)
    valid: torch.Tensor  # (A, S) bool, False for padding and for the holes left by rejected nodes
    positions: torch.Tensor  # (A, S) long, position id of every target cache entry
    context: object  # JetSpecContext of the A active rows (head keys/values per layer, (A, H_kv, S', D))
    anchors: torch.Tensor  # (A,) long, last committed token of each row, not yet read by the target
    anchor_pos: torch.Tensor  # (A,) long, its position id
    # the buffers `valid` and `positions` are views of, grown in place by each round (`columns.py`); None: tensors of
    # their own (a packed state), copied by the next round's growth
    columns: Columns | None = None


@dataclass
class DraftTrees:
    """One candidate tree per active row (node 0 is the root, the anchor). Trees of a round have the same size."""

    tokens: torch.Tensor  # (A, n) long, target token of nodes 1..n
    parents: torch.Tensor  # (A, n) long, parent of nodes 1..n (0 is the root)
    depths: torch.Tensor  # (A, n + 1) long, depth of nodes 0..n
    ancestors: torch.Tensor  # (A, n + 1, n + 1) bool, node i sees node j (from `tree.ancestor_mask`)
    budget: int  # budget the trees were built for
    host: list | None = None  # (A,) the same trees as built on the host (`tree.Tree`, padded to n nodes); None:
    # not at hand (a verifier's part of the trees), and read from the tensors where needed
    sizes: list | None = None  # (A,) each tree's own node count before the padding to n; None: not at hand
    branches: list | None = None  # (A,) each row's model-free branch as `steps.draft` merged it, a trie
    # `{path: Counter(next token)}` (`{}`: no match); None: the trees were drafted without one
    head_tokens: list | None = None  # (A,) per row and depth 1..N, the head's top-W target tokens (what every branch
    # at that depth was offered); None: not at hand
    answers: list | None = None  # (A,) each row's answer-cache trie (`answer_cache.py`); None: drafted without one

    def max_depth(self) -> int:
        """The deepest node's depth, from the host trees (n, the deepest possible, without them): no read."""
        if self.host is None:
            return self.tokens.shape[1]
        return max(max(tree.depths) for tree in self.host)


@dataclass
class Acceptance:
    """What a round commits per active row: the target's token after each accepted node, root first."""

    nodes: torch.Tensor  # (A, K) long, accepted nodes root first; padded with 0 past `count`
    tokens: torch.Tensor  # (A, K) long, tokens[i, k] is the target's choice after node nodes[i, k]: the path, then
    # the bonus
    count: torch.Tensor  # (A,) long, accepted nodes (root included) == tokens committed by the round
    scores: list | None = None  # (A,) per row, the processed scores (V,) each token was chosen from; None: the
    # scores are the logits (greedy without processors)
    host: list | None = None  # (A,) per row, `(nodes, tokens)` as lists when the acceptance was chosen on the host
    # (the walk); None: [`commit`] reads them from the tensors
    marks: list | None = None  # (A,) per row, the device criteria's verdict after each of its tokens, when they were
    # judged with the acceptance (greedy on the host); None: [`commit`] judges them

    def paths(self) -> list:
        """Accepted node indices of each row, root first (a read of `nodes` and `count`)."""
        return _paths(self.nodes, self.count)


@dataclass
class Committed:
    """What `steps.commit` hands the rest of the round: the acceptance on the host, read from the device once."""

    tokens: int  # tokens committed, all rows
    counts: list  # (A,) accepted nodes per row, root included (what the round's statistics count)
    paths: list  # (A,) accepted node indices per row, root first
    keep: torch.Tensor  # (A',) long, the rows that go on
    acceptance: Acceptance  # the round's acceptance cut to its longest path, `(A, K)` (what `compact` moves)


class Verifier(Protocol):
    """How a round reaches the target: it prefills, verifies a round's trees and compacts the cache after
    acceptance. The round's steps (`steps.py`) never call the target otherwise.

    Every target forward a verifier runs (prefill, verify, and any scan or replay forward of a state-keeping target)
    is counted in `target_forwards`, which the call's [`JetSpecStats`] reports.
    """

    target_forwards: int  # target forwards run so far, all methods

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, before_context=None
    ) -> tuple[RoundState, torch.Tensor]:
        """The target reads the prompts `(B, L)`; returns the first round's state and the logits `(B, V)` after each
        prompt (see `steps.prefill`); `before_context`, when given, receives those logits before the head reads the
        prompt's features."""

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple[DraftTrees, torch.Tensor, torch.Tensor]:
        """The target reads the round's trees after `state`'s cache; returns the trees verified (all of them, or a
        part such as one path), the target's logits after each of their nodes `(A, n + 1, V)` (in the target's dtype
        or fp32: greedy acceptance takes their argmax, processors and records upcast what they read) and the
        head's features of each node `(A, n + 1, k * H)`."""

    def compact(
        self, state: RoundState, trees: DraftTrees, acc: Acceptance, features: torch.Tensor, keep: torch.Tensor
    ) -> RoundState:
        """The state of the rows `keep` `(A',)` after their accepted nodes (see `steps.compact`)."""

    def discard(self, state: RoundState, trees: DraftTrees):
        """Undo a `verify` without compacting (timing repeats)."""


@dataclass
class Call:
    """What one `generate` call fixes at its start, and the tokens it has committed so far.

    Nothing is ever written into `sequences` past a row's length: tokens become real through the stopping criteria
    ([`commit`]). Without an EOS criterion a stopped row keeps decoding (real tokens, as plain `generate` appends
    them) until every row has stopped; tokens past [`end`] are cut from the output. The committed tokens are kept
    twice: on the device (`sequences`, what the output, processors and stopping criteria read) and on the host
    (`history`, what prompt lookup and the streamer read), so that no round reads them back.
    """

    shape: TreeShape
    verifier: Verifier  # how the target verifies and compacts (see `verifiers.verifier_for`)
    sequences: torch.Tensor  # (B, L) committed tokens, padding past each row's length; L grows with the tokens
    # committed ([`extend`]), to at most twice the longest row
    lengths: list  # (B,) committed length of each row
    stopping: StoppingCriteriaList  # checked after every committed token
    max_length: int  # generate's `max_length`, where its MaxLengthCriteria stops every row
    pads_finished: bool  # an EOS criterion exists (`compat.pads_finished_rows`): a stopped row is finished and padded;
    # otherwise, as in plain decoding, it keeps receiving real tokens until every row has stopped
    pad_token: int  # what fills `sequences` past a row's length
    history: list = field(default_factory=list)  # (B,) per row, its committed tokens (prompt included) as a list
    active: list = field(default_factory=list)  # (A,) the batch rows still decoding, in the round state's order
    stopped_at: list = field(default_factory=list)  # (B,) length at which a criterion first stopped the row, or None
    streamer: object | None = None  # a `BaseStreamer` receiving the prompts, then one `(B,)` step at a time
    streamed: int = 0  # columns of `sequences` handed to the streamer
    records: list | None = None  # (B,) per row, `(scores (V,), logits (V,))` of every committed token; None: not kept
    choose: Callable | None = None  # `(row, logits (V,), path) -> (token, scores (V,))`, see [`accept`]; None:
    # greedy without processors (vectorized acceptance)
    lookup_record: LookupRecord | None = None  # the model-free branch's record per row (`shape.lookup_record`)
    # per row, the n-gram index of its committed tokens the model-free branch is read from, fed only new tokens
    lookup_index: RowIndexes = field(default_factory=RowIndexes)
    # how `stopping` is checked (`stopping.stop_plan`): the criteria judged on the device, once per round for every
    # accepted token, and the length at which a `MaxLengthCriteria` stops a row (judged on the host); `None`: some
    # criterion is checked after each committed token, on that token's row alone
    device_stops: list | None = None
    stop_length: int | None = None
    # rows that joined the running call (`admission.py`): batch row -> its own stopping criteria, judged on its own
    # tokens `(1, L)` as its lone call judges them (the call's `stopping` judges the rows it started with)
    row_stopping: dict = field(default_factory=dict)

    def histories(self) -> dict:
        """`{row: committed tokens}` of the active rows, in order (what prompt lookup matches); host data."""
        return {row: self.history[row] for row in self.active}

    def add_row(self, prompt: list, stopping: StoppingCriteriaList) -> int:
        """A new batch row holding `prompt` (no padding), judged by its own `stopping` ([`judge`]), in every per-row
        list; returns its index (a row joining the running call, `admission.py`)."""
        self._reserve(len(prompt))
        new = self.sequences.new_full((1, self.sequences.shape[1]), self.pad_token)  # (1, L)
        new[0, : len(prompt)] = torch.tensor(prompt, dtype=new.dtype, device=new.device)
        self.sequences = torch.cat([self.sequences, new])  # (B + 1, L)
        row = len(self.lengths)
        self.lengths.append(len(prompt))
        self.history.append(list(prompt))
        self.stopped_at.append(None)
        self.row_stopping[row] = stopping
        return row

    def judge(self, row: int) -> bool:
        """Whether the stopping criteria stop `row` after its last committed token (one read of the device)."""
        ids = self.sequences[row : row + 1, : self.lengths[row]]  # (1, L)
        own = self.row_stopping.get(row)
        if own is not None:
            return bool(own(ids, None)[0])
        # the row in a batch of the call's size, so criteria holding per-row state see plain decoding's layout
        return bool(self.stopping(ids.expand(self.sequences.shape[0] - len(self.row_stopping), -1), None)[row])

    def append(self, row: int, token: int):
        """Commit `token` to `row` (a write to the device buffer per token: the path whose stopping criteria are
        checked after each one)."""
        self._reserve(self.lengths[row] + 1)
        self.sequences[row, self.lengths[row]] = token
        self.history[row].append(token)
        self.lengths[row] += 1

    def extend(self, new: dict):
        """Commit `new[row]` (a list of tokens) to each row: one write to the device buffer for every row."""
        rows, cols, tokens = [], [], []
        for row, added in new.items():
            rows += [row] * len(added)
            cols += range(self.lengths[row], self.lengths[row] + len(added))
            tokens += added
            self.history[row] += added
            self.lengths[row] += len(added)
        if tokens:
            self._reserve(max(cols) + 1)
            device = self.sequences.device
            index = torch.tensor([rows, cols], dtype=torch.long, device=device)  # (2, tokens)
            self.sequences[index[0], index[1]] = torch.tensor(tokens, dtype=self.sequences.dtype, device=device)

    def _reserve(self, length: int):
        """Room for `length` tokens per row; the buffer doubles when full (its size follows the tokens produced, not
        `max_length`)."""
        while length > self.sequences.shape[1]:
            more = self.sequences.new_full((self.sequences.shape[0], max(self.sequences.shape[1], 64)), self.pad_token)
            self.sequences = torch.cat([self.sequences, more], dim=1)  # (B, 2L)

    def end(self, rows: int | None = None) -> int | None:
        """The length of the output once every row has stopped (`None` before): the longest row when finished rows
        are padded; else the length at which the last row stopped (plain decoding runs every row until then).
        `rows`: of the first `rows` rows only (the call's own; rows that joined it come after them)."""
        rows = len(self.lengths) if rows is None else rows
        if None in self.stopped_at[:rows]:
            return None
        return max(self.lengths[:rows]) if self.pads_finished else max(self.stopped_at[:rows])

    def finished(self, row: int) -> bool:
        """Whether `row` needs no more tokens (it leaves the batch)."""
        if self.stopped_at[row] is None:
            return False
        end = self.end()
        return (
            self.pads_finished or self.lengths[row] >= self.max_length or (end is not None and self.lengths[row] >= end)
        )


def _paths(nodes: torch.Tensor, count: torch.Tensor) -> list:
    """Rows of `nodes` `(A, K)` cut at `count` `(A,)`, as lists."""
    return [row[:c] for row, c in zip(nodes.tolist(), count.tolist())]
