"""The held-out curve of a training run as a markdown table: one row per evaluation the Trainer logged (agreement with
the target at depths 1 and 2, evaluation loss, and the chain tau those agreements imply, not a decoded one), read from a `trainer_state.json` (a checkpoint's,
or the one a kept head carries) or a shipped head's `training_log.json`.

    python -m scripts.eval_curve training/checkpoints/smollm2-135m-long/trainer_state.json
    python -m scripts.eval_curve RUN/trainer_state.json --write docs/results.md --marker long-run:curve

`--write` replaces the table that follows `<!-- MARKER -->` in the file (or inserts one there), so rerunning it after
more steps updates the same table.
"""

import argparse
import json
import re
from pathlib import Path

COLUMNS = ("step", "acc d1", "acc d2", "eval loss", "tau chain")


def eval_rows(log_history: list) -> list[dict]:
    """The evaluation entries of a log history, one per step (the last entry wins when a resumed run logged a step
    twice), in step order."""
    rows = {}
    for entry in log_history:
        if "eval_acc_depth_1" not in entry:
            continue
        if "step" not in entry:
            raise ValueError(f"expected a 'step' in every evaluation entry, got {sorted(entry)}")
        rows[int(entry["step"])] = entry
    if not rows:
        raise ValueError("expected evaluation entries (eval_acc_depth_1) in the log history, got none")
    return [rows[step] for step in sorted(rows)]


def read_history(path: Path) -> list:
    data = json.loads(Path(path).read_text())
    history = data.get("log_history") if isinstance(data, dict) else data
    if not isinstance(history, list):
        raise ValueError(f"expected a trainer_state.json (log_history) or a training_log.json list in {path}")
    return history


def render(rows: list[dict]) -> str:
    def pct(value):
        return "-" if value is None else f"{100 * value:.1f}%"

    def num(value):
        return "-" if value is None else f"{value:.3f}"

    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---:" for _ in COLUMNS) + " |"]
    for row in rows:
        cells = (
            f"{int(row['step']):,}",
            pct(row.get("eval_acc_depth_1")),
            pct(row.get("eval_acc_depth_2")),
            num(row.get("eval_loss")),
            num(row.get("eval_tau_chain")),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_after_marker(path: Path, marker: str, table: str) -> None:
    """Puts `table` right after `<!-- marker -->`, replacing the table already there."""
    text = path.read_text()
    tag = f"<!-- {marker} -->\n"
    if tag not in text:
        raise ValueError(f"expected the line '{tag.strip()}' in {path}, got none")
    head, tail = text.split(tag, 1)
    tail = re.sub(r"\A\n?(\|[^\n]*\n)+", "", tail)  # the previous table, if any
    path.write_text(head + tag + "\n" + table + tail)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("state", type=Path, help="trainer_state.json or training_log.json")
    parser.add_argument("--write", type=Path, help="a markdown file holding the marker")
    parser.add_argument("--marker", default="long-run:curve")
    args = parser.parse_args(argv)
    table = render(eval_rows(read_history(args.state)))
    if args.write:
        write_after_marker(args.write, args.marker, table)
    print(table, end="")
    return table


if __name__ == "__main__":
    main()
