"""The adaptive rule: a scale from a histogram of gradient exponents.

One small object holds the rule's three parameters; every mode's policy
holds one (the adaptive modes set their scales with it, the others report
underflow with it).
"""

import dataclasses

from keras import ops

from tf_adaptive_scale.numerics import gradient_statistics as stats


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
        return stats.mass_histogram(histogram) if self.criterion == "mass" else histogram

    def log2_scale(self, histogram, peak):
        """The rule's exponent (unbounded) for `histogram` and its `peak`."""
        log2_scale, _, _ = stats.adaptive_log2_scale(
            self.weigh(histogram), peak, self.underflow_rate, self.log2_headroom
        )
        return log2_scale

    def bounds(self, histogram, peak):
        """`(low, high)`: the window of exponents `histogram` allows."""
        return stats.scale_bounds(self.weigh(histogram), peak, self.underflow_rate)

    def underflow(self, histogram, log2_scale, zeros):
        """The fraction of the values (and `zeros`) lost at `2**log2_scale`."""
        return stats.underflow_fraction(self.weigh(histogram), log2_scale, zeros=zeros)

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
        _, fits = stats.scale_bounds(histogram, wide_peak, self.underflow_rate)
        chosen = ops.where(seen, self.log2_scale(histogram, peak), fits - self.log2_headroom)
        return chosen, seen | (wide_peak > 0)
