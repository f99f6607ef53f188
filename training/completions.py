"""Answers from an OpenAI-compatible completions server: vLLM, SGLang, llama.cpp's server, TGI.

Data regeneration (`training/answers.py`) can have a serving engine write the target's answers instead of
`model.generate` in this process. Each prompt goes to `POST {url}/v1/completions` as token ids (the `prompt` field
takes a list of ints), already formatted by our tokenizer's chat template, so the server sees exactly the prompt
tokens training reads; decoding is greedy (temperature 0, no repetition penalty). A server that returns the answer's
token ids (vLLM's `return_token_ids`) gives them as they were decoded; from any other the answer comes back as text,
which the caller retokenizes (and records that it did).

A server that takes text prompts only (llama-cpp-python's, whose `prompt` is a string) is sent the formatted text
instead (`prompt_format="text"`), and each prompt is first tokenized by the server (its `/extras/tokenize`): a
prompt the server would read as other tokens than ours is refused, so a row's prompt ids are still what the server
read.

Requests run concurrently on a thread pool (the server batches them); only the standard library's `urllib` is used.
"""

import itertools
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

COMPLETIONS_PATH = "/completions"
MODELS_PATH = "/models"
TOKENIZE_PATH = "/extras/tokenize"  # llama-cpp-python's, at the root (not under /v1)
PROMPT_FORMATS = ("token_ids", "text")
# what each engine calls "no repetition penalty": llama.cpp's servers default `repeat_penalty` to 1.1 (greedy
# decoding with it is not the target's greedy decoding), vLLM / SGLang / TGI name it `repetition_penalty`
GREEDY = {"temperature": 0.0, "top_p": 1.0, "n": 1, "repeat_penalty": 1.0, "repetition_penalty": 1.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0}


@dataclass
class Completion:
    """One answer of the server."""

    text: str
    token_ids: Optional[list[int]]  # the answer's token ids, when the server returns them; None otherwise
    finish_reason: Optional[str]  # "stop" (an end-of-generation token), "length" (max_tokens reached), ...


class CompletionsServer:
    """
    A client of one OpenAI-compatible `/v1/completions` endpoint that decodes greedily from token-id prompts.

    Args:
        url (`str`):
            The server's address, `http://host:port` or `http://host:port/v1`.
        concurrency (`int`, *optional*, defaults to 8):
            Requests in flight at once.
        model (`str`, *optional*):
            The served model's name in requests; defaults to the one model `GET /v1/models` lists.
        timeout (`float`, *optional*, defaults to 600):
            Seconds one request may take.
        prompt_format (`str`, *optional*, defaults to `"token_ids"`):
            `"token_ids"` sends each prompt as its token ids; `"text"` sends the formatted text, after checking
            that the server tokenizes it to the same ids (for servers whose `prompt` takes text only).
    """

    def __init__(self, url: str, *, concurrency: int = 8, model: Optional[str] = None, timeout: float = 600.0,
                 prompt_format: str = "token_ids"):
        parsed = urllib.parse.urlparse(url if isinstance(url, str) else "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"expected a server address such as http://127.0.0.1:8000, got {url!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"expected concurrency to be a positive int, got {concurrency!r}")
        if not timeout > 0:
            raise ValueError(f"expected timeout > 0 seconds, got {timeout!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"expected prompt_format in {PROMPT_FORMATS}, got {prompt_format!r}")
        self.root = url.rstrip("/").removesuffix("/v1")
        self.base = self.root + "/v1"
        self.concurrency = concurrency
        self.timeout = timeout
        self.prompt_format = prompt_format
        self.model = model if model is not None else self._served_model()

    def _request(self, path: str, body: Optional[dict] = None, root: bool = False) -> dict[str, Any]:
        """`GET` (no body) or `POST` (a JSON body) `path` under the `/v1` address (or the root); the decoded JSON
        answer."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        address = (self.root if root else self.base) + path
        request = urllib.request.Request(address, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as error:
            detail = " ".join(error.read().decode("utf-8", "replace").split())[:500]
            raise RuntimeError(f"expected a JSON answer from {address}, got HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            raise RuntimeError(f"expected a completions server at {self.base}, got no answer ({error})") from None

    def _served_model(self) -> str:
        listed = self._request(MODELS_PATH).get("data", [])
        names = [entry.get("id") for entry in listed if isinstance(entry, dict)]
        if len(names) != 1:
            raise ValueError(f"expected {self.base} to serve one model (or a model name to ask for), got {names}")
        return names[0]

    def _text_prompt(self, prompt_ids: list[int], text: Optional[str]) -> str:
        """`text`, once the server has tokenized it to `prompt_ids`; a `RuntimeError` showing where they part."""
        if text is None:
            raise ValueError("expected the prompt's text with prompt_format='text', got none")
        tokens = self._request(TOKENIZE_PATH, {"model": self.model, "input": text}, root=True).get("tokens")
        if tokens != list(prompt_ids):
            at = next((i for i, (a, b) in enumerate(zip(tokens or [], prompt_ids)) if a != b),
                      min(len(tokens or []), len(prompt_ids)))
            raise RuntimeError(
                f"expected {self.root} to tokenize the prompt to our {len(prompt_ids)} ids, got {len(tokens or [])} "
                f"ids, first different at {at}: {(tokens or [])[at : at + 4]} vs {list(prompt_ids)[at : at + 4]}"
            )
        return text

    def complete(self, prompt_ids: list[int], max_new_tokens: int, text: Optional[str] = None) -> Completion:
        """The greedy answer to one prompt of token ids (its `text` too with `prompt_format="text"`), at most
        `max_new_tokens` tokens long."""
        prompt = list(prompt_ids) if self.prompt_format == "token_ids" else self._text_prompt(prompt_ids, text)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": False,
                "return_token_ids": True, **GREEDY}
        answer = self._request(COMPLETIONS_PATH, body)
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise RuntimeError(f"expected one choice from {self.base + COMPLETIONS_PATH}, got {str(answer)[:300]}")
        choice = choices[0]
        token_ids = choice.get("token_ids")
        if token_ids is not None and not (isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids)):
            raise RuntimeError(f"expected `token_ids` to be a list of ints from {self.base}, got {str(token_ids)[:200]}")
        return Completion(text=choice.get("text") or "", token_ids=token_ids, finish_reason=choice.get("finish_reason"))

    def complete_all(self, prompts: list[list[int]], texts: list[str], max_new_tokens: int) -> Iterator[Completion]:
        """The answers to `prompts` (token ids, and their `texts`), in their order, `concurrency` requests at a
        time."""
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            yield from pool.map(self.complete, prompts, itertools.repeat(max_new_tokens), texts)

    def returns_token_ids(self, prompt_ids: list[int], text: Optional[str] = None) -> bool:
        """Whether the server returns answers as token ids (asked with a one-token answer to the prompt)."""
        return self.complete(prompt_ids, 1, text).token_ids is not None
