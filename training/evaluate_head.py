"""Offline evaluation of JetSpec heads on fixed text: every head is scored on exactly the same held-out rows, with
the decoder's own drafting code, and no target forward.

    python -m training.evaluate_head --head jetspec/heads/smollm2-135m runs/smollm2-135m \
        --data training/data/smollm2-135m-mix.npz training/data/smollm2-135m-mix-fp32.npz \
        --feature_store cache/smollm2-135m --rows 300 --max_new_tokens 256 --budgets 8,16,32,64 --json out.json

A held-out row (the trainer's own split: [`training.rows.split_train_eval`] with the same `eval_fraction` and seed)
is a prompt and the target's own greedy answer. The evaluator replays decoding over that answer, round by round, as
`generate` would run it, with the decoder's own steps and the stored target features ([`training.replay`]): on rows
regenerated greedily in float32, with float32 features, its per-row rounds and tau equal those of real
`target.generate(..., assistant_model=head)` (`tests/test_evaluate_head.py` checks it).

Reported per head and budget: tau (committed tokens per round, bonus included, as `JetSpecStats.tau`), acceptance
per depth (share of rounds whose accepted path reached depth d), and the accepted draft tokens by who proposed them:
the head only, the model-free branch (trie or chain) only, or both (a node both propose is merged into one node).
First-round diagnostics (arXiv 2606.18394's "impossible paths") and, with `--fit_calibration`, the acceptance per
depth, source and draft-probability bin are measured by the replay too ([`training.replay`]); printed and written
to the JSON; nothing is applied to the draft.

[`offline_tau`] scores one head at its defaults (the trainer's learning curve can carry it next to agreement, e.g.
from [`OfflineTauCallback`]).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import TrainerCallback

from jetspec.provenance import weights_identity
from modeling_jetspec.budget import FALLBACK_BUDGET
from modeling_jetspec.calibration import check_calibration, to_config
from modeling_jetspec.state import TreeShape, resolve_tree_shape
from modeling_jetspec.tree import TREE_SCORINGS

from .eval_rows import decode_rows, forward_features  # noqa: F401 (imported from here by scripts)
from .eval_rows import held_out_rows, prepare_rows, store_features
from .replay import evaluate
from .rows import row_key

DEFAULT_BUDGETS = (8, 16, 32, 64)


# ------------------------------------------------------------------------------------------------ the trainer's hook
def offline_budget(default) -> int:
    """The budget a head's default `tree_budget` is scored at offline, where no host costs are measured: a fixed
    default as it is, `"auto"` at the head's fallback point ([`budget.FALLBACK_BUDGET`], with the head's own draft
    sources: what `"auto"` decodes at without a `tau_by_budget`, `budget.fallback_point`). Results record the
    budget they used; a budget given explicitly (`--budgets`) always wins."""
    return FALLBACK_BUDGET if default == "auto" else default


def tree_shape(
    head,
    budget: int | None = None,
    lookup: bool = True,
    tree_key: str | None = None,
    lookup_settings=None,
    calibration=None,
) -> TreeShape:
    """The tree a head drafts at its defaults (a default of `"auto"` at [`offline_budget`]), with `budget`, the
    model-free branch on or off, and `tree_key`; `lookup_settings` (a head config) lends its model-free branch
    settings (a head that has none of its own); `calibration` replaces the head's `tree_calibration` (a map, or
    False for raw scores)."""
    if budget is None:  # the head's default, with "auto" at its fallback point (offline, no host costs)
        budget = offline_budget(head.config.tree_budget)
    given = {"tree_budget": budget, "tree_scoring": tree_key, "tree_calibration": calibration}
    if not lookup:
        given["tree_lookup"] = 0
    elif lookup_settings is not None:
        given.update(
            tree_lookup=lookup_settings.tree_lookup,
            tree_lookup_prior=getattr(lookup_settings, "tree_lookup_prior", None) or False,
            tree_lookup_branches=getattr(lookup_settings, "tree_lookup_branches", "chain"),
            tree_lookup_record=getattr(lookup_settings, "tree_lookup_record", False),
        )
    shape = resolve_tree_shape(head.config, **given)
    if shape.budget == "auto":
        raise ValueError("expected a fixed tree budget for offline evaluation (no host costs here), got 'auto'")
    if shape.path_conditioning and shape.lookup:
        raise ValueError("expected no model-free branch with path conditioning, got both")
    return shape


def offline_tau(
    head,
    rows,
    store=None,
    fetch: Callable | None = None,
    budget: int | None = None,
    lookup: bool = True,
    max_new_tokens: int | None = 256,
    max_rows: int | None = 64,
    batch_size: int = 32,
) -> dict:
    """Offline tau of `head` at its defaults (its own budget unless `budget`; `"auto"` at [`offline_budget`]) on
    `rows` (held-out rows: dicts or a `datasets.Dataset` with `id`, `input_ids`, `prompt_length`), features from
    `store` (a `FeatureStore`) or `fetch`. The head must have its target attached. Returns `{"tau", "rounds", "rows",
    "acceptance_per_depth", "accepted_by_source", "budget"}` (`budget`: the one scored); rows not in the store are
    skipped (`"skipped"`)."""
    from .trainer import unwrap_head

    head = unwrap_head(head)
    if (store is None) == (fetch is None):
        raise ValueError(
            "expected exactly one of a feature store or a features function, got "
            f"{'both' if store is not None else 'neither'}"
        )
    fetch = fetch or store_features(store)
    shape = tree_shape(head, budget, lookup)
    rows = list(rows)[:max_rows] if max_rows is not None else list(rows)
    prepared, skipped = prepare_rows(rows, fetch, max_new_tokens, shape.depth)
    training = head.training
    head.eval()
    try:
        tally = evaluate(head, prepared, shape, batch_size, first_round=False)
    finally:
        head.train(training)
    summary = tally.summary()
    return {
        "tau": summary["tau"],
        "rounds": summary["rounds"],
        "rows": summary["rows"],
        "acceptance_per_depth": summary["acceptance_per_depth"],
        "accepted_by_source": summary["accepted_by_source"],
        "budget": shape.budget,
        "skipped": len(skipped),
    }


class OfflineTauCallback(TrainerCallback):
    """At every evaluation, the head's offline tau at its defaults on held-out `rows` (see [`offline_tau`]), added
    to the evaluation's metrics and to the log history as `eval_offline_tau`, next to the agreement."""

    def __init__(self, rows, store=None, fetch=None, **options):
        self.rows, self.store, self.fetch, self.options = list(rows), store, fetch, options

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if model is None:
            return control
        result = offline_tau(model, self.rows, self.store, self.fetch, **self.options)
        entry = {"eval_offline_tau": result["tau"], "step": state.global_step}
        if metrics is not None:
            metrics["eval_offline_tau"] = result["tau"]
        state.log_history.append(entry)
        return control


# ------------------------------------------------------------------------------------------------ command line
def parse_budgets(text: str) -> list:
    try:
        budgets = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected --budgets as comma-separated integers >= 1, got {text!r}") from None
    if not budgets or any(b < 1 for b in budgets):
        raise ValueError(f"expected --budgets as comma-separated integers >= 1, got {text!r}")
    return budgets


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate_head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", nargs="+", required=True, help="Head folders (save_pretrained), scored alike.")
    parser.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="Regenerated rows (.npz or regenerate folders), as the trainer reads them (default: the data list of "
        "training/configs/smollm2-135m.yaml).",
    )
    parser.add_argument("--feature_store", required=True, help="Feature store folder holding the held-out rows.")
    parser.add_argument(
        "--target",
        default="smollm2-135m",
        help="The target (alias, folder or Hub id): only its embeddings and LM head are used.",
    )
    parser.add_argument("--eval_fraction", type=float, default=0.02, help="The trainer's eval_fraction.")
    parser.add_argument("--seed", type=int, default=0, help="The trainer's seed (of the held-out hash).")
    parser.add_argument("--rows", type=int, default=None, help="Score at most this many held-out rows.")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="Cap on each row's answer tokens.")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), help="Tree budgets, e.g. 8,16,32.")
    parser.add_argument("--lookup", default="on", choices=["on", "off"], help="The model-free branch.")
    parser.add_argument(
        "--lookup_settings",
        default=None,
        help="A head folder whose model-free branch settings every head uses (default: each its own).",
    )
    parser.add_argument("--tree_key", default=None, help=f"Tree scoring, one of {TREE_SCORINGS} (default: the head's).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Head and target dtype.")
    parser.add_argument("--batch_size", type=int, default=32, help="Rows per head forward.")
    parser.add_argument(
        "--missing",
        default="error",
        choices=["error", "skip"],
        help="Held-out rows the store does not hold: refuse (error) or leave them out (skip).",
    )
    parser.add_argument(
        "--fit_calibration",
        action="store_true",
        help="Measure acceptance against the node's draft probability, per depth and source (raw scores).",
    )
    parser.add_argument(
        "--calibration_out",
        default=None,
        help="With --fit_calibration and one head: write its fitted map (a config's tree_calibration) to this JSON.",
    )
    parser.add_argument(
        "--min_trials", type=int, default=30, help="Trials a bin needs for its own rate in --calibration_out."
    )
    parser.add_argument(
        "--calibration",
        default=None,
        help="A JSON map (tree_calibration) to score every head with, or 'none' for raw scores (default: each "
        "head's own).",
    )
    parser.add_argument(
        "--skip_rows",
        type=int,
        default=0,
        help="Leave out the first N held-out rows (e.g. the rows that decide shipping, when fitting a calibration).",
    )
    parser.add_argument("--json", default=None, help="Write every number to this file.")
    return parser


def check_folders(heads: list, data: list, feature_store) -> None:
    """Head folders, data sources and the feature store exist as what they are (a `ValueError` names the first that
    does not): the evaluator's inputs, and the tau table's."""
    for folder in heads:
        if not (Path(folder) / "config.json").is_file():
            raise ValueError(f"expected a head folder holding config.json, got {folder}")
    for source in data:
        if not Path(source).exists():
            raise ValueError(f"expected regenerated data files or folders, got {source}, which does not exist")
    if not (Path(feature_store) / "store.json").is_file():
        raise ValueError(f"expected a feature store folder holding store.json, got {feature_store}")


def check_args(args) -> dict:
    """Every argument checked before any work; a `ValueError` names the first bad one."""
    check_folders(args.head, args.data, args.feature_store)
    budgets = parse_budgets(args.budgets)
    if args.rows is not None and args.rows < 1:
        raise ValueError(f"expected --rows >= 1, got {args.rows}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"expected --max_new_tokens >= 1, got {args.max_new_tokens}")
    if args.tree_key is not None and args.tree_key not in TREE_SCORINGS:
        raise ValueError(f"expected --tree_key in {TREE_SCORINGS}, got {args.tree_key!r}")
    if not 0.0 < args.eval_fraction < 1.0:
        raise ValueError(f"expected --eval_fraction in (0, 1) (held-out rows to score), got {args.eval_fraction}")
    if args.batch_size < 1:
        raise ValueError(f"expected --batch_size >= 1, got {args.batch_size}")
    if args.skip_rows < 0 or args.min_trials < 1:
        raise ValueError(f"expected --skip_rows >= 0 and --min_trials >= 1, got {args.skip_rows} and {args.min_trials}")
    if args.calibration_out is not None and (not args.fit_calibration or len(args.head) != 1):
        raise ValueError(
            f"expected --fit_calibration and one --head with --calibration_out, got fit_calibration="
            f"{args.fit_calibration} and {len(args.head)} heads"
        )
    calibration_map = None
    if args.calibration is not None:
        if args.calibration == "none":
            calibration_map = False
        elif not Path(args.calibration).is_file():
            raise ValueError(f"expected --calibration to be a JSON map file or 'none', got {args.calibration}")
        else:
            calibration_map = json.loads(Path(args.calibration).read_text())
            check_calibration(calibration_map)
    if args.lookup_settings is not None and not (Path(args.lookup_settings) / "config.json").is_file():
        raise ValueError(
            f"expected --lookup_settings to be a head folder holding config.json, got {args.lookup_settings}"
        )
    return {"budgets": budgets, "calibration_map": calibration_map}


def run(
    heads: dict,
    rows: list,
    budgets: list,
    lookup: bool = True,
    tree_key: str | None = None,
    batch_size: int = 32,
    calibration: bool = False,
    lookup_settings=None,
    calibration_map=None,
) -> dict:
    """Score every head of `heads` (`{name: head with its target attached}`) on the same prepared `rows` at every
    budget: `{name: {budget: summary}}`. `calibration_map` replaces every head's `tree_calibration` (False: raw
    scores); fitting (`calibration`) always scores raw, since the fit maps raw scores to acceptance."""
    results = {}
    override = False if calibration else calibration_map
    for name, head in heads.items():
        results[name] = {}
        for budget in budgets:
            shape = tree_shape(head, budget, lookup, tree_key, lookup_settings, override)
            started = time.perf_counter()
            tally = evaluate(head, rows, shape, batch_size, first_round=True, calibration=calibration)
            summary = tally.summary()
            summary["seconds"] = time.perf_counter() - started
            summary["shape"] = {
                "depth": shape.depth,
                "width": shape.width,
                "budget": shape.budget,
                "scoring": shape.scoring,
                "lookup": shape.lookup,
                "lookup_branches": shape.lookup_branches,
                "lookup_record": shape.lookup_record,
                "lookup_prior": shape.lookup_prior is not None,
                "calibrated": shape.calibration is not None,
            }
            results[name][budget] = summary
    return results


def format_results(results: dict) -> str:
    lines = []
    for name, by_budget in results.items():
        lines.append(f"head {name}")
        depths = max(len(s["acceptance_per_depth"]) for s in by_budget.values())
        shown = min(depths, 8)
        lines.append(
            "  budget   tau  rounds  rows  "
            + " ".join(f"acc@{d + 1:<2}" for d in range(shown))
            + "  accepted: head-only lookup-only both"
        )
        for budget, s in by_budget.items():
            acc = " ".join(f"{a:6.3f}" for a in s["acceptance_per_depth"][:shown])
            src = s["accepted_by_source"]
            lines.append(
                f"  {budget:6d} {s['tau']:5.3f} {s['rounds']:7d} {s['rows']:5d}  {acc}  "
                f"{src['head']:>18d} {src['lookup']:>11d} {src['both']:>4d}"
            )
        for budget, s in by_budget.items():
            f = s["first_round"]
            if not f["rows"]:
                continue
            share = "n/a" if f["share_below_-20_nats"] is None else f"{f['share_below_-20_nats']:.3f}"
            inflation = "n/a" if f["mean_inflation"] is None else f"{f['mean_inflation']:+.2f}"
            lines.append(
                f"  first round, budget {budget}: top-ranked path below -20 nats (target log-prob over the "
                f"prefix that follows the stored answer; {f['complete_paths']}/{f['rows_with_target_logprob']}"
                f" paths wholly on it): {share}; mean score inflation {inflation} nats"
            )
        for budget, s in by_budget.items():
            if "calibration" not in s:
                continue
            lines.append(f"  calibration, budget {budget}: depth source bin trials acceptance draft-prob fitted")
            for r in s["calibration"]:
                lines.append(
                    f"    {r['depth']:2d} {r['source']:6s} [{r['bin'][0]:.1f},{r['bin'][1]:.1f}) "
                    f"{r['trials']:7d} {r['acceptance']:.3f} {r['mean_draft_probability']:.3f} "
                    f"{r['fitted']:.3f}"
                )
    if len(results) > 1:  # the heads side by side, on the same rows: tau and its ratio to the first head's
        names = list(results)
        lines.append("tau on the same rows (ratio to " + names[0] + ")")
        for budget in results[names[0]]:
            base = results[names[0]][budget]["tau"]
            cells = [f"{results[n][budget]['tau']:.3f} ({results[n][budget]['tau'] / base:.3f}x)" for n in names]
            lines.append(f"  budget {budget:3d}: " + "  ".join(f"{n}: {c}" for n, c in zip(names, cells)))
    return "\n".join(lines)


DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2-135m.yaml"


def config_data(config=DEFAULT_CONFIG) -> list:
    """The data files a training config reads (its `data:` list): the evaluator's default rows."""
    import yaml

    return list(yaml.safe_load(Path(config).read_text())["data"])


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.data is None:
        args.data = config_data()
    checked = check_args(args)
    from jetspec.targets import load_target
    from modeling_jetspec import JetSpecDraftModel
    from modeling_jetspec.configuration_jetspec import JetSpecConfig

    from .feature_store import FeatureStore

    store = FeatureStore(args.feature_store)
    configs = {folder: JetSpecConfig.from_pretrained(folder) for folder in args.head}
    for folder, config in configs.items():
        store.check(config.target_layer_ids, config.target_hidden_size)
    lookup_settings = JetSpecConfig.from_pretrained(args.lookup_settings) if args.lookup_settings else None
    held = held_out_rows(args.data, args.eval_fraction, args.seed)
    last = len(held) if args.rows is None else min(len(held), args.skip_rows + args.rows)
    if args.skip_rows >= last:
        raise ValueError(f"expected held-out rows after the first {args.skip_rows}, got {len(held)} in all")
    held = held.select(range(args.skip_rows, last))
    keys = [row_key(i) for i in held["id"]]
    found = store._lookup(keys)[0]
    missing = [str(i) for i, f in zip(held["id"], found) if not f]
    if missing and args.missing == "error":
        raise ValueError(
            f"expected every held-out row in the feature store {args.feature_store}, got {len(missing)} "
            f"of {len(held)} missing (e.g. {missing[:3]}); build it for --data, or pass --missing skip"
        )
    dtype = getattr(torch, args.dtype)
    target, _ = load_target(args.target, dtype=dtype)
    heads = {}
    for folder in args.head:
        head = JetSpecDraftModel.from_pretrained(folder, dtype=dtype).eval()
        head.attach_target(target)
        heads[folder] = head
    depth = max(h.config.tree_depth for h in heads.values())
    rows, skipped = prepare_rows(held, store_features(store), args.max_new_tokens, depth)
    if not rows:
        raise ValueError(f"expected held-out rows with at least one round to score, got none of {len(held)}")
    started = time.perf_counter()
    results = run(
        heads,
        rows,
        checked["budgets"],
        args.lookup == "on",
        args.tree_key,
        args.batch_size,
        args.fit_calibration,
        lookup_settings,
        checked["calibration_map"],
    )
    print(
        f"{len(rows)} held-out rows ({sum(r.end - r.prompt_length for r in rows)} answer tokens), "
        f"{len(skipped)} skipped, {time.perf_counter() - started:.1f} s"
    )
    print(format_results(results))
    if args.json:
        out = {
            "settings": {k: v for k, v in vars(args).items()},
            "rows": len(rows),
            "skipped": skipped,
            "heads": {name: {str(b): s for b, s in by.items()} for name, by in results.items()},
            # the weights each head folder held (a shipped folder's contents change with the next ship)
            "head_identity": {name: weights_identity(name) for name in results},
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.calibration_out:
        first = checked["budgets"][0]
        (by,) = results.values()
        fitted = to_config(by[first].get("calibration", []), args.min_trials)
        Path(args.calibration_out).write_text(json.dumps(fitted, indent=1) + "\n")
        print(f"fitted calibration maps (budget {first}) written to {args.calibration_out}")
    return results


if __name__ == "__main__":
    main()
