"""Tie-aware equality of a speculative output with plain greedy decoding (`docs/design.md`, "§4 Lossless:
exactness and the bf16 tie rule").

In float32 tree decoding returns plain greedy's tokens bit for bit. In bfloat16/float16 one verify forward over
many tokens rounds differently from one-token decode steps, so the two runs may pick different tokens where the
target's two best logits are (numerically) equal, and each run then continues correctly from its own choice.
Such a divergence is a *tie*, not an error. Anything else is a *mismatch*: a token the target would not have
chosen, i.e. a bug.

[`classify_outputs`] takes the first position where the outputs differ, recomputes the target's logits for the
shared prefix in float32, and calls it a tie when both tokens' float32 logits lie within `tolerance` of the
float32 maximum. Only that first divergence is judged: past it the two continuations have different prefixes.
[`check_lossless`] applies the rule of the target's dtype (float32: bitwise; half precisions: up to ties) and
raises [`LosslessError`] on anything else; `jetspec generate` and `jetspec bench` both judge through it.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Largest float32 logit gap (to the row's maximum) still called a tie. bf16 keeps 8 significant bits: a logit in
# [16, 32) is stored to a spacing of 0.125, and the roundings of every layer compound. The ties measured on
# SmolLM2-135M in bf16 (`docs/design.md`, "§4 Lossless: exactness and the bf16 tie rule"), across every speculative
# method and prompt lookup alike, had float32 gaps of median 0.097 and maximum 0.245. 0.5 (four bf16 spacings)
# leaves headroom without hiding a wrong token: a token the target would not choose typically sits several logits
# below the maximum.
DEFAULT_TIE_TOLERANCE = 0.5
VERDICTS = ("exact", "tie", "mismatch")


class LosslessError(RuntimeError):
    """A speculative output differs from plain greedy decoding where the target's dtype allows no difference."""


@dataclass
class Verdict:
    """How one speculative output compares with plain greedy on the same prompt."""

    kind: str  # "exact", "tie" or "mismatch"
    position: Optional[int] = None  # first differing new token, None when exact
    reference_token: Optional[int] = None  # plain greedy's token there (None when its output ended)
    candidate_token: Optional[int] = None  # the speculative output's token there (None when it ended)
    gap: Optional[float] = None  # largest float32 gap of the two tokens to the maximum logit

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """Index of the first differing element of two 1-D token tensors, or of the shorter one's end; None if equal."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff):
        return int(diff[0])
    return None if len(a) == len(b) else n


@torch.no_grad()
def classify_outputs(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    prompt_ids: torch.Tensor,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    tolerance: float = DEFAULT_TIE_TOLERANCE,
) -> Verdict:
    """
    Classifies a speculative output against plain greedy as `exact`, `tie` or `mismatch`.

    Args:
        logits_fn (`Callable`): maps input ids of shape `(1, L)` to the target's float32 next-token logits of
            shape `(V,)` after the last of them (e.g. [`float32_logits_fn`]).
        prompt_ids (`torch.LongTensor` of shape `(P,)`): the prompt.
        reference (`torch.LongTensor` of shape `(n,)`): plain greedy's new tokens.
        candidate (`torch.LongTensor` of shape `(m,)`): the speculative output's new tokens.
        tolerance (`float`, *optional*, defaults to `DEFAULT_TIE_TOLERANCE`): largest float32 logit gap to the
            maximum for which both tokens count as tied.

    Returns:
        [`Verdict`].
    """
    if tolerance < 0:
        raise ValueError(f"expected a tie tolerance >= 0, got {tolerance}")
    at = first_difference(reference, candidate)
    if at is None:
        return Verdict("exact")
    ref_tok = int(reference[at]) if at < len(reference) else None
    cand_tok = int(candidate[at]) if at < len(candidate) else None
    if ref_tok is None or cand_tok is None:
        # one output stops while the other goes on with the same tokens: no choice was made differently
        return Verdict("mismatch", at, ref_tok, cand_tok)
    prefix = torch.cat([prompt_ids.cpu(), reference[:at].cpu()])[None]  # (1, P + at)
    logits = logits_fn(prefix).float()  # (V,)
    top = logits.max()
    gap = float(max(top - logits[ref_tok], top - logits[cand_tok]))
    return Verdict("tie" if gap <= tolerance else "mismatch", at, ref_tok, cand_tok, gap)


def float32_logits_fn(load_float32_target: Callable[[], "torch.nn.Module"]) -> Callable[[torch.Tensor], torch.Tensor]:
    """
    Next-token logits of the target in float32, from a model loaded on first use (most runs never diverge).

    Args:
        load_float32_target (`Callable`): returns the target with float32 weights, e.g. loaded again from its
            checkpoint (casting a bf16 copy back to float32 would keep the bf16 rounding of the weights).
    """
    cache = {}

    def logits(ids: torch.Tensor) -> torch.Tensor:
        if "model" not in cache:
            model = load_float32_target()
            if model.dtype != torch.float32:
                raise ValueError(f"expected a float32 target for the tie check, got {model.dtype}")
            cache["model"] = model.eval()
        model = cache["model"]
        with torch.no_grad():
            out = model(input_ids=ids.to(model.device))
        return out.logits[0, -1].float().cpu()

    return logits


def strict_for(dtype: torch.dtype) -> bool:
    """float32 promises bitwise equality (ties are failures too); half precisions allow ties."""
    return dtype == torch.float32


def check_lossless(
    prompt_ids: torch.Tensor,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    dtype: torch.dtype,
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    tolerance: float = DEFAULT_TIE_TOLERANCE,
    label: str = "the output",
) -> Verdict:
    """
    Judges a speculative output against plain greedy by the rule of the target's dtype, and fails on a mismatch.

    Args:
        prompt_ids (`torch.LongTensor` of shape `(P,)`): the prompt.
        reference (`torch.LongTensor` of shape `(n,)`): plain greedy's new tokens.
        candidate (`torch.LongTensor` of shape `(m,)`): the speculative output's new tokens.
        dtype (`torch.dtype`): the target's dtype; float32 is held to bitwise equality, any other to equality up
            to numerical ties.
        logits_fn (`Callable`, *optional*): the target's float32 next-token logits (see [`classify_outputs`]);
            required unless `dtype` is float32.
        tolerance (`float`, *optional*, defaults to `DEFAULT_TIE_TOLERANCE`): largest float32 logit gap still a tie.
        label (`str`, *optional*, defaults to `"the output"`): what the error message calls the candidate.

    Returns:
        [`Verdict`]: `exact`, or `tie` (never `mismatch`).

    Raises:
        `LosslessError`: the outputs differ in float32, or differ in a half precision at a position that is no tie.
    """
    strict = strict_for(dtype)
    if not strict and logits_fn is None:
        raise ValueError(f"expected a float32 logits_fn to judge ties of a {dtype} target, got None")
    if torch.equal(reference, candidate):
        return Verdict("exact")
    if strict:
        verdict = Verdict("mismatch", first_difference(reference, candidate))
    else:
        verdict = classify_outputs(logits_fn, prompt_ids, reference, candidate, tolerance)
    if verdict.kind == "mismatch":
        raise LosslessError(_mismatch_message(verdict, reference, candidate, dtype, tolerance, label))
    return verdict


def _mismatch_message(verdict: Verdict, reference, candidate, dtype, tolerance: float, label: str) -> str:
    at = verdict.position
    rule = "bitwise" if strict_for(dtype) else "up to numerical ties"
    message = (
        f"expected {label} to reproduce plain greedy decoding ({dtype}, {rule}), got a difference at new token {at} "
        f"({candidate[at:at + 5].tolist()} vs plain {reference[at:at + 5].tolist()}; lengths {len(candidate)} vs "
        f"{len(reference)})"
    )
    if verdict.gap is not None:
        message += f" that is no tie: float32 logit gap {verdict.gap:.3f} > tolerance {tolerance}"
    return message
