"""The draft head: what it stores, how its masks behave, and path-conditioned MASK probes."""

import pytest
import torch

from modeling_jetspec import JetSpecConfig, default_target_layer_ids
from jetspec.tiny import tiny_head, tiny_target


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
    torch.testing.assert_close(head.draft(block, bpos, whole).logits, head.draft(block, bpos, parts).logits)


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
    config = JetSpecConfig(
        vocab_size=100,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_num_hidden_layers=4,
        block_size=6,
        tree_width=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
        max_position_embeddings=256,
    )
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

    from jetspec.tiny import prompts

    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
        max_position_embeddings=512,
        sliding_window=4,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    target = Gemma4ForCausalLM(config).eval()
    head = tiny_head(target, tree_depth=4, tree_width=2, tree_budget=8)
    assert head.config.head_dim == 32 and head.config.num_key_value_heads == 2  # the full-attention layer's
    assert head.config.rope_parameters["rope_type"] == "proportional"  # the global layers' rotary, whole head_dim
    assert head.config.rope_parameters["partial_rotary_factor"] == 1.0
    ids, mask = prompts(2)  # lengths 9 and 5, longer than the sliding window
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    tree = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, assistant_model=head)
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
    with pytest.raises(
        ValueError,
        match=r"missing weight\(s\) \['layers\.1\.input_layernorm\.weight', .*"
        r"unexpected weight\(s\) \['extra\.weight'\]",
    ):
        JetSpecDraftModel.from_pretrained(tmp_path)
    # asked for: loaded, layer 0 as saved, with transformers' loading info
    loaded, info = JetSpecDraftModel.from_pretrained(tmp_path, ignore_mismatched_sizes=True, output_loading_info=True)
    assert "layers.1.mlp.up_proj.weight" in info["missing_keys"] and set(info["unexpected_keys"]) == {"extra.weight"}
    torch.testing.assert_close(loaded.layers[0].mlp.up_proj.weight, weights["layers.0.mlp.up_proj.weight"])  # exact
    # a complete head still loads, with or without the loading info
    head.save_pretrained(tmp_path / "whole")
    again, info = JetSpecDraftModel.from_pretrained(tmp_path / "whole", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


# --------------------------------------------------------------------------------- calling conventions and state
def test_training_forward_equals_decoding_draft_over_the_same_context():
    """`forward` (the Trainer's call: raw features, projected on the fly) and `draft` (decoding: a cached context)
    compute the same network: one block after the whole context gives the same logits either way."""
    target = tiny_target("llama")
    head = tiny_head(target)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = head.target_features(target(ids, output_hidden_states=True).hidden_states)  # (2, 7, kH)
        positions = torch.arange(7).expand(2, 7)
        context = head.extend_context(None, features, positions, torch.ones(2, 7, dtype=torch.bool))
        block = torch.full((2, 5), head.config.mask_id)
        block[:, 0] = ids[:, -1]
        block_positions = 7 + torch.arange(5).expand(2, 5)
        trained = head(input_ids=block, position_ids=block_positions, context_features=features)
        drafted = head.draft(block, block_positions, context)
    # same operations in the same order: equal up to fp32 rounding of the fused projection done twice
    torch.testing.assert_close(trained.logits, drafted.logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(drafted.logits[:, 1], drafted.logits[:, 2])  # the depths differ: the test can fail


def test_decoding_through_forward_is_refused_by_name():
    target = tiny_target("llama")
    head = tiny_head(target)
    features = random_context(head, batch=1, length=4)
    context = head.extend_context(None, features, torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool))
    block = torch.full((1, 3), head.config.mask_id)
    with pytest.raises(ValueError, match=r"got also \['context'\]; decode over a cached context with `head.draft"):
        head(block, torch.arange(4, 7)[None], context=context)
    with pytest.raises(ValueError, match="expected position_ids, a context and exactly one of input_ids"):
        head.draft(block, torch.arange(4, 7)[None], None)


def test_stack_target_states_selects_layers_then_the_final_state():
    from modeling_jetspec import stack_target_states

    target = tiny_target("llama")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states  # embeddings, layer 0, layer 1 (final, normed)
        only = target(ids, output_hidden_states=[2]).hidden_states  # the others come back as None
    stacked = stack_target_states(states, [1, 0], final=True)  # (1, 5, 3 * 64)
    torch.testing.assert_close(stacked, torch.cat([states[2], states[1], states[-1]], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(stack_target_states(only, [1]), states[2], rtol=0, atol=0)
    with pytest.raises(
        ValueError,
        match=r"hidden states of target layers \[0\], got a forward with 2 layers that "
        r"returned none for layers \[0\]",
    ):
        stack_target_states(only, [0])
    with pytest.raises(ValueError, match=r"returned none for layers \[2\]"):
        stack_target_states(states, [0, 2])


def _tensors_in(value, seen=None) -> list:
    """Every tensor reachable through the fields, lists, tuples and dicts of `value` (each object once: cycles end)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, seen)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, seen)]
    if hasattr(value, "__dict__"):
        return [t for v in vars(value).values() for t in _tensors_in(v, seen)]
    return []


def test_no_call_leaves_tensors_on_the_head():
    """Per-call state: a tree call's statistics (`last_stats`) are host numbers; the chain drafter's context (the
    head's keys/values) is released when `chain_generate` returns, its record of sources kept; transformers' DFlash
    generator's context goes with that generator's cache (a weak key) when its call ends."""
    import gc

    from modeling_jetspec import chain_generate, install_generate_hook, uninstall_generate_hook

    target = tiny_target("llama")
    head = tiny_head(target)
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=head)
    assert head.last_stats.rounds >= 1 and _tensors_in(head.last_stats) == []
    target.generate(ids, max_new_tokens=6, do_sample=False, custom_generate=chain_generate, jetspec_head=head)
    generator = head.last_candidate_generator
    assert generator.sources and generator.context is None
    during = []
    draft = head.draft
    head.draft = lambda *args, **kwargs: (during.append(len(head.dflash_contexts)), draft(*args, **kwargs))[1]
    uninstall_generate_hook()
    try:
        target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=head, speculation_type="dflash")
    finally:
        install_generate_hook()
        del head.draft
    gc.collect()
    assert during and min(during) == 1  # the generation held its context while it ran
    assert len(head.dflash_contexts) == 0
    # the models' own weights are reachable through the generator's references to them; nothing else may be
    weights = {id(t) for model in (head, target) for t in [*model.parameters(), *model.buffers()]}
    weights |= {id(t) for model in (head, target) for t in _tensors_in(model._modules)}  # e.g. rotary frequencies
    kept = {
        name: [t for t in _tensors_in(value) if id(t) not in weights]
        for name, value in vars(head).items()
        if name not in ("_parameters", "_buffers", "_modules", "_target_io", "config")
    }
    assert {name: t for name, t in kept.items() if t} == {}
