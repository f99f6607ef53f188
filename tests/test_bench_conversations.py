"""MT-Bench's second turns in the benchmark (`jetspec bench --suite mtbench_turn2`, `jetspec.bench_conversations`),
on a tiny random target with the character tokenizer of `test_bench`.

Checked from outside, on every outer `generate` call the bench makes: each conversation's turn 2 is decoded on a chat
that holds plain greedy's answer 1 as tokens; the `answers` method's cache holds that method's answer 1 when its turn
2 call starts; the rows' figures are turn 2's calls' and their `turn1` records turn 1's; every output equals plain
greedy's (float32). Bracketing it: a wrong token in turn 1 fails the run naming turn 1, and a method whose answer 1
left plain greedy's at a tie (as bfloat16 may) still decodes turn 2 on plain greedy's answer 1, the difference
recorded.
"""

import pytest
import torch

from jetspec.bench import BenchConfig, run_benchmark
from jetspec.bench_conversations import conversation_turns
from jetspec.cli import parse_suites
from jetspec.equality import Verdict, first_difference
from jetspec.prompts import load_conversations, load_suite
from modeling_jetspec import JetSpecDraftModel

from test_bench import char_tokenizer, spy_generate, tiny_pair

MAX_NEW = 10  # the warm-up calls run 8 tokens: the timed calls are those with 10
SUITES = ["mtbench_turn2", "gsm8k"]  # a conversation set first: the warm-up and the costs run on its turn 1
LIMIT = 2
METHODS = ["plain", "tree-4", "answers"]
IM_START, IM_END = 2, 3  # the character tokenizer's chat markers
LETTER_Z = 4 + 1 + ord("Z") - 32  # its ids: 4 specials, the newline, then the printable characters from " "


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One bench over 2 conversations and 2 GSM8K prompts, methods plain, tree-4 and answers, calls recorded."""
    monkeypatch = pytest.MonkeyPatch()
    target, head = tiny_pair()
    calls = spy_generate(monkeypatch, target)
    out = tmp_path_factory.mktemp("bench")
    config = BenchConfig(SUITES, [4], MAX_NEW, limit=LIMIT, methods=["plain", "tree", "answers"], cost_repeats=1)
    results = run_benchmark(target, char_tokenizer(), head, config, out, command="pytest", progress=False)
    monkeypatch.undo()
    return results, calls, out


def turns_of(calls) -> list[list[dict]]:
    """The timed calls, one group of `len(METHODS)` per prompt and turn, in the bench's order: conversation 1's turn
    1, its turn 2, conversation 2's turn 1, ..., then the GSM8K prompts."""
    timed = [c for c in calls if len(c["tokens"]) == MAX_NEW]
    assert len(timed) == len(METHODS) * LIMIT * 3  # 2 turns per conversation, 1 per GSM8K prompt
    return [timed[i : i + len(METHODS)] for i in range(0, len(timed), len(METHODS))]


def by_method(group: list[dict]) -> dict:
    """A turn's calls by method: plain has no head, answers has a cache, tree-4 neither."""
    named = {}
    for call in group:
        named["plain" if not call["assisted"] else "answers" if call["cache"] is not None else "tree-4"] = call
    assert len(named) == len(METHODS)
    return named


def test_turn_2_holds_answer_1_and_every_method_reproduces_plain_greedy(run):
    """(a) Turn 1 is the user's first turn in the chat template; (b) turn 2 opens with turn 1's prompt, then plain
    greedy's answer 1 as tokens (the end of turn and tokens outside the tokenizer's vocabulary are no text), then
    the end of turn and the user's turn 2; (c) on each turn every method's tokens equal plain greedy's."""
    _, calls, _ = run
    tokenizer = char_tokenizer()
    groups = turns_of(calls)
    for conversation, (first, second) in zip(
        load_conversations("mtbench_turn2", LIMIT), zip(groups[0::2], groups[1::2])
    ):
        turn1, turn2 = conversation_turns(conversation)
        prompt1 = list(first[0]["prompt"])
        assert all(list(c["prompt"]) == prompt1 for c in first)
        assert prompt1 == tokenizer(f"<|im_start|>user\n{turn1}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        plain1 = by_method(first)["plain"]["tokens"]
        text = [t for t in plain1 if t > IM_END and t < len(tokenizer)]  # characters only
        assert len(text) >= MAX_NEW // 2  # a random target answers mostly characters: the check below has teeth
        prompt2 = list(second[0]["prompt"])
        assert all(list(c["prompt"]) == prompt2 for c in second)  # one turn-2 prompt for every method
        assert prompt2[: len(prompt1)] == prompt1
        answer = prompt2[len(prompt1) : len(prompt1) + len(text) + 2]
        stripped = tokenizer.decode(text).strip()
        assert tokenizer.decode(answer).startswith(stripped + "<|im_end|>")
        assert tokenizer.decode(prompt2[len(prompt1) :]).endswith(
            f"<|im_end|>\n<|im_start|>user\n{turn2}<|im_end|>\n<|im_start|>assistant\n"
        )
        for group in (first, second):
            plain = by_method(group)["plain"]["tokens"]
            assert all(c["tokens"] == plain for c in group)


def test_the_answer_cache_holds_answer_1_when_turn_2_starts(run):
    """The `answers` method decodes turn 1 itself, so its cache holds that answer as its turn 2 starts (the measured
    situation: an earlier answer proposing continuations), and did not before turn 1."""
    _, calls, _ = run
    groups = turns_of(calls)
    for first, second in zip(groups[0 : 2 * LIMIT : 2], groups[1 : 2 * LIMIT : 2]):
        answer1 = by_method(first)["answers"]["tokens"]
        assert answer1 not in by_method(first)["answers"]["held"]
        assert by_method(second)["answers"]["held"][-1] == answer1
        assert by_method(second)["answers"]["cache"] is by_method(first)["answers"]["cache"]
        assert by_method(second)["tree-4"]["cache"] is None


def test_the_figures_are_turn_2s_and_turn_1s_are_recorded(run):
    """Each conversation row is turn 2's call (its prompt, tokens and statistics), its `turn1` turn 1's; speedups
    are each turn's own over plain greedy on that turn; the suite's aggregates and results.md follow."""
    results, calls, out = run
    groups = turns_of(calls)
    rows = [r for r in results["prompts"] if r["suite"] == "mtbench_turn2"]
    assert [r["method"] for r in rows] == METHODS * LIMIT
    for i, conversation in enumerate(load_conversations("mtbench_turn2", LIMIT)):
        mine = {r["method"]: r for r in rows[i * len(METHODS) : (i + 1) * len(METHODS)]}
        first, second = by_method(groups[2 * i]), by_method(groups[2 * i + 1])
        for name, row in mine.items():
            assert row["prompt_id"] == conversation["id"] and row["equality"] == "exact"
            assert row["prompt_tokens"] == len(second[name]["prompt"]) > len(first[name]["prompt"])
            assert row["turn1"]["prompt_tokens"] == len(first[name]["prompt"])
            assert row["turn1"]["equality"] == "exact" and row["turn1"]["answer_differs_from_plain"] is False
            for record, plain in ((row, mine["plain"]), (row["turn1"], mine["plain"]["turn1"])):
                assert record["speedup"] == pytest.approx(record["tokens_per_s"] / plain["tokens_per_s"])
            if name != "plain":
                assert row["tau"] == second[name]["stats"].tau and row["rounds"] == second[name]["stats"].rounds
                assert row["turn1"]["tau"] == first[name]["stats"].tau
    assert all("turn1" not in r for r in results["prompts"] if r["suite"] == "gsm8k")
    figures = results["aggregates"]["mtbench_turn2"]["answers"]
    answers = [r for r in rows if r["method"] == "answers"]
    assert figures["tau_mean"] == pytest.approx(sum(r["tau"] for r in answers) / LIMIT)
    assert figures["turn1"]["tau_mean"] == pytest.approx(sum(r["turn1"]["tau"] for r in answers) / LIMIT)
    assert figures["turn1"]["answers_differing_from_plain"] == 0
    assert "turn1" not in results["aggregates"]["gsm8k"]["answers"]
    assert set(results["aggregates"]) == {"mtbench_turn2", "gsm8k", "all"}
    report = (out / "results.md").read_text()
    table = report.split("## mtbench_turn2: first turns")[1]
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][2:] == METHODS
    assert "## gsm8k: first turns" not in report


def test_an_answer_1_left_at_a_tie_still_gives_turn_2_plain_greedys_answer(monkeypatch, tmp_path):
    """(a) The head's turn-1 answer leaves plain greedy's at its last token, and (b) the equality rule is stubbed to
    call any divergence a tie, as bfloat16's rule does at a numerical tie: turn 2's chat still holds plain greedy's
    answer 1 for the head's method too, and the row records that its own answer differed."""
    import jetspec.bench

    target, head = tiny_pair()
    calls = spy_generate(monkeypatch, target)
    original = JetSpecDraftModel.tree_generate

    def turn_1_differs(self, model, **kwargs):
        out = original(self, model, **kwargs)
        if (kwargs["input_ids"] == IM_START).sum() == 2:  # turn 1: a user header and the assistant's
            last = out.sequences[0, -1].item()
            out.sequences[:, -1] = LETTER_Z + 1 if last == LETTER_Z else LETTER_Z  # a character: the text differs
        return out

    def divergence_is_a_tie(prompt, reference, candidate, *args, **kwargs):
        at = first_difference(reference, candidate)
        return Verdict("exact") if at is None else Verdict("tie", at, int(reference[at]), int(candidate[at]), 0.0)

    monkeypatch.setattr(JetSpecDraftModel, "tree_generate", turn_1_differs)
    monkeypatch.setattr(jetspec.bench, "check_lossless", divergence_is_a_tie)
    config = BenchConfig(["mtbench_turn2"], [4], 6, limit=1, methods=("plain", "tree"), warmup=False, cost_repeats=1)
    results = run_benchmark(target, char_tokenizer(), head, config, tmp_path, progress=False)
    (plain1, tree1), (plain2, tree2) = sorted(calls[:2], key=lambda c: c["assisted"]), calls[2:]
    tokenizer = char_tokenizer()
    answers = [tokenizer.decode(c["tokens"], skip_special_tokens=True).strip() for c in (plain1, tree1)]
    assert answers[0] != answers[1]  # (a) took effect, on the text
    assert plain2["prompt"] == tree2["prompt"]  # both turn 2s decode plain greedy's answer 1
    assert f"assistant\n{answers[0]}<|im_end|>" in tokenizer.decode(list(plain2["prompt"]))
    assert torch.equal(torch.tensor(plain2["tokens"]), torch.tensor(tree2["tokens"]))
    rows = {r["method"]: r for r in results["prompts"]}
    assert rows["tree-4"]["turn1"]["answer_differs_from_plain"] is True and rows["tree-4"]["turn1"]["equality"] == "tie"
    assert rows["plain"]["turn1"]["answer_differs_from_plain"] is False
    assert rows["tree-4"]["equality"] == "exact"
    assert results["aggregates"]["mtbench_turn2"]["tree-4"]["turn1"]["answers_differing_from_plain"] == 1


def test_suites_name_conversations_and_refuse_unknown_names():
    """The bench takes conversation sets beside prompt suites; an unknown name is refused naming every valid one, a
    conversation of another shape naming the conversation."""
    assert BenchConfig(["mtbench_turn2", "gsm8k"], [4]).suites == ["mtbench_turn2", "gsm8k"]
    assert parse_suites("mtbench,mtbench_turn2") == ["mtbench", "mtbench_turn2"]
    valid = "expected one of gsm8k, humaneval, mtbench, repeated, mtbench_turn2"
    with pytest.raises(ValueError, match=f"unknown suite 'mtbench_turn3': {valid}"):
        BenchConfig(["mtbench_turn3"], [4])
    with pytest.raises(ValueError, match=f"unknown suite 'turn2': {valid}"):
        parse_suites("mtbench,turn2")
    assert load_suite("mtbench_turn2", 1)[0]["turns"] == load_conversations("mtbench_turn2", 1)[0]["turns"]
    assert load_suite("gsm8k", 1)[0]["prompt"]
    with pytest.raises(ValueError, match="expected a conversation of 2 user turns .* in conversation 7"):
        conversation_turns({"id": 7, "turns": ["one", "two", "three"]})
