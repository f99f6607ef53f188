"""The offline evaluator (`training.evaluate_head`) against reality: on rows the target answered greedily in float32,
real `generate(..., assistant_model=head)` in float32 and the offline replay of the same rows should take the same
rounds. This script runs both on the same rows and reports tau from each, per row and in all:

- `generate`: the head decoding the row's prompt for real, float32 target, batch 1, the head's defaults;
- `offline (fp32 features)`: the replay fed the float32 target's features of the stored rows (one target forward per
  row): the same numbers as `generate` wherever `generate` reproduces the stored answer;
- `offline (store)`: the replay fed the feature store's bf16 features, as training and `evaluate_head` use them:
  differs from the above only through the store's bf16 rounding.

    python -m scripts.offline_vs_generate --data training/data/smollm2-135m-mix-fp32.npz \
        --feature_store cache/smollm2-135m --rows 8 --max_new_tokens 128

Rows whose `generate` output leaves the stored answer (a float32 answer regenerated on another host may differ at a
numerical tie) are reported and left out of the comparison.
"""

import argparse
import json

import torch

from jetspec.host import host_kind
from jetspec.targets import load_target
from modeling_jetspec import JetSpecDraftModel
from training.evaluate_head import evaluate, forward_features, held_out_rows, prepare_rows, store_features, tree_shape
from training.feature_store import FeatureStore


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="jetspec/heads/smollm2-135m")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--data", nargs="+", default=["training/data/smollm2-135m-mix-fp32.npz"])
    parser.add_argument("--feature_store", default=None, help="Also replay with the store's bf16 features.")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--eval_fraction", type=float, default=0.02)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.max_new_tokens < 1:
        raise ValueError(f"expected --rows >= 1 and --max_new_tokens >= 1, got {args.rows} and {args.max_new_tokens}")

    rows = [dict(r) for r in held_out_rows(args.data, args.eval_fraction, 0, args.rows)]
    target, _ = load_target(args.target, dtype=torch.float32)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=torch.float32).eval()
    head.attach_target(target)
    shape = tree_shape(head)

    real, kept = [], []
    for row in rows:
        prompt_length = int(row["prompt_length"])
        ids = torch.tensor([row["input_ids"][:prompt_length]])
        out = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            assistant_model=head,
            return_dict_in_generate=True,
        )
        answer = out.sequences[0, prompt_length:].tolist()
        stored = list(row["input_ids"][prompt_length : prompt_length + len(answer)])
        stats = out.jetspec_stats
        same = answer == stored
        real.append({"id": row["id"], "rounds": stats.row_rounds, "tokens": stats.round_tokens, "same_text": same})
        if same:
            kept.append(row)
    report = {
        "host": host_kind().name,
        "head": args.head,
        "rows": len(rows),
        "rows_equal_to_stored": len(kept),
        "per_row_generate": real,
    }
    if not kept:
        raise SystemExit("no row's generate output equals its stored answer: nothing to compare")
    same_rows = [r for r in real if r["same_text"]]
    report["generate_tau"] = sum(r["tokens"] for r in same_rows) / sum(r["rounds"] for r in same_rows)
    sources = {"offline_fp32_features": forward_features(target, head)}
    if args.feature_store:
        sources["offline_store_features"] = store_features(FeatureStore(args.feature_store))
    for name, fetch in sources.items():
        prepared, skipped = prepare_rows(kept, fetch, args.max_new_tokens, shape.depth)
        tally = evaluate(head, prepared, shape, first_round=False)
        summary = tally.summary()
        report[name] = {"tau": summary["tau"], "rounds": summary["rounds"], "skipped": len(skipped)}
    lines = [
        f"host kind {report['host']}; {len(kept)} of {len(rows)} rows' generate output equals the stored answer",
        f"generate (float32): tau {report['generate_tau']:.4f} over {sum(r['rounds'] for r in same_rows)} rounds",
    ]
    for name in sources:
        entry = report[name]
        lines.append(
            f"{name}: tau {entry['tau']:.4f} over {entry['rounds']} rounds "
            f"(difference {entry['tau'] - report['generate_tau']:+.4f})"
        )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
