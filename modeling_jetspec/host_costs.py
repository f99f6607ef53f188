"""This host's costs for a target, measured once and kept on disk, and the operating point they choose
(`budget.py`; `docs/design.md`, "§4 Measures").

Two figures, both in plain decode steps `t(1)` (the target's forward over one new token after a cached context, what
plain greedy `generate` runs per token):

- `verify_ratio[B] = t(B) / t(1)`: the verify forward over a tree of B nodes (`verifiers.measure_verify_seconds`,
  through a verifier like the call's own);
- `overhead[sources] = c`: the rest of a round (the head's draft, the tree, accept, commit, compaction), from a short
  real call with those sources in timed rounds (`timing.timed_rounds`): seconds outside the verify forward per round.

They depend on the host, the target, its dtype and the batch size, so they are cached under all of them (and the
thread count, and for `c` the head's settings) in a JSON file: `$JETSPEC_HOST_COSTS`, else `host_costs.json` beside
the host facts' cache (`host_cache.cache_path`: `$JETSPEC_HOST_CACHE`'s folder, else `$JETSPEC_CACHE`, else
`~/.cache/jetspec`). Only what the file lacks is measured; `jetspec costs` prints it, `jetspec costs --clear` empties it.
"""

import copy
import hashlib
import json
import os
import statistics
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from .budget import (
    FALLBACK_BUDGET,
    OperatingPoint,
    candidates,
    check_tau_by_budget,
    choose_point,
    fallback_point,
    sources_shape,
)
from .host_cache import cache_path, read_cache, store, this_host_key
from .state import TreeShape
from .timing import clock, timed_rounds
from .verifiers import measure_verify_seconds

COSTS_ENV = "JETSPEC_HOST_COSTS"
CONTEXT_TOKENS = 64  # the cached context every cost is measured after
OVERHEAD_TOKENS = 24  # new tokens of the short call that times a round's overhead


def costs_path() -> Path:
    """`$JETSPEC_HOST_COSTS`, else `host_costs.json` in the folder of [`host_cache.cache_path`]."""
    if os.environ.get(COSTS_ENV):
        return Path(os.environ[COSTS_ENV]).expanduser()
    return cache_path().parent / "host_costs.json"


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


_IDENTITIES = weakref.WeakKeyDictionary()  # target -> (its config object, its identity)


def target_identity(target) -> str:
    """The target's name and a digest of its whole config (two targets of one config cost the same). Kept per target
    and config object: serializing and hashing the config took about half a millisecond of every `"auto"` call."""
    kept = _IDENTITIES.get(target)
    if kept is not None and kept[0] is target.config:
        return kept[1]
    fields = target.config.to_dict()
    name = fields.pop("_name_or_path", "") or type(target).__name__
    identity = f"{name}#{_digest(fields)}"
    _IDENTITIES[target] = (target.config, identity)
    return identity


def head_identity(head) -> str:
    """A digest of the head's config without its `tau_by_budget` (writing a table keeps the head's costs)."""
    fields = head.config.to_dict()
    for name in ("tau_by_budget", "_name_or_path"):
        fields.pop(name, None)
    return _digest(fields)


def costs_key(target, batch: int, tree_verify: str = "auto") -> str:
    """The cache key: the device (a GPU's name, else the CPU's host facts), threads, target, dtype, batch, verify."""
    device = target.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else this_host_key()
    return (
        f"{device.type}: {where} | threads {torch.get_num_threads()} | {target_identity(target)} | "
        f"{str(target.dtype).removeprefix('torch.')} | batch {batch} | verify {tree_verify}"
    )


def read_costs(path: os.PathLike | None = None) -> dict:
    """Every cached entry, `{key: {"step_seconds", "verify_ratio", "overhead"}}` (`{}` without a file)."""
    return read_cache(Path(path) if path is not None else costs_path())


def clear_costs(path: os.PathLike | None = None) -> int:
    """Remove the cache file; returns the number of entries it held."""
    path = Path(path) if path is not None else costs_path()
    held = len(read_cache(path))
    path.unlink(missing_ok=True)
    return held


def _random_prompt(target, batch: int, length: int, seed: int) -> torch.Tensor:
    vocab = target.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).to(target.device)  # (batch, length)


@torch.no_grad()
def measure_step_seconds(target, batch: int, context_length: int = CONTEXT_TOKENS, repeats: int = 5) -> float:
    """`t(1)`: median seconds of the target's forward over one new token per row after a cached random context of
    `context_length` tokens (a fresh copy of the cache each time, untimed), waiting for the accelerator."""
    prompt = _random_prompt(target, batch, context_length + 1, seed=0)
    past = target(input_ids=prompt[:, :-1], use_cache=True).past_key_values
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        cache = copy.deepcopy(past)
        start = clock()
        target(input_ids=prompt[:, -1:], past_key_values=cache, use_cache=True)
        times.append(clock() - start)
    return statistics.median(times[1:])


@torch.no_grad()
def measure_overhead_seconds(
    target, head, shape: TreeShape, sources: str, batch: int, tree_verify: str = "auto", new_tokens=OVERHEAD_TOKENS
) -> float:
    """Seconds per round outside the verify forward, in a real greedy call of `new_tokens` at budget
    [`budget.FALLBACK_BUDGET`] with `sources`, on a random prompt said twice (so that lookup finds matches), after
    an untimed warm-up call."""
    tree = sources_shape(shape, sources, FALLBACK_BUDGET)
    prompt = _random_prompt(target, batch, CONTEXT_TOKENS // 2, seed=1).repeat(1, 2)  # (batch, CONTEXT_TOKENS)
    kwargs = dict(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        assistant_model=head,
        tree_budget=tree.budget,
        tree_depth=tree.depth,
        tree_width=tree.width,
        tree_scoring=tree.scoring,
        tree_lookup=tree.lookup,
        tree_lookup_branches=tree.lookup_branches,
        tree_lookup_record=tree.lookup_record,
        tree_verify=tree_verify,
        return_dict_in_generate=True,
    )
    with timed_rounds():
        target.generate(**kwargs, max_new_tokens=4)
        stats = target.generate(**kwargs, max_new_tokens=new_tokens).jetspec_stats
    return stats.outside_verify_seconds / max(stats.rounds, 1)


def host_costs(target, head, shape: TreeShape, budgets, sources, batch: int, tree_verify="auto", path=None) -> dict:
    """`{"verify_ratio": {B: t(B) / t(1)}, "overhead": {sources: c}, "key"}` for `budgets` and `sources`, from the
    cache file `path` (default [`costs_path`]); what it lacks is measured (with a new `t(1)`) and stored."""
    path = Path(path) if path is not None else costs_path()
    key = costs_key(target, batch, tree_verify)
    entry = read_cache(path).get(key, {})
    ratios = {int(b): r for b, r in entry.get("verify_ratio", {}).items()}
    overheads = dict(entry.get("overhead", {}))
    head_id = head_identity(head)
    missing = [b for b in budgets if b not in ratios]
    unseen = [s for s in sources if f"{head_id} {s}" not in overheads]
    if missing or unseen:
        step = measure_step_seconds(target, batch)
        if missing:
            seconds = measure_verify_seconds(target, head, shape, missing, batch_size=batch, tree_verify=tree_verify)
            ratios.update({b: seconds[b] / step for b in missing})
        for s in unseen:
            overheads[f"{head_id} {s}"] = measure_overhead_seconds(target, head, shape, s, batch, tree_verify) / step
        ratio_field = {str(b): r for b, r in sorted(ratios.items())}
        store(path, key, {"step_seconds": step, "verify_ratio": ratio_field, "overhead": overheads})
    return {
        "verify_ratio": {b: ratios[b] for b in budgets},
        "overhead": {s: overheads[f"{head_id} {s}"] for s in sources},
        "key": key,
    }


def operating_point(
    head, target, shape: TreeShape, batch: int, tree_verify: str = "auto", path=None, among: str | None = None
):
    """`(shape at the chosen point, OperatingPoint)` for a `tree_budget="auto"` call of `batch` rows: the head's
    `tau_by_budget` weighed against this host's costs ([`host_costs`], kept on the head per target object too), or
    [`budget.fallback_point`] without a table. `among`: one of [`budget.SOURCES`], to choose among its budgets only
    (a running call keeps its sources); the costs are those of every candidate all the same, measured once."""
    table = check_tau_by_budget(getattr(head.config, "tau_by_budget", None))
    if table is None:
        point = fallback_point(shape)
        return replace(shape, budget=point.budget), point
    weighed = candidates(table, shape)
    budgets = sorted({b for bs in weighed.values() for b in bs})
    sources = sorted(weighed)
    per_target = head.verify_cost_cache.setdefault(target, {})  # weak: an entry goes with its target
    memo = ("host_costs", costs_key(target, batch, tree_verify), tuple(budgets), tuple(sources))
    if memo not in per_target and weighed:
        per_target[memo] = host_costs(target, head, shape, budgets, sources, batch, tree_verify, path)
    costs = per_target.get(memo, {"verify_ratio": {}, "overhead": {}})
    weighs = table if among is None else {among: table[among]}
    point: OperatingPoint = choose_point(weighs, costs["verify_ratio"], costs["overhead"], shape)
    point.host_costs = costs.get("key")
    return sources_shape(shape, point.sources, point.budget), point
