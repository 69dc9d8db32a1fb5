"""The statistics the optimizer takes on every step, from a fixed strided
sample of each gradient, against the exact ones.

Peaks, non-finite counts and norms are exact (they guard against overflow);
histograms and zeros are estimates. The scales chosen from them must stay
within one binade of those the exact histograms give, on the benchmarks'
models (`benchmarks/zoo.py`), globally and per layer.
"""

import keras
import numpy as np
import pytest
from keras import ops

import tf_adaptive_scale as tas
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.rules import adaptive_rule

from benchmarks import zoo


@pytest.mark.parametrize("sample, share_error, norm_error", [
    (stats.SAMPLE, 0.01, 0.2), (stats.VARIABLE_SAMPLE, 0.03, 0.4)])
def test_sample_estimates_counts_and_keeps_peaks_exact(sample, share_error, norm_error):
    """A 1024-wide kernel whose every 256th column is dead (zero): a round
    stride would read only those columns; the prime one reads them all
    alike. The peak is exact; one non-finite value anywhere is found. Its
    values spread over 25 binades, so the sum of squares, which its few
    largest decide, is the estimate that misses most."""
    rng = np.random.default_rng(0)
    kernel = (rng.standard_normal((512, 1024)) * 2.0 ** rng.integers(-30, -5, (512, 1024)))
    kernel[:, ::256] = 0.0
    kernel = kernel.astype("float32")
    exact = stats.grouped_statistics([ops.array(kernel)], [0], 1)
    sampled = stats.grouped_statistics([ops.array(kernel)], [0], 1, sample=sample)
    assert float(sampled.max_abs[0]) == float(exact.max_abs[0]) > 0
    assert float(sampled.non_finite[0]) == float(exact.non_finite[0]) == 0
    assert float(sampled.squares[0]) == pytest.approx(float(exact.squares[0]), rel=norm_error)
    assert float(sampled.zeros[0]) == pytest.approx(float(exact.zeros[0]), rel=0.3)
    estimated, true = np.asarray(sampled.histograms[0]), np.asarray(exact.histograms[0])
    assert np.sum(estimated) == pytest.approx(np.sum(true), rel=0.01)
    # Each binade's share within 1% (3% for the smaller sample) of all values.
    np.testing.assert_allclose(estimated / kernel.size, true / kernel.size, atol=share_error)

    kernel[3, 5] = np.inf  # not in the sample
    sampled = stats.grouped_statistics([ops.array(kernel)], [0], 1, sample=sample)
    assert float(sampled.non_finite[0]) >= 1 and float(sampled.max_abs[0]) == 0


def chosen_scales(family, scaling, sampled, steps=2):
    """After `steps` steps of a benchmark model, with the statistics sampled
    (the optimizer's own samples) or (`sampled=False`) exact: log2 of the
    scale(s) chosen, and the lowest scale(s) keeping underflow within the
    rate (`scale_bounds`' low, which the sample's quantile decides), both
    `(units,)`. (Under its test's `float16_policy`.)"""
    keras.utils.set_random_seed(0)
    model, shape = zoo.FAMILIES[family]()
    if scaling == "per_layer":
        model = tas.instrument(model)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling=scaling, update_every=1
    )
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    saved = stats.SAMPLE, stats.VARIABLE_SAMPLE
    if not sampled:
        stats.SAMPLE = stats.VARIABLE_SAMPLE = None
    gradient_scale._measured_rows.cache_clear()  # traced with the constant
    try:
        for step in range(steps):
            model.train_on_batch(*zoo.batch_for(model, shape, step))
    finally:
        stats.SAMPLE, stats.VARIABLE_SAMPLE = saved
        gradient_scale._measured_rows.cache_clear()
    if scaling != "per_layer":
        return np.log2([float(optimizer.loss_scale)]), np.asarray(optimizer.scale_window)[:1]
    (table,) = [layer for layer in model.layers if isinstance(layer, tas.ScaleTable)]
    statistics = np.asarray(table.statistics)[1:]  # the loss unit has none
    low, _ = adaptive_rule.scale_bounds(statistics[:, : stats.NUM_BINS], np.ones(len(statistics)),
                                optimizer.underflow_rate)
    return np.log2(np.array(list(optimizer.layer_scales().values()))), np.asarray(low)


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
@pytest.mark.parametrize("family", ["mlp", "cnn", "unet", "transformer"])
def test_sampled_scales_within_one_binade_of_exact(family, scaling, float16_policy):
    sampled, sampled_low = chosen_scales(family, scaling, True)
    exact, exact_low = chosen_scales(family, scaling, False)
    assert sampled.shape == exact.shape and sampled_low.shape == exact_low.shape
    assert np.max(np.abs(sampled - exact)) <= 1.0
    assert np.max(np.abs(sampled_low - exact_low)) <= 1.0


HEADS = [(1280, 5), (2048, 5), (2048, 37), (2048, 101), (1024, 10)]


def head_gradient(features, classes, batch=64, seed=0):
    """A classifier head's kernel gradient, `x^T (softmax(x W) - onehot) / B`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, features))
    logits = x @ (rng.standard_normal((features, classes)) * 0.02)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(batch), rng.integers(0, classes, batch)] -= 1.0
    return (x.T @ p / batch).astype("float32")


@pytest.mark.parametrize("shape", HEADS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_sample_reads_every_column_of_a_classifier_head(shape):
    """A stride that divides the kernel's size lines up with its columns:
    a prime stride of 5 on a (2048, 5) head read class 0 alone (its norm
    1.9x off). The stride is coprime with the size, so with every axis."""
    index = ops.arange(shape[0] * shape[1], dtype="float32")
    sample, _ = stats._strided_sample(index, stats.VARIABLE_SAMPLE)
    columns = np.unique(np.asarray(sample).astype(np.int64) % shape[1])
    assert len(columns) == shape[1]
    kernel = ops.array(head_gradient(*shape))
    exact = stats.grouped_statistics([kernel], [0], 1)
    sampled = stats.grouped_statistics([kernel], [0], 1, sample=stats.VARIABLE_SAMPLE)
    assert np.sqrt(float(sampled.squares[0])) == pytest.approx(
        np.sqrt(float(exact.squares[0])), rel=0.1)


def test_the_recorded_norm_of_a_2048_to_5_head(float16_policy):
    """End to end: the norm the optimizer records for the head's kernel,
    against the float32 gradient's."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(5, name="head")])
    twin = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(5, dtype="float32")])
    twin.set_weights(model.get_weights())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 2048)).astype("float32")
    y = rng.integers(0, 5, 64)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), update_every=1)
    model.compile(optimizer, loss)
    model.train_on_batch(x, y)
    import tensorflow as tf

    with tf.GradientTape() as tape:
        value = loss(y, twin(x))
    exact = float(tf.norm(tape.gradient(value, twin.trainable_variables[0])))
    recorded = float(optimizer.variable_gradient_norms.numpy()[0])
    assert recorded == pytest.approx(exact, rel=0.1)


def sparse_rows_gradient(rows=50_000, width=16, used=range(1, 21), seed=0):
    """A dense gradient whose `used` rows of `rows` hold values, the rest
    zero: an embedding table's (as Keras on JAX gives), a multi-hot input's
    kernel."""
    rng = np.random.default_rng(seed)
    gradient = np.zeros((rows, width), "float32")
    gradient[list(used)] = rng.standard_normal((len(used), width)).astype("float32") * 1e-3
    return gradient


# Rows of a (1000, 3) kernel that its sample (stride 7) does not read.
UNREAD_ROWS = [r for r in range(1000) if r % 7 in (1, 3, 5, 6)][:24]


@pytest.mark.parametrize("rows, width, used", [
    (50_000, 16, range(1, 21)),  # more rows than the sample reads
    (1000, 3, UNREAD_ROWS),  # rows shorter than its stride
], ids=["table", "narrow_kernel"])
def test_a_dense_gradient_whose_used_rows_the_strided_sample_misses(rows, width, used):
    """The strided sample reads no used row (about one value in each of
    2048 rows of a 50,000-row table; 3 rows in 7 of a (1000, 3) kernel,
    whose stride of 7 outruns its rows): alone, it read the gradient as all
    zero (norm 0, the whole gradient underflowed). The norm and zeros are
    exact, and the histogram is of the rows holding the largest values."""
    gradient = sparse_rows_gradient(rows, width, used)
    strided, _ = stats._strided_sample(ops.reshape(ops.array(gradient), (-1,)),
                                       stats.VARIABLE_SAMPLE)
    assert not np.any(np.asarray(strided))  # what the sample alone saw
    exact = stats.grouped_statistics([ops.array(gradient)], [0], 1)
    sampled = stats.grouped_statistics([ops.array(gradient)], [0], 1,
                                       sample=stats.VARIABLE_SAMPLE)
    assert float(sampled.squares[0]) == pytest.approx(float(exact.squares[0]), rel=1e-5)
    assert float(sampled.zeros[0]) == float(exact.zeros[0]) == gradient.size - len(used) * width
    np.testing.assert_allclose(np.asarray(sampled.histograms[0]),
                               np.asarray(exact.histograms[0]), atol=1e-3)
    assert float(sampled.max_abs[0]) == float(exact.max_abs[0])


@pytest.mark.parametrize("shape", [(64, 64), (2048, 37), (4096,)])
def test_the_row_fallback_serves_only_shapes_whose_sample_skips_rows(shape):
    """Against the rows the strided sample reads, counted here: the row
    fallback (a kernel or more per variable) is taken where a row is left
    unread, and only there (a (64, 64) kernel's sample reads every row)."""
    size = int(np.prod(shape))
    index = np.asarray(stats._strided_sample(ops.arange(size), stats.VARIABLE_SAMPLE)[0])
    width = size // shape[0]
    every_row = len(np.unique(index // width)) == shape[0]
    assert stats._skips_rows(ops.zeros(shape), stats.VARIABLE_SAMPLE) is (
        len(shape) >= 2 and not every_row)
    assert stats._skips_rows(ops.zeros((1000, 3)), stats.VARIABLE_SAMPLE)


def unread_gradient(seed=0):
    """A (64, 64) kernel gradient (its sample, stride 3, reads every row
    and column) whose nonzero values lie where the sample does not read."""
    rng = np.random.default_rng(seed)
    gradient = np.zeros(64 * 64, "float32")
    where = rng.choice(np.flatnonzero(np.arange(64 * 64) % 3 != 0), 40, replace=False)
    gradient[where] = rng.standard_normal(40).astype("float32") * 2.0**-6
    return gradient.reshape(64, 64)


def test_a_gradient_whose_sample_saw_nothing_is_unmeasured_not_zero():
    """No fallback reads it (its sample reads every row): its statistics say
    it is unmeasured (NaN squares), alone or among others, not zero; its
    peak stays exact."""
    gradient = unread_gradient()
    assert not stats._skips_rows(ops.array(gradient), stats.VARIABLE_SAMPLE)
    strided, _ = stats._strided_sample(ops.reshape(ops.array(gradient), (-1,)),
                                       stats.VARIABLE_SAMPLE)
    assert not np.any(np.asarray(strided))
    seen = np.full((64, 64), 1e-3, "float32")
    got = stats.grouped_statistics([ops.array(gradient), ops.array(seen)], [0, 1], 2,
                                   sample=stats.VARIABLE_SAMPLE)
    assert np.isnan(float(got.squares[0])) and np.isnan(float(got.total().squares))
    assert float(got.max_abs[0]) == np.max(np.abs(gradient))
    assert float(got.squares[1]) == pytest.approx(np.sum(seen.astype(np.float64) ** 2), rel=1e-4)
    exact = stats.grouped_statistics([ops.array(gradient)], [0], 1)
    assert float(exact.squares[0]) == pytest.approx(np.sum(gradient.astype(np.float64) ** 2))


def test_the_global_scale_is_set_from_the_peak_where_the_sample_saw_nothing():
    """The adaptive rule reads the exact peak where the histogram is empty:
    the first measured step is applied and sets the scale `headroom` below
    float16's maximum over the peak (it searched blind before: skipped,
    and 2**8 higher). The reading leaves the unmeasured layer out."""
    gradient = unread_gradient()
    variable = keras.Variable(np.zeros((64, 64), "float32"), name="kernel")
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1.0), scaling="adaptive")
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def step(grad):
        optimizer.apply([grad], [variable])

    step(tf.constant(gradient * optimizer.initial_scale))
    peak = float(np.max(np.abs(gradient)))
    expected = 2.0 ** (np.floor(np.log2(65504.0 / peak)) - np.log2(optimizer.headroom))
    assert int(optimizer.skipped_steps) == 0
    np.testing.assert_allclose(variable.numpy(), -gradient, rtol=1e-6)
    assert float(optimizer.loss_scale) == expected
    reading = optimizer.read()
    assert reading.layers == {} and np.isnan(reading.gradient_norm)


def test_a_multi_hot_kernel_the_sample_misses_is_measured_in_fit(float16_policy):
    """Issue 42's report: `fit` with a `ScaleMonitor` on a bias-free
    `Dense(3)` over multi-hot inputs, whose (1000, 3) kernel gradient lies
    in rows its sample does not read. Each report's gradient norm is within
    10% of float32's (from the same weights and batch, computed apart), no
    layer is flagged `never_updates`, and no step is skipped (the scale
    searched blind: 2**15, 2**23, 2**-16, two skips)."""
    rng = np.random.default_rng(0)
    x = np.zeros((64, 1000), "float32")
    for row in x:
        row[rng.choice(UNREAD_ROWS, 3, replace=False)] = 1.0
    y = rng.standard_normal((64, 3)).astype("float32")
    model = keras.Sequential([keras.Input((1000,)),
                              keras.layers.Dense(3, use_bias=False, name="multi_hot")])
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1)), "mse",
                  jit_compile=True)
    kernels = []  # the kernel before each step
    before = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: kernels.append(model.get_weights()[0]))
    monitor = tas.ScaleMonitor(every_n_steps=1, verbose=0)
    model.fit(x, y, batch_size=64, epochs=8, callbacks=[before, monitor], verbose=0)
    import tensorflow as tf

    twin = keras.Sequential([keras.Input((1000,)),
                             keras.layers.Dense(3, use_bias=False, dtype="float32")])
    assert len(monitor.records) == 8
    for record in monitor.records:
        twin.set_weights([kernels[record["measured_step"]]])
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, twin(x))
            loss = tf.reduce_mean(loss)
        reference = float(tf.norm(tape.gradient(loss, twin.trainable_variables[0])))
        assert record["layers"]["multi_hot"]["grad_norm"] == pytest.approx(reference, rel=0.1)
        assert record["layers"]["multi_hot"]["zero_fraction"] == pytest.approx(1 - 72 / 3000)
        assert record["skipped_steps"] == 0
    assert not [f for f in monitor.flags if f["kind"] == "never_updates"]


def test_a_gradient_of_values_whose_squares_underflow_is_not_recorded_as_zero():
    """Values below 2**-75 have float32 squares of 0: the norm, whose zero
    means an exactly zero gradient (`never_updates`), is then their exact
    peak, its lower bound, not 0."""
    gradient = np.full((4, 8), 2.0**-80, "float32")
    gradient[1, 2] = 2.0**-78
    variable = keras.Variable(np.zeros((4, 8), "float32"))
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1.0), scaling="none")
    optimizer.apply([ops.array(gradient)], [variable])
    norm = float(optimizer.variable_gradient_norms.numpy()[0])
    assert norm == 2.0**-78 <= np.linalg.norm(gradient.astype(np.float64))
    assert float(optimizer.gradient_norm) == norm
