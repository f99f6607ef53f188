"""Answers through an OpenAI-compatible completions server ([`training.completions.CompletionsServer`]): one shard's
prompts sent as token ids, `concurrency` at a time, each answer checked and turned into the token ids an
in-process row holds ([`answer_token_ids`]); and the settings a run through a server records and checks.
"""

from collections.abc import Callable
from typing import Any, Optional

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from jetspec.targets import apply_chat_template

from .completions import Completion, CompletionFailed, CompletionsServer, Failure
from .feature_store import StoreWriter
from .generate_answers import _until_eos

SERVER_DTYPE = "server"  # the `dtype` setting of rows a completions server wrote (its own kernels and weights)


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
