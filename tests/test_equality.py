"""Tie-aware equality (jetspec.equality) and its use by the benchmark.

Settings:
  (a) identical outputs are `exact`;
  (b) outputs that part where the target's two best float32 logits are within the tolerance are a `tie`;
  (c) a token well below the maximum, or an output that stops where the other goes on, is a `mismatch`;
  (d) a deliberately broken verifier (it commits the target's *least* likely token as the bonus once) must make
      the benchmark fail, in float32 (bitwise) and in bfloat16 (tie-aware) alike;
  (e) a correct bfloat16 run passes the tie-aware benchmark with every prompt `exact` or `tie`;
  (f) every emitted token judged on its own prefix: a wrong token planted *after* a tie fails (the first-divergence
      rule alone passes it), a correct output with ties passes and counts them, plain greedy's own output is
      judged and counted alike, and in the benchmark a planted wrong token after a tie fails the run.
"""

import pytest
import torch
from test_bench import char_tokenizer, tiny_pair

import modeling_jetspec.decode as decode
from jetspec.bench import BenchConfig, run_benchmark
from jetspec.bench import Bench
from jetspec.equality import (
    DEFAULT_TIE_TOLERANCE,
    LosslessError,
    check_lossless,
    classify_outputs,
    float32_logits_fn,
    judge_tokens,
    teacher_forced_logits,
)


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
    with pytest.raises(
        LosslessError, match=r"label to reproduce .*float32, bitwise.*new token 1 \(\[8\] vs plain \[7\]"
    ):
        check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 8]), torch.float32, fn, label="label")
    assert seen == []  # no float32 logits needed to judge a float32 output


def test_check_lossless_lets_half_precision_ties_pass_and_fails_the_rest():  # (b), (c)
    # the same logits after every prefix: 4 and 7 on top, 8 within the tolerance
    tied, _ = logits_with({4: 3.0, 7: 3.0, 8: 3.0 - DEFAULT_TIE_TOLERANCE / 2})
    verdict = check_lossless(PROMPT, torch.tensor([4, 7]), torch.tensor([4, 8]), torch.bfloat16, tied)
    assert (verdict.kind, verdict.position) == ("tie", 1)
    assert (verdict.judged.tokens, verdict.judged.violations) == (2, 0)
    far, _ = logits_with({4: 3.0, 7: 3.0, 8: 1.0})
    with pytest.raises(
        LosslessError,
        match="every token of the output within 0.5 .*got 1 of 2 beyond it; the first "
        r"at new token 1 \(\[8\]\): float32 logit gap 2.000 > tolerance 0.5",
    ):
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
            if acc.host is not None:  # chosen on the host (a CPU): what commit reads
                acc.host[0][1][last] = int(acc.tokens[0, last])
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
    with pytest.raises(
        LosslessError, match="tree-4.*bitwise" if dtype == torch.float32 else "tree-4.*(no tie|beyond it)"
    ):
        run_benchmark(target, char_tokenizer(), head, config, tmp_path, float32_logits=reference, progress=False)


def test_a_correct_bfloat16_run_passes_with_exact_or_tie(tmp_path):  # (e)
    target, head = tiny_pair()
    reference = float32_logits_fn(lambda: tiny_pair()[0])
    target, head = target.to(torch.bfloat16), head.to(torch.bfloat16)
    config = BenchConfig(
        ["gsm8k", "mtbench"], [4, 12], 12, limit=2, methods=("plain", "chain", "tree"), warmup=False, cost_repeats=1
    )
    results = run_benchmark(target, char_tokenizer(), head, config, tmp_path, float32_logits=reference, progress=False)
    assert results["config"]["equality"].startswith("tie-aware")
    for name, figures in results["aggregates"]["all"].items():
        counts = figures["equality"]
        assert counts["mismatch"] == 0 and counts["exact"] + counts["tie"] == figures["prompts"] == 4, name


def test_a_bfloat16_benchmark_needs_the_float32_reference(tmp_path):
    target, head = tiny_pair()
    config = BenchConfig(["gsm8k"], [4], 4, limit=1, methods=("plain", "tree"), warmup=False, cost_repeats=1)
    with pytest.raises(ValueError, match="expected float32_logits"):
        run_benchmark(
            target.to(torch.bfloat16), char_tokenizer(), head.to(torch.bfloat16), config, tmp_path, progress=False
        )


# ------------------------------------------------------------------------------------------------ every token judged
def next_token_table(table: dict, vocab: int = 10):
    """A stand-in whose float32 logits depend on the prefix's last token: `table[last] = {token: logit}`, -5
    elsewhere."""

    def fn(ids):
        logits = torch.full((vocab,), -5.0)
        for token, value in table.get(int(ids[0, -1]), {}).items():
            logits[token] = value
        return logits

    return fn


# after the prompt (…3): 4; after 4: 7, with 8 tied; after 7: 9; after 8: 2, 5 far below; after 2: 6
TABLE = {3: {4: 3.0}, 4: {7: 3.0, 8: 2.8}, 7: {9: 3.0}, 8: {2: 3.0, 5: 0.0}, 2: {6: 3.0}, 9: {6: 3.0}}
PLAIN = torch.tensor([4, 7, 9, 6])


def test_a_wrong_token_after_a_tie_fails():  # (f)
    fn = next_token_table(TABLE)
    planted = torch.tensor([4, 8, 5, 6])  # a tie at new token 1, then a token 3 logits below the maximum
    assert classify_outputs(fn, PROMPT, PLAIN, planted).kind == "tie"  # the first divergence alone lets it pass
    judged = judge_tokens(fn, PROMPT, planted)
    assert (judged.tokens, judged.near_ties, judged.violations, judged.first_violation) == (4, 1, 1, 2)
    assert judged.violation_gap == pytest.approx(3.0)
    with pytest.raises(
        LosslessError,
        match=r"got 1 of 4 beyond it; the first at new token 2 \(\[5, 6\]\): float32 "
        "logit gap 3.000 > tolerance 0.5",
    ):
        check_lossless(PROMPT, PLAIN, planted, torch.bfloat16, fn, label="planted")


def test_a_correct_output_with_ties_passes_and_counts_them():  # (f)
    fn = next_token_table(TABLE)
    verdict = check_lossless(PROMPT, PLAIN, torch.tensor([4, 8, 2, 6]), torch.bfloat16, fn)
    assert (verdict.kind, verdict.position, verdict.gap) == ("tie", 1, pytest.approx(0.2))
    assert (verdict.judged.tokens, verdict.judged.near_ties, verdict.judged.violations) == (4, 1, 0)
    assert verdict.judged.max_gap == pytest.approx(0.2)
    # the tolerance decides: at 0.1 the tie itself is a violation
    with pytest.raises(LosslessError, match="new token 1 .* gap 0.200 > tolerance 0.1"):
        check_lossless(PROMPT, PLAIN, torch.tensor([4, 8, 2, 6]), torch.bfloat16, fn, tolerance=0.1)


def test_plain_greedy_is_judged_the_same_way():  # (f)
    fn = next_token_table(TABLE)
    bf16_plain = torch.tensor([4, 8, 2, 6])  # plain greedy in bf16 took the near-tie itself
    verdict = check_lossless(PROMPT, bf16_plain, bf16_plain, torch.bfloat16, fn)
    assert verdict.kind == "exact" and (verdict.judged.tokens, verdict.judged.near_ties) == (4, 1)
    broken_plain = torch.tensor([4, 8, 5, 6])
    with pytest.raises(LosslessError, match="plain greedy.*new token 2"):
        check_lossless(PROMPT, broken_plain, broken_plain, torch.bfloat16, fn, label="plain greedy")
    # float32 keeps its bitwise rule: nothing judged token by token, no float32 logits read
    assert check_lossless(PROMPT, bf16_plain, bf16_plain, torch.float32).judged is None


def test_a_shared_output_is_teacher_forced_once():
    calls = []
    fn = next_token_table(TABLE)

    def counted(ids):
        calls.append(ids.shape[1])
        return fn(ids)

    memo = {}
    for _ in range(3):
        check_lossless(PROMPT, PLAIN, torch.tensor([4, 8, 2, 6]), torch.bfloat16, counted, memo=memo)
    assert calls == [3, 4, 5, 6]  # one prefix per emitted token, once


def test_one_teacher_forced_forward_gives_every_prefix_logits():
    """The float32 reference's one forward over prompt + output equals its logits prefix by prefix."""
    target = tiny_pair()[0]
    reference = float32_logits_fn(lambda: target)
    prompt, output = torch.tensor([5, 9, 14, 3]), torch.tensor([7, 7, 21, 2, 40])
    rows = teacher_forced_logits(reference, prompt, output)
    one_by_one = teacher_forced_logits(lambda ids: reference(ids), prompt, output)  # no last_rows: per prefix
    assert rows.shape == (5, target.config.vocab_size) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, one_by_one, rtol=1e-4, atol=1e-4)


def crafted_output(model, prompt: torch.Tensor, length: int, tie_at: int, plant_at=None):
    """float32 greedy of `model` for `length` tokens, but the runner-up at `tie_at` (then greedy from there on),
    and, when `plant_at` is given, the least likely token there: `(tokens, runner-up's gap, planted token's gap)`."""
    ids, gaps = prompt.clone(), {}
    for i in range(length):
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, -1].float()
        order = logits.argsort(descending=True)
        token = order[1] if i == tie_at else order[-1] if i == plant_at else order[0]
        gaps[i] = float(logits.max() - logits[token])
        ids = torch.cat([ids, token[None]])
    return ids[len(prompt) :], gaps[tie_at], gaps.get(plant_at)


@pytest.mark.parametrize("planted", [False, True], ids=["ties-counted", "wrong-after-tie"])
def test_the_benchmark_judges_every_token(monkeypatch, tmp_path, planted):  # (f)
    """tree-4's output is replaced by a float32-correct one with a tie at new token 1, and, planted, the least
    likely token at new token 4: the run counts the tie, or fails on the planted token."""
    fp32 = tiny_pair()[0]
    reference = float32_logits_fn(lambda: tiny_pair()[0])
    target, head = (m.to(torch.bfloat16) for m in tiny_pair())
    length, tie_at, plant_at = 8, 1, 4 if planted else None
    original = Bench.generate
    found = {}

    def generate(self, method, input_ids, attention_mask, **overrides):
        tokens, seconds, stats, phases = original(self, method, input_ids, attention_mask, **overrides)
        if method.name == "tree-4":
            tokens, tie_gap, _ = crafted_output(fp32, input_ids[0], length, tie_at)
            # a tiny random target's logits are close together: the tolerance lies between the tie's gap and the
            # least likely token's (judged after every method has run)
            self.tie_tolerance = found["tolerance"] = 1.5 * tie_gap
            if planted:
                tokens, _, found["plant_gap"] = crafted_output(fp32, input_ids[0], length, tie_at, plant_at)
        return tokens, seconds, stats, phases

    monkeypatch.setattr(Bench, "generate", generate)
    config = BenchConfig(["gsm8k"], [4], length, limit=1, methods=("plain", "tree"), warmup=False, cost_repeats=1)

    def run():
        return run_benchmark(target, char_tokenizer(), head, config, tmp_path, float32_logits=reference, progress=False)

    if planted:
        with pytest.raises(LosslessError, match="method 'tree-4'.*the first at new token 4"):
            run()
        assert found["plant_gap"] > found["tolerance"]  # the planted token is beyond the tolerance, the tie within
        return
    results = run()
    judged = results["aggregates"]["gsm8k"]
    assert judged["tree-4"]["judged"]["tokens"] == length and judged["tree-4"]["judged"]["violations"] == 0
    assert judged["tree-4"]["judged"]["near_ties"] == 1  # float32 greedy everywhere but the runner-up
    assert judged["plain"]["judged"]["tokens"] == results["prompts"][0]["new_tokens"]
    assert judged["plain"]["judged"]["violations"] == 0
    report = (tmp_path / "results.md").read_text()
    section = report.split("\n## gsm8k\n")[1].split("\n## ")[0]  # the suite's table, not the phases after it
    (line,) = [line for line in section.splitlines() if line.startswith("| tree-4 |")]
    assert f"| {length} | 1 | 0 |" in line  # judged, near-ties, violations
