"""Ship a trained head: into the package's head folder (`jetspec/heads/<name>`), with a model card from
`hub_cards/jetspec-head.md`, and to the Hub as an upload of exactly the head's files.

[`replace_head`] is the release step: it rewrites a shipped head folder with a new head's files ([`SHIPPED_FILES`]),
its config without `auto_map` (a local folder holds no code: `import modeling_jetspec` registers the class) and with a
calibration map where one is kept, after checking in a staging folder that the result loads as a head. Whatever else
the shipped folder held (the old head's other files, a `custom_generate/` copy) is removed, so it holds the one head.
`scripts/ship_decision.py` decides whether a head ships and calls it.

A shipped folder whose default is `tree_budget="auto"` keeps it ([`shipped_tree_budget`]): the package's default does
not fall back to the trained head's fixed budget. Its `tau_by_budget` measured the old weights and goes with them, so
the new head decodes at the fallback point (budget 8, its own sources) until `python -m training.tau_table --write`
measures its own table.

The card is a `huggingface_hub.ModelCard` rendered from the template (its YAML front matter is validated when the
card is built). The upload is [`push_head_folder`]: `upload_folder` with `allow_patterns` naming the head's files
([`head_files`]), so Trainer checkpoints and logs in the same folder stay local. This lives here, not in
`modeling_jetspec/`, which ships to the Hub as the head's remote code.
"""

import json
import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData

DEFAULT_TEMPLATE = Path(__file__).resolve().parents[1] / "hub_cards" / "jetspec-head.md"
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
SHIPPED_FILES = (  # what a shipped head folder holds, where the new head has it
    "config.json",
    "model.safetensors",
    "README.md",
    "metrics.json",
    "learning_curve.png",
    "training_log.json",
    "training_args.json",
)


def shipped_tree_budget(shipped) -> str | None:
    """`"auto"` where the shipped folder's config has `tree_budget="auto"` (a default the new head keeps, module
    docstring), else `None` (the new head's own default ships)."""
    path = Path(shipped) / "config.json"
    if not path.is_file():
        return None
    return "auto" if json.loads(path.read_text()).get("tree_budget") == "auto" else None


def stage_head(new, dest, calibration_map: dict | None = None, tree_budget: str | None = None) -> list[str]:
    """Writes the head saved in `new` as it ships into the empty or new folder `dest`: its files of [`SHIPPED_FILES`],
    its config without `auto_map` and with `calibration_map` as its `tree_calibration` and `tree_budget` as its
    default budget where given; checks that the result loads as a head.

    Args:
        new (`str` or `os.PathLike`): a head saved by `save_pretrained` (a training run's kept head).
        dest (`str` or `os.PathLike`): an empty or missing folder.
        calibration_map (`dict`, *optional*): the tree calibration the shipped config carries; `None` leaves the
            config's own.
        tree_budget (`str`, *optional*): `"auto"` to ship the head with `tree_budget="auto"` (its own
            `tau_by_budget` kept where it has one); `None` leaves the config's own budget.

    Returns:
        `list[str]`: the names written, sorted.
    """
    from modeling_jetspec import JetSpecDraftModel

    new, dest = Path(new), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"expected an empty folder to write the head into, got files in {dest}")
    config = json.loads((new / "config.json").read_text())
    config.pop("auto_map", None)
    if calibration_map is not None:
        config["tree_calibration"] = calibration_map
    if tree_budget is not None:
        if tree_budget != "auto":
            raise ValueError(f"expected tree_budget 'auto' or None to stage a head with, got {tree_budget!r}")
        config["tree_budget"] = tree_budget
    for name in SHIPPED_FILES:
        if name != "config.json" and (new / name).is_file():
            shutil.copy2(new / name, dest / name)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    JetSpecDraftModel.from_pretrained(dest)  # loads as a head, else the caller replaces nothing
    return sorted(p.name for p in dest.iterdir())


def replace_head(new, shipped, calibration_map: dict | None = None) -> list[str]:
    """Replaces the head in the folder `shipped` with the one saved in `new` (module docstring): staged beside it
    first ([`stage_head`]), so a head that does not load replaces nothing; a shipped `tree_budget="auto"` is kept
    ([`shipped_tree_budget`]).

    Args:
        new (`str` or `os.PathLike`): the head that ships.
        shipped (`str` or `os.PathLike`): the shipped head's folder (e.g. `jetspec/heads/smollm2-135m`), rewritten.
        calibration_map (`dict`, *optional*): the tree calibration the shipped config carries.

    Returns:
        `list[str]`: the names written, sorted.
    """
    new, shipped = Path(new), Path(shipped)
    with tempfile.TemporaryDirectory(dir=shipped.parent) as tmp:
        staged = Path(tmp) / shipped.name
        written = stage_head(new, staged, calibration_map, shipped_tree_budget(shipped))
        for old in shipped.iterdir():  # the folder holds one head: the old one's files and folders go
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for name in written:
            shutil.move(str(staged / name), shipped / name)
    return written


def head_files(folder) -> list[str]:
    """Relative paths of the files a head repository holds, found in the saved head `folder`: config, weights
    (single or sharded), the flat code files `save_pretrained` copied, `custom_generate/generate.py`, and `README.md`
    when there is one. Anything else there (Trainer checkpoints, logs) is not part of the head."""
    folder = Path(folder)
    required = ("config.json", "custom_generate/generate.py")
    missing = [name for name in required if not (folder / name).is_file()]
    weights = sorted(p.name for p in folder.glob("model*.safetensors*"))
    if missing or not weights:
        raise ValueError(
            f"expected a head saved by save_pretrained in {folder} (config.json, model*.safetensors, "
            f"custom_generate/generate.py), missing {missing + ([] if weights else ['model*.safetensors'])}"
        )
    files = ["config.json", *weights, *sorted(p.name for p in folder.glob("*.py")), "custom_generate/generate.py"]
    return files + (["README.md"] if (folder / "README.md").is_file() else [])


def push_head_folder(
    folder,
    repo_id: str,
    api: HfApi | None = None,
    private: bool | None = None,
    commit_message: str = "Upload JetSpec head",
):
    """`upload_folder` of exactly [`head_files`] (as `allow_patterns`), the repository created when missing.

    Args:
        folder (`str` or `os.PathLike`): a head saved by `save_pretrained` (it may hold more, which stays local).
        repo_id (`str`): the model repository.
        api (`HfApi`, *optional*): defaults to `HfApi()` (token from the environment).
        private (`bool`, *optional*): visibility of a newly created repository.

    Returns:
        The `upload_folder` result (a `CommitInfo`).
    """
    files = head_files(folder)
    api = api if api is not None else HfApi()
    api.create_repo(repo_id, exist_ok=True, private=private)
    return api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message, allow_patterns=files
    )


def render_card(template_path, **values) -> ModelCard:
    """The model card of a head, from a Jinja template with `{{name}}` placeholders.

    Args:
        template_path (`str` or `os.PathLike`): the template.
        **values: one value per placeholder, no more, no fewer (Jinja would render a missing one as empty).

    Returns:
        `ModelCard`: the card (`str(card)` is its text).
    """
    text = Path(template_path).read_text(encoding="utf-8")
    names = set(PLACEHOLDER.findall(text))
    missing = sorted(names - set(values))
    if missing:
        raise ValueError(f"expected values for the card placeholders {missing} of {template_path}, got none")
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"expected only the placeholders {sorted(names)} of {template_path}, got also {unknown}")
    return ModelCard.from_template(ModelCardData(), template_str=text, **values)


def write_card(folder, template_path=None, **values) -> Path:
    """Render the card into `folder/README.md` and return its path."""
    path = Path(folder) / "README.md"
    render_card(template_path or DEFAULT_TEMPLATE, **values).save(path)
    return path


def push_folder(
    folder,
    repo_id: str,
    api: HfApi | None = None,
    private: bool | None = None,
    commit_message: str = "Upload JetSpec head",
):
    """Upload the head saved in `folder`, with its card, to the model repository `repo_id`.

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
    if not (Path(folder) / "README.md").is_file():
        raise ValueError(f"expected a saved head with a model card in {folder}, missing ['README.md']")
    return push_head_folder(folder, repo_id, api=api, private=private, commit_message=commit_message)
