"""Host reads of device tensors per round: what makes a GPU wait (`jetspec.host_reads`, counted on the CPU).

A read (`.tolist()`, `bool(t)`, a synchronize, ...) drains the launch queue, so a round that reads more than it
must leaves the accelerator idle while Python runs. The round reads twice whatever the batch and however many
tokens it accepts: the draft's candidates (to build the trees) and the commit's acceptance (counts, nodes, tokens
and the device-judged stops). Reads inside the rounds are counted apart from the call's own (the prompt, the pad
token, transformers' checks in `generate`), which happen once per call.
"""

import pytest
import torch
from jetspec.tiny import oracle_head, prompts, tiny_target
from transformers import StoppingCriteria, StoppingCriteriaList

import modeling_jetspec.decode as decode
from jetspec.host_reads import HostReadCounter
from modeling_jetspec import JetSpecDraftModel

LENGTHS = (9, 5, 13, 7)
ROUND_BOUND = {1: 2, 4: 3}  # the bound: 2 reads per round at batch 1, 3 at any batch


def test_the_counter_counts_every_kind_of_read():
    x = torch.arange(6.0)
    with HostReadCounter() as reads:
        x[0].item(), x.tolist(), bool(x[1]), int(x[2]), float(x[3])
        assert [0, 1, 2][torch.tensor(1)] == 1  # a tensor as an index
        x.cpu(), x.to("cpu"), torch.equal(x, x)
        x.nonzero(), x[x > 2], torch.where(x > 1)
        x[x > 4] = 0.0  # an assignment through a boolean mask reads how many it selects
        torch.accelerator.synchronize()
        assert torch.accelerator.is_available()  # pretended, so code that syncs only on an accelerator shows it
        # (e) none of these reads the values: device-side math, moves to a tensor's own device, dtype casts
        y = (x + 1).argmax(-1)
        x.to(y.device), x.to(torch.float64), x[torch.tensor([0, 2])], torch.where(x > 1, x, y)
    assert reads.counts == {
        "item": 1,
        "tolist": 1,
        "bool": 1,
        "int": 1,
        "float": 1,
        "index": 1,
        "cpu": 2,
        "compare": 1,
        "nonzero": 2,
        "mask_index": 2,
        "synchronize": 1,
    }
    assert reads.total == 14
    assert all(site.startswith("tests/test_host_reads.py:") for _, site in reads.sites)  # the reading line


class RoundReads:
    """Reads inside `decode._round` (per round) and outside it (per call), counted apart."""

    def __init__(self, monkeypatch, oracle=None):
        self.rounds, self.call = HostReadCounter(), HostReadCounter()
        original = decode._round

        def counted(*args, **kwargs):
            with self.call.paused(), self.rounds:
                return original(*args, **kwargs)

        monkeypatch.setattr(decode, "_round", counted)
        if oracle is not None:  # a test oracle's own reads are not the round's: its draft forward is not counted
            draft = oracle.draft

            def quiet_draft(*args, **kwargs):
                with self.rounds.paused():
                    return draft(*args, **kwargs)

            monkeypatch.setattr(oracle, "draft", quiet_draft)

    def generate(self, target, ids, mask, **kwargs):
        """A counted call, after one uncounted call of the same shapes: the first verify of a shape on a host probes
        its linear forms (`modeling_jetspec.linear_forms`, timed with synchronizes, then cached per host), a one-off
        that is no round's read; without the warm-up the count would depend on which tests ran before."""
        with torch.no_grad():
            target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)
        for counter in (self.rounds, self.call):
            counter.counts.clear(), counter.sites.clear()
        with torch.no_grad(), self.call:
            return target.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True, **kwargs
            )


def defaults_pair():
    target = tiny_target("llama")
    torch.manual_seed(1)
    return target, JetSpecDraftModel.from_target(target).eval()  # the head's defaults: depth 7, width 4, budget 32


@pytest.mark.parametrize("batch", [1, 4])
def test_a_round_reads_at_most_twice_at_the_defaults(batch, monkeypatch):
    target, head = defaults_pair()
    ids, mask = prompts(batch, lengths=LENGTHS[:batch])
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    reads = RoundReads(monkeypatch)
    out = reads.generate(target, ids, mask, max_new_tokens=24, assistant_model=head)
    assert torch.equal(out.sequences, plain)
    rounds = out.jetspec_stats.rounds
    assert rounds >= 10
    per_round = reads.rounds.total / rounds
    assert per_round <= ROUND_BOUND[batch], reads.rounds.breakdown(rounds)
    assert reads.rounds.counts == {"tolist": 2 * rounds}  # the draft's candidates, the commit's acceptance
    assert reads.call.total <= 10, reads.call.sites  # per call: prompt, pad token, generate's own checks


@pytest.mark.parametrize("batch", [1, 3])
def test_reads_do_not_grow_with_accepted_tokens_or_stops(batch, monkeypatch):
    """(c) an always-right drafter accepts whole paths (several tokens a round); with an EOS criterion judged on
    the device the round still reads twice, and the output is still plain greedy's."""
    target = tiny_target("llama")
    ids, mask = prompts(batch, lengths=LENGTHS[:batch])
    eos = dict(eos_token_id=7, pad_token_id=0)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, **eos)
    head = oracle_head(target, plain, mask, mode="always", tree_depth=5, tree_width=3, tree_budget=16)
    reads = RoundReads(monkeypatch, oracle=head)
    out = reads.generate(target, ids, mask, max_new_tokens=30, assistant_model=head, **eos)
    assert torch.equal(out.sequences, plain)
    stats = out.jetspec_stats
    assert stats.tau > 3.0  # several tokens committed per round
    assert reads.rounds.total == 2 * stats.rounds, reads.rounds.breakdown(stats.rounds)


def test_the_chosen_operating_point_reads_as_a_fixed_budget(monkeypatch):
    """`tree_budget="auto"` chooses its budget and sources once, before the rounds (`host_costs.py`): its rounds are
    untimed and read the device at most twice, as a fixed budget's."""
    target, head = defaults_pair()
    head.config.tau_by_budget = {"head": {4: 1.5, 8: 2.0}, "head+lookup": {6: 1.8}}
    ids, mask = prompts(2, lengths=LENGTHS[:2])
    greedy = dict(do_sample=False, assistant_model=head, tree_budget="auto")
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **greedy)  # the costs, kept on the head
    reads = RoundReads(monkeypatch)
    out = reads.generate(target, ids, mask, max_new_tokens=12, assistant_model=head, tree_budget="auto")
    assert out.jetspec_stats.operating_point["reason"] == "chosen"
    assert reads.rounds.total <= 2 * out.jetspec_stats.rounds, reads.rounds.breakdown(out.jetspec_stats.rounds)
    assert out.jetspec_stats.verify_seconds == 0.0  # untimed


def test_untimed_rounds_never_read_the_clock(monkeypatch):
    """Outside `timing.timed_rounds()` a fixed budget times nothing (no synchronize), and inside it the rounds are
    timed."""
    from modeling_jetspec.timing import timed_rounds

    target, head = defaults_pair()
    ids, mask = prompts(1)
    reads = RoundReads(monkeypatch)
    out = reads.generate(target, ids, mask, max_new_tokens=6, assistant_model=head)
    assert "synchronize" not in reads.rounds.counts and "synchronize" not in reads.call.counts
    assert out.jetspec_stats.verify_seconds == out.jetspec_stats.outside_verify_seconds == 0.0
    with timed_rounds():
        out = target.generate(
            input_ids=ids, do_sample=False, max_new_tokens=6, assistant_model=head, return_dict_in_generate=True
        )
    assert out.jetspec_stats.verify_seconds > 0.0 and out.jetspec_stats.outside_verify_seconds > 0.0


class StopAfter(StoppingCriteria):
    """A user criterion (not judged on the device): stops every row at a length."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_a_user_stopping_criterion_is_checked_after_each_token(monkeypatch):
    """(b) a criterion the loop does not know is called on each committed token's row, as before: exact, at a read
    per committed token (the price of a criterion the device cannot judge for every accepted token at once)."""
    target, head = defaults_pair()
    ids, mask = prompts(2, lengths=LENGTHS[:2])
    stop = StoppingCriteriaList([StopAfter(ids.shape[1] + 9)])
    plain = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, stopping_criteria=stop
    )
    reads = RoundReads(monkeypatch)
    out = reads.generate(target, ids, mask, max_new_tokens=20, assistant_model=head, stopping_criteria=stop)
    assert torch.equal(out.sequences, plain)
    assert reads.rounds.counts["bool"] == out.jetspec_stats.round_tokens  # one check per committed token
