"""`jetspec serve`'s batching (`jetspec/serve_batching.py`): requests that wait together decode in one tree call.

The scheduler is driven directly, in this process, on a tiny random float32 target with a one-token-per-character
tokenizer: rows are queued while the inference thread is held, so that they share one call, then each answer is
compared with its one-client answer, plain `generate` of that request alone.

a) Greedy rows with different `max_tokens`, stop strings and an EOS, streamed and not, in one call: each row's
   tokens are its one-client answer (a difference is allowed only at a float32 near-tie: the one-client call's two
   top logits within 1e-4 there, checked, never assumed), its text the one-client text cut before its stop string,
   its statistics those of the same request decoded alone through the tree.
b) A client that left before its call: the others still get their answers and statistics.
   A row whose deadline passes in mid-call ends there, with `length`, and the other row finishes as alone.
c) Which requests share a call: greedy ones whatever their lengths and stops, sampling ones with the same settings,
   a seeded one alone, one with a repetition penalty alone, up to the cap; sampling rows of one call.
d) The statistics split by row, on hand-made rounds; the batch cap's measurement.
e) One run through the real server process (`python -m jetspec serve --max-batch 4`) with concurrent `openai`
   clients: each gets its one-client answer, and some shared a call; scripts/serve_bench.py smoke-checked on it.
"""

import asyncio
import collections
import logging
import sys
import threading

import pytest
import torch
from test_bench import char_tokenizer
from test_serve import NAME, Server, ask, prompt_ids
from transformers import GenerationConfig

from jetspec import serve_batching
from jetspec.serve import TreeGenerateManager, TreeStreamer, TrimmedQueue, prepare
from jetspec.serve_batching import BatchScheduler, Row, measure_batch_cap, next_call, split_stats
from jetspec.serve_requests import Job, StopTrimmer
from modeling_jetspec.state import JetSpecStats
from jetspec.tiny import tiny_head, tiny_target

TIE = 1e-4  # float32: a batch's padded shapes may round a logit differently; only a near-tie may flip the argmax
TEXTS = ["What is 2 + 3?", "Name a colour.", "abc abc abc", "Write a haiku.", "The quick brown fox"]


@pytest.fixture(scope="module")
def served():
    target = tiny_target("llama", vocab_size=100, max_position_embeddings=1024)
    return target, char_tokenizer(), tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12, tree_lookup=6)


def config_of(target, max_tokens: int, eos=None, **fields) -> GenerationConfig:
    """The target's generation config with the request's length, EOS and sampling (`fields`: the call's own)."""
    config = GenerationConfig(**target.generation_config.to_dict())
    sampling = {k: v for k, v in fields.items() if k in ("temperature", "top_p")}
    config.update(max_new_tokens=max_tokens, eos_token_id=eos, do_sample=bool(sampling), **fields)
    return config


def make_row(served, loop, text, max_tokens, stops=(), stream=False, eos=None, seed=None, **fields) -> Row:
    target, tokenizer, _ = served
    job = Job(endpoint="completions", seed=seed, temperature=fields.get("temperature", 0.0), stops=tuple(stops))
    job.max_tokens = max_tokens
    inputs = tokenizer(text, return_tensors="pt")
    config = config_of(target, max_tokens, eos, **fields)
    config.stop_strings = list(stops) or None
    prepare(job, target, inputs, config)
    if not stream:
        return Row(job, target, tokenizer, inputs, config, loop, done=loop.create_future())
    queue = TrimmedQueue(job, job.stops)
    streamer = TreeStreamer(tokenizer.backend_tokenizer, loop, queue, job=job)
    return Row(job, target, tokenizer, inputs, config, loop, streamer=streamer, queue=queue)


async def answer_of(row: Row) -> str:
    """The row's text as its client gets it."""
    if row.streamer is None:
        await row.done
        return StopTrimmer(row.job.stops).trim(row.processor.decode(row.job.new_ids, skip_special_tokens=True))
    pieces = []
    while (piece := await row.queue.get()) is not None:
        pieces.append(piece)
    return "".join(pieces)


def decode_together(served, specs: list, max_batch: int = 8) -> list:
    """Queue a row per spec before the inference thread looks, so that they share calls; `(rows, texts)`."""

    async def run():
        loop = asyncio.get_running_loop()
        manager = TreeGenerateManager(served[2], max_batch)
        rows = [make_row(served, loop, **{k: v for k, v in spec.items() if k != "deadline"}) for spec in specs]
        for row, spec in zip(rows, specs):
            row.job.deadline = spec.get("deadline")
        for row, spec in zip(rows, specs):
            if spec.get("gone"):
                row.streamer.cancel()  # the client left before its call
        for row in rows:
            manager.scheduler.add(row)
        for _ in rows:  # as the manager does for each request; the first takes every row that waits
            manager.submit(manager.scheduler.run_next)
        texts = await asyncio.wait_for(
            asyncio.gather(*(answer_of(row) for row, spec in zip(rows, specs) if not spec.get("gone"))), 120
        )
        return [row for row, spec in zip(rows, specs) if not spec.get("gone")], texts

    return asyncio.run(run())


def one_client(served, text: str, max_tokens: int, stops=(), eos=None):
    """Plain `generate` of the request alone, with its logits."""
    target, tokenizer, _ = served
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    extra = {"stop_strings": list(stops)} if stops else {}
    config = config_of(target, max_tokens, eos, output_logits=True, return_dict_in_generate=True, **extra)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, tokenizer=tokenizer)
    return out.sequences[0, ids.shape[1] :].tolist(), out.logits


def assert_one_client_answer(got: list, want: list, logits: tuple, what):
    """`got` is `want`, or leaves it at a step where the one-client call's two top logits are within `TIE`."""
    for step, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top = logits[step][0].float().topk(2).values
            assert top[0] - top[1] < TIE, (what, step, a, b, top)
            return False
    assert got == want, what
    return True


def tree_alone(served, text: str, max_tokens: int, stops=(), eos=None) -> JetSpecStats:
    target, tokenizer, head = served
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    extra = {"stop_strings": list(stops)} if stops else {}
    config = config_of(target, max_tokens, eos, return_dict_in_generate=True, **extra)
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), generation_config=config, tokenizer=tokenizer, assistant_model=head
    )
    return out.jetspec_stats


def test_greedy_rows_of_one_call_get_their_one_client_answers(served):
    target, tokenizer, _ = served
    first, _ = one_client(served, TEXTS[1], 12)
    stop = tokenizer.decode(first[5:7])  # a stop string the answer reaches
    # an EOS that the answer of TEXTS[3] reaches (it is the third token of TEXTS[0]'s): that row stops there
    eos = one_client(served, TEXTS[0], 3)[0][2]
    specs = [
        {"text": TEXTS[0], "max_tokens": 3},
        {"text": TEXTS[1], "max_tokens": 12, "stops": (stop, "never there"), "stream": True},
        {"text": TEXTS[2], "max_tokens": 20, "stream": True},
        {"text": TEXTS[3], "max_tokens": 9, "stops": ("zzz",)},
        {"text": TEXTS[4], "max_tokens": 16},
    ]
    for eos_token in (None, eos):
        rows, texts = decode_together(served, [{**spec, "eos": eos_token} for spec in specs])
        exact = 0
        for row, text, spec in zip(rows, texts, specs):
            want, logits = one_client(served, spec["text"], spec["max_tokens"], spec.get("stops", ()), eos_token)
            same = assert_one_client_answer(row.job.new_ids, want, logits, (spec, eos_token))
            exact += same
            if not same:
                continue
            assert text == StopTrimmer(row.job.stops).trim(tokenizer.decode(want, skip_special_tokens=True))
            report = row.job.report
            assert report["batch"] == len(specs) and report["new_tokens"] == len(want)
            alone = tree_alone(served, spec["text"], spec["max_tokens"], spec.get("stops", ()), eos_token)
            assert (report["tau"], report["rounds"], report["target_forwards"]) == (
                alone.tau,
                alone.rounds,
                alone.target_forwards,
            ), spec
            assert report["acceptance_per_depth"] == alone.acceptance_per_depth
        assert exact >= len(specs) - 1  # a near-tie may move one answer; not all of them
    lengths = [len(row.job.new_ids) for row in rows]
    # the stop string and the EOS ended rows 1 and 3 before their max_tokens, row 2 ran to its own
    assert lengths[1] < 12 and lengths[3] < 9 and lengths[2] == 20


def test_a_client_that_left_before_its_call_leaves_the_others_exact(served, caplog):
    caplog.set_level(logging.INFO, "jetspec.serve")
    specs = [
        {"text": TEXTS[0], "max_tokens": 10},
        {"text": TEXTS[1], "max_tokens": 40, "stream": True, "gone": True},
        {"text": TEXTS[2], "max_tokens": 14, "stream": True},
        {"text": TEXTS[3], "max_tokens": 1},  # done at the prefill's token: in no round
    ]
    rows, _ = decode_together(served, specs)
    assert [len(row.job.new_ids) for row in rows][2] == 1
    assert [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()] == [
        "jetspec serve: completions request stopped: the client disconnected after 0 tokens"
    ]
    for row, spec in zip(rows, [specs[0], specs[2], specs[3]]):
        want, logits = one_client(served, spec["text"], spec["max_tokens"])
        if assert_one_client_answer(row.job.new_ids, want, logits, spec):
            assert row.job.report["rounds"] == tree_alone(served, spec["text"], spec["max_tokens"]).rounds


@pytest.mark.parametrize("same_prompt", [False, True], ids=["own-prompts", "one-prompt"])
def test_a_row_past_its_deadline_ends_with_length_while_the_other_finishes(served, monkeypatch, same_prompt):
    # the deadlines' clock counts the call's verdicts: row 0's deadline passes after the 12th, in mid-call. With its
    # own prompt, the verdict that ends it is known (its statistics are exact); with the other row's prompt it is not
    # (the stream ends it by the clock, its statistics are those of the rounds it took part in)
    texts = [TEXTS[2], TEXTS[2] if same_prompt else TEXTS[4]]
    for stream in (False, True):
        ticks = iter(range(10**6))
        monkeypatch.setattr(serve_batching, "clock", lambda: next(ticks))
        specs = [
            {"text": texts[0], "max_tokens": 30, "stream": stream, "deadline": 12},
            {"text": texts[1], "max_tokens": 16, "stream": not stream},
        ]
        rows, answers = decode_together(served, specs)
        for row, spec in zip(rows, specs):
            want, logits = one_client(served, spec["text"], spec["max_tokens"])
            got = row.job.new_ids
            assert row.job.report["batch"] == 2 and row.job.report["new_tokens"] == len(got)
            assert sum(row.job.report["tokens_by_source"].values()) == len(got)
            if not assert_one_client_answer(got, want[: len(got)], logits, spec):
                continue
            assert answers[rows.index(row)] == served[1].decode(got, skip_special_tokens=True)
            if "deadline" in spec:
                assert 2 <= len(got) < 30 and row.job.finish_reason() == "length"
            else:
                assert got == want and row.job.finish_reason() == "length"  # its own max_tokens
            if not same_prompt or "deadline" not in spec:  # exact: the rounds of the row decoded alone to its end
                assert row.job.report["rounds"] == tree_alone(served, spec["text"], len(got)).rounds, spec


def test_sampling_rows_of_the_same_settings_share_a_call_each_to_its_own_length(served):
    sampling = {"temperature": 0.9, "top_p": 0.95}
    specs = [{"text": TEXTS[i], "max_tokens": 5 + 4 * i, "stream": i == 1, **sampling} for i in range(3)]
    rows, texts = decode_together(served, specs)
    assert [row.job.report["batch"] for row in rows] == [3, 3, 3]
    assert [len(row.job.new_ids) for row in rows] == [5, 9, 13]  # no EOS: each to its own max_tokens
    tokenizer = served[1]
    assert texts == [tokenizer.decode(row.job.new_ids, skip_special_tokens=True) for row in rows]
    greedy = [one_client(served, spec["text"], spec["max_tokens"])[0] for spec in specs]
    assert [row.job.new_ids for row in rows] != greedy  # it sampled


def test_which_requests_share_a_call(served):
    loop = asyncio.new_event_loop()
    try:
        greedy = [make_row(served, loop, TEXTS[i], 4 + i, stops=("x",) * (i % 2)) for i in range(3)]
        warm = [make_row(served, loop, TEXTS[i], 5, temperature=0.7, top_p=0.9) for i in range(2)]
        hot = make_row(served, loop, TEXTS[0], 5, temperature=1.3)
        seeded = make_row(served, loop, TEXTS[1], 5, seed=3, temperature=0.7, top_p=0.9)
        penalized = make_row(served, loop, TEXTS[2], 5, repetition_penalty=1.2)  # it would penalize the padding
        waiting = collections.deque([warm[0], greedy[0], seeded, penalized, hot, greedy[1], warm[1], greedy[2]])
        calls = []
        while waiting:
            calls.append(next_call(waiting, max_batch=2))
        assert calls == [warm, greedy[:2], [seeded], [penalized], [hot], [greedy[2]]]
        longer = make_row(served, loop, TEXTS[4], 4)  # a prompt of 19 tokens
        too_long = make_row(served, loop, TEXTS[1], 1024 - 14)  # its prompt (14) and max_tokens fill the context
        assert next_call(collections.deque([longer, too_long]), 8) == [longer]  # 19 + 1010 > 1024
    finally:
        loop.close()


def test_statistics_split_by_row_as_each_row_counts_alone():
    stats = JetSpecStats(target_forwards=1, accepted_at_depth=[0, 0, 0])  # the prefill, then a forward a round
    # rows of 1, 6 and 4 new tokens; round 1: rows 1 and 2 (row 0 left after its prefill token)
    for budget, counts, committed in ((8, [3, 1], 6), (8, [1, 2], 4), (8, [0], 0)):
        stats.add_round(budget, counts, committed, 0.0, 0.0, forwards=1)
    stats.accepted = [[2, 0], [0, 1], [0]]
    rows = split_stats(stats, [1, 6, 4])
    assert [row.rounds for row in rows] == [0, 3, 2]
    assert [row.new_tokens for row in rows] == [1, 6, 4]
    assert rows[1].accepted == [[2], [0], [0]] and rows[2].accepted == [[0], [1]]
    assert [row.target_forwards for row in rows] == [1, 4, 3]
    assert rows[1].tau == 5 / 3 and rows[2].tau == 3 / 2  # round tokens per round: the last one cut at the stop
    # a row whose client left (count unknown) fills the places the others leave
    assert [row.rounds for row in split_stats(stats, [1, None, 4])] == [0, 3, 2]
    with pytest.raises(ValueError, match="expected a round of 1 to 1 rows"):
        split_stats(stats, [1, 6, 2])


def test_the_batch_cap_is_the_last_size_whose_row_round_got_10_percent_cheaper(served):
    target, _, head = served
    cap, costs = measure_batch_cap(target, head, largest=4, prompt_length=8, new_tokens=4)
    sizes = list(costs)
    assert sizes == [1, 2, 4][: len(sizes)] and cap in sizes and all(cost > 0 for cost in costs.values())
    for smaller, larger in zip(sizes, sizes[1:]):
        assert (costs[larger] <= 0.9 * costs[smaller]) == (larger <= cap)
    assert cap == sizes[-1] or costs[sizes[-1]] > 0.9 * costs[cap]
    with pytest.raises(ValueError, match="expected max_batch to be an integer >= 1, got 0"):
        BatchScheduler(TreeGenerateManager(head), head, 0)


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory, served):
    target, tokenizer, head = served
    root = tmp_path_factory.mktemp("batched")
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    head.save_pretrained(root / "head")
    command = [sys.executable, "-m", "jetspec", "serve", "--model", str(root / "target"), "--head", str(root / "head")]
    command += ["--served-model-name", NAME, "--dtype", "float32", "--threads", "1", "--max-batch", "4"]
    server = Server(command, root / "serve.log", NAME)
    try:
        yield server.wait()
    finally:
        server.stop()


def test_concurrent_clients_of_the_server_share_calls_and_get_their_own_answers(batching_server, served):
    target, tokenizer, _ = served
    requests = [
        (
            "completions",
            TEXTS[i],
            i % 2 == 1,
            {"max_tokens": 6 + 5 * i, "temperature": 0, **({"stop": ["e"]} if i == 2 else {})},
        )
        for i in range(5)
    ]
    answers, errors = [None] * len(requests), []
    barrier = threading.Barrier(len(requests))

    def run(index):
        endpoint, text, stream, fields = requests[index]
        barrier.wait()
        try:
            answers[index] = ask(batching_server.client, endpoint, text, stream, **fields)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and None not in answers, errors
    for (endpoint, text, _, fields), answer in zip(requests, answers):
        ids = prompt_ids(tokenizer, endpoint, text)
        stops = fields.get("stop", ())
        extra = {"stop_strings": stops, "tokenizer": tokenizer} if stops else {}
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=fields["max_tokens"],
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
        want = out.sequences[0, ids.shape[1] :].tolist()
        assert_one_client_answer(answer["jetspec"]["token_ids"], want, out.logits, text)
    assert max(answer["jetspec"]["batch"] for answer in answers) > 1  # some of them shared a call


def test_serve_bench_runs_both_loads_and_compares_with_the_better_transformers_path(batching_server):
    """scripts/serve_bench.py smoke-checked at tiny size: the one tiny server stands behind the three names."""
    from test_scripts import load_script

    bench = load_script("serve_bench")
    url = batching_server.url
    servers = {name: (url, NAME) for name in (bench.JETSPEC, bench.TRANSFORMERS, bench.TRANSFORMERS_CB)}
    prompts = [{"suite": "tiny", "id": f"p{i}", "prompt": TEXTS[i]} for i in range(3)]
    results = bench.run_bench(servers, prompts, max_tokens=4, clients=[1, 2], warmup=False, loads=bench.LOADS)
    assert [(run["load"], run["clients"]) for run in results["runs"]] == [
        ("lockstep", 1),
        ("lockstep", 2),
        ("steady", 1),
        ("steady", 2),
    ]
    for run in results["runs"]:
        for records in run["requests"].values():  # every prompt once, in prompt order, each answered in full
            assert [(r["id"], r["tokens"]) for r in records] == [("p0", 4), ("p1", 4), ("p2", 4)]
            assert all(0 < r["ttft"] <= r["seconds"] for r in records)
    rows = bench.summary_rows(results)
    assert len(rows) == 12 and {r["same_text"] for r in rows} == {"3/3"}  # one greedy server: the same texts
    for index in range(0, 12, 3):
        jetspec, *theirs = rows[index : index + 3]
        assert jetspec["server"] == bench.JETSPEC and max(r["ratio"] for r in theirs) == 1.0  # the better path is 1x
        assert all(r["ttft_p50"] <= r["ttft_p95"] for r in rows[index : index + 3])
    assert "| steady | jetspec serve | 2 | 3 |" in bench.markdown(rows)
    assert bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and bench.percentile(list(range(1, 21)), 0.95) == 19
