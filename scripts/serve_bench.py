"""Aggregate tokens/s and time to first token through `jetspec serve`, with requests joining a running call
(`--join on`) and without (`--join off`: the batch of what waits when a call starts), and through `transformers
serve`, on its `generate` path and with its continuous batching: the same model in the same dtype, all driven through
the `openai` client.

    python -m scripts.serve_bench --suite gsm8k,humaneval,mtbench --limit 8 --max-new-tokens 128 --clients 1,4,8 \\
        --loads lockstep,steady --jetspec-join on,off --dtype auto --out results/serve-bench

The script starts the servers on free loopback ports (`--threads` torch threads each, through OMP_NUM_THREADS): one
`jetspec serve` per value of `--jetspec-join` (named `jetspec serve` for on, `jetspec serve --join off` for off),
`transformers serve`, and `transformers serve --continuous-batching` (on a CPU with a paged cache of
`--cb-num-blocks` blocks of `--cb-block-size` tokens, its memory cap there); `--max-batch N` gives both `jetspec serve`
modes the same batch cap (else each measures its own at start-up). It uses running ones instead where given
(`--jetspec-url`: that one `jetspec serve` only, whatever `--jetspec-join`; `--transformers-url`,
`--transformers-cb-url`, `--transformers-model`); `--no-continuous-batching` leaves that one out. All stay up
together, and the servers take turns: with k clients,

- lock-step: each group of k prompts is sent at once, and the next group when all k have answered; each group goes
  to every server in turn, which one first rotating, so that all see the same host load;
- steady: k clients each send their next prompt as soon as their last answer ends, until the prompts run out; each
  server runs the whole list in turn, which one first rotating with k.

Every request is a streamed chat completion, greedy (temperature 0): time to first token is the wait for the first
chunk with text, tokens are what the last chunk's usage counts, and a server's aggregate tokens/s is its tokens over
the wall time of its requests (a group's, or a steady run's, from the first send to the last answer). The ratio is
against the better of the two transformers paths at the same load and clients, on every server's row (each
`jetspec serve` mode has its own). With `--in-process`, the bench also loads the target and head itself and, at 1
client, decodes each prompt in its own process, plain `generate()` and with the head, taking turns with the servers
(its time to first token: the first new token's arrival in `generate`'s streamer): the head's ratio in process and
`jetspec serve`'s share of it come from the same run, on the same host load. The texts are compared per prompt: in
float32 they must be equal; in bf16 they may leave each other at a numerical tie. Writes `results.json` (every
request) and `results.md` (the table), and prints the table. Run nothing else meanwhile.
"""

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JETSPEC, TRANSFORMERS = "jetspec serve", "transformers serve"  # JETSPEC: jetspec serve with --join on, its default
JOINS = ("on", "off")  # jetspec serve --join: requests join a running call, or only a call's start
TRANSFORMERS_CB = "transformers serve --continuous-batching"
PEERS = (TRANSFORMERS, TRANSFORMERS_CB)  # the paths every row's ratio is taken against (the better of them)
IN_PROCESS, IN_PROCESS_HEAD = "in process: generate()", "in process: generate(assistant_model=head)"
LOADS = ("lockstep", "steady")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="target alias, folder or Hub id (as jetspec serve)")
    parser.add_argument("--head", default=None, help="head folder (default: the committed head of --model)")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16, resolved once for both servers")
    parser.add_argument("--suite", default="gsm8k,humaneval,mtbench", help="comma-separated prompt suites")
    parser.add_argument("--limit", type=int, default=10, help="first N prompts of each suite")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="max_tokens of every request")
    parser.add_argument("--clients", default="1,4,8", help="comma-separated numbers of concurrent clients")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="jetspec serve's --max-batch (default: its cap measured at start-up)",
    )
    parser.add_argument("--loads", default="lockstep,steady", help="comma-separated loads among lockstep, steady")
    parser.add_argument("--cb-block-size", type=int, default=32, help="continuous batching: tokens per cache block")
    parser.add_argument(
        "--cb-num-blocks", type=int, default=256, help="continuous batching: cache blocks (its memory cap on a CPU)"
    )
    parser.add_argument(
        "--no-continuous-batching", action="store_true", help="leave out transformers serve --continuous-batching"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each server (default: torch's)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="at 1 client, also decode each prompt in this process (plain generate() and with the head), taking "
        "turns with the servers: the server's share of the in-process ratio, measured in the same run",
    )
    parser.add_argument("--out", default="results/serve-bench", help="output folder")
    parser.add_argument(
        "--jetspec-join",
        default="on,off",
        help="comma-separated jetspec serve --join values, each its own server (default on,off: both, to compare)",
    )
    parser.add_argument(
        "--jetspec-url", default=None, help="a running jetspec serve, the only one then (its served name: --model)"
    )
    parser.add_argument("--transformers-url", default=None, help="a running transformers serve")
    parser.add_argument(
        "--transformers-cb-url", default=None, help="a running transformers serve --continuous-batching"
    )
    parser.add_argument(
        "--transformers-model", default=None, help="the model name the running transformers serve takes"
    )
    return parser.parse_args(argv)


class FirstToken:
    """A streamer that notes when `generate` hands it its first new token (its first `put` is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self):
        pass


class InProcess:
    """`ask(prompt, max_tokens)`: one greedy chat answer from `target.generate` in this process (with `head` as its
    assistant, or plain), recorded as [`timed_request`] records a server's: time to first token (the first new
    token's `put`), seconds, tokens, text and, with a head, the tree's statistics (`jetspec serve`'s own fields).
    With `thread` (the `jetspec.serve.inference_thread` that loaded the target), every call runs on it, as
    `jetspec serve` runs its own: from a client's thread of the bench, the process would hold a second OpenMP team
    of torch's kernels, which slows them on a host with as many cores as threads."""

    def __init__(self, target, tokenizer, head=None, thread=None):
        self.target, self.tokenizer, self.head, self.thread = target, tokenizer, head, thread

    def __call__(self, prompt: str, max_tokens: int) -> dict:
        if self.thread is not None:
            return self.thread.submit(self.decode, prompt, max_tokens).result()
        return self.decode(prompt, max_tokens)

    def decode(self, prompt: str, max_tokens: int) -> dict:
        import torch

        from jetspec.serve_requests import tree_report
        from jetspec.targets import encode_chat

        enc = encode_chat(self.tokenizer, prompt).to(self.target.device)
        assistant = {} if self.head is None else {"assistant_model": self.head}
        first = FirstToken()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(
                **enc,
                max_new_tokens=max_tokens,
                do_sample=False,
                streamer=first,
                return_dict_in_generate=True,
                **assistant,
            )
        seconds = time.perf_counter() - started
        new = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
        report = None if self.head is None else tree_report(out.jetspec_stats, new, seconds)
        return {
            "ttft": None if first.at is None else first.at - started,
            "seconds": seconds,
            "tokens": len(new),
            "text": self.tokenizer.decode(new, skip_special_tokens=True),
            "jetspec": report,
        }


def in_process_decoders(args, dtype) -> dict:
    """`{name: InProcess}`: the target and head this bench's `jetspec serve` loads, plain and with the head, loaded
    and decoding on one thread of their own, as the server's are."""
    from jetspec.cli import load_head, resolve_head_path
    from jetspec.serve import inference_thread
    from jetspec.targets import load_target

    def load() -> tuple:
        target, tokenizer = load_target(args.model, dtype=dtype)
        return target, tokenizer, load_head(resolve_head_path(args.head, args.model), target)

    thread = inference_thread()
    target, tokenizer, head = thread.submit(load).result()
    return {
        IN_PROCESS: InProcess(target, tokenizer, thread=thread),
        IN_PROCESS_HEAD: InProcess(target, tokenizer, head, thread),
    }


def jetspec_name(join: str) -> str:
    """The results' name of the `jetspec serve` started with `--join join`."""
    return JETSPEC if join == "on" else f"{JETSPEC} --join {join}"


def joins_of(text: str) -> list:
    """The `--jetspec-join` values, in order; a `ValueError` for an empty list, a repeat or a value not on/off."""
    joins = [join for join in text.split(",") if join]
    if not joins or len(set(joins)) < len(joins) or any(join not in JOINS for join in joins):
        raise ValueError(f"expected --jetspec-join to be on, off or on,off, got {text!r}")
    return joins


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(command: list, log: Path, threads, seconds: float = 600) -> tuple:
    """`(process, url)`: a server started on a free loopback port, once its /health answers."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    with open(log, "w") as err:
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)], cwd=REPO, env=env, stdout=err, stderr=err
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"expected {command[:4]} to start, it exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"expected {command[:4]} to answer at {url} within {seconds} s; see {log}")


def timed_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion: time to first token, seconds, tokens, text (and the tree's statistics)."""
    started = time.perf_counter()
    first, parts, usage, report = None, [], None, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            first = first if first is not None else time.perf_counter() - started
            parts.append(text)
        usage = chunk.usage or usage
        report = (chunk.model_extra or {}).get("jetspec", report)
    seconds = time.perf_counter() - started
    tokens = usage.completion_tokens if usage is not None else None
    return {"ttft": first, "seconds": seconds, "tokens": tokens, "text": "".join(parts), "jetspec": report}


def run_group(ask, prompts: list, max_tokens: int) -> tuple[list, float]:
    """The prompts sent at once through `ask(prompt, max_tokens)`, one client each: their records and the group's
    wall time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        records = list(pool.map(lambda p: ask(p["prompt"], max_tokens), prompts))
    return records, time.perf_counter() - started


def run_steady(ask, prompts: list, max_tokens: int, clients: int) -> tuple[list, float]:
    """`clients` clients, each sending (through `ask(prompt, max_tokens)`) its next prompt as soon as its last answer
    ends: the records (in prompt order) and the wall time from the first send to the last answer."""
    records, lock, queue = [None] * len(prompts), threading.Lock(), iter(range(len(prompts)))

    def one_client():
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            records[index] = ask(prompts[index]["prompt"], max_tokens)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for done in [pool.submit(one_client) for _ in range(clients)]:
            done.result()
    return records, time.perf_counter() - started


def run_bench(
    servers: dict,
    prompts: list,
    max_tokens: int,
    clients: list,
    warmup: bool = True,
    loads=("lockstep",),
    in_process: dict = None,
) -> dict:
    """`servers`: `{name: (url, model name)}`; `prompts`: `{"suite", "id", "prompt"}` records; `in_process`:
    `{name: ask(prompt, max_tokens) -> record}`, decoders in this process, which take part at 1 client only (one
    model, one call at a time). Every load and number of clients runs on every server, taking turns; returns the
    records and the wall time per server."""
    import openai

    made = {
        name: functools.partial(timed_request, openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600), model)
        for name, (url, model) in servers.items()
    }
    made.update(in_process or {})
    if warmup:
        for ask in made.values():
            ask(prompts[0]["prompt"], 8)
    runs = []
    for load in loads:
        if load not in LOADS:
            raise ValueError(f"expected loads among {', '.join(LOADS)}, got {load!r}")
        for turn, k in enumerate(clients):
            taking = {name: ask for name, ask in made.items() if k == 1 or name not in (in_process or {})}
            walls, records = {name: 0.0 for name in taking}, {name: [] for name in taking}
            if load == "lockstep":
                groups = [prompts[i : i + k] for i in range(0, len(prompts), k)]
                batches = [(group, turn + index) for index, group in enumerate(groups)]
            else:
                batches = [(prompts, turn)]
            for group, rotation in batches:
                names = list(taking)
                for name in names[rotation % len(names) :] + names[: rotation % len(names)]:
                    if load == "lockstep":
                        got, wall = run_group(taking[name], group, max_tokens)
                    else:
                        got, wall = run_steady(taking[name], group, max_tokens, k)
                    walls[name] += wall
                    records[name] += [{**record, "suite": p["suite"], "id": p["id"]} for record, p in zip(got, group)]
            runs.append({"load": load, "clients": k, "wall_seconds": walls, "requests": records})
    return {"runs": runs}


def percentile(values: list, share: float):
    """The nearest-rank percentile of `values` (`None` when empty)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, -(-round(share * 100) * len(ordered) // 100) - 1))]


def same_texts(run: dict) -> int:
    """Prompts whose answer every server of the run gave as the same text."""
    answers = {}
    for records in run["requests"].values():
        for record in records:
            answers.setdefault((record["suite"], record["id"]), []).append(record["text"])
    return sum(len(set(texts)) == 1 for texts in answers.values())


def summary_rows(results: dict) -> list[dict]:
    """One row per (load, clients, server): aggregate tokens/s, its ratio to the better transformers path, time to
    first token (p50, p95), tau, and the prompts all servers answered alike."""
    rows = []
    for run in results["runs"]:
        names = list(run["requests"])
        speed = {
            name: sum(r["tokens"] or 0 for r in run["requests"][name]) / run["wall_seconds"][name] for name in names
        }
        best = max((speed[name] for name in names if name in PEERS), default=None)
        same = same_texts(run)
        for name in names:
            ttfts = [r["ttft"] for r in run["requests"][name] if r["ttft"] is not None]
            taus = [r["jetspec"]["tau"] for r in run["requests"][name] if r["jetspec"]]
            rows.append(
                {
                    "load": run.get("load", "lockstep"),
                    "server": name,
                    "clients": run["clients"],
                    "requests": len(run["requests"][name]),
                    "tokens_per_second": speed[name],
                    "ratio": speed[name] / best if best else None,
                    "ttft_p50": percentile(ttfts, 0.5),
                    "ttft_p95": percentile(ttfts, 0.95),
                    "tau": statistics.mean(taus) if taus else None,
                    "same_text": f"{same}/{len(run['requests'][name])}",
                }
            )
    return rows


def in_process_shares(rows: list[dict]) -> list[dict]:
    """Per load at 1 client where both in-process decoders ran: the head's ratio in process (over plain
    `generate()`), each `jetspec serve` mode's ratio (over the better transformers path), and its share of the
    former."""
    shares = []
    for load in dict.fromkeys(row["load"] for row in rows):
        run = {row["server"]: row for row in rows if row["load"] == load and row["clients"] == 1}
        if IN_PROCESS not in run or IN_PROCESS_HEAD not in run:
            continue
        ratio = run[IN_PROCESS_HEAD]["tokens_per_second"] / run[IN_PROCESS]["tokens_per_second"]
        for name, row in run.items():
            if name.startswith(JETSPEC) and row["ratio"] is not None:
                shares.append(
                    {
                        "load": load,
                        "server": name,
                        "in_process_ratio": ratio,
                        "served_ratio": row["ratio"],
                        "share": row["ratio"] / ratio,
                    }
                )
    return shares


def markdown(rows: list[dict]) -> str:
    def number(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| load | server | clients | requests | tok/s | vs the better transformers path | TTFT p50 (s) | TTFT p95 (s) "
        "| tau | same text |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['load']} | {row['server']} | {row['clients']} | {row['requests']} | "
            f"{number(row['tokens_per_second'], 1)} | {number(row['ratio'], 2)}x | {number(row['ttft_p50'], 3)} | "
            f"{number(row['ttft_p95'], 3)} | {number(row['tau'], 2)} | {row['same_text']} |"
        )
    for share in in_process_shares(rows):
        lines.append(
            f"\n{share['load']}, 1 client: {share['server']} runs {share['served_ratio']:.2f}x the better transformers "
            f"path; in this process the head runs {share['in_process_ratio']:.2f}x plain `generate()`: a share of "
            f"{share['share']:.2f}."
        )
    return "\n".join(lines)


def servers_for(args, dtype_name: str, out: Path) -> tuple[dict, list]:
    """`({name: (url, model)}, processes started)`: the given servers, else those started here."""
    from jetspec.targets import SMOLLM2_ALIAS, smollm2_folder

    started, servers = [], {}
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    joins = [] if args.jetspec_url is not None else joins_of(args.jetspec_join)  # a running one: that one only
    if args.jetspec_url is not None:
        servers[JETSPEC] = (args.jetspec_url, args.model)
    for join in joins:
        command = [sys.executable, "-m", "jetspec", "serve", "--model", args.model, "--dtype", dtype_name, *threads]
        command += [] if args.head is None else ["--head", args.head]
        command += [] if args.max_batch is None else ["--max-batch", str(args.max_batch)]
        log = out / ("jetspec-serve.log" if join == "on" else f"jetspec-serve-join-{join}.log")
        process, url = start([*command, "--join", join], log, args.threads)
        started.append(process)
        servers[jetspec_name(join)] = (url, args.model)
    folder = str(smollm2_folder()) if args.model == SMOLLM2_ALIAS else args.model  # it loads a folder or an id
    args.transformers_model = args.transformers_model or folder
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", folder, "--dtype", dtype_name]
    command += ["--device", "cpu"]
    if args.transformers_url is None:
        process, args.transformers_url = start(command, out / "transformers-serve.log", args.threads)
        started.append(process)
    servers[TRANSFORMERS] = (args.transformers_url, args.transformers_model)
    if args.no_continuous_batching:
        return servers, started
    if args.transformers_cb_url is None:
        paged = ["--continuous-batching", "--cb-block-size", str(args.cb_block_size)]
        paged += ["--cb-num-blocks", str(args.cb_num_blocks)]
        process, args.transformers_cb_url = start([*command, *paged], out / "transformers-serve-cb.log", args.threads)
        started.append(process)
    servers[TRANSFORMERS_CB] = (args.transformers_cb_url, args.transformers_model)
    return servers, started


def main(argv=None) -> int:
    args = parse_args(argv)
    from jetspec.host import host_kind
    from jetspec.prompts import check_suites, load_prompts
    from jetspec.targets import resolve_dtype

    dtype, reason = resolve_dtype(args.dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    clients = [int(k) for k in args.clients.split(",")]
    loads = [load for load in args.loads.split(",") if load]
    if not loads or any(load not in LOADS for load in loads):
        raise SystemExit(f"expected --loads among {', '.join(LOADS)}, got {args.loads!r}")
    try:
        joins_of(args.jetspec_join)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    prompts = [
        {"suite": suite, "id": record["id"], "prompt": record["prompt"]}
        for suite in check_suites(args.suite.split(","))
        for record in load_prompts(suite, args.limit)
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    in_process = in_process_decoders(args, dtype) if args.in_process else None
    servers, started = servers_for(args, dtype_name, out)
    try:
        results = run_bench(servers, prompts, args.max_new_tokens, clients, loads=loads, in_process=in_process)
    finally:
        for process in started:
            process.terminate()
            process.wait(timeout=60)
    rows = summary_rows(results)
    config = {"command": " ".join(["python -m scripts.serve_bench", *sys.argv[1:]]), "dtype": dtype_name}
    config.update({"dtype_reason": reason, "host_kind": host_kind().name, "model": args.model, "clients": clients})
    config.update({"loads": loads, "servers": list(servers), "max_batch": args.max_batch})
    config["in_process"] = list(in_process or {})
    config["jetspec_join"] = None if args.jetspec_url is not None else joins_of(args.jetspec_join)
    shares = in_process_shares(rows)
    (out / "results.json").write_text(
        json.dumps({"config": config, "rows": rows, "shares": shares, **results}, indent=1)
    )
    table = markdown(rows)
    (out / "results.md").write_text(
        f"`{config['command']}` ({dtype_name}, host kind {config['host_kind']})\n\n{table}\n"
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
