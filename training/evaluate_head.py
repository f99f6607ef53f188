"""Offline evaluation of JetSpec heads on fixed text: every head is scored on exactly the same held-out rows, with
the decoder's own drafting code, and no target forward.

    python -m training.evaluate_head --head jetspec/heads/smollm2-135m runs/smollm2-135m \
        --data training/data/smollm2-135m-mix.npz training/data/smollm2-135m-mix-fp32.npz \
        --feature_store cache/smollm2-135m --rows 300 --max_new_tokens 256 --budgets 8,16,32,64 --json out.json

A held-out row (the trainer's own split: [`training.rows.split_train_eval`] with the same `eval_fraction` and seed)
is a prompt and the target's own greedy answer. The evaluator replays decoding over that answer, round by round, as
`generate` would run it (`modeling_jetspec/decode.py`):

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

[`offline_tau`] scores one head at its defaults (the trainer's learning curve can carry it next to agreement, e.g.
from [`OfflineTauCallback`]).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback

from jetspec.provenance import weights_identity
from modeling_jetspec import steps
from modeling_jetspec.calibration import BINS, check_calibration, node_source, probability_bin, to_config
from modeling_jetspec.continuations import LookupRecord, RowIndexes
from modeling_jetspec.state import RoundState, TreeShape, resolve_tree_shape
from modeling_jetspec.tree import TREE_SCORINGS

from .rows import row_key

DEFAULT_BUDGETS = (8, 16, 32, 64)
IMPOSSIBLE_NATS = -20.0  # a top-ranked path below this target log-prob counts as "impossible" (issue 33)
SOURCES = ("head", "lookup", "both")
LOGPROB_KEYS = ("logprob", "gap")  # tree keys that are cumulative log-probs (a path's draft score)


# ------------------------------------------------------------------------------------------------ rows and features
@dataclass
class EvalRow:
    """One held-out row as the evaluator replays it."""

    id: str
    tokens: list  # prompt then answer tokens, as stored
    prompt_length: int
    end: int  # committed length at which decoding stops: min(row length, prompt + max_new_tokens, stored + 1)
    features: torch.Tensor  # (>= end - 1, k * H) the target's selected-layer features of the first positions
    final: torch.Tensor | None = None  # (S, H) final hidden states of the first positions (first-round statistics)
    normalisers: dict = field(default_factory=dict)  # position -> the target's log-normaliser there (kept)


def held_out_rows(data: list, eval_fraction: float = 0.02, seed: int = 0, rows: int | None = None):
    """The trainer's held-out rows of `data` (its own split, [`training.rows.split_train_eval`]), the first `rows`
    of them; a `ValueError` when the split holds none (`eval_fraction` 0)."""
    from .rows import load_rows, split_train_eval

    _, held = split_train_eval(load_rows(list(data)), eval_fraction, seed)
    if held is None or len(held) == 0:
        raise ValueError(f"expected held-out rows in {list(data)} at eval_fraction={eval_fraction}, got none")
    if rows is not None:
        held = held.select(range(min(rows, len(held))))
    return held


def decode_rows(target, head, rows, max_new_tokens: int, progress: bool = False) -> list[dict]:
    """The reference the replay is checked against: real greedy `generate(..., assistant_model=head)` at batch 1 on
    each row's prompt, with the head's defaults. Per row: `id`, `answer` (the new tokens), `rounds` and `tokens`
    (verify rounds and the tokens they committed) and `accepted_at_depth` (`JetSpecStats`). `progress`: a bar over
    the rows (minutes for dozens of rows on 2 cores)."""
    out = []
    head.eval()
    for row in tqdm(rows, desc="generate", unit="row", disable=not progress):
        prompt_length = int(row["prompt_length"])
        ids = torch.tensor([list(row["input_ids"][:prompt_length])], device=target.device)
        result = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            assistant_model=head,
            return_dict_in_generate=True,
        )
        stats = result.jetspec_stats
        out.append(
            {
                "id": str(row["id"]),
                "answer": result.sequences[0, prompt_length:].tolist(),
                "rounds": stats.row_rounds,
                "tokens": stats.round_tokens,
                "accepted_at_depth": list(stats.accepted_at_depth),
            }
        )
    return out


def store_features(store) -> Callable:
    """A features function over a [`training.feature_store.FeatureStore`]: `fetch(rows, needed)` returns per row
    `(features, final, stored)`: the first `min(needed, stored)` positions (bf16) and how many the store holds;
    `stored` 0 when the row is not in the store."""

    def fetch(rows: list, needed: list):
        keys = [row_key(row["id"]) for row in rows]
        found, _, stored = store._lookup(keys)
        stored = [int(s) if f else 0 for f, s in zip(found, stored)]
        lengths = [min(n, s) for n, s in zip(needed, stored)]
        present = [i for i, n in enumerate(lengths) if n > 0]
        out = [(None, None, 0)] * len(rows)
        if present:
            features, final = store.get_batch([keys[i] for i in present], [lengths[i] for i in present])
            for j, i in enumerate(present):
                out[i] = (features[j, : lengths[i]], final[j, : lengths[i]], stored[i])
        return out

    return fetch


def forward_features(target, head) -> Callable:
    """A features function that runs `target` over each whole row (tests and small checks: float32 features, no
    store)."""

    @torch.no_grad()
    def fetch(rows: list, needed: list):
        out = []
        for row in rows:
            ids = torch.tensor([list(row["input_ids"])], device=target.device)
            hidden = target.get_decoder()(input_ids=ids, output_hidden_states=True, use_cache=False)
            features = head.target_features(hidden.hidden_states)[0]
            out.append((features, hidden.last_hidden_state[0], ids.shape[1]))
        return out

    return fetch


def prepare_rows(rows, fetch: Callable, max_new_tokens: int | None, depth: int) -> tuple[list, list]:
    """`(EvalRow list, skipped ids)`: rows whose stored features reach at least one round; the others are skipped
    (not in the store, or no answer token to draft for)."""
    rows = list(rows)
    needed = []
    for row in rows:
        length, prompt = len(row["input_ids"]), int(row["prompt_length"])
        end = length if max_new_tokens is None else min(length, prompt + max_new_tokens)
        needed.append(max(end - 1, prompt + depth))  # context to the last anchor; final states of the first round
    prepared, skipped = [], []
    for row, (features, final, stored) in zip(rows, fetch(rows, needed)):
        length, prompt = len(row["input_ids"]), int(row["prompt_length"])
        end = min(length, stored + 1) if max_new_tokens is None else min(length, prompt + max_new_tokens, stored + 1)
        if features is None or end <= prompt + 1:  # the prefill commits the only token: no round
            skipped.append(str(row["id"]))
            continue
        prepared.append(EvalRow(str(row["id"]), list(row["input_ids"]), prompt, end, features, final))
    return prepared, skipped


# ------------------------------------------------------------------------------------------------ one evaluation
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


# ------------------------------------------------------------------------------------------------ the trainer's hook
def tree_shape(
    head,
    budget: int | None = None,
    lookup: bool = True,
    tree_key: str | None = None,
    lookup_settings=None,
    calibration=None,
) -> TreeShape:
    """The tree a head drafts at its defaults, with `budget`, the model-free branch on or off, and `tree_key`;
    `lookup_settings` (a head config) lends its model-free branch settings (a head that has none of its own);
    `calibration` replaces the head's `tree_calibration` (a map, or False for raw scores)."""
    given = {"tree_budget": budget, "tree_scoring": tree_key, "tree_calibration": calibration}
    if not lookup:
        given["tree_lookup"] = 0
    elif lookup_settings is not None:
        given.update(
            tree_lookup=lookup_settings.tree_lookup,
            tree_lookup_prior=getattr(lookup_settings, "tree_lookup_prior", None) or False,
            tree_lookup_branches=getattr(lookup_settings, "tree_lookup_branches", "chain"),
            tree_lookup_record=getattr(lookup_settings, "tree_lookup_record", False),
        )
    shape = resolve_tree_shape(head.config, **given)
    if shape.budget == "auto":
        raise ValueError("expected a fixed tree budget for offline evaluation, got the head's 'auto'; pass budget")
    if shape.path_conditioning and shape.lookup:
        raise ValueError("expected no model-free branch with path conditioning, got both")
    return shape


def offline_tau(
    head,
    rows,
    store=None,
    fetch: Callable | None = None,
    budget: int | None = None,
    lookup: bool = True,
    max_new_tokens: int | None = 256,
    max_rows: int | None = 64,
    batch_size: int = 32,
) -> dict:
    """Offline tau of `head` at its defaults (its own budget unless `budget`) on `rows` (held-out rows: dicts or a
    `datasets.Dataset` with `id`, `input_ids`, `prompt_length`), features from `store` (a `FeatureStore`) or
    `fetch`. The head must have its target attached. Returns `{"tau", "rounds", "rows", "acceptance_per_depth",
    "accepted_by_source"}`; rows not in the store are skipped (`"skipped"`)."""
    from .trainer import unwrap_head

    head = unwrap_head(head)
    if (store is None) == (fetch is None):
        raise ValueError(
            "expected exactly one of a feature store or a features function, got "
            f"{'both' if store is not None else 'neither'}"
        )
    fetch = fetch or store_features(store)
    shape = tree_shape(head, budget, lookup)
    rows = list(rows)[:max_rows] if max_rows is not None else list(rows)
    prepared, skipped = prepare_rows(rows, fetch, max_new_tokens, shape.depth)
    training = head.training
    head.eval()
    try:
        tally = evaluate(head, prepared, shape, batch_size, first_round=False)
    finally:
        head.train(training)
    summary = tally.summary()
    return {
        "tau": summary["tau"],
        "rounds": summary["rounds"],
        "rows": summary["rows"],
        "acceptance_per_depth": summary["acceptance_per_depth"],
        "accepted_by_source": summary["accepted_by_source"],
        "skipped": len(skipped),
    }


class OfflineTauCallback(TrainerCallback):
    """At every evaluation, the head's offline tau at its defaults on held-out `rows` (see [`offline_tau`]), added
    to the evaluation's metrics and to the log history as `eval_offline_tau`, next to the agreement."""

    def __init__(self, rows, store=None, fetch=None, **options):
        self.rows, self.store, self.fetch, self.options = list(rows), store, fetch, options

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if model is None:
            return control
        result = offline_tau(model, self.rows, self.store, self.fetch, **self.options)
        entry = {"eval_offline_tau": result["tau"], "step": state.global_step}
        if metrics is not None:
            metrics["eval_offline_tau"] = result["tau"]
        state.log_history.append(entry)
        return control


# ------------------------------------------------------------------------------------------------ command line
def parse_budgets(text: str) -> list:
    try:
        budgets = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected --budgets as comma-separated integers >= 1, got {text!r}") from None
    if not budgets or any(b < 1 for b in budgets):
        raise ValueError(f"expected --budgets as comma-separated integers >= 1, got {text!r}")
    return budgets


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate_head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", nargs="+", required=True, help="Head folders (save_pretrained), scored alike.")
    parser.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="Regenerated rows (.npz or regenerate folders), as the trainer reads them (default: the data list of "
        "training/configs/smollm2-135m.yaml).",
    )
    parser.add_argument("--feature_store", required=True, help="Feature store folder holding the held-out rows.")
    parser.add_argument(
        "--target",
        default="smollm2-135m",
        help="The target (alias, folder or Hub id): only its embeddings and LM head are used.",
    )
    parser.add_argument("--eval_fraction", type=float, default=0.02, help="The trainer's eval_fraction.")
    parser.add_argument("--seed", type=int, default=0, help="The trainer's seed (of the held-out hash).")
    parser.add_argument("--rows", type=int, default=None, help="Score at most this many held-out rows.")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="Cap on each row's answer tokens.")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), help="Tree budgets, e.g. 8,16,32.")
    parser.add_argument("--lookup", default="on", choices=["on", "off"], help="The model-free branch.")
    parser.add_argument(
        "--lookup_settings",
        default=None,
        help="A head folder whose model-free branch settings every head uses (default: each its own).",
    )
    parser.add_argument("--tree_key", default=None, help=f"Tree scoring, one of {TREE_SCORINGS} (default: the head's).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Head and target dtype.")
    parser.add_argument("--batch_size", type=int, default=32, help="Rows per head forward.")
    parser.add_argument(
        "--missing",
        default="error",
        choices=["error", "skip"],
        help="Held-out rows the store does not hold: refuse (error) or leave them out (skip).",
    )
    parser.add_argument(
        "--fit_calibration",
        action="store_true",
        help="Measure acceptance against the node's draft probability, per depth and source (raw scores).",
    )
    parser.add_argument(
        "--calibration_out",
        default=None,
        help="With --fit_calibration and one head: write its fitted map (a config's tree_calibration) to this JSON.",
    )
    parser.add_argument(
        "--min_trials", type=int, default=30, help="Trials a bin needs for its own rate in --calibration_out."
    )
    parser.add_argument(
        "--calibration",
        default=None,
        help="A JSON map (tree_calibration) to score every head with, or 'none' for raw scores (default: each "
        "head's own).",
    )
    parser.add_argument(
        "--skip_rows",
        type=int,
        default=0,
        help="Leave out the first N held-out rows (e.g. the rows that decide shipping, when fitting a calibration).",
    )
    parser.add_argument("--json", default=None, help="Write every number to this file.")
    return parser


def check_args(args) -> dict:
    """Every argument checked before any work; a `ValueError` names the first bad one."""
    for folder in args.head:
        if not (Path(folder) / "config.json").is_file():
            raise ValueError(f"expected a head folder holding config.json, got {folder}")
    for source in args.data:
        if not Path(source).exists():
            raise ValueError(f"expected regenerated data files or folders, got {source}, which does not exist")
    if not (Path(args.feature_store) / "store.json").is_file():
        raise ValueError(f"expected a feature store folder holding store.json, got {args.feature_store}")
    budgets = parse_budgets(args.budgets)
    if args.rows is not None and args.rows < 1:
        raise ValueError(f"expected --rows >= 1, got {args.rows}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"expected --max_new_tokens >= 1, got {args.max_new_tokens}")
    if args.tree_key is not None and args.tree_key not in TREE_SCORINGS:
        raise ValueError(f"expected --tree_key in {TREE_SCORINGS}, got {args.tree_key!r}")
    if not 0.0 < args.eval_fraction < 1.0:
        raise ValueError(f"expected --eval_fraction in (0, 1) (held-out rows to score), got {args.eval_fraction}")
    if args.batch_size < 1:
        raise ValueError(f"expected --batch_size >= 1, got {args.batch_size}")
    if args.skip_rows < 0 or args.min_trials < 1:
        raise ValueError(f"expected --skip_rows >= 0 and --min_trials >= 1, got {args.skip_rows} and {args.min_trials}")
    if args.calibration_out is not None and (not args.fit_calibration or len(args.head) != 1):
        raise ValueError(
            f"expected --fit_calibration and one --head with --calibration_out, got fit_calibration="
            f"{args.fit_calibration} and {len(args.head)} heads"
        )
    calibration_map = None
    if args.calibration is not None:
        if args.calibration == "none":
            calibration_map = False
        elif not Path(args.calibration).is_file():
            raise ValueError(f"expected --calibration to be a JSON map file or 'none', got {args.calibration}")
        else:
            calibration_map = json.loads(Path(args.calibration).read_text())
            check_calibration(calibration_map)
    if args.lookup_settings is not None and not (Path(args.lookup_settings) / "config.json").is_file():
        raise ValueError(
            f"expected --lookup_settings to be a head folder holding config.json, got {args.lookup_settings}"
        )
    return {"budgets": budgets, "calibration_map": calibration_map}


def run(
    heads: dict,
    rows: list,
    budgets: list,
    lookup: bool = True,
    tree_key: str | None = None,
    batch_size: int = 32,
    calibration: bool = False,
    lookup_settings=None,
    calibration_map=None,
) -> dict:
    """Score every head of `heads` (`{name: head with its target attached}`) on the same prepared `rows` at every
    budget: `{name: {budget: summary}}`. `calibration_map` replaces every head's `tree_calibration` (False: raw
    scores); fitting (`calibration`) always scores raw, since the fit maps raw scores to acceptance."""
    results = {}
    override = False if calibration else calibration_map
    for name, head in heads.items():
        results[name] = {}
        for budget in budgets:
            shape = tree_shape(head, budget, lookup, tree_key, lookup_settings, override)
            started = time.perf_counter()
            tally = evaluate(head, rows, shape, batch_size, first_round=True, calibration=calibration)
            summary = tally.summary()
            summary["seconds"] = time.perf_counter() - started
            summary["shape"] = {
                "depth": shape.depth,
                "width": shape.width,
                "budget": shape.budget,
                "scoring": shape.scoring,
                "lookup": shape.lookup,
                "lookup_branches": shape.lookup_branches,
                "lookup_record": shape.lookup_record,
                "lookup_prior": shape.lookup_prior is not None,
                "calibrated": shape.calibration is not None,
            }
            results[name][budget] = summary
    return results


def format_results(results: dict) -> str:
    lines = []
    for name, by_budget in results.items():
        lines.append(f"head {name}")
        depths = max(len(s["acceptance_per_depth"]) for s in by_budget.values())
        shown = min(depths, 8)
        lines.append(
            "  budget   tau  rounds  rows  "
            + " ".join(f"acc@{d + 1:<2}" for d in range(shown))
            + "  accepted: head-only lookup-only both"
        )
        for budget, s in by_budget.items():
            acc = " ".join(f"{a:6.3f}" for a in s["acceptance_per_depth"][:shown])
            src = s["accepted_by_source"]
            lines.append(
                f"  {budget:6d} {s['tau']:5.3f} {s['rounds']:7d} {s['rows']:5d}  {acc}  "
                f"{src['head']:>18d} {src['lookup']:>11d} {src['both']:>4d}"
            )
        for budget, s in by_budget.items():
            f = s["first_round"]
            if not f["rows"]:
                continue
            share = "n/a" if f["share_below_-20_nats"] is None else f"{f['share_below_-20_nats']:.3f}"
            inflation = "n/a" if f["mean_inflation"] is None else f"{f['mean_inflation']:+.2f}"
            lines.append(
                f"  first round, budget {budget}: top-ranked path below -20 nats (target log-prob over the "
                f"prefix that follows the stored answer; {f['complete_paths']}/{f['rows_with_target_logprob']}"
                f" paths wholly on it): {share}; mean score inflation {inflation} nats"
            )
        for budget, s in by_budget.items():
            if "calibration" not in s:
                continue
            lines.append(f"  calibration, budget {budget}: depth source bin trials acceptance draft-prob fitted")
            for r in s["calibration"]:
                lines.append(
                    f"    {r['depth']:2d} {r['source']:6s} [{r['bin'][0]:.1f},{r['bin'][1]:.1f}) "
                    f"{r['trials']:7d} {r['acceptance']:.3f} {r['mean_draft_probability']:.3f} "
                    f"{r['fitted']:.3f}"
                )
    if len(results) > 1:  # the heads side by side, on the same rows: tau and its ratio to the first head's
        names = list(results)
        lines.append("tau on the same rows (ratio to " + names[0] + ")")
        for budget in results[names[0]]:
            base = results[names[0]][budget]["tau"]
            cells = [f"{results[n][budget]['tau']:.3f} ({results[n][budget]['tau'] / base:.3f}x)" for n in names]
            lines.append(f"  budget {budget:3d}: " + "  ".join(f"{n}: {c}" for n, c in zip(names, cells)))
    return "\n".join(lines)


DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2-135m.yaml"


def config_data(config=DEFAULT_CONFIG) -> list:
    """The data files a training config reads (its `data:` list): the evaluator's default rows."""
    import yaml

    return list(yaml.safe_load(Path(config).read_text())["data"])


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.data is None:
        args.data = config_data()
    checked = check_args(args)
    from jetspec.targets import load_target
    from modeling_jetspec import JetSpecDraftModel
    from modeling_jetspec.configuration_jetspec import JetSpecConfig

    from .feature_store import FeatureStore

    store = FeatureStore(args.feature_store)
    configs = {folder: JetSpecConfig.from_pretrained(folder) for folder in args.head}
    for folder, config in configs.items():
        store.check(config.target_layer_ids, config.target_hidden_size)
    lookup_settings = JetSpecConfig.from_pretrained(args.lookup_settings) if args.lookup_settings else None
    held = held_out_rows(args.data, args.eval_fraction, args.seed)
    last = len(held) if args.rows is None else min(len(held), args.skip_rows + args.rows)
    if args.skip_rows >= last:
        raise ValueError(f"expected held-out rows after the first {args.skip_rows}, got {len(held)} in all")
    held = held.select(range(args.skip_rows, last))
    keys = [row_key(i) for i in held["id"]]
    found = store._lookup(keys)[0]
    missing = [str(i) for i, f in zip(held["id"], found) if not f]
    if missing and args.missing == "error":
        raise ValueError(
            f"expected every held-out row in the feature store {args.feature_store}, got {len(missing)} "
            f"of {len(held)} missing (e.g. {missing[:3]}); build it for --data, or pass --missing skip"
        )
    dtype = getattr(torch, args.dtype)
    target, _ = load_target(args.target, dtype=dtype)
    heads = {}
    for folder in args.head:
        head = JetSpecDraftModel.from_pretrained(folder, dtype=dtype).eval()
        head.attach_target(target)
        heads[folder] = head
    depth = max(h.config.tree_depth for h in heads.values())
    rows, skipped = prepare_rows(held, store_features(store), args.max_new_tokens, depth)
    if not rows:
        raise ValueError(f"expected held-out rows with at least one round to score, got none of {len(held)}")
    started = time.perf_counter()
    results = run(
        heads,
        rows,
        checked["budgets"],
        args.lookup == "on",
        args.tree_key,
        args.batch_size,
        args.fit_calibration,
        lookup_settings,
        checked["calibration_map"],
    )
    print(
        f"{len(rows)} held-out rows ({sum(r.end - r.prompt_length for r in rows)} answer tokens), "
        f"{len(skipped)} skipped, {time.perf_counter() - started:.1f} s"
    )
    print(format_results(results))
    if args.json:
        out = {
            "settings": {k: v for k, v in vars(args).items()},
            "rows": len(rows),
            "skipped": skipped,
            "heads": {name: {str(b): s for b, s in by.items()} for name, by in results.items()},
            # the weights each head folder held (a shipped folder's contents change with the next ship)
            "head_identity": {name: weights_identity(name) for name in results},
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.calibration_out:
        first = checked["budgets"][0]
        (by,) = results.values()
        fitted = to_config(by[first].get("calibration", []), args.min_trials)
        Path(args.calibration_out).write_text(json.dumps(fitted, indent=1) + "\n")
        print(f"fitted calibration maps (budget {first}) written to {args.calibration_out}")
    return results


if __name__ == "__main__":
    main()
