"""Configuration of the JetSpec draft head (arXiv 2606.18394, section 3.1; `docs/design.md`, "§1 The method")."""

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig

from .budget import check_tau_by_budget
from .calibration import check_calibration
from .tree import check_lookup_prior, check_tree_shape

BLOCK_ATTENTIONS = ("causal", "bidirectional")
MASK_SOURCES = ("head", "target")
LAYER_TYPES = ("full_attention", "sliding_attention")
# field kinds checked by name before anything is derived from them (`check_field_types`)
POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "target_num_hidden_layers",
    "block_size",
)
OPTIONAL_POSITIVE_INTS = (
    "head_dim",
    "max_position_embeddings",
    "target_hidden_size",
    "draft_vocab_size",
    "sliding_window",
)
OPTIONAL_INTS = ("mask_token_id", "dflash_mask_token_id", "tree_depth")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
BOOLS = ("path_conditioning", "last_context_input")
OPTIONAL_STRING_LISTS = ("layer_types", "layer_block_attention")


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Evenly spaced target layers whose hidden states feed the head.

    Follows the paper's choice for Qwen3-8B (layers 1, 9, 17, 25, 33 of 36): from layer 1 to layer
    `num_target_layers - 3`, `num_features` ids. Shallow targets use every layer they have, up to `num_features`.
    """
    if num_target_layers < 1:
        raise ValueError(f"expected a target with at least one layer, got num_target_layers={num_target_layers}")
    first, last = 1, num_target_layers - 3
    if last - first + 1 < num_features:
        count = min(num_features, num_target_layers)
        step = (num_target_layers - 1) / max(count - 1, 1)
        return sorted({round(i * step) for i in range(count)})
    step = (last - first) / (num_features - 1)
    return [round(first + i * step) for i in range(num_features)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_field_types(fields: dict):
    """Raise a `ValueError` naming the first field of `fields` (config field name -> value; names it does not check
    are ignored) of the wrong type or out of its range; checks that relate several fields come later
    (`JetSpecConfig._validate`)."""

    def refuse(name, expected):
        raise ValueError(f"expected {name} to be {expected}, got {fields[name]!r}")

    for name in POSITIVE_INTS:
        if not (_is_int(fields[name]) and fields[name] >= 1):
            refuse(name, "a positive int")
    for name in OPTIONAL_POSITIVE_INTS:
        if fields[name] is not None and not (_is_int(fields[name]) and fields[name] >= 1):
            refuse(name, "a positive int or None")
    for name in OPTIONAL_INTS:
        if fields[name] is not None and not _is_int(fields[name]):
            refuse(name, "an int or None")
    for name in POSITIVE_NUMBERS:
        if not (_is_number(fields[name]) and fields[name] > 0):
            refuse(name, "a positive number")
    check_tau_by_budget(fields["tau_by_budget"])  # kept as given; `budget.check_tau_by_budget` reads it
    if not (_is_number(fields["initializer_range"]) and fields["initializer_range"] >= 0):
        refuse("initializer_range", "a number >= 0")
    for name in BOOLS:
        if not isinstance(fields[name], bool):
            refuse(name, "a bool (true or false)")
    if fields["rope_parameters"] is not None and not isinstance(fields["rope_parameters"], dict):
        refuse("rope_parameters", "a dict or None")
    ids = fields["target_layer_ids"]
    if ids is not None and not (isinstance(ids, (list, tuple)) and all(_is_int(i) for i in ids)):
        refuse("target_layer_ids", "a list of ints or None")
    for name in OPTIONAL_STRING_LISTS:
        value = fields[name]
        if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            refuse(name, "a list of strings or None")


# The tree settings, named once: a head's config holds their defaults, a `generate` call may override each
# (`integration.tree_generate`), `state.resolve_tree_shape` reads them into a `TreeShape`, and a benchmark records the
# head's (`jetspec/bench.py`).
TREE_FIELDS = (
    "tree_depth",
    "tree_width",
    "tree_budget",
    "tree_scoring",
    "path_conditioning",
    "tree_lookup",
    "tree_lookup_prior",
    "tree_lookup_branches",
    "tree_lookup_record",
    "tree_calibration",
)


@strict
class JetSpecConfig(PretrainedConfig):
    r"""
    Configuration of a [`JetSpecDraftModel`], a causal parallel draft head for lossless tree speculative decoding.

    The head has `num_hidden_layers` transformer layers at the target's width. Hidden states of the target layers
    `target_layer_ids` are concatenated, projected by a bias-free `Linear(k * target_hidden_size -> hidden_size)`
    and RMS-normed; the result is injected as extra keys/values in every head layer. Embeddings and LM head are the
    target's and are never stored with the head.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Vocabulary size of the target. Must equal the target's.
        hidden_size (`int`, *optional*, defaults to 1024):
            Width of the head; equals the target's hidden size (the target's embeddings and LM head are reused).
        intermediate_size (`int`, *optional*, defaults to 2816):
            Width of the SwiGLU MLP.
        num_hidden_layers (`int`, *optional*, defaults to 1):
            Number of draft layers (the paper uses 5 for Qwen3-8B).
        num_attention_heads (`int`, *optional*, defaults to 16):
            Query heads.
        num_key_value_heads (`int`, *optional*, defaults to 8):
            Key/value heads (grouped-query attention).
        head_dim (`int`, *optional*):
            Per-head width, defaults to `hidden_size // num_attention_heads`.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6):
            Epsilon of every RMSNorm.
        rope_theta (`float`, *optional*, defaults to 10000.0):
            Base of the rotary embedding. Positions are the target's absolute positions.
        rope_parameters (`dict`, *optional*):
            transformers' rope parameters (`rope_type`, `rope_theta`, `factor`, ...), copied from the target by
            [`JetSpecDraftModel.from_target`] so that the head follows the target's scaling (llama3, yarn, linear).
            Defaults to plain rotary with `rope_theta`.
        max_position_embeddings (`int`, *optional*):
            The target's, read by rope scaling types; copied by `from_target`. Defaults to the rope parameters'
            `original_max_position_embeddings`.
        target_hidden_size (`int`, *optional*):
            Hidden size of the target, defaults to `hidden_size`.
        target_num_hidden_layers (`int`, *optional*, defaults to 36):
            Number of layers of the target the head was built for. Always written to `config.json`, and required
            there: a saved config without it is refused when loaded.
        target_layer_ids (`list[int]`, *optional*):
            Target layers whose outputs feed the head, defaults to [`default_target_layer_ids`].
        block_size (`int`, *optional*, defaults to 16):
            Length of the draft block `[anchor, MASK x (block_size - 1)]`; the maximum tree depth is `block_size - 1`.
        mask_token_id (`int`, *optional*):
            In-vocabulary id that stands for a MASK slot outside the head: transformers' DFlash generator
            (`speculation_type="dflash"`) and DFlash exports embed it. With `mask_source="head"` the head replaces that
            embedding by its own trained vector, and inside the head a MASK is [`mask_id`], outside the vocabulary,
            so it never collides with a real token; defaults to `dflash_mask_token_id`, else `vocab_size - 1`
            (configs saved with the out-of-vocabulary id here read as that default). With `mask_source="target"`
            it is required: the MASK is the target's own row of this (unused) id.
        mask_source (`str`, *optional*, defaults to `"head"`):
            Where a MASK slot's embedding comes from: `"head"`, the head's trained `mask_embedding` (ours), or
            `"target"`, the target's own embedding row of `mask_token_id`, an unused id inside the vocabulary (the
            DFlash / JetSpec-reference convention, set by importing such a head). With `"target"` the row is read
            from the attached target at every forward, never copied, and `mask_embedding` is unused.
        dflash_mask_token_id (`int`, *optional*):
            In-vocabulary id written as `dflash_config.mask_token_id` when a head with `mask_source="head"` is exported
            in the DFlash format (its trained vector goes to `mask_embedding.pt`, which vLLM substitutes for that
            id's embedding row), defaults to `vocab_size - 1`. Importing a head that ships `mask_embedding.pt` keeps
            the checkpoint's id here.
        block_attention (`str`, *optional*, defaults to `"causal"`):
            `"causal"` (JetSpec: slot i sees the context and slots <= i) or `"bidirectional"` (the DFlash ablation).
        tree_depth (`int`, *optional*):
            Default maximum depth N of the candidate tree, defaults to `min(7, block_size - 1)`.
        tree_width (`int`, *optional*, defaults to 4):
            Default number of candidates W per depth.
        tree_budget (`int` or `"auto"`, *optional*, defaults to 32):
            Default number of draft nodes B in the tree (the root, i.e. the anchor, is not counted). `"auto"` picks
            one budget and the draft sources per call from `tau_by_budget` and this host's measured costs
            (`budget.py`, `host_costs.py`); without `tau_by_budget`, budget 8 with the head's own sources.
        tree_scoring (`str`, *optional*, defaults to `"logprob"`):
            Best-first key: `"logprob"` (the paper), `"entropy"` or `"mixed"` (ablations).
        path_conditioning (`bool`, *optional*, defaults to `False`):
            Rescore the tree with a second draft pass whose MASK probes see their own branch's real tokens.
        tree_lookup (`int`, *optional*, defaults to 0):
            Add a prompt-lookup branch to every tree: the up to `tree_lookup` tokens (at most 64, possibly more than
            `tree_depth`) that followed the last earlier occurrence of the sequence's final 3 (else 2, 1) tokens,
            with the head's best nodes up to `tree_budget`. 0 drafts with the head alone.
        tree_lookup_prior (`list[list[float]]`, *optional*):
            How often a prompt-lookup chain is accepted, per match order: `tree_lookup_prior[n - 1][k - 1]` is the
            fraction of chains from an n-gram match (n = 1, 2, 3) with at least k tokens accepted, measured on the
            target's own answers (`training/lookup_prior.py`). With it the chain's tokens are scored by these
            odds and compete with the head's nodes for the budget (a bigram or unigram match, rarely right, takes
            only the nodes it earns); without it the whole chain comes first.
        tree_lookup_branches (`str`, *optional*, defaults to `"chain"`):
            What the prompt-lookup branch holds: `"chain"`, the continuation of the most recent earlier occurrence
            only; `"trie"`, every earlier continuation of that n-gram (up to 64 occurrences), counted, each branch
            scored by the prior's survival ratio times its share of the count (`continuations.py`).
        tree_lookup_record (`bool`, *optional*, defaults to `False`):
            Mix `tree_lookup_prior` with the branch's record in the call: per row and match order, how often the
            target continued along the branch at each depth in recent rounds (`continuations.LookupRecord`).
            Needs a `tree_lookup_prior`.
        tree_calibration (`dict`, *optional*):
            Per depth and source of a draft node ("head", "lookup", "both"), the acceptance rate measured offline
            for each tenth of its conditional draft probability: `{"<depth>:<source>": [10 rates]}`
            (`calibration.py`, fitted by `python -m training.evaluate_head --fit_calibration`). The tree ranks
            nodes by the log of their calibrated rate instead of their raw score; scores decide which nodes are
            drafted, never which tokens are committed. `None`: raw scores.
        tau_by_budget (`dict`, *optional*):
            The head's committed tokens per round (tau, bonus included), measured offline per draft sources and
            budget: `{"head" | "head+lookup" | "head+lookup+trie": {"<budget>": tau}}` (`training/tau_table.py
            --write`). Read by `tree_budget="auto"`, which weighs it against this host's costs. `None`: unmeasured.
        draft_vocab_size (`int`, *optional*):
            Number of target tokens the head drafts from, defaults to `vocab_size` (the full vocabulary). A smaller
            value drafts only inside a fixed subset (FR-Spec / EAGLE-3 `d2t`): the head's LM head is the target's
            restricted to those rows, so the draft cost shrinks with it. Verification is unchanged and stays exact.
        last_context_input (`bool`, *optional*, defaults to `False`):
            Add the fused target features of the last context position (the one whose hidden state predicted the
            anchor) to the input of every block slot, as EAGLE feeds its features. `False` is the paper's head.
        layer_types (`list[str]`, *optional*):
            Per head layer, `"full_attention"` (the whole context) or `"sliding_attention"` (a window of
            `sliding_window` positions), as published DFlash heads declare them. Defaults to full attention everywhere.
        sliding_window (`int`, *optional*):
            Window of the `"sliding_attention"` layers: a slot at absolute position p sees keys at positions k with
            `p - k < sliding_window` (and, in a bidirectional block, `k - p < sliding_window`), transformers' causal
            convention. Required when any layer slides.
    """

    model_type = "jetspec"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        intermediate_size: int = 2816,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        max_position_embeddings: int | None = None,
        target_hidden_size: int | None = None,
        target_num_hidden_layers: int = 36,
        target_layer_ids: list[int] | None = None,
        block_size: int = 16,
        mask_token_id: int | None = None,
        block_attention: str = "causal",
        mask_source: str = "head",
        dflash_mask_token_id: int | None = None,
        tree_depth: int | None = None,
        tree_width: int = 4,
        tree_budget: int = 32,
        tree_scoring: str = "logprob",
        path_conditioning: bool = False,
        tree_lookup: int = 0,
        tree_lookup_prior: list | None = None,
        tree_lookup_branches: str = "chain",
        tree_lookup_record: bool = False,
        tree_calibration: dict | None = None,
        tau_by_budget: dict | None = None,
        draft_vocab_size: int | None = None,
        last_context_input: bool = False,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        layer_block_attention: list[str] | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        check_field_types(locals())  # the typed fields, by name, before anything is derived from them
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.rms_norm_eps = num_key_value_heads, rms_norm_eps
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self._set_rope(rope_theta, rope_parameters, max_position_embeddings)
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(target_num_hidden_layers)
        self.target_num_hidden_layers, self.target_layer_ids = target_num_hidden_layers, list(ids)
        self.block_size, self.mask_source, self.dflash_mask_token_id = block_size, mask_source, dflash_mask_token_id
        given = {**locals(), "tree_depth": tree_depth if tree_depth is not None else min(7, block_size - 1)}
        for name in (*TREE_FIELDS, "tau_by_budget", "last_context_input", "initializer_range"):
            setattr(self, name, given[name])  # as given; tree_depth derived from the block when not given
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else vocab_size
        self._set_layers(block_attention, layer_types, sliding_window, layer_block_attention)
        super().__init__(**kwargs)
        if mask_source == "head" and (mask_token_id is None or _outside(mask_token_id, vocab_size)):
            mask_token_id = dflash_mask_token_id if dflash_mask_token_id is not None else vocab_size - 1
        self.mask_token_id = mask_token_id
        self._validate()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' loading from a `config.json` dict, refusing one without `target_num_hidden_layers`: the
        default (36) would silently describe another target."""
        if "target_num_hidden_layers" not in config_dict and "target_num_hidden_layers" not in kwargs:
            raise ValueError(
                "expected target_num_hidden_layers (the number of layers of the head's target) in the config, got a "
                f"config without it (fields {sorted(config_dict)})"
            )
        return super().from_dict(config_dict, **kwargs)

    def to_diff_dict(self) -> dict:
        """transformers' `config.json` content (fields that differ from the defaults), always with
        `target_num_hidden_layers`, which loading requires."""
        return {**super().to_diff_dict(), "target_num_hidden_layers": self.target_num_hidden_layers}

    def _set_layers(self, block_attention: str, layer_types, sliding_window, layer_block_attention):
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * self.num_hidden_layers
        self.sliding_window = sliding_window
        self.layer_block_attention = None if layer_block_attention is None else list(layer_block_attention)
        if self.layer_block_attention is not None:  # drafts whole blocks unless every layer is causal
            block_attention = "causal" if set(self.layer_block_attention) == {"causal"} else "bidirectional"
        self.block_attention = block_attention

    def _set_rope(self, rope_theta: float, rope_parameters: dict | None, max_position_embeddings: int | None):
        self.rope_theta = (rope_parameters or {}).get("rope_theta", rope_theta)
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": rope_theta})
        if max_position_embeddings is None:
            max_position_embeddings = self.rope_parameters.get("original_max_position_embeddings")
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings is None and self.rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(
                f"expected max_position_embeddings (the target's) with rope_type "
                f"{self.rope_parameters['rope_type']!r}, got none"
            )

    def check_draft_vocab_restriction(self, size: int):
        """Raise a `ValueError` unless a head of this config can draft from its `size` most frequent tokens: any size
        up to its own reduced vocabulary, or `vocab_size` (the full vocabulary)."""
        if size == self.vocab_size:
            return
        if self.draft_vocab_size == self.vocab_size:
            raise ValueError(
                f"expected a head with a reduced draft vocabulary to restrict, got one drafting from the full "
                f"vocabulary; choose {size} target ids with `draft_vocab_size` and `set_draft_vocab(ids)` instead"
            )
        if not 1 <= size <= self.draft_vocab_size:
            raise ValueError(
                f"expected a draft vocabulary size in [1, {self.draft_vocab_size}] (the head's) or {self.vocab_size} "
                f"(the full vocabulary), got {size}"
            )

    def _validate(self):
        if self.block_attention not in BLOCK_ATTENTIONS:
            raise ValueError(f"expected block_attention in {BLOCK_ATTENTIONS}, got {self.block_attention!r}")
        if self.block_size < 2:
            raise ValueError(f"expected block_size >= 2 (anchor plus at least one MASK), got {self.block_size}")
        check_tree_shape(
            self.tree_depth,
            self.tree_width,
            self.tree_budget,
            self.tree_scoring,
            self.block_size,
            self.path_conditioning,
            self.tree_lookup,
            self.tree_lookup_branches,
            self.tree_lookup_record,
        )
        check_lookup_prior(self.tree_lookup_prior, self.tree_lookup_record and bool(self.tree_lookup))
        check_calibration(self.tree_calibration)
        if not isinstance(self.draft_vocab_size, int) or not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"expected draft_vocab_size in [1, {self.vocab_size}] (the target's vocabulary size), got "
                f"{self.draft_vocab_size!r}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_num_hidden_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"expected target_layer_ids within [0, {self.target_num_hidden_layers - 1}] (the target has "
                f"{self.target_num_hidden_layers} layers), got {self.target_layer_ids}"
            )
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "expected num_attention_heads to divide hidden_size and num_key_value_heads to divide "
                f"num_attention_heads, got hidden_size={self.hidden_size}, num_attention_heads="
                f"{self.num_attention_heads}, num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"expected layer_types of {self.num_hidden_layers} entries among {LAYER_TYPES}, got {self.layer_types}"
            )
        per_layer = self.layer_block_attention
        if per_layer is not None and (
            len(per_layer) != self.num_hidden_layers or set(per_layer) - set(BLOCK_ATTENTIONS)
        ):
            raise ValueError(
                f"expected layer_block_attention of {self.num_hidden_layers} entries among {BLOCK_ATTENTIONS}, got "
                f"{per_layer}"
            )
        if "sliding_attention" in self.layer_types and not (
            isinstance(self.sliding_window, int) and self.sliding_window >= 1
        ):
            raise ValueError(
                f"expected sliding_window >= 1 for the sliding_attention layers, got {self.sliding_window!r}"
            )
        if self.mask_source not in MASK_SOURCES:
            raise ValueError(f"expected mask_source in {MASK_SOURCES}, got {self.mask_source!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"expected mask_token_id inside the target vocabulary [0, {self.vocab_size}) (the id a MASK slot is "
                f"embedded from outside the head), got {self.mask_token_id!r}"
            )

    @property
    def mask_id(self) -> int:
        """The id of a MASK slot in the head's own `input_ids`: `vocab_size` (never a real token) when the head
        embeds MASK with its trained vector (`mask_source="head"`), else the in-vocabulary `mask_token_id`."""
        return self.vocab_size if self.mask_source == "head" else self.mask_token_id


def _outside(token_id, vocab_size) -> bool:
    """True for an int id outside `[0, vocab_size)` (the head's MASK id, as configs before `mask_id` stored it)."""
    return isinstance(token_id, int) and isinstance(vocab_size, int) and not 0 <= token_id < vocab_size


JetSpecConfig.register_for_auto_class()
