"""Times the static path (`modeling_jetspec/static.py`) against eager JetSpec and plain greedy, per dtype.

    python -m scripts.static_bench                                            # smollm2-135m, float32 and bfloat16
    python -m scripts.static_bench --target smollm2-135m --suites gsm8k,humaneval,mtbench --prompts 5 --new-tokens 128
    python -m scripts.static_bench --target tiny-llama --prompts 2 --new-tokens 16     # a smoke run, random weights

Methods, each run once per prompt to warm up (compilation, allocator) and then timed, batch 1, greedy:

- `plain`: plain `generate` (dynamic cache, eager);
- `plain_static_compiled`: plain `generate` with `cache_implementation="static"` and the same `torch.compile`
  settings as the static path (a `CompileConfig` that compiles on every device): the fair baseline of a compiled
  JetSpec;
- `jetspec`: the default path (dynamic cache, eager);
- `jetspec_static`: the static path, eager (`jetspec_static="eager"`);
- `jetspec_static_compiled`: the static path, compiled (`jetspec_static="compile"`).

Every method's tokens are compared with `plain`'s (in float32 they must be equal; in bfloat16 ties may break
differently, reported as `equal_fraction`). Prints one JSON line per (dtype, method): tokens per second over the
prompts (sum of tokens / sum of seconds), the median per-prompt ratio against `plain` and against
`plain_static_compiled`, tau, the fraction of prompts equal to `plain`, and what each prompt's untimed first call
cost over its timed one (`first_call_extra_seconds` for the first prompt: compilation; the later prompts' summed:
recompiling for new lengths). `--out FILE` also writes them as JSON.

The target is given by name: `smollm2-135m` (`jetspec.targets.load_target`, with the head committed in
`jetspec/heads/smollm2-135m`) or a tiny random `tiny-llama` / `tiny-qwen3` with a random head (smoke runs).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from modeling_jetspec import JetSpecDraftModel

ROOT = Path(__file__).resolve().parents[1]

TARGETS = ("smollm2-135m", "tiny-llama", "tiny-qwen3")
METHODS = ("plain", "plain_static_compiled", "jetspec", "jetspec_static", "jetspec_static_compiled")
HEAD_FOLDER = ROOT / "jetspec" / "heads" / "smollm2-135m"


def build(name: str, device: str, dtype: torch.dtype):
    """`(target, head, encode)`: `encode(prompt text)` gives `(input_ids, attention_mask)` of one prompt."""
    if name == "smollm2-135m":
        from jetspec.targets import encode_chat, load_target

        target, tokenizer = load_target(name, dtype=dtype, device=device)
        head = JetSpecDraftModel.from_pretrained(HEAD_FOLDER).to(device, dtype).eval()

        def encode(prompt: str):
            enc = encode_chat(tokenizer, prompt)
            return enc["input_ids"].to(device), enc["attention_mask"].to(device)

        return target, head, encode
    if name in ("tiny-llama", "tiny-qwen3"):
        from jetspec.tiny import tiny_target

        target = tiny_target(name.removeprefix("tiny-")).to(device, dtype)
        head = JetSpecDraftModel.from_target(
            target, num_hidden_layers=1, block_size=8, tree_depth=4, tree_width=3, tree_budget=8, tree_lookup=4
        ).eval()

        def encode(prompt: str):  # the prompt's bytes folded into the tiny vocabulary
            ids = torch.tensor([[1 + b % 127 for b in prompt.encode()[:48]]], device=device)
            return ids, torch.ones_like(ids)

        return target, head, encode
    raise ValueError(f"expected a target among {TARGETS}, got {name!r}")


def method_kwargs(method: str, device: torch.device) -> dict:
    """The `generate` arguments of a method, beside the common ones."""
    if method == "plain":
        return {}
    if method == "plain_static_compiled":
        from transformers import CompileConfig

        from modeling_jetspec.static import compile_options

        options = compile_options(device)
        config = CompileConfig(**options)
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        return {"cache_implementation": "static", "compile_config": config}
    if method == "jetspec":
        return {}
    return {"jetspec_static": "compile" if method == "jetspec_static_compiled" else "eager"}


@torch.no_grad()
def run(target, head, method: str, ids, mask, new_tokens: int) -> tuple:
    """`(new tokens (n,), seconds, tau or None)` of one call, timed after the device is idle."""
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=target.generation_config.pad_token_id or 0,
        **method_kwargs(method, ids.device),
    )
    if method.startswith("jetspec"):
        kwargs["assistant_model"] = head
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = target.generate(**kwargs)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tau = head.last_stats.tau if method.startswith("jetspec") else None
    return out[0, ids.shape[1] :], seconds, tau


def bench(args, dtype_name: str) -> list:
    dtype = getattr(torch, dtype_name)
    target, head, encode = build(args.target, args.device, dtype)
    from jetspec.prompts import load_prompts

    prompts = [row["prompt"] for suite in args.suites for row in load_prompts(suite, args.prompts)]
    # per method, per prompt: (tokens, seconds, tau, equal to plain, warm-up extra seconds)
    rows = {m: [] for m in args.methods}
    for text in prompts:
        ids, mask = encode(text)
        reference = None
        for method in args.methods:
            _, warm, _ = run(target, head, method, ids, mask, args.new_tokens)  # warm-up: compilation, allocator
            tokens, seconds, tau = run(target, head, method, ids, mask, args.new_tokens)
            if method == "plain":
                reference = tokens
            equal = None if reference is None else bool(torch.equal(tokens, reference))
            rows[method].append((tokens.numel(), seconds, tau, equal, warm - seconds))
    records = []
    base = {m: rows[m] for m in ("plain", "plain_static_compiled") if m in rows}
    for method, results in rows.items():
        tokens, seconds = sum(r[0] for r in results), sum(r[1] for r in results)
        record = {
            "target": args.target,
            "device": args.device,
            "dtype": dtype_name,
            "method": method,
            "prompts": len(results),
            "new_tokens": args.new_tokens,
            "tokens_per_second": round(tokens / seconds, 2),
        }
        for name, reference in base.items():
            ratios = [(r[0] / r[1]) / (b[0] / b[1]) for r, b in zip(results, reference)]
            record[f"median_over_{name}"] = round(statistics.median(ratios), 3)
        # what a prompt's first call paid over its second (compilation, recompiling for a new length, allocator):
        # the first prompt's, then the later prompts' summed (a server pays these on its first requests)
        record["first_call_extra_seconds"] = round(results[0][4], 2)
        record["later_first_calls_extra_seconds"] = round(sum(r[4] for r in results[1:]), 2)
        taus = [r[2] for r in results if r[2] is not None]
        if taus:
            record["tau"] = round(statistics.mean(taus), 3)
        equal = [r[3] for r in results if r[3] is not None]
        if equal and method != "plain":
            record["equal_fraction"] = round(sum(equal) / len(equal), 3)
        records.append(record)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", choices=TARGETS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--suites", default="gsm8k,humaneval,mtbench")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per suite")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, among {METHODS}")
    parser.add_argument("--out", type=Path, help="also write the records to this JSON file")
    args = parser.parse_args(argv)
    from jetspec.prompts import check_suites

    args.suites = check_suites(args.suites.split(","))
    args.methods = args.methods.split(",")
    if set(args.methods) - set(METHODS) or "plain" not in args.methods:
        raise ValueError(f"expected methods among {METHODS}, plain included, got {args.methods}")
    dtypes = args.dtypes.split(",")
    if set(dtypes) - {"float32", "bfloat16", "float16"}:
        raise ValueError(f"expected dtypes among float32, bfloat16, float16, got {dtypes}")
    if args.new_tokens < 1 or args.prompts < 1:
        raise ValueError(f"expected --new-tokens and --prompts >= 1, got {args.new_tokens} and {args.prompts}")
    torch._dynamo.config.recompile_limit = 64  # one graph per cache length (prompt lengths differ)
    records = []
    for dtype in dtypes:
        for record in bench(args, dtype):
            print(json.dumps(record), flush=True)
            records.append(record)
    if args.out is not None:
        args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
