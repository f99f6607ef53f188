"""Checkpoints a killed run can trust, and the heads a run keeps.

The `Trainer` writes a `checkpoint-N` folder file by file; a process killed meanwhile leaves half of one.
[`training.trainer.JetSpecTrainer`] writes a marker last, `checkpoint_complete.json` (every file's size, written once
every process has saved its part), and rotates (`save_total_limit`) only complete checkpoints, never the one just
completed: [`last_complete_checkpoint`] resumes from the newest checkpoint whose marker matches its files and skips
the others, saying so.

A kept head ([`keep_head`]) is the shipped folder with its weights in bf16 and the run's arguments, written under
`runs/kept/<output_dir's name>` by default ([`keep_folder`]): outside the tracked tree (`runs/` is git-ignored).
Committing a head is a deliberate act, for a head that ships or becomes the next run's warm-start base.
"""

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME

from .arguments import JetSpecTrainingArguments

KEPT_HEADS = Path("runs") / "kept"  # where `keep_head_dir: auto` keeps heads: git-ignored, never the tracked tree
CHECKPOINT_MARKER = "checkpoint_complete.json"
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's `checkpoint-{global_step}` folders


def write_checkpoint_marker(folder: Path, step: int) -> None:
    """Marks `folder` complete: `CHECKPOINT_MARKER` lists the size of every file in it, written atomically, last."""
    files = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != CHECKPOINT_MARKER
    }
    tmp = folder / f".{CHECKPOINT_MARKER}.tmp"
    tmp.write_text(json.dumps({"global_step": step, "files": files}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / CHECKPOINT_MARKER)


def checkpoint_problem(folder) -> str | None:
    """Why `folder` is not a complete checkpoint (no marker, an unreadable one, a file missing or of another size
    than recorded), or None when it is."""
    marker = Path(folder) / CHECKPOINT_MARKER
    if not marker.is_file():
        return f"no {CHECKPOINT_MARKER}: it was being written when the run stopped"
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
        assert isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{CHECKPOINT_MARKER} is unreadable"
    for name, size in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, not the {size} recorded"
    return None


def checkpoint_folders(output_dir) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, by step N."""
    found = [path for path in Path(output_dir).iterdir() if path.is_dir() and CHECKPOINT_PATTERN.match(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT_PATTERN.match(path.name).group(1)))


def last_complete_checkpoint(output_dir, report: Callable[[str], None] = print) -> str | None:
    """The newest complete `checkpoint-N` of `output_dir` (highest N), None when there is none; each newer one that
    is not complete is skipped and reported (never loaded)."""
    for folder in reversed(checkpoint_folders(output_dir)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        report(f"jetspec: skipping {folder}, an incomplete checkpoint ({problem}); it is not loaded")
    return None


def rotate_complete_checkpoints(output_dir, limit: int | None, keep: list) -> list[Path]:
    """Deletes checkpoints beyond `limit` (the `save_total_limit`): the incomplete ones (never loadable) and the
    oldest complete ones by completion time, never those in `keep` (the one just completed, the best one). The
    Trainer's own rotation counts half-written folders and protects the highest step, which may be one of them.
    Returns the deleted folders."""
    if limit is None or limit <= 0:
        return []
    keep = {Path(path).resolve() for path in keep if path is not None}
    complete, deleted = [], []
    for folder in checkpoint_folders(output_dir):
        if checkpoint_problem(folder) is None:
            complete.append(folder)
        elif folder.resolve() not in keep:
            print(f"jetspec: deleting {folder}, an incomplete checkpoint left by a stopped run")
            deleted.append(folder)
    complete.sort(key=lambda folder: (folder / CHECKPOINT_MARKER).stat().st_mtime_ns)
    kept = [folder for folder in complete if folder.resolve() in keep]
    for folder in reversed(complete):  # the most recent first
        if folder not in kept and len(kept) < limit:
            kept.append(folder)
    deleted += [folder for folder in complete if folder not in kept]
    for folder in deleted:
        shutil.rmtree(folder, ignore_errors=True)
    return deleted


def resolve_checkpoint(args: JetSpecTrainingArguments) -> str | None:
    """`resume_from_checkpoint` as a folder: a path as given, `true` for the newest complete one in `output_dir`.

    A checkpoint is complete once its marker, written last, matches its files ([`checkpoint_problem`]);
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


def keep_folder(args: JetSpecTrainingArguments, minutes: float) -> Path | None:
    """Where the final head of a run of `minutes` training minutes is kept (see `keep_head_dir`), or None: with
    `auto`, `runs/kept/<output_dir's name>` (git-ignored) once the run reaches `keep_head_minutes`."""
    value = args.keep_head_dir
    if value is None or str(value).lower() in ("", "none", "false"):
        return None
    if str(value).lower() == "auto":
        if minutes < args.keep_head_minutes:
            return None
        return KEPT_HEADS / Path(args.output_dir).name
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


def keep_final_head(trainer, args: JetSpecTrainingArguments, run_config: dict, train_minutes: float) -> Path | None:
    """Main process only, after shipping: keeps the final head of a run of `train_minutes` where [`keep_folder`]
    says (with its trainer state: step and curve), or nothing. Returns the kept folder."""
    folder = keep_folder(args, train_minutes)
    if folder is None:
        return None
    trainer.save_state()  # its step and curve go with the head (a resume from it knows where the run ended)
    kept = keep_head(Path(args.output_dir), folder, {**run_config, "train_minutes": round(train_minutes, 2)})
    print(
        f"jetspec: the final head is kept in {kept} (bf16, outside git); the next run can start from it with "
        f"--init_head {kept}. Commit a head only when it ships or becomes the next warm-start base "
        "(docs/training.md, Keeping what was trained)"
    )
    return kept
