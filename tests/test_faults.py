"""Fault injection: bad batches, bad losses, a layer whose backward is always
non-finite, gradient spikes and scales at their bounds. Each test checks the
weights, the inner optimizer's slots and the counters afterwards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import dense_model


def mlp(seed=0):
    return dense_model(6, (8, "relu", "first"), (1, None, "head"), seed=seed)


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, (x[:, :1] - x[:, 1:2]).astype("float32")


def snapshot(model, opt):
    return ([w.copy() for w in model.get_weights()],
            [np.array(v.numpy()) for v in opt.inner_optimizer.variables])


def assert_unchanged(before, after):
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)


def test_nan_batches_for_a_long_stretch_stop_fit_cleanly(float16_policy):
    """Every batch holds a NaN: every step is skipped without backing the
    scale off, and the monitor stops fit after max_consecutive_skips."""
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), max_consecutive_skips=10, autoclip_percentile=90.0)
    model.compile(opt, "mse", jit_compile=True)
    opt.build(model.trainable_variables)
    before = snapshot(model, opt)
    history = (opt.norm_history.numpy().copy(), int(opt.norm_history_count))
    scale = float(opt.loss_scale)
    x, y = data()
    x[:, 0] = np.nan
    monitor = tas.ScaleMonitor(every_n_steps=5, verbose=0)
    with pytest.warns(RuntimeWarning, match="consecutive steps skipped"):
        model.fit(x, y, batch_size=2, epochs=3, verbose=0, callbacks=[monitor])
    assert isinstance(monitor.stop_error, tas.SkippedStepsError)
    assert "loss itself was not finite" in str(monitor.stop_error)
    assert int(opt.total_steps) == 10  # stopped at the first report past the limit
    assert int(opt.skipped_steps) == 10 and int(opt.iterations) == 0
    assert float(opt.loss_scale) == scale  # bad data: no back-off
    assert_unchanged(before, snapshot(model, opt))
    # AutoClip's history took none of the skipped steps' norms.
    np.testing.assert_array_equal(opt.norm_history.numpy(), history[0])
    assert int(opt.norm_history_count) == history[1] == 0 and int(opt.clipped_steps) == 0


class Poison(keras.layers.Layer):
    """The identity forward; backward, an infinite gradient, always."""

    def call(self, x):
        @tf.custom_gradient
        def poison(x):
            return tf.identity(x), lambda dy: dy * float("inf")

        return poison(x)


def test_a_layer_whose_backward_is_always_inf_raises_naming_it():
    """Custom loop: the flag counts, then check_progress names the layer."""
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, name="first")(x)
    h = Poison(name="poison")(h)
    h = keras.layers.Dense(8, name="middle")(h)
    model = keras.Model(x, keras.layers.Dense(1, name="head")(h))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling="dynamic", max_consecutive_skips=5)
    opt.build(model.trainable_variables)
    before = snapshot(model, opt)
    xs, ys = data()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(ys, model(xs)))
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    for i in range(4):
        step()
        opt.check_progress()  # below the limit: nothing raised
        assert int(opt.consecutive_skips) == i + 1
    step()
    with pytest.raises(tas.SkippedStepsError, match="'first'") as error:
        opt.check_progress()
    assert "5 consecutive steps skipped, up to step 5" in str(error.value)
    assert opt.stalled_layers() == ["first"]  # middle and head are finite
    assert_unchanged(before, snapshot(model, opt))
    assert int(opt.skipped_steps) == 5 and float(opt.loss_scale) == 2.0**10


def test_an_applied_step_resets_the_count():
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1), scaling="none",
                                         max_consecutive_skips=3)
    variables = model.trainable_variables
    bad = [tf.fill(v.shape, np.inf) for v in variables]
    good = [tf.zeros(v.shape) for v in variables]
    for grads in (bad, bad, good, bad, bad):
        opt.apply(grads, variables)
    assert int(opt.consecutive_skips) == 2
    opt.check_progress()
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), max_consecutive_skips=0)


def test_a_gradient_spike_is_bounded_by_autoclip():
    """A 1e6 spike after steady gradients: AutoClip holds the update to the
    percentile of the recent norms; the weights move by at most that."""
    variable = keras.Variable(np.zeros(4, "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1.0), scaling="none",
                                         autoclip_percentile=90.0, autoclip_window=16)
    for _ in range(10):
        opt.apply([tf.fill((4,), 0.5)], [variable])  # norm 1.0 each
    before = variable.numpy().copy()
    opt.apply([tf.fill((4,), 5e5)], [variable])  # norm 1e6
    moved = np.linalg.norm(variable.numpy() - before)
    assert moved == pytest.approx(1.0, rel=1e-5)
    assert int(opt.clipped_steps) == 1


@pytest.mark.parametrize("bound", ["min", "max"])
def test_scale_at_its_bounds_stays_finite(float16_policy, bound):
    """Pinned at min_scale by gradients that overflow anyway, or at max_scale
    by gradients that are all zero: the scale stays that power of two."""
    model = mlp()
    limits = dict(min_scale=2.0**-4, max_scale=2.0**6, initial_scale=2.0**2)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), update_every=1, **limits)
    variables = model.trainable_variables
    for _ in range(12):
        value = np.inf if bound == "min" else 0.0
        opt.apply([tf.fill(v.shape, value) for v in variables], variables)
        scale = float(opt.loss_scale)
        assert np.isfinite(scale) and limits["min_scale"] <= scale <= limits["max_scale"]
    assert float(opt.loss_scale) == limits[f"{bound}_scale"]


@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan])
def test_a_non_finite_input_batch_is_skipped_without_back_off(float16_policy, poison):
    """Inf or NaN in one input: the loss is not finite, the step is skipped,
    nothing moves, the scale stays; the next clean batch is applied."""
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), scaling="dynamic")
    model.compile(opt, "mse", jit_compile=True)
    x, y = data(8)
    model.train_on_batch(x, y)  # builds; one applied step
    before, scale = snapshot(model, opt), float(opt.loss_scale)
    bad = x.copy()
    bad[3, 2] = poison
    model.train_on_batch(bad, y)
    assert_unchanged(before, snapshot(model, opt))
    assert float(opt.loss_scale) == scale and int(opt.skipped_steps) == 1
    assert not bool(opt.last_loss_finite.numpy())
    model.train_on_batch(x, y)
    assert int(opt.iterations) == 2 and int(opt.consecutive_skips) == 0
