"""Published draft-head checkpoints in, servable checkpoints out (DESIGN section 3, "Interop").

Three layouts hold the same network as a [`JetSpecDraftModel`] (fc + RMSNorm over concatenated target features,
Qwen3-style layers whose keys/values also cover the fused context, a final norm, the target's embeddings and LM
head), under other names:

- **jetspec**: ours (`model_type` `"jetspec"`, `save_pretrained` without `checkpoint_format`).
- **dflash**: z-lab DFlash and the JetSpec authors' reference heads, also what vLLM and SGLang serve. `config.json`
  is a Qwen3 config (`architectures` `["DFlashDraftModel"]`) with top-level `block_size`, `num_target_layers`
  (optionally `target_hidden_size`, `is_causal`, `draft_vocab_size`) and `dflash_config` holding `target_layer_ids`,
  `mask_token_id` and the block attention (`causal_head` for the JetSpec reference, `causal` for vLLM; the top-level
  `is_causal` wins in vLLM). Weights `fc.weight`, `hidden_norm.weight`, `layers.N.*` (our names), `norm.weight`,
  optionally `d2t`. A MASK slot is the target's embedding row of `mask_token_id`, an unused id inside the
  vocabulary, unless a `mask_embedding.pt` (a tensor, or `{"mask_token_id", "embedding"}`) ships a trained vector.
- **muse_glimmer_assistant**: transformers' built-in DFlash assistant; as dflash, with `target_layer_ids`,
  `mask_token_id` and `block_size` at the top level and `encoder.fc` / `encoder.output_norm_enc` for the first two
  weights. Import only.

Import maps names and config fields and refuses anything the head cannot compute identically (a `ValueError`
naming the field): sliding-window or biased attention, a non-default rotary, logit scaling, extra or missing
weights, target layer ids beyond the target's depth, a MASK id outside the vocabulary.

Export writes the dflash layout. A head's own trained MASK vector (`mask_source="head"`) is written as
`mask_embedding.pt` for `dflash_config.mask_token_id` (`config.dflash_mask_token_id`, defaults to
`vocab_size - 1`): vLLM substitutes it for that row; loaders that do not read the file (the reference
`DFlashDraftModel`; SGLang was not checked) use the target's row instead, which drafts differently (still lossless,
lower acceptance). A reduced draft vocabulary is written as `d2t` (target id = draft id + d2t[draft id]) with
`draft_vocab_size`, plus `lm_head.weight` (the target's LM head rows of the draft vocabulary; the target must be
attached), since vLLM builds a `draft_vocab_size`-row LM head only from a shipped one.
"""

import inspect
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3Config
from transformers.utils import cached_file

from .configuration_jetspec import JetSpecConfig

CHECKPOINT_FORMATS = ("jetspec", "dflash")  # what `save_pretrained(checkpoint_format=...)` writes
IMPORT_FORMATS = ("jetspec", "dflash", "muse_glimmer_assistant")  # what `from_pretrained` reads
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's name for a trained MASK vector
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")

# our name -> DFlash name, for the tensors outside the layers (layer tensors keep their names)
_TOP_LEVEL = {"fc.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
              "d2t": "d2t"}
_FROM_DFLASH = {v: k for k, v in _TOP_LEVEL.items()}
_FROM_DFLASH.update({"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "context_norm.weight"})
_LAYER_KEY = re.compile(
    r"layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|self_attn\.[qk]_norm\.weight|mlp\.(gate|up|down)_proj\.weight"
    r"|(input|post_attention)_layernorm\.weight)"
)


def check_checkpoint_format(checkpoint_format: str) -> str:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"expected checkpoint_format in {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    return checkpoint_format


def dflash_name(name: str) -> str | None:
    """The DFlash name of one of our state-dict keys; `None` for tensors the format has no place for."""
    if _LAYER_KEY.fullmatch(name):
        return name
    return _TOP_LEVEL.get(name)


def jetspec_name(name: str) -> str | None:
    """Our state-dict key for a DFlash / muse_glimmer_assistant tensor name; `None` for names we have no slot for."""
    if _LAYER_KEY.fullmatch(name):
        return name
    return _FROM_DFLASH.get(name)


# ------------------------------------------------------------------------------------------------------ detection
def detect_checkpoint_format(config: dict) -> str:
    """`"jetspec"`, `"dflash"` or `"muse_glimmer_assistant"` from a `config.json` dict; `ValueError` otherwise."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type in ("jetspec", "muse_glimmer_assistant"):
        return model_type
    if any(a != "DFlashDraftModel" and "DFlash" in a for a in architectures):
        raise ValueError(
            f"expected architectures ['DFlashDraftModel'] (the plain DFlash / JetSpec head), got {architectures}: "
            "variants with extra modules (convolutions, candidate selectors) have no JetSpec counterpart"
        )
    if model_type == "qwen3" and ("dflash_config" in config or "DFlashDraftModel" in architectures):
        return "dflash"
    raise ValueError(
        f"expected a JetSpec head (model_type 'jetspec'), a DFlash / JetSpec-reference head (model_type 'qwen3' with "
        f"dflash_config) or a muse_glimmer_assistant head, got model_type {model_type!r} with architectures "
        f"{architectures}"
    )


def read_checkpoint_config(path, kwargs: dict) -> dict | None:
    """`config.json` of a local folder or Hub repo as a dict (hub options read from `kwargs`, left in place), or
    `None` when there is none (the caller's loader then reports it)."""
    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    resolved = cached_file(
        path, "config.json", _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False, **hub,
    )
    if resolved is None:
        return None
    return json.loads(Path(resolved).read_text())


# --------------------------------------------------------------------------------------------------------- import
def _reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The JetSpec reference's default feature layers when `dflash_config.target_layer_ids` is absent: one per draft
    layer, evenly spaced from layer 1 to `num_target_layers - 3` (the middle layer for a one-layer head)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def jetspec_fields(config: dict, checkpoint_format: str, has_mask_embedding: bool, overrides: dict) -> dict:
    """[`JetSpecConfig`] fields of a dflash / muse_glimmer_assistant `config.json` dict, `overrides` applied.

    Raises `ValueError` naming the field for anything a JetSpec head cannot compute identically.
    """
    rest = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "auto_map")}
    try:
        # the host's own reading of the config: legacy `rope_theta` / `rope_scaling` become `rope_parameters`
        normal = AutoConfig.for_model(config["model_type"], **rest)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(
            f"expected a config.json that transformers reads as model_type {config.get('model_type')!r}, got an "
            f"error: {error}"
        ) from None
    extra = config.get("dflash_config") or {}

    def field(name, default=None):  # dflash_config first, then the top level (the DFlash loaders' order)
        return extra.get(name, config.get(name, default))

    checks = [  # (field, value, acceptable values)
        ("hidden_act", getattr(normal, "hidden_act", "silu"), ("silu",)),
        ("attention_bias", bool(getattr(normal, "attention_bias", False)), (False,)),
        ("is_neox_style", config.get("is_neox_style", True), (True,)),
        ("dflash_config.use_swa", extra.get("use_swa", False), (False,)),
        ("dflash_config.attention_sink_bias", extra.get("attention_sink_bias", False), (False,)),
        ("input_embedding_scale", field("input_embedding_scale", 1.0), (1, 1.0)),
        ("output_multiplier", field("output_multiplier", 1.0), (1, 1.0)),
        ("logit_scale", config.get("logit_scale", 1.0), (1, 1.0)),
        ("use_aux_hidden_state", field("use_aux_hidden_state", True), (True,)),
    ]
    for name, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"expected {name} in {list(allowed)} (what a JetSpec head computes), got {value!r}")
    softcap = field("final_logit_softcapping")
    if softcap is not None and float(softcap) > 0:
        raise ValueError(f"expected no final_logit_softcapping (a JetSpec head has none), got {softcap!r}")
    layer_types = getattr(normal, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"expected layer_types all 'full_attention' (a JetSpec head attends to the whole context, it has no "
            f"sliding window), got {layer_types}"
        )
    rope = getattr(normal, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            "expected rope_parameters.rope_type 'default' (plain rotary with rope_theta), got "
            f"{rope.get('rope_type')!r}"
        )
    target_hidden = extra.get("target_hidden_size", normal.hidden_size)
    if target_hidden != normal.hidden_size:
        raise ValueError(
            f"expected dflash_config.target_hidden_size equal to hidden_size ({normal.hidden_size}), got "
            f"{target_hidden}: the reference's random hidden-size adapter has no JetSpec counterpart"
        )

    votes = {"is_causal": config.get("is_causal"), "dflash_config.causal": extra.get("causal"),
             "dflash_config.causal_head": extra.get("causal_head")}
    votes = {k: bool(v) for k, v in votes.items() if v is not None}
    if len(set(votes.values())) > 1:
        raise ValueError(
            f"expected is_causal, dflash_config.causal and dflash_config.causal_head to agree, got {votes}"
        )
    causal = next(iter(votes.values()), False)  # DFlash's default block is bidirectional

    num_target_layers = field("num_target_layers")
    layer_ids = field("target_layer_ids")
    if layer_ids is None and checkpoint_format == "dflash" and num_target_layers is not None:
        layer_ids = _reference_layer_ids(num_target_layers, normal.num_hidden_layers)
    if layer_ids is None:
        raise ValueError("expected target_layer_ids (in dflash_config or at the top level of config.json), got none")
    vocab_size = overrides.get("vocab_size", config.get("vocab_size"))
    if vocab_size is None:
        raise ValueError("expected vocab_size in config.json (the target's), got none: pass vocab_size=<target's>")
    mask_token_id = field("mask_token_id")
    if mask_token_id is None:
        raise ValueError("expected mask_token_id (in dflash_config or at the top level of config.json), got none")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"expected mask_token_id inside the target vocabulary [0, {vocab_size}) (a DFlash MASK is the "
            f"target's embedding row of that id), got {mask_token_id}"
        )

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=normal.hidden_size,
        intermediate_size=normal.intermediate_size,
        num_hidden_layers=normal.num_hidden_layers,
        num_attention_heads=normal.num_attention_heads,
        num_key_value_heads=getattr(normal, "num_key_value_heads", None) or normal.num_attention_heads,
        head_dim=getattr(normal, "head_dim", None) or normal.hidden_size // normal.num_attention_heads,
        rms_norm_eps=normal.rms_norm_eps,
        rope_theta=rope.get("rope_theta", 10000.0),
        target_hidden_size=config.get("target_hidden_size") or normal.hidden_size,
        target_layer_ids=list(layer_ids),
        block_size=int(field("block_size", 16)),
        block_attention="causal" if causal else "bidirectional",
        max_position_embeddings=getattr(normal, "max_position_embeddings", None),
    )
    if num_target_layers is not None:
        fields["target_num_hidden_layers"] = num_target_layers
    elif "target_num_hidden_layers" not in overrides:
        raise ValueError(
            "expected num_target_layers in config.json (the depth of the target the head was trained for), got "
            "none: pass target_num_hidden_layers=<target's num_hidden_layers> to from_pretrained"
        )
    if has_mask_embedding:  # the trained vector replaces the row: ours, keyed outside the vocabulary
        fields.update(mask_source="head", mask_token_id=vocab_size, dflash_mask_token_id=mask_token_id)
    else:
        fields.update(mask_source="target", mask_token_id=mask_token_id)
    draft_vocab_size = config.get("draft_vocab_size")
    if draft_vocab_size is not None and draft_vocab_size != vocab_size:
        fields["draft_vocab_size"] = draft_vocab_size
    fields.update(overrides)
    return fields


def jetspec_state_dict(weights: dict, expected: dict, mask_embedding: torch.Tensor | None) -> dict:
    """Our state dict from DFlash-named `weights`, checked against `expected` (a fresh head's state dict).

    `t2d` (EAGLE-3's membership mask, implied by `d2t`) and, next to `d2t`, `lm_head.weight` (the target's rows of
    the draft vocabulary, which a JetSpec head reads from the attached target) are dropped.
    """
    state, unexpected = {}, []
    for name, tensor in weights.items():
        if name == "t2d" or (name == "lm_head.weight" and "d2t" in weights):
            continue
        ours = jetspec_name(name)
        if ours is None or ours not in expected:
            unexpected.append(name)
        else:
            state[ours] = tensor
    if unexpected:
        raise ValueError(
            f"expected only the weights of a {len(expected)}-tensor DFlash head described by its config.json, got "
            f"unexpected weight(s) {sorted(unexpected)} (embeddings and LM head are the target's, never the head's)"
        )
    if mask_embedding is not None:
        state["mask_embedding"] = mask_embedding.reshape(-1)
    else:  # mask_source="target": the slot is unused, kept for a uniform state dict
        state["mask_embedding"] = torch.zeros_like(expected["mask_embedding"])
    missing = [dflash_name(k) or k for k in expected if k not in state]
    if missing:
        raise ValueError(f"expected every weight of the head described by config.json, got missing weight(s) {missing}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"expected weight {dflash_name(name) or MASK_EMBEDDING_FILE} of shape {tuple(expected[name].shape)} "
                f"(from config.json: hidden_size, intermediate_size, heads, head_dim, target_layer_ids), got "
                f"{tuple(tensor.shape)}"
            )
    return state


def _read_weights(path, hub: dict) -> dict:
    single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False, **hub)
    if single is not None:
        return load_file(single)
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False, **hub)
    if index is None:
        raise ValueError(f"expected model.safetensors or model.safetensors.index.json in {path}, got neither")
    weights = {}
    for shard in sorted(set(json.loads(Path(index).read_text())["weight_map"].values())):
        weights.update(load_file(cached_file(path, shard, **hub)))
    return weights


def _read_mask_embedding(path, hub: dict, mask_token_id) -> torch.Tensor | None:
    resolved = cached_file(path, MASK_EMBEDDING_FILE, _raise_exceptions_for_missing_entries=False, **hub)
    if resolved is None:
        return None
    state = torch.load(resolved, map_location="cpu", weights_only=True)
    if isinstance(state, dict):  # vLLM's convention: {"mask_token_id": id, "embedding": (H,)}
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise ValueError(
                f"expected {MASK_EMBEDDING_FILE} for mask_token_id {mask_token_id} (config.json), got "
                f"{state.get('mask_token_id')}"
            )
        state = state["embedding"]
    return state


def import_checkpoint(cls, path, checkpoint_format: str, config: dict, **kwargs):
    """A `cls` head (a [`JetSpecDraftModel`] class) loaded from a dflash / muse_glimmer_assistant folder or repo.

    Keyword arguments: hub options (`revision`, `token`, `cache_dir`, `local_files_only`, `subfolder`, ...),
    `dtype` (`"auto"` or unset: the checkpoint's), `device_map` (one device), and any [`JetSpecConfig`] field, which
    overrides the converted config (e.g. `target_num_hidden_layers` when the checkpoint lacks `num_target_layers`).
    """
    hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
    dtype, legacy_dtype = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else legacy_dtype
    device = kwargs.pop("device_map", None)
    kwargs.pop("trust_remote_code", None)  # the head's code is ours: nothing remote runs
    known = set(inspect.signature(JetSpecConfig.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"expected hub options, dtype, device_map or JetSpecConfig fields when importing a {checkpoint_format} "
            f"head, got {unknown}"
        )
    if isinstance(device, dict):
        raise ValueError(f"expected device_map to name one device for an imported head, got {device}")
    extra = config.get("dflash_config") or {}
    mask_token_id = extra.get("mask_token_id", config.get("mask_token_id"))
    mask_embedding = _read_mask_embedding(path, hub, mask_token_id)
    fields = jetspec_fields(config, checkpoint_format, mask_embedding is not None, kwargs)
    head = cls(JetSpecConfig(**fields))
    weights = _read_weights(path, hub)
    state = jetspec_state_dict(weights, head.state_dict(), mask_embedding)
    head.load_state_dict(state, strict=True)
    if dtype in (None, "auto"):
        floats = [t.dtype for t in weights.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    head.to(dtype=dtype)  # floating tensors only: d2t stays int64
    if device is not None:
        head.to(device)
    return head.eval()


# --------------------------------------------------------------------------------------------------------- export
def dflash_config(head, mask_token_id: int | None = None) -> Qwen3Config:
    """The `config.json` of `head` in the dflash layout, as a transformers `Qwen3Config`."""
    c = head.config
    if getattr(c, "last_context_input", False):  # a field of newer configs
        raise ValueError(
            "expected last_context_input=False to export a DFlash head (the format has no such input), got True"
        )
    if c.mask_source == "target":
        if mask_token_id is not None and mask_token_id != c.mask_token_id:
            raise ValueError(
                f"expected mask_token_id {c.mask_token_id} (the head's MASK is the target's row of that id), got "
                f"{mask_token_id}"
            )
        mask_token_id = c.mask_token_id
    elif mask_token_id is None:
        mask_token_id = c.dflash_mask_token_id if c.dflash_mask_token_id is not None else c.vocab_size - 1
    if not 0 <= mask_token_id < c.vocab_size:
        raise ValueError(
            f"expected mask_token_id inside the target vocabulary [0, {c.vocab_size}) for a DFlash export (its "
            f"loaders embed that id before substituting mask_embedding.pt), got {mask_token_id}"
        )
    causal = c.block_attention == "causal"
    extra = dict(
        architectures=["DFlashDraftModel"],
        block_size=c.block_size,
        num_target_layers=c.target_num_hidden_layers,
        target_hidden_size=c.target_hidden_size,
        is_causal=causal,  # vLLM: top level first
        dflash_config={
            "target_layer_ids": list(c.target_layer_ids),
            "mask_token_id": int(mask_token_id),
            "block_size": c.block_size,
            "causal_head": causal,  # the JetSpec reference
            "causal": causal,  # vLLM
        },
    )
    d2t = getattr(head, "d2t", None)
    if d2t is not None:
        extra["draft_vocab_size"] = int(d2t.shape[0])
    max_positions = c.to_dict().get("max_position_embeddings") or Qwen3Config().max_position_embeddings
    return Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=max_positions,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=False,
        dtype=head.dtype,
        **extra,
    )


def dflash_state_dict(head) -> dict:
    """`head`'s tensors under DFlash names (the MASK vector excluded: it goes to `mask_embedding.pt`)."""
    state = {}
    for name, tensor in head.state_dict().items():
        if name == "mask_embedding":
            continue
        exported = dflash_name(name)
        if exported is None:
            raise ValueError(f"expected only tensors the DFlash format can hold, got {name!r}")
        state[exported] = tensor.detach().contiguous().cpu()
    if getattr(head, "d2t", None) is not None:
        if head._target_io is None:
            raise ValueError(
                "expected the head attached to its target (`head.attach_target(target)`) to export a reduced draft "
                "vocabulary (d2t): vLLM needs the target's LM head rows of the draft vocabulary as lm_head.weight, "
                "got no target"
            )
        _, lm_head = head._io()
        rows = head.draft_token_ids().to(lm_head.weight.device)  # (V_draft,) target ids
        state["lm_head.weight"] = lm_head.weight[rows].detach().to(head.dtype).contiguous().cpu()  # (V_draft, H)
    return state


def export_dflash(head, save_directory, *args, mask_token_id: int | None = None, **kwargs):
    """Write `head` to `save_directory` in the dflash layout: `config.json`, `model.safetensors` and, for a head
    with its own MASK vector, `mask_embedding.pt` (keyed by `mask_token_id`, an in-vocabulary id)."""
    if args or kwargs:
        raise ValueError(
            f"expected only mask_token_id with checkpoint_format='dflash', got {len(args)} positional argument(s) "
            f"and {sorted(kwargs)}"
        )
    config = dflash_config(head, mask_token_id)
    state = dflash_state_dict(head)
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    stale = folder / MASK_EMBEDDING_FILE
    if head.config.mask_source == "head":
        vector = head.mask_embedding.detach().cpu().clone()  # (H,)
        torch.save({"mask_token_id": config.dflash_config["mask_token_id"], "embedding": vector}, stale)
    elif stale.exists():
        stale.unlink()
