"""Regression tests: each SGD step must apply the true (unscaled) gradient.

Every behavioural test compares the weight change of one SGD step with
`-learning_rate * g`, where `g` is computed independently: a float32 copy of
the model with the same weights, the same loss, and `tf.GradientTape`.
"""

import json
import math

import numpy as np
import pytest
import keras
import tensorflow as tf
from keras import ops

import tf_adaptive_scale as tas
from helpers import dense_model, normal as data, run_python

# ----------------------------------------------------------------- helpers


def float32_config(config):
    """`config` with every dtype policy replaced by "float32"."""
    if isinstance(config, dict):
        if config.get("class_name") in ("DTypePolicy", "FloatDTypePolicy"):
            return "float32"
        return {k: float32_config(v) for k, v in config.items()}
    if isinstance(config, list):
        return [float32_config(v) for v in config]
    return config


def float32_twin(model):
    """A float32 copy of `model` (nested models too) holding its weights."""
    twin = model.__class__.from_config(float32_config(model.get_config()))
    twin.set_weights(model.get_weights())
    twin.trainable = True
    assert all(w.dtype == "float32" for w in twin.weights)
    return twin


def reference_gradients(model, x, y, loss_fn):
    """float32 gradients of `mean(loss_fn(y, model(x)))`, one per `model.weights`."""
    twin = float32_twin(model)
    with tf.GradientTape() as tape:
        loss = ops.mean(loss_fn(ops.convert_to_tensor(y), twin(x, training=True)))
    grads = tape.gradient(loss, twin.weights)
    return [np.asarray(g, np.float64) for g in grads]


def values(variables):
    return [np.asarray(v.numpy(), np.float64) for v in variables]


def assert_sgd_change(changes, lr, grads, rtol=2e-2):
    """Each weight changed by `-lr * grad` (the float32 reference gradient)."""
    for i, (change, g) in enumerate(zip(changes, grads)):
        expected = -lr * g
        atol = rtol * np.max(np.abs(expected))
        np.testing.assert_allclose(
            change, expected, rtol=rtol, atol=atol,
            err_msg=f"weight {i}: change / expected = "
            f"{np.linalg.norm(change) / np.linalg.norm(expected):.4g}",
        )


def assert_sgd_step(before, after, lr, grads, rtol=2e-2):
    """The weights went from `before` to `after` by one SGD step."""
    assert_sgd_change([a - b for a, b in zip(after, before)], lr, grads, rtol)


def mse(y, p):
    return ops.mean(ops.square(ops.cast(y, "float32") - ops.cast(p, "float32")), axis=-1)


def tiny_mse(y, p):
    """An MSE whose gradients (~1e-9) underflow float16 without loss scaling."""
    return 1e-6 * mse(y, p)


def milli_mse(y, p):
    return 1e-3 * mse(y, p)


def per_layer_optimizer(lr):
    return tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(lr), scaling="per_layer")


# ------------------------------------- 1: unfreezing after tas.instrument


def test_unfreezing_after_instrument_unscales_the_unfrozen_weights(float16_policy):
    """Bug 1: weights frozen at instrument time must be unscaled once trainable."""
    keras.utils.set_random_seed(1)
    base_in = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="base_1")(base_in)
    h = keras.layers.Dense(16, activation="tanh", name="base_2")(h)
    base = keras.Model(base_in, h, name="base")
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(base(inputs)))
    x, y = data((16, 8), 0), data((16, 2), 1, 0.1)
    lr = 0.05

    base.trainable = False
    inst = tas.instrument(model)
    inst.compile(per_layer_optimizer(lr), loss="mse", jit_compile=True)
    for _ in range(3):
        inst.train_on_batch(x, y)

    base.trainable = True
    optimizer = per_layer_optimizer(lr)
    inst.compile(optimizer, loss="mse", jit_compile=True)
    grads = reference_gradients(model, x, y, mse)
    before = values(model.weights)
    inst.train_on_batch(x, y)
    after = values(model.weights)
    assert int(optimizer.skipped_steps) == 0
    base_ids = {id(w) for w in base.weights}
    picked = [i for i, w in enumerate(model.weights) if id(w) in base_ids]
    assert len(picked) == 4
    assert_sgd_step(
        [before[i] for i in picked], [after[i] for i in picked], lr,
        [grads[i] for i in picked],
    )


# ------------------------------------------- 2: default scaling mode

LOADED_STEP = r"""
import json, sys
import numpy as np
import keras
import tf_adaptive_scale as tas
from test_regressions import reference_gradients, values
path, data_path = sys.argv[1], sys.argv[2]
assert keras.config.dtype_policy().name == "float32"
x, y = np.load(data_path)["x"], np.load(data_path)["y"]
model = keras.models.load_model(path)
loss_fn = keras.losses.get(model.loss)
grads = reference_gradients(model, x, y, loss_fn)
before = values(model.weights)
model.train_on_batch(x, y)
after = values(model.weights)
print(json.dumps({
    "change": [(a - b).tolist() for a, b in zip(after, before)],
    "grads": [g.tolist() for g in grads],
    "lr": float(model.optimizer.inner_optimizer.learning_rate.numpy()),
    "skipped": int(model.optimizer.skipped_steps.numpy()),
}))
"""


@pytest.mark.slow  # starts a child process
def test_default_scaling_survives_save_and_load_in_a_float32_process(tmp_path, float16_policy):
    """Bug 2a: a loaded default-mode optimizer must unscale what it scales."""
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )
    lr = 0.05
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(lr))
    model.compile(optimizer, loss="mse", jit_compile=True)
    x, y = data((16, 4), 0), data((16, 1), 1)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert float(optimizer.loss_scale) != 1.0
    path = str(tmp_path / "model.keras")
    model.save(path)
    np.savez(tmp_path / "data.npz", x=x, y=y)

    out = run_python("-c", LOADED_STEP, path, str(tmp_path / "data.npz"), cwd=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["skipped"] == 0
    assert_sgd_change(
        [np.asarray(c) for c in result["change"]],
        result["lr"],
        [np.asarray(g) for g in result["grads"]],
    )


def small_model(dtype=None):
    return dense_model(4, dict(units=8, activation="tanh", dtype=dtype), dict(units=1, dtype=dtype),
                       sequential=True)


def tiny_gradient_batch(model):
    """Targets 0.1 from the predictions: float32 weight gradients ~1e-8."""
    x = data((32, 4), 0)
    prediction = np.asarray(model(x), np.float32)
    return x, prediction + data((32, 1), 1, 0.1)


def one_tiny_step(model, optimizer, lr):
    model.compile(optimizer, loss=tiny_mse, jit_compile=True)
    x, y = tiny_gradient_batch(model)
    grads = reference_gradients(model, x, y, tiny_mse)
    before = values(model.weights)
    model.train_on_batch(x, y)
    return before, values(model.weights), grads


def test_default_scaling_follows_the_policy_set_after_the_optimizer():
    """Bug 2b: an optimizer made before set_global_policy must still scale."""
    lr = 1e5
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(lr))
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = small_model()
    before, after, grads = one_tiny_step(model, optimizer, lr)
    assert int(optimizer.skipped_steps) == 0
    assert_sgd_step(before, after, lr, grads)


def test_default_scaling_follows_mixed_float16_layers():
    """Bug 2c: layers with dtype='mixed_float16' under a float32 policy need scaling."""
    lr = 1e5
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(lr))
    model = small_model(dtype="mixed_float16")
    before, after, grads = one_tiny_step(model, optimizer, lr)
    assert int(optimizer.skipped_steps) == 0
    assert_sgd_step(before, after, lr, grads)


# --------------------------- 3: get_unscaled_gradients leaves no hidden state


def static_setup(lr):
    model = small_model()
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(lr), scaling="static", initial_scale=2.0**10
    )
    optimizer.build(model.trainable_variables)
    x, y = data((16, 4), 0), data((16, 1), 1)
    return model, optimizer, x, y


def test_get_unscaled_gradients_does_not_change_a_later_apply():
    """Bug 3: a logging call of get_unscaled_gradients must not stop the next step unscaling."""
    lr = 0.05
    model, optimizer, x, y = static_setup(lr)
    variables = model.trainable_variables

    @tf.function(jit_compile=True)
    def unscaled_gradient_norm(x, y):
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(ops.mean(mse(y, model(x, training=True))))
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
        return tf.linalg.global_norm(grads)

    @tf.function(jit_compile=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(ops.mean(mse(y, model(x, training=True))))
        optimizer.apply(tape.gradient(scaled, variables), variables)

    norm = float(unscaled_gradient_norm(x, y))
    grads = reference_gradients(model, x, y, mse)
    np.testing.assert_allclose(norm, np.sqrt(sum(np.sum(g**2) for g in grads)), rtol=1e-4)
    before = values(model.weights)
    train_step(x, y)
    assert_sgd_step(before, values(model.weights), lr, grads)


def clip_to_global_norm(grads, norm):
    """numpy reference of tf.clip_by_global_norm."""
    total = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))
    return [g * min(1.0, norm / total) for g in grads]


@pytest.mark.parametrize("clip, eager", [(None, False), (1e-3, False), (None, True), (1e-3, True)])
def test_legacy_get_scaled_loss_get_unscaled_gradients_apply_gradients(clip, eager):
    """Bug 3 guard: the tf-keras flow unscales exactly once, also when the
    unscaled gradients are clipped before apply_gradients, and eagerly."""
    lr = 0.05
    model, optimizer, x, y = static_setup(lr)
    variables = model.trainable_variables

    def train_step(x, y):
        with tf.GradientTape() as tape:
            scaled = optimizer.get_scaled_loss(ops.mean(mse(y, model(x, training=True))))
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
        if clip is not None:
            grads, _ = tf.clip_by_global_norm(grads, clip)
        optimizer.apply_gradients(zip(grads, variables))

    if not eager:
        train_step = tf.function(train_step, jit_compile=True)
    grads = reference_gradients(model, x, y, mse)
    if clip is not None:
        grads = clip_to_global_norm(grads, clip)
    before = values(model.weights)
    train_step(x, y)
    assert_sgd_step(before, values(model.weights), lr, grads)


# ------------------------------------------------------ 4: scale arguments

BAD_SCALES = [math.nan, math.inf, 2.0**200, 3.0, 0.0, -1.0, 2.0**-140]
BAD_SCALE_IDS = ["nan", "inf", "2**200", "3", "0", "-1", "2**-140"]


@pytest.mark.parametrize("value", BAD_SCALES, ids=BAD_SCALE_IDS)
def test_optimizer_rejects_bad_initial_scale(value):
    """Bug 4: initial_scale must be a power of two with a normal float32 value."""
    with pytest.raises(ValueError, match="initial_scale"):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), initial_scale=value)


@pytest.mark.parametrize("value", BAD_SCALES, ids=BAD_SCALE_IDS)
def test_instrument_rejects_bad_initial_scale(value):
    """Bug 4: tas.instrument validates initial_scale like the optimizer does."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="initial_scale"):
        tas.instrument(model, initial_scale=value)


@pytest.mark.parametrize(
    "name, value", [("min_scale", 2.0**-140), ("max_scale", 2.0**200)],
    ids=["min_scale=2**-140", "max_scale=2**200"],
)
def test_optimizer_rejects_scale_bounds_outside_float32(name, value):
    """Bug 4: min_scale/max_scale must be normal float32 values."""
    with pytest.raises(ValueError, match=name):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), **{name: value})


def test_non_finite_unscaled_gradient_skips_the_step():
    """Bug 4: the finite check must look at the unscaled gradient that is applied."""
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.1), scaling="static",
        initial_scale=2.0**-100, min_scale=2.0**-100,
    )
    var = keras.Variable([1.0, 2.0], dtype="float32")
    # 1e10 / 2**-100 overflows float32: the unscaled gradient is inf.
    optimizer.apply([tf.constant([1e10, 1.0])], [var])
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0])
    assert int(optimizer.skipped_steps) == 1


# ----------------------------------------------------- 5: float16 weights


def float16_layer_model():
    return dense_model(4, dict(units=8, activation="tanh", dtype="float16"), 1, sequential=True)


@pytest.mark.parametrize(
    "policy, kwargs",
    [
        ("float32", dict(scaling="static", initial_scale=2.0**17)),
        ("float16", dict(scaling="static", initial_scale=2.0**17)),
        ("float16", dict()),  # the default under a float16 policy: adaptive
    ],
    ids=["float16-layer-static", "float16-policy-static", "float16-policy-default"],
)
def test_float16_weights_get_their_gradient(policy, kwargs):
    """Bug 5: scales above float16's range must not zero float16 weights' gradients."""
    keras.mixed_precision.set_global_policy(policy)
    model = float16_layer_model() if policy == "float32" else small_model()
    assert model.weights[0].dtype == "float16"
    lr = 500.0  # updates ~0.1, far above float16's resolution of the weights
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(lr), **kwargs)
    model.compile(optimizer, loss=milli_mse, jit_compile=True)
    x, y = data((16, 4), 0, 0.5), data((16, 1), 1, 0.5)
    for _ in range(2):  # the adaptive scale rises above 2**16 on step 1
        model.train_on_batch(x, y)
    grads = reference_gradients(model, x, y, milli_mse)
    before = values(model.weights)
    model.train_on_batch(x, y)
    assert int(optimizer.skipped_steps) == 0
    assert float(optimizer.loss_scale) > 2.0**16
    assert_sgd_step(before[:2], values(model.weights)[:2], lr, grads[:2], rtol=5e-2)


# ---------------------------------------------- 6: per-layer under bfloat16


def test_per_layer_scaling_under_mixed_bfloat16():
    """Bug 6: per-layer scaling must train a mixed_bfloat16 model correctly."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = small_model()
    inst = tas.instrument(model)
    lr = 0.05
    optimizer = per_layer_optimizer(lr)
    inst.compile(optimizer, loss="mse", jit_compile=True)
    x, y = data((16, 4), 0), data((16, 1), 1)
    grads = reference_gradients(model, x, y, mse)
    before = values(model.weights)
    inst.train_on_batch(x, y)
    assert int(optimizer.skipped_steps) == 0
    assert_sgd_step(before, values(model.weights), lr, grads, rtol=5e-2)


# ------------------------------------------- issue 10: found as a demanding user


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(autoclip_per_variable=True), "autoclip_percentile"),
        (dict(headroom=2.0**20), "headroom"),
    ],
)
def test_silently_ignored_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_inner_gradient_accumulation_is_refused_naming_ours():
    # It would decide each micro-batch alone: an overflow in one would skip
    # only that micro-batch and the window would silently grow.
    with pytest.raises(ValueError, match="accumulation_steps=3"):
        tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=3))


def two_dense(seed=0):
    return dense_model(6, (8, "tanh", "d1"), (1, None, "d2"), seed=seed)


@pytest.mark.parametrize(
    "reference_optimizer, inner, window", [
        (lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=None),
         lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=None),
         1),
        # Keras's own accumulation and ours agree (ours decides per window).
        (lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
         lambda: keras.optimizers.Adam(1e-2), 2),
    ], ids=["ema", "accumulation"])
def test_per_layer_with_inner_ema_or_accumulation_matches_the_plain_optimizer(
        reference_optimizer, inner, window):
    """float32: per-layer scaling is exact, so `fit` must end with the same
    weights as the same inner optimizer alone (EMA finalized at the end)."""
    x, y = data((32, 6), 1), data((32, 1), 2)
    reference = two_dense()
    reference.compile(reference_optimizer(), "mse")
    reference.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    model = tas.instrument(two_dense())
    model.compile(tas.AdaptiveLossScaleOptimizer(
        inner(), scaling="per_layer", accumulation_steps=window), "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        if got.shape == want.shape:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    names = {v.path: v.numpy() for v in model.trainable_variables}
    for v in reference.trainable_variables:
        np.testing.assert_allclose(names[v.path], v.numpy(), rtol=1e-5, atol=1e-7)


def test_per_layer_fit_with_a_partial_last_batch(float16_policy):
    # The last, smaller batch retraces with an unknown batch size: the
    # statistics' exponent read (a bit view) once needed a static shape.
    model = tas.instrument(two_dense())
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.1), scaling="per_layer", update_every=1)
    model.compile(opt, "mse", jit_compile=True)
    model.fit(data((20, 6), 1), data((20, 1), 2), batch_size=8, epochs=2,
              verbose=0, shuffle=False)
    assert int(opt.total_steps) == 6
    assert int(opt.skipped_steps) <= 1


def test_one_replica_mirrored_strategy_trains():
    # MirroredStrategy() on a one-GPU machine: the inner optimizer's
    # merge_call once ran inside the step's conditional and failed.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(opt, "mse", jit_compile=False)
    before = model.get_weights()
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"),
              batch_size=4, verbose=0)
    assert opt.total_steps.numpy() == 2 and opt.skipped_steps.numpy() == 0
    assert not np.array_equal(before[0], model.get_weights()[0])
    step = tas.make_train_step(model, "mse", opt, strategy=strategy)
    logs = step(np.ones((4, 4), "float32"), np.ones((4, 1), "float32"))
    assert bool(logs["step_finite"]) and opt.total_steps.numpy() == 3
