"""The integration with transformers: `target.generate(..., assistant_model=head)` runs tree decoding
(arXiv 2606.18394, section 3; `docs/design.md`, "§2 The round").

[`install_generate_hook`] wraps `GenerationMixin.generate` once so that a call with a JetSpec head as
`assistant_model` goes to [`tree_generate`]; [`tree_generate`] resolves the call's tree shape, refuses `generate`
arguments the tree loop would drop ([`check_generate_kwargs`]), picks the call's verifier, switches flash attention to
sdpa for the tree mask, and re-enters `generate` with the loop (`decode._decode`) as its callable
`custom_generate`, so that transformers prepares the generation config, logits processors and stopping criteria as
for plain decoding. [`CUSTOM_GENERATE_SOURCE`] is the `custom_generate/generate.py` written next to a saved head.
"""

import copy
import functools
import inspect
import numbers
import os

import torch
from transformers import GenerationConfig, GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .answer_cache import AnswerCache
from .budget import DEFAULT_CANDIDATES, LOOKUP_TOKENS
from .compat import attn_implementation
from .configuration_jetspec import TREE_FIELDS
from .decode import _decode
from .round_hook import check_round_hook
from .state import TreeShape, resolve_tree_shape
from .static import resolve_static, static_decode, static_verifier
from .tree import max_tree_nodes
from .verifiers import TreeVerifier, verifier_for

MASKABLE_ATTENTION = ("eager", "sdpa")  # take an additive 4D float mask as is
# model kwargs the tree loop reads; any other model kwarg (pixel_values, token_type_ids, past_key_values, ...) raises
SUPPORTED_MODEL_KWARGS = ("input_ids", "inputs", "attention_mask")
# `generate` arguments that are not model kwargs, honoured as in plain `generate` (the loop re-enters it)
GENERATE_HONOURED = (
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "tokenizer",
    "trust_remote_code",
    "jetspec_answer_cache",  # the loop's own (`answer_cache.py`), checked by [`check_answer_cache`]
    "jetspec_rows",  # the loop's own: rows that join the call (`admission.py`)
)
# generation-config fields the tree loop would otherwise ignore without a word: value that is supported
UNSUPPORTED_GENERATION = {
    "cache_implementation": "dynamic",  # the loop keeps its own cache ("static": taken by `static.resolve_static`)
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "dola_layers": None,
    "penalty_alpha": None,
    "output_attentions": False,
    "output_hidden_states": False,
}
# `generate` parameters the tree loop cannot honour: value that is supported
UNSUPPORTED_GENERATE = {
    "synced_gpus": (None, False),
    "negative_prompt_ids": (None,),
    "negative_prompt_attention_mask": (None,),
    "custom_generate": (None,),
    "assistant_tokenizer": (None,),
}


def check_generate_kwargs(kwargs: dict):
    """Raise a `ValueError` naming every argument of a `generate` call (`kwargs`, tree arguments and streamer
    removed) the tree loop would otherwise drop.

    Model kwargs other than `attention_mask` (`pixel_values`, `token_type_ids`, a user `past_key_values`,
    `inputs_embeds`, `position_ids`, ...) change what the target computes, and the tree loop runs its own forwards:
    passing them on silently would return another answer than plain `generate`. So do the generation settings in
    `UNSUPPORTED_GENERATION`, given directly or inside a `generation_config`.
    """
    for name, allowed in UNSUPPORTED_GENERATE.items():
        if kwargs.get(name) not in allowed:
            raise ValueError(f"expected no `{name}` with tree speculative decoding (not supported), got one")
    fields = GenerationConfig()  # a name it does not have is a model kwarg, as in `generate`
    skip = (*UNSUPPORTED_GENERATE, *GENERATE_HONOURED, *SUPPORTED_MODEL_KWARGS)
    unknown = sorted(k for k in kwargs if k not in skip and not hasattr(fields, k))
    if unknown:
        raise ValueError(
            f"expected only {', '.join(SUPPORTED_MODEL_KWARGS)} as model inputs with tree speculative decoding, got "
            f"also {', '.join(unknown)}: the tree loop runs its own target forwards and cannot pass them on"
        )
    config = kwargs.get("generation_config")
    given = config.to_dict() if config is not None else {}
    for name, default in UNSUPPORTED_GENERATION.items():
        value = kwargs.get(name, given.get(name, default))
        if value not in (default, None):
            raise ValueError(
                f"expected {name}={default!r} with tree speculative decoding (not supported), got {value!r}"
            )


def _checked_prompt(args, kwargs):
    """The call's prompt (positional, `inputs` or `input_ids`), refused unless `(batch, length)` with a mask of its
    shape; checked here: `generate` drops an all-ones mask before the loop sees it, whatever its shape."""
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(prompt, torch.Tensor) and (prompt.dim() != 2 or prompt.shape[-1] == 0):
        raise ValueError(f"expected a non-empty prompt of shape (batch, length), got shape {tuple(prompt.shape)}")
    mask = kwargs.get("attention_mask")
    if isinstance(prompt, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.shape != prompt.shape:
        raise ValueError(
            f"expected an attention_mask of the shape of input_ids {tuple(prompt.shape)}, got {tuple(mask.shape)}"
        )
    return prompt


def tree_generate(head, target, *args, **kwargs):
    """Route `target.generate(..., assistant_model=head)` to tree decoding; see `JetSpecDraftModel.tree_generate`."""
    kwargs.pop("assistant_model", None)
    given = {name: _as_int(kwargs.pop(name, None)) for name in TREE_FIELDS}  # numpy integers are integers
    shape = resolve_tree_shape(head.config, **given)
    streamer = kwargs.pop("streamer", None)
    tree_verify = kwargs.pop("tree_verify", None) or "auto"  # hybrid targets: "tree", "chain" or "auto"
    static = resolve_static(kwargs)  # jetspec_static / cache_implementation="static": `static.py`
    verify_linear = kwargs.pop("verify_linear", None) or "auto"  # the verify's linear form: "auto", "linear", "mm"
    round_hook = check_round_hook(kwargs.pop("jetspec_round_hook", None))  # called with each round's record
    answers = check_answer_cache(kwargs.get("jetspec_answer_cache"), shape)  # passed on to the loop
    check_generate_kwargs(kwargs)
    _check_lengths(kwargs)
    prompt = _checked_prompt(args, kwargs)
    if head.device != target.device:
        raise ValueError(
            f"expected the head on the target's device {target.device}, got {head.device}: move it with "
            "head.to(target.device)"
        )
    head.attach_target(target)
    if isinstance(prompt, torch.Tensor):
        check_tree_bounds(shape, head, target, *prompt.shape)
    _stop_strings_with_tokenizer(target, kwargs)
    # refuses layer kinds no verifier handles and unknown settings, before any work
    verifier = verifier_for(target, head, tree_verify, verify_linear)
    if static is not None:
        verifier = static_verifier(target, head, shape, verifier, static, answers is not None)
    impl = attn_implementation(target)
    # flex_attention takes the tree mask as a BlockMask (`steps.verify`); the hybrid verifier builds float masks only
    flex_kept = impl == "flex_attention" and isinstance(verifier, TreeVerifier)
    switch = impl not in MASKABLE_ATTENTION and not flex_kept
    if switch and not (impl.startswith("flash") or impl == "flex_attention"):
        raise ValueError(
            f"expected a target attention implementation that takes a 4D tree mask ({', '.join(MASKABLE_ATTENTION)}, "
            f"flex_attention; flash attention, and flex attention on hybrid targets, are switched to sdpa for the "
            f"call), got {impl!r}"
        )
    if switch:  # flash-attn cannot take a tree mask: verify with sdpa, restore afterwards
        target.set_attn_implementation("sdpa")
    try:
        return target.generate(
            *args,
            custom_generate=_decode if static is None else static_decode,
            jetspec_head=head,
            jetspec_shape=shape,
            jetspec_streamer=streamer,
            jetspec_verifier=verifier,
            jetspec_round_hook=round_hook,
            **kwargs,
        )
    finally:
        if switch:
            target.set_attn_implementation(impl)


def check_answer_cache(cache, shape: TreeShape) -> AnswerCache | None:
    """`jetspec_answer_cache` checked: None, or an [`AnswerCache`] with a lookup branch to draft in (its continuations
    are as long as the branch's and scored by its prior)."""
    if cache is None:
        return None
    if not isinstance(cache, AnswerCache):
        raise ValueError(f"expected jetspec_answer_cache to be an AnswerCache or None, got {type(cache).__name__}")
    if not shape.lookup:
        raise ValueError(
            "expected tree_lookup >= 1 with jetspec_answer_cache (the cached answers draft as the lookup branch "
            "does, as long and scored by its prior), got tree_lookup=0"
        )
    return cache


def _as_int(value):
    """`value` as a Python `int` when it is an integer of another type (`numpy.int64`), else unchanged."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


LENGTH_FIELDS = ("max_new_tokens", "max_length", "min_new_tokens", "min_length")


def _check_lengths(kwargs: dict):
    """Length settings given directly must be integers (`numpy` integers too); `max_new_tokens` at least 1."""
    for name in LENGTH_FIELDS:
        value = kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"expected {name} to be an int, got {type(value).__name__} {value!r}")
        kwargs[name] = int(value)
    if kwargs.get("max_new_tokens") is not None and kwargs["max_new_tokens"] <= 0:
        raise ValueError(f"expected max_new_tokens >= 1, got {kwargs['max_new_tokens']}")


def _stop_strings_with_tokenizer(target, kwargs: dict):
    """`stop_strings` with a `tokenizer`: the `StopStringCriteria` plain `generate` would build, passed as a stopping
    criterion, since `generate` drops `tokenizer` for a callable `custom_generate`. Without a tokenizer, `generate`
    raises its own error, as in plain decoding."""
    config = kwargs.get("generation_config")
    stop_strings = kwargs.get("stop_strings", (config if config is not None else target.generation_config).stop_strings)
    tokenizer = kwargs.get("tokenizer")
    if stop_strings is None or tokenizer is None:
        return
    criteria = StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer)
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criteria])
    kwargs["stop_strings"] = None  # overrides the generation config's for this call
    if config is not None and config.stop_strings is not None:
        kwargs["generation_config"] = copy.deepcopy(config)
        kwargs["generation_config"].stop_strings = None


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory the device holds (total, not free: a bound no call can exceed), or `None` when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_tree_bounds(shape: TreeShape, head, target, batch: int, prompt_length: int):
    """Refuse, before any work, a tree the head cannot draft or whose first verify round cannot fit in memory.

    `tree_width` is at most the draft vocabulary (a node has at most that many distinct children). A round's verify
    tensors grow with the nodes n of a tree (at most the budget, at most a full tree of the depth and width, plus the
    lookup chain): per row, the tree mask `(n + 1, S + n + 1)`, the logits `(n + 1, V)` in the model's dtype and in
    fp32, every layer's hidden states `(n + 1, H)`, and with path conditioning the head's mask of `2n + 1` slots. Their
    sum at S = the prompt length (the first round, the least a call needs) must fit in the device's memory.
    """
    ids = head.draft_token_ids()
    draft_vocab = head.config.vocab_size if ids is None else ids.shape[0]
    if shape.width > draft_vocab:
        raise ValueError(
            f"expected tree_width <= {draft_vocab} (the head's draft vocabulary: a node has at most that many "
            f"children), got {shape.width}"
        )
    auto = shape.budget == "auto"  # any candidate point: up to the largest budget, lookup on where the shape has none
    budget, lookup = (max(DEFAULT_CANDIDATES), shape.lookup or LOOKUP_TOKENS) if auto else (shape.budget, shape.lookup)
    n = min(budget, max_tree_nodes(shape.depth, shape.width) + lookup)
    config = target.config.get_text_config()
    element = torch.finfo(target.dtype).bits // 8 if target.dtype.is_floating_point else 4
    per_row = (n + 1) * (
        (prompt_length + n + 1) * element
        + config.vocab_size * (4 + element)
        + (config.num_hidden_layers + 1) * config.hidden_size * element
    )
    if shape.path_conditioning:
        per_row += (2 * n + 1) * (prompt_length + 2 * n + 1) + 2 * n * draft_vocab * 4
    memory = device_memory(target.device)
    if memory is not None and per_row * batch > memory:
        raise ValueError(
            f"expected a tree whose verify round fits in memory, got tree_budget={shape.budget!r} (up to {n} nodes "
            f"per row at tree_depth={shape.depth}, tree_width={shape.width}): at batch {batch} its mask, logits and "
            f"hidden states need about {per_row * batch / 2**30:.1f} GiB, the {target.device.type} device holds "
            f"{memory / 2**30:.1f} GiB"
        )


_HOOK_MARK = "_jetspec_routes_heads"


def install_generate_hook():
    """Make `target.generate(..., assistant_model=<JetSpec head>)` run tree decoding.

    transformers' assisted decoding verifies a linear chain at batch size 1 and has no public hook for a tree,
    so `GenerationMixin.generate` is wrapped once: when `assistant_model` is a JetSpec head (its config's
    `model_type` is "jetspec") the call goes to the head's `tree_generate`; every other call is untouched.
    """
    if getattr(GenerationMixin.generate, _HOOK_MARK, False):
        return
    original = GenerationMixin.generate
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        assistant = bound.arguments.get("assistant_model")
        if assistant is None or getattr(assistant.config, "model_type", None) != "jetspec":
            return original(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.pop("assistant_model")
        arguments.update(arguments.pop("kwargs", {}))
        return assistant.tree_generate(self, **arguments)

    setattr(generate, _HOOK_MARK, True)
    GenerationMixin.generate = generate


def uninstall_generate_hook():
    """Give `GenerationMixin.generate` back unwrapped: a JetSpec head passed as `assistant_model` then goes to
    transformers' own loop (with `speculation_type="dflash"`, its DFlash generator calls the head's forward:
    batch 1, one chain per target forward). [`install_generate_hook`] brings the tree route back."""
    while getattr(GenerationMixin.generate, _HOOK_MARK, False):
        GenerationMixin.generate = GenerationMixin.generate.__wrapped__


# Written as `custom_generate/generate.py` next to a saved head, so that
# `target.generate(..., custom_generate=<head folder or repo>, jetspec_head=<the same>, trust_remote_code=True)`
# decodes with that head.
CUSTOM_GENERATE_SOURCE = '''"""JetSpec tree speculative decoding as a `custom_generate` recipe.

    target.generate(**inputs, custom_generate="<this repo>", jetspec_head="<this repo>", trust_remote_code=True,
                    max_new_tokens=256)

`jetspec_head` is the head to decode with: a repo id or folder (loaded once per process with
`AutoModel.from_pretrained(..., trust_remote_code=True)`), or a head you already hold. transformers does not tell a
recipe which repo it was loaded from, so the head is named explicitly.
"""

from transformers import AutoModel

_HEADS = {}


def generate(model, *args, jetspec_head=None, **kwargs):
    if jetspec_head is None:
        raise ValueError(
            "expected jetspec_head=<this repo or folder, or a loaded JetSpec head> with this recipe, got none"
        )
    head = jetspec_head
    if isinstance(head, str):
        if head not in _HEADS:
            _HEADS[head] = AutoModel.from_pretrained(head, trust_remote_code=True)
        head = _HEADS[head].to(device=model.device, dtype=model.dtype)
    return head.tree_generate(model, *args, **kwargs)
'''
