"""The statistics the optimizer takes on every step, from a fixed strided
sample of each gradient, against the exact ones.

Peaks, non-finite counts and norms are exact (they guard against overflow);
histograms and zeros are estimates. The scales chosen from them must stay
within one binade of those the exact histograms give, on the benchmarks'
models (`benchmarks/step_cost.py`), globally and per layer.
"""

import os
import sys

import keras
import numpy as np
import pytest
from helpers import ROOT
from keras import ops

import tf_adaptive_scale as tas
from tf_adaptive_scale import gradient_scale
from tf_adaptive_scale import gradient_statistics as stats

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import step_cost  # noqa: E402


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
    model, shape = step_cost.FAMILIES[family]()
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
            model.train_on_batch(*step_cost.batch_for(model, shape, step))
    finally:
        stats.SAMPLE, stats.VARIABLE_SAMPLE = saved
        gradient_scale._measured_rows.cache_clear()
    if scaling != "per_layer":
        return np.log2([float(optimizer.loss_scale)]), np.asarray(optimizer.scale_window)[:1]
    (table,) = [layer for layer in model.layers if isinstance(layer, tas.ScaleTable)]
    statistics = np.asarray(table.statistics)[1:]  # the loss unit has none
    low, _ = stats.scale_bounds(statistics[:, : stats.NUM_BINS], np.ones(len(statistics)),
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


def sparse_rows_gradient(rows=50_000, width=16, used=20, seed=0):
    """A dense embedding-table gradient (as Keras on JAX gives): rows 1 to
    `used` of `rows` hold values, the rest are zero."""
    rng = np.random.default_rng(seed)
    gradient = np.zeros((rows, width), "float32")
    gradient[1 : used + 1] = rng.standard_normal((used, width)).astype("float32") * 1e-3
    return gradient


def test_a_dense_table_whose_used_rows_the_strided_sample_misses():
    """The strided sample reads about one value in each of 2048 rows of a
    50,000-row table: the 20 rows a batch used read as all zero (norm 0,
    the whole table underflowed). The norm and zeros are exact, and the
    histogram is of the rows holding the largest values."""
    gradient = sparse_rows_gradient()
    strided, _ = stats._strided_sample(ops.reshape(ops.array(gradient), (-1,)),
                                       stats.VARIABLE_SAMPLE)
    assert not np.any(np.asarray(strided))  # what the sample alone saw
    exact = stats.grouped_statistics([ops.array(gradient)], [0], 1)
    sampled = stats.grouped_statistics([ops.array(gradient)], [0], 1,
                                       sample=stats.VARIABLE_SAMPLE)
    assert float(sampled.squares[0]) == pytest.approx(float(exact.squares[0]), rel=1e-5)
    assert float(sampled.zeros[0]) == float(exact.zeros[0]) == gradient.size - 20 * 16
    np.testing.assert_allclose(np.asarray(sampled.histograms[0]),
                               np.asarray(exact.histograms[0]), atol=1e-3)
    assert float(sampled.max_abs[0]) == float(exact.max_abs[0])
