"""What a training run reads and builds before its first step: the rows (train and held-out, streamed or not), the
feature store's coverage of them, and the head to train (new, saved, or resumed; LoRA-wrapped on request).
"""

from pathlib import Path

import datasets
import numpy as np
import torch

from modeling_jetspec import JetSpecDraftModel

from .arguments import DataArguments, HeadArguments, JetSpecTrainingArguments
from .feature_store import FeatureStore
from .rows import answer_token_cap, load_rows, load_source, row_key, split_train_eval


@torch.no_grad()
def init_layers_from_target(head: JetSpecDraftModel, target) -> list[str]:
    """Copies the target's last `n` decoder layers into the head's `n` layers, in order: every weight whose name and
    shape match (attention and MLP projections, layer norms); the others (e.g. the head's q/k norms, which a Llama
    layer lacks) keep their init. The head's last layer thus starts as the target's last, which maps the residual
    stream to what the final norm and LM head, shared with the head, read.

    Returns:
        `list[str]`: the parameter names copied into each layer (those of layer 0).

    Raises:
        `ValueError`: the target has fewer layers than the head, or no weight of a layer matches.
    """
    target_layers = target.get_decoder().layers
    n = len(head.layers)
    if len(target_layers) < n:
        raise ValueError(f"expected a target with at least the head's {n} layers to copy, got {len(target_layers)}")
    copied = []
    for head_layer, target_layer in zip(head.layers, list(target_layers)[-n:]):
        source = dict(target_layer.named_parameters())
        copied = []
        for name, param in head_layer.named_parameters():
            if name in source and source[name].shape == param.shape:
                param.copy_(source[name].to(param.dtype))
                copied.append(name)
        if not copied:
            raise ValueError(
                f"expected the target's layers ({type(target_layer).__name__}) to share weight names and shapes with "
                f"the head's, got none in common: {sorted(source)[:6]} vs {[k for k, _ in head_layer.named_parameters()][:6]}"
            )
    return copied


def build_head(head_args: HeadArguments, target, block_size: int | None = None, checkpoint: str | None = None):
    """A new head sized for `target`, or the saved one in `head_args.init_head` / the checkpoint; LoRA-wrapped on
    request.

    Args:
        head_args ([`HeadArguments`]): architecture of a new head, or the saved head to start from; LoRA settings.
        target (`PreTrainedModel`): the target; a saved head must have been built for it (same vocabulary, width
            and depth), else `ValueError`.
        block_size (`int`, *optional*): the trained block length: a new head's block size, at most a saved head's.
        checkpoint (`str`, *optional*): a full-weight Trainer checkpoint to resume, whose config is the head's.
    """
    source = None
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        source = checkpoint
    elif head_args.init_head is not None:
        source = head_args.init_head
    if source is not None:
        head = JetSpecDraftModel.from_pretrained(source, dtype=torch.float32)  # the head trains in float32
        head.attach_target(target)  # raises for a head built for another target
    else:
        head = JetSpecDraftModel.from_target(target, **head_args.head_overrides(block_size))
        if head_args.init_layers_from_target:
            copied = init_layers_from_target(head, target)
            print(
                f"jetspec: the head's layers start as the target's last {head.config.num_hidden_layers}, copied "
                f"{len(copied)} weights per layer"
            )
    if block_size is not None and block_size > head.config.block_size:
        raise ValueError(
            f"expected block_size <= {head.config.block_size} (the head's block_size, its maximum depth + 1), "
            f"got {block_size}"
        )
    if head_args.use_lora:
        from peft import LoraConfig, get_peft_model  # only LoRA runs need peft

        lora = LoraConfig(
            r=head_args.lora_r,
            lora_alpha=head_args.lora_alpha,
            lora_dropout=head_args.lora_dropout,
            target_modules=list(head_args.lora_target_modules),
        )
        return get_peft_model(head, lora)
    return head


def load_data(data_args: DataArguments, seed: int):
    """`(train, eval)` datasets of the regenerated rows `data_args.data` (eval is None without a held-out split).
    Streamed, `train` is an `IterableDataset` (shuffled in a buffer) and `eval` the stream's first held-out rows.
    With `max_train_answer_tokens`, `train` is the subset [`training.rows.answer_token_cap`] takes from the training
    rows (the held-out rows are the same with or without it). With `eval_data`, `eval` is the held-out side of those
    sources' split instead (same fraction and seed), and no training row shares an id with it. The split and the cap
    draw with `data_args.split_seed` where given (a seed variant: the same rows, another `seed` for the rest)."""
    split_seed = seed if data_args.split_seed is None else data_args.split_seed  # the held-out rows' draw
    train, held_out = split_train_eval(
        load_rows(data_args.data, streaming=data_args.streaming),
        data_args.eval_fraction,
        split_seed,
        data_args.stream_eval_rows,
    )
    if data_args.eval_data is not None:
        _, held_out = split_train_eval(
            load_rows(data_args.eval_data, streaming=data_args.streaming),
            data_args.eval_fraction,
            split_seed,
            data_args.stream_eval_rows,
        )
        # A row id falls on the same side of both splits (the same draw), except where a split holds out its
        # lowest-draw row because none fell below the fraction: keep any evaluation row out of training
        held_ids = set(held_out["id"])
        if isinstance(train, datasets.IterableDataset):
            train = train.filter(lambda row_id: row_id not in held_ids, input_columns=["id"])
        elif held_ids & set(train["id"]):
            train = train.select([i for i, row_id in enumerate(train["id"]) if row_id not in held_ids])
    if data_args.streaming and data_args.shuffle_buffer > 0:
        train = train.shuffle(seed=seed, buffer_size=data_args.shuffle_buffer)
    if data_args.max_train_answer_tokens is not None:
        rows = len(train)
        train, tokens = answer_token_cap(train, data_args.max_train_answer_tokens, split_seed)
        print(
            f"jetspec: training rows capped at {data_args.max_train_answer_tokens} answer tokens: {len(train)} of "
            f"{rows} rows, {tokens} answer tokens"
        )
    return train, held_out


def check_streaming(data_args: DataArguments, args: JetSpecTrainingArguments) -> None:
    """A stream has no length: the run needs `max_steps`. Its batches are collated on each process (accelerate's
    default for an iterable dataset, dispatching batches from the main process, would concatenate batches padded
    to different widths)."""
    if not data_args.streaming:
        return
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError(
            f"expected --max_steps > 0 with --streaming (a stream has no length to count epochs by), "
            f"got {args.max_steps}"
        )
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "expected accelerator_config dispatch_batches unset or false with --streaming (each process "
            "collates its own rows), got true"
        )
    args.accelerator_config.dispatch_batches = False


def describe_rows(dataset) -> str:
    """The row count of a dataset for logs and the card; `streamed` for a stream, which has none."""
    return "streamed" if isinstance(dataset, datasets.IterableDataset) else str(len(dataset))


def check_store_coverage(store: FeatureStore, sources: list, max_length: int) -> dict:
    """Every row of every data source must be in the feature store with its first `max_length` positions, else
    `ValueError` naming each source that misses rows and how many (a missing row would run the target inside the
    training step, slowly, and with `cache_features` keep its features in memory). Returns rows per source."""
    counts, missing = {}, []
    for source in sources:
        rows = load_source(source)
        keys = [row_key(i) for i in rows["id"]]
        lengths = np.minimum(np.array([len(r) for r in rows["input_ids"]], dtype=np.int64), max_length)
        found, _, stored = store._lookup(keys)
        absent = int((~(found & (stored >= lengths))).sum())
        counts[str(source)] = len(keys)
        if absent:
            missing.append(f"{source}: {absent} of {len(keys)} rows")
    if missing:
        raise ValueError(
            f"expected every training row in the feature store {store.path} (max_length {max_length}), got rows "
            f"missing from it: {'; '.join(missing)}. Add them with `python -m training.feature_store --data "
            f"{' '.join(map(str, sources))} --out {store.path} --max_length {max_length}` (it resumes and computes only "
            "the missing rows), or train without --feature_store"
        )
    return counts
