"""Short training runs of head variants on one feature store, side by side: held-out agreement per depth, the chain
tau it implies, and seconds per step, so variants compare per CPU-minute as well as per step.

    python -m training.feature_store --data training/data/smollm2-135m-mix.npz --out cache/smollm2-135m
    python -m scripts.ablate_head --store cache/smollm2-135m --steps 300 --out results/ablation \
        --variants baseline gamma4 layers2 no_last_context blocks32 vocab4096

Every variant starts from the committed config (training/configs/smollm2-135m.yaml) with the same data, split and
seed, and changes one thing. Results: OUT/ablation.json and OUT/ablation.md; each variant's run (its head, logs
and curve) in RUNS/<variant>. Run from the repository root, as a module (`training/` is not an installed package).
"""

import argparse
import json
import time
from pathlib import Path

from training import run_trainer

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "baseline": [],
    "gamma4": ["--gamma", "4"],
    "gamma7": ["--gamma", "7"],
    "layers2": ["--num_hidden_layers", "2"],
    "no_last_context": ["--last_context_input", "false"],
    "blocks32": ["--num_blocks_per_sequence", "32"],
    "blocks8": ["--num_blocks_per_sequence", "8"],
    "vocab4096": ["--draft_vocab_size", "4096"],
    "lr1e-3": ["--learning_rate", "1e-3"],
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "training/configs/smollm2-135m.yaml"))
    parser.add_argument("--store", required=True, help="feature store folder (training/feature_store.py)")
    parser.add_argument("--data", default=None, help="override the config's data (one .npz or folder)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="results/ablation")
    parser.add_argument("--runs", default=str(REPO / "runs" / "ablation"), help="folder of the variants' runs")
    parser.add_argument("--variants", nargs="+", default=["baseline"], choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "ablation.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for name in args.variants:
        if name in summary and summary[name].get("steps") == args.steps:
            print(f"ablation: {name} already measured, skipped")
            continue
        common = [args.config, "--feature_store", args.store, "--cache_features", "false", "--max_steps",
                  str(args.steps), "--eval_steps", str(args.steps), "--save_strategy", "no",
                  "--max_train_minutes", "1000", "--measure_tau_prompts", "0", "--warmup_steps",
                  str(max(1, args.steps // 20)), "--output_dir", str(Path(args.runs) / name)]
        if args.data:
            common += ["--data", args.data]
        started = time.perf_counter()
        metrics = run_trainer.main(common + VARIANTS[name])
        depths = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("eval_acc_depth_"))
        summary[name] = {
            "change": " ".join(VARIANTS[name]) or "(committed config)",
            "steps": args.steps,
            "seconds_per_step": metrics["train_runtime"] / args.steps,
            "wall_seconds": time.perf_counter() - started,
            "eval_loss": metrics["eval_loss"],
            "acc_per_depth": [metrics[f"eval_acc_depth_{d}"] for d in depths],
            "tau_chain": metrics["eval_tau_chain"],
        }
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["| variant | change | s/step | eval loss | depth 1 | depth 2 | depth 3 | chain tau |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in summary.items():
        acc = row["acc_per_depth"]
        lines.append(f"| {name} | `{row['change']}` | {row['seconds_per_step']:.2f} | {row['eval_loss']:.3f} | "
                     f"{acc[0]:.3f} | {acc[1]:.3f} | {acc[2]:.3f} | {row['tau_chain']:.3f} |")
    header = f"{args.steps} steps per variant, store {args.store}\n\n"
    (out / "ablation.md").write_text(header + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    main()
