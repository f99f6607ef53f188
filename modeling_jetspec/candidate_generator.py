"""The head inside transformers' own assisted-decoding loop (`GenerationMixin._assisted_decoding`), batch 1, a chain.

Owns two ways in, both lossless because transformers' loop verifies every candidate against the target:

- [`JetSpecCandidateGenerator`], a `transformers.generation.CandidateGenerator`: each round it extends the head's
  context with the target features of the tokens the last verify accepted, drafts `[anchor, MASK x N]` in one head
  forward, and proposes the better of two chains: the head's argmax chain (its reduced draft vocabulary mapped back
  through `d2t`, the last-context input as in the tree loop) and the prompt-lookup continuation, whichever has the
  larger expected accepted length (the head's chain: the sum over depths of the product of its argmax
  probabilities; the lookup chain: the sum of its survival fractions, `tree.lookup_survival` of the head's
  `tree_lookup_prior`).
- [`dflash_forward`]: the head's answer to transformers' own `DFlashTokenCandidateGenerator`
  (`target.generate(..., assistant_model=head, speculation_type="dflash")` with the generate hook uninstalled).
  That generator embeds `[anchor, mask_token_id x (block_size - 1)]` with the target's embeddings and reads
  `last_hidden_state[:, 1:]` through the target's LM head; the head replaces the MASK embeddings by its own MASK
  vector and keeps its context per generator cache.

Trees, batches > 1, sampling with per-node processors and hybrid targets go through the tree loop instead
(`integration.py`): transformers' loop is batch 1 and verifies one chain per target forward. Neither reads the head's
`tree_budget` (a fixed number or `"auto"`): a chain's length is `tree_depth` (or the lookup's), not a node budget.
"""

from __future__ import annotations

import math

import torch
from transformers.generation import CandidateGenerator
from transformers.modeling_outputs import BaseModelOutput

from .compat import assisted_decoding_with
from .steps import draft_block, feature_layers
from .tree import lookup_match, lookup_survival


class JetSpecCandidateGenerator(CandidateGenerator):
    """A JetSpec head as a chain drafter for transformers' assisted decoding (batch 1).

    Args:
        head (`JetSpecDraftModel`): the draft head; it is attached to `target`.
        target (`PreTrainedModel`): the model whose `generate` runs the loop.
        generation_config (`GenerationConfig`): the call's configuration (`max_length`, `do_sample`).
        logits_processor (`LogitsProcessorList`, *optional*): applied to the head's logits slot by slot before a
            token is chosen, as transformers' own generators do.
        depth (`int`, *optional*): candidates per round from the head, defaults to the head's `tree_depth`.
        lookup (`int`, *optional*): longest prompt-lookup chain, defaults to the head's `tree_lookup` (0: none).
    """

    requires_model_outputs = True

    def __init__(
        self,
        head,
        target,
        generation_config,
        logits_processor=None,
        depth: int | None = None,
        lookup: int | None = None,
    ):
        config = head.config
        depth = config.tree_depth if depth is None else depth
        lookup = config.tree_lookup if lookup is None else lookup
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth < config.block_size:
            raise ValueError(
                f"expected depth in [1, {config.block_size - 1}] (the head's block_size - 1), got {depth!r}"
            )
        if not isinstance(lookup, int) or isinstance(lookup, bool) or lookup < 0:
            raise ValueError(f"expected lookup >= 0 tokens, got {lookup!r}")
        head.attach_target(target)
        self.head, self.depth, self.lookup = head, depth, lookup
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        # the target returns only the layers the head reads (index i + 1 is layer i's output)
        self.model_kwargs_overrides = {"output_hidden_states": feature_layers(head)}
        self.context = None  # the head's JetSpecContext: the committed sequence minus its last token
        self.sources = []  # per round: ("head" | "lookup", candidates proposed, candidates accepted)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ):
        """Candidates after `input_ids` (`(1, L)`): `(input_ids + chain, logits of the head's chain or None)`.

        The first call of a generation returns `input_ids` unchanged: transformers' loop then runs the target on
        the prompt, whose features start the head's context on the next call.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"expected a batch of 1 (transformers' assisted decoding), got {input_ids.shape[0]}")
        if is_first_iteration:
            self.context = None
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("expected the target's outputs with hidden_states (requires_model_outputs), got none")
        room = self.max_length - input_ids.shape[1] - 1
        fresh = input_ids.shape[1] - 1 if self.context is None else n_last_matches + 1
        start = 0 if self.context is None else self.context.valid.shape[1]
        features = self.head.target_features(model_outputs.hidden_states)[:, :fresh].to(self.head.device)
        positions = torch.arange(start, start + fresh, device=self.head.device)[None]  # (1, fresh)
        valid = torch.ones_like(positions, dtype=torch.bool)
        self.context = self.head.extend_context(self.context, features, positions, valid)
        if room <= 0:  # only the target's bonus token fits
            self.sources.append(["head", 0, None])
            return input_ids, None
        logits = draft_block(self.head, self.context, input_ids[:, -1], input_ids.shape[1] - 1, self.depth)
        logits = full_vocabulary_logits(self.head, logits[:, : min(self.depth, room)])  # (1, N, V)
        chain, chain_logits = self._head_chain(input_ids, logits)
        source = "head"
        if self.lookup and not self.do_sample:
            found, order = lookup_match(input_ids[0].tolist(), min(self.lookup, room))
            if found and _expected_accepted(self.head.config.tree_lookup_prior, order, len(found)) > _chain_expectation(
                chain_logits, chain
            ):
                chain, chain_logits, source = torch.tensor([found], device=input_ids.device), None, "lookup"
        self.sources.append([source, chain.shape[1], None])
        return torch.cat([input_ids, chain.to(input_ids.device)], dim=-1), chain_logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record how many of the round's candidates the target accepted; the drafting strategy itself is fixed."""
        if self.sources and self.sources[-1][2] is None:
            self.sources[-1][2] = int(num_matches)

    def _head_chain(self, input_ids, logits):
        """The head's chain: argmax (or a sample) per depth, the processors seeing the chain so far."""
        if self.logits_processor is None or len(self.logits_processor) == 0:
            if self.do_sample:
                tokens = torch.multinomial(logits[0].softmax(-1), 1).T  # (1, N)
            else:
                tokens = logits.argmax(-1)  # (1, N)
            return tokens, logits
        logits, ids = logits.clone(), input_ids
        for d in range(logits.shape[1]):
            logits[:, d] = self.logits_processor(ids, logits[:, d])
            pick = torch.multinomial(logits[:, d].softmax(-1), 1) if self.do_sample else logits[:, d].argmax(-1, True)
            ids = torch.cat([ids, pick], dim=-1)
        return ids[:, input_ids.shape[1] :], logits


def full_vocabulary_logits(head, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits `(B, N, V_draft)` spread over the target vocabulary `(B, N, V)`, -inf elsewhere."""
    ids = head.draft_token_ids()
    if ids is None:
        return logits.float()
    full = logits.new_full((*logits.shape[:-1], head.config.vocab_size), float("-inf"), dtype=torch.float32)
    full[..., ids.to(logits.device)] = logits.float()
    return full


def _chain_expectation(logits: torch.Tensor, chain: torch.Tensor) -> float:
    """Expected accepted length of a chain drafted from `logits` `(1, N, V)`: sum over k of prod_{j <= k} p_j."""
    p = logits[0].softmax(-1).gather(-1, chain[0, :, None].to(logits.device)).squeeze(-1)  # (N,)
    return float(p.double().cumprod(0).sum())


def _expected_accepted(prior, order: int, length: int) -> float:
    """Expected accepted length of a lookup chain: its survival fractions ([`tree.lookup_survival`]) summed;
    without a prior it always leads."""
    if prior is None:
        return math.inf
    return float(sum(lookup_survival(prior, order, length)))


def dflash_forward(
    head,
    noise_embeds: torch.Tensor,
    context_hidden_states: torch.Tensor,
    position_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    past_key_values,
):
    """The head's forward as transformers' `DFlashTokenCandidateGenerator` calls it.

    Args:
        noise_embeds (`torch.Tensor` of shape `(1, block_size, H)`): the target's embeddings of the anchor and of
            `mask_token_id` in every other slot; the head uses its own MASK vector there.
        context_hidden_states (`torch.Tensor` of shape `(1, s, k * target_hidden_size)`): the target features of the
            tokens its last forward accepted.
        position_ids (`torch.LongTensor` of shape `(1, s + block_size)`): their positions, then the block's.
        attention_mask (`torch.Tensor` of shape `(1, S + block_size)`, *optional*): 2D mask of the whole sequence;
            only batch 1 without holes is served.
        past_key_values (`DFlashCache`): the generator's cache, used as the key of this generation's context (the
            head keeps context keys/values of its own; the generator's crops of its cache do not touch them).

    Returns:
        `BaseModelOutput` whose `last_hidden_state` `(1, block_size, H)` the generator projects with the target's
        LM head.
    """
    if noise_embeds.shape[0] != 1:
        raise ValueError(f"expected a batch of 1 in transformers' DFlash loop, got {noise_embeds.shape[0]}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("expected an attention_mask without padding in transformers' DFlash loop, got zeros in it")
    if past_key_values is None:
        raise ValueError("expected the DFlash generator's cache as past_key_values, got None")
    block, fresh = noise_embeds.shape[1], context_hidden_states.shape[1]
    if position_ids.shape[-1] != fresh + block:
        raise ValueError(f"expected {fresh + block} position ids (context then block), got {position_ids.shape[-1]}")
    positions = position_ids.reshape(1, -1)
    context = head.dflash_contexts.get(past_key_values)
    context = head.extend_context(
        context, context_hidden_states, positions[:, :fresh], torch.ones_like(positions[:, :fresh], dtype=torch.bool)
    )
    head.dflash_contexts[past_key_values] = context
    embeds = noise_embeds.to(head.dtype)
    if head.config.mask_source == "head":  # slots 1.. are MASK: the head's trained vector, not the target's row
        embeds = torch.cat([embeds[:, :1], head.mask_embedding.to(embeds.dtype).expand(1, block - 1, -1)], dim=1)
    out = head.draft(None, positions[:, fresh:], context, inputs_embeds=embeds, return_logits=False)
    return BaseModelOutput(last_hidden_state=out.hidden_states)


def chain_generate(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    jetspec_head=None,
    jetspec_depth=None,
    jetspec_lookup=None,
    **model_kwargs,
):
    """A `custom_generate` callable running transformers' own `_assisted_decoding` with [`JetSpecCandidateGenerator`].

    `target.generate(**inputs, custom_generate=chain_generate, jetspec_head=head)` decodes exactly as
    `target.generate(**inputs)` (batch 1; transformers' loop verifies every candidate), drafting with `head`.
    `jetspec_depth` / `jetspec_lookup` override the head's `tree_depth` / `tree_lookup`. The generator of the latest
    call is left on `head.last_candidate_generator` (its `sources` say which chain each round proposed and how many
    of its tokens were accepted); its context (the head's keys/values) is released when the call ends.
    """
    if jetspec_head is None:
        raise ValueError("expected jetspec_head=<a JetSpecDraftModel> with custom_generate=chain_generate, got none")
    generator = JetSpecCandidateGenerator(
        jetspec_head, model, generation_config, logits_processor, depth=jetspec_depth, lookup=jetspec_lookup
    )
    jetspec_head.last_candidate_generator = generator
    try:
        return assisted_decoding_with(
            model,
            generator,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus,
            streamer,
            **model_kwargs,
        )
    finally:
        generator.context = None  # the head's keys/values of this call go with it; `sources` stay to read
