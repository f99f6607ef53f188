"""A `TrainerCallback` that times a run's optimizer steps: the wall clock at the start of training and at the end of
every step, the precision and compilation the trainer resolved, and seconds per step after the first steps (which
carry one-off costs: compilation, allocator warm-up, and with `group_by_length` the longest batch first).

    timer = StepTimer()
    run_trainer.main(argv, [timer])
    timer.seconds_per_step(skip=5)
"""

import time

from transformers import TrainerCallback

DEFAULT_SKIP = 5  # steps left out of the mean by default: the first ones carry one-off costs


class StepTimer(TrainerCallback):
    """Wall-clock time (`time.perf_counter`) at the start of training and at the end of every optimizer step.

    Attributes:
        start (`float` or `None`): when training began; `None` before `on_train_begin`.
        ends (`list[float]`): when each optimizer step ended, in order.
        precision (`str` or `None`): `"bf16 autocast"` or `"float32"`, as the trainer resolved the run's precision.
        compiled (`bool` or `None`): whether the trainer compiled the model (`torch_compile`).
    """

    def __init__(self):
        self.start, self.ends = None, []
        self.precision, self.compiled = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        self.precision = "bf16 autocast" if args.bf16 else "float32"
        self.compiled = bool(args.torch_compile)

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def seconds_per_step(self, skip: int = DEFAULT_SKIP) -> float:
        """Mean seconds of the steps after the first `skip`.

        Args:
            skip (`int`, *optional*, defaults to 5): leading steps left out; at least one step must remain.
        """
        if self.start is None:
            raise ValueError("expected a timed run (on_train_begin called), got a timer that never started")
        if not 0 <= skip < len(self.ends):
            raise ValueError(f"expected 0 <= skip < the {len(self.ends)} timed steps, got skip={skip}")
        steady = ([self.start] + self.ends)[skip:]
        return (steady[-1] - steady[0]) / (len(steady) - 1)

    def first_seconds(self, skip: int) -> float:
        """Seconds of the first `skip` steps (where compilation happens)."""
        if self.start is None or not 0 <= skip <= len(self.ends):
            raise ValueError(f"expected 0 <= skip <= the {len(self.ends)} timed steps of a started run, got {skip}")
        return ([self.start] + self.ends)[skip] - self.start
