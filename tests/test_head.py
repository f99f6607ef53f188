"""The draft head: what it stores, how its masks behave, and path-conditioned MASK probes."""

import pytest
import torch

from modeling_jetspec import JetSpecConfig, default_target_layer_ids
from tiny import tiny_head, tiny_target


def random_context(head, batch=2, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, length, head.fc.in_features, generator=g)
    return features


def test_default_target_layers_follow_the_paper():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B, as in the paper
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_target_layer_ids(2) == [0, 1]


def test_state_dict_holds_only_the_heads_own_weights():
    target = tiny_target("qwen3")
    head = tiny_head(target)
    names = set(head.state_dict())
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert {n.split(".")[0] for n in names} == {"fc", "context_norm", "layers", "norm", "mask_embedding"}
    assert "mask_embedding" in names and "fc.weight" in names
    assert head.fc.in_features == len(head.config.target_layer_ids) * 64
    assert head.config.vocab_size == target.config.vocab_size


def test_causal_block_slot_ignores_later_slots_and_bidirectional_does_not():
    target = tiny_target("llama")
    feats = random_context(tiny_head(target))
    for attention, should_change in (("causal", False), ("bidirectional", True)):
        head = tiny_head(target, block_attention=attention)
        m = head.config.mask_id
        pos = torch.arange(6, 10).expand(2, 4)
        a = head(torch.tensor([[5, m, m, m]] * 2), pos, context_features=feats).logits
        b = head(torch.tensor([[5, m, 7, 9]] * 2), pos, context_features=feats).logits
        if not should_change:
            torch.testing.assert_close(a[:, :2], b[:, :2])
        assert (not torch.allclose(a[:, 1], b[:, 1])) == should_change


def test_incremental_context_equals_one_shot_context():
    target = tiny_target("llama")
    head = tiny_head(target)
    feats = random_context(head, length=8)
    pos = torch.arange(8).expand(2, 8)
    valid = torch.ones(2, 8, dtype=torch.bool)
    whole = head.extend_context(None, feats, pos, valid)
    first = head.extend_context(None, feats[:, :5], pos[:, :5], valid[:, :5])
    parts = head.extend_context(first, feats[:, 5:], pos[:, 5:], valid[:, 5:])
    m = head.config.mask_id
    block, bpos = torch.tensor([[3, m, m]] * 2), torch.arange(8, 11).expand(2, 3)
    # same projections of the same rows, concatenated: identical up to fp32 rounding of the matmuls (~1e-7)
    torch.testing.assert_close(head(block, bpos, context=whole).logits, head(block, bpos, context=parts).logits)


def test_mask_probes_under_tree_branches_equal_linear_blocks():
    """One tree-masked forward scores MASK probes that see their own branch's real tokens (`docs/design.md`,
    "§3 Trees and masks").

    Each probe must give the same logits as the causal block [anchor, branch tokens..., MASK] run on its own.
    """
    target = tiny_target("qwen3")
    head = tiny_head(target)
    feats = random_context(head, batch=1, length=6)
    m, anchor, start = head.config.mask_id, 11, 6
    # tree: node1=20 (d1), node2=21 (d1), node3=30 under node1 (d2); probes under nodes 1, 2, 3
    tokens = torch.tensor([[anchor, 20, 21, 30, m, m, m]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])
    see = torch.zeros(7, 7, dtype=torch.bool)
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    for q, keys in ancestors.items():
        see[q, keys] = True
    mask = torch.cat([torch.ones(7, 6, dtype=torch.bool), see], dim=1)[None, None]
    probes = head(tokens, start + depth, attention_mask=mask, context_features=feats).logits[0, 4:]
    for probe, branch in zip(probes, ([20], [21], [20, 30])):
        block = torch.tensor([[anchor, *branch, m]])
        linear = head(block, start + torch.arange(block.shape[1])[None], context_features=feats).logits[0, -1]
        # same attention inputs, different padding of the softmax: equal to fp32 rounding
        torch.testing.assert_close(probe, linear, rtol=1e-5, atol=1e-5)


def test_config_round_trips_and_is_validated():
    config = JetSpecConfig(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           target_num_hidden_layers=4, block_size=6, tree_width=2,
                           rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
                           max_position_embeddings=256)
    again = JetSpecConfig.from_dict(config.to_dict())
    assert again.target_layer_ids == config.target_layer_ids and again.mask_token_id == 99 and again.mask_id == 100
    assert again.rope_parameters == config.rope_parameters and again.rope_theta == 500.0
    assert again.tree_width == 2 and again.tree_depth == 5
    # a saved config is checked again when it is read back: a tree deeper than the block is refused
    saved = {**config.to_dict(), "tree_depth": 6}
    with pytest.raises(ValueError, match=r"tree_depth in \[1, 5\] \(block_size - 1 of this head\), got 6"):
        JetSpecConfig.from_dict(saved)


def test_new_head_starts_at_the_targets_final_norm_gain():
    target = tiny_target("qwen3")
    with torch.no_grad():
        target.model.norm.weight.copy_(torch.linspace(-2.0, 3.0, 64))  # a trained-looking per-channel gain
    head = tiny_head(target)
    torch.testing.assert_close(head.norm.weight.detach(), torch.linspace(-2.0, 3.0, 64))


def test_from_target_reads_gemma4_per_layer_attention():
    """Gemma 4's config holds `head_dim` per layer (reading it globally raises): a new head takes its global
    (full-attention) layers' width and rotary, and decodes losslessly."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from tiny import prompts

    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, max_position_embeddings=512, sliding_window=4, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa",
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    target = Gemma4ForCausalLM(config).eval()
    head = tiny_head(target, tree_depth=4, tree_width=2, tree_budget=8)
    assert head.config.head_dim == 32 and head.config.num_key_value_heads == 2  # the full-attention layer's
    assert head.config.rope_parameters["rope_type"] == "proportional"  # the global layers' rotary, whole head_dim
    assert head.config.rope_parameters["partial_rotary_factor"] == 1.0
    ids, mask = prompts(2)  # lengths 9 and 5, longer than the sliding window
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    tree = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                           assistant_model=head)
    assert torch.equal(tree, plain)


def test_public_accessors_expose_the_attached_targets_io_and_the_draft_rows():
    target = tiny_target("llama")
    head = tiny_head(target, draft_vocab_size=16)
    head.set_draft_vocab(range(40, 56))
    assert head.has_target
    assert head.target_input_embeddings() is target.get_input_embeddings()
    assert head.target_lm_head() is target.get_output_embeddings()
    weight, bias = head.draft_lm_head()
    assert weight.shape == (16, target.config.hidden_size)
    torch.testing.assert_close(weight, target.get_output_embeddings().weight[40:56])  # same rows, same dtype
    assert bias is None  # Llama's LM head has no bias
    detached = type(head)(head.config)
    assert not detached.has_target
    with pytest.raises(ValueError, match="expected a target attached to the head"):
        detached.target_lm_head()


def test_a_saved_head_with_missing_or_extra_weights_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from modeling_jetspec import JetSpecDraftModel

    target = tiny_target("llama")
    head = tiny_head(target, num_hidden_layers=2)
    head.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    # a config declaring 2 layers with the weights of only 1, and one weight no head has
    kept = {name: w for name, w in weights.items() if not name.startswith("layers.1.")}
    save_file({**kept, "extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weight\(s\) \['layers\.1\.input_layernorm\.weight', .*"
                                         r"unexpected weight\(s\) \['extra\.weight'\]"):
        JetSpecDraftModel.from_pretrained(tmp_path)
    # asked for: loaded, layer 0 as saved, with transformers' loading info
    loaded, info = JetSpecDraftModel.from_pretrained(tmp_path, ignore_mismatched_sizes=True, output_loading_info=True)
    assert "layers.1.mlp.up_proj.weight" in info["missing_keys"] and set(info["unexpected_keys"]) == {"extra.weight"}
    torch.testing.assert_close(loaded.layers[0].mlp.up_proj.weight, weights["layers.0.mlp.up_proj.weight"])  # exact
    # a complete head still loads, with or without the loading info
    head.save_pretrained(tmp_path / "whole")
    again, info = JetSpecDraftModel.from_pretrained(tmp_path / "whole", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
