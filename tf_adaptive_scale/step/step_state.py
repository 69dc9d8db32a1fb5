"""The optimizer's step state, in fixed-size variables.

The scale's state (`scale_policy.ScaleState`: scale, cap, growth count,
overflow streak, measurement countdown, calibration) and the step counters:
read into a `ScaleState` before a step, written from the policy's next one
after it.
"""

import numpy as np
from keras import ops

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.rules import scale_policy
from tf_adaptive_scale.rules.optimizer_state import StateVariable


def declared(num_variables):
    """The step state's variables (`optimizer_state.StateVariable`s).

    Args:
        num_variables: How many variables the optimizer trains.
    """
    counter = backends.COUNTER_DTYPE  # int64 on TF, as stock's (checkpoints)
    return (
        StateVariable("step_counter", 0, dtype=counter),
        StateVariable("overflow_streak", 0, dtype="int32"),
        StateVariable("scale_ceiling", 2.0**float16.NO_CAP_EXPONENT),
        StateVariable("steps_to_measure", 0, dtype="int32"),
        StateVariable("calibrated", False, dtype="bool"),
        StateVariable("total_steps", 0, dtype=counter),
        StateVariable("skipped_steps", 0, dtype=counter),
        StateVariable("consecutive_skips", 0, dtype=counter),
        StateVariable("last_loss_finite", True, dtype="bool"),
        # 1 where the last skipped step's gradient of a variable was not finite.
        StateVariable("non_finite_gradients", 0.0, shape=(num_variables,)),
        StateVariable("last_step_finite", True, dtype="bool"),
    )


class StepState:
    """Reads and writes the declared step state.

    Args:
        variables: The variables of `declared(...)`, by name.
        loss_scale: The optimizer's scale variable (made before `build`).
    """

    def __init__(self, variables, loss_scale):
        self.__dict__.update(vars(variables))
        self.loss_scale = loss_scale

    def scale_state(self):
        """The `ScaleState` the step runs with."""
        return scale_policy.ScaleState(
            log2_scale=ops.round(ops.log2(self.loss_scale.value)),
            log2_ceiling=ops.round(ops.log2(self.scale_ceiling.value)),
            growth_count=self.step_counter.value,
            overflow_streak=self.overflow_streak.value,
            steps_to_measure=self.steps_to_measure.value,
            calibrated=self.calibrated.value,
        )

    def note_non_finite(self, finite, finite_each, rows):
        """On a skipped step, flags the variables (at `rows`) whose gradient
        was not finite; an applied step keeps the last skipped one's flags."""
        flags = self.non_finite_gradients
        # A gather at constant positions (a row missing from `rows` reads the
        # appended 0), which XLA fuses with the select; a scatter into zeros
        # took three kernels.
        positions = np.full(flags.shape, len(rows))
        positions[list(rows)] = np.arange(len(rows))
        noted = ops.take(ops.concatenate(
            [ops.cast(ops.logical_not(finite_each), "float32"), ops.zeros((1,))]), positions)
        flags.assign(ops.where(finite, flags.value, noted))

    def write(self, state, applied, loss_finite):
        """Writes the policy's next `state` and counts the step (a skipped
        one is counted in the step's skip branch).

        Args:
            state: The next `ScaleState`.
            applied: bool, the step was applied.
            loss_finite: bool, its loss was finite.
        """
        self.loss_scale.assign(stats.pow2(state.log2_scale))
        self.scale_ceiling.assign(stats.pow2(state.log2_ceiling))
        self.step_counter.assign(state.growth_count)
        self.overflow_streak.assign(state.overflow_streak)
        self.steps_to_measure.assign(state.steps_to_measure)
        self.calibrated.assign(state.calibrated)
        self.total_steps.assign_add(1)
        self.last_step_finite.assign(applied)
        self.last_loss_finite.assign(loss_finite)
        self.consecutive_skips.assign(
            ops.where(applied, 0, self.consecutive_skips.value + 1)
        )
