"""What a layer's measured gradients say about float16 at its scale.

Pure functions of a measurement (`measurement.LayerStatistics`, or its
exponent histogram): the fractions lost to underflow and overflow, and the
window of scales that fit. `monitor_log` records them, `diagnoses` reads
them; docs/monitor.md ("When no single scale fits") explains the window.
"""

import math

import numpy as np

from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.rules import adaptive_rule


def float16_fractions(histogram, log2_scale):
    """Fractions of a histogram's values that underflow and overflow float16
    once multiplied by `2**log2_scale`.

    Args:
        histogram: Exponent histogram (`gradient_statistics` bins).
        log2_scale: Exponent of the scale the values are held at.

    Returns:
        A tuple of floats `(underflow, overflow)`; zeros for an empty one.
    """
    histogram = np.asarray(histogram, np.float64)
    total = histogram.sum()
    if total == 0:
        return 0.0, 0.0
    exponents = np.arange(histogram.size) + stats.EXPONENT_MIN + log2_scale
    under = histogram[exponents < float16.SUBNORMAL_EXPONENT].sum() / total
    over = histogram[exponents >= float16.OVERFLOW_EXPONENT].sum() / total
    return float(under), float(over)


def scale_window(layer, underflow_rate):
    """The window of scale exponents a layer's gradients fit in float16.

    `high` comes from the highest occupied exponent bin, `low` from the
    histogram as the adaptive rule reads it. Where the layer's zeros exceed
    `underflow_rate` and its histogram runs into float16's lowest binade
    (values were lost below it), `low` is estimated from the gradient norm
    as for normal values, at least one above the layer's scale, and errs low.

    Args:
        layer: A `measurement.LayerStatistics`, taken at the layer's scale.
        underflow_rate: Largest tolerated fraction of underflowing values.

    Returns:
        A tuple `(low, high, extrapolated)`: at `2**low` or more at most
        `underflow_rate` of the values underflow, at `2**high` or less none
        overflows; None for a layer with no nonzero value.

    Example:

    >>> low, high, extrapolated = scale_window(reading.layers["dense"], 1e-3)
    """
    histogram = np.asarray(layer.histogram, np.float64)
    occupied = np.flatnonzero(histogram)
    if occupied.size == 0:
        return None
    high = float(float16.OVERFLOW_EXPONENT - 2 - (occupied[-1] + stats.EXPONENT_MIN))
    edge = float16.SUBNORMAL_EXPONENT - round(layer.log2_scale) - stats.EXPONENT_MIN
    at_edge = histogram[edge] if 0 <= edge < histogram.size else 0.0
    lost = layer.zeros - underflow_rate * (histogram.sum() + layer.zeros)
    if lost > 0 and at_edge > underflow_rate * histogram.sum():
        # The `underflow_rate` quantile of normal values of the layer's
        # norm is `underflow_rate * sigma * sqrt(pi / 2)`.
        sigma = layer.norm / math.sqrt(histogram.sum() + layer.zeros)
        quantile = underflow_rate * sigma * math.sqrt(math.pi / 2)
        low = math.ceil(float16.SUBNORMAL_EXPONENT - math.log2(quantile))
        return float(max(low, round(layer.log2_scale) + 1)), high, True
    low, _ = adaptive_rule.scale_bounds(histogram, 1.0, underflow_rate)
    return float(low), high, False
