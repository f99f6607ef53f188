"""Tokens per target forward of the head in transformers' own loop against the tree loop, float32, exact outputs.

Routes, all batch 1 and greedy on the first `--limit` prompts of each evaluation suite:
- `dflash`: generate hook uninstalled, `target.generate(..., assistant_model=head, speculation_type="dflash")`:
  transformers' DFlash generator calling the head's forward;
- `chain`: `custom_generate=chain_generate` (transformers' `_assisted_decoding` with `JetSpecCandidateGenerator`),
  the head's chain alone (`jetspec_lookup=0`) and with the lookup chain where it leads;
- `tree`: the tree loop at the head's defaults.

Every route's output is checked against plain greedy `generate` (float32: equal token for token), and target
forwards are counted with a forward hook, so tau = new tokens / target forwards (the prefill included, as
`jetspec_stats.tau` counts it). Counting, not timing: other work on the machine does not change the figures.

    python -m scripts.transformers_loop --limit 3 --max-new-tokens 128
"""

import argparse
import json
from pathlib import Path

import torch

from jetspec.host import host_kind
from jetspec.prompts import load_prompts
from jetspec.targets import encode_chat, load_target
from modeling_jetspec import JetSpecDraftModel, chain_generate, install_generate_hook, uninstall_generate_hook

SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "jetspec" / "heads" / "smollm2-135m"


def routes(head):
    """name -> (extra generate kwargs, whether the generate hook is off)."""
    chain = dict(custom_generate=chain_generate, jetspec_head=head, jetspec_depth=head.config.block_size - 1)
    return {
        "dflash": (dict(assistant_model=head, speculation_type="dflash"), True),
        "chain": ({**chain, "jetspec_lookup": 0}, False),
        "chain+lookup": (chain, False),
        "tree (defaults)": (dict(assistant_model=head), False),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target alias, folder or Hub id (load_target)")
    parser.add_argument("--head", type=Path, default=SHIPPED_HEAD, help="saved head folder")
    parser.add_argument("--limit", type=int, default=3, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="write the per-route totals here as JSON")
    args = parser.parse_args(argv)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=torch.float32).eval()
    forwards = [0]
    target.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    totals = {name: {"tokens": 0, "forwards": 0, "equal": 0, "prompts": 0} for name in routes(head)}
    for suite in ("gsm8k", "humaneval", "mtbench"):
        for prompt in load_prompts(suite, args.limit):
            enc = encode_chat(tokenizer, prompt["prompt"])
            common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            plain = target.generate(**enc, **common)
            for name, (extra, unhooked) in routes(head).items():
                forwards[0] = 0
                if unhooked:
                    uninstall_generate_hook()
                try:
                    out = target.generate(**enc, **common, **extra)
                finally:
                    install_generate_hook()
                total = totals[name]
                total["tokens"] += out.shape[1] - enc["input_ids"].shape[1]
                total["forwards"] += forwards[0]
                total["equal"] += int(torch.equal(out, plain))
                total["prompts"] += 1
    for total in totals.values():
        total["tau"] = round(total["tokens"] / total["forwards"], 3)
    report = {
        "host": host_kind().name,
        "dtype": "float32",
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "routes": totals,
    }
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
