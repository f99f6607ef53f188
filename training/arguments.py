"""The arguments of a training run: [`HeadArguments`] (the target and the head distilled from it), [`DataArguments`]
(the regenerated rows, the held-out split, the feature store) and [`JetSpecTrainingArguments`] (`TrainingArguments`
plus the block, anchor and loss settings, and what is kept), parsed together by `HfArgumentParser` ([`parse_args`]),
from flags or from a `.yaml` / `.json` config file and the flags that override it.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments

from modeling_jetspec.configuration_jetspec import BLOCK_ATTENTIONS

from .losses import LOSS_CHUNK_SLOTS, LOSS_KINDS, check_loss_kind

TRAIN_PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class JetSpecTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus how blocks are drawn and scored, where the target's features come from, and what the
    run measures when it ships the head."""

    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Block length [anchor, MASK x (block_size - 1)] trained. A new head is built with it (16 by "
            "default); a saved head's may be longer (its block_size bounds it)."
        },
    )
    num_blocks_per_sequence: int = field(
        default=4, metadata={"help": "Anchors drawn per row and epoch, packed into one head forward."}
    )
    loss: str = field(
        default="fkl",
        metadata={
            "help": f"Distillation loss, one of {LOSS_KINDS}: forward KL (paper), hard-label CE on the target's "
            "greedy token, reverse KL, forward KL + total variation (1 - acceptance, as the LK losses), "
            "forward KL + a ranking loss on the target's top-8 tokens (HASS)."
        },
    )
    gamma: float | None = field(
        default=None,
        metadata={"help": "Position decay w_k ~ exp(-(k-1)/gamma) over depths (scaled to mean 1); none by default."},
    )
    reveal_prob: float = field(
        default=0.0,
        metadata={
            "help": "Probability that a block slot is fed its real token instead of MASK (no loss there); "
            "trains path-conditioned drafting. Evaluation never reveals."
        },
    )
    answer_anchor_prob: float = field(
        default=1.0,
        metadata={
            "help": "Probability that an anchor is drawn in the answer part (a >= prompt_length - 1) rather "
            "than anywhere in the row (a >= 1)."
        },
    )
    max_length: int = field(default=1024, metadata={"help": "Rows are truncated to this many tokens."})
    loss_chunk_slots: int = field(
        default=LOSS_CHUNK_SLOTS,
        metadata={
            "help": "Block slots whose logits over the vocabulary exist at once (the LM head, the loss and its "
            "gradient go chunk by chunk): memory about 8 x chunk x vocabulary x 4 bytes, not per step."
        },
    )
    cache_features: bool = field(
        default=False,
        metadata={
            "help": "Keep each row's target features in memory after its first target forward, so later "
            "epochs cost only the head (bf16, about (k + 1) * hidden * 2 bytes per token)."
        },
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Stop training after this many minutes of wall time (and evaluate once more); the "
            "schedule still follows max_steps."
        },
    )
    train_precision: str = field(
        default="fp32",
        metadata={
            "help": "The head's training step: `fp32`, `bf16` (autocast, the Trainer's `bf16`) or `auto`: bf16 "
            "where jetspec.host measures bf16 matmuls faster than float32 on this host (native bf16: "
            "AVX-512 BF16, AMX, a GPU), else fp32 (the committed config's choice). An explicit `--bf16 true` always "
            "wins."
        },
    )
    keep_head_dir: str | None = field(
        default="auto",
        metadata={
            "help": "A folder that receives the final head (bf16 weights, config, metrics, learning curve, about "
            "11 MB) whether or not it ships: `auto` = runs/kept/<output_dir's name> (git-ignored: committing a "
            "head is a deliberate act) for runs of keep_head_minutes or more, a path = always there, `none` = never."
        },
    )
    keep_head_every_save: bool = field(
        default=False,
        metadata={
            "help": "Also keep the head of every complete checkpoint in the keep_head_dir folder (bf16, with the "
            "trainer state: step and curve), so a run that outlasts its working session leaves a head at "
            "each save, and `--resume_from_checkpoint true` can continue from it where output_dir is gone."
        },
    )
    keep_head_minutes: float = field(
        default=20.0,
        metadata={"help": "With keep_head_dir=auto: the training minutes from which a run keeps its head."},
    )
    offline_tau_rows: int = field(
        default=32,
        metadata={
            "help": "With a feature store: at every evaluation, the head's offline tau at its defaults on this "
            "many held-out rows (training.evaluate_head: the decoder's own draft, tree and trie over the "
            "stored answers, no target forward), logged as eval_offline_tau beside the agreement; 0 "
            "skips it."
        },
    )
    offline_tau_new_tokens: int = field(
        default=128, metadata={"help": "Answer tokens per row of the offline tau at each evaluation."}
    )
    measure_tau_prompts: int = field(
        default=0,
        metadata={
            "help": "After training, decode this many held-out prompts with the head and report the "
            "measured tau (0 skips it)."
        },
    )
    measure_tau_new_tokens: int = field(default=64, metadata={"help": "max_new_tokens of the tau measurement."})
    base_model_id: str | None = field(
        default=None,
        metadata={"help": "Hub id of the target for the model card; defaults to the target's own name."},
    )
    card_template: str | None = field(
        default=None,
        metadata={"help": "Model card template written as README.md; defaults to hub_cards/jetspec-head.md."},
    )
    include_num_input_tokens_seen: str = field(
        default="non_padding",
        metadata={
            "help": "The Trainer's count of the rows' tokens that the target read, over all processes, logged as "
            "`num_input_tokens_seen` and `train_tokens_per_second`: `non_padding` (`attention_mask`), "
            "`all` or `no`."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: the collator reads `id` and `prompt_length`, which the head's forward "
            "does not take."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_loss_kind(self.loss)
        if self.remove_unused_columns:
            raise ValueError(
                "expected remove_unused_columns=False (the collator needs `prompt_length` and `id`, which the head's "
                "forward does not take), got True"
            )
        if self.num_blocks_per_sequence < 1:
            raise ValueError(f"expected num_blocks_per_sequence >= 1, got {self.num_blocks_per_sequence}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"expected block_size >= 2 (anchor plus at least one MASK), got {self.block_size}")
        if not 0.0 <= self.reveal_prob < 1.0:
            raise ValueError(f"expected reveal_prob in [0, 1), got {self.reveal_prob}")
        if not 0.0 <= self.answer_anchor_prob <= 1.0:
            raise ValueError(f"expected answer_anchor_prob in [0, 1], got {self.answer_anchor_prob}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"expected gamma > 0 or None, got {self.gamma}")
        if self.max_train_minutes is not None and not self.max_train_minutes > 0:
            raise ValueError(f"expected max_train_minutes > 0 or None, got {self.max_train_minutes}")
        if self.loss_chunk_slots < 1:
            raise ValueError(f"expected loss_chunk_slots >= 1, got {self.loss_chunk_slots}")
        if self.train_precision not in TRAIN_PRECISIONS:
            raise ValueError(f"expected train_precision in {TRAIN_PRECISIONS}, got {self.train_precision!r}")
        if self.train_precision == "fp32" and self.bf16:
            raise ValueError("expected bf16=False with train_precision='fp32', got bf16=True")
        if self.offline_tau_rows < 0 or self.offline_tau_new_tokens < 1:
            raise ValueError(
                f"expected offline_tau_rows >= 0 and offline_tau_new_tokens >= 1, got "
                f"{self.offline_tau_rows} and {self.offline_tau_new_tokens}"
            )
        if not self.keep_head_minutes >= 0:
            raise ValueError(f"expected keep_head_minutes >= 0, got {self.keep_head_minutes}")
        if self.max_length < 3:
            raise ValueError(
                f"expected max_length >= 3 (an anchor needs a token before and after it), got {self.max_length}"
            )
        if self.dataloader_persistent_workers and self.dataloader_num_workers > 0:
            raise ValueError(
                "expected dataloader_persistent_workers=False (persistent workers keep the collator of "
                "the first epoch, and with it its anchors), got True"
            )


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
    split_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the held-out split (and of --max_train_answer_tokens' draw); defaults to --seed. A run "
            "with another --seed and the same --split_seed is judged on the same held-out rows and trains on the "
            "same rows, from another initialisation and in another order: a seed variant of a run."
        },
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


def run_configuration(head_args: HeadArguments, data_args: DataArguments, args: JetSpecTrainingArguments) -> dict:
    """The run's arguments as a kept head records them (`training_args.json`)."""
    return {"head": dataclasses.asdict(head_args), "data": dataclasses.asdict(data_args), "training": args.to_dict()}
