"""Short training runs of head variants on one feature store, side by side: held-out agreement per depth, the chain
tau it implies, seconds per step, and each trained head scored offline on fixed text (`training.evaluate_head`), so
variants compare per CPU-minute as well as per step.

    python -m training.feature_store --data training/data/smollm2-135m-mix.npz --out cache/smollm2-135m
    python -m scripts.ablate_head --store cache/smollm2-135m --steps 300 --out results/ablation \
        --variants baseline gamma4 layers2 no_last_context blocks32 vocab4096

Every variant starts from the committed config (training/configs/smollm2-135m.yaml) with the same data, split and
seed, and changes one thing. `--minutes M` gives every variant the same wall-clock instead of the same steps: a short
probe run times the variant's step, and the real run gets the steps that fill M minutes (its cosine schedule ends
there; the probe times its steady steps, after the first few; the table gives the minutes each really trained):

    python -m scripts.ablate_head --store cache/smollm2-135m-fp32 --data training/data/smollm2-135m-mix-fp32.npz \
        --minutes 8 --out results/ablation-wallclock --variants baseline layers2 layers3 init_target block16 warm

After training, each variant's head is scored by `training.evaluate_head` on the same held-out rows (the trainer's
own split of the same data; the first `--eval_rows`, answers cut at `--eval_new_tokens`): tau at every `--budgets`
with the model-free branch on and off (on: with the branch settings of `--lookup_settings`, the committed head's by
default, the same for every variant; a new head has none of its own), acceptance per depth, and the first-round
statistics (share of rows whose top-ranked path has a target log-prob below -20 nats, mean score inflation).
`--offline off` trains only. A variant already measured at this budget is skipped; one measured without these
offline settings is only scored again.

The paper's claims (issue 33; `scripts/campaigns/results_tables.py` turns the results into docs/results.md's tables):

    # causal against bidirectional block at gamma 0, 4 and 7, and the losses (gamma4 is the forward-KL reference)
    python -m scripts.ablate_head --store cache/smollm2-135m --minutes 8 --out results/claims \
        --variants gamma0 gamma4 gamma7 bidir_gamma0 bidir_gamma4 bidir_gamma7 sft reverse_kl kl_tv topk_rank
    # data against steps: the same steps from the same start on 0.5M, 1M and all answer tokens (held-out rows fixed)
    python -m scripts.ablate_head --store cache/smollm2-135m --minutes 8 --out results/claims-data \
        --variants data_all data_1M data_0.5M
    # the tree key on one head, on the same rows
    python -m scripts.ablate_head --store cache/smollm2-135m --out results/claims-tree-keys \
        --tree_keys logprob entropy mixed gap --head runs/ablation/gamma4
    # raw against regenerated data: the same prompts and answer tokens, ShareGPT's replies or the target's answers
    python -m scripts.campaigns.raw_answers --out cache/raw-vs-regen --answer_tokens 500000
    python -m training.feature_store --data cache/raw-vs-regen/raw.npz --out cache/smollm2-135m --max_length 512
    python -m scripts.ablate_head --store cache/smollm2-135m --steps 2400 --out results/claims-raw \
        --variants raw_sharegpt regen_sharegpt

`data_<N>` (N as 300, 0.5M, 2M, or all) trains on the training rows holding about N answer tokens
(`--max_train_answer_tokens`, [`training.rows.answer_token_cap`]: a fixed draw by row id, never a held-out row).
With `--minutes`, the data variants share one step count, timed by the first of them measured, so they differ in
data only. `raw_sharegpt` and `regen_sharegpt` train on their file of cache/raw-vs-regen/ alone and are judged on the
config's held-out rows, like every other variant (`--eval_data`). `--tree_keys K...` trains nothing: it scores the
head `--head` under each tree key.

Results: OUT/ablation.json and OUT/ablation.md (OUT/tree_keys.json and .md for `--tree_keys`, written after each
key: a rerun scores only the keys missing); each variant's evaluator output, every row included, in
OUT/offline/<variant>.json (OUT/offline/tree_keys-<head>-<key>.json); each variant's run (its head, logs and curve) in
RUNS/<variant>; the results name the host kind (jetspec.host). Run from the repository root, as a module
(`training/` is not an installed package).
"""

import argparse
import gzip
import json
import re
import time
from pathlib import Path

import yaml

from jetspec.host import host_kind
from training import run_trainer
from training.checkpointing import last_complete_checkpoint
from training.offline_scorer import OfflineScorer
from training.step_timer import StepTimer

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "baseline": [],
    "gamma4": ["--gamma", "4"],
    "gamma7": ["--gamma", "7"],
    "layers1": ["--num_hidden_layers", "1"],  # the committed depth, named for the depth table
    "layers2": ["--num_hidden_layers", "2"],
    "no_last_context": ["--last_context_input", "false"],
    "blocks32": ["--num_blocks_per_sequence", "32"],
    "blocks8": ["--num_blocks_per_sequence", "8"],
    "vocab4096": ["--draft_vocab_size", "4096"],
    "lr1e-3": ["--learning_rate", "1e-3"],
    "layers3": ["--num_hidden_layers", "3"],
    "init_target": ["--init_layers_from_target", "true"],
    "layers2_init_target": ["--num_hidden_layers", "2", "--init_layers_from_target", "true"],
    "block16": ["--block_size", "16"],
    # warm restart: continue from the committed head (its architecture and draft vocabulary) on this data
    "warm": ["--init_head", "jetspec/heads/smollm2-135m"],
    # the committed head as shipped, for reference: one step at learning rate 0 (Adam moves nothing), then evaluated
    "committed": ["--init_head", "jetspec/heads/smollm2-135m", "--learning_rate", "0"],
    # the loss (training/losses.py): forward KL named, acceptance-aware additions to it, the paper's hard-label and
    # reverse KL
    "fkl": ["--loss", "fkl"],
    "kl_tv": ["--loss", "kl_tv"],
    "topk_rank": ["--loss", "topk_rank"],
    "sft": ["--loss", "sft"],
    "reverse_kl": ["--loss", "rkl"],
    # the block attention at gamma 0 (the config's gamma removed), 4 and 7; the causal block at gamma 4 and 7 is
    # gamma4 and gamma7 (the config's block attention)
    "gamma0": [],
    "bidir_gamma4": ["--block_attention", "bidirectional", "--gamma", "4"],
    "bidir_gamma0": ["--block_attention", "bidirectional"],
    "bidir_gamma7": ["--block_attention", "bidirectional", "--gamma", "7"],
}
UNSET = {"gamma0": ("gamma",), "bidir_gamma0": ("gamma",)}  # config keys a variant removes (no flag says None)
# raw against regenerated data: the same ShareGPT prompts (training rows of the config's split), answered by ShareGPT's
# own first reply or by the target, cut to the same answer tokens per row (`scripts/campaigns/raw_answers.py` writes
# both files); each trains on its file alone and is judged on the config's own held-out rows (`--eval_data`)
PAIRED_DIR = REPO / "cache" / "raw-vs-regen"
PAIRED = {"raw_sharegpt": "raw.npz", "regen_sharegpt": "regen.npz"}
DATA_VARIANT = re.compile(r"^data_(all|\d+(?:\.\d+)?[KkMm]?)$")  # data_<answer tokens>: data_300, data_0.5M, data_all
# <variant>_seed<N>: the variant from another initialisation and data order (`--seed N`), on the same rows and judged on
# the same held-out rows (`--split_seed`: the config's own seed); the spread of a row over seeds is what a gap is
# weighed against
SEED_VARIANT = re.compile(r"^(?P<base>.+)_seed(?P<seed>\d+)$")
# The probe times its steps after the first PROBE_SKIP, which carry one-off costs (and, with group_by_length, the
# longest batch first). Batches vary in width, so a short probe is noisy: 12 steps gave a 2-layer head 0.99 s/step
# where its run then took 0.63 (Intel AMX host), so it trained 19 of its 30 minutes; 40 steps average more widths.
PROBE_STEPS = 40
PROBE_SKIP = 5
DEFAULT_BUDGETS = "8,16,32,64"
DEFAULT_LOOKUP_SETTINGS = REPO / "jetspec" / "heads" / "smollm2-135m"
TREE_KEYS = ("logprob", "entropy", "mixed", "gap")


def data_tokens(name: str) -> int | None:
    """Answer tokens a `data_<N>` variant trains on (None: all); a `ValueError` for any other name."""
    match = DATA_VARIANT.match(name)
    if match is None:
        raise ValueError(
            f"expected a data variant data_<answer tokens> (e.g. data_0.5M, data_2M, data_all), got {name!r}"
        )
    size = match.group(1)
    if size == "all":
        return None
    scale = {"k": 1_000, "m": 1_000_000}.get(size[-1].lower(), 1)
    tokens = int(round(float(size.rstrip("KkMm")) * scale))
    if tokens < 1:
        raise ValueError(f"expected a data variant of at least one answer token, got {name!r}")
    return tokens


def seed_of(name: str) -> tuple[str, int | None]:
    """`(base variant, seed)` of a seed variant `<base>_seed<N>` of a named variant, `(name, None)` otherwise."""
    match = SEED_VARIANT.match(name)
    if match is None or match.group("base") not in VARIANTS:
        return name, None
    return match.group("base"), int(match.group("seed"))


def variant_flags(name: str) -> list:
    """The trainer flags of a variant: its one change (for a paired-data variant, its training file; `arguments`
    adds the evaluation data; for a seed variant, its base's change and `--seed`, `trainer_arguments` adds the
    split's seed)."""
    base, seed = seed_of(name)
    if seed is not None:
        return [*VARIANTS[base], "--seed", str(seed)]
    if name in PAIRED:
        return ["--data", str(PAIRED_DIR / PAIRED[name])]
    if name in VARIANTS:
        return list(VARIANTS[name])
    tokens = data_tokens(name)
    return [] if tokens is None else ["--max_train_answer_tokens", str(tokens)]


def check_variants(names: list) -> list:
    for name in names:
        if name in PAIRED and not (PAIRED_DIR / PAIRED[name]).is_file():
            raise ValueError(
                f"expected {PAIRED_DIR / PAIRED[name]} for variant {name}, got no such file: write it with "
                f"`python -m scripts.campaigns.raw_answers --out {PAIRED_DIR}`"
            )
        known = name in VARIANTS or name in PAIRED or seed_of(name)[1] is not None
        if not known and not DATA_VARIANT.match(name):
            raise ValueError(
                f"expected variants among {sorted([*VARIANTS, *PAIRED])}, <variant>_seed<N> (gamma4_seed1, ...) or "
                f"data_<answer tokens> (data_0.5M, data_all, ...), got {name!r}"
            )
        variant_flags(name)
    if len(set(names)) != len(names):
        raise ValueError(f"expected each variant once, got {names}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "training/configs/smollm2-135m.yaml"))
    parser.add_argument("--store", required=True, help="feature store folder (training/feature_store.py)")
    parser.add_argument("--data", nargs="+", default=None, help="override the config's data (.npz files or folders)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_fraction", type=float, default=None, help="override the config's held-out share")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="equal wall-clock instead of equal steps: train each variant for about this long",
    )
    parser.add_argument(
        "--save_every",
        type=int,
        default=0,
        help="save a checkpoint every N steps (0: none); a rerun resumes a variant cut off from its last checkpoint",
    )
    parser.add_argument("--out", default="results/ablation")
    parser.add_argument("--runs", default=str(REPO / "runs" / "ablation"), help="folder of the variants' runs")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"among {', '.join(sorted([*VARIANTS, *PAIRED]))}, <variant>_seed<N> (the variant from seed N on the "
        "same rows and held-out rows), or data_<answer tokens> (default: baseline)",
    )
    offline = parser.add_argument_group("offline scoring (training.evaluate_head) of every trained head")
    offline.add_argument("--offline", default="on", choices=["on", "off"], help="score each trained head offline")
    offline.add_argument("--eval_rows", type=int, default=300, help="held-out rows scored (the split's first)")
    offline.add_argument("--eval_new_tokens", type=int, default=256, help="cap on each row's answer tokens")
    offline.add_argument("--budgets", default=DEFAULT_BUDGETS, help="tree budgets, comma-separated")
    offline.add_argument(
        "--lookup_settings",
        default=str(DEFAULT_LOOKUP_SETTINGS),
        help="head folder lending its model-free branch settings to every head ('none': each its own)",
    )
    offline.add_argument("--eval_batch_size", type=int, default=32, help="rows per head forward")
    offline.add_argument(
        "--tree_keys",
        nargs="+",
        default=None,
        choices=TREE_KEYS,
        help="train nothing: score --head under each of these tree keys",
    )
    offline.add_argument("--head", default=None, help="with --tree_keys: the head folder scored")
    return parser


def check_args(args) -> dict:
    """Every argument checked before any work; a `ValueError` names the first bad one."""
    from training.evaluate_head import parse_budgets

    if args.minutes is not None and args.minutes <= 0:
        raise ValueError(f"expected --minutes > 0, got {args.minutes}")
    if args.steps < 1:
        raise ValueError(f"expected --steps >= 1, got {args.steps}")
    if args.save_every < 0:
        raise ValueError(f"expected --save_every >= 0, got {args.save_every}")
    if not (Path(args.store) / "store.json").is_file():
        raise ValueError(f"expected --store to be a feature store folder holding store.json, got {args.store}")
    budgets = parse_budgets(args.budgets)
    if args.eval_rows < 1:
        raise ValueError(f"expected --eval_rows >= 1, got {args.eval_rows}")
    if args.eval_new_tokens < 1:
        raise ValueError(f"expected --eval_new_tokens >= 1, got {args.eval_new_tokens}")
    if args.eval_batch_size < 1:
        raise ValueError(f"expected --eval_batch_size >= 1, got {args.eval_batch_size}")
    lookup = None if str(args.lookup_settings).lower() == "none" else args.lookup_settings
    if lookup is not None and not (Path(lookup) / "config.json").is_file():
        raise ValueError(f"expected --lookup_settings to be a head folder holding config.json or 'none', got {lookup}")
    if args.tree_keys is not None:
        if args.variants is not None:
            raise ValueError("expected either --variants (train) or --tree_keys (score one head), got both")
        if args.head is None or not (Path(args.head) / "config.json").is_file():
            raise ValueError(
                f"expected --head to be a head folder holding config.json with --tree_keys, got {args.head}"
            )
        if args.offline == "off":
            raise ValueError("expected --offline on with --tree_keys (it only scores), got off")
    variants = check_variants(args.variants or ["baseline"])
    return {"budgets": budgets, "lookup_settings": lookup, "variants": variants}


def config_of(args, name: str, run: str) -> str:
    """The config file of a variant: the given one, or a copy without the keys the variant removes."""
    name = seed_of(name)[0]
    if name not in UNSET:
        return args.config
    values = yaml.safe_load(Path(args.config).read_text())
    for key in UNSET[name]:
        values.pop(key, None)
    path = Path(args.runs) / f"{run}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


def trainer_arguments(args, name: str, steps: int, run: str) -> list[str]:
    """`run_trainer`'s command line for variant `name` trained `steps` steps into RUNS/`run`."""
    run_dir = Path(args.runs) / run
    common = [
        config_of(args, name, run),
        "--feature_store",
        args.store,
        "--cache_features",
        "false",
        "--max_steps",
        str(steps),
        "--eval_steps",
        str(steps),
        *(["--save_strategy", "no"] if not args.save_every else []),
        "--max_train_minutes",
        "1000",
        "--measure_tau_prompts",
        "0",
        "--warmup_steps",
        str(max(1, steps // 20)),
        "--output_dir",
        str(run_dir),
    ]
    if args.data:
        common += ["--data", *args.data]
    if args.eval_fraction is not None:
        common += ["--eval_fraction", str(args.eval_fraction)]
    if name in PAIRED:  # judged on the held-out rows of the data every other variant trains on
        common += ["--eval_data", *(args.data or yaml.safe_load(Path(args.config).read_text())["data"])]
    if seed_of(name)[1] is not None:  # the split of the run without the variant: the same rows, the same judges
        common += ["--split_seed", str(run_trainer.parse_args(common)[2].seed)]
    if args.save_every:  # checkpoints to resume a run cut off by a stop from (a rerun of the command resumes it)
        common += ["--save_strategy", "steps", "--save_steps", str(args.save_every), "--save_total_limit", "1"]
        if last_complete_checkpoint(run_dir) if run_dir.is_dir() else None:
            common += ["--resume_from_checkpoint", "true"]
    return common + variant_flags(name)


def run_settings(args, name: str) -> dict:
    """What the variant's run trains with, as the trainer parses it (its data, split, target and recipe)."""
    head_args, data_args, train_args = run_trainer.parse_args(trainer_arguments(args, name, 1, name))
    return {
        "target": head_args.target,
        "data": list(data_args.data),
        "eval_fraction": data_args.eval_fraction,
        "seed": train_args.seed if data_args.split_seed is None else data_args.split_seed,  # the held-out rows'
        "train_seed": train_args.seed,
        "loss": train_args.loss,
        "gamma": train_args.gamma,
        "block_attention": head_args.block_attention or "causal",
        "max_train_answer_tokens": data_args.max_train_answer_tokens,
        "eval_data": data_args.eval_data,
    }


def score_head(scorer: OfflineScorer, out: Path, name: str, settings: dict, head_dir, tree_keys=(None,)) -> dict:
    """Scores one head on the held-out rows its run was judged on; writes the full result, every row, compressed to
    OUT/offline/NAME.json.gz (about a tenth of the JSON: the clone's results stay light) and returns the compact
    one, which the summary keeps."""
    rows_of = settings.get("eval_data") or settings["data"]
    compact, full = scorer.score(
        head_dir, settings["target"], rows_of, settings["eval_fraction"], settings["seed"], tree_keys
    )
    (out / "offline").mkdir(exist_ok=True)
    with gzip.open(out / "offline" / f"{name}.json.gz", "wt", encoding="utf-8") as file:
        file.write(json.dumps(full, indent=1) + "\n")
    return compact


def score_tree_keys(args, scorer: OfflineScorer, out: Path) -> dict:
    """`--tree_keys`: the head `--head` scored under each key, one key at a time, the file written after each: a rerun
    (a campaign resumed after a stop) scores only the keys not yet scored with these settings, and returns the ones
    asked for, in the order asked."""
    done, keys = out / "tree_keys.json", [str(k) for k in args.tree_keys]
    wanted = {"head": str(args.head), **scorer.settings()}
    before = json.loads(done.read_text()) if done.is_file() else {}
    kept = before.get("by_key", {}) if all(before.get(k) == v for k, v in wanted.items()) else {}
    if all(key in kept for key in keys):
        print(f"ablation: tree keys of {args.head} already scored, skipped")
        return {**before, "by_key": {key: kept[key] for key in keys}}
    result = None
    for key in args.tree_keys:
        if str(key) in kept:
            print(f"ablation: tree key {key} of {args.head} already scored, kept")
            continue
        name = f"tree_keys-{Path(args.head).name}-{key}"
        scored = score_head(scorer, out, name, run_settings(args, "baseline"), args.head, (key,))
        kept[str(key)] = scored["by_key"][str(key)]
        result = tree_key_mode(args, out, {**scored, "by_key": {k: kept[k] for k in keys if k in kept}})
    return result


def steps_for_minutes(args, name: str, summary: dict) -> int:
    """The steps that fill `--minutes` for variant `name`: the data variants share the steps of the first one
    measured (they differ in data only); any other variant is timed by a probe run of `PROBE_STEPS` steps."""
    shared = []
    if DATA_VARIANT.match(name):
        shared = [
            other
            for other, r in summary.items()
            if other != name and DATA_VARIANT.match(other) and r.get("minutes") == args.minutes
        ]
    if shared:
        steps = summary[shared[0]]["steps"]
        print(f"ablation: {name} takes the {steps} steps of {shared[0]} (data variants share steps)")
        return steps
    timer = StepTimer()
    run_trainer.main(trainer_arguments(args, name, PROBE_STEPS, f"{name}-probe") + ["--eval_strategy", "no"], [timer])
    pace = timer.seconds_per_step(PROBE_SKIP)
    steps = max(1, int(args.minutes * 60 / pace))
    print(f"ablation: {name} at {pace:.2f} s/step gets {steps} steps")
    return steps


def train_variant(args, name: str, summary: dict, budget: dict, settings: dict, host) -> dict:
    """Trains variant `name` for its budget (steps, or the steps that fill `--minutes`) and returns its row."""
    steps = steps_for_minutes(args, name, summary) if args.minutes is not None else args.steps
    started = time.perf_counter()
    arguments = trainer_arguments(args, name, steps, name)
    metrics = run_trainer.main(arguments)
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("eval_acc_depth_"))
    row = {
        "change": " ".join(variant_flags(name) + [f"(no {key})" for key in UNSET.get(seed_of(name)[0], ())])
        or "(committed config)",
        "host_kind": host.name,
        **budget,
        "steps": steps,
        "seconds_per_step": metrics["train_runtime"] / steps,  # of this process's steps only when resumed
        "resumed": "--resume_from_checkpoint" in arguments,
        "wall_seconds": time.perf_counter() - started,
        "eval_loss": metrics["eval_loss"],
        "acc_per_depth": [metrics[f"eval_acc_depth_{d}"] for d in depths],
        "tau_chain": metrics["eval_tau_chain"],
        "settings": settings,
    }
    if "train_answer_tokens" in metrics:
        row["train_answer_tokens"] = metrics["train_answer_tokens"]
    return row


def measured(row: dict | None, budget: dict, scorer: OfflineScorer | None) -> tuple[bool, bool]:
    """Whether a stored row was trained at this budget, and scored with these offline settings (or needs none)."""
    trained = row is not None and all(row.get(key) == value for key, value in budget.items())
    scored = scorer is None or (
        row is not None
        and row.get("offline", {}).get("eval_rows") is not None
        and all(row["offline"].get(k) == v for k, v in scorer.settings().items())
    )
    return trained, scored


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    checked = check_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scorer = None
    if args.offline == "on":
        scorer = OfflineScorer(
            args.store,
            checked["budgets"],
            args.eval_rows,
            args.eval_new_tokens,
            checked["lookup_settings"],
            args.eval_batch_size,
        )
    if args.tree_keys is not None:
        return score_tree_keys(args, scorer, out)
    budget = {"minutes": args.minutes} if args.minutes is not None else {"steps": args.steps}
    host = host_kind()
    summary_path = out / "ablation.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for name in checked["variants"]:
        trained, scored = measured(summary.get(name), budget, scorer)
        if trained and scored:
            print(f"ablation: {name} already measured, skipped")
            continue
        settings = run_settings(args, name)
        if not trained:
            summary[name] = train_variant(args, name, summary, budget, settings, host)
            summary_path.write_text(json.dumps(summary, indent=1) + "\n")
        if scorer is not None:
            row = summary[name]
            row.setdefault("settings", settings)
            row["offline"] = score_head(scorer, out, name, settings, Path(args.runs) / name)
            summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    text = ablation_tables(summary, args.store, args.data)
    (out / "ablation.md").write_text(text)
    print(text)
    return summary


def tree_key_mode(args, out: Path, scored: dict) -> dict:
    """Writes and prints the tree-key table of one head."""
    result = {"head": str(args.head), **scored}
    (out / "tree_keys.json").write_text(json.dumps(result, indent=1) + "\n")
    budgets = [str(b) for b in scored["budgets"]]
    lines = [
        f"Head {args.head}, {scored['rows']} held-out rows ({scored['answer_tokens']} answer tokens), store "
        f"{args.store}; offline tau (committed tokens per round)\n",
        "| tree key | "
        + " | ".join(f"tau@{b} lookup off" for b in budgets)
        + " | "
        + " | ".join(f"tau@{b} lookup on" for b in budgets)
        + " |",
        "|---|" + "---:|" * (2 * len(budgets)),
    ]
    for key, entry in scored["by_key"].items():
        cells = [f"{entry[side][b]['tau']:.3f}" for side in ("lookup_off", "lookup_on") for b in budgets]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "tree_keys.md").write_text(text)
    print(text)
    return result


def ablation_tables(summary: dict, store: str, data) -> str:
    """OUT/ablation.md: the training table, and the offline table of the variants scored."""
    lines = [
        "| variant | change | budget | steps | s/step | train min | eval loss | depth 1 | depth 2 | depth 3 | chain tau |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        acc = row["acc_per_depth"] + [float("nan")] * 3
        budget_of_row = f"{row['minutes']:g} min" if "minutes" in row else f"{row['steps']} steps"
        lines.append(
            f"| {name} | `{row['change']}` | {budget_of_row} | {row['steps']} | {row['seconds_per_step']:.2f} | "
            f"{row['seconds_per_step'] * row['steps'] / 60:.1f} | {row['eval_loss']:.3f} | "
            f"{acc[0]:.3f} | {acc[1]:.3f} | {acc[2]:.3f} | {row['tau_chain']:.3f} |"
        )
    kinds = sorted({row.get("host_kind", "not recorded") for row in summary.values()})
    header = (
        f"Store {store}, data {' '.join(data) if data else 'of the config'}; each variant trained for its budget "
        f"(wall-clock minutes, or steps); host kind {', '.join(kinds)}\n\n"
    )
    scored = {name: row["offline"] for name, row in summary.items() if "offline" in row}
    if scored:
        budgets = [str(b) for b in next(iter(scored.values()))["budgets"]]
        top = budgets[-1]
        lines += [
            "",
            f"Offline (training.evaluate_head, the same held-out rows for every variant): tau per budget with "
            f"the model-free branch off and on; at budget {top}, branch off: acceptance at depths 1-3 and the "
            f"first round's share of top-ranked paths below -20 nats and mean score inflation (nats)",
            "",
            "| variant | rows | "
            + " | ".join(f"off @{b}" for b in budgets)
            + " | "
            + " | ".join(f"on @{b}" for b in budgets)
            + " | acc 1 | acc 2 | acc 3 | < -20 nats | inflation |",
            "|---|---:|" + "---:|" * (2 * len(budgets) + 5),
        ]
        for name, offline in scored.items():
            entry = offline["by_key"]["None"]
            cells = [fmt(entry[side].get(b, {}).get("tau")) for side in ("lookup_off", "lookup_on") for b in budgets]
            at_top = entry["lookup_off"].get(top, {})
            acc = (at_top.get("acceptance_per_depth") or []) + [None] * 3
            first = at_top.get("first_round", {})
            lines.append(
                f"| {name} | {offline['rows']} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(fmt(a) for a in acc[:3])
                + f" | {fmt(first.get('share_below_-20_nats'))} | "
                f"{fmt(first.get('mean_inflation'), '+.2f')} |"
            )
    return header + "\n".join(lines) + "\n"


def fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
