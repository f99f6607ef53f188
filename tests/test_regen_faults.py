"""Regeneration through a completions server that fails (training/completions.py, training/answers.py,
training/regenerate.py), against the scriptable loopback fake of tests/fake_openai_server.py: every fault kind is
retried and then answered with the fault-free rows; a prompt that keeps failing is recorded as failed, never becomes a
row or an exported one, and is asked again by the next run; a refusal no retry heals stops the run, naming the address
and the status."""

import functools
import json

import pytest

from fake_openai_server import FakeOpenAIServer, hashed_answer
from test_regenerate import tiny_tokenizer, write_prompts
from training.answers import read_prompts, regenerate, save_compact
from training.completions import CompletionFailed, CompletionsServer, ServerRefused
from training.rows import load_compact, load_regenerated

RUN = {"max_new_tokens": 6, "shard_size": 4, "progress": False}
FAST = {"timeout": 1.0, "retry_delay": 0.01, "max_attempts": 3}  # a stall is 2.5 s: past the timeout
# each fault kind and how the client names it
FAULT_KINDS = {
    500: "HTTP 500",
    503: "HTTP 503",
    429: "HTTP 429",
    "stall": "no answer within 1 s",
    "close": "connection dropped (RemoteDisconnected)",
    "empty": "empty body",
    "truncated": "body is not JSON",
    "short": "connection dropped (IncompleteRead)",
    "malformed": "malformed body (expected one choice)",
    "cut": "cut off (finish_reason 'length' after",
    "trickle": "no whole answer within 2 s",  # the deadline, twice the timeout: each piece came within the timeout
    "no_finish": "cut off (finish_reason None)",
    "bad_ids": "token ids [1000000, 1000000, 1000000] outside the tokenizer's 125",
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def prompts(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", len(FAULT_KINDS) + 1)
    return read_prompts(tmp_path / "prompts.jsonl")


def prompt_keys(tokenizer, prompts) -> list[tuple[int, ...]]:
    """The token ids each prompt is sent as (what the fake server scripts are keyed by)."""
    from jetspec.targets import apply_chat_template

    return [
        tuple(tokenizer(apply_chat_template(tokenizer, p["prompt"]), add_special_tokens=False)["input_ids"])
        for p in prompts
    ]


def manifest(folder) -> dict:
    return json.loads((folder / "progress.json").read_text())


def fault_free_rows(tokenizer, prompts, folder) -> list[dict]:
    with FakeOpenAIServer(hashed_answer()) as server:
        regenerate(None, tokenizer, prompts, folder, server=CompletionsServer(server.url, **FAST), **RUN)
    return load_regenerated(folder).to_list()


def test_every_fault_kind_is_retried_and_the_rows_are_the_fault_free_rows(tokenizer, prompts, tmp_path, caplog):
    keys = prompt_keys(tokenizer, prompts)
    # prompt 0 is also the probe's: it gets no fault; prompt i + 1 gets fault i once, then its answer
    script = {key: [fault] for key, fault in zip(keys[1:], FAULT_KINDS)}
    assert len(set(keys)) == len(keys) == len(FAULT_KINDS) + 1
    with FakeOpenAIServer(hashed_answer(), lambda key: script.get(key, [])) as server:
        client = CompletionsServer(server.url, concurrency=4, **FAST)
        stats = regenerate(None, tokenizer, prompts, tmp_path / "faulty", server=client, **RUN)
        for key, faults in script.items():
            assert server.faults_of(key) == [*faults, "ok"]  # one fault, one retry that was answered
        assert server.overflow == 0
    warned = "\n".join(record.getMessage() for record in caplog.records)
    for reason in FAULT_KINDS.values():
        assert f"/v1/completions: {reason}" in warned, reason  # each fault told apart, then retried
    assert stats["failed"] == {} and stats["new_rows"] == len(prompts)
    assert manifest(tmp_path / "faulty")["failed"] == {}
    assert load_regenerated(tmp_path / "faulty").to_list() == fault_free_rows(tokenizer, prompts, tmp_path / "clean")


def test_a_prompt_that_keeps_failing_is_recorded_never_written_and_asked_again(tokenizer, prompts, tmp_path, capsys):
    """Prompt 5 gets HTTP 500 at every attempt, prompt 9 a stall and prompt 0 (the first, which also probes the
    server) an empty body: the three are recorded as failed with their reasons, none is in a shard or the export, the
    other rows are the fault-free ones; the same command run again asks for the three only, and once the server heals
    they are written and exported."""
    from training.regenerate import main

    keys = prompt_keys(tokenizer, prompts)
    broken = {keys[0]: ["empty"] * 6, keys[5]: [500] * 3, keys[9]: ["stall"] * 3}
    tiny = tmp_path / "tiny"
    tokenizer.save_pretrained(tiny)
    command = [
        "--target",
        str(tiny),
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--out",
        str(tmp_path / "out"),
        "--max_new_tokens",
        "6",
        "--shard_size",
        "4",
        "--server_attempts",
        "3",
        "--server_retry_delay",
        "0.01",
        "--server_timeout",
        "1",
        "--export",
        str(tmp_path / "rows.npz"),
    ]
    with FakeOpenAIServer(hashed_answer(), lambda key: broken.get(key, [])) as server:
        main(command + ["--server", server.url])
        for key, faults in broken.items():
            assert server.faults_of(key) == faults  # the probe asked p0 three times, then p1, then p0's own request
    failed = manifest(tmp_path / "out")["failed"]
    assert failed == {
        "p0": "3 attempts: empty body x3",
        "p5": "3 attempts: HTTP 500 x3",
        "p9": "3 attempts: no answer within 1 s x3",
    }
    printed = capsys.readouterr().out
    assert "3 prompts failed, in no shard" in printed and "p5: 3 attempts: HTTP 500 x3" in printed
    clean = {row["id"]: row for row in fault_free_rows(tokenizer, prompts, tmp_path / "clean")}
    written = load_regenerated(tmp_path / "out").to_list()
    assert [row["id"] for row in written] == [p["id"] for p in prompts if p["id"] not in ("p0", "p5", "p9")]
    assert written == [clean[row["id"]] for row in written]
    exported = load_compact(tmp_path / "rows.npz")
    assert not {"p0", "p5", "p9"} & set(exported["id"]) and len(exported) == len(prompts) - 3

    # the server heals: the same command asks for the three failed prompts only (the packed ones are skipped)
    with FakeOpenAIServer(hashed_answer()) as server:
        main(command + ["--server", server.url])
        assert sorted({key for key, _ in server.log}) == sorted({keys[0], keys[5], keys[9]})  # the probe asks p0
    assert manifest(tmp_path / "out")["failed"] == {}
    exported = load_compact(tmp_path / "rows.npz")
    assert sorted(exported["id"]) == sorted(p["id"] for p in prompts)
    for row in exported:
        assert row["input_ids"] == clean[row["id"]]["input_ids"]


def test_a_refusal_stops_the_run_naming_the_address_and_status(tokenizer, prompts, tmp_path):
    keys = prompt_keys(tokenizer, prompts)
    with FakeOpenAIServer(hashed_answer(), lambda key: [401] if key == keys[6] else []) as server:
        client = CompletionsServer(server.url, concurrency=2, **FAST)
        with pytest.raises(ServerRefused, match=rf"from {server.url}/v1/completions, got HTTP 401: .*fake fault"):
            regenerate(None, tokenizer, prompts, tmp_path / "out", server=client, **RUN)
        assert server.faults_of(keys[6]) == [401]  # not retried
    # the shard before it is whole; nothing of the refused shard was written
    assert load_regenerated(tmp_path / "out")["id"] == ["p0", "p1", "p2", "p3"]
    # a wrong model name: the server's 404, at the probe
    with FakeOpenAIServer(hashed_answer()) as server:
        client = CompletionsServer(server.url, model="other", **FAST)
        with pytest.raises(ServerRefused, match=r"got HTTP 404: .*model 'other' does not exist"):
            regenerate(None, tokenizer, prompts, tmp_path / "wrong", server=client, **RUN)


def test_a_shard_whose_prompts_all_fail_stops_the_run(tokenizer, prompts, tmp_path):
    keys = prompt_keys(tokenizer, prompts)
    down = set(keys[4:8])  # the whole second shard
    with FakeOpenAIServer(hashed_answer(), lambda key: [503] * 3 if key in down else []) as server:
        client = CompletionsServer(server.url, concurrency=4, **FAST)
        with pytest.raises(
            RuntimeError,
            match=r"got none usable for any of the 4 prompts of a shard, after 3 "
            r"attempts each: 3 attempts: HTTP 503 x3; stopped \(4 prompts",
        ):
            regenerate(None, tokenizer, prompts, tmp_path / "out", server=client, **RUN)
    assert load_regenerated(tmp_path / "out")["id"] == ["p0", "p1", "p2", "p3"]
    assert sorted(manifest(tmp_path / "out")["failed"]) == ["p4", "p5", "p6", "p7"]
    summary = save_compact(tmp_path / "out", tmp_path / "rows.npz")
    assert summary["rows"] == 4 and sorted(summary["failed"]) == ["p4", "p5", "p6", "p7"]


def test_the_client_bounds_its_attempts_and_backs_off(tokenizer):
    import time

    key = (3, 7, 4)
    with FakeOpenAIServer(hashed_answer(), lambda k: ["close", "empty", "close", "empty"]) as server:
        client = CompletionsServer(server.url, timeout=1.0, retry_delay=0.05, max_attempts=3)
        start = time.perf_counter()
        with pytest.raises(
            CompletionFailed,
            match=r"3 attempts: connection dropped \(RemoteDisconnected\) x2, "
            "empty body",
        ):
            client.complete(list(key), 4)
        waited = time.perf_counter() - start
        assert 0.05 + 0.1 <= waited < 5.0  # two waits: 0.05 s, then doubled
        assert client.complete(list(key), 4).token_ids == hashed_answer()(list(key), 4)[0]  # the 4th fault, the 5th ok
        assert len(server.faults_of(key)) == 5


def test_a_text_answer_cut_short_is_retried_then_recorded_failed_never_exported(tokenizer, prompts, tmp_path):
    """A server that returns text only (llama.cpp's) cuts answers to half their tokens with `finish_reason`
    "length", short of `max_tokens`: counted by the server (`usage`), or, where it counts nothing, by retokenizing
    the text. Either is retried; a prompt cut at every attempt is recorded as failed, in no shard and not exported;
    the rows written are the fault-free text server's (p3's runs to `max_tokens`, p2's stops before)."""
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    keys = prompt_keys(tokenizer, prompts)
    script = {keys[2]: ["cut"], keys[3]: ["cut_uncounted"], keys[6]: ["cut_uncounted"] * 3}
    with FakeOpenAIServer(hashed_answer(), lambda key: script.get(key, []), decode=decode) as server:
        stats = regenerate(
            None, tokenizer, prompts, tmp_path / "cut", server=CompletionsServer(server.url, **FAST), **RUN
        )
        for key, faults in script.items():
            assert server.faults_of(key) == (faults if len(faults) == 3 else [*faults, "ok"])
    assert manifest(tmp_path / "cut")["settings"]["answer_ids"] == "retokenized"
    assert stats["failed"] == {"p6": "3 attempts: cut off (finish_reason 'length' after 2 of 6 tokens, retokenized) x3"}
    with FakeOpenAIServer(hashed_answer(), decode=decode) as server:
        regenerate(None, tokenizer, prompts, tmp_path / "clean", server=CompletionsServer(server.url, **FAST), **RUN)
    clean = {row["id"]: row for row in load_regenerated(tmp_path / "clean").to_list()}
    written = load_regenerated(tmp_path / "cut").to_list()
    assert [row["id"] for row in written] == [p["id"] for p in prompts if p["id"] != "p6"]
    assert written == [clean[row["id"]] for row in written]
    save_compact(tmp_path / "cut", tmp_path / "rows.npz")
    assert sorted(load_compact(tmp_path / "rows.npz")["id"]) == sorted(row["id"] for row in written)  # p6 is not


def test_one_deadline_bounds_a_whole_request_however_steadily_bytes_come(tokenizer):
    """A server that trickles its answer (headers included), every piece well within the per-read timeout, holds a
    request no longer than the deadline: the attempt is cut there and retried, and a request that trickles at every
    attempt fails, naming the deadline."""
    import time

    key = (3, 7, 4)
    pieces, every, deadline = 40, 0.2, 0.8  # 7.8 s of trickle per attempt, a piece every 0.2 s
    slack = 2.0  # seconds an attempt may run past its deadline on a loaded host (the timer, the retry's backoff)
    trickling = FakeOpenAIServer(hashed_answer(), lambda k: ["trickle"] * 3, trickle=every, trickle_pieces=pieces)
    with trickling as server:
        client = CompletionsServer(server.url, timeout=1.0, deadline=deadline, retry_delay=0.01, max_attempts=2)
        start = time.perf_counter()
        with pytest.raises(CompletionFailed, match=rf"2 attempts: no whole answer within {deadline:g} s x2"):
            client.complete(list(key), 4)
        assert 2 * deadline <= time.perf_counter() - start < 2 * (deadline + slack)  # cut at the deadline, twice
        start = time.perf_counter()
        assert client.complete(list(key), 4).token_ids == hashed_answer()(list(key), 4)[0]  # the 3rd trickles, 4th ok
        assert deadline <= time.perf_counter() - start < deadline + slack
        assert server.faults_of(key) == ["trickle", "trickle", "trickle", "ok"]
    # a server that sends the same answer at once is answered well within the deadline
    with FakeOpenAIServer(hashed_answer()) as server:
        client = CompletionsServer(server.url, timeout=1.0, deadline=0.8)
        assert client.complete(list(key), 4).token_ids == hashed_answer()(list(key), 4)[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_attempts": 0}, "expected max_attempts to be an int >= 1"),
        ({"retry_delay": -1}, r"expected retry_delay in \[0, 60\] seconds"),
        ({"timeout": 0}, "expected timeout > 0 seconds"),
        ({"deadline": 0}, "expected deadline > 0 seconds"),
    ],
)
def test_bad_retry_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompletionsServer("http://127.0.0.1:1", model="m", **kwargs)
