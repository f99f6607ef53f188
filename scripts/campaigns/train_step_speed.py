"""Seconds per training step of a JetSpec head in float32, under bf16 autocast and compiled with `torch.compile`,
timed side by side in one process: the modes take turns step by step (the order rotates), so drifts of a shared
machine fall on all of them alike.

The step is the trainer's own (`training.trainer.distillation_terms`, then backward and an AdamW update) on one
collated batch shaped like a real one. The target never runs and is not needed: its embeddings, final norm and LM
head are random weights of its shapes (its layers stay on the meta device), and its features and final hidden
states of the rows are random bf16 tensors, as the feature store serves them. Every mode trains its own copy of the
same head from the same start.

    python -m scripts.campaigns.train_step_speed --steps 20
    python -m scripts.campaigns.train_step_speed --steps 1 --modes fp32,bf16,compile     # a smoke run

Defaults: SmolLM2-135M-Instruct's shapes (hidden 576, 30 layers of which the head reads 5, vocabulary 49,152,
intermediate 1,536, 9 heads, 3 key/value heads) and the committed recipe (one head layer, last-context input, a
4,096-token draft vocabulary, block 8, 32 anchors per row, 8 rows of 512 tokens, forward KL, gamma 4). Run from
the repository root, as a module (`training/` is not an installed package).
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jetspec.host import host_kind
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.timing import clock
from training.trainer import JetSpecCollator, distillation_terms

MODES = {  # name: (compiled, autocast to bf16)
    "fp32": (False, False),
    "bf16": (False, True),
    "compile": (True, False),
    "compile_bf16": (True, True),
}


def synthetic_target(args) -> LlamaForCausalLM:
    """A Llama of the target's shapes whose layers stay on the meta device: only what the head borrows (input
    embeddings, tied LM head, final norm) holds memory, random."""
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=max(2048, args.max_length),
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        target = LlamaForCausalLM(config)
    decoder = target.get_decoder()
    decoder.embed_tokens.to_empty(device="cpu")
    decoder.norm.to_empty(device="cpu")
    with torch.no_grad():
        decoder.embed_tokens.weight.normal_(0.0, 0.02)
        decoder.norm.weight.uniform_(0.5, 2.0)
    target.lm_head.weight = decoder.embed_tokens.weight
    return target.eval()


def synthetic_batch(args, head: JetSpecDraftModel, generator: torch.Generator):
    """One collated batch of `batch_size` rows of `max_length` tokens, and the target's features `(B, L, k*H)` and
    final states `(B, L, H)` of its rows (bf16, as a feature store returns them)."""
    rows = [
        {
            "id": f"row-{i}",
            "prompt_length": args.max_length // 4,
            "input_ids": torch.randint(0, args.vocab_size, (args.max_length,), generator=generator).tolist(),
        }
        for i in range(args.batch_size)
    ]
    collator = JetSpecCollator(
        mask_token_id=head.config.mask_id,
        block_size=args.block_size,
        num_blocks=args.anchors,
        max_length=args.max_length,
        seed=0,
        epoch=0,
    )
    batch = collator(rows)
    k = len(head.config.target_layer_ids)
    shape = (args.batch_size, args.max_length)
    features = torch.randn(*shape, k * args.hidden_size, generator=generator).to(torch.bfloat16)
    final = torch.randn(*shape, args.hidden_size, generator=generator).to(torch.bfloat16)
    return batch, features, final


def make_step(head, batch, features, final, gamma: float | None, compiled: bool, autocast: bool, lr: float):
    """A closure running one training step of `head` (loss, backward, AdamW update); returns the loss."""
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    with torch.no_grad():  # build the head's lazy tables (rotary, draft LM head rows) before any compilation sees them
        distillation_terms(head, batch, features, final, "fkl", gamma)
    terms = torch.compile(distillation_terms) if compiled else distillation_terms

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total, count, _, _ = terms(head, batch, features, final, "fkl", gamma)
        (total / count).backward()
        optimizer.step()
        return float(total.detach() / count)

    return step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--modes", default="fp32,bf16,compile,compile_bf16", help=f"comma-separated, of {sorted(MODES)} (default: all)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per mode first (compilation of the forward and backward happens here)",
    )
    parser.add_argument("--hidden_size", type=int, default=576)
    parser.add_argument("--intermediate_size", type=int, default=1536)
    parser.add_argument("--num_layers", type=int, default=30, help="target layers (the head reads 5 of them)")
    parser.add_argument("--num_heads", type=int, default=9)
    parser.add_argument("--num_kv_heads", type=int, default=3)
    parser.add_argument("--vocab_size", type=int, default=49152)
    parser.add_argument("--draft_vocab_size", type=int, default=4096)
    parser.add_argument("--head_layers", type=int, default=1)
    parser.add_argument("--block_size", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per row")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--gamma", type=float, default=4.0)
    parser.add_argument("--learning_rate", type=float, default=6e-4)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    return parser


def mode_steps(args, modes: list) -> dict:
    """One step closure per mode, each training its own copy of the same head on the same batch."""
    target = synthetic_target(args)
    steps, batch = {}, None
    for mode in modes:
        torch.manual_seed(0)  # the same head for every mode
        head = (
            JetSpecDraftModel.from_target(
                target,
                num_hidden_layers=args.head_layers,
                block_size=args.block_size,
                last_context_input=True,
                draft_vocab_size=args.draft_vocab_size,
                tree_depth=min(7, args.block_size - 1),
            )
            .float()
            .train()
        )
        head.set_draft_vocab(torch.arange(args.draft_vocab_size))
        if batch is None:
            batch, features, final = synthetic_batch(args, head, torch.Generator().manual_seed(1))
        compiled, autocast = MODES[mode]
        steps[mode] = make_step(head, batch, features, final, args.gamma, compiled, autocast, args.learning_rate)
    return steps


def time_steps(steps: dict, warmup: int, timed: int) -> tuple[dict, dict]:
    """`(seconds, losses)`: each mode's timed step seconds and its last loss; the modes take turns step by step, the
    order rotating, after `warmup` untimed steps each."""
    modes = list(steps)
    seconds, losses = {mode: [] for mode in modes}, {}
    for _ in range(warmup):
        for mode in modes:
            losses[mode] = steps[mode]()
    for i in range(timed):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            started = clock()
            losses[mode] = steps[mode]()
            seconds[mode].append(clock() - started)
    return seconds, losses


def summarize(args, seconds: dict, losses: dict) -> dict:
    """Per mode: median, min and max seconds per step, sequence positions per second, speedup over fp32, last loss."""
    positions = args.batch_size * args.max_length
    fp32 = statistics.median(seconds["fp32"]) if "fp32" in seconds else None
    return {
        mode: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "positions_per_s": positions / statistics.median(values),
            "speedup_over_fp32": fp32 / statistics.median(values) if fp32 else None,
            "last_loss": losses[mode],
        }
        for mode, values in seconds.items()
    }


def markdown(args, results: dict, host) -> str:
    """The settings line and the table of the modes."""
    lines = [
        f"{args.steps} timed steps per mode after {args.warmup} warm-up steps; {args.batch_size} rows x "
        f"{args.max_length} tokens, {args.anchors} blocks of {args.block_size} per row, "
        f"hidden {args.hidden_size}, "
        f"draft vocabulary {args.draft_vocab_size}, {torch.get_num_threads()} threads; host kind {host.name} "
        f"(--dtype auto: {host.dtype}, {host.reason})",
        "",
        "| mode | s/step (median) | min | max | sequence positions/s | vs fp32 | last loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        speedup = f"{r['speedup_over_fp32']:.2f}x" if r["speedup_over_fp32"] else "-"
        lines.append(
            f"| {mode} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
            f"{r['positions_per_s']:.0f} | {speedup} | {r['last_loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise ValueError(f"expected --modes from {sorted(MODES)}, got {unknown or modes}")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"expected --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    seconds, losses = time_steps(mode_steps(args, modes), args.warmup, args.steps)
    host = host_kind()
    results = summarize(args, seconds, losses)
    print(markdown(args, results, host))
    if args.out:
        record = {
            "settings": vars(args),
            "host_kind": host.name,
            "host_dtype": host.dtype,
            "host_reason": host.reason,
            "results": results,
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
