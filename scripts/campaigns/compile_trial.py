"""The Trainer's `torch_compile` trial (issue 39, item 2): the same training run twice on the same store, rows, seed
and precision, once as the config has it and once with `--torch_compile true`, one after the other in one process.
Compilation is kept only if both hold:

- its real step is faster: seconds per step over the steps after the first `--skip` (the first compiles; the later
  recompiles for new batch widths are part of the real cost, so they stay in);
- its held-out loss at the last step is within `--tolerance` (2%) of the eager run's.

    python -m scripts.campaigns.compile_trial --store cache/smollm2-135m --steps 300 --out results/compile-trial

Apply it where `scripts/campaigns/train_step_speed.py` puts compile (+ bf16) ahead of the mode it would replace; on
hosts without that lead (AVX2-only: compile 1.01x) there is nothing to try. Writes OUT/compile_trial.json (both runs,
their step times and losses, the host kind and the verdict) and OUT/compile_trial.md; each run's folder is
OUT/runs/<mode>. Run from the repository root, as a module (`training/` is not an installed package); run nothing
else on the cores meanwhile.
"""

import argparse
import json
from pathlib import Path

from jetspec.host import host_kind
from training import run_trainer
from training.step_timer import StepTimer

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "training" / "configs" / "smollm2-135m.yaml"
MODES = ("eager", "compiled")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="training config both runs start from")
    parser.add_argument("--store", required=True, help="feature store folder (training/feature_store.py)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run; held-out loss at the last")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the step time (compilation)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest relative held-out loss difference")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (the Trainer's default)")
    parser.add_argument("--out", required=True, help="results folder")
    return parser


def check_args(args) -> None:
    if args.steps < 1:
        raise ValueError(f"expected --steps >= 1, got {args.steps}")
    if args.skip < 0 or args.skip >= args.steps:
        raise ValueError(f"expected 0 <= --skip < --steps ({args.steps}), got {args.skip}")
    if not 0 < args.tolerance < 1:
        raise ValueError(f"expected 0 < --tolerance < 1, got {args.tolerance}")
    if not Path(args.config).is_file():
        raise ValueError(f"expected --config to be a training config file, got {args.config!r}")
    if not Path(args.store).is_dir():
        raise ValueError(f"expected --store to be a feature store folder, got {args.store!r}")


def arguments(args, mode: str) -> list[str]:
    """run_trainer's command line of one run: the config, with evaluation only at the last step and nothing kept."""
    overrides = {
        "feature_store": args.store,
        "cache_features": "false",
        "max_steps": args.steps,
        "eval_strategy": "steps",
        "eval_steps": args.steps,  # held-out loss once, at the last step
        "save_strategy": "no",
        "max_train_minutes": 1000,  # the steps end the run, not the config's clock
        "measure_tau_prompts": 0,
        "keep_head_dir": "none",
        "output_dir": Path(args.out) / "runs" / mode,
    }
    if mode == "compiled":
        overrides.update(torch_compile="true", torch_compile_backend=args.backend)
    return [args.config] + [item for key, value in overrides.items() for item in (f"--{key}", str(value))]


def verdict(rows: dict, tolerance: float) -> dict:
    eager, compiled = rows["eager"], rows["compiled"]
    speedup = eager["seconds_per_step"] / compiled["seconds_per_step"]
    loss_change = (compiled["eval_loss"] - eager["eval_loss"]) / eager["eval_loss"]
    faster, close = speedup > 1.0, abs(loss_change) <= tolerance
    return {
        "speedup": speedup,
        "loss_change": loss_change,
        "faster": faster,
        "loss_within_tolerance": close,
        "keep": faster and close,
    }


def markdown(result: dict) -> str:
    rows = result["runs"]
    lines = [
        f"The Trainer's `torch_compile` trial, host kind {result['host_kind']}, {result['steps']} steps per run, "
        f"precision {rows['eager']['precision']}, backend {result['backend']}:",
        "",
        "| run | s/step after step {0} | first {0} steps (s) | train runtime (s) | held-out loss |".format(
            result["skip"]
        ),
        "|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        row = rows[mode]
        lines.append(
            f"| {mode} | {row['seconds_per_step']:.3f} | {row['first_seconds']:.1f} | {row['train_runtime']:.1f} | "
            f"{row['eval_loss']:.4f} |"
        )
    v = result["verdict"]
    lines += [
        "",
        f"Compiled over eager: {v['speedup']:.2f}x per step, held-out loss {v['loss_change']:+.2%} "
        f"(tolerance {result['tolerance']:.0%}): {'keep' if v['keep'] else 'do not keep'} `torch_compile`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for mode in MODES:
        clock = StepTimer()  # its steps, and the precision and compilation the trainer resolved
        metrics = run_trainer.main(arguments(args, mode), [clock])
        rows[mode] = {
            "seconds_per_step": clock.seconds_per_step(args.skip),
            "first_seconds": clock.first_seconds(args.skip),
            "train_runtime": metrics["train_runtime"],
            "eval_loss": metrics["eval_loss"],
            "steps": len(clock.ends),
            "precision": clock.precision,
            "torch_compile": clock.compiled,
        }
        print(f"compile trial: {mode} {rows[mode]['seconds_per_step']:.3f} s/step, loss {rows[mode]['eval_loss']:.4f}")
    result = {
        "host_kind": host_kind().name,
        "config": str(args.config),
        "store": str(args.store),
        "steps": args.steps,
        "skip": args.skip,
        "tolerance": args.tolerance,
        "backend": args.backend,
        "runs": rows,
        "verdict": verdict(rows, args.tolerance),
    }
    (out / "compile_trial.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "compile_trial.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
