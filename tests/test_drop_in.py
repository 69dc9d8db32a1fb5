"""What a user replacing the stock optimizer meets (issue 22), each against an
independent reference: hand-computed scale sequences, dense gradients, the
stock optimizer.

Backend-neutral: runs on TensorFlow and on JAX; sparse gradients are
`tf.IndexedSlices` on one and `BCOO` on the other.
"""

import keras
import numpy as np
import pytest
from helpers import INF, JAX, NAN, dense_model, stepper, tensor

import tf_adaptive_scale as tas

def sparse_gradient(values, indices, shape):
    """A row-sparse gradient in the backend's own form."""
    values = np.asarray(values, "float32")
    if JAX:
        from jax.experimental import sparse

        return sparse.BCOO((values, np.asarray(indices)[:, None]), shape=shape)
    import tensorflow as tf

    return tf.IndexedSlices(
        tf.constant(values), tf.constant(indices), tf.constant(shape, "int64")
    )


def dense_of(values, indices, shape):
    dense = np.zeros(shape, "float32")
    np.add.at(dense, indices, np.asarray(values, "float32"))
    return dense


def apply_sparse(optimizer, grads, variables):
    """One compiled step on gradients that may be sparse."""
    if not JAX:
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(grads):
            optimizer.apply(grads, variables)

        return step(grads)
    import jax

    new_values, new_optimizer_values = jax.jit(optimizer.stateless_apply)(
        [v.value for v in optimizer.variables], grads, [v.value for v in variables]
    )
    for v, value in zip(variables, new_values):
        v.assign(value)
    for v, value in zip(optimizer.variables, new_optimizer_values):
        v.assign(value)


def test_min_scale_above_max_scale_fails_at_construction():
    with pytest.raises(ValueError, match="`min_scale` must be <= `max_scale`"):
        tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(), min_scale=4.0, max_scale=2.0
        )
    # Above every mode's default maximum: wrong whatever the mode.
    with pytest.raises(ValueError, match="`min_scale`"):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), min_scale=2.0**70)


def test_an_abandoned_non_finite_loss_leaves_the_next_step_alone():
    var = keras.Variable(np.ones(3, "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1.0), scaling="static", initial_scale=4.0
    )
    opt.build([var])
    opt.scale_loss(tensor(NAN))  # computed, then discarded: no apply
    opt.scale_loss(tensor(2.0))
    stepper(opt, [var])(tensor([4.0, 8.0, -4.0]))
    np.testing.assert_array_equal(var.numpy(), [0.0, -1.0, 2.0])
    assert int(opt.skipped_steps) == 0 and int(opt.iterations) == 1


def test_a_non_finite_loss_in_any_micro_batch_skips_the_window_without_backing_off():
    var = keras.Variable(np.ones(2, "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1.0), scaling="dynamic", initial_scale=8.0,
        accumulation_steps=2,
    )
    opt.build([var])
    step = stepper(opt, [var])
    opt.scale_loss(tensor(NAN))
    step(tensor([NAN, NAN]))
    opt.scale_loss(tensor(1.0))  # the window's second loss is finite
    step(tensor([8.0, 8.0]))
    assert int(opt.skipped_steps) == 1
    assert float(opt.loss_scale) == 8.0  # bad data: no back-off
    assert not bool(opt.last_loss_finite.numpy())
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])


def test_a_calibration_step_whose_gradients_all_underflowed_is_not_applied():
    var = keras.Variable(np.ones(3, "float32"))
    adam = keras.optimizers.Adam(0.1)
    opt = tas.AdaptiveLossScaleOptimizer(adam, scaling="adaptive")
    opt.build([var])
    step = stepper(opt, [var])
    step(tensor([INF, 1.0, 1.0]))  # overflow at 2**15: drops 39 binades
    assert float(opt.loss_scale) == 2.0**-24
    step(tensor([0.0, 0.0, 0.0]))  # all underflowed at 2**-24: not applied
    assert float(opt.loss_scale) == 2.0**-16  # rose UNSEEN_STEP binades
    assert int(opt.iterations) == 0 and int(opt.skipped_steps) == 2
    np.testing.assert_array_equal(var.numpy(), np.ones(3))
    moments = [v for v in adam.variables if v.shape == var.shape]
    assert len(moments) == 2 and not any(np.any(m.numpy()) for m in moments)
    g = 2.0**-16 * np.array([1.0, -2.0, 4.0], "float32")
    step(tensor(g))  # seen: applied, calibrated
    assert int(opt.iterations) == 1 and bool(opt.calibrated.numpy())
    np.testing.assert_allclose(var.numpy(), 1.0 - 0.1 * np.sign(g), rtol=1e-4)
    # Once calibrated, a genuinely zero gradient is an ordinary step.
    for _ in range(100):
        step(tensor([0.0, 0.0, 0.0]))
    assert int(opt.iterations) == 101


def test_a_zero_gradient_at_the_largest_scale_is_applied():
    var = keras.Variable(np.ones(2, "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1.0), scaling="adaptive", initial_scale=2.0**24,
        max_scale=2.0**24,
    )
    opt.build([var])
    stepper(opt, [var])(tensor([0.0, 0.0]))  # no higher scale to look at
    assert int(opt.iterations) == 1 and int(opt.skipped_steps) == 0


def test_sparse_gradients_are_unscaled_clipped_and_measured_as_their_dense_sum():
    # Every clipper at once: each acts on the rows summed per index.
    clip = dict(
        agc_factor=0.5, clipvalue=2.0, clipnorm=4.0, global_clipnorm=3.0,
        autoclip_percentile=10.0,
    )
    shape = (6, 3)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((5, 3)).astype("float32") * 4.0
    indices = np.array([4, 1, 4, 0, 1], "int32")  # repeated rows
    scale = 2.0**6
    results = []
    for sparse_input in (True, False):
        var = keras.Variable(np.ones(shape, "float32"))
        bias = keras.Variable(np.zeros(3, "float32"))
        opt = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(1.0), scaling="static", initial_scale=scale,
            update_every=1, **clip,
        )
        opt.build([var, bias])
        grad = (
            sparse_gradient(values * scale, indices, shape) if sparse_input
            else tensor(dense_of(values * scale, indices, shape))
        )
        apply_sparse(opt, [grad, tensor(np.full(3, scale))], [var, bias])
        results.append(
            (var.numpy(), opt.variable_gradient_norms.numpy(), int(opt.clipped_steps))
        )
    (sparse_var, sparse_norms, sparse_clipped), (var, norms, clipped) = results
    np.testing.assert_allclose(sparse_var, var, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sparse_norms, norms, rtol=1e-6)
    assert sparse_clipped == clipped == 1
    # The reference itself: the dense sum's norm.
    np.testing.assert_allclose(
        norms[0], np.linalg.norm(dense_of(values, indices, shape)), rtol=1e-6
    )


def test_sparse_gradients_reach_the_inner_optimizer_sparse():
    seen = []

    class Recording(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            seen.extend(type(g).__name__ for g in grads)
            return super().apply(grads, trainable_variables)

    var = keras.Variable(np.ones((1000, 4), "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        Recording(1.0), scaling="static", initial_scale=2.0**15, clipnorm=10.0
    )
    opt.build([var])
    values = np.ones((3, 4), "float32") * 2.0**15
    apply_sparse(opt, [sparse_gradient(values, [7, 7, 3], (1000, 4))], [var])
    assert seen == ["BCOO" if JAX else "IndexedSlices"]
    expected = np.ones((1000, 4), "float32")
    expected[[7, 3]] -= [[2.0] * 4, [1.0] * 4]
    np.testing.assert_array_equal(var.numpy(), expected)


def test_a_non_finite_sparse_gradient_skips_the_step():
    var = keras.Variable(np.ones((10, 2), "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1.0), scaling="dynamic")
    opt.build([var])
    apply_sparse(opt, [sparse_gradient([[1.0, INF]], [2], (10, 2))], [var])
    assert int(opt.skipped_steps) == 1
    np.testing.assert_array_equal(var.numpy(), np.ones((10, 2)))
    assert float(opt.loss_scale) == 2.0**14


def test_fit_accumulation_carries_an_unfinished_window_into_the_next_epoch():
    """5 batches an epoch, windows of 2: the fifth batch and the next
    epoch's first make one window; after 2 epochs, 5 windows applied. The
    reference: plain SGD on the same stream in batches twice as large."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 3)).astype("float32")
    y = rng.standard_normal((20, 1)).astype("float32")

    def model(optimizer):
        m = dense_model(3, 1, seed=1, sequential=True)
        m.compile(optimizer=optimizer, loss="mse")
        return m

    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.1), scaling="dynamic", accumulation_steps=2
    )
    ours = model(opt)
    ours.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 2  # the fifth batch waits
    ours.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 5
    reference = model(keras.optimizers.SGD(0.1))
    reference.fit(
        np.concatenate([x, x]), np.concatenate([y, y]), batch_size=8,
        shuffle=False, verbose=0,
    )
    for a, b in zip(ours.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entry", ["fit", "apply"])
def test_wrapped_in_keras_loss_scale_optimizer_it_refuses_before_any_update(entry):
    # The outer optimizer would unscale by its scale and this one divide by
    # its own again: an update 2**-15 of float32's (1.9e-7 for 0.17), silently.
    model = dense_model(4, 1)
    before = [keras.ops.convert_to_numpy(w) for w in model.weights]
    outer = keras.mixed_precision.LossScaleOptimizer(
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match="cannot be the `inner_optimizer` of LossScaleOptimizer"):
        if entry == "fit":
            model.compile(outer, "mse")
            model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), verbose=0)
        else:
            outer.apply([np.ones(w.shape, "float32") for w in model.trainable_weights],
                        model.trainable_weights)
    for w, b in zip(model.weights, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(w), b)
    # The other order is refused at construction.
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        tas.AdaptiveLossScaleOptimizer(
            keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
