"""Regenerated training rows: where they live on disk, the stable key of a row, and the held-out split.

A row is one prompt and the target's own answer: `id` (a string), `input_ids` (prompt then answer tokens) and
`prompt_length`. Rows come in two forms, read alike:

- a regenerate folder (`training/regenerate.py --out`): `shard-*.jsonl` files and `progress.json`, or, when the
  prompts were split over K processes (`--num_shards K`), one such folder per process, `part-0000i-of-0000K/`;
- a compact file (`regenerate.py --export`, `.npz`): token ids as uint16 (uint32 for vocabularies of 65,536 or more),
  one offset and prompt length per row, the row ids and the regeneration settings.

Training also reads rows from `datasets` (a `save_to_disk` folder, a local jsonl / parquet file or a Hub dataset,
streamed or not) holding the same columns ([`load_rows`]); a stream is split into training and held-out rows by the
same id hash as a map-style dataset ([`split_train_eval`]).

A row is known everywhere else (the feature store, the trainer's anchor draws, the held-out split) by its id only,
so regenerating more data or reordering it never changes what a row trains or where it is held out.

This module imports nothing else of `training/`: the regeneration, the feature store and the trainer all build on
it.
"""

import functools
import json
import os
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Any, Optional, Union

import datasets
import numpy as np

MANIFEST_NAME = "progress.json"
SHARD_GLOB = "shard-*.jsonl"
PART_GLOB = "part-*-of-*"
COMPACT_SUFFIX = ".npz"
TRAINING_COLUMNS = ["id", "input_ids", "prompt_length"]
TRAINING_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int64")),
        "prompt_length": datasets.Value("int64"),
    }
)
# local data files training reads through `datasets.load_dataset`, by suffix
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
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


def part_name(shard_index: int, num_shards: int) -> str:
    """The subfolder of a regenerate folder that process `shard_index` of `num_shards` writes."""
    return f"part-{shard_index:05d}-of-{num_shards:05d}"


def part_folders(out_dir: Union[str, os.PathLike]) -> list[Path]:
    """The per-process subfolders of a regenerate folder (`part-*-of-*`), in process order."""
    return sorted(path for path in Path(out_dir).glob(PART_GLOB) if path.is_dir())


def regenerated_folders(out_dir: Union[str, os.PathLike]) -> list[Path]:
    """The folders holding the rows of a regenerate folder: itself (one process) and its per-process parts."""
    out_dir = Path(out_dir)
    own = shard_files(out_dir) or (out_dir / MANIFEST_NAME).is_file()
    return ([out_dir] if own else []) + part_folders(out_dir)


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
                raise ValueError(
                    f"expected a JSON row at {path} line {number}, got {error.msg}: {line[:80]!r}"
                ) from None
            if not isinstance(row, dict) or not set(TRAINING_COLUMNS) <= set(row):
                raise ValueError(
                    f"expected a row with fields {TRAINING_COLUMNS} at {path} line {number}, got "
                    f"{sorted(row) if isinstance(row, dict) else type(row).__name__}"
                )
            rows.append(row)
    return rows


def load_regenerated(out_dir: Union[str, os.PathLike]) -> datasets.Dataset:
    """
    Loads the rows of a regenerate folder as one dataset, in shard order: its own shards, then those of each of its
    per-process parts in process order (the union of the prompts split over processes).

    Args:
        out_dir (`str` or `os.PathLike`):
            The output folder of [`training.answers.regenerate`].

    Returns:
        `datasets.Dataset`: columns `id` (`str`), `prompt` (`str`), `input_ids` (`list[int]`, prompt then
        answer tokens), `prompt_length` (`int`) and `answer` (`str`).
    """
    files = [path for folder in regenerated_folders(out_dir) for path in shard_files(folder)]
    if not files:
        raise ValueError(
            f"expected {SHARD_GLOB} files from regenerate in {out_dir} (or in its {PART_GLOB} folders), got none"
        )
    rows = [row for path in files for row in read_shard(path)]
    if not rows:
        raise ValueError(f"expected regenerated rows in {out_dir}, got an empty dataset ({len(files)} empty shards)")
    seen: set[str] = set()
    for row in rows:
        if row["id"] in seen:
            raise ValueError(
                f"expected each row once in {out_dir}, got id {row['id']!r} twice (parts of one folder "
                "hold disjoint prompts)"
            )
        seen.add(row["id"])
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
        raise ValueError(
            f"expected a compact regenerated-data file ({COMPACT_SUFFIX}), got {path}, which cannot be read ({reason})"
        ) from None
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
        offsets.ndim != 1
        or len(offsets) != n + 1
        or len(data["prompt_length"]) != n
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


def load_source(source: Union[str, os.PathLike], streaming: bool = False):
    """
    The rows of one source, as `datasets` reads it, in its own row order.

    Args:
        source (`str` or `os.PathLike`):
            A compact file ([`load_compact`], `.npz`); a regenerate folder ([`load_regenerated`]); a folder written
            by `save_to_disk` (a `Dataset`, or a `DatasetDict` with a `train` split); a local `.jsonl`, `.json` or
            `.parquet` file; or, when no such path exists, a Hub dataset id (its `train` split), as
            `datasets.load_dataset` resolves names.
        streaming (`bool`, *optional*, defaults to `False`):
            Return an `IterableDataset`: data files and Hub datasets are then read as they are iterated, never
            loaded whole; the other forms are read and then iterated.

    Returns:
        `datasets.Dataset` or `datasets.IterableDataset`.
    """
    path = Path(source)
    if str(source).endswith(COMPACT_SUFFIX):
        dataset = load_compact(path)
    elif path.is_dir() and not _saved_dataset(path):
        dataset = load_regenerated(path)  # also names the folder when it holds neither form
    elif path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            if "train" not in dataset:
                raise ValueError(f"expected a `train` split in the DatasetDict saved in {path}, got {list(dataset)}")
            dataset = dataset["train"]
    elif path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(
                f"expected a data file ending in {sorted(DATA_FILE_BUILDERS)} or {COMPACT_SUFFIX}, got {path}"
            )
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming)
    else:
        return _load_hub(str(source), streaming)
    return dataset.to_iterable_dataset() if streaming else dataset


def _saved_dataset(path: Path) -> bool:
    """Whether `path` holds what `save_to_disk` writes (a `Dataset` or a `DatasetDict`)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_hub(name: str, streaming: bool):
    """The `train` split of Hub dataset `name`; a `ValueError` saying that `name` is no local path either."""
    try:
        return datasets.load_dataset(name, split="train", streaming=streaming)
    except (datasets.exceptions.DatasetNotFoundError, FileNotFoundError, ConnectionError) as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        raise ValueError(
            f"expected a local data folder or file, or a Hub dataset id, got {name!r}, which is no "
            f"local path and which the Hub does not serve ({reason})"
        ) from None


def load_rows(sources: list, streaming: bool = False):
    """
    The training columns (`id`, `input_ids`, `prompt_length`) of every source ([`load_source`]), concatenated in
    order.

    Args:
        sources (`list`): the sources.
        streaming (`bool`, *optional*, defaults to `False`): an `IterableDataset` instead of a `Dataset`.

    Returns:
        `datasets.Dataset` or `datasets.IterableDataset` with the features [`TRAINING_FEATURES`].
    """
    if not sources:
        raise ValueError("expected at least one regenerated data source, got none")
    parts = [_training_columns(load_source(source, streaming), source) for source in sources]
    if not streaming:
        check_each_prompt_once(parts, sources)
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    empty = next(iter(dataset.take(1)), None) is None if streaming else len(dataset) == 0
    if empty:
        raise ValueError(f"expected regenerated rows in {list(sources)}, got an empty dataset")
    return dataset


def check_each_prompt_once(parts: list, sources: list):
    """A `ValueError` naming the id and its sources when a prompt id is in two sources (or twice in one): a prompt
    trained on twice weighs double, and a file regenerated without `--exclude` naming every committed file repeats
    prompts. Streams are not read ahead for this."""
    first: dict = {}
    for part, source in zip(parts, sources):
        for row_id in part["id"]:
            if row_id in first:
                raise ValueError(
                    f"expected each prompt id once across the data sources, got {row_id!r} in {first[row_id]} and "
                    f"in {source} (regenerate with --exclude naming every committed file)"
                )
            first[row_id] = source


def _training_columns(dataset, source):
    """`dataset` reduced to the training columns, cast to [`TRAINING_FEATURES`] (so that sources concatenate); a
    `ValueError` naming `source` when one of them is missing. A stream whose features are unknown until read (a
    streamed json file) shows its columns in its first row."""
    columns = dataset.column_names
    if columns is None:
        first = next(iter(dataset.take(1)), {})
        columns = list(first)
    missing = [name for name in TRAINING_COLUMNS if name not in columns]
    if missing:
        raise ValueError(
            f"expected the columns {TRAINING_COLUMNS} in {source}, got {sorted(columns)} (missing {missing})"
        )
    dataset = dataset.select_columns(TRAINING_COLUMNS)
    return dataset if dataset.features == TRAINING_FEATURES else dataset.cast(TRAINING_FEATURES)


def _row_name(row: dict) -> str:
    """What a row is hashed by for the split: its id (its token ids for rows without one)."""
    return str(row["id"]) if "id" in row else str(row["input_ids"])


def held_draw(name: str, seed: int) -> float:
    """A uniform draw in [0, 1) fixed by the row's name and the seed: rows below `eval_fraction` are held out."""
    return zlib.crc32(f"{seed}:{name}".encode("utf-8")) / 2**32


def _is_training_row(row: dict, eval_fraction: float, seed: int, forced: Optional[str]) -> bool:
    name = _row_name(row)
    return held_draw(name, seed) >= eval_fraction and name != forced


def split_train_eval(dataset, eval_fraction: float, seed: int, stream_eval_rows: int = 1000):
    """
    `(train, eval)`: the rows whose seeded id hash falls below `eval_fraction` are held out (at least one; eval is
    None for 0). A row's side depends only on its id and the seed, so data regenerated later never moves a held-out
    row into training (a random split of the grown dataset would).

    Args:
        dataset (`datasets.Dataset` or `datasets.IterableDataset`): the rows.
        eval_fraction (`float`): the share held out, in [0, 1).
        seed (`int`): the seed of the hash.
        stream_eval_rows (`int`, *optional*, defaults to 1000): for an `IterableDataset`, the evaluation set holds
            the first this many held-out rows of the stream (read once, here), as a `Dataset`; the other held-out
            rows are read past in training and never trained on. The training rows stay a stream (filtered).

    Returns:
        `(train, eval)`: `train` of the kind of `dataset`, `eval` a `datasets.Dataset` or None.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"expected eval_fraction in [0, 1), got {eval_fraction}")
    if isinstance(dataset, datasets.IterableDataset):
        return _split_stream(dataset, eval_fraction, seed, stream_eval_rows)
    if len(dataset) == 0:
        raise ValueError("expected a non-empty training dataset, got an empty dataset")
    if eval_fraction == 0:
        return dataset, None
    names = dataset["id"] if "id" in dataset.column_names else [str(ids) for ids in dataset["input_ids"]]
    draws = [held_draw(name, seed) for name in names]
    held = [i for i, u in enumerate(draws) if u < eval_fraction] or [int(np.argmin(draws))]
    if len(held) >= len(dataset):
        raise ValueError(
            f"expected more than {len(held)} rows so that eval_fraction={eval_fraction} leaves training rows, "
            f"got {len(dataset)}"
        )
    held_set = set(held)
    return dataset.select([i for i in range(len(dataset)) if i not in held_set]), dataset.select(held)


def _split_stream(stream: datasets.IterableDataset, eval_fraction: float, seed: int, eval_rows: int):
    """[`split_train_eval`] of a stream: the held-out rows are collected from its start (until `eval_rows` are found,
    or, when none is, the whole stream is read and its lowest draw is held out, as for a map-style dataset)."""
    if not isinstance(eval_rows, int) or eval_rows < 1:
        raise ValueError(f"expected stream_eval_rows to be a positive int, got {eval_rows!r}")
    if eval_fraction == 0:
        return stream, None
    held, lowest = [], None
    for row in stream:
        draw = held_draw(_row_name(row), seed)
        if draw < eval_fraction:
            held.append(row)
            if len(held) == eval_rows:
                break
        elif not held and (lowest is None or draw < lowest[0]):
            lowest = (draw, row)
    if not held and lowest is None:
        raise ValueError("expected a non-empty training stream, got an empty one")
    forced = None
    if not held:
        held, forced = [lowest[1]], _row_name(lowest[1])
    train = stream.filter(functools.partial(_is_training_row, eval_fraction=eval_fraction, seed=seed, forced=forced))
    if next(iter(train.take(1)), None) is None:
        raise ValueError(
            f"expected a stream with rows left for training after eval_fraction={eval_fraction}, got "
            f"only the {len(held)} held-out rows"
        )
    return train, datasets.Dataset.from_list(held, features=stream.features)


def first_rows(dataset, count: int) -> datasets.Dataset:
    """The first `count` rows (fewer when there are fewer) of a `Dataset` or an `IterableDataset`, as a `Dataset`:
    what needs random access (the lookup prior's sample, the draft vocabulary's counts) reads a stream's head."""
    if isinstance(dataset, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(dataset.take(count)), features=dataset.features)
    return dataset.select(range(min(count, len(dataset))))


def answer_token_cap(dataset, max_tokens: int, seed: int = 0) -> tuple[datasets.Dataset, int]:
    """The rows of `dataset` (a map-style `Dataset` of training rows) that hold `max_tokens` answer tokens, and how
    many they hold: the rows are ordered by a draw fixed by their id and `seed` (`crc32("cap:<seed>:<id>")`, ties by
    position) and taken while the tokens taken so far are fewer than `max_tokens`, so the count reaches the cap and
    passes it by less than one row's answer (all rows, and their count, when they hold fewer). A smaller cap takes a
    prefix of a larger one's rows (same seed). The rows keep their order in `dataset`.

    Give it the training side of [`split_train_eval`]: it only selects among the rows it is given, so held-out rows
    stay out."""
    if isinstance(dataset, datasets.IterableDataset):
        raise ValueError("expected a map-style Dataset to cap by answer tokens, got a stream (IterableDataset)")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"expected max_tokens to be an int >= 1 (answer tokens), got {max_tokens!r}")
    names = dataset["id"] if "id" in dataset.column_names else [str(ids) for ids in dataset["input_ids"]]
    answers = answer_lengths(dataset)
    order = sorted(range(len(names)), key=lambda i: (zlib.crc32(f"cap:{seed}:{names[i]}".encode("utf-8")), i))
    chosen, taken = [], 0
    for i in order:
        if taken >= max_tokens:
            break
        chosen.append(i)
        taken += answers[i]
    return dataset.select(sorted(chosen)), taken


def answer_lengths(dataset) -> list:
    """Answer tokens per row of a map-style `Dataset` (its tokens after `prompt_length`)."""
    return [len(ids) - int(p) for ids, p in zip(dataset["input_ids"], dataset["prompt_length"])]
