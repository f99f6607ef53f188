"""Draft cost c = one head draft forward / one target decode step, measured side by side in one process.

    python -m scripts.measure_draft_cost --target smollm2-135m --depth 7 --context 256
    python -m scripts.measure_draft_cost --dtype bfloat16 --draft-vocab-sizes 49152,16384,8192,4096

Random head weights are fine for cost. `--target tiny` uses `jetspec.tiny.tiny_target` (a 2-layer random Llama, hidden 64, vocab 128).
With several draft vocabulary sizes, one head per size is timed, interleaved with the target step in the same
process, so the ratios share the machine's state.
"""

import argparse
import json

import torch
from transformers.cache_utils import DynamicCache

from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.steps import draft_block
from modeling_jetspec.timing import median_seconds


@torch.no_grad()
def draft_cost(target, head, depth: int, context: int, repeats: int) -> dict:
    vocab = target.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g)
    cache = DynamicCache()
    out = target(input_ids=prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
    positions = torch.arange(context)[None]
    ctx = head.extend_context(
        None, head.target_features(out.hidden_states), positions, torch.ones(1, context, dtype=torch.bool)
    )
    step_ids = torch.randint(0, vocab, (1, 1), generator=g)
    anchor = torch.tensor([5])

    def target_step():
        target(input_ids=step_ids, position_ids=torch.tensor([[context]]), past_key_values=cache, use_cache=True)
        cache.crop(-1)

    def draft():  # the round's own draft forward, then the tree's top-W per depth
        logits = draft_block(head, ctx, anchor, context, depth)
        torch.log_softmax(logits, dim=-1).topk(4, dim=-1)

    t_step = median_seconds(target_step, repeats=repeats)
    t_draft = median_seconds(draft, repeats=repeats)
    return {"target_step_s": t_step, "draft_s": t_draft, "c": t_draft / t_step, "depth": depth, "context": context}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="'tiny', the 'smollm2-135m' alias, or a folder")
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1, help="head layers")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (target and head)")
    parser.add_argument(
        "--draft-vocab-sizes",
        default=None,
        help="comma-separated draft vocabulary sizes to time (default: the full vocabulary only)",
    )
    args = parser.parse_args(argv)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if args.dtype not in dtypes:
        raise ValueError(f"expected --dtype float32 or bfloat16, got {args.dtype!r}")
    torch.manual_seed(0)
    if args.target == "tiny":
        from jetspec.tiny import tiny_target

        target = tiny_target("llama")
    else:
        from jetspec.targets import load_target

        target, _ = load_target(args.target)
    target = target.to(dtypes[args.dtype]).eval()
    vocab = target.config.get_text_config(decoder=True).vocab_size
    sizes = [vocab] if args.draft_vocab_sizes is None else [int(x) for x in args.draft_vocab_sizes.split(",")]
    records = []
    for size in sizes:
        head = JetSpecDraftModel.from_target(
            target, num_hidden_layers=args.layers, block_size=args.depth + 1, draft_vocab_size=size
        ).eval()
        result = draft_cost(target, head, args.depth, args.context, args.repeats)
        records.append(
            {"target": args.target, "dtype": args.dtype, "head_layers": args.layers, "draft_vocab_size": size, **result}
        )
        print(json.dumps(records[-1]), flush=True)
    return records


if __name__ == "__main__":
    main()
