"""Results name the weights they measured (`jetspec/provenance.py`): a digest that follows the bytes, and the
commit that holds them, so a shipped folder's next contents are never mistaken for the ones measured."""

import subprocess

import torch
from safetensors.torch import save_file

from jetspec.provenance import weights_digest, weights_identity


def write_weights(folder, value: float):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((4,), value)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_digest_follows_the_weights_not_the_folder(tmp_path):
    write_weights(tmp_path / "a", 1.0)
    write_weights(tmp_path / "b", 1.0)
    first = weights_digest(tmp_path / "a")
    assert len(first) == 16 and weights_digest(tmp_path / "b") == first  # same bytes, same digest
    (tmp_path / "a" / "config.json").write_text('{"changed": true}')
    assert weights_digest(tmp_path / "a") == first  # the config is not the weights
    write_weights(tmp_path / "a", 2.0)
    assert weights_digest(tmp_path / "a") != first
    assert weights_digest(tmp_path / "empty") is None


def test_identity_names_the_commit_that_holds_the_weights(tmp_path):
    repo = tmp_path / "repo"
    head = repo / "heads" / "h"
    write_weights(head, 1.0)
    git(repo.parent, "init", "-q", str(repo))
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    identity = weights_identity(head)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert identity == {"weights_sha256": weights_digest(head), "commit": commit.strip(), "committed": True}
    write_weights(head, 2.0)  # the next ship, not yet committed: the commit no longer holds these weights
    assert weights_identity(head)["committed"] is False
    outside = tmp_path / "outside"
    write_weights(outside, 1.0)
    assert weights_identity(outside)["commit"] is None  # no checkout: the digest alone
    assert weights_identity("org/a-hub-id") == {"weights_sha256": None, "commit": None, "committed": None}
