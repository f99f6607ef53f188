"""`jetspec serve`: an OpenAI-compatible server whose every answer is `target.generate(..., assistant_model=head)`.

Built on transformers' own serving app (`transformers serve`, the extras `transformers[serving]`), not a new web
framework: its FastAPI app (`build_server`: the routes, the request-id middleware), its chat and completions
handlers (the chat template, the generation config from the request, the response bodies and the SSE chunks) and its
generation manager's interface (a `DirectStreamer` per streamed request, a disconnect cancels it). What this module
changes, each in a subclass of those (design: `docs/serve.md`):

- one inference thread decodes the requests that wait when the target is free together, in one `generate` call
  (`serve_batching.BatchScheduler`, up to a batch cap measured at start-up or `--max-batch`);
- every request is checked first (`serve_requests.check_request`): what the server cannot honour exactly is refused
  with a 4xx and an OpenAI-shaped error naming the field, before any work;
- the generate call gets the head (`assistant_model=head`: the tree route, exactly as `generate` runs it), the
  request's seed on the inference thread right before its own call, sampling on for a temperature > 0, and a length
  that fits the model's context;
- the answer's text ends before its first stop string, as the OpenAI API returns it (the tokens, as `generate`
  commits them, end with the one that completes it);
- every answer carries the call's tree statistics in a `jetspec` field (the last chunk of a stream);
- `/v1/models` lists the one served model without the Hub; the routes of other model kinds are gone; errors are
  OpenAI-shaped, never a traceback.
"""

import asyncio
import contextvars
import json
import logging
import time

import torch
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from starlette.exceptions import HTTPException
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import DirectStreamer, GenerateManager, GenerationState

from modeling_jetspec.compat import stream_error

from .serve_batching import BatchScheduler, Row, measure_batch_cap
from .serve_requests import Job, RequestError, StopTrimmer, check_request, error_body, tree_report

SERVED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")
# the request being handled, from its check on the event loop to its generation manager (same task, same context)
CURRENT_JOB: contextvars.ContextVar = contextvars.ContextVar("jetspec_serve_job")
logger = logging.getLogger("jetspec.serve")


class ServedModel(ModelManager):
    """transformers' model manager, holding the one target this process loaded: no loading, no unloading, no Hub."""

    def __init__(self, name: str, target, tokenizer):
        super().__init__(device=target.device.type, dtype="auto", model_timeout=-1)
        self.force_model = name  # transformers' handlers answer 400 to any other name; we answer 404 before them
        self.target, self.tokenizer = target, tokenizer
        self.created = int(time.time())

    def process_model_name(self, model_id: str) -> str:
        return model_id  # the response's `model` is the served name as given, not `name@main`

    def load_model_and_processor(self, model_id_and_revision, progress_callback=None, tqdm_class=None, gguf_file=None):
        return self.target, self.tokenizer

    def get_gen_models(self, cache_dir=None) -> list[dict]:
        return [{"id": self.force_model, "object": "model", "created": self.created, "owned_by": "jetspec"}]

    def shutdown(self):
        pass  # the target lives as long as the process


class ServedState(GenerationState):
    """transformers' generation state, with one generation manager for every request."""

    def __init__(self, manager: GenerateManager):
        super().__init__()
        self.manager = manager

    def get_manager(self, model_id: str, use_cb: bool = False) -> GenerateManager:
        return self.manager


class TrimmedQueue(asyncio.Queue):
    """A streamer's queue whose content text ends before the first stop string (`StopTrimmer`); reasoning text (a
    `str` subclass), tool calls and errors pass as they are."""

    def __init__(self, stops: tuple):
        super().__init__()
        self.trimmer = StopTrimmer(stops) if stops else None

    def put_nowait(self, item):
        if self.trimmer is not None and item is None:  # the end: what was held back for a stop string that never came
            tail = self.trimmer.finish()
            if tail:
                super().put_nowait(tail)
        elif self.trimmer is not None and type(item) is str:
            item = self.trimmer.feed(item)
            if not item:
                return
        super().put_nowait(item)


class TreeStreamer(DirectStreamer):
    """transformers' streamer, except that the stream ends when the inference thread has the call's statistics
    (`close`, not `generate`'s `end`), and that a client's disconnect is remembered (`disconnected`)."""

    disconnected = False

    def end(self):
        pass  # `generate` returns right after: `TreeGenerateManager` closes the stream once the statistics are set

    def close(self):
        super().end()

    def cancel(self):
        self.disconnected = True
        super().cancel()  # the next `put` (the next round's tokens) raises inside `generate`, which stops there


class TreeGenerateManager(GenerateManager):
    """transformers' sequential generation manager (one inference thread), every request decoded by
    `target.generate(..., assistant_model=head)`; the requests waiting when the target is free decode together, up to
    `max_batch` rows per call (`serve_batching.BatchScheduler`, which runs on that thread)."""

    def __init__(self, head, max_batch: int = 1):
        super().__init__()
        self.head = head
        self.scheduler = BatchScheduler(self, head, max_batch)

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        job = CURRENT_JOB.get()
        prepare(job, model, inputs, gen_config)
        loop = asyncio.get_running_loop()
        queue = TrimmedQueue(job.stops)
        streamer = TreeStreamer(processor.backend_tokenizer, loop, queue, response_parser=response_parser)
        self.scheduler.add(Row(job, model, processor, inputs, gen_config, loop, streamer=streamer, queue=queue))
        self.submit(self.scheduler.run_next)
        return queue, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        job = CURRENT_JOB.get()
        prepare(job, model, inputs, gen_config)
        loop = asyncio.get_running_loop()
        row = Row(job, model, processor, inputs, gen_config, loop, done=loop.create_future())
        self.scheduler.add(row)
        self.submit(self.scheduler.run_next)
        await row.done
        new = torch.tensor(job.new_ids, dtype=torch.long)  # (N,)
        log_request(job, len(job.new_ids))
        return StopTrimmer(job.stops).trim(processor.decode(new, skip_special_tokens=True)), len(job.prompt_ids), new

    def decode(self, job: Job, model, processor, inputs, gen_config, streamer=None):
        """One request's `generate`, on the inference thread; its tokens and statistics go to `job`."""
        if job.seed is not None:  # here, not on the event loop: no other request's call runs between seed and draw
            torch.manual_seed(job.seed)
        job.prompt_ids = inputs["input_ids"][0].tolist()
        started = time.monotonic()
        out = model.generate(
            **inputs, generation_config=gen_config, streamer=streamer, tokenizer=processor, assistant_model=self.head
        )
        job.new_ids = out.sequences[0, len(job.prompt_ids) :].tolist()
        job.report = tree_report(out.jetspec_stats, job.new_ids, time.monotonic() - started)
        job.report["queued_seconds"] = started - job.started
        job.report["batch"] = 1  # decoded alone; the rows of a shared call: `serve_batching`
        return out

    def stream(self, job: Job, model, processor, inputs, gen_config, streamer: TreeStreamer, loop, queue):
        """A streamed request's `generate`, on the inference thread: the stream ends after the statistics are set."""
        try:
            self.decode(job, model, processor, inputs, gen_config, streamer)
        except Exception as error:  # the SSE loop shows it as an error event; a disconnect raised it on purpose
            self.end_stream(job, streamer, loop, queue, error)
            return
        self.end_stream(job, streamer, loop, queue)

    def end_stream(self, job: Job, streamer: TreeStreamer, loop, queue, error: Exception | None = None):
        """End a streamed request's stream once its tokens and statistics are set, or with an error event."""
        if streamer.disconnected:  # in a shared call, the row stopped without an error
            log_request(job, streamer.total_tokens, "stopped: the client disconnected")
        elif error is None:
            log_request(job, len(job.new_ids))
            streamer.close()
        else:
            logger.error("jetspec serve: a streamed %s request failed", job.endpoint, exc_info=error)
            message = json.dumps(f"{type(error).__name__}: {error}")[1:-1]  # transformers quotes it as is
            loop.call_soon_threadsafe(queue.put_nowait, stream_error(message))


def context_length(model):
    """The positions the target takes (`max_position_embeddings`), or `None` where its config names none."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def prepare(job: Job, model, inputs, gen_config):
    """Finish the generation config transformers' handler built from the request (on the event loop, before the
    call is queued): sampling on for a temperature > 0 (the handler turns it off for 0 only), the statistics
    returned, and a length that fits the context (`RequestError` when the request's own does not)."""
    if job.temperature:
        gen_config.do_sample = True
    gen_config.return_dict_in_generate = True
    limit, prompt = context_length(model), inputs["input_ids"].shape[-1]
    if limit is None:
        return
    room = limit - prompt
    field = "messages" if job.endpoint == "chat" else "prompt"
    if room < 1:
        raise RequestError(
            f"expected a prompt shorter than the model's context of {limit} tokens, got {prompt} tokens",
            param=field,
            code="context_length_exceeded",
        )
    if job.max_tokens is None:
        gen_config.max_new_tokens = min(gen_config.max_new_tokens, room)
    elif job.max_tokens > room:
        raise RequestError(
            f"expected max_tokens <= {room} (the model's context of {limit} tokens less the prompt's {prompt}), got "
            f"{job.max_tokens}",
            param="max_tokens",
            code="context_length_exceeded",
        )


def log_request(job: Job, tokens: int, note: str = "done"):
    tau = f", tau {job.report['tau']:.2f}" if job.report is not None else ""
    logger.info("jetspec serve: %s request %s after %d tokens%s", job.endpoint, note, tokens, tau)


def jetspec_field(job: Job) -> dict:
    """The response's `jetspec` field: the call's tree statistics, and its token ids when asked for."""
    field = dict(job.report)
    if job.return_token_ids:
        field["prompt_token_ids"], field["token_ids"] = job.prompt_ids, job.new_ids
    return field


class TreeHandling:
    """What both endpoints add around transformers' handler: the request's check before it, the statistics after."""

    endpoint: str

    async def handle_request(self, body: dict, request_id: str):
        job = check_request(body, self.endpoint, self.model_manager.force_model)
        token = CURRENT_JOB.set(job)
        try:
            response = await super().handle_request(body, request_id)
        finally:
            CURRENT_JOB.reset(token)
        if isinstance(response, StreamingResponse):
            response.body_iterator = with_report(response.body_iterator, job)
            return response
        payload = json.loads(response.body)
        payload["jetspec"] = jetspec_field(job)
        return JSONResponse(payload, status_code=response.status_code)


class TreeChatHandler(TreeHandling, ChatCompletionHandler):
    endpoint = "chat"


class TreeCompletionHandler(TreeHandling, CompletionHandler):
    endpoint = "completions"


async def with_report(chunks, job: Job):
    """A stream's SSE events, the last one (finish reason and usage) with the `jetspec` field, then `[DONE]`."""
    last = None
    try:
        async for chunk in chunks:
            if last is not None:
                yield last
            last = chunk
        if last is not None:
            yield with_field(last, job)
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()  # a disconnect: transformers' stream cancels its streamer


def with_field(chunk: str, job: Job) -> str:
    try:
        payload = json.loads(chunk.removeprefix("data: "))
    except ValueError:  # several events in one piece: the stream ended with an error event
        return chunk
    if "choices" not in payload or job.report is None:  # an error event
        return chunk
    payload["jetspec"] = jetspec_field(job)
    return f"data: {json.dumps(payload)}\n\n"


def build_app(target, tokenizer, head, name: str, max_batch: int = 1):
    """transformers' serving app over `target`, served as `name`, every answer decoded with `head`, up to
    `max_batch` waiting requests in one call."""
    models = ServedModel(name, target, tokenizer)
    state = ServedState(TreeGenerateManager(head, max_batch))
    app = build_server(
        models,
        TreeChatHandler(models, state),
        completion_handler=TreeCompletionHandler(models, state),
        response_handler=None,  # their routes are removed below
        transcription_handler=None,
        systemone_handler=None,
        generation_state=state,
    )
    # the routes of other model kinds and of model loading (a client could unload the target) answer 404
    app.router.routes[:] = [r for r in app.router.routes if not isinstance(r, APIRoute) or r.path in SERVED_ROUTES]
    add_error_handlers(app)
    return app


def add_error_handlers(app):
    """Every error an OpenAI-shaped body; a bad request a 4xx naming the problem, never a traceback."""

    def answer(message: str, status: int, param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param, code), status_code=status)

    @app.exception_handler(RequestError)
    async def refused(request, error: RequestError):
        return answer(str(error), error.status, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def malformed(request, error: RequestValidationError):
        found = "; ".join(
            f"{e.get('msg')}{': ' + str(e['ctx'].get('error')) if e.get('ctx') else ''}" for e in error.errors()
        )
        if "json" not in request.headers.get("content-type", ""):
            found += f" (the body came as {request.headers.get('content-type')!r}, not application/json)"
        return answer(f"expected a JSON object as the request body, got {found}", 400, code="invalid_json")

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        where = f"{request.method} {request.url.path}"
        return answer(f"{error.detail} ({where})", error.status_code, code=f"http_{error.status_code}")

    @app.exception_handler(TemplateError)
    async def template_refused(request, error: TemplateError):
        return answer(f"expected messages the chat template takes, got: {error}", 400, "messages", "chat_template")

    @app.exception_handler(ValueError)
    async def value_refused(request, error: ValueError):
        return answer(" ".join(str(error).split()), 400, code="refused")

    @app.exception_handler(Exception)
    async def internal(request, error: Exception):
        logger.exception("jetspec serve: %s %s failed", request.method, request.url.path)
        return answer(f"internal error ({type(error).__name__}: {error}); see the server's log", 500, code="internal")


def serve(target, tokenizer, head, name: str, host: str, port: int, max_batch: int | None = None):
    """Serve until interrupted (Ctrl-C, SIGTERM); `max_batch` `None`: the batch cap measured on this host."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)  # one "[Request received]" per request
    if max_batch is None:
        logger.info("jetspec serve: measuring the batch cap (--max-batch N skips it)")
        max_batch, costs = measure_batch_cap(target, head)
        found = ", ".join(f"{size}: {seconds * 1e3:.1f} ms" for size, seconds in costs.items())
        logger.info("jetspec serve: batch cap %d (time per row and round at each batch size: %s)", max_batch, found)
    app = build_app(target, tokenizer, head, name, max_batch)
    logger.info("jetspec serve: %s with its head at http://%s:%d/v1", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
