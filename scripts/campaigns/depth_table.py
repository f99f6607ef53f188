"""Head depth at equal compute (issue 38, item 4): for heads of 1, 2 and 3 layers trained for the same minutes on the
same store (`scripts/ablate_head.py --minutes`), their offline tau at the defaults (tree-8 with the trie branch, on
the same held-out rows), the draft cost c on this host, and the speedup those imply:

    expected speedup = tau / (t(B) / t(1) + c)

with t(1) one plain decode step, t(B) the verify forward of the B + 1 rows of a tree-B round and c one draft (the
head's forward and its best-first tree) over t(1), all timed in one process after a seeded random context (the
costs do not depend on the tokens), in the dtype
`--dtype auto` picks on this host (`jetspec.bench.measure_costs`, the functions `generate` runs). A deeper head wins
only if this rises: its tau must pay for its larger c.

    python -m scripts.ablate_head --store cache/smollm2-135m --minutes 30 --out results/depth --runs runs/depth \
        --variants layers1 layers2 layers3 warm
    python -m scripts.campaigns.depth_table --ablation results/depth/ablation.json --runs runs/depth \
        --variants layers1 layers2 layers3 warm --out results/depth

Writes OUT/depth.json (every timing, the host kind) and OUT/depth.md. Heads are read from RUNS/<variant> (or the
kept copy `training/checkpoints/<variant>` when the run folder is gone). Run from the repository root, as a module.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET = 8


def head_folder(runs: Path, name: str) -> Path:
    """The trained head of variant `name`: its run folder, else the kept copy of that run."""
    for folder in (runs / name, REPO / "training" / "checkpoints" / name):
        if (folder / "config.json").is_file():
            return folder
    raise ValueError(
        f"expected the head of variant {name!r} in {runs / name} or training/checkpoints/{name} (config.json), "
        "got neither: train it with scripts/ablate_head.py first"
    )


def offline_tau(row: dict, budget: int, lookup: bool) -> float | None:
    side = "lookup_on" if lookup else "lookup_off"
    return row.get("offline", {}).get("by_key", {}).get("None", {}).get(side, {}).get(str(budget), {}).get("tau")


def expected_speedup(tau: float | None, verify_ratio: float, c: float) -> float | None:
    """tau / (t(B)/t(1) + c), or None without a tau."""
    return None if tau is None else tau / (verify_ratio + c)


def train_minutes(row: dict) -> float | None:
    """The minutes a variant really trained (its steps at its measured pace), beside the budget it was given."""
    if row.get("seconds_per_step") is None or row.get("steps") is None:
        return None
    return row["seconds_per_step"] * row["steps"] / 60


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ablation", required=True, help="ablation.json of scripts/ablate_head.py")
    parser.add_argument("--runs", required=True, help="the --runs folder of that ablation")
    parser.add_argument("--variants", nargs="+", required=True, help="variants (rows) of the table, in order")
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="tree budget B (the defaults: 8)")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (target and head)")
    parser.add_argument("--prompt_tokens", type=int, default=256, help="context of the timed round")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per cost")
    parser.add_argument("--out", required=True)
    return parser


def check_args(args) -> dict:
    """Everything checked before loading a model; a `ValueError` names the first bad argument."""
    from jetspec.targets import DTYPE_CHOICES

    path = Path(args.ablation)
    if not path.is_file():
        raise ValueError(f"expected --ablation to be an ablation.json file, got {args.ablation}")
    summary = json.loads(path.read_text())
    missing = [name for name in args.variants if name not in summary]
    if missing:
        raise ValueError(f"expected every variant in {args.ablation}, got {missing} missing (have {sorted(summary)})")
    if args.budget < 1 or args.prompt_tokens < 8 or args.repeats < 1:
        raise ValueError(
            f"expected --budget >= 1, --prompt_tokens >= 8 and --repeats >= 1, got {args.budget}, "
            f"{args.prompt_tokens}, {args.repeats}"
        )
    if args.dtype not in DTYPE_CHOICES:
        raise ValueError(f"expected --dtype in {DTYPE_CHOICES}, got {args.dtype!r}")
    heads = {name: head_folder(Path(args.runs), name) for name in args.variants}
    targets = {summary[name].get("settings", {}).get("target") for name in args.variants}
    if len(targets) != 1 or None in targets:
        raise ValueError(f"expected the variants to share one recorded target (settings.target), got {targets}")
    return {"summary": summary, "heads": heads, "target": targets.pop()}


def timing_prompt(target, tokens: int) -> torch.Tensor:
    """`(1, tokens)` seeded random ids: an attention-only target's step, draft and verify cost the same whatever
    the tokens (the tree's shape is fixed by the budget)."""
    vocab = target.config.get_text_config(decoder=True).vocab_size
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    checked = check_args(args)
    from jetspec.bench import measure_costs
    from jetspec.host import host_kind
    from jetspec.targets import load_target, resolve_dtype
    from modeling_jetspec import JetSpecDraftModel

    dtype, reason = resolve_dtype(args.dtype)
    target, _ = load_target(checked["target"], dtype=dtype)
    prompt = timing_prompt(target, args.prompt_tokens)
    rows = []
    for name in args.variants:
        row = checked["summary"][name]
        head = JetSpecDraftModel.from_pretrained(checked["heads"][name], dtype=dtype).eval()
        costs = measure_costs(target, head, prompt, [args.budget], head.config.tree_depth, repeats=args.repeats)
        ratio = costs["verify"][str(args.budget)]["ratio_to_step"]
        tau_on, tau_off = offline_tau(row, args.budget, True), offline_tau(row, args.budget, False)
        rows.append(
            {
                "variant": name,
                "head": str(checked["heads"][name]),
                "head_layers": head.config.num_hidden_layers,
                "block_size": head.config.block_size,
                "change": row.get("change"),
                "minutes": row.get("minutes"),
                "steps": row.get("steps"),
                "train_minutes": train_minutes(row),
                "eval_loss": row.get("eval_loss"),
                "acc_per_depth": row.get("acc_per_depth"),
                "tau_defaults": tau_on,
                "tau_head_alone": tau_off,
                "c": costs["draft_cost_c"],
                "verify_ratio": ratio,
                "costs": costs,
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "costs"}), flush=True)
    # the verify forward is the target's over B + 1 rows whatever head drafted them: one ratio for every row, the
    # median of their timings (two timings of the same forward differed by 3% on the AMX host, as much as the heads)
    shared = statistics.median(row["verify_ratio"] for row in rows)
    for row in rows:
        row["verify_ratio_shared"] = shared
        row["expected_speedup"] = expected_speedup(row["tau_defaults"], shared, row["c"])
    result = {
        "host_kind": host_kind().name,
        "target": checked["target"],
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_reason": reason,
        "budget": args.budget,
        "prompt_tokens": args.prompt_tokens,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "depth.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "depth.md").write_text(depth_markdown(result))
    print(depth_markdown(result))
    return result


def depth_markdown(result: dict) -> str:
    def f(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    lines = [
        f"Host kind {result['host_kind']}, {result['dtype']} ({result['dtype_reason']}); tree-{result['budget']}, "
        f"a {result['prompt_tokens']}-token context.",
        "",
        "| head | layers | block | budget min (steps) | trained min | held-out acc d1 / d2 | offline tau, defaults | tau, head alone "
        "| c | t(B)/t(1) | expected speedup |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        acc = row["acc_per_depth"] or [None, None]
        lines.append(
            f"| {row['variant']} | {row['head_layers']} | {row['block_size']} "
            f"| {f(row['minutes'], 'g')} ({row['steps']}) "
            f"| {f(row['train_minutes'], '.1f')} "
            f"| {f(acc[0])} / {f(acc[1])} | {f(row['tau_defaults'])} | {f(row['tau_head_alone'])} "
            f"| {f(row['c'])} | {f(row['verify_ratio'])} | {f(row['expected_speedup'], '.2f')}x |"
        )
    lines += [
        "",
        f"Expected speedup = tau at the defaults / (t(B)/t(1) + c), with one t(B)/t(1) for every head: the median "
        f"of the rows' timings, {f(result['rows'][0]['verify_ratio_shared'])} (the verify is the target's forward "
        "whoever drafted).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
