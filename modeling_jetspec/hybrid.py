"""Verification for hybrid targets: attention layers next to layers that keep a recurrent or convolution state
(gated delta-net in Qwen3.5 / Qwen3.6 and Qwen3-Next, Kimi delta attention, Mamba in Jamba, Bamba, Granite 4 and
Nemotron-H, short convolutions in LFM2; `docs/design.md`, "§2 The round", "§7 Targets and checkpoint formats").

A key/value cache can keep any subset of a tree's entries, so an attention target verifies the whole tree in one
forward. A recurrent state cannot: it folds its tokens in order, so a state holds one path. Two verifiers serve these
targets, chosen per call with `tree_verify`:

- "chain" ([`HybridVerifier`] with `mode="chain"`): the tree's best root-to-leaf path (the best-first child at every
  depth, the prompt-lookup branch included when it leads) in one forward, with the cache's past recording on
  (`Cache.activate_past_recording`). Convolution states are cut back to the accepted length from the recorded
  window, as transformers' `LinearAttentionCacheLayerMixin.crop` does, per row. A recurrent state has no recording
  (`Cache.is_croppable` is False): a row that rejected part of its path is replayed from the state before the round
  over its accepted tokens, one forward per distinct accepted length.
- "tree" (`mode="tree"`): the whole tree, scanned depth by depth. Every node's root-to-node path runs in one forward
  from its row's recurrent and convolution states before the round, batched over the nodes of one depth, in chunks
  of at least the batch's size (more while their copies of the states stay small); attention layers see the row's
  past and the path under the causal mask. No node keeps its states, so memory grows with a chunk, not with the
  tree (a Qwen3.5 state is megabytes per row and layer). After acceptance a row keeps its root's states, or, where
  it accepted more, runs its accepted path once more from the states before the round (one forward per distinct
  accepted length). It costs depth + 1 target forwards per round (more chunks where states are large) plus those
  reruns, instead of one.

"auto" is "chain": a round of the tree scan costs depth + 1 sequential forwards, a chain one or two, and at batch 1 a
forward's time is mostly reading the weights, whatever its width; the scan pays only where a tree's tau exceeds the
chain's by that ratio (the counts, from `tests/test_hybrid.py`, and the estimate at Qwen3.5 size are in the project's
`docs/targets.md`).

Lossless: every committed token is the target's choice after exactly the committed tokens, whichever nodes are
verified, and the state a row keeps is the state after exactly its committed tokens minus the anchor.
"""

import functools
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from .compat import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    fill_linear_state,
    kv_layer_entries,
    linear_state,
    linear_state_count,
    set_linear_state,
    stop_past_recording,
)
from .state import Acceptance, DraftTrees, RoundState
from .steps import compact, keep_accepted_entries, logits_to_keep, prefill
from .tree import verification_mask

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # keys/values; windows are applied by the mask
STATE_LAYER_TYPES = ("linear_attention", "conv")  # a recurrent and/or convolution state per row
CACHELESS_LAYER_TYPES = ("moe", "mlp")  # no token mixing, nothing cached (Nemotron-H's MoE layers)
TREE_VERIFY = ("auto", "tree", "chain")
# the tree scan's forwards take at least the batch's nodes at a time, more while their copies of linear states and past
# keys/values stay under this size
SCAN_CHUNK_BYTES = 16 * 2**20


def layer_types(target) -> list:
    """The target's `layer_types` (text config), or `[]` when it has none."""
    return list(getattr(target.config.get_text_config(decoder=True), "layer_types", None) or [])


def is_hybrid(target) -> bool:
    """Whether some layer of `target` keeps a recurrent or convolution state."""
    return any(t in STATE_LAYER_TYPES for t in layer_types(target))


def check_hybrid_layer_types(target):
    """Raise a `ValueError` naming the layer types neither verifier handles."""
    known = ATTENTION_LAYER_TYPES + STATE_LAYER_TYPES + CACHELESS_LAYER_TYPES
    other = sorted({t for t in layer_types(target) if t not in known})
    if other:
        raise ValueError(
            f"expected a target whose layers are attention ({', '.join(ATTENTION_LAYER_TYPES)}), linear attention / "
            f"convolution ({', '.join(STATE_LAYER_TYPES)}) or cacheless ({', '.join(CACHELESS_LAYER_TYPES)}), got "
            f"layer types {other} ({type(target).__name__})"
        )


class HybridCache(DynamicCache):
    """A [`DynamicCache`] of key/value layers (every entry kept: sliding windows are applied by the verify mask) and
    linear-attention layers, whose rows can be selected like the key/value layers'."""

    def __init__(self, types: list):
        super().__init__()
        self.layers = [
            LinearAttentionLayer() if t in STATE_LAYER_TYPES else DummyLayer() if t in CACHELESS_LAYER_TYPES
            else DynamicLayer()
            for t in types
        ]

    def batch_select_indices(self, indices: torch.Tensor):
        """Keep the rows `indices` `(A',)` of every layer, in place (transformers' linear-attention layers lack this
        method; their `reorder_cache` selects rows)."""
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.reorder_cache(indices)  # an index_select of every state over rows
            else:
                layer.batch_select_indices(indices)


@dataclass
class LinearState:
    """One state of one linear-attention layer, for a batch of rows (or rows x nodes)."""

    conv: torch.Tensor | None  # (A, C, K) the last K inputs of the causal convolution
    recurrent: torch.Tensor | None  # (A, ...) the recurrent state

    def map(self, fn) -> "LinearState":
        """`fn` applied to each state tensor that exists."""
        return LinearState(*(fn(t) if t is not None else None for t in (self.conv, self.recurrent)))


def read_states(cache: DynamicCache, copy: bool = True) -> dict:
    """Every linear-attention state, `{(layer, state index): LinearState}`: copies, or with `copy=False` the cache's
    own tensors."""
    states = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for s in range(linear_state_count(layer)):
                state = LinearState(*linear_state(layer, s))
                states[index, s] = state.map(torch.clone) if copy else state
    return states


def write_states(cache: DynamicCache, states: dict):
    """Make the linear-attention layers of a filled cache hold `states` (rows already matching)."""
    for (index, s), state in states.items():
        set_linear_state(cache.layers[index], s, state.conv, state.recurrent)


def filled_cache(types: list, attention: dict, states: dict) -> HybridCache:
    """A new cache holding `attention` `{layer: (keys, values)}` and linear `states`, through the layers' own update
    methods (a linear layer's first update is its prefill)."""
    cache = HybridCache(types)
    for index, (keys, values) in attention.items():
        cache.layers[index].update(keys, values)
    for (index, s), state in states.items():
        fill_linear_state(cache.layers[index], s, state.conv, state.recurrent)
    return cache


def best_path(trees: DraftTrees) -> DraftTrees:
    """The tree's best root-to-leaf path as a chain: from the root, the first child (best-first
    order: the highest-scored) at every depth. Rows whose paths are shorter repeat their last token (still checked
    against the target, so lossless; their acceptance simply stops or goes on like any node's).

    Returns:
        `DraftTrees` of k nodes per row, node i's parent i - 1.
    """
    a, n = trees.tokens.shape
    paths = []
    for parents in trees.parents.tolist():
        path, node = [], 0
        while node in parents:  # node's first child is the first node naming it as parent
            node = parents.index(node) + 1
            path.append(node)
        paths.append(path)
    k = max(len(p) for p in paths)
    nodes = torch.tensor([p + p[-1:] * (k - len(p)) for p in paths], device=trees.tokens.device)  # (A, k), 1-based
    parents = torch.arange(k, device=nodes.device).expand(a, k)
    depths = torch.arange(k + 1, device=nodes.device).expand(a, k + 1)
    ancestors = torch.ones(k + 1, k + 1, dtype=torch.bool, device=nodes.device).tril().expand(a, -1, -1)
    return DraftTrees(trees.tokens.gather(1, nodes - 1), parents, depths, ancestors, trees.budget)


class HybridVerifier:
    """Verifies a round of a hybrid target by its best path ("chain") or its whole tree ("tree"); see the module.

    A `state.Verifier`, like `verifiers.TreeVerifier`: `prefill`, `verify`, `compact`, `discard`, and
    `target_forwards`, which counts every forward: the prefill, the chain's verify and its replays, each depth of the
    tree scan. Between `verify` and `compact` it keeps the round's pending linear states.

    Args:
        mode (`str`): `tree_verify` of the call, "auto" (= "chain"), "chain" or "tree".
        windows (`dict`, *optional*): sliding windows per layer type, from `verifiers.verify_windows`.
    """

    def __init__(self, target, head, mode: str, windows: dict | None):
        check_hybrid_layer_types(target)
        if mode not in TREE_VERIFY:
            raise ValueError(f"expected tree_verify in {TREE_VERIFY}, got {mode!r}")
        self.target, self.head, self.windows = target, head, windows
        self.mode = "chain" if mode == "auto" else mode
        self.types = layer_types(target)
        self.attention = [i for i, t in enumerate(self.types) if t in ATTENTION_LAYER_TYPES]
        # the linear states before the round, {(layer, s): LinearState (A, ...)}: the chain's copies, or the tree's cache
        # own (its scan leaves them untouched); tree: also the roots' states after the round's scan
        self.pending = self.root = None
        self.added = 0  # entries the last verify added to the attention layers
        self.target_forwards = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[RoundState, torch.Tensor]:
        """`steps.prefill` into a new [`HybridCache`]."""
        self.target_forwards += 1
        return prefill(self.head, self.target, input_ids, attention_mask, HybridCache(self.types))

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple[DraftTrees, torch.Tensor, torch.Tensor]:
        """Verify the round's trees (`DraftTrees`, n nodes per row) after `state`'s cache.

        Returns:
            `(trees, logits, features)`: the trees verified (chain: the best paths, k nodes per row), the target's
            logits after each of their nodes `(A, n + 1, V)` in fp32 and the head's features `(A, n + 1, kH)`. The
            attention layers hold past + n + 1 entries; the linear layers' states of the round wait in `pending`.
        """
        if self.mode == "chain":
            chain = best_path(trees)
            self.pending = read_states(state.cache)  # the states before the round, for replays and discards
            for layer in state.cache.layers:
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    layer.activate_past_recording()
            tokens = torch.cat([state.anchors[:, None], chain.tokens], dim=1)  # (A, k + 1)
            self.added = tokens.shape[1]
            out = self._forward(state.cache, tokens, state.anchor_pos[:, None] + chain.depths,
                                self._masks(state.valid, state.positions, chain.depths, chain.ancestors,
                                            state.anchor_pos))
            return chain, out.logits.float(), self.head.target_features(out.hidden_states)
        self.pending = read_states(state.cache, copy=False)  # the scan leaves the cache's states as they are
        logits, features, tree_kv = self._scan(state, trees)
        self.added = trees.depths.shape[1]
        for index, (keys, values) in tree_kv.items():  # the cache now holds past + n + 1 entries, as a tree verify's
            state.cache.layers[index].update(keys, values)
        return trees, logits, features

    def compact(self, state: RoundState, trees: DraftTrees, acc: Acceptance, features: torch.Tensor,
                keep: torch.Tensor) -> RoundState:
        """`steps.compact` for the attention layers; each surviving row's linear states become those after its
        accepted nodes."""
        if self.mode == "chain":
            states = self._chain_states(state, trees, acc.count)
        else:
            states = self._tree_states(state, trees, acc)
        self.pending = self.root = None
        keep_entries = functools.partial(keep_accepted_entries, layers=self.attention)
        state = compact(self.head, state, trees, acc, features, keep, keep_entries=keep_entries)
        write_states(state.cache, {key: s.map(lambda t: t[keep]) for key, s in states.items()})
        return state

    def discard(self, state: RoundState, trees: DraftTrees):
        """Undo a `verify` without compacting (timing repeats)."""
        for index in self.attention:
            state.cache.layers[index].crop(-self.added)  # the chain's or the tree's entries
        if self.mode == "chain":
            write_states(state.cache, self.pending)
            self._stop_recording(state.cache)
        self.pending = self.root = None

    # -------------------------------------------------------------------------------------------- pieces
    def _forward(self, cache, tokens, positions, masks, **kwargs):
        """One target forward (counted in `target_forwards`)."""
        self.target_forwards += 1
        return self.target(
            input_ids=tokens, attention_mask=masks, position_ids=positions, past_key_values=cache, use_cache=True,
            output_hidden_states=True, **kwargs,
        )

    def _masks(self, valid, past_positions, depths, ancestors, anchor_pos) -> dict:
        """`{layer type: mask}`: the tree-causal verify mask `(A, 1, n + 1, S + n + 1)` of nodes at `depths`
        `(A, n + 1)` seeing `ancestors` `(A, n + 1, n + 1)`, for attention layer types (with their sliding windows),
        None (no padding among the new tokens) for linear ones."""
        positions = anchor_pos[:, None] + depths
        dtype = self.target.dtype if self.target.dtype.is_floating_point else torch.float32
        masks = {}
        for t in set(self.types):
            window = None if self.windows is None else self.windows.get(t, self.windows.get(None))
            masks[t] = None if t in STATE_LAYER_TYPES + CACHELESS_LAYER_TYPES else verification_mask(
                valid, ancestors, dtype, window, past_positions, positions
            )
        return masks

    def _stop_recording(self, cache):
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                stop_past_recording(layer)

    def _chain_states(self, state, chain, count: torch.Tensor) -> dict:
        """The linear states after each row's accepted nodes (`count` of shape `(A,)`, root included) of the chain.

        Convolution states: the K recorded inputs ending at the last accepted one. Recurrent states: the final one
        where the whole chain was accepted; otherwise replayed from the state before the round.
        """
        k1 = chain.tokens.shape[1] + 1
        states = {}
        for (index, s), before in self.pending.items():
            layer = state.cache.layers[index]
            conv = None
            if before.conv is not None:  # recorded: (A, C, K + k + 1), the K inputs before the round first
                size = before.conv.shape[-1]
                window = count[:, None, None] + torch.arange(size, device=count.device)  # (A, 1, K)
                conv = linear_state(layer, s)[0].gather(2, window.expand(-1, before.conv.shape[1], -1))
            rec = linear_state(layer, s)[1].clone() if before.recurrent is not None else None
            states[index, s] = LinearState(conv, rec)
        self._stop_recording(state.cache)
        if any(s.recurrent is not None for s in states.values()):
            tokens = torch.cat([state.anchors[:, None], chain.tokens], dim=1)  # (A, k + 1)
            for v in sorted(set(count[count < k1].tolist())):
                rows = (count == v).nonzero()[:, 0]
                self._rerun(state, rows, tokens[rows, :v], states, conv=False)
        return states

    def _tree_states(self, state, trees, acc: Acceptance) -> dict:
        """The linear states after each row's accepted nodes of the tree: the root's (kept by the scan) where only the
        root was accepted, else its accepted path run again from the states before the round, one forward per
        distinct accepted length."""
        states = self.root
        tokens = torch.cat([state.anchors[:, None], trees.tokens], dim=1).gather(1, acc.nodes)  # (A, K) the paths
        for v in sorted(set(acc.count[acc.count > 1].tolist())):
            rows = (acc.count == v).nonzero()[:, 0]
            self._rerun(state, rows, tokens[rows, :v], states, conv=True)
        return states

    def _rerun(self, state, rows: torch.Tensor, tokens: torch.Tensor, states: dict, conv: bool):
        """Run `tokens` `(R, v)` after rows `rows` from the states before the round, and put the recurrent (and with
        `conv`, the convolution) states that come out into `states` `{(layer, s): LinearState (A, ...)}`."""
        _, step = self._paths_forward(state, rows, tokens)
        _put_states(states, rows, step, conv)

    def _paths_forward(self, state, rows: torch.Tensor, tokens: torch.Tensor, last_only: bool = False):
        """One forward of the paths `tokens` `(R, v)` (a row's anchor, then nodes one depth apart) of rows `rows`
        `(R,)` (a row may repeat), each after its row's past and its linear states before the round (`pending`).

        Memory per path: its row's linear states and past keys/values, copied once into a new cache.

        Returns:
            `(output, cache)`: the target's output (with `last_only`, logits of the last position only) and the cache
            the forward filled (the past, then the path's entries; the linear states after the path).
        """
        past, (r, v) = state.valid.shape[1], tokens.shape
        attention = {i: tuple(t[rows, :, :past] for t in kv_layer_entries(state.cache.layers[i])) for i in self.attention}
        cache = filled_cache(self.types, attention, {key: s.map(lambda t: t[rows]) for key, s in self.pending.items()})
        depths = torch.arange(v, device=tokens.device).expand(r, v)
        ancestors = torch.ones(v, v, dtype=torch.bool, device=tokens.device).tril().expand(r, v, v)
        masks = self._masks(state.valid[rows], state.positions[rows], depths, ancestors, state.anchor_pos[rows])
        out = self._forward(cache, tokens, state.anchor_pos[rows, None] + depths, masks,
                            **(logits_to_keep(self.target, 1) if last_only else {}))
        return out, cache

    def _scan(self, state, trees):
        """The whole tree, depth by depth: every node's root-to-node path in one forward per depth (in chunks of at
        most `_chunk` nodes), each from its row's states before the round. No node's linear states are kept but the
        roots' (`self.root`): memory grows with the chunk, not with the tree.

        Returns:
            `(logits (A, n + 1, V) fp32, features (A, n + 1, kH), tree_kv {layer: (keys, values) (A, H, n + 1, D)})`.
        """
        a, n1 = trees.depths.shape
        tokens = torch.cat([state.anchors[:, None], trees.tokens], dim=1)  # (A, n + 1)
        tree_kv = {i: tuple(t.new_zeros(*t.shape[:2], n1, t.shape[-1])
                            for t in kv_layer_entries(state.cache.layers[i])) for i in self.attention}
        self.root = {key: s.map(torch.empty_like) for key, s in self.pending.items()}
        logits = features = None
        chunk = self._chunk(state)
        for d in range(int(trees.depths.max()) + 1):
            r, j = (trees.depths == d).nonzero(as_tuple=True)  # (N_d,) row and node of every node at depth d
            paths = tokens[r[:, None], path_nodes(trees, r, j, d)]  # (N_d, d + 1)
            for c in range(0, r.shape[0], chunk):
                rc, jc = r[c : c + chunk], j[c : c + chunk]
                out, step = self._paths_forward(state, rc, paths[c : c + chunk], last_only=True)
                feats = self.head.target_features(out.hidden_states)[:, -1]  # (N, kH)
                if logits is None:
                    logits = out.logits.new_zeros(a, n1, out.logits.shape[-1], dtype=torch.float32)
                    features = feats.new_zeros(a, n1, feats.shape[-1])
                logits[rc, jc], features[rc, jc] = out.logits[:, -1].float(), feats
                for i, (keys, values) in tree_kv.items():
                    step_keys, step_values = kv_layer_entries(step.layers[i])
                    keys[rc, :, jc], values[rc, :, jc] = step_keys[:, :, -1], step_values[:, :, -1]
                if d == 0:  # the roots, in row order: their states are a row's when only the root is accepted
                    _put_states(self.root, rc, step, conv=True)
        return logits, features, tree_kv

    def _chunk(self, state) -> int:
        """Nodes per scan forward: the batch, or more where their linear states and past keys/values fit in
        `SCAN_CHUNK_BYTES` (so a tree costs about the memory of a chain verify, whatever its size)."""
        a = state.valid.shape[0]
        batch_bytes = sum(t.numel() * t.element_size() for s in self.pending.values() for t in (s.conv, s.recurrent)
                          if t is not None)  # the batch's linear states
        batch_bytes += sum(t[:, :, : state.valid.shape[1]].numel() * t.element_size() for i in self.attention
                           for t in kv_layer_entries(state.cache.layers[i]))  # and its past keys/values
        return max(a, SCAN_CHUNK_BYTES * a // max(batch_bytes, 1))


def path_nodes(trees: DraftTrees, rows: torch.Tensor, nodes: torch.Tensor, depth: int) -> torch.Tensor:
    """The root-to-node path of each node `nodes[i]` (at `depth`) of row `rows[i]`: its ancestors ordered by depth,
    of shape `(N, depth + 1)`, the root first and the node last."""
    seen = trees.ancestors[rows, nodes]  # (N, n + 1): the node and its ancestors
    at = trees.depths[rows][:, None, :] == torch.arange(depth + 1, device=rows.device)[None, :, None]  # (N, d + 1, n + 1)
    return (seen[:, None, :] & at).long().argmax(-1)  # (N, d + 1): the one ancestor at each depth


def _put_states(states: dict, rows: torch.Tensor, cache, conv: bool):
    """Write the linear states of `cache` (one per row of `rows` `(R,)`) into rows `rows` of `states`
    `{(layer, s): LinearState (A, ...)}`: the recurrent states, and with `conv` the convolution states."""
    for (index, s), out in states.items():
        new_conv, new_recurrent = linear_state(cache.layers[index], s)
        if out.recurrent is not None:
            out.recurrent[rows] = new_recurrent
        if conv and out.conv is not None:
            out.conv[rows] = new_conv
