"""The config a new head is sized from (arXiv 2606.18394, section 3.1): the target's vocabulary, hidden and attention
sizes and rotary, read through the text decoder's config (a multimodal target's text part; the global layers of a
target whose attention fields differ per layer).
"""

from transformers import PreTrainedModel

from .configuration_jetspec import default_target_layer_ids


def head_fields(target: PreTrainedModel) -> dict:
    """The [`JetSpecConfig`] fields of a new head sized for `target`: its vocabulary, hidden and attention sizes,
    rotary, and the target layers the head reads (`default_target_layer_ids`)."""
    text = decoder_config(target)
    layer = global_layer_config(text)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3/4): the global layers' rotary
        rope = dict(rope["full_attention"])
    if "partial_rotary_factor" in rope:  # the head rotates its whole head_dim
        rope["partial_rotary_factor"] = 1.0
    return dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        # MoE-only targets (Qwen3.5-MoE) have no dense MLP size: the experts' sum of the routed ones
        intermediate_size=getattr(text, "intermediate_size", None)
        or text.moe_intermediate_size * text.num_experts_per_tok,
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads,
        head_dim=getattr(layer, "head_dim", None) or text.hidden_size // layer.num_attention_heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
        rope_parameters=rope or None,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        target_hidden_size=text.hidden_size,
        target_num_hidden_layers=text.num_hidden_layers,
        target_layer_ids=default_target_layer_ids(text.num_hidden_layers),
    )


def decoder_config(model: PreTrainedModel):
    """The text decoder's config of a model (a multimodal model's text part)."""
    return model.config.get_text_config(decoder=True)


def global_layer_config(text):
    """The config of the target's first full-attention layer when attention fields differ per layer (Gemma 4's
    per-layer `head_dim`: reading it from the whole config raises), else `text` itself."""
    if not text.is_heterogeneous:
        return text
    layer_types = list(getattr(text, "layer_types", None) or [])
    index = layer_types.index("full_attention") if "full_attention" in layer_types else 0
    return text.per_layer_config[index]
