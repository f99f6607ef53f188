"""Tree verification of a hybrid target (`tree_verify="tree"`; `docs/design.md`, "§7 Targets and checkpoint
formats"): the whole tree in at most two forwards per round, where the forward's memory allows.

Forward 1 runs the tree's root-to-leaf paths ([`leaf_paths`]), one batch row per leaf, each from its row's recurrent
and convolution states (copied per leaf), right-padded to the longest. Their attention layers read the row's past
where it lies, once for all its leaves (`shared_past.py`), under the causal mask. A causal forward's output at a node
depends only on the node's path, so every node's logits, features and keys/values are read from a leaf row that
holds it. A row whose accepted path is its best path (the first child at every depth, what an always-right drafter
accepts) and reached that path's leaf with no padding after it keeps that leaf row's states: one forward per round.
The others fold their committed tokens into their states in forward 2, from the states before the round; padding
would enter a state, so the fold runs one count of tokens for all its rows ([`fold_length`]), and a row left with
some runs them first in its next round's forward 1 (their keys/values are already cached: they see the cache up to
their own position and add nothing to it).

Memory: forward 1 holds, per leaf path, its copy of the row's linear states, the working tensors of the largest
linear layer (the gated delta-net's chunked form works on many per-token tensors of its head sizes), its logits and
its part of the masks and new keys ([`TreeRounds.path_bytes`]); the past is not counted per path, it is read in
place. As many paths run in one forward as fit in `PATHS_FORWARD_BYTES` or `WEIGHTS_SHARE` of the target's weights,
and never fewer than the batch's rows (a chain verify's forward holds that many rows); the rest run in further
forwards.

Lossless: every committed token is the target's choice after exactly the committed tokens, and the state a row keeps
is the state after exactly its committed tokens minus the anchor.
"""

import functools
import math
from dataclasses import dataclass

import torch

from .compat import kv_layer_entries, linear_state
from .hybrid_cache import HybridForwards, LinearState, read_states, rows_of_states, write_states
from .hybrid_chain import firsts_path
from .state import Acceptance, DraftTrees, RoundState
from .steps import compact, float_dtype, keep_accepted_entries, logits_to_keep

# forward 1 runs as many leaf paths as fit (`TreeRounds.path_bytes`) in a quarter of the target's weights, or in this
# size where that is larger. A real Qwen3.5 9B (18 GB of bf16 weights; 24 gated delta-net layers of 32 value heads x
# 128 x 128, 48 MiB of fp32 recurrent states per path, 19 MiB of one layer's working tensors, 12 MiB of logits over
# its 248K-token vocabulary at 8 tokens) runs about 50 paths per forward: a budget-32 tree's 20-odd leaves at batch 2
PATHS_FORWARD_BYTES = 64 * 2**20
WEIGHTS_SHARE = 0.25
CHUNK = 64  # the chunked gated delta rule pads a forward's tokens to a multiple of this


@dataclass
class LeafPaths:
    """A tree's root-to-leaf paths and where each node is read from ([`leaf_paths`])."""

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


def fold_length(lengths: list) -> int:
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


@dataclass
class TreeRound:
    """What a tree round's forward 1 leaves for its compaction."""

    plans: list  # per active row, its `LeafPaths`
    lead: list  # per active row, the unfolded tokens its paths ran first
    anchors: list  # per active row, its anchor
    shapes: list  # per active row, `(tokens, parents)` of its tree
    ends: dict  # active row -> `(leaf, {(layer, s): LinearState (1, ...)})`: its best path's leaf and the states after
    # it, where no padding followed it in its forward


@dataclass
class PathsForward:
    """The leaf paths of a tree round, in the order forward 1 runs them."""

    rows: list  # per path, its active row
    nodes: list  # per path, its nodes root first
    tokens: list  # per path, its tokens: the row's unfolded ones, the anchor, then the nodes'
    leads: list  # per path, how many of its tokens are unfolded ones
    first: list  # per active row, the index of its first path


class TreeRounds:
    """The rounds of `tree_verify="tree"` (see the module), through the verifier's [`HybridForwards`]."""

    def __init__(self, forwards: HybridForwards):
        self.forwards = forwards
        target = forwards.target
        self.weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        text = target.config.get_text_config(decoder=True)
        self.vocab, self.hidden_size = text.vocab_size, text.hidden_size

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple:
        """Forward 1: every root-to-leaf path, one batch row per leaf, each from its row's linear states (the row's
        `unfolded` tokens first), in as few forwards as [`paths_per_forward`] allows.

        Returns:
            `(logits, features, round)`: the target's logits after every node `(A, n + 1, V)` in fp32, the head's
            features `(A, n + 1, kH)`, and the [`TreeRound`] for [`compact`]. The attention layers hold past + n + 1
            entries, as after a tree verify; the linear layers still hold the states before the round.
        """
        a, n1 = trees.depths.shape
        shapes = (
            [(t.tokens, t.parents) for t in trees.host]
            if trees.host is not None
            else list(zip(trees.tokens.tolist(), trees.parents.tolist()))
        )
        plans = [leaf_paths(tokens, parents) for tokens, parents in shapes]
        lead = [self.forwards.unfolded.get(r, []) for r in state.rows.tolist()]
        paths = self._paths(state, shapes, plans, lead)
        best = {
            i: plan.canonical[(firsts_path(parents) or [0])[-1]]
            for i, (plan, (_, parents)) in enumerate(zip(plans, shapes))
        }
        out = _Gathered(state, self.forwards, a, n1)
        ends = {}
        slots = max(len(plan.paths) for plan in plans)
        chunk = self.paths_per_forward(state, max(len(t) for t in paths.tokens), slots)
        for start in range(0, len(paths.rows), chunk):
            part = range(start, min(start + chunk, len(paths.rows)))
            result, cache, layout = self.paths_forward(state, paths, part)
            out.gather(result, cache, layout, plans, paths, part)
            length = max(len(paths.tokens[p]) for p in part)
            for k, p in enumerate(part):  # a best path that no padding followed: its states are the path's
                row = paths.rows[p]
                if paths.nodes[p][-1] == best[row] and len(paths.tokens[p]) == length:
                    ends[row] = (best[row], _row_states(cache, k))
            del result, cache
        for index, (keys, values) in out.keys.items():  # the cache now holds past + n + 1 entries, as a tree verify's
            state.cache.layers[index].update(keys, values)
        anchors = state.anchors.tolist()
        return out.logits, out.features, TreeRound(plans, lead, anchors, shapes, ends)

    def _paths(self, state, shapes: list, plans: list, lead: list) -> PathsForward:
        anchors = state.anchors.tolist()
        paths = PathsForward([], [], [], [], [])
        for i, ((tokens, _), plan) in enumerate(zip(shapes, plans)):
            paths.first.append(len(paths.rows))
            for path in plan.paths:
                paths.rows.append(i)
                paths.nodes.append(path)
                paths.tokens.append(lead[i] + [anchors[i]] + [tokens[j - 1] for j in path[1:]])
                paths.leads.append(len(lead[i]))
        return paths

    def paths_forward(self, state: RoundState, paths: PathsForward, part) -> tuple:
        """One forward of the leaf paths `part` (indices into `paths`), right-padded to the longest, each after its
        row's past (read in place) and from its row's linear states. A row's first `leads` tokens are committed
        tokens whose keys/values the cache already holds (`unfolded`): they see the past up to their own position
        and no new entry, and no other token sees their new entries.

        Returns:
            `(output, cache, layout)`: the target's output (per forward row), the cache the forward filled (the
            paths' new entries laid out by `layout`, the linear states after each padded row) and the forward rows'
            `shared_past.SharedRows`.
        """
        forwards, device = self.forwards, state.anchors.device
        rows = [paths.rows[p] for p in part]
        length = max(len(paths.tokens[p]) for p in part)
        ids = torch.tensor([paths.tokens[p] + paths.tokens[p][-1:] * (length - len(paths.tokens[p])) for p in part])
        linear = read_states(state.cache, copy=False)
        index = torch.tensor(rows, device=device)
        cache, layout, used = forwards.rows_cache(state, rows, length, rows_of_states(linear, index))
        leads = {paths.rows[p]: paths.leads[p] for p in part}
        lead = torch.tensor([leads[r] for r in used.tolist()], device=device)[:, None, None]  # (A', 1, 1)
        steps = torch.arange(length, device=device)
        positions = state.anchor_pos[used, None] - lead[:, 0] + steps  # (A', L)
        query, key = steps[None, :, None], steps[None, None, :]
        seen = (key <= query) & (key >= lead) & (query >= lead)  # (A', L, L): causal over the path, no lead entry
        masks = forwards.shared_masks(layout, state, used, seen, positions, causal_past=True)
        out = forwards.forward(
            cache, ids.to(device), positions[layout.source], masks, **logits_to_keep(forwards.target, 0)
        )
        return out, cache, layout

    def compact(self, state, trees, acc: Acceptance, features, keep, data: TreeRound) -> RoundState:
        """After a tree round: the attention layers keep the accepted nodes (`steps.compact`); a row whose accepted
        path is its best path, whose leaf no padding followed, takes that path's states from forward 1; the others
        fold their committed tokens into their states in one forward (forward 2), as many as [`fold_length`]
        chooses."""
        forwards = self.forwards
        counts, nodes = acc.count.tolist(), acc.nodes.tolist()
        rows = state.rows.tolist()
        done, todo = {}, {}  # active row -> states from forward 1; active row -> committed tokens to fold
        for i, plan in enumerate(data.plans):
            path = nodes[i][: counts[i]]
            end = data.ends.get(i)
            if end is not None and end[0] == plan.canonical[path[-1]]:
                done[i] = end[1]
            else:
                todo[i] = data.lead[i] + [data.anchors[i]] + [data.shapes[i][0][j - 1] for j in path[1:]]
        anchor_pos = state.anchor_pos.tolist()
        start = {i: anchor_pos[i] - len(data.lead[i]) for i in todo}  # the first unfolded position
        keep_entries = functools.partial(keep_accepted_entries, layers=forwards.attention)
        state = compact(forwards.head, state, trees, acc, features, keep, keep_entries=keep_entries)
        kept = keep.tolist()
        forwards.unfolded = {}
        ready = [(k, done[i]) for k, i in enumerate(kept) if i in done]
        if ready:
            write_states(state.cache, _rows_of(state.cache, [k for k, _ in ready], _stacked([s for _, s in ready])))
        waiting = {k: todo[i] for k, i in enumerate(kept) if i in todo}
        if waiting:
            length = fold_length([len(t) for t in waiting.values()])
            fold = [k for k, t in waiting.items() if len(t) >= length]
            forwards.fold(state, fold, [waiting[k][:length] for k in fold], [start[kept[k]] for k in fold])
            for k, tokens in waiting.items():
                rest = tokens[length:] if k in fold else tokens
                if rest:
                    forwards.unfolded[rows[kept[k]]] = rest
        return state

    def paths_per_forward(self, state: RoundState, length: int, slots: int) -> int:
        """Leaf paths per forward: as many as fit in `WEIGHTS_SHARE` of the target's weights, or in
        `PATHS_FORWARD_BYTES` where that is more, each counted at [`path_bytes`]; at least the batch's rows."""
        bound = max(PATHS_FORWARD_BYTES, self.weight_bytes * WEIGHTS_SHARE)
        return max(state.rows.shape[0], int(bound // self.path_bytes(state, length, slots)))

    def path_bytes(self, state: RoundState, length: int, slots: int) -> int:
        """What one leaf path of `length` tokens adds to forward 1 (see the module), its row running `slots` paths:
        its copy of the row's linear states, the largest linear layer's working tensors, its logits (the target's
        dtype and float32), its hidden states (the head's feature layers and the last), its rows of the masks
        (one per window) and its new keys/values. The past is read in place: not counted."""
        forwards = self.forwards
        a, past = state.valid.shape
        linear = read_states(state.cache, copy=False).values()
        states = sum(t.numel() * t.element_size() for s in linear for t in s.tensors()) / a
        working = max((_working_bytes(s, length) for s in linear), default=0)
        itemsize = float_dtype(forwards.target).itemsize
        logits = length * self.vocab * (itemsize + 4)
        hidden = length * self.hidden_size * itemsize * (len(forwards.head.config.target_layer_ids) + 2)
        windows = {None} if forwards.windows is None else set(forwards.windows.values())
        masks = length * (past + slots * length) * itemsize * len(windows)
        entries = sum(
            t.shape[1] * length * t.shape[-1] * t.element_size()
            for i in forwards.attention
            for t in kv_layer_entries(state.cache.layers[i])
        )
        return int(states + working + logits + hidden + masks + entries)


def _working_bytes(state: LinearState, length: int) -> int:
    """A linear layer's working tensors for one row of `length` tokens, float32. A recurrent state of `h` heads x
    `dk` x `dv` (gated delta-net, Kimi delta attention, Mamba-2) is counted as the chunked gated delta rule
    (transformers' torch form) works: about 9 per-token tensors of the head sizes over the tokens padded to `CHUNK`
    (`5 dk + 4 dv` per head and token), 3 `CHUNK x CHUNK` matrices per chunk and head, and 4 states. A recurrent state
    of another shape (Mamba's `(d_inner, d_state)`) as a selective scan works: 3 state-sized tensors per token. A
    convolution-only layer works on a few inputs of its width."""
    if state.recurrent is None:
        return 4 * state.conv[0].numel() * 4 if state.conv is not None else 0
    if state.recurrent.dim() != 4:
        return 4 * 3 * state.recurrent[0].numel() * length
    h, dk, dv = state.recurrent.shape[1:]
    padded = CHUNK * math.ceil(length / CHUNK)
    return 4 * h * (padded * (5 * dk + 4 * dv) + 3 * padded * CHUNK + 4 * dk * dv)


class _Gathered:
    """Every node's logits, features and keys/values, gathered from the leaf rows that hold them."""

    def __init__(self, state, forwards: HybridForwards, a: int, n1: int):
        self.state, self.forwards, self.a, self.n1 = state, forwards, a, n1
        self.logits = self.features = None
        self.keys = {
            i: tuple(t.new_zeros(a, t.shape[1], n1, t.shape[-1]) for t in kv_layer_entries(state.cache.layers[i]))
            for i in forwards.attention
        }

    def gather(self, out, cache, layout, plans: list, paths: PathsForward, part):
        feats = self.forwards.head.target_features(out.hidden_states)  # (R, L, kH)
        if self.logits is None:
            self.logits = out.logits.new_zeros(self.a, self.n1, out.logits.shape[-1], dtype=torch.float32)
            self.features = feats.new_zeros(self.a, self.n1, feats.shape[-1])
        start, stop = part.start, part.stop
        # the nodes whose source path is in this forward: (active row, node, row in the forward, offset)
        where = [
            (i, j, paths.first[i] + p - start, paths.leads[paths.first[i] + p] + depth)
            for i, plan in enumerate(plans)
            for j, (p, depth) in enumerate(plan.source)
            if start <= paths.first[i] + p < stop
        ]
        device = self.state.anchors.device
        ii, jj, pp, oo = (torch.tensor(x, device=device) for x in zip(*where))
        self.logits[ii, jj], self.features[ii, jj] = out.logits[pp, oo].float(), feats[pp, oo]
        for index, (keys, values) in self.keys.items():
            step_keys, step_values = cache.layers[index].entries(layout.source[pp], layout.slot[pp], oo)
            keys[ii, :, jj], values[ii, :, jj] = step_keys, step_values


def _stacked(states: list) -> dict:
    """Per-row states `[{(layer, s): LinearState (1, ...)}]` stacked into `{(layer, s): LinearState (R, ...)}`."""
    return {
        key: LinearState(
            *(
                torch.cat(parts) if parts[0] is not None else None
                for parts in zip(*((s[key].conv, s[key].recurrent) for s in states))
            )
        )
        for key in states[0]
    }


def _rows_of(cache, rows: list, states: dict) -> dict:
    """`states` `{(layer, s): LinearState (R, ...)}` written into rows `rows` of a copy of the cache's own
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


def _row_states(cache, row: int) -> dict:
    """The linear states `{(layer, s): LinearState (1, ...)}` of one batch row of a forward's cache, copied."""
    return {
        key: LinearState(*linear_state(cache.layers[key[0]], key[1])).map(lambda t: t[row : row + 1].clone())
        for key in read_states(cache, copy=False)
    }
