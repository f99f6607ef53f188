"""Decoding settings of a head side by side on held-out regenerated prompts (never the benchmark suites): tau and
speed over plain greedy, every setting on every prompt in one process, in an order that rotates per prompt.

    python -m scripts.ablate_decoding --out results/ablation-decoding --prompts 12 --max-new-tokens 128

The prompts are the held-out rows of the training data (the trainer's hash split), so the defaults chosen here are
not tuned on the evaluation suites. Each setting is a set of `generate` tree arguments (see SETTINGS).
Results: OUT/decoding.json and OUT/decoding.md. Run from the repository root, as a module (`training/` is not an
installed package).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from jetspec.bench import portable_name
from jetspec.targets import load_target, resolve_dtype
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.timing import clock
from training.rows import TRAINING_COLUMNS, load_source, split_train_eval

REPO = Path(__file__).resolve().parents[1]

SETTINGS = {
    "tree-16": {"tree_budget": 16, "tree_lookup": 0},
    "tree-16-lookup7-first": {"tree_budget": 16, "tree_lookup": 7, "tree_lookup_prior": False},
    "tree-16-lookup7": {"tree_budget": 16, "tree_lookup": 7},
    "tree-16-lookup12": {"tree_budget": 16, "tree_lookup": 12},
    "tree-16-lookup16": {"tree_budget": 16, "tree_lookup": 16},
    "tree-24-lookup16": {"tree_budget": 24, "tree_lookup": 16},
    "tree-8-lookup12": {"tree_budget": 8, "tree_lookup": 12},
    # best-first cumulative log-prob (the default) against the top-2-gap fanout, at the low budgets
    "tree-8": {"tree_budget": 8, "tree_lookup": 0},
    "tree-8-gap": {"tree_budget": 8, "tree_lookup": 0, "tree_scoring": "gap"},
    "tree-16-gap": {"tree_budget": 16, "tree_lookup": 0, "tree_scoring": "gap"},
    "tree-8-lookup16": {"tree_budget": 8, "tree_lookup": 16},
    "tree-8-lookup16-gap": {"tree_budget": 8, "tree_lookup": 16, "tree_scoring": "gap"},
    "tree-16-lookup16-gap": {"tree_budget": 16, "tree_lookup": 16, "tree_scoring": "gap"},
    # the single lookup chain (the default) against the trie of every earlier continuation, and each with its record
    "tree-8-trie16": {"tree_budget": 8, "tree_lookup": 16, "tree_lookup_branches": "trie"},
    "tree-16-trie16": {"tree_budget": 16, "tree_lookup": 16, "tree_lookup_branches": "trie"},
    "tree-8-lookup16-record": {"tree_budget": 8, "tree_lookup": 16, "tree_lookup_record": True},
    "tree-8-trie16-record": {
        "tree_budget": 8,
        "tree_lookup": 16,
        "tree_lookup_branches": "trie",
        "tree_lookup_record": True,
    },
    "auto-lookup16": {"tree_budget": "auto", "tree_lookup": 16},
    "auto-trie16": {"tree_budget": "auto", "tree_lookup": 16, "tree_lookup_branches": "trie"},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="target alias, folder or Hub id (load_target)")
    parser.add_argument("--head", default=str(REPO / "jetspec/heads/smollm2-135m"))
    parser.add_argument("--data", default=str(REPO / "training/data/smollm2-135m-mix.npz"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=sorted(SETTINGS))
    parser.add_argument("--out", default="results/ablation-decoding")
    return parser


def decode_rows(target, head, rows, names: list, common: dict) -> dict:
    """Every setting of `names` (`"plain"` among them) on every row, after an untimed warm-up of each: per setting,
    the speedup over plain, tau and whether the output equals plain's, one entry per row."""
    per = {name: {"speedup": [], "tau": [], "same_prefix": []} for name in names}
    warm = torch.tensor([rows[0]["input_ids"][: rows[0]["prompt_length"]]])
    for name in names:  # untimed warm-up of every setting
        extra = {} if name == "plain" else dict(SETTINGS[name], assistant_model=head)
        target.generate(input_ids=warm, attention_mask=torch.ones_like(warm), **dict(common, max_new_tokens=8), **extra)
    for i, row in enumerate(tqdm(rows, desc="prompts")):
        ids = torch.tensor([row["input_ids"][: row["prompt_length"]]])
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate: drifts fall on every setting alike
        seconds, outputs = {}, {}
        for name in order:
            extra = {} if name == "plain" else dict(SETTINGS[name], assistant_model=head)
            started = clock()
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **common, **extra)
            seconds[name] = clock() - started
            outputs[name] = out.sequences[0, ids.shape[1] :]
            if name != "plain":
                per[name]["tau"].append(out.jetspec_stats.tau)
        for name in names:
            n = min(len(outputs[name]), len(outputs["plain"]))
            rate, plain_rate = len(outputs[name]) / seconds[name], len(outputs["plain"]) / seconds["plain"]
            per[name]["speedup"].append(rate / plain_rate)
            per[name]["same_prefix"].append(bool(torch.equal(outputs[name][:n], outputs["plain"][:n])))
    return per


def markdown(summary: dict) -> str:
    """OUT/decoding.md: the command and one line per setting."""
    lines = [
        f"# Decoding settings on {summary['prompts']} held-out regenerated prompts, {summary['max_new_tokens']} new "
        f"tokens, {summary['dtype']}",
        "",
        f"`{summary['command']}`",
        "",
        "| setting | arguments | speedup over plain (median) | tau | outputs equal to plain |",
        "|---|---|---|---|---|",
    ]
    for name, r in summary["results"].items():
        tau = f"{r['tau_mean']:.2f}" if r["tau_mean"] is not None else "-"
        lines.append(
            f"| {name} | {SETTINGS.get(name, {})} | {r['speedup_median']:.2f}x | {tau} | "
            f"{r['outputs_equal_plain']}/{summary['prompts']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    dtype, reason = resolve_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=target.dtype).to(target.device).eval()
    head.attach_target(target)
    data = load_source(args.data)
    _, held_out = split_train_eval(data.select_columns(TRAINING_COLUMNS), 0.02, 0)
    rows = held_out.select(range(min(args.prompts, len(held_out))))
    common = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": False,
        "pad_token_id": tokenizer.eos_token_id,
        "return_dict_in_generate": True,
    }
    per = decode_rows(target, head, rows, ["plain"] + list(args.settings), common)
    summary = {
        "command": "python -m scripts.ablate_decoding " + " ".join(sys.argv[1:]),
        "dtype": str(dtype),
        "dtype_reason": reason,
        "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "head": portable_name(args.head),
        "settings": {k: SETTINGS[k] for k in args.settings},
        "results": {
            name: {
                "speedup_median": statistics.median(v["speedup"]),
                "tau_mean": statistics.fmean(v["tau"]) if v["tau"] else None,
                "outputs_equal_plain": sum(v["same_prefix"]),
            }
            for name, v in per.items()
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decoding.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    (out / "decoding.md").write_text(text + "\n")
    print(text)
    return summary


if __name__ == "__main__":
    main()
