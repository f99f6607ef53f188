"""Data regeneration: the target writes its own answers to the training prompts.

A drafter distilled on the target's own outputs learns the distribution it has to
predict at inference time, rather than that of whichever model wrote the original
dataset. Each prompt is formatted with the chat template shared by every method
([`jetspec.targets.apply_chat_template`]) and answered by plain `model.generate`.

The answers come from `model.generate` in this process, or from an OpenAI-compatible completions server (vLLM,
SGLang, llama.cpp's server, TGI; [`training.completions.CompletionsServer`]) sent the same prompt token ids.

Output layout of `out_dir` (resumable, one writer per folder):

- `shard-00000.jsonl`, `shard-00001.jsonl`, ...: completed shards, each written
  atomically, one row per prompt: `{"id", "prompt", "input_ids", "prompt_length", "answer"}`.
- `progress.json`: the generation settings, checked on restart, a summary of the shards, and `failed`: the prompts a
  completions server gave no usable answer to after every retry, `{id: reason}`. A failed prompt is in no shard (no
  row is ever written for it, so `--export` never packs one); a rerun asks for it again.
- with the prompts split over K processes or machines (`num_shards=K`), none of these but one such folder per
  process, `part-0000i-of-0000K/`: process i answers the prompts whose id hash ([`training.rows.row_key`]) is i
  modulo K, disjoint sets whose union is every prompt. Reading the folder reads the union.

`training/rows.py` reads such a folder back ([`training.rows.load_regenerated`]); [`save_compact`] packs it into the
small `.npz` file that is committed.

Shards are consecutive chunks of the prompts not yet written, and an interrupted
shard is dropped whole, so a resumed run regenerates exactly the batches an
uninterrupted run would have: same rows, same order, same tokens. (Through a server, the prompts that failed go
first into the resumed run's shards; each answer is its own greedy request, so the rows are the same.)

Through a completions server (`server`), each prompt is answered greedily, sent as its token ids, `concurrency`
requests at a time (no batches, feature store or sampling). The answer's token ids are those the server returns, or
its text retokenized (with the tokenizer's EOS appended when the server stopped at one); the settings record which
(`answer_ids`). Faults are retried by the client; a prompt still without a usable answer is recorded as failed (no
row) and asked again by the next run, a shard whose prompts all failed stops the run, and a refusal no retry heals
(`ServerRefused`) raises at once.

`sort_pool` orders the prompts by token length within consecutive pools (in the order given) before they are cut
into shards, so that a batch pads its prompts to a width close to their own (each shard is sorted within anyway).
On the training mix, the padded prompts of shards of 64 are 3.5x their real length, of pools of 1,024 1.3x (the
throughput gain measured on a 2-core AVX2 CPU was within noise: `results/machine-avx2/README.md`).

The pieces: [`training.prompt_file.read_prompts`] reads the prompts, [`training.generate_answers`] answers in this
process, [`training.server_answers`] through a server, and [`training.compact_file.save_compact`] packs a folder.
"""

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from jetspec.targets import apply_chat_template

from .compact_file import save_compact, write_compact  # noqa: F401 (this module's API before the split)
from .completions import CompletionsServer
from .feature_store import StoreWriter
from .generate_answers import _batches, _generate_shard
from .prompt_file import read_prompts  # noqa: F401 (this module's API before the split)
from .rows import (
    MANIFEST_NAME,
    compact_ids,  # noqa: F401 (imported from here by scripts/regen_throughput.py)
    part_folders,
    part_name,
    read_shard,
    regenerated_folders,
    row_key,
    shard_files,
)
from .server_answers import SERVER_DTYPE, _check_server_run, _server_settings, _server_shard

# what a manifest written before a setting existed ran with
OLDER_SETTINGS = {"continuous": False, "sort_pool": 0, "cache_implementation": None}
CACHE_IMPLEMENTATIONS = (None, "static")


def _write_atomic(path: Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def regenerate(
    model: Optional[PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[dict[str, str]],
    out_dir: Union[str, os.PathLike],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    sample_temperature: float = 0.0,
    shard_size: int = 64,
    target: Optional[str] = None,
    progress: bool = True,
    feature_store: Optional[StoreWriter] = None,
    continuous: bool = False,
    sort_pool: int = 0,
    cache_implementation: Optional[str] = None,
    server: Optional[CompletionsServer] = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> dict[str, Any]:
    """Answers every prompt with the target and writes the rows as shards in `out_dir`, resuming from the shards
    already there (the folder's layout, the resume rule, the server's and `sort_pool`'s details: the module docstring).

    Args:
        model (`PreTrainedModel` or `None`): the target causal LM, in eval mode; `None` with a `server`.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template and a pad (or EOS) token.
        prompts (`list[dict[str, str]]`): records `{"id", "prompt"}` ([`training.prompt_file.read_prompts`]).
        out_dir (`str` or `os.PathLike`): folder of the shards and of `progress.json`; created if missing.
        max_new_tokens (`int`, *optional*, defaults to 256): longest answer, in tokens.
        batch_size (`int`, *optional*, defaults to 8): prompts per `generate` call, left padded.
        seed (`int`, *optional*, defaults to 0): seed of shard `k` is `seed + k`; only matters when sampling.
        sample_temperature (`float`, *optional*, defaults to 0.0): 0 decodes greedily; a positive value samples
            from the target's distribution at that temperature instead (no top-k / top-p truncation).
        shard_size (`int`, *optional*, defaults to 64): rows per shard file, the most work an interruption can lose.
        target (`str`, *optional*): name of the target, recorded in `progress.json` and checked on restart.
        progress (`bool`, *optional*, defaults to `True`): show a tqdm bar with rows and generated tokens/s.
        feature_store ([`training.feature_store.StoreWriter`], *optional*): also keep the target's selected layers
            and final hidden states, as computed while generating, in this store after each shard.
        continuous (`bool`, *optional*, defaults to `False`): answer with transformers' continuous batching
            instead of padded `generate` batches (no feature store).
        sort_pool (`int`, *optional*, defaults to 0): order the prompts by token length within consecutive pools
            of this many before cutting them into shards; 0 or 1 keeps the given order.
        cache_implementation (`str`, *optional*): `"static"` preallocates each batch's KV cache (default: dynamic).
        server ([`training.completions.CompletionsServer`], *optional*): answer through it, not a model in this process.
        num_shards (`int`, *optional*, defaults to 1): split the prompts over this many processes or machines
            (disjoint sets, by id hash); this call answers its set into `out_dir/part-<index>-of-<num_shards>/`.
        shard_index (`int`, *optional*, defaults to 0): the set this call answers, in `[0, num_shards)`.

    Returns:
        `dict[str, Any]`: `{"rows": rows in the folder this call writes (0 when no prompt falls in its set),
        "new_rows": rows written by this call, "new_tokens": tokens generated by this call, "seconds": wall time of
        this call, "failed": {id: reason} of the prompts in no shard after this call (through a server only)}`.
    """
    prompt_ids = _PromptIds(tokenizer)
    prompts = shard_prompts(prompts, num_shards, shard_index)
    if not prompts:  # more processes than prompts left: this one has nothing to answer
        return {"rows": 0, "new_rows": 0, "new_tokens": 0, "seconds": 0.0, "failed": {}}
    common = dict(target=target, max_new_tokens=max_new_tokens, seed=seed, shard_size=shard_size, sort_pool=sort_pool)
    generation = dict(batch_size=batch_size, sample_temperature=sample_temperature, continuous=continuous)
    settings = _run_settings(
        model, server, prompts[:3], tokenizer, prompt_ids, feature_store, cache_implementation, common, generation
    )
    _check_feature_store(feature_store, continuous, num_shards)
    answering = _Answering(model, tokenizer, server, feature_store, prompt_ids, _pad_token_id(tokenizer))
    folder = _part_folder(Path(out_dir), num_shards, shard_index)
    shards, failed, pending = _resume_pending(folder, settings, prompts, sort_pool, prompt_ids)
    progress_bar = _Progress(len(pending), enabled=progress)
    try:
        written = _write_shards(answering, pending, folder, settings, shards, failed, progress_bar.update)
    finally:
        progress_bar.close()
    return {
        "rows": sum(s["rows"] for s in shards),
        "new_rows": written,
        "new_tokens": progress_bar.new_tokens,
        "seconds": time.perf_counter() - progress_bar.start,
        "failed": dict(failed),
    }


def _run_settings(
    model: Optional[PreTrainedModel],
    server: Optional[CompletionsServer],
    probe_records: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: "_PromptIds",
    feature_store: Optional[StoreWriter],
    cache_implementation: Optional[str],
    common: dict[str, Any],
    generation: dict[str, Any],
) -> dict[str, Any]:
    """The run's settings, checked, as `progress.json` records them: of `generate` in this process ([`_settings`]),
    or, once nothing of `generate` was asked for ([`training.server_answers._check_server_run`]), of the server's
    run, which asks the server with the `probe_records` whether it returns token ids
    ([`training.server_answers._server_settings`]). `common`: `target`, `max_new_tokens`, `seed`, `shard_size`,
    `sort_pool`; `generation`: `batch_size`, `sample_temperature`, `continuous`."""
    if server is None:
        if model is None:
            raise ValueError("expected a model to answer with, or a server, got neither")
        return _settings(model, cache_implementation=cache_implementation, **generation, **common)
    continuous, temperature = generation["continuous"], generation["sample_temperature"]
    _check_server_run(model, feature_store, continuous, temperature, cache_implementation)
    probes = [(prompt_ids(record), apply_chat_template(tokenizer, record["prompt"])) for record in probe_records]
    return _server_settings(server, probes, **common)


def _check_feature_store(feature_store: Optional[StoreWriter], continuous: bool, num_shards: int) -> None:
    """A feature store takes the hidden states of padded `generate` batches, from one writer."""
    if continuous and feature_store is not None:
        raise ValueError(
            "expected either continuous=True or a feature_store, got both: continuous batching returns "
            "no hidden states (build the store afterwards with training/feature_store.py)"
        )
    if num_shards > 1 and feature_store is not None:
        raise ValueError(
            f"expected no feature_store with num_shards={num_shards} (one store has one writer), got "
            "one; build the store from the exported rows afterwards (training/feature_store.py)"
        )


def _resume_pending(
    folder: Path, settings: dict[str, Any], prompts: list[dict[str, str]], sort_pool: int, prompt_ids: "_PromptIds"
) -> tuple[list[dict[str, Any]], dict[str, str], list[dict[str, str]]]:
    """`(shards, failed, pending)` of a run resuming in `folder` ([`_resume`]), the manifest written with the
    run's `settings`: `pending` holds the prompts no shard holds yet, in the order [`_sort_pools`] gives them; the
    prompts recorded as failed are not done, so they are asked again, in their place."""
    shards, done_ids, failed = _resume(folder, settings)
    pending = [record for record in _sort_pools(prompts, sort_pool, prompt_ids) if record["id"] not in done_ids]
    _write_manifest(folder, settings, shards, failed)
    return shards, failed, pending


def _settings(
    model: PreTrainedModel,
    *,
    target: Optional[str],
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    sample_temperature: float,
    shard_size: int,
    continuous: bool,
    sort_pool: int,
    cache_implementation: Optional[str],
) -> dict[str, Any]:
    """The run's settings as recorded in `progress.json` (checked on resume), after checking each of them."""
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size), ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    if sample_temperature < 0:
        raise ValueError(f"expected sample_temperature >= 0 (0 is greedy), got {sample_temperature}")
    if not isinstance(sort_pool, int) or sort_pool < 0:
        raise ValueError(f"expected sort_pool to be an int >= 0 (0 keeps the given order), got {sort_pool!r}")
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"expected cache_implementation in {CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
    return {
        "target": target,
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "seed": seed,
        "sample_temperature": sample_temperature,
        "shard_size": shard_size,
        "continuous": continuous,
        "sort_pool": sort_pool,
        "cache_implementation": cache_implementation,
    }


def shard_prompts(prompts: list[dict[str, str]], num_shards: int, shard_index: int) -> list[dict[str, str]]:
    """The prompts set `shard_index` of `num_shards` answers, in their order: those whose id hash
    ([`training.rows.row_key`]) is `shard_index` modulo `num_shards`. The sets are disjoint, cover every prompt,
    and a prompt's set depends on its id only (not on the file's order or on which prompts are already done)."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"expected num_shards to be a positive int, got {num_shards!r}")
    if not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
        raise ValueError(f"expected shard_index in [0, {num_shards}), got {shard_index!r}")
    return [record for record in prompts if row_key(record["id"]) % num_shards == shard_index]


def _part_folder(out_dir: Path, num_shards: int, shard_index: int) -> Path:
    """The folder this process writes (created): `out_dir` for one process, else its `part-*-of-*` subfolder. A
    folder is split one way: parts of another count, or rows of one process beside parts, are refused."""
    held = {int(path.name.rsplit("-of-", 1)[1]) for path in part_folders(out_dir)}
    if out_dir in regenerated_folders(out_dir):
        held.add(1)  # its own shards: one process
    if held - {num_shards}:
        raise ValueError(
            f"expected {out_dir} to hold rows split over num_shards={num_shards} processes only, got rows "
            f"split over {sorted(held)}; resume with the same num_shards, or use a fresh output folder"
        )
    folder = out_dir if num_shards == 1 else out_dir / part_name(shard_index, num_shards)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id left padding uses: the tokenizer's pad token, else its EOS."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError(
            f"expected the tokenizer to have a pad or EOS token for left padding, got neither on "
            f"{type(tokenizer).__name__}"
        )
    return pad_token_id


def _resume(out_dir: Path, settings: dict[str, Any]) -> tuple[list[dict[str, Any]], set[str], dict[str, str]]:
    """`(shards, done ids, failed)`: the completed shards of `out_dir` in order, as `{"file", "rows"}`, the ids of
    their rows, and the prompts recorded as failed that no shard holds, `{id: reason}`; a `ValueError` when the
    folder was written with other settings."""
    manifest_path = out_dir / MANIFEST_NAME
    failed = {}
    if manifest_path.exists():
        # folders written before a scheduling setting existed ran without it
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        saved, failed = manifest["settings"], manifest.get("failed", {})
        previous = saved if saved.get("dtype") == SERVER_DTYPE else {**OLDER_SETTINGS, **saved}
        if previous != settings:
            raise ValueError(
                f"expected the settings of the run being resumed in {out_dir}, {previous}, got {settings}; "
                "use a fresh output folder to change them"
            )
    shards, done_ids = [], set()
    for path in shard_files(out_dir):
        rows = read_shard(path)
        done_ids.update(row["id"] for row in rows)
        shards.append({"file": path.name, "rows": len(rows)})
    # a shard written after the manifest's last update may hold a prompt the manifest still lists as failed
    return shards, done_ids, {id_: reason for id_, reason in failed.items() if id_ not in done_ids}


def _write_manifest(
    out_dir: Path, settings: dict[str, Any], shards: list[dict[str, Any]], failed: dict[str, str]
) -> None:
    summary = {"settings": settings, "rows": sum(s["rows"] for s in shards), "shards": shards, "failed": failed}
    _write_atomic(out_dir / MANIFEST_NAME, json.dumps(summary, indent=1) + "\n")


class _PromptIds:
    """Token ids of a record's chat-formatted prompt, tokenized once, on first use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: dict[str, list[int]] = {}

    def __call__(self, record: dict[str, str]) -> list[int]:
        if record["id"] not in self.ids:
            text = apply_chat_template(self.tokenizer, record["prompt"])
            self.ids[record["id"]] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.ids[record["id"]]


def _sort_pools(prompts: list[dict[str, str]], sort_pool: int, prompt_ids: _PromptIds) -> list[dict[str, str]]:
    """`prompts` ordered by token length within consecutive pools of `sort_pool` (stable); as given for 0 or 1.

    The order depends on the given prompts only, not on what is done: a resumed run's shards stay those of an
    uninterrupted one."""
    if sort_pool <= 1:
        return prompts
    return [
        record
        for start in range(0, len(prompts), sort_pool)
        for record in sorted(prompts[start : start + sort_pool], key=lambda r: len(prompt_ids(r)))
    ]


class _Progress:
    """A tqdm bar of rows with the generated tokens/s, and the count of generated tokens."""

    def __init__(self, total: int, enabled: bool):
        self.start = time.perf_counter()
        self.new_tokens = 0
        self.bar = tqdm(total=total, unit="row", desc="regenerate", disable=not enabled, dynamic_ncols=True)

    def update(self, rows: int, tokens: int) -> None:
        self.new_tokens += tokens
        rate = self.new_tokens / (time.perf_counter() - self.start)
        self.bar.set_postfix(tok_s=f"{rate:.1f}", tokens=self.new_tokens, refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Answering:
    """What answers a shard's prompts: `model` in this process (keeping their features in `feature_store`, if any),
    or `server`; `prompt_ids` tokenizes each prompt once, `pad_token_id` left-pads `generate`'s batches."""

    model: Optional[PreTrainedModel]
    tokenizer: PreTrainedTokenizerBase
    server: Optional[CompletionsServer]
    feature_store: Optional[StoreWriter]
    prompt_ids: _PromptIds
    pad_token_id: int

    def answer(self, shard: list[dict[str, Any]], settings: dict[str, Any], on_batch: Callable[[int, int], None]):
        """`(rows, failed)` of one shard: its rows in order, and `{id: reason}` of the prompts a server gave no
        usable answer to (none in this process)."""
        if self.server is not None:
            return _server_shard(
                self.server, self.tokenizer, shard, max_new_tokens=settings["max_new_tokens"], on_batch=on_batch
            )
        store = self.feature_store
        rows = _generate_shard(
            self.model,
            self.tokenizer,
            shard,
            batch_size=settings["batch_size"],
            max_new_tokens=settings["max_new_tokens"],
            sample_temperature=settings["sample_temperature"],
            pad_token_id=self.pad_token_id,
            on_batch=on_batch,
            capture_layers=None if store is None else store.meta["target_layer_ids"],
            continuous=settings["continuous"],
            cache_implementation=settings["cache_implementation"],
        )
        return rows, {}


def _write_shards(
    answering: _Answering,
    pending: list[dict[str, str]],
    out_dir: Path,
    settings: dict[str, Any],
    shards: list[dict[str, Any]],
    failed: dict[str, str],
    on_batch: Callable[[int, int], None],
) -> int:
    """Answers the `pending` prompts shard by shard ([`_Answering`]), appending each completed shard to `shards` and
    the manifest, and keeping `failed` (`{id: reason}`) up to date; the rows written.

    Shards are consecutive chunks of the pending prompts: after an interruption the completed shards form a prefix,
    so the remaining chunks are exactly those of an uninterrupted run. Shard `k` samples with seed `seed + k`.

    Through a server, a prompt every attempt failed for is left out of its shard and recorded in `failed` (the
    manifest's), and a shard whose prompts all failed stops the run with a `RuntimeError`: the server is down or
    answers nothing usable, and going on would only record every prompt as failed.
    """
    written, server = 0, answering.server
    for shard_records in _batches(pending, settings["shard_size"]):
        index = len(shards)
        shard = [{**record, "prompt_ids": answering.prompt_ids(record)} for record in shard_records]
        torch.manual_seed(settings["seed"] + index)
        rows, shard_failed = answering.answer(shard, settings, on_batch)
        if answering.feature_store is not None:
            answering.feature_store.append([(row_key(row["id"]), row.pop("states")) for row in rows])
        if rows:
            path = out_dir / f"shard-{index:05d}.jsonl"
            _write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
            shards.append({"file": path.name, "rows": len(rows)})
            written += len(rows)
        for row in rows:
            failed.pop(row["id"], None)
        failed.update(shard_failed)
        _write_manifest(out_dir, settings, shards, failed)
        if not rows:
            reasons = sorted(set(shard_failed.values()))
            raise RuntimeError(
                f"expected answers from {server.base if server else 'the model'}, got none usable for any of the "
                f"{len(shard)} prompts of a shard, after {server.max_attempts if server else 1} attempts each: "
                f"{'; '.join(reasons)[:600]}; stopped ({len(failed)} prompts recorded as failed in "
                f"{out_dir / MANIFEST_NAME}; rerun the same command to retry them)"
            )
    return written
