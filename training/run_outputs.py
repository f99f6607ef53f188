"""What a training run leaves in its output folder once trained: the head (`save_pretrained`, with the lookup prior
measured on the training rows), its model card `README.md`, `training_log.json` (the Trainer's log history),
`learning_curve.png` and `metrics.json`; uploaded with `--push_to_hub` (see `training/shipping.py`).
"""

import json
from pathlib import Path

from .arguments import DataArguments, HeadArguments, JetSpecTrainingArguments
from .eval_rows import decode_rows
from .lookup_prior import measure_lookup_prior
from .rows import first_rows
from .run_setup import describe_rows
from .shipping import push_folder, write_card
from .trainer import unwrap_head

LOOKUP_PRIOR_ROWS = 1000  # training rows the lookup prior is measured on (about 5 s per 1,000 rows)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
LOSS_NAMES = {
    "fkl": "forward KL(p_target || q_draft) on every MASK slot (soft labels)",
    "sft": "cross-entropy on the target's tokens (hard labels)",
    "rkl": "reverse KL(q_draft || p_target) on every MASK slot",
    "kl_tv": "forward KL plus total variation TV(p_target, q_draft) = 1 - acceptance, on every MASK slot",
    "topk_rank": "forward KL plus a ranking loss on the target's top-8 tokens (HASS), on every MASK slot",
}


def measure_tau(head, target, rows, max_new_tokens: int) -> dict:
    """Decode the prompts of `rows` one at a time with the head ([`training.eval_rows.decode_rows`]); tokens per target
    verify forward, and per depth."""
    decoded = decode_rows(target, head, rows, max_new_tokens)
    rounds, tokens = sum(r["rounds"] for r in decoded), sum(r["tokens"] for r in decoded)
    depth_counts = [sum(counts) for counts in zip(*(r["accepted_at_depth"] for r in decoded))]
    return {
        "tau": tokens / max(rounds, 1),
        "rounds": rounds,
        "acceptance_per_depth": [c / max(rounds, 1) for c in depth_counts],
    }


def tau_table(eval_metrics: dict, measured: dict | None) -> str:
    lines = ["| measure | value |", "|---|---|"]
    if measured:
        lines.append(f"| tau, tree decoding, {measured['rounds']} rounds (measured) | {measured['tau']:.3f} |")
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in eval_metrics if k.startswith("eval_acc_depth_"))
    if "eval_tau_chain" in eval_metrics:
        lines.append(f"| tau, chain, from held-out top-1 agreement | {eval_metrics['eval_tau_chain']:.3f} |")
    for d in depths:
        lines.append(f"| top-1 agreement at depth {d} | {eval_metrics[f'eval_acc_depth_{d}']:.3f} |")
    return "\n".join(lines) if len(lines) > 2 else "Not measured."


def write_learning_curve(log_history: list, path: Path) -> Path | None:
    """Held-out top-1 agreement per depth (the eval logs) against training steps and, where the Trainer counted them,
    against the target tokens the head has been trained on, as a PNG; None without eval logs."""
    evals = [entry for entry in log_history if "eval_acc_depth_1" in entry]
    if not evals:
        return None
    from matplotlib.figure import Figure

    depths = sorted(int(k.rsplit("_", 1)[1]) for k in evals[0] if k.startswith("eval_acc_depth_"))
    axes_x = [("step", "training step", 1.0)]
    if all("num_input_tokens_seen" in entry for entry in evals):
        axes_x.append(("num_input_tokens_seen", "target tokens seen (millions)", 1e-6))
    offline = [entry for entry in log_history if "eval_offline_tau" in entry]
    panels = len(axes_x) + (1 if offline else 0)
    figure = Figure(figsize=(6 * panels, 4))
    if offline:
        axes = figure.add_subplot(1, panels, panels)
        axes.plot([e["step"] for e in offline], [e["eval_offline_tau"] for e in offline], marker="o", color="k")
        axes.set_xlabel("training step")
        axes.set_ylabel("offline tau at the defaults (held-out answers)")
        axes.grid(alpha=0.3)
    for column, (key, label, scale) in enumerate(axes_x, start=1):
        axes = figure.add_subplot(1, panels, column)
        xs = [entry[key] * scale for entry in evals]
        for d in depths:
            axes.plot(xs, [entry[f"eval_acc_depth_{d}"] for entry in evals], marker="o", label=f"depth {d}")
        axes.set_xlabel(label)
        axes.set_ylabel("held-out top-1 agreement with the target")
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def ship(
    trainer,
    head_args: HeadArguments,
    data_args: DataArguments,
    args: JetSpecTrainingArguments,
    metrics: dict,
    eval_set,
    train_set,
    target,
    push: bool,
    repo_id,
) -> None:
    """Main process only: save the head, measure tau, write the card, logs and curve, push on request."""
    out = Path(args.output_dir)
    final = unwrap_head(trainer.model)
    if head_args.use_lora:
        final = trainer.model.merge_and_unload()  # a plain head: the Hub folder needs no peft to load
    # the odds of prompt-lookup chains on the target's own answers: the head scores its lookup branch with them
    sample = first_rows(train_set, LOOKUP_PRIOR_ROWS)  # a stream's first rows
    depth = max(final.config.tree_depth, final.config.tree_lookup)
    lookup = measure_lookup_prior(zip(sample["input_ids"], sample["prompt_length"]), depth)
    if lookup["prior"] is not None:
        final.config.tree_lookup_prior = lookup["prior"]
    metrics["lookup_matches_per_order"] = lookup["matches"]
    final.save_pretrained(out)
    measured = None
    if args.measure_tau_prompts > 0 and eval_set is not None:
        rows = eval_set.select(range(min(args.measure_tau_prompts, len(eval_set))))
        measured = measure_tau(final, target, rows, args.measure_tau_new_tokens)
        metrics.update({f"measured_{k}": v for k, v in measured.items()})
    base_model = args.base_model_id or HUB_IDS.get(head_args.target, head_args.target)
    gamma = f", position decay gamma={args.gamma} (weights scaled to mean 1)" if args.gamma else ""
    write_card(
        out,
        args.card_template,
        base_model=base_model,
        repo_id=repo_id or f"<your-org>/jetspec-{Path(str(head_args.target)).name}",  # a placeholder id until pushed
        max_depth=final.config.block_size - 1,
        num_hidden_layers=final.config.num_hidden_layers,
        block_size=final.config.block_size,
        training_data=", ".join(data_args.data) + " (prompts answered by the target itself, greedy)",
        loss=LOSS_NAMES[args.loss] + gamma,
        steps=trainer.state.global_step,
        num_train_rows=describe_rows(train_set),
        num_eval_rows=len(eval_set) if eval_set is not None else 0,
        tau_table=tau_table(metrics, measured),
        licence="Apache-2.0 for the head's weights and code. The target's own licence governs the target.",
    )
    (out / "training_log.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    write_learning_curve(trainer.state.log_history, out / "learning_curve.png")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if push:
        push_folder(out, repo_id, private=args.hub_private_repo)
