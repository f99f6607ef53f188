"""Step time of the warm-started head with and without flush-to-zero of denormals, and of a new head: 80 steps of
the committed config each, the same seed and rows, alone on the cores. Run from the repository root:

    python -m scripts.campaigns.warm_step_probe          # writes results/warm-step-probe/result.json
"""

import json
from pathlib import Path

import torch

from training import run_trainer
from training.step_timer import StepTimer

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "results" / "warm-step-probe"

COMMON = [
    "training/configs/smollm2-135m.yaml",
    *("--feature_store cache/smollm2-135m --cache_features false --max_steps 80 --eval_strategy no".split()),
    *(
        "--save_strategy no --max_train_minutes 1000 --measure_tau_prompts 0 --warmup_steps 4 --keep_head_dir none".split()
    ),
]
CASES = [  # (name, extra flags, flush denormals)
    ("warm", ["--init_head", "jetspec/heads/smollm2-135m"], False),
    ("warm_flush", ["--init_head", "jetspec/heads/smollm2-135m"], True),
    ("new", [], False),
    ("new_flush", [], True),
]


def main() -> dict:
    out = {}
    for name, extra, flush in CASES:
        torch.set_flush_denormal(flush)
        timer = StepTimer()
        run_trainer.main(COMMON + extra + ["--output_dir", f"runs/denormal/{name}"], [timer])
        out[name] = timer.seconds_per_step(skip=10)
        print("PROBE", name, out[name], flush=True)
    (OUT / "result.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
