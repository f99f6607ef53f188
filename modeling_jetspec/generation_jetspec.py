"""Lossless tree speculative decoding inside `target.generate` (arXiv 2606.18394, sections 3.2-3.4; `docs/design.md`,
"§2 The round").

A round is five functions over explicit tensors; `generate`, the benchmark and the measured budget call the same ones:

- [`draft`]: one head forward over `[anchor, MASK x N]` per row, a best-first tree of `budget` nodes per row;
- [`verify`]: one target forward over root + tree nodes under the tree-causal mask (position = past length + depth);
- [`accept`]: the deepest node whose whole path equals the target's own choices, plus the target's next token
  (the bonus);
- [`commit`]: each row's tokens enter its sequence one at a time, through the stopping criteria and the streamer;
- [`compact`]: finished rows leave; the target cache keeps its past in place and moves only the accepted nodes'
  entries behind it; the head's context grows by their target features; the bonus token becomes the next anchor.

[`RoundState`] holds the tensors a round replaces, [`Call`] what one `generate` call fixes (tree shape, stopping
criteria, processors) and the sequences it has committed. The target is reached through a verifier chosen once per
call by [`verifier_for`] ([`TreeVerifier`] for targets whose layers all cache keys/values): a target whose layers
keep another state gets a verifier of its own with the same methods, and the round stays as it is.

Lossless: every committed token is the target's own choice (argmax, or a sample of the processed distribution)
given exactly the committed tokens before it, whatever the head drafts.

Rows of a batch keep their own lengths: the caches are rectangular with holes, and a `(A, S)` validity mask plus
explicit position ids make the holes invisible. Finished rows leave the batch.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .budget import DEFAULT_CANDIDATES, BudgetController
from .hybrid import HybridVerifier, is_hybrid
from .timing import clock, median_seconds
from .tree import (
    ENTROPY_SCORINGS,
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
# transformers' processors whose output row depends only on that row's tokens and scores (no batch-sized state, no
# batch index): a node's scores are processed on its row alone. Any other processor sees the row in the batch layout
# of the call (see `_row_processors`).
ROW_WISE_PROCESSORS = (
    EpsilonLogitsWarper, EtaLogitsWarper, ExponentialDecayLengthPenalty, ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor, LogitNormalization, MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopHLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
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
    tree_verify = kwargs.pop("tree_verify", None) or "auto"  # hybrid targets: "tree", "chain" or "auto"
    check_generate_kwargs(kwargs)
    max_new_tokens = kwargs.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValueError(f"expected max_new_tokens >= 1, got {max_new_tokens}")
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(prompt, torch.Tensor) and (prompt.dim() != 2 or prompt.shape[-1] == 0):
        raise ValueError(f"expected a non-empty prompt of shape (batch, length), got shape {tuple(prompt.shape)}")
    head.attach_target(target)
    verifier = verifier_for(target, head, tree_verify)  # refuses layer kinds no verifier handles, before any work
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
            *args, custom_generate=_decode, jetspec_head=head, jetspec_shape=shape, jetspec_streamer=streamer,
            jetspec_verifier=verifier, **kwargs,
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


# ------------------------------------------------------------------------------------------------ one round: data
@dataclass
class RoundState:
    """The tensors a round reads and replaces. B rows were asked for; the A rows still decoding are `rows`.

    Invariant between rounds: for active row i, the target cache holds the committed sequence of row `rows[i]` except
    its last token (the anchor), and the head's context holds the target features of the same positions.
    """

    rows: torch.Tensor  # (A,) long, batch row of each active row
    cache: Cache  # target cache of the A active rows: keys (A, H_kv, S, D_k) and values (A, H_kv, S, D_v) per layer
    # (D_k != D_v under multi-head latent attention)
    valid: torch.Tensor  # (A, S) bool, False for padding and for the holes left by rejected nodes
    positions: torch.Tensor  # (A, S) long, position id of every target cache entry
    context: object  # JetSpecContext of the A active rows (head keys/values per layer, (A, H_kv, S', D))
    anchors: torch.Tensor  # (A,) long, last committed token of each row, not yet read by the target
    anchor_pos: torch.Tensor  # (A,) long, its position id


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
    scores: list | None = None  # (A,) per row, the processed scores (V,) each token was chosen from; None: the
    # scores are the logits (greedy without processors)

    def paths(self) -> list:
        """Accepted node indices of each row, root first (what `BudgetController.update` reads)."""
        return _paths(self.nodes, self.count)


@dataclass
class Call:
    """What one `generate` call fixes at its start, and the tokens it has committed so far.

    Nothing is ever written into `sequences` past a row's length: tokens become real one at a time, through the
    stopping criteria ([`commit`]).
    """

    shape: TreeShape
    verifier: "TreeVerifier"  # how the target verifies and compacts (see `verifier_for`)
    sequences: torch.Tensor  # (B, L) committed tokens, padding past each row's length; L = max_length, where the
    # MaxLengthCriteria that `generate` always adds stops every row
    lengths: list  # (B,) committed length of each row
    stopping: StoppingCriteriaList  # checked after every committed token
    streamer: object | None = None  # a `BaseStreamer` receiving each row's committed tokens (batch 1)
    records: list | None = None  # (B,) per row, `(scores (V,), logits (V,))` of every committed token; None: not kept
    choose: Callable | None = None  # `(row, logits (V,), path) -> (token, scores (V,))`, see [`accept`]; None:
    # greedy without processors (vectorized acceptance)

    def histories(self, rows: torch.Tensor) -> list:
        """The committed tokens of each row in `rows` `(A,)`, as lists (what prompt lookup matches)."""
        return [self.sequences[row, : self.lengths[row]].tolist() for row in rows.tolist()]


# ------------------------------------------------------------------------------------------------ one round: steps
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
        output_hidden_states=True,
        **logits_to_keep(target, 1),
    )
    logits = out.logits[:, -1].float()  # (B, V)
    state = RoundState(
        rows=torch.arange(input_ids.shape[0], device=input_ids.device),
        cache=cache,
        valid=valid,
        positions=positions,
        context=head.extend_context(None, head.target_features(out.hidden_states), positions, valid),
        anchors=logits.argmax(-1),
        anchor_pos=valid.long().sum(-1),
    )
    return state, logits


def draft(head, state: RoundState, shape: TreeShape, budget: int, histories: list | None = None) -> DraftTrees:
    """One head forward over `[anchor, MASK x N]` (the full block when bidirectional), a best-first tree per row.

    The head's logits at block slot d are its distribution of the token at depth d, `(A, N, V_draft)`; their top-W
    become the candidates of every depth-(d - 1) branch (`tree.marginal_children`). With `path_conditioning`, a
    second forward rescores the tree from what the head predicts under each branch's real tokens. With `lookup`,
    each tree also holds the row's prompt-lookup continuation (`tree.lookup_match`): first, or, with the head's
    `tree_lookup_prior`, scored by how often such chains are accepted against the head's own nodes.

    Args:
        shape (`TreeShape`): depth, width, scoring, path conditioning and lookup of the trees.
        budget (`int`): draft nodes per tree.
        histories (`list`, *optional*): per active row, its committed tokens ([`Call.histories`]); needed when
            `shape.lookup` is set.
    """
    if shape.lookup and histories is None:
        raise ValueError(f"expected the rows' committed tokens with tree_lookup={shape.lookup}, got none")
    a, device = state.anchors.shape[0], state.anchors.device
    length = shape.depth + 1 if head.config.block_attention == "causal" else head.config.block_size
    block = torch.full((a, length), head.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = state.anchors
    out = head(block, state.anchor_pos[:, None] + torch.arange(length, device=device), context=state.context)
    logp = torch.log_softmax(out.logits[:, 1 : shape.depth + 1], dim=-1)  # (A, N, V_draft)
    top_lp, top_tok = logp.topk(shape.width, dim=-1)  # (A, N, W)
    top_tok = head.draft_to_target(top_tok)  # (A, N, W) target ids
    ent = entropy(logp) if shape.scoring in ENTROPY_SCORINGS else torch.zeros(logp.shape[:2])  # (A, N)
    children = [marginal_children(top_lp[i], top_tok[i], ent[i]) for i in range(a)]
    if shape.lookup:
        children = [_with_lookup_branch(fn, history, shape) for fn, history in zip(children, histories)]
    deepest = max(shape.depth, shape.lookup)  # a lookup chain may run past the head's depths
    trees = [build_tree(children[i], budget, deepest, shape.scoring) for i in range(a)]
    if shape.path_conditioning:
        trees = _path_conditioned_trees(head, state, _stack_trees(trees, budget, device), children, shape, budget)
    return _stack_trees(trees, budget, device)


def verify(target, head, state: RoundState, trees: DraftTrees, windows: dict | None = None):
    """The target reads root + n nodes of every tree in one forward, under the tree-causal mask, after its cache.

    Args:
        windows (`dict`, *optional*): the sliding windows of the verify mask, from [`verify_windows`].

    Returns:
        `(logits, features)`: the target's logits after every node, `(A, n + 1, V)` in fp32, and the head's input
        features of every node, `(A, n + 1, k * H)`. The cache grows by the n + 1 entries; [`compact`] keeps the
        accepted ones.
    """
    positions = state.anchor_pos[:, None] + trees.depths  # (A, n + 1)

    def mask(window):  # (A, 1, n + 1, S + n + 1)
        return verification_mask(state.valid, trees.ancestors, float_dtype(target), window, state.positions, positions)

    if windows is None:
        attention_mask = mask(None)
    elif None in windows:  # every layer slides (Mistral): one mask
        attention_mask = mask(windows[None])
    else:  # one mask per layer type; the model hands each layer its own
        attention_mask = {layer_type: mask(window) for layer_type, window in windows.items()}
    out = target(
        input_ids=torch.cat([state.anchors[:, None], trees.tokens], dim=1),  # (A, n + 1)
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=state.cache,
        use_cache=True,
        output_hidden_states=True,
        **logits_to_keep(target, 0),
    )
    return out.logits.float(), head.target_features(out.hidden_states)


def accept(logits: torch.Tensor, trees: DraftTrees, rows: torch.Tensor, choose=None) -> Acceptance:
    """The deepest node whose path equals the target's own choices, and the target's token after it (the bonus).

    Greedy without logits processors (`choose is None`) is vectorized over rows and nodes: the target's argmax
    after every node, a node matches when its token is its parent's argmax, a node survives when it and all its
    ancestors match, the deepest survivor ends the path. Otherwise (sampling, processors) each row walks its tree
    from the root: `choose(row, node_logits, path)` is the target's token after `path` (processors see exactly the
    committed tokens plus the path), and the walk moves to the child holding it (sample-then-match).

    Args:
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`].
        trees (`DraftTrees`): the trees verified.
        rows (`torch.LongTensor` of shape `(A,)`): the batch row of each tree (what `choose` is told).
        choose (`Callable`, *optional*): `(row, logits (V,), path tokens) -> (token, scores (V,))`.
    """
    if choose is None:
        return _accept_greedy(logits, trees)
    walks = [_walk(logits[i], trees.tokens[i].tolist(), trees.parents[i].tolist(), row, choose)
             for i, row in enumerate(rows.tolist())]
    a, width = len(walks), max(len(nodes) for nodes, _, _ in walks)
    padded = torch.zeros(2, a, width, dtype=torch.long)  # accepted nodes, committed tokens
    for i, (nodes, path, _) in enumerate(walks):
        padded[0, i, : len(nodes)], padded[1, i, : len(path)] = torch.tensor(nodes), torch.tensor(path)
    count = torch.tensor([len(nodes) for nodes, _, _ in walks], device=logits.device)
    return Acceptance(padded[0].to(logits.device), padded[1].to(logits.device), count, [s for _, _, s in walks])


def _accept_greedy(logits: torch.Tensor, trees: DraftTrees) -> Acceptance:
    a, n1 = logits.shape[:2]
    device = logits.device
    choice = logits.argmax(-1)  # (A, n + 1)
    matches = torch.cat(  # (A, n + 1): the node's token is what the target chose after its parent
        [torch.ones(a, 1, dtype=torch.bool, device=device), trees.tokens == choice.gather(1, trees.parents)], dim=1
    )
    alive = ~(trees.ancestors & ~matches[:, None, :]).any(-1)  # (A, n + 1): the whole path matches
    deepest = torch.where(alive, trees.depths, -1).argmax(-1)  # (A,)
    on_path = trees.ancestors[torch.arange(a, device=device), deepest]  # (A, n + 1)
    count = on_path.sum(-1)  # (A,)
    order = torch.where(on_path, torch.arange(n1, device=device), n1).sort(-1).values  # accepted nodes first
    nodes = order[:, : int(count.max())]
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


def commit(call: Call, rows: torch.Tensor, acc: Acceptance, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Append each row's accepted tokens to its sequence one at a time, through the stopping criteria, so a row stops
    exactly where plain decoding would, even inside an accepted path; the streamer gets what was committed.

    Args:
        rows (`torch.LongTensor` of shape `(A,)`): the batch row of each acceptance row.
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`] (kept with `output_logits`).

    Returns:
        `(committed, keep)`: tokens committed, all rows, and the indices `(A',)` of the rows that go on.
    """
    keep, committed = [], 0
    for i, row in enumerate(rows.tolist()):
        count = int(acc.count[i])
        records = None
        if call.records is not None:
            nodes = acc.nodes[i, :count].tolist()
            scores = acc.scores[i] if acc.scores is not None else [logits[i, node] for node in nodes]
            records = [(s, logits[i, node]) for s, node in zip(scores, nodes)]
        added, done = _commit_row(call, row, acc.tokens[i, :count].tolist(), records)
        committed += added
        keep += [] if done else [i]
    return committed, torch.tensor(keep, dtype=torch.long, device=rows.device)


def _commit_row(call: Call, row: int, tokens: list, records: list | None) -> tuple[int, bool]:
    """Append `tokens` to `row` one at a time; stop as soon as the stopping criteria say so.

    Returns:
        `(added, done)`: tokens committed and whether the row finished.
    """
    start, batch = call.lengths[row], call.sequences.shape[0]
    for added, token in enumerate(tokens, start=1):
        call.sequences[row, call.lengths[row]] = token
        call.lengths[row] += 1
        if records is not None:
            call.records[row].append(records[added - 1])
        # the row in a batch of the caller's size, so criteria holding per-row state see plain decoding's layout
        ids = call.sequences[row : row + 1, : call.lengths[row]].expand(batch, -1)
        done = bool(call.stopping(ids, None)[row])
        if done:
            break
    if call.streamer is not None:
        call.streamer.put(call.sequences[row, start : call.lengths[row]].cpu())
    return call.lengths[row] - start, done


def keep_accepted_entries(cache: Cache, past: int, nodes: torch.Tensor):
    """Make a key/value cache hold its first `past` entries, then the accepted nodes' entries, root first.

    After a verify forward every layer holds `past` entries and then the n + 1 entries of the tree's nodes. The past
    stays where it is: only the accepted nodes' entries (`nodes` of shape `(A, K)`, from [`Acceptance`]) move, into
    slots `past .. past + K - 1`, and the layer is cropped to `past + K`. Keys and values are moved each by its own
    shape: their head sizes differ under multi-head latent attention (DeepSeek-V3, Kimi K2).
    """
    k = nodes.shape[1]
    for layer in cache.layers:
        if not layer.is_initialized:  # a layer that reads another layer's keys/values holds none of its own
            continue
        tail = layer.keys.shape[-2] - past  # n + 1
        layer.keys[:, :, past : past + k] = _gather_nodes(layer.keys[:, :, past:], nodes)
        layer.values[:, :, past : past + k] = _gather_nodes(layer.values[:, :, past:], nodes)
        layer.crop(k - tail)  # a negative count: the entries to drop from the end


def _gather_nodes(tail: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """Entries `nodes` `(A, K)` of a layer's tree entries `tail` `(A, H, n + 1, D)`: `(A, H, K, D)`."""
    return tail.gather(2, nodes[:, None, :, None].expand(-1, tail.shape[1], -1, tail.shape[-1]))


def compact(head, state: RoundState, trees: DraftTrees, acc: Acceptance, features: torch.Tensor, keep: torch.Tensor,
            keep_entries=keep_accepted_entries) -> RoundState:
    """Finished rows leave; the target cache keeps its past and the accepted nodes; the head's context grows by their
    target features; the bonus token becomes the next anchor.

    Args:
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
        width = int(acc.count[keep].max()) if keep.numel() else 0  # the survivors' longest path
        acc = Acceptance(acc.nodes[keep, :width], acc.tokens[keep, :width], acc.count[keep])
        features, depths = features[keep], depths[keep]
    if not keep.numel():
        return state
    keep_entries(state.cache, state.valid.shape[1], acc.nodes)
    kept = torch.arange(acc.nodes.shape[1], device=keep.device) < acc.count[:, None]  # (A', K), False: a hole
    positions = state.anchor_pos[:, None] + depths.gather(1, acc.nodes)  # (A', K)
    accepted = features.gather(1, acc.nodes[..., None].expand(-1, -1, features.shape[-1]))  # (A', K, kH)
    return replace(
        state,
        context=head.extend_context(state.context, accepted, positions, kept),
        valid=torch.cat([state.valid, kept], dim=1),  # (A', S + K)
        positions=torch.cat([state.positions, positions], dim=1),  # (A', S + K)
        anchors=acc.tokens.gather(1, (acc.count - 1)[:, None])[:, 0],  # the bonus token
        anchor_pos=state.anchor_pos + acc.count,
    )


def select_rows(state: RoundState, keep: torch.Tensor) -> RoundState:
    """The rows `keep` `(A',)` of a round state; the target cache keeps only them, in place."""
    state.cache.batch_select_indices(keep)
    return replace(
        state, rows=state.rows[keep], valid=state.valid[keep], positions=state.positions[keep],
        context=state.context.select_rows(keep), anchors=state.anchors[keep], anchor_pos=state.anchor_pos[keep],
    )


# ------------------------------------------------------------------------------------------------ verifiers
class TreeVerifier:
    """How a target whose layers all cache attention keys/values verifies a round: the whole tree in one forward
    under the tree-causal mask ([`verify`]), then [`keep_accepted_entries`] in [`compact`].

    The round reaches the target only through these methods, so a target whose layers keep another state (recurrent
    or convolution states) is served by a verifier of its own with the same methods, chosen in [`verifier_for`].
    """

    def __init__(self, target, head):
        self.target, self.head, self.windows = target, head, verify_windows(target)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[RoundState, torch.Tensor]:
        """[`prefill`] into a new cache of keys/values; see there."""
        state, logits = prefill(self.head, self.target, input_ids, attention_mask, DynamicCache())
        for layer in state.cache.layers:
            if type(layer) is not DynamicLayer:
                raise ValueError(
                    f"expected a target cache of attention keys/values (DynamicLayer), got {type(layer).__name__}"
                )
        return state, logits

    def verify(self, state: RoundState, trees: DraftTrees) -> tuple[DraftTrees, torch.Tensor, torch.Tensor]:
        """[`verify`]. Returns the trees verified (another verifier may verify a part of them, e.g. one path) with
        their logits and features."""
        logits, features = verify(self.target, self.head, state, trees, self.windows)
        return trees, logits, features

    def compact(self, state, trees, acc, features, keep) -> RoundState:
        """[`compact`] with [`keep_accepted_entries`]."""
        return compact(self.head, state, trees, acc, features, keep)

    def discard(self, state: RoundState, trees: DraftTrees):
        """Undo a [`verify`] without compacting (timing repeats): drop the n + 1 entries it added."""
        state.cache.crop(-(trees.tokens.shape[1] + 1))


def verifier_for(target, head, tree_verify: str = "auto") -> TreeVerifier:
    """The verifier of a call: [`TreeVerifier`] for targets whose layers all cache attention keys/values,
    [`hybrid.HybridVerifier`] (`tree_verify`: "auto", "tree" or "chain") for targets with linear-attention or
    convolution layers; a `ValueError` naming the layer types of any other target."""
    if is_hybrid(target):
        return HybridVerifier(target, head, tree_verify, verify_windows(target))
    check_layer_types(target)
    if tree_verify not in ("auto", "tree"):
        raise ValueError(f"expected tree_verify 'auto' or 'tree' for an attention-only target, got {tree_verify!r}")
    return TreeVerifier(target, head)


def verify_windows(target) -> dict | None:
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


# ------------------------------------------------------------------------------------------------ measured costs
def verify_seconds(verifier, state: RoundState, trees: DraftTrees, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of the verifier's forward over `trees` after `state`'s cache, undone after every call
    ([`timing.median_seconds`]: it waits for the accelerator)."""

    def once():
        verifier.verify(state, trees)
        verifier.discard(state, trees)

    return median_seconds(once, repeats=repeats, warmup=warmup)


@torch.no_grad()
def measure_verify_seconds(target, head, shape: TreeShape, budgets, batch_size: int = 1, context_length: int = 64,
                           repeats: int = 3) -> dict:
    """Median wall time of a verify round at each budget b, at this batch size, after a prefilled random context.

    The trees are the head's own ([`draft`] at `shape` without path conditioning or lookup branch, so b nodes), and
    the forward is [`verify`] as `generate` runs it.

    Returns:
        `dict` from budget to seconds.
    """
    vocab = target.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch_size, context_length), generator=g).to(target.device)
    verifier = verifier_for(target, head)
    state, _ = verifier.prefill(prompt, None)
    alone = replace(shape, path_conditioning=False, lookup=0)
    return {b: verify_seconds(verifier, state, draft(head, state, alone, b), repeats) for b in budgets}


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
    jetspec_verifier=None,
    **model_kwargs,
):
    """The decoding method `generate` runs for a JetSpec head (passed as its callable `custom_generate`)."""
    head, shape, streamer = jetspec_head, jetspec_shape, jetspec_streamer
    _check_call(input_ids, generation_config, streamer)
    if streamer is not None:  # as in plain `generate`: the prompt first (the streamer was kept from `generate`)
        streamer.put(input_ids.cpu())
    call = _start_call(input_ids, shape, jetspec_verifier, logits_processor, stopping_criteria, generation_config,
                       streamer)
    # the prefill is a forward; a lookup chain may be accepted past the head's depths
    stats = JetSpecStats(target_forwards=1, accepted_at_depth=[0] * max(shape.depth, shape.lookup))
    started = clock()
    state, logits = call.verifier.prefill(input_ids, model_kwargs.get("attention_mask"))
    state = _first_token(call, state, logits_processor(input_ids, logits), logits, generation_config.do_sample, stats)
    controller = None
    if shape.budget == "auto" and state.rows.numel():
        controller = _budget_controller(head, model, shape, state.rows.shape[0])
    while state.rows.numel():
        state = _round(head, call, state, stats, controller)
    stats.total_seconds = clock() - started
    return _finish(head, call, stats, generation_config, input_ids.shape[1])


def _round(head, call: Call, state: RoundState, stats: JetSpecStats, controller) -> RoundState:
    """One round: draft, verify, accept, commit, compact (`docs/design.md`, "§2 The round")."""
    t0 = clock()
    budget = controller.next_budget() if controller is not None else call.shape.budget
    histories = call.histories(state.rows) if call.shape.lookup else None
    trees = draft(head, state, call.shape, budget, histories)
    t1 = clock()
    trees, logits, features = call.verifier.verify(state, trees)
    t2 = clock()
    acc = accept(logits, trees, state.rows, call.choose)
    if controller is not None:
        controller.update(acc.paths(), budget, t1 - t0)
    active = state.rows.shape[0]
    committed, keep = commit(call, state.rows, acc, logits)
    state = call.verifier.compact(state, trees, acc, features, keep)
    stats.add_round(budget, active, acc.count, committed, clock() - t2 + t1 - t0, t2 - t1)
    return state


def _check_call(input_ids, generation_config, streamer):
    batch, prompt_length = input_ids.shape
    if generation_config.num_beams > 1:
        raise ValueError(f"expected num_beams == 1 for tree speculative decoding, got {generation_config.num_beams}")
    if prompt_length == 0:
        raise ValueError("expected a non-empty prompt, got input_ids with 0 tokens")
    if streamer is not None and batch > 1:
        raise ValueError(f"expected batch size 1 with a streamer (as in transformers), got {batch}")


def _start_call(input_ids, shape, verifier, processors, stopping, generation_config, streamer) -> Call:
    """The call's settings and its sequences, holding the prompts and room for every new token."""
    batch, prompt_length = input_ids.shape
    pad = generation_config._pad_token_tensor
    sequences = torch.full(
        (batch, generation_config.max_length), int(pad) if pad is not None else 0, dtype=torch.long,
        device=input_ids.device,
    )
    sequences[:, :prompt_length] = input_ids
    wants_records = generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    )
    call = Call(
        shape=shape, verifier=verifier, sequences=sequences, lengths=[prompt_length] * batch, stopping=stopping,
        streamer=streamer, records=[[] for _ in range(batch)] if wants_records else None,
    )
    if generation_config.do_sample or len(processors):
        call.choose = functools.partial(_choose, _row_processors(processors, batch), generation_config.do_sample, call)
    return call


def _first_token(call: Call, state: RoundState, scores, logits, do_sample: bool, stats: JetSpecStats) -> RoundState:
    """Commit each row's first token, picked from the prefill's processed `scores` `(B, V)` (every row has the same
    length here, so the processors run on the whole batch, as in plain decoding); it becomes the row's anchor."""
    first = _pick(scores, do_sample)  # (B,)
    acc = Acceptance(  # the prefill as a round whose tree is its root alone
        nodes=torch.zeros_like(first)[:, None], tokens=first[:, None], count=torch.ones_like(first),
        scores=[[row] for row in scores],
    )
    committed, keep = commit(call, state.rows, acc, logits[:, None])
    stats.new_tokens += committed
    state = replace(state, anchors=first)
    return select_rows(state, keep) if keep.numel() < first.shape[0] else state


def _finish(head, call: Call, stats: JetSpecStats, generation_config, prompt_length: int):
    if call.streamer is not None:
        call.streamer.end()
    longest = max(call.lengths)
    if generation_config._pad_token_tensor is None and min(call.lengths) != longest:
        raise ValueError("expected a pad_token_id to pad rows that finish early, got none")
    sequences = call.sequences[:, :longest]  # (B, longest); past each row's length: padding, never written
    head.last_stats = stats
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = longest - prompt_length
    return JetSpecGenerateOutput(
        sequences=sequences,
        scores=_per_step(call.records, 0, steps) if generation_config.output_scores else None,
        logits=_per_step(call.records, 1, steps) if generation_config.output_logits else None,
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
        per_target[key] = measure_verify_seconds(target, head, shape, candidates, batch_size=batch)
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


def _with_lookup_branch(children, history: list, shape: TreeShape):
    """A row's children with its prompt-lookup chain: scored by `shape.lookup_prior`, else first."""
    prior = shape.lookup_prior
    chain, order = lookup_match(history, shape.lookup, max_ngram=len(prior) if prior else LOOKUP_MAX_NGRAM)
    logprobs = lookup_logprobs(prior, order, len(chain)) if prior and chain else None
    return with_lookup(children, chain, logprobs)


def _path_conditioned_trees(head, state: RoundState, trees: DraftTrees, marginals: list, shape, budget) -> list:
    """Second draft pass (`docs/design.md`, "§3 Trees and masks"): real tokens at the tree's nodes plus one MASK probe
    under every node.

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
    probe_ent = entropy(logp) if shape.scoring in ENTROPY_SCORINGS else torch.zeros(logp.shape[:2])  # (A, n)
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


def _choose(row_processors: list, do_sample: bool, call: Call, row: int, logits: torch.Tensor, path: list):
    """The target's token after row `row`'s committed tokens plus `path`, as plain `generate` would pick it.

    Returns:
        `(token, scores)`: the token and the processed scores it was picked from, `(V,)`.
    """
    ids = call.sequences[row : row + 1, : call.lengths[row]]
    if path:
        ids = torch.cat([ids, torch.tensor([path], dtype=torch.long, device=ids.device)], dim=1)  # (1, L + len)
    scores = row_processors[row](ids, logits[None].clone())  # (1, V); a copy: processors may write in place
    return int(_pick(scores, do_sample)[0]), scores[0]


def _row_processors(processors, batch: int) -> list:
    """Per batch row, the call's logits processors as they act on that row alone: `(1, L)` tokens, `(1, V)` scores.

    Rows advance by different amounts per round, so each node is processed on its own row. A processor of
    `ROW_WISE_PROCESSORS` runs on the row as it is (cost V per node); a repetition penalty that skips each row's left
    padding gets that row's padding length; any other processor (`prefix_allowed_tokens_fn`'s batch id, per-row
    state of a user's processor) sees the row repeated to the caller's batch size, its layout in plain decoding,
    and row `row` is read back (cost B x V per node: exact for any processor).
    """
    return [LogitsProcessorList([_for_row(p, row, batch) for p in processors]) for row in range(batch)]


def _for_row(processor, row: int, batch: int):
    if isinstance(processor, ROW_WISE_PROCESSORS):
        return processor
    if type(processor) is RepetitionPenaltyLogitsProcessor:
        skip = processor.prompt_ignore_length
        if not isinstance(skip, torch.Tensor):
            return processor
        return RepetitionPenaltyLogitsProcessor(processor.penalty, prompt_ignore_length=skip[row : row + 1])
    return _InBatchLayout(processor, row, batch)


class _InBatchLayout(LogitsProcessor):
    """A processor called on one row `(1, L)` / `(1, V)` repeated to the batch size; row `row` of its output."""

    def __init__(self, processor, row: int, batch: int):
        self.processor, self.row, self.batch = processor, row, batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = self.processor(input_ids.expand(self.batch, -1), scores.repeat(self.batch, 1))  # (B, V)
        return out[self.row : self.row + 1]


def _pick(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """`(B,)` tokens from processed scores `(B, V)`: a sample of their softmax, or their argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
    return scores.argmax(-1)


def float_dtype(model) -> torch.dtype:
    """The floating dtype of a model's activations (float32 for a quantized, integer-typed one)."""
    return model.dtype if model.dtype.is_floating_point else torch.float32


def logits_to_keep(target, count: int) -> dict:
    """`logits_to_keep=count` for a target that takes it (0: every position), else nothing."""
    return {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


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
