"""What a round leaves behind: compaction, the round's last step (arXiv 2606.18394, section 3.4; `docs/design.md`,
"§2 The round").

[`compact`]: finished rows leave ([`select_rows`]); the target cache keeps its past in place and moves only the
accepted nodes' entries behind it ([`keep_accepted_entries`]); the head's context grows by their target features;
the bonus token becomes the next anchor. Rows of a batch keep their own lengths: a shorter accepted path leaves
holes, masked through the state's `(A, S)` validity.
"""

from dataclasses import replace

import torch
from transformers.cache_utils import Cache

from .columns import Columns
from .compat import crop_pooled, kv_layer_entries, pooled_entries
from .state import Acceptance, DraftTrees, RoundState


def keep_accepted_entries(cache: Cache, past: int, nodes: torch.Tensor, layers: list | None = None):
    """Make a key/value cache hold its first `past` entries, then the accepted nodes' entries, root first.

    After a verify forward every layer holds `past` entries and then the n + 1 entries of the tree's nodes. The past
    stays where it is: only the accepted nodes' entries (`nodes` of shape `(A, K)`, from [`Acceptance`]) move, into
    slots `past .. past + K - 1`, and the layer is cropped to `past + K`. Keys and values are moved each by its own
    shape: their head sizes differ under multi-head latent attention (DeepSeek-V3, Kimi K2).

    Args:
        layers (`list`, *optional*): indices of the key/value layers to compact (a hybrid target's attention
            layers); defaults to every layer.
    """
    k = nodes.shape[1]
    # slot 0 is every row's root, already in place: only the nodes after it move (none when no row accepted a node)
    # (A, K - 1), indices into the entries after the root; a hole (node 0 past a row's count) reads entry 0, masked
    moved = (nodes[:, 1:] - 1).clamp(min=0)
    single = nodes.shape[0] == 1  # one row: a plain index along the entries instead of a gather
    index = moved[0] if single else None
    pooled = pooled_entries(cache) if layers is None else None
    if pooled is not None:  # every layer's keys (values) slices of one buffer: one move for all layers
        *buffers, length = pooled
        if k > 1:
            for buffer in buffers:  # (L, A, H, C, D)
                after = buffer[..., past + 1 : length, :]
                if single:
                    buffer[..., past + 1 : past + k, :] = after.index_select(3, index)
                else:  # the layers as more rows, each reading its row's nodes
                    rows = gather_nodes(after.flatten(0, 1), moved.repeat(buffer.shape[0], 1))
                    buffer[..., past + 1 : past + k, :] = rows.unflatten(0, buffer.shape[:2])
        crop_pooled(cache, past + k)
        return
    for layer in cache.layers if layers is None else [cache.layers[i] for i in layers]:
        entries = kv_layer_entries(layer)
        if entries is None:  # a layer that reads another layer's keys/values holds none of its own
            continue
        keys, values = entries
        tail = keys.shape[-2] - past  # n + 1
        if k > 1:
            for tensor in (keys, values):
                after = tensor[:, :, past + 1 :]  # (A, H, n, D): the entries after the root
                tensor[:, :, past + 1 : past + k] = (
                    after.index_select(2, index) if single else gather_nodes(after, moved)
                )
        layer.crop(k - tail)  # a negative count: the entries to drop from the end


def gather_nodes(tail: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """Entries `nodes` `(A, K)` of a layer's tree entries `tail` `(A, H, n + 1, D)`: `(A, H, K, D)`."""
    return tail.gather(2, nodes[:, None, :, None].expand(-1, tail.shape[1], -1, tail.shape[-1]))


def compact(
    head,
    state: RoundState,
    trees: DraftTrees,
    acc: Acceptance,
    features: torch.Tensor,
    keep: torch.Tensor,
    keep_entries=keep_accepted_entries,
) -> RoundState:
    """Finished rows leave; the target cache keeps its past and the accepted nodes; the head's context grows by their
    target features; the bonus token becomes the next anchor.

    Args:
        acc (`Acceptance`): of width K, the longest accepted path (from [`commit`]); a shorter path leaves holes,
            invisible through `valid`.
        features (`torch.Tensor` of shape `(A, n + 1, k * H)`): from [`verify`].
        keep (`torch.LongTensor` of shape `(A',)`): the rows that go on, from [`commit`].
        keep_entries (`Callable`, *optional*, defaults to [`keep_accepted_entries`]): `(cache, past, nodes)`, leaves
            the target cache holding its `past` entries then the accepted nodes' `(A', K)`, root first. A verifier
            for layers that keep another state than keys/values passes its own.

    Returns:
        `RoundState`: the A' rows that go on.
    """
    depths = trees.depths
    if keep.numel() < state.rows.shape[0]:  # finished rows leave before anything moves
        state = select_rows(state, keep)
        acc = Acceptance(acc.nodes[keep], acc.tokens[keep], acc.count[keep])  # holes past a row's count: masked
        features, depths = features[keep], depths[keep]
    if not keep.numel():
        return state
    width = state.valid.shape[1]
    keep_entries(state.cache, width, acc.nodes)
    kept = torch.arange(acc.nodes.shape[1], device=keep.device) < acc.count[:, None]  # (A', K), False: a hole
    positions = state.anchor_pos[:, None] + depths.gather(1, acc.nodes)  # (A', K)
    accepted = features.gather(1, acc.nodes[..., None].expand(-1, -1, features.shape[-1]))  # (A', K, kH)
    columns = state.columns if state.columns is not None else Columns.start([state.valid, state.positions])[0]
    columns, (valid, grown) = columns.append(width, [kept, positions])  # (A', S + K), in place where there is room
    return replace(
        state,
        context=head.extend_context(state.context, accepted, positions, kept),
        valid=valid,
        positions=grown,
        anchors=acc.tokens.gather(1, (acc.count - 1)[:, None])[:, 0],  # the bonus token
        anchor_pos=state.anchor_pos + acc.count,
        columns=columns,
    )


def select_rows(state: RoundState, keep: torch.Tensor) -> RoundState:
    """The rows `keep` `(A',)` of a round state; the target cache keeps only them, in place."""
    state.cache.batch_select_indices(keep)
    if state.columns is not None:
        columns, (valid, positions) = state.columns.rows(keep, state.valid.shape[1])
    else:
        columns, valid, positions = None, state.valid[keep], state.positions[keep]
    return replace(
        state,
        rows=state.rows[keep],
        valid=valid,
        positions=positions,
        context=state.context.select_rows(keep),
        anchors=state.anchors[keep],
        anchor_pos=state.anchor_pos[keep],
        columns=columns,
    )
