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
blind). Each call also returns the device's request to measure the next
step (`REQUEST`, see `with_request`); the host reads a call's request once
the next call is dispatched, so that the device never waits for it, and
runs the measuring program on the call after: a request made between two
scheduled measurements is served two steps later, not at the next
scheduled one.
"""

import contextlib
import math

from keras import ops

from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.rules import scale_policy

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


# The key of a step's outputs that carries the device's request to measure
# the next step; `ScheduledPrograms` takes it out before a caller sees them.
REQUEST = "measure_requested"


def requested(flags):
    """Whether any of the `measure` flags (of the `ScaleTable`s a step
    drives, their variables or values) asks the next step to measure, as a
    float32 scalar for the step's outputs."""
    flags = [ops.cast(f, "float32") for f in flags]
    # One table's flag as it is: a reduction would be a kernel of its own.
    return flags[0] if len(flags) == 1 else ops.max(ops.stack(flags))


def with_request(outputs, request):
    """A step's outputs with `request` (see `requested`) under `REQUEST`:
    `outputs` a dict of logs, or Keras's JAX `(logs, state)`."""
    if isinstance(outputs, tuple):
        logs, *rest = outputs
        return ({**logs, REQUEST: request}, *rest)
    return {**outputs, REQUEST: request}


class Schedule:
    """Which calls of a compiled step measure, counted on the host: those
    holding a step `measuring_step` names, or the step the device asked for
    (`ask`), after which the count restarts, as the device's does.

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
        self._phase = 0  # of the scheduled steps, moved by a request

    def restart(self, micro_batch):
        """Counts on from `micro_batch` (a `fit` after a restore)."""
        self.micro_batch = micro_batch

    def ask(self):
        """The device asked to measure: the first step no call has begun
        yet measures (all its micro-batches), and the schedule counts
        `every` steps from it."""
        self._phase = -(-self.micro_batch // self.micro_batches) % self.every

    def next_call_measures(self):
        """Whether the next call measures; counts its micro-batches."""
        if self.every == 1:
            return True
        if self.micro_batch is None:
            self.micro_batch = self._start()
        first, self.micro_batch = self.micro_batch, self.micro_batch + self.steps_per_call
        return any(self._due(b // self.micro_batches) for b in range(first, self.micro_batch))

    def _due(self, step):
        return step < CALIBRATION_STEPS or (step - self._phase) % self.every == 0


class ScheduledPrograms:
    """Calls the measuring program or the plain one, as `schedule` says,
    and passes the device's requests (`REQUEST` among a call's outputs,
    taken out) to it one call late.

    Args:
        make: `make()`, a new step function (a `tf.function` or a jitted
            JAX function); traced on its first call, under `measuring`.
        schedule: A `Schedule`.
    """

    def __init__(self, make, schedule):
        self._make = make
        self.schedule = schedule
        self.programs = {}
        self._request = None  # the last call's, not read yet

    def program(self, measures):
        """The measuring (`measures` True) or the plain step function."""
        if measures not in self.programs:
            self.programs[measures] = self._make()
        return self.programs[measures]

    def run(self, measures, *args, **kwargs):
        """Calls the measuring (`measures` True) or the plain program;
        returns its outputs without `REQUEST`, which it keeps."""
        with measuring(measures):
            outputs = self.program(measures)(*args, **kwargs)
        self._request = _take_request(outputs)
        return outputs

    def __call__(self, *args, **kwargs):
        measures = self.schedule.next_call_measures()
        request = self._request
        outputs = self.run(measures, *args, **kwargs)
        # The call before's request, read now that this one is dispatched
        # (the device never waits for the host); a measuring call serves it.
        if request is not None and not measures and float(request) > 0:
            self.schedule.ask()
        return outputs


def _take_request(outputs):
    """Removes `REQUEST` from a call's outputs (a dict of logs, or Keras's
    JAX `(logs, state)`); returns it (None where absent)."""
    logs = outputs[0] if isinstance(outputs, tuple) else outputs
    return logs.pop(REQUEST, None) if isinstance(logs, dict) else None
