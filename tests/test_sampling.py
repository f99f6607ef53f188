"""Lossless sampling: with a head, sampled continuations follow the target's own (processed) distribution.

A tiny target with an 8-token vocabulary; every 3-token continuation's exact probability is computed by
enumeration with the same logits processors `generate` applies (repetition penalty, temperature, top-k,
top-p). Several thousand continuations sampled in one batched call are compared with it by a chi-square
goodness-of-fit test at alpha = 1e-3: with a fixed seed the outcome is deterministic, and a correct sampler
would fail it for one seed in a thousand. Plain sampling goes through the same test, which checks the reference.
"""

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
from jetspec.tiny import tiny_head, tiny_target


class MarginalHead(JetSpecDraftModel):
    """Drafts, at every depth d, the target's marginal distribution of the d-th new token: often right."""

    marginals: torch.Tensor = None  # (NEW, VOCAB) log-probs

    def draft(self, input_ids, position_ids, *args, **kwargs):
        out = super().draft(input_ids, position_ids, *args, **kwargs)
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


SCORED = [[0.3, 0.2], [0.6], [0.9]]


@pytest.mark.parametrize(
    "width,budget,lookup,prior,branches",
    [
        (8, 72, 0, None, {}),
        (2, 6, 0, None, {}),
        (2, 6, 2, None, {}),
        (2, 6, 2, SCORED, {}),
        # the trie of every earlier continuation (the prompt's "1" is followed by 4 and by 5), alone and with the record
        (2, 6, 2, SCORED, {"tree_lookup_branches": "trie"}),
        (2, 6, 2, SCORED, {"tree_lookup_branches": "trie", "tree_lookup_record": True}),
    ],
    ids=[
        "full-tree",
        "partial-tree",
        "partial-tree-lookup",
        "partial-tree-scored-lookup",
        "partial-tree-trie",
        "partial-tree-trie-record",
    ],
)
def test_tree_sampling_matches_the_exact_reference(setup, width, budget, lookup, prior, branches):
    target, prompt, probs = setup
    torch.manual_seed(1)
    head = MarginalHead.from_target(
        target,
        num_hidden_layers=1,
        block_size=4,
        tree_depth=2,
        tree_width=width,
        tree_budget=budget,
        tree_lookup=lookup,
        tree_lookup_prior=prior,
        **branches,
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


RAGGED = (torch.tensor([3, 1, 4, 1, 5]), torch.tensor([2, 7]))  # two prompts of different lengths in one batch
RAGGED_SETTINGS = dict(do_sample=True, temperature=0.7, top_k=6, top_p=0.97)  # no penalty: pads stay invisible
EOS, PAD, PER_PROMPT, SCALE = 6, 0, 1600, 6.0


def exact_with_eos(target, prompt):
    """Exact probability of every continuation of up to NEW tokens that stops at EOS (then padding)."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.97)])
    probs, frontier = {}, [((), 1.0)]
    while frontier:
        prefix, p = frontier.pop()
        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])[None]
        with torch.no_grad():
            step = torch.softmax(processors(ids, target(ids).logits[:, -1].float()), dim=-1)[0].tolist()
        for token in range(VOCAB):
            seq, q = prefix + (token,), p * step[token]
            if token == EOS or len(seq) == NEW:
                probs[seq] = probs.get(seq, 0.0) + q
            elif q > 0:
                frontier.append((seq, q))
    return probs


def test_tree_sampling_at_batch_32_with_ragged_prompts_and_eos():
    """Half the rows hold one prompt and half another (left-padded); rows stop at EOS at different rounds. Each
    prompt's continuations, cut at EOS, must follow that prompt's exact distribution."""
    target = tiny_target("llama", vocab_size=VOCAB, seed=4, pad_token_id=None)
    with torch.no_grad():  # peaked enough that drafts are often accepted, flat enough for many continuations
        target.lm_head.weight.mul_(SCALE)
    exact = [exact_with_eos(target, p) for p in RAGGED]
    longest = max(len(p) for p in RAGGED)
    ids = torch.full((BATCH, longest), PAD, dtype=torch.long)
    mask = torch.zeros(BATCH, longest, dtype=torch.long)
    for row in range(BATCH):
        p = RAGGED[row % 2]
        ids[row, longest - len(p) :], mask[row, longest - len(p) :] = p, 1
    head = MarginalHead.from_target(
        target, num_hidden_layers=1, block_size=4, tree_depth=2, tree_width=3, tree_budget=8
    ).eval()
    marginals = torch.full((NEW, VOCAB), 1e-9)
    for probs in exact:  # the mixture of both prompts' marginals: often right, never exact
        for seq, p in probs.items():
            for d, token in enumerate(seq):
                marginals[d, token] += p / 2
    head.marginals = marginals.log()
    torch.manual_seed(2)
    samples = [[], []]
    stopped_early = 0
    for _ in range(2 * PER_PROMPT // BATCH):
        out = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            eos_token_id=EOS,
            pad_token_id=PAD,
            assistant_model=head,
            **RAGGED_SETTINGS,
        )[:, longest:]
        for row, seq in enumerate(out.tolist()):
            cut = seq.index(EOS) + 1 if EOS in seq else len(seq)
            assert all(t == PAD for t in seq[cut:]), "tokens after EOS must be padding"
            stopped_early += cut < NEW
            samples[row % 2].append(tuple(seq[:cut]))
    assert stopped_early > 0.1 * 2 * PER_PROMPT, "the test needs rows that stop at EOS before the others"
    for probs, drawn in zip(exact, samples):
        counts = {}
        for seq in drawn:
            counts[seq] = counts.get(seq, 0) + 1
        assert set(counts) <= {s for s, p in probs.items() if p > 0}, "sampled a continuation of probability zero"
        keys = [s for s, p in probs.items() if p * len(drawn) >= 5]
        rest = [s for s in probs if s not in keys]
        observed = [counts.get(s, 0) for s in keys] + [sum(counts.get(s, 0) for s in rest)]
        expected = [probs[s] * len(drawn) for s in keys] + [sum(probs[s] for s in rest) * len(drawn)]
        if expected[-1] < 5:  # pool a too small remainder into the last bin
            observed[-2:], expected[-2:] = [sum(observed[-2:])], [sum(expected[-2:])]
        scale = sum(observed) / sum(expected)
        assert chisquare(observed, [e * scale for e in expected]).pvalue > ALPHA
    assert min(head.last_stats.acceptance_per_depth) > 0.1


def test_sampling_with_top_k_1_equals_plain_at_batch_3():
    # do_sample with top_k=1 draws the argmax: the sampling path (processors, multinomial, sample-then-match)
    # must then return plain generate's tokens exactly, with ragged prompts and rows stopping at EOS
    from jetspec.tiny import oracle_head, prompts

    target = tiny_target("llama")
    ids, mask = prompts(3)
    kwargs = dict(do_sample=True, top_k=1, max_new_tokens=24)
    free = target.generate(input_ids=ids, attention_mask=mask, **kwargs)
    eos = int(free[0, ids.shape[1] + 6])
    plain = target.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kwargs)
    head = oracle_head(target, free, mask, mode="sometimes", tree_depth=4, tree_budget=16)
    tree = target.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, assistant_model=head, **kwargs)
    assert torch.equal(tree, plain)
    assert (plain[:, ids.shape[1] :] == eos).any(dim=1).sum() >= 1
    assert head.last_stats.tau > 1.5


def test_num_return_sequences_rows_are_expanded_as_in_plain_generate():
    # generate expands each prompt to num_return_sequences rows before the tree loop sees them; top_k=1 makes the
    # samples deterministic, so the expanded batch must match plain generate row for row
    from jetspec.tiny import prompts

    target = tiny_target("llama")
    ids, mask = prompts(2)
    kwargs = dict(do_sample=True, top_k=1, max_new_tokens=10, num_return_sequences=2)
    plain = target.generate(input_ids=ids, attention_mask=mask, **kwargs)
    tree = target.generate(input_ids=ids, attention_mask=mask, assistant_model=tiny_head(target), **kwargs)
    assert tree.shape[0] == 4 and torch.equal(tree, plain)
