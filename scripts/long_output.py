"""Plain greedy against tree decoding on long outputs: SmolLM2-135M-Instruct (`--dtype auto`: bf16 where the hardware
runs it natively, else fp32) with a saved head, 1,024 new tokens per call, the two alternated in one process; prints every call and the speedup ratio.

    python -m scripts.long_output
    python -m scripts.long_output --repeats 3 --max-new-tokens 2048 --head /path/to/the/same/head

Made to compare checkouts (before and after a change to the round): it calls only `load_target`,
`JetSpecDraftModel.from_pretrained` and `target.generate(..., assistant_model=head)`, which every version has, so
the same file runs unchanged in each. The head defaults to the checkout's own shipped one; pass `--head` with one
folder to time both checkouts with the same head (the same drafts, so the same tau). End-of-sequence is ignored
(`eos_token_id=None`): every call makes exactly `--max-new-tokens` tokens, where per-round cache work shows most.
Timing uses `modeling_jetspec.timing.clock`, which waits for the accelerator. Run nothing else meanwhile.
"""

import argparse
import statistics
from pathlib import Path

import torch

from jetspec.targets import apply_chat_template, load_target, resolve_dtype
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.timing import clock

SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "jetspec" / "heads" / "smollm2-135m"
PROMPTS = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a compiler turns source code into machine code, with examples.",
    "Write a Python module that implements a priority queue, a trie and a LRU cache, with tests.",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, default=SHIPPED_HEAD, help="saved head folder (default: the shipped one)")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="new tokens per call (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per prompt and method")
    parser.add_argument("--budget", type=int, default=None, help="tree budget (default: the head's)")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (see jetspec.targets.resolve_dtype)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeats < 1:
        parser.error(f"expected --max-new-tokens and --repeats >= 1, got {args.max_new_tokens} and {args.repeats}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype, reason = resolve_dtype(args.dtype)
    print(f"target dtype {str(dtype).removeprefix('torch.')} ({reason})", flush=True)
    target, tokenizer = load_target("smollm2-135m", dtype=dtype)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=target.dtype).to(target.device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(do_sample=False, eos_token_id=None, pad_token_id=pad, max_new_tokens=args.max_new_tokens)
    tree = dict(assistant_model=head, **({} if args.budget is None else {"tree_budget": args.budget}))
    methods = {"plain": {}, "tree": tree}
    seconds = {name: [] for name in methods}
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS):
            text = apply_chat_template(tokenizer, prompt)
            enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(target.device)
            for name, extra in methods.items():  # untimed warm-up of both paths
                target.generate(**enc, **dict(common, max_new_tokens=8), **extra)
            for repeat in range(args.repeats):
                order = list(methods) if (index + repeat) % 2 == 0 else list(methods)[::-1]  # alternate who goes first
                for name in order:
                    started = clock()
                    out = target.generate(**enc, **common, **methods[name])
                    elapsed = clock() - started
                    new = out.shape[1] - enc["input_ids"].shape[1]
                    seconds[name].append(elapsed)
                    print(
                        f"prompt {index} repeat {repeat} {name:5s}: {new} tokens in {elapsed:7.2f} s "
                        f"({new / elapsed:6.1f} tok/s)",
                        flush=True,
                    )
    plain, spec = statistics.median(seconds["plain"]), statistics.median(seconds["tree"])
    print(
        f"median seconds per {args.max_new_tokens}-token call: plain {plain:.2f}, tree {spec:.2f}; "
        f"speedup {plain / spec:.3f}x (per-call ratios: "
        + ", ".join(f"{p / t:.2f}" for p, t in zip(seconds["plain"], seconds["tree"]))
        + ")"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
