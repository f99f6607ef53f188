"""Chain verification of a hybrid target (`tree_verify="chain"`; `docs/design.md`, "§7 Targets and checkpoint
formats").

The tree's best root-to-leaf path ([`best_path`]: the best-first child at every depth, the prompt-lookup branch
included when it leads) runs in one forward on the round's cache, with the cache's past recording on
(`Cache.activate_past_recording`). After acceptance, convolution states are cut back to the accepted length from
the recorded window, as transformers' `LinearAttentionCacheLayerMixin.crop` does, per row. A recurrent state has no
recording (`Cache.is_croppable` is False): a row that rejected part of its path is replayed from the state before
the round over its accepted tokens, one forward per distinct accepted length, its attention layers reading the
round's past in place (`shared_past.py`).

Lossless: every committed token is the target's choice after exactly the committed tokens, and the state a row keeps
is the state after exactly its committed tokens minus the anchor.
"""

import functools

import torch

from .compat import LinearAttentionCacheLayerMixin, linear_state, stop_past_recording
from .hybrid_cache import HybridForwards, LinearState, put_states, read_states, rows_of_states, write_states
from .state import Acceptance, DraftTrees, RoundState
from .steps import compact, keep_accepted_entries, kept_masks, logits_to_keep


def firsts_path(parents: list) -> list:
    """The nodes of a tree's best path ([`best_path`]): the first child at every depth from the root."""
    path, node = [], 0
    while node in parents:
        node = parents.index(node) + 1
        path.append(node)
    return path


def best_path(trees: DraftTrees) -> DraftTrees:
    """The tree's best root-to-leaf path as a chain: from the root, the first child (best-first order: the
    highest-scored) at every depth. Rows whose paths are shorter repeat their last token (still checked against the
    target, so lossless; their acceptance simply stops or goes on like any node's).

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
    tokens = trees.tokens.gather(1, nodes - 1)  # (A, k); the draft's branches and head tokens name their sources
    return DraftTrees(
        tokens,
        parents,
        depths,
        ancestors,
        trees.budget,
        branches=trees.branches,
        head_tokens=trees.head_tokens,
        answers=trees.answers,
    )


class ChainRounds:
    """The rounds of `tree_verify="chain"` (see the module), through the verifier's [`HybridForwards`]."""

    def __init__(self, forwards: HybridForwards):
        self.forwards = forwards

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple:
        """The best paths in one forward after `state`'s cache, past recording on.

        Returns:
            `(chain, logits, features, before)`: the chains (k nodes per row), the target's logits `(A, k + 1, V)` in
            fp32 and the head's features `(A, k + 1, kH)`, and the linear states before the round (copies).
        """
        forwards = self.forwards
        forwards.fold_all(state)  # a chain starts from the states after every committed token but the anchor
        chain = best_path(trees)
        before = read_states(state.cache)  # the states before the round, for replays and discards
        for layer in state.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.activate_past_recording()
        tokens = torch.cat([state.anchors[:, None], chain.tokens], dim=1)  # (A, k + 1)
        positions = state.anchor_pos[:, None] + chain.depths
        masks = forwards.masks(state.valid, state.positions, chain.ancestors, positions, kept=kept_masks(state))
        out = forwards.forward(state.cache, tokens, positions, masks)
        return chain, out.logits.float(), forwards.head.target_features(out.hidden_states), before

    def compact(self, state, chain, acc: Acceptance, features, keep, before: dict) -> RoundState:
        """`steps.compact` for the attention layers; each surviving row's linear states become those after its
        accepted nodes."""
        forwards = self.forwards
        states = self.states_after(state, chain, acc.count, before)
        keep_entries = functools.partial(keep_accepted_entries, layers=forwards.attention)
        state = compact(forwards.head, state, chain, acc, features, keep, keep_entries=keep_entries)
        write_states(state.cache, {key: s.map(lambda t: t[keep]) for key, s in states.items()})
        return state

    def discard(self, state: RoundState, before: dict):
        """Undo a verify (timing repeats): the linear states before it, recording off (the caller crops the
        attention layers)."""
        write_states(state.cache, before)
        stop_recording(state.cache)

    def states_after(self, state, chain, count: torch.Tensor, before: dict) -> dict:
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
        stop_recording(state.cache)
        if any(s.recurrent is not None for s in states.values()):
            tokens = torch.cat([state.anchors[:, None], chain.tokens], dim=1)  # (A, k + 1)
            for v in sorted(set(count[count < k1].tolist())):
                self.replay(state, (count == v).nonzero()[:, 0], tokens[:, :v], before, states)
        return states

    def replay(self, state, rows: torch.Tensor, tokens: torch.Tensor, before: dict, states: dict):
        """The recurrent states of rows `rows` `(R,)` after `tokens[rows]` `(A, v)` from their states `before` the
        round, written into `states`; the attention layers read the round's past in place."""
        forwards, v, r = self.forwards, tokens.shape[1], rows.shape[0]
        cache, layout, used = forwards.rows_cache(state, rows.tolist(), v, rows_of_states(before, rows))
        seen = torch.ones(v, v, dtype=torch.bool, device=tokens.device).tril().expand(r, v, v)
        positions = state.anchor_pos[rows, None] + torch.arange(v, device=tokens.device)
        masks = forwards.shared_masks(layout, state, used, seen, positions, causal_past=False)
        forwards.forward(cache, tokens[rows], positions, masks, hidden=False, **logits_to_keep(forwards.target, 1))
        put_states(states, rows, cache, conv=False)


def stop_recording(cache):
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            stop_past_recording(layer)
