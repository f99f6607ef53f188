"""Target forwards per round, tokens per forward and peak memory of hybrid verification, at a real Qwen3.5's state
sizes.

A random Qwen3.5 whose gated delta-net layers have a real one's sizes (32 value heads and 16 key heads of 128: a
recurrent state of 32 x 128 x 128 per layer and row, 2 MiB in fp32), with a small hidden size and few layers, so
the states are real and the weights are not. Tiny states hide what a tree costs: a tree verify whose memory grows
with the states runs more forwards, and only real sizes show it.

Two drafters that know the target's greedy continuation: "always" (the right token is always the top candidate)
and "sometimes" (it is the 1st, 2nd or 3rd candidate by position, so the accepted path runs through later
siblings), at the head's default tree (depth 7, budget 32, width 3 here). Each run is checked against plain greedy
`generate` (float32) and prints one JSON line: rounds, tau, target forwards per round (mean, max) and committed
tokens per target forward (the prefill excluded).

A third drafter, "random", is an untrained head (mostly wrong).

The leaf paths of a tree round run in one forward while what each adds to it (its copy of the row's states, the
gated delta-net's working tensors, its logits, `hybrid_tree.TreeRounds.path_bytes`) fits in
`hybrid_tree.PATHS_FORWARD_BYTES` or a quarter of the target's weights, and never fewer than the batch's rows. This
model's weights are tiny, so the floor applies; `--weights-gb` sets the bound a real target of that many GB of
weights gets (18: Qwen3.5 9B in bf16).

With `--isolate` every (batch, new tokens, drafter, mode) runs in a process of its own, which also reports its peak
resident memory (`ru_maxrss`): `rss_before_mib` after the model, the plain greedy reference and a warm-up call,
`peak_rss_mib` after the measured call (a peak reached before it, by the reference, hides the call's own).

    OMP_NUM_THREADS=1 nice -n 19 python -m scripts.hybrid_forwards --layers 4 --new-tokens 24
    # memory and forwards at batch 1, 2 and 32, 12 and 1,024 new tokens, each mode in its own process, at this
    # model's bound and at a 9B's:
    OMP_NUM_THREADS=1 python -m scripts.hybrid_forwards --layers 8 --isolate --batch 1 2 32 --new-tokens 12 1024 \
        --drafters random always sometimes
    OMP_NUM_THREADS=1 python -m scripts.hybrid_forwards --layers 8 --isolate --batch 1 2 32 --new-tokens 12 1024 \
        --drafters random always sometimes --modes tree --weights-gb 18

`--run-timeout S` stops an isolated run after S seconds and prints it as unfinished (at this model's bound a batch-32
tree round runs a forward per few leaf paths, which takes long on a CPU). `--reference-dir DIR` keeps each plain
greedy reference there (named by the model's weights digest, transformers' version, batch and lengths) and reuses it:
at batch 32 x 1,024 tokens the reference alone is most of a run, and every isolated run needs it.
"""

import argparse
import hashlib
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from modeling_jetspec import JetSpecDraftModel, hybrid_tree
from modeling_jetspec.state import JetSpecStats

REPO = Path(__file__).resolve().parents[1]


class KnowingHead(JetSpecDraftModel):
    """A drafter that knows each row's greedy continuation (`reference`, `(B, L)` token ids by absolute position,
    prompts not left-padded): it ranks the right token first ("always") or 1st, 2nd or 3rd by position
    ("sometimes", behind decoys)."""

    reference: torch.Tensor = None
    mode: str = "always"

    def draft(self, input_ids, position_ids, *args, **kwargs):
        out = super().draft(input_ids, position_ids, *args, **kwargs)
        logits = torch.full_like(out.logits, -1e4)
        vocab = logits.shape[-1]
        for i in range(input_ids.shape[0]):
            row = self._row(int(input_ids[i, 0]), int(position_ids[i, 0]))
            for t in range(input_ids.shape[1]):
                position = int(position_ids[i, t])
                token = int(self.reference[row, position]) if position < self.reference.shape[1] else 0
                logits[i, t, token] = 0.0
                if self.mode == "sometimes":
                    for j in range((position * 7) % 3):  # decoys ranked above the right token
                        logits[i, t, (token + 1 + j) % vocab] = 1.0 - 0.25 * j
        out.logits = logits
        return out

    def _row(self, anchor: int, position: int) -> int:
        """The reference row a batch row decodes: the first one holding its anchor at its position."""
        for row in range(self.reference.shape[0]):
            if position < self.reference.shape[1] and int(self.reference[row, position]) == anchor:
                return row
        return 0


def qwen35(layers: int, vocab: int, seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )  # a real Qwen3.5's gated delta-net sizes; every 4th layer full attention
    return Qwen3_5ForCausalLM(config).eval()


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[24])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["tree", "chain"])
    parser.add_argument("--drafters", nargs="+", default=["always", "sometimes"], help="always, sometimes, random")
    parser.add_argument(
        "--weights-gb",
        type=float,
        default=0.0,
        help="bound forward 1 as a target with this many GB of weights would (0: this model's)",
    )
    parser.add_argument("--isolate", action="store_true", help="each run in its own process, with its peak memory")
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="with --isolate: stop a run after this many seconds and report it unfinished (the next one runs)",
    )
    parser.add_argument(
        "--reference-dir", default=None, help="keep and reuse each plain greedy reference in this folder"
    )
    parser.add_argument("--one", nargs=4, metavar=("BATCH", "NEW", "DRAFTER", "MODE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class RoundForwards:
    """The target forwards of every round of the calls made while installed (`JetSpecStats.add_round`)."""

    def __init__(self):
        self.per_round = []
        add_round = JetSpecStats.add_round

        def recording(stats, budget, counts, *rest, forwards):
            self.per_round.append(forwards)
            return add_round(stats, budget, counts, *rest, forwards=forwards)

        JetSpecStats.add_round = recording


def drafter_head(target, drafter: str, plain: torch.Tensor):
    if drafter == "random":
        torch.manual_seed(1)
        return JetSpecDraftModel.from_target(target, tree_width=3).eval()  # default depth 7, budget 32
    head = KnowingHead.from_target(target, tree_width=3).eval()
    head.reference = torch.nn.functional.pad(plain, (0, 64))
    head.mode = drafter
    return head


def prompt_ids(args, batch: int) -> torch.Tensor:
    return torch.randint(1, args.vocab, (batch, args.prompt_length), generator=torch.Generator().manual_seed(1))


def plain_reference(args, target, batch: int, new: int) -> torch.Tensor:
    """Plain greedy `generate` of `new` tokens per row, read from `--reference-dir` when it holds this model's (same
    weights, same transformers) and written there atomically otherwise."""
    ids = prompt_ids(args, batch)
    path = None
    if args.reference_dir:
        digest = hashlib.sha256(transformers.__version__.encode())
        for name, tensor in sorted(target.state_dict().items()):
            digest.update(name.encode() + tensor.detach().float().contiguous().numpy().tobytes())
        name = f"plain-{digest.hexdigest()[:16]}-p{args.prompt_length}-b{batch}-n{new}.pt"
        path = Path(args.reference_dir) / name
        if path.is_file():
            plain = torch.load(path)
            if torch.equal(plain[:, : ids.shape[1]], ids):
                return plain
    with torch.no_grad():
        plain = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(plain, partial)
        partial.replace(path)
    return plain


def run(args, target, batch: int, new: int, drafter: str, mode: str, plain=None, rounds=None) -> dict:
    """One call of `new` tokens per row at `batch`, checked against plain greedy (`plain`, computed when not given);
    its rounds, tau and forwards."""
    ids = prompt_ids(args, batch)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
    with torch.no_grad():
        plain = target.generate(**kwargs) if plain is None else plain
        head = drafter_head(target, drafter, plain)
        rounds = rounds or RoundForwards()
        rounds.per_round.clear()
        out = target.generate(**kwargs, assistant_model=head, tree_verify=mode)
    stats = head.last_stats
    forwards = stats.target_forwards - 1  # the prefill excluded
    return {
        "batch": batch,
        "new_tokens": new,
        "drafter": drafter,
        "mode": mode,
        "equal_to_greedy": torch.equal(out, plain),
        "rounds": stats.rounds,
        "tau": round(stats.tau, 2),
        "forwards_per_round": round(forwards / max(stats.rounds, 1), 2),
        "max_forwards": max(rounds.per_round, default=0),
        "tokens_per_forward": round(stats.round_tokens / max(forwards, 1), 2),
        "paths_forward_mib": round(hybrid_tree.PATHS_FORWARD_BYTES / 2**20),
    }


def run_alone(args, target, batch: int, new: int, drafter: str, mode: str) -> dict:
    """[`run`] after the plain reference and a warm-up call of 2 tokens, with the process's peak resident memory
    before and after the measured call."""
    plain = plain_reference(args, target, batch, new)
    run(args, target, batch, 2, drafter, mode)  # lazy imports and allocations common to every call
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run(args, target, batch, new, drafter, mode, plain)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {**result, "rss_before_mib": round(before / 1024), "peak_rss_mib": round(after / 1024)}


def main(argv=None) -> None:
    args = parse(argv)
    if args.weights_gb:
        hybrid_tree.PATHS_FORWARD_BYTES = int(args.weights_gb * 1e9 * hybrid_tree.WEIGHTS_SHARE)
    combos = [(b, n, d, m) for b in args.batch for n in args.new_tokens for d in args.drafters for m in args.modes]
    if args.isolate:  # a process per run: its peak memory is its own
        for b, n, d, m in combos:
            rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--isolate"]
            command = [sys.executable, "-m", "scripts.hybrid_forwards", *rest, "--one", str(b), str(n), d, m]
            label = {"batch": b, "new_tokens": n, "drafter": d, "mode": m}
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout, cwd=REPO)
            except subprocess.TimeoutExpired:
                print(json.dumps({**label, "unfinished": f"stopped after {args.run_timeout:g} s"}), flush=True)
                continue
            print(
                done.stdout.strip().splitlines()[-1]
                if done.returncode == 0
                else json.dumps({**label, "error": done.stderr[-500:]}),
                flush=True,
            )
        return
    target = qwen35(args.layers, args.vocab)
    if args.one:
        b, n, d, m = args.one
        print(json.dumps(run_alone(args, target, int(b), int(n), d, m)), flush=True)
        return
    rounds, plains = RoundForwards(), {}
    for b, n, d, m in combos:
        if (b, n) not in plains:
            plains[b, n] = plain_reference(args, target, b, n)
        print(json.dumps(run(args, target, b, n, d, m, plains[b, n], rounds)), flush=True)


if __name__ == "__main__":
    main()
