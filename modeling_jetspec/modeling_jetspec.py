"""The JetSpec draft head: a causal parallel drafter over fused target features (arXiv 2606.18394, section 3.1;
`docs/design.md`, "§1 The method").

One forward over the block `[anchor, MASK x D]` gives logits for every depth 1..D. Each head layer attends to
the fused target context (extra keys/values, cached across rounds) and to the block itself, causally (JetSpec)
or bidirectionally (the DFlash ablation). The forward also takes any explicit 4D mask over a mix of real tokens
and MASK slots, which lets one forward score MASK probes placed under the real tokens of tree branches.
Embeddings and LM head are the target's: frozen, attached at run time, never part of the head's state dict.

The head's draft vocabulary (its methods, a mixin) is in `draft_vocabulary.py`; the config a new head is sized from,
in `target_config.py`.
"""

import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .checkpoint_formats import (
    check_checkpoint_format,
    check_saved_weights,
    detect_checkpoint_format,
    export_dflash,
    import_checkpoint,
    read_checkpoint_config,
)
from .candidate_generator import dflash_forward
from .configuration_jetspec import JetSpecConfig
from .draft_vocabulary import DraftVocabulary
from .integration import CUSTOM_GENERATE_SOURCE, install_generate_hook, tree_generate
from .columns import Columns
from .layers import JetSpecContext, JetSpecDecoderLayer, JetSpecRotary
from .kept_masks import PastMask
from .target_config import decoder_config, head_fields


@dataclass
class JetSpecOutput(ModelOutput):
    logits: torch.Tensor | None = None  # (B, T, V)
    hidden_states: torch.Tensor | None = None  # (B, T, H), after the final norm


class JetSpecPreTrainedModel(PreTrainedModel):
    config_class = JetSpecConfig
    base_model_prefix = "jetspec"
    supports_gradient_checkpointing = False
    _no_split_modules = ["JetSpecDecoderLayer"]
    # published DFlash checkpoints have no MASK vector: the import installs one (a trained file or zeros)
    _keys_to_ignore_on_load_missing = [r"^mask_embedding$"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, JetSpecDraftModel):
            init.normal_(module.mask_embedding, mean=0.0, std=self.config.initializer_range)


class JetSpecDraftModel(DraftVocabulary, JetSpecPreTrainedModel):
    """JetSpec draft head. Use [`JetSpecDraftModel.from_target`] for a new head sized for a target, and pass it as
    `assistant_model` to the target's `generate` for lossless tree speculative decoding."""

    def __init__(self, config: JetSpecConfig):
        super().__init__(config)
        k = len(config.target_layer_ids)
        self.fc = nn.Linear(k * config.target_hidden_size, config.hidden_size, bias=False)
        self.context_norm = nn.RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(JetSpecDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.rotary = JetSpecRotary(config)
        self.norm = nn.RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        if config.last_context_input:
            self.last_context_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if config.draft_vocab_size < config.vocab_size:
            # EAGLE-3 convention: target id = draft id + d2t[draft id]; saved with the weights
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # (V_draft,)
        else:
            self.d2t = None
        self._draft_lm = None  # (key, weight (V_draft, H), bias) rows of the target's LM head, gathered lazily
        self._target_io = None  # (input embeddings, LM head) of the attached target; deliberately not submodules
        # convenience: JetSpecStats of the latest generate call, host numbers only (no tensor, cache or context
        # outlives the call); the call's own copy is `jetspec_stats` of its output with `return_dict_in_generate=True`,
        # which is the one to read when a head serves several threads
        self.last_stats = None
        # target -> {key: costs} measured for that target: the host costs of tree_budget="auto"'s operating point
        # (`host_costs.operating_point`: host, dtype, batch, budgets, sources) and a hybrid target's verify seconds per
        # mode for tree_verify="auto" (`hybrid.HybridVerifier`); weak, so an entry goes with its target and a new
        # target never inherits a freed one's costs
        self.verify_cost_cache = weakref.WeakKeyDictionary()
        # transformers' DFlash generator's cache -> this head's context in that generation (`dflash_forward`); weak,
        # so a generation's context goes with its cache when the call ends
        self.dflash_contexts = weakref.WeakKeyDictionary()
        self.post_init()

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_target(cls, target: PreTrainedModel, **overrides) -> "JetSpecDraftModel":
        """A new (untrained) head sized for `target`; `overrides` set any [`JetSpecConfig`] field."""
        fields = {**head_fields(target), **overrides}
        head = cls(JetSpecConfig(**fields))
        head.to(device=target.device, dtype=target.dtype)
        head.attach_target(target)
        head._init_output_gain(target)
        return head

    @torch.no_grad()
    def _init_output_gain(self, target: PreTrainedModel):
        """Start the head's final norm at the target's effective final-norm gain.

        The head's output feeds the target's LM head, which expects the per-channel scale of the target's own final
        norm (SmolLM2: gains from -2.1 to 3.3). Learning that scale from 1 at a small learning rate takes thousands
        of steps; `norm(ones) = gain` reads it for any RMSNorm convention (`w * x` or `(1 + w) * x`). Targets whose
        decoder has no final `norm` keep the default.
        """
        final_norm = getattr(target.get_decoder(), "norm", None)
        if not isinstance(final_norm, nn.Module):
            return
        ones = torch.ones(1, 1, self.config.hidden_size, device=self.device, dtype=self.dtype)
        gain = final_norm(ones).reshape(-1)
        if gain.shape == self.norm.weight.shape and torch.isfinite(gain).all():
            self.norm.weight.copy_(gain.to(self.norm.weight.dtype))

    def check_target(self, target: PreTrainedModel):
        """Raise a `ValueError` when `target` is not the kind of model this head was built for."""
        if target.config.is_encoder_decoder:
            raise ValueError(f"expected a decoder-only target, got an encoder-decoder model ({type(target).__name__})")
        text = decoder_config(target)
        for name, want, have in (
            ("hidden size", self.config.target_hidden_size, text.hidden_size),
            ("vocab size", self.config.vocab_size, text.vocab_size),
            ("number of layers", self.config.target_num_hidden_layers, text.num_hidden_layers),
        ):
            if want != have:
                raise ValueError(
                    f"this JetSpec head was built for a target with {name} {want}, got a target with {name} {have}"
                )
        ids, fc_width = self.config.target_layer_ids, self.fc.in_features
        if not ids or not all(0 <= i < text.num_hidden_layers for i in ids):
            raise ValueError(
                f"expected target_layer_ids within [0, {text.num_hidden_layers - 1}] (the target has "
                f"{text.num_hidden_layers} layers), got {ids}"
            )
        if len(ids) * self.config.target_hidden_size != fc_width:
            raise ValueError(
                f"expected {fc_width // self.config.target_hidden_size} target_layer_ids (the head's fc reads "
                f"{fc_width} features), got {len(ids)}: {ids}"
            )
        if self.config.hidden_size != text.hidden_size:
            raise ValueError(
                f"expected the head's hidden_size to equal the target's ({text.hidden_size}) since it reuses the "
                f"target's embeddings and LM head, got {self.config.hidden_size}"
            )

    def attach_target(self, target: PreTrainedModel):
        """Borrow the target's (frozen) input embeddings and LM head. They stay out of the head's state dict."""
        self.check_target(target)
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if lm_head is None:
            raise ValueError(f"expected a target with an LM head, got {type(target).__name__} without one")
        self._target_io = (embed, lm_head)
        self._draft_lm = None
        self.check_draft_vocab()

    @property
    def has_target(self) -> bool:
        """Whether a target's embeddings and LM head are attached ([`attach_target`])."""
        return self._target_io is not None

    def target_input_embeddings(self) -> nn.Module:
        """The attached target's input embeddings (frozen, not part of the head's state dict)."""
        return self._attached()[0]

    def target_lm_head(self) -> nn.Module:
        """The attached target's LM head over the full vocabulary (frozen, not part of the head's state dict)."""
        return self._attached()[1]

    def _attached(self) -> tuple[nn.Module, nn.Module]:
        if self._target_io is None:
            raise ValueError(
                "expected a target attached to the head (call `head.attach_target(target)`, or pass the head to "
                "`target.generate(..., assistant_model=head)`), got none"
            )
        return self._target_io

    # --------------------------------------------------------------------------------------------------- context
    def target_features(self, hidden_states: tuple) -> torch.Tensor:
        """The head's input features: the target layers `config.target_layer_ids` of a forward's `hidden_states`
        ([`stack_target_states`]).

        Returns:
            `torch.Tensor` of shape `(B, S, k * target_hidden_size)`.
        """
        return stack_target_states(hidden_states, self.config.target_layer_ids)

    def extend_context(
        self,
        context: JetSpecContext | None,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        valid: torch.Tensor,
    ) -> JetSpecContext:
        """Project new target features into every layer's context keys/values and append them.

        Args:
            context (`JetSpecContext`, *optional*): the context so far; `None` starts a new one.
            features (`torch.Tensor` of shape `(B, s, k * target_hidden_size)`): from [`target_features`].
            position_ids (`torch.LongTensor` of shape `(B, s)`): their absolute positions.
            valid (`torch.BoolTensor` of shape `(B, s)`): False for padding.
        """
        return self._extend_fused(context, self.fuse(features), position_ids, valid)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Fused context features `(B, s, H)` from raw target features `(B, s, k * target_hidden_size)`."""
        return self.context_norm(self.fc(features.to(self.dtype)))

    def _extend_fused(self, context, fused, position_ids, valid) -> JetSpecContext:
        cos, sin = self.rotary(position_ids, fused.dtype)
        kv = [layer.self_attn.key_values(fused, cos, sin) for layer in self.layers]
        # the last valid new position of each row, or the row's previous `last` when it got none
        s = valid.shape[1]
        index = torch.where(valid, torch.arange(s, device=valid.device), -1).amax(dim=1)  # (B,)
        last = fused[torch.arange(fused.shape[0], device=fused.device), index.clamp_min(0)]  # (B, H)
        if context is not None and context.last is not None:
            last = torch.where((index >= 0)[:, None], last, context.last)
        keys, values = [k for k, _ in kv], [v for _, v in kv]
        if context is None:
            return JetSpecContext.of_columns(*Columns.start([*keys, *values, valid, position_ids]), last)
        return context.extended(keys, values, valid, position_ids, last)  # in place, where its buffers have room

    def block_mask(self, context_valid: torch.Tensor, block_length: int, block_attention: str | None = None):
        """The drafting mask of a block that follows the whole context: `(B, 1, T, S + T)` boolean.

        Every slot sees the valid context; within the block, slot i sees slots <= i (`"causal"`) or all slots.
        `block_attention` defaults to `config.block_attention`.
        """
        b = context_valid.shape[0]
        inner = torch.ones(block_length, block_length, dtype=torch.bool, device=context_valid.device)
        if (block_attention or self.config.block_attention) == "causal":
            inner = inner.tril()
        ctx = context_valid[:, None, None, :].expand(b, 1, block_length, -1)
        return torch.cat([ctx, inner.expand(b, 1, -1, -1)], dim=-1)

    def _default_mask(self, context: JetSpecContext, block_length: int, kind: str):
        """[`block_mask`], or, over a context grown in place without sliding layers, the same mask in additive
        form kept in the context's columns (`kept_masks.py`: a round writes only its new columns, so its cost does
        not grow with the context). Training builds it whole."""
        if context.columns is None or torch.is_grad_enabled() or "sliding_attention" in self.config.layer_types:
            return self.block_mask(context.valid, block_length, kind)
        past = context.columns.masks.setdefault(("draft", kind, self.dtype), PastMask(self.dtype))
        inner = self.block_mask(context.valid[:, :0], block_length, kind)[:, 0]  # (B, T, T)
        return past(context.valid, inner)

    def layer_masks(self, attention_mask, position_ids: torch.Tensor, context: JetSpecContext) -> list:
        """One boolean mask `(B, 1, T, S + T)` per head layer: `attention_mask` (checked), or each layer's
        [`block_mask`] when it is `None`, narrowed to the window for `"sliding_attention"` layers.

        In a sliding layer a slot at position p sees a key at position k only if `p - k < sliding_window` (and, with
        bidirectional block attention, `k - p < sliding_window`).
        """
        config, t = self.config, position_ids.shape[1]
        kinds = config.layer_block_attention or [config.block_attention] * config.num_hidden_layers
        if attention_mask is None:
            defaults = {kind: self._default_mask(context, t, kind) for kind in set(kinds)}
            masks = [defaults[kind] for kind in kinds]
        else:
            expected = (position_ids.shape[0], 1, t, context.valid.shape[1] + t)
            if tuple(attention_mask.shape) != expected:
                raise ValueError(f"expected attention_mask of shape {expected}, got {tuple(attention_mask.shape)}")
            masks = [attention_mask] * config.num_hidden_layers
        if "sliding_attention" not in config.layer_types:
            return masks
        if context.positions is None:
            raise ValueError("expected a context with positions (built by extend_context) for sliding layers, got none")
        keys = torch.cat([context.positions, position_ids], dim=1)  # (B, S + T)
        behind = position_ids[:, None, :, None] - keys[:, None, None, :]  # (B, 1, T, S + T)
        ahead = -behind < config.sliding_window
        behind = behind < config.sliding_window
        return [
            mask if layer == "full_attention" else mask & behind & (ahead if kind == "bidirectional" else True)
            for mask, layer, kind in zip(masks, config.layer_types, kinds)
        ]

    # --------------------------------------------------------------------------------------------------- forward
    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Target embeddings for real tokens, the head's trained MASK vector for `config.mask_id`. `(B, T, H)`.

        With `config.mask_source == "target"` (imported DFlash heads) a MASK is the target's own row of the
        in-vocabulary `mask_token_id`, so every slot is a plain target embedding.
        """
        embed = self.target_input_embeddings()
        if self.config.mask_source == "target":
            return embed(input_ids).to(self.dtype)
        is_mask = input_ids == self.config.mask_id
        real = embed(input_ids.masked_fill(is_mask, 0)).to(self.dtype)
        return torch.where(is_mask.unsqueeze(-1), self.mask_embedding.to(real.dtype), real)

    def draft(
        self,
        input_ids: torch.LongTensor | None,
        position_ids: torch.LongTensor,
        context: JetSpecContext,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> JetSpecOutput:
        r"""Decoding: the head's outputs for slots after a cached `context` (the tree loop, the chain drafter).

        Args:
            input_ids (`torch.LongTensor` of shape `(B, T)`):
                Real tokens and MASK slots (`config.mask_id`) in any arrangement: a block `[anchor, MASK x D]`,
                several packed blocks, or tree nodes with MASK probes under them. `None` with `inputs_embeds`.
            position_ids (`torch.LongTensor` of shape `(B, T)`):
                Absolute positions (the anchor's position is the number of tokens before it).
            context (`JetSpecContext`):
                Cached context keys/values, from [`extend_context`].
            attention_mask (`torch.BoolTensor` of shape `(B, 1, T, S + T)`, *optional*):
                True where query t may attend key s; keys are the S context positions, then the T inputs.
                Defaults to [`block_mask`] (a single block after the whole context).
            inputs_embeds (`torch.Tensor` of shape `(B, T, H)`, *optional*):
                The slots already embedded, instead of `input_ids`.
            return_logits (`bool`, *optional*, defaults to `True`):
                Apply the draft LM head (the target's, restricted to the draft vocabulary when
                `config.draft_vocab_size` is smaller than the vocabulary); otherwise only the normed hidden states
                are returned.
        """
        if (input_ids is None) == (inputs_embeds is None) or position_ids is None or context is None:
            raise ValueError(
                "expected position_ids, a context and exactly one of input_ids / inputs_embeds, got "
                f"input_ids={_shape(input_ids)}, inputs_embeds={_shape(inputs_embeds)}, "
                f"position_ids={_shape(position_ids)}, context={'None' if context is None else 'given'}"
            )
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        if self.config.last_context_input:  # every slot reads the context's last fused position
            x = x + self.last_context_proj(context.last[:, None, :].to(self.dtype))  # (B, 1, H)
        return self._blocks(
            x, position_ids, self.layer_masks(attention_mask, position_ids, context), context, return_logits
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        context_features: torch.Tensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        context_valid: torch.Tensor | None = None,
        last_context_index: torch.LongTensor | None = None,
        return_logits: bool = True,
        **dflash_inputs,
    ) -> JetSpecOutput:
        r"""Training (what the Trainer calls): packed blocks over raw target features, projected on the fly.

        Called with transformers' DFlash keywords (`noise_embeds`, `context_hidden_states`, `past_key_values`), this
        is [`dflash_step`]. Decoding over a cached context is [`draft`].

        Args:
            input_ids (`torch.LongTensor` of shape `(B, T)`): blocks of real tokens and MASK slots.
            position_ids (`torch.LongTensor` of shape `(B, T)`): their absolute positions.
            attention_mask (`torch.BoolTensor` of shape `(B, 1, T, S + T)`, *optional*):
                As in [`draft`]; defaults to [`block_mask`].
            context_features (`torch.Tensor` of shape `(B, S, k * target_hidden_size)`):
                Raw target features ([`stack_target_features`]).
            context_position_ids (`torch.LongTensor` of shape `(B, S)`, *optional*):
                Positions of `context_features`, defaults to `0..S-1`.
            context_valid (`torch.BoolTensor` of shape `(B, S)`, *optional*):
                Validity of `context_features`, defaults to all True.
            last_context_index (`torch.LongTensor` of shape `(B, T)`, *optional*):
                With `config.last_context_input`: the context position whose fused features are added to each input
                slot. Defaults to the context's last valid position for every slot.
            return_logits (`bool`, *optional*, defaults to `True`):
                False leaves the LM head to the caller (the trainer applies it a chunk of slots at a time).
        """
        if dflash_inputs:
            return self.dflash_step(position_ids=position_ids, attention_mask=attention_mask, **dflash_inputs)
        if input_ids is None or position_ids is None:
            raise ValueError(
                f"expected input_ids and position_ids, got input_ids={_shape(input_ids)}, "
                f"position_ids={_shape(position_ids)}"
            )
        fused, context = self._training_context(input_ids, context_features, context_position_ids, context_valid)
        masks = self.layer_masks(attention_mask, position_ids, context)
        x = self.embed(input_ids)
        if self.config.last_context_input:
            x = x + self._last_context(input_ids, context, fused, last_context_index)
        return self._blocks(x, position_ids, masks, context, return_logits)

    def dflash_step(
        self,
        noise_embeds=None,
        context_hidden_states=None,
        position_ids=None,
        attention_mask=None,
        past_key_values=None,
        **unknown,
    ):
        """The head as transformers' own DFlash generator calls it (`speculation_type="dflash"`, generate hook
        uninstalled): see [`candidate_generator.dflash_forward`]. Its context lives in the generator's cache's
        entry of `dflash_contexts`, which goes with that cache at the end of the generation."""
        if unknown or noise_embeds is None:
            raise ValueError(
                "expected either training inputs (context_features) or transformers' DFlash call (noise_embeds, "
                f"context_hidden_states, position_ids, past_key_values), got also {sorted(unknown)}; decode over a "
                "cached context with `head.draft(...)`"
            )
        return dflash_forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask, past_key_values)

    def _blocks(self, x, position_ids, masks, context, return_logits: bool) -> JetSpecOutput:
        """The head's layers over embedded slots `x` `(B, T, H)`, then its norm and (optionally) the draft LM head."""
        cos, sin = self.rotary(position_ids, x.dtype)
        for index, (layer, mask) in enumerate(zip(self.layers, masks)):
            x = layer(x, cos, sin, context, index, mask)
        x = self.norm(x)
        logits = None
        if return_logits:
            weight, bias = self.draft_lm_head()
            logits = F.linear(x.to(weight.dtype), weight, bias).float()  # (B, T, V_draft)
        return JetSpecOutput(logits=logits, hidden_states=x)

    def _training_context(self, input_ids, features, positions, valid) -> tuple[torch.Tensor, JetSpecContext]:
        """`(fused features (B, S, H), context)` of raw target `features` `(B, S, k * target_hidden_size)`."""
        if features is None:
            raise ValueError("expected `context_features` (the target's hidden states), got none")
        b, s, _ = features.shape
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        if valid is None:
            valid = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
        fused = self.fuse(features)  # (B, S, H)
        return fused, self._extend_fused(None, fused, positions, valid)

    def _last_context(self, input_ids, context, fused, last_context_index) -> torch.Tensor:
        """The projected last-context input added to every training slot: `(B, T, H)`, or `(B, 1, H)` by default."""
        if last_context_index is None:
            return self.last_context_proj(context.last[:, None, :].to(self.dtype))  # (B, 1, H)
        if tuple(last_context_index.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"expected last_context_index of shape {tuple(input_ids.shape)}, got {tuple(last_context_index.shape)}"
            )
        last = fused.gather(1, last_context_index[..., None].expand(-1, -1, fused.shape[-1]))  # (B, T, H)
        return self.last_context_proj(last.to(self.dtype))

    # ------------------------------------------------------------------------------------------------ generation
    def tree_generate(self, target: PreTrainedModel, *args, **kwargs):
        """Lossless tree speculative decoding of `target` with this head; same arguments as `target.generate`.

        Extra keyword arguments: `tree_depth`, `tree_width`, `tree_budget`, `tree_scoring`, `path_conditioning`,
        `tree_lookup`, `tree_lookup_prior` (defaults from this head's config; `tree_lookup_prior=False` puts the
        whole prompt-lookup chain first instead of scoring it). With `return_dict_in_generate=True` the output is a
        [`JetSpecGenerateOutput`] whose `jetspec_stats` holds the call's statistics; `self.last_stats` keeps the latest
        call's statistics as a convenience.
        """
        return tree_generate(self, target, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a head saved by [`save_pretrained`], or a published DFlash / JetSpec-reference /
        `muse_glimmer_assistant` head, detected from its `config.json`: its config is converted and its weights are
        loaded by transformers under our names (see `checkpoint_formats.py`). Missing or extra weights are a
        `ValueError` listing them, unless `ignore_mismatched_sizes=True`. For a converted head, keyword
        arguments besides hub and loading options (`dtype`, `device_map`, ...) set [`JetSpecConfig`] fields
        (e.g. `tree_budget=64`)."""
        if kwargs.get("config") is None and pretrained_model_name_or_path is not None:
            foreign = read_checkpoint_config(pretrained_model_name_or_path, kwargs)
            checkpoint_format = "jetspec" if foreign is None else detect_checkpoint_format(foreign)
            if checkpoint_format != "jetspec":

                def load(**options):
                    return super(JetSpecDraftModel, cls).from_pretrained(
                        pretrained_model_name_or_path, *model_args, **options
                    )

                return import_checkpoint(load, pretrained_model_name_or_path, checkpoint_format, foreign, kwargs)
        if kwargs.get("ignore_mismatched_sizes"):
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return_info = kwargs.pop("output_loading_info", False)
        head, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        check_saved_weights(info, pretrained_model_name_or_path)
        return (head, info) if return_info else head

    def save_pretrained(self, save_directory, *args, checkpoint_format: str = "jetspec", **kwargs):
        """Save config, safetensors (head weights only), the flat code files and `custom_generate/`.

        With `push_to_hub=True` the folder is then uploaded by transformers' [`~PreTrainedModel.push_to_hub`]
        (`repo_id` defaults to the folder's name; `token`, `private`, `commit_message` are passed on). With
        `checkpoint_format="dflash"` the folder is the DFlash layout that vLLM, SGLang and the reference loaders read
        (`config.json`, `model.safetensors`, `mask_embedding.pt` for a trained MASK vector; `mask_token_id=` picks
        its in-vocabulary id), no code files.
        """
        check_checkpoint_format(checkpoint_format)
        if checkpoint_format == "dflash":
            return export_dflash(self, save_directory, *args, **kwargs)
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in ("token", "private", "commit_message") if k in kwargs}
        repo_id = kwargs.pop("repo_id", None) or Path(save_directory).name
        kwargs.setdefault("save_original_format", False)  # our names, even for a head imported with key_mapping
        super().save_pretrained(save_directory, *args, **kwargs)
        folder = Path(save_directory) / "custom_generate"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "generate.py").write_text(CUSTOM_GENERATE_SOURCE)
        if push:  # into a fresh folder, so every file (custom_generate/ included) is new and uploaded
            return self.push_to_hub(repo_id, **hub)


def stack_target_states(hidden_states: tuple, layer_ids, final: bool = False) -> torch.Tensor:
    """The selected layers of a target forward's `hidden_states` (index i + 1 is layer i's output; the last entry is
    the final normed state), concatenated on the last axis, then with `final` the final state.

    The head's input features ([`JetSpecDraftModel.target_features`]) and the training feature store's rows (the
    same layers, then the final state) both come from here.

    Args:
        hidden_states (`tuple` of `torch.Tensor` of shape `(..., H)`): a forward's `hidden_states`, embeddings first;
            entries the forward did not return (`output_hidden_states` given as indices) may be `None`.
        layer_ids (`list[int]`): target layers, `0 <= i < len(hidden_states) - 1`.
        final (`bool`, *optional*, defaults to `False`): append the final state.

    Returns:
        `torch.Tensor` of shape `(..., (len(layer_ids) + final) * H)`.
    """
    missing = [i for i in layer_ids if not 0 <= i < len(hidden_states) - 1 or hidden_states[i + 1] is None]
    if missing:
        raise ValueError(
            f"expected hidden states of target layers {list(layer_ids)}, got a forward with "
            f"{len(hidden_states) - 1} layers that returned none for layers {missing}"
        )
    return torch.cat([hidden_states[i + 1] for i in layer_ids] + ([hidden_states[-1]] if final else []), dim=-1)


def _shape(tensor) -> str:
    return "None" if tensor is None else str(tuple(tensor.shape))


JetSpecDraftModel.register_for_auto_class("AutoModel")
install_generate_hook()
