"""A round's host time outside the forwards, and the cache's memory, as the output grows: tiny random targets (a
full-attention llama and a mistral whose every layer slides), a random head with the trie branch, batch 1 and 4.

    OMP_NUM_THREADS=1 python -m scripts.long_rounds --lengths 256,2048,8192 --batches 1,4
    OMP_NUM_THREADS=1 nice python -m scripts.long_rounds --lengths 64,256 --batches 1,2   # a quick smoke run

One `generate` per target and batch makes the longest length (EOS ignored); every round is timed on its own:

- host: the round's wall time minus its two forwards (the head's draft forward, `steps.draft_block`, and the
  target's verify forward), i.e. tree building, the trie, acceptance, commit, compaction and cache reclaiming;
- the cache: bytes of the target cache's keys/values and of the head's context after the round, and its width
  (columns) against the longest live row;
- a plain decode step (one target forward of one token on a cache of that length), for comparison.

Each figure is the median over the rounds whose row-0 history lies within the last `--span` tokens before each
length. `growth` is host(longest) / host(shortest), beside the plain step's own growth. On CUDA the peak allocated
memory of each call is printed as well (CPU peak resident memory is process-wide, so it is not).
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import modeling_jetspec.steps as steps
import modeling_jetspec.verifiers as verifiers
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.reclaim import live_columns

WINDOW = 64


def tiny(arch: str, length: int):
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=length + 256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def cache_bytes(state) -> int:
    total = sum(
        t.numel() * t.element_size()
        for layer in state.cache.layers
        if layer.is_initialized
        for t in (layer.keys, layer.values)
    )
    context = state.context
    return total + sum(t.numel() * t.element_size() for t in (*context.keys, *context.values))


class RoundSpy:
    """Times every round (`decode._round` runs draft, verify, compact through these module attributes)."""

    def __init__(self, window):
        self.window, self.rounds, self.forward = window, [], 0.0
        self.started = None

    def install(self):
        draft_block, verify, reclaim = steps.draft_block, verifiers.verify, verifiers.reclaim

        def timed(fn):
            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                out = fn(*args, **kwargs)
                self.forward += time.perf_counter() - started
                return out

            return wrapper

        def draft_entry(*args, **kwargs):  # the first thing a round does is its draft
            if self.started is None:
                self.started, self.forward = time.perf_counter(), 0.0
            return timed(draft_block)(*args, **kwargs)

        def reclaim_exit(state, window=None, live_bound=None, force=False):  # the round's last step
            state = reclaim(state, window, live_bound, force)
            if self.started is not None and state.rows.numel():
                wall = time.perf_counter() - self.started
                live = int(live_columns(state, self.window).sum(1).max())
                self.rounds.append(
                    dict(
                        history=int(state.anchor_pos[0]),
                        host=wall - self.forward,
                        bytes=cache_bytes(state),
                        width=state.valid.shape[1],
                        live=live,
                    )
                )
            self.started = None
            return state

        steps.draft_block, verifiers.verify, verifiers.reclaim = draft_entry, timed(verify), reclaim_exit


def plain_step_seconds(target, length: int, repeats: int = 20) -> float:
    cache = DynamicCache()
    ids = torch.randint(1, 256, (1, length))
    with torch.no_grad():
        target(input_ids=ids, past_key_values=cache, use_cache=True)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            target(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[length]]))
            times.append(time.perf_counter() - started)
            cache.crop(-1)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="256,2048,8192", help="history lengths to report (tokens)")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--archs", default="llama,mistral")
    parser.add_argument("--span", type=int, default=64, help="rounds within this many tokens before a length")
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if lengths[0] <= args.span:
        parser.error(f"expected lengths above --span {args.span}, got {lengths}")
    longest = lengths[-1]
    for arch in args.archs.split(","):
        target = tiny(arch, longest)
        head = JetSpecDraftModel.from_target(
            target,
            num_hidden_layers=1,
            block_size=8,
            tree_depth=4,
            tree_width=3,
            tree_budget=12,
            tree_lookup=8,
            tree_lookup_branches="trie",
        ).eval()
        plain = {n: plain_step_seconds(target, n) for n in lengths}
        for batch in (int(x) for x in args.batches.split(",")):
            spy = RoundSpy(WINDOW if arch == "mistral" else None)
            saved = steps.draft_block, verifiers.verify, verifiers.reclaim
            spy.install()
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(1, 256, (batch, 16), generator=g)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            try:
                with torch.no_grad():
                    target.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=False,
                        max_new_tokens=longest - ids.shape[1],
                        eos_token_id=None,
                        pad_token_id=0,
                        assistant_model=head,
                    )
            finally:
                steps.draft_block, verifiers.verify, verifiers.reclaim = saved
            peak = (
                f", CUDA peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if torch.cuda.is_available() else ""
            )
            print(
                f"{arch} (window {WINDOW if arch == 'mistral' else 'none'}), batch {batch}: {len(spy.rounds)} rounds"
                + peak
            )
            hosts = {}
            for n in lengths:
                near = [r for r in spy.rounds if n - args.span < r["history"] <= n]
                if not near:
                    print(f"  {n:6d} tokens: no round ended there")
                    continue
                hosts[n] = statistics.median(r["host"] for r in near)
                last = near[-1]
                print(
                    f"  {n:6d} tokens: host {hosts[n] * 1e3:7.3f} ms/round ({len(near)} rounds), plain step "
                    f"{plain[n] * 1e3:6.3f} ms; cache {last['bytes'] / 2**20:7.2f} MiB, width {last['width']} "
                    f"columns for {last['live']} live"
                )
            if len(hosts) >= 2:
                lo, hi = min(hosts), max(hosts)
                print(
                    f"  growth {lo} -> {hi}: host {hosts[hi] / hosts[lo]:.2f}x, plain step {plain[hi] / plain[lo]:.2f}x"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
