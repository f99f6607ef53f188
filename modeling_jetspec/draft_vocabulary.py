"""The head's draft vocabulary (FR-Spec / EAGLE-3 `d2t`; `configuration_jetspec.py`, `draft_vocab_size`): the
head drafts only inside a fixed subset of the target's tokens, and its LM head is the target's, restricted to those
rows. A mixin of [`JetSpecDraftModel`], which holds the `d2t` buffer (`None` for the full vocabulary) and the
attached target's LM head.
"""

import torch


class DraftVocabulary:
    """The draft vocabulary's methods of [`JetSpecDraftModel`]: its target ids, the map from draft ids to target ids,
    its checks and changes, and the restricted LM head."""

    def draft_token_ids(self) -> torch.LongTensor | None:
        """Target ids of the draft vocabulary, of shape `(draft_vocab_size,)`; `None` for the full vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Map draft-vocabulary ids (any shape) to target ids; the identity for the full vocabulary."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def check_draft_vocab(self):
        """Raise a `ValueError` when `d2t` maps outside the target vocabulary or maps two draft ids to one token."""
        ids = self.draft_token_ids()
        if ids is None:
            return
        bad = ((ids < 0) | (ids >= self.config.vocab_size)).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"expected d2t to map every draft id into the target vocabulary [0, {self.config.vocab_size}), got "
                f"draft id {i} -> {int(ids[i])}"
            )
        if ids.unique().numel() != ids.numel():
            values, counts = ids.unique(return_counts=True)
            raise ValueError(
                f"expected d2t to map draft ids to distinct target ids, got target id {int(values[counts > 1][0])} "
                "more than once"
            )

    @torch.no_grad()
    def set_draft_vocab(self, target_ids):
        """Draft only inside `target_ids` (a sequence of `draft_vocab_size` distinct target ids, kept in order)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if self.d2t is None or ids.numel() != self.d2t.numel():
            raise ValueError(
                f"expected {self.config.draft_vocab_size} target ids (config.draft_vocab_size), got {ids.numel()}"
            )
        previous = self.d2t.clone()
        self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))
        try:
            self.check_draft_vocab()
        except ValueError:
            self.d2t.copy_(previous)
            raise
        self._draft_lm = None

    @torch.no_grad()
    def restrict_draft_vocab(self, size: int):
        """Keep only the first `size` draft ids (the most frequent first, for heads whose vocabulary was chosen by
        frequency in training); `size == vocab_size` drafts from the full vocabulary again. Changes the config."""
        self.config.check_draft_vocab_restriction(size)
        if size == self.config.vocab_size:
            self.d2t = None
        else:
            d2t = self.d2t[:size].clone()
            del self.d2t
            self.register_buffer("d2t", d2t)
        self.config.draft_vocab_size = size
        self._draft_lm = None

    def draft_lm_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(weight, bias)` of the draft LM head: the target's LM head, restricted to the draft rows when reduced.

        Returns:
            `weight` of shape `(draft_vocab_size, hidden_size)` and `bias` of shape `(draft_vocab_size,)` or `None`.
        """
        lm_head = self.target_lm_head()
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.d2t is None:
            return weight, bias
        key = (weight.data_ptr(), weight.dtype, weight.device, self.dtype, self.d2t.data_ptr(), self.d2t._version)
        if self._draft_lm is None or self._draft_lm[0] != key:
            ids = self.draft_token_ids().to(weight.device)
            # in the head's dtype: a float32 head trained next to a bf16 target keeps float32 logits
            rows = weight[ids].detach().to(self.dtype)  # (V_draft, H)
            self._draft_lm = (key, rows, None if bias is None else bias[ids].detach().to(self.dtype))
        return self._draft_lm[1], self._draft_lm[2]
