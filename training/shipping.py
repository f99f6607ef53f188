"""Ship a trained head: a model card from `hub_cards/jetspec-head.md`, and an upload of exactly the head's files.

`Trainer.push_to_hub` does not copy `custom_generate/` and would upload checkpoints and logs; here the shipped
files (config, weights, the flat code files, `custom_generate/`, `README.md`) are staged in a temporary folder
which is uploaded whole with `HfApi.upload_folder`.
"""

import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi

DEFAULT_TEMPLATE = Path(__file__).resolve().parents[1] / "hub_cards" / "jetspec-head.md"
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
REQUIRED_FILES = ("config.json", "model.safetensors", "custom_generate/generate.py", "README.md")


def render_card(template_path, **values) -> str:
    """Fill the `{{name}}` placeholders of a card template.

    Args:
        template_path (`str` or `os.PathLike`): the template.
        **values: one value per placeholder (converted with `str`).

    Returns:
        `str`: the card.
    """
    text = Path(template_path).read_text(encoding="utf-8")
    names = set(PLACEHOLDER.findall(text))
    missing = sorted(names - set(values))
    if missing:
        raise ValueError(f"expected values for the card placeholders {missing} of {template_path}, got none")
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"expected only the placeholders {sorted(names)} of {template_path}, got also {unknown}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def write_card(folder, template_path=None, **values) -> Path:
    """Render the card into `folder/README.md` and return its path."""
    path = Path(folder) / "README.md"
    path.write_text(render_card(template_path or DEFAULT_TEMPLATE, **values), encoding="utf-8")
    return path


def shipped_files(folder) -> list[str]:
    """Relative paths of the files a head repository holds: config, weights, top-level code, custom_generate/,
    README.md. Raises when one of the required ones is missing."""
    folder = Path(folder)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"expected a saved head with a model card in {folder}, missing {missing}")
    files = ["config.json", "model.safetensors", "README.md"]
    files += sorted(p.name for p in folder.glob("*.py"))
    files += sorted(p.relative_to(folder).as_posix() for p in (folder / "custom_generate").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts)
    return files


def push_folder(folder, repo_id: str, api: HfApi | None = None, private: bool | None = None,
                commit_message: str = "Upload JetSpec head"):
    """Upload the shipped files of the head folder `folder` to the model repository `repo_id`.

    Args:
        folder (`str` or `os.PathLike`): written by `head.save_pretrained` and [`write_card`]; may hold more
            (checkpoints, logs), which are not uploaded.
        repo_id (`str`): `"org/name"`.
        api (`HfApi`, *optional*): defaults to a new `HfApi()` (token from the environment).
        private (`bool`, *optional*): visibility of a newly created repository.

    Returns:
        The `upload_folder` result (a `CommitInfo`).
    """
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"expected a Hub repository id 'org/name', got {repo_id!r}")
    files = shipped_files(folder)
    api = api if api is not None else HfApi()
    with tempfile.TemporaryDirectory(prefix="jetspec-ship-") as staging:
        for name in files:
            destination = Path(staging) / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(folder) / name, destination)
        api.create_repo(repo_id, exist_ok=True, private=private)
        return api.upload_folder(repo_id=repo_id, folder_path=staging, commit_message=commit_message)
