"""Verification for hybrid targets: attention layers next to layers that keep a recurrent or convolution state
(gated delta-net in Qwen3.5 / Qwen3.6 and Qwen3-Next, Kimi delta attention, Mamba in Jamba, Bamba, Granite 4 and
Nemotron-H, short convolutions in LFM2; `docs/design.md`, "§2 The round", "§7 Targets and checkpoint formats").

A key/value cache can keep any subset of a tree's entries, so an attention target verifies the whole tree in one
forward. A recurrent state cannot: it folds its tokens in order, so a state holds one path. Two ways of verifying
serve these targets, chosen per call with `tree_verify`, each in a module of its own:

- "chain" (`hybrid_chain.py`): the tree's best root-to-leaf path in one forward, with the cache's past recording on;
  convolution states are cut back per row, and a row that rejected part of its path is replayed over its accepted
  tokens;
- "tree" (`hybrid_tree.py`): every root-to-leaf path in one forward (a batch row per leaf, the rows' attention past
  read in place, `shared_past.py`), where its memory allows, then at most one fold of the committed tokens;
- "auto" (the default): per round, the mode with the most expected tokens per second ([`ModeChooser`]): a chain
  verify and a tree's forward 1 timed once per batch and tree size, the extra forwards (replays, folds) and the tau
  each mode shows (a tree round shows the chain's too).

[`HybridVerifier`] is the `state.Verifier` of these targets: it prefills into a `hybrid_cache.HybridCache` and hands
each round to the mode it runs in. The cache, the rows' linear states and the forwards both modes run (counted) are
in `hybrid_cache.py`.

Lossless: every committed token is the target's choice after exactly the committed tokens, whichever nodes are
verified, and the state a row keeps is the state after exactly its committed tokens minus the anchor.
"""

import functools
from collections import deque

import torch

from .hybrid_cache import (
    ATTENTION_LAYER_TYPES,
    CACHELESS_LAYER_TYPES,
    STATE_LAYER_TYPES,
    HybridCache,
    HybridForwards,
    layer_types,
    read_states,
)
from .hybrid_chain import ChainRounds, firsts_path
from .hybrid_tree import TreeRounds
from .state import Acceptance, DraftTrees, RoundState
from .steps import prefill
from .timing import median_seconds

TREE_VERIFY = ("auto", "tree", "chain")
ROUND_MODES = ("chain", "tree")  # what a round runs; "auto" chooses one per round


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
        self.target, self.head, self.mode = target, head, mode
        self.forwards = HybridForwards(target, head, windows)
        self.modes = {"chain": ChainRounds(self.forwards), "tree": TreeRounds(self.forwards)}
        self.round = None  # what `verify` leaves for `compact`: (mode, what that mode needs)
        self.added = 0  # entries the last verify added to the attention layers
        self.chooser = ModeChooser() if mode == "auto" else None

    @property
    def target_forwards(self) -> int:
        return self.forwards.target_forwards

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, before_context=None
    ) -> tuple[RoundState, torch.Tensor]:
        """`steps.prefill` into a new `hybrid_cache.HybridCache`."""
        forwards = self.forwards
        forwards.target_forwards += 1
        forwards.unfolded = {}
        state, logits = prefill(
            self.head, self.target, input_ids, attention_mask, HybridCache(forwards.types), before_context
        )
        forwards.recurrent = any(s.recurrent is not None for s in read_states(state.cache, copy=False).values())
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
            self.chooser.observe(mode, trees, acc, self.forwards.recurrent)
        state = self.modes[mode].compact(state, trees, acc, features, keep, data)
        if self.chooser is not None:
            self.chooser.extra(mode, self.target_forwards - forwards)
        return state

    def discard(self, state: RoundState, trees: DraftTrees):
        """Undo a `verify` without compacting (timing repeats)."""
        mode, data = self.round
        self.round = None
        for index in self.forwards.attention:
            state.cache.layers[index].crop(-self.added)  # the chain's or the tree's entries
        if mode == "chain":
            self.modes["chain"].discard(state, data)

    def _verify(self, mode: str, state: RoundState, trees: DraftTrees):
        if mode == "tree":
            logits, features, data = self.modes["tree"].verify(state, trees)
            verified = trees
        else:
            verified, logits, features, data = self.modes["chain"].verify(state, trees)
        self.added = verified.depths.shape[1]
        self.round = (mode, data)
        return verified, logits, features

    def _mode_seconds(self, state, trees) -> dict:
        """ "auto": the seconds of a chain verify and of a tree verify (forward 1) of this batch and tree size, timed
        once per (target, device, dtype, batch, nodes) and kept on the head beside the operating point's host costs
        (`host_costs.py`)."""
        a, n1 = trees.depths.shape
        per_target = self.head.verify_cost_cache.setdefault(self.target, {})
        key = ("tree_verify", str(self.target.device), self.target.dtype, a, n1)
        if key not in per_target:
            self.forwards.fold_all(state)

            def once(mode):
                self._verify(mode, state, trees)
                self.discard(state, trees)

            per_target[key] = {
                mode: median_seconds(functools.partial(once, mode), repeats=2, warmup=1) for mode in ROUND_MODES
            }
        return per_target[key]


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
