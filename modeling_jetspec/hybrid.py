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
- "tree" (`mode="tree"`): the whole tree, scanned depth by depth. Every node's forward starts from its parent's
  recurrent and convolution states (the row's own for the root) and is batched over all nodes of one depth, so each
  node is a one-token decode step like plain decoding's; attention layers see the row's past and the node's
  ancestors under the tree-causal mask. After acceptance the deepest accepted node's states become the row's.
  It costs depth + 1 target forwards per round instead of one.

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
from .steps import compact, keep_accepted_entries, prefill
from .tree import verification_mask

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # keys/values; windows are applied by the mask
STATE_LAYER_TYPES = ("linear_attention", "conv")  # a recurrent and/or convolution state per row
CACHELESS_LAYER_TYPES = ("moe", "mlp")  # no token mixing, nothing cached (Nemotron-H's MoE layers)
TREE_VERIFY = ("auto", "tree", "chain")


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


def read_states(cache: DynamicCache) -> dict:
    """Copies of every linear-attention state: `{(layer, state index): LinearState}`."""
    states = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for s in range(linear_state_count(layer)):
                states[index, s] = LinearState(*linear_state(layer, s)).map(torch.clone)
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
        # chain: the linear states before the round; tree: every node's, {(layer, s): LinearState (A, n + 1, ...)}
        self.pending = None
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
        logits, features, tree_kv, self.pending = self._scan(state, trees)
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
        else:  # the deepest accepted node's states
            last = acc.nodes.gather(1, (acc.count - 1)[:, None])[:, 0]  # (A,)
            rows = torch.arange(last.shape[0], device=last.device)
            states = {key: s.map(lambda t: t[rows, last]) for key, s in self.pending.items()}
        self.pending = None
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
        self.pending = None

    # -------------------------------------------------------------------------------------------- pieces
    def _forward(self, cache, tokens, positions, masks):
        """One target forward (counted in `target_forwards`)."""
        self.target_forwards += 1
        return self.target(
            input_ids=tokens, attention_mask=masks, position_ids=positions, past_key_values=cache, use_cache=True,
            output_hidden_states=True,
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
            for v in sorted(set(count[count < k1].tolist())):
                self._replay(state, chain, (count == v).nonzero()[:, 0], v, states)
        return states

    def _replay(self, state, chain, rows: torch.Tensor, v: int, states: dict):
        """Rows `rows` accepted `v` nodes of their chain: run them again from the states before the round, and put
        the recurrent states that come out into `states`."""
        past = state.valid.shape[1]
        attention = {i: tuple(t[rows, :, :past] for t in kv_layer_entries(state.cache.layers[i]))
                     for i in self.attention}
        cache = filled_cache(self.types, attention, {key: s.map(lambda t: t[rows]) for key, s in self.pending.items()})
        depths, ancestors = chain.depths[rows, :v], chain.ancestors[rows, :v, :v]  # (R, v), (R, v, v)
        tokens = torch.cat([state.anchors[rows, None], chain.tokens[rows, : v - 1]], dim=1)  # (R, v)
        masks = self._masks(state.valid[rows], state.positions[rows], depths, ancestors, state.anchor_pos[rows])
        self._forward(cache, tokens, state.anchor_pos[rows, None] + depths, masks)
        for (index, s), out in states.items():
            if out.recurrent is not None:
                out.recurrent[rows] = linear_state(cache.layers[index], s)[1]

    def _scan(self, state, trees):
        """The whole tree, depth by depth: one forward per depth over all its nodes (of every row), each node a
        one-token step from its parent's linear states, attending to the row's past and its ancestors.

        Returns:
            `(logits (A, n + 1, V) fp32, features (A, n + 1, kH), tree_kv {layer: (keys, values) (A, H, n + 1, D)},
            node states {(layer, s): LinearState (A, n + 1, ...)})`.
        """
        a, n1 = trees.depths.shape
        past, cache = state.valid.shape[1], state.cache
        masks = self._masks(state.valid, state.positions, trees.depths, trees.ancestors,
                            state.anchor_pos)  # (A, 1, n + 1, S + n + 1)
        positions = state.anchor_pos[:, None] + trees.depths  # (A, n + 1)
        tokens = torch.cat([state.anchors[:, None], trees.tokens], dim=1)  # (A, n + 1)
        parents = torch.cat([torch.zeros_like(trees.parents[:, :1]), trees.parents], dim=1)  # (A, n + 1)
        row_states = read_states(cache)
        nodes = {key: s.map(lambda t: t.new_zeros(a, n1, *t.shape[1:])) for key, s in row_states.items()}
        tree_kv = {i: tuple(t.new_zeros(*t.shape[:2], n1, t.shape[-1]) for t in kv_layer_entries(cache.layers[i]))
                   for i in self.attention}
        logits = features = None
        for d in range(int(trees.depths.max()) + 1):
            r, j = (trees.depths == d).nonzero(as_tuple=True)  # (N_d,) row and node of every node at depth d
            start = {key: s.map(lambda t: t[r]) for key, s in row_states.items()} if d == 0 else \
                {key: s.map(lambda t: t[r, parents[r, j]]) for key, s in nodes.items()}
            attention = {i: tuple(torch.cat([c[r], t[r]], dim=2) for c, t in zip(  # (N, H, S + n + 1, D)
                kv_layer_entries(cache.layers[i]), tree_kv[i])) for i in self.attention}
            step = filled_cache(self.types, attention, start)
            out = self._forward(step, tokens[r, j][:, None], positions[r, j][:, None],
                                {t: m if m is None else _node_mask(m, r, j, past) for t, m in masks.items()})
            if logits is None:
                logits = out.logits.new_zeros(a, n1, out.logits.shape[-1], dtype=torch.float32)
                feats = self.head.target_features(out.hidden_states)
                features = feats.new_zeros(a, n1, feats.shape[-1])
            logits[r, j] = out.logits[:, -1].float()
            features[r, j] = self.head.target_features(out.hidden_states)[:, -1]
            for i, (keys, values) in tree_kv.items():
                step_keys, step_values = kv_layer_entries(step.layers[i])
                keys[r, :, j], values[r, :, j] = step_keys[:, :, -1], step_values[:, :, -1]
            for (i, s), node in nodes.items():
                conv, recurrent = linear_state(step.layers[i], s)
                if node.conv is not None:
                    node.conv[r, j] = conv
                if node.recurrent is not None:
                    node.recurrent[r, j] = recurrent
        return logits, features, tree_kv, nodes


def _node_mask(mask: torch.Tensor, r: torch.Tensor, j: torch.Tensor, past: int) -> torch.Tensor:
    """One node's row of the tree verify mask `(A, 1, n + 1, S + n + 1)`, for a cache holding the past, then the
    tree's slots (the node's own still empty), then the node itself appended: `(N, 1, 1, S + n + 2)`."""
    rows = mask[r, 0, j].clone()  # (N, S + n + 1)
    own = rows[torch.arange(r.shape[0], device=r.device), past + j].clone()  # 0: a node sees itself
    rows[torch.arange(r.shape[0], device=r.device), past + j] = torch.finfo(mask.dtype).min
    return torch.cat([rows, own[:, None]], dim=1)[:, None, None, :]
