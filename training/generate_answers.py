"""Answers in this process: the target's `generate` over left-padded batches of one shard (optionally returning the
hidden states it computed, for the feature store), or transformers' continuous batching over the whole shard
([`_generate_shard`]; [`training.answers.regenerate`] writes the rows).
"""

from collections.abc import Callable, Iterator
from typing import Any, Optional

import psutil
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown

from .feature_store import stack_states

CONTINUOUS_MEMORY_SHARE = 0.5  # of the memory available now, for continuous batching's paged cache on a CPU


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
    ([`training.answers.regenerate`] refuses the combination).
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
