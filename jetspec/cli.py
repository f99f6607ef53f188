"""The `jetspec` command: answer a prompt with tree speculative decoding, or benchmark it.

    jetspec generate ["PROMPT"] [--max-new-tokens 256] [--head DIR] [--target smollm2-135m] [--budget N|auto]
        [--show-drafts]
    jetspec bench --suite gsm8k,humaneval,mtbench --budgets 8,16,32,64 --max-new-tokens 256 --limit 10 \
        --out results/ [--head DIR] [--target smollm2-135m]
    jetspec convert SRC DST [--to jetspec|dflash] [--mask-token-id N]
    jetspec costs [--clear]
    jetspec serve [--model smollm2-135m] [--head DIR] [--host 127.0.0.1] [--port 8000] [--dtype auto] [--device cuda]
        [--api-key KEY] [--max-queue N] [--request-timeout S] [--max-batch N] [--answer-cache N]
        [--static off|eager|compile]

Without `--head`, the head committed for the default target (`jetspec/heads/smollm2-135m`) is used. Bad inputs
exit with status 2 and a one-line message.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .prompts import CONVERSATIONS, SUITES, check_suites
from .serve_limits import add_arguments as add_serve_limits  # stdlib only: no torch before the arguments are checked

# Bad input is reported before torch and transformers are imported (seconds): models load lazily.
DEFAULT_TARGET = "smollm2-135m"  # `jetspec.targets.SMOLLM2_ALIAS`
HEADS_DIR = Path(__file__).resolve().parent / "heads"
DEFAULT_HEADS = {DEFAULT_TARGET: HEADS_DIR / "smollm2-135m"}  # target alias -> head committed in this package
DEFAULT_SUITES = "gsm8k,humaneval,mtbench"
DEFAULT_BUDGETS = "8,16,32,64"
TARGET_HELP = f"target alias, folder or Hub id (default {DEFAULT_TARGET})"
# SmolLM2-135M-Instruct answers it correctly (a working class and a usage example whose printed values are right,
# 220 tokens greedily in bf16), long enough for a stable speed ratio
DEMO_PROMPT = "Write a Python class for a stack with push, pop, peek and is_empty methods."


class _Parser(argparse.ArgumentParser):
    """argparse, with errors reported on one line (`jetspec: error: ...`) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {value}")
    return value


def _budget(text: str):
    return "auto" if text == "auto" else _positive_int(text)


def parse_budgets(text: str) -> list[int]:
    """`"8,16,32"` -> `[8, 16, 32]`; raises `ValueError` on an item that is no integer (the values themselves are
    checked by `jetspec.bench.BenchConfig`)."""
    budgets = []
    for item in parse_list(text):
        try:
            budgets.append(int(item))
        except ValueError:
            raise ValueError(f"expected tree budgets that are integers >= 1, got {item!r} in {text!r}") from None
    return budgets


def parse_list(text: Optional[str]) -> Optional[list[str]]:
    """`"a, b"` -> `["a", "b"]`; `None` stays `None`."""
    return None if text is None else [item.strip() for item in text.split(",") if item.strip()]


def parse_suites(text: str) -> list[str]:
    """`"gsm8k,mtbench"` -> `["gsm8k", "mtbench"]`, conversation sets (`mtbench_turn2`) included; raises `ValueError`
    naming the valid suites otherwise."""
    return check_suites(parse_list(text), conversations=True)


def check_target_name(target: str, option: str = "--target"):
    """Raise a `ValueError` for a `--target` (or `option`) that names a local folder which does not exist: an absolute
    or relative path (`/x`, `./x`, `~/x`, `a/b/c`) cannot be an alias or a Hub id (`org/name`)."""
    if target in DEFAULT_HEADS or Path(target).expanduser().is_dir():
        return
    if target.startswith(("/", ".", "~")) or target.count("/") > 1 or os.sep != "/" and os.sep in target:
        found = "a file, not a folder" if Path(target).expanduser().exists() else "no such folder"
        raise ValueError(
            f"expected {option} to be the alias {DEFAULT_TARGET}, a saved model folder or a Hub id (org/name), got "
            f"{target!r}: {found}"
        )


def resolve_head_path(head: Optional[str], target: str) -> Path:
    """The head folder to load: `--head`, else the head committed for `target`; it must hold a saved head."""
    if head is None:
        if target not in DEFAULT_HEADS:
            raise ValueError(
                f"expected --head DIR for target {target!r}: a committed head exists only for "
                f"{', '.join(DEFAULT_HEADS)}"
            )
        path = DEFAULT_HEADS[target]
    else:
        path = Path(head).expanduser()
    if not (path / "config.json").is_file():
        found = "no such folder" if not path.exists() else "a folder without config.json"
        raise ValueError(
            f"expected a trained JetSpec head at {path} (config.json + model.safetensors from "
            f"`head.save_pretrained`), got {found}; train one for target {target!r} (regenerate data with "
            f"`python -m training.regenerate --target {target} ...`, then `python training/run_trainer.py "
            f"--target {target} --data data/regen --output_dir {path}`) or pass --head DIR"
        )
    return path


def load_head(path: Path, target):
    """A saved head, on the target's device and dtype, attached to it (raises `ValueError` on a mismatch)."""
    from modeling_jetspec import JetSpecDraftModel

    head = JetSpecDraftModel.from_pretrained(path, dtype=target.dtype).to(target.device).eval()
    head.attach_target(target)
    return head


SERVING_PACKAGES = ("fastapi", "uvicorn", "starlette", "openai")


def check_serving_extras():
    """Raise a `ValueError` naming the serving packages (`pip install "jetspec[serve]"`) that are not installed."""
    import importlib.util

    missing = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"expected the serving extras for `jetspec serve`, got {', '.join(missing)} missing: "
            f'pip install -e ".[serve]" (transformers[serving] and the openai client)'
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jetspec", description="Lossless tree speculative decoding with a JetSpec draft head.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for sub in (_add_generate(commands), _add_bench(commands), _add_serve(commands)):
        _add_model_options(sub)
    _add_convert(commands)
    costs = commands.add_parser(
        "costs", help="print this host's cached costs behind tree_budget='auto' (t(B)/t(1) and the round's overhead)"
    )
    costs.add_argument("--clear", action="store_true", help="delete the cached costs (measured again when needed)")
    return parser


def _add_generate(commands) -> argparse.ArgumentParser:
    gen = commands.add_parser("generate", help="answer one prompt, with and without the head, and compare speed")
    gen.add_argument(
        "prompt",
        nargs="?",
        default=DEMO_PROMPT,
        help=f"the user's message (the target's chat template is applied); default: {DEMO_PROMPT!r}",
    )
    gen.add_argument("--max-new-tokens", type=_positive_int, default=256, help="longest answer (default 256)")
    gen.add_argument("--head", default=None, help="saved head folder (default: the committed head of --target)")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    gen.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="tree budget B, or 'auto' (a budget and draft sources chosen from the head's tau_by_budget and this "
        "host's costs) (default: the head's config)",
    )
    gen.add_argument(
        "--show-drafts",
        action="store_true",
        help="mark each token of the answer by where it came from: the head's draft, the prompt-lookup branch or "
        "the target's own (bonus) token; coloured in a terminal, [head] {lookup} in plain text",
    )
    return gen


def _add_bench(commands) -> argparse.ArgumentParser:
    bench = commands.add_parser("bench", help="benchmark every method against plain greedy on prompt suites")
    bench.add_argument(
        "--suite",
        default=DEFAULT_SUITES,
        help=f"comma-separated suites among {', '.join(SUITES + CONVERSATIONS)} (default {DEFAULT_SUITES}); "
        "mtbench_turn2 decodes each MT-Bench conversation's first turn, then reports its second",
    )
    bench.add_argument(
        "--budgets", default=DEFAULT_BUDGETS, help=f"comma-separated tree budgets (default {DEFAULT_BUDGETS})"
    )
    bench.add_argument("--max-new-tokens", type=_positive_int, default=256, help="tokens per answer (default 256)")
    bench.add_argument("--limit", type=_positive_int, default=10, help="first N prompts of each suite (default 10)")
    bench.add_argument("--out", default="results", help="output folder (default results/)")
    bench.add_argument("--head", default=None, help="saved head folder (default: the committed head of --target)")
    bench.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    bench.add_argument(
        "--methods",
        default=None,
        help="comma-separated method kinds among plain, prompt_lookup, chain, tree, auto, path_conditioning, lookup, "
        "lookup_first, gap, lookup_gap, trie, answers (default: all)",
    )
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of every method")
    bench.add_argument(
        "--baseline-head",
        default=None,
        help="a second saved head for the same target: every head method runs once more with it (`<name>@baseline`)",
    )
    return bench


def _add_serve(commands) -> argparse.ArgumentParser:
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible server (chat, completions, streaming) that decodes with the head's tree"
    )
    serve.add_argument("--model", dest="target", default=DEFAULT_TARGET, help=TARGET_HELP.replace("target", "model"))
    serve.add_argument("--head", default=None, help="saved head folder (default: the committed head of --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give as `model` and /v1/models lists (default: --model as given)",
    )
    # --device, --api-key, --max-queue, --request-timeout, --max-batch, --answer-cache, --static
    add_serve_limits(serve)
    return serve


def _add_model_options(sub: argparse.ArgumentParser):
    """The options of every command that loads a target and a head: dtype, draft vocabulary, threads."""
    sub.add_argument(
        "--dtype",
        default="auto",
        help="target dtype: auto (bfloat16 on a CUDA device or a CPU with native bf16, else float32), float32 "
        "(output bitwise equal to plain greedy) or bfloat16 (equal up to numerical ties); default auto",
    )
    sub.add_argument(
        "--draft-vocab-size",
        type=_positive_int,
        default=None,
        help="draft from the head's N most frequent tokens only (N <= the head's draft vocabulary), or the full "
        "vocabulary when N is the target's vocabulary size (default: the head's own)",
    )
    sub.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads (default: torch's choice; on a busy shared CPU, 1 avoids threads that only spin)",
    )


def _add_convert(commands):
    convert = commands.add_parser("convert", help="convert a head between our layout and the DFlash one (vLLM, SGLang)")
    convert.add_argument(
        "src", help="head folder or Hub id: ours, DFlash / JetSpec-reference, or muse_glimmer_assistant"
    )
    convert.add_argument("dst", help="output folder")
    convert.add_argument(
        "--to",
        choices=("jetspec", "dflash"),
        default=None,
        help="output layout (default: dflash for one of our heads, jetspec for any other)",
    )
    convert.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="with --to dflash: the in-vocabulary id keyed to our trained MASK vector (default: "
        "config.dflash_mask_token_id or vocab_size - 1)",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "convert":
        return _convert(args, parser)
    if args.command == "costs":
        try:
            return _costs(args)
        except ValueError as error:  # a cache file that is not a JSON object of entries
            parser.error(" ".join(str(error).split()))
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # everything cheap is checked before any model loads: bad input -> exit status 2, one line
        dtype, dtype_reason, head_path, bench_config = _check_inputs(args)
    except ValueError as error:
        parser.error(str(error))

    import torch

    from .equality import float32_logits_fn
    from .targets import load_target

    print(f"jetspec: target dtype {str(dtype).removeprefix('torch.')} ({dtype_reason})", file=sys.stderr)

    def load() -> tuple:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        target, tokenizer = load_target(args.target, dtype=dtype, device=getattr(args, "device", None))
        head = load_head(head_path, target)
        baseline = None
        if args.command == "bench" and args.baseline_head is not None:
            baseline = load_head(args.baseline_head, target)
        for loaded in (head, baseline):
            if loaded is not None and args.draft_vocab_size is not None:
                loaded.restrict_draft_vocab(args.draft_vocab_size)
        if args.command == "serve":  # refused before serving: --answer-cache without the head's lookup branch,
            from .serve_limits import answer_cache_for  # and what the static path cannot run (--static)
            from .serve_static import check_static

            answer_cache_for(head, args.limits.answer_cache)
            check_static(target, head, args.limits.static)
        return target, tokenizer, head, baseline

    thread = None
    if args.command == "serve":  # the server's torch work, loading included, runs on its one inference thread
        from .serve import inference_thread

        thread = inference_thread()
    try:  # a Hub id that does not resolve, a head built for another target: one line, no traceback
        target, tokenizer, head, baseline = load() if thread is None else thread.submit(load).result()
    except (ValueError, OSError) as error:
        parser.error(" ".join(str(error).split()))
    if args.command == "serve":
        from .serve import serve

        name = args.served_model_name or args.target
        serve(target, tokenizer, head, name, args.host, args.port, args.limits, args.max_batch, thread)
        return 0
    # float32 is held to bitwise equality; a half precision's ties are judged against float32 logits, from the
    # checkpoint reloaded in float32 only if an output ever diverges
    float32_logits = None
    if dtype != torch.float32:
        float32_logits = float32_logits_fn(lambda: load_target(args.target, dtype=torch.float32)[0])
    try:
        if args.command == "generate":
            return _generate(args, target, tokenizer, head, float32_logits)
        return _bench(args, argv, target, tokenizer, head, bench_config, float32_logits, dtype_reason, baseline)
    except ValueError as error:  # refused arguments (e.g. a budget the head cannot draft)
        parser.error(" ".join(str(error).split()))


def _check_inputs(args):
    """`(dtype, why, head folder, BenchConfig or None)` from the arguments; raises `ValueError` on bad input."""
    from .targets import resolve_dtype

    dtype, dtype_reason = resolve_dtype(args.dtype)
    if args.command == "serve":
        from .serve_limits import check_arguments

        args.device, dtype, dtype_reason, args.limits = check_arguments(args)
    check_target_name(args.target, "--model" if args.command == "serve" else "--target")
    if args.command == "bench":
        suites, budgets = parse_suites(args.suite), parse_budgets(args.budgets)
    head_path = resolve_head_path(args.head, args.target)
    if args.command == "serve":
        check_serving_extras()
    if args.draft_vocab_size is not None:
        from modeling_jetspec import JetSpecConfig

        JetSpecConfig.from_pretrained(head_path).check_draft_vocab_restriction(args.draft_vocab_size)
    bench_config = None
    if args.command == "bench":
        from .bench import METHOD_KINDS, BenchConfig

        if args.baseline_head is not None:  # checked here, loaded beside the head
            args.baseline_head = resolve_head_path(args.baseline_head, args.target)

        methods = METHOD_KINDS if args.methods is None else parse_list(args.methods)
        bench_config = BenchConfig(suites, budgets, args.max_new_tokens, args.limit, methods, warmup=not args.no_warmup)
    return dtype, dtype_reason, head_path, bench_config


def _bench(args, argv, target, tokenizer, head, bench_config, float32_logits, dtype_reason, baseline=None) -> int:
    """`jetspec bench`: run, write the results, print the report."""
    from .bench import portable_name, run_benchmark

    # the recorded command names local folders as results.json names models: never by an absolute path
    command = " ".join(["jetspec", *(portable_name(a) if os.path.isabs(a) else a for a in argv)])
    results = run_benchmark(
        target,
        tokenizer,
        head,
        bench_config,
        args.out,
        float32_logits=float32_logits,
        command=command,
        dtype_reason=dtype_reason,
        baseline_head=baseline,
    )
    out = Path(args.out)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, " + ", ".join(str(out / p) for p in results["plots"]))
    return 0


def _generate(args, target, tokenizer, head, float32_logits) -> int:
    """`jetspec generate`: the head's answer, checked against plain greedy, and both speeds."""
    import torch

    from modeling_jetspec.timing import clock

    from .equality import check_lossless
    from .targets import encode_chat

    enc = encode_chat(tokenizer, args.prompt)
    inputs = {
        "input_ids": enc["input_ids"].to(target.device),
        "attention_mask": enc["attention_mask"].to(target.device),
    }
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "return_dict_in_generate": True}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is not None:
        common["pad_token_id"] = pad
    tree = {"assistant_model": head} if args.budget is None else {"assistant_model": head, "tree_budget": args.budget}

    def timed(**kwargs):  # the project's one clock: it waits for the accelerator, as the benchmark's does
        started = clock()
        out = target.generate(**inputs, **common, **kwargs)
        return out, clock() - started

    with torch.no_grad():  # untimed warm-up of both paths, then one timed run each
        target.generate(**inputs, **dict(common, max_new_tokens=4))
        target.generate(**inputs, **dict(common, max_new_tokens=4), **tree)
        spec, spec_seconds = timed(**tree)
        plain, plain_seconds = timed()
    prompt_ids = inputs["input_ids"][0].cpu()
    spec_tokens, plain_tokens = (out.sequences[0, len(prompt_ids) :].cpu() for out in (spec, plain))
    # half precisions: plain greedy's own tokens are judged on their prefixes too, beside the head's
    plain_verdict = check_lossless(
        prompt_ids, plain_tokens, plain_tokens, target.dtype, float32_logits, label="plain greedy's answer"
    )
    verdict = check_lossless(
        prompt_ids, plain_tokens, spec_tokens, target.dtype, float32_logits, label="the head's answer"
    )
    stats = spec.jetspec_stats
    if args.show_drafts:
        from .drafts import counts, legend, render, row_sources

        sources = row_sources(stats, spec_tokens.tolist())
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print(render(tokenizer, spec_tokens.tolist(), sources, colour))
        print()
        print(f"{legend(colour)}: {counts(sources)}")
    else:
        print(tokenizer.decode(spec_tokens, skip_special_tokens=True))
    print()
    budget = _budget_of(stats, args.budget or head.config.tree_budget)
    if stats.operating_point is not None:
        print(f"operating point: {_operating_point_note(stats.operating_point)}")
    plain_tps, spec_tps = len(plain_tokens) / plain_seconds, len(spec_tokens) / spec_seconds
    print(f"plain greedy:   {plain_tps:8.1f} tok/s ({len(plain_tokens)} tokens in {plain_seconds:.2f} s)")
    print(
        f"jetspec (B={budget}): {spec_tps:8.1f} tok/s ({len(spec_tokens)} tokens in {spec_seconds:.2f} s), "
        f"speedup {spec_tps / plain_tps:.2f}x, tau {stats.tau:.2f} ({stats.target_forwards} target forwards); "
        + _equality_note(verdict)
    )
    if verdict.judged is not None:
        print(
            f"every token judged against the float32 target: {_judged_note(verdict.judged)} (jetspec), "
            f"{_judged_note(plain_verdict.judged)} (plain greedy)"
        )
    return 0


def _budget_of(stats, asked):
    """The tree budget a call ran: its first round's, else (no round) the operating point's, else `asked`."""
    if stats.budgets:
        return stats.budgets[0]
    point = stats.operating_point
    if isinstance(point, dict) and point.get("budget") is not None:
        return point["budget"]  # "auto": the chosen one, even when the answer needed no round
    return asked


def _operating_point_note(point: dict) -> str:
    """One line for `JetSpecStats.operating_point`: the chosen budget and sources and the figures behind them."""
    if point["expected_speedup"] is None:
        return f"budget {point['budget']}, sources {point['sources']} ({point['reason']})"
    figures = point["figures"][f"{point['sources']}@{point['budget']}"]
    runner_up = sorted((f["expected_speedup"], name) for name, f in point["figures"].items())[-2:]
    other = f"; next best {runner_up[0][1]} at {runner_up[0][0]:.2f}x" if len(runner_up) == 2 else ""
    return (
        f"budget {point['budget']}, sources {point['sources']}: expected {point['expected_speedup']:.2f}x = tau "
        f"{figures['tau']:.2f} / (t(B)/t(1) {figures['verify_ratio']:.2f} + overhead {figures['overhead']:.2f})"
        f"{other}"
    )


def _costs(args) -> int:
    """`jetspec costs [--clear]`: the cached host costs behind `tree_budget="auto"`, or clear them."""
    from modeling_jetspec.host_costs import clear_costs, costs_path, read_costs

    path = costs_path()
    if args.clear:
        print(f"cleared {clear_costs(path)} cached host cost entries from {path}")
        return 0
    entries = read_costs(path)
    if not entries:
        print(
            f"no host costs cached in {path} (measured by the first tree_budget='auto' call of a head with "
            "tau_by_budget)"
        )
        return 0
    print(f"host costs in {path}, in plain decode steps t(1):")
    for key, entry in entries.items():
        print(key)
        print(f"  t(1) {entry['step_seconds'] * 1e3:.3f} ms")
        ratios = ", ".join(f"{b}: {r:.2f}" for b, r in sorted(entry["verify_ratio"].items(), key=lambda x: int(x[0])))
        print(f"  t(B)/t(1): {ratios}")
        for name, overhead in sorted(entry["overhead"].items()):
            head, sources = name.split(" ", 1)
            print(f"  overhead c, head {head}, {sources}: {overhead:.2f}")
    return 0


def _equality_note(verdict) -> str:
    if verdict.kind == "exact":
        return "same tokens as plain greedy"
    return f"left plain greedy at new token {verdict.position} at a numerical tie (float32 logit gap {verdict.gap:.3f})"


def _judged_note(judged) -> str:
    return f"{judged.tokens} tokens, {judged.near_ties} near-ties, {judged.violations} violations"


def _convert(args, parser) -> int:
    """`jetspec convert`: load SRC in whatever layout its config names, write DST in `--to`'s."""
    from modeling_jetspec import JetSpecDraftModel
    from modeling_jetspec.checkpoint_formats import detect_checkpoint_format, read_checkpoint_config

    try:
        config = read_checkpoint_config(args.src, {})
        if config is None:
            raise ValueError(f"expected a head folder or Hub id with a config.json, got {args.src!r}")
        layout = args.to or ("dflash" if detect_checkpoint_format(config) == "jetspec" else "jetspec")
        head = JetSpecDraftModel.from_pretrained(args.src)
        if args.mask_token_id is not None and layout != "dflash":
            raise ValueError(f"expected --mask-token-id only with --to dflash, got --to {layout}")
        extra = {} if args.mask_token_id is None else {"mask_token_id": args.mask_token_id}
        head.save_pretrained(args.dst, checkpoint_format=layout, **extra)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    print(f"wrote {args.dst} ({layout} layout) from {args.src}")
    return 0
