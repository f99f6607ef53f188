"""How often a prompt-lookup chain is accepted, per n-gram order: the head's `tree_lookup_prior`.

At every answer position of the target's own (greedy) answers, the lookup branch would draft the tokens that
followed the most recent earlier occurrence of the last 3 (else 2, else 1) tokens. Comparing that chain with the
tokens the target actually wrote next gives, per match order n, the fraction of chains with at least k tokens
accepted. Decoding scores the chain's tokens with these odds, so a trigram match (right most of the time) fills the
tree while a unigram match (right about one time in four) takes only the nodes it earns against the head's.

    python -m training.lookup_prior --data training/data/smollm2-135m-mix.npz --head jetspec/heads/smollm2-135m

measures on the training split's rows and writes the table into the head's `config.json`.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from modeling_jetspec.tree import LOOKUP_MAX_NGRAM, lookup_match

from .rows import TRAINING_COLUMNS, load_source, split_train_eval


def measure_lookup_prior(rows, depth: int, max_ngram: int = LOOKUP_MAX_NGRAM, progress: bool = False) -> dict:
    """Survival fractions of lookup chains on answers, per match order.

    Args:
        rows (iterable of `(input_ids, prompt_length)`): full sequences (prompt, then the target's answer).
        depth (`int`): the longest chain measured (the head's `tree_depth`).
        max_ngram (`int`, *optional*, defaults to 3): the longest suffix matched, as decoding matches.
        progress (`bool`, *optional*, defaults to `False`): a tqdm bar over rows.

    Returns:
        `{"prior": [[P(at least k accepted) for k = 1..depth] per order 1..max_ngram], "matches": [count per order],
        "positions": answer positions seen}`. An order never matched gets the pooled fractions of all orders, so
        every row is usable; with no match at all `"prior"` is None (nothing to score chains by).
    """
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"expected depth >= 1, got {depth!r}")
    hist = np.zeros((max_ngram, depth + 1), dtype=np.int64)  # [order - 1, tokens accepted]
    positions = 0
    for ids, prompt_length in tqdm(rows, desc="lookup prior", disable=not progress):
        ids = [int(t) for t in ids]
        prompt_length = int(prompt_length)
        if not 1 <= prompt_length <= len(ids):
            raise ValueError(f"expected a prompt length in [1, {len(ids)}], got {prompt_length}")
        # position t: the anchor is ids[t] (committed), the chain guesses ids[t + 1 :]
        for t in range(prompt_length - 1, len(ids) - 1):
            positions += 1
            chain, order = lookup_match(ids[: t + 1], depth, max_ngram)
            if not chain:
                continue
            accepted = 0
            for guess, truth in zip(chain, ids[t + 1 : t + 1 + depth]):
                if guess != truth:
                    break
                accepted += 1
            hist[order - 1, accepted] += 1
    matches = hist.sum(axis=1)
    if matches.sum() == 0:
        return {"prior": None, "matches": [0] * max_ngram, "positions": positions}
    pooled = hist.sum(axis=0)

    def survival(counts):
        total = counts.sum()
        at_least = np.cumsum(counts[::-1])[::-1][1:] / total  # P(accepted >= k), k = 1..depth
        return [round(float(max(x, 1e-4)), 4) for x in at_least]  # never 0: a log-prob must exist; 4 decimals

    prior = [survival(hist[n] if matches[n] else pooled) for n in range(max_ngram)]
    return {"prior": prior, "matches": [int(m) for m in matches], "positions": positions}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a compact regenerated file (.npz) or regenerate folder")
    parser.add_argument("--head", required=True, help="a saved head folder: its config.json gets the table")
    parser.add_argument("--max_rows", type=int, default=1000, help="training rows measured (default 1000)")
    parser.add_argument(
        "--depth", type=int, default=16, help="longest chain measured (default 16; longer chains repeat the last ratio)"
    )
    parser.add_argument("--eval_fraction", type=float, default=0.02, help="as the trainer's: its rows are skipped")
    args = parser.parse_args(argv)
    source = args.data
    dataset = load_source(source)
    train, _ = split_train_eval(dataset.select_columns(TRAINING_COLUMNS), args.eval_fraction, 0)
    train = train.select(range(min(args.max_rows, len(train))))
    config_path = Path(args.head) / "config.json"
    config = json.loads(config_path.read_text())
    result = measure_lookup_prior(zip(train["input_ids"], train["prompt_length"]), args.depth, progress=True)
    if result["prior"] is None:
        raise ValueError(
            f"expected lookup matches in the answers of {source}, got none in {result['positions']} positions"
        )
    config["tree_lookup_prior"] = result["prior"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(
        json.dumps(
            {
                "matches_per_order": result["matches"],
                "positions": result["positions"],
                "tree_lookup_prior": config["tree_lookup_prior"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
