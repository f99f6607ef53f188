"""The clone's budget (issue 55): the tree holds the shipped head and at most two kept heads a next run warm-starts
from, their weights at most 40 MiB in all, and `results/` at most 8 MiB. Every other trained head leaves the tree,
its weights digest, config and metrics recorded in `results/heads.json` (weights back with
`git show <commit>:<folder>/model.safetensors`). A new weight file anywhere else fails."""

import json
import re
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
WEIGHTS_BUDGET = 40 * MIB
RESULTS_BUDGET = 8 * MIB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")

# The shipped head, and the two heads the next run warm-starts from.
KEEP = (
    "jetspec/heads/smollm2-135m",
    "training/checkpoints/smollm2-135m-long",
    "training/checkpoints/smollm2-135m-long2",
)


def tracked_sizes() -> dict:
    """`{path: bytes}` of every tracked file present in the working tree (a file deleted but not yet committed
    counts as gone)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the budget is on tracked files")
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
    ).stdout.decode("utf-8")
    sizes = {}
    for path in filter(None, listing.split("\0")):
        file = ROOT / path
        if file.is_file():
            sizes[path] = file.stat().st_size
    return sizes


def under(path: str, folders) -> bool:
    return any(path.startswith(folder.rstrip("/") + "/") for folder in folders)


def weight_problems(sizes: dict) -> list:
    """What breaks the weights' budget in `{path: bytes}`: a weight file outside `KEEP`, or more than
    `WEIGHTS_BUDGET` bytes of weights."""
    weights = {path: size for path, size in sizes.items() if path.endswith(WEIGHT_SUFFIXES)}
    problems = [f"{path}: a weight file outside KEEP" for path in weights if not under(path, KEEP)]
    counted = sum(weights.values())
    if counted > WEIGHTS_BUDGET:
        problems.append(f"tracked weights: {counted / MIB:.1f} MiB, over {WEIGHTS_BUDGET // MIB} MiB")
    return problems


def results_bytes(sizes: dict) -> int:
    return sum(size for path, size in sizes.items() if path.startswith("results/"))


def test_the_listing_sees_the_shipped_head():
    # a listing that saw nothing would pass every budget below
    sizes = tracked_sizes()
    assert sizes.get("jetspec/heads/smollm2-135m/model.safetensors", 0) > MIB
    assert results_bytes(sizes) > 0


def test_tracked_weights_fit_the_budget():
    assert weight_problems(tracked_sizes()) == []


def test_a_new_weight_file_breaks_the_budget():
    sizes = tracked_sizes()
    assert weight_problems(sizes) == []
    # (a) a small new head anywhere outside KEEP fails by its place alone
    assert weight_problems({**sizes, "training/checkpoints/next/model.safetensors": 1024})
    assert weight_problems({**sizes, "runs/next/pytorch_model.bin": 1024})
    # (b) inside KEEP, weights that push the total past the budget fail by their size
    assert weight_problems({**sizes, "jetspec/heads/smollm2-135m/extra.safetensors": WEIGHTS_BUDGET})


def test_every_head_that_left_is_recorded():
    """Each head that left the tree keeps its record (weights digest, config, the result file that evaluated it, the
    command that brings its weights back), and none of them is still tracked."""
    record = json.loads((ROOT / "results" / "heads.json").read_text(encoding="utf-8"))
    commit = record["commit"]
    sizes = tracked_sizes()
    assert len(record["heads"]) >= 14
    for name, head in record["heads"].items():
        folder = f"training/checkpoints/{name}"
        assert not any(under(path, [folder]) for path in sizes), f"{folder} left the tree but is still tracked"
        assert re.fullmatch(r"[0-9a-f]{16}", head["weights_sha256"]), head["weights_sha256"]
        assert head["checkout"] == f"git show {commit}:{folder}/model.safetensors > model.safetensors"
        assert head["config"]["model_type"] == "jetspec"
        assert (ROOT / head["metrics"]["file"]).is_file(), f"{name}: {head['metrics']['file']} is not in the tree"


def test_results_fit_the_budget():
    size = results_bytes(tracked_sizes())
    assert size <= RESULTS_BUDGET, f"results/: {size / MIB:.1f} MiB, over 8 MiB"


def test_no_result_file_is_a_megabyte_of_rows():
    """A per-row result (an offline evaluation's every row) is kept only compressed: no file under `results/` reaches
    1 MiB (the largest summaries, a bench's results.json, are about a quarter of that)."""
    large = {path: size for path, size in tracked_sizes().items() if path.startswith("results/") and size >= MIB}
    assert not large, f"files under results/ of 1 MiB or more (gzip per-row files): {large}"
