"""The exponent histogram and the adaptive rule against numpy references."""

import numpy as np
import pytest
from keras import ops

from tf_adaptive_scale.numerics import gradient_statistics as stats

from tf_adaptive_scale.rules import adaptive_rule


def numpy_histogram(values):
    a = np.abs(np.asarray(values, np.float64).ravel())
    a = a[np.isfinite(a) & (a > 0)]
    bins = np.clip(np.floor(np.log2(a)) - stats.EXPONENT_MIN, 0, stats.NUM_BINS - 1)
    return np.bincount(bins.astype(int), minlength=stats.NUM_BINS), a.max(initial=0)


def test_histogram_matches_numpy_and_ignores_zero_and_non_finite():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(1000) * 2.0 ** rng.integers(-40, 10, 1000)).astype("float32")
    b = np.array([[0.0, np.inf, -np.nan, 3.0], [1e-30, -2.0**-70, 2.0**70, 0.0]], "float32")
    hist, max_abs = stats.exponent_histogram([ops.array(a), ops.array(b)])
    expected, expected_max = numpy_histogram(np.concatenate([a, b.ravel()]))
    np.testing.assert_array_equal(np.asarray(hist), expected)
    assert float(max_abs) == pytest.approx(float(expected_max))
    assert float(np.sum(hist)) == 1000 + 4  # zeros, inf and nan not counted


@pytest.mark.parametrize("log2_scale", [0.0, 5.0])
def test_grouped_statistics_match_numpy_per_group(log2_scale):
    """Groups of tensors of several dtypes in one pass: each group's
    histogram, peak, zeros, non-finite count and squared norm as numpy
    computes them group by group (group 2 is empty)."""
    rng = np.random.default_rng(1)
    tensors = [
        (rng.standard_normal((7, 5)) * 2.0 ** rng.integers(-30, 5, (7, 5))).astype("float32"),
        np.array([0.0, np.inf, 3.0, -np.nan, 0.0, 1e-3], "float16"),
        (rng.standard_normal(300) * 1e-4).astype("float32"),
        np.array([[0.0, -2.0**-70], [2.0**20, -np.inf]], "float32"),
    ]
    groups = [0, 1, 0, 3]
    got = stats.grouped_statistics(
        [ops.array(t) for t in tensors], groups, 4, log2_scale
    )
    for group in range(4):
        values = np.concatenate(
            [t.astype(np.float64).ravel() for t, g in zip(tensors, groups) if g == group]
            or [np.zeros(0)]
        )
        histogram, peak = numpy_histogram(values)
        shifted = np.roll(histogram, -int(log2_scale))  # counts of values / 2**s
        finite = values[np.isfinite(values)]
        np.testing.assert_array_equal(np.asarray(got.histograms[group])[: -8], shifted[: -8])
        assert float(got.max_abs[group]) == pytest.approx(peak / 2.0**log2_scale)
        assert float(got.zeros[group]) == np.sum(values == 0)
        assert float(got.non_finite[group]) == np.sum(~np.isfinite(values))
        assert float(got.squares[group]) == pytest.approx(np.sum(finite**2), rel=1e-5)


@pytest.mark.parametrize("sample", [None, stats.VARIABLE_SAMPLE])
@pytest.mark.parametrize("grouping", ["each", "mixed"])
@pytest.mark.parametrize("count", [11, 19])
def test_every_small_tensor_is_binned_past_the_last_full_chunk(count, grouping, sample):
    """Small tensors are binned `_FUSED_OPERANDS` (8) at a time: with 11 or
    19 of them the last chunk is partial, and its tensors' histograms,
    zeros, non-finite counts and squared norms are numpy's (float64), group
    by group, as the full chunks' are (none is over the sample: all exact)."""
    rng = np.random.default_rng(count)
    tensors = []
    for i in range(count):
        size = int(rng.integers(1, 600))
        t = rng.standard_normal(size) * 2.0 ** rng.integers(-40, 8, size)
        t[rng.random(size) < 0.2] = 0.0
        if i % 4 == 3:
            t[0] = np.inf
        tensors.append(t.astype("float16" if i % 5 == 4 else "float32"))
    groups = list(range(count)) if grouping == "each" else [i % 3 for i in range(count)]
    num_groups = max(groups) + 1
    got = stats.grouped_statistics(
        [ops.array(t) for t in tensors], groups, num_groups, sample=sample)
    assert count % stats._FUSED_OPERANDS and all(t.size < stats._SMALL for t in tensors)
    for group in range(num_groups):
        values = np.concatenate(
            [t.astype(np.float64) for t, g in zip(tensors, groups) if g == group])
        finite = values[np.isfinite(values)]
        histogram, peak = numpy_histogram(values)
        np.testing.assert_array_equal(np.asarray(got.histograms[group]), histogram)
        assert float(got.zeros[group]) == np.sum(values == 0)
        assert float(got.squares[group]) == pytest.approx(np.sum(finite**2), rel=1e-5)
        members = [t.astype(np.float64) for t, g in zip(tensors, groups) if g == group]
        if sample is None:
            assert float(got.non_finite[group]) == np.sum(~np.isfinite(values))
            assert float(got.max_abs[group]) == pytest.approx(peak)
        else:  # sampled: the tensors holding one, and the peak of the others
            assert float(got.non_finite[group]) == sum(
                not np.all(np.isfinite(t)) for t in members)
            assert float(got.max_abs[group]) == pytest.approx(max(
                [np.max(np.abs(t)) for t in members if np.all(np.isfinite(t))], default=0.0))


def test_grouped_norms_of_a_large_tensor_are_accurate_under_xla():
    """A million values: the squared norm to 1e-5 of float64's (a segment
    sum over all values, a sequential scatter, was 5e-4 off) and the peak
    exact, as the compiled step takes them."""
    import tensorflow as tf

    rng = np.random.default_rng(2)
    tensors = [(rng.standard_normal((1024, 1024)) * 1e-3).astype("float32"),
               rng.standard_normal(10).astype("float32")]

    @tf.function(jit_compile=True)
    def measure(a, b):
        got = stats.grouped_statistics([a, b], [0, 1], 2)
        return got.squares, got.max_abs

    squares, peaks = measure(*tensors)
    for t, s, p in zip(tensors, np.asarray(squares), np.asarray(peaks)):
        assert s == pytest.approx(np.sum(t.astype(np.float64) ** 2), rel=1e-5)
        assert p == np.abs(t).max()


def test_histogram_of_float16_tensor():
    x = np.array([2.0**-24, 2.0**-14, 65504.0], "float16")
    hist, max_abs = stats.exponent_histogram([ops.array(x)])
    for e in (-24, -14, 15):
        assert hist[e - stats.EXPONENT_MIN] == 1
    assert float(max_abs) == 65504.0


def known_distribution():
    """1000 values: 10 at 2**-40, 90 at 2**-30, 900 at 2**-10, max 1.5*2**-3."""
    values = np.concatenate(
        [np.full(10, 2.0**-40), np.full(90, 2.0**-30), np.full(899, 2.0**-10), [1.5 * 2.0**-3]]
    ).astype("float32")
    return stats.exponent_histogram([ops.array(values)])


def test_scale_bounds_on_known_distribution():
    hist, max_abs = known_distribution()
    # At most 1% may underflow: the 10 values at 2**-40 may, the 90 at 2**-30
    # may not, so 2**-30 * 2**k >= 2**-24 -> k >= 6.
    low, high = adaptive_rule.scale_bounds(hist, max_abs, 0.01)
    assert float(low) == 6
    # 1.5 * 2**-3 * 2**k <= 65504 -> k <= 18 (1.5 * 2**15 = 49152; 2**16 overflows).
    assert float(high) == 18
    # At 0.1% even the 10 smallest values count: 2**-40 * 2**k >= 2**-24 -> k >= 16.
    low, _ = adaptive_rule.scale_bounds(hist, max_abs, 1e-3)
    assert float(low) == 16
    # At 20% the 90 may underflow too: k >= -24 + 10 = -14.
    low, _ = adaptive_rule.scale_bounds(hist, max_abs, 0.2)
    assert float(low) == -14


@pytest.mark.parametrize(
    "rate, log2_headroom, expected",
    [
        (0.01, 4, 14),  # window [6, 18]: keep headroom 2**4 -> 18 - 4
        (1e-3, 4, 16),  # window [16, 18]: headroom given up to meet the rate
        (1e-3, 0, 18),  # no headroom asked
        (1e-4, 4, 16),  # budget 0.1 values: nothing may underflow -> 2**-40 * 2**16 = 2**-24
    ],
)
def test_adaptive_rule_picks_predicted_scale(rate, log2_headroom, expected):
    hist, max_abs = known_distribution()
    log2_scale, _, high = adaptive_rule.adaptive_log2_scale(hist, max_abs, rate, log2_headroom)
    assert float(log2_scale) == expected
    assert float(log2_scale) <= float(high)


def test_no_window_when_range_exceeds_float16():
    values = np.array([2.0**-40] * 50 + [2.0**10] * 50, "float32")
    hist, max_abs = stats.exponent_histogram([ops.array(values)])
    log2_scale, low, high = adaptive_rule.adaptive_log2_scale(hist, max_abs, 1e-3, 4)
    assert float(low) == 16 and float(high) == 5  # no global scale fits
    assert float(log2_scale) == 5  # overflow wins: never past the max
    # Half the values underflow at the chosen scale.
    assert float(adaptive_rule.underflow_fraction(hist, log2_scale)) == 0.5


def test_underflow_fraction_matches_float16_cast():
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(4096) * 2.0 ** rng.integers(-36, -4, 4096)).astype("float32")
    hist, _ = stats.exponent_histogram([ops.array(g)])
    for k in (0, 4, 8, 12):
        scaled = g * 2.0**k
        lost = np.mean(np.abs(scaled) < 2.0**-24)
        assert float(adaptive_rule.underflow_fraction(hist, float(k))) == pytest.approx(lost)


def test_rule_is_vectorized_over_rows():
    hist, max_abs = known_distribution()
    stacked = ops.stack([hist, hist * 2])
    log2_scale, low, high = adaptive_rule.adaptive_log2_scale(
        stacked, ops.stack([max_abs, max_abs * 8]), 0.01, 4
    )
    np.testing.assert_array_equal(np.asarray(low), [6, 6])
    np.testing.assert_array_equal(np.asarray(high), [18, 15])
    np.testing.assert_array_equal(np.asarray(log2_scale), [14, 11])


def test_mass_criterion_ignores_tiny_values_that_carry_no_norm():
    # Half the values are tiny (2**-40) and carry ~2**-60 of the squared norm.
    values = np.array([2.0**-40] * 500 + [2.0**-10] * 500, "float32")
    hist, max_abs = stats.exponent_histogram([ops.array(values)])
    count_low, _ = adaptive_rule.scale_bounds(hist, max_abs, 1e-3)
    mass_low, _ = adaptive_rule.scale_bounds(adaptive_rule.mass_histogram(hist), max_abs, 1e-3)
    assert float(count_low) == 16  # keep the tiny half: 2**-40 * 2**16
    assert float(mass_low) == -14  # keep only what carries the norm: 2**-10 * 2**-14
    # The mass share that underflows at 2**14: the tiny half's, about 2**-60.
    share = float(adaptive_rule.underflow_fraction(adaptive_rule.mass_histogram(hist), 14.0))
    assert 0 < share < 2.0**-55
    expected = np.sum(values[values * 2.0**14 < 2.0**-24] ** 2) / np.sum(values**2)
    assert share == pytest.approx(expected, rel=1.0)  # within the 4x bin width


def test_mass_histogram_of_empty_histogram_is_zero():
    empty = ops.zeros((stats.NUM_BINS,))
    assert float(ops.sum(adaptive_rule.mass_histogram(empty))) == 0.0


def test_pow2_is_exact():
    exponents = np.arange(-126, 128, dtype="float32")
    np.testing.assert_array_equal(np.asarray(stats.pow2(ops.array(exponents))), 2.0**exponents)


def test_exact_powers_of_two_land_in_their_own_bin():
    # ops.log2(32768.0) is 14.999999 in float32: a scaled 1.0 once counted
    # as 0.5.
    exponents = np.arange(-60, 30)
    values = np.float32(2.0) ** exponents.astype("float32")
    for log2_scale in (0.0, 15.0, -7.0):
        scaled = values * np.float32(2.0**log2_scale)
        histogram, max_abs = stats.exponent_histogram(
            [ops.convert_to_tensor(scaled)], log2_scale)
        expected = np.zeros(stats.NUM_BINS)
        expected[exponents - stats.EXPONENT_MIN] = 1
        np.testing.assert_array_equal(np.asarray(histogram), expected)
        assert float(max_abs) == 2.0**29
