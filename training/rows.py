"""Regenerated training rows: where they live on disk, the stable key of a row, and the held-out split.

A row is one prompt and the target's own answer: `id` (a string), `input_ids` (prompt then answer tokens) and
`prompt_length`. Rows come in two forms, read alike:

- a regenerate folder (`training/regenerate.py --out`): `shard-*.jsonl` files and `progress.json`;
- a compact file (`regenerate.py --export`, `.npz`): token ids as uint16 (uint32 for vocabularies of 65,536 or more),
  one offset and prompt length per row, the row ids and the regeneration settings.

A row is known everywhere else (the feature store, the trainer's anchor draws, the held-out split) by its id only,
so regenerating more data or reordering it never changes what a row trains or where it is held out.

This module imports nothing else of `training/`: the regeneration, the feature store and the trainer all build on
it.
"""

import json
import os
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Any, Union

import datasets
import numpy as np

MANIFEST_NAME = "progress.json"
SHARD_GLOB = "shard-*.jsonl"
COMPACT_SUFFIX = ".npz"
TRAINING_COLUMNS = ["id", "input_ids", "prompt_length"]
COMPACT_ARRAYS = ("tokens", "offsets", "prompt_length", "id")
# what numpy raises for an empty, truncated or foreign file
UNREADABLE = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error, pickle.UnpicklingError)


def row_key(row_id) -> int:
    """The integer a row is known by: the CRC-32 of its id, the same on every process and run. The feature store
    files a row's features under it, and the collator seeds the row's anchors with it."""
    return zlib.crc32(str(row_id).encode("utf-8"))


def shard_files(out_dir: Union[str, os.PathLike]) -> list[Path]:
    """The shard files of a regenerate folder, in order."""
    return sorted(Path(out_dir).glob(SHARD_GLOB))


def read_shard(path: Union[str, os.PathLike]) -> list[dict[str, Any]]:
    """The rows of one shard file; a `ValueError` naming the file and line for a line that is not a row."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"expected a JSON row at {path} line {number}, got {error.msg}: {line[:80]!r}") from None
            if not isinstance(row, dict) or not set(TRAINING_COLUMNS) <= set(row):
                raise ValueError(f"expected a row with fields {TRAINING_COLUMNS} at {path} line {number}, got "
                                 f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
            rows.append(row)
    return rows


def load_regenerated(out_dir: Union[str, os.PathLike]) -> datasets.Dataset:
    """
    Loads the rows of a regenerate folder as one dataset, in shard order.

    Args:
        out_dir (`str` or `os.PathLike`):
            The output folder of [`training.answers.regenerate`].

    Returns:
        `datasets.Dataset`: columns `id` (`str`), `prompt` (`str`), `input_ids` (`list[int]`, prompt then
        answer tokens), `prompt_length` (`int`) and `answer` (`str`).
    """
    files = shard_files(out_dir)
    if not files:
        raise ValueError(f"expected {SHARD_GLOB} files from regenerate in {out_dir}, got none")
    rows = [row for path in files for row in read_shard(path)]
    if not rows:
        raise ValueError(f"expected regenerated rows in {out_dir}, got an empty dataset ({len(files)} empty shards)")
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "prompt": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "prompt_length": datasets.Value("int64"),
            "answer": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_list(rows, features=features)


def compact_ids(path: Union[str, os.PathLike]) -> tuple[set[str], dict]:
    """The row ids and the regeneration settings held by a compact file (empty when it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return set(), {}
    arrays = read_compact_arrays(path, ("id", "settings"))
    return {str(i) for i in arrays["id"]}, json.loads(str(arrays["settings"]))


def read_compact_arrays(path: Path, names) -> dict[str, np.ndarray]:
    """The arrays `names` of a compact file, read whole; a one-line `ValueError` naming the file when it is empty,
    not a readable `.npz`, or lacks one of them."""
    if path.stat().st_size == 0:
        raise ValueError(f"expected a compact regenerated-data file ({COMPACT_SUFFIX}), got {path}, an empty file")
    try:
        data = np.load(path)
        files, arrays = set(), {}
        if isinstance(data, np.lib.npyio.NpzFile):  # not a plain .npy array saved under the name
            with data:
                files = set(data.files)
                arrays = {name: data[name] for name in names if name in files}
    except UNREADABLE as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise ValueError(f"expected a compact regenerated-data file ({COMPACT_SUFFIX}), got {path}, which cannot be "
                         f"read ({reason})") from None
    if len(arrays) < len(names):
        raise ValueError(f"expected arrays {', '.join(names)} in {path}, got {sorted(files)}")
    return arrays


def load_compact(path: Union[str, os.PathLike]) -> datasets.Dataset:
    """
    Loads a compact file (written by [`training.answers.save_compact`]) as a dataset with columns `id`, `input_ids`
    and `prompt_length` (what training reads), in the original row order.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"expected a compact regenerated-data file ({COMPACT_SUFFIX}), got {path} which does not exist"
        )
    data = read_compact_arrays(path, COMPACT_ARRAYS)
    tokens, offsets = data["tokens"].astype(np.int64), data["offsets"].astype(np.int64)
    n = len(data["id"])
    if (
        offsets.ndim != 1 or len(offsets) != n + 1 or len(data["prompt_length"]) != n
        or (n and (offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any()))
    ):
        raise ValueError(
            f"expected {n} rows in {path} (ids) with {n + 1} increasing offsets from 0 to {len(tokens)} (tokens) and "
            f"{n} prompt lengths, got {len(offsets)} offsets ({offsets[:1].tolist()} .. {offsets[-1:].tolist()}) and "
            f"{len(data['prompt_length'])} prompt lengths"
        )
    rows = {
        "id": [str(i) for i in data["id"]],
        "input_ids": [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(n)],
        "prompt_length": data["prompt_length"].astype(np.int64).tolist(),
    }
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "prompt_length": datasets.Value("int64"),
        }
    )
    return datasets.Dataset.from_dict(rows, features=features)


def load_source(source: Union[str, os.PathLike]) -> datasets.Dataset:
    """Regenerated rows from either form: a compact file ([`load_compact`], `.npz`) or a regenerate folder of shards
    ([`load_regenerated`])."""
    return load_compact(source) if str(source).endswith(COMPACT_SUFFIX) else load_regenerated(source)


def load_rows(sources: list) -> datasets.Dataset:
    """The training columns (`id`, `input_ids`, `prompt_length`) of every source, concatenated in order."""
    if not sources:
        raise ValueError("expected at least one regenerated data source, got none")
    parts = [load_source(source).select_columns(TRAINING_COLUMNS) for source in sources]
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(dataset) == 0:
        raise ValueError(f"expected regenerated rows in {list(sources)}, got an empty dataset")
    return dataset


def split_train_eval(dataset: datasets.Dataset, eval_fraction: float, seed: int):
    """`(train, eval)`: the rows whose seeded id hash falls below `eval_fraction` are held out (at least one; None if
    0). A row's side depends only on its id and the seed, so data regenerated later never moves a held-out row into
    training (a random split of the grown dataset would)."""
    if len(dataset) == 0:
        raise ValueError("expected a non-empty training dataset, got an empty dataset")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"expected eval_fraction in [0, 1), got {eval_fraction}")
    if eval_fraction == 0:
        return dataset, None
    names = dataset["id"] if "id" in dataset.column_names else [str(ids) for ids in dataset["input_ids"]]
    draws = [zlib.crc32(f"{seed}:{name}".encode("utf-8")) / 2**32 for name in names]
    held = [i for i, u in enumerate(draws) if u < eval_fraction] or [int(np.argmin(draws))]
    if len(held) >= len(dataset):
        raise ValueError(
            f"expected more than {len(held)} rows so that eval_fraction={eval_fraction} leaves training rows, "
            f"got {len(dataset)}"
        )
    held_set = set(held)
    return dataset.select([i for i in range(len(dataset)) if i not in held_set]), dataset.select(held)
