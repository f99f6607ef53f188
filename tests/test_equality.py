"""Tie-aware equality (jetspec.equality) and its use by the benchmark.

Settings:
  (a) identical outputs are `exact`;
  (b) outputs that part where the target's two best float32 logits are within the tolerance are a `tie`;
  (c) a token well below the maximum, or an output that stops where the other goes on, is a `mismatch`;
  (d) a deliberately broken verifier (it commits the target's *least* likely token as the bonus once) must make
      the benchmark fail, in float32 (bitwise) and in bfloat16 (tie-aware) alike;
  (e) a correct bfloat16 run passes the tie-aware benchmark with every prompt `exact` or `tie`.
"""

import pytest
import torch
from test_bench import char_tokenizer, tiny_pair

import modeling_jetspec.decode as decode
from jetspec.bench import BenchConfig, run_benchmark
from jetspec.equality import DEFAULT_TIE_TOLERANCE, LosslessError, check_lossless, classify_outputs, float32_logits_fn


def logits_with(values: dict, vocab: int = 10):
    """A stand-in for the target's float32 logits: `values` at their ids, -5 elsewhere; records the prefixes."""
    seen = []

    def fn(ids):
        seen.append(ids)
        logits = torch.full((vocab,), -5.0)
        for token, value in values.items():
            logits[token] = value
        return logits

    return fn, seen


PROMPT = torch.tensor([1, 2, 3])


def test_identical_outputs_are_exact():  # (a)
    fn, seen = logits_with({})
    verdict = classify_outputs(fn, PROMPT, torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6]))
    assert verdict.kind == "exact" and verdict.position is None and seen == []  # nothing recomputed


def test_a_divergence_between_near_equal_logits_is_a_tie():  # (b)
    fn, seen = logits_with({7: 3.0, 8: 3.0 - DEFAULT_TIE_TOLERANCE / 2})
    verdict = classify_outputs(fn, PROMPT, torch.tensor([4, 7, 9]), torch.tensor([4, 8, 2]))
    assert verdict.kind == "tie" and verdict.position == 1
    assert (verdict.reference_token, verdict.candidate_token) == (7, 8)
    assert verdict.gap == pytest.approx(DEFAULT_TIE_TOLERANCE / 2)
    assert torch.equal(seen[0], torch.tensor([[1, 2, 3, 4]]))  # logits of the shared prefix only


@pytest.mark.parametrize(
    "reference,candidate,values",
    [
        ([4, 7], [4, 8], {7: 3.0, 8: 1.0}),  # the candidate's token is 2 logits below the maximum
        ([4, 7], [4, 8], {7: 1.0, 8: 1.0, 9: 3.0}),  # both tied with each other, but neither is the target's choice
        ([4, 7], [4], {7: 3.0}),  # the candidate stops where plain greedy goes on
    ],
    ids=["far-below", "tied-but-not-top", "stops-early"],
)
def test_anything_else_is_a_mismatch(reference, candidate, values):  # (c)
    fn, _ = logits_with(values)
    verdict = classify_outputs(fn, PROMPT, torch.tensor(reference), torch.tensor(candidate))
    assert verdict.kind == "mismatch" and verdict.position == 1


def test_negative_tolerance_is_refused():
    fn, _ = logits_with({})
    with pytest.raises(ValueError, match="tie tolerance >= 0, got -1"):
        classify_outputs(fn, PROMPT, torch.tensor([1]), torch.tensor([2]), tolerance=-1)


def test_check_lossless_holds_float32_to_bitwise_equality():  # (c) in float32 even a tie fails
    fn, seen = logits_with({7: 3.0, 8: 3.0})
    assert check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 7]), torch.float32).kind == "exact"
    with pytest.raises(LosslessError, match=r"label to reproduce .*float32, bitwise.*new token 1 \(\[8\] vs plain \[7\]"):
        check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 8]), torch.float32, fn, label="label")
    assert seen == []  # no float32 logits needed to judge a float32 output


def test_check_lossless_lets_half_precision_ties_pass_and_fails_the_rest():  # (b), (c)
    tied, _ = logits_with({7: 3.0, 8: 3.0 - DEFAULT_TIE_TOLERANCE / 2})
    verdict = check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 8]), torch.bfloat16, tied)
    assert (verdict.kind, verdict.position) == ("tie", 1)
    far, _ = logits_with({7: 3.0, 8: 1.0})
    with pytest.raises(LosslessError, match="up to numerical ties.*no tie: float32 logit gap 2.000 > tolerance 0.5"):
        check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 8]), torch.bfloat16, far)
    with pytest.raises(ValueError, match="float32 logits_fn to judge ties of a torch.bfloat16 target, got None"):
        check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 7]), torch.bfloat16)


def broken_accept(monkeypatch):
    """Once, the round commits the target's least likely token after the accepted path instead of its choice."""
    original = decode.accept
    state = {"broken": False}

    def accept(logits, *args, **kwargs):  # logits of shape (A, n + 1, V): every node's next-token scores
        acc = original(logits, *args, **kwargs)
        if not state["broken"] and int(acc.count[0]) >= 1:
            last = int(acc.count[0]) - 1
            node = int(acc.nodes[0, last])
            acc.tokens[0, last] = logits[0, node].argmin()
            state["broken"] = True
        return acc

    monkeypatch.setattr(decode, "accept", accept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_broken_verifier_fails_the_benchmark(monkeypatch, tmp_path, dtype):  # (d)
    target, head = tiny_pair()
    reference = float32_logits_fn(lambda: tiny_pair()[0])  # the same seeded weights, in float32
    target, head = target.to(dtype), head.to(dtype)
    broken_accept(monkeypatch)
    config = BenchConfig(["gsm8k"], [4], 8, limit=1, methods=("plain", "tree"), warmup=False, cost_repeats=1)
    with pytest.raises(LosslessError, match="tree-4.*bitwise" if dtype == torch.float32 else "tree-4.*no tie"):
        run_benchmark(target, char_tokenizer(), head, config, tmp_path, float32_logits=reference, progress=False)


def test_a_correct_bfloat16_run_passes_with_exact_or_tie(tmp_path):  # (e)
    target, head = tiny_pair()
    reference = float32_logits_fn(lambda: tiny_pair()[0])
    target, head = target.to(torch.bfloat16), head.to(torch.bfloat16)
    config = BenchConfig(["gsm8k", "mtbench"], [4, 12], 12, limit=2, methods=("plain", "chain", "tree"),
                         warmup=False, cost_repeats=1)
    results = run_benchmark(target, char_tokenizer(), head, config, tmp_path, float32_logits=reference,
                            progress=False)
    assert results["config"]["equality"].startswith("tie-aware")
    for name, figures in results["aggregates"]["all"].items():
        counts = figures["equality"]
        assert counts["mismatch"] == 0 and counts["exact"] + counts["tie"] == figures["prompts"] == 4, name


def test_a_bfloat16_benchmark_needs_the_float32_reference(tmp_path):
    target, head = tiny_pair()
    config = BenchConfig(["gsm8k"], [4], 4, limit=1, methods=("plain", "tree"), warmup=False, cost_repeats=1)
    with pytest.raises(ValueError, match="expected float32_logits"):
        run_benchmark(target.to(torch.bfloat16), char_tokenizer(), head.to(torch.bfloat16), config, tmp_path,
                      progress=False)
