"""A round whose cost does not grow with the answer: what grows by columns every round (the round state's validity
and positions, the head's context, the verify and draft masks) is written in place into buffers that double when
full (`modeling_jetspec/columns.py`, `tree.PastMask`), never concatenated anew; so do the target cache's keys and
values (`compat.GrowingLayer`), which transformers' `DynamicLayer` concatenates at every forward.

Checked here: the buffers hold exactly what concatenation would give, an earlier view never sees its columns change,
a whole `generate` call reallocates them a logarithmic number of times (a concatenating round reallocates every
round), the kept masks equal the masks built whole, and the output stays plain greedy's.
"""

import math

import pytest
import torch

import modeling_jetspec.verifiers as verifiers
from modeling_jetspec.columns import MIN_COLUMNS, Columns
from modeling_jetspec.kept_masks import PastMask
from modeling_jetspec.tree import ancestor_mask, verification_mask, verify_attention_mask
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


@torch.no_grad()
def test_columns_equal_concatenation_and_double():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 5, 4, generator=g)  # (B, H, S, D): the column axis third
    valid = torch.rand(2, 5, generator=g) > 0.3  # (B, S): second
    columns, (k, v) = Columns.start([keys, valid])
    reference, storages, earlier = [keys, valid], set(), []
    for step in range(300):
        width = 1 + step % 7
        new = [torch.randn(2, 3, width, 4, generator=g), torch.rand(2, width, generator=g) > 0.5]
        earlier.append((k, k.clone()))
        columns, (k, v) = columns.append(k.shape[2], new)
        reference = [torch.cat([reference[0], new[0]], dim=2), torch.cat([reference[1], new[1]], dim=1)]
        assert torch.equal(k, reference[0]) and torch.equal(v, reference[1])
        storages.add(k.untyped_storage().data_ptr())
    assert all(torch.equal(view, copy) for view, copy in earlier)  # no earlier view saw a write
    # 1,205 columns from 5: at most the doublings (and the first growth by MIN_COLUMNS), not one buffer per round
    assert len(storages) <= 2 + math.ceil(math.log2(k.shape[2] / MIN_COLUMNS))
    assert columns.capacity < 2 * k.shape[2] + MIN_COLUMNS


@torch.no_grad()
def test_an_earlier_view_copies_instead_of_writing():
    columns, (valid,) = Columns.start([torch.ones(1, 4, dtype=torch.bool)])
    columns, (newest,) = columns.append(4, [torch.zeros(1, 2, dtype=torch.bool)])
    columns, (newest,) = columns.append(6, [torch.ones(1, 2, dtype=torch.bool)])  # in place, room left
    kept = newest.clone()
    branch, (other,) = columns.append(6 - 2, [torch.zeros(1, 3, dtype=torch.bool)])  # an earlier view of 4 columns
    assert branch is not columns and other.untyped_storage().data_ptr() != newest.untyped_storage().data_ptr()
    assert torch.equal(newest, kept) and other.tolist() == [[True] * 4 + [False] * 3]
    assert columns.scratch(0, 4, torch.zeros(1, 1, dtype=torch.bool)) is None  # nor may it borrow the room
    room = columns.scratch(0, 8, torch.zeros(1, 2, dtype=torch.bool))
    assert room is not None and room.shape == (1, 10) and torch.equal(room[:, :8], kept)


@torch.no_grad()
def test_past_mask_equals_the_mask_built_whole():
    g = torch.Generator().manual_seed(1)
    columns, (valid,) = Columns.start([torch.rand(3, 7, generator=g) > 0.2])
    past = PastMask(torch.float32)
    for step in range(60):
        if step == 30:  # rows leave: new columns, a new mask
            columns, (valid,) = columns.rows(torch.tensor([0, 2]), valid.shape[1])
            past = PastMask(torch.float32)
        t = 1 + (step * 5) % 9  # the tree's size changes: more query rows than the buffer holds rebuild it
        parents = torch.zeros(valid.shape[0], t - 1, dtype=torch.long)
        for i in range(t - 1):  # a parent precedes its child
            parents[:, i] = torch.randint(0, i + 1, (valid.shape[0],), generator=g)
        seen = ancestor_mask(parents)
        built = past(valid, seen)
        assert torch.equal(built, verification_mask(valid, seen, torch.float32))
        width = 1 + step % 5
        columns, (valid,) = columns.append(valid.shape[1], [torch.rand(valid.shape[0], width, generator=g) > 0.4])


def random_trees(a: int, t: int, g, shape: str = "random") -> tuple:
    """`(ancestors (A, T, T), depths (A, T))` of trees of T nodes, root first: random, a chain or a star."""
    parents = torch.zeros(a, t - 1, dtype=torch.long)
    for i in range(t - 1):  # a parent precedes its child
        if shape == "chain":
            parents[:, i] = i
        elif shape == "random":
            parents[:, i] = torch.randint(0, i + 1, (a,), generator=g)
    depths = torch.zeros(a, t, dtype=torch.long)
    for i in range(1, t):
        depths[:, i] = depths.gather(1, parents[:, i - 1 : i])[:, 0] + 1
    return ancestor_mask(parents), depths


@pytest.mark.parametrize("window", [None, 2, 5, 40])
@torch.no_grad()
def test_kept_masks_equal_the_masks_built_whole_round_after_round(window):
    # rounds as the tree loop makes them: left-padded prompts, then per round each row's accepted nodes and its holes
    # (at the anchor's position), trees of changing sizes; the kept mask must equal the one built whole every time
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([9, 4, 13])
    width = int(lengths.max())
    valid = torch.arange(width)[None] >= (width - lengths)[:, None]  # (3, S), left padding
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    columns, (valid, positions) = Columns.start([valid, positions])
    anchors = lengths.clone()
    windows = None if window is None else {None: window}
    for step in range(40):
        if step == 25:  # a row leaves: new columns, new masks
            keep = torch.tensor([0, 2])
            columns, (valid, positions) = columns.rows(keep, valid.shape[1])
            anchors = anchors[keep]
        a = valid.shape[0]
        # deep and shallow trees in turn: a query row of a shallow tree sees what the same row of a deep one did not
        seen, depths = random_trees(a, 1 + (step * 7) % 11, g, ("random", "chain", "star")[step % 3])
        query = anchors[:, None] + depths
        kept = verify_attention_mask(valid, seen, torch.float32, windows, positions, query, kept=columns.masks)
        whole = verification_mask(valid, seen, torch.float32, window, positions, query)
        assert torch.equal(kept, whole), step
        count = torch.randint(1, 5, (a,), generator=g)
        k = int(count.max())
        kept_columns = torch.arange(k)[None] < count[:, None]  # (A, K), False: a hole
        new_positions = anchors[:, None] + torch.where(kept_columns, torch.arange(k)[None], 0)
        columns, (valid, positions) = columns.append(valid.shape[1], [kept_columns, new_positions])
        anchors = anchors + count


@pytest.mark.parametrize("batch", [1, 3])
def test_a_call_reallocates_logarithmically_and_stays_greedy(batch, monkeypatch):
    target = tiny_target("llama")
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=120)
    # (c) sometimes right: paths of different lengths, so rows leave holes; the rounds are many and short
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=3, tree_width=2, tree_budget=6)
    pointers = []  # per round, where the state's validity, the head's keys and the verify mask live
    compact = verifiers.compact

    def recording(*args, **kwargs):
        state = compact(*args, **kwargs)
        if state.rows.numel():
            masks = [m.buffer for key, m in state.columns.masks.items() if key[0] == "verify"]
            pointers.append(
                (
                    state.valid.shape[1],
                    state.valid.untyped_storage().data_ptr(),
                    state.context.keys[0].untyped_storage().data_ptr(),
                    masks[0].untyped_storage().data_ptr() if masks else None,
                    state.cache.layers[0].keys.untyped_storage().data_ptr(),  # the target's keys (GrowingLayer)
                )
            )
        return state

    monkeypatch.setattr(verifiers, "compact", recording)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=120, assistant_model=head), plain)
    assert len(pointers) >= 30
    widest = max(width for width, *_ in pointers)
    # a buffer moves when it doubles (or a reclaiming pack starts new columns, each followed by its own doublings);
    # a concatenating round would move every round (the new tensor is allocated while the old one is alive)
    for k, name in enumerate(["valid", "context", "mask", "target cache"], start=1):
        moves = sum(a[k] != b[k] for a, b in zip(pointers, pointers[1:]) if a[k] is not None and b[k] is not None)
        assert moves <= 2 + 2 * math.ceil(math.log2(widest)), (name, moves, len(pointers))


def test_the_head_attends_in_the_room_after_its_context():
    target = tiny_target("llama")
    head = tiny_head(target)
    with torch.no_grad():
        features = torch.randn(1, 6, head.fc.in_features)
        context = head.extend_context(None, features, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
        context = head.extend_context(context, features[:, :2], torch.arange(6, 8)[None], torch.ones(1, 2, dtype=bool))
        block = torch.randn(1, context.keys[0].shape[1], 3, context.keys[0].shape[-1])
        keys, values = context.joined(0, block, block)
        # a view of the context's own buffer, not a copy of the context
        assert keys.untyped_storage().data_ptr() == context.keys[0].untyped_storage().data_ptr()
        assert torch.equal(keys, torch.cat([context.keys[0], block], dim=2))
        assert torch.equal(values, torch.cat([context.values[0], block], dim=2))
        # drafting through the room and through a copy of the context give the same logits
        copy = type(context)(
            [k.clone() for k in context.keys], [v.clone() for v in context.values], context.valid.clone(), context.last
        )
        ids = torch.tensor([[5, head.config.mask_id, head.config.mask_id]])
        positions = torch.arange(8, 11)[None]
        assert torch.equal(head.draft(ids, positions, context).logits, head.draft(ids, positions, copy).logits)


@torch.no_grad()
def test_a_flex_attention_target_keeps_transformers_own_cache_layer():
    """The tree loop's target cache grows in place (`GrowingLayer`, views of larger buffers) except under
    flex_attention: inductor's compiled flex kernel decoded NaN from such views on the CI host (every token after
    the first round came out as id 0), so a flex target keeps whole tensors in `DynamicLayer`s."""
    from transformers.cache_utils import DynamicLayer

    from modeling_jetspec.compat import GrowingLayer

    ids, mask = prompts(2)
    for attention, layer_type in (("sdpa", GrowingLayer), ("flex_attention", DynamicLayer)):
        target = tiny_target("llama", attn_implementation=attention)
        state, _ = verifiers.TreeVerifier(target, tiny_head(target)).prefill(ids, mask)
        assert {type(layer) for layer in state.cache.layers} == {layer_type}, attention
        if layer_type is DynamicLayer:
            assert all(layer.keys.is_contiguous() and layer.values.is_contiguous() for layer in state.cache.layers)
