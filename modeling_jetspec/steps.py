"""The round's steps over explicit tensors (arXiv 2606.18394, sections 3.2-3.4; `docs/design.md`, "§2 The round").

A round is five functions; `generate` (`decode.py`), the benchmark and the measured budget call the same ones:

- [`draft`]: one head forward over `[anchor, MASK x N]` per row, a best-first tree of `budget` nodes per row;
- [`verify`]: one target forward over root + tree nodes under the tree-causal mask (position = past length + depth);
- [`accept`]: the deepest node whose whole path equals the target's own choices, plus the target's next token
  (the bonus);
- [`commit`]: each row's tokens enter its sequence one at a time, through the stopping criteria;
- [`compact`]: finished rows leave; the target cache keeps its past in place and moves only the accepted nodes'
  entries behind it; the head's context grows by their target features; the bonus token becomes the next anchor.

Also here: [`prefill`] and the tree assembly behind [`draft`] (lookup branch, path conditioning). The call's logits
processors as they act on one row (what [`accept`] asks through `Call.choose`) are in `processors.py`; how the
stopping criteria are judged for [`commit`], in `stopping.py`.

Lossless: every committed token is the target's own choice (argmax, or a sample of the processed distribution)
given exactly the committed tokens before it, whatever the head drafts.

Rows of a batch keep their own lengths: the caches are rectangular with holes, and a `(A, S)` validity mask plus
explicit position ids make the holes invisible. Finished rows leave the batch.
"""

import functools
import inspect
from dataclasses import replace

import torch
from transformers.cache_utils import Cache

from .calibration import calibrated_children, node_source
from .columns import Columns
from .compat import attn_implementation, kv_layer_entries
from .continuations import LookupRecord, RowIndexes, chain_trie, merge_children, trie_children
from .verify_attention import attention_function
from .linear_forms import LinearForms, linear_forms
from .state import Acceptance, Call, Committed, DraftTrees, RoundState, TreeShape
from .stopping import stop_marks
from .tree import (
    ENTROPY_SCORINGS,
    LOOKUP_MAX_NGRAM,
    Tree,
    ancestor_mask,
    build_tree,
    entropy,
    marginal_children,
    verify_attention_mask,
)


def prefill(head, target, input_ids, attention_mask, cache: Cache) -> tuple[RoundState, torch.Tensor]:
    """The target reads the prompts into `cache`; the head's context starts from their features.

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L)`): left-padded prompts.
        attention_mask (`torch.LongTensor` of shape `(B, L)`, *optional*): 0 on padding.
        cache (`Cache`): an empty cache, filled in place.

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

    The trees are built on the host from one read of every row's top-W candidates per depth (two with path
    conditioning); the returned [`DraftTrees`] keep them (`host`), so the round reads them back nowhere.
    """
    device = state.anchors.device
    logits = draft_block(head, state.context, state.anchors, state.anchor_pos[:, None], shape.depth)
    trees, children, branches, head_tokens = draft_trees(head, logits, shape, budget, histories, record, indexes)
    if shape.path_conditioning:
        trees = _path_conditioned_trees(head, state, _stack_trees(trees, budget, device), children, shape, budget)
    stacked = _stack_trees(trees, budget, device)
    stacked.branches, stacked.head_tokens = branches, head_tokens
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
        `(trees, children, branches, head_tokens)`: the host trees (`tree.Tree`), the children functions they were
        built from, each row's model-free branch as a trie (`{}`: no match; None without `shape.lookup`), and each
        row's top-W target tokens of the head per depth.
    """
    if shape.lookup and histories is None:
        raise ValueError(f"expected the rows' committed tokens with tree_lookup={shape.lookup}, got none")
    candidates = _top_candidates(head, logits, shape)
    children = [marginal_children(*found) for found in candidates]
    head_tokens = [tokens for _, tokens, _ in candidates]
    branches = None
    if shape.lookup:
        indexes = RowIndexes() if indexes is None else indexes
        found = [_lookup_branch(history, shape, record, row, indexes) for row, history in histories.items()]
        children = [_merged(fn, *branch) for fn, branch in zip(children, found)]
        branches = [trie for trie, _, _ in found]
    if shape.calibration:  # a node's source: the head (among its top-W at that depth), the branch, or both
        children = [
            calibrated_children(fn, shape.calibration, functools.partial(node_source, tokens, trie))
            for fn, tokens, trie in zip(children, head_tokens, branches or [None] * len(children))
        ]
    deepest = max(shape.depth, shape.lookup)  # a lookup chain may run past the head's depths
    trees = [build_tree(fn, budget, deepest, shape.scoring) for fn in children]
    return trees, children, branches, head_tokens


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


def accept(logits: torch.Tensor, trees: DraftTrees, rows, choose=None) -> Acceptance:
    """The deepest node whose path equals the target's own choices, and the target's token after it (the bonus).

    Greedy without logits processors (`choose is None`) is vectorized over rows and nodes, on the device: the
    target's argmax after every node, a node matches when its token is its parent's argmax, a node survives when it
    and all its ancestors match, the deepest survivor ends the path. Otherwise (sampling, processors) each row walks
    its tree from the root: `choose(row, node_logits, path)` is the target's token after `path` (processors see
    exactly the committed tokens plus the path), and the walk moves to the child holding it (sample-then-match).

    Args:
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`].
        trees (`DraftTrees`): the trees verified.
        rows (`list[int]` or `torch.LongTensor` of shape `(A,)`): the batch row of each tree (what `choose` is told).
        choose (`Callable`, *optional*): `(row, logits (V,), path tokens) -> (token, scores (V,))`.

    Returns:
        `Acceptance` of width `K` = the trees' deepest depth + 1 (a bound known without reading the device), padded
        past each row's count; [`commit`] reads it and cuts it to the longest path.
    """
    if choose is None:
        return _accept_greedy(logits, trees)
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if trees.host is not None:
        shapes = [(tree.tokens, tree.parents) for tree in trees.host]
    else:
        shapes = list(zip(trees.tokens.tolist(), trees.parents.tolist()))
    walks = [
        _walk(logits[i], tokens, parents, row, choose) for i, (row, (tokens, parents)) in enumerate(zip(rows, shapes))
    ]
    a, width = len(walks), max(len(nodes) for nodes, _, _ in walks)
    padded = torch.zeros(2, a, width, dtype=torch.long)  # accepted nodes, committed tokens
    for i, (nodes, path, _) in enumerate(walks):
        padded[0, i, : len(nodes)], padded[1, i, : len(path)] = torch.tensor(nodes), torch.tensor(path)
    count = torch.tensor([len(nodes) for nodes, _, _ in walks], device=logits.device)
    return Acceptance(
        padded[0].to(logits.device),
        padded[1].to(logits.device),
        count,
        [s for _, _, s in walks],
        host=[(nodes, path) for nodes, path, _ in walks],
    )


def _accept_greedy(logits: torch.Tensor, trees: DraftTrees) -> Acceptance:
    a, n1 = logits.shape[:2]
    device = logits.device
    # (A, n + 1), in the logits' own dtype (no fp32 copy of the vocabulary). `max(-1).indices` is argmax, the first
    # maximal index on ties as documented for both, but CPU kernels reduce it several times faster over a vocabulary
    # (bf16 (1, 9, 49152): 0.4 ms against 3.7 ms, one thread, Intel AMX host)
    choice = logits.max(-1).indices
    matches = torch.cat(  # (A, n + 1): the node's token is what the target chose after its parent
        [torch.ones(a, 1, dtype=torch.bool, device=device), trees.tokens == choice.gather(1, trees.parents)], dim=1
    )
    alive = ~(trees.ancestors & ~matches[:, None, :]).any(-1)  # (A, n + 1): the whole path matches
    deepest = torch.where(alive, trees.depths, -1).argmax(-1)  # (A,)
    on_path = trees.ancestors[torch.arange(a, device=device), deepest]  # (A, n + 1)
    count = on_path.sum(-1)  # (A,)
    order = torch.where(on_path, torch.arange(n1, device=device), n1).sort(-1).values  # accepted nodes first
    nodes = order[:, : min(trees.max_depth() + 1, n1)]  # a path holds at most one node per depth
    nodes = nodes.masked_fill(nodes == n1, 0)  # (A, K)
    return Acceptance(nodes, choice.gather(1, nodes), count)


def _walk(logits: torch.Tensor, tokens: list, parents: list, row: int, choose) -> tuple[list, list, list]:
    """One row's walk down its tree (`logits` of shape `(n + 1, V)`). Returns its accepted nodes, committed tokens
    and the scores each token was chosen from."""
    kids = [{} for _ in range(len(tokens) + 1)]  # node -> {token: child}; the first child holding a token wins
    for child, (token, parent) in enumerate(zip(tokens, parents), start=1):
        kids[parent].setdefault(token, child)
    node, nodes, path, scores = 0, [0], [], []
    while True:
        token, processed = choose(row, logits[node], path)
        path.append(token)
        scores.append(processed)
        node = kids[node].get(token)
        if node is None:
            return nodes, path, scores
        nodes.append(node)


def commit(call: Call, acc: Acceptance, logits: torch.Tensor) -> Committed:
    """Append each active row's accepted tokens to its sequence, through the stopping criteria, so a row stops
    exactly where plain decoding would, even inside an accepted path. A stopped row leaves the batch when an EOS
    criterion exists (plain decoding pads it); otherwise it goes on until every row has stopped ([`Call.finished`]).

    The round's one read: the acceptance (counts, nodes, tokens) and the verdicts of the criteria judged on the
    device (`stopping.stop_marks`) come to the host together; what follows is host work, and one write of every row's
    tokens to `call.sequences`. With a criterion that is not judged on the device (`stopping.stop_plan`) each committed
    token is checked on its own, a read per token.

    Args:
        acc (`Acceptance`): from [`accept`], one row per entry of `call.active`.
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`] (kept with `output_logits`).
    """
    rows = call.active
    stops = stop_marks(call, acc)  # (A, K) bool, or None
    counts, paths, tokens, marks = _read_acceptance(acc, stops)
    committed, new = 0, {}
    for i, row in enumerate(rows):
        records = _records(acc, logits, i, paths[i]) if call.records is not None else None
        if call.device_stops is None:  # checked token by token, on the device
            committed += _commit_row(call, row, tokens[i], records)
            continue
        taken = _taken(call, row, marks[i] if marks is not None else None, counts[i])
        new[row] = tokens[i][:taken]
        if records is not None:
            call.records[row] += records[:taken]
        committed += taken
    call.extend(new)
    keep = [i for i, row in enumerate(rows) if not call.finished(row)]  # after every row: a stop ends others
    call.active = [rows[i] for i in keep]
    width = max(counts)  # every path fits; a shorter one leaves holes that `compact` masks
    return Committed(
        committed,
        counts,
        paths,
        torch.tensor(keep, dtype=torch.long, device=acc.count.device),
        replace(acc, nodes=acc.nodes[:, :width], tokens=acc.tokens[:, :width]),
    )


def _read_acceptance(acc: Acceptance, stops: torch.Tensor | None) -> tuple[list, list, list, list | None]:
    """`(counts, paths, tokens, marks)` on the host, per row: accepted nodes, their indices, the committed tokens
    and the stop verdicts after each; one read (none when the walk chose on the host and nothing is judged on the
    device)."""
    k = acc.nodes.shape[1]
    if acc.host is not None:
        paths, tokens = [nodes for nodes, _ in acc.host], [path for _, path in acc.host]
        return [len(p) for p in paths], paths, tokens, stops.tolist() if stops is not None else None
    parts = [acc.count[:, None], acc.nodes, acc.tokens] + ([stops.long()] if stops is not None else [])
    packed = torch.cat(parts, dim=1).tolist()  # (A, 1 + 2K (+ K))
    counts = [row[0] for row in packed]
    paths = [row[1 : 1 + c] for row, c in zip(packed, counts)]
    tokens = [row[1 + k : 1 + k + c] for row, c in zip(packed, counts)]
    marks = [row[1 + 2 * k :] for row in packed] if stops is not None else None
    return counts, paths, tokens, marks


def _records(acc: Acceptance, logits: torch.Tensor, i: int, nodes: list) -> list:
    """`(scores, logits)` in fp32 of each token row `i` commits (the scores are the logits when greedy without
    processors, as in plain decoding)."""
    node_logits = [logits[i, node].float() for node in nodes]
    scores = acc.scores[i] if acc.scores is not None else node_logits
    return list(zip(scores, node_logits))


def _taken(call: Call, row: int, marks: list | None, count: int) -> int:
    """How many of its `count` accepted tokens `row` commits, and where it stops (host data: `marks[k - 1]` is the
    device criteria's verdict after the k-th token, `call.stop_length` the max-length criterion's length)."""
    length = call.lengths[row]
    for k in range(1, count + 1):
        if call.stopped_at[row] is None and (
            (marks is not None and marks[k - 1]) or (call.stop_length is not None and length + k >= call.stop_length)
        ):
            call.stopped_at[row] = length + k  # a stop is final, as `unfinished_sequences` in plain decoding
        if call.stopped_at[row] is not None and (call.pads_finished or length + k >= call.max_length):
            return k
    return count


def _commit_row(call: Call, row: int, tokens: list, records: list | None) -> int:
    """Append `tokens` to `row` one at a time, the stopping criteria checked after each until one stops the row;
    a stopped row takes no more when finished rows are padded, or past `max_length`. Returns the tokens committed."""
    start, batch = call.lengths[row], call.sequences.shape[0]
    for added, token in enumerate(tokens, start=1):
        call.append(row, token)
        if records is not None:
            call.records[row].append(records[added - 1])
        if call.stopped_at[row] is None:  # a stop is final, as `unfinished_sequences` in plain decoding
            # the row in a batch of the caller's size, so criteria holding per-row state see plain decoding's layout
            ids = call.sequences[row : row + 1, : call.lengths[row]].expand(batch, -1)
            if bool(call.stopping(ids, None)[row]):
                call.stopped_at[row] = call.lengths[row]
        if call.stopped_at[row] is not None and (call.pads_finished or call.lengths[row] >= call.max_length):
            break
    return call.lengths[row] - start


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
    for layer in cache.layers if layers is None else [cache.layers[i] for i in layers]:
        entries = kv_layer_entries(layer)
        if entries is None:  # a layer that reads another layer's keys/values holds none of its own
            continue
        keys, values = entries
        tail = keys.shape[-2] - past  # n + 1
        keys[:, :, past : past + k] = _gather_nodes(keys[:, :, past:], nodes)
        values[:, :, past : past + k] = _gather_nodes(values[:, :, past:], nodes)
        layer.crop(k - tail)  # a negative count: the entries to drop from the end


def _gather_nodes(tail: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
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
        ancestors=ancestor_mask(parents),
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


def logits_to_keep(target, count: int) -> dict:
    """`logits_to_keep=count` for a target that takes it (0: every position), else nothing."""
    return {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
