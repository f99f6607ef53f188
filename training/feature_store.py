"""What a head's training needs from the frozen target, computed once and kept on disk.

A JetSpec head reads two things of the target per training row: the concatenated outputs of the selected layers
(`target_layer_ids`, the head's context) and the final post-norm hidden state (the teacher: the target's LM head
applied to it). Both depend only on the target and the row, not on the head, so one pass of the target over the
regenerated data serves every later run (ablations, longer schedules, resumed runs): training then costs only the
head. `cache_features` in the trainer keeps the same tensors in memory for one run; a store keeps them across runs.

Layout of a store folder:
    store.json      target, layer ids, widths, max_length, and per row key: [start row of features.bin, length]
    features.bin    bfloat16 rows of width (k + 1) * H, raw, appended chunk by chunk:
                    [layer ids[0] | ... | layer ids[k-1] | final hidden]

    python -m training.feature_store --target smollm2-135m --data training/data/smollm2-135m-mix.npz \
        --out cache/smollm2-135m --max_length 512

Building is resumable: rows already in the store are skipped, and a chunk counts once `store.json` names it.
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


class FeatureStore:
    """Read access to a store folder (see the module docstring).

    Args:
        path (`str` or `os.PathLike`): the folder written by [`build_feature_store`].
    """

    def __init__(self, path):
        self.path = Path(path)
        meta_path = self.path / META_NAME
        if not meta_path.is_file():
            raise ValueError(f"expected a feature store folder holding {META_NAME}, got {self.path}")
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
            self.layer_ids = list(self.meta["target_layer_ids"])
            self.hidden_size = int(self.meta["hidden_size"])
            self.rows = {int(k): (int(s), int(n)) for k, (s, n) in self.meta["rows"].items()}
            total = int(self.meta["total"])
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"expected a feature store index (target_layer_ids, hidden_size, rows, total) in "
                             f"{meta_path}, got an unreadable one ({type(error).__name__}: {error})") from None
        self.width = (len(self.layer_ids) + 1) * self.hidden_size
        data_path = self.path / DATA_NAME
        size = data_path.stat().st_size if data_path.is_file() else 0
        if size < total * self.width * 2:  # bfloat16 rows
            raise ValueError(f"expected {total} rows of {self.width} bfloat16 values ({total * self.width * 2} bytes) "
                             f"in {data_path} (as {META_NAME} says), got {size} bytes")
        self._data = np.memmap(data_path, dtype=np.uint16, mode="r", shape=(total, self.width)) if total else None

    def __len__(self) -> int:
        return len(self.rows)

    def check(self, layer_ids, hidden_size: int) -> None:
        """`ValueError` unless the store holds the features a head reading `layer_ids` of width `hidden_size` needs."""
        if list(layer_ids) != self.layer_ids or int(hidden_size) != self.hidden_size:
            raise ValueError(
                f"expected a feature store of target layers {list(layer_ids)} and hidden size {hidden_size} (the "
                f"head's), got layers {self.layer_ids} and hidden size {self.hidden_size} in {self.path}"
            )

    def covers(self, key: int, length: int) -> bool:
        """Whether row `key` is stored with at least its first `length` positions."""
        stored = self.rows.get(int(key))
        return stored is not None and stored[1] >= length

    def get(self, key: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of row `key`: features `(length, k*H)` and final hidden `(length, H)`, bf16."""
        start, stored = self.rows[int(key)]
        if length > stored:
            raise ValueError(f"expected at most {stored} positions of row {key} (stored), got {length}")
        block = torch.from_numpy(np.array(self._data[start : start + length])).view(torch.bfloat16)
        split = len(self.layer_ids) * self.hidden_size
        return block[:, :split], block[:, split:]


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path / f".{META_NAME}.tmp"
    tmp.write_text(json.dumps(meta), encoding="utf-8")
    os.replace(tmp, path / META_NAME)


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
    return {"target": target_name, "target_layer_ids": layer_ids, "hidden_size": hidden_size, "dtype": "bfloat16",
            "max_length": int(max_length)}


def stack_states(hidden_states, layer_ids) -> torch.Tensor:
    """One store row block from a forward's `hidden_states` (index i + 1 is layer i, the last one the final normed
    state): `(..., (k + 1) * H)` bf16, the selected layers then the final state."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids] + [hidden_states[-1]], -1).to("cpu", torch.bfloat16)


class StoreWriter:
    """Appends rows to a store folder, creating it or checking that its settings match; each `append` is durable.

    Args:
        out_dir (`str` or `os.PathLike`): the store folder.
        settings (`dict`): from [`store_settings`].
    """

    def __init__(self, out_dir, settings: dict):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if (self.out / META_NAME).is_file():
            self.meta = json.loads((self.out / META_NAME).read_text(encoding="utf-8"))
            previous = {k: self.meta.get(k) for k in settings}
            if previous != settings:
                raise ValueError(f"expected the settings of the store in {self.out}, {previous}, got {settings}")
        else:
            self.meta = dict(settings, total=0, rows={})
            _write_meta(self.out, self.meta)
        self.max_length = settings["max_length"]
        self.width = (len(settings["target_layer_ids"]) + 1) * settings["hidden_size"]
        data_path = self.out / DATA_NAME
        with open(data_path, "ab"):
            pass
        # bytes of an append interrupted before store.json named them are dropped
        os.truncate(data_path, self.meta["total"] * self.width * 2)

    def has(self, key: int) -> bool:
        return str(int(key)) in self.meta["rows"]

    def append(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """Store `(row key, (length, (k + 1) * H) tensor)` pairs, truncated to the store's `max_length`; rows already
        stored are kept as they are."""
        with open(self.out / DATA_NAME, "ab") as handle:
            for key, block in blocks:
                if self.has(key):
                    continue
                if block.dim() != 2 or block.shape[1] != self.width:
                    raise ValueError(f"expected a (length, {self.width}) block for row {key}, got {tuple(block.shape)}")
                block = block[: self.max_length].to(torch.bfloat16).contiguous()
                handle.write(block.view(torch.uint16).numpy().tobytes())
                self.meta["rows"][str(int(key))] = [self.meta["total"], int(block.shape[0])]
                self.meta["total"] += int(block.shape[0])
            handle.flush()
            os.fsync(handle.fileno())
        _write_meta(self.out, self.meta)


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
def build_feature_store(target, layer_ids, rows, out_dir, max_length: int = 512, batch_tokens: int = 8192,
                        chunk_rows: int = 128, target_name: str = "", progress: bool = True) -> FeatureStore:
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
            output = decoder(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             output_hidden_states=True, use_cache=False)
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
    data: list[str] = field(default_factory=lambda: ["training/data/smollm2-135m-mix.npz"],
                            metadata={"help": "Regenerated data (.npz or regenerate folders), as for training."})
    out: str = field(default="cache/smollm2-135m", metadata={"help": "The store folder (created or extended)."})
    dtype: str = field(default="bfloat16", metadata={"help": "Target dtype: float32 or bfloat16."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers the heads read; the default head's layers if not given."}
    )
    max_length: int = field(default=512, metadata={"help": "Positions stored per row (the trainer's max_length)."})
    batch_tokens: int = field(default=8192, metadata={"help": "Padded tokens per target forward."})


def main(argv=None) -> FeatureStore:
    (args,) = HfArgumentParser(StoreArguments).parse_args_into_dataclasses(argv)
    if args.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"expected --dtype float32 or bfloat16, got {args.dtype!r}")
    target, _ = load_target(args.target, dtype=getattr(torch, args.dtype))
    target.eval()
    config = target.config.get_text_config()
    layer_ids = args.target_layer_ids or default_target_layer_ids(config.num_hidden_layers)
    for source in args.data:
        rows = load_source(source)
        store = build_feature_store(target, layer_ids, rows.select_columns(["id", "input_ids"]), args.out,
                                    max_length=args.max_length, batch_tokens=args.batch_tokens,
                                    target_name=args.target)
    print(f"feature store {args.out}: {len(store)} rows, {store.meta['total']} positions, layers {layer_ids}")
    return store


if __name__ == "__main__":
    main()
