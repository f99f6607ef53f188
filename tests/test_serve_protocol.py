"""`jetspec serve`'s protocol, in process: transformers' handlers as `jetspec serve` builds them (`build_handlers`),
called as the app calls them, without a server process (tests/test_serve.py has the real process and the `openai`
client). Two tiny random targets: the char-tokenizer llama of the serve tests, and a qwen3 whose chat template ends
its generation prompt as Qwen3's does (`<think>\\n` when the message starts with `/think`, else an empty thinking
block), so that transformers' built-in qwen3 response template parses its answers (content and reasoning text).

a) The request bodies LangChain's (0.1 and 0.3 era) and LiteLLM's OpenAI clients send are accepted, and answered as
   the same request without their harmless fields, token for token; a value that would change the answer is
   refused by name.
b) Stop strings on the response-template target: content and reasoning text end before the stop string, streamed
   and not; the tokens are `generate(stop_strings=...)`'s.
c) `finish_reason` is `stop` when an end-of-sequence token or a stop string ends the answer, even on its last
   allowed token, and `length` when `max_tokens` does.
d) Streams: no event waits for the next one; an error is OpenAI's error object, without internal text.
e) `--request-timeout`: a decoding request ends at its deadline with `length`; a request still waiting then gets a
   503 and is never decoded. `--device`: checked, and served on CUDA where there is one (skipped by name elsewhere).
f) Requests that share one call (`--max-batch`) are answered as lone ones: each stream its own finish reason, usage
   chunk and `[DONE]`; stop strings cut content and reasoning text on the response-template target; a failed call an
   error without internal text to each, under its own request id; the queue limit and the 503 as above.
"""

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from jetspec.serve import build_handlers
from jetspec.serve_limits import Limits, api_key_from, check_arguments
from jetspec.serve_requests import HARMLESS, RequestError, Job, check_request
from jetspec.serve_stream import shaped_stream
from test_bench import char_tokenizer
from jetspec.tiny import tiny_head, tiny_target

NAME = "tiny"
QWEN_SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if messages[-1]['content'].startswith('/think') %}"
    "<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, Qwen's chat markers and thinking tags as special tokens."""
    return char_tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE)


def served(arch: str, tokenizer, vocab_size: int, limits=None, max_batch: int = 1) -> SimpleNamespace:
    target = tiny_target(arch, vocab_size=vocab_size, max_position_embeddings=4096)
    head = tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12)
    chat, completions = build_handlers(target, tokenizer, head, NAME, limits, max_batch)
    return SimpleNamespace(target=target, tokenizer=tokenizer, chat=chat, completions=completions)


@pytest.fixture(scope="module")
def llama():
    return served("llama", char_tokenizer(), 100)


@pytest.fixture(scope="module")
def qwen():
    return served("qwen3", qwen_tokenizer(), len(QWEN_SPECIALS) + 96)


def call(handler, body: dict, request_id: str = "req-1"):
    """The handler's answer: the JSON body, or a stream's raw SSE text."""

    async def run():
        response = await handler.handle_request(json.loads(json.dumps(body)), request_id)
        if hasattr(response, "body_iterator"):
            return "".join([piece async for piece in response.body_iterator])
        return json.loads(response.body)

    return asyncio.run(run())


def events(stream: str) -> list:
    """A stream's events as JSON, checking the SSE framing: `data: ` events, blank-line separated, `[DONE]` last."""
    assert stream.endswith("data: [DONE]\n\n"), stream[-300:]
    parts = stream.split("\n\n")
    assert parts[-1] == "" and all(part.startswith("data: ") for part in parts[:-1]), stream[:300]
    return [json.loads(part.removeprefix("data: ")) for part in parts[:-2]]


def chat_body(text: str, **fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": text}], "return_token_ids": True, **fields}


def streamed_message(stream: str) -> tuple[dict, dict]:
    """A chat stream's message (content and reasoning text joined from the deltas), and its finish chunk."""
    got = events(stream)
    finish = next(event for event in got if event["choices"] and event["choices"][0].get("finish_reason"))
    deltas = [event["choices"][0]["delta"] for event in got if event["choices"]]
    message = {key: "".join(d.get(key) or "" for d in deltas) for key in ("content", "reasoning_content")}
    return message, finish


def prompt(tokenizer, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def plain(target, ids, new: int, **kwargs) -> list:
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kwargs)
    return out[0, ids.shape[1] :].tolist()


# a) the bodies clients send: (client, endpoint, body) with a user's max_tokens 8 and temperature 0
CLIENT_BODIES = [
    (  # langchain-openai 0.1, ChatOpenAI(temperature=0, max_tokens=8).invoke(...)
        "langchain 0.1 chat",
        "chat",
        {"messages": [], "model": NAME, "max_tokens": 8, "n": 1, "stream": False, "temperature": 0.0},
    ),
    (  # langchain-openai 0.1, OpenAI(temperature=0, max_tokens=8).invoke(...): the legacy completions defaults
        "langchain 0.1 completions",
        "completions",
        {
            "prompt": "",
            "model": NAME,
            "temperature": 0.0,
            "top_p": 1,
            "frequency_penalty": 0,
            "presence_penalty": 0,
            "n": 1,
            "seed": None,
            "logprobs": None,
            "logit_bias": {},
            "max_tokens": 8,
        },
    ),
    (  # langchain-openai 0.3, ChatOpenAI(temperature=0, max_completion_tokens=8, stream_usage=True).stream(...)
        "langchain 0.3 chat stream",
        "chat",
        {
            "messages": [],
            "model": NAME,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            "max_completion_tokens": 8,
        },
    ),
    (  # litellm.completion(model="openai/...", ..., user=..., metadata=...) through the openai client
        "litellm chat",
        "chat",
        {
            "model": NAME,
            "messages": [],
            "max_tokens": 8,
            "temperature": 0,
            "user": "litellm-user",
            "metadata": {"trace": "abc"},
            "logprobs": False,
            "response_format": {"type": "text"},
            "parallel_tool_calls": False,
            "store": False,
            "service_tier": "auto",
            "extra_headers": None,
        },
    ),
]


@pytest.mark.parametrize("client, endpoint, body", CLIENT_BODIES, ids=[c[0] for c in CLIENT_BODIES])
def test_client_bodies_are_answered_as_without_their_harmless_fields(llama, client, endpoint, body):
    body = {key: value for key, value in body.items() if key != "extra_headers"}  # the client's, not the body's
    text = "What is 2 + 3?"
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    handler = getattr(llama, endpoint)
    bare = {"model": NAME, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    bare.update({"messages": body["messages"]} if endpoint == "chat" else {"prompt": text})
    expected = call(handler, bare)["jetspec"]["token_ids"]
    got = call(handler, {**body, "return_token_ids": True})
    if body.get("stream"):
        stream = events(got)
        assert stream[-1]["choices"] == [] and stream[-1]["usage"]["completion_tokens"] == 8  # asked for usage
        got = next(event for event in stream if "jetspec" in event)
    assert got["jetspec"]["token_ids"] == expected, client


def test_each_harmless_field_is_refused_by_name_with_a_value_that_would_change_the_answer():
    changing = {  # a value per field that the server could not honour
        "n": 2,
        "user": 3,
        "safety_identifier": [],
        "prompt_cache_key": 1,
        "metadata": {"a": 1},
        "store": True,
        "service_tier": "flex",
        "frequency_penalty": 0.5,
        "presence_penalty": -1,
        "logit_bias": {"5": 10},
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_object"},
        "modalities": ["text", "audio"],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "functions": [{"name": "f"}],
        "tool_choice": "required",
        "function_call": {"name": "f"},
        "parallel_tool_calls": "yes",
        "reasoning_effort": "high",
        "verbosity": "low",
        "prediction": {"type": "content", "content": "x"},
        "audio": {"voice": "alloy"},
        "web_search_options": {},
    }
    assert set(changing) == set(HARMLESS)  # every harmless field is tried
    for name, value in changing.items():
        body = chat_body("hi", **{name: value})
        with pytest.raises(RequestError) as refused:
            check_request(body, "chat", NAME)
        assert refused.value.param == name and f"expected {name} to be" in str(refused.value), name
        assert refused.value.status == 400
    body = {"model": NAME, "prompt": "a", "stream_options": {"include_usage": True}, "echo": False, "logprobs": None}
    job = check_request(body, "completions", NAME)
    assert job.include_usage and set(body) == {"model", "prompt"}  # accepted, and kept from transformers' handler
    for field, value in (("echo", True), ("logprobs", 0), ("suffix", "x"), ("best_of", 2)):
        with pytest.raises(RequestError, match=f"expected {field} to be"):
            check_request({"model": NAME, "prompt": "a", field: value}, "completions", NAME)


def first_new_pair(text: str, start: int) -> int:
    """The first index from `start` where two characters begin that do not occur before: a stop string there."""
    return next(i for i in range(start, len(text) - 1) if text.find(text[i : i + 2]) == i)


@pytest.mark.parametrize("think", [False, True], ids=["content", "reasoning"])
def test_stop_strings_on_a_response_template_target_end_content_and_reasoning(qwen, think):
    text = ("/think " if think else "") + "Why is the sky blue?"
    ids = prompt(qwen.tokenizer, text)
    full = qwen.tokenizer.decode(plain(qwen.target, ids, 24), skip_special_tokens=False)
    at = first_new_pair(full, 4)
    assert not think or at + 2 < full.index("</think>")  # inside the thinking block: the reasoning text is cut
    stop = full[at : at + 2]
    tokens = plain(qwen.target, ids, 24, stop_strings=[stop], tokenizer=qwen.tokenizer)
    field = "reasoning_content" if think else "content"
    answer = call(qwen.chat, chat_body(text, max_tokens=24, temperature=0, stop=[stop, "never"]))
    message = answer["choices"][0]["message"]
    assert answer["jetspec"]["token_ids"] == tokens and len(tokens) < 24
    assert message[field] == full[:at] and answer["choices"][0]["finish_reason"] == "stop"
    if think:  # the answer stopped inside its thinking block: no content
        assert message["content"] == ""
    stream = call(qwen.chat, chat_body(text, max_tokens=24, temperature=0, stop=[stop], stream=True))
    streamed, finish = streamed_message(stream)
    assert streamed[field].strip("\n") == full[:at].strip("\n") and stop not in json.dumps(streamed)
    assert finish["jetspec"]["token_ids"] == tokens and finish["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("target", ["llama", "qwen"])
def test_an_end_of_sequence_token_ends_with_stop_even_on_the_last_allowed_token(request, target):
    model = request.getfixturevalue(target)
    text = "Count to five."
    greedy = plain(model.target, prompt(model.tokenizer, text), 24)
    k = next(i for i in range(3, 24) if greedy[i] not in greedy[:i])  # its first time: generation ends there
    config = model.target.generation_config
    saved = config.eos_token_id
    config.eos_token_id = greedy[k]
    try:
        for stream in (False, True):
            for max_tokens, reason in ((k + 1, "stop"), (k, "length"), (k + 5, "stop")):
                got = call(model.chat, chat_body(text, max_tokens=max_tokens, temperature=0, stream=stream))
                finish = streamed_message(got)[1] if stream else got
                assert finish["choices"][0]["finish_reason"] == reason, (stream, max_tokens)
                assert finish["jetspec"]["token_ids"] == greedy[: min(k + 1, max_tokens)]
    finally:
        config.eos_token_id = saved


def test_a_stop_string_completed_on_the_last_allowed_token_ends_with_stop(llama):
    text = "Name a colour."
    ids = prompt(llama.tokenizer, text)
    greedy = plain(llama.target, ids, 16)
    full = llama.tokenizer.decode(greedy)
    stop = full[4:6]
    assert full.index(stop) == 4 and len(full) == len(greedy)  # one character per token: it ends on token 6
    for stream in (False, True):
        for max_tokens, reason in ((6, "stop"), (5, "length")):
            body = chat_body(text, max_tokens=max_tokens, temperature=0, stop=stop, stream=stream)
            got = call(llama.chat, body)
            finish = streamed_message(got)[1] if stream else got
            assert finish["choices"][0]["finish_reason"] == reason, (stream, max_tokens)


def test_a_stream_passes_each_event_as_it_comes():
    """The next piece is made only once the previous one came out: a stream that held one back would hang."""
    job = Job(endpoint="chat", report={"tau": 1.0}, new_ids=[5], eos_ids=(5,))
    released = asyncio.Event()

    async def pieces():
        yield 'data: {"choices": [{"delta": {"role": "assistant"}, "index": 0}]}\n\n'
        await released.wait()
        yield 'data: {"id": "x", "choices": [{"delta": {}, "index": 0, "finish_reason": "length"}], "usage": {}}\n\n'

    async def read():
        stream = shaped_stream(pieces(), job)
        first = await asyncio.wait_for(stream.__anext__(), timeout=5)
        released.set()
        return first, [piece async for piece in stream]

    first, rest = asyncio.run(read())
    assert '"role": "assistant"' in first
    last = json.loads(rest[0].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "stop" and last["jetspec"] == {"tau": 1.0}  # it ended on EOS
    assert "usage" in last and rest[1:] == ["data: [DONE]\n\n"]  # no usage chunk unless asked


def test_an_error_inside_a_stream_is_an_openai_error_object_without_internal_text(llama, caplog):
    # a temperature so small that sampling's probabilities overflow: `generate` raises after the stream began
    body = chat_body("hi", max_tokens=4, temperature=1e-300, stream=True)
    with caplog.at_level("ERROR", logger="jetspec.serve"):
        got = events(call(llama.chat, body, request_id="req-broken"))
    error = got[-1]["error"]
    assert error["message"] == "internal error while answering request req-broken; the server's log has its details"
    assert (error["type"], error["code"]) == ("server_error", "internal")
    assert "req-broken" in caplog.text and "probability" in caplog.text  # the log has what the client does not


def test_a_decoding_request_ends_at_its_deadline_with_length():
    model = served("llama", char_tokenizer(), 100, Limits(request_timeout=0.3))
    got = call(model.completions, {"model": NAME, "prompt": "abc", "max_tokens": 3000, "temperature": 0})
    assert got["choices"][0]["finish_reason"] == "length" and got["usage"]["completion_tokens"] < 3000


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_request_still_waiting_at_its_deadline_gets_503_and_is_never_decoded(max_batch):
    model = served("llama", char_tokenizer(), 100, Limits(request_timeout=0.3, max_queue=1), max_batch)
    manager = model.chat.generation_state.manager
    busy, decoded = threading.Event(), []
    original = manager.decode
    manager.decode = lambda job, *args, **kwargs: decoded.append(job) or original(job, *args, **kwargs)
    joined = manager.scheduler.decode_joined  # with a cap above 1, a greedy request decodes in a call others may join
    manager.scheduler.decode_joined = lambda rows: decoded.extend(row.job for row in rows) or joined(rows)
    manager.submit(busy.wait, 30)  # the inference thread is taken

    async def scenario():  # one event loop, alive while the thread hands the skipped requests back
        refusals = []
        for stream in (False, True):
            try:
                await model.chat.handle_request(chat_body("hi", max_tokens=2, stream=stream), f"late-{stream}")
            except RequestError as error:
                refusals.append(error)
        busy.set()
        answer = await model.chat.handle_request(chat_body("hi", max_tokens=2), "in-time")
        return refusals, json.loads(answer.body)

    try:
        refusals, answer = asyncio.run(scenario())
    finally:
        busy.set()
    assert [(error.status, error.code) for error in refusals] == [(503, "timeout")] * 2
    assert "request timeout of 0.3 s" in str(refusals[0])
    assert answer["usage"]["completion_tokens"] == 2  # the thread is free again: answered as usual
    # the expired ones were skipped: alone, by `decode`'s `begin`; sharing a call, before it (they never reach it)
    assert [job.admission.begun for job in decoded] == ([False, False, True] if max_batch == 1 else [True])


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_full_queue_is_answered_429_with_retry_after(max_batch):
    model = served("llama", char_tokenizer(), 100, Limits(max_queue=1), max_batch)
    manager = model.chat.generation_state.manager
    busy = threading.Event()
    manager.submit(busy.wait, 30)

    async def three():
        first = asyncio.ensure_future(model.chat.handle_request(chat_body("a", max_tokens=2), "r1"))
        await asyncio.sleep(0.05)  # it waits for the thread
        with pytest.raises(RequestError) as refused:
            await model.chat.handle_request(chat_body("b", max_tokens=2), "r2")
        busy.set()
        return refused.value, await first

    refused, first = asyncio.run(three())
    assert (refused.status, refused.code, refused.headers) == (429, "queue_full", {"Retry-After": "1"})
    assert json.loads(first.body)["usage"]["completion_tokens"] == 2


def call_together(model, bodies: list) -> list:
    """The chat answers of `bodies` (the JSON body, or a stream's raw SSE text), sent at once while the inference
    thread is held, so that they share its next call (the batch cap raised for them)."""
    manager = model.chat.generation_state.manager
    busy, cap = threading.Event(), manager.scheduler.max_batch
    manager.scheduler.max_batch = len(bodies)
    manager.submit(busy.wait, 30)

    async def run():
        tasks = [asyncio.ensure_future(model.chat.handle_request(b, f"r{i}")) for i, b in enumerate(bodies)]
        for _ in range(1000):  # each handler queues its row
            if len(manager.scheduler.waiting) == len(bodies):
                break
            await asyncio.sleep(0.01)
        busy.set()
        responses = await asyncio.gather(*tasks)
        return await asyncio.gather(*(read(response) for response in responses))

    async def read(response):
        if hasattr(response, "body_iterator"):
            return "".join([piece async for piece in response.body_iterator])
        return json.loads(response.body)

    try:
        return asyncio.run(run())
    finally:
        busy.set()
        manager.scheduler.max_batch = cap


def test_streams_sharing_a_call_each_get_their_own_usage_chunk_finish_reason_and_done(llama):
    texts = ["Name a colour.", "What is 2 + 3?"]
    ids = [prompt(llama.tokenizer, text) for text in texts]
    greedy = [plain(llama.target, ids[0], 9), plain(llama.target, ids[1], 14)]
    full = llama.tokenizer.decode(greedy[1])
    at = first_new_pair(full, 2)
    stop = full[at : at + 2]
    assert at + 2 < 14 and len(full) == 14  # one character per token: the second answer ends on token at + 2
    bodies = [
        chat_body(texts[0], max_tokens=9, temperature=0, stream=True, stream_options={"include_usage": True}),
        chat_body(texts[1], max_tokens=14, temperature=0, stream=True, stop=[stop]),
    ]
    streams = [events(stream) for stream in call_together(llama, bodies)]
    for got, tokens, reason in zip(streams, (greedy[0], greedy[1][: at + 2]), ("length", "stop")):
        finish = next(event for event in got if event["choices"] and event["choices"][0].get("finish_reason"))
        assert finish["jetspec"]["batch"] == 2 and finish["jetspec"]["token_ids"] == tokens
        assert finish["choices"][0]["finish_reason"] == reason
    usage = streams[0][-1]
    assert usage["choices"] == [] and usage["id"] == streams[0][0]["id"]  # OpenAI's usage chunk, after the finish
    assert usage["usage"]["completion_tokens"] == 9 and usage["usage"]["prompt_tokens"] == ids[0].shape[1]
    assert all(event["choices"] for event in streams[1])  # no usage chunk unless asked
    content = "".join(event["choices"][0]["delta"].get("content") or "" for event in streams[1])
    assert content == full[:at]


@pytest.mark.parametrize("stream", [False, True])
def test_rows_sharing_a_call_on_a_response_template_target_end_content_and_reasoning_at_their_stops(qwen, stream):
    texts, wanted, bodies = ["Why is the sky blue?", "/think Why is the sky blue?"], [], []
    for text in texts:
        ids = prompt(qwen.tokenizer, text)
        full = qwen.tokenizer.decode(plain(qwen.target, ids, 24), skip_special_tokens=False)
        at = first_new_pair(full, 4)
        tokens = plain(qwen.target, ids, 24, stop_strings=[full[at : at + 2]], tokenizer=qwen.tokenizer)
        wanted.append((full[:at], tokens))
        bodies.append(chat_body(text, max_tokens=24, temperature=0, stop=[full[at : at + 2]], stream=stream))
    answers = call_together(qwen, bodies)
    for answer, field, (text, tokens) in zip(answers, ("content", "reasoning_content"), wanted):
        message, finish = streamed_message(answer) if stream else (answer["choices"][0]["message"], answer)
        assert finish["jetspec"]["batch"] == 2 and finish["jetspec"]["token_ids"] == tokens
        assert message[field].strip("\n") == text.strip("\n") and finish["choices"][0]["finish_reason"] == "stop"


def test_a_failed_shared_call_answers_each_row_with_its_own_request_id_and_no_internal_text(llama, caplog):
    # a temperature so small that sampling's probabilities overflow: the shared call raises after the streams began
    bodies = [
        chat_body("hi", max_tokens=4, temperature=1e-300, stream=True),
        chat_body("yo", max_tokens=4, temperature=1e-300),
    ]
    with caplog.at_level("ERROR", logger="jetspec.serve"):
        streamed, answered = call_together(llama, bodies)
    message = "internal error while answering request {}; the server's log has its details"
    assert events(streamed)[-1]["error"]["message"] == message.format("r0")
    assert answered["error"]["message"] == message.format("r1") and answered["error"]["code"] == "internal"
    assert "r0" in caplog.text and "r1" in caplog.text and "probability" in caplog.text


def device_args(**given) -> SimpleNamespace:
    return SimpleNamespace(
        **{
            "device": None,
            "dtype": "auto",
            "api_key": None,
            "max_queue": None,
            "answer_cache": 0,
            "static": "off",
            "join": "on",
            **given,
        }
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_device_defaults_to_the_cpu_and_refuses_cuda_where_there_is_none(monkeypatch):
    monkeypatch.setenv("JETSPEC_API_KEY", "from-env")
    device, dtype, _, limits = check_arguments(device_args(request_timeout=None))
    assert device == "cpu" and dtype in (torch.float32, torch.bfloat16) and limits.api_key == "from-env"
    for name, words in (("cuda", "no CUDA device"), ("tpu", "expected --device cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=words):
            check_arguments(device_args(device=name, request_timeout=None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: --device cuda")
def test_served_on_cuda_by_default_in_bf16_and_float32_answers_are_plain_generate():
    device, dtype, _, _ = check_arguments(device_args(request_timeout=None))
    assert (device, dtype) == ("cuda", torch.bfloat16)
    target = tiny_target("llama", vocab_size=100, max_position_embeddings=4096).to(device)
    head = tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12).to(device)
    chat, _ = build_handlers(target, char_tokenizer(), head, NAME)
    ids = prompt(char_tokenizer(), "What is 2 + 3?").to(device)
    for stream in (False, True):
        got = call(chat, chat_body("What is 2 + 3?", max_tokens=16, temperature=0, stream=stream))
        finish = streamed_message(got)[1] if stream else got
        assert finish["jetspec"]["token_ids"] == plain(target, ids, 16)


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv("JETSPEC_API_KEY", raising=False)
    assert (api_key_from(None), api_key_from("flag")) == (None, "flag")
    monkeypatch.setenv("JETSPEC_API_KEY", "env")
    assert (api_key_from(None), api_key_from("flag"), api_key_from("")) == ("env", "flag", None)  # empty: no key
