"""`model.fit` and `train_on_batch`, one body on both backends (TensorFlow's
stateful `apply` in its trainer, JAX's `stateless_apply` in its): against
the stock optimizer (dynamic mode), plain float32 training, float32
autodiff and float64 gradients by hand (a gradient no global scale
reaches), the monitor's JSON lines, and save and resume.
"""

import json

import keras
import numpy as np
import pytest

import tf_adaptive_scale as tas
from helpers import (
    JAX, TF, applied_update, attenuated_problem, attenuated_training, linear_data, three_layer_mlp,
    twin,
)


# The cheaper compiled trainer path where a test does not depend on it: XLA
# compiles slowly on TensorFlow (its graph mode is compiled too); JAX runs
# slowly op by op.
FAST_JIT = JAX


def test_fit_matches_stock_keras_side_by_side(float16_policy):
    """Dynamic mode is the stock optimizer's rule: same weights and scale
    after `fit`, overflowing batches included."""
    x, y = linear_data()
    x[17] = 3e4  # overflows float16 in the backward pass of its batch
    ours_model = three_layer_mlp()
    stock_model = twin(ours_model)
    ours = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.01), scaling="dynamic", dynamic_growth_steps=3,
        initial_scale=2.0**12,
    )
    stock = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), dynamic_growth_steps=3, initial_scale=2.0**12
    )
    for model, opt in ((ours_model, ours), (stock_model, stock)):
        model.compile(opt, "mse", jit_compile=FAST_JIT)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(ours.skipped_steps) >= 1
    assert float(ours.loss_scale.numpy()) == float(stock.dynamic_scale.numpy())
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy())
    for a, b in zip(ours_model.get_weights(), stock_model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
def test_scaled_float32_training_equals_unscaled(scaling):
    """In float32, power-of-two scales are exact: training with any of them,
    per layer inside the backward pass too, gives the weights of plain Adam."""
    x, y = linear_data()
    plain = three_layer_mlp()
    model = twin(plain)
    if scaling == "per_layer":
        model = tas.instrument(model, initial_scale=2.0**9)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling=scaling, update_every=2,
        initial_scale=2.0**7,
    )
    model.compile(opt, "mse", jit_compile=FAST_JIT)
    plain.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=FAST_JIT)
    for m in (model, plain):
        m.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert int(opt.skipped_steps) == 0 and int(opt.measurements) >= 5
    for layer in plain.layers:
        for a, b in zip(model.get_layer(layer.name).get_weights(), layer.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if scaling == "per_layer":
        scales = opt.layer_scales()
        assert set(scales) == {"hidden", "middle", "head"}
        assert len(set(scales.values())) > 1  # each layer found its own scale


def autodiff_gradients(model, x, y):
    """The backend's gradients of `model`'s mean squared error on `(x, y)`
    with respect to its trainable variables, as numpy arrays."""
    def loss_of(pred):
        return keras.ops.mean(keras.ops.square(pred - y))

    if TF:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_of(model(x))
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    import jax

    def loss(trainable):
        pred, _ = model.stateless_call(trainable, [v.value for v in model.non_trainable_variables], x)
        return loss_of(pred)

    return [np.asarray(g) for g in jax.grad(loss)([v.value for v in model.trainable_variables])]


def test_per_layer_reaches_a_gradient_no_global_scale_can():
    """float16: the lowest layer's gradient lies below 2**-30, out of reach of
    any global scale (at most 2**24; the global adaptive optimizer: in
    test_jax.py). Per layer, that unit, far below the loss, gets a scale
    beyond the global bound and applies the float32 gradient: the float64
    one by hand, and the float32 twin's by the backend's autodiff."""
    x, y, reference, expected = attenuated_problem()
    assert 0 < np.abs(expected[0]).max() < 2.0**-30
    kernel_grad, bias_grad = autodiff_gradients(reference, x, y)
    assert 0 < np.abs(kernel_grad).max() < 2.0**-30  # no float16 scale of 2**24 reaches it
    # All underflowed at scale 1: rises 2**8 a step, then the rule.
    model, inst, opt = attenuated_training("per_layer", reference, x, y)
    assert inst.layer_scales()["below"] > 2.0**40
    applied = applied_update(model, inst, opt, x, y)
    assert int(opt.skipped_steps) == 0
    assert opt.layer_scales()["below"] > 2.0**40
    for got, g, g32 in zip(applied, expected, (kernel_grad, bias_grad)):
        np.testing.assert_allclose(got, g, rtol=2e-2, atol=2e-2 * np.abs(g).max())
        np.testing.assert_allclose(got, g32, rtol=2e-2, atol=2e-2 * np.abs(g32).max())


def test_monitor_writes_json_lines_in_fit(tmp_path, float16_policy):
    x, y = linear_data()
    model = three_layer_mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2)
    model.compile(opt, "mse", jit_compile=FAST_JIT)
    monitor = tas.ScaleMonitor(every_n_steps=2, log_dir=str(tmp_path), verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    lines = (tmp_path / "scale_monitor.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    layers = {name.rsplit("/", 1)[-1] for name in records[-1]["layers"]}
    assert layers == {"hidden", "middle", "head"}
    assert records[-1]["loss_scale"] == float(opt.loss_scale.numpy())


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
def test_saved_model_resumes_exactly(tmp_path, scaling, float16_policy):
    x, y = linear_data()

    def make():
        keras.utils.set_random_seed(1)
        model = three_layer_mlp()
        if scaling == "per_layer":
            model = tas.instrument(model)
        opt = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-3), scaling=scaling, update_every=3
        )
        model.compile(opt, "mse", jit_compile=FAST_JIT)
        return model

    straight = make()
    straight.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    first = make()
    first.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    first.save(path)
    resumed = keras.saving.load_model(path)
    resumed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert resumed.optimizer.scaling == scaling
    for name in ("total_steps", "measurements", "skipped_steps"):
        assert int(getattr(resumed.optimizer, name).numpy()) == int(
            getattr(straight.optimizer, name).numpy()
        ), name
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(a, b)
