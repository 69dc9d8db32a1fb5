"""Gradient accumulation: one optimizer step per window of micro-batches.

Within a window the scale does not change, so the unscaled gradients of its
micro-batches are summed in float32, each times its weight (1, or its loss's
normaliser: `exact_accumulation`), and decided on once, divided by the sum
of the weights: one finite check, one apply or skip, one scale update. Their
statistics combine as those of replicas do: counts add up, peaks take the
largest.
"""

from keras import ops

from tf_adaptive_scale.backend import branching
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.rules.optimizer_state import StateVariable
from tf_adaptive_scale.step import measurement


def accumulate(total, value, is_statistics):
    """`total` with one more micro-batch's `value`: a gradient adds up in
    float32; an instrumented model's statistics combine as replicas' do
    (counts add up, peaks take the max)."""
    value = ops.cast(value, "float32")
    if is_statistics:
        return gradient_scale.combine_replicas(ops.stack([total, value]))
    return total + value


def declared(variables):
    """The window's variables (`optimizer_state.StateVariable`s, not read
    as the optimizer's attributes).

    Args:
        variables: The optimizer's trained variables, in its order.
    """
    return tuple(
        StateVariable(f"window_sum_{i}", shape=tuple(v.shape), readable=False)
        for i, v in enumerate(variables)
    ) + (
        StateVariable("window_measurement", shape=(measurement.PACKED_SIZE,), readable=False),
        StateVariable("window_count", 0, dtype="int32", readable=False),
        # The sum of the micro-batches' weights, which divides the sums.
        StateVariable("window_weight", readable=False),
        # Whether every micro-batch's loss so far was finite.
        StateVariable("window_loss_finite", True, dtype="bool", readable=False),
    )


class GradientWindow:
    """The optimizer state of a window: sums, statistics and a count.

    Args:
        state: The variables of `declared(variables)`, by name.
        variables: The optimizer's variables, in its order; an instrumented
            model's `statistics` variables are combined, the others summed.
        steps: Micro-batches per window, >= 2.

    Example:

    >>> window = GradientWindow(state, var_list, steps=4)
    >>> last = window.add({0: grad}, 1.0, [measurement], loss_finite)
    """

    def __init__(self, state, variables, steps):
        self.steps = steps
        self.is_statistics = [gradient_scale.table_of_statistics(v) is not None for v in variables]
        self.sums = [getattr(state, f"window_sum_{i}") for i in range(len(variables))]
        self.measurement = state.window_measurement
        self.count = state.window_count
        self.weight = state.window_weight
        self.loss_finite = state.window_loss_finite

    def add(self, values, weight, measurements, loss_finite):
        """Adds one micro-batch.

        Args:
            values: `{optimizer variable index: gradient or statistics}`,
                gradients already times `weight`.
            weight: The micro-batch's weight (a float32 scalar).
            measurements: The micro-batch's own packed histogram, zeros and
                peak (`gradient_statistics.combine_measurements`' rows), as a
                list: none where the mode measures otherwise (per layer).
            loss_finite: bool, this micro-batch's loss was finite.

        Returns:
            A boolean tensor: whether this micro-batch ends the window.
        """
        last = ops.equal(self.count + 1, self.steps)
        for i, value in values.items():
            self.sums[i].assign(
                accumulate(self.sums[i].value, value, self.is_statistics[i])
            )
        for measurement in measurements:
            self.measurement.assign(
                stats.combine_measurements(ops.stack([self.measurement.value, measurement]))
            )
        self.count.assign_add(1)
        self.weight.assign_add(ops.cast(weight, "float32"))
        self.loss_finite.assign(ops.logical_and(self.loss_finite.value, loss_finite))
        return last

    def add_and_decide(self, values, weight, measurements, loss_finite, decide):
        """Adds one micro-batch (see `add`); on the window's last, calls
        `decide(contents, measurements, loss_finite)` for the whole window
        (`contents` as the method below: each replica reads its own copy of
        the sums) and empties the window.
        """
        last = self.add(values, weight, measurements, loss_finite)

        def run():
            # The window's combined measurement, where micro-batches gave one.
            decide(self.contents, [self.measurement.value] if measurements else [],
                   self.loss_finite.value)
            self.reset()

        branching.cond(last, run, lambda: None)

    def contents(self, index):
        """The window's weighted mean gradient, or combined statistics, of
        the variable at `index` (a window whose weights are all 0, every
        entry masked, has a zero gradient)."""
        total = self.sums[index].value
        return total if self.is_statistics[index] else ops.divide_no_nan(total, self.weight.value)

    def reset(self):
        for total in self.sums:
            total.assign(ops.zeros(total.shape))
        self.measurement.assign(ops.zeros(self.measurement.shape))
        self.count.assign(0)
        self.weight.assign(0.0)
        self.loss_finite.assign(True)
