"""Clipping acts on unscaled gradients, as clipping float32 gradients would."""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import dense_model

SCALE = 2.0**10
LR = 0.5


def setup(shapes=((3, 2), (2,)), **kwargs):
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.standard_normal(s).astype("float32")) for s in shapes]
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="static", initial_scale=SCALE, **kwargs
    )
    opt.build(variables)

    @tf.function(jit_compile=True)
    def step(grads):
        opt.apply([g * SCALE for g in grads], variables)  # as from a scaled loss

    return opt, variables, step


def random_grads(variables, rng, magnitude=1.0):
    return [(rng.standard_normal(v.shape) * magnitude).astype("float32") for v in variables]


def check_step(opt, variables, step, grads, reference_clip):
    before = [v.numpy().copy() for v in variables]
    step([tf.constant(g) for g in grads])
    expected = reference_clip(grads, before)
    for v, b, e in zip(variables, before, expected):
        np.testing.assert_allclose(v.numpy(), b - LR * e, rtol=1e-5, atol=1e-6)


def ref_clipnorm(c):
    return lambda gs, _: [g * min(1.0, c / np.linalg.norm(g)) for g in gs]


def ref_global(c):
    def clip(gs, _):
        n = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gs))
        return [g * min(1.0, c / n) for g in gs]

    return clip


def ref_agc(factor, eps):
    def unit_norm(x):
        if x.ndim <= 1:
            return np.abs(x)
        return np.sqrt(np.sum(x**2, axis=tuple(range(x.ndim - 1)), keepdims=True))

    def clip(gs, ws):
        out = []
        for g, w in zip(gs, ws):
            limit = np.maximum(unit_norm(w), eps) * factor
            n = unit_norm(g)
            out.append(np.where(n > limit, g * limit / n, g))
        return out

    return clip


@pytest.mark.parametrize(
    "kwargs, reference",
    [
        (dict(clipvalue=0.3), lambda gs, _: [np.clip(g, -0.3, 0.3) for g in gs]),
        (dict(clipnorm=0.7), ref_clipnorm(0.7)),
        (dict(global_clipnorm=0.9), ref_global(0.9)),
        (dict(agc_factor=0.2, agc_eps=1e-3), ref_agc(0.2, 1e-3)),
    ],
    ids=["clipvalue", "clipnorm", "global_clipnorm", "agc"],
)
def test_fixed_clipping_matches_float32_reference(kwargs, reference):
    opt, variables, step = setup(**kwargs)
    rng = np.random.default_rng(1)
    check_step(opt, variables, step, random_grads(variables, rng), reference)
    assert int(opt.clipped_steps) == 1
    # Tiny gradients are not clipped, and the step is not counted.
    check_step(opt, variables, step, random_grads(variables, rng, 1e-4), lambda gs, _: gs)
    assert int(opt.clipped_steps) == 1


@pytest.mark.parametrize("name, value", [("clipnorm", 0.7), ("global_clipnorm", 0.9), ("clipvalue", 0.3)])
def test_clipping_on_wrapper_equals_stock_clipping_on_inner(name, value):
    """Stock Keras can clip only on the inner optimizer; results must agree."""
    opt, variables, step = setup(**{name: value})
    twins = [keras.Variable(v.numpy()) for v in variables]
    stock = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(LR, **{name: value}), initial_scale=SCALE
    )
    stock.build(twins)
    rng = np.random.default_rng(2)
    for _ in range(3):
        grads = random_grads(variables, rng)
        step([tf.constant(g) for g in grads])
        stock.apply([tf.constant(g * SCALE) for g in grads], twins)
    for a, b in zip(variables, twins):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_global_clipnorm_in_mixed_float16_fit_matches_float32_clipping(float16_policy):
    """Clipping in a float16 model is applied after unscaling: the update
    equals one computed from float32 gradients clipped in numpy."""
    x = np.random.default_rng(3).standard_normal((16, 4)).astype("float32")
    y = np.ones((16, 1), "float32")
    model = dense_model(4, 1, sequential=True)
    w0 = model.get_weights()
    # Reference float32 gradients at the same weights.
    keras.mixed_precision.set_global_policy("float32")
    ref = dense_model(4, 1, sequential=True)
    ref.set_weights(w0)
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, ref(x))
        loss = tf.reduce_mean(loss)
    grads = [g.numpy() for g in tape.gradient(loss, ref.trainable_variables)]
    expected = [w - LR * g for w, g in zip(w0, ref_global(0.01)(grads, None))]
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), global_clipnorm=0.01, scaling="dynamic")
    model.compile(opt, "mse", jit_compile=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(opt.clipped_steps) == 1 and int(opt.skipped_steps) == 0
    assert float(opt.gradient_norm) == pytest.approx(np.sqrt(sum(np.sum(g**2) for g in grads)), rel=1e-2)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def test_autoclip_global_follows_percentile_of_ring_buffer():
    window, p = 3, 50.0
    opt, variables, step = setup(autoclip_percentile=p, autoclip_window=window)
    rng = np.random.default_rng(4)
    history = []
    for magnitude in [1.0, 4.0, 0.5, 8.0, 0.1, 2.0]:
        grads = random_grads(variables, rng, magnitude)
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
        history = (history + [norm])[-window:]
        threshold = np.percentile(history, p)
        check_step(opt, variables, step, grads, ref_global(threshold))
    assert int(opt.norm_history_count) == 6
    np.testing.assert_allclose(np.sort(opt.norm_history.numpy()), np.sort(history), rtol=1e-5)


def test_autoclip_per_variable():
    p = 25.0
    opt, variables, step = setup(autoclip_percentile=p, autoclip_window=4, autoclip_per_variable=True)
    assert opt.norm_history.shape == (2, 4)
    rng = np.random.default_rng(5)
    histories = [[], []]
    clipped = 0
    for magnitude in [1.0, 3.0, 0.2, 5.0, 0.7]:
        grads = random_grads(variables, rng, magnitude)
        thresholds = []
        for h, g in zip(histories, grads):
            h.append(np.linalg.norm(g))
            del h[:-4]
            thresholds.append(np.percentile(h, p))
        clipped += any(np.linalg.norm(g) > t for g, t in zip(grads, thresholds))
        check_step(
            opt, variables, step, grads,
            lambda gs, _: [g * min(1.0, t / np.linalg.norm(g)) for g, t in zip(gs, thresholds)],
        )
    assert int(opt.clipped_steps) == clipped > 0


def test_clipping_and_statistics_without_scaling_in_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = dense_model(4, 8, 1, sequential=True)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1), global_clipnorm=1e-3, update_every=1)
    model.compile(opt, "mse", jit_compile=True)
    model.fit(np.ones((8, 4)), np.full((8, 1), 5.0), batch_size=8, epochs=2, verbose=0)
    assert opt.scaling == "none" and float(opt.loss_scale) == 1.0
    assert int(opt.clipped_steps) == 2
    assert float(opt.gradient_max) > 0 and float(np.sum(opt.gradient_histogram.numpy())) > 0
