"""The offline replay of decoding over stored answers ([`evaluate`]), and what it tallies ([`Tally`]).

A held-out row is a prompt and the target's own greedy answer. The replay runs decoding over that answer, round by
round, as `generate` would run it (`modeling_jetspec/decode.py`):

- the prompt's features start the head's context and the answer's first token is committed (the prefill);
- each round calls the decoder's own steps: `steps.draft` (the head's block forward, the best-first tree, the
  model-free branch with the call's `LookupRecord` and n-gram indexes, kept across rounds as `generate` keeps them),
  `steps.accept` (its walk down the tree, the target's choice after a node being the stored answer's next token:
  what greedy verification accepts when the stored answer is the target's greedy continuation) and `steps.compact`
  (the head's context grows by the stored features of the accepted nodes, which are the stored answer's positions);
  the head reads the stored target features, which is what the verify forwards would have handed it;
- the round commits the accepted path and the bonus token (the stored next token), cut at the row's end, as
  `generate`'s stopping criteria cut it.

So on rows regenerated greedily in float32, with float32 features, its per-row rounds and tau equal those of real
`target.generate(..., assistant_model=head)` (`tests/test_evaluate_head.py` checks it). With a bf16 store the head
reads bf16-rounded features, as a bf16 decode does.

Reported per head and budget: tau (committed tokens per round, bonus included, as `JetSpecStats.tau`), acceptance
per depth (share of rounds whose accepted path reached depth d), and the accepted draft tokens by who proposed them:
the head only, the model-free branch (trie or chain) only, or both (a node both propose is merged into one node).

First-round diagnostics (arXiv 2606.18394's "impossible paths"): for each row's first round, the tree's top-ranked
path (from the root, each node's best-ranked child, down to a leaf), its draft score (the tree's cumulative
log-prob key), and the target's log-prob of that path computed from the stored final hidden states (final state
@ the target's LM head, log-softmax). The stored states hold the target only along the stored answer: the target's
log-prob of a path token at depth d is known while the path's first d - 1 tokens follow the answer, so it is
computed over that prefix (through the first token that leaves the answer). A prefix's log-prob bounds the whole
path's from above, so the share of rows below -20 nats is a lower bound; the score inflation is the draft score
minus the target's log-prob over the same prefix.

Calibration (`--fit_calibration`): every node whose parent is on the accepted path is a trial (its parent is the
context the target's next token is known for): per depth and source, binned by the node's conditional draft
probability, the measured acceptance rate. Printed and written to the JSON; nothing is applied to the draft.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from modeling_jetspec import steps
from modeling_jetspec.calibration import BINS, node_source, probability_bin
from modeling_jetspec.continuations import LookupRecord, RowIndexes
from modeling_jetspec.state import RoundState, TreeShape

from .eval_rows import EvalRow

IMPOSSIBLE_NATS = -20.0  # a top-ranked path below this target log-prob counts as "impossible" (issue 33)
SOURCES = ("head", "lookup", "both")
LOGPROB_KEYS = ("logprob", "gap")  # tree keys that are cumulative log-probs (a path's draft score)


@dataclass
class Tally:
    """What one head at one tree shape measured over the rows."""

    rows: int = 0
    rounds: int = 0
    tokens: int = 0  # committed by rounds (bonus included); the prefill's token is not counted, as in JetSpecStats
    accepted_at_depth: list = field(default_factory=list)
    sources: dict = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    per_row: list = field(default_factory=list)  # (id, rounds, tokens, accepted_at_depth)
    first_round: list = field(default_factory=list)  # per row, see `_first_round`
    calibration: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0]))  # (depth, source, bin) ->
    # [trials, accepted, summed draft probability]

    @property
    def tau(self) -> float:
        return self.tokens / max(self.rounds, 1)

    def summary(self) -> dict:
        accepted = sum(self.sources.values())
        out = {
            "rows": self.rows,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "tau": self.tau,
            "acceptance_per_depth": [c / max(self.rounds, 1) for c in self.accepted_at_depth],
            "accepted_tokens": accepted,
            "accepted_by_source": dict(self.sources),
            "per_row": [{"id": i, "rounds": r, "tokens": t, "accepted_at_depth": d} for i, r, t, d in self.per_row],
        }
        out["first_round"] = first_round_summary(self.first_round)
        if self.calibration:
            out["calibration"] = calibration_table(self.calibration)
        return out


@torch.no_grad()
def evaluate(
    head,
    rows: list,
    shape: TreeShape,
    batch_size: int = 32,
    first_round: bool = True,
    calibration: bool = False,
    on_round: Callable | None = None,
) -> Tally:
    """Replay decoding over `rows` ([`EvalRow`]) with `head` at `shape` (a fixed budget), `batch_size` rows per
    head forward. See the module docstring.

    Args:
        on_round (`Callable`, *optional*): `(row ids, trees)` after each round's draft (tests compare the trees).
    """
    if not isinstance(shape.budget, int):
        raise ValueError(f"expected a fixed tree budget for offline evaluation, got {shape.budget!r}")
    tally = Tally(accepted_at_depth=[0] * max(shape.depth, shape.lookup))
    for begin in range(0, len(rows), batch_size):
        _evaluate_batch(head, rows[begin : begin + batch_size], shape, tally, first_round, calibration, on_round)
    return tally


class _NoCache:
    """The target cache of a replay: there is no target forward, so nothing to keep or select."""

    def batch_select_indices(self, indices):
        pass


def _keep_no_entries(cache, past, nodes):
    """`steps.compact`'s `keep_entries` for a replay: no target cache."""


def _prefill(head, rows: list, device) -> RoundState:
    """What `steps.prefill` leaves: the prompts' stored features in the head's context (right-padded, holes masked),
    each row's first answer token committed as its anchor, at position `prompt_length`."""
    a = len(rows)
    width = max(row.prompt_length for row in rows)
    features = torch.zeros(a, width, rows[0].features.shape[-1], dtype=rows[0].features.dtype)
    valid = torch.zeros(a, width, dtype=torch.bool)
    for i, row in enumerate(rows):
        features[i, : row.prompt_length] = row.features[: row.prompt_length]
        valid[i, : row.prompt_length] = True
    positions = torch.arange(width).expand(a, width).to(device)
    valid = valid.to(device)
    return RoundState(
        rows=torch.arange(a, device=device),
        cache=_NoCache(),
        valid=valid,
        positions=positions,
        context=head.extend_context(None, features.to(device), positions, valid),
        anchors=torch.tensor([row.tokens[row.prompt_length] for row in rows], device=device),
        anchor_pos=torch.tensor([row.prompt_length for row in rows], device=device),
    )


def _stored_choice(rows: list, histories: dict):
    """`steps.accept`'s `choose` when the target's choices are the stored answer: after the committed tokens and
    `path`, the row's next stored token (-1, which no node holds, past the stored answer)."""

    def choose(row, logits, path):
        tokens, at = rows[row].tokens, len(histories[row]) + len(path)
        return (tokens[at] if at < len(tokens) else -1), None

    return choose


def _node_features(rows: list, active: list, lengths: list, acc, trees, width: int) -> torch.Tensor:
    """`(A, n + 1, k * H)`: what `steps.verify` hands `steps.compact`, at the accepted nodes (the stored features along
    the answer: node at depth d holds the features of position anchor + d); zeros elsewhere, which nothing reads."""
    features = torch.zeros(len(active), trees.tokens.shape[1] + 1, width, dtype=rows[active[0]].features.dtype)
    for slot, (i, (nodes, _)) in enumerate(zip(active, acc.host)):
        start = lengths[slot] - 1
        stored = rows[i].features[start : start + len(nodes)]
        features[slot, nodes[: stored.shape[0]]] = stored
    return features


def _evaluate_batch(head, rows: list, shape: TreeShape, tally: Tally, first_round: bool, calibration: bool, on_round):
    """One batch of rows, round by round through the decoder's own steps: `steps.draft` (with the call's lookup
    record and n-gram indexes, as `generate` keeps them), `steps.accept` (its walk, the stored answer as the target's
    choices) and `steps.compact` (the head's context grows by the accepted nodes' stored features)."""
    device = head.device
    state = _prefill(head, rows, device)
    histories = {i: row.tokens[: row.prompt_length + 1] for i, row in enumerate(rows)}
    active = list(range(len(rows)))
    record = LookupRecord() if shape.lookup and shape.lookup_record else None
    indexes = RowIndexes() if shape.lookup else None
    counts = {i: [0, 0, [0] * len(tally.accepted_at_depth)] for i in active}  # rounds, tokens, depths
    choose = _stored_choice(rows, histories)
    while active:
        lengths = [len(histories[i]) for i in active]
        order = {i: histories[i] for i in active} if shape.lookup else None
        trees = steps.draft(head, state, shape, shape.budget, order, record, indexes)
        if on_round is not None:
            on_round([rows[i].id for i in active], trees)
        acc = steps.accept(torch.empty(len(active), trees.tokens.shape[1] + 1, 0), trees, active, choose)
        keep = []
        for slot, i in enumerate(active):
            row, m, (nodes, _) = rows[i], lengths[slot], acc.host[slot]
            committed = min(len(nodes), row.end - m)  # the accepted path and the bonus, cut at the row's end
            _tally_round(tally, trees, slot, nodes, row, m, shape, counts[i], first_round, calibration, head)
            counts[i][1] += committed
            histories[i] = histories[i] + row.tokens[m : m + committed]
            if m + committed < row.end:
                keep.append(slot)
            else:
                _row_done(tally, row, counts[i])
        if not keep:
            break
        features = _node_features(rows, active, lengths, acc, trees, rows[active[0]].features.shape[-1])
        keep_rows = torch.tensor(keep, dtype=torch.long, device=device)
        state = steps.compact(head, state, trees, acc, features.to(device), keep_rows, keep_entries=_keep_no_entries)
        active = [active[slot] for slot in keep]


def _tally_round(tally, trees, slot, nodes, row, m, shape, count, first_round, calibration, head):
    """One row's round: its rounds, accepted depths and sources (who proposed each node, as the draft recorded it in
    `trees`), calibration trials and first-round statistics."""
    tree, n, head_tokens = trees.host[slot], trees.sizes[slot], trees.head_tokens[slot]
    trie = trees.branches[slot] if trees.branches is not None else {}
    following = row.tokens[m:]
    accepted = len(nodes) - 1
    path = following[:accepted]
    for d in range(accepted):
        tally.sources[node_source(head_tokens, trie, tuple(path[:d]), path[d])] += 1
    for d in range(min(accepted, len(count[2]))):
        count[2][d] += 1
    if calibration:
        _calibrate(tally, tree, n, nodes, following, head_tokens, trie)
    if first_round and m == row.prompt_length + 1:
        tally.first_round.append(_first_round(head, tree, n, row, m, shape))
    count[0] += 1


def _row_done(tally: Tally, row: EvalRow, count: list):
    rounds, tokens, depths = count
    tally.rows += 1
    tally.rounds += rounds
    tally.tokens += tokens
    tally.accepted_at_depth = [x + y for x, y in zip(tally.accepted_at_depth, depths)]
    tally.per_row.append((row.id, rounds, tokens, depths))


def _calibrate(tally: Tally, tree, n: int, nodes: list, following: list, head_tokens, trie: dict):
    """Trials of every node whose parent is on the accepted path and whose next stored token is known."""
    on_path = {node: depth for depth, node in enumerate(nodes)}
    for child in range(1, n + 1):
        parent = tree.parents[child - 1]
        if parent not in on_path:
            continue
        d = on_path[parent]  # the child's depth - 1
        if d >= len(following):
            continue
        prefix = following[:d]
        token = tree.tokens[child - 1]
        parent_key = tree.scores[parent - 1] if parent else 0.0
        prob = math.exp(min(tree.scores[child - 1] - parent_key, 0.0))
        source = node_source(head_tokens, trie, tuple(prefix), token)
        bucket = probability_bin(prob)  # the bins a calibration map is read by
        entry = tally.calibration[(d + 1, source, bucket)]
        entry[0] += 1
        entry[1] += int(token == following[d])
        entry[2] += prob


def _first_round(head, tree, n: int, row: EvalRow, m: int, shape: TreeShape) -> dict:
    """The top-ranked path of a row's first tree: its draft score and the target's log-prob where known."""
    first_child = {}
    for child in range(1, n + 1):
        first_child.setdefault(tree.parents[child - 1], child)  # best-first: a node's best child is popped first
    path, node = [], 0
    while node in first_child:
        node = first_child[node]
        path.append(node)
    following = row.tokens[m:]
    anchor_pos = m - 1
    target_lp, known, node_known = 0.0, 0, 0
    if row.final is not None:
        lm_head = head.target_lm_head()
        for d, node in enumerate(path):  # token at depth d + 1: the target's state at anchor_pos + d
            if anchor_pos + d >= row.final.shape[0]:
                break
            target_lp += _target_logprob(row, lm_head, anchor_pos + d, tree.tokens[node - 1])
            known, node_known = d + 1, node
            if d >= len(following) or tree.tokens[node - 1] != following[d]:
                break  # past the first token that leaves the answer the target's states are not stored
    scored = shape.scoring in LOGPROB_KEYS
    score = tree.scores[path[-1] - 1] if path else 0.0
    known_score = tree.scores[node_known - 1] if node_known else 0.0
    return {
        "id": row.id,
        "depth": len(path),
        "known_depth": known,
        "draft_score": score,
        "draft_score_known": known_score if scored else None,
        "target_logprob_known": target_lp if known else None,
        "inflation": known_score - target_lp if (known and scored) else None,
    }


def _target_logprob(row: EvalRow, lm_head, position: int, token: int) -> float:
    """The target's log-prob of `token` after `position`, from the stored final state there: the log-normaliser of
    a position is computed once per row (the LM head over the whole vocabulary) and kept; then one dot product."""
    state = row.final[position].to(lm_head.weight.dtype)
    if position not in row.normalisers:
        row.normalisers[position] = float(torch.logsumexp(lm_head(state[None]).float(), -1)[0])
    bias = getattr(lm_head, "bias", None)
    logit = state @ lm_head.weight[token] + (bias[token] if bias is not None else 0.0)
    return float(logit.float()) - row.normalisers[position]


def first_round_summary(entries: list) -> dict:
    known = [e for e in entries if e["target_logprob_known"] is not None]
    inflations = [e["inflation"] for e in known if e["inflation"] is not None]
    return {
        "rows": len(entries),
        "rows_with_target_logprob": len(known),
        "complete_paths": sum(1 for e in known if e["known_depth"] == e["depth"]),
        "share_below_-20_nats": (
            sum(1 for e in known if e["target_logprob_known"] < IMPOSSIBLE_NATS) / len(known) if known else None
        ),
        "mean_inflation": sum(inflations) / len(inflations) if inflations else None,
        "mean_draft_score": sum(e["draft_score"] for e in entries) / len(entries) if entries else None,
        "rows_detail": entries,
    }


def calibration_table(calibration: dict) -> list:
    """Rows `{depth, source, bin, trials, accepted, acceptance, mean_draft_probability}`, sorted; and per (depth,
    source) a monotone (pooled adjacent violators) fit of acceptance over the bins, `fitted`."""
    rows = []
    groups = defaultdict(list)
    for (depth, source, bucket), (trials, accepted, summed) in sorted(calibration.items()):
        groups[(depth, source)].append([bucket, trials, accepted, summed])
    for (depth, source), bins in sorted(groups.items()):
        fitted = _isotonic([b[2] / b[1] for b in bins], [b[1] for b in bins])
        for (bucket, trials, accepted, summed), fit in zip(bins, fitted):
            rows.append(
                {
                    "depth": depth,
                    "source": source,
                    "bin": [bucket / BINS, (bucket + 1) / BINS],
                    "trials": trials,
                    "accepted": accepted,
                    "acceptance": accepted / trials,
                    "mean_draft_probability": summed / trials,
                    "fitted": fit,
                }
            )
    return rows


def _isotonic(values: list, weights: list) -> list:
    """Non-decreasing least-squares fit of `values` with `weights` (pool adjacent violators)."""
    blocks = []  # [value, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [v for v, _, c in blocks for _ in range(c)]
