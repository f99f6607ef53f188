"""Every touch of a transformers name that is private or undocumented, each named here and said why it is needed.

The tree loop runs inside `generate` and reaches into caches the library does not expose as an API: these are the
places an upgrade of transformers can break it. Each touch is one small function or constant below;
`tests/test_compat.py` checks every one against the installed transformers (the attribute, signature or class
exists and behaves as assumed), so an upgrade fails there, in one place. Where transformers has a public API
(`PreTrainedModel.set_attn_implementation`, `Cache.crop`, `Cache.batch_select_indices`, a cache layer's `update` /
`crop` / `reorder_cache` / `activate_past_recording`) the package calls it directly.

Touches that are the library's documented extension points are listed in the test but not wrapped, since they must
stay where they are: the head overrides `PreTrainedModel._init_weights` and sets `_no_split_modules` /
`_keys_to_ignore_on_load_missing` (`modeling_jetspec.py`), as every transformers model does.

This module imports nothing from the package: every other file may import it.
"""

import inspect
import sys
import weakref

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

__all__ = [
    "DummyLayer",
    "DynamicLayer",
    "EntryPool",
    "GrowingLayer",
    "LinearAttentionCacheLayerMixin",
    "LinearAttentionLayer",
    "ROW_WISE_PROCESSORS",
    "assisted_decoding_with",
    "attn_implementation",
    "crop_pooled",
    "custom_decode_kwargs",
    "decoder_attention_implementation",
    "eager_attention_of",
    "growing_cache",
    "fill_linear_state",
    "key_value_groups",
    "kv_layer_entries",
    "linear_state",
    "linear_state_count",
    "pad_token_tensor",
    "pads_finished_rows",
    "pooled_entries",
    "repetition_penalty_for_row",
    "set_attention_implementation",
    "set_linear_state",
    "stop_past_recording",
]


# ------------------------------------------------------------------------------------------------ model and generate
def attn_implementation(model) -> str:
    """The attention implementation a model runs with ("eager", "sdpa", "flash_attention_2", ...).

    transformers 5.23 has a public setter (`set_attn_implementation`, used to switch flash attention to sdpa for a
    tree mask) but no public getter: the value lives in the config's `_attn_implementation` property.
    """
    return model.config._attn_implementation


def decoder_attention_implementation(model) -> str:
    """The attention implementation the decoder's attention layers run: its text config's `_attn_implementation`
    (the model's own for a causal LM; a composite model's text sub-config may differ from its vision one's)."""
    return model.config.get_text_config(decoder=True)._attn_implementation


def set_attention_implementation(model, implementation: str) -> str:
    """Make the decoder's attention layers of `model` run `implementation` (a name in transformers'
    `AttentionInterface`) from their next call; returns the implementation they ran (the hybrid verifier's forwards
    over rows that share their past, `shared_past.py`).

    Each attention layer reads its config's `_attn_implementation` (a private property) at every call; this sets
    the decoder's text config's. The public `set_attn_implementation` does the same after checks that walk every
    module, too slow to run around forwards of a round; the text config is looked up once per config
    ([`_decoder_text_config`]).
    """
    text = _decoder_text_config(model)
    before = text._attn_implementation
    text._attn_implementation = implementation
    return before


_TEXT_CONFIGS = weakref.WeakKeyDictionary()  # model -> (its config, that config's decoder text config)


def _decoder_text_config(model):
    """`model.config.get_text_config(decoder=True)`, looked up once per config object (the lookup goes through
    transformers' config `__getattribute__` several times, about a twentieth of a millisecond, twice a round)."""
    config = model.config
    kept = _TEXT_CONFIGS.get(model)
    if kept is None or kept[0] is not config:
        kept = _TEXT_CONFIGS[model] = (config, config.get_text_config(decoder=True))
    return kept[1]


def eager_attention_of(module):
    """The eager attention function of the modeling file `module` comes from: its `eager_attention_forward`, the
    module-level function each modeling file defines and its attention layers run under "eager" (not exported)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def key_value_groups(module) -> int:
    """How many query heads share each key/value head in attention layer `module` (1 without grouped-query
    attention): the layer's `num_key_value_groups` attribute, which every modeling file's attention class sets and
    transformers' own sdpa function reads (undocumented)."""
    return getattr(module, "num_key_value_groups", 1)


def pad_token_tensor(generation_config):
    """The pad token `generate` resolved for this call (`pad_token_id`, else the first `eos_token_id`), as a
    0-dim tensor or `None`.

    `generate`'s `_prepare_special_tokens` stores it on the call's copy of the generation config as
    `_pad_token_tensor` before a decoding method runs; `_sample` reads the same attribute. Reading it (rather than
    `pad_token_id`) pads finished rows exactly as plain `generate` does.
    """
    return generation_config._pad_token_tensor


def pads_finished_rows(stopping_criteria) -> bool:
    """Whether plain decoding pads a row that a stopping criterion has finished, as `_sample` (private) decides it.

    `_sample` pads finished rows only when some criterion has an `eos_token_id` attribute (`EosTokenCriteria`, from
    the generation config's `eos_token_id`); otherwise a row that a criterion stopped keeps receiving real tokens
    until every row has stopped, and all rows end at the same length. The tree loop mirrors both.
    """
    return any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)


def custom_decode_kwargs(decode) -> set:
    """The keyword arguments `generate` hands a callable `custom_generate` besides its usual ones.

    `generate` (`_extract_generation_mode_kwargs`) passes a custom decoding method the arguments of the private
    `GenerationMixin._sample` (`input_ids`, `logits_processor`, `stopping_criteria`, `generation_config`, model
    kwargs), plus every keyword of the call that the callable names and `_sample` does not: the tree loop's
    `_decode` mirrors `_sample`'s signature and receives its `jetspec_*` arguments this way.
    """
    return set(inspect.signature(decode).parameters) - set(inspect.signature(GenerationMixin._sample).parameters)


def assisted_decoding_with(
    model,
    generator,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    **model_kwargs,
):
    """Run transformers' `_assisted_decoding` (private) with `generator` as its candidate generator (what
    `candidate_generator.chain_generate` runs).

    `_assisted_decoding` builds its generator with the model's `_get_candidate_generator` (private, no public way to
    pass one in 5.23); the instance attribute set here shadows that method for this call only.
    """
    model._get_candidate_generator = lambda **kwargs: generator
    try:
        return model._assisted_decoding(
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus=synced_gpus,
            streamer=streamer,
            **model_kwargs,
        )
    finally:
        del model._get_candidate_generator


# ------------------------------------------------------------------------------------------------ logits processors
# transformers' processors whose output row depends only on that row's tokens and scores (no batch-sized state, no
# batch index), read from their `__call__`: a node's scores are processed on its row alone. Matched by exact type (a
# subclass may override `__call__`); `processors.check_processors` names which others are honoured and refuses the rest.
# The list is kept by hand because transformers does not mark row-wise processors; the compat test runs each on a
# batch and on its rows alone.
ROW_WISE_PROCESSORS = (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


def repetition_penalty_for_row(processor: RepetitionPenaltyLogitsProcessor, row: int):
    """A repetition penalty acting on batch row `row` alone, or `None` when `processor` already acts row-wise.

    `generate` gives the penalty a per-row `prompt_ignore_length` tensor `(B,)` (each row's left padding) through
    its constructor argument of that name and keeps it in the attribute of the same name (undocumented); a row
    processed alone needs that row's entry.
    """
    skip = processor.prompt_ignore_length
    if not isinstance(skip, torch.Tensor):
        return None
    return RepetitionPenaltyLogitsProcessor(processor.penalty, prompt_ignore_length=skip[row : row + 1])


# ------------------------------------------------------------------------------------------------ cache layers
# The cache layer classes (`transformers.cache_utils`, not exported at the top level): a key/value layer
# (`DynamicLayer`), a layer that caches nothing (`DummyLayer`) and a recurrent / convolution state layer
# (`LinearAttentionLayer`, a `LinearAttentionCacheLayerMixin`), which the hybrid verifier builds caches from.


def kv_layer_entries(layer: DynamicLayer):
    """`(keys, values)` of a key/value cache layer, each `(B, H_kv, S, D)`, or `None` when the layer holds none
    (it reads another layer's keys/values).

    A `DynamicLayer` keeps them in its undocumented `keys` / `values` attributes, allocated on the first `update`
    (`is_initialized`); the tree loop moves accepted entries in place there, as `DynamicLayer.crop` slices them.
    """
    if not layer.is_initialized:
        return None
    return layer.keys, layer.values


def set_kv_layer_entries(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor):
    """Replace a key/value cache layer's entries (each `(B, H_kv, S', D)`), as `DynamicLayer.crop` does."""
    layer.keys, layer.values = keys, values


GROWTH_ROOM = 256  # entries of room a growing cache layer leaves after what it holds, at least (a quarter above)


def room_for(entries: int) -> int:
    """The capacity a [`GrowingLayer`] allocates for `entries`: a quarter more, and at least `GROWTH_ROOM` more, so
    a buffer moves a logarithmic number of times as the history grows and holds at most a quarter (or 256
    entries) unused: the tree's verify adds up to budget + 1 entries per round, which compaction crops back."""
    return entries + max(GROWTH_ROOM, entries // 4)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers that grow when full: the first `update` (a prompt)
    keeps its entries as they come, a later one writes the new entries in place after the past (moving them once
    into a buffer with room when full) and returns views, `crop` shortens the views. The room past the entries is
    zero-filled (a kernel that reads a masked block past a view multiplies its values by 0; unset memory can hold
    NaN). `DynamicLayer.update` concatenates the whole past with every new entry (`torch.cat`), a copy of the layer's
    cache per forward that grows with the history; the tree loop's verify forward appends n + 1 entries and its
    compaction crops back every round.

    The layer keeps `DynamicLayer`'s undocumented `keys` / `values` attributes as views of the buffers, so every
    reader (`get_seq_length`, `kv_layer_entries`, the model's attention) sees the same `(B, H_kv, S, D)` tensors;
    assigning them (`batch_select_indices`, `reset`, `set_kv_layer_entries`) adopts the tensors as the new buffers.
    """

    def __init__(self, *args, pool: "EntryPool | None" = None, **kwargs):
        self._storage, self._length = (None, None), 0
        self._pool, self._pooled = pool, 0  # the pool's generation whose buffers `_storage` views; 0: its own
        super().__init__(*args, **kwargs)
        if pool is not None:
            pool.members.append(self)

    def _view(self, index: int):
        buffer = self._storage[index]
        if buffer is None or buffer.dim() < 2:  # unset, or the empty placeholder of `lazy_initialization`
            return buffer
        return buffer[..., : self._length, :]

    def _adopt(self, index: int, tensor):
        buffers = list(self._storage)
        buffers[index] = tensor
        self._storage, self._pooled = tuple(buffers), 0
        self._length = tensor.shape[-2] if tensor is not None and tensor.dim() >= 2 else 0

    keys = property(lambda self: self._view(0), lambda self, tensor: self._adopt(0, tensor))
    values = property(lambda self: self._view(1), lambda self, tensor: self._adopt(1, tensor))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._storage[0] is None or self._storage[0].dim() < 2:
            # the first entries (a prompt) are kept as they come, as `DynamicLayer` keeps them: the prefill's attention
            # reads them whole, and the room comes with the first verify, after the first token is out (2-4 ms of a
            # 135M target's ~90 ms prompt forward, AVX-512 + bf16 AMD host)
            self.keys, self.values = key_states, value_states  # adopted, as an assigned tensor is
            return self.keys, self.values
        start, added = self._length, key_states.shape[-2]
        # full: larger buffers, the past copied once (every layer of the pool at once, where it can hold them all)
        if start + added > self._storage[0].shape[-2] and (self._pool is None or not self._pool.grow(added)):
            capacity = room_for(start + added)
            grown = []
            for old, new in zip(self._storage, (key_states, value_states)):
                buffer = old.new_zeros(*new.shape[:-2], capacity, new.shape[-1])
                buffer[..., :start, :] = old[..., :start, :]
                grown.append(buffer)
            self._storage, self._pooled = tuple(grown), 0
        self._storage[0][..., start : start + added, :] = key_states
        self._storage[1][..., start : start + added, :] = value_states
        self._length = start + added
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"expected a negative count of entries to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized and self._storage[0] is not None:
            self._length = max(self._length - abs(tokens_to_remove), 0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:  # the rows kept, at the buffers' capacity, out of the pool until it grows
            self._storage, self._pooled = tuple(buffer[indices, ...] for buffer in self._storage), 0


class EntryPool:
    """The keys and the values of a cache's [`GrowingLayer`]s, each in one buffer for all layers: keys `(L, B, H_kv,
    C, D_k)`, values `(L, B, H_kv, C, D_v)`, layer i's buffers their slices i. A round's compaction then moves every
    layer's accepted entries with one index per buffer instead of two per layer (30 layers: 60 small copies, about
    0.6 ms a round on a CPU; `compaction.keep_accepted_entries`).

    The layers join as they are made ([`growing_cache`]); a layer that needs room grows the whole pool, the past of
    every layer copied once. A layer's buffers leave the pool when they are replaced (an assigned tensor, rows
    selected, a growth of its own) and come back with the pool's next growth; [`pooled_entries`] reads the buffers
    only while every layer views them at one length. Layers whose entries differ in shape, dtype or device grow each
    on its own, as without a pool. A growth holds the old and the new buffers of every layer for a moment (at most
    2.25 times the cache), where layers growing one by one hold one layer's twice.
    """

    def __init__(self):
        self.members, self.buffers, self.generation = [], None, 0

    def grow(self, added: int) -> bool:
        """Move every member's entries into new buffers with room for `added` more past the longest; `False`
        (nothing moved) when the members' keys or values differ in shape past the entries, dtype or device."""
        stores = [member._storage for member in self.members]
        if any(t is None or t.dim() < 2 for store in stores for t in store):
            return False
        first = stores[0]
        if not all(_alike(k, first[0]) and _alike(v, first[1]) for k, v in stores):
            return False
        capacity = room_for(max(member._length for member in self.members) + added)
        buffers = tuple(t.new_zeros(len(stores), *t.shape[:-2], capacity, t.shape[-1]) for t in first)
        self.generation += 1
        for i, member in enumerate(self.members):
            length = member._length
            for buffer, old in zip(buffers, member._storage):
                buffer[i, ..., :length, :] = old[..., :length, :]
            member._storage, member._pooled = (buffers[0][i], buffers[1][i]), self.generation
        self.buffers = buffers
        return True


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two layers' keys (or values) fit slices of one buffer: the same shape but for their entries' count."""
    return (a.shape[:-2], a.shape[-1], a.dtype, a.device) == (b.shape[:-2], b.shape[-1], b.dtype, b.device)


def pooled_entries(cache) -> tuple | None:
    """`(keys, values, length)` of a [`growing_cache`] whose layers all view their [`EntryPool`]'s buffers at one
    length (the buffers `(L, B, H_kv, C, D)`, the entries `[..., :length, :]`), else `None`: then each layer is read
    through [`kv_layer_entries`]."""
    layers = cache.layers
    pool = getattr(layers[0], "_pool", None) if layers else None
    if pool is None or pool.buffers is None or len(pool.members) != len(layers):
        return None
    length = layers[0]._length
    for layer, member in zip(layers, pool.members):
        if layer is not member or member._pooled != pool.generation or member._length != length:
            return None
    return (*pool.buffers, length)


def crop_pooled(cache, length: int) -> None:
    """Make every layer of a cache read by [`pooled_entries`] hold its first `length` entries."""
    for layer in cache.layers:
        layer._length = length


def growing_cache():
    """A `DynamicCache` whose layers are [`GrowingLayer`]s of one [`EntryPool`], created as the model first writes to
    each (the constructor's `layer_class_to_replicate`, which `DynamicCache()` sets to `DynamicLayer`; it is called
    with no argument)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    pool = EntryPool()
    cache.layer_class_to_replicate = lambda: GrowingLayer(pool=pool)
    return cache


def linear_state_count(layer: LinearAttentionCacheLayerMixin) -> int:
    """How many (convolution, recurrent) state pairs a linear-attention layer keeps (`number_of_states`)."""
    return layer.number_of_states


def linear_state(layer: LinearAttentionCacheLayerMixin, index: int) -> tuple:
    """`(conv, recurrent)` state `index` of a linear-attention layer, each a tensor or `None` when not allocated.

    Kept in the undocumented dicts `conv_states` / `recurrent_states` with `is_*_initialized` flags; the layer's
    API writes them (`update_*_state`) but has no reader. While past recording is on, `conv` holds every input of
    the forward after the K before it, `(B, C, K + T)`.
    """
    conv = layer.conv_states[index] if layer.is_conv_states_initialized[index] else None
    recurrent = layer.recurrent_states[index] if layer.is_recurrent_states_initialized[index] else None
    return conv, recurrent


def set_linear_state(layer: LinearAttentionCacheLayerMixin, index: int, conv=None, recurrent=None):
    """Make state `index` of an allocated linear-attention layer hold `conv` / `recurrent` (`None`: unchanged).

    The layer's `update_*_state` methods fold new inputs into the state; restoring a state (after a rejected chain,
    or a tree node's) replaces it, which only the undocumented dicts allow.
    """
    if conv is not None:
        layer.conv_states[index] = conv
    if recurrent is not None:
        layer.recurrent_states[index] = recurrent


def fill_linear_state(layer: LinearAttentionLayer, index: int, conv=None, recurrent=None):
    """Allocate state `index` of an empty `LinearAttentionLayer` holding `conv` `(B, C, K)` / `recurrent`.

    Through the layer's own update methods (a first update is its prefill); `update_conv_state` takes the kernel
    size K as `conv_kernel_size` (a keyword of `LinearAttentionLayer`'s, not of the abstract mixin's).
    """
    if conv is not None:
        layer.update_conv_state(conv, state_idx=index, conv_kernel_size=conv.shape[-1])
    if recurrent is not None:
        layer.update_recurrent_state(recurrent, state_idx=index)


def stop_past_recording(layer: LinearAttentionCacheLayerMixin):
    """End a past recording without cropping: the layer keeps only its last K convolution inputs again.

    transformers has `activate_past_recording` but no public way back; `generate` ends a recording by setting the
    `record_past` flag (`DeferredStopCheck.finish`), and so does this.
    """
    layer.record_past = False


def compile_all_devices(compile_config) -> bool:
    """Whether a `CompileConfig` asks `generate` to compile on every device, the CPU included (its private
    `_compile_all_devices`, read by transformers' own auto-compile check)."""
    return bool(getattr(compile_config, "_compile_all_devices", False))


def mark_static_address(tensor) -> None:
    """Tells `torch.compile` a buffer keeps its address across calls (CUDA graphs then read it in place)."""
    torch._dynamo.mark_static_address(tensor)


# ------------------------------------------------------------------------------------------------ serving
def stream_error(message: str):
    """The item that ends a stream of transformers' serving handlers with an error event (`jetspec serve`).

    A streamed request's handler reads text from a queue and shows an item of the private class `_StreamError`
    (`transformers.cli.serving.utils`) as `data: {"error": ...}`; its own generation manager puts one there when
    `generate` raises. Imported here, on first use: the serving extras need not be installed for the rest.
    """
    from transformers.cli.serving.utils import _StreamError

    return _StreamError(message)
