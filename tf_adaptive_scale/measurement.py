"""The gradient statistics of measured steps, and how they are read.

Every `update_every` steps a finite step's unscaled gradients are measured in
one pass (`gradient_statistics.grouped_statistics`) into fixed-size optimizer
variables: the total exponent histogram, zero count and peak that the
adaptive rule reads, and per trainable variable a norm and a histogram for
monitoring. `Reading` is the one host-side view of them, what
`tas.ScaleMonitor` reports.
"""

import math
from typing import NamedTuple

import numpy as np
from keras import ops

from tf_adaptive_scale import backends
from tf_adaptive_scale import float16
from tf_adaptive_scale import gradient_scale
from tf_adaptive_scale import gradient_statistics as stats
from tf_adaptive_scale import keras_internals

# Packed per-replica (or per-micro-batch) measurement: histogram, zeros, peak.
PACKED_SIZE = float16.NUM_BINS + 2


class SkippedStepsError(RuntimeError):
    """Training skipped `max_consecutive_skips` steps in a row."""


class Reading(NamedTuple):
    """What the optimizer measured and counted, read on the host.

    Attributes:
        loss_scale: The global loss scale (1 per layer and without scaling).
        in_float16: Whether gradients are float16 (underflow applies).
        total_steps: Optimizer steps so far, applied or skipped (with
            accumulation, windows), restored with the optimizer's state.
        skipped_steps: Steps skipped so far.
        loss_finite: Whether the last step's loss was finite (as far as the
            optimizer learnt: Keras's JAX trainer does not tell it).
        clipped_steps: Applied steps on which clipping acted.
        measurements: Measured steps so far.
        measured_step: `total_steps` of the last measured step (-1: none).
        gradient_norm: Global norm of the last measured unscaled gradients
            (of a large gradient, estimated from its sample).
        layers: `{layer name: LayerStatistics}` of the last measured step,
            each layer's variables taken together.
    """

    loss_scale: float
    in_float16: bool
    total_steps: int
    skipped_steps: int
    loss_finite: bool
    clipped_steps: int
    measurements: int
    measured_step: int
    gradient_norm: float
    layers: dict


class Measurement:
    """The statistics variables, created through the optimizer's
    `_add_state` (so they are saved with it and read as its attributes), and
    the writes of a measured step.

    Args:
        add_state: `add_state(name, value, shape=(), dtype="float32")`, a
            new optimizer variable.
        num_variables: How many variables the optimizer trains.
        underflow_rate: The tolerated underflow fraction.
        criterion: `"count"` or `"mass"` (see `weights`).
    """

    def __init__(self, add_state, num_variables, underflow_rate, criterion):
        self.underflow_rate = underflow_rate
        self.criterion = criterion
        self.gradient_histogram = add_state("gradient_histogram", 0.0, shape=(float16.NUM_BINS,))
        self.gradient_zeros = add_state("gradient_zeros", 0.0)
        self.gradient_max = add_state("gradient_max", 0.0)
        self.underflow_fraction = add_state("underflow_fraction", 0.0)
        self.scale_window = add_state("scale_window", 0.0, shape=(2,))
        self.gradient_norm = add_state("gradient_norm", 0.0)
        self.variable_gradient_norms = add_state(
            "variable_gradient_norms", 0.0, shape=(num_variables,)
        )
        # Exact zeros per variable: float16 cannot tell a value lost to
        # underflow from a true zero (the monitor reads both).
        self.variable_gradient_zeros = add_state(
            "variable_gradient_zeros", 0.0, shape=(num_variables,)
        )
        self.variable_gradient_histograms = add_state(
            "variable_gradient_histograms", 0.0,
            shape=(num_variables, float16.NUM_BINS),
        )
        self.measurements = add_state("measurements", 0, dtype=backends.COUNTER_DTYPE)
        self.measured_step = add_state("measured_step", -1, dtype=backends.COUNTER_DTYPE)

    def weights(self, histogram):
        """The histogram the rule weighs: counts, or squared magnitudes."""
        if self.criterion == "mass":
            return stats.mass_histogram(histogram)
        return histogram

    @staticmethod
    def packed(grads, log2_scale):
        """One replica's (or micro-batch's) histogram, zero count and peak of
        its gradients at `2**log2_scale`: float16 underflow happens in each
        replica's gradients, before they are summed. Taken on every step
        (a conditional would cost more, see `record`)."""
        total = stats.grouped_statistics(
            grads, [0] * len(grads), 1, log2_scale, sample=stats.VARIABLE_SAMPLE
        )
        return ops.concatenate([total.histograms[0], total.zeros, total.max_abs])

    @staticmethod
    def statistics(unscaled):
        """Each unscaled gradient's statistics (`GroupStatistics`, a row per
        gradient), taken on every step from a sample of each
        (`gradient_statistics.VARIABLE_SAMPLE`) but for the exact peak."""
        return stats.grouped_statistics(
            unscaled, range(len(unscaled)), len(unscaled), sample=stats.VARIABLE_SAMPLE
        )

    def record(self, measured, each, rows, step, packed=None):
        """Where `measured`, records a finite step's gradient statistics
        (`statistics`), per variable (at `rows`) and in total; with several
        replicas or micro-batches the total histogram, zeros and peak are
        their own, combined (`packed`), the per-variable records those of
        the sum.

        Written by selects where `measured`, not in a conditional: a
        conditional in the compiled step makes XLA give its operands buffers
        and layouts of their own, and on a GPU waits on the host for its
        predicate.
        """
        total = each.total()
        histogram, max_abs, zeros = total.histograms, total.max_abs, total.zeros
        if packed is not None:
            histogram = packed[: float16.NUM_BINS]
            zeros, max_abs = ops.unstack(packed[float16.NUM_BINS :])
        norms = ops.sqrt(each.squares)

        def write(variable, value):
            variable.assign(ops.where(measured, value, variable.value))

        write(self.variable_gradient_histograms,
              _placed(self.variable_gradient_histograms.value, rows, each.histograms))
        write(self.variable_gradient_norms,
              _placed(self.variable_gradient_norms.value, rows, norms))
        write(self.variable_gradient_zeros,
              _placed(self.variable_gradient_zeros.value, rows, each.zeros))
        write(self.gradient_histogram, histogram)
        write(self.gradient_zeros, zeros)
        write(self.gradient_max, max_abs)
        write(self.gradient_norm, ops.sqrt(total.squares))
        write(self.scale_window, ops.stack(
            stats.scale_bounds(self.weights(histogram), max_abs, self.underflow_rate)
        ))
        self.measurements.assign_add(ops.cast(measured, self.measurements.dtype))
        write(self.measured_step, ops.cast(step, self.measured_step.dtype))

    def proposal(self, log2_headroom):
        """The adaptive rule's exponent from the last measurement, and
        whether it saw any nonzero value."""
        log2_scale, _, _ = stats.adaptive_log2_scale(
            self.weights(self.gradient_histogram.value),
            self.gradient_max.value, self.underflow_rate, log2_headroom,
        )
        return log2_scale, ops.sum(self.gradient_histogram.value) > 0

    def report_underflow(self, measured, log2_scale):
        """On a measured step, the underflow fraction at the scale the next
        steps use."""
        self.underflow_fraction.assign(ops.where(
            measured,
            stats.underflow_fraction(
                self.weights(self.gradient_histogram.value), log2_scale,
                zeros=self.gradient_zeros.value,
            ),
            self.underflow_fraction.value,
        ))


def _placed(old, rows, new):
    """`old` with its rows at `rows` (static ints) replaced by `new`'s, as
    one gather with constant indices (a scatter costs more on CPU)."""
    position = {row: i for i, row in enumerate(rows)}
    index = [position.get(row, len(rows) + row) for row in range(old.shape[0])]
    return ops.take(ops.concatenate([ops.cast(new, old.dtype), old], axis=0), index, axis=0)


class LayerStatistics(NamedTuple):
    """One layer's measured gradients, its variables taken together."""

    log2_scale: float  # the scale its gradients carried
    norm: float
    histogram: np.ndarray  # exponents of the nonzero finite unscaled values
    zeros: float  # exact zeros (true ones, or values lost to underflow)


def layers(scales, norms, histograms, zeros):
    """Per layer, its variables' statistics taken together.

    Args:
        scales: Per variable, `(layer name, log2 scale)` or None (not
            measured: an instrumented model's own statistics).
        norms: Per variable, its gradient norm.
        histograms: Per variable, its exponent histogram.
        zeros: Per variable, its number of exact zeros.

    Returns:
        `{layer name: LayerStatistics}`.
    """
    found = {}
    for scale, norm, histogram, zero in zip(scales, norms, histograms, zeros):
        if scale is None:
            continue
        name, log2_scale = scale
        # `norm` sums the squares until every variable is in.
        first = found.get(name, LayerStatistics(log2_scale, 0.0, 0.0, 0.0))
        found[name] = first._replace(norm=first.norm + float(norm) ** 2,
                                     histogram=first.histogram + histogram,
                                     zeros=first.zeros + float(zero))
    return {name: entry._replace(norm=math.sqrt(entry.norm)) for name, entry in found.items()}


def read(measured, loss_scale, total_steps, skipped_steps, loss_finite, clipped_steps,
         policy, scales):
    """A `Reading` of an optimizer's variables.

    Args:
        measured: The optimizer's `Measurement`.
        loss_scale: Its scale variable.
        total_steps: Its step counter (applied and skipped steps).
        skipped_steps: Its skipped-steps counter.
        loss_finite: Its flag of the last step's loss.
        clipped_steps: Its clipped-steps counter.
        policy: Its `scale_policy.Policy`, or None before the mode is known.
        scales: Its `gradient_scales()`.

    Returns:
        A `Reading`.
    """
    return Reading(
        loss_scale=float(loss_scale.numpy()),
        in_float16=policy is None or policy.in_float16,
        total_steps=int(total_steps.numpy()),
        skipped_steps=int(skipped_steps.numpy()),
        loss_finite=bool(loss_finite.numpy()),
        clipped_steps=int(clipped_steps.numpy()),
        measurements=int(measured.measurements.numpy()),
        measured_step=int(measured.measured_step.numpy()),
        gradient_norm=float(measured.gradient_norm.numpy()),
        layers=layers(
            scales, measured.variable_gradient_norms.numpy(),
            measured.variable_gradient_histograms.numpy(),
            measured.variable_gradient_zeros.numpy(),
        ),
    )


def gradient_scales(variables, tables, loss_scale):
    """Where each variable's gradient was scaled, and by what.

    Args:
        variables: The optimizer's trainable variables.
        tables: The instrumented models' `ScaleTable`s among them.
        loss_scale: The global scale variable.

    Returns:
        Per variable, `(layer name, log2 of the scale its gradient carries)`
        (per layer, its unit's name and scale), or None for an instrumented
        model's own statistics and scales.
    """
    global_log2 = math.log2(float(loss_scale.numpy()))
    tables = [(t, t.log2_scales.numpy()) for t in tables]
    scales = []
    for variable in variables:
        if gradient_scale.written_by_optimizer(variable):
            scales.append(None)
            continue
        path = getattr(variable, "path", variable.name)
        entry = (path.rsplit("/", 1)[0], global_log2)
        for table, log2 in tables:
            unit = table.unit_of(variable)
            if unit is not None:
                entry = (table.unit_names[unit], global_log2 + float(log2[unit]))
        scales.append(entry)
    return scales


def stalled_layers(non_finite, scales):
    """The layers whose flag in `non_finite` (per variable) is set, once
    each, in the variables' order."""
    names = []
    for flag, scale in zip(non_finite.numpy(), scales):
        if flag > 0 and scale is not None and scale[0] not in names:
            names.append(scale[0])
    return names


def stall_report(skips, step, limit, loss_finite, layers):
    """Why training stalled: `skips` consecutive skips up to `step`."""
    if not loss_finite:
        why = "the loss itself was not finite (bad data or a diverged model)"
    else:
        why = (
            "the gradients overflowed at every scale tried; non-finite "
            f"gradients in layers {layers}"
            + (f" (nearest the loss: '{layers[-1]}')" if layers else "")
        )
    return (
        f"{skips} consecutive steps skipped, up to step {step} "
        f"(max_consecutive_skips={limit}): {why}."
    )


class MeasurementReader:
    """Mixed into `AdaptiveLossScaleOptimizer`: the host-side reads of what
    it measured and counted (its `_measurement`, `_step_state` and scale
    tables)."""

    def read(self):
        """What the optimizer measured and counted, read on the host (all
        that `tas.ScaleMonitor` reports).

        Returns:
            A `Reading`.
        """
        return read(
            self._measurement, self.dynamic_scale, self._step_state.total_steps,
            self._step_state.skipped_steps, self._step_state.last_loss_finite,
            self.clipped_steps, self.policy,
            self.gradient_scales(),
        )

    def gradient_scales(self):
        """Per variable the optimizer was built for, `(layer name, log2 of the
        scale its gradient carries)` (per layer, its unit's), None for an
        instrumented model's own statistics; empty before `build`."""
        if not self.built:
            return []
        return gradient_scales(
            keras_internals.built_variables(self), self._scale_tables, self.dynamic_scale
        )

    def stalled_layers(self):
        """The layers whose gradients were not finite on the last skipped
        step, nearest the loss last."""
        return stalled_layers(
            self._step_state.non_finite_gradients, self.gradient_scales()
        )

    def check_progress(self):
        """Raises `SkippedStepsError`, saying why and where, after
        `max_consecutive_skips` consecutive skipped steps (for custom loops;
        in `fit`, `tas.ScaleMonitor` calls it).

        Raises:
            SkippedStepsError: When the limit is reached.
        """
        limit, state = self.max_consecutive_skips, getattr(self, "_step_state", None)
        skips = 0 if state is None else int(state.consecutive_skips.numpy())
        if limit is not None and skips >= limit:
            raise SkippedStepsError(stall_report(
                skips, int(state.total_steps.numpy()), limit,
                bool(state.last_loss_finite.numpy()), self.stalled_layers(),
            ))

    def micro_batches_taken(self):
        """Micro-batches taken so far, read on the host: steps (applied and
        skipped) times `accumulation_steps`, and the open window's. Where a
        step count kept on the host starts (`step_programs.Schedule`)."""
        if not self.built:
            return 0
        window = getattr(self, "_window", None)
        open_window = 0 if window is None else int(window.count.numpy())
        return int(self._step_state.total_steps.numpy()) * self.accumulation_steps + open_window

    def layer_scales(self):
        """The current per-layer scales by layer name (per-layer mode), as
        Python floats; empty before the first step."""
        scales = {}
        for table in getattr(self, "_scale_tables", []):
            scales.update(table.scales())
        return scales
