"""Which weights a result measured, named so that the name keeps pointing at them.

A folder's path is not enough: `jetspec/heads/smollm2-135m` holds whatever head shipped last, so a result that
names only the folder compares a head with itself when it is rerun after the next ship. [`weights_identity`]
records, beside the folder, a digest of its weights and, inside a git checkout, the last commit that changed the
folder (with whether the working tree still holds that commit's files): `git show <commit>:<folder>/...` or a
worktree at that commit gives the same weights back.
"""

import hashlib
import subprocess
from pathlib import Path
from typing import Optional

__all__ = ["weights_digest", "weights_identity"]

DIGEST_CHARS = 16


def weights_digest(folder) -> Optional[str]:
    """sha256 over the folder's `*.safetensors` files (name and bytes, in name order), its first 16 hex digits;
    `None` for a folder without any (a Hub id, say)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode("utf-8") + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:DIGEST_CHARS]


def _git(folder: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def weights_identity(folder) -> dict:
    """`{"weights_sha256": ..., "commit": ..., "committed": ...}` of a head or model folder: the digest of
    [`weights_digest`]; the last commit that changed the folder (`None` outside a git checkout or for an untracked
    folder); `committed`: whether the folder's files equal that commit's (no uncommitted change)."""
    path = Path(folder)
    identity = {"weights_sha256": weights_digest(path) if path.is_dir() else None, "commit": None, "committed": None}
    if not path.is_dir():
        return identity
    commit = _git(path, "log", "-1", "--format=%H", "--", ".")
    if commit:
        identity["commit"] = commit
        identity["committed"] = _git(path, "status", "--porcelain", "--", ".") == ""
    return identity
