"""Property: for random combinations of what plain `generate` accepts, `generate(..., assistant_model=head)` returns
plain `generate`'s tokens (greedy: token for token, same shape), or raises a `ValueError` before any target forward
(for the refusals the draw predicts: guidance at batch > 1, a user's processor, path conditioning with a lookup
branch or the measured budget). Sampling is exact in distribution, not per seed (`test_sampling.py`): a sampled case
must run, or be refused as above. Where plain `generate` raises, the tree loop must raise too.

Each case is drawn from `numpy.random.default_rng([JETSPEC_FUZZ_SEED, case])` (seed 20261201): processors (repetition
penalty, no-repeat n-grams, bad words, sequence bias, min new tokens, suppress / begin-suppress tokens, forced EOS,
temperature / top-k / top-p), stopping criteria (max_new_tokens, EOS ids, a per-row custom criterion, stop strings
with a tiny tokenizer), `return_dict_in_generate`, a streamer (handed the same puts), batch 1-3 with left padding,
tree shapes (depth, width, budget or "auto", lookup, path conditioning), targets llama / qwen3 with and without a pad
token, and heads of random quality: random heads and the never / sometimes / always oracles (`jetspec/tiny.py`). fp32, CPU.
`JETSPEC_FUZZ_CASES` (default 48, about 10 s on 2 cores) sets the count; a case that fails prints its draw.
"""

import functools
import os

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from jetspec.tiny import oracle_head, tiny_head, tiny_target, tiny_tokenizer

SEED = int(os.environ.get("JETSPEC_FUZZ_SEED", 20261201))
CASES = int(os.environ.get("JETSPEC_FUZZ_CASES", 48))
VOCAB = 128


@functools.cache
def target(arch: str, pad: int | None):
    return tiny_target(arch, vocab_size=VOCAB, pad_token_id=pad)


@functools.cache
def random_head(arch: str, pad: int | None, seed: int):
    return tiny_head(target(arch, pad), seed=seed)


class StopRowAt(StoppingCriteria):
    """Stops row r once it holds `lengths[r]` tokens (a per-row stop that is not an EOS)."""

    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.lengths[: input_ids.shape[0]]


class Collect:
    """A streamer that takes batches: what it was handed, put by put."""

    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.puts.append("end")


class Shift(LogitsProcessor):
    """A user's processor: the tree loop cannot know it is row-wise and stateless, so it is refused."""

    def __call__(self, input_ids, scores):
        return scores + 0.1


def draw(rng: np.random.Generator) -> dict:
    """One case: the target, prompts, head and the `generate` keyword arguments; `refusal`: what the tree loop must
    refuse (a fragment of its message), or None."""
    arch = str(rng.choice(["llama", "qwen3"]))
    pad = None if rng.random() < 0.25 else 0
    batch = int(rng.integers(1, 4))
    lengths = [int(n) for n in rng.integers(1, 12, size=batch)]
    longest = max(lengths)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for row, n in enumerate(lengths):  # left padding
        ids[row, longest - n :] = torch.from_numpy(rng.integers(1, VOCAB, size=n))
        mask[row, longest - n :] = 1
    tokens = lambda k: [int(t) for t in rng.choice(np.arange(1, VOCAB), size=k, replace=False)]  # noqa: E731
    kw = dict(max_new_tokens=int(rng.integers(1, 25)))
    refusal = None
    if rng.random() < 0.5:
        kw["eos_token_id"] = tokens(1)[0] if rng.random() < 0.5 else tokens(2)
    if rng.random() < 0.3:
        kw["repetition_penalty"] = float(rng.uniform(1.0, 3.0))
    if rng.random() < 0.3:
        kw["no_repeat_ngram_size"] = int(rng.integers(1, 4))
    if rng.random() < 0.2:
        kw["bad_words_ids"] = [tokens(1), tokens(2)]
    if rng.random() < 0.15:
        kw["sequence_bias"] = {tuple(tokens(1)): float(rng.uniform(-5, 5)), tuple(tokens(2)): 4.0}
    if rng.random() < 0.2 and "eos_token_id" in kw:
        kw["min_new_tokens"] = int(rng.integers(1, 8))
    if rng.random() < 0.2:
        kw["suppress_tokens"] = tokens(3)
    if rng.random() < 0.2:
        kw["begin_suppress_tokens"] = tokens(2)
    if rng.random() < 0.1 and "eos_token_id" in kw:
        kw["forced_eos_token_id"] = tokens(1)[0]
    if rng.random() < 0.25:
        kw["stopping_criteria"] = StoppingCriteriaList(
            [StopRowAt([longest + int(n) for n in rng.integers(1, kw["max_new_tokens"] + 2, size=batch)])]
        )
    if rng.random() < 0.2:
        kw["stop_strings"] = ["".join(rng.choice(list("abcdefghijk"), size=2)) for _ in range(2)]
        kw["tokenizer"] = tiny_tokenizer(VOCAB)
    if rng.random() < 0.08:
        kw["guidance_scale"] = 2.0
        refusal = "UnbatchedClassifierFreeGuidanceLogitsProcessor" if batch > 1 else refusal
    if rng.random() < 0.05:
        kw["logits_processor"] = LogitsProcessorList([Shift()])
        refusal = "Shift"
    if rng.random() < 0.15:
        kw.update(return_dict_in_generate=True, output_scores=bool(rng.random() < 0.5))
    stream = rng.random() < 0.2
    sample = rng.random() < 0.25
    if sample:
        kw.update(
            do_sample=True,
            temperature=float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.integers(0, 20)),
            top_p=float(rng.uniform(0.5, 1.0)),
        )
    else:
        kw["do_sample"] = False
    tree = dict(
        tree_depth=int(rng.integers(1, 8)),
        tree_width=int(rng.integers(1, 5)),
        tree_budget="auto" if rng.random() < 0.1 else int(rng.integers(1, 41)),
    )
    if rng.random() < 0.2:
        tree["tree_lookup"] = int(rng.integers(1, 9))
    if rng.random() < 0.15:
        tree["path_conditioning"] = True
        if tree.get("tree_lookup") or tree["tree_budget"] == "auto":
            refusal = "path_conditioning=True"
    head = str(rng.choice(["random", "never", "sometimes", "always"]))
    return dict(
        arch=arch,
        pad=pad,
        ids=ids,
        mask=mask,
        kwargs=kw,
        tree=tree,
        head=head,
        head_seed=int(rng.integers(1, 4)),
        sample=sample,
        stream=stream,
        refusal=refusal,
    )


def describe(case: dict) -> str:
    shown = {k: v for k, v in case.items() if k not in ("ids", "mask")}
    shown["kwargs"] = {k: v for k, v in case["kwargs"].items() if k != "tokenizer"}
    return f"{shown}, prompt lengths {case['mask'].sum(-1).tolist()}"


@pytest.mark.parametrize("index", range(CASES))
def test_tree_generate_equals_plain_generate_or_refuses_before_decoding(index):
    case = draw(np.random.default_rng([SEED, index]))
    model = target(case["arch"], case["pad"])
    ids, mask, kwargs = case["ids"], case["mask"], case["kwargs"]
    torch.manual_seed(index)
    streams = (Collect(), Collect()) if case["stream"] else (None, None)  # plain's, the tree loop's
    try:
        plain = model.generate(input_ids=ids, attention_mask=mask, streamer=streams[0], **kwargs)
    except Exception as error:  # plain generate refuses this combination: so must the tree loop
        with pytest.raises(type(error)):
            head = random_head(case["arch"], case["pad"], 1)
            model.generate(input_ids=ids, attention_mask=mask, assistant_model=head, **kwargs, **case["tree"])
        return
    if case["head"] == "random" or case["sample"]:
        head = random_head(case["arch"], case["pad"], case["head_seed"])
    else:  # the oracles know plain greedy's continuation
        reference = plain.sequences if kwargs.get("return_dict_in_generate") else plain
        head = oracle_head(model, reference, mask, mode=case["head"])
    forwards = []
    hook = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        tree = model.generate(
            input_ids=ids, attention_mask=mask, assistant_model=head, streamer=streams[1], **kwargs, **case["tree"]
        )
    except ValueError as error:
        assert case["refusal"] is not None and case["refusal"] in str(error), f"{error}\n{describe(case)}"
        assert not forwards, f"refused after {len(forwards)} target forwards\n{describe(case)}"
        return
    finally:
        hook.remove()
    assert case["refusal"] is None, f"expected a refusal naming {case['refusal']}\n{describe(case)}"
    if kwargs.get("return_dict_in_generate"):  # scores of finished rows differ (zeros), by design: sequences only
        plain, tree = plain.sequences, tree.sequences
    if case["sample"]:  # exact in distribution only: the same rows, the prompts kept, tokens of the vocabulary
        assert tree.shape[0] == plain.shape[0] and torch.equal(tree[:, : ids.shape[1]], ids), describe(case)
        assert ids.shape[1] < tree.shape[1] <= ids.shape[1] + kwargs["max_new_tokens"] and tree.max() < VOCAB
    else:
        assert tree.shape == plain.shape and torch.equal(tree, plain), describe(case)
        assert streams[1] is None or streams[1].puts == streams[0].puts, describe(case)
