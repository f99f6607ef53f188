"""GPU check of the round: verify cost per token count, host reads per round, the round outside its forwards, tau.

    python -m scripts.gpu_check                                   # CUDA: a tiny random Qwen3 and SmolLM2-135M
    python -m scripts.gpu_check --targets tiny-qwen3 --dtype bfloat16
    python -m scripts.gpu_check --device cpu --targets tiny-qwen3 --sizes 1,2,4 --new-tokens 8   # the pieces, on a CPU

For each target it prints one JSON line:

- `verify_ratio`: t(B) / t(1), the target's verify forward over B tokens (root + B - 1 tree nodes of the round's
  own `draft`, the root alone at B = 1, through the round's verifier) after a 128-token context, batch 1, against
  the plain one-token decoding step (t(1), `plain_step_seconds`); both sides are measured, so the ratio at B = 1
  is what the verify path (its tree mask, its features) costs over a plain step of as many tokens;
- `host_reads_per_round`: per batch size, the host reads of a `generate` call divided by its rounds, with their
  kinds (`.item()`, `.tolist()`, `bool` / `int` / `float` of a tensor, `.cpu()`, `nonzero`, boolean-mask indexing,
  explicit synchronizes), counted by `jetspec.host_reads.HostReadCounter` (every read stalls the launch queue on a
  GPU);
- `outside_forwards_ms_per_round`: wall time of the call minus the time inside target forwards and head drafts
  (CUDA events on a GPU), per round: the Python and small kernels of the round while the forwards do not run;
- `tau`: committed tokens per row and verify round, from the call's `jetspec_stats`;
- `static_batch_<b>` (unless `--no-static`): milliseconds per generated token of plain greedy with a static cache
  compiled as the static path compiles (`plain_static_compiled`), the default JetSpec path (`jetspec`) and the
  static path compiled (`jetspec_static_compiled`, `modeling_jetspec/static.py`; CUDA graphs on CUDA), each timed
  after a warm-up call, and whether the static path's tokens equal plain greedy's (`static_equal`).

SmolLM2 uses the head committed in `jetspec/heads/smollm2-135m` and `jetspec.targets.load_target`; where its weights
cannot be loaded (no network, no cache) its line says why and the other targets go on. Without a CUDA device the
script exits with status 2, unless `--device cpu` is given.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from jetspec.host_reads import HostReadCounter
from modeling_jetspec import JetSpecDraftModel, resolve_tree_shape
from modeling_jetspec.state import DraftTrees
from modeling_jetspec.steps import draft
from modeling_jetspec.tree import ancestor_mask
from modeling_jetspec.verifiers import verifier_for, verify_seconds

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA_EXIT = 2
TARGETS = ("tiny-qwen3", "smollm2-135m")
HEAD_FOLDER = ROOT / "jetspec" / "heads" / "smollm2-135m"
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 * 23? Explain each step.",
    "List three uses of a binary search tree.",
    "def quicksort(items):",
    "The capital of France is",
)


def build(name: str, device: str, dtype: torch.dtype):
    """`(target, head, prompts)` of a check target on `device`; `prompts(batch)` gives `(input_ids, attention_mask)`."""
    if name == "tiny-qwen3":
        from jetspec.tiny import tiny_target

        target = tiny_target("qwen3").to(device, dtype)
        head = JetSpecDraftModel.from_target(target).eval()

        def prompts(batch):
            ids = torch.randint(1, 128, (batch, 32), generator=torch.Generator().manual_seed(0)).to(device)
            return ids, torch.ones_like(ids)

        return target, head, prompts
    if name == "smollm2-135m":
        from jetspec.targets import load_target

        target, tokenizer = load_target(name, dtype=dtype)
        target = target.to(device)
        head = JetSpecDraftModel.from_pretrained(HEAD_FOLDER).to(device, dtype).eval()
        tokenizer.padding_side = "left"

        def prompts(batch):
            inputs = tokenizer([PROMPTS[i % len(PROMPTS)] for i in range(batch)], return_tensors="pt", padding=True)
            return inputs["input_ids"].to(device), inputs["attention_mask"].to(device)

        return target, head, prompts
    raise ValueError(f"expected a target among {TARGETS}, got {name!r}")


def verify_ratios(target, head, sizes, context_length: int = 128, repeats: int = 5) -> dict:
    """t(B) / t(1), batch 1, after `context_length` tokens: t(B) is the verify forward over B tokens (the root and
    B - 1 tree nodes, [`verify_seconds_by_size`]); t(1) is the plain decoding step (one token, no tree), what the
    ratios are against. Both sides are measured: at B = 1 the ratio is the verify of the root alone against the plain
    step, the cost of the verify path itself."""
    if 1 not in sizes or min(sizes) < 1:
        raise ValueError(f"expected verify sizes >= 1 including 1 (the ratios' base), got {sizes}")
    seconds = verify_seconds_by_size(target, head, sizes, context_length, repeats)
    one = plain_step_seconds(target, context_length, repeats)
    return {size: round(seconds[size] / one, 3) for size in sizes}


@torch.no_grad()
def verify_seconds_by_size(target, head, sizes, context_length: int = 128, repeats: int = 5) -> dict:
    """`{B: seconds}`: median wall time of the round's verify forward over B tokens, batch 1, after a prefilled
    random context of `context_length` tokens (the prompt `plain_step_seconds` draws). B >= 2: the root and the
    B - 1 nodes of the head's own tree (`steps.draft` without path conditioning or lookup branch, as
    `verifiers.measure_verify_seconds` drafts); B = 1: the root alone, under the same tree mask."""
    vocab = target.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(0, vocab, (1, context_length), generator=torch.Generator().manual_seed(0))
    verifier = verifier_for(target, head)
    state, _ = verifier.prefill(prompt.to(target.device), None)
    alone = replace(resolve_tree_shape(head.config), path_conditioning=False, lookup=0)
    trees = {size: draft(head, state, alone, size - 1) if size > 1 else root_only(state) for size in sizes}
    return {size: verify_seconds(verifier, state, trees[size], repeats) for size in sizes}


def root_only(state) -> DraftTrees:
    """Trees of no node: each active row's verify reads its anchor alone."""
    rows, device = state.anchors.shape[0], state.anchors.device
    parents = torch.zeros(rows, 0, dtype=torch.long, device=device)  # (A, 0)
    return DraftTrees(
        tokens=parents.clone(),
        parents=parents,
        depths=torch.zeros(rows, 1, dtype=torch.long, device=device),  # (A, 1)
        ancestors=ancestor_mask(parents),  # (A, 1, 1)
        budget=0,
    )


@torch.no_grad()
def plain_step_seconds(target, context_length: int = 128, repeats: int = 5) -> float:
    """Median wall time of one plain greedy decoding step (one token after a cache of `context_length` random
    tokens, the prompt `verify_seconds_by_size` draws), the cache cropped back after every step."""
    from transformers import DynamicCache

    from modeling_jetspec.timing import median_seconds

    vocab = target.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(0, vocab, (1, context_length), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(target.device)
    cache = DynamicCache()
    target(input_ids=prompt, past_key_values=cache, use_cache=True)
    step = prompt[:, -1:]
    position = torch.tensor([[context_length]], device=target.device)

    def once():
        target(input_ids=step, position_ids=position, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the step's entry

    return median_seconds(once, repeats=repeats, warmup=1)


def host_reads(target, head, ids, mask, new_tokens: int) -> dict:
    """Host reads per round of one greedy `generate` call with the head, by kind."""
    with HostReadCounter(pretend_accelerator=False) as reads:  # on a GPU its synchronizes run
        out = generate(target, head, ids, mask, new_tokens)
    rounds = max(out.jetspec_stats.rounds, 1)
    return {
        "per_round": round(reads.total / rounds, 2),
        "kinds": {k: round(v / rounds, 2) for k, v in reads.counts.most_common()},
        "rounds": rounds,
    }


def outside_forwards(target, head, ids, mask, new_tokens: int) -> dict:
    """Milliseconds per round outside target forwards and head drafts, and tau, of one greedy `generate` call."""
    spans = []  # (start, end) per forward: CUDA events, or perf_counter seconds on a CPU
    cuda = ids.device.type == "cuda"

    def mark():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    starts = []
    handles = [
        target.register_forward_pre_hook(lambda *a: starts.append(mark())),
        target.register_forward_hook(lambda *a: spans.append((starts.pop(), mark()))),
    ]
    draft = head.draft

    def timed_draft(*args, **kwargs):
        start = mark()
        out = draft(*args, **kwargs)
        spans.append((start, mark()))
        return out

    head.draft = timed_draft
    try:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(target, head, ids, mask, new_tokens)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        del head.draft
        for handle in handles:
            handle.remove()
    inside = sum(a.elapsed_time(b) / 1000 if cuda else b - a for a, b in spans)
    stats = out.jetspec_stats
    return {
        "outside_forwards_ms_per_round": round(1000 * (wall - inside) / max(stats.rounds, 1), 3),
        "forwards_ms_per_round": round(1000 * inside / max(stats.rounds, 1), 3),
        "tau": round(stats.tau, 3),
        "rounds": stats.rounds,
    }


@torch.no_grad()
def generate(target, head, ids, mask, new_tokens: int):
    return target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        assistant_model=head,
        return_dict_in_generate=True,
    )


@torch.no_grad()
def static_timing(target, head, ids, mask, new_tokens: int) -> dict:
    """Milliseconds per generated token of plain greedy (static cache, compiled like the static path), the default
    JetSpec path and the compiled static path; each call timed after one warm-up call of the same shapes."""
    from transformers import CompileConfig

    from modeling_jetspec.static import compile_options

    config = CompileConfig(**compile_options(ids.device))
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    common = dict(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )
    methods = {
        "plain_static_compiled": dict(cache_implementation="static", compile_config=config),
        "jetspec": dict(assistant_model=head),
        "jetspec_static_compiled": dict(assistant_model=head, jetspec_static="compile"),
    }
    record, outputs = {}, {}
    for method, kwargs in methods.items():
        target.generate(**common, **kwargs)  # warm-up: compilation, CUDA graphs, allocator
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs[method] = target.generate(**common, **kwargs)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        record[f"{method}_ms_per_token"] = round(1000 * (time.perf_counter() - start) / new_tokens, 3)
    record["static_equal"] = bool(torch.equal(outputs["jetspec_static_compiled"], outputs["plain_static_compiled"]))
    return record


@torch.no_grad()
def check(name: str, args) -> dict:
    """Every measurement of one target, as one JSON-ready record."""
    record = {"target": name, "device": args.device, "dtype": args.dtype}
    dtype = getattr(torch, args.dtype)
    try:
        target, head, prompts = build(name, args.device, dtype)
    except (OSError, ImportError, ValueError) as error:  # weights out of reach: say so, go on with the others
        return {**record, "skipped": f"{type(error).__name__}: {error}"}
    record["verify_ratio"] = verify_ratios(target, head, args.sizes)
    record["host_reads_per_round"] = {}
    for batch in args.batches:
        ids, mask = prompts(batch)
        generate(target, head, ids, mask, 4)  # warm-up: kernels, allocator
        record["host_reads_per_round"][batch] = host_reads(target, head, ids, mask, args.new_tokens)
        record[f"batch_{batch}"] = outside_forwards(target, head, ids, mask, args.new_tokens)
        if args.static:
            record[f"static_batch_{batch}"] = static_timing(target, head, ids, mask, args.new_tokens)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: test the pieces only")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, among {TARGETS}")
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="verify token counts B for t(B) / t(1)")
    parser.add_argument("--batches", default="1,4", help="batch sizes of the generate calls")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--no-static",
        dest="static",
        action="store_false",
        help="skip timing the static path (compiled; minutes of compilation per target)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with a GPU, "
            "or pass --device cpu to exercise its pieces",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    if 1 not in args.sizes or min(args.sizes) < 1:
        raise ValueError(f"expected verify sizes >= 1 including 1 (the ratios' base: the plain step), got {args.sizes}")
    names = args.targets.split(",")
    if set(names) - set(TARGETS):
        raise ValueError(f"expected targets among {TARGETS}, got {sorted(set(names) - set(TARGETS))}")
    for name in names:
        print(json.dumps(check(name, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
