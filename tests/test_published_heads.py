"""Published draft heads (`docs/design.md`, "§7 Targets and checkpoint formats"): tiny copies of their `config.json`
field sets load, draft what the published format's own semantics compute, and decode losslessly.

Each fixture keeps the keys and kinds of values of a published config (z-lab Qwen3-4B/8B-DFlash-b16, z-lab
Qwen3.5 / Qwen3.6 DFlash, the JetSpec authors' Qwen3.6-35B-A3B causal head, transformers' `muse_glimmer_assistant`)
at tiny sizes, with a window of a few positions where the published one has 2048 so that windows matter in tests.
Next to it, `semantics` states by hand what the publisher's loader computes per layer (block attention, window and
its convention); `reference_draft_logits` is a plain-torch forward written from those statements alone.

The Qwen3.5 / Qwen3.6 heads decode with tiny hybrid targets of their own families (linear-attention layers, so the
round goes through `hybrid.HybridVerifier`), and also with an attention-only Qwen3 target of the same width
(`verifiers.TreeVerifier`), where their sliding windows and per-layer block attention run in the whole-tree verify.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    MuseGlimmerConfig,
    MuseGlimmerForConditionalGeneration,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

import modeling_jetspec.integration as integration
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.hybrid import HybridVerifier
from modeling_jetspec.verifiers import TreeVerifier
from jetspec.tiny import prompts, tiny_target

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 64, 4, 2, 16, 96
TARGET_LAYERS, MASK_ID, WINDOW = 4, 120, 5


# ------------------------------------------------------------------------------------------- the published configs
def qwen3_fields(num_layers, **extra):
    """The Qwen3 fields every z-lab / JetSpec DFlash config carries, at tiny sizes."""
    fields = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 512,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": TARGET_LAYERS,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "transformers_version": "5.15.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }
    fields.update(extra)
    return fields


def zlab_qwen3_b16():
    """z-lab Qwen3-4B/8B-DFlash-b16: legacy rope fields, block size at the top, no causal flag (bidirectional)."""
    config = qwen3_fields(
        3,
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=16,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        use_sliding_window=False,
        layer_types=["full_attention"] * 3,
        dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0, 1, 3]},
    )
    return config, dict(causal=[False] * 3, window=[None] * 3, theta=1000000.0)


def zlab_qwen35():
    """z-lab Qwen3.5 DFlash: rope_parameters, block size in dflash_config, all layers full, bidirectional."""
    config = qwen3_fields(
        3,
        rope_parameters={"rope_theta": 10000000, "rope_type": "default"},
        sliding_window=None,
        use_sliding_window=False,
        layer_types=["full_attention"] * 3,
        dflash_config={"block_size": 16, "mask_token_id": MASK_ID, "target_layer_ids": [0, 2, 3]},
    )
    return config, dict(causal=[False] * 3, window=[None] * 3, theta=10000000.0)


def zlab_qwen36():
    """z-lab Qwen3.6-27B-DFlash: four sliding layers and one full, no causal flag, so z-lab's loader makes the
    sliding layers causal and the full layer bidirectional; a sliding layer sees keys with `q - k < window`."""
    config = qwen3_fields(
        5,
        rope_parameters={"rope_theta": 10000000, "rope_type": "default"},
        sliding_window=WINDOW,
        use_sliding_window=True,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        dflash_config={"block_size": 16, "mask_token_id": MASK_ID, "target_layer_ids": [0, 1, 2, 3]},
    )
    return config, dict(causal=[True] * 4 + [False], window=[WINDOW] * 4 + [None], theta=10000000.0)


def jetspec_qwen36_35b_a3b():
    """The JetSpec authors' Qwen3.6-35B-A3B head: causal (dflash_config.causal_head), 8 layers, rope_parameters."""
    config = qwen3_fields(
        8,
        block_size=16,
        rope_parameters={"rope_theta": 10000000, "rope_type": "default"},
        sliding_window=None,
        use_sliding_window=False,
        layer_types=["full_attention"] * 8,
        dflash_config={"causal_head": True, "mask_token_id": MASK_ID, "target_layer_ids": [0, 1, 2, 3]},
    )
    return config, dict(causal=[True] * 8, window=[None] * 8, theta=10000000.0)


def muse_glimmer_assistant():
    """transformers' `muse_glimmer_assistant`: every layer sliding, bidirectional, no vocab size or target depth;
    transformers' bidirectional sliding mask lets a slot see keys with `|q - k| <= window`."""
    config = {
        "architectures": ["MuseGlimmerAssistantModel"],
        "attention_dropout": 0,
        "block_size": 16,
        "bos_token_id": 1,
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "layer_types": ["sliding_attention"] * 3,
        "mask_token_id": MASK_ID,
        "max_position_embeddings": 512,
        "model_type": "muse_glimmer_assistant",
        "num_attention_heads": HEADS,
        "num_hidden_layers": 3,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": WINDOW,
        "target_layer_ids": [0, 1, 3],
        "transformers_version": "5.15.0.dev0",
    }
    return config, dict(causal=[False] * 3, window=[WINDOW] * 3, inclusive=True, theta=500000.0, muse=True)


FIXTURES = {
    "zlab-qwen3-8b-b16": zlab_qwen3_b16,
    "zlab-qwen3.5": zlab_qwen35,
    "zlab-qwen3.6-27b": zlab_qwen36,
    "jetspec-qwen3.6-35b-a3b": jetspec_qwen36_35b_a3b,
    "muse-glimmer-assistant": muse_glimmer_assistant,
}


def random_weights(config, semantics, seed=0):
    """Random tensors under the checkpoint's own names, `(out, in)` linear weights, norms near 1."""
    g = torch.Generator().manual_seed(seed)

    def linear(out, inp):
        return torch.randn(out, inp, generator=g) / inp**0.5

    def gain(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    muse = semantics.get("muse", False)
    features = len(config.get("target_layer_ids") or config["dflash_config"]["target_layer_ids"]) * HIDDEN
    w = {
        ("encoder.fc.weight" if muse else "fc.weight"): linear(HIDDEN, features),
        ("encoder.output_norm_enc.weight" if muse else "hidden_norm.weight"): gain(HIDDEN),
        "norm.weight": gain(HIDDEN),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, shape in (
            ("q_proj", (HEADS * HEAD_DIM, HIDDEN)),
            ("k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
            ("v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
            ("o_proj", (HIDDEN, HEADS * HEAD_DIM)),
        ):
            w[p + f"self_attn.{name}.weight"] = linear(*shape)
        w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = gain(HEAD_DIM), gain(HEAD_DIM)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = (
            linear(INTERMEDIATE, HIDDEN),
            linear(INTERMEDIATE, HIDDEN),
        )
        w[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = gain(HIDDEN), gain(HIDDEN)
    return w


def write(folder, config, weights):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, folder / "model.safetensors")
    return folder


def load(folder, config):
    extra = {} if "vocab_size" in config else dict(vocab_size=VOCAB, target_num_hidden_layers=TARGET_LAYERS)
    return JetSpecDraftModel.from_pretrained(folder, **extra).eval()


# ------------------------------------------------------------------------------ the reference network, by hand
def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions, theta):
    """Rotary at absolute `positions`, half-split layout, the whole head dimension. `x` of shape `(T, heads, D)`."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv_freq  # (T, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def visible(s, block, causal, window, inclusive):
    """What block slot q (at position s + q) sees of keys at positions 0..s+block-1: `(block, s + block)` bool."""
    q = torch.arange(s, s + block)[:, None]
    k = torch.arange(s + block)[None, :]
    see = torch.ones(block, s + block, dtype=torch.bool)
    if causal:
        see &= k <= q
    if window is not None:
        see &= (q - k).abs() <= window if inclusive else (q - k < window) & (causal | (k - q < window))
    return see


def reference_draft_logits(config, semantics, w, target, prompt, block):
    """Per-depth draft logits `(block - 1, V)` for one prompt `(1, S)`: context = RMSNorm(fc(target layers)), block
    `[anchor, MASK x (block - 1)]` at positions S.., every layer attending, through its own k/v projections, to the
    context and the block as `semantics` says, at the config's rotary base."""
    muse, eps = semantics.get("muse", False), config["rms_norm_eps"]
    layer_ids = config.get("target_layer_ids") or config["dflash_config"]["target_layer_ids"]
    out = target(prompt, output_hidden_states=True)
    s = prompt.shape[1]
    features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    fc, norm = ("encoder.fc.weight", "encoder.output_norm_enc.weight") if muse else ("fc.weight", "hidden_norm.weight")
    context = rms_norm(features @ w[fc].T, w[norm], eps)  # (S, H)
    anchor = int(out.logits[0, -1].argmax())
    h = target.get_input_embeddings().weight[torch.tensor([anchor] + [MASK_ID] * (block - 1))]  # (block, H)
    block_pos, all_pos, theta = torch.arange(s, s + block), torch.arange(s + block), semantics["theta"]
    for i, (causal, window) in enumerate(zip(semantics["causal"], semantics["window"])):
        p = f"layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = rms_norm(
            (x @ w[p + "self_attn.q_proj.weight"].T).view(block, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"], eps
        )
        kv_in = torch.cat([context, x])  # (S + block, H)
        k = rms_norm(
            (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM),
            w[p + "self_attn.k_norm.weight"],
            eps,
        )
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = rotate(q, block_pos, theta), rotate(k, all_pos, theta)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / HEAD_DIM**0.5
        scores = scores.masked_fill(~visible(s, block, causal, window, semantics.get("inclusive", False)), -torch.inf)
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(block, HEADS * HEAD_DIM)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["norm.weight"], eps)
    return (h @ target.get_output_embeddings().weight.T)[1:]  # slot i drafts depth i


def head_draft_logits(head, target, prompt):
    """The same block drafted by the imported head through its decoding path (`extend_context`, default masks)."""
    head.attach_target(target)
    out = target(prompt, output_hidden_states=True)
    s, b = prompt.shape[1], head.config.block_size
    context = head.extend_context(
        None, head.target_features(out.hidden_states), torch.arange(s)[None], torch.ones(1, s, dtype=torch.bool)
    )
    block = torch.tensor([[int(out.logits[0, -1].argmax())] + [head.config.mask_token_id] * (b - 1)])
    return head.draft(block, torch.arange(s, s + b)[None], context).logits[0, 1:]


# ---------------------------------------------------------------------------------------------------- targets
def qwen3_target():
    return tiny_target("qwen3", num_hidden_layers=TARGET_LAYERS, intermediate_size=INTERMEDIATE)


def hybrid_config(text_config_class, **extra):
    """A tiny Qwen3.5 / Qwen3.6 text config: linear-attention layers with one full-attention layer in four."""
    return text_config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
        **extra,
    )


def qwen35_target():
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(hybrid_config(Qwen3_5TextConfig)).eval()


def qwen35_moe_target():
    torch.manual_seed(0)
    config = hybrid_config(
        Qwen3_5MoeTextConfig,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return Qwen3_5MoeForCausalLM(config).eval()


def muse_glimmer_target():
    """Muse-Glimmer's text decoder (sliding layers, every fourth full), with a one-layer vision tower never used."""
    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2)
    config = MuseGlimmerConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=126,
        video_token_id=127,
        out_hidden_size=HIDDEN,
        projector_hidden_size=32,
    )
    config._attn_implementation = "sdpa"
    return MuseGlimmerForConditionalGeneration(config).eval()


# --------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", FIXTURES)
@torch.no_grad()
def test_published_head_drafts_like_its_format(tmp_path, name):
    config, semantics = FIXTURES[name]()
    weights = random_weights(config, semantics)
    head = load(write(tmp_path / name, config, weights), config)
    target = qwen3_target()
    block = head.config.block_size
    assert block == 16 and head.config.mask_token_id == MASK_ID and head.config.mask_source == "target"
    for seed, length in ((0, 11), (1, 13)):  # longer than the window, so windows cut keys out
        prompt = torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
        want = reference_draft_logits(config, semantics, weights, target, prompt, block)
        # fp32, same math in another order (sdpa vs explicit softmax): ~1e-6 relative; a wrong window, mask,
        # position, norm or name moves logits by O(0.1)
        torch.testing.assert_close(head_draft_logits(head, target, prompt), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["zlab-qwen3.6-27b", "muse-glimmer-assistant"])
@torch.no_grad()
def test_windows_and_per_layer_block_attention_matter(tmp_path, name):
    """The checks above would pass with windows ignored if no key fell outside them: this one fails then."""
    config, semantics = FIXTURES[name]()
    weights = random_weights(config, semantics)
    head = load(write(tmp_path / name, config, weights), config)
    target, prompt = qwen3_target(), torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(2))
    got = head_draft_logits(head, target, prompt)
    unwindowed = dict(semantics, window=[None] * len(semantics["window"]))
    assert not torch.allclose(got, reference_draft_logits(config, unwindowed, weights, target, prompt, 16), atol=1e-3)
    if name == "zlab-qwen3.6-27b":
        assert head.config.layer_block_attention == ["causal"] * 4 + ["bidirectional"]
        all_bidirectional = dict(semantics, causal=[False] * 5)
        other = reference_draft_logits(config, all_bidirectional, weights, target, prompt, 16)
        assert not torch.allclose(got, other, atol=1e-3)


def decode_losslessly(head, target, new_tokens=24):
    """Tree decoding with `head` returns plain greedy's tokens, every row's new tokens counted."""
    ids, mask = prompts(2)  # lengths 9 and 5, left-padded: the windows slide during decoding
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens)
    tree = target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        assistant_model=head,
        tree_depth=4,
        tree_width=2,
        tree_budget=8,
    )
    assert torch.equal(tree, plain)
    assert head.last_stats.new_tokens == 2 * new_tokens


@pytest.mark.parametrize(
    "name,make_target,verifier",
    [
        ("zlab-qwen3-8b-b16", qwen3_target, TreeVerifier),  # the matching target: Qwen3
        # the matching target: Muse-Glimmer's sliding decoder
        ("muse-glimmer-assistant", muse_glimmer_target, TreeVerifier),
        # heads of hybrid targets, with an attention-only target of the same width (their sliding windows and
        # per-layer block attention in the whole-tree verify) and with their own hybrid targets (the hybrid verifier)
        ("zlab-qwen3.5", qwen3_target, TreeVerifier),
        ("zlab-qwen3.6-27b", qwen3_target, TreeVerifier),
        ("jetspec-qwen3.6-35b-a3b", qwen3_target, TreeVerifier),
        ("zlab-qwen3.5", qwen35_target, HybridVerifier),
        ("zlab-qwen3.6-27b", qwen35_target, HybridVerifier),
        ("jetspec-qwen3.6-35b-a3b", qwen35_moe_target, HybridVerifier),
    ],
)
def test_published_head_decodes_losslessly(tmp_path, monkeypatch, name, make_target, verifier):
    config, semantics = FIXTURES[name]()
    head = load(write(tmp_path / name, config, random_weights(config, semantics)), config)
    chosen, verifier_for = [], integration.verifier_for
    monkeypatch.setattr(integration, "verifier_for", lambda *args: chosen.append(verifier_for(*args)) or chosen[-1])
    decode_losslessly(head, make_target())
    # the case the target is for: a hybrid target's rounds go through the hybrid verifier, an attention one's not
    assert [type(v) for v in chosen] == [verifier]


def test_dflash2_head_is_refused_by_name(tmp_path):
    """z-lab's DFlash2 (Qwen3.8-27B-DFlash2, Muse-Glimmer-30B-DFlash2): convolutions and a candidate selector."""
    config = qwen3_fields(
        2,
        architectures=["DFlash2DraftModel"],
        is_causal=False,
        layer_types=["sliding_attention"] * 2,
        sliding_window=WINDOW,
        use_sliding_window=True,
        use_cache=False,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        dflash_config={
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": MASK_ID,
            "output_multiplier": 0.196,
            "selector_rank": 8,
            "selector_top_k": 4,
            "target_layer_ids": [0, 1, 3],
        },
    )
    folder = write(tmp_path / "dflash2", config, {"norm.weight": torch.ones(HIDDEN)})
    with pytest.raises(ValueError, match=r"DFlash2DraftModel.*convolutions.*candidate selector"):
        JetSpecDraftModel.from_pretrained(folder)
