"""A public round hook: what each round of a tree-decoding call did and how long each of its phases took
(`docs/design.md`, "§2 The round"; `docs/generate-arguments.md`, "The round hook").

    records = []
    target.generate(**inputs, assistant_model=head, jetspec_round_hook=records.append)

`generate` calls the hook once per round, after the round, with a [`RoundRecord`]. A call with a hook times its
rounds through `timing.RoundClock` (device events on an accelerator, read once at the round's end; the CPU clock
on a CPU); a call without one times nothing it does not need. The hook changes no token.

The phases, in order, each ending where the next begins:

- `draft`: the round's start (its budget, the rows' histories) up to the end of the head's block forward;
- `tree`: the best-first trees built from the head's candidates (one host read), the model-free branch merged in,
  the trees' tensors (with `path_conditioning`, its second head forward falls here too);
- `verify`: the verifier's forward over the trees, the verify mask included;
- `accept`: the target's choices matched against the trees;
- `commit`: the acceptance read back (one host read), the tokens committed through the stopping criteria;
- `compact`: finished rows leave, the caches keep the accepted nodes, the columns no row reads are reclaimed.

Host reads are not counted here: counting them takes a `TorchFunctionMode` over every torch call of the round
(`jetspec.host_reads.HostReadCounter`), which a hook can pair with its records (read the counter's `total` in the
hook) where that cost is acceptable.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("draft", "tree", "verify", "accept", "commit", "compact")
FORWARD_PHASES = ("draft", "verify")  # the phases that hold the round's two forwards (head, target)


@dataclass(frozen=True)
class RoundRecord:
    """One round of a tree-decoding call, as `jetspec_round_hook` receives it (module docstring).

    Args:
        index (`int`): the round's number in the call, from 0.
        rows (`int`): A, the rows decoding in the round.
        budget (`int`): the draft nodes per tree the round asked for.
        nodes (`list[int]`): (A,) each row's draft nodes, before any padding to the round's size (a model-free
            branch may add nodes beyond the budget).
        accepted (`list[int]`): (A,) each row's accepted draft nodes (the bonus token not counted).
        tokens (`int`): tokens the round committed, all rows (the stopping criteria may cut a path).
        target_forwards (`int`): target forwards the round's verifier ran (one for a tree verify).
        phases (`dict[str, float]`): seconds of each phase of [`PHASES`], on the device's timeline.
        state (`RoundState`, *optional*): the round state after the round (`state.RoundState`; the static path's
            `static.StaticState`), for instrumentation that reads the caches (their width, their bytes). Read it
            inside the hook only: the next round reuses its buffers. Not part of the record's `repr` or equality.
    """

    index: int
    rows: int
    budget: int
    nodes: list
    accepted: list
    tokens: int
    target_forwards: int
    phases: dict
    state: object = field(default=None, repr=False, compare=False)

    @property
    def seconds(self) -> float:
        """The whole round."""
        return sum(self.phases.values())

    @property
    def outside_forwards_seconds(self) -> float:
        """The round outside its `draft` and `verify` phases (the head's and the target's forwards)."""
        return self.seconds - sum(self.phases[name] for name in FORWARD_PHASES)


def check_round_hook(hook) -> Callable | None:
    """`hook` when it is `None` or callable; a `ValueError` otherwise (raised before any forward)."""
    if hook is not None and not callable(hook):
        raise ValueError(
            f"expected jetspec_round_hook to be a callable taking a RoundRecord, got {type(hook).__name__} {hook!r}"
        )
    return hook
