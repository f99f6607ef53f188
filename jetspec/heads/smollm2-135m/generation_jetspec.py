"""Lossless tree speculative decoding inside `target.generate` (arXiv 2606.18394, sections 3.2-3.4).

Per round: one head forward drafts per-depth distributions for the block `[anchor, MASK x N]`; a best-first
tree of `budget` nodes is built from them; the target verifies every node in one forward under the
tree-causal mask (position = past length + depth); the walk keeps the deepest path whose tokens equal the
target's own choices and appends the target's next token (the bonus); the target cache keeps only the accepted
nodes; their target hidden states extend the head's context; the bonus token becomes the next anchor.

Lossless: every committed token is the target's own choice (argmax, or a sample of the processed distribution)
given exactly the tokens before it, whatever the head drafts.

Rows of a batch keep their own lengths: the caches are rectangular with holes, and a `(B, S)` validity mask
plus explicit position ids make the holes invisible. Finished rows leave the batch.
"""

import functools
import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .budget import DEFAULT_CANDIDATES, BudgetController, measure_verify_seconds
from .tree import (
    Tree,
    accept_walk,
    ancestor_mask,
    build_tree,
    children_map,
    entropy,
    marginal_children,
    max_tree_nodes,
    verification_mask,
)

TREE_ARGUMENTS = ("tree_depth", "tree_width", "tree_budget", "tree_scoring", "path_conditioning")
MASKABLE_ATTENTION = ("eager", "sdpa")  # take an additive 4D float mask as is


@dataclass
class TreeShape:
    depth: int  # N, maximum depth of a draft node
    width: int  # W, candidates per node
    budget: int | str  # B, draft nodes per tree (root excluded), or "auto" (chosen per round, see `budget.py`)
    scoring: str  # best-first key, see `tree.tree_key`
    path_conditioning: bool  # second draft pass with MASK probes under the tree's real tokens


@dataclass
class JetSpecStats:
    """Statistics of one `generate` call. tau counts committed tokens per verify forward, bonus included."""

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


def resolve_tree_shape(config, **given) -> TreeShape:
    """Tree shape from per-call values, falling back to the head's config; validated."""
    shape = TreeShape(
        depth=given.get("tree_depth") if given.get("tree_depth") is not None else config.tree_depth,
        width=given.get("tree_width") if given.get("tree_width") is not None else config.tree_width,
        budget=given.get("tree_budget") if given.get("tree_budget") is not None else config.tree_budget,
        scoring=given.get("tree_scoring") if given.get("tree_scoring") is not None else config.tree_scoring,
        path_conditioning=(
            given.get("path_conditioning")
            if given.get("path_conditioning") is not None
            else config.path_conditioning
        ),
    )
    if not 1 <= shape.depth <= config.block_size - 1:
        raise ValueError(
            f"expected tree_depth in [1, {config.block_size - 1}] (block_size - 1 of this head), got {shape.depth}"
        )
    if shape.width < 1:
        raise ValueError(f"expected tree_width >= 1, got {shape.width}")
    if shape.budget != "auto" and (not isinstance(shape.budget, int) or shape.budget < 1):
        raise ValueError(f"expected tree_budget >= 1 draft node or 'auto', got {shape.budget!r}")
    if shape.scoring not in ("logprob", "entropy", "mixed"):
        raise ValueError(f"expected tree_scoring 'logprob', 'entropy' or 'mixed', got {shape.scoring!r}")
    return shape


# ------------------------------------------------------------------------------------------------ entry points
def tree_generate(head, target, *args, **kwargs):
    """Route `target.generate(..., assistant_model=head)` to tree decoding; see `JetSpecDraftModel.tree_generate`."""
    kwargs.pop("assistant_model", None)
    given = {name: kwargs.pop(name, None) for name in TREE_ARGUMENTS}
    shape = resolve_tree_shape(head.config, **given)
    streamer = kwargs.pop("streamer", None)
    max_new_tokens = kwargs.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValueError(f"expected max_new_tokens >= 1, got {max_new_tokens}")
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(prompt, torch.Tensor) and (prompt.dim() != 2 or prompt.shape[-1] == 0):
        raise ValueError(f"expected a non-empty prompt of shape (batch, length), got shape {tuple(prompt.shape)}")
    head.attach_target(target)
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
            *args,
            custom_generate=_decode,
            jetspec_head=head,
            jetspec_shape=shape,
            jetspec_streamer=streamer,
            **kwargs,
        )
    finally:
        if switch:
            target.set_attn_implementation(impl)


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
    batch, prompt_length = input_ids.shape
    if generation_config.num_beams > 1:
        raise ValueError(f"expected num_beams == 1 for tree speculative decoding, got {generation_config.num_beams}")
    if prompt_length == 0:
        raise ValueError("expected a non-empty prompt, got input_ids with 0 tokens")
    if streamer is not None and batch > 1:
        raise ValueError(f"expected batch size 1 with a streamer (as in transformers), got {batch}")
    text = target.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    reach = generation_config.max_length + shape.depth + 1
    if window is not None and reach > window:
        raise ValueError(
            f"expected prompt + max_new_tokens + tree depth ({reach}) within the target's sliding window "
            f"({window}); tree verification with a binding sliding window is not supported"
        )
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else 0
    do_sample = generation_config.do_sample
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    device = input_ids.device
    stats = JetSpecStats(accepted_at_depth=[0] * shape.depth)
    started = time.perf_counter()

    attention_mask = model_kwargs.get("attention_mask")
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
    # per-row token buffer: committed tokens up to lengths[r]; room for one tree's worth of tentative tokens
    seq = torch.full((batch, generation_config.max_length + shape.depth + 2), pad_id, dtype=torch.long, device=device)
    seq[:, :prompt_length] = input_ids
    lengths = [prompt_length] * batch
    recorded = [[] for _ in range(batch)]  # per row: (processed scores, raw logits) of each committed token
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def choose(row, node_logits, n_before):
        """Target's token at a node given the row's committed tokens plus `n_before` tentative ones."""
        scores = node_logits.unsqueeze(0)  # (1, V)
        if len(logits_processor):
            scores = _as_row(logits_processor, row, batch, seq[row : row + 1, : lengths[row] + n_before], scores)
        if do_sample:
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1))
        else:
            token = int(scores.argmax(-1))
        seq[row, lengths[row] + n_before] = token
        if want_scores or want_logits:
            recorded[row].append((scores[0], node_logits))
        return token

    def commit(row, count):
        """Advance the row over `count` tentative tokens, stopping exactly where the stopping criteria say."""
        for i in range(count):
            lengths[row] += 1
            if _as_row(stopping_criteria, row, batch, seq[row : row + 1, : lengths[row]], None):
                del recorded[row][lengths[row] - prompt_length :]
                return i + 1, True
        return count, False

    # ---- prefill: the target reads the prompt and chooses the first token
    cache = DynamicCache()
    t0 = time.perf_counter()
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        **_logits_to_keep(target, 1),
    )
    stats.target_forwards += 1
    stats.verify_seconds += time.perf_counter() - t0
    last_logits = out.logits[:, -1].float()  # (B, V)
    finished = [False] * batch
    for row in range(batch):
        choose(row, last_logits[row], 0)
        _, finished[row] = commit(row, 1)
    stats.new_tokens += batch
    if streamer is not None:
        streamer.put(seq[0, prompt_length : prompt_length + 1].cpu())
    t0 = time.perf_counter()
    context = head.extend_context(None, head.target_features(out.hidden_states), positions, valid)
    stats.draft_seconds += time.perf_counter() - t0
    del out

    rows = [r for r in range(batch) if not finished[r]]  # batch rows still decoding
    keep = torch.tensor(rows, dtype=torch.long, device=device)
    if len(rows) < batch:
        cache, valid, context = _select_rows(cache, keep), valid[keep], context.select_rows(keep)
    anchors = seq[keep, prompt_length]  # (A,) last committed token, not yet seen by the target
    anchor_pos = valid.long().sum(-1)  # (A,) its position
    controller = _budget_controller(head, target, shape, len(rows)) if shape.budget == "auto" and rows else None
    greedy_fast = not do_sample and not len(logits_processor) and not (want_scores or want_logits)

    while rows:
        a = len(rows)
        # ---- draft: one head forward over [anchor, MASK x N], then a best-first tree per row
        t0 = time.perf_counter()
        budget = controller.next_budget() if controller is not None else shape.budget
        trees = _draft_trees(head, context, anchors, anchor_pos, shape, budget)
        n = len(trees[0].tokens)
        tokens = torch.tensor([t.tokens for t in trees], dtype=torch.long, device=device)  # (A, n)
        parents = torch.tensor([t.parents for t in trees], dtype=torch.long, device=device)  # (A, n)
        depths = torch.tensor([[0] + t.depths for t in trees], dtype=torch.long, device=device)  # (A, n+1)
        anc = ancestor_mask(parents)  # (A, n+1, n+1)
        draft_seconds = time.perf_counter() - t0
        stats.draft_seconds += draft_seconds
        stats.budgets.append(budget)

        # ---- verify: the target reads root + n nodes under the tree-causal mask
        t0 = time.perf_counter()
        past = valid.shape[1]
        out = target(
            input_ids=torch.cat([anchors[:, None], tokens], dim=1),
            attention_mask=verification_mask(valid, anc, _float_dtype(target)),  # (A, 1, n+1, S+n+1)
            position_ids=anchor_pos[:, None] + depths,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            **_logits_to_keep(target, 0),
        )
        logits = out.logits.float()  # (A, n+1, V)
        stats.target_forwards += 1
        stats.rounds += 1
        stats.row_rounds += a
        stats.verify_seconds += time.perf_counter() - t0

        # ---- accept: walk each row's tree along the target's own choices
        argmax = logits.argmax(-1).tolist() if greedy_fast else None
        walks = []
        for i, row in enumerate(rows):
            kids = children_map(trees[i])
            if greedy_fast:
                start = lengths[row]

                def pick(node, path, i=i, row=row, start=start):
                    token = argmax[i][node]
                    seq[row, start + len(path)] = token
                    return token

            else:

                def pick(node, path, i=i, row=row):
                    return choose(row, logits[i, node], len(path))

            committed, accepted = accept_walk(kids, pick)
            walks.append((committed, accepted))
            depth = len(accepted) - 1
            for d in range(min(depth, shape.depth)):
                stats.accepted_at_depth[d] += 1
        if controller is not None:
            controller.update([acc for _, acc in walks], budget, draft_seconds)

        # ---- compact: the target cache keeps root + accepted nodes; their features extend the head's context
        t0 = time.perf_counter()
        width = max(len(acc) for _, acc in walks)
        kept = torch.zeros(a, width, dtype=torch.long, device=device)
        kept_valid = torch.zeros(a, width, dtype=torch.bool, device=device)
        for i, (_, acc) in enumerate(walks):
            kept[i, : len(acc)] = torch.tensor(acc, device=device)
            kept_valid[i, : len(acc)] = True
        index = torch.cat([torch.arange(past, device=device).expand(a, past), past + kept], dim=1)  # (A, S+K)
        _gather_cache(cache, index)
        valid = torch.cat([valid, kept_valid], dim=1)
        features = head.target_features(out.hidden_states)  # (A, n+1, kH)
        features = features.gather(1, kept[..., None].expand(-1, -1, features.shape[-1]))  # (A, K, kH)
        context = head.extend_context(context, features, anchor_pos[:, None] + depths.gather(1, kept), kept_valid)
        del out
        stats.draft_seconds += time.perf_counter() - t0

        # ---- commit: tokens one by one through the stopping criteria; the bonus token is the next anchor
        still = []
        for i, row in enumerate(rows):
            committed, _ = walks[i]
            start = lengths[row]
            count, done = commit(row, len(committed))
            stats.new_tokens += count
            stats.round_tokens += count
            if streamer is not None:
                streamer.put(seq[row, start : start + count].cpu())
            if not done:
                still.append(i)
                anchors[i] = committed[-1]
                anchor_pos[i] += len(committed)
        if len(still) < a:
            pick_rows = torch.tensor(still, dtype=torch.long, device=device)
            cache = _select_rows(cache, pick_rows)
            valid, context = valid[pick_rows], context.select_rows(pick_rows)
            anchors, anchor_pos = anchors[pick_rows], anchor_pos[pick_rows]
            rows = [rows[i] for i in still]

    if streamer is not None:
        streamer.end()
    longest = max(lengths)
    if pad is None and min(lengths) != longest:
        raise ValueError("expected a pad_token_id to pad rows that finish early, got none")
    sequences = torch.full((batch, longest), pad_id, dtype=torch.long, device=device)
    for row in range(batch):
        sequences[row, : lengths[row]] = seq[row, : lengths[row]]
    stats.total_seconds = time.perf_counter() - started
    head.last_stats = stats
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = longest - prompt_length
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_per_step(recorded, 0, steps, batch) if want_scores else None,
        logits=_per_step(recorded, 1, steps, batch) if want_logits else None,
    )


# ------------------------------------------------------------------------------------------------ pieces
def _budget_controller(head, target, shape: TreeShape, batch: int) -> BudgetController:
    """Verify costs are measured once per (target, device, batch size) and kept on the head."""
    largest = max_tree_nodes(shape.depth, shape.width)
    candidates = sorted({min(b, largest) for b in DEFAULT_CANDIDATES})
    key = (id(target), str(target.device), batch, tuple(candidates))
    costs = head.verify_cost_cache.get(key)
    if costs is None:
        costs = measure_verify_seconds(target, candidates, batch_size=batch)
        head.verify_cost_cache[key] = costs
    return BudgetController(candidates, costs)


def _draft_trees(head, context, anchors, anchor_pos, shape: TreeShape, budget: int) -> list[Tree]:
    """One head forward over `[anchor, MASK x N]` (the full block when bidirectional), a tree per row."""
    a = anchors.shape[0]
    length = shape.depth + 1 if head.config.block_attention == "causal" else head.config.block_size
    block = torch.full((a, length), head.config.mask_token_id, dtype=torch.long, device=anchors.device)
    block[:, 0] = anchors
    offsets = torch.arange(length, device=anchors.device)
    out = head(block, anchor_pos[:, None] + offsets, context=context)
    logp = torch.log_softmax(out.logits[:, 1 : shape.depth + 1], dim=-1)  # (A, N, V)
    top_lp, top_tok = logp.topk(shape.width, dim=-1)  # (A, N, W)
    ent = entropy(logp) if shape.scoring != "logprob" else torch.zeros(logp.shape[:2])  # (A, N)
    trees = [
        build_tree(marginal_children(top_lp[i], top_tok[i], ent[i]), budget, shape.depth, shape.scoring)
        for i in range(a)
    ]
    if shape.path_conditioning:
        trees = _path_conditioned_trees(head, context, anchors, anchor_pos, trees, top_lp, top_tok, ent, shape, budget)
    return trees


def _path_conditioned_trees(head, context, anchors, anchor_pos, trees, top_lp, top_tok, ent, shape, budget):
    """Second draft pass (DESIGN section 3): real tokens at the tree's nodes plus one MASK probe under every node.

    Probe j sits at depth(j) + 1 and sees the context, the anchor, node j's ancestors and node j: its output is
    q(child | the branch's actual tokens). The tree is rebuilt best-first from these conditionals (depth-1
    children come from the first pass, which already conditions on the anchor alone; nodes without a probe fall
    back to the first pass's marginals).
    """
    a, n = anchors.shape[0], len(trees[0].tokens)
    device = anchors.device
    tokens = torch.tensor([t.tokens for t in trees], dtype=torch.long, device=device)  # (A, n)
    parents = torch.tensor([t.parents for t in trees], dtype=torch.long, device=device)
    depths = torch.tensor([t.depths for t in trees], dtype=torch.long, device=device)  # (A, n)
    anc = ancestor_mask(parents)  # (A, n+1, n+1)
    probes = torch.full((a, n), head.config.mask_token_id, dtype=torch.long, device=device)
    inputs = torch.cat([anchors[:, None], tokens, probes], dim=1)  # (A, 1+2n)
    positions = anchor_pos[:, None] + torch.cat([torch.zeros_like(anchors)[:, None], depths, depths + 1], dim=1)
    t = 1 + 2 * n
    inner = torch.zeros(a, t, t, dtype=torch.bool, device=device)
    inner[:, : n + 1, : n + 1] = anc
    inner[:, n + 1 :, : n + 1] = anc[:, 1:]  # probe j sees what node j sees, node j included
    inner[:, n + 1 :, n + 1 :] = torch.eye(n, dtype=torch.bool, device=device)
    ctx = context.valid[:, None, :].expand(a, t, -1)
    mask = torch.cat([ctx, inner], dim=-1)[:, None]  # (A, 1, t, S+t)
    out = head(inputs, positions, attention_mask=mask, context=context)
    logp = torch.log_softmax(out.logits[:, n + 1 :], dim=-1)  # (A, n, V)
    probe_lp, probe_tok = logp.topk(shape.width, dim=-1)
    probe_ent = entropy(logp) if shape.scoring != "logprob" else torch.zeros(logp.shape[:2])
    rebuilt = []
    for i, tree in enumerate(trees):
        marginal = marginal_children(top_lp[i], top_tok[i], ent[i])
        paths, probed = [()], {}
        for j, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            paths.append(paths[parent] + (token,))
            probed[paths[-1]] = (probe_lp[i, j].tolist(), probe_tok[i, j].tolist(), float(probe_ent[i, j]))

        def children(path, probed=probed, marginal=marginal):
            return probed.get(path) or marginal(path)

        rebuilt.append(build_tree(children, budget, shape.depth, shape.scoring))
    return rebuilt


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


def _gather_cache(cache, index: torch.Tensor):
    """Keep, per row, the cache entries at `index` of shape `(B, S')` along the sequence axis."""
    for layer in cache.layers:
        idx = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, idx)
        layer.values = layer.values.gather(2, idx)


def _select_rows(cache, rows: torch.Tensor):
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    return cache


def _per_step(recorded, which: int, steps: int, batch: int):
    """Per generated step, `(B, V)` scores or logits; rows that already finished get zeros."""
    vocab = next(entry[which] for row in recorded for entry in row).shape[-1]
    out = []
    for step in range(steps):
        rows = [rec[step][which] if step < len(rec) else torch.zeros(vocab) for rec in recorded]
        out.append(torch.stack(rows))
    return tuple(out)


# Written as `custom_generate/generate.py` next to a saved head, so that
# `target.generate(..., custom_generate=<head folder or repo>, trust_remote_code=True)` decodes with that head.
CUSTOM_GENERATE_SOURCE = '''"""JetSpec tree speculative decoding as a `custom_generate` recipe.

    target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, max_new_tokens=256)

loads the JetSpec head stored in this repo (once per process) and decodes losslessly with it. Pass
`jetspec_head=<a loaded head>` to reuse a head you already hold.
"""

import sys

from transformers import AutoModel

_HEADS = {}


def _calling_repo():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("custom_generate"), str):
            return frame.f_locals["custom_generate"]
        frame = frame.f_back
    raise ValueError("expected to be called from `generate(..., custom_generate=<repo>)`, got another caller")


def generate(model, *args, jetspec_head=None, **kwargs):
    head = jetspec_head
    if head is None:
        repo = _calling_repo()
        if repo not in _HEADS:
            _HEADS[repo] = AutoModel.from_pretrained(repo, trust_remote_code=True)
        head = _HEADS[repo].to(device=model.device, dtype=model.dtype)
    return head.tree_generate(model, *args, **kwargs)
'''
