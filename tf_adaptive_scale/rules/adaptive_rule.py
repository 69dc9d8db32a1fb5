"""The adaptive rule: a scale from a histogram of gradient exponents.

One small object holds the rule's three parameters; every mode's policy
holds one (the adaptive modes set their scales with it, the others report
underflow with it).
"""

import dataclasses

import numpy as np
from keras import ops

from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.numerics.float16 import EXPONENT_MIN
from tf_adaptive_scale.numerics.float16 import NUM_BINS


@dataclasses.dataclass(frozen=True)
class AdaptiveRule:
    """The largest scale that keeps `2**log2_headroom` below float16's
    maximum, lowered until at most `underflow_rate` of the gradient
    underflows, never so far that the peak overflows.

    Args:
        underflow_rate: Tolerated underflowing fraction, in (0, 1).
        log2_headroom: Exponent of the headroom.
        criterion: `"count"` (of the values) or `"mass"` (of their squares).

    Example:

    >>> rule = AdaptiveRule(1e-3, 4.0)
    >>> log2_scale = rule.log2_scale(histogram, peak)
    """

    underflow_rate: float = 1e-3
    log2_headroom: float = 4.0
    criterion: str = "count"

    def weigh(self, histogram):
        """The histogram the rule weighs: counts, or squared magnitudes."""
        return mass_histogram(histogram) if self.criterion == "mass" else histogram

    def log2_scale(self, histogram, peak):
        """The rule's exponent (unbounded) for `histogram` and its `peak`."""
        log2_scale, _, _ = adaptive_log2_scale(
            self.weigh(histogram), peak, self.underflow_rate, self.log2_headroom
        )
        return log2_scale

    def proposal(self, histogram, peak):
        """The rule's exponent for the last measured step's statistics, and
        whether any value was nonzero: counted, or the exact `peak` (a
        sample can miss every nonzero value; the rule then reads the peak
        alone)."""
        seen = ops.logical_or(ops.sum(histogram) > 0, peak > 0)
        return self.log2_scale(histogram, peak), seen

    def bounds(self, histogram, peak):
        """`(low, high)`: the window of exponents `histogram` allows."""
        return scale_bounds(self.weigh(histogram), peak, self.underflow_rate)

    def underflow(self, histogram, log2_scale, zeros):
        """The fraction of the values (and `zeros`) lost at `2**log2_scale`."""
        return underflow_fraction(self.weigh(histogram), log2_scale, zeros=zeros)

    def unit_log2_scales(self, histogram, peak, wide_peak):
        """Each unit's exponent, unbounded, from one backward pass.

        A unit with no value in its histogram but float32 output gradients
        keeps their peak, `wide_peak`, the headroom below float16's maximum.

        Args:
            histogram: `(units, NUM_BINS)`, each unit's unscaled gradients.
            peak: `(units,)` the largest of them.
            wide_peak: `(units,)` the largest float32 output gradient.

        Returns:
            `(log2_scales, seen)`: `(units,)` exponents, and whether each
            unit saw a nonzero gradient (its exponent means nothing if not).
        """
        seen = ops.sum(histogram, axis=-1) > 0
        _, fits = scale_bounds(histogram, wide_peak, self.underflow_rate)
        chosen = ops.where(seen, self.log2_scale(histogram, peak), fits - self.log2_headroom)
        return chosen, seen | (wide_peak > 0)


def mass_histogram(histogram):
    """Weights an exponent histogram by squared magnitude.

    Fed to `scale_bounds`/`underflow_fraction` in place of the counts, it
    turns the count-based criterion into a mass-based one: the share of the
    squared L2 norm that underflows (bins are weighted by `4**exponent`,
    relative to the largest occupied bin, so within a factor 4 per value).
    Many tiny values can underflow while carrying almost none of the norm.

    Args:
        histogram: Exponent histogram(s), shape `(..., NUM_BINS)`.

    Returns:
        float32 tensor of the same shape.
    """
    exponents = ops.arange(NUM_BINS, dtype="float32") + EXPONENT_MIN
    occupied = ops.where(histogram > 0, exponents, -np.inf)
    top = ops.max(occupied, axis=-1, keepdims=True)
    top = ops.where(ops.isfinite(top), top, 0.0)
    return histogram * stats.pow2(2.0 * ops.minimum(exponents - top, 0.0))


def underflow_fraction(histogram, log2_scale, zeros=0.0):
    """Fraction of values below 2**-24 once multiplied by a scale.

    Args:
        histogram: Exponent histogram(s) of unscaled values, shape
            `(..., NUM_BINS)`.
        log2_scale: Integer-valued exponent(s) of the scale, shape `(...)`.
        zeros: Exact zeros among the values (the `zeros` of
            `gradient_statistics.grouped_statistics`), counted as
            underflowed: float16 cannot tell a value lost to underflow from
            a true zero, and hiding them would hide the loss.

    Returns:
        The fraction of the values that underflow float16, shape `(...)`
        (0 where there are none).
    """
    below = _count_below(histogram, float16.SUBNORMAL_EXPONENT - log2_scale)
    total = ops.sum(histogram, axis=-1) + zeros
    return ops.where(total > 0, (below + zeros) / ops.maximum(total, 1.0), 0.0)


def scale_bounds(histogram, max_abs, underflow_rate):
    """The window of scale exponents a histogram allows.

    Args:
        histogram: Exponent histogram(s) of unscaled values, `(..., NUM_BINS)`.
        max_abs: Largest unscaled |value|, shape `(...)`.
        underflow_rate: Largest tolerated fraction of underflowing values.

    Returns:
        A tuple `(low, high)` of float32 exponents: `2**low` is the smallest
        power-of-two scale at which at most `underflow_rate` of the nonzero
        values fall below float16's smallest subnormal, and `2**high` the
        largest at which `max_abs` stays at or below float16's maximum. A
        global scale exists that satisfies both only where `low <= high`.
    """
    total = ops.sum(histogram, axis=-1, keepdims=True)
    # cumulative[..., j]: values with exponent < j + EXPONENT_MIN.
    cumulative = ops.cumsum(histogram, axis=-1) - histogram
    allowed = ops.cast(cumulative <= underflow_rate * total, "float32")
    # Exponents e with count(exponent < e) within the budget form a prefix;
    # the largest such e is the lowest exponent that may stay representable.
    lowest_kept = ops.sum(allowed, axis=-1) - 1.0 + EXPONENT_MIN
    low = float16.SUBNORMAL_EXPONENT - lowest_kept
    safe_max = ops.where(max_abs > 0, max_abs, 1.0)
    high = ops.floor(ops.log2(float16.MAX / safe_max))
    return low, high


def adaptive_log2_scale(histogram, max_abs, underflow_rate, log2_headroom):
    """The adaptive rule: the exponent of the scale to use next.

    The largest power of two that keeps `headroom` between the largest value
    and float16's maximum; where that leaves more than `underflow_rate` of the
    values below float16's smallest subnormal, the headroom is given up as far
    as needed, but never past the point where the largest value overflows.

    Args:
        histogram: Exponent histogram(s) of unscaled values, `(..., NUM_BINS)`.
        max_abs: Largest unscaled |value|, shape `(...)`.
        underflow_rate: Largest tolerated fraction of underflowing values.
        log2_headroom: Exponent of the headroom factor.

    Returns:
        A tuple `(log2_scale, low, high)`: the chosen exponent (not yet
        bounded by the optimizer's `min_scale`/`max_scale`) and the window from
        `scale_bounds`.
    """
    low, high = scale_bounds(histogram, max_abs, underflow_rate)
    log2_scale = ops.minimum(ops.maximum(high - log2_headroom, low), high)
    return log2_scale, low, high


def _count_below(histogram, exponent):
    """Counts values whose binary exponent is below `exponent`."""
    edges = ops.arange(NUM_BINS, dtype="float32") + EXPONENT_MIN
    below = ops.cast(edges < ops.expand_dims(exponent, -1), "float32")
    return ops.sum(histogram * below, axis=-1)
