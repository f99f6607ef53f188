"""Checkpoint import and export (`docs/design.md`, "§7 Targets and checkpoint formats"): published DFlash / JetSpec-reference /
`muse_glimmer_assistant` heads load as JetSpec heads, and ours export to the DFlash layout vLLM and SGLang serve.

Foreign checkpoints are written here with random weights, in each layout's exact key names and config fields.
An imported head must draft what `reference_draft_logits`, an independent plain-torch forward of the DFlash
network, drafts; decode losslessly; and survive round trips through the other layout tensor for tensor.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from jetspec.cli import main
from modeling_jetspec import JetSpecConfig, JetSpecDraftModel
from jetspec.tiny import prompts, tiny_head, tiny_target

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 64, 4, 2, 16, 96
TARGET_LAYERS, DRAFT_LAYERS, BLOCK, MASK_ID = 3, 2, 6, 120
LAYER_IDS = [0, 2]
THETA = 10000.0
LAYOUTS = ("jetspec_reference", "zlab", "vllm", "muse_glimmer_assistant")


def target_for(arch, **overrides):
    return tiny_target(arch, num_hidden_layers=TARGET_LAYERS, **overrides)


# ----------------------------------------------------------------------------------------- foreign checkpoints
def dflash_weights(seed=0, muse=False):
    """Random tensors under DFlash names, `(out, in)` linear weights, norms near 1."""
    g = torch.Generator().manual_seed(seed)

    def linear(out, inp):
        return torch.randn(out, inp, generator=g) / inp**0.5

    def gain(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {
        ("encoder.fc.weight" if muse else "fc.weight"): linear(HIDDEN, len(LAYER_IDS) * HIDDEN),
        ("encoder.output_norm_enc.weight" if muse else "hidden_norm.weight"): gain(HIDDEN),
        "norm.weight": gain(HIDDEN),
    }
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = linear(HIDDEN, HEADS * HEAD_DIM)
        w[p + "self_attn.q_norm.weight"] = gain(HEAD_DIM)
        w[p + "self_attn.k_norm.weight"] = gain(HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        w[p + "input_layernorm.weight"] = gain(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = gain(HIDDEN)
    return w


def dflash_config_dict(layout, causal):
    """`config.json` of each layout, as its authors write it."""
    qwen3 = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        use_sliding_window=False,
        rope_theta=THETA,
        dtype="float32",
    )
    if layout == "jetspec_reference":  # hao-ai-lab/JetSpec: causal_head in dflash_config, block_size at the top
        return dict(
            qwen3,
            block_size=BLOCK,
            num_target_layers=TARGET_LAYERS,
            auto_map={"AutoModel": "dflash.DFlashDraftModel"},
            dflash_config={"target_layer_ids": LAYER_IDS, "mask_token_id": MASK_ID, "causal_head": causal},
        )
    if layout == "zlab":  # z-lab/dflash: everything in dflash_config, top-level is_causal when causal
        config = dict(
            qwen3,
            num_target_layers=TARGET_LAYERS,
            dflash_config={"target_layer_ids": LAYER_IDS, "mask_token_id": MASK_ID, "block_size": BLOCK},
        )
        if causal:
            config["is_causal"] = True
        return config
    if layout == "vllm":  # vLLM's reading: top-level is_causal and dflash_config.causal
        return dict(
            qwen3,
            block_size=BLOCK,
            num_target_layers=TARGET_LAYERS,
            is_causal=causal,
            dflash_config={"target_layer_ids": LAYER_IDS, "mask_token_id": MASK_ID, "causal": causal},
        )
    if layout == "muse_glimmer_assistant":  # transformers' built-in assistant: always bidirectional, no vocab size
        return dict(
            architectures=["MuseGlimmerAssistantModel"],
            model_type="muse_glimmer_assistant",
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            num_hidden_layers=DRAFT_LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            rope_parameters={"rope_theta": THETA, "rope_type": "default"},
            max_position_embeddings=512,
            layer_types=["full_attention"] * DRAFT_LAYERS,
            block_size=BLOCK,
            mask_token_id=MASK_ID,
            target_layer_ids=LAYER_IDS,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    raise ValueError(f"unknown layout {layout!r}")


def write_checkpoint(folder, config, weights, mask_vector=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, folder / "model.safetensors")
    if mask_vector is not None:
        torch.save(
            {"mask_token_id": config["dflash_config"]["mask_token_id"], "embedding": mask_vector},
            folder / "mask_embedding.pt",
        )
    return folder


def import_head(folder, layout="zlab"):
    extra = dict(target_num_hidden_layers=TARGET_LAYERS, vocab_size=VOCAB) if layout == "muse_glimmer_assistant" else {}
    return JetSpecDraftModel.from_pretrained(folder, **extra)


# ------------------------------------------------------------------------------ the reference network, by hand
def rms_norm(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions):
    """Rotary at absolute `positions` (half-split layout). `x` of shape `(T, heads, D)`."""
    d = x.shape[-1]
    inv_freq = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv_freq  # (T, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_draft_logits(w, target, prompt, causal, muse=False, mask_vector=None):
    """Per-depth draft logits `(BLOCK - 1, V)` of a DFlash head for one prompt `(1, S)`, written from the format's
    description: context = RMSNorm(fc(target layers)), block `[anchor, MASK x (BLOCK - 1)]` at positions
    S..S+BLOCK-1 embedded by the target (the MASK as the target's row of MASK_ID unless `mask_vector`), every
    layer attending to the context (through its own k/v projections and k-norm) and to the block."""
    fc = w["encoder.fc.weight" if muse else "fc.weight"]
    hidden_norm = w["encoder.output_norm_enc.weight" if muse else "hidden_norm.weight"]
    out = target(prompt, output_hidden_states=True)
    s = prompt.shape[1]
    features = torch.cat([out.hidden_states[i + 1][0] for i in LAYER_IDS], dim=-1)  # (S, 2H)
    context = rms_norm(features @ fc.T, hidden_norm)  # (S, H)
    anchor = int(out.logits[0, -1].argmax())
    table = target.get_input_embeddings().weight
    h = table[torch.tensor([anchor] + [MASK_ID] * (BLOCK - 1))]  # (BLOCK, H)
    if mask_vector is not None:
        h = torch.cat([h[:1], mask_vector.expand(BLOCK - 1, -1)])
    block_pos, all_pos = torch.arange(s, s + BLOCK), torch.arange(s + BLOCK)
    visible = torch.ones(BLOCK, s + BLOCK, dtype=torch.bool)
    if causal:
        visible[:, s:] = torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril()
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(BLOCK, HEADS, HEAD_DIM)
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"])
        kv_in = torch.cat([context, x])  # (S + BLOCK, H)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"])
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = rotate(q, block_pos), rotate(k, all_pos)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / HEAD_DIM**0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(BLOCK, HEADS * HEAD_DIM)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["norm.weight"])
    return (h @ target.get_output_embeddings().weight.T)[1:]  # slot i drafts depth i


def head_draft_logits(head, target, prompt):
    """The same block drafted by a JetSpec head: `(block_size - 1, V)`."""
    head.attach_target(target)
    out = target(prompt, output_hidden_states=True)
    s, b = prompt.shape[1], head.config.block_size
    anchor = int(out.logits[0, -1].argmax())
    block = torch.tensor([[anchor] + [head.config.mask_id] * (b - 1)])
    drafted = head(
        input_ids=block,
        position_ids=torch.arange(s, s + b)[None],
        context_features=head.target_features(out.hidden_states),
    )
    return drafted.logits[0, 1:]


def prompt_ids(seed=0):
    return torch.randint(1, VOCAB, (1, 11), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------- import
IMPORT_CASES = [
    (layout, arch, causal)
    for layout in LAYOUTS
    for arch in ("qwen3", "llama")
    for causal in (False, True)
    if not (layout == "muse_glimmer_assistant" and causal)
]


@pytest.mark.parametrize(
    "layout,arch,causal", IMPORT_CASES, ids=[f"{lay}-{a}-{'causal' if c else 'bidir'}" for lay, a, c in IMPORT_CASES]
)
@torch.no_grad()
def test_imported_head_drafts_like_the_reference_forward(tmp_path, layout, arch, causal):
    target = target_for(arch)
    muse = layout == "muse_glimmer_assistant"
    weights = dflash_weights(muse=muse)
    folder = write_checkpoint(tmp_path / "head", dflash_config_dict(layout, causal), weights)
    head = import_head(folder, layout)
    assert head.config.block_attention == ("causal" if causal else "bidirectional")
    assert head.config.mask_source == "target" and head.config.mask_token_id == MASK_ID
    assert head.config.target_layer_ids == LAYER_IDS and head.config.target_num_hidden_layers == TARGET_LAYERS
    for seed in range(2):
        prompt = prompt_ids(seed)
        want = reference_draft_logits(weights, target, prompt, causal, muse=muse)
        got = head_draft_logits(head, target, prompt)
        # fp32, same math in another order (sdpa vs explicit softmax, fused vs split projections): agreement to
        # ~1e-6 relative; a wrong mask, position, norm or name moves logits by O(0.1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the block attention matters here, so the causal/bidirectional assertion above is not vacuous
    other = reference_draft_logits(weights, target, prompt_ids(0), not causal, muse=muse)
    assert not torch.allclose(head_draft_logits(head, target, prompt_ids(0)), other, atol=1e-3)


@torch.no_grad()
def test_imported_trained_mask_vector_is_used(tmp_path):
    """A checkpoint shipping `mask_embedding.pt` (vLLM's convention) drafts with that vector, not the target's row."""
    target = target_for("qwen3")
    weights, vector = dflash_weights(), torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    folder = write_checkpoint(tmp_path / "head", dflash_config_dict("vllm", True), weights, mask_vector=vector)
    head = import_head(folder)
    assert head.config.mask_source == "head" and head.config.dflash_mask_token_id == MASK_ID
    assert torch.equal(head.mask_embedding, vector)
    want = reference_draft_logits(weights, target, prompt_ids(), True, mask_vector=vector)
    torch.testing.assert_close(head_draft_logits(head, target, prompt_ids()), want, rtol=1e-4, atol=1e-4)  # as above


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_imported_head_decodes_losslessly(tmp_path, arch, causal):
    target = target_for(arch)
    folder = write_checkpoint(tmp_path / "head", dflash_config_dict("jetspec_reference", causal), dflash_weights())
    head = import_head(folder).eval()
    ids, mask = prompts(2)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    tree = target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=20,
        assistant_model=head,
        tree_depth=4,
        tree_width=2,
        tree_budget=8,
    )
    assert torch.equal(tree, plain)
    assert head.last_stats.new_tokens == 40


def test_import_options_sharded_weights_dtype_and_overrides(tmp_path):
    weights = dflash_weights()
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dflash_config_dict("zlab", False)))
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / shard)
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    head = JetSpecDraftModel.from_pretrained(folder, dtype=torch.bfloat16, tree_budget=20, tree_width=2)
    assert head.dtype == torch.bfloat16 and not head.training
    assert (head.config.tree_budget, head.config.tree_width) == (20, 2)
    assert torch.equal(head.layers[1].mlp.up_proj.weight, weights["layers.1.mlp.up_proj.weight"].bfloat16())
    with pytest.raises(ValueError, match=r"JetSpecConfig fields.*\['tree_breadth'\]"):
        JetSpecDraftModel.from_pretrained(folder, tree_breadth=3)


def test_imported_head_decodes_losslessly_with_path_conditioning(tmp_path):
    """Path-conditioned probes are MASK ids too: with the MASK as a target row they must still verify exactly."""
    target = target_for("qwen3")
    folder = write_checkpoint(tmp_path / "head", dflash_config_dict("vllm", True), dflash_weights())
    head = import_head(folder)
    ids, mask = prompts(2)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    tree = target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=16,
        assistant_model=head,
        tree_depth=3,
        tree_width=2,
        tree_budget=6,
        path_conditioning=True,
    )
    assert torch.equal(tree, plain)


def test_reference_default_layer_ids_follow_the_paper():
    """Without `dflash_config.target_layer_ids` the JetSpec reference spaces one feature layer per draft layer."""
    from modeling_jetspec.checkpoint_formats import _reference_layer_ids

    assert _reference_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, the paper's layers
    assert _reference_layer_ids(36, 1) == [18]


# ------------------------------------------------------------------------------------------------- round trips
def state_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
@torch.no_grad()
def test_ours_to_dflash_to_ours_keeps_every_tensor(tmp_path, block_attention):
    target = target_for("llama")
    head = tiny_head(target, num_hidden_layers=2, target_layer_ids=LAYER_IDS, block_attention=block_attention)
    head.save_pretrained(tmp_path / "dflash", checkpoint_format="dflash")

    exported = load_file(tmp_path / "dflash" / "model.safetensors")
    assert "hidden_norm.weight" in exported and "context_norm.weight" not in exported
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in exported)
    mask_file = torch.load(tmp_path / "dflash" / "mask_embedding.pt", weights_only=True)
    assert mask_file["mask_token_id"] == VOCAB - 1 and torch.equal(mask_file["embedding"], head.mask_embedding)

    again = JetSpecDraftModel.from_pretrained(tmp_path / "dflash")
    state_equal(head.state_dict(), again.state_dict())
    for field in (
        "block_attention",
        "target_layer_ids",
        "block_size",
        "mask_source",
        "mask_token_id",
        "rope_theta",
        "target_num_hidden_layers",
        "head_dim",
        "rms_norm_eps",
    ):
        assert getattr(again.config, field) == getattr(head.config, field), field
    assert torch.equal(head_draft_logits(again, target, prompt_ids()), head_draft_logits(head, target, prompt_ids()))


@pytest.mark.parametrize(
    "layout,causal,with_mask", [("jetspec_reference", True, False), ("zlab", False, False), ("vllm", True, True)]
)
@torch.no_grad()
def test_dflash_to_ours_to_dflash_keeps_every_tensor(tmp_path, layout, causal, with_mask):
    target = target_for("qwen3")
    weights = dflash_weights()
    vector = torch.randn(HIDDEN) if with_mask else None
    config = dflash_config_dict(layout, causal)
    original = write_checkpoint(tmp_path / "original", config, weights, mask_vector=vector)
    head = import_head(original)
    head.save_pretrained(tmp_path / "ours")
    ours = JetSpecDraftModel.from_pretrained(tmp_path / "ours")
    ours.save_pretrained(tmp_path / "back", checkpoint_format="dflash")

    state_equal(weights, load_file(tmp_path / "back" / "model.safetensors"))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["dflash_config"]["target_layer_ids"] == LAYER_IDS
    assert back["dflash_config"]["mask_token_id"] == MASK_ID
    assert back["dflash_config"]["causal_head"] is back["dflash_config"]["causal"] is back["is_causal"] is causal
    assert back["block_size"] == back["dflash_config"]["block_size"] == BLOCK
    assert back["num_target_layers"] == TARGET_LAYERS and back["max_position_embeddings"] == 512
    assert (tmp_path / "back" / "mask_embedding.pt").exists() == with_mask
    if with_mask:
        assert torch.equal(torch.load(tmp_path / "back" / "mask_embedding.pt", weights_only=True)["embedding"], vector)
    first = head_draft_logits(head, target, prompt_ids())
    assert torch.equal(head_draft_logits(import_head(tmp_path / "back"), target, prompt_ids()), first)
    assert torch.equal(head_draft_logits(ours, target, prompt_ids()), first)


@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
def test_exported_config_loads_as_qwen3_config(tmp_path, block_attention):
    target = target_for("qwen3")
    head = tiny_head(target, num_hidden_layers=2, target_layer_ids=LAYER_IDS, block_attention=block_attention)
    head.save_pretrained(tmp_path, checkpoint_format="dflash", mask_token_id=100)
    config = Qwen3Config.from_pretrained(tmp_path)
    causal = block_attention == "causal"
    assert config.model_type == "qwen3" and config.architectures == ["DFlashDraftModel"]
    assert config.is_causal is causal and config.dflash_config["causal"] is causal
    assert config.dflash_config["causal_head"] is causal
    assert config.dflash_config == {
        "target_layer_ids": LAYER_IDS,
        "mask_token_id": 100,
        "block_size": 8,
        "causal_head": causal,
        "causal": causal,
    }
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (HIDDEN, 2, HEAD_DIM)
    assert config.block_size == 8 and config.num_target_layers == TARGET_LAYERS
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": head.config.rope_theta}
    assert set(config.layer_types) == {"full_attention"}
    assert torch.load(tmp_path / "mask_embedding.pt", weights_only=True)["mask_token_id"] == 100


@torch.no_grad()
def test_reduced_draft_vocabulary_exports_d2t_and_lm_head_rows(tmp_path):
    target = target_for("llama")
    head = tiny_head(target, num_hidden_layers=2, target_layer_ids=LAYER_IDS, draft_vocab_size=32)
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:32].sort().values
    head.set_draft_vocab(keep)
    head.save_pretrained(tmp_path, checkpoint_format="dflash")
    exported = load_file(tmp_path / "model.safetensors")
    assert exported["d2t"].dtype == torch.int64 and torch.equal(exported["d2t"] + torch.arange(32), keep)
    assert torch.equal(exported["lm_head.weight"], target.get_output_embeddings().weight[keep])
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 32
    again = JetSpecDraftModel.from_pretrained(tmp_path)
    state_equal(head.state_dict(), again.state_dict())
    assert torch.equal(head_draft_logits(again, target, prompt_ids()), head_draft_logits(head, target, prompt_ids()))


def test_reduced_draft_vocabulary_export_needs_the_target(tmp_path):
    target = target_for("llama")
    head = tiny_head(target, num_hidden_layers=2, target_layer_ids=LAYER_IDS, draft_vocab_size=32)
    head.set_draft_vocab(range(32))
    head.save_pretrained(tmp_path / "saved")
    loaded = JetSpecDraftModel.from_pretrained(tmp_path / "saved")  # no target attached yet
    assert not loaded.has_target
    with pytest.raises(ValueError, match="attached to its target"):
        loaded.save_pretrained(tmp_path / "dflash", checkpoint_format="dflash")


# ------------------------------------------------------------------------------------------------- bad inputs
def broken(config=None, weights=None, **dflash_fields):
    config = config if config is not None else dflash_config_dict("jetspec_reference", True)
    config = json.loads(json.dumps(config))
    if dflash_fields:
        config["dflash_config"].update(dflash_fields)
    return config, weights if weights is not None else dflash_weights()


def without(weights, name):
    return {k: v for k, v in weights.items() if k != name}


BAD_CHECKPOINTS = {
    "layer id beyond the target's depth": (broken(target_layer_ids=[0, TARGET_LAYERS]), "target_layer_ids"),
    "mask id outside the vocabulary": (broken(mask_token_id=VOCAB), "mask_token_id"),
    "missing weight": (
        broken(weights=without(dflash_weights(), "layers.1.mlp.up_proj.weight")),
        r"missing weight.*layers\.1\.mlp\.up_proj\.weight",
    ),
    "unexpected bias": (
        broken(weights={**dflash_weights(), "layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
        r"unexpected weight.*layers\.0\.self_attn\.q_proj\.bias",
    ),
    "own embeddings": (
        broken(weights={**dflash_weights(), "embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}),
        r"unexpected weight.*embed_tokens\.weight",
    ),
    "layer beyond num_hidden_layers": (
        broken(weights={**dflash_weights(), "layers.2.mlp.up_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN)}),
        r"unexpected weight.*layers\.2\.mlp\.up_proj\.weight",
    ),
    "hidden size of fc": (
        broken(weights={**dflash_weights(), "fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}),
        r"fc\.weight of shape \(64, 128\)",
    ),
    "conflicting causal flags": (broken(config={**dflash_config_dict("vllm", True), "is_causal": False}), "is_causal"),
    "sliding layer type not allowed": (
        broken(config={**dflash_config_dict("zlab", False), "layer_types": ["chunked_attention"] * 2}),
        "layer_types",
    ),
    "partial rotary": (
        broken(
            config={
                **dflash_config_dict("zlab", False),
                "rope_parameters": {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.25},
            }
        ),
        "partial_rotary_factor",
    ),
    "logit softcapping": (broken(final_logit_softcapping=20.0), "final_logit_softcapping"),
    "DFlash2": (
        broken(config={**dflash_config_dict("zlab", False), "architectures": ["DFlash2DraftModel"]}),
        r"DFlash2DraftModel.*candidate selector",
    ),
    "no mask id": (
        broken(config={**dflash_config_dict("zlab", False), "dflash_config": {"target_layer_ids": LAYER_IDS}}),
        "mask_token_id",
    ),
    "scaled rotary": (
        broken(
            config={
                **dflash_config_dict("zlab", False),
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            }
        ),
        "rope_type",
    ),
    "biased attention": (
        broken(config={**dflash_config_dict("zlab", False), "attention_bias": True}),
        "attention_bias",
    ),
    "no target depth": (
        broken(config={k: v for k, v in dflash_config_dict("zlab", False).items() if k != "num_target_layers"}),
        "num_target_layers",
    ),
    "other architecture": (
        broken(config={**dflash_config_dict("zlab", False), "architectures": ["DFlash2DraftModel"]}),
        "architectures",
    ),
    "not a head": (broken(config={**dflash_config_dict("zlab", False), "model_type": "llama"}), "model_type"),
    # an outside campaign's inputs that crashed inside the conversion: refused by name before it
    "mask id a string": (
        broken(
            config={
                **dflash_config_dict("zlab", False),
                "dflash_config": {"target_layer_ids": LAYER_IDS, "mask_token_id": str(MASK_ID)},
            }
        ),
        f"mask_token_id to be an int, got str '{MASK_ID}'",
    ),
    "dflash_config a list": (
        broken(config={**dflash_config_dict("zlab", False), "dflash_config": [LAYER_IDS]}),
        "dflash_config to be a dict, got list",
    ),
    "layer ids a string": (
        broken(
            config={
                **dflash_config_dict("zlab", False),
                "dflash_config": {"target_layer_ids": "0,1", "mask_token_id": MASK_ID},
            }
        ),
        "target_layer_ids to be a list of ints",
    ),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS, ids=list(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_a_value_error_naming_the_field(tmp_path, case):
    (config, weights), message = BAD_CHECKPOINTS[case]
    folder = write_checkpoint(tmp_path / "head", config, weights)
    with pytest.raises(ValueError, match=message):
        JetSpecDraftModel.from_pretrained(folder)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("hidden_size", 32, "hidden size 64, got a target with hidden size 32"),
        ("vocab_size", 100, "vocab size 128, got a target with vocab size 100"),
        ("num_hidden_layers", 2, "number of layers 3, got a target with number of layers 2"),
    ],
)
def test_target_mismatch_is_a_value_error_naming_the_field(tmp_path, field, value, message):
    folder = write_checkpoint(tmp_path / "head", dflash_config_dict("zlab", False), dflash_weights())
    head = import_head(folder)
    other = tiny_target("llama", **{"num_hidden_layers": TARGET_LAYERS, field: value})
    with pytest.raises(ValueError, match=message):
        head.attach_target(other)


def test_export_errors_name_the_field(tmp_path):
    target = target_for("llama")
    head = tiny_head(target, num_hidden_layers=2, target_layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="expected checkpoint_format in"):
        head.save_pretrained(tmp_path, checkpoint_format="eagle3")
    with pytest.raises(ValueError, match=r"mask_token_id inside the target vocabulary \[0, 128\).*got 128"):
        head.save_pretrained(tmp_path, checkpoint_format="dflash", mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="expected only mask_token_id"):
        head.save_pretrained(tmp_path, checkpoint_format="dflash", push_to_hub=True)
    assert not (tmp_path / "config.json").exists()  # nothing written before the checks
    imported = import_head(write_checkpoint(tmp_path / "foreign", dflash_config_dict("zlab", False), dflash_weights()))
    with pytest.raises(ValueError, match=f"expected mask_token_id {MASK_ID}"):
        imported.save_pretrained(tmp_path / "out", checkpoint_format="dflash", mask_token_id=3)
    extended = tiny_head(target, num_hidden_layers=2, target_layer_ids=LAYER_IDS, last_context_input=True)
    with pytest.raises(ValueError, match="last_context_input"):
        extended.save_pretrained(tmp_path, checkpoint_format="dflash")


def test_config_mask_source_rules():
    with pytest.raises(ValueError, match=r"mask_token_id inside the target vocabulary \[0, 128\)"):
        JetSpecConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            target_num_hidden_layers=TARGET_LAYERS,
            mask_source="target",
            mask_token_id=VOCAB,
        )
    with pytest.raises(ValueError, match="mask_source in"):
        JetSpecConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            target_num_hidden_layers=TARGET_LAYERS,
            mask_source="tokenizer",
        )


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_convert_both_ways(tmp_path, capsys):
    target = target_for("qwen3")
    original = write_checkpoint(tmp_path / "dflash", dflash_config_dict("zlab", True), dflash_weights())
    assert main(["convert", str(original), str(tmp_path / "ours"), "--to", "jetspec"]) == 0
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "jetspec"
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0  # --to dflash by default
    state_equal(dflash_weights(), load_file(tmp_path / "back" / "model.safetensors"))
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["convert", str(original), str(tmp_path / "y"), "--to", "eagle3"])
    assert JetSpecDraftModel.from_pretrained(tmp_path / "back").config.block_attention == "causal"
    head_draft_logits(JetSpecDraftModel.from_pretrained(tmp_path / "ours"), target, prompt_ids())
