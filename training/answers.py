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
"""

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import datasets
import numpy as np
import psutil
import torch
from tqdm.auto import tqdm
from transformers import ContinuousBatchingConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown

from jetspec.targets import apply_chat_template

from .completions import Completion, CompletionFailed, CompletionsServer, Failure
from .feature_store import StoreWriter, stack_states
from .rows import (
    COMPACT_SUFFIX,
    MANIFEST_NAME,
    PART_GLOB,
    compact_ids,
    load_compact,
    load_regenerated,
    part_folders,
    part_name,
    read_shard,
    regenerated_folders,
    row_key,
    shard_files,
)

HUMAN_ROLES = ("human", "user")
# may differ between the parts of one compact file
SCHEDULING_SETTINGS = frozenset(
    {"batch_size", "shard_size", "continuous", "sort_pool", "cache_implementation", "concurrency"}
)
SERVER_DTYPE = "server"  # the `dtype` setting of rows a completions server wrote (its own kernels and weights)
# what a manifest written before a setting existed ran with
OLDER_SETTINGS = {"continuous": False, "sort_pool": 0, "cache_implementation": None}
CACHE_IMPLEMENTATIONS = (None, "static")
CONTINUOUS_MEMORY_SHARE = 0.5  # of the memory available now, for continuous batching's paged cache on a CPU


def _prompt_of(record: Any, where: str) -> str:
    """The user prompt of one record: its `"prompt"` field, or the first human turn of `"conversations"`."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object at {where}, got {type(record).__name__}")
    if "prompt" in record:
        prompt = record["prompt"]
    elif "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list):
            raise ValueError(f"expected `conversations` to be a list at {where}, got {type(turns).__name__}")
        # ShareGPT turns are {"from": "human", "value": ...}; chat-style turns are {"role": "user", "content": ...}
        human = [
            turn.get("value", turn.get("content"))
            for turn in turns
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in HUMAN_ROLES
        ]
        if not human:
            raise ValueError(
                f"expected a human/user turn in `conversations` at {where}, got roles "
                f"{[turn.get('from', turn.get('role')) for turn in turns if isinstance(turn, dict)]}"
            )
        prompt = human[0]
    else:
        raise ValueError(f"expected a `prompt` or `conversations` field at {where}, got fields {sorted(record)}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"expected a non-empty string prompt at {where}, got {prompt!r}")
    return prompt


def read_prompts(path: Union[str, os.PathLike], limit: Optional[int] = None) -> list[dict[str, str]]:
    """
    Reads the prompts to regenerate answers for.

    Args:
        path (`str` or `os.PathLike`):
            Either a jsonl file with one JSON object per line, holding a `"prompt"` string or a
            ShareGPT-style `"conversations"` list (the first human/user turn is the prompt), or a
            folder written by `datasets.Dataset.save_to_disk` with a `"prompt"` column. An `"id"`
            field/column is kept; rows without one are numbered by their position.
        limit (`int`, *optional*):
            Keep only the first `limit` prompts.

    Returns:
        `list[dict[str, str]]`: records `{"id": str, "prompt": str}` in file order, with unique ids.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"expected limit to be a positive int or None, got {limit}")
    records: list[dict[str, str]] = []
    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if not isinstance(dataset, datasets.Dataset):
            raise ValueError(
                f"expected a single Dataset saved with save_to_disk in {path}, got {type(dataset).__name__}"
            )
        if "prompt" not in dataset.column_names:
            raise ValueError(f"expected a `prompt` column in {path}, got columns {dataset.column_names}")
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
        ids = dataset["id"] if "id" in dataset.column_names else range(len(dataset))
        for index, (id_, prompt) in enumerate(zip(ids, dataset["prompt"])):
            records.append({"id": str(id_), "prompt": _prompt_of({"prompt": prompt}, f"{path} row {index}")})
    elif path.is_file():
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if limit is not None and len(records) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path} line {line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"expected valid JSON at {where}, got {error.msg}: {line[:80]!r}") from None
                prompt = _prompt_of(record, where)
                records.append({"id": str(record.get("id", len(records))), "prompt": prompt})
    else:
        raise ValueError(f"expected a jsonl file or a datasets folder, got {path} which does not exist")
    if not records:
        raise ValueError(f"expected at least one prompt in {path}, got none")
    seen: set[str] = set()
    for record in records:
        if record["id"] in seen:
            raise ValueError(f"expected unique prompt ids in {path}, got {record['id']!r} twice")
        seen.add(record["id"])
    return records


def _write_atomic(path: Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _eos_ids(model: PreTrainedModel) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _until_eos(answer_ids: list[int], eos_ids: set[int]) -> list[int]:
    """The answer up to and including its first EOS; what a batch generated after it is padding."""
    for position, token in enumerate(answer_ids):
        if token in eos_ids:
            return answer_ids[: position + 1]
    return answer_ids


def _static_answers(
    model: PreTrainedModel,
    shard: list[dict[str, Any]],
    *,
    batch_size: int,
    pad_token_id: int,
    capture_layers: Optional[list[int]],
    generate_kwargs: dict,
) -> Iterator[tuple[list[int], list[list[int]], Optional[list[torch.Tensor]]]]:
    """`model.generate` on left-padded batches of similar prompt lengths; yields `(shard indices, answers, states)`
    per batch, states (one tensor per row) only with `capture_layers`. `generate_kwargs` may hold
    `cache_implementation="static"`: a preallocated cache instead of one concatenated at every step."""
    eos_ids = _eos_ids(model)
    # batches of similar length waste less compute on padding; the order is deterministic
    order = sorted(range(len(shard)), key=lambda i: (len(shard[i]["prompt_ids"]), i))
    for batch in _batches(order, batch_size):
        prompt_ids = [shard[i]["prompt_ids"] for i in batch]
        width = max(len(ids) for ids in prompt_ids)
        # left padding: every prompt ends at the same column, where generation starts
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        output = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            pad_token_id=pad_token_id,
            output_hidden_states=capture_layers is not None,
            return_dict_in_generate=capture_layers is not None,
            **generate_kwargs,
        )
        steps = None
        if capture_layers is not None:
            # step 0 is the prompt forward (B, T, .); step s >= 1 fed answer token s - 1 (B, 1, .)
            steps = [stack_states(states, capture_layers) for states in output.hidden_states]
            output = output.sequences  # (B, T + new)
        answers = [_until_eos(output[row, width:].tolist(), eos_ids) for row in range(len(batch))]
        states = None
        if steps is not None:
            states = []
            for row, answer_ids in enumerate(answers):
                prompt = steps[0][row, width - len(prompt_ids[row]) :]
                fed = [steps[s][row] for s in range(1, len(answer_ids))]
                states.append(torch.cat([prompt, *fed, torch.zeros_like(prompt[:1])]))
        yield batch, answers, states


def _paged_cache_config(model: PreTrainedModel, share: float = CONTINUOUS_MEMORY_SHARE) -> ContinuousBatchingConfig:
    """Continuous batching's paged cache sized from the memory this machine has free now. On a CPU transformers sizes
    it as a share of the machine's total memory (capped to the process's NUMA nodes) less this process's own, as if
    nothing else ran: beside another process (a paused training run holding 11 GB of 23) that cache alone exhausted
    the memory and the kernel killed the process. Here the cache gets `share` of the memory available now, expressed
    as the share of transformers' own measure (`get_device_and_memory_breakdown`) that `max_memory_percent` takes."""
    if model.device.type != "cpu":
        return ContinuousBatchingConfig()  # accelerators: transformers reads the device's free memory itself
    _, total, reserved, allocated = get_device_and_memory_breakdown()
    free_by_transformers = max(total - max(reserved, allocated), 1)
    percent = share * psutil.virtual_memory().available / free_by_transformers
    return ContinuousBatchingConfig(max_memory_percent=max(min(percent, 0.9), 0.01))


def _continuous_answers(
    model: PreTrainedModel,
    shard: list[dict[str, Any]],
    *,
    pad_token_id: int,
    generate_kwargs: dict,
) -> Iterator[tuple[list[int], list[list[int]], None]]:
    """transformers' continuous batching (`generate_batch`) over the whole shard: a finished answer frees its slot
    for the next prompt at once, so no row decodes padding after its EOS and no prompt is padded. Yields the shard
    as one batch, in its order."""
    eos_ids = _eos_ids(model)
    config = GenerationConfig(pad_token_id=pad_token_id, eos_token_id=sorted(eos_ids) or None, **generate_kwargs)
    outputs = model.generate_batch(
        [row["prompt_ids"] for row in shard],
        generation_config=config,
        continuous_batching_config=_paged_cache_config(model),
        warmup=False,
    )
    results = list(outputs.values())
    failed = [r.request_id for r in results if r.error is not None]
    if len(results) != len(shard) or failed:
        raise RuntimeError(
            f"expected generate_batch to answer all {len(shard)} prompts, got {len(results)} answers "
            f"and failures {failed}"
        )
    yield list(range(len(shard))), [_until_eos(list(r.generated_tokens), eos_ids) for r in results], None


@torch.inference_mode()
def _generate_shard(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    shard: list[dict[str, Any]],
    *,
    batch_size: int,
    max_new_tokens: int,
    sample_temperature: float,
    pad_token_id: int,
    on_batch: Callable[[int, int], None],
    capture_layers: Optional[list[int]] = None,
    continuous: bool = False,
    cache_implementation: Optional[str] = None,
) -> list[dict[str, Any]]:
    """Answers the prompts of one shard; rows come back in the shard's order.

    With `capture_layers`, each row also carries `"states"`: the target's selected-layer and final hidden states at
    every position, as computed during generation, in the feature store's layout ([`training.feature_store.stack_states`]).
    Generation never feeds the last token of an answer, so its row is zero; training never reads it (an anchor
    needs a next token, and its context ends before it). `continuous` answers with transformers' continuous
    batching instead of padded `generate` batches; it returns no states, so `capture_layers` is ignored with it
    ([`regenerate`] refuses the combination).
    """
    sampling = (
        {"do_sample": True, "temperature": sample_temperature, "top_k": 0, "top_p": 1.0}
        if sample_temperature > 0
        else {"do_sample": False}
    )
    generate_kwargs = {"max_new_tokens": max_new_tokens, **sampling}
    if continuous:
        batches = _continuous_answers(model, shard, pad_token_id=pad_token_id, generate_kwargs=generate_kwargs)
    else:
        if cache_implementation is not None:
            generate_kwargs["cache_implementation"] = cache_implementation
        batches = _static_answers(
            model,
            shard,
            batch_size=batch_size,
            pad_token_id=pad_token_id,
            capture_layers=capture_layers,
            generate_kwargs=generate_kwargs,
        )
    rows: dict[int, dict[str, Any]] = {}
    for batch, answers, states in batches:
        for row, (i, answer_ids) in enumerate(zip(batch, answers)):
            rows[i] = {
                "id": shard[i]["id"],
                "prompt": shard[i]["prompt"],
                "input_ids": shard[i]["prompt_ids"] + answer_ids,
                "prompt_length": len(shard[i]["prompt_ids"]),
                "answer": tokenizer.decode(answer_ids, skip_special_tokens=True),
            }
            if states is not None:
                rows[i]["states"] = states[row]
        on_batch(len(batch), sum(len(a) for a in answers))
    return [rows[i] for i in range(len(shard))]


def _server_shard(
    server: CompletionsServer,
    tokenizer: PreTrainedTokenizerBase,
    shard: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    on_batch: Callable[[int, int], None],
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Answers the prompts of one shard through the server, `server.concurrency` at a time: `(rows, failed)`, the
    rows in the shard's order, as [`_generate_shard`] writes them, for the prompts answered, and `{id: reason}` for
    those every attempt failed for (no row)."""
    rows, failed = [], {}
    texts = [apply_chat_template(tokenizer, record["prompt"]) for record in shard]  # what prompt_ids tokenize
    vocab = len(tokenizer)

    def check(completion: Completion) -> Optional[str]:
        """What makes an answer unusable besides its form (which the client checks): ids the tokenizer lacks, or a
        text answer cut by `max_tokens` (`"length"`) short of it, counted here where the server did not count it."""
        ids = answer_token_ids(completion, tokenizer, max_new_tokens)
        bad = [token for token in ids if token >= vocab]
        if bad:
            return f"token ids {bad[:3]} outside the tokenizer's {vocab}"
        if completion.finish_reason == "length" and completion.generated is None and len(ids) < max_new_tokens:
            return f"cut off (finish_reason 'length' after {len(ids)} of {max_new_tokens} tokens, retokenized)"
        return None

    answers = server.complete_all([record["prompt_ids"] for record in shard], texts, max_new_tokens, check=check)
    for record, completion in zip(shard, answers):
        if isinstance(completion, Failure):
            failed[record["id"]] = completion.reason
            on_batch(1, 0)
            continue
        answer_ids = answer_token_ids(completion, tokenizer, max_new_tokens)
        rows.append(
            {
                "id": record["id"],
                "prompt": record["prompt"],
                "input_ids": record["prompt_ids"] + answer_ids,
                "prompt_length": len(record["prompt_ids"]),
                "answer": tokenizer.decode(answer_ids, skip_special_tokens=True),
            }
        )
        on_batch(1, len(answer_ids))
    return rows, failed


def answer_token_ids(completion: Completion, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int) -> list[int]:
    """The answer's token ids as an in-process row holds them: up to and including its first EOS.

    The server's own ids when it returned them; otherwise its text retokenized (a tokenizer may split decoded text
    otherwise than the model wrote it), cut to `max_new_tokens`. An answer that stopped at an end-of-generation token
    (`finish_reason == "stop"`; no stop strings are sent) ends with the tokenizer's EOS, as a generated row does; a
    server that returns ids may or may not include it."""
    eos = tokenizer.eos_token_id
    if completion.token_ids is not None:
        ids = list(completion.token_ids)
    else:
        ids = tokenizer(completion.text, add_special_tokens=False)["input_ids"][:max_new_tokens]
    eos_ids = {eos} if eos is not None else set()
    ids = _until_eos(ids, eos_ids)
    stopped = completion.finish_reason == "stop" and not (ids and ids[-1] in eos_ids)
    if stopped and eos is not None and len(ids) < max_new_tokens:
        ids.append(eos)
    return ids


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
    """
    Answers every prompt with the target and writes the rows as shards in `out_dir`, resuming
    from the shards already there.

    Args:
        model (`PreTrainedModel` or `None`):
            The target causal LM, in eval mode; `None` with a `server`.
        tokenizer (`PreTrainedTokenizerBase`):
            Its tokenizer, with a chat template and a pad (or EOS) token.
        prompts (`list[dict[str, str]]`):
            Records `{"id", "prompt"}` as returned by [`read_prompts`].
        out_dir (`str` or `os.PathLike`):
            Folder of the shards and of `progress.json`; created if missing.
        max_new_tokens (`int`, *optional*, defaults to 256):
            Longest answer, in tokens.
        batch_size (`int`, *optional*, defaults to 8):
            Prompts per `generate` call, left padded.
        seed (`int`, *optional*, defaults to 0):
            Seed of shard `k` is `seed + k`; only matters when sampling.
        sample_temperature (`float`, *optional*, defaults to 0.0):
            0 decodes greedily; a positive value samples from the target's distribution at that
            temperature instead (no top-k / top-p truncation).
        shard_size (`int`, *optional*, defaults to 64):
            Rows per shard file, i.e. the most work an interruption can lose.
        target (`str`, *optional*):
            Name of the target, recorded in `progress.json` and checked on restart.
        progress (`bool`, *optional*, defaults to `True`):
            Show a tqdm bar with rows and generated tokens/s.
        feature_store ([`training.feature_store.StoreWriter`], *optional*):
            Also keep what training needs of the target (its selected layers and final hidden states, as computed
            while generating) in this store, after each shard: training then never runs the target on these rows.
        continuous (`bool`, *optional*, defaults to `False`):
            Answer with transformers' continuous batching instead of padded `generate` batches (no feature store).
        sort_pool (`int`, *optional*, defaults to 0):
            Order the prompts by token length within consecutive pools of this many (in the order given) before
            cutting them into shards, so that a batch pads its prompts to a width close to their own; 0 or 1 keeps
            the given order (each shard is still sorted within). On the training mix, the padded prompts of
            shards of 64 are 3.5x their real length, of pools of 1,024 1.3x (the throughput gain measured on a
            2-core AVX2 CPU was within noise: `results/machine-avx2/README.md`).
        cache_implementation (`str`, *optional*):
            `"static"` preallocates each batch's KV cache instead of concatenating it at every step; `None` is
            `generate`'s default (dynamic).
        server ([`training.completions.CompletionsServer`], *optional*):
            Answer through this completions server instead of a model in this process: greedily, the prompt sent as
            its token ids, `server.concurrency` requests at a time (no batches, feature store or sampling). The
            answer's token ids are those the server returns, or its text retokenized by `tokenizer` (with the
            tokenizer's EOS appended when the server stopped at one); the settings record which (`answer_ids`).
            Faults are retried by the client; a prompt still without a usable answer is recorded as failed (no row)
            and asked again by the next run, a shard whose prompts all failed stops the run, and a refusal no retry
            heals (`ServerRefused`) raises at once.
        num_shards (`int`, *optional*, defaults to 1):
            Split the prompts over this many processes or machines, each a disjoint set (by id hash); this call
            answers set `shard_index` into `out_dir/part-<shard_index>-of-<num_shards>/`.
        shard_index (`int`, *optional*, defaults to 0):
            The set this call answers, in `[0, num_shards)`.

    Returns:
        `dict[str, Any]`: `{"rows": rows in the folder this call writes (0 when no prompt falls in its set),
        "new_rows": rows written by this call, "new_tokens": tokens generated by this call, "seconds": wall time of
        this call, "failed": {id: reason} of the prompts in no shard after this call (through a server only)}`.
    """
    prompt_ids = _PromptIds(tokenizer)
    prompts = shard_prompts(prompts, num_shards, shard_index)
    if not prompts:  # more processes than prompts left: this one has nothing to answer
        return {"rows": 0, "new_rows": 0, "new_tokens": 0, "seconds": 0.0, "failed": {}}
    settings = _run_settings(
        model,
        server,
        prompts[:3],
        tokenizer,
        prompt_ids,
        feature_store=feature_store,
        target=target,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        sample_temperature=sample_temperature,
        shard_size=shard_size,
        continuous=continuous,
        sort_pool=sort_pool,
        cache_implementation=cache_implementation,
    )
    _check_feature_store(feature_store, continuous, num_shards)
    pad_token_id = _pad_token_id(tokenizer)
    folder = _part_folder(Path(out_dir), num_shards, shard_index)
    shards, failed, pending = _resume_pending(folder, settings, prompts, sort_pool, prompt_ids)
    progress_bar = _Progress(len(pending), enabled=progress)
    try:
        written = _write_shards(
            model,
            tokenizer,
            pending,
            folder,
            settings,
            shards,
            failed,
            prompt_ids=prompt_ids,
            pad_token_id=pad_token_id,
            feature_store=feature_store,
            on_batch=progress_bar.update,
            server=server,
        )
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
    *,
    feature_store: Optional[StoreWriter],
    batch_size: int,
    continuous: bool,
    sample_temperature: float,
    cache_implementation: Optional[str],
    **common: Any,
) -> dict[str, Any]:
    """The run's settings, checked, as `progress.json` records them: of `generate` in this process ([`_settings`]),
    or, once nothing of `generate` was asked for ([`_check_server_run`]), of the server's run, which asks the server
    with the `probe_records` whether it returns token ids ([`_server_settings`]). `common`: `target`,
    `max_new_tokens`, `seed`, `shard_size`, `sort_pool`."""
    if server is None:
        if model is None:
            raise ValueError("expected a model to answer with, or a server, got neither")
        return _settings(
            model,
            batch_size=batch_size,
            sample_temperature=sample_temperature,
            continuous=continuous,
            cache_implementation=cache_implementation,
            **common,
        )
    _check_server_run(model, feature_store, continuous, sample_temperature, cache_implementation)
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


def _check_server_run(
    model: Optional[PreTrainedModel],
    feature_store: Optional[StoreWriter],
    continuous: bool,
    sample_temperature: float,
    cache_implementation: Optional[str],
) -> None:
    """A server answers greedily and alone: no model here, no hidden states, no batching settings of `generate`."""
    if model is not None:
        raise ValueError(f"expected either a model or a server to answer with, got both ({type(model).__name__})")
    given = {
        "feature_store": feature_store is not None,
        "continuous": continuous,
        "sample_temperature": sample_temperature != 0,
        "cache_implementation": cache_implementation is not None,
    }
    if any(given.values()):
        raise ValueError(
            f"expected greedy decoding and none of {sorted(given)} with a server (they belong to "
            f"generate in this process), got {sorted(name for name, on in given.items() if on)}"
        )


def _server_settings(
    server: CompletionsServer,
    probes: list[tuple[list[int], str]],
    *,
    target: Optional[str],
    max_new_tokens: int,
    seed: int,
    shard_size: int,
    sort_pool: int,
) -> dict[str, Any]:
    """The settings of a run through a server, as recorded in `progress.json`: the served model's name, how prompts
    are sent, and whether the answers' token ids are the server's own or retokenized from its text (asked with a
    one-token answer to the first of the `probes` prompts, ids and text, that gets one); the dtype is the server's
    (`"server"`), which no in-process run shares."""
    for name, value in (("max_new_tokens", max_new_tokens), ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    if not isinstance(sort_pool, int) or sort_pool < 0:
        raise ValueError(f"expected sort_pool to be an int >= 0 (0 keeps the given order), got {sort_pool!r}")
    return {
        "target": target,
        "dtype": SERVER_DTYPE,
        "server_model": server.model,
        "prompt_format": server.prompt_format,
        "answer_ids": "server" if _returns_token_ids(server, probes) else "retokenized",
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "sample_temperature": 0.0,
        "shard_size": shard_size,
        "sort_pool": sort_pool,
        "concurrency": server.concurrency,
    }


def _returns_token_ids(server: CompletionsServer, probes: list[tuple[list[int], str]]) -> bool:
    """Whether `server` answers with token ids, asked with the first of the `probes` it answers (one prompt that
    keeps failing does not stop the run; its own request later records it as failed)."""
    for number, probe in enumerate(probes, start=1):
        try:
            return server.returns_token_ids(*probe)
        except CompletionFailed:
            if number == len(probes):
                raise
    raise ValueError("expected a prompt to probe the server with, got none")


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


def _write_shards(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pending: list[dict[str, str]],
    out_dir: Path,
    settings: dict[str, Any],
    shards: list[dict[str, Any]],
    failed: dict[str, str],
    *,
    prompt_ids: _PromptIds,
    pad_token_id: int,
    feature_store: Optional[StoreWriter],
    on_batch: Callable[[int, int], None],
    server: Optional[CompletionsServer],
) -> int:
    """Answers the `pending` prompts shard by shard (with `model`, or through `server`), appending each completed
    shard to `shards` and the manifest, and keeping `failed` (`{id: reason}`) up to date; the rows written.

    Shards are consecutive chunks of the pending prompts: after an interruption the completed shards form a prefix,
    so the remaining chunks are exactly those of an uninterrupted run. Shard `k` samples with seed `seed + k`.

    Through a server, a prompt every attempt failed for is left out of its shard and recorded in `failed` (the
    manifest's), and a shard whose prompts all failed stops the run with a `RuntimeError`: the server is down or
    answers nothing usable, and going on would only record every prompt as failed.
    """
    written = 0
    for shard_records in _batches(pending, settings["shard_size"]):
        index = len(shards)
        shard = [{**record, "prompt_ids": prompt_ids(record)} for record in shard_records]
        torch.manual_seed(settings["seed"] + index)
        shard_failed = {}
        if server is not None:
            rows, shard_failed = _server_shard(
                server, tokenizer, shard, max_new_tokens=settings["max_new_tokens"], on_batch=on_batch
            )
        else:
            rows = _generate_shard(
                model,
                tokenizer,
                shard,
                batch_size=settings["batch_size"],
                max_new_tokens=settings["max_new_tokens"],
                sample_temperature=settings["sample_temperature"],
                pad_token_id=pad_token_id,
                on_batch=on_batch,
                capture_layers=None if feature_store is None else feature_store.meta["target_layer_ids"],
                continuous=settings["continuous"],
                cache_implementation=settings["cache_implementation"],
            )
        if feature_store is not None:
            feature_store.append([(row_key(row["id"]), row.pop("states")) for row in rows])
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
    Packs the rows written by [`regenerate`] into one small file to commit: token ids as uint16 (uint32 for
    vocabularies of 65,536 or more), one offset and prompt length per row, and the row ids; text is left out
    (prompts are in the prompt file, answers decode from the ids).

    When `path` already exists its rows are kept first and the folder's rows not in it are appended, so a
    regeneration resumed on a fresh clone (which skips the ids already packed) extends the committed file.

    Args:
        out_dir (`str` or `os.PathLike`): the output folder of [`regenerate`].
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
