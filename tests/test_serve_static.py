"""`jetspec serve --static eager|compile` (`jetspec/serve_static.py`): every call of the server on the static path, in
process (`build_handlers`, called as the app calls it, on a tiny random float32 target with a one-token-per-character
tokenizer, as tests/test_serve_protocol.py does). Eager only: compiling costs about half a minute per shape on a CPU
(the compiled path's tokens are tests/test_static.py's `test_compiled_path_matches_greedy`).

a) Lossless: with `--static eager`, every answer (chat and completions, streamed and not) is the answer without it and
   plain greedy's, token for token; the calls did take the static path (its verifiers are recorded).
b) Requests that share one call (`--max-batch`) take the static path too, at the call's batch, each answer its lone
   one.
c) The warm-up: before the handlers exist, one call at batch 1 and one at the batch cap, each with its progress line,
   on the inference thread that then serves, at the cache length that the first chat request without `max_tokens`
   gets; a server with an answer cache warms up its larger trees, and its cache is left empty.
d) Refused at start-up, by name: a sliding-window target, a head with `path_conditioning`, a bad `--static` value (in
   process and through `jetspec serve`, before serving).
"""

import logging
import re
import threading
from types import SimpleNamespace

import pytest
from test_bench import char_tokenizer
from test_serve_protocol import NAME, call, call_together, chat_body, events, plain, prompt, streamed_message

import modeling_jetspec.integration as integration
from jetspec import cli
from jetspec.serve import build_handlers
from jetspec.serve_limits import Limits, check_arguments
from jetspec.serve_static import check_static, warm_up
from jetspec.tiny import tiny_head, tiny_target

TEXTS = ["Write a haiku.", "What is 2 + 3?"]
CONTEXT = 256  # a request without max_tokens asks for the rest of it: short, and another cache length than 24 tokens


def tiny_pair(arch: str = "llama", **head_fields):
    target = tiny_target(arch, vocab_size=100, max_position_embeddings=CONTEXT)
    # a lookup branch, as the committed head has: some drafts are accepted, so compaction moves nodes
    return target, tiny_head(
        target, **{"tree_depth": 4, "tree_width": 3, "tree_budget": 12, "tree_lookup": 6, **head_fields}
    )


def handlers(target, head, static=None, max_batch: int = 1, answer_cache: int = 0) -> SimpleNamespace:
    limits = Limits(static=static, answer_cache=answer_cache)
    chat, completions = build_handlers(target, char_tokenizer(), head, NAME, limits, max_batch)
    return SimpleNamespace(chat=chat, completions=completions)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def servers(pair):
    """The same target and head served without the static path and with `--static eager`."""
    target, head = pair
    return {None: handlers(target, head), "eager": handlers(target, head, "eager")}


@pytest.fixture
def built(monkeypatch):
    """The static verifiers the calls build, each with the thread that built it (the call's thread)."""
    made = []
    original = integration.static_verifier

    def recording(*args, **kwargs):
        made.append((original(*args, **kwargs), threading.current_thread()))
        return made[-1][0]

    monkeypatch.setattr(integration, "static_verifier", recording)
    return made


def answer_of(reply, endpoint: str, stream: bool) -> tuple:
    """`(text, token ids)` of a reply: a JSON body, or a stream's raw SSE text."""
    if not stream:
        choice = reply["choices"][0]
        return choice["message"]["content"] if endpoint == "chat" else choice["text"], reply["jetspec"]["token_ids"]
    if endpoint == "chat":
        message, finish = streamed_message(reply)
        return message["content"], finish["jetspec"]["token_ids"]
    got = [event for event in events(reply) if event["choices"]]
    finish = next(event for event in got if event["choices"][0].get("finish_reason"))
    return "".join(event["choices"][0].get("text") or "" for event in got), finish["jetspec"]["token_ids"]


def body_of(endpoint: str, text: str, **fields) -> dict:
    if endpoint == "chat":
        return chat_body(text, **fields)
    return {"model": NAME, "prompt": text, "return_token_ids": True, **fields}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_answers_on_the_static_path_are_those_without_it_and_plain_greedys(servers, pair, built, endpoint, stream):
    target, _ = pair
    tokenizer = char_tokenizer()
    for text in TEXTS:
        body = body_of(endpoint, text, max_tokens=24, temperature=0, stream=stream)
        before = len(built)
        off = answer_of(call(getattr(servers[None], endpoint), body), endpoint, stream)
        assert len(built) == before  # the default path builds no static verifier
        on = answer_of(call(getattr(servers["eager"], endpoint), body), endpoint, stream)
        ids = prompt(tokenizer, text) if endpoint == "chat" else tokenizer(text, return_tensors="pt")["input_ids"]
        want = plain(target, ids, 24)
        assert on == off and on[1] == want, (text, on, off)
        assert on[0] == tokenizer.decode(want, skip_special_tokens=True)
    assert [(verifier.mode, verifier.batch, verifier.compiled) for verifier, _ in built] == [("eager", 1, False)] * 2


def test_requests_sharing_a_call_take_the_static_path_at_the_calls_batch(servers, pair, built):
    target, _ = pair
    tokenizer = char_tokenizer()
    wanted = [plain(target, prompt(tokenizer, text), n) for text, n in zip(TEXTS, (20, 13))]
    bodies = [
        chat_body(TEXTS[0], max_tokens=20, temperature=0),
        chat_body(TEXTS[1], max_tokens=13, temperature=0, stream=True),  # leaves the call before the other row
    ]
    whole, stream = call_together(SimpleNamespace(chat=servers["eager"].chat), bodies)
    message, finish = streamed_message(stream)
    assert [whole["jetspec"]["batch"], finish["jetspec"]["batch"]] == [2, 2]
    assert [whole["jetspec"]["token_ids"], finish["jetspec"]["token_ids"]] == wanted
    assert message["content"] == tokenizer.decode(wanted[1], skip_special_tokens=True)
    assert [(verifier.mode, verifier.batch) for verifier, _ in built] == [("eager", 2)]


def test_the_warm_up_runs_on_the_serving_thread_at_the_first_requests_cache_length(pair, built, caplog):
    target, head = pair
    with caplog.at_level(logging.INFO, logger="jetspec.serve"):
        server = handlers(target, head, "eager", max_batch=3)
    warmed = list(built)
    assert [verifier.batch for verifier, _ in warmed] == [1, 3]
    columns = warmed[0][0].length
    assert warmed[1][0].length == columns
    lines = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    assert len(lines) == 2, lines
    for index, (line, batch) in enumerate(zip(lines, (1, 3)), 1):
        assert re.match(
            rf"jetspec serve: warm-up {index}/2: static eager, batch {batch}, cache {columns} \.\.\. ", line
        )
    assert "warmed up at batch 1 and 3 and a cache of" in caplog.text
    # the first chat request without max_tokens: the warm-up's cache length, on the warm-up's thread
    reply = call(server.chat, chat_body(TEXTS[0], temperature=0))
    tokenizer = char_tokenizer()
    ids = prompt(tokenizer, TEXTS[0])
    assert reply["jetspec"]["token_ids"] == plain(target, ids, CONTEXT - ids.shape[1])
    (request, thread), threads = built[-1], {thread for _, thread in warmed}
    assert request.length == columns and threads == {thread} and thread is not threading.main_thread()


def test_a_server_with_an_answer_cache_warms_up_its_larger_trees_and_keeps_its_cache_empty(built):
    # a budget above the full tree and its lookup chain: the answers' trie adds nodes to each tree
    target, head = tiny_pair(tree_depth=2, tree_width=2, tree_budget=40, tree_lookup=2)
    server = handlers(target, head, "eager", answer_cache=4)
    plain_trees = warm_up(target, char_tokenizer(), head, "eager")
    assert [verifier.answers for verifier, _ in built] == [True, False]
    assert built[0][0].nodes > built[1][0].nodes  # the answers' trie joins each tree: another shape to warm up
    assert len(server.chat.generation_state.manager.answer_cache) == 0
    assert [run["batch"] for run in plain_trees] == [1] and warm_up(target, char_tokenizer(), head, None) == []


@pytest.mark.parametrize(
    "arch,head_fields,message",
    [
        ("mistral", {}, "expected a target without sliding-window layers on the static path"),
        ("llama", {"path_conditioning": True, "tree_lookup": 0}, "expected path_conditioning=False on the static path"),
    ],
    ids=["sliding-window", "path-conditioning"],
)
def test_what_the_static_path_refuses_is_refused_at_start_up(arch, head_fields, message):
    target, head = tiny_pair(arch, **head_fields)
    for check in (
        lambda: check_static(target, head, "compile"),
        lambda: handlers(target, head, "eager"),
        lambda: handlers(target, head, "compile", max_batch=2),
    ):
        with pytest.raises(ValueError, match=message):
            check()
    check_static(target, head, None)  # the default path serves them
    handlers(target, head)
    with pytest.raises(ValueError, match=r"expected --static off, eager or compile .*got 'fast'"):
        handlers(target, head, "fast")


def test_jetspec_serve_refuses_them_before_serving(capsys, tmp_path):
    target, head = tiny_pair("mistral")
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "head")
    argv = ["serve", "--model", str(tmp_path / "target"), "--head", str(tmp_path / "head"), "--dtype", "float32"]
    argv += ["--device", "cpu", "--max-batch", "1"]
    for extra, words in [
        (["--static", "fast"], "argument --static: expected off, eager or compile, got 'fast'"),
        (["--static", "eager"], "error: expected a target without sliding-window layers on the static path"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:  # after the target loads, before serving
            cli.main([*argv, *extra])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and words in last, (extra, last)
    parser = cli.build_parser()
    assert check_arguments(parser.parse_args(argv))[3].static is None  # the default, off: the default path
    assert check_arguments(parser.parse_args([*argv, "--static", "compile"]))[3].static == "compile"
