"""`jetspec serve --static eager|compile`: every request decoded on the static path (`modeling_jetspec/static.py`),
checked and warmed up before the server takes a request (`docs/serve.md`, "The static path").

A compiled graph of the static path is keyed by the call's batch and cache length (`max_length` plus one verify,
rounded up to `static.LENGTH_BUCKET` columns), not by its prompt: the verify writes at a column held in a tensor. A
chat request without `max_tokens` asks for transformers serve's default length ([`DEFAULT_NEW_TOKENS`], within the
model's context), so the first requests a chat server gets (short prompts, no `max_tokens`) share one cache length.

- [`check_static`]: what the static path refuses (`path_conditioning`, targets with recurrent or convolution layers,
  sliding-window targets) is refused before serving, by the static path's own `ValueError`: one call of one new
  token, whose refusal comes before any forward.
- [`warm_up`]: a few rounds of a tree call at that cache length, at batch 1 and at the batch cap, each with its
  progress line, on the inference thread (CUDA graphs are kept per thread: a graph recorded on another thread would
  be recorded again on the first request). Other batch sizes and cache lengths (longer prompts, another
  `max_tokens`) compile on their first request; past `torch._dynamo.config.recompile_limit` shapes per function,
  `torch.compile` runs new shapes eager.
"""

import copy
import logging
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from modeling_jetspec import AnswerCache

STATIC_MODES = (None, "eager", "compile")  # `Limits.static`: None is `--static off`, the default path
DEFAULT_NEW_TOKENS = 1024  # transformers serve's `max_new_tokens` for a request without one (or its model's, if more)
WARMUP_ROUNDS = 3  # rounds per warm-up call: the first compiles, CUDA graphs record on a later one
WARMUP_MESSAGES = [{"role": "user", "content": "Hello!"}]  # a short chat request
logger = logging.getLogger("jetspec.serve")


class RoundsStop(StoppingCriteria):
    """Stops every row in the call's `rounds`-th round, whatever its `max_length` (a warm-up call is sized as a long
    request and runs a few rounds). The call's round hook ([`count`]) counts the rounds and keeps the static cache's
    columns."""

    def __init__(self, rounds: int):
        self.rounds, self.done, self.columns = rounds, 0, None

    def count(self, record):
        self.done += 1
        self.columns = record.state.valid.shape[1]  # (B, length): the static path's round state

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        stop = self.done >= self.rounds - 1  # judged while the next round commits, before its hook
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)  # (B,)


def check_mode(static):
    """`static` (`Limits.static`) checked: `None`, `"eager"` or `"compile"`."""
    if static not in STATIC_MODES:
        raise ValueError(
            f"expected --static off, eager or compile (Limits.static None, 'eager' or 'compile'), got {static!r}"
        )


def check_static(target, head, static):
    """Refuse, before serving, what the static path cannot run for `target` and `head` (a `ValueError` naming it,
    raised by the static path itself); nothing for `static` `None`. An accepted pair costs one prefill of one token,
    eager."""
    check_mode(static)
    if static is None:
        return
    ids = torch.zeros((1, 1), dtype=torch.long, device=target.device)  # (1, 1)
    target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=1,
        do_sample=False,
        assistant_model=head,
        jetspec_static="eager",
    )


def warmup_prompt(target, tokenizer) -> torch.Tensor:
    """`(1, P)` a short chat request's prompt (its text alone without a chat template), on the target's device."""
    if tokenizer.chat_template is None:
        ids = tokenizer(WARMUP_MESSAGES[-1]["content"], return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(
            WARMUP_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return ids.to(target.device)


def default_new_tokens(target, prompt: int) -> int:
    """The new tokens a request without `max_tokens` asks for: transformers serve's default (at least
    [`DEFAULT_NEW_TOKENS`]), within the model's context after a prompt of `prompt` tokens (`serve.prepare`)."""
    new = max(target.generation_config.max_new_tokens or 0, DEFAULT_NEW_TOKENS)
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    return new if limit is None else max(min(new, limit - prompt), 1)


def warm_up(target, tokenizer, head, static, max_batch: int = 1, answers: bool = False) -> list:
    """Warm the static path up before serving: [`WARMUP_ROUNDS`] rounds of a greedy tree call at the cache length of
    a short chat request without `max_tokens`, at batch 1 and at `max_batch`, each logged as it ends; the first call
    raises what the static path refuses. Run it on the thread that serves (the generation manager's).

    Args:
        static (`str` or `None`): `"eager"` or `"compile"` (`--static`); `None` warms nothing up.
        max_batch (`int`, *optional*, defaults to 1): the batch cap; a cap above 1 gets its own call.
        answers (`bool`, *optional*, defaults to `False`): whether the server drafts from an answer cache (its trie
            joins each tree: more nodes per tree, another shape); the warm-up's cache is its own, empty.

    Returns:
        `list[dict]`: each call's `batch`, `columns` (the static cache's length) and `seconds`.
    """
    check_mode(static)
    if static is None:
        return []
    ids = warmup_prompt(target, tokenizer)  # (1, P)
    config = copy.deepcopy(target.generation_config)  # a request's, as transformers serve builds it
    config.max_new_tokens, config.do_sample = default_new_tokens(target, ids.shape[1]), False
    config.eos_token_id = None  # every call runs its rounds
    batches = [1] if max_batch == 1 else [1, max_batch]
    logger.info(
        "jetspec serve: warming up the static path (%s) before serving: %d call(s) of %d rounds, a chat prompt of %d "
        "tokens + up to %d new (a request without max_tokens)",
        static,
        len(batches),
        WARMUP_ROUNDS,
        ids.shape[1],
        config.max_new_tokens,
    )
    done = []
    for index, batch in enumerate(batches, 1):
        stop, started = RoundsStop(WARMUP_ROUNDS), time.perf_counter()
        target.generate(
            ids.repeat(batch, 1),  # (b, P)
            attention_mask=torch.ones_like(ids).repeat(batch, 1),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stop]),
            assistant_model=head,
            jetspec_static=static,
            jetspec_round_hook=stop.count,
            jetspec_answer_cache=AnswerCache(max_answers=1) if answers else None,
        )
        done.append({"batch": batch, "columns": stop.columns, "seconds": time.perf_counter() - started})
        logger.info(
            "jetspec serve: warm-up %d/%d: static %s, batch %d, cache %s ... %.2f s (%d rounds)",
            index,
            len(batches),
            static,
            batch,
            stop.columns,
            done[-1]["seconds"],
            stop.done,
        )
    logger.info(
        "jetspec serve: static %s warmed up at batch %s and a cache of %s columns; %s",
        static,
        " and ".join(str(b) for b in batches),
        done[0]["columns"],
        "other batch sizes and cache lengths (longer prompts, another max_tokens) compile on their first request"
        if static == "compile"
        else "eager: nothing to compile",
    )
    return done
