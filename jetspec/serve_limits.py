"""`jetspec serve` as a deployment runs it: where the model runs (`--device`), who may ask (`--api-key`), how many
requests may wait (`--max-queue`), for how long a request may take (`--request-timeout`), and how many waiting
requests decode together (`--max-batch`, `serve_batching`; `--join`: whether waiting requests join a running call), and which path every call decodes on (`--static`,
`serve_static`).

- An API key (`--api-key`, or the environment's `JETSPEC_API_KEY`): every route but `/health` answers 401 to a
  request without `Authorization: Bearer <key>`.
- [`Admission`]: a request that would make more than `--max-queue` requests wait for the inference thread is
  answered 429 with `Retry-After` (the median time of the last answers, rounded up, at least 1 s). With
  `--request-timeout S`, a request's deadline is S seconds after it arrives: one still waiting then is answered 503
  (and never decoded); one decoding then ends there (`generate`'s `max_time`), with `finish_reason` `length`. A
  stream's headers go out when its decoding begins, so that a waiting stream can still be answered 503.
- An answer cache (`--answer-cache N`, off by default): one `modeling_jetspec.AnswerCache` of the last N answers,
  shared by every request of the process and passed to every `generate` call ([`answer_cache_for`]).
- The static path (`--static eager|compile`, off by default): every `generate` call of the server gets
  `jetspec_static=` (`modeling_jetspec/static.py`: fixed shapes, compiled with `torch.compile` for `compile`); what
  that path refuses is refused at start-up, and its first shapes are warmed up there (`serve_static`).
- [`begin`]: the inference thread's side, right before a request's `generate`, or before a call shared by several
  requests (each row's own; there, each row ends at its own deadline: `serve_batching.RowStops`).
"""

import asyncio
import hmac
import math
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .serve_requests import Job, RequestError, error_body

API_KEY_ENV = "JETSPEC_API_KEY"
OPEN_PATHS = ("/health",)  # a load balancer's probe needs no key
STATIC_CHOICES = ("off", "eager", "compile")  # --static: off is the default path (`jetspec_static=None`)
JOIN_CHOICES = ("on", "off")  # --join: on, greedy requests join a running greedy call; off, only a call's start


@dataclass
class Limits:
    """The deployment options of `jetspec serve` (`None`: no limit)."""

    api_key: Optional[str] = None
    max_queue: Optional[int] = None  # requests that may wait for the inference thread
    request_timeout: Optional[float] = None  # seconds from a request's arrival to its answer's end
    answer_cache: int = 0  # earlier answers kept to draft from (`AnswerCache(max_answers=N)`); 0: no cache
    static: Optional[str] = None  # every call's `jetspec_static`: "eager" or "compile"; None: the default path
    join: bool = True  # waiting greedy requests join a running greedy call; False: they wait for the next call


class RequestExpired(RuntimeError):
    """Raised on the inference thread for a request whose deadline passed while it waited (already answered 503)."""


class Handover:
    """A request between the event loop, where it waits, and the inference thread, where it begins."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.begun_event, self.lock = loop, asyncio.Event(), threading.Lock()
        self.begun = self.expired = False


def begin(job: Job, gen_config):
    """On the inference thread, right before a request's `generate`: raise [`RequestExpired`] if it was answered 503
    while waiting; else mark it begun (the event loop stops counting it as waiting) and bound its decoding by its
    deadline (`max_time`)."""
    handover = job.admission
    if handover is None:
        return
    with handover.lock:
        if handover.expired:
            raise RequestExpired(f"request {job.request_id} passed its deadline while waiting")
        handover.begun = True
    if job.deadline is not None:
        gen_config.max_time = max(job.deadline - time.monotonic(), 1e-3)
    handover.loop.call_soon_threadsafe(handover.begun_event.set)


class Admission:
    """Who gets in (`--max-queue`), and how long a request may wait for the inference thread (`--request-timeout`)."""

    def __init__(self, limits: Limits):
        self.limits, self.waiting, self.recent = limits, set(), deque(maxlen=16)

    def retry_after(self) -> int:
        return max(1, math.ceil(statistics.median(self.recent))) if self.recent else 1

    def record(self, job: Job):
        """An answer is complete: its time from arrival feeds `Retry-After`."""
        self.recent.append(time.monotonic() - job.started)

    async def run(self, job: Job, start):
        """Admit `job` (429 when the queue is full), run `start()` (transformers' handler, which queues the request),
        and return its response once the request has begun decoding, or 503 at its deadline if it has not."""
        limit = self.limits.max_queue
        if limit is not None and len(self.waiting) >= limit:
            wait = self.retry_after()
            raise RequestError(
                f"expected at most {limit} requests waiting, got a full queue: retry after {wait} s",
                status=429,
                code="queue_full",
                headers={"Retry-After": str(wait)},
            )
        handover = job.admission = Handover(asyncio.get_running_loop())
        if self.limits.request_timeout is not None:
            job.deadline = job.started + self.limits.request_timeout
        self.waiting.add(job)
        task = asyncio.ensure_future(start())  # the context (the current job) goes with it
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, even after a 503
        begun = asyncio.ensure_future(handover.begun_event.wait())
        try:
            while not begun.done():
                if task.done() and (task.exception() is not None or not hasattr(task.result(), "body_iterator")):
                    break  # it failed before it was queued (a prompt too long), or it is answered (not a stream)
                timeout = None if job.deadline is None else job.deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    self._expire(job, handover)
                    timeout = None  # it began meanwhile: the event is on its way
                waited = {future for future in (task, begun) if not future.done()}
                await asyncio.wait(waited, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            begun.cancel()
            self.waiting.discard(job)
        return await task

    def _expire(self, job: Job, handover: Handover):
        """Answer 503 to a request still waiting at its deadline (the inference thread will skip it)."""
        with handover.lock:
            if handover.begun:
                return
            handover.expired = True
        raise RequestError(
            f"expected to begin within the request timeout of {self.limits.request_timeout:g} s, got a request "
            f"still waiting for the inference thread then",
            status=503,
            code="timeout",
        )


def add_api_key(app, key: str):
    """Every route but `/health` answers 401 without `Authorization: Bearer <key>`."""
    from fastapi.responses import JSONResponse

    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def require_key(request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path in OPEN_PATHS or hmac.compare_digest(given, expected):
            return await call_next(request)
        message = "expected the server's API key as `Authorization: Bearer <key>`, got " + (
            "another key" if given else "none"
        )
        body = error_body(message, 401, code="invalid_api_key")
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def api_key_from(given: Optional[str]) -> Optional[str]:
    """`--api-key`, else the environment's `JETSPEC_API_KEY`; an empty key is no key."""
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    return key or None


def add_arguments(serve):
    """`jetspec serve`'s deployment options, on its argument parser."""
    serve.add_argument(
        "--device",
        default=None,
        help="where the model runs: cpu, cuda or cuda:N (default: cuda where a CUDA device is present, else cpu); "
        "--dtype auto follows it (bfloat16 on CUDA, the host's measured choice on a CPU)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"answer 401 to requests without `Authorization: Bearer KEY` (default: ${API_KEY_ENV}, else no key)",
    )
    serve.add_argument(
        "--max-queue",
        type=_count,
        default=None,
        help="requests that may wait for the inference thread; one more is answered 429 with Retry-After "
        "(default: no limit)",
    )
    serve.add_argument(
        "--request-timeout",
        type=_seconds,
        default=None,
        help="seconds from a request's arrival to its answer's end: still waiting then, 503; decoding, the answer "
        "ends there with finish_reason length (default: none)",
    )
    serve.add_argument(
        "--max-batch",
        type=_batch,
        default=None,
        help="at most N waiting requests decoded together in one call (default: measured at start-up, the batch size "
        "past which a row's round stops getting 10%% cheaper; 1 decodes one request at a time)",
    )
    serve.add_argument(
        "--answer-cache",
        type=_count,
        default=0,
        metavar="N",
        help="keep the last N answers of the process and draft from them in every request (the head's lookup "
        "branch, tree_lookup >= 1; lossless whatever they hold; default 0: off, its gain not measured yet)",
    )
    serve.add_argument(
        "--static",
        type=_static,
        default="off",
        metavar="{off,eager,compile}",
        help="decode every request on the static path (fixed shapes; compile: torch.compile'd verify and draft), "
        "checked and warmed up at start-up; default off: not yet measured faster on every host kind",
    )
    serve.add_argument(
        "--join",
        type=_join,
        default="on",
        metavar="{on,off}",
        help="on (default): with a batch cap above 1, a waiting greedy request joins the running greedy call at its "
        "next round; off: requests decode together only from a call's start (the batch of what waits then)",
    )


def _count(text: str) -> int:
    import argparse

    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _batch(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _static(text: str) -> str:
    import argparse

    if text not in STATIC_CHOICES:
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(STATIC_CHOICES[:-1])} or {STATIC_CHOICES[-1]}, got {text!r}"
        )
    return text


def _join(text: str) -> str:
    import argparse

    if text not in JOIN_CHOICES:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text


def _seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def check_arguments(args) -> tuple:
    """`(device, dtype, why, Limits)` of `jetspec serve`'s arguments; raises `ValueError` on bad input."""
    import torch

    from .targets import host_kind, resolve_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"expected --device cpu, cuda or cuda:N, got {device!r}") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"expected --device cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"expected --device cpu on this machine (torch sees no CUDA device), got {device!r}")
    if args.dtype != "auto":
        dtype, why = resolve_dtype(args.dtype)
    elif kind == "cuda":
        dtype, why = torch.bfloat16, f"auto: the device {device}"
    else:
        host = host_kind()
        dtype, why = host.torch_dtype, f"{host.reason}; host kind {host.name}"
    static = None if args.static == "off" else args.static
    limits = Limits(api_key_from(args.api_key), args.max_queue, args.request_timeout, args.answer_cache, static)
    limits.join = args.join == "on"
    return device, dtype, why, limits


def answer_cache_for(head, answers: int):
    """The answer cache of a server of `head` keeping the last `answers` answers (`--answer-cache`): `None` for 0,
    else one `AnswerCache(max_answers=answers)`; a `ValueError` for a count < 0, or > 0 with a head without a lookup
    branch (the cached answers draft in it)."""
    if isinstance(answers, bool) or not isinstance(answers, int) or answers < 0:
        raise ValueError(f"expected --answer-cache to be an integer >= 0, got {answers!r}")
    if answers == 0:
        return None
    lookup = getattr(head.config, "tree_lookup", 0)
    if not lookup:
        raise ValueError(
            f"expected a head with a lookup branch (tree_lookup >= 1) for --answer-cache {answers} (the cached "
            f"answers draft in that branch), got tree_lookup={lookup!r}: serve with --answer-cache 0"
        )
    from modeling_jetspec import AnswerCache

    return AnswerCache(max_answers=answers)
