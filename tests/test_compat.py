"""Every private or undocumented transformers name the package touches (`modeling_jetspec/compat.py`), checked
against the installed transformers: the attribute, signature or class exists and behaves as the tree loop assumes.
An upgrade of transformers that moves one of them fails here, in one place.

The last test keeps the list whole: an underscore attribute used anywhere in `modeling_jetspec/`, `jetspec/` or
`training/` outside `compat.py` must be the project's own name (or a listed extension point).
"""

import ast
import inspect
from pathlib import Path

import pytest
import torch
from test_architectures import HYBRID_FAMILIES, family_target
from transformers import AttentionInterface, DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation import logits_process as lp
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling_jetspec import compat
from modeling_jetspec.decode import _decode
from jetspec.tiny import prompts, tiny_target

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("modeling_jetspec", "jetspec", "training")
# the private names compat.py reads, by where they live in transformers
TOUCHED = {
    PretrainedConfig: ["_attn_implementation"],
    GenerationMixin: ["_sample", "_assisted_decoding", "_get_candidate_generator"],
}
# transformers' documented extension points a model class overrides or sets (not wrapped: they stay in the class)
EXTENSION_POINTS = {"_init_weights", "_no_split_modules", "_keys_to_ignore_on_load_missing"}
# torch's, not transformers': `Tensor._version` (the in-place version counter keying the head's cached d2t gather)
TORCH_PRIVATE = {"_version", "_is_avx512_bf16_supported"}


@pytest.mark.parametrize("owner,name", [(o, n) for o, names in TOUCHED.items() for n in names])
def test_touched_private_names_exist(owner, name):
    assert hasattr(owner, name), f"transformers {owner.__name__}.{name} is gone: update modeling_jetspec/compat.py"


def test_extension_points_exist():
    for name in EXTENSION_POINTS:
        assert hasattr(PreTrainedModel, name), name


def test_attn_implementation_reads_what_set_attn_implementation_set():
    target = tiny_target("llama")
    assert compat.attn_implementation(target) == "sdpa"
    target.set_attn_implementation("eager")
    assert compat.attn_implementation(target) == "eager"


def test_set_attention_implementation_switches_every_attention_layer():
    # what `shared_past.rows_attention` relies on: an attention layer looks its function up from its config at every
    # call, and the model's config reaches the layers' (a hybrid target's text config included)
    target = family_target("qwen3_5_text", *HYBRID_FAMILIES["qwen3_5_text"])
    calls = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return sdpa(module, *args, **kwargs)

    AttentionInterface.register("test_recording", recording)
    ids = torch.tensor([[1, 2, 3]])
    before = compat.set_attention_implementation(target, "test_recording")
    try:
        with torch.no_grad():
            target(ids)
    finally:
        compat.set_attention_implementation(target, before)
    assert before == "sdpa" and compat.decoder_attention_implementation(target) == "sdpa"
    assert calls and compat.attn_implementation(target) == "sdpa"
    attention = next(m for m in target.modules() if type(m).__name__ == calls[0])
    assert compat.eager_attention_of(attention).__name__ == "eager_attention_forward"


def _config_seen_by_decoding(target, **kwargs):
    """The generation config `generate` hands a callable `custom_generate`."""
    seen = {}

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        seen["config"] = generation_config
        return input_ids

    ids, mask = prompts(2)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, custom_generate=decode, **kwargs)
    return seen["config"]


def test_pad_token_tensor_is_pad_else_first_eos():
    target = tiny_target("llama")
    config = _config_seen_by_decoding(target, pad_token_id=7, eos_token_id=[5, 6])
    assert isinstance(compat.pad_token_tensor(config), torch.Tensor) and int(compat.pad_token_tensor(config)) == 7
    config = _config_seen_by_decoding(target, pad_token_id=None, eos_token_id=[5, 6])
    assert int(compat.pad_token_tensor(config)) == 5


def test_decode_mirrors_sample_and_receives_its_own_arguments():
    sample = list(inspect.signature(GenerationMixin._sample).parameters)
    ours = list(inspect.signature(_decode).parameters)
    # generate calls a decoding method as method(model, input_ids, logits_processor=, stopping_criteria=,
    # generation_config=, ...): the first five parameters line up
    assert sample[:5] == ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"]
    assert ours[1:5] == sample[1:5]
    # `model` is the callable's first positional argument (`self` in `_sample`), never passed by keyword
    assert compat.custom_decode_kwargs(_decode) - {"model"} == {
        "jetspec_head",
        "jetspec_point",  # the static path's own (`static.static_decode`); from `generate`, refused as a model kwarg
        "jetspec_round_hook",
        "jetspec_answer_cache",
        "jetspec_rows",
        "jetspec_shape",
        "jetspec_streamer",
        "jetspec_verifier",
    }
    # and generate really routes a callable's extra keyword to it (what custom_decode_kwargs assumes)
    seen = {}

    def decode(
        model, input_ids, logits_processor, stopping_criteria, generation_config, jetspec_probe=None, **model_kwargs
    ):
        seen["probe"] = jetspec_probe
        return input_ids

    ids, mask = prompts(1)
    tiny_target("llama").generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=2, custom_generate=decode, jetspec_probe="here"
    )
    assert seen["probe"] == "here"


def test_assisted_decoding_takes_what_assisted_decoding_with_passes():
    params = list(inspect.signature(GenerationMixin._assisted_decoding).parameters)
    assert params[:5] == ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"]
    assert {"synced_gpus", "streamer"} <= set(params)
    assert "generation_config" in inspect.signature(GenerationMixin._get_candidate_generator).parameters


L = 6  # prompt length of the processor batch (1 for ForcedBOSTokenLogitsProcessor, which acts at length 1 only)
ROW_WISE = {  # every class of compat.ROW_WISE_PROCESSORS, built with settings that change the scores
    lp.EpsilonLogitsWarper: lambda: lp.EpsilonLogitsWarper(epsilon=0.05),
    lp.EtaLogitsWarper: lambda: lp.EtaLogitsWarper(epsilon=0.05),
    lp.ExponentialDecayLengthPenalty: lambda: lp.ExponentialDecayLengthPenalty((2, 1.5), 3, 2),
    lp.ForcedBOSTokenLogitsProcessor: lambda: lp.ForcedBOSTokenLogitsProcessor(bos_token_id=1),
    lp.ForcedEOSTokenLogitsProcessor: lambda: lp.ForcedEOSTokenLogitsProcessor(max_length=L + 1, eos_token_id=3),
    lp.InfNanRemoveLogitsProcessor: lambda: lp.InfNanRemoveLogitsProcessor(),
    lp.LogitNormalization: lambda: lp.LogitNormalization(),
    lp.MinLengthLogitsProcessor: lambda: lp.MinLengthLogitsProcessor(min_length=10, eos_token_id=3),
    lp.MinNewTokensLengthLogitsProcessor: lambda: lp.MinNewTokensLengthLogitsProcessor(2, 10, eos_token_id=3),
    lp.MinPLogitsWarper: lambda: lp.MinPLogitsWarper(min_p=0.1),
    lp.NoBadWordsLogitsProcessor: lambda: lp.NoBadWordsLogitsProcessor([[5], [1, 2]], eos_token_id=3),
    lp.NoRepeatNGramLogitsProcessor: lambda: lp.NoRepeatNGramLogitsProcessor(ngram_size=2),
    lp.SequenceBiasLogitsProcessor: lambda: lp.SequenceBiasLogitsProcessor([[[5], 2.0], [[1, 2], -3.0]]),
    lp.SuppressTokensAtBeginLogitsProcessor: lambda: lp.SuppressTokensAtBeginLogitsProcessor([4], begin_index=L),
    lp.SuppressTokensLogitsProcessor: lambda: lp.SuppressTokensLogitsProcessor([4]),
    lp.TemperatureLogitsWarper: lambda: lp.TemperatureLogitsWarper(0.7),
    lp.TopHLogitsWarper: lambda: lp.TopHLogitsWarper(top_h=0.5),
    lp.TopKLogitsWarper: lambda: lp.TopKLogitsWarper(top_k=3),
    lp.TopPLogitsWarper: lambda: lp.TopPLogitsWarper(top_p=0.8),
    lp.TypicalLogitsWarper: lambda: lp.TypicalLogitsWarper(mass=0.9),
}


def test_every_row_wise_processor_is_checked():
    assert set(ROW_WISE) == set(compat.ROW_WISE_PROCESSORS)


@pytest.mark.parametrize("cls", list(ROW_WISE), ids=lambda cls: cls.__name__)
def test_row_wise_processors_process_a_row_alone_as_in_the_batch(cls):
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 2, 1, 2, 5, 1], [3, 3, 3, 4, 4, 2], [5, 1, 2, 6, 6, 6]])  # (3, L): repeats, bigrams
    ids = ids[:, :1] if cls is lp.ForcedBOSTokenLogitsProcessor else ids
    scores = torch.randn(3, 12, generator=g) * 3  # (3, V)
    batch = ROW_WISE[cls]()(ids, scores.clone())
    assert not torch.equal(batch, scores) or cls is lp.InfNanRemoveLogitsProcessor  # the setting does something
    for row in range(3):
        alone = ROW_WISE[cls]()(ids[row : row + 1], scores[row : row + 1].clone())
        # exact: the same row-wise arithmetic on the same values, whatever the other rows hold
        torch.testing.assert_close(alone[0], batch[row], rtol=0, atol=0)


def test_pads_finished_rows_as_sample_decides():
    """`_sample` pads a finished row only when some criterion has an `eos_token_id` (its EOS criterion); checked on
    what `generate` builds with and without an EOS token."""
    from transformers import StoppingCriteriaList

    target = tiny_target("llama")
    for eos, pads in ((None, False), (5, True)):
        seen = {}

        def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
            seen["criteria"] = stopping_criteria
            return input_ids

        ids, mask = prompts(2)
        target.generate(input_ids=ids, attention_mask=mask, custom_generate=decode, max_new_tokens=2, eos_token_id=eos)
        assert isinstance(seen["criteria"], StoppingCriteriaList)
        assert compat.pads_finished_rows(seen["criteria"]) is pads
    assert 'has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id")' in inspect.getsource(
        GenerationMixin._sample
    )  # the rule mirrored, as transformers writes it


def test_repetition_penalty_for_row_skips_that_row_s_padding():
    ids = torch.tensor([[9, 9, 1, 2], [3, 4, 5, 6]])  # row 0: two pad tokens (9) that must not be penalised
    scores = torch.ones(2, 12)
    batch = lp.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([2, 0]))
    expected = batch(ids, scores.clone())
    assert expected[0, 9] == 1.0 and expected[0, 1] == 0.5  # the padding was skipped, the prompt penalised
    for row in range(2):
        alone = compat.repetition_penalty_for_row(batch, row)
        torch.testing.assert_close(
            alone(ids[row : row + 1], scores[row : row + 1].clone())[0], expected[row], rtol=0, atol=0
        )  # exact: the same arithmetic on one row
    assert (
        compat.repetition_penalty_for_row(lp.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=1), 0) is None
    )


def test_kv_layer_entries_are_the_layer_s_own_tensors():
    layer = compat.DynamicLayer()
    assert compat.kv_layer_entries(layer) is None  # nothing cached yet
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 2)  # (B, H, S, D_k), (B, H, S, D_v)
    layer.update(keys.clone(), values.clone())
    k, v = compat.kv_layer_entries(layer)
    assert torch.equal(k, keys) and torch.equal(v, values)
    k[:, :, 1] = 0.0  # written in place (how accepted entries move), then cropped through the public API
    layer.crop(-2)
    k, v = compat.kv_layer_entries(layer)
    assert k.shape[2] == 3 and torch.equal(k[:, :, 1], torch.zeros(2, 3, 4)) and torch.equal(v, values[:, :, :3])


def test_linear_states_read_write_fill_and_record():
    layer = compat.LinearAttentionLayer()
    assert compat.linear_state_count(layer) == 1 and compat.linear_state(layer, 0) == (None, None)
    conv, rec = torch.randn(2, 4, 3), torch.randn(2, 4, 5)  # (B, C, K), (B, ...)
    compat.fill_linear_state(layer, 0, conv, rec)
    got_conv, got_rec = compat.linear_state(layer, 0)
    assert torch.equal(got_conv, conv) and torch.equal(got_rec, rec)
    assert not layer.is_croppable  # a recurrent state cannot be cut back: the hybrid chain verifier replays
    compat.set_linear_state(layer, 0, recurrent=torch.zeros(2, 4, 5))
    assert torch.equal(compat.linear_state(layer, 0)[1], torch.zeros(2, 4, 5))
    # past recording keeps every convolution input of a forward after the K before it; once it is stopped and the
    # state put back to K inputs (as the hybrid verifier does), updates keep the last K again
    layer.activate_past_recording()
    step = torch.randn(2, 4, 2)
    layer.update_conv_state(step, state_idx=0)
    recorded = compat.linear_state(layer, 0)[0]
    assert torch.equal(recorded, torch.cat([conv, step], dim=-1))  # (B, C, K + 2)
    compat.stop_past_recording(layer)
    compat.set_linear_state(layer, 0, conv=recorded[..., 1:4].clone())  # the K inputs ending at the first step
    nxt = torch.randn(2, 4, 1)
    layer.update_conv_state(nxt, state_idx=0)
    assert torch.equal(compat.linear_state(layer, 0)[0], torch.cat([recorded[..., 2:4], nxt], dim=-1))
    layer.reorder_cache(torch.tensor([1]))  # what HybridCache.batch_select_indices calls: rows are selected
    assert compat.linear_state(layer, 0)[1].shape == (1, 4, 5)
    assert not hasattr(compat.LinearAttentionLayer, "batch_select_indices")  # why HybridCache adds one
    # a layer that caches nothing (HybridCache's MoE / MLP layers): built without arguments, holding no keys or
    # values, and selecting rows as HybridCache.batch_select_indices does is a no-op
    dummy = compat.DummyLayer()
    dummy.batch_select_indices(torch.tensor([1]))
    assert dummy.keys is None and dummy.values is None


def _private_attributes(path: Path) -> set:
    """`x._name` attribute accesses in a file's code (strings and comments excluded), `self` / `cls` excluded."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def _own_names() -> set:
    """Underscore names the packages define themselves (functions, classes, attributes, variables), compat.py
    excluded (it sets transformers' `_get_candidate_generator`)."""
    names = set()
    for path in (p for package in PACKAGES for p in (REPO / package).glob("*.py") if p.name != "compat.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_")}


@torch.no_grad()
def test_growing_layer_equals_dynamic_layer_op_for_op():
    """`compat.GrowingLayer` (the tree loop's target cache) against transformers' `DynamicLayer`: the same entries
    after every update, crop, row selection, repeat and reset; the first entries are kept as they come, the next
    update moves them into a buffer with room, and later ones write in place until it is full."""
    g = torch.Generator().manual_seed(0)
    ours, theirs = compat.growing_cache(), DynamicCache()

    def update(rows: int, count: int):
        k, v = torch.randn(rows, 2, count, 4, generator=g), torch.randn(rows, 2, count, 4, generator=g)
        a, b = ours.update(k, v, 0), theirs.update(k, v, 0)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        return k

    first = update(3, 5)
    layer = ours.layers[0]
    assert isinstance(layer, compat.GrowingLayer) and layer.keys.shape == (3, 2, 5, 4)
    assert layer.keys.data_ptr() == first.data_ptr()  # the prompt's entries as they came: no copy before the answer
    update(3, 3)  # into a buffer with room
    start = layer.keys.untyped_storage().data_ptr()
    assert start != first.untyped_storage().data_ptr()
    update(3, 2)  # room left: written in place
    assert layer.keys.untyped_storage().data_ptr() == start
    for count, crop in ((4, -2), (60, -1), (300, -7)):  # the last past the room: grown, the past copied once
        update(3, count)
        ours.crop(crop), theirs.crop(crop)
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(layer.keys, theirs.layers[0].keys) and torch.equal(layer.values, theirs.layers[0].values)
    rows = torch.tensor([2, 0])
    ours.batch_select_indices(rows), theirs.batch_select_indices(rows)
    update(2, 2)
    ours.batch_repeat_interleave(2), theirs.batch_repeat_interleave(2)
    update(4, 1)
    assert torch.equal(layer.keys, theirs.layers[0].keys) and torch.equal(layer.values, theirs.layers[0].values)
    with pytest.raises(ValueError, match="negative"):
        ours.crop(2)
    ours.reset(), theirs.reset()
    assert ours.get_seq_length() == theirs.get_seq_length() == 0
    update(1, 3)
    assert torch.equal(layer.keys, theirs.layers[0].keys)


@torch.no_grad()
@pytest.mark.parametrize("odd_layer", [None, "heads", "dtype"])
def test_growing_layers_share_one_pool_and_equal_dynamic_layers(odd_layer):
    """The tree loop's cache keeps every layer's keys (values) in one buffer once the layers grow
    (`compat.EntryPool`), so compaction moves them all at once. Op for op against transformers' `DynamicCache`:
    the same entries in every layer; pooled after each growth, out of the pool after a row selection or an assigned
    tensor, back in with the next growth. A layer of other heads or dtype keeps the pool from forming: each layer
    grows on its own, with the same entries."""
    g = torch.Generator().manual_seed(2)
    ours, theirs = compat.growing_cache(), DynamicCache()
    heads = [2, 2, 3 if odd_layer == "heads" else 2]
    dtypes = [torch.float32, torch.float32, torch.float64 if odd_layer == "dtype" else torch.float32]

    def update(rows: int, count: int):
        for i, (h, dtype) in enumerate(zip(heads, dtypes)):
            k = torch.randn(rows, h, count, 4, generator=g).to(dtype)
            v = torch.randn(rows, h, count, 3, generator=g).to(dtype)  # values of another size (as under MLA)
            a, b = ours.update(k, v, i), theirs.update(k, v, i)
            assert all(torch.equal(x, y) for x, y in zip(a, b))

    def same():
        for mine, their in zip(ours.layers, theirs.layers):
            assert torch.equal(mine.keys, their.keys) and torch.equal(mine.values, their.values)

    def pooled() -> bool:
        entries = compat.pooled_entries(ours)
        if entries is not None:  # every layer a slice of the two buffers, at the length read
            keys, values, length = entries
            assert keys.shape[0] == values.shape[0] == len(ours.layers) and length == ours.get_seq_length()
            for i, layer in enumerate(ours.layers):
                assert layer.keys.data_ptr() == keys[i].data_ptr() and layer.values.data_ptr() == values[i].data_ptr()
        return entries is not None

    update(3, 5)  # the prompt: each layer's entries as they came
    assert not pooled()
    update(3, 4)  # the first verify: the layers grow, into one pool where they can
    assert pooled() is (odd_layer is None)
    ours.crop(-2), theirs.crop(-2)
    assert pooled() is (odd_layer is None)
    same()
    update(3, 300)  # past the room: the pool grows as one
    assert pooled() is (odd_layer is None)
    same()
    rows = torch.tensor([2, 0])
    ours.batch_select_indices(rows), theirs.batch_select_indices(rows)
    assert not pooled()  # each layer holds its kept rows on its own
    update(2, 1)
    same()
    assert not pooled()
    update(2, 400)  # the next growth: back in the pool
    assert pooled() is (odd_layer is None)
    same()
    compat.set_kv_layer_entries(ours.layers[1], ours.layers[1].keys.clone(), ours.layers[1].values.clone())
    assert not pooled()  # an assigned tensor leaves the pool
    same()


@torch.no_grad()
def test_growing_layer_room_holds_zeros_or_its_own_entries_never_unset_memory():
    """A fused attention kernel may read a cache view's storage a whole block past its end and mask those scores
    (inductor's compiled flex_attention on an AVX-512 host did): the masked weight is an exact 0, and 0 * NaN from
    unset memory is NaN. The CI run of the compiled flex test decoded every token after the first round as id 0 (the
    argmax of NaN logits) while the room was allocated with `new_empty`. The room past the entries holds zeros, or
    entries cropped earlier, after every growth; the first entries are kept as they come, with no room after them."""
    layer = compat.growing_cache()
    g = torch.Generator().manual_seed(1)
    for count in (5, 300, 2):  # the first entries, a growth, a write in place
        layer.update(torch.randn(2, 2, count, 4, generator=g), torch.randn(2, 2, count, 4, generator=g), 0)
        grown = layer.layers[0]
        for buffer in grown._storage:
            room = buffer[..., grown._length :, :]
            assert room.numel() == 0 if count == 5 else room.numel() > 0 and torch.equal(room, torch.zeros_like(room))
    layer.crop(-3)
    assert all(torch.isfinite(buffer).all() for buffer in layer.layers[0]._storage)


def test_key_value_groups_is_the_attention_layers_query_heads_per_key_value_head():
    target = tiny_target("llama")  # 4 query heads over 2 key/value heads
    attention = target.model.layers[0].self_attn
    assert compat.key_value_groups(attention) == 2
    assert compat.key_value_groups(torch.nn.Linear(2, 2)) == 1  # a module without grouping


def test_private_transformers_names_are_touched_only_in_compat():
    used = set()
    for package in PACKAGES:
        for path in (REPO / package).glob("*.py"):
            if path.name != "compat.py":
                used |= _private_attributes(path)
    unknown = used - _own_names() - EXTENSION_POINTS - TORCH_PRIVATE
    assert not unknown, f"private names used outside modeling_jetspec/compat.py: {sorted(unknown)}"


def test_stream_error_is_what_the_serving_handlers_show_as_an_error_event():
    from transformers.cli.serving import chat_completion, completion

    error = compat.stream_error("boom")
    # both streamed handlers test their queue's items against the class they import; `msg` is what they print
    assert isinstance(error, chat_completion._StreamError) and isinstance(error, completion._StreamError)
    assert error.msg == "boom"
