"""`jetspec serve`: an OpenAI-compatible server whose every answer is `target.generate(..., assistant_model=head)`.

Built on transformers' own serving app (`transformers serve`, the extras `transformers[serving]`), not a new web
framework: its FastAPI app (`build_server`: the routes, the request-id middleware), its chat and completions
handlers (the chat template, the generation config from the request, the response bodies and the SSE chunks) and its
generation manager's interface (a `DirectStreamer` per streamed request, a disconnect cancels it). What this module
changes, each in a subclass of those (design: `docs/serve.md`):

- one inference thread decodes the requests that wait when the target is free together, in one `generate` call
  (`serve_batching.BatchScheduler`, up to a batch cap measured at start-up or `--max-batch`); greedy requests that
  arrive while a greedy call runs join it between rounds (unless `--join off`), and each request is answered when
  its row finishes;
- every request is checked first (`serve_requests.check_request`): a field whose value changes nothing is accepted
  and dropped, what the server cannot honour exactly is refused with a 4xx and an OpenAI-shaped error naming the
  field, before any work; then admitted (`serve_limits`: the API key, the queue limit, the deadline);
- the generate call gets the head (`assistant_model=head`: the tree route, exactly as `generate` runs it), the
  request's seed on the inference thread right before its own call, sampling on for a temperature > 0, a length
  that fits the model's context, and the request's deadline; with `--answer-cache N`, the process's one answer cache
  (`jetspec_answer_cache`, `serve_limits.answer_cache_for`), which drafts from earlier answers and keeps this one;
  with `--static eager|compile`, the static path (`jetspec_static`), checked and warmed up at start-up
  (`serve_static`);
- the answer's text ends before its first stop string, as the OpenAI API returns it (the tokens, as `generate`
  commits them, end with the one that completes it), on targets with a response template too (reasoning text
  included);
- every answer carries the call's tree statistics in a `jetspec` field, and a stream is shaped as OpenAI clients
  read it (`serve_stream`: no event held back, the usage chunk, error objects, the finish reason);
- all the process's torch work, loading and start-up timing included, runs on the one inference thread
  ([`inference_thread`]);
- `/v1/models` lists the one served model without the Hub; the routes of other model kinds are gone; errors are
  OpenAI-shaped, never a traceback nor an internal message (a 500 names the request id its log line has).
"""

import asyncio
import contextvars
import json
import logging
import time
import uuid

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
from transformers.cli.serving.utils import (
    DirectStreamer,
    GenerateManager,
    GenerationState,
    InferenceThread,
    get_response_template,
)

from modeling_jetspec.compat import stream_error

from .serve_batching import BatchScheduler, Row, measure_batch_cap
from .serve_limits import Admission, Limits, RequestExpired, add_api_key, answer_cache_for, begin
from .serve_requests import Job, RequestError, StopTrimmer, check_request, error_body, tree_report
from .serve_static import warm_up, warmup_prompt
from .serve_stream import TrimmedParser, internal_error_message, reparse_trimmed, shaped_json, shaped_stream

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
    """A streamer's queue whose text ends before the first stop string (`StopTrimmer`, kept as `job.trimmer`); tool
    calls and errors pass as they are. A target with a response template trims in its parser instead
    (`TreeStreamer`), and its queue is given no stop strings."""

    def __init__(self, job: Job, stops: tuple):
        super().__init__()
        self.trimmer = job.trimmer = StopTrimmer(stops) if stops else None

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
    (`close`, not `generate`'s `end`), that a client's disconnect is remembered (`disconnected`), and that a response
    template's parser reads the raw text only up to its first stop string (`TrimmedParser`)."""

    disconnected = False

    def __init__(self, tokenizer, loop, queue, response_parser=None, job: Job = None):
        super().__init__(tokenizer, loop, queue, response_parser=response_parser)
        if response_parser is not None and job.stops:
            job.trimmer = StopTrimmer(job.stops)
            self._parser = TrimmedParser(response_parser, job.trimmer)

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
    `max_batch` rows per call (`serve_batching.BatchScheduler`, which runs on that thread); every call drafts also
    from `answer_cache` (a `modeling_jetspec.AnswerCache` shared by every request, or `None`), and decodes on the
    path `static` names (`jetspec_static`: `None`, `"eager"` or `"compile"`; `serve_static`); with `join` False
    (`--join off`), greedy requests join no running call."""

    def __init__(self, head, max_batch: int = 1, answer_cache=None, static=None, join: bool = True, thread=None):
        super().__init__()
        self.head, self.answer_cache, self.static = head, answer_cache, static
        self.thread = thread  # the process's inference thread ([`inference_thread`]); `None`: transformers' own
        self.scheduler = BatchScheduler(self, head, max_batch, answer_cache, static, join)

    def submit(self, fn, *args, **kwargs):
        return super().submit(fn, *args, **kwargs) if self.thread is None else self.thread.submit(fn, *args, **kwargs)

    def async_submit(self, fn, *args, **kwargs):
        if self.thread is None:
            return super().async_submit(fn, *args, **kwargs)
        return self.thread.async_submit(fn, *args, **kwargs)

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        job = CURRENT_JOB.get()
        prepare(job, model, inputs, gen_config)
        loop = asyncio.get_running_loop()
        queue = TrimmedQueue(job, job.stops if response_parser is None else ())
        streamer = TreeStreamer(processor.backend_tokenizer, loop, queue, response_parser=response_parser, job=job)
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
        job.trimmer = StopTrimmer(job.stops)
        return job.trimmer.trim(processor.decode(new, skip_special_tokens=True)), len(job.prompt_ids), new

    def decode(self, job: Job, model, processor, inputs, gen_config, streamer=None):
        """One request's `generate`, on the inference thread; its tokens and statistics go to `job`."""
        begin(job, gen_config)  # its deadline; a request answered 503 while it waited raises here
        if job.seed is not None:  # here, not on the event loop: no other request's call runs between seed and draw
            torch.manual_seed(job.seed)
        job.prompt_ids = inputs["input_ids"][0].tolist()
        started = time.monotonic()
        out = model.generate(
            **inputs,
            generation_config=gen_config,
            streamer=streamer,
            tokenizer=processor,
            assistant_model=self.head,
            jetspec_answer_cache=self.answer_cache,
            jetspec_static=self.static,
        )
        job.new_ids = out.sequences[0, len(job.prompt_ids) :].tolist()
        job.report = tree_report(out.jetspec_stats, job.new_ids, time.monotonic() - started)
        job.report["queued_seconds"] = started - job.started
        job.report["batch"], job.report["joined"] = 1, False  # decoded alone; a shared call's rows: `serve_batching`
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
        """End a streamed request's stream once its tokens and statistics are set, or with an error event (its
        message without internal text: the log line has it, under the request's id)."""
        if isinstance(error, RequestExpired):  # answered 503 while it waited: no stream to end
            return
        if streamer.disconnected:  # in a shared call, the row stopped without an error
            log_request(job, streamer.total_tokens, "stopped: the client disconnected")
        elif error is None:
            log_request(job, len(job.new_ids))
            streamer.close()
        else:
            logger.error("jetspec serve: streamed %s request %s failed", job.endpoint, job.request_id, exc_info=error)
            message = json.dumps(internal_error_message(job))[1:-1]  # transformers quotes it as is
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
    eos = gen_config.eos_token_id
    job.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,))
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


class TreeHandling:
    """What both endpoints add around transformers' handler: the request's check and admission before it, the
    statistics and the stream's shape after (`serve_stream`)."""

    endpoint: str
    admission: Admission

    async def handle_request(self, body: dict, request_id: str):
        job = check_request(body, self.endpoint, self.model_manager.force_model)
        job.request_id = request_id
        token = CURRENT_JOB.set(job)
        try:
            response = await self.admission.run(job, lambda: super(TreeHandling, self).handle_request(body, request_id))
        except (HTTPException, TemplateError, ValueError):  # refusals: their handlers answer 4xx
            raise
        except Exception:  # answered here: raised past the app, it would also close the client's connection
            return internal_error(request_id, f"POST /v1/{'chat/' if self.endpoint == 'chat' else ''}completions")
        finally:
            CURRENT_JOB.reset(token)
        if isinstance(response, StreamingResponse):
            response.body_iterator = shaped_stream(response.body_iterator, job, self.admission.record)
            return response
        payload = json.loads(response.body)
        template = get_response_template(self.model_manager.tokenizer, self.model_manager.target)
        if self.endpoint == "chat" and job.stops and template is not None:
            payload = reparse_trimmed(payload, job, self.model_manager.tokenizer, template)
        self.admission.record(job)
        return JSONResponse(shaped_json(payload, job), status_code=response.status_code)


class TreeChatHandler(TreeHandling, ChatCompletionHandler):
    endpoint = "chat"


class TreeCompletionHandler(TreeHandling, CompletionHandler):
    endpoint = "completions"


def inference_thread() -> InferenceThread:
    """The thread that runs all of a server process's torch work: loading, start-up timing and every request's
    `generate` (transformers' `InferenceThread`, passed to [`build_app`] as `thread`).

    Why one thread: torch's CPU kernels run on OpenMP (libgomp), which keeps a team of worker threads per calling
    thread. Once the main thread has run a parallel kernel (a model load, a timing call) and the inference thread
    runs another, the process holds more OpenMP threads than CPUs, and libgomp then spins its idle workers only
    briefly before they sleep: every kernel waits for a worker to wake. Measured on a 2-core AVX-512 + bf16 AMD host,
    bf16 SmolLM2-135M, 5 prompts x 3, beside `transformers serve` (whose main thread runs no kernel): the prompt's
    forward took 108-125 ms in `jetspec serve` against 81-98 ms there, its worker thread busy half the time against
    all of it (`docs/serve.md`, "One thread for torch's work")."""
    return InferenceThread()


def build_handlers(target, tokenizer, head, name: str, limits: Limits = None, max_batch: int = 1, thread=None) -> tuple:
    """The chat and completions handlers over `target`, served as `name`, every answer decoded with `head`, up to
    `max_batch` waiting requests in one call, within `limits` (`serve_limits`), on `thread` (an
    [`inference_thread`]; `None`: a new one); with `limits.static`, the static path warmed up first, on that thread
    (`serve_static.warm_up`: a `ValueError` for what it refuses)."""
    limits = limits or Limits()
    models = ServedModel(name, target, tokenizer)
    cache = answer_cache_for(head, limits.answer_cache)
    manager = TreeGenerateManager(head, max_batch, cache, limits.static, limits.join, thread)
    if limits.static is not None:
        answers = manager.answer_cache is not None
        manager.submit(warm_up, target, tokenizer, head, limits.static, max_batch, answers).result()
    state = ServedState(manager)
    admission = Admission(limits)
    handlers = TreeChatHandler(models, state), TreeCompletionHandler(models, state)
    for handler in handlers:
        handler.admission = admission
    return handlers


def build_app(target, tokenizer, head, name: str, limits: Limits = None, max_batch: int = 1, thread=None):
    """transformers' serving app over `target`, served as `name`, every answer decoded with `head`, up to
    `max_batch` waiting requests in one call, within `limits` (`serve_limits`), on `thread` (the
    [`inference_thread`] that loaded the target; `None`: a new one)."""
    chat, completions = build_handlers(target, tokenizer, head, name, limits, max_batch, thread)
    models, state = chat.model_manager, chat.generation_state
    app = build_server(
        models,
        chat,
        completion_handler=completions,
        response_handler=None,  # their routes are removed below
        transcription_handler=None,
        systemone_handler=None,
        generation_state=state,
    )
    # the routes of other model kinds and of model loading (a client could unload the target) answer 404
    app.router.routes[:] = [r for r in app.router.routes if not isinstance(r, APIRoute) or r.path in SERVED_ROUTES]
    add_error_handlers(app)
    if limits is not None and limits.api_key is not None:
        add_api_key(app, limits.api_key)
    return app


def add_error_handlers(app):
    """Every error an OpenAI-shaped body; a bad request a 4xx naming the problem, never a traceback."""

    def answer(message: str, status: int, param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param, code), status_code=status)

    @app.exception_handler(RequestError)
    async def refused(request, error: RequestError):
        response = answer(str(error), error.status, error.param, error.code)
        response.headers.update(error.headers or {})
        return response

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
        request_id = getattr(request.state, "request_id", None) or uuid.uuid4().hex
        return internal_error(request_id, f"{request.method} {request.url.path}")


def internal_error(request_id: str, where: str) -> JSONResponse:
    """A 500 without internal text: the log has the exception being handled, under the request's id (also the
    answer's `X-Request-ID`)."""
    logger.exception("jetspec serve: request %s (%s) failed", request_id, where)
    message = f"internal error while answering request {request_id}; the server's log has its details"
    body = error_body(message, 500, code="internal")
    return JSONResponse(body, status_code=500, headers={"X-Request-ID": request_id})


def time_host_costs(target, tokenizer, head, max_batch: int = 1):
    """With a head whose `tree_budget` is "auto", one short greedy tree call per batch size 1 to `max_batch` before
    the server takes a request: the host costs its operating point weighs (`modeling_jetspec/host_costs.py`,
    measured once per host, target, dtype and batch, then cached) are timed now, so that no client waits for them,
    neither the first nor a call whose batch grows as requests join it (its budget is re-weighed at each size)."""
    if head.config.tree_budget != "auto":
        return
    started = time.monotonic()
    logger.info(
        "jetspec serve: timing this host's costs for the head's tree_budget='auto' at batch 1 to %d (once, then "
        "cached)",
        max_batch,
    )
    ids = warmup_prompt(target, tokenizer)  # (1, P), a short chat request
    for batch in range(1, max_batch + 1):
        rows = ids.expand(batch, -1)  # (batch, P)
        with torch.inference_mode():
            target.generate(
                rows, attention_mask=torch.ones_like(rows), max_new_tokens=2, do_sample=False, assistant_model=head
            )
        logger.info("jetspec serve: host costs at batch %d ready (%.1f s)", batch, time.monotonic() - started)


def serve(
    target,
    tokenizer,
    head,
    name: str,
    host: str,
    port: int,
    limits: Limits = None,
    max_batch: int = None,
    thread: InferenceThread = None,
):
    """Serve until interrupted (Ctrl-C, SIGTERM); `max_batch` `None`: the batch cap measured on this host; `thread`:
    the [`inference_thread`] that loaded the target (`None`: a new one), where the start-up timing runs too."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)  # one "[Request received]" per request
    thread = thread or inference_thread()
    if max_batch is None:
        logger.info("jetspec serve: measuring the batch cap (--max-batch N skips it)")
        max_batch, costs = thread.submit(measure_batch_cap, target, head).result()
        found = ", ".join(f"{size}: {seconds * 1e3:.1f} ms" for size, seconds in costs.items())
        logger.info("jetspec serve: batch cap %d (time per row and round at each batch size: %s)", max_batch, found)
    thread.submit(time_host_costs, target, tokenizer, head, max_batch).result()
    app = build_app(target, tokenizer, head, name, limits, max_batch, thread)
    join = "on" if limits is None or limits.join else "off"  # --join: whether waiting requests join a running call
    at = (name, target.device, host, port, join)
    logger.info("jetspec serve: %s with its head on %s at http://%s:%d/v1, joining a running call %s", *at)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
