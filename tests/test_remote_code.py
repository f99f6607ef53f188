"""A saved head is a complete Hub-style folder: it reloads through `AutoModel(..., trust_remote_code=True)` in a
fresh process, decodes identically, and `custom_generate=<folder>, jetspec_head=<folder>` runs tree decoding from
the folder alone."""

import json
import os
import subprocess
import sys
import textwrap

import torch
import transformers.utils.hub as transformers_hub
from huggingface_hub import ModelCard, ModelCardData
from safetensors.torch import load_file

from jetspec.tiny import prompts, tiny_head, tiny_target

# the package's files a saved head needs: the head, its config and formats, and every file of the round
CODE_FILES = {
    "modeling_jetspec.py",
    "configuration_jetspec.py",
    "checkpoint_formats.py",
    "integration.py",
    "decode.py",
    "verifiers.py",
    "hybrid.py",
    "hybrid_cache.py",
    "hybrid_chain.py",
    "hybrid_tree.py",
    "shared_past.py",
    "columns.py",
    "steps.py",
    "acceptance.py",
    "compaction.py",
    "draft_vocabulary.py",
    "target_config.py",
    "state.py",
    "compat.py",
    "tree.py",
    "budget.py",
    "timing.py",
    "layers.py",
    "candidate_generator.py",
    "processors.py",
    "stopping.py",
    "linear_forms.py",
    "host_cache.py",
}

FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModel, AutoModelForCausalLM
    sys.modules.pop("modeling_jetspec", None)
    target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    head = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
    ids = torch.tensor(json.loads(sys.argv[3])); mask = torch.tensor(json.loads(sys.argv[4]))
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    tree = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                           assistant_model=head)
    recipe = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                             custom_generate=sys.argv[2], jetspec_head=sys.argv[2], trust_remote_code=True)
    try:
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, custom_generate=sys.argv[2],
                        trust_remote_code=True)
        refused = ""
    except ValueError as error:
        refused = str(error)
    print(json.dumps({"plain": plain.tolist(), "tree": tree.tolist(), "recipe": recipe.tolist(),
                      "head_module": type(head).__module__, "refused": refused}))
    """
)


def test_save_reload_in_a_fresh_process_decodes_identically(tmp_path):
    target = tiny_target("qwen3")
    ids, mask = prompts(3)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    head = tiny_head(target)
    ours = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=head)
    target.save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "head")

    folder = tmp_path / "head"
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "custom_generate/generate.py"} | CODE_FILES <= files
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_jetspec.JetSpecDraftModel"
    weights = load_file(folder / "model.safetensors")
    assert not any("embed_tokens" in k or "lm_head" in k for k in weights)  # the target's, never stored

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH_PROCESS,
            str(tmp_path / "target"),
            str(folder),
            json.dumps(ids.tolist()),
            json.dumps(mask.tolist()),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["head_module"].startswith("transformers_modules")  # the folder's code, not the installed package
    assert out["plain"] == plain.tolist()
    assert out["tree"] == ours.tolist() == plain.tolist()
    assert out["recipe"] == plain.tolist()
    # the recipe does not guess which head to use: transformers does not tell it the repo it came from
    assert "expected jetspec_head=<this repo or folder" in out["refused"]


def test_reloaded_weights_draft_the_same_trees(tmp_path):
    target = tiny_target("llama")
    ids, mask = prompts(1)
    head = tiny_head(target)
    head.save_pretrained(tmp_path)
    from modeling_jetspec import JetSpecDraftModel

    again = JetSpecDraftModel.from_pretrained(tmp_path).eval()
    saved, loaded = head.state_dict(), again.state_dict()
    assert list(loaded) == list(saved)  # same names in the same order, nothing renamed, dropped or added
    for name in saved:
        assert loaded[name].dtype == saved[name].dtype and torch.equal(loaded[name], saved[name]), name
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, assistant_model=head)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, assistant_model=again)
    assert head.last_stats.accepted_at_depth == again.last_stats.accepted_at_depth


class FakeHubApi:
    """Stands for transformers' `hf_api()`: records the repository and every file a commit would upload."""

    def __init__(self):
        self.created, self.uploaded = [], {}

    def create_repo(self, repo_id, private=None, token=None, exist_ok=False):
        self.created.append((repo_id, private))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, commit_message=None, **kwargs):
        for op in operations:
            with open(op.path_or_fileobj, "rb") as file:
                self.uploaded[op.path_in_repo] = file.read()
        self.commit_message = commit_message
        return "commit"


def test_push_to_hub_uploads_the_jetspec_layout(tmp_path, monkeypatch):
    """`save_pretrained(push_to_hub=True)` uploads, through transformers' own push, the folder a Hub user needs:
    config, weights, the flat code files and the `custom_generate` recipe (no network: the Hub API is a fake)."""
    api = FakeHubApi()
    monkeypatch.setattr(transformers_hub, "hf_api", lambda: api)
    monkeypatch.setattr(  # a new repository has no card yet: transformers writes its default one
        transformers_hub,
        "create_and_tag_model_card",
        lambda repo_id, tags=None, token=None: ModelCard.from_template(ModelCardData(library_name="transformers")),
    )
    head = tiny_head(tiny_target("llama"))
    head.save_pretrained(
        tmp_path / "head", push_to_hub=True, repo_id="org/head", private=True, commit_message="first head"
    )
    local = {p.relative_to(tmp_path / "head").as_posix() for p in (tmp_path / "head").rglob("*") if p.is_file()}
    assert api.created == [("org/head", True)] and api.commit_message == "first head"
    assert set(api.uploaded) == local | {"README.md"}
    assert {"config.json", "model.safetensors", "custom_generate/generate.py"} | CODE_FILES <= local
    assert json.loads(api.uploaded["config.json"])["auto_map"]["AutoModel"] == "modeling_jetspec.JetSpecDraftModel"
    for name in local:  # the uploaded bytes are the saved ones
        assert api.uploaded[name] == (tmp_path / "head" / name).read_bytes(), name


LOCAL_LOAD = """
import json, sys
import modeling_jetspec  # the installed package registers the head's config and model with the Auto classes
from transformers import AutoModel
heads = [AutoModel.from_pretrained(folder, trust_remote_code=True) for folder in sys.argv[1:]]
print(json.dumps([[type(head).__module__, head.config.num_hidden_layers] for head in heads]))
"""


def test_committed_head_folders_load_as_their_docs_say():
    """The shipped head and every kept head hold no code files, so their configs name none (`auto_map` would send
    `trust_remote_code` looking for them); in a fresh process, after `import modeling_jetspec`, `AutoModel` loads each
    from the installed package, with `trust_remote_code=True` as a Hub user would pass it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = [os.path.join(root, "jetspec", "heads", "smollm2-135m")]
    kept = os.path.join(root, "training", "checkpoints")
    folders += sorted(os.path.join(kept, name) for name in os.listdir(kept) if os.path.isdir(os.path.join(kept, name)))
    layers = []
    for folder in folders:
        config = json.loads(open(os.path.join(folder, "config.json")).read())
        for target in config.get("auto_map", {}).values():
            module = target.split(".")[0] + ".py"
            assert os.path.isfile(os.path.join(folder, module)), f"{folder}: config names {module}, folder lacks it"
        layers.append(config["num_hidden_layers"])
    result = subprocess.run(
        [sys.executable, "-c", LOCAL_LOAD, *folders],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == [["modeling_jetspec.modeling_jetspec", n] for n in layers]
