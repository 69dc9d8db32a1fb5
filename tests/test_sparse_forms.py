"""Sparse gradients in every form TensorFlow allows (issue 42): a
`tf.IndexedSlices` whose `dense_shape` is a tuple, a list or a tensor, with
a known or an unknown number of stored rows, is measured and applied as the
stock `LossScaleOptimizer` applies it.

TensorFlow only: `tf.IndexedSlices` and `tf.function` input signatures.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adaptive_scale as tas

SHAPE = (5, 10)
INDICES = [0, 2, 0]  # a repeated index: its rows add up
FORMS = {
    "tuple": lambda: SHAPE,
    "list": lambda: list(SHAPE),
    "tensor": lambda: tf.constant(SHAPE, "int64"),
}
# How the step runs: eagerly, traced, compiled, and traced for any number
# of stored rows (an input signature of None rows).
RUNS = ("eager", "function", "xla", "unknown_rows")


def step_for(optimizer, variable, form, run):
    """A step applying `IndexedSlices(values, indices, form's dense_shape)`."""

    def step(values, indices):
        optimizer.apply([tf.IndexedSlices(values, indices, FORMS[form]())], [variable])

    if run == "eager":
        return step
    if run == "unknown_rows":
        return tf.function(step, input_signature=[
            tf.TensorSpec((None, SHAPE[1]), "float32"), tf.TensorSpec((None,), "int32")])
    return tf.function(step, jit_compile=run == "xla")


def values_at(i):
    """Step `i`'s stored values, as a loss scaled by 2**15 gives them."""
    rng = np.random.default_rng(i)
    return (rng.standard_normal((len(INDICES), SHAPE[1])) * 2.0**15).astype("float32")


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("form", FORMS)
def test_every_dense_shape_form_is_applied_as_stock_applies_it(form, run):
    """Three steps side by side with the stock optimizer (the Keras-compatible
    mode): equal weights; the recorded norm is the dense sum's (float64)."""
    weights = []
    for make in (keras.mixed_precision.LossScaleOptimizer,
                 lambda inner: tas.AdaptiveLossScaleOptimizer(inner, scaling="dynamic",
                                                              update_every=1)):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = make(keras.optimizers.SGD(0.5))
        step = step_for(optimizer, variable, form, run)
        for i in range(3):
            step(tf.constant(values_at(i)), tf.constant(INDICES, "int32"))
        weights.append(variable.numpy())
    np.testing.assert_array_equal(weights[1], weights[0])
    dense = np.zeros(SHAPE)
    np.add.at(dense, INDICES, values_at(2).astype(np.float64) / 2.0**15)
    recorded = float(optimizer.variable_gradient_norms.numpy()[0])
    assert recorded == pytest.approx(np.linalg.norm(dense), rel=1e-5)


def test_keras_sparse_correctness_with_a_loss_scale_sgd():
    """Keras's `optimizer_sparse_test.py::test_sparse_correctness`, its
    loss-scale SGD case, with ours in place of `LossScaleOptimizer`: a
    sparse gradient (indices and `dense_shape` Python tuples) updates the
    variable as the same gradient made dense does, step after step."""
    optimizer_sparse = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    optimizer_dense = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    var_sparse = keras.Variable(initializer="ones", shape=(5, 3, 2))
    var_dense = keras.Variable(initializer="ones", shape=(5, 3, 2))
    for i in range(5):
        grad_sparse = tf.IndexedSlices(
            values=keras.ops.ones((3, 3, 2)) * (10.0 - i), indices=(0, 2, 4),
            dense_shape=(5, 3, 2),
        )
        grad_dense = keras.ops.convert_to_tensor(grad_sparse, sparse=False)
        optimizer_sparse.apply([grad_sparse], [var_sparse])
        optimizer_dense.apply([grad_dense], [var_dense])
        np.testing.assert_allclose(var_sparse.numpy(), var_dense.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arguments", [{"accumulation_steps": 2}, {"clipnorm": 1.0}],
                         ids=["accumulated", "clipped"])
def test_every_form_through_accumulation_and_clipping_as_its_dense_gradient(form, arguments):
    """Where stock has no counterpart (a window of micro-batches, clipping on
    the outer optimizer): each form gives the weights its dense gradient
    gives (compiled steps)."""
    weights = []
    for sparse_input in (True, False):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.5), scaling="dynamic", **arguments)

        @tf.function(jit_compile=True)
        def step(values, indices):
            grad = tf.IndexedSlices(values, indices, FORMS[form]())
            optimizer.apply([grad if sparse_input else tf.convert_to_tensor(grad)], [variable])

        for i in range(4):
            step(tf.constant(values_at(i)), tf.constant(INDICES, "int32"))
        weights.append(variable.numpy())
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-6, atol=1e-6)
