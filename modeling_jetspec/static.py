"""The static path (opt-in): fixed shapes every round, so the verify forward and the draft can be compiled.

`target.generate(..., assistant_model=head, jetspec_static="eager" | "compile")`, or `cache_implementation="static"`
(compiled where plain `generate` would compile a static cache's forward: see [`resolve_static`]), runs the same
rounds as the default path (`decode._round`: draft, verify, accept, commit, compact) through [`StaticVerifier`]:

- the target's cache is a transformers `StaticCache` of `length` columns, allocated once per call. Every row shares
  the column layout of the default path (the prompt, then per round the accepted nodes of the row that accepted the
  most, holes masked through a `(B, length)` validity buffer and explicit position ids); only the number of columns
  in use (`past`) moves. A verify writes its `n + 1` nodes at columns `past ..` (each layer's write position is set
  on the device), compaction moves the accepted nodes' entries into place with a gather and an indexed write;
  nothing is concatenated or cropped. When the columns run out, the holes are squeezed out of every row at once
  ([`StaticVerifier.repack`]);
- every tree is padded to a fixed node count ([`StaticVerifier.nodes`]): a padded node's token is -1 for acceptance
  (it matches no choice of the target, so it is never accepted; the forward reads token 0 there) and it sees only
  the root and itself;
- finished rows stay in the buffers: they are verified on a tree of padded nodes and their new columns are marked
  invalid; the round's steps still see only the active rows (`state.rows`), so acceptance, commits and stops are
  the default path's own;
- the head's context lives in buffers of the same columns (keys/values per head layer, validity, positions), so the
  draft reads the same shapes every round.

Compiled (`"compile"`), [`verify_forward`] and [`draft_forward`] run through `torch.compile` (`dynamic=False`;
`mode="reduce-overhead"`, CUDA graphs, on CUDA; a `compile_config` in the generation config overrides). The
cache length is rounded up to a multiple of `LENGTH_BUCKET`, so calls of nearby lengths share a compiled graph.

A `tree_budget="auto"` call (a head whose config says so, or the call's argument) picks its operating point, one
budget and draft sources for the whole call (`host_costs.operating_point`), in [`static_decode`] once the batch is
known and before the buffers are sized, so its node count is fixed per call as on any other budget. The costs it
weighs are the default path's, cached per host (`host_costs.py`): both paths choose the same point.

Refused on this path, by name: `path_conditioning=True` (its second draft pass has another shape), targets with
recurrent or convolution layers, sliding-window targets (a static sliding layer keeps a ring of the window, not the
columns the tree loop moves).
"""

import copy
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from .compat import compile_all_devices, mark_static_address
from .continuations import MAX_OCCURRENCES, RowIndexes
from .decode import _decode
from .host_costs import operating_point
from .layers import JetSpecContext
from .state import Acceptance, DraftTrees, TreeShape
from .compaction import gather_nodes
from .steps import (
    draft_block,
    draft_trees,
    feature_layers,
    float_dtype,
    logits_to_keep,
    prefill,
)
from .tree import ancestor_mask, max_tree_nodes
from .verifiers import TreeVerifier, verify_windows

STATIC_MODES = ("eager", "compile")
LENGTH_BUCKET = 128  # the cache length is rounded up to a multiple of this (fewer compiled shapes)
AUTO_COMPILE_DEVICES = ("cuda", "xpu", "neuron", "tpu")  # where plain `generate` compiles a static cache's forward
PAD_TOKEN = -1  # a padded node's token for acceptance: no target choice equals it


def resolve_static(kwargs: dict) -> str | None:
    """The static mode a `generate` call asks for, its arguments removed from `kwargs` (the tree loop keeps its own
    cache, so `generate` must not build one): `None` (the default path), `"eager"`, `"compile"`, or `"auto"`
    (`cache_implementation="static"` alone: compiled where plain `generate` would compile, see [`compile_mode`]).

    `jetspec_static`: `None` / `False` (the default path), `"eager"`, `"compile"`, or `True` (`"compile"`).
    """
    given = kwargs.pop("jetspec_static", None)
    if given is not None and not isinstance(given, bool) and given not in STATIC_MODES:
        raise ValueError(f"expected jetspec_static in (None, False, True, 'eager', 'compile'), got {given!r}")
    config = kwargs.get("generation_config")
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    if implementation != "static":
        return None if given in (None, False) else ("compile" if given is True else given)
    if given is False:
        raise ValueError("expected jetspec_static unset (or not False) with cache_implementation='static', got False")
    kwargs.pop("cache_implementation", None)
    if config is not None and config.cache_implementation == "static":
        kwargs["generation_config"] = copy.deepcopy(config)
        kwargs["generation_config"].cache_implementation = None
    return "auto" if given is None else ("compile" if given is True else given)


def compile_mode(mode: str, device: torch.device, generation_config) -> bool:
    """Whether a call of static `mode` compiles: `"compile"` always, `"eager"` never, `"auto"` as plain `generate`
    compiles a static cache's forward (not with `disable_compile`; on an accelerator, or anywhere with a
    `compile_config` whose `_compile_all_devices` is set)."""
    if mode != "auto":
        return mode == "compile"
    if generation_config.disable_compile:
        return False
    config = generation_config.compile_config
    return device.type in AUTO_COMPILE_DEVICES or bool(config is not None and compile_all_devices(config))


def compile_options(device: torch.device, config=None) -> dict:
    """`torch.compile` options: those of `config` (a `CompileConfig`, the generation config's), else `dynamic=False`
    and, on CUDA, `mode="reduce-overhead"` (CUDA graphs)."""
    if config is not None:
        return config.to_dict()
    return {"dynamic": False, "mode": "reduce-overhead" if device.type == "cuda" else None}


def static_verifier(target, head, shape: TreeShape, verifier, mode: str, answers: bool = False) -> "StaticVerifier":
    """The call's [`StaticVerifier`]; refuses, before any work, what the static path cannot run."""
    if not isinstance(verifier, TreeVerifier):
        raise ValueError(
            f"expected a target whose layers all cache attention keys/values on the static path (jetspec_static / "
            f"cache_implementation='static'), got {type(target).__name__} (recurrent or convolution layers)"
        )
    if verify_windows(target) is not None:
        raise ValueError(
            f"expected a target without sliding-window layers on the static path, got {type(target).__name__} with "
            "sliding_window: a static sliding layer keeps a ring of the window, not the tree loop's columns"
        )
    if shape.path_conditioning:
        raise ValueError(
            "expected path_conditioning=False on the static path (its second draft pass has another shape), got True"
        )
    return StaticVerifier(target, head, shape, mode, answers)


def static_decode(
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
    jetspec_round_hook=None,
    jetspec_answer_cache=None,
    jetspec_rows=None,
    **model_kwargs,
):
    """`decode._decode` once the static verifier knows the call's batch, lengths, compile settings (what `generate`
    has prepared by now) and tree: a `tree_budget="auto"` call's operating point is chosen here, for this batch, and
    recorded in the call's statistics (`JetSpecStats.operating_point`) as on the default path."""
    shape, point = jetspec_shape, None
    if shape.budget == "auto":  # the static path's verifier is always a `TreeVerifier`: tree_verify "auto"
        shape, point = operating_point(jetspec_head, model, shape, input_ids.shape[0])
    jetspec_verifier.plan(input_ids.shape[0], generation_config, shape)
    return _decode(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus,
        jetspec_head=jetspec_head,
        jetspec_shape=shape,
        jetspec_streamer=jetspec_streamer,
        jetspec_verifier=jetspec_verifier,
        jetspec_round_hook=jetspec_round_hook,
        jetspec_answer_cache=jetspec_answer_cache,
        jetspec_rows=jetspec_rows,  # its rows leave with their answers; none joins (`admission.admission_for`)
        jetspec_point=point,  # recorded from the call's start, as on the default path
        **model_kwargs,
    )


@dataclass
class StaticState:
    """The round state of the static path. `rows` are the active batch rows (also their slots in the buffers,
    which hold every row of the call); the other tensors are buffers of all B rows, written in place."""

    rows: torch.Tensor  # (A,) long, the active batch rows
    anchors: torch.Tensor  # (B,) long, each row's last committed token (stale for a finished row)
    anchor_pos: torch.Tensor  # (B,) long, its position id
    past: int  # columns in use
    cache: StaticCache  # the target's keys/values, (B, H_kv, length, D) per layer
    valid: torch.Tensor  # (B, length) bool, False for padding, holes and columns >= past
    positions: torch.Tensor  # (B, length) long, position id of every column
    context: JetSpecContext  # the head's context: keys/values (B, H_kv, length, D) per head layer, the same columns


_COMPILED = {}  # (function, options) -> its torch.compile'd form, shared by every call of the process


def _compiled(fn, options: dict):
    key = (fn.__name__, repr(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]


def verify_forward(target, head, cache: StaticCache, input_ids, position_ids, ancestors, valid, past, keep: dict):
    """The target reads root + nodes `(B, T)` at columns `past ..` of a static `cache`, under the tree mask.

    Args:
        ancestors (`torch.BoolTensor` of shape `(B, T, T)`): node i sees node j.
        valid (`torch.BoolTensor` of shape `(B, length)`): the columns each row may see (read below `past`).
        past (`torch.LongTensor` of shape `()`): the columns in use, on the device.
        keep (`dict`): `steps.logits_to_keep(target, 0)`, read outside the compiled function: compiled, the lookup
            guarded on its per-target cache's keys, which a collected target removes (an `IndexError` while dynamo
            built its guards, seen when other tests' targets were collected).

    Returns:
        `(logits (B, T, V), features (B, T, k * H))`, as `steps.verify`.
    """
    for layer in cache.layers:  # every layer writes the nodes at `past ..`
        layer.cumulative_length.copy_(past)
    b, t = input_ids.shape
    length = valid.shape[1]
    column = torch.arange(length, device=valid.device) - past  # (length,), a node's index from `past` on
    in_tree = (column >= 0) & (column < t)
    tree = ancestors.gather(2, column.clamp(0, t - 1).expand(b, t, length))  # (B, T, length)
    allowed = torch.where(in_tree, tree, valid[:, None, :] & (column < 0))
    dtype = float_dtype(target)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(~allowed, torch.finfo(dtype).min)
    out = target(
        input_ids=input_ids,
        attention_mask=mask[:, None],
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=feature_layers(head),
        **keep,
    )
    return out.logits, head.target_features(out.hidden_states)


def draft_forward(head, anchors, anchor_pos, keys: list, values: list, valid, last, positions, depth: int):
    """The head's logits at depths 1..`depth` after every row's anchor, over the context buffers:
    `(B, depth, V_draft)` (`steps.draft_block`)."""
    context = JetSpecContext(keys, values, valid, last, positions)
    return draft_block(head, context, anchors, anchor_pos[:, None], depth)


def tree_nodes(shape: TreeShape, answers: bool = False) -> int:
    """The most draft nodes a tree of `shape` (a fixed budget) can have: its budget, at most a full tree plus the
    model-free branch (a chain, or every occurrence's continuation for the trie) and, with an answer cache
    (`answers`), its trie."""
    extra = shape.lookup * (1 if shape.lookup_branches == "chain" else MAX_OCCURRENCES)
    extra += shape.lookup * MAX_OCCURRENCES if answers else 0
    return min(shape.budget, max_tree_nodes(shape.depth, shape.width) + extra)


class StaticVerifier:
    """The [`Verifier`] of the static path (see the module's docstring), and its drafter (`decode._round` drafts
    through a verifier's `draft` where it has one) and row selection (`decode._first_token`)."""

    def __init__(self, target, head, shape: TreeShape, mode: str, answers: bool = False):
        self.target, self.head, self.shape, self.mode = target, head, shape, mode
        self.target_forwards = 0
        self.repacks = 0  # times the holes were squeezed out ([`repack`])
        self.answers = answers  # an answer cache's trie may join each tree (`answer_cache.py`)
        self.nodes = None if shape.budget == "auto" else tree_nodes(shape, answers)  # "auto": set by [`plan`]
        self.batch = self.length = None
        self.compiled, self.options = False, {}
        self._round = None  # (depths (B, n + 1), features (B, n + 1, kH)) of the last verify, all rows

    # ----------------------------------------------------------------------------------------------- setup
    def plan(self, batch: int, generation_config, shape: TreeShape | None = None):
        """The call's batch, cache length (`max_length` plus one verify, rounded up to `LENGTH_BUCKET`), compile
        settings and, where given, its `shape` at a fixed budget (a `tree_budget="auto"` call's operating point)."""
        self.shape = shape if shape is not None else self.shape
        if self.shape.budget == "auto":
            raise ValueError("expected the call's tree at its operating point on the static path, got budget 'auto'")
        self.nodes = tree_nodes(self.shape, self.answers)
        self.batch = batch
        needed = generation_config.max_length + self.nodes + 1
        self.length = -(-needed // LENGTH_BUCKET) * LENGTH_BUCKET
        device = self.target.device
        self.compiled = compile_mode(self.mode, device, generation_config)
        self.options = compile_options(device, generation_config.compile_config) if self.compiled else {}
        self._graphs = (
            self.compiled and device.type == "cuda" and self.options.get("mode") in ("reduce-overhead", "max-autotune")
        )
        self._verify = _compiled(verify_forward, self.options) if self.compiled else verify_forward
        self._draft = _compiled(draft_forward, self.options) if self.compiled else draft_forward

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, before_context=None):
        """`steps.prefill` into a `StaticCache`; the head's context copied into buffers of the same columns."""
        b, prompt = input_ids.shape
        if self.length is None or b != self.batch:
            raise ValueError(f"expected a planned batch of {self.batch} rows on the static path, got {b}")
        cache = StaticCache(config=self.target.config, max_cache_len=self.length)
        state, logits = prefill(self.head, self.target, input_ids, attention_mask, cache, before_context)
        self.target_forwards += 1
        kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
        if kinds:
            raise ValueError(f"expected a static cache of StaticLayer layers on the static path, got {kinds}")
        device = input_ids.device
        valid = torch.zeros(b, self.length, dtype=torch.bool, device=device)
        positions = torch.zeros(b, self.length, dtype=torch.long, device=device)
        valid[:, :prompt], positions[:, :prompt] = state.valid, state.positions

        def buffer(part):  # (B, H, prompt, D) -> (B, H, length, D)
            full = part.new_zeros(*part.shape[:2], self.length, part.shape[-1])
            full[:, :, :prompt] = part
            return full

        ctx = state.context
        context = JetSpecContext(
            [buffer(k) for k in ctx.keys], [buffer(v) for v in ctx.values], valid, ctx.last.clone(), positions
        )
        self._past = torch.zeros((), dtype=torch.long, device=device)
        if self.compiled:  # fixed addresses: compiled graphs (CUDA graphs) read them in place
            for tensor in (*context.keys, *context.values, valid, positions, context.last, self._past):
                mark_static_address(tensor)
        # the buffers a finished row's padded tree reads: every node a padded node
        self._pad = self._pad_trees(b, device)
        return StaticState(
            rows=state.rows,
            anchors=state.anchors.clone(),
            anchor_pos=state.anchor_pos.clone(),
            past=prompt,
            cache=cache,
            valid=valid,
            positions=positions,
            context=context,
        ), logits

    def _pad_trees(self, rows: int, device) -> DraftTrees:
        n = self.nodes
        parents = torch.zeros(rows, n, dtype=torch.long, device=device)
        depths = torch.ones(rows, n + 1, dtype=torch.long, device=device)
        depths[:, 0] = 0
        return DraftTrees(
            tokens=torch.full((rows, n), PAD_TOKEN, dtype=torch.long, device=device),
            parents=parents,
            depths=depths,
            ancestors=ancestor_mask(parents),
            budget=self.shape.budget,
        )

    # ----------------------------------------------------------------------------------------------- the round
    def draft(
        self,
        head,
        state: StaticState,
        shape: TreeShape,
        budget: int,
        histories: dict | None = None,
        record=None,
        indexes: RowIndexes | None = None,
        mark=None,
    ) -> DraftTrees:
        """`steps.draft` over the buffers: one head forward for every row, finished rows included, then the active
        rows' trees as `steps.draft` builds them (`steps.draft_trees`), each padded to [`nodes`]; `mark` is
        called once the head's forward is queued, as in `steps.draft`."""
        ctx = state.context
        self._step()
        logits = self._draft(
            head, state.anchors, state.anchor_pos, ctx.keys, ctx.values, ctx.valid, ctx.last, ctx.positions, shape.depth
        )  # (B, depth, V_draft)
        if mark is not None:
            mark()
        if state.rows.shape[0] < self.batch:
            logits = logits[state.rows]
        trees, _, branches, head_tokens, answers = draft_trees(head, logits, shape, budget, histories, record, indexes)
        padded = self._padded(trees, state.anchors.device)
        padded.branches, padded.head_tokens, padded.answers = branches, head_tokens, answers
        return padded

    def _padded(self, trees: list, device) -> DraftTrees:
        """The trees as tensors of [`nodes`] nodes each: padded nodes hang from the root, token -1."""
        n = self.nodes
        if any(len(t.tokens) > n or not t.tokens for t in trees):
            raise ValueError(f"expected 1 to {n} draft nodes per tree, got sizes {[len(t.tokens) for t in trees]}")
        extra = [n - len(t.tokens) for t in trees]
        parents = torch.tensor([t.parents + [0] * e for t, e in zip(trees, extra)], dtype=torch.long, device=device)
        return DraftTrees(
            tokens=torch.tensor(
                [t.tokens + [PAD_TOKEN] * e for t, e in zip(trees, extra)], dtype=torch.long, device=device
            ),
            parents=parents,
            depths=torch.tensor(
                [[0] + t.depths + [1] * e for t, e in zip(trees, extra)], dtype=torch.long, device=device
            ),
            ancestors=ancestor_mask(parents),
            budget=self.shape.budget,
            host=trees,
            sizes=[len(t.tokens) for t in trees],
        )

    def verify(self, state: StaticState, trees: DraftTrees):
        """One forward over every row's tree (a finished row's: padded nodes) at columns `past ..`; returns the
        active rows' trees, logits and features."""
        rows, everyone = state.rows, state.rows.shape[0] == self.batch
        full = trees if everyone else self._scatter(trees, rows)
        input_ids = torch.cat([state.anchors[:, None], full.tokens.clamp(min=0)], dim=1)  # (B, n + 1)
        position_ids = state.anchor_pos[:, None] + full.depths
        self._past.fill_(state.past)
        self._step()
        logits, features = self._verify(
            self.target,
            self.head,
            state.cache,
            input_ids,
            position_ids,
            full.ancestors,
            state.valid,
            self._past,
            logits_to_keep(self.target, 0),
        )
        if self._graphs:  # a CUDA graph's outputs are overwritten by its next replay
            logits, features = logits.clone(), features.clone()
        self.target_forwards += 1
        self._round = (full.depths, features)
        if not everyone:
            logits, features = logits[rows], features[rows]
        return trees, logits, features

    def _scatter(self, trees: DraftTrees, rows: torch.Tensor) -> DraftTrees:
        pad = self._pad
        fields = {}
        for name in ("tokens", "parents", "depths", "ancestors"):
            whole = getattr(pad, name).clone()
            whole[rows] = getattr(trees, name)
            fields[name] = whole
        return DraftTrees(budget=trees.budget, **fields)

    def compact(
        self, state: StaticState, trees: DraftTrees, acc: Acceptance, features: torch.Tensor, keep: torch.Tensor
    ) -> StaticState:
        """The accepted nodes' keys/values move into columns `past ..` of every row (gather, indexed write), the
        head's context gets their features in the same columns, and the bonus tokens become the anchors; finished
        rows get invalid columns and leave `rows`, not the buffers."""
        depths, features = self._round
        rows, past, k = state.rows, state.past, acc.nodes.shape[1]
        t = depths.shape[1]
        if rows.shape[0] == self.batch:
            nodes, count = acc.nodes, acc.count
        else:
            nodes = acc.nodes.new_zeros(self.batch, k).index_copy_(0, rows, acc.nodes)
            count = acc.count.new_zeros(self.batch).index_copy_(0, rows, acc.count)
        for layer in state.cache.layers:
            for entries in (layer.keys, layer.values):
                entries[:, :, past : past + k] = gather_nodes(entries[:, :, past : past + t], nodes)
        kept = torch.arange(k, device=count.device) < count[:, None]  # (B, K), False: a hole or a finished row
        positions = state.anchor_pos[:, None] + depths.gather(1, nodes)  # (B, K)
        accepted = features.gather(1, nodes[..., None].expand(-1, -1, features.shape[-1]))  # (B, K, kH)
        new = self.head.extend_context(None, accepted, positions, kept)
        ctx = state.context
        for old, part in zip((*ctx.keys, *ctx.values), (*new.keys, *new.values)):
            old[:, :, past : past + k] = part
        ctx.last.copy_(torch.where(kept.any(-1)[:, None], new.last, ctx.last))
        state.valid[:, past : past + k] = kept
        state.positions[:, past : past + k] = positions
        state.anchors.index_copy_(0, rows, acc.tokens.gather(1, (acc.count - 1)[:, None])[:, 0])  # the bonus token
        state.anchor_pos.index_add_(0, rows, acc.count)
        state = replace(state, rows=rows[keep], past=past + k)
        if state.past + self.nodes + 1 > self.length and state.rows.numel():
            state = self.repack(state)
        return state

    def repack(self, state: StaticState) -> StaticState:
        """Squeeze the holes out: every row's valid columns move to its front, in order (one read: how many the
        fullest row keeps). Attention reads positions, not columns, so nothing else changes."""
        past = state.past
        valid = state.valid[:, :past]
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices  # valid columns first
        kept = int(valid.sum(-1).max())
        index = order[:, :kept]  # (B, kept)
        buffers = [entries for layer in state.cache.layers for entries in (layer.keys, layer.values)]
        for entries in (*buffers, *state.context.keys, *state.context.values):
            entries[:, :, :kept] = entries[:, :, :past].gather(
                2, index[:, None, :, None].expand(-1, entries.shape[1], -1, entries.shape[-1])
            )
        state.positions[:, :kept] = state.positions[:, :past].gather(1, index)
        state.valid[:, :kept] = valid.gather(1, index)
        state.valid[:, kept:] = False
        self.repacks += 1
        if kept + self.nodes + 1 > self.length:
            raise RuntimeError(f"static cache of {self.length} columns full after a repack ({kept} kept)")
        return replace(state, past=kept)

    def select_rows(self, state: StaticState, keep: torch.Tensor) -> StaticState:
        """The rows `keep` of the active rows; the buffers keep every row."""
        return replace(state, rows=state.rows[keep])

    def discard(self, state: StaticState, trees: DraftTrees):
        """Nothing to undo: a verify writes only at columns >= `past`, which the next one overwrites."""

    def _step(self):
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
