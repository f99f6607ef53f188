"""Whether a newly trained head replaces the shipped one, decided from the results that
`scripts/campaigns/ship_campaign.sh` wrote, and the replacement itself (issue 39: "ship on identical text").

    python -m scripts.ship_decision --results results/long-run --new training/checkpoints/smollm2-135m-long \
        --shipped jetspec/heads/smollm2-135m            # prints and writes results/long-run/decision.json
    python -m scripts.ship_decision ... --apply         # and, if it ships, replaces the shipped folder's head
    python -m scripts.ship_decision ... --candidate runs/long-run-candidate   # before the bench: the new head as
                                                        # it would ship (offline results only), for `--head`

The new head ships only if both judgements on identical text put it ahead at the shipped operating point (the
head's defaults: tree budget 8 with the trie of earlier continuations). A head whose default is `tree_budget="auto"`
chooses its point per host from measured costs, which an offline judgement has none of: it is judged at its fallback
point, `modeling_jetspec.budget.FALLBACK_BUDGET` (8) with its own sources, the same rule as the offline evaluator's
(`training.evaluate_head.offline_budget`); the decision records the budget as `defaults_budget`:

- offline tau on the held-out shipping rows (`offline-defaults.json`, `training.evaluate_head`, the feature-store
  path the recipe issue checked against real decoding);
- the float32 bench with both heads side by side (`bench-fp32/results.json`, `jetspec bench --head NEW
  --baseline-head SHIPPED`: tau at the defaults over every prompt, each output equal to plain greedy).

Its calibration map (`calibration-map.json`) is kept only if offline tau with the map (`offline-calibrated.json`)
is above offline tau without it. Offline, both heads run without a map; in the float32 bench each runs as it would
ship: the shipped folder with the map its config holds, the new head as `--candidate DIR` writes it from the offline
results alone (its map in the config where kept), so a shipped map never races an unmapped new head. Every result
names the weights it measured (`head_identity`); the decision refuses results whose weights are not the folders'
current ones, so a rerun after shipping never compares a head with itself.

`--apply` replaces the shipped folder's files with the new head's (`training.shipping.replace_head`: config, weights,
card, metrics, curve, log and its training arguments; the map in the config when kept; no `auto_map`, as for every
local head folder), after checking that the result loads as a head; the folder then holds the one head.
"""

import argparse
import json
from pathlib import Path

from jetspec.report import every_prompt
from modeling_jetspec.budget import FALLBACK_BUDGET
from training.shipping import replace_head, shipped_tree_budget, stage_head

DEFAULTS_BUDGET = FALLBACK_BUDGET  # the defaults judged offline: a fixed 8, or "auto" at its fallback point (8)
DEFAULTS_METHOD = f"tree-{DEFAULTS_BUDGET}-lookup"  # the bench's name for it with the head's own lookup branch


def _load(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"expected {path} (written by scripts/campaigns/ship_campaign.sh), got no such file")
    return json.loads(path.read_text())


def _offline_tau(result: dict, head: str, path: Path, budget: str = str(DEFAULTS_BUDGET)) -> float:
    heads = result.get("heads", {})
    if head not in heads or budget not in heads[head]:
        raise ValueError(f"expected head {head} at budget {budget} in {path}, got heads {sorted(heads)}")
    return float(heads[head][budget]["tau"])


def _check_identity(recorded: dict | None, folder: str, now: dict, where: Path) -> None:
    """The weights a result measured must be the folder's current weights (`now`: folder -> digest)."""
    if not recorded or recorded.get("weights_sha256") is None:
        raise ValueError(f"expected the weights of {folder} recorded in {where}, got none")
    if recorded["weights_sha256"] != now[folder]:
        raise ValueError(
            f"expected {where} to have measured the weights now in {folder} ({now[folder][:12]}), got "
            f"{recorded['weights_sha256'][:12]}: the folder changed since (a head shipped?), so the result no longer "
            "describes it"
        )


def current_weights(*folders: str) -> dict:
    """Each head folder's weights as they are now (folder -> digest), hashed once per judgement."""
    from jetspec.provenance import weights_digest

    return {folder: weights_digest(Path(folder)) for folder in folders}


def offline_decision(results: Path, new: str, shipped: str, now: dict) -> dict:
    """The offline half of the judgement: both heads' tau on the shipping rows (head alone too, where run) and
    whether the new head's map is kept. `now` maps each folder to its current weights' digest."""
    offline_path = results / "offline-defaults.json"
    offline = _load(offline_path)
    for head in (new, shipped):
        _check_identity(offline.get("head_identity", {}).get(head), head, now, offline_path)
    decision = {
        "new": new,
        "shipped": shipped,
        "offline_tau": {
            "new": _offline_tau(offline, new, offline_path),
            "shipped": _offline_tau(offline, shipped, offline_path),
        },
        "offline_rows": offline.get("rows"),
        "defaults_budget": DEFAULTS_BUDGET,
    }
    alone_path = results / "offline-head-alone.json"
    if alone_path.is_file():
        alone = _load(alone_path)
        decision["offline_tau_head_alone"] = {
            "new": _offline_tau(alone, new, alone_path),
            "shipped": _offline_tau(alone, shipped, alone_path),
        }
    calibrated_path = results / "offline-calibrated.json"
    if calibrated_path.is_file():
        calibrated = _load(calibrated_path)
        _check_identity(calibrated.get("head_identity", {}).get(new), new, now, calibrated_path)
        decision["offline_tau_calibrated"] = _offline_tau(calibrated, new, calibrated_path)
    decision["keep_calibration"] = (
        decision.get("offline_tau_calibrated", float("-inf")) > decision["offline_tau"]["new"]
    )
    return decision


def decide(results: Path, new: str, shipped: str) -> dict:
    """The comparison of the two heads from the campaign's result files, and whether the new head ships."""
    now = current_weights(new, shipped)
    decision = offline_decision(results, new, shipped, now)
    bench_path = results / "bench-fp32" / "results.json"
    bench = _load(bench_path)
    settings = bench.get("config", {})  # `jetspec bench` records the heads' weights with its settings
    _check_identity(settings.get("head_identity"), new, now, bench_path)
    _check_identity(settings.get("baseline_head_identity"), shipped, now, bench_path)
    everything = every_prompt(bench.get("aggregates", {}))
    pair = {"new": DEFAULTS_METHOD, "shipped": f"{DEFAULTS_METHOD}@baseline"}
    missing = [name for name in pair.values() if name not in everything]
    if missing:
        raise ValueError(f"expected the methods {sorted(pair.values())} in {bench_path}, missing {missing}")
    for side, name in pair.items():
        equality = everything[name].get("equality") or {}
        if equality.get("mismatch", 0) or equality.get("exact", 0) != everything[name].get("prompts"):
            raise ValueError(f"expected every output of {name} in {bench_path} equal to plain greedy, got {equality}")
    decision["bench_fp32"] = {
        side: {
            "tau": everything[name]["tau_mean"],
            "speedup_median": everything[name]["speedup_median"],
            "prompts": everything[name]["prompts"],
        }
        for side, name in pair.items()
    }
    # the folders the bench loaded (the new head's may be its candidate: same weights, its map where kept)
    decision["bench_fp32_folders"] = {
        side: {"folder": settings.get(key), "calibration_map": settings.get(f"{key}_calibration_map")}
        for side, key in (("new", "head"), ("shipped", "baseline_head"))
    }
    decision["host_kind"] = bench.get("machine", {}).get("host_kind")
    decision["ships"] = (
        decision["offline_tau"]["new"] > decision["offline_tau"]["shipped"]
        and decision["bench_fp32"]["new"]["tau"] > decision["bench_fp32"]["shipped"]["tau"]
    )
    return decision


def kept_map(results: Path, keep_calibration: bool) -> dict | None:
    """The campaign's calibration map where the decision keeps it, else `None` (the new head's config as it is)."""
    return json.loads((results / "calibration-map.json").read_text()) if keep_calibration else None


def apply(decision: dict, results: Path) -> list[str]:
    """Replaces the shipped folder's head with the new one (module docstring); the files written."""
    if not decision["ships"]:
        raise ValueError(f"expected a decision to ship, got ships=False for {decision['new']}")
    calibration = kept_map(results, decision["keep_calibration"])
    return replace_head(decision["new"], decision["shipped"], calibration)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results/long-run", help="the campaign's OUT folder")
    parser.add_argument("--new", default="training/checkpoints/smollm2-135m-long")
    parser.add_argument("--shipped", default="jetspec/heads/smollm2-135m")
    parser.add_argument("--apply", action="store_true", help="replace the shipped head when the decision ships")
    parser.add_argument(
        "--candidate",
        type=Path,
        help="write the new head as it would ship (its map where the offline results keep it) into this empty "
        "folder, for the float32 bench, and stop: needs only the offline results",
    )
    args = parser.parse_args(argv)
    for name in ("new", "shipped"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            raise ValueError(f"expected --{name} to be a head folder holding config.json, got {getattr(args, name)}")
    if args.candidate is not None and args.apply:
        raise ValueError("expected one of --candidate (before the bench) and --apply (after it), got both")
    results = Path(args.results)
    if args.candidate is not None:
        decision = offline_decision(results, args.new, args.shipped, current_weights(args.new, args.shipped))
        decision["candidate"] = str(args.candidate)
        calibration = kept_map(results, decision["keep_calibration"])
        decision["written"] = stage_head(args.new, args.candidate, calibration, shipped_tree_budget(args.shipped))
        print(json.dumps(decision, indent=1))
        return decision
    decision = decide(results, args.new, args.shipped)
    (results / "decision.json").write_text(json.dumps(decision, indent=1) + "\n")
    print(json.dumps(decision, indent=1))
    if args.apply and decision["ships"]:
        decision["written"] = apply(decision, results)
        print(f"shipped {args.new} as {args.shipped}: {', '.join(decision['written'])}")
    return decision


if __name__ == "__main__":
    main()
