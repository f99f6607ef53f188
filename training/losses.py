"""Distillation losses of the draft head over block slots (arXiv 2606.18394, section 3.3 "Training").

Every MASK slot k = 1..D of a block is a separate prediction of the token at depth k. The paper trains with
soft labels, forward KL(p_target || q_draft): a tree ranks whole distributions, so the draft must cover the
target's mass, not only its mode. Hard-label cross-entropy ("sft") is about as good; reverse KL ("rkl",
mode seeking) is 36-46% worse and is kept as the ablation. Two acceptance-aware losses add a term to forward KL:

- `"kl_tv"`: plus the total variation TV(p, q) = 1/2 sum_v |p_v - q_v|. Under speculative sampling a draft token is
  accepted with probability sum_v min(p_v, q_v) = 1 - TV(p, q), so this term is the rejection rate itself, as in the
  LK losses.
- `"topk_rank"`: plus a ranking loss on the target's top-K tokens t_1..t_K (HASS's top-K distillation): the
  Plackett-Luce log-likelihood of the draft ranking them in the target's order,
  `-1/K sum_j log(exp(z_{t_j}) / sum_{v not in t_1..t_{j-1}} exp(z_v))`, with z the draft's logits. A tree keeps a
  slot's top-ranked tokens, so their order matters more than the tail's mass.

With a reduced draft vocabulary every soft loss compares the draft with the target's softmax restricted to the draft
tokens (the caller passes the target's logits over those rows), and the hard label is the target token's draft id.

An optional position decay w_k ~ exp(-(k - 1) / gamma) weights shallow depths more (the bidirectional DFlash head
needs it; the causal head is insensitive to it).

The trainer never holds a `(slots, V)` tensor whole: [`chunked_block_loss_terms`] applies the LM head to the head's
and the target's final states a chunk of slots at a time, and takes each chunk's gradient as it goes (every slot's
loss is its own, so the sum over chunks is the same loss). With a 150K vocabulary that moves the peak memory of a step
from the logits to the head.

The loss of a batch is a mean over its counted slots (MASK slots inside the sequence) of w_k times the slot's loss.
The decay weights are scaled to mean 1 over the depths, so gamma moves weight between depths without changing the
loss scale, and the mean's denominator is a plain count of slots: the count the `Trainer` makes of the labels
(`num_items_in_batch`) across micro-batches and processes.
"""

import math

import torch
import torch.nn.functional as F

LOSS_KINDS = ("fkl", "sft", "rkl", "kl_tv", "topk_rank")
LOSS_CHUNK_SLOTS = 64  # slots whose (slots, V) logits exist at once in the chunked loss and argmax
RANK_TOP_K = 8  # tokens of the target's top-K that `"topk_rank"` orders (a tree's width per slot is at most this)


def check_loss_kind(kind: str) -> None:
    """Raise a `ValueError` naming the valid loss kinds when `kind` is not one of them."""
    if kind not in LOSS_KINDS:
        raise ValueError(
            f"expected loss in {LOSS_KINDS} (forward KL, hard-label CE, reverse KL, forward KL + total "
            f"variation, forward KL + top-K ranking), got {kind!r}"
        )


def total_variation(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """`TV(p, q) = 1/2 sum_v |p_v - q_v|` over the last dimension: 1 minus the acceptance probability of a token
    drawn from q under speculative sampling against p."""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def topk_rank_loss(log_p: torch.Tensor, student_logits: torch.Tensor, k: int = RANK_TOP_K) -> torch.Tensor:
    """Plackett-Luce negative log-likelihood, averaged over the K ranks, of the draft ordering the target's top-K
    tokens in the target's order (see the module docstring). Rank j's denominator holds every token but the j - 1
    ranked before it: the tokens outside the top-K and t_j..t_K.

    Args:
        log_p (`torch.Tensor` of shape `(..., V)`): the target's log-probabilities.
        student_logits (`torch.Tensor` of shape `(..., V)`): the draft's logits, float32.
        k (`int`, *optional*, defaults to `RANK_TOP_K`): ranks scored, at most V.

    Returns:
        `torch.Tensor` of shape `(...)`.
    """
    k = min(k, log_p.shape[-1])
    top = log_p.topk(k, dim=-1).indices  # (..., K), the target's order
    z_top = student_logits.gather(-1, top)  # (..., K)
    outside = student_logits.scatter(-1, top, float("-inf")).logsumexp(-1, keepdim=True)  # (..., 1)
    # log sum_{i >= j} exp(z_{t_i}), for every rank j: a reversed cumulative logsumexp
    tail = z_top.flip(-1).logcumsumexp(-1).flip(-1)  # (..., K)
    return (torch.logaddexp(outside, tail) - z_top).mean(-1)


def depth_weights(depth: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """Position-decay weights `w_k = D * exp(-(k - 1) / gamma) / sum_j exp(-(j - 1) / gamma)` for depths
    k = 1..D (`depth`): the paper's decay scaled to mean 1 over the depths; all ones without `gamma`.

    Returns:
        `torch.Tensor` of shape `(depth,)`, float32.
    """
    if gamma is not None and not gamma > 0:
        raise ValueError(f"expected gamma > 0 or None (no decay), got {gamma}")
    if gamma is None:
        return torch.ones(depth, device=device)
    decay = torch.exp(-torch.arange(depth, dtype=torch.float32, device=device) / gamma)  # exp(-(k - 1) / gamma)
    return decay * (depth / decay.sum())


def slot_losses(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    kind: str = "fkl",
) -> torch.Tensor:
    r"""Per-slot loss, unreduced.

    Args:
        student_logits (`torch.Tensor` of shape `(N, D, V)`): the head's logits at the MASK slots.
        teacher_logits (`torch.Tensor` of shape `(N, D, V)`, *optional*): the target's logits predicting the same
            tokens (position a + k - 1 for slot k of the block anchored at a). Unused by `"sft"`.
        labels (`torch.LongTensor` of shape `(N, D)`): the real tokens at those depths (any value where masked out).
        kind (`str`, *optional*, defaults to `"fkl"`): `"fkl"` = KL(p || q), `"sft"` = -log q(label),
            `"rkl"` = KL(q || p), `"kl_tv"` = KL(p || q) + TV(p, q), `"topk_rank"` = KL(p || q) + the top-K ranking
            loss, with p the target's and q the draft's softmax.

    Returns:
        `torch.Tensor` of shape `(N, D)`, float32.
    """
    check_loss_kind(kind)
    log_q = F.log_softmax(student_logits.float(), dim=-1)  # (N, D, V)
    if kind == "sft":
        index = labels.clamp_min(0).unsqueeze(-1)  # masked-out slots may hold -100
        return -log_q.gather(-1, index).squeeze(-1)
    if teacher_logits is None:
        raise ValueError(f"expected teacher_logits for loss {kind!r}, got None")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"expected teacher_logits of the student's shape {tuple(student_logits.shape)}, "
            f"got {tuple(teacher_logits.shape)}"
        )
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)  # (N, D, V)
    if kind == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    forward = (log_p.exp() * (log_p - log_q)).sum(-1)  # (N, D)
    if kind == "kl_tv":
        return forward + total_variation(log_p, log_q)
    if kind == "topk_rank":
        return forward + topk_rank_loss(log_p, student_logits.float())
    return forward


def block_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    kind: str = "fkl",
    gamma: float | None = None,
) -> torch.Tensor:
    r"""Mean of the depth-weighted [`slot_losses`] over the MASK slots that count.

    `loss = sum_{n,k} m_{n,k} w_k l_{n,k} / sum_{n,k} m_{n,k}`, with `m` the `loss_mask` and `w` the
    [`depth_weights`] (mean 1 over the depths). A batch without any counted slot gives a zero that still depends on
    the student (so a distributed backward sees every parameter).

    Args:
        student_logits (`torch.Tensor` of shape `(N, D, V)`): see [`slot_losses`].
        teacher_logits (`torch.Tensor` of shape `(N, D, V)`, *optional*): see [`slot_losses`].
        labels (`torch.LongTensor` of shape `(N, D)`): see [`slot_losses`].
        loss_mask (`torch.BoolTensor` of shape `(N, D)`): True for MASK slots inside the sequence; False for
            revealed slots and slots past the end.
        kind (`str`, *optional*, defaults to `"fkl"`): one of [`LOSS_KINDS`], see [`slot_losses`].
        gamma (`float`, *optional*): position decay; none by default (the paper's causal head).

    Returns:
        `torch.Tensor`: a scalar.
    """
    total, count = block_loss_terms(student_logits, teacher_logits, labels, loss_mask, kind, gamma)
    return total / count if count > 0 else total * 0.0


def block_loss_terms(student_logits, teacher_logits, labels, loss_mask, kind="fkl", gamma=None):
    """Numerator and denominator of [`block_loss`], for a normalisation across processes or micro-batches.

    Returns:
        `(weighted_sum, count)`: the depth-weighted loss summed over the counted slots, and the number of counted
        slots (float32, no gradient).
    """
    if student_logits.dim() != 3:
        raise ValueError(f"expected student_logits of shape (N, D, V), got {tuple(student_logits.shape)}")
    if labels.shape != student_logits.shape[:2] or loss_mask.shape != student_logits.shape[:2]:
        raise ValueError(
            f"expected labels and loss_mask of shape {tuple(student_logits.shape[:2])}, got "
            f"{tuple(labels.shape)} and {tuple(loss_mask.shape)}"
        )
    losses = slot_losses(student_logits, teacher_logits, labels, kind)  # (N, D)
    mask = loss_mask.float()  # (N, D)
    w = depth_weights(losses.shape[1], gamma, device=losses.device)  # (D,)
    return (losses * w * mask).sum(), mask.sum().detach()


def _chunk_loss(student_hidden, teacher_hidden, weight, bias, labels, slot_weight, kind) -> torch.Tensor:
    """`sum_s slot_weight_s * loss_s` over the slots of one chunk: the LM head applied to their `(c, H)` final states,
    as the head and the trainer apply it (in the LM head's dtype, then float32)."""
    student = F.linear(student_hidden.to(weight.dtype), weight, bias).float()  # (c, V)
    teacher = None
    if teacher_hidden is not None:
        teacher = F.linear(teacher_hidden.to(weight.dtype), weight, bias).float()  # (c, V)
    return (slot_losses(student, teacher, labels, kind) * slot_weight).sum()


class _ChunkedLoss(torch.autograd.Function):
    """The weighted slot loss of [`chunked_block_loss_terms`], chunk by chunk: each chunk's gradient with respect to
    the student's states is taken in the forward, while its logits exist, and only the `(slots, H)` gradient is kept
    for the backward."""

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, weight, bias, labels, slot_weight, kind, chunk):
        total = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
        grad = torch.zeros_like(student_hidden) if ctx.needs_input_grad[0] else None  # (S, H)
        for begin in range(0, student_hidden.shape[0], chunk):
            part = slice(begin, begin + chunk)
            with torch.enable_grad():
                hidden = student_hidden[part].detach().requires_grad_(grad is not None)  # (c, H)
                teacher = None if teacher_hidden is None else teacher_hidden[part]
                loss = _chunk_loss(hidden, teacher, weight, bias, labels[part], slot_weight[part], kind)
            if grad is not None:
                (grad[part],) = torch.autograd.grad(loss, hidden)
            total += loss.detach()
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total, None, None, None, None, None, None, None


def chunked_block_loss_terms(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    kind: str = "fkl",
    gamma: float | None = None,
    chunk_slots: int = LOSS_CHUNK_SLOTS,
):
    r"""[`block_loss_terms`] of the logits `F.linear(hidden, weight, bias)` of the student and the teacher, computed
    `chunk_slots` counted slots at a time: no `(slots, V)` tensor exists whole, in the forward or the backward. Same
    value and gradient as [`block_loss_terms`] on the whole logits, up to the order of float additions.

    Args:
        student_hidden (`torch.Tensor` of shape `(N, D, H)`): the head's final (normed) states at the MASK slots.
        teacher_hidden (`torch.Tensor` of shape `(N, D, H)`, *optional*): the target's final states predicting the
            same tokens. Unused by `"sft"`.
        weight (`torch.Tensor` of shape `(V, H)`): the (draft) LM head, frozen: no gradient reaches it.
        bias (`torch.Tensor` of shape `(V,)`, *optional*): its bias.
        labels (`torch.LongTensor` of shape `(N, D)`), loss_mask (`torch.BoolTensor` of shape `(N, D)`), kind
            (`str`), gamma (`float`, *optional*): see [`block_loss`].
        chunk_slots (`int`, *optional*, defaults to `LOSS_CHUNK_SLOTS`): slots per chunk.

    Returns:
        `(weighted_sum, count)`, as [`block_loss_terms`].
    """
    check_loss_kind(kind)
    if student_hidden.dim() != 3 or labels.shape != student_hidden.shape[:2] or loss_mask.shape != labels.shape:
        raise ValueError(
            f"expected student_hidden of shape (N, D, H) and labels and loss_mask of shape (N, D), got "
            f"{tuple(student_hidden.shape)}, {tuple(labels.shape)} and {tuple(loss_mask.shape)}"
        )
    if kind != "sft" and (teacher_hidden is None or teacher_hidden.shape != student_hidden.shape):
        raise ValueError(
            f"expected teacher_hidden of the student's shape {tuple(student_hidden.shape)} for loss "
            f"{kind!r}, got {None if teacher_hidden is None else tuple(teacher_hidden.shape)}"
        )
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("expected a frozen LM head weight (requires_grad=False), got one that requires grad")
    if chunk_slots < 1:
        raise ValueError(f"expected chunk_slots >= 1, got {chunk_slots}")
    n, d, h = student_hidden.shape
    mask = loss_mask.float()  # (N, D)
    slot_weight = (mask * depth_weights(d, gamma, device=mask.device)).reshape(-1)  # (N*D,)
    counted = slot_weight.nonzero().squeeze(-1)  # only counted slots have a loss; the others get no gradient
    teacher = None if kind == "sft" else teacher_hidden.reshape(n * d, h)[counted]
    total = _ChunkedLoss.apply(
        student_hidden.reshape(n * d, h)[counted],
        teacher,
        weight,
        bias,
        labels.reshape(-1)[counted],
        slot_weight[counted],
        kind,
        chunk_slots,
    )
    return total, mask.sum().detach()


@torch.no_grad()
def chunked_argmax(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, chunk_slots: int = LOSS_CHUNK_SLOTS
) -> torch.Tensor:
    """`F.linear(hidden, weight, bias).argmax(-1)`, `chunk_slots` rows of `hidden` `(..., H)` at a time.

    Returns:
        `torch.LongTensor` of shape `(...)`.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])  # (S, H)
    top = [
        F.linear(flat[i : i + chunk_slots].to(weight.dtype), weight, bias).argmax(-1)
        for i in range(0, flat.shape[0], chunk_slots)
    ]
    return torch.cat(top).view(hidden.shape[:-1]) if top else flat.new_zeros(hidden.shape[:-1], dtype=torch.long)


def chain_accept_length(acceptance: list[float]) -> float:
    """Expected committed tokens per round of a chain draft: `1 + sum_d prod_{k<=d} acc_k` (bonus included)."""
    return 1.0 + sum(math.prod(acceptance[: d + 1]) for d in range(len(acceptance)))
