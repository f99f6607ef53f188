"""Choosing a reduced draft vocabulary from token frequencies (FR-Spec; EAGLE-3's `d2t`).

The head drafts only inside the `draft_vocab_size` tokens the target writes most often in the regenerated answers.
Verification is untouched, so decoding stays lossless; a token outside the subset simply cannot be drafted, and
the coverage (the share of answer tokens inside the subset) bounds the per-depth acceptance from above.
"""

from collections import Counter

import torch


def answer_token_counts(dataset) -> Counter:
    """Counts of every token in the answers (`input_ids[prompt_length:]`) of a regenerated dataset."""
    counts: Counter = Counter()
    for ids, prompt_length in zip(dataset["input_ids"], dataset["prompt_length"]):
        counts.update(ids[prompt_length:])
    return counts


def frequent_tokens(counts: Counter, size: int, vocab_size: int) -> tuple[torch.LongTensor, float]:
    """
    The `size` most frequent token ids, most frequent first (ties by id), and their coverage of all counted
    tokens. Frequency order lets a head trained with this vocabulary be restricted later to its N most frequent
    tokens ([`JetSpecDraftModel.restrict_draft_vocab`]).

    Args:
        counts (`Counter`): token id -> count, from [`answer_token_counts`].
        size (`int`): draft vocabulary size, at most `vocab_size`.
        vocab_size (`int`): the target's vocabulary size; ids never seen fill the subset in id order when fewer
            than `size` distinct tokens were counted.

    Returns:
        `(ids, coverage)`: `torch.LongTensor` of shape `(size,)` and a float in [0, 1].
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"expected a draft vocabulary size in [1, {vocab_size}], got {size}")
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"expected token ids in [0, {vocab_size}), got {bad[:5]}")
    chosen = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]]
    if len(chosen) < size:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: size - len(chosen)]
    total = sum(counts.values())
    coverage = sum(counts[t] for t in chosen) / total if total else 0.0
    return torch.tensor(chosen, dtype=torch.long), coverage
