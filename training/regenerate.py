"""Regenerates training data with the target's own answers (see `training/answers.py`).

Example:

```bash
python -m training.regenerate --target smollm2-135m --prompts training/prompts/sharegpt_train.jsonl \
    --out data/regen --max_new_tokens 192 --batch_size 16 --limit 1200
```

Rerunning the same command resumes after the last completed shard (and, with `--server`, asks again for the prompts
recorded as failed).

Through a serving engine (any OpenAI-compatible completions server; the prompts go as token ids formatted by the
target's tokenizer, answers are greedy):

```bash
python -m training.regenerate --target smollm2-135m --prompts training/prompts/sharegpt_train.jsonl \
    --out data/regen-server --server http://127.0.0.1:8000 --concurrency 32 --max_new_tokens 192
```

A server's faults (5xx, stalls past `--server_timeout`, requests past `--server_deadline` however steadily bytes
come, dropped connections, empty, cut or malformed answers) are retried `--server_attempts` times per prompt with exponential backoff from `--server_retry_delay`; a prompt still
without an answer is recorded as failed in `progress.json` (no row is written for it, `--export` never packs it) and
listed at the end. A refusal no retry heals (401, 403, 404, 422: wrong address, model or credentials) stops the run.

Split over processes or machines: `accelerate launch --num_processes 8 training/regenerate.py ...` gives each
process one set of the prompts (its GPU in process, or `--server` per process), or `--num_shards K --shard_index i`
by hand on K machines; `--export_only --export FILE.npz` on the shared `--out` then packs the union.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if not __package__:  # run as a file, not as `python -m training.regenerate`: see training/_bootstrap.py
    import _bootstrap  # noqa: F401

from accelerate import PartialState
from transformers import AutoTokenizer, HfArgumentParser

from jetspec.targets import SMOLLM2_ALIAS, load_target, resolve_dtype
from modeling_jetspec.configuration_jetspec import default_target_layer_ids

from training.answers import regenerate
from training.compact_file import save_compact
from training.completions import (
    DEADLINE_PER_TIMEOUT,
    DEFAULT_ATTEMPTS,
    DEFAULT_RETRY_DELAY,
    DEFAULT_TIMEOUT,
    MAX_RETRY_DELAY,
    CompletionsServer,
)
from training.feature_store import StoreWriter, store_settings
from training.prompt_file import read_prompts
from training.rows import compact_ids


@dataclass
class RegenerateArguments:
    target: str = field(
        default="smollm2-135m", metadata={"help": "Target alias (`smollm2-135m`), local folder or Hub id."}
    )
    prompts: str = field(
        default=None,
        metadata={"help": "jsonl file with a `prompt` (or ShareGPT `conversations`) field, or a save_to_disk folder."},
    )
    out: str = field(default="data/regen", metadata={"help": "Output folder of the shards; rerun to resume."})
    max_new_tokens: int = field(default=256, metadata={"help": "Longest answer, in tokens."})
    batch_size: int = field(default=8, metadata={"help": "Prompts per generate call (left padded)."})
    limit: Optional[int] = field(default=None, metadata={"help": "Use only the first N prompts."})
    seed: int = field(default=0, metadata={"help": "Seed of shard k is seed + k (matters only when sampling)."})
    sample_temperature: float = field(
        default=0.0, metadata={"help": "0 decodes greedily; > 0 samples at this temperature instead."}
    )
    shard_size: int = field(default=64, metadata={"help": "Rows per shard file (the most an interruption loses)."})
    export: Optional[str] = field(
        default=None,
        metadata={
            "help": "After regenerating, pack every row of --out into this compact .npz file (token ids, "
            "offsets, prompt lengths, ids) for committing; training reads it like a folder."
        },
    )
    export_only: bool = field(default=False, metadata={"help": "Only pack --out into --export; regenerate nothing."})
    feature_store: Optional[str] = field(
        default=None,
        metadata={
            "help": "Also store the target's features of every new row, as computed while generating, in "
            "this folder (see training/feature_store.py): training reads them instead of running the "
            "target."
        },
    )
    feature_max_length: int = field(default=512, metadata={"help": "Positions stored per row (training max_length)."})
    continuous: bool = field(
        default=False,
        metadata={
            "help": "Answer with transformers' continuous batching (generate_batch) instead of padded "
            "generate batches; excludes --feature_store (build it afterwards)."
        },
    )
    exclude: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Compact .npz files whose row ids are skipped besides --export's (e.g. rows committed "
            "from a run with other settings, which --export cannot be extended with)."
        },
    )
    sort_pool: int = field(
        default=0,
        metadata={
            "help": "Order the prompts by token length within pools of this many before sharding (0 keeps "
            "file order): batches then pad prompts to a width close to their own."
        },
    )
    cache_implementation: Optional[str] = field(
        default=None,
        metadata={"help": "`static` preallocates each batch's KV cache; unset is generate's dynamic cache."},
    )
    server: Optional[str] = field(
        default=None,
        metadata={
            "help": "Answer through this OpenAI-compatible completions server (vLLM, SGLang, llama.cpp, TGI), "
            "e.g. http://127.0.0.1:8000, instead of generate in this process (greedy; the target's "
            "tokenizer formats the prompts and sends them as token ids)."
        },
    )
    concurrency: int = field(default=8, metadata={"help": "With --server: requests in flight at once."})
    server_prompt: str = field(
        default="token_ids",
        metadata={
            "help": "With --server: send prompts as `token_ids`, or as `text` for a server whose prompt takes "
            "text only (llama-cpp-python's), each checked to tokenize to our ids on the server first, or as "
            "`text_openai` for a server that takes the OpenAI API's fields only (`transformers serve`), checked by "
            "the count of prompt tokens it reports."
        },
    )
    server_model: Optional[str] = field(
        default=None,
        metadata={
            "help": "With --server: the served model's name; defaults to the one GET /v1/models lists (transformers "
            "serve answers that with a 500 offline: name its model, the path or id it was started with)."
        },
    )
    server_attempts: int = field(
        default=DEFAULT_ATTEMPTS,
        metadata={
            "help": "With --server: attempts per prompt (1 retries nothing) before it is recorded as failed "
            "(5xx, 408, 429, timeouts, deadlines, dropped connections, empty, cut or malformed answers)."
        },
    )
    server_retry_delay: float = field(
        default=DEFAULT_RETRY_DELAY,
        metadata={
            "help": f"With --server: seconds before the first retry, doubled before each next one (at most "
            f"{MAX_RETRY_DELAY:g})."
        },
    )
    server_timeout: float = field(
        default=DEFAULT_TIMEOUT,
        metadata={
            "help": "With --server: seconds a request may wait for the server's next bytes before the attempt "
            "fails (the whole answer comes at once: allow for the longest one under load)."
        },
    )
    server_deadline: Optional[float] = field(
        default=None,
        metadata={
            "help": "With --server: seconds a whole request may take, however steadily the server sends bytes, "
            f"before the attempt fails; defaults to {DEADLINE_PER_TIMEOUT:g} times --server_timeout."
        },
    )
    num_shards: Optional[int] = field(
        default=None,
        metadata={
            "help": "Split the prompts over this many processes or machines (disjoint sets by id hash, each "
            "written to --out/part-i-of-K); defaults to accelerate's process count."
        },
    )
    shard_index: Optional[int] = field(
        default=None, metadata={"help": "The set this process answers; defaults to accelerate's process index."}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "Target weights: `auto` (bfloat16 on a GPU or a CPU with native bf16, else float32), "
            "`bfloat16` or `float32`. bf16 without native support is several times slower."
        },
    )


def target_tokenizer(target: str):
    """The target's tokenizer alone (a server holds the weights): from the converted alias or `from_pretrained`."""
    if target == SMOLLM2_ALIAS:
        return load_target(target)[1]  # builds the alias's cache on first use; 135M weights, loaded in a second
    return AutoTokenizer.from_pretrained(target)


def report_failures(failed: dict[str, str], out: str, where: str, shown: int = 10) -> None:
    """Prints the prompts recorded as failed (the first `shown`, each with its reason) and how to retry them."""
    if not failed:
        return
    print(
        f"{len(failed)} prompt{'s' if len(failed) > 1 else ''} failed, {where} (recorded in {out}'s progress.json; "
        "rerun the same command to ask again):"
    )
    for id_, reason in list(failed.items())[:shown]:
        print(f"  {id_}: {reason}")
    if len(failed) > shown:
        print(f"  ... and {len(failed) - shown} more")


def main(argv: Optional[list[str]] = None) -> None:
    (args,) = HfArgumentParser(RegenerateArguments).parse_args_into_dataclasses(args=argv)
    state = PartialState()
    num_shards = state.num_processes if args.num_shards is None else args.num_shards
    shard_index = state.process_index if args.shard_index is None else args.shard_index
    if args.export is not None and not args.export_only and num_shards != state.num_processes:
        raise ValueError(
            f"expected --export with --num_shards only under one launch of all {num_shards} processes, "
            f"got {state.num_processes}; run --export_only once every part is done"
        )
    if args.export_only:
        if args.export is None:
            raise ValueError("expected --export FILE.npz with --export_only, got none")
        summary = save_compact(args.out, args.export)
        print(f"packed {summary['rows']} rows ({summary['answer_tokens']} answer tokens) into {args.export}")
        report_failures(summary["failed"], args.out, "not packed")
        return
    prompts = prompts_to_answer(args)
    if not prompts:
        return
    model, tokenizer, server, writer = answerer(args, state)
    stats = regenerate(
        model,
        tokenizer,
        prompts,
        args.out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        sample_temperature=args.sample_temperature,
        shard_size=args.shard_size,
        target=args.target,
        feature_store=writer,
        continuous=args.continuous,
        sort_pool=args.sort_pool,
        cache_implementation=args.cache_implementation,
        server=server,
        num_shards=num_shards,
        shard_index=shard_index,
        progress=state.is_local_main_process,
    )
    part = f" (set {shard_index} of {num_shards})" if num_shards > 1 else ""
    print(
        f"{stats['rows']} rows in {args.out}{part} ({stats['new_rows']} new, {stats['new_tokens']} tokens "
        f"in {stats['seconds']:.0f} s, {stats['new_tokens'] / max(stats['seconds'], 1e-9):.1f} tok/s)"
    )
    report_failures(stats["failed"], args.out, "in no shard")
    if args.export is not None:
        state.wait_for_everyone()  # every part is done before the union is packed
        if state.is_main_process:
            summary = save_compact(args.out, args.export)
            print(f"packed {summary['rows']} rows ({summary['answer_tokens']} answer tokens) into {args.export}")
            if summary["failed"] != stats["failed"]:  # other parts' failures
                report_failures(summary["failed"], args.out, "not packed")


def prompts_to_answer(args: RegenerateArguments) -> list[dict[str, str]]:
    """The prompts of `--prompts` (the first `--limit`), less those already packed in `--exclude` files or in the
    `--export` file (e.g. committed rows are not regenerated again); empty, saying so, when every one is packed."""
    if args.prompts is None:
        raise ValueError("expected --prompts <jsonl file or datasets folder>, got none")
    prompts = read_prompts(args.prompts, limit=args.limit)
    missing = [path for path in args.exclude if not Path(path).is_file()]
    if missing:
        raise ValueError(f"expected --exclude to name existing compact .npz files, got missing {missing}")
    skipped = [path for path in [*args.exclude, args.export] if path is not None]
    packed = set().union(*(compact_ids(path)[0] for path in skipped))
    if packed:
        prompts = [record for record in prompts if record["id"] not in packed]
        if not prompts:
            print(f"every prompt is already in {', '.join(skipped)}")
    return prompts


def answerer(args: RegenerateArguments, state: PartialState) -> tuple:
    """`(model, tokenizer, server, feature store writer)`: the completions server of `--server` (no model here), or
    the target loaded on this process's device, with a feature store writer for `--feature_store`."""
    model, server, writer = None, None, None
    if args.server is not None:
        server = CompletionsServer(
            args.server,
            concurrency=args.concurrency,
            model=args.server_model,
            prompt_format=args.server_prompt,
            timeout=args.server_timeout,
            deadline=args.server_deadline,
            max_attempts=args.server_attempts,
            retry_delay=args.server_retry_delay,
        )
        tokenizer = target_tokenizer(args.target)
        print(f"answering through {server.base} ({server.model}), {server.concurrency} requests at a time")
        return model, tokenizer, server, writer
    dtype, reason = resolve_dtype(args.dtype)
    print(f"target dtype {str(dtype).removeprefix('torch.')} ({reason}) on {state.device}")
    model, tokenizer = load_target(args.target, dtype=dtype)
    model.to(state.device)  # each process its own accelerator
    if args.feature_store is not None:
        layers = default_target_layer_ids(model.config.get_text_config().num_hidden_layers)
        writer = StoreWriter(args.feature_store, store_settings(model, layers, args.feature_max_length, args.target))
    return model, tokenizer, server, writer


if __name__ == "__main__":
    main()
