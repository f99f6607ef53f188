"""A tree round on a gated delta-net target (Qwen3.5) holds leaves x (linear states + past) for its leaf paths, up
to a bound: past `hybrid.PATHS_FORWARD_BYTES` (or a share of the target's weights, tiny here) the paths run in
chunks, a few forwards instead of one.

A gated delta-net layer keeps a recurrent state of `linear_num_value_heads x key dim x value dim` per row: here
8 x 128 x 128 fp32, 0.5 MiB per layer and row (Qwen3.5's defaults, 32 value heads, make it 2 MiB). The old
depth-by-depth scan, which kept every node's states, peaked at 1.17 GB at batch 1 and 3.22 GB at batch 4 on this
target, against 0.49 and 0.61 GB for chain verify. Each measurement runs in a fresh process (peak RSS,
`ru_maxrss`) under a 3 GB address-space limit.
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

    from modeling_jetspec import JetSpecDraftModel, hybrid

    if bound_mib:
        hybrid.PATHS_FORWARD_BYTES = int(bound_mib * 2**20)
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


def peak(mode: str, bound_mib: float = 0) -> dict:
    """[`measure`] in a fresh process, its address space capped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, __file__, mode, str(BATCH), str(bound_mib)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES)),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tree_verify_memory_follows_its_bound():
    chain, tree, small = peak("chain"), peak("tree"), peak("tree", bound_mib=8)
    print(f"\nchain {chain}\ntree  {tree}\nsmall {small}")
    assert chain["rounds"] >= 1 and tree["rounds"] >= 1 and small["rounds"] >= 1  # all really verified rounds
    # 4 rows x about 20 leaves x 1.5 MiB of states: past the default 64 MiB, so two chunks of paths, and a fold
    assert tree["forwards_per_round"] <= 3
    # what the call added: the paths' copies and the forward's working tensors, not one state per node and depth
    assert tree["peak_mib"] - tree["before_mib"] <= 480
    # an 8 MiB bound runs 5 paths per forward: more forwards, and about the old scan's memory (measured: 15.5
    # forwards per round, +152 MiB; the default bound: 3 forwards per round, +381 MiB; chain: +24 MiB)
    assert small["forwards_per_round"] > tree["forwards_per_round"]
    assert small["peak_mib"] <= 1.5 * chain["peak_mib"] and small["peak_mib"] - small["before_mib"] <= 200


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))
