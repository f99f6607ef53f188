"""The verify's linear layers in both GEMM forms, and how many nodes the trie adds beyond the tree budget.

    python -m scripts.measure_verify_linears                     # SmolLM2-135M, its committed head, float32
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m scripts.measure_verify_linears
    python -m scripts.measure_verify_linears --target tiny --prompts 2 --tokens 16   # smoke run

1. Linears: every `torch.nn.Linear` of the target (the LM head included) called once at each row count
   (`--rows`, default 1, 8, 9, 12, 16), as `F.linear(x, W)` and as `torch.mm(W, x.T).T`
   (`modeling_jetspec.linear_forms.mm_linear`), interleaved, median of `--repeats` passes; per row count the totals,
   their ratio to one row, and the LM head alone. The forms the `verify_linear="auto"` probe picks are printed too.
2. Trie nodes: `generate` at the head's defaults over `--prompts` prompts per suite; per verify round the tree's
   draft nodes against the budget (the lookup branch's nodes beyond it), from the round hook's records
   (`jetspec_round_hook`: each round's budget and its rows' draft nodes).

Writes `--out` (JSON) when given. Timings are of this host and this process's threads; say which host (and whether
the AVX2 variables above emulate one) with any number quoted.
"""

import argparse
import json
import statistics
import time

import torch

from modeling_jetspec.linear_forms import mm_linear, probe_form


@torch.no_grad()
def time_linears(target, rows_list, repeats: int) -> dict:
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    head = target.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    forms = {"linear": torch.nn.functional.linear, "mm": mm_linear}
    out = {}
    for rows in rows_list:
        xs = {m.in_features: torch.randn(rows, m.in_features, generator=g).to(m.weight) for m in linears}
        totals, lm = {name: [] for name in forms}, {name: [] for name in forms}
        for _ in range(repeats + 1):  # the first pass warms up
            for name, fn in forms.items():
                start = time.perf_counter()
                for m in linears:
                    fn(xs[m.in_features], m.weight, m.bias)
                totals[name].append(time.perf_counter() - start)
                start = time.perf_counter()
                fn(xs[head.in_features], head.weight, head.bias)
                lm[name].append(time.perf_counter() - start)
        picks = (
            {f"{m.out_features}x{m.in_features}": probe_form(m.weight, m.bias, rows) for m in linears}
            if rows > 1
            else {}
        )
        out[rows] = {f"{name}_ms": statistics.median(t[1:]) * 1e3 for name, t in totals.items()}
        out[rows].update({f"lm_head_{name}_ms": statistics.median(t[1:]) * 1e3 for name, t in lm.items()})
        out[rows]["auto_picks"] = picks
    for rows, r in out.items():
        r["linear_vs_1_row"] = r["linear_ms"] / out[rows_list[0]]["linear_ms"] if rows_list[0] == 1 else None
        r["mm_vs_1_row_linear"] = r["mm_ms"] / out[rows_list[0]]["linear_ms"] if rows_list[0] == 1 else None
    return out


@torch.no_grad()
def trie_nodes(target, tokenizer, head, prompts: list, tokens: int) -> dict:
    sizes = []  # (draft nodes, budget) per round: batch 1, one tree a round

    def recording(record):
        sizes.append((max(record.nodes), record.budget))

    for prompt in prompts:
        ids = (
            prompt
            if tokenizer is None
            else tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
        )
        target.generate(
            input_ids=ids, do_sample=False, max_new_tokens=tokens, assistant_model=head, jetspec_round_hook=recording
        )
    extra = [n - b for n, b in sizes]
    return {
        "rounds": len(sizes),
        "budget": sorted({b for _, b in sizes}),
        "mean_nodes": statistics.mean(n for n, _ in sizes),
        "mean_extra": statistics.mean(extra),
        "max_extra": max(extra),
        "rounds_with_extra": sum(e > 0 for e in extra),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="'tiny', the 'smollm2-135m' alias, or a folder")
    parser.add_argument("--head", default=None, help="head folder (default: the target's committed head)")
    parser.add_argument("--rows", default="1,8,9,12,16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=5, help="prompts per suite for the trie count (0: skip)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if any(r < 1 for r in rows):
        raise ValueError(f"expected row counts >= 1, got {rows}")
    tokenizer = None
    if args.target == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        from modeling_jetspec import JetSpecDraftModel

        torch.manual_seed(0)
        target = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ).eval()
        head = JetSpecDraftModel.from_target(
            target, num_hidden_layers=1, block_size=8, tree_lookup=8, tree_lookup_branches="trie"
        ).eval()
        g = torch.Generator().manual_seed(0)
        loop = torch.randint(1, 128, (1, 6), generator=g)
        prompts = [torch.cat([loop] * 4, dim=1) for _ in range(args.prompts)]  # repeats: the trie has matches
    else:
        from jetspec.cli import DEFAULT_HEADS
        from jetspec.prompts import load_prompts
        from jetspec.targets import load_target
        from modeling_jetspec import JetSpecDraftModel

        target, tokenizer = load_target(args.target)
        head = JetSpecDraftModel.from_pretrained(args.head or DEFAULT_HEADS[args.target], dtype=target.dtype).eval()
        prompts = (
            [p["prompt"] for suite in ("gsm8k", "humaneval", "mtbench") for p in load_prompts(suite, args.prompts)]
            if args.prompts
            else []
        )
    report = {
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "linears": time_linears(target, rows, args.repeats),
    }
    if prompts:
        report["trie"] = trie_nodes(target, tokenizer, head, prompts, args.tokens)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
