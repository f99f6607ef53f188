"""The public round hook (`jetspec_round_hook`, `modeling_jetspec/round_hook.py`): one `RoundRecord` per round,
the same tokens with and without it, on the default and the static path, at batch 1 and 3.

Settings: (a) a random head (mostly one token a round); (b) the "sometimes" oracle (paths through later siblings,
several tokens a round) with an EOS that finishes rows at different rounds, so the active rows shrink.
"""

import types

import pytest
import torch

from modeling_jetspec import RoundRecord, timing
from modeling_jetspec.round_hook import PHASES
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target

PATHS = [None, "eager"]  # the default path, the static path (uncompiled)


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, **kwargs)


def decode_with_hook(target, ids, mask, head, static, **kwargs) -> tuple:
    """`(output, records)` of one call with a hook that keeps every record."""
    records = []
    extra = {"jetspec_static": static} if static else {}
    out = greedy(
        target,
        ids,
        mask,
        assistant_model=head,
        jetspec_round_hook=records.append,
        return_dict_in_generate=True,
        **extra,
        **kwargs,
    )
    return out, records


@pytest.mark.parametrize("static", PATHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_hook_changes_no_token(static, batch):  # (a)
    target = tiny_target("llama")
    ids, mask = prompts(batch)
    head = tiny_head(target, tree_lookup=4, tree_lookup_branches="trie")
    plain = greedy(target, ids, mask)
    extra = {"jetspec_static": static} if static else {}
    without = greedy(target, ids, mask, assistant_model=head, **extra)
    out, records = decode_with_hook(target, ids, mask, head, static)
    assert torch.equal(without, plain)
    assert torch.equal(out.sequences, plain)
    assert len(records) == out.jetspec_stats.rounds > 1


@pytest.mark.parametrize("static", PATHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_records_are_the_call_s_rounds(static, batch):  # (b)
    """Every record against the call's statistics (counted by `JetSpecStats.add_round`, apart from the hook): the
    rounds in order, their rows, budgets, accepted nodes, tokens and target forwards; every phase timed."""
    target = tiny_target("llama")
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask)
    eos = int(plain[0, -10])  # row 0 stops before the end; the other rows stop where the token occurs, if ever
    plain = greedy(target, ids, mask, eos_token_id=eos, pad_token_id=0)
    head = oracle_head(target, plain, mask, mode="sometimes")
    out, records = decode_with_hook(target, ids, mask, head, static, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, plain)
    stats = out.jetspec_stats
    assert all(isinstance(r, RoundRecord) for r in records)
    assert [r.index for r in records] == list(range(stats.rounds))
    assert sum(r.rows for r in records) == stats.row_rounds
    assert [r.budget for r in records] == stats.budgets == [12] * stats.rounds
    assert [r.accepted for r in records] == stats.accepted
    assert [len(r.nodes) for r in records] == [r.rows for r in records]
    assert all(1 <= n <= 12 for r in records for n in r.nodes)
    assert sum(r.tokens for r in records) == stats.round_tokens
    assert sum(r.target_forwards for r in records) == stats.target_forwards - 1  # the prefill is no round
    assert max(max(r.accepted) for r in records) > 0  # the oracle's paths were accepted
    if batch > 1:
        assert records[-1].rows < records[0].rows  # a row finished first and left
    for r in records:
        assert tuple(r.phases) == PHASES and all(seconds >= 0.0 for seconds in r.phases.values())
        assert r.seconds == pytest.approx(sum(r.phases.values()))
        assert r.outside_forwards_seconds == pytest.approx(r.seconds - r.phases["draft"] - r.phases["verify"])
    assert sum(r.phases["verify"] for r in records) == pytest.approx(stats.verify_seconds)
    outside = sum(r.seconds - r.phases["verify"] for r in records)
    assert outside == pytest.approx(stats.outside_verify_seconds)


# the static path refuses path_conditioning (its second draft pass has another shape)
@pytest.mark.parametrize("static,path_conditioning", [(None, False), (None, True), ("eager", False)])
def test_each_phase_holds_its_own_work(static, path_conditioning, monkeypatch):
    """On a clock that only the forwards advance (a target forward 1, a head forward 0.25), each round's `verify`
    phase is exactly its target forward and its `draft` phase its head forward; the rest of the round costs nothing
    on that clock. With path conditioning the second head forward rebuilds the trees: it falls in `tree`."""
    target = tiny_target("llama")
    ids, mask = prompts(2)
    head = tiny_head(target, path_conditioning=path_conditioning)
    now = [0.0]

    def advance(cost):
        def hook(module, args):
            now[0] += cost

        return hook

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    handles = [
        target.register_forward_pre_hook(advance(1.0)),
        head.layers[0].register_forward_pre_hook(advance(0.25)),  # once per head forward (one layer)
    ]
    try:
        out, records = decode_with_hook(target, ids, mask, head, static)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(out.sequences, greedy(target, ids, mask))
    for r in records:
        assert r.phases["verify"] == 1.0
        assert r.phases["draft"] == 0.25
        assert r.phases["tree"] == (0.25 if path_conditioning else 0.0)
        assert r.phases["accept"] == r.phases["commit"] == r.phases["compact"] == 0.0
        assert r.outside_forwards_seconds == r.phases["tree"]


@pytest.mark.parametrize("hook", [3, "print", [print]])
def test_a_hook_that_cannot_be_called_is_refused_before_any_forward(hook):
    target = tiny_target("llama")
    ids, mask = prompts(1)
    forwards = []
    handle = target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="expected jetspec_round_hook to be a callable"):
            greedy(target, ids, mask, assistant_model=tiny_head(target), jetspec_round_hook=hook)
    finally:
        handle.remove()
    assert forwards == []


def test_no_hook_times_nothing():
    """Without a hook (a fixed budget, outside `timing.timed_rounds()`) the rounds keep no times."""
    target = tiny_target("llama")
    ids, mask = prompts(1)
    out = greedy(target, ids, mask, assistant_model=tiny_head(target), return_dict_in_generate=True)
    assert out.jetspec_stats.verify_seconds == out.jetspec_stats.outside_verify_seconds == 0.0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_hybrid_target_s_rounds_count_their_own_forwards(mode):
    """A target with linear-attention layers (`hybrid.HybridVerifier`): its rounds may run more than one target
    forward (a chain's replay, a tree's leaf paths); each record counts its own, and the tokens stay plain greedy's."""
    from test_architectures import VOCAB
    from test_hybrid import hybrid_target

    target = hybrid_target("qwen3_5_text")
    ids, mask = prompts(3, vocab_size=VOCAB)
    head = tiny_head(target)
    out, records = decode_with_hook(target, ids, mask, head, None, tree_verify=mode)
    assert torch.equal(out.sequences, greedy(target, ids, mask))
    stats = out.jetspec_stats
    assert len(records) == stats.rounds > 1
    assert sum(r.target_forwards for r in records) == stats.target_forwards - 1
    assert max(r.target_forwards for r in records) == 2  # the verify and its replay or leaf paths: one round
    assert [r.accepted for r in records] == stats.accepted
