"""Lossless sampling: with a head, sampled continuations follow the target's own (processed) distribution.

A tiny target with an 8-token vocabulary; every 3-token continuation's exact probability is computed by
enumeration with the same logits processors `generate` applies (repetition penalty, temperature, top-k,
top-p). Several thousand continuations sampled in one batched call are compared with it by a chi-square
goodness-of-fit test at alpha = 1e-3: with a fixed seed the outcome is deterministic, and a correct sampler
would fail it for one seed in a thousand. Plain sampling goes through the same test, which checks the reference.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from modeling_jetspec import JetSpecDraftModel
from tiny import tiny_head, tiny_target


class MarginalHead(JetSpecDraftModel):
    """Drafts, at every depth d, the target's marginal distribution of the d-th new token: often right."""

    marginals: torch.Tensor = None  # (NEW, VOCAB) log-probs

    def forward(self, input_ids, position_ids, *args, **kwargs):
        out = super().forward(input_ids, position_ids, *args, **kwargs)
        depth = (position_ids - position_ids[:, :1]).clamp(max=NEW - 1)  # slot d drafts new token d
        out.logits = self.marginals[depth]
        return out

VOCAB, NEW, SAMPLES, BATCH, ALPHA = 8, 3, 3200, 32, 1e-3
SETTINGS = dict(do_sample=True, temperature=0.7, top_k=6, top_p=0.97, repetition_penalty=1.4)


def exact_distribution(target, prompt):
    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(SETTINGS["repetition_penalty"]),
            TemperatureLogitsWarper(SETTINGS["temperature"]),
            TopKLogitsWarper(SETTINGS["top_k"]),
            TopPLogitsWarper(SETTINGS["top_p"]),
        ]
    )
    probs, frontier = {}, [((), 1.0)]
    while frontier:  # one target forward per prefix: 1 + 8 + 64
        prefix, p = frontier.pop()
        ids = torch.cat([prompt, torch.tensor([list(prefix)], dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = target(ids).logits[:, -1].float()
        step = torch.softmax(processors(ids, logits), dim=-1)[0].tolist()
        for token in range(VOCAB):
            child = (prefix + (token,), p * step[token])
            if len(child[0]) == NEW:
                probs[child[0]] = child[1]
            elif child[1] > 0:
                frontier.append(child)
    return probs


def goodness_of_fit(sequences, probs):
    counts = {}
    for row in sequences.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= {s for s, p in probs.items() if p > 0}, "sampled a continuation of probability zero"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for seq, p in probs.items():
        if p * SAMPLES >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(p * SAMPLES)
        else:  # pool rare continuations into one bin so every bin expects >= 5
            rest_o += counts.get(seq, 0)
            rest_e += p * SAMPLES
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab_size=VOCAB, seed=4, pad_token_id=None)
    with torch.no_grad():  # a peakier target, so that drafts are accepted often
        target.lm_head.weight.mul_(40.0)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    return target, prompt, exact_distribution(target, prompt)


def test_plain_sampling_matches_the_exact_reference(setup):
    target, prompt, probs = setup
    torch.manual_seed(0)
    out = sample(target, prompt)
    assert goodness_of_fit(out, probs) > ALPHA


def sample(target, prompt, **kwargs):
    """SAMPLES continuations of `prompt`, in batches of BATCH rows."""
    chunks = [
        target.generate(prompt.repeat(BATCH, 1), max_new_tokens=NEW, **SETTINGS, **kwargs)[:, prompt.shape[1] :]
        for _ in range(SAMPLES // BATCH)
    ]
    return torch.cat(chunks)


@pytest.mark.parametrize("width,budget", [(8, 72), (2, 6)], ids=["full-tree", "partial-tree"])
def test_tree_sampling_matches_the_exact_reference(setup, width, budget):
    target, prompt, probs = setup
    torch.manual_seed(1)
    head = MarginalHead.from_target(
        target, num_hidden_layers=1, block_size=4, tree_depth=2, tree_width=width, tree_budget=budget
    ).eval()
    marginals = torch.zeros(NEW, VOCAB)
    for seq, p in probs.items():
        for d, token in enumerate(seq):
            marginals[d, token] += p
    head.marginals = marginals.clamp(min=1e-9).log()
    out = sample(target, prompt, assistant_model=head)
    assert goodness_of_fit(out, probs) > ALPHA
    # drafts were accepted at both depths, so the walk beyond the root was exercised
    assert min(head.last_stats.acceptance_per_depth) > 0.2
