"""Tie-aware equality of a speculative output with plain greedy decoding (`docs/design.md`, "§4 Lossless:
exactness and the bf16 tie rule").

In float32 tree decoding returns plain greedy's tokens bit for bit. In bfloat16/float16 one verify forward over
many tokens rounds differently from one-token decode steps, so the two runs may pick different tokens where the
target's two best logits are (numerically) equal, and each run then continues correctly from its own choice.
Such a divergence is a *tie*, not an error. Anything else is a *mismatch*: a token the target would not have
chosen, i.e. a bug.

[`classify_outputs`] takes the first position where the outputs differ, recomputes the target's logits for the
shared prefix in float32, and calls it a tie when both tokens' float32 logits lie within `tolerance` of the
float32 maximum. Past that first divergence the two continuations have different prefixes, so a comparison with
plain greedy says nothing more: [`judge_tokens`] judges *every* emitted token on its own prefix instead. It
teacher-forces the output once through the float32 target (one forward over prompt + output) and requires each
token's float32 logit to lie within `tolerance` of the maximum at its prefix: a token that is not the float32
argmax but within the tolerance is a *near-tie*, one beyond it a *violation*. Plain greedy's own half-precision
output is judged the same way, so its near-ties are counted beside the speculative methods'.

[`check_lossless`] applies the rule of the target's dtype (float32: bitwise equality with plain greedy; half
precisions: first divergence a tie, and no emitted token a violation) and raises [`LosslessError`] on anything
else; `jetspec generate` and `jetspec bench` both judge through it.
"""

from dataclasses import dataclass
import inspect
from typing import Callable, Optional

import torch

# Largest float32 logit gap (to the row's maximum) still called a tie. bf16 keeps 8 significant bits: a logit in
# [16, 32) is stored to a spacing of 0.125, and the roundings of every layer compound. The ties measured on
# SmolLM2-135M in bf16 (`docs/design.md`, "§4 Lossless: exactness and the bf16 tie rule"), across every speculative
# method and prompt lookup alike, had float32 gaps of median 0.097 and maximum 0.245. 0.5 (four bf16 spacings)
# leaves headroom without hiding a wrong token: a token the target would not choose typically sits several logits
# below the maximum.
DEFAULT_TIE_TOLERANCE = 0.5
# In float32 two logits this close are a tie of rounding, not a choice: kernels of other shapes (a tree verify, another
# attention implementation) may order them apart over thousands of tokens of a random tiny target.
FLOAT32_TIE_TOLERANCE = 1e-4
VERDICTS = ("exact", "tie", "mismatch")


class LosslessError(RuntimeError):
    """A speculative output differs from plain greedy decoding where the target's dtype allows no difference."""


@dataclass
class Judgement:
    """Every emitted token of one output, judged on its own prefix against the float32 target's logits."""

    tokens: int = 0  # emitted tokens judged
    near_ties: int = 0  # tokens below the float32 maximum (not an argmax) but within the tolerance of it
    violations: int = 0  # tokens whose float32 logit lies more than the tolerance below the maximum
    max_gap: float = 0.0  # the largest float32 gap to the maximum of any emitted token
    first_violation: Optional[int] = None  # the new token's index of the first violation
    violation_gap: Optional[float] = None  # its float32 gap

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Verdict:
    """How one speculative output compares with plain greedy on the same prompt."""

    kind: str  # "exact", "tie" or "mismatch"
    position: Optional[int] = None  # first differing new token, None when exact
    reference_token: Optional[int] = None  # plain greedy's token there (None when its output ended)
    candidate_token: Optional[int] = None  # the speculative output's token there (None when it ended)
    gap: Optional[float] = None  # largest float32 gap of the two tokens to the maximum logit
    judged: Optional[Judgement] = None  # every emitted token judged (half precisions), None under the bitwise rule

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["judged"] = self.judged.as_dict() if self.judged is not None else None
        return out


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


@torch.no_grad()
def row_verdicts(
    model, prompts: torch.Tensor, mask: torch.Tensor, reference: torch.Tensor, candidate: torch.Tensor, tolerance: float
) -> list:
    """[`classify_outputs`] of each row of a batch: `reference` and `candidate` `(B, L + n)` are two greedy outputs of
    the prompts `prompts` `(B, L)` (left-padded, `mask` 0 on padding); a difference is judged on `model`'s own float32
    logits after the shared prefix (one full forward)."""

    def logits_fn(ids):
        return model(ids).logits[0, -1].float()

    width = prompts.shape[1]
    return [
        classify_outputs(
            logits_fn, prompts[row][mask[row].bool()], reference[row, width:], candidate[row, width:], tolerance
        )
        for row in range(prompts.shape[0])
    ]


def float32_logits_fn(load_float32_target: Callable[[], "torch.nn.Module"]) -> Callable[[torch.Tensor], torch.Tensor]:
    """
    Next-token logits of the target in float32, from a model loaded on first use (most runs never diverge).

    Args:
        load_float32_target (`Callable`): returns the target with float32 weights, e.g. loaded again from its
            checkpoint (casting a bf16 copy back to float32 would keep the bf16 rounding of the weights).
    """
    cache = {}

    def model():
        if "model" not in cache:
            loaded = load_float32_target()
            if loaded.dtype != torch.float32:
                raise ValueError(f"expected a float32 target for the tie check, got {loaded.dtype}")
            cache["model"] = loaded.eval()
        return cache["model"]

    def last_rows(ids: torch.Tensor, count: int) -> torch.Tensor:
        """The float32 next-token logits after each of the last `count` prefixes of `ids` `(1, L)`: `(count, V)`,
        from one forward."""
        target = model()
        keep = {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
        with torch.no_grad():
            out = target(input_ids=ids.to(target.device), **keep)
        return out.logits[0, -count:].float().cpu()

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return last_rows(ids, 1)[0]

    logits.last_rows = last_rows
    return logits


def teacher_forced_logits(logits_fn: Callable, prompt_ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The float32 next-token logits at every prefix of `output`: row i follows `prompt_ids + output[:i]`, `(n, V)`.

    One forward over `prompt + output[:-1]` when `logits_fn` has `last_rows` (as [`float32_logits_fn`]'s does),
    else one call of `logits_fn` per prefix.
    """
    n = len(output)
    ids = torch.cat([prompt_ids.cpu(), output[: max(n - 1, 0)].cpu()])[None]  # (1, P + n - 1)
    if n == 0:
        return torch.empty(0, 0)
    last_rows = getattr(logits_fn, "last_rows", None)
    if last_rows is not None:
        return last_rows(ids, n)
    start = ids.shape[1] - n + 1
    return torch.stack([logits_fn(ids[:, : start + i]).float() for i in range(n)])


@torch.no_grad()
def judge_tokens(
    logits_fn: Callable,
    prompt_ids: torch.Tensor,
    output: torch.Tensor,
    tolerance: float = DEFAULT_TIE_TOLERANCE,
    logits: Optional[torch.Tensor] = None,
) -> Judgement:
    """
    Judges every emitted token of `output` on its own prefix: its float32 logit must lie within `tolerance` of the
    float32 maximum after `prompt_ids + output[:i]`.

    Args:
        logits_fn (`Callable`): the target's float32 logits (see [`teacher_forced_logits`]).
        prompt_ids (`torch.LongTensor` of shape `(P,)`): the prompt.
        output (`torch.LongTensor` of shape `(n,)`): the new tokens, as decoded.
        tolerance (`float`, *optional*, defaults to `DEFAULT_TIE_TOLERANCE`): largest float32 gap still a near-tie.
        logits (`torch.Tensor` of shape `(n, V)`, *optional*): [`teacher_forced_logits`] already computed.

    Returns:
        [`Judgement`]: tokens judged, near-ties, violations and the first violation.
    """
    if tolerance < 0:
        raise ValueError(f"expected a tie tolerance >= 0, got {tolerance}")
    n = len(output)
    if n == 0:
        return Judgement()
    if logits is None:
        logits = teacher_forced_logits(logits_fn, prompt_ids, output)
    if logits.shape[0] != n:
        raise ValueError(f"expected float32 logits for each of the {n} new tokens, got {tuple(logits.shape)}")
    tokens = output.cpu().long()
    top = logits.max(-1).values  # (n,)
    gaps = top - logits.gather(1, tokens[:, None])[:, 0]  # (n,) >= 0; 0: the token is (one of) the argmax
    bad = gaps > tolerance
    near = (gaps > 0) & ~bad
    first = int(bad.nonzero()[0]) if bad.any() else None
    return Judgement(
        tokens=n,
        near_ties=int(near.sum()),
        violations=int(bad.sum()),
        max_gap=float(gaps.max()),
        first_violation=first,
        violation_gap=float(gaps[first]) if first is not None else None,
    )


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
    memo: Optional[dict] = None,
) -> Verdict:
    """
    Judges a speculative output against plain greedy by the rule of the target's dtype, and fails on a mismatch.

    float32: the output must equal plain greedy's token for token. Half precisions: every emitted token is judged on
    its own prefix ([`judge_tokens`], one float32 forward over prompt + output), and the first divergence from plain
    greedy must be a tie ([`classify_outputs`], read from the same forward). Pass `candidate = reference` to judge
    plain greedy's own output.

    Args:
        prompt_ids (`torch.LongTensor` of shape `(P,)`): the prompt.
        reference (`torch.LongTensor` of shape `(n,)`): plain greedy's new tokens.
        candidate (`torch.LongTensor` of shape `(m,)`): the speculative output's new tokens.
        dtype (`torch.dtype`): the target's dtype; float32 is held to bitwise equality, any other to equality up
            to numerical ties, every token judged.
        logits_fn (`Callable`, *optional*): the target's float32 next-token logits (see [`classify_outputs`]);
            required unless `dtype` is float32.
        tolerance (`float`, *optional*, defaults to `DEFAULT_TIE_TOLERANCE`): largest float32 logit gap still a tie.
        label (`str`, *optional*, defaults to `"the output"`): what the error message calls the candidate.
        memo (`dict`, *optional*): verdicts already reached for this prompt and reference, by candidate tokens; an
            output several methods share is teacher-forced once.

    Returns:
        [`Verdict`]: `exact`, or `tie` (never `mismatch`), with `judged` counts in half precisions.

    Raises:
        `LosslessError`: the outputs differ in float32; in a half precision, an emitted token lies beyond the
        tolerance at its own prefix, or the first divergence from plain greedy is no tie.
    """
    strict = strict_for(dtype)
    if not strict and logits_fn is None:
        raise ValueError(f"expected a float32 logits_fn to judge ties of a {dtype} target, got None")
    if strict:
        if torch.equal(reference, candidate):
            return Verdict("exact")
        verdict = Verdict("mismatch", first_difference(reference, candidate))
        raise LosslessError(_mismatch_message(verdict, reference, candidate, dtype, tolerance, label))
    key = tuple(candidate.tolist())
    if memo is not None and key in memo:
        return memo[key]
    logits = teacher_forced_logits(logits_fn, prompt_ids, candidate)  # (m, V): one float32 forward
    judged = judge_tokens(logits_fn, prompt_ids, candidate, tolerance, logits=logits)
    if judged.violations:
        raise LosslessError(_violation_message(judged, candidate, tolerance, label))
    if torch.equal(reference, candidate):
        verdict = Verdict("exact", judged=judged)
    else:
        at = first_difference(reference, candidate)
        row = logits[at] if at < len(candidate) else None  # the shared prefix's logits
        verdict = classify_outputs(lambda ids: row, prompt_ids, reference, candidate, tolerance)
        verdict.judged = judged
    if verdict.kind == "mismatch":
        raise LosslessError(_mismatch_message(verdict, reference, candidate, dtype, tolerance, label))
    if memo is not None:
        memo[key] = verdict
    return verdict


def _violation_message(judged: Judgement, candidate, tolerance: float, label: str) -> str:
    at = judged.first_violation
    return (
        f"expected every token of {label} within {tolerance} float32 logits of the target's maximum at its own "
        f"prefix, got {judged.violations} of {judged.tokens} beyond it; the first at new token {at} "
        f"({candidate[at : at + 5].tolist()}): float32 logit gap {judged.violation_gap:.3f} > tolerance {tolerance}"
    )


def _mismatch_message(verdict: Verdict, reference, candidate, dtype, tolerance: float, label: str) -> str:
    at = verdict.position
    rule = "bitwise" if strict_for(dtype) else "up to numerical ties"
    message = (
        f"expected {label} to reproduce plain greedy decoding ({dtype}, {rule}), got a difference at new token {at} "
        f"({candidate[at : at + 5].tolist()} vs plain {reference[at : at + 5].tolist()}; lengths {len(candidate)} vs "
        f"{len(reference)})"
    )
    if verdict.gap is not None:
        message += f" that is no tie: float32 logit gap {verdict.gap:.3f} > tolerance {tolerance}"
    return message
