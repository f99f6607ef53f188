"""Published draft-head checkpoints in, servable checkpoints out (`docs/design.md`, "§7 Targets and checkpoint
formats").

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
  Sliding layers (`layer_types`, `sliding_window`) see keys at most `sliding_window - 1` positions back, as z-lab's
  loader masks them; without any causal flag z-lab's loader makes sliding layers causal and full layers
  bidirectional (its Qwen3.6 heads: four causal sliding layers, one bidirectional full layer), kept per layer
  (`layer_block_attention`).
- **muse_glimmer_assistant**: transformers' built-in DFlash assistant; as dflash, with `target_layer_ids`,
  `mask_token_id` and `block_size` at the top level and `encoder.fc` / `encoder.output_norm_enc` for the first two
  weights, a bidirectional block, and all layers sliding by default, where transformers' bidirectional window lets
  a slot see keys up to `sliding_window` positions back (one more than the dflash convention). Import only.

Import converts the config into a [`JetSpecConfig`] and then loads the weights with transformers' own
`from_pretrained(config=..., key_mapping=...)` (sharding, `dtype`, `device_map` and hub options are transformers').
It refuses anything the head cannot compute identically (a `ValueError` naming the field): biased attention, a
non-default or partial rotary, logit scaling, extra or missing weights, target layer ids beyond the target's depth,
a MASK id outside the vocabulary, and DFlash2 heads (z-lab's `DFlash2DraftModel`: grouped dynamic convolutions and a
candidate selector that rescores each depth along one path, which a tree of independent depths cannot reproduce).

Export writes the dflash layout. A head's own trained MASK vector (`mask_source="head"`) is written as
`mask_embedding.pt` for `dflash_config.mask_token_id` (`config.dflash_mask_token_id`, defaults to
`vocab_size - 1`): vLLM substitutes it for that row; loaders that do not read the file (the reference
`DFlashDraftModel`; SGLang was not checked) use the target's row instead, which drafts differently (still lossless,
lower acceptance). A reduced draft vocabulary is written as `d2t` (target id = draft id + d2t[draft id]) with
`draft_vocab_size`, plus `lm_head.weight` (the target's LM head rows of the draft vocabulary; the target must be
attached), since vLLM builds a `draft_vocab_size`-row LM head only from a shipped one.
"""

import inspect
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig, Qwen3Config
from transformers.utils import cached_file, has_file

from .configuration_jetspec import LAYER_TYPES, JetSpecConfig

CHECKPOINT_FORMATS = ("jetspec", "dflash")  # what `save_pretrained(checkpoint_format=...)` writes
IMPORT_FORMATS = ("jetspec", "dflash", "muse_glimmer_assistant")  # what `from_pretrained` reads
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's name for a trained MASK vector
HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
# what an import passes on to transformers' `from_pretrained`, besides the hub options
LOAD_OPTIONS = (
    "dtype",
    "torch_dtype",
    "device_map",
    "max_memory",
    "offload_folder",
    "attn_implementation",
    "low_cpu_mem_usage",
    "use_safetensors",
    "variant",
    "weights_only",
)

# our name -> DFlash name, for the tensors outside the layers (layer tensors keep their names)
_TOP_LEVEL = {
    "fc.weight": "fc.weight",
    "context_norm.weight": "hidden_norm.weight",
    "norm.weight": "norm.weight",
    "d2t": "d2t",
}
# checkpoint name (regex) -> ours, applied by transformers while loading (`key_mapping`)
IMPORT_KEY_MAPPING = {
    r"^hidden_norm\.": "context_norm.",
    r"^encoder\.fc\.": "fc.",
    r"^encoder\.output_norm_enc\.": "context_norm.",
}
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


# ------------------------------------------------------------------------------------------------------ detection
def detect_checkpoint_format(config: dict) -> str:
    """`"jetspec"`, `"dflash"` or `"muse_glimmer_assistant"` from a `config.json` dict; `ValueError` otherwise."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type in ("jetspec", "muse_glimmer_assistant"):
        return model_type
    if "DFlash2DraftModel" in architectures:
        raise ValueError(
            "expected architectures ['DFlashDraftModel'] (the plain DFlash / JetSpec head), got ['DFlash2DraftModel']: "
            "DFlash2 adds grouped dynamic convolutions around attention and MLP and a candidate selector that rescores "
            "each depth's top tokens along one drafted path, which a JetSpec head cannot compute"
        )
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
    hub = {k: kwargs[k] for k in HUB_OPTIONS if k in kwargs}
    try:
        config, _ = PretrainedConfig.get_config_dict(path, **hub)
    except OSError:
        return None
    return config


# ------------------------------------------------------------------------------------------ import: the config
def _reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The JetSpec reference's default feature layers when `dflash_config.target_layer_ids` is absent: one per draft
    layer, evenly spaced from layer 1 to `num_target_layers - 3` (the middle layer for a one-layer head)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_foreign_field_types(config: dict):
    """Raise a `ValueError` naming the first field of a dflash / muse `config.json` dict of the wrong type, before
    any of it is converted: `dflash_config` a dict, `mask_token_id`, `block_size` and `num_target_layers` ints,
    `target_layer_ids` a list of ints (each in `dflash_config` or at the top level)."""
    extra = config.get("dflash_config")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"expected dflash_config to be a dict, got {type(extra).__name__} {extra!r}")
    for name in ("mask_token_id", "block_size", "num_target_layers"):
        value = _field(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"expected {name} to be an int, got {type(value).__name__} {value!r}")
    ids = _field(config, "target_layer_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError(f"expected target_layer_ids to be a list of ints, got {ids!r}")


def _field(config: dict, name: str, default=None):
    """`dflash_config.<name>` first, then the top level: the DFlash loaders' order."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def _host_config(config: dict) -> PretrainedConfig:
    """transformers' own reading of `config` (legacy `rope_theta` / `rope_scaling` become `rope_parameters`)."""
    rest = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "auto_map")}
    try:
        return AutoConfig.for_model(config["model_type"], **rest)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(
            f"expected a config.json that transformers reads as model_type {config.get('model_type')!r}, got an "
            f"error: {error}"
        ) from None


def check_computable(config: dict, normal: PretrainedConfig):
    """Raise a `ValueError` naming the first field of `config` whose network a JetSpec head does not compute."""
    extra = config.get("dflash_config") or {}
    rope = dict(getattr(normal, "rope_parameters", None) or {})
    checks = [  # (field, value, acceptable values)
        ("hidden_act", getattr(normal, "hidden_act", "silu"), ("silu",)),
        ("attention_bias", bool(getattr(normal, "attention_bias", False)), (False,)),
        ("is_neox_style", config.get("is_neox_style", True), (True,)),
        ("dflash_config.use_swa", extra.get("use_swa", False), (False,)),
        ("dflash_config.attention_sink_bias", extra.get("attention_sink_bias", False), (False,)),
        ("input_embedding_scale", _field(config, "input_embedding_scale", 1.0), (1, 1.0)),
        ("output_multiplier", _field(config, "output_multiplier", 1.0), (1, 1.0)),
        ("logit_scale", config.get("logit_scale", 1.0), (1, 1.0)),
        ("use_aux_hidden_state", _field(config, "use_aux_hidden_state", True), (True,)),
        ("final_logit_softcapping", _field(config, "final_logit_softcapping") or None, (None,)),
        # loaders disagree on a partial rotary (transformers' Qwen3 rotary ignores it, vLLM rotates that fraction)
        (
            "partial_rotary_factor",
            rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)),
            (1, 1.0),
        ),
        ("rope_parameters.rope_type", rope.get("rope_type", "default"), ("default",)),
    ]
    for name, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"expected {name} in {list(allowed)} (what a JetSpec head computes), got {value!r}")
    target_hidden = extra.get("target_hidden_size", normal.hidden_size)
    if target_hidden != normal.hidden_size:
        raise ValueError(
            f"expected dflash_config.target_hidden_size equal to hidden_size ({normal.hidden_size}), got "
            f"{target_hidden}: the reference's random hidden-size adapter has no JetSpec counterpart"
        )


def attention_fields(config: dict, normal: PretrainedConfig, checkpoint_format: str) -> dict:
    """`layer_types`, `sliding_window`, `block_attention` (and `layer_block_attention` for a mix) of a dflash /
    muse_glimmer_assistant head, in the conventions of [`JetSpecConfig`] (a sliding slot sees keys with
    `p - k < sliding_window`)."""
    declared = list(getattr(normal, "layer_types", None) or ["full_attention"] * normal.num_hidden_layers)
    window = getattr(normal, "sliding_window", None)
    if checkpoint_format == "muse_glimmer_assistant":
        causal, window = False, None if window is None else window + 1  # |p - k| <= W in transformers' mask
    else:
        extra = config.get("dflash_config") or {}
        votes = {
            "is_causal": config.get("is_causal"),
            "dflash_config.causal": extra.get("causal"),
            "dflash_config.causal_head": extra.get("causal_head"),
        }
        votes = {k: bool(v) for k, v in votes.items() if v is not None}
        if len(set(votes.values())) > 1:
            raise ValueError(
                f"expected is_causal, dflash_config.causal and dflash_config.causal_head to agree, got {votes}"
            )
        # DFlash's block is bidirectional by default; z-lab's loader makes sliding layers causal when no flag is set
        per_layer = ["causal" if t == "sliding_attention" else "bidirectional" for t in declared]
        if not votes and len(set(per_layer)) > 1:
            fields = attention_layers(declared, window)
            return dict(fields, layer_block_attention=per_layer, block_attention="bidirectional")
        causal = next(iter(votes.values()), per_layer[0] == "causal")
    return dict(attention_layers(declared, window), block_attention="causal" if causal else "bidirectional")


def attention_layers(declared: list, window: int | None) -> dict:
    """`layer_types` and `sliding_window` of a head: a sliding layer without a window attends to everything."""
    if set(declared) - set(LAYER_TYPES):
        raise ValueError(f"expected layer_types among {LAYER_TYPES} (what a JetSpec head computes), got {declared}")
    layer_types = [t if window is not None else "full_attention" for t in declared]
    return dict(layer_types=layer_types, sliding_window=window if "sliding_attention" in layer_types else None)


def feature_fields(config: dict, normal: PretrainedConfig, checkpoint_format: str, overrides: dict) -> dict:
    """`target_layer_ids` and `target_num_hidden_layers` (the target's depth) of a dflash / muse head."""
    num_target_layers = _field(config, "num_target_layers")
    layer_ids = _field(config, "target_layer_ids")
    if layer_ids is None and checkpoint_format == "dflash" and num_target_layers is not None:
        layer_ids = _reference_layer_ids(num_target_layers, normal.num_hidden_layers)
    if layer_ids is None:
        raise ValueError("expected target_layer_ids (in dflash_config or at the top level of config.json), got none")
    fields = dict(target_layer_ids=list(layer_ids))
    if num_target_layers is not None:
        fields["target_num_hidden_layers"] = num_target_layers
    elif "target_num_hidden_layers" not in overrides:
        raise ValueError(
            "expected num_target_layers in config.json (the depth of the target the head was trained for), got "
            "none: pass target_num_hidden_layers=<target's num_hidden_layers> to from_pretrained"
        )
    return fields


def mask_fields(config: dict, vocab_size: int, has_mask_embedding: bool) -> dict:
    """The MASK of a dflash / muse head: the target's row of `mask_token_id`, or a shipped trained vector."""
    mask_token_id = _field(config, "mask_token_id")
    if mask_token_id is None:
        raise ValueError("expected mask_token_id (in dflash_config or at the top level of config.json), got none")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"expected mask_token_id inside the target vocabulary [0, {vocab_size}) (a DFlash MASK is the "
            f"target's embedding row of that id), got {mask_token_id}"
        )
    if has_mask_embedding:  # the trained vector replaces the row: the head embeds MASK itself (config.mask_id)
        return dict(mask_source="head", mask_token_id=mask_token_id, dflash_mask_token_id=mask_token_id)
    return dict(mask_source="target", mask_token_id=mask_token_id)


def jetspec_fields(config: dict, checkpoint_format: str, has_mask_embedding: bool, overrides: dict) -> dict:
    """[`JetSpecConfig`] fields of a dflash / muse_glimmer_assistant `config.json` dict, `overrides` applied.

    Raises `ValueError` naming the field for anything a JetSpec head cannot compute identically.
    """
    normal = _host_config(config)
    check_computable(config, normal)
    vocab_size = overrides.get("vocab_size", config.get("vocab_size"))
    if vocab_size is None:
        raise ValueError("expected vocab_size in config.json (the target's), got none: pass vocab_size=<target's>")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=normal.hidden_size,
        intermediate_size=normal.intermediate_size,
        num_hidden_layers=normal.num_hidden_layers,
        num_attention_heads=normal.num_attention_heads,
        num_key_value_heads=getattr(normal, "num_key_value_heads", None) or normal.num_attention_heads,
        head_dim=getattr(normal, "head_dim", None) or normal.hidden_size // normal.num_attention_heads,
        rms_norm_eps=normal.rms_norm_eps,
        rope_theta=(normal.rope_parameters or {}).get("rope_theta", 10000.0),
        target_hidden_size=config.get("target_hidden_size") or normal.hidden_size,
        block_size=int(_field(config, "block_size", 16)),
        max_position_embeddings=getattr(normal, "max_position_embeddings", None),
        dtype=config.get("dtype", config.get("torch_dtype")),
        **attention_fields(config, normal, checkpoint_format),
        **feature_fields(config, normal, checkpoint_format, overrides),
        **mask_fields(config, vocab_size, has_mask_embedding),
    )
    draft_vocab_size = config.get("draft_vocab_size")
    if draft_vocab_size is not None and draft_vocab_size != vocab_size:
        fields["draft_vocab_size"] = draft_vocab_size
    fields.update(overrides)
    return fields


# ----------------------------------------------------------------------------------------- import: the weights
def split_import_options(kwargs: dict, checkpoint_format: str) -> tuple[dict, dict]:
    """`(JetSpecConfig overrides, options for transformers' from_pretrained)` from a `from_pretrained` call's
    keyword arguments; a `ValueError` names any that is neither."""
    fields = set(inspect.signature(JetSpecConfig.__init__).parameters) - {"self", "kwargs"}
    kwargs = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}  # the head's code is ours
    unknown = sorted(set(kwargs) - fields - set(HUB_OPTIONS) - set(LOAD_OPTIONS))
    if unknown:
        raise ValueError(
            f"expected hub options, loading options ({', '.join(LOAD_OPTIONS)}) or JetSpecConfig fields when "
            f"importing a {checkpoint_format} head, got {unknown}"
        )
    overrides = {k: v for k, v in kwargs.items() if k in fields}
    return overrides, {k: v for k, v in kwargs.items() if k not in fields}


def read_mask_embedding(path, options: dict, mask_token_id) -> torch.Tensor | None:
    """The trained MASK vector a checkpoint ships as `mask_embedding.pt`, of shape `(H,)`, or `None`."""
    hub = {k: options[k] for k in HUB_OPTIONS if k in options}
    subfolder = hub.get("subfolder") or ""
    listed = {k: hub[k] for k in ("revision", "proxies", "token", "local_files_only", "cache_dir") if k in hub}
    if not has_file(path, str(Path(subfolder) / MASK_EMBEDDING_FILE) if subfolder else MASK_EMBEDDING_FILE, **listed):
        return None
    state = torch.load(cached_file(path, MASK_EMBEDDING_FILE, **hub), map_location="cpu", weights_only=True)
    if isinstance(state, dict):  # vLLM's convention: {"mask_token_id": id, "embedding": (H,)}
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise ValueError(
                f"expected {MASK_EMBEDDING_FILE} for mask_token_id {mask_token_id} (config.json), got "
                f"{state.get('mask_token_id')}"
            )
        state = state["embedding"]
    return state.reshape(-1)


def check_loaded_weights(info: dict, head):
    """Raise a `ValueError` for a checkpoint whose weights are not exactly those of the head its config describes.

    `t2d` (EAGLE-3's membership mask, implied by `d2t`) and, next to `d2t`, `lm_head.weight` (the target's rows of
    the draft vocabulary, which a JetSpec head reads from the attached target) are expected extras.
    """
    extras = {"t2d", "lm_head.weight"} if head.d2t is not None else {"t2d"}
    unexpected = sorted(set(info["unexpected_keys"]) - extras)
    if unexpected:
        raise ValueError(
            f"expected only the weights of the DFlash head described by its config.json, got unexpected weight(s) "
            f"{unexpected} (embeddings and LM head are the target's, never the head's)"
        )
    missing = sorted(dflash_name(k) or k for k in info["missing_keys"] if k != "mask_embedding")
    if missing:
        raise ValueError(f"expected every weight of the head described by config.json, got missing weight(s) {missing}")
    for name, got, want in sorted(info["mismatched_keys"]):
        raise ValueError(
            f"expected weight {dflash_name(name) or name} of shape {tuple(want)} (from config.json: "
            f"hidden_size, intermediate_size, heads, head_dim, target_layer_ids), got {tuple(got)}"
        )


def check_saved_weights(info: dict, path):
    """Raise a `ValueError` listing the weights a saved JetSpec head lacks or has beyond those its `config.json`
    describes (transformers would initialise the missing ones at random and drop the extra ones)."""
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if missing or unexpected:
        raise ValueError(
            f"expected exactly the weights of the head described by {path}/config.json, got missing weight(s) "
            f"{missing} and unexpected weight(s) {unexpected}; pass ignore_mismatched_sizes=True to load it anyway "
            "(missing weights start at random)"
        )


def import_checkpoint(load, path, checkpoint_format: str, config: dict, kwargs: dict):
    """A head loaded from a dflash / muse_glimmer_assistant folder or repo whose `config.json` dict is `config`.

    `load(**options)` is transformers' `from_pretrained` of the head class for `path`. Keyword arguments: hub and
    loading options (`dtype`, `device_map`, ...), passed on, and any [`JetSpecConfig`] field, which overrides the
    converted config (e.g. `target_num_hidden_layers` when the checkpoint lacks `num_target_layers`).
    """
    check_foreign_field_types(config)
    overrides, options = split_import_options(kwargs, checkpoint_format)
    mask_embedding = read_mask_embedding(path, options, _field(config, "mask_token_id"))
    converted = JetSpecConfig(**jetspec_fields(config, checkpoint_format, mask_embedding is not None, overrides))
    head, info = load(
        config=converted,
        key_mapping=IMPORT_KEY_MAPPING,
        output_loading_info=True,
        ignore_mismatched_sizes=True,
        **options,
    )
    check_loaded_weights(info, head)
    with torch.no_grad():  # mask_source="target": the slot is unused, zeros keep the state dict deterministic
        vector = mask_embedding if mask_embedding is not None else torch.zeros(head.config.hidden_size)
        head.mask_embedding.copy_(vector.to(head.mask_embedding))
    return head.eval()


# --------------------------------------------------------------------------------------------------------- export
def _export_mask_token_id(c: JetSpecConfig, mask_token_id: int | None) -> int:
    """The in-vocabulary `dflash_config.mask_token_id` of an export."""
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
    return int(mask_token_id)


def _causal_flags(c: JetSpecConfig) -> tuple[dict, dict]:
    """`(top-level, dflash_config)` block-attention flags of an export. A head mixing causal and bidirectional
    layers is written without flags, which z-lab's loader reads as causal sliding and bidirectional full layers."""
    per_layer = c.layer_block_attention
    if per_layer is not None and len(set(per_layer)) > 1:
        zlab = ["causal" if t == "sliding_attention" else "bidirectional" for t in c.layer_types]
        if per_layer != zlab:
            raise ValueError(
                f"expected layer_block_attention {zlab} (causal exactly on the sliding layers, the only mix the "
                f"DFlash format can say), got {per_layer}"
            )
        return {}, {}
    causal = c.block_attention == "causal"
    # vLLM reads the top level first and dflash_config.causal; the JetSpec reference reads causal_head
    return {"is_causal": causal}, {"causal_head": causal, "causal": causal}


def dflash_config(head, mask_token_id: int | None = None) -> Qwen3Config:
    """The `config.json` of `head` in the dflash layout, as a transformers `Qwen3Config`."""
    c = head.config
    if getattr(c, "last_context_input", False):  # a field of newer configs
        raise ValueError(
            "expected last_context_input=False to export a DFlash head (the format has no such input), got True"
        )
    top, flags = _causal_flags(c)
    extra = dict(
        architectures=["DFlashDraftModel"],
        block_size=c.block_size,
        num_target_layers=c.target_num_hidden_layers,
        target_hidden_size=c.target_hidden_size,
        **top,
        dflash_config={
            "target_layer_ids": list(c.target_layer_ids),
            "mask_token_id": _export_mask_token_id(c, mask_token_id),
            "block_size": c.block_size,
            **flags,
        },
    )
    d2t = getattr(head, "d2t", None)
    if d2t is not None:
        extra["draft_vocab_size"] = int(d2t.shape[0])
    max_positions = c.to_dict().get("max_position_embeddings") or Qwen3Config().max_position_embeddings
    sliding = "sliding_attention" in c.layer_types
    return Qwen3Config(  # a DFlash head is a Qwen3 network: silu, no biases, untied
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
        use_sliding_window=sliding,
        sliding_window=c.sliding_window if sliding else None,
        layer_types=list(c.layer_types),
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
        if not head.has_target:
            raise ValueError(
                "expected the head attached to its target (`head.attach_target(target)`) to export a reduced draft "
                "vocabulary (d2t): vLLM needs the target's LM head rows of the draft vocabulary as lm_head.weight, "
                "got no target"
            )
        lm_head = head.target_lm_head()
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
