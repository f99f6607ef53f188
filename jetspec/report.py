"""The benchmark's report: `results.md` and the PNG plots, both drawn from the content of `results.json`.

Figures follow `docs/design.md`, "§6 Measured costs": speedup is tokens/s over plain greedy on the same prompt
(median and quartiles over prompts), the limit is tau * t(1) / (t(B) + t_draft). Everything here reads the results
`dict` that [`jetspec.bench.run_benchmark`] returns, so a saved `results.json` can be re-reported.
"""

from pathlib import Path

import numpy as np

ACCEPTANCE_COLUMNS = 8  # deepest depth shown in the tables (the plots show every depth)


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(results: dict) -> str:
    """The `results.md` report: settings, costs, one table per suite (and `all`), then the plots."""
    lines = _settings_lines(results)
    lines += summary_table(results["aggregates"])
    if results["costs"] is not None:
        lines += _cost_lines(results["costs"])
    for group, methods in results["aggregates"].items():
        lines += _suite_table(group, methods)
    if results.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]]
    return "\n".join(lines) + "\n"


def _settings_lines(results: dict) -> list[str]:
    config, machine, versions = results["config"], results["machine"], results["versions"]
    prompts = f"at most {config['limit']}" if config["limit"] else "all"
    return [
        "# jetspec benchmark",
        "",
        f"Command: `{results['command']}`  ",
        f"Started {results['started_at']}, {results['wall_seconds']:.0f} s; machine: {machine['platform']}, "
        f"{machine['cpu_count']} CPUs ({machine['torch_threads']} torch threads), host kind "
        f"{machine.get('host_kind', 'not recorded')}" + (f", {machine['cuda']}" if machine["cuda"] else "") + "  ",
        f"torch {versions['torch']}, transformers {versions['transformers']}, "
        f"jetspec {versions['jetspec']} ({versions['git_commit'] or 'no git commit'})  ",
        f"Target `{config['target']}` ({config['target_dtype']}, {config['attn_implementation']}); head "
        f"`{config['head']}` (tree depth {config['head_config']['tree_depth']}, width "
        f"{config['head_config']['tree_width']}); greedy, max_new_tokens {config['max_new_tokens']}, {prompts} "
        "prompts per suite, methods alternated per prompt in rotating order.",
        "",
        "Speedup: tokens/s over plain greedy on the same prompt (prefill included), median [q25, q75] over prompts. "
        f"Limit: tau * t(1) / (t(B) + t_draft). Equality with plain greedy: {config['equality']}; the `=/tie` "
        "column counts prompts equal to plain greedy and prompts that left it at a numerical tie (a mismatch fails "
        "the run). In half precisions every emitted token is judged on its own prefix against the float32 target: "
        "`judged` counts the tokens, `near-ties` those that are not the float32 argmax but lie within the tolerance "
        "of it, `violations` those beyond it (a violation fails the run; plain greedy is judged alike).",
        "",
        f"Note: {results['notes']['chain']}",
    ]


def _cost_lines(costs: dict) -> list[str]:
    lines = [
        "",
        "## Costs",
        "",
        f"On a prompt of {costs['prompt_tokens']} tokens, median of {costs['repeats']} repeats: target step "
        f"t(1) = {costs['target_step_seconds'] * 1e3:.2f} ms, head draft forward "
        f"{costs['draft_forward_seconds'] * 1e3:.2f} ms, draft cost c = {costs['draft_cost_c']:.3f}.",
        "",
        "| verify | nodes | t(B) ms | t(B)/t(1) |",
        "| --- | ---: | ---: | ---: |",
    ]
    entries = [(f"tree-{b}", v) for b, v in costs["verify"].items()] + [("chain", costs["chain"])]
    for name, v in entries:
        lines.append(f"| {name} | {v['nodes']} | {v['seconds'] * 1e3:.2f} | {v['ratio_to_step']:.2f} |")
    return lines


def every_prompt(aggregates: dict) -> dict:
    """The group of `aggregates` over every prompt: `all` when the bench ran several suites, else its one suite
    (`{}` when there is neither)."""
    if "all" in aggregates:
        return aggregates["all"]
    return next(iter(aggregates.values())) if len(aggregates) == 1 else {}


def summary_table(aggregates: dict) -> list[str]:
    """The short table (the one a README quotes): a row per method, speedup median over plain greedy per suite and
    over all prompts, tau in parentheses where the method drafts, and `=/tie` over all prompts."""
    groups = [g for g in aggregates if g != "all"] + (["all"] if "all" in aggregates else [])
    everything = every_prompt(aggregates)
    lines = [
        "",
        "## Summary",
        "",
        "| method | =/tie | " + " | ".join(groups) + " |",
        "| --- | ---: |" + " --- |" * len(groups),
    ]
    for name, a in everything.items():
        label = f"{name} ({a['tokens_per_s_median']:.1f} tok/s)" if name == "plain" else name
        cells = []
        for group in groups:
            m = aggregates[group].get(name)
            if m is None:
                cells.append("-")
                continue
            tau = m.get("tau_mean")
            cells.append(f"{m['speedup_median']:.2f}x" + ("" if tau is None else f" ({tau:.2f})"))
        lines.append(f"| {label} | {a['equality']['exact']}/{a['equality']['tie']} | " + " | ".join(cells) + " |")
    return lines


def _suite_table(group: str, methods: dict) -> list[str]:
    """One table: a row per method, acceptance columns up to the deepest depth any method reached (at most 8)."""
    deepest = max((len(a.get("acceptance_per_depth") or []) for a in methods.values()), default=0)
    shown = min(deepest, ACCEPTANCE_COLUMNS)
    acc_head = "".join(f" acc d{d + 1} |" for d in range(shown))
    lines = [
        "",
        f"## {group}",
        "",
        "| method | B | prompts | =/tie | judged | near-ties | violations | tok/s | speedup median [q25, q75] | tau "
        "| limit |" + acc_head,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |" + " ---: |" * shown,
    ]
    for name, a in methods.items():
        acc = ((a.get("acceptance_per_depth") or []) + [None] * shown)[:shown]
        lines.append(
            f"| {name} | {_fmt(a.get('budget_mean'), 1)} | {a['prompts']} | "
            f"{a['equality']['exact']}/{a['equality']['tie']} | {_judged_cells(a.get('judged'))} | "
            f"{a['tokens_per_s_median']:.1f} | "
            f"{a['speedup_median']:.2f}x [{a['speedup_q25']:.2f}, {a['speedup_q75']:.2f}] | "
            f"{_fmt(a.get('tau_mean'))} | {_fmt(a.get('limit_speedup'), suffix='x')} |"
            + "".join(f" {_fmt(x)} |" for x in acc)
        )
    return lines


def _judged_cells(judged) -> str:
    """`judged | near-ties | violations`, dashes where nothing was judged token by token (float32, older runs)."""
    if not judged:
        return "- | - | -"
    return f"{judged['tokens']} | {judged['near_ties']} | {judged['violations']}"


# ------------------------------------------------------------------------------------------------ plots
def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """Speedup vs budget and per-depth acceptance, one panel per suite (matplotlib's Agg canvas, no pyplot).

    Returns:
        `list[Path]`: the PNG files written to `out_dir`.
    """
    suites = results["config"]["suites"]
    speedup = _figure(len(suites), "Speedup over plain greedy vs tree budget (median, bars: q25-q75)")
    acceptance = _figure(len(suites), "Acceptance per depth (fraction of rounds whose accepted path reaches depth d)")
    for i, suite in enumerate(suites):
        aggregates = results["aggregates"].get(suite, {})
        _speedup_panel(speedup.axes[i], suite, aggregates, results["config"]["budgets"])
        _acceptance_panel(acceptance.axes[i], suite, aggregates)
    written = [Path(out_dir) / "speedup_vs_budget.png", Path(out_dir) / "acceptance_per_depth.png"]
    for fig, path in zip((speedup, acceptance), written):
        fig.savefig(path, dpi=120)
    return written


def _figure(panels: int, title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * panels, 3.6), layout="constrained")
    fig.subplots(1, panels, squeeze=False)
    fig.suptitle(title)
    return fig


def _quartile_bar(ax, x: float, a: dict, marker: str, label: str):
    """One method's median speedup at `x`, with a q25-q75 bar."""
    below, above = a["speedup_median"] - a["speedup_q25"], a["speedup_q75"] - a["speedup_median"]
    ax.errorbar(
        [x], [a["speedup_median"]], yerr=[[below], [above]], marker=marker, capsize=3, linestyle="none", label=label
    )


def _speedup_panel(ax, suite: str, aggregates: dict, budgets: list):
    tree = [(b, aggregates[f"tree-{b}"]) for b in budgets if f"tree-{b}" in aggregates]
    if tree:
        xs = [b for b, _ in tree]
        med = np.array([a["speedup_median"] for _, a in tree])
        err = np.array(
            [
                [a["speedup_median"] - a["speedup_q25"] for _, a in tree],
                [a["speedup_q75"] - a["speedup_median"] for _, a in tree],
            ]
        )  # (2, budgets)
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label="tree (measured)")
        limits = [a.get("limit_speedup") for _, a in tree]
        if all(v is not None for v in limits):
            ax.plot(xs, limits, linestyle="--", marker="x", label="tree (limit)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    if "chain" in aggregates:
        chain = aggregates["chain"]
        _quartile_bar(ax, chain["budget"], chain, "s", f"chain (D={chain['budget']})")
    if aggregates.get("auto", {}).get("budget_mean") is not None:
        auto = aggregates["auto"]
        _quartile_bar(ax, auto["budget_mean"], auto, "D", f"auto (mean B={auto['budget_mean']:.1f})")
    if "prompt_lookup" in aggregates:
        ax.axhline(aggregates["prompt_lookup"]["speedup_median"], linestyle=":", color="gray", label="prompt_lookup")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set(title=suite, xlabel="tree budget B (draft nodes)", ylabel="speedup (x)")
    ax.legend(fontsize="small")


def _acceptance_panel(ax, suite: str, aggregates: dict):
    for name, a in aggregates.items():
        acc = a.get("acceptance_per_depth")
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {a['tau_mean']:.2f})")
    ax.set(title=suite, xlabel="depth d", ylabel="acceptance", ylim=(0, 1.02))
    ax.legend(fontsize="small")
