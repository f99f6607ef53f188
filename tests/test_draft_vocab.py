"""Reduced draft vocabulary (`draft_vocab_size`, EAGLE-3 `d2t`) and the last-context slot input.

Settings:
  (a) a random head drafting from a random subset of the vocabulary: the target's greedy token is often outside
      it, so whole depths can never be accepted; output must still be plain greedy's, token for token;
  (b) sampling with a subset drafter: the walk only ever matches target samples against drafted tokens, so the
      output follows the target's exact distribution (chi-square against enumeration, as in test_sampling);
  (c) the head's logits over the subset equal the full-vocabulary head's logits at those rows (same weights):
      the reduced LM head is only a row selection;
  (d) the training forward (raw features, packed blocks with per-slot `last_context_index`) and the decoding
      forward (cached context) of a `last_context_input` head agree.
"""

import pytest
import torch
from test_sampling import ALPHA, NEW, VOCAB, goodness_of_fit, sample, setup  # noqa: F401  (setup is a fixture)
from jetspec.tiny import prompts, tiny_head, tiny_target
from transformers import AutoModel

from modeling_jetspec import JetSpecDraftModel


def subset(vocab: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("last_context_input", [False, True], ids=["paper-input", "last-context-input"])
def test_subset_head_matches_greedy(arch, batch, last_context_input):  # (a)
    target = tiny_target(arch)
    head = tiny_head(target, draft_vocab_size=40, last_context_input=last_context_input)
    head.set_draft_vocab(subset(128, 40))
    ids, mask = prompts(batch)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    tree = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, assistant_model=head)
    assert torch.equal(tree, plain)
    assert head.last_stats.new_tokens == 24 * batch


class SubsetMarginalHead(JetSpecDraftModel):
    """Drafts the target's marginal of the d-th new token, restricted to the draft vocabulary."""

    marginals: torch.Tensor = None  # (NEW, VOCAB) log-probs

    def draft(self, input_ids, position_ids, *args, **kwargs):
        out = super().draft(input_ids, position_ids, *args, **kwargs)
        depth = (position_ids - position_ids[:, :1]).clamp(max=NEW - 1)
        out.logits = self.marginals[depth][..., self.draft_token_ids()]  # (B, T, V_draft)
        return out


def test_subset_sampling_matches_the_exact_reference(setup):  # noqa: F811  (b)
    target, prompt, probs = setup
    torch.manual_seed(1)
    head = SubsetMarginalHead.from_target(
        target, num_hidden_layers=1, block_size=4, tree_depth=2, tree_width=3, tree_budget=8, draft_vocab_size=5
    ).eval()
    marginals = torch.zeros(NEW, VOCAB)
    for seq, p in probs.items():
        for d, token in enumerate(seq):
            marginals[d, token] += p
    # the five most likely first tokens: some continuations need tokens outside the subset
    head.set_draft_vocab(marginals[0].topk(5).indices.sort().values)
    head.marginals = marginals.clamp(min=1e-9).log()
    out = sample(target, prompt, assistant_model=head)
    assert goodness_of_fit(out, probs) > ALPHA
    assert head.last_stats.acceptance_per_depth[0] > 0.2  # drafts from the subset were accepted


def test_subset_logits_are_the_full_logits_at_those_rows():  # (c)
    target = tiny_target("qwen3")
    full = tiny_head(target)
    reduced = tiny_head(target, draft_vocab_size=32)
    reduced.load_state_dict(full.state_dict(), strict=False)
    rows = subset(128, 32, seed=3)
    reduced.set_draft_vocab(rows)
    features = torch.randn(2, 10, full.fc.in_features)
    block = torch.full((2, 5), full.config.mask_id)
    block[:, 0] = torch.tensor([7, 9])
    positions = torch.arange(10, 15).expand(2, 5)
    with torch.no_grad():
        want = full(block, positions, context_features=features).logits[..., rows]
        got = reduced(block, positions, context_features=features).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same matmul rows, same order: bitwise
    assert torch.equal(reduced.draft_to_target(torch.arange(32)), rows)


def test_last_context_input_training_forward_equals_decoding_forward():  # (d)
    target = tiny_target("llama")
    head = tiny_head(target, last_context_input=True)
    features = torch.randn(1, 12, head.fc.in_features)
    # two blocks packed in one forward, anchored at 5 and 9: each sees context < anchor and itself only
    anchors, bs = [5, 9], 4
    ids = torch.full((1, 2 * bs), head.config.mask_id)
    ids[0, 0], ids[0, bs] = 11, 22
    positions = torch.tensor([[a + i for a in anchors for i in range(bs)]])
    ctx = torch.arange(12)
    inner = torch.ones(bs, bs, dtype=torch.bool).tril()
    mask = torch.cat(
        [
            torch.cat([(ctx < a).expand(bs, 12) for a in anchors]),
            torch.block_diag(inner, inner),
        ],
        dim=1,
    )[None, None]
    last_index = torch.tensor([[a - 1 for a in anchors for _ in range(bs)]])
    with torch.no_grad():
        packed = head(ids, positions, attention_mask=mask, context_features=features, last_context_index=last_index)
        for j, a in enumerate(anchors):
            context = head.extend_context(
                None, features[:, :a], torch.arange(a)[None], torch.ones(1, a, dtype=torch.bool)
            )
            single = head.draft(ids[:, j * bs : (j + 1) * bs], positions[:, j * bs : (j + 1) * bs], context)
            # same math, different reduction order in attention over a longer masked key set: float32 rounding
            torch.testing.assert_close(packed.logits[:, j * bs : (j + 1) * bs], single.logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the slot input matters: zeroing the projection changes the drafts
        head.last_context_proj.weight.zero_()
        changed = head(ids, positions, attention_mask=mask, context_features=features, last_context_index=last_index)
    assert not torch.allclose(changed.logits, packed.logits)


def test_d2t_round_trips_through_save_and_auto_model(tmp_path):
    target = tiny_target("llama")
    head = tiny_head(target, draft_vocab_size=50, last_context_input=True)
    rows = subset(128, 50, seed=5)
    head.set_draft_vocab(rows)
    head.save_pretrained(tmp_path)
    for loaded in (
        JetSpecDraftModel.from_pretrained(tmp_path),
        AutoModel.from_pretrained(tmp_path, trust_remote_code=True),
    ):
        assert loaded.config.draft_vocab_size == 50 and loaded.config.last_context_input
        assert torch.equal(loaded.draft_token_ids(), rows)
        loaded.attach_target(target)
        ids, mask = prompts(1)
        assert torch.equal(
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, assistant_model=loaded.eval()),
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, assistant_model=head),
        )


def test_draft_vocab_larger_than_the_target_vocab():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match=r"draft_vocab_size in \[1, 128\].*got 129"):
        tiny_head(target, draft_vocab_size=129)


@pytest.mark.parametrize(
    "ids,message",
    [
        ([0, 1, 2, 200], r"into the target vocabulary \[0, 128\).*draft id 3 -> 200"),
        ([0, 1, 1, 3], r"distinct target ids, got target id 1 more than once"),
        ([0, 1, 2], r"expected 4 target ids"),
    ],
    ids=["out-of-range", "duplicated", "wrong-count"],
)
def test_bad_d2t_is_rejected(ids, message):
    head = tiny_head(tiny_target("llama"), draft_vocab_size=4)
    before = head.d2t.clone()
    with pytest.raises(ValueError, match=message):
        head.set_draft_vocab(ids)
    assert torch.equal(head.d2t, before)  # a rejected mapping leaves the head as it was


def test_tampered_d2t_in_a_checkpoint_is_rejected_at_attach(tmp_path):
    target = tiny_target("llama")
    head = tiny_head(target, draft_vocab_size=4)
    head.set_draft_vocab([3, 5, 7, 9])
    with torch.no_grad():
        head.d2t[2] = 500  # draft id 2 -> 502, outside the vocabulary
    head.save_pretrained(tmp_path)
    loaded = JetSpecDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"draft id 2 -> 502"):
        loaded.attach_target(target)


def test_restricting_keeps_the_first_draft_ids_and_stays_lossless():
    target = tiny_target("llama")
    head = tiny_head(target, draft_vocab_size=40)
    order = torch.randperm(128, generator=torch.Generator().manual_seed(9))[:40]  # "most frequent first"
    head.set_draft_vocab(order)
    ids, mask = prompts(3)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16)
    head.restrict_draft_vocab(10)
    assert head.config.draft_vocab_size == 10 and torch.equal(head.draft_token_ids(), order[:10])
    assert torch.equal(
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, assistant_model=head), plain
    )
    with pytest.raises(ValueError, match=r"size in \[1, 10\].*got 20"):
        head.restrict_draft_vocab(20)  # the dropped ids are gone
    head.restrict_draft_vocab(128)  # the full vocabulary: the target's whole LM head
    assert head.d2t is None and head.draft_token_ids() is None and head.config.draft_vocab_size == 128
    assert torch.equal(
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, assistant_model=head), plain
    )
