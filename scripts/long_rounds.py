"""What a tree round costs as the output grows, against a plain decode step: tiny random targets (a full-attention
llama and a mistral whose every layer slides, a 16-token vocabulary so that earlier continuations abound), a random
head at tree-8 with the trie branch, greedy, batch 1 and 4: a round should cost the same at token 8,000 as at token 200.

    OMP_NUM_THREADS=1 python -m scripts.long_rounds                                      # 256 .. 8,192, batch 1 and 4
    OMP_NUM_THREADS=1 nice python -m scripts.long_rounds --lengths 96,256 --batches 1 --span 32   # a smoke run
    python -m scripts.long_rounds --archs smollm2 --lengths 256,4096 --batches 1   # SmolLM2 in float32, shipped head

One `generate` per target and batch makes the longest length (EOS ignored; the output is checked against plain
greedy unless `--no-check`); every round is timed on its own, by the round hook (`jetspec_round_hook`,
`modeling_jetspec/round_hook.py`):

- round: the whole round's time, from its draft to its cache reclaiming (both forwards included);
- host: the round outside its `draft` and `verify` phases (the head's draft forward and the target's verify
  forward, its mask included), i.e. tree building, the trie, acceptance, commit, compaction and reclaiming;
- the cache: bytes of the target cache's keys/values and of the head's context after the round (the head's buffers
  hold up to twice their columns, `columns.py`), and its width (columns) against the longest live row;
- a plain decode step: one target forward of one token per row on a cache of that length (median of 20).

Each figure is the median over the rounds whose row-0 history lies within the last `--span` tokens before each
length. The last line per target and batch is the growth from the shortest to the longest length, in ms, of the
round and of the plain step, and their ratio (the target: the round's growth at most 2x the step's). On CUDA
the peak allocated memory of each call is printed as well (CPU peak resident memory is process-wide, so it is not).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from jetspec.tiny import tiny_target
from jetspec.equality import FLOAT32_TIE_TOLERANCE, row_verdicts
from modeling_jetspec import JetSpecDraftModel, RoundRecord
from modeling_jetspec.reclaim import live_columns

WINDOW = 64
SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "jetspec" / "heads" / "smollm2-135m"


def tiny(arch: str, length: int, vocab: int):
    """The shared tiny random target (`jetspec.tiny`) with room for `length` positions; mistral's window `WINDOW`."""
    extra = {"sliding_window": WINDOW} if arch == "mistral" else {}
    return tiny_target(arch, vocab_size=vocab, max_position_embeddings=length + 256, **extra).eval()


def cache_bytes(state) -> int:
    total = sum(
        t.numel() * t.element_size()
        for layer in state.cache.layers
        if layer.is_initialized
        for t in (layer.keys, layer.values)
    )
    context = state.context
    buffers = context.columns.buffers if context.columns is not None else context.tensors()
    return total + sum(t.numel() * t.element_size() for t in buffers)


class RoundSpy:
    """Keeps every round's times and cache figures: the call's round hook (`jetspec_round_hook=spy`)."""

    def __init__(self, window):
        self.window, self.rounds = window, []

    def __call__(self, record: RoundRecord):
        state = record.state
        if not state.rows.numel():  # the last round: every row finished, nothing left to measure
            return
        self.rounds.append(
            dict(
                history=int(state.anchor_pos[0]),
                round=record.seconds,
                host=record.outside_forwards_seconds,
                draft=record.phases["draft"],
                verify=record.phases["verify"],
                bytes=cache_bytes(state),
                width=state.valid.shape[1],
                live=int(live_columns(state, self.window).sum(1).max()),
            )
        )


def plain_step_seconds(target, length: int, batch: int, vocab: int, repeats: int = 20) -> float:
    cache = DynamicCache()
    ids = torch.randint(1, vocab, (batch, length))
    with torch.no_grad():
        target(input_ids=ids, past_key_values=cache, use_cache=True)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            target(
                input_ids=ids[:, -1:],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((batch, 1), length),
            )
            times.append(time.perf_counter() - started)
            cache.crop(-1)
    return statistics.median(times)


def run(target, head, arch: str, batch: int, longest: int, vocab: int, check: bool) -> RoundSpy:
    """One call of `longest` tokens per row, every round timed; checked against plain greedy with `check`."""
    spy = RoundSpy(WINDOW if arch == "mistral" else None)
    ids = torch.randint(1, vocab, (batch, 16), generator=torch.Generator().manual_seed(batch))
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=longest - ids.shape[1],
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        out = target.generate(**kwargs, assistant_model=head, jetspec_round_hook=spy)
    if check:
        with torch.no_grad():
            check_output(target, ids, target.generate(**kwargs), out, f"{arch}, batch {batch}")
    return spy


def check_output(target, prompts, plain, tree, label: str):
    """Each row's tree output against plain greedy's: equal, or leaving it first at a float32 tie (the target's two
    best logits within `FLOAT32_TIE_TOLERANCE` of each other after the shared prefix, `jetspec.equality.row_verdicts`:
    over thousands of tokens a random tiny target meets such ties, where the tree's and the plain step's kernels may
    round apart); anything else ends the run."""
    verdicts = row_verdicts(target, prompts, torch.ones_like(prompts), plain, tree, FLOAT32_TIE_TOLERANCE)
    for row, verdict in enumerate(verdicts):
        if verdict.kind == "mismatch":
            raise SystemExit(f"{label}, row {row}: the tree's output differs from plain greedy ({verdict})")
        if verdict.kind == "tie":
            print(
                f"{label}, row {row}: leaves plain greedy at new token {verdict.position}, a float32 tie (gap "
                f"{verdict.gap:.2e}); the rounds after it still time the same work"
            )


def report(spy: RoundSpy, plain: dict, lengths: list, span: int):
    rounds = {}
    for n in lengths:
        near = [r for r in spy.rounds if n - span < r["history"] <= n]
        if not near:
            print(f"  {n:6d} tokens: no round ended there")
            continue
        rounds[n] = {key: statistics.median(r[key] for r in near) for key in ("round", "host", "draft", "verify")}
        last = near[-1]
        print(
            f"  {n:6d} tokens: round {rounds[n]['round'] * 1e3:7.3f} ms (host {rounds[n]['host'] * 1e3:7.3f} ms, "
            f"draft {rounds[n]['draft'] * 1e3:7.3f} ms, verify {rounds[n]['verify'] * 1e3:7.3f} ms, "
            f"{len(near)} rounds), plain step {plain[n] * 1e3:6.3f} ms; cache {last['bytes'] / 2**20:7.2f} MiB, "
            f"width {last['width']} columns for {last['live']} live"
        )
    if len(rounds) >= 2:
        lo, hi = min(rounds), max(rounds)
        grew, step = rounds[hi]["round"] - rounds[lo]["round"], plain[hi] - plain[lo]
        ratio = f"{grew / step:.2f}x the step's" if step > 0 else "the step did not grow"
        print(
            f"  growth {lo} -> {hi}: round {grew * 1e3:+.3f} ms, host {(rounds[hi]['host'] - rounds[lo]['host']) * 1e3:+.3f}"
            f" ms, draft {(rounds[hi]['draft'] - rounds[lo]['draft']) * 1e3:+.3f} ms, verify "
            f"{(rounds[hi]['verify'] - rounds[lo]['verify']) * 1e3:+.3f} ms, plain step {step * 1e3:+.3f} ms; "
            f"round growth {ratio}"
        )


def build(arch: str, longest: int, vocab: int, budget: int):
    """`(target, head, vocabulary of the prompts)`: a tiny random target with a random head at tree-`budget` with the
    trie, or (`smollm2`) SmolLM2-135M-Instruct in float32 with the shipped head at its defaults."""
    if arch == "smollm2":
        from jetspec.targets import load_target

        target, _ = load_target("smollm2-135m", dtype=torch.float32)
        head = JetSpecDraftModel.from_pretrained(SHIPPED_HEAD, dtype=torch.float32).eval()
        return target.eval(), head, target.config.vocab_size
    target = tiny(arch, longest, vocab)
    head = JetSpecDraftModel.from_target(
        target,
        num_hidden_layers=1,
        block_size=8,
        tree_depth=4,
        tree_width=3,
        tree_budget=budget,
        tree_lookup=8,
        tree_lookup_branches="trie",
    ).eval()
    return target, head, vocab


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="256,1024,2048,4096,8192", help="history lengths to report (tokens)")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--archs", default="llama,mistral", help="tiny llama, tiny mistral, or smollm2 (float32)")
    parser.add_argument("--vocab", type=int, default=16, help="a small vocabulary: earlier continuations abound")
    parser.add_argument("--budget", type=int, default=8, help="draft nodes of the head's tree")
    parser.add_argument("--span", type=int, default=64, help="rounds within this many tokens before a length")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with plain greedy")
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if lengths[0] <= args.span:
        parser.error(f"expected lengths above --span {args.span}, got {lengths}")
    longest = lengths[-1]
    for arch in args.archs.split(","):
        target, head, vocab = build(arch, longest, args.vocab, args.budget)
        for batch in (int(x) for x in args.batches.split(",")):
            plain = {n: plain_step_seconds(target, n, batch, vocab) for n in lengths}
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            spy = run(target, head, arch, batch, longest, vocab, not args.no_check)
            peak = (
                f", CUDA peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if torch.cuda.is_available() else ""
            )
            window = WINDOW if arch == "mistral" else "none"
            print(f"{arch} (window {window}), batch {batch}: {len(spy.rounds)} rounds" + peak, flush=True)
            report(spy, plain, lengths, args.span)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
