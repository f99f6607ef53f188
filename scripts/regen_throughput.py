"""Regeneration throughput, side by side in one process: `generate` at several batch sizes (with and without the
feature capture that `regenerate.py --feature_store` uses, with generate's dynamic or a static KV cache, in file order
or with the prompts sorted by length first) and transformers' continuous batching (`generate_batch`).

Every setting answers the same prompts (train-mix rows not yet in the committed data) with the same
`max_new_tokens`, round after round on fresh prompts, the order of the settings rotating per round so that a drift
of the machine falls on every setting alike; the table reports answer tokens per second of wall time.

    python -m scripts.regen_throughput --prompts 128 --rounds 2 --max_new_tokens 96 --batch_sizes 32,64,128 --continuous
"""

import argparse
import json
import time


from jetspec.targets import apply_chat_template, load_target, resolve_dtype
from modeling_jetspec.configuration_jetspec import default_target_layer_ids
from training.answers import _generate_shard, compact_ids, read_prompts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128, help="prompts per round (every setting answers them)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds on fresh prompts; the setting order rotates")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument(
        "--batch_sizes",
        default="32,64,128",
        help="settings: a batch size, optionally with `+static` (static KV cache) and `+pool` (the "
        "round's prompts sorted by length before being cut into shards), e.g. 32,32+static+pool",
    )
    parser.add_argument("--shard_size", type=int, default=64, help="rows per shard, as regenerate.py cuts them")
    parser.add_argument("--capture", action="store_true", help="generate with the feature capture of --feature_store")
    parser.add_argument("--continuous", action="store_true", help="also time continuous batching (generate_batch)")
    parser.add_argument("--out", default=None, help="jsonl file to append the results to")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 only where the CPU runs it natively), float32, bfloat16"
    )
    args = parser.parse_args(argv)
    dtype, reason = resolve_dtype(args.dtype)
    print(f"dtype {dtype} ({reason})", flush=True)
    model, tokenizer = load_target("smollm2-135m", dtype=dtype)
    packed, _ = compact_ids("training/data/smollm2-135m-mix.npz")
    records = [r for r in read_prompts("training/prompts/train_mix.jsonl") if r["id"] not in packed]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    capture = default_target_layer_ids(model.config.num_hidden_layers) if args.capture else None
    settings = [f"generate batch {b}" for b in args.batch_sizes.split(",")]
    settings += ["continuous batching"] if args.continuous else []
    totals = {name: [0, 0.0] for name in settings}  # answer tokens, seconds

    def run(name: str, prompts: list) -> int:
        counted = []
        continuous = name == "continuous batching"
        batch, *options = name.split()[-1].split("+")
        if "pool" in options:
            prompts = sorted(prompts, key=lambda r: len(r["prompt_ids"]))
        # regenerate.py cuts the prompts into shards and sorts each by length into batches
        step = len(prompts) if continuous else args.shard_size
        for start in range(0, len(prompts), step):
            _generate_shard(
                model,
                tokenizer,
                prompts[start : start + step],
                batch_size=0 if continuous else int(batch),
                max_new_tokens=args.max_new_tokens,
                sample_temperature=0.0,
                pad_token_id=pad,
                on_batch=lambda rows, tokens: counted.append(tokens),
                capture_layers=None if continuous else capture,  # continuous batching returns no states
                continuous=continuous,
                cache_implementation="static" if "static" in options else None,
            )
        return sum(counted)

    for round_ in range(args.rounds):
        chunk = records[round_ * args.prompts : (round_ + 1) * args.prompts]
        shard = [
            {
                **r,
                "prompt_ids": tokenizer(apply_chat_template(tokenizer, r["prompt"]), add_special_tokens=False)[
                    "input_ids"
                ],
            }
            for r in chunk
        ]
        order = settings[round_ % len(settings) :] + settings[: round_ % len(settings)]
        for name in order:
            start = time.perf_counter()
            tokens = run(name, shard)
            seconds = time.perf_counter() - start
            totals[name][0] += tokens
            totals[name][1] += seconds
            print(
                json.dumps({"round": round_, "setting": name, "tokens": tokens, "tok_s": round(tokens / seconds, 1)}),
                flush=True,
            )
    base = totals[settings[0]][0] / totals[settings[0]][1]
    results = [
        {
            "setting": name,
            "dtype": str(dtype).removeprefix("torch."),
            "capture": bool(capture),
            "prompts": args.prompts * args.rounds,
            "max_new_tokens": args.max_new_tokens,
            "answer_tokens": tokens,
            "seconds": round(seconds, 1),
            "tok_s": round(tokens / seconds, 1),
            "vs_first": round(tokens / seconds / base, 2),
        }
        for name, (tokens, seconds) in totals.items()
    ]
    print("| setting | answer tokens | tok/s | vs " + settings[0] + " |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['setting']} | {r['answer_tokens']} | {r['tok_s']} | {r['vs_first']:.2f}x |")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    main()
