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
the one bootstrap below puts it there.

Several CPU processes (gloo DDP): with accelerate 1.15, `--cpu` launches a single process whatever
`--num_processes` says; `--multi_gpu --num_processes N` starts torchrun, and `ACCELERATE_USE_CPU=1` plus
`use_cpu` keep it on CPU. The loss is normalised over the slots of all processes, so N processes with b rows each
follow the curve of one process with N * b rows. Every process leaves the process group at the same point, right
after its last collective (the final evaluation); only then does the main process ship the head.
"""

import dataclasses
import json
import shutil
import time
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, as `python -m` would have it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback, set_seed  # noqa: E402
from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402

from jetspec.targets import load_target, resolve_dtype  # noqa: E402
from modeling_jetspec import JetSpecDraftModel  # noqa: E402
from modeling_jetspec.configuration_jetspec import BLOCK_ATTENTIONS  # noqa: E402
from training.draft_vocab import answer_token_counts, frequent_tokens  # noqa: E402
from training.evaluate_head import OfflineTauCallback, decode_rows  # noqa: E402
from training.feature_store import FeatureStore  # noqa: E402
from training.lookup_prior import measure_lookup_prior  # noqa: E402
from training.rows import (  # noqa: E402
    answer_lengths,
    answer_token_cap,
    first_rows,
    load_rows,
    load_source,
    row_key,
    split_train_eval,
)
from training.shipping import push_folder, write_card  # noqa: E402
from training.trainer import (  # noqa: E402
    CHECKPOINT_MARKER,
    JetSpecTrainer,
    JetSpecTrainingArguments,
    checkpoint_problem,
    last_complete_checkpoint,
    unwrap_head,
    write_checkpoint_marker,
)

LOOKUP_PRIOR_ROWS = 1000  # training rows the lookup prior is measured on (about 5 s per 1,000 rows)
DRAFT_VOCAB_ROWS = 1_000_000  # training rows whose answer tokens choose a draft vocabulary (a stream's first ones)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
LOSS_NAMES = {
    "fkl": "forward KL(p_target || q_draft) on every MASK slot (soft labels)",
    "sft": "cross-entropy on the target's tokens (hard labels)",
    "rkl": "reverse KL(q_draft || p_target) on every MASK slot",
    "kl_tv": "forward KL plus total variation TV(p_target, q_draft) = 1 - acceptance, on every MASK slot",
    "topk_rank": "forward KL plus a ranking loss on the target's top-8 tokens (HASS), on every MASK slot",
}


@dataclass
class HeadArguments:
    """The frozen target and the head distilled from it: a new head's architecture, or a saved head to start from,
    optionally trained through LoRA adapters."""

    target: str = field(
        default="smollm2-135m",
        metadata={"help": "Target model: the alias 'smollm2-135m', a local folder or a Hub id (see load_target)."},
    )
    target_dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype of the frozen target during training: float32, bfloat16, or auto (bfloat16 where "
            "jetspec.host measures it faster on this host; float32 where ATen is held at AVX2). "
            "Features are cached in bfloat16 either way when cache_features is on."
        },
    )
    init_head: str | None = field(
        default=None,
        metadata={"help": "Start from this saved head folder instead of a new head (fine-tuning, LoRA)."},
    )
    num_hidden_layers: int | None = field(default=None, metadata={"help": "Head layers (new head only)."})
    intermediate_size: int | None = field(default=None, metadata={"help": "Head MLP width (new head only)."})
    block_attention: str | None = field(
        default=None, metadata={"help": "'causal' (JetSpec) or 'bidirectional' (DFlash ablation); new head only."}
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers feeding the head (new head only); evenly spaced by default."}
    )
    tree_depth: int | None = field(default=None, metadata={"help": "Default tree depth stored in the head."})
    tree_width: int | None = field(default=None, metadata={"help": "Default tree width stored in the head."})
    tree_budget: int | None = field(default=None, metadata={"help": "Default tree budget stored in the head."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "New head only: draft from the N most frequent answer tokens of the training data "
            "(reduced LM head and loss); the full vocabulary by default."
        },
    )
    last_context_input: bool = field(
        default=False,
        metadata={"help": "New head only: add the last context position's fused features to every block slot."},
    )
    init_layers_from_target: bool = field(
        default=False,
        metadata={
            "help": "New head only: start its decoder layers as copies of the target's last layers (the "
            "weights whose names and shapes match; the rest keep their random init)."
        },
    )
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters on the head's linear layers only."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"],
        metadata={"help": "Head linear layers that get LoRA adapters."},
    )

    def __post_init__(self):
        """Checks what needs no target, so that a bad value fails before the target loads."""
        if self.target_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"expected target_dtype 'auto', 'float32' or 'bfloat16', got {self.target_dtype!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"expected draft_vocab_size >= 1 or None (full vocabulary), got {self.draft_vocab_size}")
        for name in (
            "num_hidden_layers",
            "intermediate_size",
            "tree_depth",
            "tree_width",
            "tree_budget",
            "lora_r",
            "lora_alpha",
        ):
            value = getattr(self, name)
            if value is not None and not value >= 1:
                raise ValueError(f"expected {name} >= 1, got {value}")
        if self.block_attention is not None and self.block_attention not in BLOCK_ATTENTIONS:
            raise ValueError(f"expected block_attention in {BLOCK_ATTENTIONS}, got {self.block_attention!r}")
        if self.target_layer_ids is not None and (not self.target_layer_ids or min(self.target_layer_ids) < 0):
            raise ValueError(f"expected target_layer_ids of layers >= 0, got {self.target_layer_ids}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"expected lora_dropout in [0, 1), got {self.lora_dropout}")

    def head_overrides(self, block_size: int | None = None) -> dict:
        """Config fields given for a new head (None means the `from_target` default), with the trained block size."""
        names = (
            "num_hidden_layers",
            "intermediate_size",
            "block_attention",
            "target_layer_ids",
            "tree_depth",
            "tree_width",
            "tree_budget",
            "draft_vocab_size",
        )
        overrides = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if block_size is not None:
            overrides["block_size"] = block_size
            overrides.setdefault("tree_depth", min(7, block_size - 1))  # keep the default depth servable
        if self.last_context_input:
            overrides["last_context_input"] = True
        return overrides


@dataclass
class DataArguments:
    """The regenerated rows trained on, the held-out split, and where their target features are kept."""

    data: list[str] = field(
        default_factory=lambda: ["data/regen"],
        metadata={
            "help": "Folder(s) written by training/regenerate.py (shard-*.jsonl), compact .npz files from "
            "`regenerate.py --export`, save_to_disk folders, local .jsonl / .parquet files or Hub "
            "dataset ids, with columns id, input_ids and prompt_length; concatenated in order."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the data as a datasets IterableDataset (data files and Hub datasets are never loaded "
            "whole); needs --max_steps. Training rows are shuffled in a buffer of shuffle_buffer rows."
        },
    )
    shuffle_buffer: int = field(
        default=10_000, metadata={"help": "With --streaming: rows of the shuffle buffer (0 keeps the stream's order)."}
    )
    eval_fraction: float = field(
        default=0.02, metadata={"help": "Fraction of the rows held out for evaluation (at least one if > 0)."}
    )
    eval_data: list[str] | None = field(
        default=None,
        metadata={
            "help": "Evaluate on the held-out rows of these sources (the same split: eval_fraction, seed) instead "
            "of --data's: train on one dataset, judge on another's fixed held-out rows. --data's own held-out "
            "rows are still never trained on, nor is any row sharing an id with an evaluation row."
        },
    )
    stream_eval_rows: int = field(
        default=1000,
        metadata={"help": "With --streaming: evaluate on the first this many held-out rows of the stream."},
    )
    feature_store: str | None = field(
        default=None,
        metadata={
            "help": "Folder written by training/feature_store.py: rows it holds read their target features from "
            "disk and the target never runs for them (any run, any epoch)."
        },
    )
    max_train_answer_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Train on a subset of the training rows holding about this many answer tokens (chosen by a "
            "draw fixed by row id and seed, at least the cap, over it by less than one row; a smaller "
            "cap's rows are a subset of a larger one's); the held-out rows are unchanged. Not with "
            "--streaming."
        },
    )

    def __post_init__(self):
        if isinstance(self.data, str):
            self.data = [self.data]
        if not self.data:
            raise ValueError("expected at least one data folder, got none")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"expected eval_fraction in [0, 1), got {self.eval_fraction}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"expected shuffle_buffer >= 0 (0 keeps the stream's order), got {self.shuffle_buffer}")
        if self.stream_eval_rows < 1:
            raise ValueError(f"expected stream_eval_rows >= 1, got {self.stream_eval_rows}")
        if self.max_train_answer_tokens is not None:
            if self.max_train_answer_tokens < 1:
                raise ValueError(f"expected max_train_answer_tokens >= 1 or None, got {self.max_train_answer_tokens}")
            if self.streaming:
                raise ValueError(
                    "expected no max_train_answer_tokens with --streaming (the cap draws from all training "
                    "rows), got both"
                )
        if isinstance(self.eval_data, str):
            self.eval_data = [self.eval_data]
        if self.eval_data is not None:
            if not self.eval_data:
                raise ValueError("expected at least one --eval_data source or none, got an empty list")
            if self.eval_fraction == 0:
                raise ValueError(
                    "expected eval_fraction > 0 with --eval_data (its held-out rows are the evaluation set), got 0"
                )

    def sources(self) -> list[str]:
        """Every source the run reads rows from: the training data, then the evaluation data when it differs."""
        return list(self.data) + [s for s in self.eval_data or [] if s not in self.data]


ARGUMENTS = (HeadArguments, DataArguments, JetSpecTrainingArguments)
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def parse_args(argv=None) -> tuple[HeadArguments, DataArguments, JetSpecTrainingArguments]:
    """The three argument dataclasses from flags, or from a config file (a leading `.yaml` / `.yml` / `.json`) and
    the flags after it, which override the file's values (e.g. `--max_steps 10`).

    With a file, the flags actually given are told apart from defaults, and the dataclasses are built
    once from the file's values updated by them, by `HfArgumentParser.parse_dict` (what its `parse_yaml_file` and
    `parse_json_file` run), which refuses names no dataclass has.
    """
    parser = HfArgumentParser(ARGUMENTS)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not (argv and argv[0].endswith(CONFIG_SUFFIXES)):
        return parser.parse_args_into_dataclasses(argv)
    path = Path(argv.pop(0))
    if not path.is_file():
        raise ValueError(f"expected a config file, got {path} which does not exist")
    text = path.read_text(encoding="utf-8")
    values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(values, dict):
        raise ValueError(f"expected a mapping of argument names to values in {path}, got {type(values).__name__}")
    not_given = object()  # every default, so that the flags given are those parsed to another value
    parser.set_defaults(**{f.name: not_given for kind in ARGUMENTS for f in dataclasses.fields(kind) if f.init})
    flags, rest = parser.parse_known_args(argv)
    if rest:
        raise ValueError(f"expected only flags of {', '.join(kind.__name__ for kind in ARGUMENTS)}, got {rest}")
    given = {name: value for name, value in vars(flags).items() if value is not not_given}
    return parser.parse_dict({**values, **given})


def resolve_checkpoint(args: JetSpecTrainingArguments) -> str | None:
    """`resume_from_checkpoint` as a folder: a path as given, `true` for the newest complete one in `output_dir`.

    A checkpoint is complete once its marker, written last, matches its files ([`training.trainer.checkpoint_problem`]);
    `true` skips newer incomplete ones (a run killed while writing one), printing why, and never loads them. A folder
    given by path is refused when its marker does not match, or, without a marker (a checkpoint of an older version),
    when the Trainer's last file, `trainer_state.json`, is missing or unreadable."""
    value = args.resume_from_checkpoint
    if value is None or str(value).lower() in ("", "false"):
        return None
    if str(value).lower() == "true":
        last = last_complete_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
        kept = keep_folder(args, float("inf"))
        if last is None and kept is not None and (kept / TRAINER_STATE_NAME).is_file():
            last = checkpoint_from_kept(kept, Path(args.output_dir))
            print(
                f"jetspec: no checkpoint in {args.output_dir}; resuming from the head kept in {kept} ({last}): its "
                "weights (bf16-rounded), step, data position and learning-rate schedule; the optimizer's moments "
                "start afresh"
            )
            return last
        if last is None:
            raise ValueError(
                f"expected a complete checkpoint-* folder in {args.output_dir} (or a head kept at a save in "
                f"{kept}, keep_head_every_save) to resume from, got none"
            )
        print(f"jetspec: resuming from {last}")
        return last
    if not Path(value).is_dir():
        raise ValueError(f"expected resume_from_checkpoint to be a checkpoint folder or true, got {value!r}")
    problem = checkpoint_problem(value)
    if problem is not None:
        if (Path(value) / CHECKPOINT_MARKER).is_file() or not readable_json(Path(value) / TRAINER_STATE_NAME):
            raise ValueError(
                f"expected a complete checkpoint to resume from, got {value}, an incomplete one "
                f"({problem}); resume from an earlier one, or with true"
            )
        print(
            f"jetspec: {value} has no {CHECKPOINT_MARKER} (written by an older version?); its trainer state is "
            "whole, so it is loaded"
        )
    return str(value)


def readable_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return False


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
    sources' split instead (same fraction and seed), and no training row shares an id with it."""
    train, held_out = split_train_eval(
        load_rows(data_args.data, streaming=data_args.streaming),
        data_args.eval_fraction,
        seed,
        data_args.stream_eval_rows,
    )
    if data_args.eval_data is not None:
        _, held_out = split_train_eval(
            load_rows(data_args.eval_data, streaming=data_args.streaming),
            data_args.eval_fraction,
            seed,
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
        train, tokens = answer_token_cap(train, data_args.max_train_answer_tokens, seed)
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


def measure_tau(head, target, rows, max_new_tokens: int) -> dict:
    """Decode the prompts of `rows` one at a time with the head (`evaluate_head.decode_rows`); tokens per target
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


def keep_folder(args: JetSpecTrainingArguments, minutes: float) -> Path | None:
    """Where the final head is kept for the next session (see `keep_head_dir`), or None."""
    value = args.keep_head_dir
    if value is None or str(value).lower() in ("", "none", "false"):
        return None
    if str(value).lower() == "auto":
        if minutes < args.keep_head_minutes:
            return None
        return Path("training/checkpoints") / Path(args.output_dir).name
    return Path(value)


def checkpoint_from_kept(kept: Path, output_dir: Path) -> str:
    """A checkpoint folder `output_dir/checkpoint-N` rebuilt from a head kept at step N (`keep_head_every_save`):
    its weights in float32 (from the kept bf16), its config and the kept trainer state, marked complete. It holds no
    optimizer, scheduler or RNG files: the Trainer starts the optimizer afresh, [`ScheduleCatchUpCallback`] moves
    the schedule to step N, and the data position follows from the step as in any resume."""
    step = int(json.loads((kept / TRAINER_STATE_NAME).read_text())["global_step"])
    folder = output_dir / f"checkpoint-{step}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in [*kept.glob("*.safetensors"), kept / "config.json", kept / TRAINER_STATE_NAME]:
        shutil.copy2(path, folder / path.name)
    cast_head_files(folder, torch.float32)
    write_checkpoint_marker(folder, step)
    return str(folder)


def cast_head_files(folder: Path, dtype: torch.dtype, drop: tuple = ()) -> None:
    """Casts the floating weights of every `*.safetensors` in `folder` to `dtype`, in place, and makes its config
    say so (`dtype`), leaving out the config keys `drop`."""
    from safetensors.torch import load_file, save_file

    for weights in folder.glob("*.safetensors"):
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    config_path = folder / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        for key in drop:
            config.pop(key, None)
        config_path.write_text(json.dumps(config, indent=2) + "\n")


class KeepOnSaveCallback(TrainerCallback):
    """`keep_head_every_save`: after each complete checkpoint, its head (bf16 weights, config, trainer state with
    the curve so far) replaces the kept one in `folder`, atomically ([`keep_head`])."""

    def __init__(self, folder: Path, run_config: dict):
        self.folder, self.run_config = folder, run_config

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if checkpoint.is_dir() and checkpoint_problem(checkpoint) is None:
            keep_head(checkpoint, self.folder, {**self.run_config, "kept_at_step": state.global_step})
            print(f"jetspec: step {state.global_step}'s head kept in {self.folder}")


def keep_head(out: Path, folder: Path, run_config: dict) -> Path:
    """Copies the shipped head in `out` (config, card, metrics, log, curve; no `checkpoint-*`, and no copy of the
    package's code: the installed `modeling_jetspec` loads it) to `folder`
    with its weights cast to bf16 (half the float32 size) and the run's arguments as `training_args.json`,
    atomically: a temporary folder renamed into place, so a killed run never leaves half a head there."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(
        out,
        staging,
        # a checkpoint's optimizer, scheduler, RNG and marker files are not the head (`KeepOnSaveCallback`)
        ignore=shutil.ignore_patterns(
            "checkpoint-*",
            "runs",
            "*.partial",
            "*.py",
            "custom_generate",
            "optimizer.pt",
            "scheduler.pt",
            "scaler.pt",
            "rng_state*.pth",
            "training_args.bin",
            CHECKPOINT_MARKER,
        ),
    )
    # no code files here: a config naming them (`auto_map`) would send `trust_remote_code` looking for them; the
    # installed package loads the folder (`import modeling_jetspec`, then `AutoModel.from_pretrained`)
    cast_head_files(staging, torch.bfloat16, drop=("auto_map",))
    (staging / "training_args.json").write_text(json.dumps(run_config, indent=1, default=str) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


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
    store = FeatureStore(data_args.feature_store) if data_args.feature_store is not None else None
    if store is not None and not data_args.streaming:
        covered = check_store_coverage(store, data_args.sources(), args.max_length)
        print(f"jetspec: the feature store covers all {sum(covered.values())} rows of {len(covered)} data sources")
    dtype, reason = resolve_dtype(head_args.target_dtype)
    print(f"jetspec: target in {dtype} ({reason})")
    target, tokenizer = load_target(head_args.target, dtype=dtype, device=args.device)  # straight to this rank's device
    set_seed(args.seed)  # a new head's initialisation is part of the run: same seed, same head on every process
    head = build_head(head_args, target, args.block_size, checkpoint)
    head.to(torch.float32)  # the head trains in float32 whatever the target's dtype
    coverage = None
    if head_args.draft_vocab_size is not None and checkpoint is None and head_args.init_head is None:
        counts = answer_token_counts(first_rows(train_set, DRAFT_VOCAB_ROWS))
        ids, coverage = frequent_tokens(counts, head_args.draft_vocab_size, head.config.vocab_size)
        unwrap_head(head).set_draft_vocab(ids)
        print(f"jetspec: draft vocabulary of {len(ids)} tokens covers {coverage:.2%} of the training answers' tokens")
    callbacks = list(callbacks or [])
    every_save = keep_folder(args, float("inf")) if args.keep_head_every_save else None
    if every_save is not None:
        callbacks.append(KeepOnSaveCallback(every_save, run_configuration(head_args, data_args, args)))
    if store is not None and eval_set is not None and args.offline_tau_rows > 0 and not data_args.streaming:
        rows = eval_set.select(range(min(args.offline_tau_rows, len(eval_set))))
        callbacks.append(
            OfflineTauCallback(rows, store, max_new_tokens=args.offline_tau_new_tokens, max_rows=args.offline_tau_rows)
        )
    trainer = JetSpecTrainer(
        model=head,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        target=target,
        feature_store=store,
        callbacks=callbacks or None,
    )
    if trainer.is_world_process_zero():
        print(f"jetspec: the head trains in {trainer.precision}")  # the trainer resolved `train_precision`
        print(f"jetspec: world size {trainer.accelerator.num_processes}, train rows {describe_rows(train_set)}")
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=checkpoint)
    train_minutes = (time.perf_counter() - started) / 60.0
    metrics = dict(result.metrics)
    if coverage is not None:
        metrics["draft_vocab_coverage"] = coverage
    if not data_args.streaming:  # the answer tokens trained on (a data cap's count; the data-against-steps runs)
        metrics["train_answer_tokens"] = sum(answer_lengths(train_set))
    # the Trainer's count of the target's input tokens: its last training log holds this session's rate
    speeds = [
        entry["train_tokens_per_second"] for entry in trainer.state.log_history if "train_tokens_per_second" in entry
    ]
    if speeds:
        metrics["train_tokens_per_second"] = speeds[-1]
        metrics["num_input_tokens_seen"] = trainer.state.num_input_tokens_seen
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
        folder = keep_folder(args, train_minutes)
        if folder is not None:
            run_config = {**run_configuration(head_args, data_args, args), "train_minutes": round(train_minutes, 2)}
            trainer.save_state()  # its step and curve go with the head (a resume from it knows where the run ended)
            kept = keep_head(Path(args.output_dir), folder, run_config)
            print(
                f"jetspec: the final head is kept in {kept} (bf16; commit it: the next run can start from it with "
                f"--init_head {kept})"
            )
    return metrics


def run_configuration(head_args: HeadArguments, data_args: DataArguments, args: JetSpecTrainingArguments) -> dict:
    """The run's arguments as a kept head records them (`training_args.json`)."""
    return {"head": dataclasses.asdict(head_args), "data": dataclasses.asdict(data_args), "training": args.to_dict()}


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


if __name__ == "__main__":
    main()
