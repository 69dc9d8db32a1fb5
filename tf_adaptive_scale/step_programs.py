"""Two compiled programs for a per-layer step: measuring and plain.

A per-layer step takes the statistics of every activation gradient at its
boundaries (`gradient_scale`) only on the steps its optimizer measures,
every `update_every`; every other step needs only the boundaries'
multiplies. The statistics are left out of a program, not skipped inside
it: a conditional in the compiled step waits on the host on a GPU, and a
select computes both sides. So a training loop traces two programs, the
measuring one and the plain one, and chooses one per call on the host from
a step count it keeps itself: read from the optimizer once, when the
count starts (a `fit`), never in the steps.

- `measuring(flag)`: steps traced inside take the statistics (True, also
  the default outside any) or leave them out (False).
- `Schedule`: which calls measure.
- `ScheduledPrograms`: a step callable that runs the program a call needs,
  each traced on its first use (the first step compiles one program).

The optimizer decides on the device which steps of a measuring call measure
(on schedule, and sooner after an overflow or while a unit's scale rises
blind): the first steps all measure, for the scales to calibrate; after
them, a request to measure sooner waits on the device for the next
measuring call, at most `update_every - 1` steps.
"""

import contextlib
import math

from tf_adaptive_scale import float16
from tf_adaptive_scale import scale_policy

_measuring = [True]
# The first steps all measure: a unit that sees nothing rises
# `UNSEEN_STEP` binades per measurement, so that many sweep it from a scale
# of 1 to the largest per-layer one (2**64), as the optimizer asks.
CALIBRATION_STEPS = math.ceil(float16.PER_LAYER_MAX_EXPONENT / scale_policy.UNSEEN_STEP)


@contextlib.contextmanager
def measuring(flag):
    """Steps traced inside take the per-layer statistics (`flag` True) or
    leave them out (False).

    Args:
        flag: bool.

    Example:

    >>> @tf.function(jit_compile=True)
    ... def train_step(x, y, measure):  # a Python bool: a trace each
    ...     with tas.measuring(measure):
    ...         ...  # the forward pass, gradients and `optimizer.apply`
    >>> for step, (x, y) in enumerate(batches):
    ...     train_step(x, y, tas.measuring_step(step, optimizer.update_every))
    """
    _measuring.append(bool(flag))
    try:
        yield
    finally:
        _measuring.pop()


def is_measuring():
    """Whether the step being traced takes the per-layer statistics."""
    return _measuring[-1]


def measuring_step(step, update_every):
    """Whether a custom loop's step `step` runs the measuring program: the
    first `CALIBRATION_STEPS` steps and every `update_every`-th (a resumed
    loop counts from the optimizer's `total_steps`).

    Args:
        step: int, the step's number.
        update_every: The optimizer's `update_every`.

    Returns:
        bool.
    """
    return step < CALIBRATION_STEPS or step % update_every == 0


class Schedule:
    """Which calls of a compiled step measure, counted on the host: those
    holding a step `measuring_step` names.

    Args:
        every: Steps between two measurements (the optimizer's
            `update_every`).
        steps_per_call: Micro-batches one call runs (`steps_per_execution`):
            a call measures when one of their steps is due, all of them then
            taking the statistics.
        micro_batches: Micro-batches per optimizer step (its
            `accumulation_steps`, where each call is one micro-batch): a
            measuring step's micro-batches all measure.
        start: `start()`, the micro-batches taken before the first call (a
            resumed run's, read once on the host: `micro_batches_taken`).
    """

    def __init__(self, every, steps_per_call=1, micro_batches=1, start=lambda: 0):
        self.every = int(every)
        self.steps_per_call = int(steps_per_call)
        self.micro_batches = int(micro_batches)
        self._start = start
        self.micro_batch = None

    def restart(self, micro_batch):
        """Counts on from `micro_batch` (a `fit` after a restore)."""
        self.micro_batch = micro_batch

    def next_call_measures(self):
        """Whether the next call measures; counts its micro-batches."""
        if self.every == 1:
            return True
        if self.micro_batch is None:
            self.micro_batch = self._start()
        first, self.micro_batch = self.micro_batch, self.micro_batch + self.steps_per_call
        return any(measuring_step(b // self.micro_batches, self.every)
                   for b in range(first, self.micro_batch))


class ScheduledPrograms:
    """Calls the measuring program or the plain one, as `schedule` says.

    Args:
        make: `make()`, a new step function (a `tf.function` or a jitted
            JAX function); traced on its first call, under `measuring`.
        schedule: A `Schedule`.
    """

    def __init__(self, make, schedule):
        self._make = make
        self.schedule = schedule
        self.programs = {}

    def program(self, measures):
        """The measuring (`measures` True) or the plain step function."""
        if measures not in self.programs:
            self.programs[measures] = self._make()
        return self.programs[measures]

    def run(self, measures, *args, **kwargs):
        """Calls the measuring (`measures` True) or the plain program."""
        with measuring(measures):
            return self.program(measures)(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.run(self.schedule.next_call_measures(), *args, **kwargs)
