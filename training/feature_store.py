"""What a head's training needs from the frozen target, computed once and kept on disk.

A JetSpec head reads two things of the target per training row: the concatenated outputs of the selected layers
(`target_layer_ids`, the head's context) and the final post-norm hidden state (the teacher: the target's LM head
applied to it). Both depend only on the target and the row, not on the head, so one pass of the target over the
regenerated data serves every later run (ablations, longer schedules, resumed runs): training then costs only the
head. `cache_features` in the trainer keeps the same tensors in memory for one run; a store keeps them across runs.

Layout of a store folder:
    store.json      target, layer ids, widths, max_length and `"format": 2`; written once, when the store is created
    features.bin    bfloat16 rows of width (k + 1) * H, raw, appended chunk by chunk:
                    [layer ids[0] | ... | layer ids[k-1] | final hidden]
    index.bin       one little-endian int64 record (row key, start row of features.bin, length) per stored row,
                    appended after the chunk's features are durable: a build writes each row's index once, so
                    writing and opening a store cost time linear in its rows

A store of the first format (its `store.json` holds a `rows` dict {key: [start, length]} and `total`, rewritten at
every chunk) is read as it is, and moved to the index file the first time a build extends it.

    python -m training.feature_store --target smollm2-135m --data training/data/smollm2-135m-mix.npz \
        --out cache/smollm2-135m --max_length 512

Building is resumable: rows already in the store are skipped, and a chunk counts once `index.bin` names it.
`--held_out first` stores the trainer's held-out rows of all the data before the rest (`only`: just them), so the
offline evaluator (`training.evaluate_head`, `training.tau_table`) can run while the store is still being built.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser

from jetspec.targets import load_target
from modeling_jetspec.configuration_jetspec import default_target_layer_ids

from .rows import load_source, row_key

META_NAME = "store.json"
DATA_NAME = "features.bin"
INDEX_NAME = "index.bin"
STORE_FORMAT = 2
HELD_OUT_MODES = ("with_the_rest", "first", "only")
INDEX_RECORD = np.dtype([("key", "<i8"), ("start", "<i8"), ("length", "<i8")])  # 24 bytes per stored row


def _open_index(path: Path) -> tuple[dict, np.ndarray, int]:
    """`(meta, records, total)` of a store folder: its `store.json`, its stored rows as [`INDEX_RECORD`]s in the order
    they were written (a record cut short by an interrupted append left out), and the rows of `features.bin` they
    name. A `ValueError` names an unreadable store."""
    meta_path = path / META_NAME
    if not meta_path.is_file():
        raise ValueError(f"expected a feature store folder holding {META_NAME}, got {path}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        meta["target_layer_ids"] = [int(i) for i in meta["target_layer_ids"]]
        meta["hidden_size"] = int(meta["hidden_size"])
        if meta.get("format", 1) == 1:  # the first format: the index inside store.json
            rows = sorted((int(s), int(k), int(n)) for k, (s, n) in meta["rows"].items())
            return meta, np.array([(k, s, n) for s, k, n in rows], dtype=INDEX_RECORD), int(meta["total"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"expected a feature store index (target_layer_ids, hidden_size, rows, total) in "
            f"{meta_path}, got an unreadable one ({type(error).__name__}: {error})"
        ) from None
    if meta["format"] != STORE_FORMAT:
        raise ValueError(
            f"expected a feature store of format 1 or {STORE_FORMAT} in {meta_path}, got {meta['format']!r}"
        )
    index_path = path / INDEX_NAME
    raw = index_path.read_bytes() if index_path.is_file() else b""
    records = np.frombuffer(raw[: len(raw) - len(raw) % INDEX_RECORD.itemsize], dtype=INDEX_RECORD)
    total = int((records["start"] + records["length"]).max()) if len(records) else 0
    return meta, records, total


def _check_data(path: Path, total: int, width: int) -> None:
    data_path = path / DATA_NAME
    size = data_path.stat().st_size if data_path.is_file() else 0
    if size < total * width * 2:  # bfloat16 rows
        raise ValueError(
            f"expected {total} rows of {width} bfloat16 values ({total * width * 2} bytes) "
            f"in {data_path} (as {META_NAME} and {INDEX_NAME} say), got {size} bytes"
        )


class FeatureStore:
    """Read access to a store folder (see the module docstring), one row or one batch of rows at a time.

    Args:
        path (`str` or `os.PathLike`): the folder written by [`build_feature_store`].
    """

    def __init__(self, path):
        self.path = Path(path)
        self.meta, records, self.total = _open_index(self.path)
        self.layer_ids, self.hidden_size = self.meta["target_layer_ids"], self.meta["hidden_size"]
        self.width = (len(self.layer_ids) + 1) * self.hidden_size
        _check_data(self.path, self.total, self.width)
        # sorted by key for `searchsorted`; a stable sort keeps the first record of a key first
        order = np.argsort(records["key"], kind="stable")
        self._keys, self._starts, self._lengths = (records[name][order] for name in ("key", "start", "length"))
        self._rows = int(np.unique(self._keys).size)
        self._data = (
            np.memmap(self.path / DATA_NAME, dtype=np.uint16, mode="r", shape=(self.total, self.width))
            if self.total
            else None
        )

    def __len__(self) -> int:
        return self._rows

    def check(self, layer_ids, hidden_size: int) -> None:
        """`ValueError` unless the store holds the features a head reading `layer_ids` of width `hidden_size` needs."""
        if list(layer_ids) != self.layer_ids or int(hidden_size) != self.hidden_size:
            raise ValueError(
                f"expected a feature store of target layers {list(layer_ids)} and hidden size {hidden_size} (the "
                f"head's), got layers {self.layer_ids} and hidden size {self.hidden_size} in {self.path}"
            )

    def _lookup(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(found, start, stored length)` per key, of shape `(B,)` each (start and length 0 where not found)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        at = np.searchsorted(self._keys, keys).clip(max=max(len(self._keys) - 1, 0))
        found = (self._keys[at] == keys) if len(self._keys) else np.zeros(len(keys), dtype=bool)
        starts = np.where(found, self._starts[at] if len(self._keys) else 0, 0)
        lengths = np.where(found, self._lengths[at] if len(self._keys) else 0, 0)
        return found, starts, lengths

    def covers(self, key: int, length: int) -> bool:
        """Whether row `key` is stored with at least its first `length` positions."""
        return self.covers_all([key], [length])

    def covers_all(self, keys, lengths) -> bool:
        """Whether every row `keys[i]` is stored with at least its first `lengths[i]` positions."""
        found, _, stored = self._lookup(keys)
        return bool((found & (stored >= np.asarray(lengths, dtype=np.int64).reshape(-1))).all())

    def get(self, key: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of row `key`: features `(length, k*H)` and final hidden `(length, H)`, bf16."""
        features, final = self.get_batch([key], [length], width=length)
        return features[0], final[0]

    def get_batch(self, keys, lengths, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `lengths[i]` positions of each row `keys[i]`, right padded with zeros to `width`, in one pass
        over the file in its order: features `(B, width, k*H)` and final hidden `(B, width, H)`, bf16.

        Args:
            keys (sequence of `int`): row keys ([`training.rows.row_key`]).
            lengths (sequence of `int`): positions wanted per row, each at most what the store holds.
            width (`int`, *optional*): padded length; defaults to the longest of `lengths`.
        """
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        found, starts, stored = self._lookup(keys)
        if len(lengths) != len(found):
            raise ValueError(f"expected one length per key, got {len(found)} keys and {len(lengths)} lengths")
        short = np.flatnonzero(~found | (lengths > stored))
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"expected at most {int(stored[i])} positions of row {int(np.asarray(keys)[i])} "
                f"(stored), got {int(lengths[i])}"
            )
        width = int(lengths.max(initial=0)) if width is None else int(width)
        block = np.zeros((len(lengths), width, self.width), dtype=np.uint16)  # (B, width, (k + 1) * H)
        for i in np.argsort(starts, kind="stable"):  # file order: sequential reads
            n = min(int(lengths[i]), width)
            block[i, :n] = self._data[starts[i] : starts[i] + n]
        block = torch.from_numpy(block).view(torch.bfloat16)
        split = len(self.layer_ids) * self.hidden_size
        return block[..., :split], block[..., split:]


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path / f".{META_NAME}.tmp"
    tmp.write_text(json.dumps(meta), encoding="utf-8")
    os.replace(tmp, path / META_NAME)


def _append_durably(path: Path, payload: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


def _move_to_index_file(path: Path, meta: dict, records: np.ndarray) -> dict:
    """Write a first-format store's `records` (its `rows` dict) as `index.bin`, then its `store.json` without them."""
    tmp = path / f".{INDEX_NAME}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(records.tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path / INDEX_NAME)
    moved = {k: v for k, v in meta.items() if k not in ("rows", "total")}
    moved["format"] = STORE_FORMAT
    _write_meta(path, moved)
    return moved


def store_settings(target, layer_ids, max_length: int, target_name: str = "") -> dict:
    """What a store records and checks when extended: the target, its layers read, widths and row truncation."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    hidden_size, num_layers = int(config.hidden_size), int(config.num_hidden_layers)
    layer_ids = [int(i) for i in layer_ids]
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if not layer_ids or bad:
        raise ValueError(f"expected target layer ids in [0, {num_layers}), got {layer_ids}")
    if max_length < 1:
        raise ValueError(f"expected max_length >= 1, got {max_length}")
    return {
        "target": target_name,
        "target_layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "dtype": "bfloat16",
        "max_length": int(max_length),
    }


def stored_hidden_states(layer_ids) -> list[int]:
    """The `output_hidden_states` selection a store row is made of: the outputs of `layer_ids` (index i + 1 is layer
    i) and the final normed state (-1). The target then keeps only these k + 1 of its L + 1 hidden states; the
    returned tuple still has L + 1 entries, `None` where not selected, so [`stack_states`] indexes it as before."""
    return [int(i) + 1 for i in layer_ids] + [-1]


def stack_states(hidden_states, layer_ids) -> torch.Tensor:
    """One store row block from a forward's `hidden_states` (index i + 1 is layer i, the last one the final normed
    state; all of them, or the [`stored_hidden_states`] selection): `(..., (k + 1) * H)` bf16, the selected layers
    then the final state."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids] + [hidden_states[-1]], -1).to("cpu", torch.bfloat16)


class StoreWriter:
    """Appends rows to a store folder, creating it or checking that its settings match; each `append` is durable.

    An append writes the chunk's features, then its index records (24 bytes a row); `store.json` is written only when
    the store is created. Bytes of an append that no index record names (an interrupted build) are dropped on open.

    Args:
        out_dir (`str` or `os.PathLike`): the store folder.
        settings (`dict`): from [`store_settings`].
    """

    def __init__(self, out_dir, settings: dict):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if (self.out / META_NAME).is_file():
            self.meta, records, self.total = _open_index(self.out)
            previous = {k: self.meta.get(k) for k in settings}
            if previous != settings:
                raise ValueError(f"expected the settings of the store in {self.out}, {previous}, got {settings}")
            if self.meta.get("format", 1) == 1:
                self.meta = _move_to_index_file(self.out, self.meta, records)
        else:
            self.meta, records, self.total = dict(settings, format=STORE_FORMAT), np.empty(0, INDEX_RECORD), 0
            (self.out / INDEX_NAME).write_bytes(b"")
            _write_meta(self.out, self.meta)
        self.max_length = settings["max_length"]
        self.width = (len(settings["target_layer_ids"]) + 1) * settings["hidden_size"]
        with open(self.out / DATA_NAME, "ab"):
            pass
        _check_data(self.out, self.total, self.width)
        self._keys = set(records["key"].tolist())
        os.truncate(self.out / INDEX_NAME, records.nbytes)  # a record cut short
        os.truncate(self.out / DATA_NAME, self.total * self.width * 2)  # features no record names

    def has(self, key: int) -> bool:
        return int(key) in self._keys

    def append(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """Store `(row key, (length, (k + 1) * H) tensor)` pairs, truncated to the store's `max_length`; rows already
        stored are kept as they are."""
        payload, records, fresh, offset = [], [], set(), self.total
        for key, block in blocks:
            key = int(key)
            if self.has(key) or key in fresh:
                continue
            if block.dim() != 2 or block.shape[1] != self.width:
                raise ValueError(f"expected a (length, {self.width}) block for row {key}, got {tuple(block.shape)}")
            block = block[: self.max_length].to(torch.bfloat16).contiguous()
            payload.append(block.view(torch.uint16).numpy().tobytes())
            records.append((key, offset, int(block.shape[0])))
            offset += int(block.shape[0])
            fresh.add(key)
        if not records:
            return
        _append_durably(self.out / DATA_NAME, b"".join(payload))
        # the index names the features only once they are on disk
        _append_durably(self.out / INDEX_NAME, np.array(records, dtype=INDEX_RECORD).tobytes())
        self._keys |= fresh
        self.total = offset


def _length_batches(order: list[int], lengths: list[int], batch_tokens: int) -> Iterable[list[int]]:
    """Consecutive groups of `order` (sorted by length) whose padded size rows * longest stays within the budget."""
    batch = []
    for index in order:
        if batch and (len(batch) + 1) * lengths[index] > batch_tokens:  # `index` is the longest so far
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


@torch.no_grad()
def build_feature_store(
    target,
    layer_ids,
    rows,
    out_dir,
    max_length: int = 512,
    batch_tokens: int = 8192,
    chunk_rows: int = 128,
    target_name: str = "",
    progress: bool = True,
) -> FeatureStore:
    """Run the frozen `target` once over every row of `rows` not yet stored, appending to the store in `out_dir`.

    Args:
        target (`PreTrainedModel`): the target, in the dtype training will use (bf16 on CPUs that run it well).
        layer_ids (`list[int]`): the head's `target_layer_ids`.
        rows (iterable of `dict`): `id` and `input_ids` per row (a regenerated dataset).
        out_dir (`str` or `os.PathLike`): the store folder, created or extended.
        max_length (`int`, *optional*, defaults to 512): rows are stored truncated to this many positions (the
            trainer's `max_length`; a longer run recomputes rows the store holds too short).
        batch_tokens (`int`, *optional*, defaults to 8192): padded tokens per target forward (rows sorted by length).
        chunk_rows (`int`, *optional*, defaults to 128): rows written (and made durable) together.
        target_name (`str`, *optional*): recorded, and checked when extending an existing store.
    """
    if batch_tokens < 1 or chunk_rows < 1:
        raise ValueError(f"expected batch_tokens and chunk_rows >= 1, got {batch_tokens} and {chunk_rows}")
    settings = store_settings(target, layer_ids, max_length, target_name)
    layer_ids = settings["target_layer_ids"]
    writer = StoreWriter(out_dir, settings)
    todo, seen = [], {}
    for row in rows:
        key = row_key(row["id"])
        if key in seen and seen[key] != str(row["id"]):
            raise ValueError(f"expected distinct row keys, got rows {seen[key]!r} and {row['id']!r} sharing key {key}")
        seen[key] = str(row["id"])
        if not writer.has(key):
            todo.append((key, list(row["input_ids"])[:max_length]))
    device = next(target.parameters()).device
    decoder = target.get_decoder()
    bar = tqdm(total=sum(len(ids) for _, ids in todo), unit="tok", desc="target features", disable=not progress)
    for begin in range(0, len(todo), chunk_rows):
        chunk = todo[begin : begin + chunk_rows]
        lengths = [len(ids) for _, ids in chunk]
        order = sorted(range(len(chunk)), key=lambda i: lengths[i])
        stored = [None] * len(chunk)
        for batch in _length_batches(order, lengths, batch_tokens):
            longest = max(lengths[i] for i in batch)
            input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
            attention_mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for j, i in enumerate(batch):
                input_ids[j, : lengths[i]] = torch.tensor(chunk[i][1])
                attention_mask[j, : lengths[i]] = 1
            output = decoder(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                output_hidden_states=stored_hidden_states(layer_ids),
                use_cache=False,
            )
            states = stack_states(output.hidden_states, layer_ids)  # (b, longest, (k+1)*H)
            for j, i in enumerate(batch):
                stored[i] = states[j, : lengths[i]]
            bar.update(sum(lengths[i] for i in batch))
        writer.append([(key, block) for (key, _), block in zip(chunk, stored)])
    bar.close()
    return FeatureStore(out_dir)


@dataclass
class StoreArguments:
    target: str = field(default="smollm2-135m", metadata={"help": "Target alias, folder or Hub id (load_target)."})
    data: list[str] = field(
        default_factory=lambda: ["training/data/smollm2-135m-mix.npz"],
        metadata={"help": "Regenerated data (.npz or regenerate folders), as for training."},
    )
    out: str = field(default="cache/smollm2-135m", metadata={"help": "The store folder (created or extended)."})
    dtype: str = field(default="bfloat16", metadata={"help": "Target dtype: float32 or bfloat16."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers the heads read; the default head's layers if not given."}
    )
    max_length: int = field(default=512, metadata={"help": "Positions stored per row (the trainer's max_length)."})
    batch_tokens: int = field(default=8192, metadata={"help": "Padded tokens per target forward."})
    held_out: str = field(
        default="with_the_rest",
        metadata={
            "help": "The trainer's held-out rows of all --data together (--eval_fraction, --seed): 'first' stores them "
            "before the rest, so offline evaluation can start on a store still being built; 'only' stores just them; "
            "'with_the_rest' makes no difference between them."
        },
    )
    eval_fraction: float = field(default=0.02, metadata={"help": "The trainer's eval_fraction (with --held_out)."})
    seed: int = field(default=0, metadata={"help": "The trainer's seed of the split (with --held_out)."})


def main(argv=None) -> FeatureStore:
    (args,) = HfArgumentParser(StoreArguments).parse_args_into_dataclasses(argv)
    if args.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"expected --dtype float32 or bfloat16, got {args.dtype!r}")
    if args.held_out not in HELD_OUT_MODES:
        raise ValueError(f"expected --held_out among {HELD_OUT_MODES}, got {args.held_out!r}")
    target, _ = load_target(args.target, dtype=getattr(torch, args.dtype))
    target.eval()
    config = target.config.get_text_config()
    layer_ids = args.target_layer_ids or default_target_layer_ids(config.num_hidden_layers)
    sources = [load_source(source) for source in args.data]
    if args.held_out != "with_the_rest":
        from .evaluate_head import held_out_rows

        sources.insert(0, held_out_rows(args.data, args.eval_fraction, args.seed))
        if args.held_out == "only":
            sources = sources[:1]
    for rows in sources:  # rows already stored (the held-out ones, the second time) are skipped
        store = build_feature_store(
            target,
            layer_ids,
            rows.select_columns(["id", "input_ids"]),
            args.out,
            max_length=args.max_length,
            batch_tokens=args.batch_tokens,
            target_name=args.target,
        )
    print(f"feature store {args.out}: {len(store)} rows, {store.total} positions, layers {layer_ids}")
    return store


if __name__ == "__main__":
    main()
