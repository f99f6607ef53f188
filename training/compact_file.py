"""The committed form of regenerated rows: a regenerate folder packed into one small compressed `.npz`
([`save_compact`], [`write_compact`]; [`training.rows.load_compact`] reads it back), and the folder's settings and
failed prompts, checked across the parts of a split run.
"""

import json
import os
from pathlib import Path
from typing import Any, Union

import numpy as np

from .rows import (
    COMPACT_SUFFIX,
    MANIFEST_NAME,
    PART_GLOB,
    compact_ids,
    load_compact,
    load_regenerated,
    regenerated_folders,
)

# may differ between the parts of one compact file
SCHEDULING_SETTINGS = frozenset(
    {"batch_size", "shard_size", "continuous", "sort_pool", "cache_implementation", "concurrency"}
)


def folder_settings(out_dir: Union[str, os.PathLike]) -> dict[str, Any]:
    """The regeneration settings of a regenerate folder (`progress.json`); of its first part when the prompts were
    split over processes, after checking that every part ran with them (only scheduling settings may differ)."""
    folders = regenerated_folders(out_dir)
    if not folders:
        raise ValueError(
            f"expected a regenerate folder ({MANIFEST_NAME}, or {PART_GLOB} folders holding one) in {out_dir}, got none"
        )
    manifests = [folder / MANIFEST_NAME for folder in folders]
    missing = [str(path) for path in manifests if not path.is_file()]
    if missing:
        raise ValueError(f"expected {MANIFEST_NAME} in every part of {out_dir}, missing {missing}")
    every = [json.loads(path.read_text(encoding="utf-8"))["settings"] for path in manifests]
    for folder, settings in zip(folders[1:], every[1:]):
        differ = sorted(
            key for key in {*settings, *every[0]} - SCHEDULING_SETTINGS if settings.get(key) != every[0].get(key)
        )
        if differ:
            raise ValueError(
                f"expected the parts of {out_dir} to share their settings, got {folder.name} differing "
                f"from {folders[0].name} in {differ}"
            )
    return every[0]


def failed_prompts(out_dir: Union[str, os.PathLike]) -> dict[str, str]:
    """The prompts recorded as failed in a regenerate folder (its manifest, or every part's), `{id: reason}`: a
    completions server gave no usable answer to them after every retry, and no shard holds them."""
    failed = {}
    for folder in regenerated_folders(out_dir):
        manifest = folder / MANIFEST_NAME
        if manifest.is_file():
            failed.update(json.loads(manifest.read_text(encoding="utf-8")).get("failed", {}))
    return failed


def save_compact(out_dir: Union[str, os.PathLike], path: Union[str, os.PathLike]) -> dict[str, Any]:
    """
    Packs the rows written by [`training.answers.regenerate`] into one small file to commit: token ids as uint16
    (uint32 for vocabularies of 65,536 or more), one offset and prompt length per row, and the row ids; text is left out
    (prompts are in the prompt file, answers decode from the ids).

    When `path` already exists its rows are kept first and the folder's rows not in it are appended, so a
    regeneration resumed on a fresh clone (which skips the ids already packed) extends the committed file.

    Args:
        out_dir (`str` or `os.PathLike`): the output folder of [`training.answers.regenerate`].
        path (`str` or `os.PathLike`): the `.npz` file to write (compressed, written atomically).

    Returns:
        `dict[str, Any]`: `{"rows", "tokens", "answer_tokens", "settings", "failed"}`, `failed` the prompts of the
        folder recorded as failed (never packed: they have no row), `{id: reason}`.
    """
    path = Path(path)
    if path.suffix != COMPACT_SUFFIX:
        raise ValueError(f"expected a {COMPACT_SUFFIX} file to write, got {path}")
    settings = folder_settings(out_dir)
    previous_ids, previous_settings = compact_ids(path)
    # batching and sharding change how rows were scheduled, not what greedy decoding writes (bf16 may move a tie)
    same = [key for key in settings if key not in SCHEDULING_SETTINGS]
    if previous_ids and any(previous_settings.get(key) != settings[key] for key in same):
        raise ValueError(
            f"expected the settings of the rows already in {path}, {previous_settings}, got {settings} in {out_dir} "
            f"(only {sorted(SCHEDULING_SETTINGS)} may differ)"
        )
    if previous_ids:
        settings = previous_settings
    rows = load_compact(path).to_list() if previous_ids else []
    rows += [
        {"id": row["id"], "input_ids": row["input_ids"], "prompt_length": row["prompt_length"]}
        for row in load_regenerated(out_dir)
        if row["id"] not in previous_ids
    ]
    return {**write_compact(path, rows, settings), "failed": failed_prompts(out_dir)}


def write_compact(path: Union[str, os.PathLike], rows: list[dict], settings: dict) -> dict[str, Any]:
    """
    Writes `rows` (dicts with `id`, `input_ids` and `prompt_length`) as a compact file, the layout
    [`training.rows.load_compact`] reads: token ids as uint16 (uint32 for ids of 65,536 or more), one offset and
    prompt length per row, the row ids, and `settings` as JSON. Compressed, written atomically.

    Returns:
        `dict[str, Any]`: `{"rows", "tokens", "answer_tokens", "settings"}`.
    """
    path = Path(path)
    if path.suffix != COMPACT_SUFFIX:
        raise ValueError(f"expected a {COMPACT_SUFFIX} file to write, got {path}")
    ids = [row["input_ids"] for row in rows]
    flat = [token for row in ids for token in row]
    dtype = np.uint16 if max(flat, default=0) < 2**16 else np.uint32
    lengths = np.array([len(row) for row in ids], dtype=np.int64)
    arrays = {
        "tokens": np.array(flat, dtype=dtype),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "prompt_length": np.array([row["prompt_length"] for row in rows], dtype=np.int32),
        "id": np.array([row["id"] for row in rows]),
        "settings": np.array(json.dumps(settings)),
    }
    tmp = path.with_name(f".{path.stem}.tmp{COMPACT_SUFFIX}")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)
    answer_tokens = int(lengths.sum() - arrays["prompt_length"].sum())
    return {"rows": len(ids), "tokens": len(flat), "answer_tokens": answer_tokens, "settings": settings}
