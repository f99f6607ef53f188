"""How a call's stopping criteria are judged in the tree loop (`docs/design.md`, "§2 The round").

[`stop_plan`] sorts a call's criteria: those whose verdict reads a row's last token alone (EOS, time) are judged on
the device for every accepted token of a round at once ([`stop_marks`]), a max length on the host; any other
criterion makes `steps.commit` check each committed token on its own.
"""

import functools

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from .state import Acceptance, Call

# transformers' stopping criteria whose verdict on a row reads that row's last token alone (or the clock), judged on
# the device for every accepted token at once; a `MaxLengthCriteria` reads only the length, judged on the host.
# Matched by exact type (a subclass may override `__call__`); any other criterion is checked after each token.
DEVICE_STOPS = (EosTokenCriteria, MaxTimeCriteria)


def stop_plan(stopping) -> tuple[list | None, int | None]:
    """`(device criteria, stop length)` of a call's stopping criteria (see `Call.device_stops`): `(None, None)`
    when some criterion must be checked after each committed token."""
    if any(type(c) not in (*DEVICE_STOPS, MaxLengthCriteria) for c in stopping):
        return None, None
    lengths = [c.max_length for c in stopping if type(c) is MaxLengthCriteria]
    return [c for c in stopping if type(c) in DEVICE_STOPS], min(lengths) if lengths else None


def stop_marks(call: Call, acc: Acceptance) -> torch.Tensor | None:
    """`(A, K)` bool: whether the device criteria stop a row after its k-th accepted token, or `None` when none is
    judged on the device."""
    return judged_alone(call.device_stops, acc.tokens) if call.device_stops else None


def judged_alone(criteria: list, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens`' shape, bool: whether any of `criteria` ([`DEVICE_STOPS`], which read a row's last token alone) stops
    a row that ends with each token; each criterion called once, on every token as a row of its own."""
    last = tokens.reshape(-1, 1)  # each token as the last one of its row
    return functools.reduce(torch.logical_or, [c(last, None) for c in criteria]).reshape(tokens.shape)
