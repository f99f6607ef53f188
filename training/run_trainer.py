"""Distill a JetSpec draft head from a target with the transformers `Trainer` and ship it.

    python training/run_trainer.py training/configs/smollm2-135m.yaml [--max_steps 10 ...]
    python -m training.run_trainer --target smollm2-135m --data data/regen --output_dir out --max_steps 10 --use_cpu
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 training/run_trainer.py \
        training/configs/smollm2-135m.yaml

Arguments come in three dataclasses, parsed together by `HfArgumentParser`: [`HeadArguments`] (the target and the
head distilled from it), [`DataArguments`] (the regenerated rows, the held-out split, the feature store) and
[`JetSpecTrainingArguments`] (`TrainingArguments` plus the block, anchor and loss settings). A leading `.yaml` /
`.json` argument is read as a config file holding fields of any of them; flags (alone, or after the file,
overriding it) are parsed as usual. The output folder receives the trained head (`save_pretrained`: config, weights,
code files, `custom_generate/`), its model card `README.md`, `training_log.json` (the Trainer's log history) and
`metrics.json`; checkpoints go to `checkpoint-*` inside it. `--push_to_hub --hub_model_id org/name` uploads the
head's files only (see `training/shipping.py`).

Run from the repository root: `training/` is not an installed package. As a module (`python -m training.run_trainer`)
the root is on the path already; as a file (`python training/run_trainer.py`, which `accelerate launch` also runs)
`training/_bootstrap.py` registers this folder as the package `training` by its location (no `sys.path` edit), and
`jetspec` / `modeling_jetspec` come from the installed package (`pip install -e .`: this checkout).

The run's pieces live beside this command: `training/arguments.py` (the three dataclasses and the config file),
`training/run_setup.py` (rows, store coverage, the head), `training/trainer.py` (the `Trainer`),
`training/checkpointing.py` (complete checkpoints, resuming, kept heads) and `training/run_outputs.py` (the
output folder).

Several CPU processes (gloo DDP): with accelerate 1.15, `--cpu` launches a single process whatever
`--num_processes` says; `--multi_gpu --num_processes N` starts torchrun, and `ACCELERATE_USE_CPU=1` plus
`use_cpu` keep it on CPU. The loss is normalised over the slots of all processes, so N processes with b rows each
follow the curve of one process with N * b rows. Every process leaves the process group at the same point, right
after its last collective (the final evaluation); only then does the main process ship the head.
"""

import time

if not __package__:  # run as a file, not as `python -m training.run_trainer`: see training/_bootstrap.py
    import _bootstrap  # noqa: F401

import torch
from transformers import set_seed

from jetspec.targets import load_target, resolve_dtype
from training.arguments import (
    DataArguments,
    HeadArguments,
    JetSpecTrainingArguments,
    parse_args,
    run_configuration,
)
from training.checkpointing import KeepOnSaveCallback, keep_final_head, keep_folder, resolve_checkpoint
from training.draft_vocab import answer_token_counts, frequent_tokens
from training.evaluate_head import OfflineTauCallback
from training.feature_store import FeatureStore
from training.rows import answer_lengths, first_rows
from training.run_setup import (
    build_head,
    check_store_coverage,
    check_streaming,
    describe_rows,
    load_data,
)
from training.run_outputs import ship
from training.trainer import JetSpecTrainer, unwrap_head

DRAFT_VOCAB_ROWS = 1_000_000  # training rows whose answer tokens choose a draft vocabulary (a stream's first ones)


def main(argv=None, callbacks=None) -> dict:
    """Trains a head as the command line asks; `callbacks` are extra `TrainerCallback`s (e.g. a timer). Returns the
    run's metrics (training, then held-out evaluation)."""
    head_args, data_args, args = parse_args(argv)
    push, repo_id = args.push_to_hub, args.hub_model_id
    if push and not repo_id:
        raise ValueError("expected --hub_model_id org/name with --push_to_hub, got none")
    args.push_to_hub = False  # Trainer's own push misses custom_generate/ and adds checkpoints: we ship ourselves
    checkpoint = resolve_checkpoint(args)
    check_streaming(data_args, args)
    # everything that needs no target is read and checked before the target loads (minutes for a large one)
    train_set, eval_set = load_data(data_args, args.seed)
    store = open_store(data_args, args)
    dtype, reason = resolve_dtype(head_args.target_dtype)
    print(f"jetspec: target in {dtype} ({reason})")
    target, tokenizer = load_target(head_args.target, dtype=dtype, device=args.device)  # straight to this rank's device
    set_seed(args.seed)  # a new head's initialisation is part of the run: same seed, same head on every process
    head = build_head(head_args, target, args.block_size, checkpoint)
    head.to(torch.float32)  # the head trains in float32 whatever the target's dtype
    coverage = None
    if head_args.draft_vocab_size is not None and checkpoint is None and head_args.init_head is None:
        coverage = choose_draft_vocab(head, train_set, head_args.draft_vocab_size)
    trainer = JetSpecTrainer(
        model=head,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        target=target,
        feature_store=store,
        callbacks=run_callbacks(callbacks, head_args, data_args, args, store, eval_set) or None,
    )
    if trainer.is_world_process_zero():
        print(f"jetspec: the head trains in {trainer.precision}")  # the trainer resolved `train_precision`
        print(f"jetspec: world size {trainer.accelerator.num_processes}, train rows {describe_rows(train_set)}")
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=checkpoint)
    train_minutes = (time.perf_counter() - started) / 60.0
    metrics = training_metrics(trainer, result, coverage, None if data_args.streaming else train_set)
    if eval_set is not None:
        metrics.update(trainer.evaluate())
    # The evaluation was the last collective. Every process meets the others once more and leaves the process group
    # here, through accelerate, at the same point and with nothing in flight. Shipping needs no other process, so it
    # comes after: no rank waits in a collective while the main process ships (tens of seconds), and a process that
    # must exit abnormally never leaves a peer blocked in one. A stuck collective fails after `ddp_timeout`.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if trainer.is_world_process_zero():
        ship(trainer, head_args, data_args, args, metrics, eval_set, train_set, target, push, repo_id)
        keep_final_head(trainer, args, run_configuration(head_args, data_args, args), train_minutes)
    return metrics


def open_store(data_args: DataArguments, args: JetSpecTrainingArguments) -> FeatureStore | None:
    """The run's feature store, or None; a store read by a run that is not streamed must cover every row it reads
    ([`training.run_setup.check_store_coverage`])."""
    if data_args.feature_store is None:
        return None
    store = FeatureStore(data_args.feature_store)
    if not data_args.streaming:
        covered = check_store_coverage(store, data_args.sources(), args.max_length)
        print(f"jetspec: the feature store covers all {sum(covered.values())} rows of {len(covered)} data sources")
    return store


def choose_draft_vocab(head, train_set, size: int) -> float:
    """Gives a new head the `size` most frequent answer tokens of the training rows (a stream's first ones) as its
    draft vocabulary; returns the share of the answers' tokens they cover."""
    counts = answer_token_counts(first_rows(train_set, DRAFT_VOCAB_ROWS))
    ids, coverage = frequent_tokens(counts, size, head.config.vocab_size)
    unwrap_head(head).set_draft_vocab(ids)
    print(f"jetspec: draft vocabulary of {len(ids)} tokens covers {coverage:.2%} of the training answers' tokens")
    return coverage


def run_callbacks(
    callbacks,
    head_args: HeadArguments,
    data_args: DataArguments,
    args: JetSpecTrainingArguments,
    store: FeatureStore | None,
    eval_set,
) -> list:
    """The caller's `callbacks`, then the run's own: a head kept at every save (`keep_head_every_save`) and the
    offline tau at every evaluation (with a feature store and held-out rows)."""
    callbacks = list(callbacks or [])
    every_save = keep_folder(args, float("inf")) if args.keep_head_every_save else None
    if every_save is not None:
        callbacks.append(KeepOnSaveCallback(every_save, run_configuration(head_args, data_args, args)))
    if store is not None and eval_set is not None and args.offline_tau_rows > 0 and not data_args.streaming:
        rows = eval_set.select(range(min(args.offline_tau_rows, len(eval_set))))
        callbacks.append(
            OfflineTauCallback(rows, store, max_new_tokens=args.offline_tau_new_tokens, max_rows=args.offline_tau_rows)
        )
    return callbacks


def training_metrics(trainer, result, coverage: float | None, train_set) -> dict:
    """The training's metrics: the Trainer's, the draft vocabulary's coverage, the answer tokens trained on (not
    for a stream, `train_set` None) and the Trainer's count of the target's input tokens and their rate."""
    metrics = dict(result.metrics)
    if coverage is not None:
        metrics["draft_vocab_coverage"] = coverage
    if train_set is not None:  # the answer tokens trained on (a data cap's count; the data-against-steps runs)
        metrics["train_answer_tokens"] = sum(answer_lengths(train_set))
    # the Trainer's count of the target's input tokens: its last training log holds this session's rate
    speeds = [
        entry["train_tokens_per_second"] for entry in trainer.state.log_history if "train_tokens_per_second" in entry
    ]
    if speeds:
        metrics["train_tokens_per_second"] = speeds[-1]
        metrics["num_input_tokens_seen"] = trainer.state.num_input_tokens_seen
    return metrics


if __name__ == "__main__":
    main()
