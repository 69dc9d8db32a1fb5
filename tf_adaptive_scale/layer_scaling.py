"""The per-layer update rule and overflow attribution, on a `ScaleTable`'s
statistics (see `gradient_scale`): pure functions of tensors, and
`TableStep`, which applies them to one table's variables during an
optimizer step."""

from keras import ops

from tf_adaptive_scale import gradient_scale as boundary
from tf_adaptive_scale import gradient_statistics as stats

# Binades a unit's scale rises when it saw no nonzero gradient at all.
UNSEEN_STEP = 8.0
# Binades a unit's scale falls when its own weight gradient overflowed.
WEIGHT_OVERFLOW_STEP = 4.0


def per_unit_max(values, units, num_units):
    """The max of `values` (one per variable) within each unit, 0 if none.

    Args:
        values: float32 vector, one entry per variable.
        units: int list, the unit of each variable.
        num_units: Number of units.

    Returns:
        float32 vector `(num_units,)`.
    """
    peak = ops.segment_max(
        values, ops.array(units, "int32"), num_segments=num_units
    )
    return ops.maximum(peak, 0.0)


def layer_log2_scales(
    statistics, weight_max, log2_scales, log2_ceilings, underflow_rate,
    log2_headroom, log2_min, log2_max, weigh=None, max_rise=None,
):
    """Each unit's new scale exponent by the adaptive rule.

    A unit's histogram covers its output gradients and the input gradients
    its backward produced; its largest value is the largest of those and of
    its weight gradients (all unscaled), since all are held at its scale.

    Args:
        statistics: `(units, NUM_COLUMNS)` statistics of one backward pass.
        weight_max: `(units,)` largest unscaled weight gradient per unit.
        log2_scales: `(units,)` current exponents.
        log2_ceilings: `(units,)` caps lowered by overflows.
        underflow_rate: Tolerated underflowing fraction.
        log2_headroom: Exponent of the headroom.
        log2_min: Exponent of the smallest scale.
        log2_max: Exponent of the largest scale.
        weigh: Optional `weigh(histogram)` giving the weights the underflow
            fraction is taken over (e.g. `gradient_statistics.mass_histogram`);
            by default the counts.
        max_rise: Optional most binades a scale may rise.

    Returns:
        `(units,)` float32 exponents; the loss unit stays at 0 and a unit
        whose gradient was all zero rises by `UNSEEN_STEP` binades.
    """
    histogram = statistics[:, : stats.NUM_BINS]
    peak = ops.maximum(
        ops.maximum(
            statistics[:, boundary.OUTPUT_MAX], statistics[:, boundary.INPUT_MAX]
        ),
        weight_max,
    )
    weights = histogram if weigh is None else weigh(histogram)
    chosen, _, _ = stats.adaptive_log2_scale(
        weights, peak, underflow_rate, log2_headroom
    )
    # All-zero gradients may have underflowed entirely: raise the scale.
    chosen = ops.where(
        ops.sum(histogram, axis=-1) > 0, chosen, log2_scales + UNSEEN_STEP
    )
    return _keep_loss_unit(
        stats.bounded_log2_scale(
            chosen, log2_scales, log2_ceilings, log2_min, log2_max, max_rise
        )
    )


def overflow_origins(statistics, weight_non_finite):
    """The units where a non-finite gradient started.

    A unit is an origin when converting a finite gradient to its scale
    overflowed, or when its own backward pass (input or weight gradients)
    produced non-finite values from a finite output gradient. Where no unit
    can be blamed (e.g. the loss itself is not finite), all are.

    Args:
        statistics: `(units, NUM_COLUMNS)` statistics of the skipped step.
        weight_non_finite: `(units,)` whether a weight gradient of the unit
            was non-finite.

    Returns:
        `(units,)` bool, False for the loss unit.
    """
    produced = ops.logical_or(
        statistics[:, boundary.PRODUCED_NON_FINITE] > 0, weight_non_finite
    )
    received = statistics[:, boundary.RECEIVED_NON_FINITE] > 0
    origins = ops.logical_or(
        statistics[:, boundary.CONVERSION_OVERFLOW] > 0,
        ops.logical_and(produced, ops.logical_not(received)),
    )
    origins = _keep_loss_unit(origins, False)
    return ops.where(ops.any(origins), origins, _keep_loss_unit(origins | True, False))


def _keep_loss_unit(values, loss_value=0.0):
    is_loss = ops.arange(values.shape[0]) == boundary.LOSS_UNIT
    return ops.where(is_loss, loss_value, values)


class TableStep:
    """One optimizer step's work on one instrumented model's `ScaleTable`.

    Args:
        table: The `ScaleTable`.
        statistics: The statistics its boundaries returned this step, summed
            over replicas.
        members: `(position, unit)` pairs: where each of the table's weights
            sits in the step's gradient list, and its unit.
        rule: `rule(statistics, weight_max, log2_scales, log2_ceilings)`, the
            bounded adaptive rule (see `layer_log2_scales`).
        log2_min: Exponent of the smallest scale.
        log2_max: Exponent of the largest scale.

    Example:

    >>> step = TableStep(table, statistics, [(0, 1), (1, 1)], rule, -16.0, 24.0)
    """

    def __init__(self, table, statistics, members, rule, log2_min, log2_max):
        self.table = table
        self.statistics = statistics
        self.positions = [p for p, _ in members]
        self.units = [u for _, u in members]
        self.rule = rule
        self.log2_min = log2_min
        self.flags = statistics[:, boundary.PRODUCED_NON_FINITE :]
        self.measured = table.measure > 0
        # A unit whose gradient all underflowed rises UNSEEN_STEP binades per
        # measurement; measure again at once until it sees values or its cap.
        empty = ops.sum(statistics[:, : stats.NUM_BINS], axis=-1) == 0
        below_cap = table.log2_scales < ops.minimum(table.log2_ceilings, log2_max)
        self.rising = self.measured & ops.any(_keep_loss_unit(empty & below_cap, False))

    def divisors(self):
        """`{position: scale}` of every weight this table governs."""
        scales = stats.pow2(ops.convert_to_tensor(self.table.log2_scales))
        return {p: scales[u] for p, u in zip(self.positions, self.units)}

    def backward_finite(self):
        """No boundary saw a non-finite gradient."""
        return ops.all(self.flags == 0)

    def measured_scales(self, grads):
        """The rule's exponents from this step (non-finite values ignored).

        Args:
            grads: The step's unscaled gradients, by position.
        """
        weight_max = self._per_unit_max(
            lambda g: ops.max(ops.where(ops.isfinite(g), ops.abs(g), 0.0)), grads
        )
        return self.rule(
            self.statistics, weight_max, self.table.log2_scales, self.table.log2_ceilings
        )

    def update(self, grads):
        """On a finite measured step: every unit takes the rule's scale."""
        def assign():
            self.table.log2_scales.assign(self.measured_scales(grads))

        ops.cond(self.measured, assign, lambda: None)

    def back_off(self, grads, allowed):
        """On a skipped step: halve the units where the overflow started.

        Only a measured step knows where that was: its origins are bounded by
        the rule, then halved, and the units the overflow did not touch take
        the rule's scale. A step that did not measure changes no scale; the
        optimizer measures the next step, which finds the origin if the
        overflow repeats.

        Args:
            grads: The step's unscaled gradients, by position.
            allowed: bool scalar, False while hysteresis holds the back-off.
        """
        ops.cond(
            self.measured, lambda: self._back_off(grads, allowed), lambda: None
        )

    def _back_off(self, grads, allowed):
        current = ops.convert_to_tensor(self.table.log2_scales)
        measured = self.measured_scales(grads)
        weight_non_finite = self._per_unit_max(
            lambda g: ops.cast(~ops.all(ops.isfinite(g)), "float32"), grads
        ) > 0
        flagged = ops.any(self.flags > 0, axis=-1)
        involved = weight_non_finite | flagged
        back_off = overflow_origins(self.statistics, weight_non_finite) & allowed
        bounded = ops.minimum(measured, current)
        capped = ops.maximum(bounded - 1.0, self.log2_min)
        # Where only a weight gradient sum overflowed, the rule saw finite
        # activation gradients but not that sum: step further down, so that
        # the next step fits, but cap one binade down only, for the rule to
        # climb back.
        lowered = ops.where(
            weight_non_finite & ~flagged,
            ops.maximum(bounded - WEIGHT_OVERFLOW_STEP, self.log2_min),
            capped,
        )
        self.table.log2_scales.assign(
            ops.where(back_off, lowered, ops.where(involved, current, measured))
        )
        self.table.log2_ceilings.assign(
            ops.where(back_off, capped, self.table.log2_ceilings)
        )

    def _per_unit_max(self, reduce, grads):
        """`reduce` (a scalar per weight gradient), maxed within each unit."""
        values = ops.stack([reduce(grads[p]) for p in self.positions])
        return per_unit_max(values, self.units, len(self.table.unit_names))

    def raise_ceilings(self, grow):
        """Caps lowered by overflows rise one binade when `grow` is true."""
        ceilings = self.table.log2_ceilings
        ceilings.assign(ops.where(grow, ceilings + 1.0, ceilings))

    def record(self, scheduled, scheduled_next):
        """Keeps this step's statistics (skipped steps too: they show where
        the overflow was) and tells the boundaries whether to measure next.

        Args:
            scheduled: bool, the optimizer meant this step to measure.
            scheduled_next: bool, it means the next step to.
        """
        self.table.statistics.assign(self.statistics)
        # A table the optimizer has not driven before may not have measured.
        missed = scheduled & ~self.measured
        measure_next = scheduled_next | missed | self.rising
        self.table.measure.assign(ops.cast(measure_next, "float32"))
