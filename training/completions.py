"""Answers from an OpenAI-compatible completions server: vLLM, SGLang, llama.cpp's server, TGI.

Data regeneration (`training/answers.py`) can have a serving engine write the target's answers instead of
`model.generate` in this process. Each prompt goes to `POST {url}/v1/completions` as token ids (the `prompt` field
takes a list of ints), already formatted by our tokenizer's chat template, so the server sees exactly the prompt
tokens training reads; decoding is greedy (temperature 0, no repetition penalty). A server that returns the answer's
token ids (vLLM's `return_token_ids`) gives them as they were decoded; from any other the answer comes back as text,
which the caller retokenizes (and records that it did).

A server that takes text prompts only (llama-cpp-python's, whose `prompt` is a string) is sent the formatted text
instead (`prompt_format="text"`), and each prompt is first tokenized by the server (its `/extras/tokenize`): a
prompt the server would read as other tokens than ours is refused, so a row's prompt ids are still what the server
read. A server that takes only the OpenAI API's own fields and has no tokenize endpoint (`transformers serve`, which
answers any other field with a 422) is sent the formatted text in such a request (`prompt_format="text_openai"`); the
prompt's tokens are checked by the count the server reports reading (`usage.prompt_tokens`).

Requests run concurrently on a thread pool (the server batches them); only the standard library's `urllib` is used.

Faults. A serving engine under load answers 5xx, stalls, drops connections, trickles its bytes, or returns an empty,
cut or malformed body. Each of these is retried, at most `max_attempts` times per request with exponential backoff
(`retry_delay`, doubled per attempt, at most `MAX_RETRY_DELAY` seconds): an HTTP 5xx, 408 or 429; no byte within
`timeout` seconds; no whole answer within `deadline` seconds of the request's start (the connection is shut down
then, however steadily bytes arrive); a connection refused, reset or closed before the whole answer; an empty body; a
body that is not JSON (e.g. cut short); JSON without one choice holding text, a valid `token_ids` list and a
`finish_reason`; an answer that ends without a reason that explains its length (`"length"` before `max_tokens`
tokens as the server counts them, in its `token_ids` or its `usage.completion_tokens`; no reason, or another reason
than `"stop"` / `"length"`). A text answer the server does not count is counted by the caller, whose `check` sees it
(`training/answers.py` retokenizes it). After the last attempt [`CompletionsServer.complete`] raises
[`CompletionFailed`] with the
reasons, and [`CompletionsServer.complete_all`] yields a [`Failure`] in that prompt's place: the caller records the
prompt as failed and goes on. A refusal that no retry heals (any other 4xx: a bad request, a wrong model or path,
missing credentials) raises [`ServerRefused`] at once, naming the address and the status: the run stops.
"""

import functools
import http.client
import json
import logging
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

COMPLETIONS_PATH = "/completions"
MODELS_PATH = "/models"
TOKENIZE_PATH = "/extras/tokenize"  # llama-cpp-python's, at the root (not under /v1)
PROMPT_FORMATS = ("token_ids", "text", "text_openai")
OPENAI_GREEDY = ("temperature", "top_p", "n", "frequency_penalty", "presence_penalty")  # GREEDY's OpenAI API fields
# what each engine calls "no repetition penalty": llama.cpp's servers default `repeat_penalty` to 1.1 (greedy
# decoding with it is not the target's greedy decoding), vLLM / SGLang / TGI name it `repetition_penalty`
GREEDY = {
    "temperature": 0.0,
    "top_p": 1.0,
    "n": 1,
    "repeat_penalty": 1.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}
FINISH_REASONS = ("stop", "length")  # an end-of-generation token; max_tokens reached
RETRIED_STATUSES = frozenset({408, 429})  # request timeout, too many requests; and every 5xx
MAX_RETRY_DELAY = 60.0  # seconds: the longest wait between two attempts, however many there are
DEFAULT_ATTEMPTS, DEFAULT_RETRY_DELAY, DEFAULT_TIMEOUT = 5, 1.0, 600.0
DEADLINE_PER_TIMEOUT = 2.0  # the default deadline of a whole request, in per-read timeouts
logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Completion:
    """One answer of the server."""

    text: str
    token_ids: Optional[list[int]]  # the answer's token ids, when the server returns them; None otherwise
    finish_reason: Optional[str]  # "stop" (an end-of-generation token), "length" (max_tokens reached), ...
    generated: Optional[int] = None  # tokens the server says it wrote (its `token_ids`, or `usage.completion_tokens`);
    # None when it says neither


@dataclass
class Failure:
    """A prompt every attempt failed for, in [`CompletionsServer.complete_all`]'s answers: the reasons, in short."""

    reason: str


class ServerRefused(RuntimeError):
    """The server refused a request in a way no retry heals (a 4xx other than 408 / 429)."""


class CompletionFailed(RuntimeError):
    """Every attempt of one request failed in a way a retry might have healed; `reason` sums them up."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"expected an answer from {address}, got none: {reason}")
        self.reason = reason


class _Retry(Exception):
    """One attempt failed in a way a retry may heal (internal)."""

    def __init__(self, reason: str, refused: bool = False):
        super().__init__(reason)
        self.reason, self.refused = reason, refused


def _summary(reasons: list[str]) -> str:
    """`"3 attempts: HTTP 500 x2, empty body"`: the distinct reasons with their counts, in order of first sight."""
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    kinds = ", ".join(reason if n == 1 else f"{reason} x{n}" for reason, n in counts.items())
    return f"{len(reasons)} attempt{'s' if len(reasons) > 1 else ''}: {kinds}"[:500]


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _count(value: Any) -> Optional[int]:
    """`value` when it is a count (an int >= 0), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class _Deadline:
    """The end of one request, `seconds` after its start: the sockets it opened are then shut down, so that a read
    blocked in one returns at once, however steadily a server trickles bytes (each read's own `timeout` never
    expires then). `passed` tells whether that happened before the request ended ([`end`])."""

    def __init__(self, seconds: float):
        self.seconds, self.passed, self._ended = seconds, False, False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._pass)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def end(self) -> bool:
        """The request is over (answered or failed); whether the deadline had passed before."""
        with self._lock:
            self._ended = True
        self._timer.cancel()
        return self.passed

    def watch(self, sock: socket.socket) -> None:
        """A socket the request opened (shut down at once when the deadline has passed already)."""
        with self._lock:
            self._sockets.append(sock)
            if self.passed:
                _shut_down(sock)

    def _pass(self) -> None:
        with self._lock:
            if self._ended:
                return
            self.passed = True
            for sock in self._sockets:
                _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


class _Watched:
    """A connection that hands its socket to `watch` once connected (mixed into http.client's two)."""

    def __init__(self, *args, watch: Callable[[socket.socket], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.watch = watch

    def connect(self):
        super().connect()
        self.watch(self.sock)


class _HTTPConnection(_Watched, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Watched, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_HTTPConnection, watch=self.deadline.watch), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):  # no context given: http.client's default, as urlopen's
        return self.do_open(functools.partial(_HTTPSConnection, watch=self.deadline.watch), req)


class CompletionsServer:
    """
    A client of one OpenAI-compatible `/v1/completions` endpoint that decodes greedily from token-id prompts.

    Args:
        url (`str`):
            The server's address, `http://host:port` or `http://host:port/v1`.
        concurrency (`int`, *optional*, defaults to 8):
            Requests in flight at once.
        model (`str`, *optional*):
            The served model's name in requests; defaults to the one model `GET /v1/models` lists.
        timeout (`float`, *optional*, defaults to 600):
            Seconds a request may wait for the server's next bytes (to connect, for the answer's head, for each read
            of its body); past it the attempt fails and is retried.
        deadline (`float`, *optional*):
            Seconds a whole request may take, from its start to its answer's last byte, however steadily the bytes
            come; past it the connection is shut down and the attempt is retried. Defaults to twice `timeout`.
        prompt_format (`str`, *optional*, defaults to `"token_ids"`):
            `"token_ids"` sends each prompt as its token ids; `"text"` sends the formatted text, after checking
            that the server tokenizes it to the same ids (for servers whose `prompt` takes text only);
            `"text_openai"` sends the text with the OpenAI API's fields only, checked by the count of prompt tokens
            the server reports (`transformers serve`).
        max_attempts (`int`, *optional*, defaults to 5):
            Attempts per request (1: no retry) before it counts as failed.
        retry_delay (`float`, *optional*, defaults to 1.0):
            Seconds before the first retry; doubled before each next one, at most `MAX_RETRY_DELAY`.
    """

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 8,
        model: Optional[str] = None,
        timeout: float = DEFAULT_TIMEOUT,
        deadline: Optional[float] = None,
        prompt_format: str = "token_ids",
        max_attempts: int = DEFAULT_ATTEMPTS,
        retry_delay: float = DEFAULT_RETRY_DELAY,
    ):
        parsed = urllib.parse.urlparse(url if isinstance(url, str) else "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"expected a server address such as http://127.0.0.1:8000, got {url!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"expected concurrency to be a positive int, got {concurrency!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"expected timeout > 0 seconds, got {timeout!r}")
        if deadline is not None and (not isinstance(deadline, (int, float)) or not deadline > 0):
            raise ValueError(f"expected deadline > 0 seconds (or None: twice the timeout), got {deadline!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"expected prompt_format in {PROMPT_FORMATS}, got {prompt_format!r}")
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise ValueError(f"expected max_attempts to be an int >= 1 (1 retries nothing), got {max_attempts!r}")
        if not isinstance(retry_delay, (int, float)) or not 0 <= retry_delay <= MAX_RETRY_DELAY:
            raise ValueError(f"expected retry_delay in [0, {MAX_RETRY_DELAY:g}] seconds, got {retry_delay!r}")
        self.root = url.rstrip("/").removesuffix("/v1")
        self.base = self.root + "/v1"
        self.concurrency = concurrency
        self.timeout = timeout
        self.deadline = float(deadline) if deadline is not None else DEADLINE_PER_TIMEOUT * timeout
        self.prompt_format = prompt_format
        self.max_attempts = max_attempts
        self.retry_delay = float(retry_delay)
        self._stop = threading.Event()  # set when a request was refused: the others stop waiting to retry
        self.model = model if model is not None else self._served_model()

    # ------------------------------------------------------------------------------------------------ one attempt
    def _attempt(self, address: str, body: Optional[dict]) -> dict[str, Any]:
        """`GET` (no body) or `POST` (a JSON body) `address` once, within `deadline` seconds: the decoded JSON
        object, `_Retry` for a fault a retry may heal, `ServerRefused` for one it will not."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(address, data=data, headers={"Content-Type": "application/json"})
        late = f"no whole answer within {self.deadline:g} s"
        with _Deadline(self.deadline) as deadline:
            try:
                raw = self._exchange(address, request, deadline)
            except _Retry:
                if deadline.end():
                    raise _Retry(late) from None
                raise
            if deadline.end():  # what came before the shutdown may parse, but it is not the whole answer
                raise _Retry(late)
        if not raw.strip():
            raise _Retry("empty body")
        try:
            answer = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _Retry("body is not JSON (truncated?)") from None
        if not isinstance(answer, dict):
            raise _Retry(f"malformed body (a JSON {type(answer).__name__}, not an object)")
        return answer

    def _exchange(self, address: str, request: urllib.request.Request, deadline: _Deadline) -> bytes:
        """The body of the answer to `request`, its sockets watched by `deadline`; `_Retry` / `ServerRefused`."""
        opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
        try:
            with opener.open(request, timeout=min(self.timeout, self.deadline)) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            try:
                detail = " ".join(error.read().decode("utf-8", "replace").split())[:500]
            except (OSError, http.client.HTTPException):
                detail = "(no readable body)"
            if error.code >= 500 or error.code in RETRIED_STATUSES:
                raise _Retry(f"HTTP {error.code}") from None
            raise ServerRefused(
                f"expected a JSON answer from {address}, got HTTP {error.code}: {detail} (a retry "
                "would be refused the same way: check the address, the model name and the "
                "credentials)"
            ) from None
        except urllib.error.URLError as error:  # before the answer's head: connect, send
            if isinstance(error.reason, TimeoutError):
                raise _Retry(f"no answer within {self.timeout:g} s") from None
            refused = isinstance(error.reason, ConnectionRefusedError)
            raise _Retry(f"no connection ({error.reason})", refused=refused) from None
        except TimeoutError:
            raise _Retry(f"no answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as error:  # closed, reset, or fewer bytes than announced
            raise _Retry(f"connection dropped ({type(error).__name__})") from None

    def _with_retries(self, address: str, attempt: Callable[[], T], first_contact: bool = False) -> T:
        """`attempt()`, retried with backoff on `_Retry` up to `max_attempts` times; then `CompletionFailed`. At
        `first_contact`, a refused connection raises at once: nothing listens at the address."""
        reasons = []
        for number in range(1, self.max_attempts + 1):
            if self._stop.is_set():
                raise CompletionFailed(address, "stopped: another request was refused")
            try:
                return attempt()
            except _Retry as failure:
                if first_contact and failure.refused:
                    raise RuntimeError(
                        f"expected a completions server at {self.base}, got no answer ({failure.reason})"
                    ) from None
                reasons.append(failure.reason)
                if number == self.max_attempts:
                    break
                delay = min(self.retry_delay * 2 ** (number - 1), MAX_RETRY_DELAY)
                logger.warning(
                    "%s: %s; attempt %d of %d in %.3g s", address, failure.reason, number + 1, self.max_attempts, delay
                )
                self._stop.wait(delay)
        raise CompletionFailed(address, _summary(reasons))

    def _request(
        self, path: str, body: Optional[dict] = None, root: bool = False, first_contact: bool = False
    ) -> dict[str, Any]:
        """The JSON answer to `path` under the `/v1` address (or the root), retried."""
        address = (self.root if root else self.base) + path
        return self._with_retries(address, lambda: self._attempt(address, body), first_contact)

    # --------------------------------------------------------------------------------------------------- requests
    def _served_model(self) -> str:
        hint = "name the served model instead (--server_model NAME, or model=NAME)"
        try:
            listed = self._request(MODELS_PATH, first_contact=True).get("data", [])
        except (CompletionFailed, ServerRefused) as error:  # transformers serve answers it with a 500 offline
            raise ValueError(
                f"expected {self.base}{MODELS_PATH} to list the served model, got none: {error}; {hint}"
            ) from None
        names = [entry.get("id") for entry in listed if isinstance(entry, dict)] if isinstance(listed, list) else []
        if len(names) != 1:
            raise ValueError(f"expected {self.base} to serve one model, got {names}; {hint}")
        return names[0]

    def _text_prompt(self, prompt_ids: list[int], text: Optional[str]) -> str:
        """`text`, once the server has tokenized it to `prompt_ids`; a `RuntimeError` showing where they part."""
        if text is None:
            raise ValueError("expected the prompt's text with prompt_format='text', got none")
        address = self.root + TOKENIZE_PATH

        def attempt() -> list[int]:
            tokens = self._attempt(address, {"model": self.model, "input": text}).get("tokens")
            if not _int_list(tokens):
                raise _Retry("malformed body (no `tokens` list of ids)")
            return tokens

        tokens = self._with_retries(address, attempt)
        if tokens != list(prompt_ids):
            at = next(
                (i for i, (a, b) in enumerate(zip(tokens, prompt_ids)) if a != b), min(len(tokens), len(prompt_ids))
            )
            raise RuntimeError(
                f"expected {self.root} to tokenize the prompt to our {len(prompt_ids)} ids, got {len(tokens)} "
                f"ids, first different at {at}: {tokens[at : at + 4]} vs {list(prompt_ids)[at : at + 4]}"
            )
        return text

    @staticmethod
    def _completion(answer: dict[str, Any], max_new_tokens: int) -> Completion:
        """The one choice of a completions answer; `_Retry` naming what is wrong with a malformed or cut one."""
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise _Retry("malformed body (expected one choice)")
        choice = choices[0]
        text, token_ids, finish = choice.get("text"), choice.get("token_ids"), choice.get("finish_reason")
        if not isinstance(text, str) and not (text is None and token_ids is not None):
            raise _Retry("malformed body (no `text`)")
        if token_ids is not None and not (_int_list(token_ids) and len(token_ids) <= max_new_tokens):
            raise _Retry(f"malformed body (`token_ids` is not a list of at most {max_new_tokens} ids)")
        if finish not in FINISH_REASONS:
            raise _Retry(f"cut off (finish_reason {finish!r})")
        usage = answer.get("usage")
        generated = len(token_ids) if token_ids is not None else None
        if generated is None and isinstance(usage, dict):
            generated = _count(usage.get("completion_tokens"))
        if finish == "length" and generated is not None and generated < max_new_tokens:
            raise _Retry(f"cut off (finish_reason 'length' after {generated} of {max_new_tokens} tokens)")
        return Completion(text=text or "", token_ids=token_ids, finish_reason=finish, generated=generated)

    def complete(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        text: Optional[str] = None,
        check: Optional[Callable[[Completion], Optional[str]]] = None,
    ) -> Completion:
        """The greedy answer to one prompt of token ids (its `text` too with `prompt_format="text"`), at most
        `max_new_tokens` tokens long, retried on faults; `check(completion)` may name what else makes an answer
        unusable (retried too). `CompletionFailed` when every attempt failed; `ServerRefused` when refused."""
        body = self._body(prompt_ids, text, max_new_tokens)
        address = self.base + COMPLETIONS_PATH

        def attempt() -> Completion:
            answer = self._attempt(address, body)
            if self.prompt_format == "text_openai":
                self._check_prompt_count(answer, prompt_ids)
            completion = self._completion(answer, max_new_tokens)
            problem = check(completion) if check is not None else None
            if problem is not None:
                raise _Retry(problem)
            return completion

        try:
            return self._with_retries(address, attempt)
        except ServerRefused:
            self._stop.set()
            raise

    def _body(self, prompt_ids: list[int], text: Optional[str], max_new_tokens: int) -> dict[str, Any]:
        """A greedy request; for `"text_openai"`, with the OpenAI API's fields only."""
        if self.prompt_format == "text_openai":
            if text is None:
                raise ValueError("expected the prompt's text with prompt_format='text_openai', got none")
            greedy = {name: GREEDY[name] for name in OPENAI_GREEDY}
            return {"model": self.model, "prompt": text, "max_tokens": max_new_tokens, "stream": False, **greedy}
        prompt = list(prompt_ids) if self.prompt_format == "token_ids" else self._text_prompt(prompt_ids, text)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": False}
        return {**body, "return_token_ids": True, **GREEDY}

    def _check_prompt_count(self, answer: dict[str, Any], prompt_ids: list[int]):
        """A `RuntimeError` (no retry heals it) when the server read the text prompt as another number of tokens than
        our ids (e.g. with a BOS of its own), or does not say how many."""
        usage = answer.get("usage")
        read = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if read != len(prompt_ids):
            raise RuntimeError(
                f"expected {self.base} to read the prompt as our {len(prompt_ids)} tokens (usage.prompt_tokens), got "
                f"{read!r}: its rows would not hold the prompt it answered"
            )

    def _complete_or_failure(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        text: Optional[str],
        check: Optional[Callable[[Completion], Optional[str]]],
    ) -> Union[Completion, Failure]:
        try:
            return self.complete(prompt_ids, max_new_tokens, text, check)
        except CompletionFailed as failed:
            return Failure(failed.reason)

    def complete_all(
        self,
        prompts: list[list[int]],
        texts: list[str],
        max_new_tokens: int,
        check: Optional[Callable[[Completion], Optional[str]]] = None,
    ) -> Iterator[Union[Completion, Failure]]:
        """The answers to `prompts` (token ids, and their `texts`), in their order, `concurrency` requests at a
        time: a [`Completion`], or a [`Failure`] where every attempt failed. A refusal (`ServerRefused`) raises,
        and the requests not yet sent are dropped."""
        self._stop.clear()
        pool, futures = ThreadPoolExecutor(max_workers=self.concurrency), []
        try:
            futures = [
                pool.submit(self._complete_or_failure, ids, max_new_tokens, text, check)
                for ids, text in zip(prompts, texts)
            ]
            for future in futures:
                yield future.result()
        except BaseException:  # refused, interrupted, or the caller stopped reading early: no request waits to retry
            if not all(future.done() for future in futures):
                self._stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def returns_token_ids(self, prompt_ids: list[int], text: Optional[str] = None) -> bool:
        """Whether the server returns answers as token ids (asked with a one-token answer to the prompt)."""
        return self.complete(prompt_ids, 1, text).token_ids is not None
