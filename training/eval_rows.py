"""The rows the offline evaluator scores: the trainer's held-out rows ([`held_out_rows`]), their target features
(from a feature store, [`store_features`], or a target forward, [`forward_features`]) prepared as [`EvalRow`]s
([`prepare_rows`]), and the reference the replay is checked against: real `generate` with the head
([`decode_rows`]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm

from .rows import row_key


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
