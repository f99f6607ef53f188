"""What `jetspec serve` checks in a request before any work, and what it does with its answer afterwards.

[`check_request`] refuses, with the HTTP status and an OpenAI-shaped error naming the field, every request the
server cannot answer exactly as asked (`RequestError`); it returns the request's [`Job`], which holds the fields that
transformers' serving handlers do not carry to the inference thread (the seed, the stop strings to cut the text at,
whether to return token ids) and, once decoded, the call's tokens and tree statistics. [`StopTrimmer`] cuts an
answer's text before the first stop string, streamed or not, as the OpenAI API returns it. [`tree_report`] is the
`jetspec` field of a response: the tree's statistics of the call that answered it.

This module imports neither torch nor the serving packages: its checks run before either matters.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Optional

# The request fields each endpoint honours, beyond which a field is accepted only with a value that changes nothing
# (`HARMLESS`) and everything else is refused by name (transformers' own handlers log and ignore fields they do not
# implement, such as `n`, `logprobs` or `presence_penalty`: an answer that silently ignores a field is not the answer
# asked for). `return_token_ids` (vLLM's name) adds the prompt's and the answer's token ids to the `jetspec` field.
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "return_token_ids")
ENDPOINT_FIELDS = {
    "chat": (*COMMON_FIELDS, "messages", "max_completion_tokens"),
    "completions": (*COMMON_FIELDS, "prompt"),
}
# what transformers' handlers read from a checked body; the rest is taken out before them (a `frequency_penalty` of
# 0 would become generate's `repetition_penalty` of 1, over the model's own)
FORWARDED = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop")
FORWARDED += ("stream",)


def _same(value, allowed) -> bool:
    """`value == allowed`, without `False == 0` or `1 == True`."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, (int, float)):
        return isinstance(value, (int, float)) and value == allowed
    return value == allowed


def _values(*allowed):
    """A check that takes null or one of `allowed`."""
    return lambda value: value is None or any(_same(value, a) for a in allowed)


def _strings(value) -> bool:
    return value is None or isinstance(value, str)


def _metadata(value) -> bool:
    return value is None or (isinstance(value, dict) and all(isinstance(v, str) for v in value.values()))


def _any_bool(value) -> bool:
    return value is None or isinstance(value, bool)


# A field whose value changes nothing in the answer: (its check, the values it takes, in words). Such a field is
# accepted and dropped; any other value of it is refused by name. Tool fields are harmless only without tools.
HARMLESS = {
    "n": (_values(1), "1 (jetspec serve answers one choice per request)"),
    "user": (_strings, "a string"),
    "safety_identifier": (_strings, "a string"),
    "prompt_cache_key": (_strings, "a string"),
    "metadata": (_metadata, "an object of strings"),
    "store": (_values(False), "false (nothing is stored)"),
    "service_tier": (_values("auto", "default"), "auto or default"),
    "frequency_penalty": (_values(0), "0 (no penalty is applied)"),
    "presence_penalty": (_values(0), "0 (no penalty is applied)"),
    "logit_bias": (_values({}), "{} (no bias is applied)"),
    "logprobs": (_values(False), "false (log-probabilities are not returned)"),
    "top_logprobs": (_values(0), "0 (log-probabilities are not returned)"),
    "response_format": (_values({"type": "text"}), '{"type": "text"}'),
    "modalities": (_values(["text"]), '["text"]'),
    "tools": (_values([]), "[] (jetspec serve calls no tools)"),
    "functions": (_values([]), "[] (jetspec serve calls no tools)"),
    "tool_choice": (_values("none", "auto"), "none or auto, without tools"),
    "function_call": (_values("none", "auto"), "none or auto, without tools"),
    "parallel_tool_calls": (_any_bool, "true or false, without tools"),
    "reasoning_effort": (_values(), "null (the chat template decides)"),
    "verbosity": (_values(), "null"),
    "prediction": (_values(), "null"),
    "audio": (_values(), "null (text only)"),
    "web_search_options": (_values(), "null"),
}
COMPLETIONS_HARMLESS = {
    "best_of": (_values(1), "1"),
    "echo": (_values(False), "false (the prompt is not repeated)"),
    "suffix": (_values(""), "null or empty (no fill-in-the-middle)"),
    "logprobs": (_values(), "null (log-probabilities are not returned)"),
}
STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # the second pads chunks against side channels: harmless
ROLES = ("system", "user", "assistant")
MAX_STOPS = 4  # as the OpenAI API
MAX_TEMPERATURE = 2.0  # as the OpenAI API
MAX_SEED = 2**64  # torch.manual_seed takes [0, 2**64)


class RequestError(ValueError):
    """A request the server refuses: the HTTP `status`, the message, and the offending field (`param`) and `code` of
    the OpenAI error body; `headers` go with the answer (a 429's `Retry-After`)."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        status: int = 400,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code or "invalid_request", headers


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """The OpenAI API's error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(eq=False)  # a job is itself: hashed by identity (`Admission.waiting`)
class Job:
    """One request's settings that transformers' handlers do not carry, and what its decoding returned."""

    endpoint: str  # "chat" or "completions"
    seed: Optional[int] = None  # torch's seed, set on the inference thread right before this request's generate
    temperature: Optional[float] = None  # > 0 samples; 0 is greedy; None keeps the model's generation config
    max_tokens: Optional[int] = None  # None: as many as transformers' default allows within the context
    stops: tuple = ()  # the answer's text ends before the first of them
    return_token_ids: bool = False
    include_usage: bool = False  # `stream_options.include_usage`: a last chunk with `usage` and no choices
    request_id: str = ""
    started: float = field(default_factory=time.monotonic)
    eos_ids: tuple = ()  # the generation config's end-of-sequence ids, set before the call is queued
    trimmer: Optional["StopTrimmer"] = None  # what cut the text at a stop string (`stopped`), once one did
    deadline: Optional[float] = None  # `time.monotonic()` by which the answer ends (`serve_limits`)
    admission: Any = None  # `serve_limits.Admission`'s hand-over between the event loop and the inference thread
    prompt_ids: Optional[list] = None  # (P,) set on the inference thread
    new_ids: Optional[list] = None  # (N,) the committed tokens, set once decoded
    report: Optional[dict] = None  # the response's `jetspec` field, set once decoded

    def finish_reason(self) -> str:
        """`stop` when the answer ended on its own (an end-of-sequence token, a stop string), even on its last allowed
        token; `length` otherwise (`max_tokens`, the context, the request's deadline)."""
        ended = bool(self.new_ids) and self.new_ids[-1] in self.eos_ids
        return "stop" if ended or (self.trimmer is not None and self.trimmer.stopped) else "length"


def check_request(body: dict, endpoint: str, served: str) -> Job:
    """Refuse a request the server cannot answer as asked; else its [`Job`]. What transformers' handlers do not
    read (`seed` and `return_token_ids`: they would seed on the event loop, or refuse the field; the harmless fields)
    is taken out of `body`."""
    if not isinstance(body, dict):
        raise RequestError(f"expected a JSON object as the request body, got a {type(body).__name__}")
    harmless = {**HARMLESS, **COMPLETIONS_HARMLESS} if endpoint == "completions" else HARMLESS
    allowed = (*ENDPOINT_FIELDS[endpoint], *harmless, "stream_options")
    unknown = sorted(name for name in body if name not in allowed)
    if unknown:
        raise RequestError(
            f"expected only the fields {', '.join(allowed)} on this endpoint (jetspec serve refuses what it does "
            f"not honour), got also {', '.join(unknown)}",
            param=unknown[0],
            code="unsupported_field",
        )
    _check_model(body.get("model"), served)
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    max_tokens = _check_max_tokens(body)
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE, low_open=False)
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    for name in ("stream", "return_token_ids"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestError(f"expected {name} to be true or false, got {body[name]!r}", param=name)
    for name, (check, words) in harmless.items():
        if name in body and not check(body[name]):
            raise RequestError(
                f"expected {name} to be {words}, got {body[name]!r}"[:300], name, code="unsupported_value"
            )
    include_usage = _check_stream_options(body.get("stream_options"))
    seed = body.pop("seed", None)
    if seed is not None and not (_is_int(seed) and 0 <= seed < MAX_SEED):
        raise RequestError(f"expected seed to be an integer in [0, 2**64), got {seed!r}", param="seed")
    job = Job(
        endpoint=endpoint,
        seed=seed,
        temperature=temperature,
        max_tokens=max_tokens,
        stops=_check_stop(body.get("stop")),
        return_token_ids=bool(body.pop("return_token_ids", False)),
        include_usage=include_usage,
    )
    for name in [name for name in body if name not in FORWARDED]:
        del body[name]
    return job


def _check_stream_options(options) -> bool:
    """`stream_options.include_usage`; any other key or value refused by name."""
    if options is None:
        return False
    if not isinstance(options, dict) or any(k not in STREAM_OPTIONS or not _any_bool(v) for k, v in options.items()):
        raise RequestError(
            f"expected stream_options to be an object of {' and '.join(STREAM_OPTIONS)}, each true or false, got "
            f"{options!r}"[:300],
            param="stream_options",
        )
    return bool(options.get("include_usage"))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_model(model, served: str):
    if not isinstance(model, str):
        raise RequestError(f"expected model to be the served model's name {served!r}, got {model!r}", param="model")
    if model != served:
        raise RequestError(
            f"expected model {served!r} (the one model this server serves, GET /v1/models), got {model!r}",
            param="model",
            status=404,
            code="model_not_found",
        )


def _check_messages(messages):
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"expected messages to be a non-empty list, got {messages!r}"[:300], param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise RequestError(
                f"expected {where} to be an object with a role in {', '.join(ROLES)}, got {role!r}"[:300], param=where
            )
        extra = sorted(set(message) - {"role", "content"})  # a `name` or tool calls would not reach the template
        if extra:
            raise RequestError(f"expected {where} to hold role and content only, got also {', '.join(extra)}", where)
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
            raise RequestError(
                f"expected {where}.content to be a string or a list of text parts (jetspec serve takes text only), "
                f"got {content!r}"[:300],
                param=f"{where}.content",
            )


def _check_prompt(prompt):
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(
            f"expected prompt to be a non-empty string (token-id and batched prompts are not supported), got "
            f"{prompt!r}"[:300],
            param="prompt",
        )


def _check_max_tokens(body: dict) -> Optional[int]:
    given = [name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    if len(given) > 1:
        raise RequestError("expected one of max_tokens and max_completion_tokens, got both", param=given[0])
    if not given:
        return None
    value = body[given[0]]
    if not _is_int(value) or value < 1:
        raise RequestError(f"expected {given[0]} to be an integer >= 1, got {value!r}", param=given[0])
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (low < value if low_open else low <= value) and value <= high):  # NaN fails every comparison
        bracket = "(" if low_open else "["
        raise RequestError(f"expected {name} in {bracket}{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _check_stop(stop) -> tuple:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not 1 <= len(stops) <= MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError(
            f"expected stop to be a non-empty string or a list of 1 to {MAX_STOPS} of them, got {stop!r}"[:300],
            param="stop",
        )
    return tuple(stops)


class StopTrimmer:
    """Cuts a text, fed in pieces, before the first occurrence of any stop string, as the OpenAI API returns it.

    A piece is let through as soon as no stop string can begin in it; the tail that could still be the start of one
    is held back until the next piece decides it (`feed`) or the text ends (`finish`).
    """

    def __init__(self, stops: tuple):
        self.stops, self.pending, self.stopped = tuple(stops), "", False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        held = max(
            (k for stop in self.stops for k in range(1, len(stop)) if self.pending.endswith(stop[:k])), default=0
        )
        out, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return out

    def finish(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def trim(self, text: str) -> str:
        """The whole text at once."""
        return self.feed(text) + self.finish()


def tree_report(stats, new_ids: list, seconds: float) -> dict:
    """The response's `jetspec` field: the tree statistics of the call (`JetSpecStats`) that decoded `new_ids`.

    `tau` is the project's (committed tokens per verify round, bonus included, as `jetspec generate` prints);
    `tokens_per_target_forward` counts the prefill too. `tokens_by_source` splits the answer by who proposed each
    token, as the round recorded it (`JetSpecStats.token_sources`, `jetspec.drafts`): the head's draft, the
    model-free branch, both, earlier answers (`answers`, with `--answer-cache`), or the target (its prefill token and
    each round's bonus token).
    """
    from .drafts import SOURCES, row_sources

    sources = row_sources(stats, new_ids)
    return {
        "tau": stats.tau,
        "target_forwards": stats.target_forwards,
        "rounds": stats.rounds,
        "new_tokens": len(new_ids),
        "tokens_per_target_forward": len(new_ids) / max(stats.target_forwards, 1),
        "acceptance_per_depth": stats.acceptance_per_depth,
        "tokens_by_source": {name: sources.count(name) for name in SOURCES},
        "seconds": seconds,
        "operating_point": stats.operating_point,  # tree_budget="auto": the budget and sources chosen, else None
    }
