"""Per-prompt round statistics of tree decoding in float32, to compare two checkouts exactly.

In float32 tree decoding is deterministic, so a change to the round that keeps its behaviour must reproduce every
prompt's rounds, tau and output bit for bit. Runs the head's defaults, the head alone at budget 8 and budget 16 with
the lookup branch on the first `--limit` prompts of each evaluation suite and prints one JSON line per (prompt,
method) with a hash of the output tokens. Run it in each checkout (it only calls `load_target`, `load_prompts`,
`JetSpecDraftModel.from_pretrained` and `target.generate`, which every version has) and `diff` the two outputs:

    python -m scripts.round_stats --head jetspec/heads/smollm2-135m > after.jsonl
"""

import argparse
import hashlib
import json
from pathlib import Path

import torch

from jetspec.prompts import load_prompts
from jetspec.targets import apply_chat_template, load_target
from modeling_jetspec import JetSpecDraftModel

SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "jetspec" / "heads" / "smollm2-135m"
METHODS = {"default": {}, "tree-8": {"tree_budget": 8, "tree_lookup": 0}, "tree-16-lookup": {"tree_budget": 16}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target alias, folder or Hub id (load_target)")
    parser.add_argument("--head", type=Path, default=SHIPPED_HEAD, help="saved head folder (the same in both runs)")
    parser.add_argument("--limit", type=int, default=2, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    head = JetSpecDraftModel.from_pretrained(args.head, dtype=torch.float32).eval()
    for suite in ("gsm8k", "humaneval", "mtbench"):
        for prompt in load_prompts(suite, args.limit):
            text = apply_chat_template(tokenizer, prompt["prompt"])
            enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            for name, extra in METHODS.items():
                out = target.generate(
                    **enc,
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    assistant_model=head,
                    return_dict_in_generate=True,
                    pad_token_id=tokenizer.eos_token_id,
                    **extra,
                )
                # older checkouts report through head.last_stats instead of the output
                stats = getattr(out, "jetspec_stats", None) or head.last_stats
                new = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
                print(
                    json.dumps(
                        {
                            "prompt": prompt["id"],
                            "method": name,
                            "rounds": stats.rounds,
                            "tau": round(stats.tau, 4),
                            "tokens": len(new),
                            "sha1": hashlib.sha1(str(new).encode()).hexdigest()[:12],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
