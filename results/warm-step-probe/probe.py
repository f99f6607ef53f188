"""Step time of the warm-started head with and without flush-to-zero of denormals, and of a new head (session 47)."""
import json, sys, time
import torch
sys.path.insert(0, ".")
from scripts.ablate_head import StepTimer
from training import run_trainer

common = ["training/configs/smollm2-135m.yaml", "--feature_store", "cache/smollm2-135m", "--cache_features", "false",
          "--max_steps", "80", "--eval_strategy", "no", "--save_strategy", "no", "--max_train_minutes", "1000",
          "--measure_tau_prompts", "0", "--warmup_steps", "4", "--keep_head_dir", "none"]
out = {}
for name, extra, flush in [("warm", ["--init_head", "jetspec/heads/smollm2-135m"], False),
                           ("warm_flush", ["--init_head", "jetspec/heads/smollm2-135m"], True),
                           ("new", [], False), ("new_flush", [], True)]:
    torch.set_flush_denormal(flush)
    timer = StepTimer()
    run_trainer.main(common + extra + ["--output_dir", f"runs/denormal/{name}"], [timer])
    out[name] = timer.seconds_per_step(skip=10)
    print("PROBE", name, out[name], flush=True)
json.dump(out, open("results/warm-step-probe/result.json", "w"), indent=1)
