"""Lossless tree speculative decoding inside `target.generate` (arXiv 2606.18394, sections 3.2-3.4).

One round is four functions over a [`RoundState`]:

- [`draft`]: one head forward over `[anchor, MASK x N]` per row, a best-first tree of `budget` nodes per row;
- [`verify`]: one target forward over root + tree nodes under the tree-causal mask (position = past length + depth);
- [`accept`]: the deepest node whose whole path equals the target's own choices, plus the target's next token
  (the bonus);
- [`advance`]: commit the tokens through the stopping criteria, drop finished rows, keep only the accepted nodes in
  the target cache, extend the head's context with their target features, make the bonus token the next anchor.

Lossless: every committed token is the target's own choice (argmax, or a sample of the processed distribution)
given exactly the committed tokens before it, whatever the head drafts.

Rows of a batch keep their own lengths: the caches are rectangular with holes, and a `(A, S)` validity mask plus
explicit position ids make the holes invisible. Finished rows leave the batch.
"""

import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .budget import DEFAULT_CANDIDATES, BudgetController, measure_verify_seconds
from .timing import clock
from .tree import (
    LOOKUP_MAX_NGRAM,
    Tree,
    ancestor_mask,
    build_tree,
    check_lookup_prior,
    check_tree_shape,
    entropy,
    lookup_logprobs,
    lookup_match,
    marginal_children,
    max_tree_nodes,
    verification_mask,
    with_lookup,
)

TREE_ARGUMENTS = (
    "tree_depth", "tree_width", "tree_budget", "tree_scoring", "path_conditioning", "tree_lookup", "tree_lookup_prior",
)
MASKABLE_ATTENTION = ("eager", "sdpa")  # take an additive 4D float mask as is
TREE_LAYER_TYPES = ("full_attention", "sliding_attention")  # a key/value cache the tree loop can compact
# model kwargs the tree loop reads; any other model kwarg (pixel_values, token_type_ids, past_key_values, ...) raises
SUPPORTED_MODEL_KWARGS = ("input_ids", "inputs", "attention_mask")
# `generate` arguments that are not model kwargs, honoured as in plain `generate` (the loop re-enters it)
GENERATE_HONOURED = (
    "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "tokenizer",
    "trust_remote_code",
)
# generation-config fields the tree loop would otherwise ignore without a word: value that is supported
UNSUPPORTED_GENERATION = {
    "cache_implementation": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "dola_layers": None,
    "penalty_alpha": None,
    "output_attentions": False,
    "output_hidden_states": False,
}
# `generate` parameters the tree loop cannot honour: value that is supported
UNSUPPORTED_GENERATE = {
    "synced_gpus": (None, False),
    "negative_prompt_ids": (None,),
    "negative_prompt_attention_mask": (None,),
    "custom_generate": (None,),
    "assistant_tokenizer": (None,),
}


@dataclass
class TreeShape:
    depth: int  # N, maximum depth of a draft node
    width: int  # W, candidates per node
    budget: int | str  # B, draft nodes per tree (root excluded), or "auto" (chosen per round, see `budget.py`)
    scoring: str  # best-first key, see `tree.tree_key`
    path_conditioning: bool  # second draft pass with MASK probes under the tree's real tokens
    lookup: int = 0  # tokens of the prompt-lookup branch in every tree (0: none); may exceed `depth`
    lookup_prior: list | None = None  # acceptance odds of lookup chains per match order; None: the chain goes first


@dataclass
class JetSpecStats:
    """Statistics of one `generate` call. tau counts committed tokens per verify forward and row, bonus included."""

    target_forwards: int = 0  # prefill and verify forwards of the target
    rounds: int = 0  # verify forwards
    row_rounds: int = 0  # sum over rounds of the rows in the batch
    new_tokens: int = 0  # committed tokens, all rows
    round_tokens: int = 0  # committed tokens produced by verify rounds
    accepted_at_depth: list = field(default_factory=list)  # (N,) row-rounds whose accepted path reached depth d
    budgets: list = field(default_factory=list)  # budget verified in each round
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return self.round_tokens / max(self.row_rounds, 1)

    @property
    def acceptance_per_depth(self) -> list:
        return [count / max(self.row_rounds, 1) for count in self.accepted_at_depth]

    def add_round(self, budget: int, rows: int, count: torch.Tensor, committed: int, draft_s: float, verify_s: float):
        """Record one verify round over `rows` rows; `count` of shape `(rows,)` holds each row's accepted nodes
        (root included), `committed` the tokens the stopping criteria let through."""
        self.target_forwards += 1
        self.rounds += 1
        self.row_rounds += rows
        self.new_tokens += committed
        self.round_tokens += committed
        self.budgets.append(budget)
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        for reached in (count - 1).clamp(max=len(self.accepted_at_depth)).tolist():
            for depth in range(reached):
                self.accepted_at_depth[depth] += 1

    def as_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "tau": self.tau,
            "acceptance_per_depth": self.acceptance_per_depth,
            "budgets": self.budgets,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
        }


@dataclass
class JetSpecGenerateOutput(GenerateDecoderOnlyOutput):
    """[`GenerateDecoderOnlyOutput`] of a tree-decoding call (`return_dict_in_generate=True`), with its statistics.

    `scores` / `logits` hold, per generated step, a `(batch, vocab)` tensor; a row that has already finished holds
    zeros there (plain `generate` keeps computing a finished row on padding; the tree loop does not).
    """

    jetspec_stats: JetSpecStats | None = None


def resolve_tree_shape(config, **given) -> TreeShape:
    """Tree shape from per-call values, falling back to the head's config; validated by [`tree.check_tree_shape`]."""

    def pick(name, default):
        return given[name] if given.get(name) is not None else default

    shape = TreeShape(
        depth=pick("tree_depth", config.tree_depth),
        width=pick("tree_width", config.tree_width),
        budget=pick("tree_budget", config.tree_budget),
        scoring=pick("tree_scoring", config.tree_scoring),
        path_conditioning=pick("path_conditioning", config.path_conditioning),
        lookup=pick("tree_lookup", getattr(config, "tree_lookup", 0)),
        # False switches the head's prior off for this call (the whole chain first)
        lookup_prior=None if given.get("tree_lookup_prior") is False
        else pick("tree_lookup_prior", getattr(config, "tree_lookup_prior", None)),
    )
    check_lookup_prior(shape.lookup_prior)
    check_tree_shape(shape.depth, shape.width, shape.budget, shape.scoring, config.block_size, shape.path_conditioning,
                     shape.lookup)
    return shape


# ------------------------------------------------------------------------------------------------ entry points
def check_generate_kwargs(kwargs: dict):
    """Raise a `ValueError` naming every argument of a `generate` call (`kwargs`, tree arguments and streamer
    removed) the tree loop would otherwise drop.

    Model kwargs other than `attention_mask` (`pixel_values`, `token_type_ids`, a user `past_key_values`,
    `inputs_embeds`, `position_ids`, ...) change what the target computes, and the tree loop runs its own forwards:
    passing them on silently would return another answer than plain `generate`. So do the generation settings in
    `UNSUPPORTED_GENERATION`, given directly or inside a `generation_config`.
    """
    for name, allowed in UNSUPPORTED_GENERATE.items():
        if kwargs.get(name) not in allowed:
            raise ValueError(f"expected no `{name}` with tree speculative decoding (not supported), got one")
    fields = GenerationConfig()  # a name it does not have is a model kwarg, as in `generate`
    skip = (*UNSUPPORTED_GENERATE, *GENERATE_HONOURED, *SUPPORTED_MODEL_KWARGS)
    unknown = sorted(k for k in kwargs if k not in skip and not hasattr(fields, k))
    if unknown:
        raise ValueError(
            f"expected only {', '.join(SUPPORTED_MODEL_KWARGS)} as model inputs with tree speculative decoding, got "
            f"also {', '.join(unknown)}: the tree loop runs its own target forwards and cannot pass them on"
        )
    config = kwargs.get("generation_config")
    given = config.to_dict() if config is not None else {}
    for name, default in UNSUPPORTED_GENERATION.items():
        value = kwargs.get(name, given.get(name, default))
        if value not in (default, None):
            raise ValueError(
                f"expected {name}={default!r} with tree speculative decoding (not supported), got {value!r}"
            )


def tree_generate(head, target, *args, **kwargs):
    """Route `target.generate(..., assistant_model=head)` to tree decoding; see `JetSpecDraftModel.tree_generate`."""
    kwargs.pop("assistant_model", None)
    given = {name: kwargs.pop(name, None) for name in TREE_ARGUMENTS}
    shape = resolve_tree_shape(head.config, **given)
    streamer = kwargs.pop("streamer", None)
    check_generate_kwargs(kwargs)
    max_new_tokens = kwargs.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValueError(f"expected max_new_tokens >= 1, got {max_new_tokens}")
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(prompt, torch.Tensor) and (prompt.dim() != 2 or prompt.shape[-1] == 0):
        raise ValueError(f"expected a non-empty prompt of shape (batch, length), got shape {tuple(prompt.shape)}")
    head.attach_target(target)
    check_layer_types(target)
    impl = target.config._attn_implementation
    switch = impl not in MASKABLE_ATTENTION
    if switch and not (impl.startswith("flash") or impl == "flex_attention"):
        raise ValueError(
            f"expected a target attention implementation that takes a 4D tree mask ({', '.join(MASKABLE_ATTENTION)}; "
            f"flash and flex attention are switched to sdpa for the call), got {impl!r}"
        )
    if switch:  # flash-attn cannot take a tree mask: verify with sdpa, restore afterwards
        target.set_attn_implementation("sdpa")
    try:
        return target.generate(
            *args, custom_generate=_decode, jetspec_head=head, jetspec_shape=shape, jetspec_streamer=streamer, **kwargs
        )
    finally:
        if switch:
            target.set_attn_implementation(impl)


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


_HOOK_MARK = "_jetspec_routes_heads"


def install_generate_hook():
    """Make `target.generate(..., assistant_model=<JetSpec head>)` run tree decoding.

    transformers' assisted decoding verifies a linear chain at batch size 1 and has no public hook for a tree,
    so `GenerationMixin.generate` is wrapped once: when `assistant_model` is a JetSpec head (its config's
    `model_type` is "jetspec") the call goes to the head's `tree_generate`; every other call is untouched.
    """
    if getattr(GenerationMixin.generate, _HOOK_MARK, False):
        return
    original = GenerationMixin.generate
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        assistant = bound.arguments.get("assistant_model")
        if assistant is None or getattr(assistant.config, "model_type", None) != "jetspec":
            return original(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.pop("assistant_model")
        arguments.update(arguments.pop("kwargs", {}))
        return assistant.tree_generate(self, **arguments)

    setattr(generate, _HOOK_MARK, True)
    GenerationMixin.generate = generate


# ------------------------------------------------------------------------------------------------ one round
@dataclass
class RoundState:
    """Everything a round reads and writes. B rows were asked for; the A rows still decoding are `rows`.

    Invariant between rounds: for active row i, the target cache holds the committed sequence of row `rows[i]`
    except its last token (the anchor), and the head's context holds the target features of the same positions.
    Nothing is ever written into `sequences` past a row's length: tokens become real one at a time, through the
    stopping criteria.
    """

    sequences: torch.Tensor  # (B, L) committed tokens, padding past each row's length; L = max_length, where the
    # MaxLengthCriteria that `generate` always adds stops every row
    lengths: list  # (B,) committed length of each row
    rows: torch.Tensor  # (A,) long, batch row of each active row
    cache: DynamicCache  # target keys/values of the A active rows, (A, H_kv, S, D) per layer
    valid: torch.Tensor  # (A, S) bool, False for padding and for the holes left by rejected nodes
    positions: torch.Tensor  # (A, S) long, position id of every target cache entry
    windows: dict | None  # sliding windows of the verify mask, see `_verify_windows`
    context: object  # JetSpecContext of the A active rows (head keys/values per layer, (A, H_kv, S', D))
    anchors: torch.Tensor  # (A,) long, last committed token of each row, not yet read by the target
    anchor_pos: torch.Tensor  # (A,) long, its position id
    records: list  # (B,) per row, `(scores (V,), logits (V,))` of every committed token, when asked for


@dataclass
class DraftTrees:
    """One candidate tree per active row (node 0 is the root, the anchor). Trees of a round have the same size."""

    tokens: torch.Tensor  # (A, n) long, target token of nodes 1..n
    parents: torch.Tensor  # (A, n) long, parent of nodes 1..n (0 is the root)
    depths: torch.Tensor  # (A, n + 1) long, depth of nodes 0..n
    ancestors: torch.Tensor  # (A, n + 1, n + 1) bool, node i sees node j (from `tree.ancestor_mask`)
    budget: int  # budget the trees were built for


@dataclass
class Acceptance:
    """What a round commits per active row: the target's token after each accepted node, root first."""

    nodes: torch.Tensor  # (A, K) long, accepted nodes root first; padded with 0 past `count`
    tokens: torch.Tensor  # (A, K) long, tokens[i, k] is the target's choice after node nodes[i, k]: the path, then
    # the bonus
    count: torch.Tensor  # (A,) long, accepted nodes (root included) == tokens committed by the round
    records: list | None  # (A,) per row, `(scores (V,), logits (V,))` of each committed token, or None

    def paths(self) -> list:
        """Accepted node indices of each row, root first (what `BudgetController.update` reads)."""
        return _paths(self.nodes, self.count)


def draft(head, state: RoundState, shape: TreeShape, budget: int) -> DraftTrees:
    """One head forward over `[anchor, MASK x N]` (the full block when bidirectional), a best-first tree per row.

    The head's logits at block slot d are its distribution of the token at depth d, `(A, N, V_draft)`; their top-W
    become the candidates of every depth-(d - 1) branch (`tree.marginal_children`). With `path_conditioning`, a
    second forward rescores the tree from what the head predicts under each branch's real tokens. With `lookup`,
    each tree also holds the row's prompt-lookup continuation (`tree.lookup_match`): first, or, with the head's
    `tree_lookup_prior`, scored by how often such chains are accepted against the head's own nodes.
    """
    a, device = state.anchors.shape[0], state.anchors.device
    length = shape.depth + 1 if head.config.block_attention == "causal" else head.config.block_size
    block = torch.full((a, length), head.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = state.anchors
    out = head(block, state.anchor_pos[:, None] + torch.arange(length, device=device), context=state.context)
    logp = torch.log_softmax(out.logits[:, 1 : shape.depth + 1], dim=-1)  # (A, N, V_draft)
    top_lp, top_tok = logp.topk(shape.width, dim=-1)  # (A, N, W)
    top_tok = head.draft_to_target(top_tok)  # (A, N, W) target ids
    ent = entropy(logp) if shape.scoring != "logprob" else torch.zeros(logp.shape[:2])  # (A, N)
    children = [marginal_children(top_lp[i], top_tok[i], ent[i]) for i in range(a)]
    if shape.lookup:
        sequences = [state.sequences[row, : state.lengths[row]].tolist() for row in state.rows.tolist()]
        prior = shape.lookup_prior
        merged = []
        for fn, seq in zip(children, sequences):
            chain, order = lookup_match(seq, shape.lookup, max_ngram=len(prior) if prior else LOOKUP_MAX_NGRAM)
            logprobs = lookup_logprobs(prior, order, len(chain)) if prior and chain else None
            merged.append(with_lookup(fn, chain, logprobs))
        children = merged
    deepest = max(shape.depth, shape.lookup)  # a lookup chain may run past the head's depths
    trees = [build_tree(children[i], budget, deepest, shape.scoring) for i in range(a)]
    if shape.path_conditioning:
        trees = _path_conditioned_trees(head, state, _stack_trees(trees, budget, device), children, shape, budget)
    return _stack_trees(trees, budget, device)


def verify(target, head, state: RoundState, trees: DraftTrees) -> tuple[torch.Tensor, torch.Tensor]:
    """The target reads root + n nodes of every tree in one forward, under the tree-causal mask, after its cache.

    Returns:
        `(logits, features)`: the target's logits after every node, `(A, n + 1, V)` in fp32, and the head's input
        features of every node, `(A, n + 1, k * H)`. The cache grows by the n + 1 entries; [`advance`] compacts it.
    """
    positions = state.anchor_pos[:, None] + trees.depths  # (A, n + 1)

    def mask(window):  # (A, 1, n + 1, S + n + 1)
        dtype = _float_dtype(target)
        return verification_mask(state.valid, trees.ancestors, dtype, window, state.positions, positions)

    if state.windows is None:
        attention_mask = mask(None)
    elif None in state.windows:  # every layer slides (Mistral): one mask
        attention_mask = mask(state.windows[None])
    else:  # one mask per layer type; the model hands each layer its own
        attention_mask = {layer_type: mask(window) for layer_type, window in state.windows.items()}
    out = target(
        input_ids=torch.cat([state.anchors[:, None], trees.tokens], dim=1),  # (A, n + 1)
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=state.cache,
        use_cache=True,
        output_hidden_states=True,
        **_logits_to_keep(target, 0),
    )
    return out.logits.float(), head.target_features(out.hidden_states)


def accept(logits: torch.Tensor, trees: DraftTrees, state: RoundState, choose, record: bool) -> Acceptance:
    """The deepest node whose path equals the target's own choices, and the target's token after it (the bonus).

    Greedy without logits processors (`choose is None`) is vectorized over rows and nodes: the target's argmax
    after every node, a node matches when its token is its parent's argmax, a node survives when it and all its
    ancestors match, the deepest survivor ends the path. Otherwise (sampling, processors) each row walks its tree
    from the root: `choose(row, node_logits, path)` is the target's token after `path` (processors see exactly the
    committed tokens plus the path), and the walk moves to the child holding it (sample-then-match).

    Args:
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`].
        choose (`Callable`, *optional*): `(row, logits (V,), path tokens) -> (token, scores (V,))`.
        record (`bool`): keep `(scores, logits)` of every committed token (`output_scores` / `output_logits`).
    """
    a, n1 = logits.shape[:2]
    device = logits.device
    if choose is None:
        choice = logits.argmax(-1)  # (A, n + 1)
        matches = torch.cat(  # (A, n + 1): the node's token is what the target chose after its parent
            [torch.ones(a, 1, dtype=torch.bool, device=device), trees.tokens == choice.gather(1, trees.parents)], dim=1
        )
        alive = ~(trees.ancestors & ~matches[:, None, :]).any(-1)  # (A, n + 1): the whole path matches
        deepest = torch.where(alive, trees.depths, -1).argmax(-1)  # (A,)
        on_path = trees.ancestors[torch.arange(a, device=device), deepest]  # (A, n + 1)
        count = on_path.sum(-1)  # (A,)
        order = torch.where(on_path, torch.arange(n1, device=device), n1).sort(-1).values  # accepted nodes first
        order = order[:, : int(count.max())]
        nodes = order.masked_fill(order == n1, 0)  # (A, K)
        records = None
        if record:  # no processors: the scores are the logits
            records = [[(logits[i, j], logits[i, j]) for j in path] for i, path in enumerate(_paths(nodes, count))]
        return Acceptance(nodes, choice.gather(1, nodes), count, records)
    walks, records = [], []
    for i, row in enumerate(state.rows.tolist()):
        kids = [{} for _ in range(n1)]  # node -> {token: child}; the first child holding a token wins
        for child, (token, parent) in enumerate(zip(trees.tokens[i].tolist(), trees.parents[i].tolist()), start=1):
            kids[parent].setdefault(token, child)
        node, path, nodes, picked = 0, [], [0], []
        while True:
            token, scores = choose(row, logits[i, node], path)
            path.append(token)
            picked.append((scores, logits[i, node]))
            node = kids[node].get(token)
            if node is None:
                break
            nodes.append(node)
        walks.append((nodes, path))
        records.append(picked)
    width = max(len(nodes) for nodes, _ in walks)
    padded = torch.zeros(2, a, width, dtype=torch.long)  # accepted nodes, committed tokens
    for i, (nodes, path) in enumerate(walks):
        padded[0, i, : len(nodes)], padded[1, i, : len(path)] = torch.tensor(nodes), torch.tensor(path)
    count = torch.tensor([len(nodes) for nodes, _ in walks], device=device)
    return Acceptance(padded[0].to(device), padded[1].to(device), count, records if record else None)


def advance(head, state: RoundState, trees: DraftTrees, acc: Acceptance, features, stopping, batch, streamer):
    """Commit, drop finished rows, compact the target cache, extend the head's context: one pass, survivors only.

    Args:
        features (`torch.Tensor` of shape `(A, n + 1, k * H)`): from [`verify`].
        stopping (`StoppingCriteriaList`): checked after every committed token, so a row stops exactly where plain
            decoding would, even inside an accepted path.
        batch (`int`): the batch size the caller passed to `generate` (see [`_as_row`]).
        streamer (`BaseStreamer`, *optional*): receives each row's committed tokens (batch 1).

    Returns:
        `(state, committed)`: the next round's state (A' <= A rows) and the number of tokens committed.
    """
    device = state.anchors.device
    keep, committed = [], 0
    for i, row in enumerate(state.rows.tolist()):
        count = int(acc.count[i])
        records = acc.records[i] if acc.records is not None else None
        added, done = _commit(state, row, acc.tokens[i, :count].tolist(), records, stopping, batch, streamer)
        committed += added
        if not done:
            keep.append(i)
    past = state.valid.shape[1]
    if len(keep) < state.rows.shape[0]:  # finished rows leave before any compaction
        sel = torch.tensor(keep, dtype=torch.long, device=device)
        state.cache.batch_select_indices(sel)
        state.rows, state.valid, state.context = state.rows[sel], state.valid[sel], state.context.select_rows(sel)
        state.positions = state.positions[sel]
        state.anchors, state.anchor_pos = state.anchors[sel], state.anchor_pos[sel]
        width = int(acc.count[sel].max()) if keep else 0  # the survivors' longest path
        acc = Acceptance(acc.nodes[sel, :width], acc.tokens[sel, :width], acc.count[sel], None)
        features, depths = features[sel], trees.depths[sel]
    else:
        depths = trees.depths
    if not keep:
        return state, committed
    a, k = acc.nodes.shape
    kept = torch.arange(k, device=device) < acc.count[:, None]  # (A', K)
    index = torch.cat([torch.arange(past, device=device).expand(a, past), past + acc.nodes], dim=1)  # (A', S + K)
    for layer in state.cache.layers:  # the cache keeps its past and the accepted nodes, root first
        gather = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
    positions = state.anchor_pos[:, None] + depths.gather(1, acc.nodes)  # (A', K)
    accepted = features.gather(1, acc.nodes[..., None].expand(-1, -1, features.shape[-1]))  # (A', K, kH)
    state.context = head.extend_context(state.context, accepted, positions, kept)
    state.valid = torch.cat([state.valid, kept], dim=1)  # (A', S + K)
    state.positions = torch.cat([state.positions, positions], dim=1)  # (A', S + K)
    state.anchors = acc.tokens.gather(1, (acc.count - 1)[:, None])[:, 0]  # the bonus token
    state.anchor_pos = state.anchor_pos + acc.count
    return state, committed


def _commit(state: RoundState, row: int, tokens: list, records, stopping, batch: int, streamer) -> tuple[int, bool]:
    """Append `tokens` to `row` one at a time; stop as soon as the stopping criteria say so.

    Returns:
        `(added, done)`: tokens committed and whether the row finished.
    """
    start = state.lengths[row]
    for added, token in enumerate(tokens, start=1):
        state.sequences[row, state.lengths[row]] = token
        state.lengths[row] += 1
        if records is not None:
            state.records[row].append(records[added - 1])
        done = _as_row(stopping, row, batch, state.sequences[row : row + 1, : state.lengths[row]], None)
        if done:
            break
    if streamer is not None:
        streamer.put(state.sequences[row, start : state.lengths[row]].cpu())
    return state.lengths[row] - start, done


# ------------------------------------------------------------------------------------------------ the decoding loop
def _decode(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    jetspec_head=None,
    jetspec_shape=None,
    jetspec_streamer=None,
    **model_kwargs,
):
    """The decoding method `generate` runs for a JetSpec head (passed as its callable `custom_generate`)."""
    head, shape, streamer, target = jetspec_head, jetspec_shape, jetspec_streamer, model
    _check_call(input_ids, generation_config, streamer)
    if streamer is not None:  # as in plain `generate`: the prompt first (the streamer was kept from `generate`)
        streamer.put(input_ids.cpu())
    batch = input_ids.shape[0]
    want_records = generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    )
    # the prefill is a forward; a lookup chain may be accepted past the head's depths
    stats = JetSpecStats(target_forwards=1, accepted_at_depth=[0] * max(shape.depth, shape.lookup))
    started = clock()
    state, first_logits = _prefill(head, target, input_ids, model_kwargs.get("attention_mask"), generation_config)
    first_scores = logits_processor(input_ids, first_logits)  # (B, V): every row has the same length here
    first = _pick(first_scores, generation_config.do_sample)  # (B,)
    keep = []
    for row in range(batch):
        record = [(first_scores[row], first_logits[row])] if want_records else None
        added, done = _commit(state, row, [int(first[row])], record, stopping_criteria, batch, streamer)
        stats.new_tokens += added
        keep += [] if done else [row]
    state = _keep_rows(state, torch.tensor(keep, dtype=torch.long, device=input_ids.device), first)
    controller = _budget_controller(head, target, shape, len(keep)) if shape.budget == "auto" and keep else None
    choose = None  # greedy without processors: vectorized acceptance
    if generation_config.do_sample or len(logits_processor):
        choose = functools.partial(_choose, logits_processor, generation_config.do_sample, batch, state)
    while state.rows.numel():
        t0 = clock()
        budget = controller.next_budget() if controller is not None else shape.budget
        trees = draft(head, state, shape, budget)
        t1 = clock()
        logits, features = verify(target, head, state, trees)
        t2 = clock()
        acc = accept(logits, trees, state, choose, want_records)
        if controller is not None:
            controller.update(acc.paths(), budget, t1 - t0)
        active = state.rows.shape[0]
        state, committed = advance(head, state, trees, acc, features, stopping_criteria, batch, streamer)
        stats.add_round(budget, active, acc.count, committed, clock() - t2 + t1 - t0, t2 - t1)
    stats.total_seconds = clock() - started
    return _finish(head, state, stats, generation_config, input_ids.shape[1], streamer)


def _check_call(input_ids, generation_config, streamer):
    batch, prompt_length = input_ids.shape
    if generation_config.num_beams > 1:
        raise ValueError(f"expected num_beams == 1 for tree speculative decoding, got {generation_config.num_beams}")
    if prompt_length == 0:
        raise ValueError("expected a non-empty prompt, got input_ids with 0 tokens")
    if streamer is not None and batch > 1:
        raise ValueError(f"expected batch size 1 with a streamer (as in transformers), got {batch}")


def _verify_windows(target) -> dict | None:
    """The sliding windows the verify mask applies, or `None` when no layer has one.

    Returns `{layer_type: window or None}` for targets with `layer_types` (the model takes a dict of masks and hands
    each layer the one of its type), or `{None: window}` when every layer slides (Mistral: one mask). Plain
    `generate` crops sliding layers' caches to the window; the tree loop keeps every entry and masks by position
    instead, which attends to the same keys.
    """
    text = target.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    if layer_types is None:
        return {None: window}
    return {t: window if t == "sliding_attention" else None for t in sorted(set(layer_types))}


def _prefill(head, target, input_ids, attention_mask, generation_config) -> tuple[RoundState, torch.Tensor]:
    """The target reads the prompts; the head's context starts from their features.

    Returns:
        `(state, logits)`: the state with every row active and no token committed yet, and the target's logits
        after each prompt, `(B, V)` in fp32.
    """
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
    cache = DynamicCache()
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        **_logits_to_keep(target, 1),
    )
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"expected a target cache of attention keys/values (DynamicLayer), got {type(layer).__name__}"
            )
    pad = generation_config._pad_token_tensor
    sequences = torch.full(
        (batch, generation_config.max_length), int(pad) if pad is not None else 0, dtype=torch.long, device=device
    )
    sequences[:, :prompt_length] = input_ids
    state = RoundState(
        sequences=sequences,
        lengths=[prompt_length] * batch,
        rows=torch.arange(batch, device=device),
        cache=cache,
        valid=valid,
        positions=positions,
        windows=_verify_windows(target),
        context=head.extend_context(None, head.target_features(out.hidden_states), positions, valid),
        anchors=input_ids[:, -1],  # replaced by the first committed token in `_keep_rows`
        anchor_pos=valid.long().sum(-1),
        records=[[] for _ in range(batch)],
    )
    return state, out.logits[:, -1].float()


def _keep_rows(state: RoundState, keep: torch.Tensor, first: torch.Tensor) -> RoundState:
    """After the first token: the rows that go on, their anchor is that token (`first` of shape `(B,)`)."""
    if keep.numel() < state.rows.shape[0]:
        state.cache.batch_select_indices(keep)
        state.valid, state.positions = state.valid[keep], state.positions[keep]
        state.context, state.anchor_pos = state.context.select_rows(keep), state.anchor_pos[keep]
    state.rows, state.anchors = keep, first[keep]
    return state


def _finish(head, state: RoundState, stats: JetSpecStats, generation_config, prompt_length: int, streamer):
    if streamer is not None:
        streamer.end()
    longest = max(state.lengths)
    if generation_config._pad_token_tensor is None and min(state.lengths) != longest:
        raise ValueError("expected a pad_token_id to pad rows that finish early, got none")
    sequences = state.sequences[:, :longest]  # (B, longest); past each row's length: padding, never written
    head.last_stats = stats
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = longest - prompt_length
    return JetSpecGenerateOutput(
        sequences=sequences,
        scores=_per_step(state.records, 0, steps) if generation_config.output_scores else None,
        logits=_per_step(state.records, 1, steps) if generation_config.output_logits else None,
        jetspec_stats=stats,
    )


# ------------------------------------------------------------------------------------------------ pieces
def _budget_controller(head, target, shape: TreeShape, batch: int) -> BudgetController:
    """Verify costs are measured once per (target, device, dtype, batch size) and kept on the head.

    `head.verify_cost_cache` is keyed by the target object itself (weakly), never by `id(target)`: an id is reused
    once a target is freed.
    """
    largest = max_tree_nodes(shape.depth, shape.width)
    candidates = sorted({min(b, largest) for b in DEFAULT_CANDIDATES})
    per_target = head.verify_cost_cache.setdefault(target, {})
    key = (str(target.device), target.dtype, batch, tuple(candidates))
    if key not in per_target:
        per_target[key] = measure_verify_seconds(target, candidates, batch_size=batch)
    return BudgetController(candidates, per_target[key])


def _stack_trees(trees: list, budget: int, device) -> DraftTrees:
    """One batch of trees. A tree short of the others' size (a row whose lookup chain added fewer nodes, or none) is
    padded with copies of its last node: same token, parent and position, so the same keys and logits, and acceptance
    takes the first of equal nodes; the copies only cost verify width."""
    size = max(len(t.tokens) for t in trees)
    if any(not t.tokens for t in trees):
        raise ValueError(f"expected at least one draft node per tree, got sizes {[len(t.tokens) for t in trees]}")

    def padded(t: Tree) -> Tree:
        extra = size - len(t.tokens)
        return Tree(t.tokens + t.tokens[-1:] * extra, t.parents + t.parents[-1:] * extra,
                    t.depths + t.depths[-1:] * extra, t.scores + t.scores[-1:] * extra)

    trees = [padded(t) for t in trees]
    parents = torch.tensor([t.parents for t in trees], dtype=torch.long, device=device)  # (A, n)
    return DraftTrees(
        tokens=torch.tensor([t.tokens for t in trees], dtype=torch.long, device=device),
        parents=parents,
        depths=torch.tensor([[0] + t.depths for t in trees], dtype=torch.long, device=device),
        ancestors=ancestor_mask(parents),
        budget=budget,
    )


def _path_conditioned_trees(head, state: RoundState, trees: DraftTrees, marginals: list, shape, budget) -> list:
    """Second draft pass (DESIGN section 3): real tokens at the tree's nodes plus one MASK probe under every node.

    Probe j sits at depth(j) + 1 and sees the context, the anchor, node j's ancestors and node j: its output is
    q(child | the branch's actual tokens). The tree is rebuilt best-first from these conditionals (branches without
    a probe fall back to the first pass's marginals, `marginals[i]`).
    """
    a, n = trees.tokens.shape
    device = trees.tokens.device
    probes = torch.full((a, n), head.config.mask_token_id, dtype=torch.long, device=device)
    inputs = torch.cat([state.anchors[:, None], trees.tokens, probes], dim=1)  # (A, 1 + 2n)
    depths = trees.depths[:, 1:]  # (A, n)
    positions = state.anchor_pos[:, None] + torch.cat([trees.depths, depths + 1], dim=1)  # (A, 1 + 2n)
    t = 1 + 2 * n
    inner = torch.zeros(a, t, t, dtype=torch.bool, device=device)
    inner[:, : n + 1, : n + 1] = trees.ancestors
    inner[:, n + 1 :, : n + 1] = trees.ancestors[:, 1:]  # probe j sees what node j sees, node j included
    inner[:, n + 1 :, n + 1 :] = torch.eye(n, dtype=torch.bool, device=device)
    mask = torch.cat([state.context.valid[:, None, :].expand(a, t, -1), inner], dim=-1)[:, None]  # (A, 1, t, S+t)
    out = head(inputs, positions, attention_mask=mask, context=state.context)
    logp = torch.log_softmax(out.logits[:, n + 1 :], dim=-1)  # (A, n, V_draft)
    probe_lp, probe_tok = logp.topk(shape.width, dim=-1)  # (A, n, W)
    probe_tok = head.draft_to_target(probe_tok)  # (A, n, W) target ids
    probe_ent = entropy(logp) if shape.scoring != "logprob" else torch.zeros(logp.shape[:2])  # (A, n)
    rebuilt = []
    for i in range(a):
        paths, probed = [()], {}
        for j, (token, parent) in enumerate(zip(trees.tokens[i].tolist(), trees.parents[i].tolist())):
            paths.append(paths[parent] + (token,))
            probed[paths[-1]] = (probe_lp[i, j].tolist(), probe_tok[i, j].tolist(), float(probe_ent[i, j]))
        children = functools.partial(_probed_or_marginal, probed, marginals[i])
        rebuilt.append(build_tree(children, budget, shape.depth, shape.scoring))
    return rebuilt


def _paths(nodes: torch.Tensor, count: torch.Tensor) -> list:
    """Rows of `nodes` `(A, K)` cut at `count` `(A,)`, as lists."""
    return [row[:c] for row, c in zip(nodes.tolist(), count.tolist())]


def _probed_or_marginal(probed: dict, marginal, path: tuple):
    return probed.get(path) or marginal(path)


def _choose(processors, do_sample: bool, batch: int, state: RoundState | None, row: int, logits, path: list):
    """The target's token after row `row`'s committed tokens plus `path`, as plain `generate` would pick it.

    Returns:
        `(token, scores)`: the token and the processed scores it was picked from, `(V,)`.
    """
    ids = state.sequences[row : row + 1, : state.lengths[row]]
    if path:
        ids = torch.cat([ids, torch.tensor([path], dtype=torch.long, device=ids.device)], dim=1)  # (1, L + len)
    scores = _as_row(processors, row, batch, ids, logits[None])  # (1, V)
    return int(_pick(scores, do_sample)[0]), scores[0]


def _pick(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """`(B,)` tokens from processed scores `(B, V)`: a sample of their softmax, or their argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
    return scores.argmax(-1)


def _as_row(fn, row: int, batch: int, ids: torch.Tensor, scores: torch.Tensor | None):
    """Call a logits processor or stopping criterion for one row, in a batch of the caller's size.

    Rows advance by different amounts per round, so each row is processed on its own; the row is repeated to the
    batch size the caller passed to `generate` so that processors holding per-row state (batch-sized tensors,
    `prefix_allowed_tokens_fn`'s batch id) see the same batch layout as in plain decoding, and row `row` is read
    back.
    """
    ids = ids.expand(batch, -1)
    if scores is None:
        return bool(fn(ids, None)[row])
    return fn(ids, scores.repeat(batch, 1))[row : row + 1]  # a copy: processors may write in place


def _float_dtype(target) -> torch.dtype:
    return target.dtype if target.dtype.is_floating_point else torch.float32


def _logits_to_keep(target, count: int) -> dict:
    return {"logits_to_keep": count} if target._supports_logits_to_keep() else {}


def _per_step(records: list, which: int, steps: int) -> tuple:
    """Per generated step, `(B, V)` scores (`which=0`) or logits (`which=1`); finished rows get zeros."""
    zeros = torch.zeros_like(next(entry[which] for row in records for entry in row))  # (V,), on its device
    return tuple(
        torch.stack([rec[step][which] if step < len(rec) else zeros for rec in records]) for step in range(steps)
    )


# Written as `custom_generate/generate.py` next to a saved head, so that
# `target.generate(..., custom_generate=<head folder or repo>, jetspec_head=<the same>, trust_remote_code=True)`
# decodes with that head.
CUSTOM_GENERATE_SOURCE = '''"""JetSpec tree speculative decoding as a `custom_generate` recipe.

    target.generate(**inputs, custom_generate="<this repo>", jetspec_head="<this repo>", trust_remote_code=True,
                    max_new_tokens=256)

`jetspec_head` is the head to decode with: a repo id or folder (loaded once per process with
`AutoModel.from_pretrained(..., trust_remote_code=True)`), or a head you already hold. transformers does not tell a
recipe which repo it was loaded from, so the head is named explicitly.
"""

from transformers import AutoModel

_HEADS = {}


def generate(model, *args, jetspec_head=None, **kwargs):
    if jetspec_head is None:
        raise ValueError(
            "expected jetspec_head=<this repo or folder, or a loaded JetSpec head> with this recipe, got none"
        )
    head = jetspec_head
    if isinstance(head, str):
        if head not in _HEADS:
            _HEADS[head] = AutoModel.from_pretrained(head, trust_remote_code=True)
        head = _HEADS[head].to(device=model.device, dtype=model.dtype)
    return head.tree_generate(model, *args, **kwargs)
'''
