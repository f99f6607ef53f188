"""The distillation losses (training/losses.py): hand-computed values, where each is minimal, that gradients reach
the draft's logits, that the chunked loss equals the whole-vocabulary one in value and gradient, and that a few
training steps with each one move every parameter of a reduced-vocabulary head."""

import math

import datasets
import pytest
import torch
import torch.nn.functional as F

from test_training import regenerated_rows, sharp_target, training_args
from jetspec.tiny import tiny_head
from training.losses import (
    LOSS_KINDS,
    block_loss,
    block_loss_terms,
    chunked_argmax,
    chunked_block_loss_terms,
    slot_losses,
    topk_rank_loss,
    total_variation,
)
from training.trainer import JetSpecTrainer

SOFT = ("fkl", "rkl", "kl_tv")  # zero exactly where the draft equals the target


def one_slot(probabilities):
    """Log-probabilities of shape `(1, 1, V)`, usable as logits."""
    return torch.tensor(probabilities).log().view(1, 1, -1)


def test_total_variation_and_reverse_kl_match_hand_computed_values():
    # target p = (0.5, 0.3, 0.2), draft q uniform over 3 tokens
    p, q = [0.5, 0.3, 0.2], [1 / 3] * 3
    teacher, student = one_slot(p), torch.zeros(1, 1, 3)
    label = torch.zeros(1, 1, dtype=torch.long)
    tv = 0.5 * (abs(0.5 - 1 / 3) + abs(0.3 - 1 / 3) + abs(0.2 - 1 / 3))  # = 1/6
    fkl = sum(a * math.log(a / b) for a, b in zip(p, q))
    rkl = sum(b * math.log(b / a) for a, b in zip(p, q))
    # the acceptance probability of a draft token is sum min(p, q) = 1 - TV
    assert sum(min(a, b) for a, b in zip(p, q)) == pytest.approx(1 - tv)
    # (tolerances: the defaults for float32, which the fp32 logs and exps meet)
    torch.testing.assert_close(total_variation(teacher.log_softmax(-1), student.log_softmax(-1)), torch.tensor([[tv]]))
    torch.testing.assert_close(slot_losses(student, teacher, label, "kl_tv"), torch.tensor([[fkl + tv]]))
    torch.testing.assert_close(slot_losses(student, teacher, label, "rkl"), torch.tensor([[rkl]]))


def test_topk_rank_matches_the_plackett_luce_likelihood_by_hand():
    # the target ranks tokens 0 > 1 > 2; the draft's logits z = (0, 1, 2) rank them the other way round
    log_p = one_slot([0.5, 0.3, 0.2])
    z = torch.tensor([0.0, 1.0, 2.0]).view(1, 1, 3)

    def lse(*values):
        return math.log(sum(math.exp(v) for v in values))

    # rank j's denominator: every token but those ranked before it
    ranks = [lse(0, 1, 2) - 0, lse(1, 2) - 1, 2 - 2]
    torch.testing.assert_close(topk_rank_loss(log_p, z, k=3), torch.tensor([[sum(ranks) / 3]]))
    torch.testing.assert_close(topk_rank_loss(log_p, z, k=2), torch.tensor([[sum(ranks[:2]) / 2]]))
    # a K above the (draft) vocabulary is capped at it
    torch.testing.assert_close(topk_rank_loss(log_p, z, k=8), topk_rank_loss(log_p, z, k=3))


@pytest.mark.parametrize("kind", SOFT)
def test_soft_losses_are_zero_where_the_draft_equals_the_target_and_positive_elsewhere(kind):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(3, 4, 16, generator=g) * 3
    labels = torch.zeros(3, 4, dtype=torch.long)
    # (atol: a KL of equal fp32 distributions sums ~1e-7 roundings per token)
    torch.testing.assert_close(slot_losses(teacher, teacher, labels, kind), torch.zeros(3, 4), atol=1e-5, rtol=0)
    student = teacher + torch.randn(3, 4, 16, generator=g)
    assert (slot_losses(student, teacher, labels, kind) > 1e-3).all()


def test_topk_rank_prefers_the_targets_order_and_sft_the_targets_token():
    teacher = one_slot([0.4, 0.3, 0.2, 0.1])
    label = torch.zeros(1, 1, dtype=torch.long)
    in_order = torch.tensor([3.0, 2.0, 1.0, 0.0]).view(1, 1, 4)
    swapped = torch.tensor([2.0, 3.0, 1.0, 0.0]).view(1, 1, 4)  # the target's first two tokens swapped
    assert slot_losses(in_order, teacher, label, "topk_rank") < slot_losses(swapped, teacher, label, "topk_rank")
    # the ranking term alone goes to zero as the draft's order becomes certain
    assert (
        topk_rank_loss(teacher.log_softmax(-1), in_order * 30)
        < 1e-6
        < topk_rank_loss(teacher.log_softmax(-1), in_order)
    )
    # hard labels: zero as the draft becomes certain of the label, positive before
    sure = torch.tensor([30.0, 0.0, 0.0, 0.0]).view(1, 1, 4)
    assert slot_losses(sure, None, label, "sft") < 1e-6 < slot_losses(in_order, None, label, "sft")


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_gradients_reach_every_logit_of_a_counted_slot(kind):
    g = torch.Generator().manual_seed(1)
    student = torch.randn(2, 3, 10, generator=g).requires_grad_()
    teacher = torch.randn(2, 3, 10, generator=g)
    labels = torch.randint(0, 10, (2, 3), generator=g)
    counted = torch.tensor([[True, True, False], [True, False, False]])
    block_loss(student, teacher, labels, counted, kind, gamma=4.0).backward()
    grad = student.grad
    assert torch.isfinite(grad).all()
    assert (grad[counted].abs().sum(-1) > 0).all() and (grad[~counted] == 0).all()


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_a_few_steps_with_each_loss_move_every_parameter_of_a_reduced_vocabulary_head(kind, tmp_path):
    # a 64-token draft vocabulary (every other id): soft losses compare with the target's softmax over those rows,
    # sft scores the target token's draft id and leaves out slots whose token is not drafted
    target = sharp_target()
    head = tiny_head(target, draft_vocab_size=64, last_context_input=True).train()
    head.set_draft_vocab(torch.arange(0, 128, 2))
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    rows = datasets.Dataset.from_list(regenerated_rows(target, count=8))
    trainer = JetSpecTrainer(
        model=head,
        train_dataset=rows,
        target=target,
        args=training_args(tmp_path, max_steps=3, num_blocks_per_sequence=3, loss=kind),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses
    assert [n for n, p in head.named_parameters() if torch.equal(before[n], p)] == []


# the chunked loss adds the same float32 slot losses in another order (per chunk, then over chunks), and its matmuls
# run on fewer rows: measured differences are ~1e-7 relative, a few float32 ulps; 1e-5 leaves room for any BLAS
CHUNKED_RTOL, CHUNKED_ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("gamma", [None, 3.0])
def test_chunked_loss_equals_the_whole_vocabulary_loss_in_value_and_gradient(kind, gamma):
    g = torch.Generator().manual_seed(2)
    n, d, h, v = 5, 7, 16, 300
    weight, bias = torch.randn(v, h, generator=g) * 0.5, torch.randn(v, generator=g) * 0.1
    student = torch.randn(n, d, h, generator=g).requires_grad_()
    teacher = torch.randn(n, d, h, generator=g)
    labels = torch.randint(0, v, (n, d), generator=g)
    counted = torch.rand(n, d, generator=g) < 0.7
    whole, whole_count = block_loss_terms(
        F.linear(student, weight, bias), F.linear(teacher, weight, bias), labels, counted, kind, gamma
    )
    (whole_grad,) = torch.autograd.grad(whole, student)
    for chunk in (4, 1000):  # 4 does not divide the counted slots; 1000 is one chunk
        total, count = chunked_block_loss_terms(student, teacher, weight, bias, labels, counted, kind, gamma, chunk)
        (grad,) = torch.autograd.grad(total, student)
        torch.testing.assert_close(total, whole, rtol=CHUNKED_RTOL, atol=CHUNKED_ATOL)
        torch.testing.assert_close(grad, whole_grad, rtol=CHUNKED_RTOL, atol=CHUNKED_ATOL)
        assert count == whole_count == counted.sum()
        assert (grad[~counted] == 0).all() and (grad[counted].abs().sum(-1) > 0).all()


def test_chunked_loss_refuses_a_trainable_lm_head_and_bad_shapes():
    student, labels, counted = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=bool)
    with pytest.raises(ValueError, match="expected a frozen LM head weight"):
        chunked_block_loss_terms(student, student, torch.randn(5, 4, requires_grad=True), None, labels, counted)
    with pytest.raises(
        ValueError, match=r"expected teacher_hidden of the student's shape \(2, 3, 4\) for loss 'fkl', got None"
    ):
        chunked_block_loss_terms(student, None, torch.randn(5, 4), None, labels, counted)
    with pytest.raises(ValueError, match="expected chunk_slots >= 1, got 0"):
        chunked_block_loss_terms(student, student, torch.randn(5, 4), None, labels, counted, chunk_slots=0)


def test_chunked_argmax_equals_the_whole_argmax():
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = (
        torch.randn(3, 5, 8, generator=g),
        torch.randn(50, 8, generator=g),
        torch.randn(50, generator=g),
    )
    want = F.linear(hidden, weight, bias).argmax(-1)  # (3, 5)
    assert torch.equal(chunked_argmax(hidden, weight, bias, chunk_slots=4), want)
    assert torch.equal(chunked_argmax(hidden, weight, None, chunk_slots=4), F.linear(hidden, weight).argmax(-1))
