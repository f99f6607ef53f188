"""The lossless matrix over transformers' decoder-only families: speculative output == plain greedy, token for token.

Every family is a tiny random target built in-process from its own config class (2 layers, hidden 64, vocabulary
128, fp32, no download), decoded with an untrained head sized by `JetSpecDraftModel.from_target`:
  (a) batch 1;
  (b) batch 3, left-padded prompts of different lengths, and an EOS token that one row emits mid-answer, so rows
      stop at different rounds.
A family is either lossless or refused up front with a `ValueError` that names the layer types it cannot verify.
"""

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from modeling_jetspec import JetSpecDraftModel
from jetspec.tiny import prompts

VOCAB = 128
# fields every family of the matrix shrinks to, when its config has them
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)
MLA = dict(
    head_dim=8,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=1,
)  # keys and values of different last sizes
LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)  # gated delta-net layers (Qwen3.5, Qwen3-Next)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16)  # Mamba-2 layers
# model type -> (config overrides, attention implementation); sliding windows smaller than the answers
ATTENTION_FAMILIES = {
    "llama": ({}, "sdpa"),
    "mistral": ({"sliding_window": 8}, "sdpa"),
    "mixtral": ({}, "sdpa"),
    "ministral": ({"sliding_window": 8}, "sdpa"),
    "qwen2": ({}, "sdpa"),
    "qwen2_moe": ({}, "sdpa"),
    "qwen3": ({}, "sdpa"),
    "qwen3_moe": ({}, "sdpa"),
    "gemma": ({}, "sdpa"),
    "gemma2": ({"sliding_window": 8}, "eager"),
    "gemma3_text": ({"sliding_window": 8}, "sdpa"),
    "gemma4_text": ({"sliding_window": 8, "global_head_dim": 32}, "sdpa"),
    "phi": ({}, "sdpa"),
    "phi3": ({}, "sdpa"),
    "phimoe": ({}, "sdpa"),
    "olmo": ({}, "sdpa"),
    "olmo2": ({}, "sdpa"),
    "olmo3": ({"sliding_window": 8}, "sdpa"),
    "olmoe": ({}, "sdpa"),
    "flex_olmo": ({}, "sdpa"),
    "smollm3": ({}, "sdpa"),
    "glm": ({}, "sdpa"),
    "glm4": ({}, "sdpa"),
    "glm4_moe": ({"first_k_dense_replace": 1}, "sdpa"),
    "cohere": ({}, "sdpa"),
    "cohere2": ({"sliding_window": 8}, "sdpa"),
    "granite": ({}, "sdpa"),
    "granitemoe": ({}, "sdpa"),
    "exaone4": ({"sliding_window": 8}, "sdpa"),
    "gpt_oss": ({"sliding_window": 8}, "eager"),
    "deepseek_v2": (MLA, "sdpa"),
    "deepseek_v3": (MLA, "sdpa"),
    "starcoder2": ({}, "sdpa"),
    "stablelm": ({}, "sdpa"),
    "gpt_neox": ({}, "sdpa"),
    "seed_oss": ({}, "sdpa"),
    "hunyuan_v1_dense": ({}, "sdpa"),
    "ernie4_5": ({}, "sdpa"),
    "helium": ({}, "sdpa"),
    "internlm3": ({}, "sdpa"),
    "apertus": ({}, "sdpa"),
    "arcee": ({}, "sdpa"),
    "minimax_m2": ({}, "sdpa"),
    "dots1": ({}, "sdpa"),
    "nanochat": ({}, "sdpa"),
    "vaultgemma": ({"sliding_window": 8}, "eager"),
}
# hybrid families, verified by modeling_jetspec/hybrid.py ("auto": chain or tree, per round): one linear-attention,
# Mamba or convolution layer and one attention layer
HYBRID_FAMILIES = {
    "qwen3_5_text": ({**LINEAR, "layer_types": ["linear_attention", "full_attention"]}, "sdpa"),
    "qwen3_5_moe_text": ({**LINEAR, "layer_types": ["linear_attention", "full_attention"]}, "sdpa"),
    "qwen3_next": ({**LINEAR, "layer_types": ["linear_attention", "full_attention"]}, "sdpa"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "sdpa"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"], "num_dense_layers": 1}, "sdpa"),
    "olmo_hybrid": ({**LINEAR, "layer_types": ["linear_attention", "full_attention"]}, "sdpa"),
    "jamba": ({"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 8}, "sdpa"),
    "granitemoehybrid": ({**MAMBA2, "layer_types": ["linear_attention", "full_attention"]}, "sdpa"),
    "bamba": ({**MAMBA2, "attn_layer_indices": [1]}, "sdpa"),
    "nemotron_h": (
        {
            "layers_block_type": ["mamba", "attention", "moe"],
            "num_hidden_layers": 3,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "chunk_size": 16,
            "n_groups": 1,
        },
        "sdpa",
    ),  # + a
    # cacheless MoE layer
    "kimi_linear": (
        {
            **MLA,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "mlp_layer_types": ["dense", "sparse"],
        },
        "sdpa",
    ),  # KDA + MLA
}
# families neither verification path handles: refused, naming the layer types (or, MiniMax, its own cache class)
REFUSED = {
    "llama4_text": ({"attention_chunk_size": 8}, "sdpa", "chunked_attention"),
    "zamba2": (
        {
            "layers_block_type": ["mamba", "hybrid"],
            "mamba_d_state": 8,
            "mamba_headdim": 16,
            "n_mamba_heads": 8,
            "chunk_size": 16,
        },
        "sdpa",
        "'hybrid'",
    ),  # a mamba layer plus a shared attention block in one layer
    "minimax": ({"layer_types": ["linear_attention", "full_attention"]}, "sdpa", "cache of its own"),
}


def family_target(model_type: str, overrides: dict, attention: str):
    """A 2-layer random target of `model_type`, eval mode, fp32."""
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    fields = {name: value for name, value in {**TINY, **overrides}.items() if has_field(default, name)}
    fields.update({name: value for name, value in overrides.items() if name == "layer_types"})
    config = config_class(**fields)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


def has_field(config, name: str) -> bool:
    """Whether the config class knows `name` (a field of Gemma 4's per-layer kind refuses a global read)."""
    return name in config.to_dict() or name in config.attribute_map or hasattr(config, name)


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=14, **kwargs)


def head_for(target):
    torch.manual_seed(1)
    return JetSpecDraftModel.from_target(
        target, num_hidden_layers=1, block_size=8, tree_depth=3, tree_width=2, tree_budget=6
    ).eval()


def lossless_cases():
    for family, (overrides, attention) in {**ATTENTION_FAMILIES, **HYBRID_FAMILIES}.items():
        for batch in (1, 3):
            yield pytest.param(family, overrides, attention, batch, id=f"{family}-bs{batch}")


@pytest.mark.parametrize("family,overrides,attention,batch", lossless_cases())
def test_family_is_lossless(family, overrides, attention, batch):  # (a), (b)
    target = family_target(family, overrides, attention)
    ids, mask = prompts(batch, vocab_size=VOCAB)
    kwargs = {}
    if batch > 1:  # an EOS that row 1 emits mid-answer: rows finish in different rounds
        free = greedy(target, ids, mask)
        kwargs = {"eos_token_id": int(free[1, ids.shape[1] + 5])}
    plain = greedy(target, ids, mask, **kwargs)
    head = head_for(target)
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    tree = greedy(target, ids, mask, assistant_model=head, **kwargs)
    hook.remove()
    assert torch.equal(tree, plain)
    if batch > 1:
        assert (plain[:, ids.shape[1] :] == kwargs["eos_token_id"]).any(), "the test needs a row that stops on EOS"
        assert (plain[:, -1] == 0).any(), "the test needs a row that stops early"
    # the tree loop decoded (its statistics are this call's), and they count every forward the target ran: the
    # prefill, and each verify, scan step or replay of its verifier
    assert head.last_stats.rounds >= 1 and head.last_stats.target_forwards == len(forwards)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_is_refused_by_layer_type(family):
    overrides, attention, layer_type = REFUSED[family]
    target = family_target(family, overrides, attention)
    ids, mask = prompts(1, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=layer_type):
        greedy(target, ids, mask, assistant_model=head_for(target))
