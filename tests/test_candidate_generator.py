"""The head as a transformers `CandidateGenerator`, inside transformers' own `_assisted_decoding` loop (batch 1).

Lossless: transformers' loop verifies every candidate, so the output equals plain greedy `generate` for any
drafter; the oracles bracket the drafter (a: never right, every round commits only the target's bonus token;
b: always right, every round commits the whole chain plus the bonus; c: sometimes right) and the counts show the
candidates really were drafted and accepted.
"""

import pytest
import torch
from transformers import GenerationMixin, LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation import CandidateGenerator, DFlashTokenCandidateGenerator

from modeling_jetspec import (
    JetSpecCandidateGenerator,
    chain_generate,
    install_generate_hook,
    uninstall_generate_hook,
)
from jetspec.tiny import oracle_head, tiny_head, tiny_target

NEW = 24
_hooked_generate = GenerationMixin.generate  # the wrapper importing modeling_jetspec installs
_original_generate = _hooked_generate.__wrapped__


def _prompt(repeats: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (1, 9), generator=g)
    return ids.repeat(1, repeats)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["never", "always", "sometimes"])
def test_chain_in_transformers_loop_equals_greedy(arch, mode):
    target = tiny_target(arch)
    ids = _prompt()
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    head = oracle_head(target, plain, torch.ones_like(plain), mode=mode)
    out = target.generate(
        ids, max_new_tokens=NEW, do_sample=False, custom_generate=chain_generate, jetspec_head=head, jetspec_lookup=0
    )
    assert torch.equal(out, plain)
    rounds = head.last_candidate_generator.sources
    accepted = sum(a for _, _, a in rounds)
    # every round commits its accepted candidates plus the bonus; the prefill's token comes first
    assert 1 + sum(a + 1 for _, _, a in rounds) == NEW
    if mode == "never":
        assert accepted == 0
    elif mode == "always":  # (b) depth 4: every full round commits 4 candidates + the bonus
        assert all(a == proposed for _, proposed, a in rounds)
        assert len(rounds) == -(-(NEW - 1) // 5)
    else:
        assert 0 < accepted < sum(p for _, p, _ in rounds)


def test_random_head_with_processor_equals_greedy():
    target = tiny_target("llama")
    head = tiny_head(target)
    ids = _prompt(repeats=3)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, repetition_penalty=1.3)
    plain = target.generate(ids, **kwargs)
    out = target.generate(ids, **kwargs, custom_generate=chain_generate, jetspec_head=head)
    assert torch.equal(out, plain)


def test_lookup_chain_leads_where_it_is_likelier():
    """A never-right head and a prompt that repeats: the lookup chain is proposed and its tokens are accepted."""
    target = tiny_target("llama")
    ids = _prompt(repeats=4)
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    head = oracle_head(target, plain, torch.ones_like(plain), mode="never")
    out = target.generate(
        ids, max_new_tokens=NEW, do_sample=False, custom_generate=chain_generate, jetspec_head=head, jetspec_lookup=8
    )
    assert torch.equal(out, plain)
    lookup_rounds = [r for r in head.last_candidate_generator.sources if r[0] == "lookup"]
    assert lookup_rounds, "a never-right head's chain has expectation ~0, so any lookup match must lead"
    head_accepted = sum(a for s, _, a in head.last_candidate_generator.sources if s == "head")
    assert head_accepted == 0


def test_generator_interface():
    target = tiny_target("llama")
    head = tiny_head(target)
    generator = JetSpecCandidateGenerator(head, target, target.generation_config)
    assert isinstance(generator, CandidateGenerator)
    assert generator.requires_model_outputs
    assert generator.model_kwargs_overrides == {"output_hidden_states": [i + 1 for i in head.config.target_layer_ids]}
    ids = _prompt()
    # the first iteration proposes nothing: the target's prefill comes first
    same, logits = generator.get_candidates(ids, model_kwargs={}, model_outputs=None, is_first_iteration=True)
    assert torch.equal(same, ids) and logits is None
    with pytest.raises(ValueError, match="hidden_states"):
        generator.get_candidates(ids, model_kwargs={}, model_outputs=None, is_first_iteration=False)


def test_processor_sees_the_chain_so_far():
    """With processors, each candidate slot is processed with the chain drafted before it (as transformers does)."""
    target = tiny_target("llama")
    ids = _prompt()
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    head = oracle_head(target, plain, torch.ones_like(plain), mode="always")
    config = target.generation_config
    config.max_length = ids.shape[1] + NEW
    generator = JetSpecCandidateGenerator(
        head, target, config, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1e9)]), lookup=0
    )
    generator.get_candidates(ids, is_first_iteration=True)
    outputs = target(ids, output_hidden_states=True)
    chain, _ = generator.get_candidates(ids, model_outputs=outputs, is_first_iteration=False)
    drafted = chain[0, ids.shape[1] :].tolist()
    # an infinite repetition penalty forbids any token already in the prompt or the chain: no repeats
    assert len(set(drafted)) == len(drafted)
    assert not set(drafted) & set(ids[0].tolist())


def test_chain_generate_needs_a_head():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="jetspec_head"):
        target.generate(_prompt(), max_new_tokens=4, custom_generate=chain_generate)


@pytest.fixture
def unhooked():
    """transformers' own generate, unwrapped, for the test; the tree route comes back after it."""
    uninstall_generate_hook()
    try:
        yield
    finally:
        install_generate_hook()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dflash_route_unhooked_equals_greedy_and_drafts_the_heads_chain(arch, unhooked, monkeypatch):
    """transformers' own DFlash generator calls the head's forward: lossless, and its candidates are the head's
    own argmax chain (the same chain JetSpecCandidateGenerator proposes with the full vocabulary)."""
    target = tiny_target(arch)
    head = tiny_head(target)
    ids = _prompt(repeats=2)
    assert GenerationMixin.generate is not _hooked_generate
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    drafted = {"dflash": [], "jetspec": []}

    def recording(cls, name):
        original = cls.get_candidates

        def get_candidates(self, input_ids, *args, **kwargs):
            candidates, logits = original(self, input_ids, *args, **kwargs)
            drafted[name].append(candidates[0, input_ids.shape[1] :].tolist())
            return candidates, logits

        monkeypatch.setattr(cls, "get_candidates", get_candidates)

    recording(DFlashTokenCandidateGenerator, "dflash")
    recording(JetSpecCandidateGenerator, "jetspec")
    out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=head, speculation_type="dflash")
    assert torch.equal(out, plain)
    ours = target.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        custom_generate=chain_generate,
        jetspec_head=head,
        jetspec_depth=head.config.block_size - 1,
        jetspec_lookup=0,
    )
    assert torch.equal(ours, plain)
    # the first round of each proposes nothing (the target's prefill); the next ones draft block_size - 1 tokens
    full = [c for c in drafted["dflash"] if len(c) == head.config.block_size - 1]
    assert len(full) >= 3
    assert full[:3] == drafted["jetspec"][1:4]


def test_hook_round_trip_routes_heads():
    """Installed, a JetSpec assistant goes to the tree loop (its stats appear); uninstalled, to transformers'."""
    target = tiny_target("llama")
    head = tiny_head(target)
    ids = _prompt()
    head.last_stats = None
    target.generate(ids, max_new_tokens=4, assistant_model=head)
    assert head.last_stats is not None
    uninstall_generate_hook()
    try:
        head.last_stats = None
        target.generate(ids, max_new_tokens=4, assistant_model=head, speculation_type="dflash")
        assert head.last_stats is None
        uninstall_generate_hook()  # idempotent
    finally:
        install_generate_hook()
    install_generate_hook()  # idempotent: wrapped once
    assert GenerationMixin.generate.__wrapped__ is _original_generate
    target.generate(ids, max_new_tokens=4, assistant_model=head)
    assert head.last_stats is not None
