"""The verifiers: how a round reaches the target (arXiv 2606.18394, section 3.3; `docs/design.md`, "§2 The round").

Every verifier implements the [`Verifier`] protocol (declared in `state.py`, next to the [`Call`] that holds one):
`prefill`, `verify`, `compact`, `discard`, and a count of the target forwards it ran. [`TreeVerifier`] serves
targets whose layers all cache attention keys/values (the whole tree in one forward); `hybrid.HybridVerifier`
serves targets with recurrent or convolution layers. [`verifier_for`] picks one per call, so the round stays as it
is whatever the target keeps.

Also here: the verify costs that `tree_budget="auto"` and the benchmark read ([`verify_seconds`],
[`measure_verify_seconds`]), timed through a verifier like the round's own.
"""

from dataclasses import replace

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .compat import GrowingLayer, decoder_attention_implementation, growing_cache
from .hybrid import HybridVerifier, is_hybrid
from .reclaim import reclaim
from .linear_forms import LinearForms, check_verify_linear
from .state import DraftTrees, RoundState, TreeShape, Verifier
from .steps import compact, draft, prefill, verify
from .timing import median_seconds
from .verify_attention import verify_attention_of

__all__ = [
    "TREE_LAYER_TYPES",
    "TreeVerifier",
    "Verifier",
    "check_layer_types",
    "measure_verify_seconds",
    "verifier_for",
    "verify_seconds",
    "verify_windows",
]

TREE_LAYER_TYPES = ("full_attention", "sliding_attention")  # a key/value cache the tree loop can compact


class TreeVerifier:
    """How a target whose layers all cache attention keys/values verifies a round: the whole tree in one forward
    under the tree-causal mask ([`verify`]), then [`keep_accepted_entries`] in [`compact`].

    The round reaches the target only through these methods ([`Verifier`]), so a target whose layers keep another
    state (recurrent or convolution states) is served by a verifier of its own, chosen in [`verifier_for`].
    """

    def __init__(self, target, head, verify_linear: str = "auto"):
        self.target, self.head, self.windows = target, head, verify_windows(target)
        self.forms = LinearForms(verify_linear)  # the form of the target's linears in the verify
        self.attention = verify_attention_of(target)  # the attention function of the verify forward
        self.target_forwards = 0  # one per prefill, one per verify

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, before_context=None
    ) -> tuple[RoundState, torch.Tensor]:
        """[`prefill`] into a new cache of keys/values; see there."""
        # keys/values in buffers with room: a verify appends in place instead of copying the past (`GrowingLayer`).
        # flex_attention keeps transformers' own layer, whole tensors: inductor's compiled flex kernel decoded NaN
        # (every later token id 0) with views of larger buffers on the CI host (the CPU kernel fault of verify_attention)
        growing = decoder_attention_implementation(self.target) != "flex_attention"
        state, logits = prefill(
            self.head,
            self.target,
            input_ids,
            attention_mask,
            growing_cache() if growing else DynamicCache(),
            before_context,
        )
        self.target_forwards += 1
        expected = GrowingLayer if growing else DynamicLayer
        for layer in state.cache.layers:
            if type(layer) is not expected:
                raise ValueError(
                    f"expected a target cache of attention keys/values ({expected.__name__}), got {type(layer).__name__}"
                )
        return state, logits

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple[DraftTrees, torch.Tensor, torch.Tensor]:
        """[`verify`]. Returns the trees verified (another verifier may verify a part of them, e.g. one path) with
        their logits and features."""
        logits, features = verify(self.target, self.head, state, trees, self.windows, self.forms, self.attention)
        self.target_forwards += 1
        return trees, logits, features

    def compact(self, state, trees, acc, features, keep) -> RoundState:
        """[`compact`] with [`keep_accepted_entries`]."""
        return compact(self.head, state, trees, acc, features, keep)

    def reclaim(self, state: RoundState, live_bound: int) -> RoundState:
        """[`reclaim.reclaim`] after [`compact`]: the columns no row reads again (holes of uneven acceptance;
        entries out of the window when every layer slides) are freed once they make a quarter of the cache.
        `live_bound`: the longest active row's committed length - 1 (host data)."""
        window = self.windows[None] if self.windows is not None and None in self.windows else None
        return reclaim(state, window, live_bound)

    def discard(self, state: RoundState, trees: DraftTrees):
        """Undo a [`verify`] without compacting (timing repeats): drop the n + 1 entries it added."""
        state.cache.crop(-(trees.tokens.shape[1] + 1))


def verifier_for(target, head, tree_verify: str = "auto", verify_linear: str = "auto") -> Verifier:
    """The verifier of a call: [`TreeVerifier`] for targets whose layers all cache attention keys/values (its verify
    runs the target's linears in the form `verify_linear` picks, `linear_forms.py`), [`hybrid.HybridVerifier`]
    (`tree_verify`: "auto", "tree" or "chain") for targets with linear-attention or convolution layers; a
    `ValueError` naming the layer types of any other target."""
    check_verify_linear(verify_linear)
    if is_hybrid(target):
        return HybridVerifier(target, head, tree_verify, verify_windows(target))
    check_layer_types(target)
    if tree_verify not in ("auto", "tree"):
        raise ValueError(f"expected tree_verify 'auto' or 'tree' for an attention-only target, got {tree_verify!r}")
    return TreeVerifier(target, head, verify_linear)


def verify_windows(target) -> dict | None:
    """The sliding windows the verify mask applies, or `None` when no layer has one.

    Returns `{layer_type: window or None}` for targets with `layer_types` (the model takes a dict of masks and hands
    each layer the one of its type), or `{None: window}` when every layer slides (Mistral: one mask). Plain
    `generate` crops sliding layers' caches to the window; the tree loop masks by position, which attends to the
    same keys, and, when every layer slides, [`reclaim.reclaim`] cuts the entries out of the window (with both
    kinds of layers the cache keeps one width for all, so sliding layers keep every live entry).
    """
    text = target.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    if layer_types is None:
        return {None: window}
    return {t: window if t == "sliding_attention" else None for t in sorted(set(layer_types))}


def check_layer_types(target):
    """Reject targets whose layers keep a state other than attention keys/values (recurrent, hybrid)."""
    text = target.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in TREE_LAYER_TYPES})
    if other:
        raise ValueError(
            f"expected a target whose layers all cache attention keys/values ({', '.join(TREE_LAYER_TYPES)}), got "
            f"layer types {other} ({type(target).__name__}): a tree verify cannot be compacted in a recurrent state"
        )


# ------------------------------------------------------------------------------------------------ measured costs
def verify_seconds(
    verifier: Verifier, state: RoundState, trees: DraftTrees, repeats: int = 3, warmup: int = 1
) -> float:
    """Median wall time of the verifier's forward over `trees` after `state`'s cache, undone after every call
    ([`timing.median_seconds`]: it waits for the accelerator)."""

    def once():
        verifier.verify(state, trees)
        verifier.discard(state, trees)

    return median_seconds(once, repeats=repeats, warmup=warmup)


@torch.no_grad()
def measure_verify_seconds(
    target,
    head,
    shape: TreeShape,
    budgets,
    batch_size: int = 1,
    context_length: int = 64,
    repeats: int = 3,
    tree_verify: str = "auto",
) -> dict:
    """Median wall time of a verify round at each budget b, at this batch size, after a prefilled random context.

    The trees are the head's own ([`draft`] at `shape` without path conditioning or lookup branch, so b nodes), and
    the forward is the verify of the call's verifier ([`verifier_for`] with `tree_verify`). A hybrid target is timed
    in the mode it runs: "chain" its chain verify, "tree" a tree round's forward 1 over the leaf paths, "auto" the
    tree's, the mode "auto" starts in. `host_costs.py` divides these by one plain decode step to price each budget
    of `tree_budget="auto"` (`budget.py`).

    Returns:
        `dict` from budget to seconds.
    """
    vocab = target.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch_size, context_length), generator=g).to(target.device)
    if is_hybrid(target) and tree_verify == "auto":
        tree_verify = "tree"
    verifier = verifier_for(target, head, tree_verify)
    state, _ = verifier.prefill(prompt, None)
    alone = replace(shape, path_conditioning=False, lookup=0)
    return {b: verify_seconds(verifier, state, draft(head, state, alone, b), repeats) for b in budgets}
