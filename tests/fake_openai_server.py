"""A scriptable fake OpenAI-compatible completions server for the fault tests (not collected by pytest).

Loopback only (127.0.0.1, an ephemeral port), served from a daemon thread. It answers `GET /v1/models` and
`POST /v1/completions` in vLLM's dialect (token-id prompts, `token_ids` in the answer), or, given `decode` (ids to
text), as a server that returns text only (llama.cpp's): the answer's text, no `token_ids`, and its count in
`usage.completion_tokens`. Each prompt has a script: the list of what its successive requests get, after which every
request is answered. What a request can get:

- `"ok"`: the answer of `answer(prompt_ids, max_tokens) -> (token_ids, finish_reason)`;
- an int: that HTTP status with a JSON error body (500, 503, 429, 401, 404, ...);
- `"stall"`: nothing at all for `stall` seconds (longer than the client's timeout), then the connection closes;
- `"close"`: the connection closes without an answer;
- `"empty"`: 200 with an empty body;
- `"truncated"`: 200 with the first half of the answer's JSON (its length announced: the body reads whole);
- `"short"`: 200 announcing the whole answer's length, sending half of it, then closing;
- `"malformed"`: 200 with JSON that has no choice;
- `"cut"`: 200 with half the answer's tokens and `finish_reason` `"length"` (as text with `decode`, counted in
  `usage`);
- `"cut_uncounted"`: with `decode` only: 200 with the text of half the answer's tokens, `finish_reason` `"length"`
  and no `usage` (a text server that does not count: only the client's retokenization can tell);
- `"trickle"`: the whole answer, status line and headers included, in `trickle_pieces` pieces `trickle` seconds
  apart: every read gets bytes within the client's timeout, the whole takes `trickle * trickle_pieces` seconds;
- `"no_finish"`: 200 with the answer but no `finish_reason`;
- `"bad_ids"`: 200 with token ids no tokenizer of the tests has.

It stops itself: past `max_requests` requests it closes every connection unanswered (and counts them in
`overflow`), and after `lifetime` seconds it shuts down (and sets `expired`); leaving the `with` block stops it at
once.
"""

import json
import threading
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Union

Fault = Union[str, int]
FAULTS = (
    "ok",
    "stall",
    "close",
    "empty",
    "truncated",
    "short",
    "malformed",
    "cut",
    "cut_uncounted",
    "trickle",
    "no_finish",
    "bad_ids",
)


def hashed_answer(eos: int = 2, low: int = 5, high: int = 125) -> Callable[[list[int], int], tuple[list[int], str]]:
    """A deterministic answer of ids in [low, high) that depends on the prompt only: some stop early at `eos`
    (`finish_reason` "stop"), others run to `max_tokens` ("length")."""

    def answer(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        seed = zlib.crc32(json.dumps(prompt_ids).encode())
        length = 1 + seed % max_tokens
        ids = [low + (seed // (k + 1) + 7 * k) % (high - low) for k in range(length)]
        if length < max_tokens:
            ids[-1] = eos
            return ids, "stop"
        return ids, "length"

    return answer


class FakeOpenAIServer:
    """See the module docstring. `script(prompt_ids) -> list of faults` gives each prompt its own (called once per
    prompt, at its first request); `log` lists `(prompt_ids, fault)` per completions request, in arrival order."""

    def __init__(
        self,
        answer: Callable[[list[int], int], tuple[list[int], str]],
        script: Optional[Callable[[tuple[int, ...]], list[Fault]]] = None,
        *,
        model: str = "fake",
        decode: Optional[Callable[[list[int]], str]] = None,
        stall: float = 2.5,
        trickle: float = 0.2,
        trickle_pieces: int = 15,
        max_requests: int = 500,
        lifetime: float = 900.0,
    ):
        self.answer, self.script, self.model, self.decode = answer, script or (lambda ids: []), model, decode
        self.stall, self.trickle, self.trickle_pieces, self.max_requests = stall, trickle, trickle_pieces, max_requests
        self.lock = threading.Lock()
        self.scripts: dict[tuple[int, ...], list[Fault]] = {}
        self.log: list[tuple[tuple[int, ...], Fault]] = []
        self.requests = 0
        self.overflow = 0
        self.expired = False
        self.stopped = threading.Event()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.http.daemon_threads = True
        self.http.handle_error = lambda request, address: None  # a client gone mid-answer (killed) is no error here
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.timer = threading.Timer(lifetime, self._expire)
        self.timer.daemon = True

    def __enter__(self):
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def _expire(self) -> None:
        self.expired = True
        self.stop()

    def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()  # wakes the stalled requests
        self.timer.cancel()
        self.http.shutdown()
        self.http.server_close()

    def faults_of(self, prompt: tuple[int, ...]) -> list[Fault]:
        """The faults every request of `prompt` got so far."""
        return [fault for ids, fault in self.log if ids == prompt]

    def _next(self, prompt: tuple[int, ...]) -> Optional[Fault]:
        """What this request gets; None past `max_requests`."""
        with self.lock:
            self.requests += 1
            if self.requests > self.max_requests:
                self.overflow += 1
                return None
            if prompt not in self.scripts:
                self.scripts[prompt] = list(self.script(prompt))
            fault = self.scripts[prompt].pop(0) if self.scripts[prompt] else "ok"
            self.log.append((prompt, fault))
            return fault

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, status: int, data: bytes, length: Optional[int] = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
                self.close_connection = True

            def do_GET(self):
                if self.path == "/v1/models":
                    return self.send(200, json.dumps({"data": [{"id": server.model}]}).encode())
                self.send(404, b'{"detail": "not found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self.send(404, b'{"detail": "not found"}')
                if body.get("model") != server.model:
                    return self.send(
                        404, json.dumps({"detail": f"model {body.get('model')!r} does not exist"}).encode()
                    )
                prompt = tuple(body["prompt"])
                fault = server._next(prompt)
                self.close_connection = True
                if fault is None or fault == "close":
                    return
                if fault == "stall":
                    server.stopped.wait(server.stall)
                    return
                if isinstance(fault, int):
                    return self.send(fault, json.dumps({"error": {"message": f"fake fault {fault}"}}).encode())
                ids, finish = server.answer(list(prompt), body["max_tokens"])
                if fault in ("cut", "cut_uncounted"):
                    ids, finish = ids[: len(ids) // 2], "length"
                elif fault == "bad_ids":
                    ids = [10**6] * len(ids)
                answer = server.body(ids, None if fault == "no_finish" else finish, counted=fault != "cut_uncounted")
                if fault == "malformed":
                    answer = {"object": "text_completion", "model": server.model, "choices": []}
                data = json.dumps(answer).encode()
                if fault == "empty":
                    return self.send(200, b"")
                if fault == "truncated":
                    return self.send(200, data[: len(data) // 2])
                if fault == "short":
                    return self.send(200, data[: len(data) // 2], length=len(data))
                if fault == "trickle":
                    return self.trickle(data)
                assert fault in FAULTS, f"unknown fault {fault!r}"
                self.send(200, data)

            def trickle(self, data: bytes):
                head = (
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                ).encode()
                whole, pieces = head + data, server.trickle_pieces
                size = -(-len(whole) // pieces)
                for start in range(0, len(whole), size):
                    if server.stopped.wait(server.trickle if start else 0.0):
                        return
                    try:
                        self.wfile.write(whole[start : start + size])
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        return

        return Handler

    def body(self, ids: list[int], finish: Optional[str], counted: bool = True) -> dict:
        """An answer of `ids`: vLLM's (`token_ids`, the text left empty), or, with `decode`, a text server's (the text,
        and, when `counted`, `usage.completion_tokens`)."""
        if self.decode is None:
            choice = {"text": "", "token_ids": ids, "finish_reason": finish}
            return {"object": "text_completion", "model": self.model, "choices": [choice]}
        answer = {
            "object": "text_completion",
            "model": self.model,
            "choices": [{"text": self.decode(ids), "finish_reason": finish}],
        }
        if counted:
            answer["usage"] = {"completion_tokens": len(ids)}
        return answer
