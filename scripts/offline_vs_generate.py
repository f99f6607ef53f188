"""The offline evaluator (`training.evaluate_head`) against reality: on rows the target answered greedily in float32,
real `generate(..., assistant_model=head)` in float32 and the offline replay of the same rows should take the same
rounds. This script runs three figures on the same held-out rows and reports tau from each, per row and in all:

- `generate`: the head decoding the row's prompt for real, float32 target, batch 1, the head's defaults;
- `offline (fp32 features)`: the replay fed the float32 target's features of the stored rows (one target forward per
  row): the same rounds as `generate` wherever `generate` reproduces the stored answer;
- `offline (store)`: the replay fed the feature store's bf16 features, as training and `evaluate_head` use them:
  differs from the above through the store's bf16 rounding (and, for a store a bf16 target computed, its bf16
  arithmetic);
- `offline (bf16 target features)`, with `--bf16_features`: the replay fed the features a bfloat16 target computes
  for the rows, which is what a store built with `--dtype bfloat16` holds (the store the published offline figures
  replayed), whatever the store at hand was built with.

    python -m scripts.offline_vs_generate --feature_store cache/smollm2-135m --max_new_tokens 128 \
        --json results/offline-vs-generate/shipped.json

Every held-out row is kept (`--rows` caps them; default all of the two float32 files' held-out rows). A row whose
`generate` output leaves its stored answer (a float32 answer regenerated on another host may differ at a numerical
tie) is counted in every figure and also reported apart: the figures over all rows and over the rows equal to their
stored answer, and the differences between them.
"""

import argparse
import json
from pathlib import Path

import torch

from jetspec.host import host_kind
from jetspec.provenance import weights_identity
from jetspec.targets import load_target
from modeling_jetspec import JetSpecDraftModel
from training.evaluate_head import (
    decode_rows,
    evaluate,
    forward_features,
    held_out_rows,
    prepare_rows,
    store_features,
    tree_shape,
)
from training.feature_store import FeatureStore


FP32_FILES = ["training/data/smollm2-135m-mix-fp32.npz", "training/data/smollm2-135m-mix-fp32-more.npz"]


def real_generate(target, head, rows: list, max_new_tokens: int) -> list:
    """Per row: real float32 `generate` with the head at batch 1 (`evaluate_head.decode_rows`), its rounds and
    tokens, and whether its answer is the stored one."""
    out = []
    for row, decoded in zip(rows, decode_rows(target, head, rows, max_new_tokens, progress=True)):
        prompt_length = int(row["prompt_length"])
        answer = decoded["answer"]
        stored = list(row["input_ids"][prompt_length : prompt_length + len(answer)])
        out.append(
            {
                "id": decoded["id"],
                "rounds": decoded["rounds"],
                "tokens": decoded["tokens"],
                "same_text": answer == stored,
            }
        )
    return out


def tau_of(entries: list, ids: set | None = None) -> dict:
    """Committed tokens per round over `entries` (those of `ids`, when given)."""
    chosen = [e for e in entries if ids is None or e["id"] in ids]
    rounds, tokens = sum(e["rounds"] for e in chosen), sum(e["tokens"] for e in chosen)
    return {"rows": len(chosen), "rounds": rounds, "tokens": tokens, "tau": tokens / rounds if rounds else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="jetspec/heads/smollm2-135m")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--data", nargs="+", default=FP32_FILES)
    parser.add_argument("--feature_store", default=None, help="Also replay with the store's bf16 features.")
    parser.add_argument("--rows", type=int, default=None, help="At most this many held-out rows (default: all).")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--eval_fraction", type=float, default=0.02)
    parser.add_argument(
        "--bf16_features", action="store_true", help="Also replay features a bfloat16 target computes for the rows."
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if (args.rows is not None and args.rows < 1) or args.max_new_tokens < 1:
        raise ValueError(f"expected --rows >= 1 and --max_new_tokens >= 1, got {args.rows} and {args.max_new_tokens}")

    rows = [dict(r) for r in held_out_rows(args.data, args.eval_fraction, 0, args.rows)]
    target, _ = load_target(args.target, dtype=torch.float32)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=torch.float32).eval()
    head.attach_target(target)
    shape = tree_shape(head)

    figures = {"generate": real_generate(target, head, rows, args.max_new_tokens)}
    same = {e["id"] for e in figures["generate"] if e["same_text"]}
    sources = {"offline_fp32_features": forward_features(target, head)}
    if args.feature_store:
        sources["offline_store_features"] = store_features(FeatureStore(args.feature_store))
    if args.bf16_features:
        bf16_target, _ = load_target(args.target, dtype=torch.bfloat16)
        sources["offline_bf16_target_features"] = forward_features(bf16_target, head)
    skipped = {}
    for name, fetch in sources.items():
        print(f"{name}: replaying {len(rows)} rows", flush=True)  # each replay takes a minute or two on 2 cores
        prepared, skipped[name] = prepare_rows(rows, fetch, args.max_new_tokens, shape.depth)
        summary = evaluate(head, prepared, shape, first_round=False).summary()
        figures[name] = [{"id": e["id"], "rounds": e["rounds"], "tokens": e["tokens"]} for e in summary["per_row"]]
    report = {
        "host": host_kind().name,
        "head": args.head,
        "head_identity": weights_identity(args.head),  # the folder's weights, whatever it holds later
        "data": args.data,
        "max_new_tokens": args.max_new_tokens,
        "feature_store": args.feature_store,
        "rows": len(rows),
        "rows_equal_to_stored": len(same),
        "rows_leaving_stored": sorted({str(r["id"]) for r in rows} - same),
        "skipped": skipped,
        "all_rows": {name: tau_of(entries) for name, entries in figures.items()},
        "rows_equal_to_stored_only": {name: tau_of(entries, same) for name, entries in figures.items()},
        "per_row": figures,
    }
    print(render(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def render(report: dict) -> str:
    lines = [
        f"host kind {report['host']}; head {report['head']}; {report['rows']} held-out rows x {report['max_new_tokens']} "
        f"tokens; {report['rows_equal_to_stored']} rows' generate output equals the stored answer",
        "| figure | tau, all rows | tau, rows equal to stored | difference |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, entry in report["all_rows"].items():
        kept = report["rows_equal_to_stored_only"][name]
        lines.append(f"| {name} | {entry['tau']:.4f} | {kept['tau']:.4f} | {kept['tau'] - entry['tau']:+.4f} |")
    real_all, real_kept = report["all_rows"]["generate"]["tau"], report["rows_equal_to_stored_only"]["generate"]["tau"]
    for name in report["all_rows"]:
        if name != "generate":
            mine_all = report["all_rows"][name]["tau"]
            mine_kept = report["rows_equal_to_stored_only"][name]["tau"]
            lines.append(
                f"{name} - generate: {mine_all - real_all:+.4f} over all rows, "
                f"{mine_kept - real_kept:+.4f} over the rows equal to stored"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
