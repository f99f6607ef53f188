"""Wall-clock timing that waits for the accelerator (the costs behind the measured budget and the benchmark).

On a GPU a forward returns as soon as its kernels are queued; reading the clock without waiting times the launches,
not the work. Every clock read here first synchronizes the accelerator, as `torch.utils.benchmark.Timer` does
(which is not used directly: each `timeit` call runs two extra warm-up calls, too many for forwards that take
hundreds of milliseconds on a CPU).
"""

import statistics
import time
from collections.abc import Callable

import torch


def clock() -> float:
    """`time.perf_counter()` after the current accelerator (if any) has finished its queued work."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    return time.perf_counter()


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
