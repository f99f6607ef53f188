"""Distill a JetSpec draft head from a target with the transformers `Trainer` and ship it.

    python training/run_trainer.py training/configs/smollm2-135m.yaml [--max_steps 10 ...]
    python training/run_trainer.py --target smollm2-135m --data data/regen --output_dir out --max_steps 10 --use_cpu
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 training/run_trainer.py \
        training/configs/smollm2-135m.yaml

A leading `.yaml` / `.json` argument is read as a config file holding both `JetSpecArguments` and
`TrainingArguments` fields; flags (alone, or after the file, overriding it) are parsed as usual. The output folder receives the trained head
(`save_pretrained`: config, weights, code files, `custom_generate/`), its model card `README.md`,
`training_log.json` (the Trainer's log history) and `metrics.json`; checkpoints go to `checkpoint-*` inside it.
`--push_to_hub --hub_model_id org/name` uploads the head's files only (see `training/shipping.py`).

Several CPU processes (gloo DDP): with accelerate 1.15, `--cpu` launches a single process whatever
`--num_processes` says; `--multi_gpu --num_processes N` starts torchrun, and `ACCELERATE_USE_CPU=1` plus
`use_cpu` keep it on CPU. The loss is normalised over the slots of all processes, so N processes with b rows each
follow the curve of one process with N * b rows.
"""

import json
import math
import sys
from pathlib import Path

import datasets
import torch
import yaml
from transformers import HfArgumentParser, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

# runnable as `python training/run_trainer.py` from the repo root: `training` is not an installed package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetspec.targets import load_target  # noqa: E402
from modeling_jetspec import JetSpecDraftModel  # noqa: E402
from training.draft_vocab import answer_token_counts, frequent_tokens  # noqa: E402
from training.lookup_prior import measure_lookup_prior  # noqa: E402
from training.losses import chain_accept_length  # noqa: E402
from training.regen import COMPACT_SUFFIX, SHARD_GLOB, load_source  # noqa: E402
from training.shipping import push_folder, write_card  # noqa: E402
from training.trainer import JetSpecArguments, JetSpecTrainer, split_train_eval, unwrap_head  # noqa: E402

LOOKUP_PRIOR_ROWS = 1000  # training rows the lookup prior is measured on (about 5 s per 1,000 rows)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
LOSS_NAMES = {
    "fkl": "forward KL(p_target || q_draft) on every MASK slot (soft labels)",
    "sft": "cross-entropy on the target's tokens (hard labels)",
    "rkl": "reverse KL(q_draft || p_target) on every MASK slot",
}


def parse_args(argv=None) -> tuple[JetSpecArguments, TrainingArguments]:
    parser = HfArgumentParser((JetSpecArguments, TrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        # the file's values become the defaults; flags after it override them (e.g. `--max_steps 10`)
        path = Path(argv.pop(0))
        if not path.is_file():
            raise ValueError(f"expected a config file, got {path} which does not exist")
        values = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
        if not isinstance(values, dict):
            raise ValueError(f"expected a mapping of argument names to values in {path}, got {type(values).__name__}")
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"expected JetSpecArguments or TrainingArguments fields in {path}, got unknown {unknown}")
        parser.set_defaults(**values)
    jargs, targs = parser.parse_args_into_dataclasses(argv)
    # the collator needs `prompt_length` and `id`, which the head's forward signature does not name
    targs.remove_unused_columns = False
    return jargs, targs


def resolve_checkpoint(targs: TrainingArguments) -> str | None:
    """`resume_from_checkpoint` as a folder: a path as given, `true` for the latest one in `output_dir`."""
    value = targs.resume_from_checkpoint
    if value is None or str(value).lower() in ("", "false"):
        return None
    if str(value).lower() == "true":
        last = get_last_checkpoint(targs.output_dir) if Path(targs.output_dir).is_dir() else None
        if last is None:
            raise ValueError(f"expected a checkpoint-* folder in {targs.output_dir} to resume from, got none")
        return last
    if not Path(value).is_dir():
        raise ValueError(f"expected resume_from_checkpoint to be a checkpoint folder or true, got {value!r}")
    return str(value)


def build_head(jargs: JetSpecArguments, target, checkpoint: str | None = None):
    """A new head sized for `target`, or the saved one in `jargs.init_head` / the checkpoint; LoRA-wrapped on request.

    A saved head must have been built for `target` (same vocabulary, width and depth), else `ValueError`.
    """
    source = None
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        source = checkpoint  # full-weight checkpoint: its config is the head's
    elif jargs.init_head is not None:
        source = jargs.init_head
    if source is not None:
        head = JetSpecDraftModel.from_pretrained(source, dtype=torch.float32)  # the head trains in float32
        head.attach_target(target)  # raises for a head built for another target
    else:
        head = JetSpecDraftModel.from_target(target, **jargs.head_overrides())
    block_size = jargs.block_size or head.config.block_size
    if block_size > head.config.block_size:
        raise ValueError(
            f"expected block_size <= {head.config.block_size} (the head's block_size, its maximum depth + 1), "
            f"got {block_size}"
        )
    if jargs.use_lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=jargs.lora_r, lora_alpha=jargs.lora_alpha, lora_dropout=jargs.lora_dropout,
                          target_modules=list(jargs.lora_target_modules))
        return get_peft_model(head, lora)
    return head


def load_data(jargs: JetSpecArguments, seed: int):
    """`(train, eval)` datasets from the regenerated folders `jargs.data`."""
    for folder in jargs.data:
        if str(folder).endswith(COMPACT_SUFFIX):
            continue
        shards = sorted(Path(folder).glob(SHARD_GLOB))
        # load_regenerated fails inside `datasets` (features mismatch) when every shard is empty: say it plainly
        if shards and all(not line.strip() for shard in shards for line in shard.open(encoding="utf-8")):
            raise ValueError(f"expected regenerated rows in {folder}, got an empty dataset ({len(shards)} empty shards)")
    # a compact file (committed) or a regenerate folder (shards); training reads only these columns
    parts = [
        load_source(source).select_columns(["id", "input_ids", "prompt_length"])
        for source in jargs.data
    ]
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(dataset) == 0:
        raise ValueError(f"expected regenerated rows in {jargs.data}, got an empty dataset")
    return split_train_eval(dataset, jargs.eval_fraction, seed)


def measure_tau(head, target, rows, max_new_tokens: int) -> dict:
    """Decode the prompts of `rows` one at a time with the head; tokens per target verify forward, and per depth."""
    rounds, tokens, depth_counts = 0, 0, None
    head.eval()
    for row in rows:
        ids = torch.tensor([row["input_ids"][: row["prompt_length"]]], device=target.device)
        target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=max_new_tokens, assistant_model=head)
        stats = head.last_stats
        rounds, tokens = rounds + stats.row_rounds, tokens + stats.round_tokens
        counts = list(stats.accepted_at_depth)
        depth_counts = counts if depth_counts is None else [a + b for a, b in zip(depth_counts, counts)]
    return {"tau": tokens / max(rounds, 1), "rounds": rounds,
            "acceptance_per_depth": [c / max(rounds, 1) for c in depth_counts or []]}


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
    """Held-out top-1 agreement per depth over training steps (the eval logs), as a PNG; None without eval logs."""
    evals = [entry for entry in log_history if "eval_acc_depth_1" in entry]
    if not evals:
        return None
    from matplotlib.figure import Figure

    depths = sorted(int(k.rsplit("_", 1)[1]) for k in evals[0] if k.startswith("eval_acc_depth_"))
    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    steps = [entry["step"] for entry in evals]
    for d in depths:
        axes.plot(steps, [entry[f"eval_acc_depth_{d}"] for entry in evals], marker="o", label=f"depth {d}")
    axes.set_xlabel("training step")
    axes.set_ylabel("held-out top-1 agreement with the target")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def main(argv=None) -> dict:
    jargs, targs = parse_args(argv)
    push, repo_id = targs.push_to_hub, targs.hub_model_id
    if push and not repo_id:
        raise ValueError("expected --hub_model_id org/name with --push_to_hub, got none")
    targs.push_to_hub = False  # Trainer's own push misses custom_generate/ and adds checkpoints: we ship ourselves
    checkpoint = resolve_checkpoint(targs)

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[jargs.target_dtype]
    target, tokenizer = load_target(jargs.target, dtype=dtype)
    set_seed(targs.seed)  # a new head's initialisation is part of the run: same seed, same head on every process
    head = build_head(jargs, target, checkpoint)
    head.to(torch.float32)  # the head trains in float32 whatever the target's dtype
    train_set, eval_set = load_data(jargs, targs.seed)
    coverage = None
    if jargs.draft_vocab_size is not None and checkpoint is None and jargs.init_head is None:
        ids, coverage = frequent_tokens(answer_token_counts(train_set), jargs.draft_vocab_size, head.config.vocab_size)
        unwrap_head(head).set_draft_vocab(ids)
        print(f"jetspec: draft vocabulary of {len(ids)} tokens covers {coverage:.2%} of the training answers' tokens")
    trainer = JetSpecTrainer(
        model=head, args=targs, train_dataset=train_set, eval_dataset=eval_set, processing_class=tokenizer,
        target=target, jetspec_args=jargs,
    )
    if trainer.is_world_process_zero():
        print(f"jetspec: world size {trainer.accelerator.num_processes}, train rows {len(train_set)}")
    result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = dict(result.metrics)
    if coverage is not None:
        metrics["draft_vocab_coverage"] = coverage
    runtime = metrics.get("train_runtime") or math.nan
    metrics["train_target_tokens_per_second"] = trainer._tokens_seen * trainer.accelerator.num_processes / runtime
    if eval_set is not None:
        metrics.update(trainer.evaluate())

    if trainer.is_world_process_zero():
        ship(trainer, jargs, targs, metrics, eval_set, train_set, target, push, repo_id)
    # every process leaves together and closes the process group: a rank that exits while others still hold gloo
    # connections can abort at interpreter shutdown ("terminate called without an active exception")
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return metrics


def ship(trainer, jargs, targs, metrics: dict, eval_set, train_set, target, push: bool, repo_id) -> None:
    """Main process only: save the head, measure tau, write the card, logs and curve, push on request."""
    out = Path(targs.output_dir)
    final = unwrap_head(trainer.model)
    if jargs.use_lora:
        final = trainer.model.merge_and_unload()  # a plain head: the Hub folder needs no peft to load
    # the odds of prompt-lookup chains on the target's own answers: the head scores its lookup branch with them
    sample = train_set.select(range(min(LOOKUP_PRIOR_ROWS, len(train_set))))
    depth = max(final.config.tree_depth, final.config.tree_lookup)
    lookup = measure_lookup_prior(zip(sample["input_ids"], sample["prompt_length"]), depth)
    if lookup["prior"] is not None:
        final.config.tree_lookup_prior = lookup["prior"]
    metrics["lookup_matches_per_order"] = lookup["matches"]
    final.save_pretrained(out)
    measured = None
    if jargs.measure_tau_prompts > 0 and eval_set is not None:
        rows = eval_set.select(range(min(jargs.measure_tau_prompts, len(eval_set))))
        measured = measure_tau(final, target, rows, jargs.measure_tau_new_tokens)
        metrics.update({f"measured_{k}": v for k, v in measured.items()})
    base_model = jargs.base_model_id or HUB_IDS.get(jargs.target, jargs.target)
    write_card(
        out,
        jargs.card_template,
        base_model=base_model,
        repo_id=repo_id or f"<your-org>/jetspec-{Path(str(jargs.target)).name}",  # a placeholder id until pushed
        max_depth=final.config.block_size - 1,
        num_hidden_layers=final.config.num_hidden_layers,
        block_size=final.config.block_size,
        training_data=", ".join(jargs.data) + " (prompts answered by the target itself, greedy)",
        loss=LOSS_NAMES[jargs.loss] + (f", position decay gamma={jargs.gamma}" if jargs.gamma else ""),
        steps=trainer.state.global_step,
        num_train_rows=len(train_set),
        num_eval_rows=len(eval_set) if eval_set is not None else 0,
        tau_table=tau_table(metrics, measured),
        licence="Apache-2.0 for the head's weights and code. The target's own licence governs the target.",
    )
    (out / "training_log.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    write_learning_curve(trainer.state.log_history, out / "learning_curve.png")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if push:
        push_folder(out, repo_id, private=targs.hub_private_repo)


if __name__ == "__main__":
    main()
