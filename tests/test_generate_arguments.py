"""`generate` arguments at their edges: each is honoured exactly as plain `generate` (token for token, fp32) or
refused by name with a `ValueError` before any target forward.

Drafters: (s) the "sometimes" oracle, whose accepted paths run through later siblings, so rows advance by different
amounts per round; (r) a random head. Rows of different prompt lengths stop at different steps.
"""

import numpy as np
import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TextStreamer,
)

import modeling_jetspec.decode as decode
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target, tiny_tokenizer


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


class CountForwards:
    """Counts the target's forwards (a pre-hook): a refusal before decoding leaves the count at 0."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, *args):
        self.count += 1


def refused_before_decoding(target, match, **kwargs):
    counter = CountForwards(target)
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(**kwargs)
    finally:
        counter.handle.remove()
    assert counter.count == 0


class StopRowAt(StoppingCriteria):
    """Stops row r once it holds `lengths[r]` tokens: a per-row stop with no EOS token."""

    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.lengths[: input_ids.shape[0]]


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


# ------------------------------------------------------------------------------------------------ processors
def test_guidance_at_batch_1_is_exact(llama):
    ids, mask = prompts(1)
    plain = greedy(llama, ids, mask, max_new_tokens=16, guidance_scale=3.0)
    for head in (oracle_head(llama, plain, mask, mode="sometimes"), tiny_head(llama)):  # (s), (r)
        assert torch.equal(greedy(llama, ids, mask, max_new_tokens=16, guidance_scale=3.0, assistant_model=head), plain)


def test_guidance_at_batch_2_is_refused_by_name(llama):
    ids, mask = prompts(2)
    refused_before_decoding(
        llama,
        "got UnbatchedClassifierFreeGuidanceLogitsProcessor at batch size 2",
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        guidance_scale=3.0,
        assistant_model=tiny_head(llama),
    )


def test_user_processors_and_subclasses_are_refused_by_name(llama):
    class RowMixing(LogitsProcessor):  # every row's scores shifted by the batch mean: rows depend on each other
        def __call__(self, input_ids, scores):
            return scores - scores.mean(0, keepdim=True)

    class Spied(TemperatureLogitsWarper):  # a subclass may override __call__: matched by exact type, refused
        pass

    ids, mask = prompts(2)
    for processor in (RowMixing(), Spied(0.7)):
        refused_before_decoding(
            llama,
            f"got {type(processor).__name__} at batch size 2",
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            logits_processor=LogitsProcessorList([processor]),
            assistant_model=tiny_head(llama),
        )


# ------------------------------------------------------------------------------------------------ per-row stops
@pytest.mark.parametrize("eos,pad", [(None, 0), (None, None), (7, 0)], ids=["no-eos", "no-eos-no-pad", "eos"])
def test_per_row_stops_follow_plain_generate(eos, pad):
    """Without an EOS token plain `generate` keeps appending real tokens to a row a criterion stopped, until every
    row has stopped; with one it pads the row. The tree loop does the same, with or without a pad token."""
    target = tiny_target("llama", eos_token_id=eos, pad_token_id=pad)
    ids, mask = prompts(3)
    stop = StoppingCriteriaList([StopRowAt([ids.shape[1] + 3, ids.shape[1] + 11, ids.shape[1] + 6])])
    plain = greedy(target, ids, mask, max_new_tokens=20, stopping_criteria=stop)
    assert plain.shape[1] == ids.shape[1] + 11 or eos is not None  # the last row to stop sets the length
    for head in (oracle_head(target, plain, mask, mode="sometimes"), tiny_head(target)):
        tree = greedy(target, ids, mask, max_new_tokens=20, stopping_criteria=stop, assistant_model=head)
        assert tree.shape == plain.shape and torch.equal(tree, plain)


def test_stop_strings_with_a_tokenizer(llama):
    tokenizer = tiny_tokenizer()
    ids, mask = prompts(3)
    free = greedy(llama, ids, mask, max_new_tokens=24)
    texts = [tokenizer.decode(row[ids.shape[1] :]) for row in free]
    stops = [text[4 + 3 * i : 6 + 3 * i] for i, text in enumerate(texts)]  # a string each row reaches at some step
    kwargs = dict(max_new_tokens=24, stop_strings=stops, tokenizer=tokenizer)
    plain = greedy(llama, ids, mask, **kwargs)
    assert plain.shape[1] < free.shape[1]  # the stop strings stop every row before max_new_tokens
    for head in (oracle_head(llama, plain, mask, mode="sometimes"), tiny_head(llama)):
        assert torch.equal(greedy(llama, ids, mask, assistant_model=head, **kwargs), plain)
        config = GenerationConfig(max_new_tokens=24, stop_strings=stops, do_sample=False)
        assert torch.equal(
            llama.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tokenizer, assistant_model=head
            ),
            plain,
        )


def test_streamer_at_batch_2_gets_what_plain_generate_hands_it(llama):
    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    ids, mask = prompts(2)
    stop = StoppingCriteriaList([StopRowAt([ids.shape[1] + 4, ids.shape[1] + 9])])
    for kwargs in (dict(max_new_tokens=12), dict(max_new_tokens=12, stopping_criteria=stop)):
        plain_streamer, tree_streamer = Collect(), Collect()
        plain = greedy(llama, ids, mask, streamer=plain_streamer, **kwargs)
        head = oracle_head(llama, plain, mask, mode="sometimes")
        tree = greedy(llama, ids, mask, streamer=tree_streamer, assistant_model=head, **kwargs)
        assert torch.equal(tree, plain) and tree_streamer.ended
        assert tree_streamer.puts == plain_streamer.puts  # the prompts (2, L), then one (2,) step per put


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_the_first_token_is_streamed_before_the_head_reads_the_prompt(family):
    """A stream's first token comes from the prefill's logits alone: it is handed to the streamer before the head's
    pass over the prompt's features (`steps.prefill`'s `before_context`), for an attention target and a hybrid one,
    and the output stays plain greedy's."""
    from test_architectures import HYBRID_FAMILIES, family_target

    target = tiny_target("llama") if family == "llama" else family_target(family, *HYBRID_FAMILIES[family])
    ids, mask = prompts(2)
    events = []

    class Record:
        def put(self, value):
            events.append(("put", tuple(value.shape)))

        def end(self):
            events.append(("end",))

    plain = greedy(target, ids, mask, max_new_tokens=6)
    head = tiny_head(target)
    extend = head.extend_context

    def extend_context(*args, **kwargs):
        events.append(("context",))
        return extend(*args, **kwargs)

    head.extend_context = extend_context
    tree = greedy(target, ids, mask, max_new_tokens=6, assistant_model=head, streamer=Record())
    assert torch.equal(tree, plain)
    assert events[:3] == [("put", tuple(ids.shape)), ("put", (2,)), ("context",)]  # prompt, first step, then the head
    assert events[-1] == ("end",)


def test_text_streamer_refuses_a_batch_itself(llama):
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        greedy(llama, ids, mask, max_new_tokens=4, streamer=TextStreamer(tiny_tokenizer()))
    refused_before_decoding(
        llama,
        "TextStreamer only supports batch size 1",
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        streamer=TextStreamer(tiny_tokenizer()),
        assistant_model=tiny_head(llama),
    )


# ------------------------------------------------------------------------------------------------ inputs and bounds
def test_attention_mask_shorter_than_the_prompt(llama):
    ids, mask = prompts(2)
    with pytest.raises(Exception):  # plain generate fails too (an index error inside the model)
        greedy(llama, ids, mask[:, 1:], max_new_tokens=4)
    refused_before_decoding(
        llama,
        r"attention_mask of the shape of input_ids \(2, 9\), got \(2, 8\)",
        input_ids=ids,
        attention_mask=mask[:, 1:],
        max_new_tokens=4,
        assistant_model=tiny_head(llama),
    )


def test_tree_wider_than_the_draft_vocabulary(llama):
    ids, mask = prompts(1)
    refused_before_decoding(
        llama,
        r"tree_width <= 128 \(the head's draft vocabulary.*got 129",
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        tree_width=129,
        assistant_model=tiny_head(llama),
    )


def test_tree_budget_beyond_memory_is_refused_before_the_tree_is_built(llama):
    ids, mask = prompts(2)
    head = tiny_head(llama)
    calls = []
    head.register_forward_pre_hook(lambda *args: calls.append(1))
    refused_before_decoding(
        llama,
        r"fits in memory, got tree_budget=1000000 \(up to 1000000 nodes.*GiB",
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        tree_depth=7,
        tree_width=100,
        tree_budget=10**6,
        assistant_model=head,
    )
    assert not calls  # no draft either


def test_buffers_follow_the_tokens_produced(llama, monkeypatch):
    """max_new_tokens=10**9 with a criterion that stops every row early: plain generate returns at once, and so does
    the tree loop, holding a buffer sized by the tokens produced."""
    widths = []
    finish = decode._finish
    monkeypatch.setattr(
        decode, "_finish", lambda head, call, *a: widths.append(call.sequences.shape[1]) or finish(head, call, *a)
    )
    ids, mask = prompts(2)
    stop = StoppingCriteriaList([StopRowAt([ids.shape[1] + 5, ids.shape[1] + 90])])
    plain = greedy(llama, ids, mask, max_new_tokens=10**9, stopping_criteria=stop)
    tree = greedy(llama, ids, mask, max_new_tokens=10**9, stopping_criteria=stop, assistant_model=tiny_head(llama))
    assert torch.equal(tree, plain) and widths[0] <= 2 * plain.shape[1]


@pytest.mark.parametrize("value", [5.0, "5", True])
def test_max_new_tokens_of_another_type_is_refused_by_name(llama, value):
    ids, mask = prompts(1)
    refused_before_decoding(
        llama,
        f"max_new_tokens to be an int, got {type(value).__name__}",
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=value,
        assistant_model=tiny_head(llama),
    )


def test_numpy_integers_are_integers(llama):
    ids, mask = prompts(2)
    plain = greedy(llama, ids, mask, max_new_tokens=10)
    tree = greedy(
        llama,
        ids,
        mask,
        max_new_tokens=np.int64(10),
        tree_budget=np.int64(8),
        tree_depth=np.int32(3),
        tree_width=np.int64(2),
        assistant_model=tiny_head(llama),
    )
    assert torch.equal(tree, plain)


def test_dynamic_cache_implementation_is_generate_s_default(llama):
    ids, mask = prompts(2)
    plain = greedy(llama, ids, mask, max_new_tokens=10, cache_implementation="dynamic")
    tree = greedy(llama, ids, mask, max_new_tokens=10, cache_implementation="dynamic", assistant_model=tiny_head(llama))
    assert torch.equal(tree, plain)


def test_head_on_another_device_is_refused(llama):
    head = tiny_head(llama).to("meta")
    ids, mask = prompts(1)
    refused_before_decoding(
        llama,
        "head on the target's device cpu, got meta: move it with head.to",
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        assistant_model=head,
    )
