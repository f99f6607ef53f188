"""Concurrent requests of `jetspec serve` decoded together: one `target.generate(..., assistant_model=head)` call
over the requests that wait when the target is free (`docs/serve.md`, "Several clients").

The tree round decodes a batch as plain `generate` does (left padding, each row its own prefix), so a request's
answer is its one-client answer whatever rows it shares a call with (float32: token for token, up to a near-tie of
its two top logits, where the batch's padded shapes may round the other way). What differs per request is judged per
row:

- [`RowStops`], one stopping criterion of the call: a row stops at its own `max_tokens`, at its own stop strings
  (transformers' `StopStringCriteria` over that row), at its own deadline (`--request-timeout`: `generate`'s
  `max_time` would end the whole call), or when its client disconnected; the call's own EOS criterion stops every
  row at an EOS. A stopped row leaves the batch (the criterion declares an `eos_token_id`, so the loop
  pads finished rows as plain decoding does with an EOS);
- [`RowsStreamer`], the call's streamer: it splits each `(B,)` step into the rows' own streamers, and judges where
  each row ended with the same criteria, which gives each row its tokens;
- [`split_stats`] gives each row the statistics of the rounds it took part in.

[`BatchScheduler`] holds the waiting requests and runs on transformers' inference thread (the generation manager's
own, `serve.TreeGenerateManager`). A call takes the oldest waiting request and every later one that may share its
call, up to the batch cap ([`batch_key`]: greedy rows always share, sampling rows share with the same sampling
settings and no seed; a seeded request decodes alone, its seed set right before its own call); a call of one row is
the manager's own call, as without batching. Each row of a shared call begins (`serve_limits.begin`) right before
the call, as a lone request does: a request already answered 503 at its deadline is dropped from it. With a cap above
1, a greedy call is continuous ([`BatchScheduler.decode_joined`]): [`CallRows`], its `jetspec_rows`
(`modeling_jetspec/admission.py`), lets the waiting requests of its batch key join between rounds, judged by
[`JoinedStops`], and answers each row when it leaves.
[`measure_batch_cap`] picks the cap from the host's costs at start-up.
"""

import collections
import copy
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from modeling_jetspec.admission import Newcomer
from modeling_jetspec.state import JetSpecStats

from .serve_limits import RequestExpired, begin
from .serve_requests import Job, tree_report

# generation-config fields that differ per row of a call (judged by `RowStops`) or that greedy decoding ignores
PER_ROW_FIELDS = ("max_new_tokens", "max_length", "stop_strings")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
# settings whose logits processors read a row's whole sequence, left padding included (a repetition penalty would
# penalize the pad token, a total min_length would count the padding): a request with one decodes alone. Value that
# does nothing.
PADDING_READERS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "bad_words_ids": None}
PADDING_READERS |= {"sequence_bias": None, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0}


@dataclass
class Row:
    """One request, waiting for a `generate` call or in one. Streamed: `streamer` (a `TreeStreamer`, whose
    `disconnected` says the client left) and its `queue`; not streamed: `done`, resolved once `job` holds the answer."""

    job: Job
    model: object  # the target
    processor: object  # its tokenizer
    inputs: dict  # `input_ids` (1, P) and `attention_mask` (1, P), on the target's device
    gen_config: object  # the request's `GenerationConfig` (`serve.prepare` finished it)
    loop: object  # the event loop that waits for the answer
    streamer: object = None
    queue: object = None
    done: object = None  # an `asyncio.Future`
    key: Optional[str] = field(init=False, default=None)

    def __post_init__(self):
        self.key = batch_key(self.job, self.gen_config)

    @property
    def prompt(self) -> list:
        return self.inputs["input_ids"][0].tolist()

    @property
    def disconnected(self) -> bool:
        return self.streamer is not None and self.streamer.disconnected


def batch_key(job: Job, gen_config) -> Optional[str]:
    """What rows sharing a call must have in common: their generation config less the per-row fields (and, greedy,
    less the sampling fields, which greedy decoding ignores); `None` for a request that decodes alone: a seeded one,
    or one whose processors would read the left padding (`PADDING_READERS`)."""
    if job.seed is not None or gen_config.max_new_tokens is None:  # a row's own length is judged from max_new_tokens
        return None
    settings = gen_config.to_dict()
    if any(settings.get(name) not in (idle, None) for name, idle in PADDING_READERS.items()):
        return None
    for name in PER_ROW_FIELDS + (() if settings.get("do_sample") else SAMPLING_FIELDS):
        settings.pop(name, None)
    return json.dumps(settings, sort_keys=True, default=str)


class RowStops(StoppingCriteria):
    """Each row's own stops in a batched call: its `max_tokens`, its stop strings, its deadline, its client's
    disconnect.

    `eos_token_id` marks this criterion as one that finishes rows: the tree loop (as plain decoding, which checks
    that attribute) then pads a stopped row and drops it from the batch instead of decoding it on.

    The loop judges one row at a time (`input_ids`: that row, repeated over the batch), without saying which. A row
    past its deadline ends at the first token judged after it, as `max_time` ends a lone call: the call judging it is
    known by its padded prompt, and where it ended is kept (`ends`), so that [`RowsStreamer`] ends it at the same
    token. Rows of one prompt cannot be told apart: such a row past its deadline is `unsure`, and the streamer ends it
    by the clock, at a token no later than the loop's.
    """

    eos_token_id = None

    def __init__(self, rows: list, width: int, tokenizer, pad: int):
        self.rows, self.width = rows, width  # width: the padded prompt length P
        self.pads = [width - len(row.prompt) for row in rows]  # each row's left padding
        self.padded = [[pad] * (width - len(row.prompt)) + row.prompt for row in rows]  # (B, P) on the host
        self.limits = [row.gen_config.max_new_tokens for row in rows]
        # each row's stop strings, as `generate(stop_strings=...)` judges them alone
        self.strings = [stop_strings(tokenizer, row.gen_config.stop_strings) for row in rows]
        self.deadlines = [row.job.deadline for row in rows]  # `time.monotonic()`, or None
        self.ends = [None] * len(rows)  # the new-token count at which a row's deadline ended it
        self.unsure = [False] * len(rows)
        self.finished = [False] * len(rows)  # the rows the streamer has ended (`RowsStreamer.ended`)

    def row_done(self, i: int, ids: torch.Tensor, new: int) -> bool:
        """Whether row `i` stops after its `new`-th token; `ids` `(1, L)`: the row with its prompt (read only for its
        stop strings)."""
        if new >= self.limits[i] or self.rows[i].disconnected or (self.ends[i] is not None and new >= self.ends[i]):
            return True
        return self.strings[i] is not None and bool(self.strings[i](ids, None)[0])

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids.shape[1] - self.width  # (B, L): every row holds the padded prompt and `new` tokens
        self.judge_deadlines(input_ids, new)
        # each row judged on its own tokens, without its left padding, as alone
        done = [
            self.unsure[i] or self.row_done(i, input_ids[i : i + 1, self.pads[i] :], new)
            for i in range(input_ids.shape[0])
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # (B,)

    def judge_deadlines(self, input_ids: torch.Tensor, new: int):
        """Where a row past its deadline ends: at this token, if this call judges it (`input_ids` `(B, L)`)."""
        if all(d is None for d in self.deadlines):
            return
        now = clock()
        due = [
            i
            for i, d in enumerate(self.deadlines)
            if d is not None and now > d and self.ends[i] is None and not (self.unsure[i] or self.finished[i])
        ]
        if not due:
            return
        head = input_ids[0, : self.width].tolist()  # the judged row's padded prompt
        judged = [i for i, padded in enumerate(self.padded) if padded == head]
        for i in due:
            if judged == [i]:
                self.ends[i] = new
            elif i in judged:
                self.unsure[i] = True


def clock() -> float:
    """The time deadlines are judged by (`time.monotonic()`, as `Job.deadline`)."""
    return time.monotonic()


def stop_strings(tokenizer, strings) -> Optional[StopStringCriteria]:
    """transformers' criterion for a row's `stop_strings` (a string or a list), or `None` without any."""
    if not strings:
        return None
    return StopStringCriteria(tokenizer, [strings] if isinstance(strings, str) else list(strings))


class RowsStreamer:
    """The streamer of a batched call: each `(B,)` step goes to the rows' own streamers, up to each row's end (judged
    as the call judges it: an EOS, or [`RowStops`]), and each row's tokens are kept (`tokens`). A row whose client
    disconnected gets nothing more; its end is not known (`counts` holds `None` for it), nor that of a row its deadline
    ended by the clock (`RowStops.unsure`: its answer ends at the token the streamer had when it saw the deadline
    pass)."""

    def __init__(self, rows: list, stops: RowStops, eos):
        self.rows, self.stops = rows, stops
        self.eos = set([eos] if isinstance(eos, int) else eos or [])
        self.prompts = [row.prompt for row in rows]
        self.tokens = [[] for _ in rows]
        self.ended = stops.finished  # (B,) whether each row has ended
        self.lost = [False] * len(rows)
        self.cut = [False] * len(rows)
        self.started = False

    def put(self, value: torch.Tensor):
        if not self.started:  # the prompts (B, P): each row's streamer skips its first put, as in plain `generate`
            self.started = True
            for i, (row, prompt) in enumerate(zip(self.rows, self.prompts)):
                self._give(i, torch.tensor([prompt]))
            return
        for i, token in enumerate(value.tolist()):  # (B,): one step
            if not self.ended[i]:
                self._step(i, token)

    def _step(self, i: int, token: int):
        tokens = self.tokens[i]
        tokens.append(token)
        if not self._give(i, torch.tensor([token])):
            return
        has_strings = self.stops.strings[i] is not None
        ids = torch.tensor([self.prompts[i] + tokens]) if has_strings else None  # (1, P_i + n): for stop strings
        self.ended[i] = token in self.eos or self.stops.row_done(i, ids, len(tokens))
        if not self.ended[i] and self.stops.unsure[i]:  # the loop ends it at this token or a later one
            self.ended[i] = self.cut[i] = True

    def _give(self, i: int, value: torch.Tensor) -> bool:
        """Hand `value` to row `i`'s streamer, if it has one; `False` when its client has left."""
        row = self.rows[i]
        try:
            if not row.disconnected:
                if row.streamer is not None:
                    row.streamer.put(value)
                return True
        except Exception:
            if not row.disconnected:
                raise
            # cancelled between the check and the put: the client left
        self.ended[i] = self.lost[i] = True
        return False

    def end(self):
        pass  # each row's stream is closed once its statistics are set (`BatchScheduler`)

    def counts(self) -> list:
        """`(B,)` each row's new tokens, `None` for a row whose end in the call is not known (its client left, or the
        clock ended it)."""
        return [None if lost or cut else len(tokens) for lost, cut, tokens in zip(self.lost, self.cut, self.tokens)]


def joinable(row: Row) -> bool:
    """Whether `row` decodes in a call that later rows may join: greedy, and free to share a call ([`batch_key`])."""
    return row.key is not None and not row.gen_config.do_sample


class JoinedStops(StoppingCriteria):
    """The stops of a row that joined a running call, besides its length and EOS, judged on its own tokens
    `(1, L)` as its lone call judges them: its stop strings, its deadline (as `max_time`: at the first token judged
    past it), its client's disconnect."""

    def __init__(self, row: Row, tokenizer):
        self.row, self.strings = row, stop_strings(tokenizer, row.gen_config.stop_strings)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        deadline = self.row.job.deadline
        done = self.row.disconnected or (deadline is not None and clock() > deadline)
        if not done and self.strings is not None:
            done = bool(self.strings(input_ids, None)[0])
        return torch.tensor([done], dtype=torch.bool, device=input_ids.device)  # (1,)


def joined_stops(row: Row) -> StoppingCriteriaList:
    """A joining row's criteria (`modeling_jetspec.admission.Newcomer`): its length, its EOS, [`JoinedStops`]."""
    config, prompt = row.gen_config, len(row.prompt)
    criteria = [MaxLengthCriteria(prompt + config.max_new_tokens)]
    if config.eos_token_id is not None:
        criteria.append(EosTokenCriteria(config.eos_token_id))
    return StoppingCriteriaList(criteria + [JoinedStops(row, row.processor)])


class CallRows:
    """The rows of a call that others join (`modeling_jetspec.admission.RowSource`, the call's `jetspec_rows`).

    Between rounds the call asks for newcomers: the oldest waiting rows while they have the call's batch key, up to
    the batch cap ([`BatchScheduler.take`]); each begins as a lone request does (`serve_limits.begin`: one answered
    503 while it waited is dropped). Every row's tokens go to its stream as the call commits them, and a row that
    leaves (its EOS, `max_tokens`, stop string, deadline or disconnect) is answered at once with the statistics of
    the rounds it took part in; `batch` counts the rows the call had held by then.
    """

    def __init__(self, scheduler: "BatchScheduler", rows: list, stops: RowStops):
        self.scheduler, self.rows, self.stops = scheduler, list(rows), stops
        self.key, now = rows[0].key, time.monotonic()
        self.joined = [now] * len(rows)  # when each row's decoding began
        self.settled = [False] * len(rows)
        for row in rows:
            self.give(row, torch.tensor([row.prompt]))  # a streamer's first put is the prompt, as in `generate`

    def admit(self, active: int) -> list:
        taken = self.scheduler.take(self.key, self.scheduler.max_batch - active)
        newcomers = []
        for row in self.scheduler.begin_rows(taken):
            self.rows.append(row)
            self.joined.append(time.monotonic())
            self.settled.append(False)
            self.give(row, torch.tensor([row.prompt]))
            newcomers.append(Newcomer(row.inputs["input_ids"], joined_stops(row)))  # (1, P)
        return newcomers

    def committed(self, index: int, tokens: list):
        self.give(self.rows[index], torch.tensor(tokens))

    def give(self, row: Row, value: torch.Tensor):
        """Hand `value` to the row's streamer, if it has one and its client is still there."""
        try:
            if row.streamer is not None and not row.disconnected:
                row.streamer.put(value)
        except Exception:
            if not row.disconnected:
                raise
            # cancelled between the check and the put: the client left, and `RowStops` ends the row

    def left(self, index: int, tokens: list, stats: JetSpecStats):
        row = self.rows[index]
        if index < len(self.stops.finished):
            self.stops.finished[index] = True  # its deadline is judged no more
        row.job.prompt_ids, row.job.new_ids = row.prompt, tokens
        if not row.disconnected:
            self.scheduler.report(row.job, stats, self.joined[index], len(self.rows), index >= len(self.stops.rows))
        self.settled[index] = True
        self.scheduler.settle(row)

    def fail(self, error: Exception):
        """Every row not yet answered gets `error`."""
        for i, row in enumerate(self.rows):
            if not self.settled[i]:
                self.settled[i] = True
                self.scheduler.settle(row, error)


def split_stats(stats: JetSpecStats, counts: list) -> list:
    """Each row's statistics of a batched call whose rows left at their own ends (`counts`: each row's new tokens, or
    `None` for a row whose end is not known), as a batch-1 call would count them.

    `stats.accepted` holds, per round, the accepted draft tokens of the rows still in the batch, in row order; a row
    takes part in a round while it has fewer tokens than its count (the first came from the prefill). Rows of unknown
    end fill the places the known rows leave; when several of them are in, those of higher index are taken to leave
    first (the order in which they left is not recorded: their answers go nowhere, the others' counts stay exact
    unless one sits between two of them).
    """
    depth = len(stats.accepted_at_depth)
    rows = [JetSpecStats(accepted_at_depth=[0] * depth) for _ in counts]
    committed = [1] * len(counts)
    unknown = [i for i, count in enumerate(counts) if count is None]
    for budget, accepted in zip(stats.budgets, stats.accepted):
        known = [i for i, count in enumerate(counts) if count is not None and committed[i] < count]
        if not 0 <= len(accepted) - len(known) <= len(unknown):
            raise ValueError(
                f"expected a round of {len(known)} to {len(known) + len(unknown)} rows for the counts {counts}, got "
                f"{len(accepted)}: statistics of another call?"
            )
        unknown = unknown[: len(accepted) - len(known)]
        for i, drafted in zip(sorted(known + unknown), accepted):
            took = drafted + 1 if counts[i] is None else min(drafted + 1, counts[i] - committed[i])
            committed[i] += took
            rows[i].add_round(budget, [drafted + 1], took, 0.0, 0.0, forwards=1)
    outside = stats.target_forwards - stats.rounds  # forwards outside the rounds: the prefill
    sources = stats.token_sources or [[] for _ in counts]  # each row's committed tokens' sources, as recorded
    for i, (row, count) in enumerate(zip(rows, counts)):
        row.target_forwards += outside
        row.new_tokens += 1  # the prefill's token
        row.token_sources = [sources[i][:count] if count is not None else sources[i]]
        row.operating_point = stats.operating_point  # one point for the whole batched call
    return rows


class RowDecoder(Protocol):
    """What the scheduler calls on `jetspec serve`'s generation manager (`serve.TreeGenerateManager`)."""

    def decode(self, job: Job, model, processor, inputs, gen_config, streamer=None):
        """Decode one request alone; its tokens and statistics go to `job`."""

    def stream(self, job: Job, model, processor, inputs, gen_config, streamer, loop, queue):
        """Decode one streamed request alone and end its stream (with an error event if it failed)."""

    def end_stream(self, job: Job, streamer, loop, queue, error: Optional[Exception] = None):
        """End a streamed request's stream once `job` holds its tokens and statistics, or with `error`."""


class BatchScheduler:
    """The waiting requests, decoded on transformers' inference thread up to `max_batch` rows per call: each request
    queues its row ([`add`]) and then one [`run_next`] on that thread, which decodes whatever waits (a later
    `run_next` whose row an earlier call took finds nothing and returns); a shared call drafts also from
    `answer_cache` (the server's `modeling_jetspec.AnswerCache`, or `None`) and decodes on the path `static` names
    (`jetspec_static`), as the decoder's lone calls do; with `join` False, no request joins a running call."""

    def __init__(self, decoder: RowDecoder, head, max_batch: int = 1, answer_cache=None, static=None, join=True):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"expected max_batch to be an integer >= 1, got {max_batch!r}")
        self.decoder, self.head, self.max_batch = decoder, head, max_batch
        self.answer_cache, self.static, self.join = answer_cache, static, join  # join False: `--join off`
        self.waiting = collections.deque()
        self.lock = threading.Lock()

    def add(self, row: Row):
        """Queue `row` (on the event loop)."""
        with self.lock:
            self.waiting.append(row)

    def run_next(self):
        """Decode the next call's rows, if any wait (on the inference thread): greedy rows in a call that others
        may join ([`decode_joined`], with a cap above 1 and `join`), other rows that share a call together, a lone row
        alone."""
        with self.lock:
            rows = next_call(self.waiting, self.max_batch) if self.waiting else []
        joins = bool(rows) and self.join and self.max_batch > 1 and joinable(rows[0])
        if len(rows) > 1 or joins:
            rows = self.begin_rows(rows)
        if joins and rows:
            self.decode_joined(rows)
        elif len(rows) == 1:
            self.decode_alone(rows[0])
        elif rows:
            try:
                self.decode_together(rows)
            except Exception as error:  # every row of the call gets it; the thread serves on
                for row in rows:
                    self.settle(row, error)
                return
            for row in rows:
                self.settle(row)

    def take(self, key: str, room: int) -> list:
        """The oldest waiting rows while they have the batch key `key`, at most `room`: a waiting row of another
        key stops it (it decodes in the next call, and no later row passes it)."""
        taken = []
        with self.lock:
            while self.waiting and len(taken) < room and self.waiting[0].key == key:
                taken.append(self.waiting.popleft())
        return taken

    def decode_joined(self, rows: list):
        """One `generate` call over `rows` that the rows waiting with their batch key join between rounds, each row
        answered when it leaves (`CallRows`, the call's `jetspec_rows`)."""
        call = self.call_of(rows)
        source = CallRows(self, rows, call["stopping_criteria"][0])
        try:
            rows[0].model.generate(**call, jetspec_rows=source)
        except Exception as error:  # every row not yet answered gets it; the thread serves on
            source.fail(error)
            return
        source.fail(RuntimeError("expected every row of a joined call to leave it, got rows that did not"))

    def begin_rows(self, rows: list) -> list:
        """`rows` less those answered 503 while they waited: each row begins (`serve_limits.begin`: its handler stops
        counting it as waiting, a stream's headers go out), as a lone request does in its own call."""
        kept = []
        for row in rows:
            try:
                begin(row.job, row.gen_config)
            except RequestExpired as error:  # its handler has its answer; its task ends with the error
                self.settle(row, error)
                continue
            kept.append(row)
        return kept

    def decode_alone(self, row: Row):
        """One request's own `generate` call, as `generate` runs it in a notebook (the manager's)."""
        job, args = row.job, (row.model, row.processor, row.inputs, row.gen_config)
        if row.streamer is not None:
            self.decoder.stream(job, *args, row.streamer, row.loop, row.queue)
            return
        try:
            self.decoder.decode(job, *args)
        except Exception as error:  # the request's handler raises it (a 500)
            self.settle(row, error)
            return
        self.settle(row)

    def settle(self, row: Row, error: Optional[Exception] = None):
        """Hand a decoded row to whoever waits for it: end its stream, or resolve its future on the event loop."""
        if row.streamer is not None:
            self.decoder.end_stream(row.job, row.streamer, row.loop, row.queue, error)
            return

        def resolve():  # the request may have been cancelled meanwhile
            if not row.done.done():
                row.done.set_result(None) if error is None else row.done.set_exception(error)

        row.loop.call_soon_threadsafe(resolve)

    def decode_together(self, rows: list):
        """One `generate` call over `rows`, left-padded; each row's tokens and statistics go to its job."""
        started = time.monotonic()
        call = self.call_of(rows)
        streamer = RowsStreamer(rows, call["stopping_criteria"][0], call["generation_config"].eos_token_id)
        out = rows[0].model.generate(**call, streamer=streamer)
        counts, width = streamer.counts(), call["input_ids"].shape[1]
        for i, (row, stats) in enumerate(zip(rows, split_stats(out.jetspec_stats, counts))):
            row.job.prompt_ids = row.prompt
            row.job.new_ids = out.sequences[i, width : width + len(streamer.tokens[i])].tolist()
            if streamer.cut[i]:  # the loop ended it at this token or later: the sources of the answer's own
                stats.token_sources = [stats.token_sources[0][: len(row.job.new_ids)]]
            if not streamer.lost[i]:
                self.report(row.job, stats, started, len(rows))

    def call_of(self, rows: list) -> dict:
        """The `generate` arguments of a call over `rows`: left-padded prompts `(B, P)` and their mask, the first
        row's generation config to the largest `max_tokens`, each row judged by [`RowStops`]."""
        first = rows[0]
        config = copy.deepcopy(first.gen_config)
        pad = config.pad_token_id if config.pad_token_id is not None else first_token(config.eos_token_id)
        pad = 0 if pad is None else pad  # any id: a padded slot is masked out, and a finished row's is cut off
        prompts = [row.prompt for row in rows]
        width = max(len(prompt) for prompt in prompts)
        device = first.inputs["input_ids"].device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (B, P)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, P)
        config.max_new_tokens = max(row.gen_config.max_new_tokens for row in rows)
        config.stop_strings, config.return_dict_in_generate = None, True
        config.max_time = None  # `begin` set the first row's: each row's deadline is its own (`RowStops`)
        config.pad_token_id = pad
        return dict(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([RowStops(rows, width, first.processor, pad)]),
            assistant_model=self.head,
            jetspec_answer_cache=self.answer_cache,
            jetspec_static=self.static,
        )

    def report(self, job: Job, stats: JetSpecStats, started: float, batch: int, joined: bool = False):
        seconds = time.monotonic() - started
        job.report = tree_report(stats, job.new_ids, seconds)
        job.report["queued_seconds"] = started - job.started
        job.report["batch"], job.report["joined"] = batch, joined


def next_call(waiting: collections.deque, max_batch: int) -> list:
    """Take from `waiting` the next call's rows: the oldest request and, unless it decodes alone, every later one
    with its [`batch_key`] that fits the call ([`fits`]), in arrival order, up to `max_batch` rows."""
    first = waiting.popleft()
    rows = [first]
    if first.key is None:
        return rows
    for row in list(waiting):
        if len(rows) >= max_batch:
            break
        if row.key == first.key and fits(rows + [row]):
            rows.append(row)
            waiting.remove(row)
    return rows


def first_token(ids) -> Optional[int]:
    return ids[0] if isinstance(ids, (list, tuple)) else ids


def fits(rows: list) -> bool:
    """Whether `rows` fit one call: the longest prompt and the largest `max_tokens` within the target's context."""
    config = rows[0].model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(len(row.prompt) for row in rows) + max(row.gen_config.max_new_tokens for row in rows)
    return limit is None or longest <= limit


def measure_batch_cap(target, head, largest: int = 16, prompt_length: int = 32, new_tokens: int = 16) -> tuple:
    """`(cap, costs)`: the batch size past which a row's round stops getting cheaper on this host, and the measured
    seconds per row and round at each batch size (1, 2, 4, ... up to `largest`).

    Each size runs a greedy tree call on random prompts, twice (the faster kept), after one warm-up call; the sizes
    double while the cost per row and round falls by at least 10%, and the cap is the last size that got it.
    """
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)

    def cost(batch: int) -> float:
        ids = torch.randint(0, vocab, (batch, prompt_length), generator=generator).to(target.device)  # (b, P)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                assistant_model=head,
            )
            best = min(best, (time.perf_counter() - started) / max(out.jetspec_stats.row_rounds, 1))
        return best

    cost(1)  # warm-up
    costs, cap = {1: cost(1)}, 1
    while cap * 2 <= largest:
        costs[cap * 2] = cost(cap * 2)
        if costs[cap * 2] > 0.9 * costs[cap]:
            break
        cap *= 2
    return cap, costs
