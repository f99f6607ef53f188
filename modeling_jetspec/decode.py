"""The decoding loop: one `generate` call as a prefill and rounds (arXiv 2606.18394, sections 3.2-3.4;
`docs/design.md`, "§2 The round").

[`_decode`] is the decoding method `generate` runs for a JetSpec head (handed to it as a callable
`custom_generate` by `integration.tree_generate`): it checks the call, prefills through the call's verifier, commits
each row's first token, then runs [`_round`] (draft, verify, accept, commit, compact; `steps.py`) until every row
has finished, and returns the sequences (and, with `return_dict_in_generate`, scores, logits and statistics) as
plain `generate` does. A `tree_budget="auto"` call first picks its operating point, a budget and the draft sources,
from the head's acceptance and this host's costs (`budget.py`, `host_costs.py`), then decodes at it.
A `jetspec_round_hook` receives each round's [`round_hook.RoundRecord`] (its phases timed, `round_hook.py`).
"""

import functools
import time
from dataclasses import replace

import torch

from .admission import admission_for
from .compat import pad_token_tensor, pads_finished_rows
from .continuations import LookupRecord, RowIndexes
from .host_costs import operating_point
from .state import Acceptance, Call, JetSpecGenerateOutput, JetSpecStats, RoundState
from .processors import check_processors, choose_token, pick_token, processors_per_row
from .round_hook import PHASES, RoundRecord
from .steps import accept, commit, draft, select_rows
from .stopping import stop_plan
from .timing import RoundClock, clock, rounds_timed


def _decode(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    jetspec_head=None,
    jetspec_shape=None,
    jetspec_streamer=None,
    jetspec_verifier=None,
    jetspec_round_hook=None,
    jetspec_answer_cache=None,
    jetspec_rows=None,
    jetspec_point=None,
    **model_kwargs,
):
    """The decoding method `generate` runs for a JetSpec head (passed as its callable `custom_generate`);
    `jetspec_rows`: an `admission.RowSource` whose rows join the call between rounds, where it can merge them;
    `jetspec_point`: the operating point a caller chose for `jetspec_shape` (the static path's, for its batch)."""
    head, shape, streamer = jetspec_head, jetspec_shape, jetspec_streamer
    attention_mask = model_kwargs.get("attention_mask")
    _check_call(input_ids, attention_mask, logits_processor, stopping_criteria, generation_config)
    point, rebudget = jetspec_point, None
    if shape.budget == "auto":  # one budget and sources for the call, chosen before it starts
        tree_verify = getattr(jetspec_verifier, "mode", "auto")
        auto, (shape, point) = shape, operating_point(head, model, shape, input_ids.shape[0], tree_verify)
        # rows that join or leave it (`admission.py`) re-weigh the budget at the new batch, its sources kept
        rebudget = functools.partial(_budget_at, head, model, auto, point.sources, tree_verify)
    if streamer is not None:  # as in plain `generate`: the prompt first (the streamer was kept from `generate`)
        streamer.put(input_ids.cpu())
    call = _start_call(
        input_ids, shape, jetspec_verifier, logits_processor, stopping_criteria, generation_config, streamer
    )
    call.lookup_index = RowIndexes(answers=jetspec_answer_cache)  # earlier calls' answers (`answer_cache.py`)
    # a lookup chain may be accepted past the head's depths
    stats = JetSpecStats(accepted_at_depth=[0] * max(shape.depth, shape.lookup))
    stats.operating_point = point.as_dict() if point is not None else None
    timed = rounds_timed() or jetspec_round_hook is not None  # a hook reads every round's phases
    started = clock() if timed else time.perf_counter()
    state = _prefill(call, input_ids, attention_mask, logits_processor, generation_config.do_sample, stats)
    admission = admission_for(jetspec_rows, call, generation_config, stats, input_ids.shape[1], rebudget)
    hook = admission.hook(jetspec_round_hook)
    admission.started()
    while state.rows.numel():
        timer = RoundClock(state.anchors.device) if timed else None
        admission.before_round()
        state = _round(head, call, state, stats, timer, hook)
        _stream(call)
        if state.rows.numel():
            state = admission.admit(head, state)
    stats.total_seconds = (clock() if timed else time.perf_counter()) - started
    if jetspec_answer_cache is not None and not admission.reports_rows:  # else each row's went in as it left
        for row in call.history:  # each row's new tokens, the prompt excluded (`answer_cache.py`)
            jetspec_answer_cache.add(row[input_ids.shape[1] : call.end()])
    return _finish(head, call, stats, generation_config, input_ids.shape)


def _budget_at(head, model, auto_shape, sources: str, tree_verify: str, rows: int) -> int:
    """The budget of highest expected speed for a batch of `rows` among `sources` (the call's own, chosen at its
    start) for a `tree_budget="auto"` call whose batch changed; this batch's host costs are measured once, then
    cached (`host_costs.py`). A head without `tau_by_budget` keeps the fallback budget."""
    return operating_point(head, model, auto_shape, rows, tree_verify, among=sources)[1].budget


def _round(head, call: Call, state: RoundState, stats: JetSpecStats, timer: RoundClock | None = None, hook=None):
    """One round: draft, verify, accept, commit, compact (`docs/design.md`, "§2 The round"); `hook` receives its
    [`RoundRecord`] (a `timer` times its phases, `round_hook.PHASES`).

    Its reads of the device: the draft's candidates and the commit's acceptance (`steps.draft`, `steps.commit`),
    and, when timed (`timer`), the clock's once at the end.
    """
    mark = timer.mark if timer is not None else _no_mark
    mark()
    before, rows = call.verifier.target_forwards, len(call.active)
    budget = call.shape.budget
    histories = call.histories() if call.shape.lookup else None
    drafter = getattr(call.verifier, "draft", None) or draft  # the static path drafts over its fixed-shape buffers
    drafted = functools.partial(mark, "draft") if timer is not None else None  # the head's forward ends the draft
    trees = drafter(head, state, call.shape, budget, histories, call.lookup_record, call.lookup_index, mark=drafted)
    mark("tree")
    nodes = trees.sizes if trees.sizes is not None else [trees.tokens.shape[1]] * rows
    trees, logits, features = call.verifier.verify(state, trees)
    mark("verify")
    acc = accept(logits, trees, call.active, call.choose, call.device_stops)
    mark("accept")
    done = commit(call, acc, logits, trees, stats)
    mark("commit")
    state = call.verifier.compact(state, trees, done.acceptance, features, done.keep)
    if call.active and hasattr(call.verifier, "reclaim"):  # holes and out-of-window columns (reclaim.py)
        state = call.verifier.reclaim(state, max(call.lengths[row] for row in call.active) - 1)
    mark("compact")
    phases = dict.fromkeys(PHASES, 0.0) | (timer.phases() if timer is not None else {})
    outside, verify = 0.0, 0.0
    if timer is not None:
        verify = phases["verify"]
        outside = sum(phases.values()) - verify  # the round outside its verify forward
    forwards = call.verifier.target_forwards - before
    stats.add_round(budget, done.counts, done.tokens, outside, verify, forwards=forwards)
    if hook is not None:
        accepted = [count - 1 for count in done.counts]
        index = stats.rounds - 1
        hook(RoundRecord(index, rows, budget, list(nodes), accepted, done.tokens, forwards, phases, state))
    return state


def _no_mark(phase: str | None = None):
    """An untimed round's clock: marks nothing."""


def _check_call(input_ids, attention_mask, processors, stopping, generation_config):
    """Refuse, before any forward, what the loop cannot decode as plain `generate` would."""
    batch, prompt_length = input_ids.shape
    if generation_config.num_beams > 1:
        raise ValueError(f"expected num_beams == 1 for tree speculative decoding, got {generation_config.num_beams}")
    if prompt_length == 0:
        raise ValueError("expected a non-empty prompt, got input_ids with 0 tokens")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"expected an attention_mask of the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    check_processors(processors, batch)
    if pads_finished_rows(stopping) and pad_token_tensor(generation_config) is None:
        raise ValueError(
            "expected a pad_token_id (or an eos_token_id) with a stopping criterion that has an eos_token_id: plain "
            "decoding pads the rows it finishes, got none"
        )


def _start_call(input_ids, shape, verifier, processors, stopping, generation_config, streamer) -> Call:
    """The call's settings and its sequences, holding the prompts (room for new tokens grows as they come)."""
    batch, prompt_length = input_ids.shape
    pad = pad_token_tensor(generation_config)
    pad = int(pad) if pad is not None else 0  # without a pad token every row ends at the same length (`Call.end`)
    sequences = input_ids.new_full((batch, prompt_length + min(generation_config.max_length - prompt_length, 64)), pad)
    sequences[:, :prompt_length] = input_ids
    wants_records = generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    )
    device_stops, stop_length = stop_plan(stopping)
    call = Call(
        shape=shape,
        verifier=verifier,
        sequences=sequences,
        lengths=[prompt_length] * batch,
        stopping=stopping,
        max_length=generation_config.max_length,
        pads_finished=pads_finished_rows(stopping),
        pad_token=pad,
        history=input_ids.tolist(),
        active=list(range(batch)),
        stopped_at=[None] * batch,
        streamer=streamer,
        streamed=prompt_length,
        records=[[] for _ in range(batch)] if wants_records else None,
        lookup_record=LookupRecord() if shape.lookup and shape.lookup_record else None,
        device_stops=device_stops,
        stop_length=stop_length,
    )
    if generation_config.do_sample or len(processors):
        per_row = processors_per_row(processors, batch)
        call.choose = functools.partial(choose_token, per_row, generation_config.do_sample, call)
    return call


def _prefill(call: Call, input_ids, attention_mask, logits_processor, do_sample: bool, stats: JetSpecStats):
    """The verifier's prefill, each row's first token committed and streamed as soon as the target's logits exist
    (before the head reads the prompt's features, [`_commit_first`]); returns the first round's state."""
    before, firsts = call.verifier.target_forwards, []

    def first_out(logits):
        firsts.append(_commit_first(call, logits_processor(input_ids, logits), logits, do_sample, stats))

    state, _ = call.verifier.prefill(input_ids, attention_mask, before_context=first_out)
    stats.target_forwards += call.verifier.target_forwards - before
    return _first_token(call, state, *firsts[0])


def _commit_first(call: Call, scores, logits, do_sample: bool, stats: JetSpecStats) -> tuple:
    """Commit and stream each row's first token, picked from the prefill's processed `scores` `(B, V)` (every row
    has the same length here, so the processors run on the whole batch, as in plain decoding). Called by the
    verifier's prefill between the target's forward and the head's pass over the prompt (`steps.prefill`'s
    `before_context`), so a stream's first token does not wait for the head. Returns `(first, done)`, the tokens
    `(B,)` and the commit's outcome, for [`_first_token`]."""
    first = pick_token(scores, do_sample)  # (B,)
    acc = Acceptance(  # the prefill as a round whose tree is its root alone
        nodes=torch.zeros_like(first)[:, None],
        tokens=first[:, None],
        count=torch.ones_like(first),
        scores=[[row] for row in scores],
    )
    done = commit(call, acc, logits[:, None], stats=stats)
    _stream(call)
    stats.new_tokens += done.tokens
    return first, done


def _first_token(call: Call, state: RoundState, first: torch.Tensor, done) -> RoundState:
    """The first round's state: each row's first token ([`_commit_first`]) becomes its anchor; rows it finished
    leave."""
    state = replace(state, anchors=first)
    select = getattr(call.verifier, "select_rows", None) or select_rows  # the static path keeps its buffers' rows
    return select(state, done.keep) if done.keep.numel() < first.shape[0] else state


def _stream(call: Call, final: bool = False):
    """Hand the streamer every step that all rows have reached, one `(B,)` tensor per step as plain `generate` does
    (a padded row's step is its padding); `final`: every step up to the output's end."""
    if call.streamer is None:
        return
    waiting = [
        length for length, stop in zip(call.lengths, call.stopped_at) if not (call.pads_finished and stop is not None)
    ]
    limit = call.end() if final or not waiting else min(waiting)
    if call.end() is not None:  # no step past the end (a stopped row may have run ahead of it)
        limit = min(limit, call.end())
    for step in range(call.streamed, limit):  # from the host's copy: a padded row's step is its padding
        call.streamer.put(torch.tensor([h[step] if step < len(h) else call.pad_token for h in call.history]))
    call.streamed = max(call.streamed, limit)


def _finish(head, call: Call, stats: JetSpecStats, generation_config, prompt_shape: tuple):
    """The call's output: its B rows (rows that joined it, `admission.py`, went to their source)."""
    _stream(call, final=True)
    if call.streamer is not None:
        call.streamer.end()
    batch, prompt_length = prompt_shape
    longest = call.end(batch)  # rows past the first B joined the call and left it with their answers
    sequences = call.sequences[:batch, :longest]  # (B, longest); past each row's length: padding, never written
    head.last_stats = stats
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = longest - prompt_length
    return JetSpecGenerateOutput(
        sequences=sequences,
        scores=_per_step(call.records, 0, steps) if generation_config.output_scores else None,
        logits=_per_step(call.records, 1, steps) if generation_config.output_logits else None,
        jetspec_stats=stats,
    )


def _per_step(records: list, which: int, steps: int) -> tuple:
    """Per generated step, `(B, V)` scores (`which=0`) or logits (`which=1`); finished rows get zeros."""
    zeros = torch.zeros_like(next(entry[which] for row in records for entry in row))  # (V,), on its device
    return tuple(
        torch.stack([rec[step][which] if step < len(rec) else zeros for rec in records]) for step in range(steps)
    )


# Written as `custom_generate/generate.py` next to a saved head, so that
