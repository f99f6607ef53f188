"""The round's steps over explicit tensors (arXiv 2606.18394, sections 3.2-3.4; `docs/design.md`, "§2 The round").

A round is five functions; `generate` (`decode.py`), the benchmark and the host costs of `tree_budget="auto"`
(`verifiers.measure_verify_seconds`) call the same ones, and all five are importable from here:

- [`draft`]: one head forward over `[anchor, MASK x N]` per row, a best-first tree of `budget` nodes per row;
- [`verify`]: one target forward over root + tree nodes under the tree-causal mask (position = past length + depth);
- [`accept`]: the deepest node whose whole path equals the target's own choices, plus the target's next token
  (the bonus);
- [`commit`]: each row's tokens enter its sequence one at a time, through the stopping criteria;
- [`compact`]: finished rows leave; the target cache keeps its past in place and moves only the accepted nodes'
  entries behind it; the head's context grows by their target features; the bonus token becomes the next anchor.

This file holds [`prefill`], [`draft`] with the tree assembly behind it (lookup branch, path conditioning) and
[`verify`]; [`accept`] and [`commit`] are in `acceptance.py`, [`compact`] in `compaction.py`.

Lossless: every committed token is the target's own choice (argmax, or a sample of the processed distribution)
given exactly the committed tokens before it, whatever the head drafts.

Rows of a batch keep their own lengths: the caches are rectangular with holes, and a `(A, S)` validity mask plus
explicit position ids make the holes invisible. Finished rows leave the batch.
"""

import functools
import inspect
import weakref

import torch
from transformers.cache_utils import Cache

from .acceptance import accept, commit
from .calibration import calibrated_children, node_source
from .compaction import compact, keep_accepted_entries, select_rows
from .continuations import LookupRecord, RowIndexes, chain_trie, merge_children, trie_children
from .verify_attention import attention_function
from .columns import Columns
from .compat import attn_implementation
from .linear_forms import LinearForms, linear_forms
from .state import DraftTrees, RoundState, TreeShape
from .tree import (
    ENTROPY_SCORINGS,
    LOOKUP_MAX_NGRAM,
    Tree,
    ancestor_mask_of,
    build_tree,
    entropy,
    marginal_children,
    verify_attention_mask,
)

__all__ = [
    "accept",
    "commit",
    "compact",
    "draft",
    "draft_block",
    "draft_trees",
    "feature_layers",
    "float_dtype",
    "keep_accepted_entries",
    "kept_masks",
    "logits_to_keep",
    "prefill",
    "select_rows",
    "verify",
]


def prefill(
    head, target, input_ids, attention_mask, cache: Cache, before_context=None
) -> tuple[RoundState, torch.Tensor]:
    """The target reads the prompts into `cache`; the head's context starts from their features.

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L)`): left-padded prompts.
        attention_mask (`torch.LongTensor` of shape `(B, L)`, *optional*): 0 on padding.
        cache (`Cache`): an empty cache, filled in place.
        before_context (`Callable`, *optional*): called with the logits `(B, V)` (fp32) after the target's forward,
            before the head's pass over the prompt's features: `generate` commits and streams the first token there.

    Returns:
        `(state, logits)`: every row active, its anchor the target's greedy next token (`generate` replaces it with
        its processed choice), and the target's logits after each prompt, `(B, V)` in fp32.
    """
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=feature_layers(head),
        **logits_to_keep(target, 1),
    )
    logits = out.logits[:, -1].float()  # (B, V)
    if before_context is not None:
        before_context(logits)
    columns, (valid, positions) = Columns.start([valid, positions])
    state = RoundState(
        rows=torch.arange(input_ids.shape[0], device=input_ids.device),
        cache=cache,
        valid=valid,
        positions=positions,
        context=head.extend_context(None, head.target_features(out.hidden_states), positions, valid),
        anchors=logits.argmax(-1),
        anchor_pos=valid.long().sum(-1),
        columns=columns,
    )
    return state, logits


def feature_layers(head) -> list:
    """The indices of a target's `hidden_states` the head reads (index i + 1 is layer i's output): passed as
    `output_hidden_states`, the target keeps only those (transformers returns `None` in the other places)."""
    return [i + 1 for i in head.config.target_layer_ids]


def draft_block(head, context, anchor: torch.LongTensor, anchor_position: int, depth: int) -> torch.Tensor:
    """The head's logits at depths 1..`depth` after `anchor` (`(B,)`) at `anchor_position` (an int, or `(B, 1)`):
    one forward over `[anchor, MASK x depth]` (the full block when bidirectional), `(B, depth, V_draft)`."""
    b, device = anchor.shape[0], anchor.device
    length = depth + 1 if head.config.block_attention == "causal" else head.config.block_size
    block = torch.full((b, length), head.config.mask_id, dtype=torch.long, device=device)
    block[:, 0] = anchor
    positions = anchor_position + torch.arange(length, device=device).expand(b, length)
    return head.draft(block, positions, context).logits[:, 1 : depth + 1]


def draft(
    head,
    state: RoundState,
    shape: TreeShape,
    budget: int,
    histories: dict | None = None,
    record: LookupRecord | None = None,
    indexes: RowIndexes | None = None,
    mark=None,
) -> DraftTrees:
    """One head forward over `[anchor, MASK x N]` (the full block when bidirectional), a best-first tree per row.

    The head's logits at block slot d are its distribution of the token at depth d, `(A, N, V_draft)`; their top-W
    become the candidates of every depth-(d - 1) branch (`tree.marginal_children`). With `path_conditioning`, a
    second forward rescores the tree from what the head predicts under each branch's real tokens. With `lookup`,
    each tree also holds the row's prompt-lookup continuation (`tree.lookup_match`): first, or, with the head's
    `tree_lookup_prior`, scored by how often such chains are accepted against the head's own nodes.

    Args:
        shape (`TreeShape`): depth, width, scoring, path conditioning and lookup of the trees.
        budget (`int`): draft nodes per tree.
        histories (`dict`, *optional*): `{batch row: committed tokens}` of the active rows, in order
            ([`Call.histories`]); needed when `shape.lookup` is set.
        record (`LookupRecord`, *optional*): the lookup branch's record in the call (`shape.lookup_record`); it
            reads what each row committed since its last draft and scores the branch from its prior and record.
        indexes (`RowIndexes`, *optional*): the rows' n-gram indexes in the call ([`Call.lookup_index`]), each
            updated with the tokens committed since its last draft; without them every row's history is indexed
            anew.
        mark (`Callable[[], None]`, *optional*): called once the head's forward is queued (a timed round's clock,
            `round_hook.py`: the `draft` phase ends there, the `tree` phase begins).

    The trees are built on the host from one read of every row's top-W candidates per depth (two with path
    conditioning); the returned [`DraftTrees`] keep them (`host`), so the round reads them back nowhere.
    """
    device = state.anchors.device
    logits = draft_block(head, state.context, state.anchors, state.anchor_pos[:, None], shape.depth)
    if mark is not None:
        mark()
    trees, children, branches, head_tokens, answers = draft_trees(
        head, logits, shape, budget, histories, record, indexes
    )
    if shape.path_conditioning:
        trees = _path_conditioned_trees(head, state, _stack_trees(trees, budget, device), children, shape, budget)
    stacked = _stack_trees(trees, budget, device)
    stacked.branches, stacked.head_tokens, stacked.answers = branches, head_tokens, answers
    return stacked


def draft_trees(
    head,
    logits: torch.Tensor,
    shape: TreeShape,
    budget: int,
    histories: dict | None = None,
    record: LookupRecord | None = None,
    indexes: RowIndexes | None = None,
) -> tuple[list, list, list | None, list]:
    """The active rows' best-first trees from the head's block `logits` `(A, N, V_draft)`: the top-W candidates of
    every depth (`tree.marginal_children`), each row's model-free branch where `shape.lookup` asks for one, then
    `tree.build_tree` of `budget` nodes. The part of [`draft`] between the head's forward and the trees' tensors
    (the static path's draft calls it too); the arguments are [`draft`]'s.

    Returns:
        `(trees, children, branches, head_tokens, answers)`: the host trees (`tree.Tree`), the children functions
        they were built from, each row's model-free branch as a trie (`{}`: no match; None without `shape.lookup`),
        each row's top-W target tokens of the head per depth, and each row's answer-cache trie (None as branches).
    """
    if shape.lookup and histories is None:
        raise ValueError(f"expected the rows' committed tokens with tree_lookup={shape.lookup}, got none")
    candidates = _top_candidates(head, logits, shape)
    children = [marginal_children(*found) for found in candidates]
    head_tokens = [tokens for _, tokens, _ in candidates]
    branches = answers = None
    if shape.lookup:
        indexes = RowIndexes() if indexes is None else indexes
        found = [_lookup_branch(history, shape, record, row, indexes) for row, history in histories.items()]
        children = [_merged(fn, *branch) for fn, branch in zip(children, found)]
        branches = [trie for trie, _, _ in found]
        # earlier calls' answers (`answer_cache.py`), merged as the row's own trie is
        answered = [indexes.answer_branch(history, shape.lookup, shape.lookup_prior) for history in histories.values()]
        children = [_merged(fn, *branch) for fn, branch in zip(children, answered)]
        answers = [trie for trie, _, _ in answered]
    if shape.calibration:  # a node's source: the head (among its top-W at that depth), the branch, both, or answers
        children = [
            calibrated_children(fn, shape.calibration, functools.partial(node_source, tokens, trie, answers=answer))
            for fn, tokens, trie, answer in zip(
                children, head_tokens, branches or [None] * len(children), answers or [None] * len(children)
            )
        ]
    deepest = max(shape.depth, shape.lookup)  # a lookup chain may run past the head's depths
    trees = [build_tree(fn, budget, deepest, shape.scoring) for fn in children]
    return trees, children, branches, head_tokens, answers


def _top_candidates(head, logits: torch.Tensor, shape: TreeShape) -> list:
    """Per row, the top-W candidates of every slot of the head's `logits` `(A, T, V_draft)` as host lists:
    `(log-probs (T, W), target tokens (T, W), entropies (T,))`, zeros for the entropies unless the scoring reads
    them. One read for every row: the three are packed into one float64 tensor (exact for float32 log-probs and for
    token ids below 2**53; float32 on MPS, which has no float64: exact for ids below 2**24)."""
    logp = torch.log_softmax(logits, dim=-1)  # (A, T, V_draft)
    top_lp, top_tok = logp.topk(shape.width, dim=-1)  # (A, T, W)
    top_tok = head.draft_to_target(top_tok)  # (A, T, W) target ids
    if shape.scoring in ENTROPY_SCORINGS:
        ent = entropy(logp)  # (A, T)
    else:
        ent = logp.new_zeros(logp.shape[:2])
    dtype = torch.float32 if logp.device.type == "mps" else torch.float64
    packed = torch.cat([top_lp.to(dtype), top_tok.to(dtype), ent.to(dtype)[..., None]], dim=-1)  # (A, T, 2W + 1)
    w = shape.width
    rows = packed.tolist()
    return [([s[:w] for s in row], [[int(t) for t in s[w : 2 * w]] for s in row], [s[-1] for s in row]) for row in rows]


def verify(
    target,
    head,
    state: RoundState,
    trees: DraftTrees,
    windows: dict | None = None,
    forms: LinearForms | None = None,
    attention: str | None = None,
):
    """The target reads root + n nodes of every tree in one forward, under the tree-causal mask, after its cache.

    Args:
        windows (`dict`, *optional*): the sliding windows of the verify mask, from [`verify_windows`].
        forms (`LinearForms`, *optional*): the form of the target's linear layers in this forward
            (`linear_forms.py`, the call's `verify_linear`); `None`: the model as it is.
        attention (`str`, *optional*): the attention function the target's layers run in this forward (a name in
            `AttentionInterface`): grouped keys/values read in place (`grouped_attention.py`), flex_attention
            uncompiled on CPU (`verify_attention.py`); `None`: the target's own. The verifier decides once per call
            (`verify_attention.verify_attention_of`).

    Returns:
        `(logits, features)`: the target's logits after every node, `(A, n + 1, V)` in the target's dtype (greedy
        acceptance takes their argmax; processors and records upcast the nodes they read to fp32, as plain
        `generate` does), and the head's input features of every node, `(A, n + 1, k * H)`. The cache grows by the
        n + 1 entries; [`compact`] keeps the accepted ones.
    """
    positions = state.anchor_pos[:, None] + trees.depths  # (A, n + 1)
    flex = attn_implementation(target) == "flex_attention"  # a BlockMask for flex_attention, else additive masks
    attention_mask = verify_attention_mask(
        state.valid,
        trees.ancestors,
        float_dtype(target),
        windows,
        state.positions,
        positions,
        flex=flex,
        kept=kept_masks(state),
    )
    with linear_forms(target, forms), attention_function(target, attention):
        out = target(
            input_ids=torch.cat([state.anchors[:, None], trees.tokens], dim=1),  # (A, n + 1)
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=state.cache,
            use_cache=True,
            output_hidden_states=feature_layers(head),
            **logits_to_keep(target, 0),
        )
    return out.logits, head.target_features(out.hidden_states)


def kept_masks(state: RoundState) -> dict | None:
    """Where the verify masks are kept across rounds: the state's columns (`kept_masks.py`: a round writes only its
    new columns); `None` for a state whose tensors have no columns (its masks are built whole)."""
    return None if state.columns is None else state.columns.masks


# ------------------------------------------------------------------------------------------------ tree assembly
def _stack_trees(trees: list, budget: int, device) -> DraftTrees:
    """One batch of trees. A tree short of the others' size (a row whose lookup chain added fewer nodes, or none) is
    padded with copies of its last node: same token, parent and position, so the same keys and logits, and acceptance
    takes the first of equal nodes; the copies only cost verify width."""
    size = max(len(t.tokens) for t in trees)
    if any(not t.tokens for t in trees):
        raise ValueError(f"expected at least one draft node per tree, got sizes {[len(t.tokens) for t in trees]}")

    def padded(t: Tree) -> Tree:
        extra = size - len(t.tokens)
        return Tree(
            t.tokens + t.tokens[-1:] * extra,
            t.parents + t.parents[-1:] * extra,
            t.depths + t.depths[-1:] * extra,
            t.scores + t.scores[-1:] * extra,
        )

    sizes = [len(t.tokens) for t in trees]
    trees = [padded(t) for t in trees]
    parents = torch.tensor([t.parents for t in trees], dtype=torch.long, device=device)  # (A, n)
    return DraftTrees(
        tokens=torch.tensor([t.tokens for t in trees], dtype=torch.long, device=device),
        parents=parents,
        depths=torch.tensor([[0] + t.depths for t in trees], dtype=torch.long, device=device),
        ancestors=ancestor_mask_of([t.parents for t in trees], device),
        budget=budget,
        host=trees,
        sizes=sizes,
    )


def _lookup_branch(
    history: list, shape: TreeShape, record: LookupRecord | None, row: int, indexes: RowIndexes | None
) -> tuple[dict, list | None, int]:
    """A row's model-free branch (`shape.lookup_branches`: the prompt-lookup chain, or the trie of every earlier
    continuation) as `(trie, prior, order)`: the trie `{path: Counter(next token)}` (`{}` without a match), the
    scores of its nodes (`shape.lookup_prior`, mixed with the row's `record` when given; `None`: first) and the
    match's n-gram order. The branch is read from the row's n-gram index (`indexes`), fed only the tokens committed
    since."""
    prior = shape.lookup_prior
    max_ngram = len(prior) if prior else LOOKUP_MAX_NGRAM
    if record is not None:
        record.observe(row, history)
    index = (RowIndexes() if indexes is None else indexes).updated(row, history, max_ngram)
    if shape.lookup_branches == "trie":
        trie, order = index.trie(shape.lookup)
    else:
        chain, order = index.chain(shape.lookup)
        trie = chain_trie(chain)
    if record is not None and trie:
        record.offer(row, trie, order, len(history))
        prior = record.prior(row, prior, order, shape.lookup)
    return trie, prior or None, order


def _merged(children, trie: dict, prior, order: int):
    """`children` with the trie's nodes merged in ([`continuations.merge_children`]); unchanged without a match."""
    return merge_children(children, trie_children(trie, prior, order)) if trie else children


def _path_conditioned_trees(head, state: RoundState, trees: DraftTrees, marginals: list, shape, budget) -> list:
    """Second draft pass (`docs/design.md`, "§3 Trees and masks"): real tokens at the tree's nodes plus one MASK probe
    under every node.

    Probe j sits at depth(j) + 1 and sees the context, the anchor, node j's ancestors and node j: its output is
    q(child | the branch's actual tokens). The tree is rebuilt best-first from these conditionals (branches without
    a probe fall back to the first pass's marginals, `marginals[i]`).
    """
    a, n = trees.tokens.shape
    device = trees.tokens.device
    probes = torch.full((a, n), head.config.mask_id, dtype=torch.long, device=device)
    inputs = torch.cat([state.anchors[:, None], trees.tokens, probes], dim=1)  # (A, 1 + 2n)
    depths = trees.depths[:, 1:]  # (A, n)
    positions = state.anchor_pos[:, None] + torch.cat([trees.depths, depths + 1], dim=1)  # (A, 1 + 2n)
    t = 1 + 2 * n
    inner = torch.zeros(a, t, t, dtype=torch.bool, device=device)
    inner[:, : n + 1, : n + 1] = trees.ancestors
    inner[:, n + 1 :, : n + 1] = trees.ancestors[:, 1:]  # probe j sees what node j sees, node j included
    inner[:, n + 1 :, n + 1 :] = torch.eye(n, dtype=torch.bool, device=device)
    mask = torch.cat([state.context.valid[:, None, :].expand(a, t, -1), inner], dim=-1)[:, None]  # (A, 1, t, S+t)
    out = head.draft(inputs, positions, state.context, attention_mask=mask)  # probes at slots n + 1 ..
    rebuilt = []
    for tree, (lps, toks, ents), marginal in zip(
        trees.host, _top_candidates(head, out.logits[:, n + 1 :], shape), marginals
    ):
        paths, probed = [()], {}
        for j, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            paths.append(paths[parent] + (token,))
            probed[paths[-1]] = (lps[j], toks[j], ents[j])
        children = functools.partial(_probed_or_marginal, probed, marginal)
        rebuilt.append(build_tree(children, budget, shape.depth, shape.scoring))
    return rebuilt


def _probed_or_marginal(probed: dict, marginal, path: tuple):
    return probed.get(path) or marginal(path)


def float_dtype(model) -> torch.dtype:
    """The floating dtype of a model's activations (float32 for a quantized, integer-typed one)."""
    return model.dtype if model.dtype.is_floating_point else torch.float32


_KEEPS_LOGITS = weakref.WeakKeyDictionary()  # target -> whether its forward takes `logits_to_keep`


def logits_to_keep(target, count: int) -> dict:
    """`logits_to_keep=count` for a target that takes it (0: every position), else nothing. The forward's signature
    is read once per target (reading it costs about a tenth of a millisecond, every round otherwise)."""
    takes = _KEEPS_LOGITS.get(target)
    if takes is None:
        takes = _KEEPS_LOGITS[target] = "logits_to_keep" in inspect.signature(target.forward).parameters
    return {"logits_to_keep": count} if takes else {}
