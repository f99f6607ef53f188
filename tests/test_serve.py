"""`jetspec serve` (`jetspec/serve.py`): a real server process, talked to through the real `openai` client.

A tiny random target (with a one-token-per-character tokenizer and a chat template) and a head are written to
folders; `python -m jetspec serve` is started on them once for the module, on a free loopback port, one thread, and
stopped at its end. The same folders are loaded in this process for the references. What the tests add to the rest
of the suite (which checks the tree route inside `generate`): that a request through HTTP reaches exactly that route.

a) Greedy (float32): every answer, chat and completions, streamed and not, is plain `generate`'s, token for token
   (the ids come back with `return_token_ids`), and its text; its statistics are those of the same call in process.
b) Sampling: the server's call is the direct `generate(..., assistant_model=head, do_sample=True, temperature,
   top_p)` of the same seed, token for token, and one seed gives one answer. That the tree route's samples follow
   plain sampling's distribution is tests/test_sampling.py's chi-square test (thousands of samples, one batched call
   each): through HTTP, one request per sample, it would cost minutes; what the server adds is which call it makes,
   and that is checked here exactly.
c) `stop`: the text ends before the stop string, the tokens where `generate(stop_strings=...)` ends them.
d) 1, 4 and 8 concurrent clients (greedy and seeded sampling, both endpoints, streamed and not): each gets its
   one-client answer (requests run one at a time on the inference thread, the seed set right before each call).
e) Bad requests: a 4xx with an OpenAI-shaped error naming the problem, and the server keeps serving.
f) A client that disconnects mid-stream stops its generation (the server's log says after how many tokens).
g) `transformers serve` on the same folder, without the head, gives the same greedy answers (marked slow-ish: one
   more server process).
h) Streams read as raw bytes (the `openai` client hides missing framing): `data: ` events, the finish chunk with the
   statistics, OpenAI's usage chunk when asked for, `data: [DONE]`; through the `openai` client, the usage chunk and
   the message of an error inside a stream.
i) The server runs with an API key and a queue limit (as a deployment does): a request without the key gets a 401;
   one more request than the queue holds, while one decodes, a 429 with `Retry-After`.
(tests/test_serve_protocol.py checks the rest of the protocol in process: client bodies, finish reasons, stop
strings on a response-template target, deadlines, `--device`.)
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from test_bench import char_tokenizer

from jetspec.cli import load_head
from jetspec.serve_requests import StopTrimmer
from jetspec.targets import load_target
from jetspec.tiny import tiny_head, tiny_target

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny-served"
PROMPTS = [
    "What is 2 + 3?",
    "Name a colour.",
    "abc abc abc",
    "Write a haiku.",
    "def f(x): return x",
    "Count to five.",
    "Hello there!",
    "1, 2, 3, 4,",
    "Why is the sky blue?",
    "The quick brown fox",
]
NEW = 16
SAMPLING = {"temperature": 0.9, "top_p": 0.95}
KEY = "none"  # what the `openai` clients here, and scripts/serve_bench.py, send
MAX_QUEUE = 8


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server process on a free loopback port; its stderr goes to `log`."""

    def __init__(self, command: list, log: Path, name: str, key: str = "none", env: dict = None):
        self.port, self.log, self.name = free_port(), log, name
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        with open(log, "w") as err:
            self.process = subprocess.Popen(
                [*command, "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def wait(self, seconds: float = 240):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"expected the server to start, it exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        pytest.fail(f"expected the server to answer at {self.url} within {seconds} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    target = tiny_target("llama", vocab_size=100, max_position_embeddings=4096)  # ids < 100: the tokenizer's
    # a lookup branch, as the committed head has: answers take tokens from it, and the statistics count them
    head = tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12, tree_lookup=6)
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    head.save_pretrained(root / "head")
    return root


@pytest.fixture(scope="module")
def local(folders):
    """The served target, tokenizer and head, loaded in this process as the server loads them."""
    target, tokenizer = load_target(str(folders / "target"), dtype=torch.float32)
    return target, tokenizer, load_head(folders / "head", target)


@pytest.fixture(scope="module")
def server(folders):
    """`jetspec serve` with an API key (from the environment: the `openai` clients here send it) and a queue limit of
    8 (the 8 concurrent clients below all fit)."""
    command = [sys.executable, "-m", "jetspec", "serve", "--model", str(folders / "target")]
    command += ["--head", str(folders / "head"), "--served-model-name", NAME, "--dtype", "float32", "--threads", "1"]
    command += ["--max-queue", str(MAX_QUEUE)]
    served = Server(command, folders / "jetspec-serve.log", NAME, key=KEY, env={"JETSPEC_API_KEY": KEY})
    try:
        yield served.wait()
    finally:
        served.stop()


def prompt_ids(tokenizer, endpoint: str, text: str) -> torch.Tensor:
    """`(1, P)`: the prompt as the server tokenizes it (the chat template for chat, the text as is otherwise)."""
    if endpoint == "chat":
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]


def direct(target, ids, head=None, seed=None, new=NEW, **kwargs):
    """The new tokens of `target.generate` in this process (with `head`: the tree route), and its output."""
    if seed is not None:
        torch.manual_seed(seed)
    extra = {} if head is None else {"assistant_model": head, "return_dict_in_generate": True}
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **kwargs, **extra)
    sequences = out if head is None else out.sequences
    return sequences[0, ids.shape[1] :].tolist(), out


def ask(client, endpoint: str, text: str, stream: bool = False, **fields) -> dict:
    """One request through the `openai` client: the answer's text, finish reason, usage and `jetspec` field."""
    fields = {"max_tokens": NEW, "extra_body": {"return_token_ids": True}, **fields}
    if endpoint == "chat":
        made = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": text}], stream=stream, **fields
        )
    else:
        made = client.completions.create(model=NAME, prompt=text, stream=stream, **fields)
    if not stream:
        choice = made.choices[0]
        content = choice.message.content if endpoint == "chat" else choice.text
        return {
            "text": content,
            "finish": choice.finish_reason,
            "usage": made.usage,
            "jetspec": made.model_extra["jetspec"],
        }
    pieces, last = [], None
    for chunk in made:
        delta = chunk.choices[0].delta.content if endpoint == "chat" else chunk.choices[0].text
        pieces.append(delta or "")
        last = chunk
    return {
        "text": "".join(pieces),
        "finish": last.choices[0].finish_reason,
        "usage": last.usage,
        "jetspec": last.model_extra["jetspec"],
    }


def test_the_app_keeps_transformers_routes_of_the_served_endpoints_only(local):
    from fastapi.routing import APIRoute

    from jetspec.serve import SERVED_ROUTES, build_app

    app = build_app(*local, NAME)
    # transformers' app builds these and more (responses, transcriptions, model loading and reset): the others go
    assert {r.path for r in app.router.routes if isinstance(r, APIRoute)} == set(SERVED_ROUTES)


def test_models_are_listed_without_the_hub(server):
    listed = server.client.models.list()
    assert [model.id for model in listed.data] == [NAME]  # HF_HUB_OFFLINE=1: transformers' own answers 500


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_greedy_answers_are_plain_generate_token_for_token(server, local, endpoint, stream):
    target, tokenizer, head = local
    for text in PROMPTS:
        ids = prompt_ids(tokenizer, endpoint, text)
        plain, _ = direct(target, ids, do_sample=False)
        answer = ask(server.client, endpoint, text, stream, temperature=0)
        got = answer["jetspec"]
        assert got["prompt_token_ids"] == ids[0].tolist()
        assert got["token_ids"] == plain, text
        assert answer["text"] == tokenizer.decode(plain, skip_special_tokens=True)
        assert (answer["finish"], answer["usage"].completion_tokens) == ("length", NEW)
        # the statistics are the call's: the same tree call in this process counts the same
        _, tree = direct(target, ids, head, do_sample=False)
        stats = tree.jetspec_stats
        assert (got["tau"], got["target_forwards"], got["rounds"]) == (stats.tau, stats.target_forwards, stats.rounds)
        assert got["acceptance_per_depth"] == stats.acceptance_per_depth
        assert sum(got["tokens_by_source"].values()) == NEW


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_seeded_sample_is_the_direct_tree_call_of_that_seed(server, local, endpoint):
    target, tokenizer, head = local
    text = PROMPTS[0]
    ids = prompt_ids(tokenizer, endpoint, text)
    greedy, _ = direct(target, ids, do_sample=False)
    answers = []
    for seed in (0, 1, 2):
        expected, _ = direct(target, ids, head, seed=seed, do_sample=True, **SAMPLING)
        for stream in (False, True):
            answer = ask(server.client, endpoint, text, stream, seed=seed, **SAMPLING)
            assert answer["jetspec"]["token_ids"] == expected, (seed, stream)
        answers.append(tuple(expected))
    assert len(set(answers)) == 3 and greedy not in [list(a) for a in answers]  # it samples, and seeds differ


def test_a_stop_string_ends_the_text_before_it_and_the_tokens_as_generate(server, local):
    target, tokenizer, head = local
    for endpoint, stream in (("completions", False), ("chat", True)):
        ids = prompt_ids(tokenizer, endpoint, PROMPTS[1])
        full = tokenizer.decode(direct(target, ids, do_sample=False)[0], skip_special_tokens=True)
        stop = full[6:8]
        expected, _ = direct(target, ids, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        answer = ask(server.client, endpoint, PROMPTS[1], stream, temperature=0, stop=[stop, "never there"])
        assert answer["jetspec"]["token_ids"] == expected and len(expected) < NEW
        assert answer["text"] == full[: full.index(stop)] and answer["finish"] == "stop"


def test_stop_trimmer_holds_back_what_may_start_a_stop_string():
    trimmer = StopTrimmer(("abc", "xy"))
    assert [trimmer.feed(piece) for piece in ("12a", "b", "3x", "z", "ab", "c", "more")] == [
        "12",
        "",
        "ab3",
        "xz",
        "",
        "",
        "",
    ]
    assert trimmer.finish() == ""
    trimmer = StopTrimmer(("abc",))
    assert trimmer.feed("zza") == "zz" and trimmer.finish() == "a"  # the text ended: the held tail was text
    assert StopTrimmer(("b", "ab")).trim("xxabyy") == "xx"  # the earliest stop string wins, not the first listed


def one_client_answer(local, request: dict, new: int) -> list:
    """What a request gets alone: plain greedy, or the seeded direct tree call."""
    target, tokenizer, head = local
    ids = prompt_ids(tokenizer, request["endpoint"], request["text"])
    if request["seed"] is None:
        return direct(target, ids, new=new, do_sample=False)[0]
    return direct(target, ids, head, seed=request["seed"], new=new, do_sample=True, **SAMPLING)[0]


@pytest.mark.parametrize("clients", [1, 4, 8])
def test_concurrent_clients_each_get_their_own_answer(server, local, clients):
    requests = []
    for i in range(clients):
        request = {"endpoint": ("chat", "completions")[i % 2], "text": PROMPTS[i], "stream": i % 4 >= 2}
        request["fields"] = {"temperature": 0} if i % 3 else {"seed": 10 + i, **SAMPLING}
        request["seed"] = request["fields"].get("seed")
        requests.append(request)
    answers, errors = [None] * clients, []
    barrier = threading.Barrier(clients)

    def run(index: int):
        request = requests[index]
        barrier.wait()
        try:
            answers[index] = ask(
                server.client,
                request["endpoint"],
                request["text"],
                request["stream"],
                max_tokens=32,
                **request["fields"],
            )
        except Exception as error:  # reported below, with the request
            errors.append((request, error))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and all(answer is not None for answer in answers), errors
    for request, answer in zip(requests, answers):
        assert answer["jetspec"]["token_ids"] == one_client_answer(local, request, 32), request
    if clients > 1:  # they overlapped: some request waited for another's generation, or joined its call
        waited = max(a["jetspec"]["queued_seconds"] for a in answers) > min(a["jetspec"]["seconds"] for a in answers)
        assert waited or any(a["jetspec"]["joined"] for a in answers)


def post(url: str, data: bytes, method: str = "POST", kind: str = "application/json", key=KEY, answer=None):
    """`(status, JSON body)` of a request sent without the `openai` client; its headers (lower-cased) go into
    `answer`."""
    headers = {"Content-Type": kind, **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            (answer if answer is not None else {}).update((k.lower(), v) for k, v in response.headers.items())
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        (answer if answer is not None else {}).update((k.lower(), v) for k, v in error.headers.items())
        return error.code, json.loads(error.read())


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (path, body: a dict, or raw bytes; status; words of the message; the field named)
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "expected model 'tiny-served'", "model"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, 400, "max_tokens to be an integer >= 1, got -3", "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 0}, 400, "integer >= 1, got 0", "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny-served", "messages": [', 400, "JSON object", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object", None),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "expected n to be 1", "n"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "expected logprobs to be false", "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "best_of": 3}, 400, "expected best_of to be 1", "best_of"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0.5}, 400, "frequency_penalty to be 0", "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "calls no tools", "tools"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"x": 1}}, 400, "include_usage", "stream_options"),
    ("/v1/chat/completions", {**CHAT, "best_of": 2}, 400, "got also best_of", "best_of"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature in [0, 2]", "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p in (0, 1]", "top_p"),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, 400, "seed to be an integer", "seed"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "1 to 4", "stop"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream to be true or false", "stream"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "non-empty list", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "role in", "messages[0]"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "text only",
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x", "name": "b"}]},
        400,
        "also name",
        "messages[0]",
    ),
    ("/v1/completions", {"model": NAME, "prompt": [1, 2, 3]}, 400, "non-empty string", "prompt"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5000}, 400, "the model's context of 4096", "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 5000}, 400, "shorter than the model's context", "prompt"),
    ("/v1/responses", {"model": NAME, "input": "hi"}, 404, "Not Found", None),
    ("/load_model", {"model": "gpt2"}, 404, "Not Found", None),
    ("/reset", {}, 404, "Not Found", None),
]


def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_keeps_serving(server):
    for path, body, status, words, param in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, answer = post(server.url + path, data)
        assert got == status, (path, body, answer)
        error = answer["error"]
        assert words in error["message"] and error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error" and "Traceback" not in json.dumps(answer)
    got, answer = post(server.url + "/v1/completions", b"", method="GET")
    assert got == 405 and "Method Not Allowed" in answer["error"]["message"]
    got, answer = post(
        server.url + "/v1/completions", json.dumps(CHAT).encode(), kind="application/x-www-form-urlencoded"
    )
    assert got == 400 and "not application/json" in answer["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="expected model 'tiny-served'"):  # what the client raises
        server.client.completions.create(model="other", prompt="a", max_tokens=2)
    assert ask(server.client, "completions", "still here", max_tokens=3)["usage"].completion_tokens == 3


def test_a_client_that_disconnects_mid_stream_stops_its_generation(server):
    longest = 4000
    stream = server.client.completions.create(model=NAME, prompt="abc", max_tokens=longest, temperature=0, stream=True)
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    assert ask(server.client, "completions", "next", max_tokens=3)["usage"].completion_tokens == 3
    deadline = time.monotonic() + 60
    while "disconnected" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(line for line in server.log.read_text().splitlines() if "disconnected" in line)
    assert line.startswith("jetspec serve: completions request stopped: the client disconnected after ")
    assert 3 <= int(line.split(" after ")[1].split()[0]) < longest


def sse(url: str, body: dict, key=KEY) -> tuple[str, str]:
    """A stream read as raw bytes, without the `openai` client (which hides missing framing): content type, text."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.headers["Content-Type"], response.read().decode()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_raw_sse_framing_has_the_chunks_the_usage_chunk_and_done(server, local, endpoint):
    _, tokenizer, _ = local
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"model": NAME, "max_tokens": NEW, "temperature": 0, "stream": True, "return_token_ids": True}
    body.update(
        {"messages": [{"role": "user", "content": PROMPTS[3]}]} if endpoint == "chat" else {"prompt": PROMPTS[3]}
    )
    for include_usage in (True, False):
        kind, text = sse(server.url + path, {**body, "stream_options": {"include_usage": include_usage}})
        assert kind.startswith("text/event-stream") and text.endswith("\n\ndata: [DONE]\n\n")
        parts = text.split("\n\n")  # every event one `data: ` line and a blank line
        assert parts[-1] == "" and all(p.startswith("data: ") and "\n" not in p for p in parts[:-1]), text[:400]
        chunks = [json.loads(p.removeprefix("data: ")) for p in parts[:-2]]
        assert len({c["id"] for c in chunks}) == 1 and all("error" not in c for c in chunks)
        finish = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
        ids = finish[0]["jetspec"]["token_ids"]
        assert len(ids) == NEW
        pieces = [c["choices"][0]["delta" if endpoint == "chat" else "text"] for c in chunks if c["choices"]]
        joined = "".join((p.get("content") or "") if endpoint == "chat" else p for p in pieces)
        assert joined == tokenizer.decode(ids, skip_special_tokens=True)
        if include_usage:  # OpenAI's last chunk: no choices, the usage; the finish chunk has none
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == NEW
            assert chunks[-2] is finish[0] and "usage" not in finish[0]
        else:
            assert all(c["choices"] for c in chunks) and chunks[-1] is finish[0]


def test_the_openai_client_reads_the_usage_chunk_and_the_message_of_an_error_in_a_stream_or_a_500(server):
    chunks = list(
        server.client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # a temperature so small that sampling's probabilities overflow: `generate` raises after the stream began
    made = server.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1e-300, stream=True
    )
    with pytest.raises(openai.APIError, match="internal error while answering request .+; the server's log") as got:
        list(made)
    request_id = str(got.value).split("request ")[1].split(";")[0]
    assert "probability" not in str(got.value) and "probability" in server.tail()  # the log has it, not the client
    assert f"request {request_id} failed" in server.log.read_text()
    with pytest.raises(openai.InternalServerError, match="internal error while answering request") as got:
        server.client.completions.create(model=NAME, prompt="hi", max_tokens=5, temperature=1e-300)
    request_id = got.value.response.headers["x-request-id"]  # a 500 names the request id, and nothing internal
    assert (
        got.value.body["message"]
        == f"internal error while answering request {request_id}; the server's log has its details"
    )
    assert f"request {request_id} (POST /v1/completions) failed" in server.log.read_text()
    assert ask(server.client, "chat", "still here", max_tokens=3)["usage"].completion_tokens == 3


def test_requests_without_the_api_key_get_a_401(server):
    url = server.url
    body = json.dumps({"model": NAME, "prompt": "a", "max_tokens": 2}).encode()
    for key, words in (("", "got none"), ("wrong", "got another key")):
        answer = {}
        status, error = post(url + "/v1/completions", body, key=key, answer=answer)
        assert status == 401 and answer["www-authenticate"] == "Bearer", (key, error)
        assert words in error["error"]["message"] and error["error"]["code"] == "invalid_api_key"
    assert post(url + "/v1/models", b"", method="GET", key="")[0] == 401
    with urllib.request.urlopen(url + "/health", timeout=10) as health:  # a load balancer's probe needs no key
        assert health.status == 200
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert ask(server.client, "completions", "a", max_tokens=2)["usage"].completion_tokens == 2


def test_a_full_queue_is_answered_429_with_retry_after(server):
    url = server.url
    body = {"model": NAME, "prompt": "abc", "max_tokens": 4000, "temperature": 0, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    decoding = urllib.request.urlopen(
        urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers), timeout=60
    )
    decoding.readline()  # its headers came: it is decoding (a stream's headers go out when its decoding begins)
    results = []

    def short(text: str):
        answer = {}
        data = json.dumps({"model": NAME, "prompt": text, "max_tokens": 2}).encode()
        results.append((*post(url + "/v1/completions", data, key=KEY, answer=answer), answer))

    # one more than the queue holds, at once, while one decodes: the last to come is refused at once
    threads = [threading.Thread(target=short, args=(PROMPTS[i],)) for i in range(MAX_QUEUE + 1)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not results and time.monotonic() < deadline:
        time.sleep(0.05)
    decoding.close()  # a disconnect: its generation stops, the waiting ones decode
    for thread in threads:
        thread.join(timeout=60)
    (status, error, answer), *others = results
    assert status == 429 and int(answer["retry-after"]) >= 1 and error["error"]["code"] == "queue_full"
    assert [(code, done["usage"]["completion_tokens"]) for code, done, _ in others] == [(200, 2)] * MAX_QUEUE


@pytest.fixture(scope="module")
def transformers_server(folders):
    """transformers' own server on the same target folder: no head."""
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folders / "target")]
    command += ["--dtype", "float32", "--device", "cpu"]
    served = Server(command, folders / "transformers-serve.log", str(folders / "target"))
    try:
        yield served.wait()
    finally:
        served.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_transformers_serve_without_the_head_answers_the_same(server, transformers_server, stream):
    name = transformers_server.name
    for endpoint in ("chat", "completions"):
        for text in PROMPTS[:3]:
            ours = ask(server.client, endpoint, text, stream, temperature=0)
            if endpoint == "chat":
                made = transformers_server.client.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": text}],
                    max_tokens=NEW,
                    temperature=0,
                    stream=stream,
                )
            else:
                made = transformers_server.client.completions.create(
                    model=name, prompt=text, max_tokens=NEW, temperature=0, stream=stream
                )
            if stream:
                chunks = list(made)
                parts = [(c.choices[0].delta.content if endpoint == "chat" else c.choices[0].text) for c in chunks]
                theirs, tokens = "".join(p or "" for p in parts), chunks[-1].usage.completion_tokens
            else:
                choice = made.choices[0]
                theirs = choice.message.content if endpoint == "chat" else choice.text
                tokens = made.usage.completion_tokens
            assert (ours["text"], ours["usage"].completion_tokens) == (theirs, tokens), (endpoint, text)


@pytest.mark.real_model
def test_serves_smollm2_with_the_committed_head_as_plain_generate(tmp_path):
    """SmolLM2-135M-Instruct (the GGUF, de-quantized to float32) with the committed head: greedy answers through the
    server (the call that others may join), chat, streamed and not, equal plain `generate` token for token."""
    target, tokenizer = load_target("smollm2-135m", dtype=torch.float32)  # builds the converted cache if absent
    # a set cap skips the start-up measurement (tested on a tiny target) and sends greedy requests through the call
    # that others join (`decode_joined`)
    command = [sys.executable, "-m", "jetspec", "serve", "--served-model-name", NAME, "--dtype", "float32"]
    served = Server(command + ["--max-batch", "2"], tmp_path / "serve.log", NAME)
    try:
        served.wait()
        for text, stream in (("What is 17 * 23?", False), ("Name three primary colours.", True)):
            ids = prompt_ids(tokenizer, "chat", text)
            plain, _ = direct(target, ids, do_sample=False)
            answer = ask(served.client, "chat", text, stream, temperature=0, max_tokens=NEW)
            assert answer["jetspec"]["token_ids"] == plain
            assert answer["text"] == tokenizer.decode(plain, skip_special_tokens=True)
            assert answer["jetspec"]["tokens_by_source"]["head"] + answer["jetspec"]["tokens_by_source"]["lookup"] > 0
    finally:
        served.stop()


def test_serve_bench_drives_both_servers_on_one_prompt(server, transformers_server, local):
    """scripts/serve_bench.py, smoke-checked at tiny size (one prompt, 4 tokens): the servers and the in-process
    decoders (`--in-process`: plain `generate()` and with the head, in the bench's own process) answer alike, each
    record holds its time to first token and its tokens, the tree's statistics come from the head's paths only; the
    one tiny jetspec server stands behind both jetspec names (`--join on` and `--join off`), whose rows the ratio
    leaves out of its reference; the in-process decoders take part at 1 client only."""
    from test_scripts import load_script

    bench = load_script("serve_bench")
    off = bench.jetspec_name("off")
    servers = {
        bench.JETSPEC: (server.url, NAME),
        off: (server.url, NAME),
        bench.TRANSFORMERS: (transformers_server.url, transformers_server.name),
    }
    target, tokenizer, head = local
    in_process = {
        bench.IN_PROCESS: bench.InProcess(target, tokenizer),
        bench.IN_PROCESS_HEAD: bench.InProcess(target, tokenizer, head),
    }
    prompts = [{"suite": "gsm8k", "id": "p0", "prompt": PROMPTS[0]}]
    results = bench.run_bench(servers, prompts, max_tokens=4, clients=[1, 2], warmup=False, in_process=in_process)
    records = results["runs"][0]["requests"]
    names = [*servers, *in_process]
    assert [r["tokens"] for name in names for r in records[name]] == [4] * 5
    assert all(0 < r["ttft"] <= r["seconds"] for name in names for r in records[name])
    assert list(results["runs"][1]["requests"]) == list(servers)  # 2 clients: the servers only
    rows = bench.summary_rows(results)
    assert [(r["server"], r["requests"], r["same_text"], r["tau"] is None) for r in rows[:5]] == [
        (bench.JETSPEC, 1, "1/1", False),
        ("jetspec serve --join off", 1, "1/1", False),
        (bench.TRANSFORMERS, 1, "1/1", True),
        (bench.IN_PROCESS, 1, "1/1", True),
        (bench.IN_PROCESS_HEAD, 1, "1/1", False),
    ]
    assert rows[2]["ratio"] == 1.0  # the reference is the transformers path, not a jetspec mode nor plain in process
    assert rows[0]["ratio"] == rows[0]["tokens_per_second"] / rows[2]["tokens_per_second"]
    shares = bench.in_process_shares(rows)
    assert [share["server"] for share in shares] == [bench.JETSPEC, off]
    in_process_ratio = rows[4]["tokens_per_second"] / rows[3]["tokens_per_second"]
    assert shares[0]["in_process_ratio"] == in_process_ratio
    assert shares[0]["share"] == rows[0]["ratio"] / in_process_ratio
    table = bench.markdown(rows)
    assert "| jetspec serve | 1 | 1 |" in table and "| jetspec serve --join off | 1 | 1 |" in table
    assert f"in this process the head runs {in_process_ratio:.2f}x plain `generate()`" in table
    assert "/v1, joining a running call on" in server.log.read_text()  # the start-up line says it: the default


def test_serve_bench_starts_a_jetspec_serve_per_join_mode_unless_one_runs(monkeypatch, tmp_path):
    """scripts/serve_bench.py's servers, with its server start recorded rather than run: one `jetspec serve` per
    `--jetspec-join` value, each with its `--join`; a running one (`--jetspec-url`) is the only one; a bad value is
    refused before anything starts."""
    from test_scripts import load_script

    bench = load_script("serve_bench")
    commands = []

    def start(command, log, threads):
        commands.append((command, log.name))
        return None, f"http://127.0.0.1:{len(commands)}"

    monkeypatch.setattr(bench, "start", start)
    model = str(tmp_path / "model")
    args = bench.parse_args(["--model", model, "--max-batch", "4", "--no-continuous-batching"])
    servers, _ = bench.servers_for(args, "float32", tmp_path)
    assert list(servers) == ["jetspec serve", "jetspec serve --join off", "transformers serve"]
    assert [url for url, _ in servers.values()] == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    for (command, log), join in zip(commands, ["on", "off"]):
        assert command[1:4] == ["-m", "jetspec", "serve"] and command[-2:] == ["--join", join]
        assert command[command.index("--max-batch") + 1] == "4"  # both modes at the same cap
    assert [log for _, log in commands[:2]] == ["jetspec-serve.log", "jetspec-serve-join-off.log"]
    commands.clear()
    args = bench.parse_args(["--model", model, "--jetspec-url", "http://running", "--jetspec-join", "off"])
    args.no_continuous_batching = True
    servers, _ = bench.servers_for(args, "float32", tmp_path)
    assert servers["jetspec serve"] == ("http://running", model) and len(servers) == 2  # and transformers serve
    assert [command[1] for command, _ in commands] == ["-m"] and "jetspec" not in commands[0][0]
    args = bench.parse_args(["--model", model, "--jetspec-join", "off", "--no-continuous-batching"])
    assert list(bench.servers_for(args, "float32", tmp_path)[0])[0] == "jetspec serve --join off"
    for bad in ("", "on,on", "yes", "on,off,maybe"):
        with pytest.raises(SystemExit, match="expected --jetspec-join to be on, off or on,off, got"):
            bench.main(["--jetspec-join", bad, "--dtype", "float32", "--out", str(tmp_path / "out")])


def test_serve_reports_bad_arguments_on_one_line_before_loading(capsys, tmp_path):
    from jetspec import cli

    for argv, words in [
        (["serve", "--port", "70000"], "expected a port in [1, 65535], got 70000"),
        (["serve", "--port", "http"], "expected a port in [1, 65535], got 'http'"),
        (["serve", "--model", str(tmp_path / "none")], "expected --model to be the alias smollm2-135m"),
        (["serve", "--head", str(tmp_path)], "expected a trained JetSpec head"),
        (["serve", "--dtype", "float16"], "expected --dtype in auto, float32, bfloat16"),
        (["serve", "--device", "tpu"], "expected --device cpu, cuda or cuda:N, got 'tpu'"),
        (["serve", "--max-queue", "-1"], "expected an integer >= 0, got '-1'"),
        (["serve", "--request-timeout", "0"], "expected a number of seconds > 0, got '0'"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and words in err and "\n" not in err, (argv, err)
