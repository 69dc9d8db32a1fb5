"""model.fit and custom loops, XLA and not, side by side with stock Keras."""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import dense_model


def data(n=64, d=8):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d)).astype("float32")
    y = (x @ rng.standard_normal((d, 1)) + 0.1).astype("float32")
    return x, y


def mlp(d=8):
    return dense_model(d, (16, "relu"), 1, seed=1, sequential=True)


def fit_pair(ours, stock, jit, epochs=2):
    """Fits twin models with our optimizer and the stock one; returns both."""
    x, y = data()
    models = []
    for opt in (ours, stock):
        model = mlp()
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
        models.append(model)
    return models


@pytest.mark.parametrize("jit", [True, False])
def test_fit_mixed_float16_not_wrapped_twice_and_equals_stock(jit, float16_policy):
    ours = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling="dynamic", dynamic_growth_steps=3
    )
    stock = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic_growth_steps=3
    )
    a, b = fit_pair(ours, stock, jit)
    assert a.optimizer is ours  # compile(auto_scale_loss=True) kept it
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)
    assert float(ours.loss_scale) == float(stock.dynamic_scale)
    assert int(ours.iterations) == int(stock.iterations)
    assert int(ours.total_steps) == 8
    assert int(ours.skipped_steps) == 8 - int(ours.iterations)


@pytest.mark.parametrize("jit", [True, False])
def test_fit_adaptive_learns_like_float32(jit):
    x, y = data()
    ref = mlp()
    ref.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=jit)
    ref_hist = ref.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), update_every=2, initial_scale=2.0**8
    )
    model.compile(opt, "mse", jit_compile=jit)
    hist = model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)
    assert int(opt.skipped_steps) == 0
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=0.01)
    assert np.log2(float(opt.loss_scale)) % 1 == 0


def test_adaptive_skips_only_before_its_first_measurement(float16_policy):
    """The default initial scale (2**15, as Keras) overflows on this model;
    the adaptive scale backs off, measures, and skips nothing afterwards."""
    x, y = data()
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), update_every=2)
    model.compile(opt, "mse", jit_compile=True)
    finite = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: finite.append(bool(opt.last_step_finite.numpy()))
    )
    model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0, callbacks=[record])
    first_applied = finite.index(True)
    assert 0 < first_applied <= 3
    assert all(finite[first_applied:])
    assert int(opt.skipped_steps) == first_applied
    assert 2.0**-16 <= float(opt.loss_scale) <= 2.0**24


INNER = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "adam_accumulation": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
    "sgd_ema": lambda: keras.optimizers.SGD(0.05, use_ema=True, ema_overwrite_frequency=3),
}


@pytest.mark.parametrize("name", sorted(INNER))
def test_any_inner_optimizer_equals_stock(name, float16_policy):
    inner, window = INNER[name](), 1
    if inner.gradient_accumulation_steps:
        # Ours accumulates itself (one decision per window); the inner
        # optimizer's own accumulation is refused.
        inner, window = keras.optimizers.Adam(1e-2), inner.gradient_accumulation_steps
    ours = tas.AdaptiveLossScaleOptimizer(
        inner, scaling="dynamic", initial_scale=2.0**8, accumulation_steps=window)
    stock = keras.mixed_precision.LossScaleOptimizer(INNER[name](), initial_scale=2.0**8)
    a, b = fit_pair(ours, stock, jit=True)
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-6, atol=1e-7)
    assert int(ours.iterations) == int(stock.iterations)


def custom_loop(api, jit=True):
    """A GradientTape loop (under its test's `float16_policy`); returns the
    model, optimizer, trace count and losses."""
    x, y = data()
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.05), update_every=3)
    opt.build(model.trainable_variables)  # building inside the trace would retrace
    traces = []

    @tf.function(jit_compile=jit)
    def train_step(xb, yb):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(xb), "float32") - yb))
            scaled = opt.scale_loss(loss) if api == "keras3" else opt.get_scaled_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if api == "keras3":
            opt.apply(grads, model.trainable_variables)
        else:
            grads = opt.get_unscaled_gradients(grads)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(train_step(x[i : i + 16], y[i : i + 16])) for i in range(0, 64, 16) for _ in range(2)]
    return model, opt, len(traces), losses


@pytest.mark.parametrize("jit", [True, False])
def test_custom_loops_trace_once_and_agree(jit, float16_policy):
    m3, opt3, traces3, losses3 = custom_loop("keras3", jit)
    ml, optl, tracesl, lossesl = custom_loop("legacy", jit)
    assert traces3 == 1 and tracesl == 1
    assert int(opt3.total_steps) == 8 and int(opt3.iterations) + int(opt3.skipped_steps) == 8
    assert float(opt3.loss_scale) == float(optl.loss_scale)
    assert losses3[-1] < losses3[0]
    for a, b in zip(m3.get_weights(), ml.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_scaling_disabled_where_not_needed(policy):
    keras.mixed_precision.set_global_policy(policy)
    x, y = data()
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), update_every=1)
    model.compile(opt, "mse", jit_compile=True)
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert opt.scaling == "none" and float(opt.loss_scale) == 1.0
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert int(opt.skipped_steps) == 0 and int(opt.iterations) == 12
    assert float(opt.gradient_norm) > 0 and float(opt.gradient_max) > 0
