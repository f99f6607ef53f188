"""What `jetspec serve` makes of an answer once transformers' handlers have shaped it: the stream as OpenAI clients read
it, the finish reason, and the stop strings of targets whose answers go through a response template.

- [`shaped_stream`]: every SSE event passes as soon as it exists (none is held for the next one); the chunk with the
  finish reason gets the right one (`Job.finish_reason`) and the `jetspec` field; with
  `stream_options.include_usage`, OpenAI's last chunk (no choices, the `usage`) follows it; an error event is the
  OpenAI error object, whose message the `openai` client raises; then `data: [DONE]`.
- [`TrimmedParser`]: a response template's parser (transformers' built-in ones for qwen2, qwen3, qwen3_5, gemma4)
  rebuilds the answer from the raw text, special tokens included; the raw text is cut before its first stop string
  before the parser reads it, so content and reasoning text both end there.
- [`reparse_trimmed`]: the same for an answer that is not streamed.
"""

import json
import time

from .serve_requests import Job, StopTrimmer


def jetspec_field(job: Job) -> dict:
    """The response's `jetspec` field: the call's tree statistics, and its token ids when asked for."""
    field = dict(job.report)
    if job.return_token_ids:
        field["prompt_token_ids"], field["token_ids"] = job.prompt_ids, job.new_ids
    return field


def internal_error_message(job: Job) -> str:
    """What a client is told of a failure inside the server: no internal text, the id its log line carries."""
    return f"internal error while answering request {job.request_id}; the server's log has its details"


async def shaped_stream(chunks, job: Job, on_end=None):
    """A stream's SSE events, shaped as OpenAI clients read them (module docstring), then `data: [DONE]`.
    `on_end(job)` runs once the answer is complete."""
    try:
        async for piece in chunks:
            out = [shape_event(event + "\n\n", job) for event in piece.split("\n\n") if event]
            yield "".join(out)
        if on_end is not None and job.report is not None:
            on_end(job)
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()  # a disconnect: transformers' stream cancels its streamer


def shape_event(event: str, job: Job) -> str:
    """One SSE event: most pass as they are; the error event and the finish reason's chunk are rewritten."""
    if event.startswith('data: {"error"'):
        error = {"message": internal_error_message(job), "type": "server_error", "param": None, "code": "internal"}
        return f"data: {json.dumps({'error': error})}\n\n"
    if '"finish_reason"' not in event or job.report is None:
        return event
    payload = json.loads(event.removeprefix("data: "))
    choice = (payload.get("choices") or [{}])[0]
    if choice.get("finish_reason") is None:  # the words in a piece of text: not the finish chunk
        return event
    if choice["finish_reason"] != "tool_calls":
        choice["finish_reason"] = job.finish_reason()
    payload["jetspec"] = jetspec_field(job)
    usage = payload.pop("usage", None) if job.include_usage else None
    shaped = f"data: {json.dumps(payload)}\n\n"
    if usage is not None:  # OpenAI's usage chunk: the same id, no choices
        last = {key: payload[key] for key in ("id", "object", "model", "system_fingerprint") if key in payload}
        shaped += f"data: {json.dumps({**last, 'created': int(time.time()), 'choices': [], 'usage': usage})}\n\n"
    return shaped


def shaped_json(payload: dict, job: Job) -> dict:
    """A non-streamed answer's body: the right finish reason and the `jetspec` field."""
    choice = payload["choices"][0]
    if choice.get("finish_reason") != "tool_calls":
        choice["finish_reason"] = job.finish_reason()
    payload["jetspec"] = jetspec_field(job)
    return payload


class TrimmedParser:
    """A response template's parser (transformers' `ResponseParser`) that reads the raw text only up to its first
    stop string (`StopTrimmer`): what the template makes of the rest (content, reasoning text) never comes."""

    def __init__(self, parser, trimmer: StopTrimmer):
        self.parser, self.trimmer = parser, trimmer
        self.initial_events = parser.initial_events

    def feed(self, text: str) -> list:
        kept = self.trimmer.feed(text)
        return self.parser.feed(kept) if kept else []

    def finalize(self):
        tail = self.trimmer.finish()
        events = self.parser.feed(tail) if tail else []
        message, final = self.parser.finalize()
        return message, events + final


def reparse_trimmed(payload: dict, job: Job, tokenizer, template) -> dict:
    """A non-streamed chat answer of a response-template target, its message rebuilt from the raw text cut before
    the first stop string (transformers' handler parses the raw ids, whole)."""
    raw = tokenizer.decode(job.new_ids, skip_special_tokens=False)
    job.trimmer = StopTrimmer(job.stops)
    kept = job.trimmer.trim(raw)
    try:
        parsed = tokenizer.parse_response(kept, template, prefix=tokenizer.decode(job.prompt_ids))
    except (ValueError, RuntimeError):  # cut inside a structured region (a tool call's JSON): the text as it is
        parsed = {"content": StopTrimmer(job.stops).trim(tokenizer.decode(job.new_ids, skip_special_tokens=True))}
    message = payload["choices"][0]["message"]
    message["content"] = parsed.get("content", "")
    reasoning = parsed.get("reasoning_content", parsed.get("thinking"))
    if reasoning is None:
        message.pop("reasoning_content", None)
    else:
        message["reasoning_content"] = reasoning
    return payload
