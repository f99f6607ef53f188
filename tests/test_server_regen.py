"""Regeneration through an OpenAI-compatible completions server (training/completions.py, training/answers.py).

a) A loopback server in front of the tiny random target, speaking the two dialects the client meets: vLLM's (token-id
   prompts, `return_token_ids`) and llama-cpp-python's (text prompts, text answers, `/extras/tokenize`). Its rows
   must be the in-process rows, token for token: the server decodes greedily with the same fp32 model.
b) The real llama-cpp-python server on the SmolLM2 GGUF (marked `llama_server`; skipped, by name, where the package is
   not installed), started and stopped by the test on a free loopback port.
c) The real `transformers serve` (the extras `transformers[serving]`, installed by .ci/run), on the tiny target saved to
   a folder and on SmolLM2 written out by the project (marked `real_model`): it takes the OpenAI API's fields only and
   answers text, so prompts go as text (`text_openai`, checked by the prompt tokens it reports) and answers are
   retokenized; its rows must be the in-process rows of the same float32 model, token for token. Its `/v1/models`
   answers 500 offline: the client says to name the model.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from test_regenerate import RUN, tiny_model, tiny_tokenizer, write_prompts
from test_serve import Server
from training.answers import read_prompts, regenerate
from training.completions import CompletionsServer
from training.rows import load_regenerated


class TinyServer:
    """`/v1/models`, `/v1/completions` and `/extras/tokenize` over a model, greedy, one request at a time.

    `dialect="vllm"` takes token-id prompts and returns the answer's `token_ids` (EOS included, as vLLM does);
    `dialect="llama_cpp"` takes text prompts only (refusing ids with 422, as llama-cpp-python's server does) and
    returns text. `bos` is prepended to what the server tokenizes (a server that adds a BOS of its own)."""

    def __init__(self, model, tokenizer, dialect: str, bos=None):
        self.model, self.tokenizer, self.dialect, self.bos = model, tokenizer, dialect, bos
        self.lock = threading.Lock()
        self.requests = 0
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()

    def tokens(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ([self.bos] if self.bos is not None else []) + ids

    def answer(self, body: dict) -> tuple[int, dict]:
        prompt = body["prompt"]
        if self.dialect == "llama_cpp" and not isinstance(prompt, str):
            return 422, {"detail": "prompt: Input should be a valid string"}
        ids = self.tokens(prompt) if isinstance(prompt, str) else prompt
        with self.lock, torch.no_grad():
            self.requests += 1
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=body["max_tokens"], do_sample=False, pad_token_id=1
            )[0, len(ids) :].tolist()
        eos = self.model.generation_config.eos_token_id
        answer = out[: out.index(eos) + 1] if eos in out else out
        stopped = bool(answer) and answer[-1] == eos
        choice = {
            "text": self.tokenizer.decode(answer, skip_special_tokens=True),
            "finish_reason": "stop" if stopped else "length",
        }
        if self.dialect == "vllm" and body.get("return_token_ids"):
            choice["token_ids"] = answer
        return 200, {"choices": [choice]}

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self.reply(200, {"data": [{"id": "tiny"}]})
                self.reply(404, {"detail": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/completions":
                    return self.reply(*server.answer(body))
                if self.path == "/extras/tokenize" and server.dialect == "llama_cpp":
                    return self.reply(200, {"tokens": server.tokens(body["input"])})
                self.reply(404, {"detail": "not found"})

        return Handler


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def prompts(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 11)
    return read_prompts(tmp_path / "prompts.jsonl")


SERVER_RUN = {key: value for key, value in RUN.items() if key != "batch_size"}


def settings_of(folder) -> dict:
    return json.loads((folder / "progress.json").read_text())["settings"]


@pytest.mark.parametrize(
    "dialect, prompt_format, answer_ids",
    [
        ("vllm", "token_ids", "server"),  # a) ids both ways
        ("llama_cpp", "text", "retokenized"),  # b) text both ways: the word-level tokenizer retokenizes exactly
    ],
)
def test_server_rows_are_the_in_process_rows(model, tokenizer, prompts, tmp_path, dialect, prompt_format, answer_ids):
    regenerate(model, tokenizer, prompts, tmp_path / "local", **RUN)
    with TinyServer(model, tokenizer, dialect) as server:
        client = CompletionsServer(server.url, concurrency=3, prompt_format=prompt_format)
        stats = regenerate(None, tokenizer, prompts, tmp_path / "server", server=client, **SERVER_RUN)
        assert server.requests == 11 + 1  # each prompt once, and the one-token probe
        # a rerun resumes: nothing left but the probe
        assert regenerate(None, tokenizer, prompts, tmp_path / "server", server=client, **SERVER_RUN)["new_rows"] == 0
    local, served = load_regenerated(tmp_path / "local"), load_regenerated(tmp_path / "server")
    assert stats["new_rows"] == 11 and served.to_list() == local.to_list()
    settings = settings_of(tmp_path / "server")
    assert (settings["dtype"], settings["server_model"], settings["answer_ids"]) == ("server", "tiny", answer_ids)
    assert settings["prompt_format"] == prompt_format and settings["concurrency"] == 3


def test_server_rows_split_over_two_processes_are_the_one_process_rows(model, tokenizer, prompts, tmp_path):
    with TinyServer(model, tokenizer, "vllm") as server:
        client = CompletionsServer(server.url, concurrency=2)
        regenerate(None, tokenizer, prompts, tmp_path / "one", server=client, **SERVER_RUN)
        for index in (0, 1):
            regenerate(
                None, tokenizer, prompts, tmp_path / "two", server=client, num_shards=2, shard_index=index, **SERVER_RUN
            )
    by_id = {row["id"]: row for row in load_regenerated(tmp_path / "one")}
    assert {row["id"]: row for row in load_regenerated(tmp_path / "two")} == by_id and len(by_id) == 11


def test_a_text_prompt_the_server_reads_otherwise_is_refused(model, tokenizer, prompts, tmp_path):
    with TinyServer(model, tokenizer, "llama_cpp", bos=0) as server:  # its tokenizer prepends <unk>
        client = CompletionsServer(server.url, prompt_format="text")
        with pytest.raises(
            RuntimeError,
            match=r"to tokenize the prompt to our \d+ ids, got \d+ ids, first different "
            r"at 0: \[0, 3, ",
        ):
            regenerate(None, tokenizer, prompts, tmp_path / "out", server=client, **SERVER_RUN)
        # token ids to a server that takes text only: its 422 is shown
        with pytest.raises(RuntimeError, match="got HTTP 422: .*valid string"):
            regenerate(None, tokenizer, prompts, tmp_path / "ids", server=CompletionsServer(server.url), **SERVER_RUN)


def test_bad_server_runs_raise(model, tokenizer, prompts, tmp_path):
    with TinyServer(model, tokenizer, "vllm") as server:
        client = CompletionsServer(server.url)
        for kwargs, match in [
            ({"model": model}, "expected either a model or a server to answer with, got both"),
            ({"sample_temperature": 1.0}, r"expected greedy decoding .* got \['sample_temperature'\]"),
            ({"continuous": True}, r"got \['continuous'\]"),
        ]:
            with pytest.raises(ValueError, match=match):
                regenerate(
                    kwargs.pop("model", None),
                    tokenizer,
                    prompts,
                    tmp_path / "out",
                    server=client,
                    **SERVER_RUN,
                    **kwargs,
                )
        # rows of a server and of the model in this process never share a folder (their dtypes differ)
        regenerate(None, tokenizer, prompts[:2], tmp_path / "mixed", server=client, **SERVER_RUN)
        with pytest.raises(ValueError, match="expected the settings of the run being resumed"):
            regenerate(model, tokenizer, prompts, tmp_path / "mixed", **RUN)
    for url, match in [
        ("127.0.0.1:8000", "expected a server address such as"),
        ("http://127.0.0.1:1", "expected a completions server at http://127.0.0.1:1/v1, got no answer"),
    ]:
        with pytest.raises((ValueError, RuntimeError), match=match):
            CompletionsServer(url)
    with pytest.raises(ValueError, match="expected concurrency to be a positive int"):
        CompletionsServer("http://127.0.0.1:1", concurrency=0)


# ------------------------------------------------------------------------------------- the real llama.cpp server
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, log: Path, seconds: float) -> None:
    """Until the server answers `/v1/models`; its log (a file: a pipe nobody reads fills with llama.cpp's loading
    messages and blocks the server before it listens) is shown when it exits or never answers."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"expected the llama.cpp server to start, it exited with {process.returncode}:\n"
                f"{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(
        f"expected the llama.cpp server to answer at {url} within {seconds} s; its log ends:\n"
        f"{log.read_text(errors='replace')[-3000:]}"
    )


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on the SmolLM2 Q4_1 GGUF, on a free loopback port, one thread."""
    pytest.importorskip(
        "llama_cpp.server",
        reason="needs llama-cpp-python[server] (pip install 'llama-cpp-python[server]'; not yet installed by .ci/run)",
    )
    from jetspec.targets import SMOLLM2_GGUF_FILE, smollm2_gguf_folder

    gguf = smollm2_gguf_folder() / SMOLLM2_GGUF_FILE
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        "1",
        "--n_ctx",
        "2048",
        "--model_alias",
        "smollm2-135m",
    ]
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(url, process, log, seconds=120)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.llama_server
@pytest.mark.real_model
def test_llama_cpp_server_regenerates_greedy_rows_of_the_real_target(llama_server, tmp_path):
    """The real server answers the chat-formatted prompts greedily: the prompt ids it read are ours (checked by its
    tokenizer), the answers are retokenized (it returns text) and stop at EOS or max_new_tokens; the rows resume like
    in-process rows, and its greedy answers mostly agree with the de-quantized fp32 target's own (Q4_1 kernels
    against fp32 weights: a near tie may break the other way, and the answer diverges from there)."""
    from jetspec.targets import apply_chat_template, load_target

    model, tokenizer = load_target("smollm2-135m")
    prompts = [
        {"id": f"q{i}", "prompt": text}
        for i, text in enumerate(
            ["What is 2 + 3?", "Name the capital of France.", "Say hello in Spanish.", "List three colours."]
        )
    ]
    client = CompletionsServer(llama_server, concurrency=2, prompt_format="text")
    stats = regenerate(
        None,
        tokenizer,
        prompts,
        tmp_path / "server",
        server=client,
        max_new_tokens=16,
        shard_size=2,
        target="smollm2-135m",
        progress=False,
    )
    rows = load_regenerated(tmp_path / "server")
    assert stats["new_rows"] == 4 and rows["id"] == ["q0", "q1", "q2", "q3"]
    assert settings_of(tmp_path / "server")["answer_ids"] == "retokenized"
    same = 0
    for prompt, row in zip(prompts, rows):
        prompt_ids = tokenizer(apply_chat_template(tokenizer, prompt["prompt"]), add_special_tokens=False)["input_ids"]
        answer = row["input_ids"][row["prompt_length"] :]
        assert row["input_ids"][: row["prompt_length"]] == prompt_ids
        assert 1 <= len(answer) <= 16 and (answer[-1] == tokenizer.eos_token_id or len(answer) == 16)
        local = model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)[0, len(prompt_ids) :]
        same += local.tolist()[: len(answer)] == answer
    print(f"llama.cpp server: {same} of 4 greedy answers equal the float32 target's, token for token")
    assert "5" in rows[0]["answer"]
    assert same >= 2, f"expected most greedy answers of the Q4_1 server to equal the fp32 target's, got {same} of 4"
    assert (
        regenerate(
            None,
            tokenizer,
            prompts,
            tmp_path / "server",
            server=client,
            max_new_tokens=16,
            shard_size=2,
            target="smollm2-135m",
            progress=False,
        )["new_rows"]
        == 0
    )


# ------------------------------------------------------------------------------------- the real transformers serve
def transformers_serve(folder, log) -> Server:
    """`transformers serve` on a model folder, float32 on the CPU, offline (the folder is its model's name)."""
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder), "--dtype", "float32"]
    return Server([*command, "--device", "cpu"], log, str(folder))


def assert_same_rows(served, local, tokenizer, replaced_characters: bool = False) -> int:
    """The served rows hold the in-process rows' text; their ids are the same, token for token, except (with
    `replaced_characters`) in a row whose text holds U+FFFD: an answer that max_new_tokens cut inside a character
    written as several byte-level tokens decodes to the replacement character, and no retokenizing gets the bytes
    back. Returns how many rows are the same token for token; a difference names the row and where its ids part."""
    assert served["id"] == local["id"]
    same = 0
    for ours, theirs in zip(local, served):
        assert (theirs["answer"], theirs["prompt_length"]) == (ours["answer"], ours["prompt_length"])
        a, b = ours["input_ids"], theirs["input_ids"]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        explained = replaced_characters and "\ufffd" in ours["answer"]
        assert a == b or explained, (
            f"row {ours['id']}: the served row leaves the in-process one at token {at} of {len(a)}/{len(b)}: "
            f"{tokenizer.convert_ids_to_tokens(a[at : at + 4])} vs {tokenizer.convert_ids_to_tokens(b[at : at + 4])}"
        )
        same += a == b
    return same


def test_transformers_serve_rows_are_the_in_process_rows(model, tokenizer, prompts, tmp_path):
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    regenerate(model, tokenizer, prompts, tmp_path / "local", **RUN)
    served = transformers_serve(tmp_path / "model", tmp_path / "serve.log").wait()
    try:
        with pytest.raises(
            ValueError, match=r"/v1/models to list the served model, got none: .*HTTP 500.*--server_model"
        ):
            CompletionsServer(served.url, max_attempts=1)
        client = CompletionsServer(served.url, model=served.name, concurrency=3, prompt_format="text_openai")
        stats = regenerate(None, tokenizer, prompts, tmp_path / "server", server=client, **SERVER_RUN)
    finally:
        served.stop()
    assert stats["new_rows"] == 11
    assert (
        assert_same_rows(load_regenerated(tmp_path / "server"), load_regenerated(tmp_path / "local"), tokenizer) == 11
    )
    settings = settings_of(tmp_path / "server")
    assert (settings["prompt_format"], settings["answer_ids"]) == ("text_openai", "retokenized")


class CountingServer(TinyServer):
    """The llama.cpp dialect, reporting how many prompt tokens it read (`usage.prompt_tokens`), as transformers' does."""

    def answer(self, body: dict) -> tuple[int, dict]:
        status, payload = super().answer(body)
        payload["usage"] = {"prompt_tokens": len(self.tokens(body["prompt"]))}
        return status, payload


def test_a_text_openai_prompt_read_as_other_tokens_is_refused(model, tokenizer, prompts, tmp_path):
    with CountingServer(model, tokenizer, "llama_cpp", bos=0) as server:  # it reads one token more than we sent
        client = CompletionsServer(server.url, prompt_format="text_openai")
        with pytest.raises(RuntimeError, match=r"to read the prompt as our (\d+) tokens \(usage.prompt_tokens\), got"):
            regenerate(None, tokenizer, prompts, tmp_path / "out", server=client, **SERVER_RUN)
    with CountingServer(model, tokenizer, "llama_cpp") as server:  # the same server reading our tokens: accepted
        client = CompletionsServer(server.url, prompt_format="text_openai")
        assert regenerate(None, tokenizer, prompts, tmp_path / "ok", server=client, **SERVER_RUN)["new_rows"] == 11


@pytest.mark.real_model
def test_transformers_serve_regenerates_the_in_process_rows_of_the_real_target(tmp_path):
    """SmolLM2 written out by the project (`jetspec.targets.smollm2_folder`, the GGUF de-quantized and saved with
    `save_pretrained`, here into a fresh folder) served by `transformers serve` in float32: greedy rows through it are
    the in-process rows of the same folder in float32 (batch 1, so that no padding enters either side)."""
    from jetspec.targets import load_target, smollm2_folder

    folder = smollm2_folder(tmp_path / "cache")
    model, tokenizer = load_target(str(folder), dtype=torch.float32)
    prompts = [
        {"id": f"q{i}", "prompt": text}
        for i, text in enumerate(
            ["What is 2 + 3?", "Name the capital of France.", "Say hello in Spanish.", "Write a haiku about rain."]
        )
    ]
    run = {"max_new_tokens": 24, "shard_size": 2, "target": "smollm2-135m", "progress": False}
    regenerate(model, tokenizer, prompts, tmp_path / "local", batch_size=1, **run)
    served = transformers_serve(folder, tmp_path / "serve.log").wait()
    try:
        client = CompletionsServer(served.url, model=str(folder), concurrency=2, prompt_format="text_openai")
        stats = regenerate(None, tokenizer, prompts, tmp_path / "server", server=client, **run)
    finally:
        served.stop()
    assert stats["new_rows"] == 4
    served, local = load_regenerated(tmp_path / "server"), load_regenerated(tmp_path / "local")
    # q2's answer ends at max_new_tokens inside an emoji (byte-level tokens 'ðŁ', 'Į' of its four bytes): its text
    # holds U+FFFD where they were, which retokenizes to other ids; every other row is the same, token for token
    assert assert_same_rows(served, local, tokenizer, replaced_characters=True) >= 3
