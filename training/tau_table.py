"""A head's acceptance at every candidate budget and draft sources, measured offline: the `tau_by_budget` table that
`tree_budget="auto"` weighs against a host's costs (`modeling_jetspec/budget.py`, `host_costs.py`).

    python -m training.tau_table --head jetspec/heads/smollm2-135m \
        --data training/data/smollm2-135m-mix.npz --feature_store cache/smollm2-135m --rows 300 \
        --max_new_tokens 256 --json tau_table.json --write

The rows are the trainer's held-out rows (its own split), replayed by the offline evaluator
(`training/evaluate_head.py`: the decoder's own draft, accept and compaction over the stored target features, no
target forward), once per sources ("head": no lookup branch; "head+lookup": the prompt-lookup chain; "head+lookup+trie":
every earlier continuation) and budget (4, 6, 8, 10, 12, 16 by default). tau counts committed tokens per round, bonus
included, as `JetSpecStats.tau`. `--write` puts the table into the head folder's `config.json` as `tau_by_budget`.
Every point names its budget, so the head's own default (`tree_budget="auto"` included) is never read.
"""

import argparse
import json
import functools
import time
from pathlib import Path

import torch

from modeling_jetspec.budget import CANDIDATE_BUDGETS, SOURCES, check_tau_by_budget, sources_shape

from .evaluate_head import (
    check_folders,
    config_data,
    evaluate,
    held_out_rows,
    parse_budgets,
    prepare_rows,
    store_features,
    tree_shape,
)


def tau_table(head, rows: list, budgets=CANDIDATE_BUDGETS, sources=SOURCES, batch_size: int = 32, report=None) -> dict:
    """`{sources: {budget: tau}}` of `head` (its target attached) over prepared rows (`evaluate_head.prepare_rows`),
    each point the head's own tree settings at that budget with those sources (`budget.sources_shape`); `report`
    (e.g. `print`) is told each point as it is measured (a table over hundreds of rows takes minutes)."""
    if head.config.path_conditioning:
        raise ValueError(
            "expected a head without path_conditioning (tree_budget='auto', which reads this table, refuses it), got "
            "one with it"
        )
    table = {}
    for name in sources:
        table[name] = {}
        for budget in budgets:
            started = time.perf_counter()
            shape = sources_shape(tree_shape(head, budget, lookup=True), name, budget)
            table[name][budget] = evaluate(head, rows, shape, batch_size, first_round=False).tau
            if report is not None:
                seconds = time.perf_counter() - started
                report(f"{name} at budget {budget}: tau {table[name][budget]:.4f} ({seconds:.0f} s)")
    return table


def write_table(head_dir, table: dict) -> Path:
    """Set `tau_by_budget` in `head_dir/config.json` to `table` (checked first; budgets as strings, as JSON keeps
    them), every other field kept."""
    check_tau_by_budget(table)
    path = Path(head_dir) / "config.json"
    config = json.loads(path.read_text())
    config["tau_by_budget"] = {name: {str(b): round(t, 4) for b, t in by.items()} for name, by in table.items()}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def format_table(table: dict) -> str:
    budgets = sorted({b for by in table.values() for b in by})
    lines = [f"  {'sources':18s}" + "".join(f"{b:>8d}" for b in budgets)]
    for name, by in table.items():
        lines.append(f"  {name:18s}" + "".join(f"{by[b]:8.3f}" if b in by else f"{'':8s}" for b in budgets))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.tau_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="The head folder (save_pretrained).")
    parser.add_argument(
        "--data", nargs="+", default=None, help="Regenerated rows (default: the training config's data list)."
    )
    parser.add_argument("--feature_store", required=True, help="Feature store folder holding the held-out rows.")
    parser.add_argument("--target", default="smollm2-135m", help="The target (alias, folder or Hub id).")
    parser.add_argument("--eval_fraction", type=float, default=0.02, help="The trainer's eval_fraction.")
    parser.add_argument("--seed", type=int, default=0, help="The trainer's seed (of the held-out hash).")
    parser.add_argument("--rows", type=int, default=None, help="Score at most this many held-out rows.")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="Cap on each row's answer tokens.")
    parser.add_argument(
        "--budgets", default=",".join(map(str, CANDIDATE_BUDGETS)), help=f"Budgets among {CANDIDATE_BUDGETS}."
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Head and target dtype.")
    parser.add_argument("--batch_size", type=int, default=32, help="Rows per head forward.")
    parser.add_argument("--json", default=None, help="Write the table and its settings to this file.")
    parser.add_argument("--write", action="store_true", help="Put the table into the head's config.json.")
    return parser


def check_args(args) -> list:
    """The budgets, every argument checked before any work; a `ValueError` names the first bad one."""
    check_folders([args.head], args.data, args.feature_store)
    budgets = parse_budgets(args.budgets)
    if any(b not in CANDIDATE_BUDGETS for b in budgets):
        raise ValueError(f"expected --budgets among {CANDIDATE_BUDGETS} (the budgets auto weighs), got {budgets}")
    for name in ("rows", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"expected --{name} >= 1, got {getattr(args, name)}")
    if not 0.0 < args.eval_fraction < 1.0 or args.batch_size < 1:
        raise ValueError(
            f"expected --eval_fraction in (0, 1) and --batch_size >= 1, got {args.eval_fraction} and {args.batch_size}"
        )
    return budgets


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    args.data = args.data if args.data is not None else config_data()
    budgets = check_args(args)
    from jetspec.targets import load_target
    from modeling_jetspec import JetSpecDraftModel

    from .feature_store import FeatureStore

    store = FeatureStore(args.feature_store)
    dtype = getattr(torch, args.dtype)
    target, _ = load_target(args.target, dtype=dtype)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=dtype).eval()
    store.check(head.config.target_layer_ids, head.config.target_hidden_size)
    head.attach_target(target)
    held = held_out_rows(args.data, args.eval_fraction, args.seed, args.rows)
    rows, skipped = prepare_rows(held, store_features(store), args.max_new_tokens, head.config.tree_depth)
    if not rows:
        raise ValueError(f"expected held-out rows in the feature store with a round to score, got none of {len(held)}")
    started = time.perf_counter()
    table = tau_table(head, rows, budgets, SOURCES, args.batch_size, report=functools.partial(print, flush=True))
    print(f"{len(rows)} held-out rows, {len(skipped)} skipped, {time.perf_counter() - started:.1f} s")
    print(format_table(table))
    if args.json:
        out = {"settings": vars(args), "rows": len(rows), "skipped": skipped, "tau_by_budget": table}
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.write:
        print(f"tau_by_budget written to {write_table(args.head, table)}")
    return table


if __name__ == "__main__":
    main()
