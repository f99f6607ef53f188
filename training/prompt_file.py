"""The prompts regeneration answers: a jsonl file (a `"prompt"` string or ShareGPT-style `"conversations"` per line) or
a `datasets` folder with a `"prompt"` column ([`read_prompts`]).
"""

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import datasets

HUMAN_ROLES = ("human", "user")


def _prompt_of(record: Any, where: str) -> str:
    """The user prompt of one record: its `"prompt"` field, or the first human turn of `"conversations"`."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object at {where}, got {type(record).__name__}")
    if "prompt" in record:
        prompt = record["prompt"]
    elif "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list):
            raise ValueError(f"expected `conversations` to be a list at {where}, got {type(turns).__name__}")
        # ShareGPT turns are {"from": "human", "value": ...}; chat-style turns are {"role": "user", "content": ...}
        human = [
            turn.get("value", turn.get("content"))
            for turn in turns
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in HUMAN_ROLES
        ]
        if not human:
            raise ValueError(
                f"expected a human/user turn in `conversations` at {where}, got roles "
                f"{[turn.get('from', turn.get('role')) for turn in turns if isinstance(turn, dict)]}"
            )
        prompt = human[0]
    else:
        raise ValueError(f"expected a `prompt` or `conversations` field at {where}, got fields {sorted(record)}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"expected a non-empty string prompt at {where}, got {prompt!r}")
    return prompt


def read_prompts(path: Union[str, os.PathLike], limit: Optional[int] = None) -> list[dict[str, str]]:
    """
    Reads the prompts to regenerate answers for.

    Args:
        path (`str` or `os.PathLike`):
            Either a jsonl file with one JSON object per line, holding a `"prompt"` string or a
            ShareGPT-style `"conversations"` list (the first human/user turn is the prompt), or a
            folder written by `datasets.Dataset.save_to_disk` with a `"prompt"` column. An `"id"`
            field/column is kept; rows without one are numbered by their position.
        limit (`int`, *optional*):
            Keep only the first `limit` prompts.

    Returns:
        `list[dict[str, str]]`: records `{"id": str, "prompt": str}` in file order, with unique ids.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"expected limit to be a positive int or None, got {limit}")
    records: list[dict[str, str]] = []
    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if not isinstance(dataset, datasets.Dataset):
            raise ValueError(
                f"expected a single Dataset saved with save_to_disk in {path}, got {type(dataset).__name__}"
            )
        if "prompt" not in dataset.column_names:
            raise ValueError(f"expected a `prompt` column in {path}, got columns {dataset.column_names}")
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
        ids = dataset["id"] if "id" in dataset.column_names else range(len(dataset))
        for index, (id_, prompt) in enumerate(zip(ids, dataset["prompt"])):
            records.append({"id": str(id_), "prompt": _prompt_of({"prompt": prompt}, f"{path} row {index}")})
    elif path.is_file():
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if limit is not None and len(records) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path} line {line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"expected valid JSON at {where}, got {error.msg}: {line[:80]!r}") from None
                prompt = _prompt_of(record, where)
                records.append({"id": str(record.get("id", len(records))), "prompt": prompt})
    else:
        raise ValueError(f"expected a jsonl file or a datasets folder, got {path} which does not exist")
    if not records:
        raise ValueError(f"expected at least one prompt in {path}, got none")
    seen: set[str] = set()
    for record in records:
        if record["id"] in seen:
            raise ValueError(f"expected unique prompt ids in {path}, got {record['id']!r} twice")
        seen.add(record["id"])
    return records
