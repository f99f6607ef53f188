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
- "tree" (`mode="tree"`): at most 2 forwards per round. Forward 1 runs the tree's root-to-leaf paths, one batch row
  per leaf, each from its row's recurrent and convolution states (copied per leaf), right-padded to the longest;
  attention layers see the row's past and the path under the causal mask. A causal forward's output at a node
  depends only on the node's path, so every node's logits, features and keys/values are read from a leaf row that
  holds it. A row whose accepted path is a whole leaf path that no padding followed keeps that row's states (an
  always-right drafter costs one forward per round). The others fold their committed tokens into their states in
  forward 2, from the states before the round; padding would enter a state, so the fold runs one count of tokens
  for all its rows ([`_fold_length`]), and a row left with some runs them first in its next round's forward 1
  (their keys/values are already cached: they see the cache up to their own position and add nothing to it).
  Memory: leaves x (states + past) for forward 1, within `PATHS_FORWARD_BYTES` or a share of the target's weights;
  past that the leaf paths run in chunks, a few forwards more.
- "auto" (the default): per round, the mode with the most expected tokens per second ([`ModeChooser`]): a chain
  verify and a tree's forward 1 timed once per batch and tree size, the extra forwards (replays, folds) and the tau
  each mode shows (a tree round shows the chain's too).

Lossless: every committed token is the target's choice after exactly the committed tokens, whichever nodes are
verified, and the state a row keeps is the state after exactly its committed tokens minus the anchor.
"""

import functools
from collections import deque
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
from .steps import compact, feature_layers, float_dtype, keep_accepted_entries, logits_to_keep, prefill
from .timing import median_seconds
from .tree import verify_attention_mask

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # keys/values; windows are applied by the mask
STATE_LAYER_TYPES = ("linear_attention", "conv")  # a recurrent and/or convolution state per row
CACHELESS_LAYER_TYPES = ("moe", "mlp")  # no token mixing, nothing cached (Nemotron-H's MoE layers)
TREE_VERIFY = ("auto", "tree", "chain")
ROUND_MODES = ("chain", "tree")  # what a round runs; "auto" chooses one per round
# a tree round's forward 1 runs as many leaf paths as their copies (each path's linear states and past keys/values,
# and its logits) fit in a quarter of the target's weights, or in this size where that is larger; the rest run in
# further forwards. A real Qwen3.5 (about 9B, 24 gated delta-net layers of 32 value heads x 128 x 128) holds 18 GB of
# bf16 weights and 24 MiB of recurrent states per path: a budget-32 tree's 20-odd leaves fit in one forward
PATHS_FORWARD_BYTES = 64 * 2**20
WEIGHTS_SHARE = 0.25


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
            LinearAttentionLayer()
            if t in STATE_LAYER_TYPES
            else DummyLayer()
            if t in CACHELESS_LAYER_TYPES
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
    paths = [firsts_path(parents) for parents in trees.parents.tolist()]
    k = max(len(p) for p in paths)
    nodes = torch.tensor([p + p[-1:] * (k - len(p)) for p in paths], device=trees.tokens.device)  # (A, k), 1-based
    parents = torch.arange(k, device=nodes.device).expand(a, k)
    depths = torch.arange(k + 1, device=nodes.device).expand(a, k + 1)
    ancestors = torch.ones(k + 1, k + 1, dtype=torch.bool, device=nodes.device).tril().expand(a, -1, -1)
    return DraftTrees(trees.tokens.gather(1, nodes - 1), parents, depths, ancestors, trees.budget)


class HybridVerifier:
    """Verifies a round of a hybrid target by its best path ("chain") or its whole tree ("tree"), or chooses between
    them per round ("auto", [`ModeChooser`]); see the module.

    A `state.Verifier`, like `verifiers.TreeVerifier`: `prefill`, `verify`, `compact`, `discard`, and
    `target_forwards`, which counts every forward: the prefill, the chain's verify and its replays, the tree's
    leaf-path forwards and its fold, and the forwards timing the two modes for "auto". Between `verify` and
    `compact` it keeps what the round needs (`self.round`).

    Args:
        mode (`str`): `tree_verify` of the call, "auto", "chain" or "tree".
        windows (`dict`, *optional*): sliding windows per layer type, from `verifiers.verify_windows`.
    """

    def __init__(self, target, head, mode: str, windows: dict | None):
        check_hybrid_layer_types(target)
        if mode not in TREE_VERIFY:
            raise ValueError(f"expected tree_verify in {TREE_VERIFY}, got {mode!r}")
        self.target, self.head, self.windows, self.mode = target, head, windows, mode
        self.types = layer_types(target)
        self.attention = [i for i, t in enumerate(self.types) if t in ATTENTION_LAYER_TYPES]
        self.recurrent = None  # whether some layer keeps a recurrent state (known after the prefill)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        self.vocab = target.config.get_text_config(decoder=True).vocab_size
        # {batch row: tokens}: the committed tokens after the point a row's linear states stand at, before its anchor
        # (a tree round's fold can leave some, see `_fold_length`); the next tree round runs them first
        self.unfolded = {}
        self.round = None  # what `verify` leaves for `compact`: (mode, what that mode needs)
        self.added = 0  # entries the last verify added to the attention layers
        self.target_forwards = 0
        self.chooser = ModeChooser() if mode == "auto" else None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[RoundState, torch.Tensor]:
        """`steps.prefill` into a new [`HybridCache`]."""
        self.target_forwards += 1
        self.unfolded = {}
        state, logits = prefill(self.head, self.target, input_ids, attention_mask, HybridCache(self.types))
        self.recurrent = any(s.recurrent is not None for s in read_states(state.cache, copy=False).values())
        return state, logits

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple[DraftTrees, torch.Tensor, torch.Tensor]:
        """Verify the round's trees (`DraftTrees`, n nodes per row) after `state`'s cache.

        Returns:
            `(trees, logits, features)`: the trees verified (chain: the best paths, k nodes per row), the target's
            logits after each of their nodes `(A, n + 1, V)` in fp32 and the head's features `(A, n + 1, kH)`. The
            attention layers hold past + n + 1 entries; the linear layers still hold the states before the round.
        """
        mode = self.mode
        if self.chooser is not None:
            mode = self.chooser.next_mode(self._mode_seconds(state, trees))
        return self._verify(mode, state, trees)

    def compact(
        self, state: RoundState, trees: DraftTrees, acc: Acceptance, features: torch.Tensor, keep: torch.Tensor
    ) -> RoundState:
        """`steps.compact` for the attention layers; each surviving row's linear states become those after its
        accepted nodes (or, after a tree round, after all but its last few committed tokens: `unfolded`)."""
        mode, data = self.round
        self.round = None
        forwards = self.target_forwards
        if self.chooser is not None:
            self.chooser.observe(mode, trees, acc, self.recurrent)
        keep_entries = functools.partial(keep_accepted_entries, layers=self.attention)
        if mode == "chain":
            states = self._chain_states(state, trees, acc.count, data)
            state = compact(self.head, state, trees, acc, features, keep, keep_entries=keep_entries)
            write_states(state.cache, {key: s.map(lambda t: t[keep]) for key, s in states.items()})
        else:
            state = self._tree_compact(state, trees, acc, features, keep, data, keep_entries)
        if self.chooser is not None:
            self.chooser.extra(mode, self.target_forwards - forwards)
        return state

    def discard(self, state: RoundState, trees: DraftTrees):
        """Undo a `verify` without compacting (timing repeats)."""
        mode, data = self.round
        self.round = None
        for index in self.attention:
            state.cache.layers[index].crop(-self.added)  # the chain's or the tree's entries
        if mode == "chain":
            write_states(state.cache, data)
            self._stop_recording(state.cache)

    # -------------------------------------------------------------------------------------------- the two modes
    def _verify(self, mode: str, state: RoundState, trees: DraftTrees):
        if mode == "tree":
            return self._verify_tree(state, trees)
        self._fold_all(state)  # a chain starts from the states after every committed token but the anchor
        chain = best_path(trees)
        before = read_states(state.cache)  # the states before the round, for replays and discards
        for layer in state.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.activate_past_recording()
        tokens = torch.cat([state.anchors[:, None], chain.tokens], dim=1)  # (A, k + 1)
        self.added = tokens.shape[1]
        positions = state.anchor_pos[:, None] + chain.depths
        out = self._forward(
            state.cache, tokens, positions, self._masks(state.valid, state.positions, chain.ancestors, positions)
        )
        self.round = ("chain", before)
        return chain, out.logits.float(), self.head.target_features(out.hidden_states)

    def _verify_tree(self, state: RoundState, trees: DraftTrees):
        """Forward 1 of a tree round: every root-to-leaf path, one batch row per leaf, each from its row's linear
        states (the row's `unfolded` tokens first), in as few forwards as `_paths_per_forward` allows (one at the
        default bound). Every node's logits, features and keys/values are read from a leaf row that holds it: a
        causal forward's output at a node depends only on the tokens up to it, which are the node's path."""
        a, n1 = trees.depths.shape
        rows = state.rows.tolist()
        anchors = state.anchors.tolist()
        shapes = (
            [(t.tokens, t.parents) for t in trees.host]
            if trees.host is not None
            else list(zip(trees.tokens.tolist(), trees.parents.tolist()))
        )
        plans = [leaf_paths(tokens, parents) for tokens, parents in shapes]
        lead = [self.unfolded.get(r, []) for r in rows]
        paths, base = [], []  # (active row, node path root first, the row's tokens); each row's first path
        for i, ((tokens, _), plan) in enumerate(zip(shapes, plans)):
            base.append(len(paths))
            for path in plan.paths:
                paths.append((i, path, lead[i] + [anchors[i]] + [tokens[j - 1] for j in path[1:]]))
        tree_kv = {
            i: tuple(t.new_zeros(a, t.shape[1], n1, t.shape[-1]) for t in kv_layer_entries(state.cache.layers[i]))
            for i in self.attention
        }
        logits = features = None
        ends = {}  # path index -> {(layer, s): LinearState (1, ...)}: the states after a path no padding follows
        chunk = self._paths_per_forward(state, max(len(p[2]) for p in paths))
        for start in range(0, len(paths), chunk):
            part = paths[start : start + chunk]
            out, cache, length = self._paths_forward(state, part, [len(lead[i]) for i, _, _ in part])
            feats = self.head.target_features(out.hidden_states)  # (R, L, kH)
            if logits is None:
                logits = out.logits.new_zeros(a, n1, out.logits.shape[-1], dtype=torch.float32)
                features = feats.new_zeros(a, n1, feats.shape[-1])
            # the nodes whose source path is in this forward: (active row, node, row in the forward, offset)
            where = [
                (i, j, base[i] + p - start, len(lead[i]) + depth)
                for i, plan in enumerate(plans)
                for j, (p, depth) in enumerate(plan.source)
                if start <= base[i] + p < start + len(part)
            ]
            ii, jj, pp, oo = (torch.tensor(x, device=state.anchors.device) for x in zip(*where))
            logits[ii, jj], features[ii, jj] = out.logits[pp, oo].float(), feats[pp, oo]
            past = state.valid.shape[1]
            for index, (keys, values) in tree_kv.items():
                step_keys, step_values = kv_layer_entries(cache.layers[index])
                keys[ii, :, jj], values[ii, :, jj] = step_keys[pp, :, past + oo], step_values[pp, :, past + oo]
            for p, (_, _, tokens) in enumerate(part):
                if len(tokens) == length:  # no padding after the path: its states are the path's
                    ends[start + p] = _row_states(cache, p)
            del out, cache
        index_of = {(i, path[-1]): p for p, (i, path, _) in enumerate(paths)}
        self.added = n1
        for index, (keys, values) in tree_kv.items():  # the cache now holds past + n + 1 entries, as a tree verify's
            state.cache.layers[index].update(keys, values)
        self.round = ("tree", TreeRound(plans, lead, anchors, shapes, index_of, ends))
        return trees, logits, features

    def _tree_compact(self, state, trees, acc, features, keep, data, keep_entries) -> RoundState:
        """After a tree round: the attention layers keep the accepted nodes (`steps.compact`); a row whose accepted
        path is a whole leaf path that no padding followed takes that path's states from forward 1; the others fold
        their committed tokens into their states in one forward (forward 2), as many as `_fold_length` chooses."""
        counts, nodes = acc.count.tolist(), acc.nodes.tolist()
        rows = state.rows.tolist()
        done, todo = {}, {}  # active row -> states from forward 1; active row -> committed tokens to fold
        for i, plan in enumerate(data.plans):
            path = nodes[i][: counts[i]]
            committed = data.lead[i] + [data.anchors[i]] + [data.shapes[i][0][j - 1] for j in path[1:]]
            end = data.index_of.get((i, plan.canonical[path[-1]]))
            if end is not None and end in data.ends:
                done[i] = data.ends[end]
            else:
                todo[i] = committed
        anchor_pos = state.anchor_pos.tolist()
        start = {i: anchor_pos[i] - len(data.lead[i]) for i in todo}  # the first unfolded position
        state = compact(self.head, state, trees, acc, features, keep, keep_entries=keep_entries)
        kept = keep.tolist()
        self.unfolded = {}
        ready = [(k, done[i]) for k, i in enumerate(kept) if i in done]
        if ready:
            stacked = {
                key: LinearState(
                    *(
                        torch.cat(parts) if parts[0] is not None else None
                        for parts in zip(*((s[key].conv, s[key].recurrent) for _, s in ready))
                    )
                )
                for key in ready[0][1]
            }
            write_states(state.cache, _rows_of(state.cache, [k for k, _ in ready], stacked))
        waiting = {k: todo[i] for k, i in enumerate(kept) if i in todo}
        if waiting:
            length = _fold_length([len(t) for t in waiting.values()])
            fold = [k for k, t in waiting.items() if len(t) >= length]
            self._fold(state, fold, [waiting[k][:length] for k in fold], [start[kept[k]] for k in fold])
            for k, tokens in waiting.items():
                rest = tokens[length:] if k in fold else tokens
                if rest:
                    self.unfolded[rows[kept[k]]] = rest
        return state

    # -------------------------------------------------------------------------------------------- pieces
    def _forward(self, cache, tokens, positions, masks, hidden: bool = True, **kwargs):
        """One target forward (counted in `target_forwards`)."""
        self.target_forwards += 1
        return self.target(
            input_ids=tokens,
            attention_mask=masks,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=feature_layers(self.head) if hidden else False,
            **kwargs,
        )

    def _masks(self, valid, past_positions, seen, positions, causal_past: bool = False) -> dict:
        """`{layer type: mask}` (`tree.verify_attention_mask`): the verify mask `(A, 1, T, S + T)` of new tokens at
        `positions` `(A, T)` seeing `seen` `(A, T, T)` of each other, for attention layer types (with their sliding
        windows), None for linear and cacheless ones."""
        return verify_attention_mask(
            valid,
            seen,
            float_dtype(self.target),
            self.windows,
            past_positions,
            positions,
            layer_types=self.types,
            unmasked=STATE_LAYER_TYPES + CACHELESS_LAYER_TYPES,
            causal_past=causal_past,
        )

    def _stop_recording(self, cache):
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                stop_past_recording(layer)

    def _chain_states(self, state, chain, count: torch.Tensor, before: dict) -> dict:
        """The linear states after each row's accepted nodes (`count` of shape `(A,)`, root included) of the chain.

        Convolution states: the K recorded inputs ending at the last accepted one. Recurrent states: the final one
        where the whole chain was accepted; otherwise replayed from the state before the round.
        """
        k1 = chain.tokens.shape[1] + 1
        states = {}
        for (index, s), old in before.items():
            layer = state.cache.layers[index]
            conv = None
            if old.conv is not None:  # recorded: (A, C, K + k + 1), the K inputs before the round first
                size = old.conv.shape[-1]
                window = count[:, None, None] + torch.arange(size, device=count.device)  # (A, 1, K)
                conv = linear_state(layer, s)[0].gather(2, window.expand(-1, old.conv.shape[1], -1))
            rec = linear_state(layer, s)[1].clone() if old.recurrent is not None else None
            states[index, s] = LinearState(conv, rec)
        self._stop_recording(state.cache)
        if any(s.recurrent is not None for s in states.values()):
            tokens = torch.cat([state.anchors[:, None], chain.tokens], dim=1)  # (A, k + 1)
            for v in sorted(set(count[count < k1].tolist())):
                rows = (count == v).nonzero()[:, 0]
                cache = self._replay_cache(state, rows, {key: s.map(lambda t: t[rows]) for key, s in before.items()})
                depths = torch.arange(v, device=tokens.device).expand(rows.shape[0], v)
                seen = torch.ones(v, v, dtype=torch.bool, device=tokens.device).tril().expand(rows.shape[0], v, v)
                positions = state.anchor_pos[rows, None] + depths
                masks = self._masks(state.valid[rows], state.positions[rows], seen, positions)
                self._forward(cache, tokens[rows, :v], positions, masks, hidden=False, **logits_to_keep(self.target, 1))
                _put_states(states, rows, cache, conv=False)
        return states

    def _replay_cache(self, state, rows: torch.Tensor, states: dict, past: int | None = None) -> HybridCache:
        """A new cache for rows `rows` `(R,)` (a row may repeat): their first `past` key/value entries (default: the
        round's past) and linear `states` `{(layer, s): LinearState (R, ...)}`. Memory: a copy of each."""
        past = state.valid.shape[1] if past is None else past
        attention = {
            i: tuple(t[rows, :, :past] for t in kv_layer_entries(state.cache.layers[i])) for i in self.attention
        }
        return filled_cache(self.types, attention, states)

    def _paths_forward(self, state, part: list, leads: list):
        """One forward of the leaf paths `part` `[(active row, nodes, tokens)]`, right-padded to the longest, each
        after its row's past and from its row's linear states. A row's first `leads[p]` tokens are committed tokens
        whose keys/values the cache already holds (`unfolded`): they see the past up to their own position and no
        new entry, and no other token sees their new entries.

        Returns:
            `(output, cache, L)`: the target's output, the cache the forward filled (past, then the paths' entries;
            the linear states after each padded row) and the rows' length L.
        """
        device = state.anchors.device
        length = max(len(tokens) for _, _, tokens in part)
        rows = torch.tensor([i for i, _, _ in part], device=device)
        ids = torch.tensor([tokens + tokens[-1:] * (length - len(tokens)) for _, _, tokens in part], device=device)
        lead = torch.tensor(leads, device=device)[:, None, None]  # (R, 1, 1)
        steps = torch.arange(length, device=device)
        positions = state.anchor_pos[rows, None] - lead[:, 0] + steps  # (R, L)
        query, key = steps[None, :, None], steps[None, None, :]
        seen = (key <= query) & (key >= lead) & (query >= lead)  # (R, L, L): causal over the path, no lead entry
        masks = self._masks(state.valid[rows], state.positions[rows], seen, positions, causal_past=True)
        linear = read_states(state.cache, copy=False)
        cache = self._replay_cache(state, rows, {key: s.map(lambda t: t[rows]) for key, s in linear.items()})
        out = self._forward(cache, ids, positions, masks, **logits_to_keep(self.target, 0))
        return out, cache, length

    def _fold(self, state, rows: list, tokens: list, starts: list):
        """Forward 2 of a tree round: active rows `rows` fold `tokens` (one list per row, all of one length,
        committed and already held by the attention layers) into their linear states, from the positions
        `starts`. Their queries see the cache up to their own position and none of their new entries."""
        if not rows:
            return
        device = state.anchors.device
        index = torch.tensor(rows, device=device)
        ids = torch.tensor(tokens, device=device)
        r, v = ids.shape
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(v, device=device)
        seen = torch.zeros(r, v, v, dtype=torch.bool, device=device)
        masks = self._masks(state.valid[index], state.positions[index], seen, positions, causal_past=True)
        linear = read_states(state.cache, copy=False)
        cache = self._replay_cache(state, index, {key: s.map(lambda t: t[index]) for key, s in linear.items()})
        self._forward(cache, ids, positions, masks, hidden=False, **logits_to_keep(self.target, 1))
        _put_states(linear, index, cache, conv=True)

    def _fold_all(self, state):
        """Fold every row's `unfolded` tokens (one forward per distinct count): before a chain round, which starts
        from the states after every committed token but the anchor. Only "auto" leaves any for a chain round."""
        if not self.unfolded:
            return
        rows = state.rows.tolist()
        waiting = {k: self.unfolded[r] for k, r in enumerate(rows) if r in self.unfolded}
        anchor_pos = state.anchor_pos.tolist()
        for v in sorted({len(t) for t in waiting.values()}):
            group = [k for k, t in waiting.items() if len(t) == v]
            self._fold(state, group, [waiting[k] for k in group], [anchor_pos[k] - v for k in group])
        self.unfolded = {}

    def _paths_per_forward(self, state, length: int) -> int:
        """Leaf paths per forward: as many as fit in `WEIGHTS_SHARE` of the target's weights, or in
        `PATHS_FORWARD_BYTES` where that is more, each path counted at its copies of the row's linear states and past
        keys/values and its logits over `length` positions."""
        a, past = state.valid.shape
        per_path = (
            sum(
                t.numel() * t.element_size()
                for s in read_states(state.cache, copy=False).values()
                for t in (s.conv, s.recurrent)
                if t is not None
            )
            / a
        )
        per_path += sum(
            t.shape[1] * (past + length) * t.shape[-1] * t.element_size()
            for i in self.attention
            for t in kv_layer_entries(state.cache.layers[i])
        )
        per_path += length * self.vocab * 4
        return max(1, int(max(PATHS_FORWARD_BYTES, self.weight_bytes * WEIGHTS_SHARE) // per_path))

    def _mode_seconds(self, state, trees) -> dict:
        """ "auto": the seconds of a chain verify and of a tree verify (forward 1) of this batch and tree size, timed
        once per (target, device, dtype, batch, nodes) and kept on the head beside the measured budget's costs."""
        a, n1 = trees.depths.shape
        per_target = self.head.verify_cost_cache.setdefault(self.target, {})
        key = ("tree_verify", str(self.target.device), self.target.dtype, a, n1)
        if key not in per_target:
            self._fold_all(state)

            def once(mode):
                self._verify(mode, state, trees)
                self.discard(state, trees)

            per_target[key] = {
                mode: median_seconds(functools.partial(once, mode), repeats=2, warmup=1) for mode in ROUND_MODES
            }
        return per_target[key]


@dataclass
class TreeRound:
    """What a tree round's forward 1 leaves for its compaction."""

    plans: list  # per active row, its `LeafPaths`
    lead: list  # per active row, the unfolded tokens its paths ran first
    anchors: list  # per active row, its anchor
    shapes: list  # per active row, `(tokens, parents)` of its tree
    index_of: dict  # (active row, leaf) -> index of its path
    ends: dict  # path index -> the linear states after the path, for the paths no padding followed


@dataclass
class LeafPaths:
    """A tree's root-to-leaf paths and where each node is read from (`leaf_paths`)."""

    paths: list  # per leaf, its nodes root first (node 0 the root)
    source: list  # per node 0..n, `(path index, depth)`: a path holding it (its own where it is a leaf) and where
    canonical: list  # per node 0..n, the first node with its parent and token (a tree padded with copies of its
    # last node holds them twice; acceptance takes the first)


def leaf_paths(tokens: list, parents: list) -> LeafPaths:
    """The root-to-leaf paths of one tree (`tokens`, `parents` of nodes 1..n, root excluded), one per distinct leaf:
    a node that repeats an earlier node's parent and token (the padding of `steps._stack_trees`) is read from that
    node's path."""
    n = len(tokens)
    canonical, first = [0] * (n + 1), {}
    for j in range(1, n + 1):
        canonical[j] = first.setdefault((canonical[parents[j - 1]], tokens[j - 1]), j)
    has_child = [False] * (n + 1)
    for j in range(1, n + 1):
        if canonical[j] == j:
            has_child[canonical[parents[j - 1]]] = True
    paths, leaf_index = [], {}
    for j in range(n + 1):
        if canonical[j] == j and not has_child[j]:
            path, node = [j], j
            while node:
                node = canonical[parents[node - 1]]
                path.append(node)
            leaf_index[j] = len(paths)
            paths.append(path[::-1])
    source = [None] * (n + 1)
    depth = [0] * (n + 1)
    for j in range(1, n + 1):
        depth[j] = depth[parents[j - 1]] + 1
    for j in range(n, -1, -1):  # children follow their parents: a parent's source is one of its children's
        if canonical[j] != j:
            continue
        if j in leaf_index:
            source[j] = (leaf_index[j], depth[j])
        if j:
            parent = canonical[parents[j - 1]]
            if source[parent] is None:
                source[parent] = (source[j][0], depth[parent])
    for j in range(n + 1):
        if source[j] is None:
            source[j] = source[canonical[j]]
    return LeafPaths(paths, source, canonical)


def _fold_length(lengths: list) -> int:
    """Forward 2 folds one count of tokens for every row it runs (a row's tokens cannot be padded: padding would
    enter its state). The count chosen leaves the fewest tokens unfolded in any row (ties: the larger count): rows
    with at least that many fold that many, the others none, and what stays is run first in the next round's
    forward 1. At batch 1 a row folds all its tokens; at batch 2 what stays is at most about a tree's depth."""
    best = None
    for m in sorted(set(lengths)):
        left = max(n - m if n >= m else n for n in lengths)
        if best is None or left <= best[0]:
            best = (left, m)
    return best[1]


def _rows_of(cache, rows: list, states: dict) -> dict:
    """`states` `{(layer, s): LinearState (1, ...)}` written into rows `rows` of a copy of the cache's own
    states."""
    out = {}
    for key, new in states.items():
        conv, recurrent = linear_state(cache.layers[key[0]], key[1])
        index = torch.tensor(rows, device=(conv if conv is not None else recurrent).device)
        if conv is not None and new.conv is not None:
            conv = conv.index_copy(0, index, new.conv.to(conv.dtype))
        if recurrent is not None and new.recurrent is not None:
            recurrent = recurrent.index_copy(0, index, new.recurrent.to(recurrent.dtype))
        out[key] = LinearState(conv, recurrent)
    return out


class ModeChooser:
    """`tree_verify="auto"`: each round's mode, the one with the most expected tokens per second, `tau(m) /
    (t(m) + e(m) * t(chain))`, from `t(m)`, the measured seconds of a verify in mode m (a chain's forward, a tree's
    forward 1), `e(m)` the forwards its rounds run after the verify (chain: replays; tree: the fold), priced as a
    chain's verify (a forward of at most depth + 1 tokens per row), and `tau(m)` the mean committed tokens per row and
    round. A tree round tells both taus (the chain's is the part of the accepted path along first children) and the
    chain's replays; a chain round only its own. The first two rounds are trees, and so is every `explore_every`-th
    round while chains are chosen."""

    def __init__(self, explore_every: int = 8, window: int = 32):
        self.explore_every = explore_every
        self.tau = {mode: deque(maxlen=window) for mode in ROUND_MODES}
        self.forwards = {mode: deque(maxlen=window) for mode in ROUND_MODES}
        self.rounds = 0

    def next_mode(self, seconds: dict) -> str:
        if self.rounds < 2 or not self.tau["tree"] or self.rounds % self.explore_every == 0:
            mode = "tree"
        else:
            mode = max(ROUND_MODES, key=lambda m: self.rate(m, seconds))
        self.rounds += 1
        return mode

    def rate(self, mode: str, seconds: dict) -> float:
        """Expected committed tokens per second and row in `mode`."""
        tau = sum(self.tau[mode]) / max(len(self.tau[mode]), 1)
        extra = sum(self.forwards[mode]) / max(len(self.forwards[mode]), 1)
        return tau / (seconds[mode] + extra * seconds["chain"])

    def observe(self, mode: str, trees: DraftTrees, acc: Acceptance, recurrent: bool):
        """A round's acceptance: its tau, and after a tree round the chain's tau and replays on the same round."""
        counts = acc.count.tolist()
        self.tau[mode].append(sum(counts) / len(counts))
        if mode != "tree":
            return
        nodes = acc.nodes.tolist()
        parents = [t.parents for t in trees.host] if trees.host is not None else trees.parents.tolist()
        chain_counts = []
        for path, count, parent in zip(nodes, counts, parents):
            firsts = {}
            for j, p in enumerate(parent, start=1):
                firsts.setdefault(p, j)  # a node's first child: the chain's node at the next depth
            along = 1
            while along < count and firsts.get(path[along - 1]) == path[along]:
                along += 1
            chain_counts.append(along)
        self.tau["chain"].append(sum(chain_counts) / len(chain_counts))
        longest = [len(firsts_path(parent)) + 1 for parent in parents]
        replays = {c for c, k1 in zip(chain_counts, longest) if c < k1} if recurrent else set()
        self.forwards["chain"].append(len(replays))

    def extra(self, mode: str, forwards: int):
        """The forwards a round ran after its verify (replays, fold)."""
        self.forwards[mode].append(forwards)


def firsts_path(parents: list) -> list:
    """The nodes of a tree's best path (`best_path`): the first child at every depth from the root."""
    path, node = [], 0
    while node in parents:
        node = parents.index(node) + 1
        path.append(node)
    return path


def _put_states(states: dict, rows: torch.Tensor, cache, conv: bool):
    """Write the linear states of `cache` (one per row of `rows` `(R,)`) into rows `rows` of `states`
    `{(layer, s): LinearState (A, ...)}`: the recurrent states, and with `conv` the convolution states."""
    for (index, s), out in states.items():
        new_conv, new_recurrent = linear_state(cache.layers[index], s)
        if out.recurrent is not None:
            out.recurrent[rows] = new_recurrent
        if conv and out.conv is not None:
            out.conv[rows] = new_conv


def _row_states(cache, row: int) -> dict:
    """The linear states `{(layer, s): LinearState (1, ...)}` of one batch row of a forward's cache, copied."""
    return {
        key: LinearState(*linear_state(cache.layers[key[0]], key[1])).map(lambda t: t[row : row + 1].clone())
        for key in read_states(cache, copy=False)
    }
