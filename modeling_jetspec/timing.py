"""Wall-clock timing that waits for the accelerator (the host costs behind `tree_budget="auto"`'s operating point,
`host_costs.py`, and the benchmark).

On a GPU a forward returns as soon as its kernels are queued; reading the clock without waiting times the launches,
not the work. [`clock`] first synchronizes the accelerator, as `torch.utils.benchmark.Timer` does (which is not
used directly: each `timeit` call runs two extra warm-up calls, too many for forwards that take hundreds of
milliseconds on a CPU). A round is timed only when something reads its times ([`timed_rounds`], which the host
costs' short call runs in, or a round hook, `round_hook.py`, which the benchmark passes): a synchronize stalls the
launch queue, so untimed rounds never read a clock that waits. [`RoundClock`] times a round through device events where
the device has them, read once at the round's end.
"""

import contextlib
import contextvars
import statistics
import time
from collections.abc import Callable

import torch

_TIMED = contextvars.ContextVar("jetspec_timed_rounds", default=False)


def clock() -> float:
    """`time.perf_counter()` after the current accelerator (if any) has finished its queued work."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def timed_rounds():
    """Inside this block every round of a tree-decoding call is timed (`JetSpecStats.verify_seconds`,
    `outside_verify_seconds`, and a synchronized `total_seconds`); outside it only a call with a round hook times its
    rounds (`round_hook.py`). `tree_budget="auto"` chooses its operating point before the rounds, from costs measured
    once (`host_costs.py`), so its own rounds are timed only as any other call's."""
    token = _TIMED.set(True)
    try:
        yield
    finally:
        _TIMED.reset(token)


def rounds_timed() -> bool:
    """Whether the current context asked for timed rounds ([`timed_rounds`])."""
    return _TIMED.get()


class RoundClock:
    """Marks inside one round, on `device`'s own timeline: device events on an accelerator (one synchronize, at
    [`intervals`]); on the CPU, whose work is done when its call returns, `time.perf_counter()` at each mark.

    Args:
        device (`torch.device`): where the round's work runs.
    """

    def __init__(self, device: torch.device):
        self.events = device.type not in ("cpu", "meta")
        self.device = device
        self.marks, self.names = [], []

    def mark(self, phase: str | None = None):
        """The time now; `phase` names what ends here (`None`: the round's start), for [`phases`]."""
        self.names.append(phase)
        if self.events:
            if self.device.type == "cuda":  # the Python class (its reads are visible to `jetspec.host_reads`)
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(self.device))
            else:
                event = torch.Event(device=self.device, enable_timing=True)
                event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list:
        """Seconds between consecutive marks."""
        if not self.events:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]

    def phases(self) -> dict:
        """`{phase: seconds}`: each interval under the name of the mark that ends it (a name marked twice adds up)."""
        spent = {}
        for name, seconds in zip(self.names[1:], self.intervals()):
            spent[name] = spent.get(name, 0.0) + seconds
        return spent


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed calls, accelerator work included.

    Args:
        fn (`Callable[[], object]`): the work to time; its result is discarded.
        repeats (`int`, *optional*, defaults to 5): timed calls, >= 1.
        warmup (`int`, *optional*, defaults to 1): untimed calls first (allocations, kernel selection), >= 0.

    Returns:
        `float`: seconds.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"expected repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)
