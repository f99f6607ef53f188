"""A tree round on a gated delta-net target (Qwen3.5) holds, per leaf path of forward 1, a copy of its row's linear
states, the gated delta-net's working tensors, its logits and its share of the masks; the attention past is read in
place, once per batch row. As many paths run in one forward as fit in `hybrid_tree.PATHS_FORWARD_BYTES` (or a share
of the target's weights, tiny here), and never fewer than the batch's rows (what a chain verify's forward holds).

A gated delta-net layer keeps a recurrent state of `linear_num_value_heads x key dim x value dim` per row: here
8 x 128 x 128 fp32, 0.5 MiB per layer and row (Qwen3.5's defaults, 32 value heads, make it 2 MiB), and its chunked
form works on about 5 MiB per row and layer at these sizes. Measured here (fresh processes, peak RSS added by the
call): at batch 4 chain +30 MiB, tree +88 MiB at the default 64 MiB bound (8.5 forwards per round), +627 MiB at a
512 MiB bound (2 forwards per round); at batch 32 chain 728 MiB, tree 774 MiB. Each measurement runs in a fresh
process (peak RSS, `ru_maxrss`) under a 3 GB address-space limit.
"""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = 4
LIMIT_BYTES = 3 * 2**30


def measure(mode: str, batch: int, bound_mib: float) -> dict:
    """Peak RSS (MiB) before and after one greedy `generate` call with a random head, `tree_verify=mode`, with
    `PATHS_FORWARD_BYTES` at `bound_mib` (0: the default), and the call's forwards per round."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from modeling_jetspec import JetSpecDraftModel, hybrid_tree

    if bound_mib:
        hybrid_tree.PATHS_FORWARD_BYTES = int(bound_mib * 2**20)
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )  # layers: 3 gated delta-net, 1 full attention
    target = Qwen3_5ForCausalLM(config).eval()
    head = JetSpecDraftModel.from_target(target, tree_width=3).eval()  # default depth 7, budget 32
    ids = torch.randint(1, 16, (batch, 8), generator=torch.Generator().manual_seed(0))

    def run(rows, verify):
        return target.generate(
            input_ids=rows,
            attention_mask=torch.ones_like(rows),
            do_sample=False,
            max_new_tokens=3,
            assistant_model=head,
            tree_verify=verify,
        )

    with torch.no_grad():
        run(ids[:1], "chain")  # warm-up: lazy imports and allocations common to both modes
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run(ids, mode)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = head.last_stats
    return {
        "mode": mode,
        "batch": batch,
        "bound_mib": bound_mib,
        "before_mib": before / 1024,
        "peak_mib": after / 1024,
        "rounds": stats.rounds,
        "forwards_per_round": (stats.target_forwards - 1) / max(stats.rounds, 1),
    }


def peak(mode: str, batch: int = BATCH, bound_mib: float = 0) -> dict:
    """[`measure`] in a fresh process, its address space capped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, __file__, mode, str(batch), str(bound_mib)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES)),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def added(run: dict) -> float:
    return run["peak_mib"] - run["before_mib"]


def test_tree_verify_memory_follows_its_bound():
    chain, tree, large = peak("chain"), peak("tree"), peak("tree", bound_mib=256)
    print(f"\nchain {chain}\ntree  {tree}\nlarge {large}")
    assert chain["rounds"] >= 1 and tree["rounds"] >= 1 and large["rounds"] >= 1  # all really verified rounds
    # 4 rows x about 20 leaves x 6.5 MiB counted per path: the default 64 MiB runs about 9 paths per forward, a
    # 256 MiB bound about 40: fewer forwards, more memory, each within its bound (with the allocator's slack)
    assert large["forwards_per_round"] < tree["forwards_per_round"]
    assert added(tree) <= 2 * 64 + added(chain)
    assert added(tree) < added(large) <= 1.5 * 256


def test_tree_verify_at_batch_32_holds_about_a_chains_memory():
    # a forward of as many leaf paths as the batch has rows holds what the chain's forward of its rows holds
    chain, tree = peak("chain", batch=32), peak("tree", batch=32)
    print(f"\nchain {chain}\ntree  {tree}")
    assert tree["rounds"] >= 1 and tree["forwards_per_round"] > 2  # the leaves ran in several forwards
    assert tree["peak_mib"] <= 1.5 * chain["peak_mib"]


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))


def test_hybrid_forwards_isolates_runs_and_reports_one_cut_by_its_timeout(tmp_path):
    """scripts/hybrid_forwards.py --isolate: each run in its own process prints one JSON line (equal to plain greedy,
    forwards per round, peak memory); with --run-timeout a run that outlasts it is reported unfinished, not lost."""
    common = [sys.executable, "-m", "scripts.hybrid_forwards", "--layers", "4", "--isolate", "--batch", "1"]
    common += ["--new-tokens", "3"]
    common += ["--drafters", "always", "--modes", "chain"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(common, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT, check=True)
    (line,) = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert line["equal_to_greedy"] and line["mode"] == "chain" and line["peak_rss_mib"] >= line["rss_before_mib"]
    cut = subprocess.run(
        [*common, "--run-timeout", "0.01"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    (line,) = [json.loads(text) for text in cut.stdout.splitlines() if text.startswith("{")]
    assert line == {
        "batch": 1,
        "new_tokens": 3,
        "drafter": "always",
        "mode": "chain",
        "unfinished": "stopped after 0.01 s",
    }


def test_hybrid_forwards_reuses_a_kept_plain_reference(tmp_path):
    """--reference-dir: the first isolated run writes the plain greedy reference there, the next runs read it (no
    second file) and are still checked against it; a reference whose prompt is not this run's is recomputed."""
    import torch

    common = [sys.executable, "-m", "scripts.hybrid_forwards", "--layers", "4", "--isolate", "--batch", "1"]
    common += ["--new-tokens", "3"]
    common += ["--drafters", "always", "--reference-dir", str(tmp_path / "refs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*common, "--modes", "chain", "tree"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    lines = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert [line["mode"] for line in lines] == ["chain", "tree"] and all(line["equal_to_greedy"] for line in lines)
    (kept,) = (tmp_path / "refs").iterdir()
    reference = torch.load(kept)
    assert reference.shape == (1, 16 + 3) and kept.name.endswith("-p16-b1-n3.pt")
    torch.save(torch.zeros_like(reference), kept)  # not this run's prompt: recomputed and written again
    done = subprocess.run([*common, "--modes", "chain"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    (line,) = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert line["equal_to_greedy"] and torch.equal(torch.load(kept), reference)
