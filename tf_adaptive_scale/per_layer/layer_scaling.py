"""The per-layer observation of one step, on a `ScaleTable`'s statistics (see
`gradient_scale`): overflow attribution, as pure functions of tensors, and
`TableStep`, which gathers them with the adaptive rule's exponents into the
`scale_policy.Observation` that `PerLayerScaling` turns into new scales
(`scale_step.LayerStep` runs one per table)."""

from keras import ops

from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.per_layer import gradient_scale as boundary
from tf_adaptive_scale.rules import scale_policy


def unit_view(statistics, weight_max):
    """What the adaptive rule reads of each unit (`AdaptiveRule.unit_log2_scales`).

    A unit's histogram covers its float16 output gradients and the input
    gradients its backward produced; its peak is the largest of those and of
    its weight gradients (all unscaled), since all are held at its scale.

    Args:
        statistics: `(units, NUM_COLUMNS)` statistics of one backward pass.
        weight_max: `(units,)` largest unscaled weight gradient per unit.

    Returns:
        `(histogram, peak, wide_peak)`, the last the peak of its float32
        output gradients.
    """
    peak = ops.maximum(
        ops.maximum(statistics[:, boundary.OUTPUT_MAX], statistics[:, boundary.INPUT_MAX]),
        weight_max,
    )
    return statistics[:, : stats.NUM_BINS], peak, statistics[:, boundary.WIDE_OUTPUT_MAX]


def overflow_origins(statistics, weight_non_finite):
    """The units where a non-finite gradient started.

    A unit is an origin when converting a finite gradient to its scale
    overflowed, or when its own backward pass (input or weight gradients)
    produced non-finite values from a finite output gradient. Where no unit
    can be blamed, all are.

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


def mostly_underflowed(statistics, log2_scales):
    """The units whose measured values were mostly lost to underflow.

    At scale `2**s` float16 holds unscaled values down to `2**(-24 - s)`;
    below that they become zeros, which the histogram does not count. Where
    the lowest binade it holds is the histogram's most populated one, the
    values were cut off there and most lay below: the statistics show only
    their top.

    Args:
        statistics: `(units, NUM_COLUMNS)` statistics of a measured step.
        log2_scales: `(units,)` the scales the step ran with.

    Returns:
        `(units,)` bool, False where nothing was seen.
    """
    histogram = statistics[:, : stats.NUM_BINS]
    floor = float16.SUBNORMAL_EXPONENT - log2_scales - stats.EXPONENT_MIN
    floor = ops.cast(ops.clip(floor, 0, stats.NUM_BINS - 1), "int32")
    at_floor = ops.take_along_axis(histogram, floor[:, None], axis=1)[:, 0]
    return (at_floor > 0) & (at_floor >= ops.max(histogram, axis=-1))


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
        policy: The `scale_policy.PerLayerScaling` that sets the scales (with
            its `rule.layer_log2_scales`).
        measuring: Whether the program being traced is the measuring one
            (`step_programs.is_measuring`).

    Example:

    >>> step = TableStep(table, statistics, [(0, 1), (1, 1)], policy, True)
    >>> new_state = step.step(state, observation, grads, scheduled)
    """

    def __init__(self, table, statistics, members, policy, measuring):
        self.table = table
        self.statistics = statistics
        self.positions = [p for p, _ in members]
        self.units = [u for _, u in members]
        self.policy = policy
        self.flags = statistics[
            :, boundary.PRODUCED_NON_FINITE : boundary.RECEIVED_NON_FINITE + 1
        ]
        # A plain program measures nothing: the table's request to measure
        # stands until a measuring program serves it (see `record`).
        self.measured = table.measure.value > 0 if measuring else ops.zeros((), "bool")

    def step(self, state, observation, grads, scheduled):
        """This table's part of a step, in its order: what the step saw,
        the next scales, then whether to measure next (which reads both).

        Args:
            state: The optimizer's `ScaleState` (its scalar fields).
            observation: The step's shared `Observation` (finite,
                loss_finite).
            grads: The step's unscaled gradients, by position.
            scheduled: bool, the optimizer meant this step to measure.

        Returns:
            The policy's next `ScaleState` (with this table's vectors).
        """
        seen = self.observation(grads, observation.finite, observation.loss_finite)
        new, rose_far = self.advance(state, seen)
        self.record(scheduled, ops.equal(new.steps_to_measure, 0), seen, rose_far)
        return new

    def log2_divisors(self):
        """`{position: log2 scale}` of every weight this table governs."""
        scales = self.table.log2_scales.value
        return {p: scales[u] for p, u in zip(self.positions, self.units)}

    def backward_finite(self):
        """No boundary saw a non-finite gradient."""
        return ops.all(self.flags == 0)

    def observation(self, grads, finite, loss_finite):
        """What this step saw, per unit (used where the step was measured).

        Args:
            grads: The step's unscaled gradients, by position.
            finite: bool, the step's gradients were all finite.
            loss_finite: bool, its loss was finite.

        Returns:
            A `scale_policy.Observation`.
        """
        # Computed on every step and selected (no conditional: XLA's GPU
        # runtime waits on the host for each): the weights' peaks and
        # non-finite counts are reductions fused with the step's finite
        # check, the rest reads the small statistics table.
        peaks, non_finite = stats.peaks_and_non_finite(
            [grads[p] for p in self.positions], self.units, len(self.table.unit_names)
        )
        proposed, seen = self.policy.rule.unit_log2_scales(*unit_view(self.statistics, peaks))
        cut = mostly_underflowed(self.statistics, self.table.log2_scales.value)
        proposed = ops.where(self.measured, proposed, 0.0)
        seen, cut = seen & self.measured, cut & self.measured
        weight_non_finite = (non_finite > 0) & self.measured & ~finite
        flagged = ops.any(self.flags > 0, axis=-1)
        return scale_policy.Observation(
            finite=finite,
            loss_finite=loss_finite,
            measured=self.measured,
            proposed=_keep_loss_unit(proposed),
            seen=_keep_loss_unit(seen, True),
            origins=overflow_origins(self.statistics, weight_non_finite),
            involved=weight_non_finite | flagged,
            weight_only=weight_non_finite & ~flagged,
            cut=_keep_loss_unit(cut, False),
        )

    def advance(self, state, observation):
        """Writes the policy's next scales and caps for this table.

        Args:
            state: The optimizer's `ScaleState` (its scalar fields).
            observation: This table's `observation(...)`.

        Returns:
            `(state, rose_far)`: the policy's next `ScaleState` (with this
            table's vectors), and whether a unit rose so far that the next
            step measures too.
        """
        state = state._replace(
            log2_scale=self.table.log2_scales.value,
            log2_ceiling=self.table.log2_ceilings.value,
        )
        new = self.policy.next_state(state, observation)
        # Once calibrated, a clean measurement that raised a unit
        # `UNSEEN_STEP` binades or more found its gradients far from where
        # they were: the next update may move them as far, so the next step
        # measures too (the calibrating one rises from a guess).
        rise = _keep_loss_unit(new.log2_scale - state.log2_scale)
        rose_far = (
            state.calibrated & self.measured & observation.finite
            & ops.any(rise >= scale_policy.UNSEEN_STEP)
        )
        self.table.log2_scales.assign(_keep_loss_unit(new.log2_scale))
        self.table.log2_ceilings.assign(
            _keep_loss_unit(new.log2_ceiling, float16.NO_CAP_EXPONENT)
        )
        return new, rose_far

    def record(self, scheduled, scheduled_next, observation, rose_far):
        """Keeps this step's statistics (skipped steps too: they show where
        the overflow was) and tells the boundaries whether to measure next.

        Args:
            scheduled: bool, the optimizer meant this step to measure.
            scheduled_next: bool, it means the next step to.
            observation: This step's observation.
            rose_far: `advance`'s flag.
        """
        self.table.statistics.assign(self.statistics)
        # A table the optimizer has not driven before may not have measured.
        missed = scheduled & ~self.measured
        # A unit whose gradient all underflowed rises UNSEEN_STEP binades per
        # measurement: measure again at once until it sees values or its cap.
        # So does one whose values mostly underflowed, until it reaches the
        # rule's scale, and any far rise once calibrated (`advance`).
        scales = self.table.log2_scales.value
        below_cap = scales < ops.minimum(
            self.table.log2_ceilings.value, self.policy.log2_max
        )
        blind = ~observation.seen & below_cap
        held = observation.cut & (scales < observation.proposed) & below_cap
        rising = self.measured & observation.finite & ops.any(
            _keep_loss_unit(blind | held, False)
        )
        measure_next = scheduled_next | missed | rising | rose_far
        self.table.measure.assign(ops.cast(measure_next, "float32"))


def tables_of(var_list):
    """The instrumented models' tables among `var_list` (the optimizer's
    variables); a weight two of them claim is refused."""
    tables = [t for t in map(boundary.table_of_statistics, var_list) if t is not None]
    for v in var_list:
        owners = [t for t in tables if t.unit_of(v) is not None]
        if len(owners) > 1:
            raise ValueError(
                f"The weight '{v.path}' belongs to {len(owners)} "
                "instrumented models trained in one step by this "
                "optimizer; its gradient would sum contributions at "
                "different per-layer scales. Instrument the model that "
                "holds all of them once instead."
            )
    return tables


def table_steps(tables, statistics, variables, regular, policy, measuring):
    """One `TableStep` per table, on the step's gradients.

    Args:
        tables: The `ScaleTable`s whose statistics this step received.
        statistics: Their statistics, in the same order.
        variables: The step's variables.
        regular: Positions of the variables updated from their gradients.
        policy: The `scale_policy.PerLayerScaling`.
        measuring: Whether the measuring program is traced.

    Returns:
        A list of `TableStep`s.
    """
    steps = []
    for table, table_statistics in zip(tables, statistics):
        units = [(i, table.unit_of(variables[i])) for i in regular]
        members = [(i, unit) for i, unit in units if unit is not None]
        steps.append(TableStep(table, table_statistics, members, policy, measuring))
    return steps


def split_tables(pairs, policy):
    """Separates an apply's `(gradient, variable)` pairs from its
    instrumented models' statistics, checking the mode fits them.

    Args:
        pairs: The step's `(gradient, variable)` pairs.
        policy: The optimizer's `scale_policy.Policy` (None: not resolved).

    Returns:
        `(pairs, tables)`: the other pairs, and `(statistics, ScaleTable)`
        pairs.
    """
    owners = [boundary.table_of_statistics(v) for _, v in pairs]
    tables = [(g, t) for (g, _), t in zip(pairs, owners) if t is not None]
    rest = [p for p, t in zip(pairs, owners) if t is None]
    if policy is not None and policy.per_layer and not tables:
        raise ValueError(
            "scaling='per_layer' needs the gradients of a model made by "
            "tas.instrument(model), including its `statistics` variable "
            "(pass all of model.trainable_variables)."
        )
    if policy is not None and not policy.per_layer and tables:
        raise ValueError(
            "These gradients come from an instrumented model (per-layer "
            "scales): use AdaptiveLossScaleOptimizer(..., "
            f"scaling='per_layer'), not scaling={policy.name!r}."
        )
    return rest, tables
