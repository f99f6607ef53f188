"""Continuous batching of the tree loop (`modeling_jetspec/admission.py`) and of `jetspec serve`
(`jetspec/serve_batching.py`): requests join a running call between rounds and leave it when they finish.

Tiny random float32 targets, in process. Each row's tokens are compared with its lone greedy answer (plain `generate`
of that prompt alone); a difference is allowed only at a float32 near-tie of the lone call's two top logits (within
`test_serve_batching.TIE`, checked, never assumed), where the batch's padded shapes may round the other way.

a) Decode level, on llama, qwen3 and mistral (a sliding window) targets: a call of rows A and B, a newcomer with a
   shorter prompt than the running width after round 1 and one with a longer prompt after round 3 (the running rows
   are widened then): every row gets its lone answer, its statistics those of its own rounds.
b) A newcomer that finishes early leaves (its answer handed over) rounds before the call ends; one that finishes at
   its first token never joins the batch.
c) Calls that cannot merge a row exactly never ask for newcomers: logits processors, sampling, a streamer, no EOS
   criterion, a hybrid target; a malformed newcomer is refused by name.
d) `jetspec serve`'s scheduler: requests that arrive mid-call join it and are answered as they leave; with
   `--join off` they wait for the next call, which they share; `--join` parses, and a bad value is refused.
"""

import asyncio
import logging

import pytest
import test_serve_batching
import torch
from test_hybrid import hybrid_target
from test_serve_batching import (
    TEXTS,
    answer_of,
    assert_one_client_answer,
    make_row,
    one_client,
    tree_alone,
)
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from jetspec import serve_batching
from jetspec.serve import TreeGenerateManager
from jetspec.tiny import prompts, tiny_head, tiny_target
from modeling_jetspec.admission import Newcomer

served = test_serve_batching.served  # its fixture: the tiny target, character tokenizer and head it serves
EOS = 7  # an id the random targets' answers reach now and then


class Source:
    """A row source (`admission.RowSource`) that offers `plan[k]` after round k, and keeps what it is told."""

    def __init__(self, plan: dict):
        self.plan, self.rounds, self.asked = dict(plan), 0, 0
        self.tokens, self.left_at, self.answers, self.stats = {}, {}, {}, {}

    def admit(self, active: int) -> list:
        self.rounds += 1
        self.asked += 1
        return self.plan.pop(self.rounds, [])

    def committed(self, row: int, tokens: list):
        self.tokens.setdefault(row, []).extend(tokens)

    def left(self, row: int, tokens: list, stats):
        self.left_at[row], self.answers[row], self.stats[row] = self.rounds, tokens, stats


def newcomer(ids: torch.Tensor, max_new_tokens: int) -> Newcomer:
    """A prompt `(1, P)` with the criteria of its lone greedy call: its length and the EOS."""
    stops = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + max_new_tokens), EosTokenCriteria(EOS)])
    return Newcomer(ids, stops)


def lone(target, ids: torch.Tensor, max_new_tokens: int, head=None):
    """Plain greedy `generate` of one unpadded prompt `(1, P)` (the tree's with `head`): its tokens and the output."""
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
        output_logits=head is None,
        return_dict_in_generate=True,
        assistant_model=head,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), out


def joined_call(target, head, ids: torch.Tensor, mask: torch.Tensor, source: Source, max_new_tokens: int):
    """The greedy tree call of `ids` `(B, P)` that `source`'s rows join, EOS-stopped, its output with statistics."""
    return target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
        return_dict_in_generate=True,
        assistant_model=head,
        jetspec_rows=source,
    )


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))  # (1, P)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_newcomers_get_their_lone_answers(arch):
    target = tiny_target(arch)
    head = tiny_head(target, tree_lookup=4)
    ids, mask = prompts(2, lengths=(9, 5))  # rows A and B, width 9
    short, long = random_prompt(3, 1), random_prompt(30, 2)  # narrower, then wider than the running width
    source = Source({1: [newcomer(short, 14)], 3: [newcomer(long, 10)]})
    out = joined_call(target, head, ids, mask, source, 16)
    assert source.plan == {} and sorted(source.answers) == [0, 1, 2, 3]  # both joined, every row left
    starts = [ids.shape[1] - int(mask[row].sum()) for row in range(2)]
    rows = [(ids[row : row + 1, starts[row] :], 16) for row in range(2)] + [(short, 14), (long, 10)]
    exact = 0
    for row, (prompt, new) in enumerate(rows):
        want, reference = lone(target, prompt, new)
        got = source.answers[row]
        assert source.tokens[row] == got  # what was handed over as it came is the answer
        if row < 2:  # the call's own rows are also its output, as plain `generate` returns a batch
            assert out.sequences[row, ids.shape[1] : ids.shape[1] + len(got)].tolist() == got
        same = assert_one_client_answer(got, want, reference.logits, (arch, row))
        exact += same
        if same:
            stats, alone = source.stats[row], lone(target, prompt, new, head)[1].jetspec_stats
            assert stats.new_tokens == len(got) == stats.round_tokens + 1
            assert (stats.rounds, stats.target_forwards) == (alone.rounds, alone.target_forwards), (arch, row)
            assert len(stats.token_sources[0]) == len(got)
    assert exact >= 3  # a near-tie may move one answer, not all of them
    assert out.jetspec_stats.target_forwards == 1 + 2 + out.jetspec_stats.rounds  # two newcomers' prefills
    # some round accepted drafted tokens (the lookup branch on repetitive answers): rows of uneven acceptance, holes
    assert max(stats.tau for stats in source.stats.values()) > 1


def test_an_auto_call_reweighs_its_budget_when_rows_join_and_leave(tmp_path, monkeypatch):
    """A `tree_budget="auto"` call chooses its budget for the batch it starts with; when a row joins, the budget is
    re-weighed from the host costs of the new batch (here written to the cost file: budget 8 wins alone, budget 4 at
    batch 2), among the sources chosen at the start, and again once a row has left. Every answer stays its lone
    greedy one."""
    import modeling_jetspec.decode as decode
    from modeling_jetspec.host_cache import store
    from modeling_jetspec.host_costs import costs_key, head_identity

    costs = tmp_path / "costs.json"
    monkeypatch.setenv("JETSPEC_HOST_COSTS", str(costs))
    target = tiny_target("llama")
    table = {
        "head": {"4": 1.5, "8": 1.6},
        "head+lookup": {"4": 1.8, "8": 2.2},
        "head+lookup+trie": {"4": 2.0, "8": 2.4},
    }
    head = tiny_head(target, tree_budget="auto", tau_by_budget=table, tree_lookup=4, tree_lookup_branches="trie")
    overhead = {f"{head_identity(head)} {sources}": 0.1 for sources in table}
    # trie at 8: 2.4 / 1.15 = 2.09 against 2.0 / 1.1 = 1.82 alone; at batch 2: 2.4 / 2.1 = 1.14 against 2.0 / 1.3 = 1.54
    for batch, ratios in {1: {"4": 1.0, "8": 1.05}, 2: {"4": 1.2, "8": 2.0}}.items():
        store(costs, costs_key(target, batch), {"step_seconds": 0.01, "verify_ratio": ratios, "overhead": overhead})
    budgets = []
    original = decode.draft
    monkeypatch.setattr(
        decode, "draft", lambda h, st, sh, b, *a, **k: budgets.append(b) or original(h, st, sh, b, *a, **k)
    )
    ids = random_prompt(6, 3)
    joining = random_prompt(4, 4)
    source = Source({2: [newcomer(joining, 6)]})  # joins after round 2, and leaves long before the first row
    out = joined_call(target, head, ids, torch.ones_like(ids), source, 24)
    point = out.jetspec_stats.operating_point
    assert (point["budget"], point["sources"]) == (8, "head+lookup+trie")  # chosen alone, at the start
    assert point["budget_by_batch"][2] == 4
    joined = source.left_at[1]  # the newcomer's row left after this round
    assert budgets[:2] == [8, 8] and 4 in budgets[2:joined]
    if joined < len(budgets):  # the first row went on alone: the budget of batch 1 again
        assert point["budget_by_batch"][1] == 8 and budgets[-1] == 8
    for row, (prompt, new) in enumerate([(ids, 24), (joining, 6)]):
        want, reference = lone(target, prompt, new)
        assert_one_client_answer(source.answers[row], want, reference.logits, row)


def test_a_newcomer_that_finishes_early_leaves_before_the_call_ends():
    target = tiny_target("llama")
    head = tiny_head(target)
    ids, mask = prompts(1, lengths=(9,))
    quick, instant = random_prompt(6, 3), random_prompt(4, 4)
    source = Source({1: [newcomer(quick, 3), newcomer(instant, 1)]})
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=24,
        eos_token_id=EOS,
        pad_token_id=0,
        do_sample=False,
        return_dict_in_generate=True,
        assistant_model=head,
        jetspec_rows=source,
    )
    rounds = out.jetspec_stats.rounds
    # the instant one left at its prefill's token, in the round-1 admission; the quick one a round or two later
    assert source.left_at[2] == 1 and source.stats[2].rounds == 0 and source.answers[2] == lone(target, instant, 1)[0]
    assert source.left_at[1] <= 3 < rounds and source.answers[1] == lone(target, quick, 3)[0]
    assert out.jetspec_stats.row_rounds == rounds + source.stats[1].rounds  # row 2 took part in no round


class Steps(BaseStreamer):
    """A streamer that keeps the `(B,)` steps it is handed."""

    def __init__(self):
        self.steps = []

    def put(self, value):
        self.steps.append(value)

    def end(self):
        pass


def call_kwargs(**given) -> dict:
    return dict(max_new_tokens=6, do_sample=False, eos_token_id=EOS, pad_token_id=0, **given)


@pytest.mark.parametrize(
    "case", ["repetition_penalty", "sampling", "streamer", "no_eos", "hybrid", "static"], ids=lambda case: case
)
def test_calls_that_cannot_merge_a_row_never_admit(case):
    target = hybrid_target("lfm2") if case == "hybrid" else tiny_target("llama")
    head = tiny_head(target)
    ids, mask = prompts(2, lengths=(9, 5))
    kwargs = call_kwargs()
    if case == "repetition_penalty":
        kwargs["repetition_penalty"] = 1.3  # a processor reads the whole row
    elif case == "sampling":
        kwargs["do_sample"] = True
    elif case == "streamer":
        kwargs["streamer"] = Steps()
    elif case == "no_eos":
        kwargs["eos_token_id"] = None  # no EOS criterion: a stopped row would decode on
    elif case == "static":
        kwargs["jetspec_static"] = "eager"  # fixed-shape buffers of the call's rows
    source = Source({1: [newcomer(random_prompt(4, 5), 4)]})
    torch.manual_seed(0)
    out = target.generate(ids, attention_mask=mask, assistant_model=head, jetspec_rows=source, **kwargs)
    assert source.asked == 0 and source.plan  # never asked for a newcomer
    torch.manual_seed(0)
    alone = target.generate(ids, attention_mask=mask, assistant_model=head, **kwargs)
    assert torch.equal(out, alone)  # the call's tokens are those of a call without a source
    if case in ("streamer", "no_eos"):  # its rows do not leave on their own: the source hears nothing
        assert source.answers == {} and source.tokens == {}
    else:  # its own rows still leave with their answers
        for row in range(2):
            answer = source.answers[row]
            assert out[row, ids.shape[1] : ids.shape[1] + len(answer)].tolist() == answer
            assert answer[-1] == EOS or len(answer) == 6


def test_a_malformed_newcomer_is_refused_by_name():
    target = tiny_target("llama")
    head = tiny_head(target)
    ids, mask = prompts(1, lengths=(9,))
    for bad, message in [
        (Newcomer(torch.ones(2, 3, dtype=torch.long), StoppingCriteriaList()), r"shape \(1, P\)"),
        (Newcomer(torch.ones(1, 3, dtype=torch.long), [MaxLengthCriteria(5)]), "StoppingCriteriaList"),
        ("not a newcomer", "expected a Newcomer"),
    ]:
        with pytest.raises(ValueError, match=message):
            target.generate(
                ids, attention_mask=mask, assistant_model=head, jetspec_rows=Source({1: [bad]}), **call_kwargs()
            )


# ------------------------------------------------------------------------------------------------ jetspec serve
def decode_arriving(served, first: dict, later: list, after_puts: int = 3, setup=None, gone=(), join=True) -> tuple:
    """`first` (a streamed row spec) decodes on the inference thread; after its streamer's `after_puts`-th put (the
    prompt, then each round's tokens), the `later` specs arrive, from inside the call, so that they come mid-call on
    every host (`setup(rows)`, if given, first adjusts the rows), to a server with joining on or off (`join`).
    Returns `(rows, texts, answered)`: the rows, their texts (`None` for the rows `gone`, whose clients leave), and
    the rows in the order they were answered (`BatchScheduler.settle`, or a stream's end)."""

    async def run():
        loop = asyncio.get_running_loop()
        manager = TreeGenerateManager(served[2], 4, join=join)
        rows = [make_row(served, loop, **spec) for spec in [first] + later]
        if setup is not None:
            setup(rows)
        answered, puts = [], []
        settle, end_stream, put = manager.scheduler.settle, manager.end_stream, rows[0].streamer.put

        def recording(row, error=None):
            if row.streamer is None:  # a stream is recorded as it ends: a lone one ends without `settle`
                answered.append(row)
            settle(row, error)

        def ending(job, *args, **kwargs):
            answered.append(next(row for row in rows if row.job is job))
            end_stream(job, *args, **kwargs)

        def arriving(value):
            put(value)
            puts.append(value)
            if len(puts) == after_puts:
                for row in rows[1:]:  # as the manager queues a request
                    manager.scheduler.add(row)
                    manager.submit(manager.scheduler.run_next)

        manager.scheduler.settle, manager.end_stream, rows[0].streamer.put = recording, ending, arriving
        manager.scheduler.add(rows[0])
        manager.submit(manager.scheduler.run_next)
        texts = await asyncio.wait_for(asyncio.gather(*(text_of(i, row) for i, row in enumerate(rows))), 120)
        await asyncio.wait_for(every_row_answered(answered, len(rows)), 120)
        return rows, texts, answered

    async def text_of(index: int, row):
        return None if index in gone else await answer_of(row)

    async def every_row_answered(answered: list, count: int):  # a row whose client left has no text to wait for
        while len(answered) < count:
            await asyncio.sleep(0.01)

    return asyncio.run(run())


def test_a_request_that_arrives_mid_call_joins_it_and_is_answered_when_it_leaves(served):
    first = {"text": TEXTS[1], "max_tokens": 40, "stream": True}
    later = [
        {"text": TEXTS[4], "max_tokens": 4},  # a longer prompt than the first's, answered long before it
        {"text": TEXTS[0], "max_tokens": 12, "stream": True, "stops": ("zz",)},
    ]
    rows, texts, answered = decode_arriving(served, first, later)
    assert [row.job.report["joined"] for row in rows] == [False, True, True]  # both joined the running call
    assert [row.job.report["batch"] for row in rows] == [3, 3, 3]  # both joined at the same round boundary
    assert answered.index(rows[1]) < answered.index(rows[0])  # answered when it left, not at the call's end
    exact = 0
    for row, text, spec in zip(rows, texts, [first] + later):
        want, logits = one_client(served, spec["text"], spec["max_tokens"], spec.get("stops", ()))
        same = assert_one_client_answer(row.job.new_ids, want, logits, spec)
        exact += same
        if same:
            assert text == served[1].decode(want, skip_special_tokens=True)
            alone = tree_alone(served, spec["text"], spec["max_tokens"], spec.get("stops", ()))
            report = row.job.report
            assert (report["rounds"], report["target_forwards"], report["tau"]) == (
                alone.rounds,
                alone.target_forwards,
                alone.tau,
            ), spec
            assert sum(report["tokens_by_source"].values()) == len(want)
    assert exact >= 2  # a near-tie may move one answer, not all of them


def test_with_join_off_requests_arriving_mid_call_wait_and_then_share_the_next_call(served):
    first = {"text": TEXTS[1], "max_tokens": 30, "stream": True}
    later = [{"text": TEXTS[4], "max_tokens": 4}, {"text": TEXTS[0], "max_tokens": 12, "stream": True}]
    rows, texts, answered = decode_arriving(served, first, later, join=False)
    assert [row.job.report["joined"] for row in rows] == [False, False, False]  # `--join off`: nobody joined
    assert answered[0] is rows[0] and rows[0].job.report["batch"] == 1  # the first call ran alone to its end
    assert [row.job.report["batch"] for row in rows[1:]] == [2, 2]  # the two that waited: the next call, together
    exact = 0
    for row, text, spec in zip(rows, texts, [first] + later):
        want, logits = one_client(served, spec["text"], spec["max_tokens"])
        if assert_one_client_answer(row.job.new_ids, want, logits, spec):
            assert text == served[1].decode(want, skip_special_tokens=True)
            exact += 1
    assert exact >= 2  # a near-tie may move one answer, not all of them


def test_the_join_argument_parses_reaches_the_scheduler_and_a_bad_value_is_refused(served, capsys):
    from jetspec import cli
    from jetspec.serve import build_handlers
    from jetspec.serve_limits import check_arguments

    parser = cli.build_parser()
    argv = ["serve", "--device", "cpu", "--dtype", "float32"]
    assert check_arguments(parser.parse_args(argv))[3].join is True  # the default: on
    assert check_arguments(parser.parse_args([*argv, "--join", "on"]))[3].join is True
    limits = check_arguments(parser.parse_args([*argv, "--join", "off"]))[3]
    assert limits.join is False
    for given, join in [(limits, False), (None, True)]:  # the server's handlers: one manager, one scheduler
        chat, _ = build_handlers(*served, "tiny", given, 4)
        assert chat.generation_state.manager.scheduler.join is join
    for bad in ("no", "OFF", ""):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*argv, "--join", bad])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and f"argument --join: expected on or off, got {bad!r}" in last, last


def test_a_request_that_cannot_share_the_call_waits_and_holds_back_later_ones(served):
    first = {"text": TEXTS[1], "max_tokens": 30, "stream": True}
    later = [
        {"text": TEXTS[2], "max_tokens": 5, "temperature": 0.8},  # sampling: another batch key
        {"text": TEXTS[3], "max_tokens": 5},  # greedy, but behind the sampling one: it does not pass it
    ]
    rows, _, answered = decode_arriving(served, first, later)
    assert [row.job.report["joined"] for row in rows] == [False, False, False]
    assert answered[0] is rows[0] and rows[0].job.report["batch"] == 1  # the first call ran alone to its end
    want, logits = one_client(served, TEXTS[3], 5)
    assert_one_client_answer(rows[2].job.new_ids, want, logits, "greedy after the call")


def test_a_joined_row_ends_at_its_deadline_or_its_disconnect_and_the_others_go_on(served, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "jetspec.serve")
    ticks = iter(range(10**6))  # the deadlines' clock counts the verdicts: the joined row's passes after its 6th token
    monkeypatch.setattr(serve_batching, "clock", lambda: next(ticks))
    first = {"text": TEXTS[1], "max_tokens": 30, "stream": True}
    later = [{"text": TEXTS[3], "max_tokens": 20}, {"text": TEXTS[2], "max_tokens": 20, "stream": True}]

    def setup(rows):
        rows[1].job.deadline = 5
        leaving, put = rows[2].streamer, rows[2].streamer.put

        def put_then_leave(value):  # the client leaves once it has had its first token
            put(value)
            if leaving.total_tokens:
                leaving.cancel()

        leaving.put = put_then_leave

    rows, texts, answered = decode_arriving(served, first, later, setup=setup, gone=(2,))
    assert rows[1].job.report["joined"] and rows[1].job.finish_reason() == "length"
    assert len(rows[1].job.new_ids) == 7  # verdicts 0 .. 6: the 7th is past the deadline of 5
    assert rows[2] in answered and rows[2].job.report is None and texts[2] is None  # it stopped, unanswered
    assert [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()] == [
        "jetspec serve: completions request stopped: the client disconnected after 1 tokens"
    ]
    for row, spec in zip(rows[:2], [first, later[0]]):
        want, logits = one_client(served, spec["text"], spec["max_tokens"])
        assert_one_client_answer(row.job.new_ids, want[: len(row.job.new_ids)], logits, spec)
    assert len(rows[0].job.new_ids) == 30  # the first row ran to its own max_tokens
