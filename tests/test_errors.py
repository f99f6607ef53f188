"""Bad input gets a ValueError naming what was expected and what came."""

import json

import pytest
import torch
from transformers import AttentionInterface, T5Config, T5ForConditionalGeneration
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from modeling_jetspec import JetSpecConfig, JetSpecDraftModel
from jetspec.tiny import prompts, tiny_head, tiny_target


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, tiny_head(target)


def run(target, head, **kwargs):
    ids, mask = prompts(1)
    return target.generate(input_ids=ids, attention_mask=mask, assistant_model=head, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize(
    "other,message",
    [
        (dict(hidden_size=32, intermediate_size=64), "hidden size 64, got a target with hidden size 32"),
        (dict(vocab_size=100), "vocab size 128, got a target with vocab size 100"),
        (dict(num_hidden_layers=3), "number of layers 2, got a target with number of layers 3"),
    ],
)
def test_head_built_for_another_target(pair, other, message):
    _, head = pair
    with pytest.raises(ValueError, match=message):
        run(tiny_target("llama", **other), head)


def test_layer_ids_out_of_range():
    with pytest.raises(ValueError, match=r"target_layer_ids within \[0, 3\].*got \[0, 4\]"):
        JetSpecConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            target_num_hidden_layers=4,
            target_layer_ids=[0, 4],
        )


def test_mask_ids_inside_and_outside_the_vocabulary():
    sizes = dict(
        vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, target_num_hidden_layers=4
    )
    # the head's own MASK: an in-vocabulary id for transformers' DFlash generator, the head's MASK id outside
    config = JetSpecConfig(**sizes, mask_token_id=5)
    assert (config.mask_token_id, config.mask_id) == (5, 100)
    # a config saved before mask_id held the out-of-vocabulary id in mask_token_id: read as the default
    legacy = JetSpecConfig(**sizes, mask_token_id=100)
    assert (legacy.mask_token_id, legacy.mask_id) == (99, 100)
    assert JetSpecConfig(**sizes, mask_token_id=100, dflash_mask_token_id=7).mask_token_id == 7
    # the target's row as MASK: the id must be one of the target's
    with pytest.raises(ValueError, match=r"mask_token_id inside the target vocabulary \[0, 100\).*got 100"):
        JetSpecConfig(**sizes, mask_source="target", mask_token_id=100)
    assert JetSpecConfig(**sizes, mask_source="target", mask_token_id=5).mask_id == 5


def test_unknown_block_attention():
    with pytest.raises(ValueError, match="block_attention in .*got 'sideways'"):
        JetSpecConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            target_num_hidden_layers=4,
            block_attention="sideways",
        )


@pytest.mark.parametrize(
    "prior,what",
    [
        ([], "got \\[\\]"),
        ([[0.5], [0.6], [0.7], [0.8]], "got \\[\\[0.5\\]"),
        ([[0.5, 0.6]], "got the row \\[0.5, 0.6\\]"),  # increasing
        ([[1.5]], "got the row \\[1.5\\]"),
        ([[0.0]], "got the row \\[0.0\\]"),
        ([[]], "got the row \\[\\]"),
        ("0.5", "got '0.5'"),
    ],
)
def test_bad_lookup_prior(prior, what):
    with pytest.raises(ValueError, match="tree_lookup_prior None or 1-3 lists .*" + what):
        JetSpecConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            target_num_hidden_layers=4,
            tree_lookup_prior=prior,
        )


def test_beam_search(pair):
    with pytest.raises(ValueError, match="num_beams == 1 .*got 3"):
        run(*pair, num_beams=3)


def test_encoder_decoder_target(pair):
    _, head = pair
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16))
    with pytest.raises(ValueError, match="decoder-only target, got an encoder-decoder model"):
        t5.generate(input_ids=torch.tensor([[1, 2, 3]]), assistant_model=head, max_new_tokens=4)


@pytest.mark.parametrize("max_new", [0, -2])
def test_max_new_tokens_not_positive(pair, max_new):
    with pytest.raises(ValueError, match=f"max_new_tokens >= 1, got {max_new}"):
        run(*pair, max_new_tokens=max_new)


def test_empty_prompt(pair):
    target, head = pair
    with pytest.raises(ValueError, match=r"non-empty prompt .*got shape \(1, 0\)"):
        target.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), assistant_model=head, max_new_tokens=4)


@pytest.mark.parametrize(
    "tree,message",
    [
        (dict(tree_budget=0), "tree_budget >= 1 draft node or 'auto', got 0"),
        (dict(tree_budget="many"), "tree_budget >= 1 draft node or 'auto', got 'many'"),
        (dict(tree_depth=8), r"tree_depth in \[1, 7\] \(block_size - 1 of this head\), got 8"),
        (dict(tree_depth=0), r"tree_depth in \[1, 7\]"),
        (dict(tree_width=0), "tree_width >= 1, got 0"),
        (dict(tree_scoring="random"), "tree_scoring .*got 'random'"),
        (dict(tree_lookup=2, tree_lookup_prior=[[0.5, 2.0]]), r"tree_lookup_prior .*got the row \[0.5, 2.0\]"),
        (dict(tree_lookup=2, tree_lookup_prior=True), "tree_lookup_prior .*got True"),
    ],
)
def test_bad_tree_shape(pair, tree, message):
    with pytest.raises(ValueError, match=message):
        run(*pair, **tree)


def test_attention_that_cannot_take_a_tree_mask():
    AttentionInterface.register("opaque_test_attention", sdpa_attention_forward)
    target = tiny_target("llama")
    target.set_attn_implementation("opaque_test_attention")
    with pytest.raises(ValueError, match="takes a 4D tree mask .*got 'opaque_test_attention'"):
        run(target, tiny_head(target))


def test_head_without_a_target():
    config = JetSpecConfig(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_num_hidden_layers=2,
        intermediate_size=64,
    )
    head = JetSpecDraftModel(config)
    m = config.mask_id
    with pytest.raises(ValueError, match="expected a target attached to the head"):
        head(torch.tensor([[1, m]]), torch.tensor([[3, 4]]), context_features=torch.randn(1, 3, 128))


def test_head_mask_of_the_wrong_shape(pair):
    _, head = pair
    m = head.config.mask_id
    feats = torch.randn(1, 3, head.fc.in_features)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 1, 2, 5\), got \(1, 1, 2, 2\)"):
        head(
            torch.tensor([[1, m]]),
            torch.tensor([[3, 4]]),
            attention_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool),
            context_features=feats,
        )


def test_default_depth_deeper_than_the_block():
    with pytest.raises(ValueError, match=r"tree_depth in \[1, 3\] \(block_size - 1 of this head\), got 5"):
        JetSpecConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            target_num_hidden_layers=4,
            block_size=4,
            tree_depth=5,
        )
    assert (
        JetSpecConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, target_num_hidden_layers=4, block_size=4
        ).tree_depth
        == 3
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(pixel_values=torch.zeros(1, 3, 8, 8)), "got also pixel_values"),
        (dict(token_type_ids=torch.zeros(1, 13, dtype=torch.long)), "got also token_type_ids"),
        (dict(position_ids=torch.arange(13)[None]), "got also position_ids"),
        (dict(inputs_embeds=torch.zeros(1, 13, 64)), "got also inputs_embeds"),
        (dict(past_key_values="a user cache"), "got also past_key_values"),
        (dict(cache_implementation="offloaded"), "cache_implementation='dynamic' .*got 'offloaded'"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=None .*got 3"),
        (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions=False .*got True"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states=False .*got True"),
        (dict(negative_prompt_ids=torch.tensor([[1, 2]])), "no `negative_prompt_ids`"),
        (dict(custom_generate="some/recipe"), "no `custom_generate`"),
        (dict(synced_gpus=True), "no `synced_gpus`"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_unsupported_generate_arguments_are_named(pair, kwargs, message):
    # each of these would change what plain generate returns; the tree loop runs its own forwards, so it refuses
    with pytest.raises(ValueError, match=message):
        run(*pair, **kwargs)


def test_unsupported_setting_inside_a_generation_config(pair):
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match="cache_implementation='dynamic' .*got 'offloaded'"):
        run(*pair, generation_config=GenerationConfig(max_new_tokens=4, cache_implementation="offloaded"))


def test_layer_types_no_verifier_handles_are_rejected_by_name():
    # recurrent and convolution layers are verified by modeling_jetspec/hybrid.py; Zamba2's "hybrid" layers (a Mamba
    # block and a shared attention block in one layer) by neither verifier
    from transformers import Zamba2Config, Zamba2ForCausalLM

    config = Zamba2Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        layers_block_type=["mamba", "hybrid"],
        mamba_d_state=8,
        mamba_headdim=16,
        n_mamba_heads=8,
        chunk_size=16,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    target = Zamba2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"layer types \['hybrid'\] \(Zamba2ForCausalLM\)"):
        run(target, tiny_head(target))


def test_auto_budget_with_path_conditioning_is_rejected(pair):
    with pytest.raises(ValueError, match="fixed tree_budget with path_conditioning=True .*got tree_budget='auto'"):
        run(*pair, tree_budget="auto", path_conditioning=True)
    with pytest.raises(ValueError, match="fixed tree_budget with path_conditioning=True"):
        JetSpecConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            target_num_hidden_layers=4,
            tree_budget="auto",
            path_conditioning=True,
        )


# ---------------------------------------------------------------------------------------- head config fields
TINY_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    target_num_hidden_layers=4,
)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        # a) wrong types that used to fail deep inside with TypeError / AttributeError
        ("hidden_size", "64", "a positive int"),
        ("block_size", 8.0, "a positive int"),
        ("target_layer_ids", "1,2", "a list of ints or None"),
        ("rope_parameters", ["default"], "a dict or None"),
        ("layer_types", "full_attention", "a list of strings or None"),
        ("mask_token_id", "x", "an int or None"),
        ("path_conditioning", "no", "a bool"),  # a non-empty string would have switched it on
        ("last_context_input", 1, "a bool"),
        # b) non-positive sizes that used to divide by zero or build empty layers
        ("num_attention_heads", 0, "a positive int"),
        ("num_key_value_heads", 0, "a positive int"),
        ("num_hidden_layers", 0, "a positive int"),
        ("intermediate_size", -3, "a positive int"),
        ("head_dim", 0, "a positive int or None"),
        ("vocab_size", None, "a positive int"),
        ("target_num_hidden_layers", True, "a positive int"),  # a bool is not a size
        ("rms_norm_eps", -1e-6, "a positive number"),
        ("initializer_range", -0.02, "a number >= 0"),
    ],
)
def test_every_config_field_is_checked_by_name(field, value, expected):
    with pytest.raises(ValueError, match=rf"expected {field} to be {expected}.*got {value!r}".replace("[", r"\[")):
        JetSpecConfig(**{**TINY_CONFIG, field: value})


def test_a_saved_config_without_the_targets_depth_is_refused_and_always_written(tmp_path):
    config = JetSpecConfig(**{**TINY_CONFIG, "target_num_hidden_layers": 36, "target_layer_ids": [1, 9]})
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["target_num_hidden_layers"] == 36  # written although it equals the default
    assert JetSpecConfig.from_pretrained(tmp_path).target_num_hidden_layers == 36
    del saved["target_num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="expected target_num_hidden_layers .* got a config without it"):
        JetSpecConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="expected target_num_hidden_layers"):
        JetSpecDraftModel.from_pretrained(tmp_path)


# ------------------------------------------------------------- inputs an outside campaign still caught, refused by name
def test_all_ones_attention_mask_shorter_than_the_prompt(pair):
    # plain `generate` fails inside the model; `generate` drops an all-ones mask before the tree loop could see it
    target, head = pair
    ids, _ = prompts(2)
    short = torch.ones(2, ids.shape[1] - 1, dtype=torch.long)
    with pytest.raises(Exception):
        target.generate(input_ids=ids, attention_mask=short, max_new_tokens=4, do_sample=False)
    calls = []
    hook = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"attention_mask of the shape of input_ids \(2, 9\), got \(2, 8\)"):
            target.generate(input_ids=ids, attention_mask=short, max_new_tokens=4, assistant_model=head)
    finally:
        hook.remove()
    assert calls == []  # before any forward


@pytest.mark.parametrize(
    "layer_ids,message",
    [
        ([0, 2], r"target_layer_ids within \[0, 1\] \(the target has 2 layers\), got \[0, 2\]"),
        ([0, 1, 1], r"expected 2 target_layer_ids \(the head's fc reads 128 features\), got 3"),
    ],
)
def test_head_layer_ids_beyond_the_target(layer_ids, message):
    target = tiny_target("llama")
    head = tiny_head(target)
    head.config.target_layer_ids = layer_ids  # changed after the head was built: its config check has passed
    calls = []
    hook = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            run(target, head)
    finally:
        hook.remove()
    assert calls == []
