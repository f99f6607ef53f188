"""Short training runs of head variants on one feature store, side by side: held-out agreement per depth, the chain
tau it implies, and seconds per step, so variants compare per CPU-minute as well as per step.

    python -m training.feature_store --data training/data/smollm2-135m-mix.npz --out cache/smollm2-135m
    python -m scripts.ablate_head --store cache/smollm2-135m --steps 300 --out results/ablation \
        --variants baseline gamma4 layers2 no_last_context blocks32 vocab4096

Every variant starts from the committed config (training/configs/smollm2-135m.yaml) with the same data, split and
seed, and changes one thing. `--minutes M` gives every variant the same wall-clock instead of the same steps: a short
probe run times the variant's step, and the real run gets the steps that fill M minutes (its cosine schedule ends
there; the probe times its steady steps, after the first few; the table gives the minutes each really trained):

    python -m scripts.ablate_head --store cache/smollm2-135m-fp32 --data training/data/smollm2-135m-mix-fp32.npz \
        --minutes 8 --out results/ablation-wallclock --variants baseline layers2 layers3 init_target block16 warm

The loss and block-attention axes (the baseline is forward KL, a causal block, gamma 4):

    python -m scripts.ablate_head --store cache/smollm2-135m-fp32 --data training/data/smollm2-135m-mix-fp32.npz \
        --minutes 8 --out results/ablation-losses --variants baseline kl_tv topk_rank sft reverse_kl gamma0 \
        bidir_gamma4 bidir_gamma0
 Results: OUT/ablation.json and OUT/ablation.md; each variant's run (its head, logs
and curve) in RUNS/<variant>; the results name the host kind (jetspec.host). Run from the repository root, as a
module (`training/` is not an installed package).
"""

import argparse
import json
import time
from pathlib import Path

import yaml
from transformers import TrainerCallback

from jetspec.host import host_kind
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
    "layers3": ["--num_hidden_layers", "3"],
    "init_target": ["--init_layers_from_target", "true"],
    "layers2_init_target": ["--num_hidden_layers", "2", "--init_layers_from_target", "true"],
    "block16": ["--block_size", "16"],
    # warm restart: continue from the committed head (its architecture and draft vocabulary) on this data
    "warm": ["--init_head", "jetspec/heads/smollm2-135m"],
    # the committed head as shipped, for reference: one step at learning rate 0 (Adam moves nothing), then evaluated
    "committed": ["--init_head", "jetspec/heads/smollm2-135m", "--learning_rate", "0"],
    # the loss (training/losses.py): acceptance-aware additions to forward KL, and the paper's hard-label and reverse KL
    "kl_tv": ["--loss", "kl_tv"],
    "topk_rank": ["--loss", "topk_rank"],
    "sft": ["--loss", "sft"],
    "reverse_kl": ["--loss", "rkl"],
    # the block attention at gamma 4 (the config's) and without position decay ("gamma 0": the config's gamma removed)
    "gamma0": [],
    "bidir_gamma4": ["--block_attention", "bidirectional"],
    "bidir_gamma0": ["--block_attention", "bidirectional"],
}
UNSET = {"gamma0": ("gamma",), "bidir_gamma0": ("gamma",)}  # config keys a variant removes (no flag says None)
PROBE_STEPS = 12  # the probe times its steps after the first PROBE_SKIP, which carry one-off costs
PROBE_SKIP = 3


class StepTimer(TrainerCallback):
    """Wall-clock time at the end of every optimizer step."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        steady = self.ends[PROBE_SKIP - 1 :]
        return (steady[-1] - steady[0]) / (len(steady) - 1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "training/configs/smollm2-135m.yaml"))
    parser.add_argument("--store", required=True, help="feature store folder (training/feature_store.py)")
    parser.add_argument("--data", default=None, help="override the config's data (one .npz or folder)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_fraction", type=float, default=None, help="override the config's held-out share")
    parser.add_argument("--minutes", type=float, default=None,
                        help="equal wall-clock instead of equal steps: train each variant for about this long")
    parser.add_argument("--out", default="results/ablation")
    parser.add_argument("--runs", default=str(REPO / "runs" / "ablation"), help="folder of the variants' runs")
    parser.add_argument("--variants", nargs="+", default=["baseline"], choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "ablation.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if args.minutes is not None and args.minutes <= 0:
        raise ValueError(f"expected --minutes > 0, got {args.minutes}")
    budget = {"minutes": args.minutes} if args.minutes is not None else {"steps": args.steps}
    host = host_kind()

    def config_of(name: str, run: str) -> str:
        """The config file of a variant: the given one, or a copy without the keys the variant removes."""
        if name not in UNSET:
            return args.config
        values = yaml.safe_load(Path(args.config).read_text())
        for key in UNSET[name]:
            values.pop(key, None)
        path = Path(args.runs) / f"{run}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(values, sort_keys=False))
        return str(path)

    def arguments(name: str, steps: int, run: str) -> list[str]:
        common = [config_of(name, run), "--feature_store", args.store, "--cache_features", "false", "--max_steps",
                  str(steps), "--eval_steps", str(steps), "--save_strategy", "no",
                  "--max_train_minutes", "1000", "--measure_tau_prompts", "0", "--warmup_steps",
                  str(max(1, steps // 20)), "--output_dir", str(Path(args.runs) / run)]
        if args.data:
            common += ["--data", args.data]
        if args.eval_fraction is not None:
            common += ["--eval_fraction", str(args.eval_fraction)]
        return common + VARIANTS[name]

    for name in args.variants:
        if name in summary and all(summary[name].get(key) == value for key, value in budget.items()):
            print(f"ablation: {name} already measured, skipped")
            continue
        steps = args.steps
        if args.minutes is not None:
            timer = StepTimer()
            run_trainer.main(arguments(name, PROBE_STEPS, f"{name}-probe") + ["--eval_strategy", "no"], [timer])
            pace = timer.seconds_per_step()
            steps = max(1, int(args.minutes * 60 / pace))
            print(f"ablation: {name} at {pace:.2f} s/step gets {steps} steps")
        started = time.perf_counter()
        metrics = run_trainer.main(arguments(name, steps, name))
        depths = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("eval_acc_depth_"))
        summary[name] = {
            "change": " ".join(VARIANTS[name] + [f"(no {key})" for key in UNSET.get(name, ())])
                      or "(committed config)",
            "host_kind": host.name,
            **budget,
            "steps": steps,
            "seconds_per_step": metrics["train_runtime"] / steps,
            "wall_seconds": time.perf_counter() - started,
            "eval_loss": metrics["eval_loss"],
            "acc_per_depth": [metrics[f"eval_acc_depth_{d}"] for d in depths],
            "tau_chain": metrics["eval_tau_chain"],
        }
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["| variant | change | budget | steps | s/step | train min | eval loss | depth 1 | depth 2 | depth 3 | chain tau |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in summary.items():
        acc = row["acc_per_depth"]
        budget_of_row = f"{row['minutes']:g} min" if "minutes" in row else f"{row['steps']} steps"
        lines.append(f"| {name} | `{row['change']}` | {budget_of_row} | {row['steps']} | {row['seconds_per_step']:.2f} | "
                     f"{row['seconds_per_step'] * row['steps'] / 60:.1f} | {row['eval_loss']:.3f} | "
                     f"{acc[0]:.3f} | {acc[1]:.3f} | {acc[2]:.3f} | {row['tau_chain']:.3f} |")
    kinds = sorted({row.get("host_kind", "not recorded") for row in summary.values()})
    header = (f"Store {args.store}, data {args.data or 'of the config'}; each variant trained for its budget "
              f"(wall-clock minutes, or steps); host kind {', '.join(kinds)}\n\n")
    (out / "ablation.md").write_text(header + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    main()
