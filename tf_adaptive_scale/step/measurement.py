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

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.backend import keras_internals
from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.rules.optimizer_state import StateVariable
from tf_adaptive_scale.step import layer_names

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
            (of a large gradient, estimated from its sample; NaN where a
            gradient went unmeasured, see `layers`).
        layers: `{layer name: LayerStatistics}` of the last measured step,
            each layer's variables taken together (`layers`).
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


def declared(num_variables):
    """The statistics' variables (`optimizer_state.StateVariable`s).

    Args:
        num_variables: How many variables the optimizer trains.
    """
    return (
        StateVariable("gradient_histogram", shape=(float16.NUM_BINS,)),
        StateVariable("gradient_zeros"),
        StateVariable("gradient_max"),
        StateVariable("underflow_fraction"),
        # Unread (the rule's window is `AdaptiveLossScaleOptimizer.scale_window`,
        # worked out when read); 0.1.0's files hold it.
        StateVariable("scale_window", shape=(2,), retired=True),
        StateVariable("gradient_norm"),
        StateVariable("variable_gradient_norms", shape=(num_variables,)),
        # Exact zeros per variable: float16 cannot tell a value lost to
        # underflow from a true zero (the monitor reads both).
        StateVariable("variable_gradient_zeros", shape=(num_variables,)),
        StateVariable("variable_gradient_histograms",
                      shape=(num_variables, float16.NUM_BINS)),
        StateVariable("measurements", 0, dtype=backends.COUNTER_DTYPE),
        StateVariable("measured_step", -1, dtype=backends.COUNTER_DTYPE),
    )


class Measurement:
    """The writes of a measured step to the declared statistics.

    Args:
        variables: The variables of `declared(...)`, by name.
    """

    def __init__(self, variables):
        self.__dict__.update(vars(variables))

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

        Returns:
            The `Latest` statistics, as written (the step's where measured).
        """
        if measured is False:  # known when traced: no write (not even of the old values)
            return self.latest()
        total = each.total()
        histogram, max_abs, zeros = total.histograms, total.max_abs, total.zeros
        if packed is not None:
            histogram = packed[: float16.NUM_BINS]
            zeros, max_abs = ops.unstack(packed[float16.NUM_BINS :])
        # NaN where unmeasured (`layers` leaves the layer out).
        norms = _norm(each)

        def write(variable, value):
            value = ops.where(measured, value, variable.value)
            variable.assign(value)
            return value

        write(self.variable_gradient_histograms,
              _placed(self.variable_gradient_histograms.value, rows, each.histograms))
        write(self.variable_gradient_norms,
              _placed(self.variable_gradient_norms.value, rows, norms))
        write(self.variable_gradient_zeros,
              _placed(self.variable_gradient_zeros.value, rows, each.zeros))
        latest = Latest(write(self.gradient_histogram, histogram),
                        write(self.gradient_zeros, zeros), write(self.gradient_max, max_abs))
        write(self.gradient_norm, _norm(total))
        self.measurements.assign_add(ops.cast(measured, self.measurements.dtype))
        write(self.measured_step, ops.cast(step, self.measured_step.dtype))
        return latest

    def latest(self):
        """The last measured step's `Latest` statistics (none this step)."""
        return Latest(self.gradient_histogram.value, self.gradient_zeros.value,
                      self.gradient_max.value)

    def report_underflow(self, measured, log2_scale, rule, latest):
        """On a measured step, the underflow fraction of the `latest`
        statistics at the scale the next steps use."""
        if measured is False:
            return
        self.underflow_fraction.assign(ops.where(
            measured,
            rule.underflow(latest.histogram, log2_scale, latest.zeros),
            self.underflow_fraction.value,
        ))


class Latest(NamedTuple):
    """The statistics of the last measured step that the rule reads."""

    histogram: object
    zeros: object
    max_abs: object


def _norm(statistics):
    """The norms of `GroupStatistics`, 0 only where the exact peak is (and
    NaN where its squares are: unmeasured): where the float32 squares of
    tiny values (below 2**-75) all underflow, the peak, the norm's lower
    bound, stands in."""
    squares = statistics.squares
    return ops.where(squares == 0, statistics.max_abs, ops.sqrt(squares))


def _placed(old, rows, new):
    """`old` with its rows at `rows` (static ints) replaced by `new`'s, as
    one gather with constant indices (a scatter costs more on CPU)."""
    if list(rows) == list(range(old.shape[0])):
        # Every row new (no overwritten variable): no gather of `old`, which
        # made XLA copy the variable before writing it in place.
        return ops.cast(new, old.dtype)
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
        norms: Per variable, its gradient norm (NaN: unmeasured, its sample
            saw none of its nonzero values).
        histograms: Per variable, its exponent histogram.
        zeros: Per variable, its number of exact zeros.

    Returns:
        `{layer name: LayerStatistics}`, but for the layers holding an
        unmeasured variable: nothing they would show is known.
    """
    found, unmeasured = {}, set()
    for scale, norm, histogram, zero in zip(scales, norms, histograms, zeros):
        if scale is None:
            continue
        name, log2_scale = scale
        if math.isnan(norm):
            unmeasured.add(name)
        # `norm` sums the squares until every variable is in.
        first = found.get(name, LayerStatistics(log2_scale, 0.0, 0.0, 0.0))
        found[name] = first._replace(norm=first.norm + float(norm) ** 2,
                                     histogram=first.histogram + histogram,
                                     zeros=first.zeros + float(zero))
    return {name: entry._replace(norm=math.sqrt(entry.norm))
            for name, entry in found.items() if name not in unmeasured}


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


def gradient_scales(variables, tables, loss_scale, names=None):
    """Where each variable's gradient was scaled, and by what.

    Args:
        variables: The optimizer's trainable variables.
        tables: The instrumented models' `ScaleTable`s among them.
        loss_scale: The global scale variable.
        names: Optional `{id(variable): layer name}` (`layer_names.of_model`
            of the model trained); a variable it lacks is named by its path
            (`layer_names.from_paths`).

    Returns:
        Per variable, `(layer name, log2 of the scale its gradient carries)`
        (per layer, its unit's name and scale), or None for an instrumented
        model's own statistics and scales.
    """
    global_log2 = math.log2(float(loss_scale.numpy()))
    tables = [(t, t.log2_scales.numpy()) for t in tables]
    names = names or {}
    measured = [v for v in variables if not gradient_scale.written_by_optimizer(v)]
    by_path = dict(zip(map(id, measured), layer_names.from_paths(measured)))
    scales = []
    for variable in variables:
        if gradient_scale.written_by_optimizer(variable):
            scales.append(None)
            continue
        entry = (names.get(id(variable), by_path[id(variable)]), global_log2)
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
