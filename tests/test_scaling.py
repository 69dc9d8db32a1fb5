"""Scale sequences against hand-computed ones and the stock optimizer; skips.

Backend-neutral: runs on TensorFlow and on JAX.
"""

import numpy as np
import pytest
import keras
from helpers import JAX, INF, compiled_once, dense_model, stepper, tensor

import tf_adaptive_scale as tas

def make(opt_kwargs, inner=None, shape=(4,)):
    var = keras.Variable(np.linspace(-1, 1, int(np.prod(shape))).reshape(shape).astype("float32"))
    opt = tas.AdaptiveLossScaleOptimizer(inner or keras.optimizers.SGD(0.1), **opt_kwargs)
    opt.build([var])
    return opt, var


def step_of(opt, var, jit=True):
    """`opt`'s compiled step on `var`: one per optimizer, variable and `jit`
    in a test, reused by each of its `run`s."""
    return compiled_once((opt, var), lambda: stepper(opt, [var], jit), jit)


def run(opt, var, grads, jit=True):
    """Applies each gradient; returns the scale after every step."""
    step = step_of(opt, var, jit)
    scales = []
    for g in grads:
        step(tensor(np.broadcast_to(g, var.shape)))
        scales.append(float(opt.loss_scale))
    return scales


def test_dynamic_growth_backoff_hysteresis_and_bounds():
    opt, var = make(
        dict(scaling="dynamic", initial_scale=16.0, dynamic_growth_steps=3,
             min_scale=4.0, max_scale=64.0, hysteresis=2)
    )
    f, n = 1.0, INF
    grads = [f, f, f, n, f, n, n, n, n, n, n, n, n, f, f, f, f, f, f, f, f, f, f, f, f]
    expected = [16, 16, 32, 32, 32, 32, 16, 16, 8, 8, 4, 4, 4,  # floor at min
                4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64]
    assert run(opt, var, grads) == expected
    assert run(opt, var, [f, f, f]) == [64, 64, 64]  # ceiling at max
    assert int(opt.skipped_steps) == 9
    assert int(opt.total_steps) == 28
    assert int(opt.iterations) == 19  # applied steps only


@pytest.mark.parametrize("jit", [True, False])
def test_dynamic_matches_stock_keras_side_by_side(jit):
    rng = np.random.default_rng(0)
    pattern = rng.random(60) < 0.15
    grads = [INF if bad else float(rng.standard_normal()) for bad in pattern]
    ours, var_a = make(dict(scaling="dynamic", dynamic_growth_steps=4, initial_scale=2.0**10))
    var_b = keras.Variable(var_a.numpy())
    stock = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10, dynamic_growth_steps=4
    )
    stock.build([var_b])
    step_b = stepper(stock, [var_b], jit)
    expected = []
    for g in grads:
        step_b(tensor(np.full(var_b.shape, g)))
        expected.append(float(stock.dynamic_scale))
    assert run(ours, var_a, grads, jit) == expected
    np.testing.assert_array_equal(var_a.numpy(), var_b.numpy())
    assert int(ours.skipped_steps) == int(pattern.sum())


def test_static_keeps_scale_and_still_skips():
    opt, var = make(dict(scaling="static", initial_scale=8.0))
    before = var.numpy()
    assert run(opt, var, [INF, INF, 1.0]) == [8.0] * 3
    assert int(opt.skipped_steps) == 2
    np.testing.assert_allclose(var.numpy(), before - 0.1 * 1.0 / 8.0)
    assert float(opt.scale_loss(tensor(3.0))) == 24.0


def test_none_mode_does_not_scale():
    opt, var = make(dict(scaling="none"))
    assert float(opt.loss_scale) == 1.0
    loss = tensor(3.0)
    assert float(opt.scale_loss(loss)) == 3.0
    before = var.numpy()
    run(opt, var, [2.0, np.nan])
    np.testing.assert_allclose(var.numpy(), before - 0.2)
    assert int(opt.skipped_steps) == 1


def fit_one_step(build_model, optimizer):
    model = build_model()
    model.compile(optimizer, "mse", jit_compile=True)
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=8, epochs=1, verbose=0)
    return optimizer


def dense_factory(dtype=None):
    return lambda: dense_model(4, dict(units=8, dtype=dtype), 1, sequential=True)


@pytest.mark.parametrize(
    "policy, layer_dtype, expected",
    [
        ("float32", None, "none"),
        ("mixed_bfloat16", None, "none"),
        ("mixed_float16", None, "adaptive"),
        ("float32", "mixed_float16", "adaptive"),  # one float16 layer is enough
        ("float32", "float16", "adaptive"),
    ],
)
def test_default_scaling_follows_what_the_model_computes_in(policy, layer_dtype, expected):
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())
    assert opt.scaling is None  # resolved at the first step
    keras.mixed_precision.set_global_policy(policy)  # after the optimizer
    if JAX and policy == "float32":
        # JAX resolves at `build`, from the global policy alone: a float16
        # layer in a float32 model needs scaling="adaptive" there.
        expected = "none"
    fit_one_step(dense_factory(layer_dtype), opt)
    assert opt.scaling == expected and opt.get_config()["scaling"] == expected
    if expected == "none":
        assert float(opt.loss_scale) == 1.0


def test_explicit_scaling_is_kept(float16_policy):
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling="dynamic")
    assert opt.scaling == "dynamic"
    assert fit_one_step(dense_factory(), opt).scaling == "dynamic"


def known_gradient(scale):
    """Unscaled: 10 at 2**-40, 90 at 2**-30, 899 at 2**-10, one at 1.5*2**-3."""
    g = np.concatenate([np.full(10, 2.0**-40), np.full(90, 2.0**-30),
                        np.full(899, 2.0**-10), [1.5 * 2.0**-3]])
    return (g * scale).astype("float32")


def test_adaptive_sets_predicted_scale_on_update_steps_only():
    opt, var = make(
        dict(scaling="adaptive", initial_scale=2.0**10, update_every=3,
             underflow_rate=0.01, headroom=16.0),
        shape=(1000,),
    )
    # Window [6, 18] (see test_gradient_statistics); headroom 2**4 -> 2**14.
    scales = run(opt, var, [known_gradient(2.0**10)])
    assert scales == [2.0**14]
    np.testing.assert_array_equal(opt.scale_window, [6, 18])
    assert float(opt.gradient_max) == 1.5 * 2.0**-3
    assert float(opt.underflow_fraction) == pytest.approx(0.01)  # the 10 smallest
    # Steps 2 and 3 are not update steps: gradients 4x larger change nothing.
    assert run(opt, var, [known_gradient(2.0**16)] * 2) == [2.0**14] * 2
    # Step 4 measures again: the max is 4x larger -> two binades lower.
    assert run(opt, var, [known_gradient(2.0**16)]) == [2.0**12]
    assert int(opt.skipped_steps) == 0


def test_adaptive_overflow_backs_off_caps_and_recovers():
    opt, var = make(
        dict(scaling="adaptive", initial_scale=2.0**10, update_every=100,
             underflow_rate=0.01, headroom=16.0, dynamic_growth_steps=2),
        shape=(1000,),
    )
    g = lambda s: known_gradient(s)  # noqa: E731
    assert run(opt, var, [g(2.0**10)]) == [2.0**14]
    # Overflow: halve, cap at the halved scale, re-measure on the next step
    # (the rule says 2**14 but the cap holds it at 2**13).
    assert run(opt, var, [INF]) == [2.0**13]
    assert float(opt.scale_ceiling) == 2.0**13
    assert run(opt, var, [g(2.0**13)]) == [2.0**13]
    # After 2 clean steps the cap doubles; the next update may use it.
    run(opt, var, [g(2.0**13)])
    assert float(opt.scale_ceiling) == 2.0**14
    assert int(opt.skipped_steps) == 1


def test_adaptive_scale_respects_bounds():
    opt, var = make(
        dict(scaling="adaptive", initial_scale=2.0**3, min_scale=2.0**2,
             max_scale=2.0**5, underflow_rate=0.01, headroom=16.0),
        shape=(1000,),
    )
    assert run(opt, var, [known_gradient(2.0**3)]) == [2.0**5]  # rule: 2**14
    opt, var = make(
        dict(scaling="adaptive", initial_scale=2.0**3, min_scale=2.0**2, max_scale=2.0**5),
        shape=(1000,),
    )
    assert run(opt, var, [known_gradient(2.0**3) * 2.0**20]) == [2.0**2]


@pytest.mark.parametrize(
    "inner, window",
    [
        (lambda: keras.optimizers.Adam(0.1), 1),
        (lambda: keras.optimizers.RMSprop(0.1, momentum=0.9), 1),
        (lambda: keras.optimizers.Adam(0.1, use_ema=True), 1),
        # The non-finite micro-batch ends a window whose first was finite.
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 2),
    ],
)
def test_non_finite_step_changes_nothing(inner, window):
    opt, var = make(
        dict(scaling="dynamic", autoclip_percentile=50, autoclip_window=4,
             agc_factor=0.5, accumulation_steps=window),
        inner=inner(),
    )
    run(opt, var, [0.5, -0.25, 0.75])
    state_before = [np.array(v.numpy()) for v in opt.inner_optimizer.variables]
    var_before = var.numpy().copy()
    history_before = opt.norm_history.numpy().copy()
    clipped_before = int(opt.clipped_steps)
    scale_before = float(opt.loss_scale)
    grad = np.array([0.5, np.inf, 0.1, -0.2], "float32")
    step_of(opt, var)(tensor(grad))
    np.testing.assert_array_equal(var.numpy(), var_before)
    for v, before in zip(opt.inner_optimizer.variables, state_before):
        np.testing.assert_array_equal(v.numpy(), before, err_msg=v.name)
    np.testing.assert_array_equal(opt.norm_history.numpy(), history_before)
    assert int(opt.clipped_steps) == clipped_before
    assert float(opt.loss_scale) == scale_before / 2
    assert int(opt.skipped_steps) == 1 and not bool(opt.last_step_finite.numpy())


def test_last_step_finite_and_counters_in_fit(float16_policy):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(opt, "mse", jit_compile=True)
    x = np.ones((8, 3), "float32")
    model.fit(x, np.ones((8, 2)), batch_size=4, verbose=0, shuffle=False)
    assert bool(opt.last_step_finite.numpy())
    skipped = int(opt.skipped_steps)
    x[5] = 1e30  # overflows float16 in the forward pass of the second batch
    model.fit(x, np.ones((8, 2)), batch_size=4, verbose=0, shuffle=False)
    assert int(opt.total_steps) == 4 and int(opt.skipped_steps) == skipped + 1
    assert not bool(opt.last_step_finite.numpy())
    assert np.all(np.isfinite(model.get_weights()[0]))


def test_adaptive_mass_criterion_and_rise_cap():
    # 30% of the values at 2**-40 (count: must not underflow), the rest larger.
    g = np.concatenate([np.full(300, 2.0**-40), np.full(700, 2.0**-12), [2.0**-4]])
    count, var = make(dict(scaling="adaptive", initial_scale=2.0**3, headroom=2.0**8), shape=(1001,))
    mass, var_m = make(
        dict(scaling="adaptive", initial_scale=2.0**3, headroom=2.0**8, underflow_criterion="mass"),
        shape=(1001,),
    )
    # high = floor(log2(65504 / 2**-4)) = 19; count: low = 16 -> max(19 - 8, 16) = 16;
    # mass: low = -24 + 12 = 12 -> 19 - 8 = 11.
    assert run(count, var, [g * 2.0**3]) == [2.0**16]
    assert run(mass, var_m, [g * 2.0**3]) == [2.0**11]
    capped, var_c = make(
        dict(scaling="adaptive", initial_scale=2.0**3, headroom=2.0**8, max_scale_rise=2), shape=(1001,)
    )
    assert run(capped, var_c, [g * 2.0**3]) == [2.0**5]


def test_underflow_fraction_counts_values_lost_to_zero(float16_policy):
    """At too low a scale most float16 gradients flush to zero: the reported
    underflow must show them, not only the nonzero values that remain."""
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(4)])
    x = np.random.default_rng(0).standard_normal((64, 16)).astype("float32")
    y = np.zeros((64, 4), "float32")
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.0), scaling="static", initial_scale=2.0**-18
    )
    model.compile(opt, "mse", jit_compile=True)
    model.train_on_batch(x, y)
    keras.mixed_precision.set_global_policy("float32")
    # float64 gradients of the mean squared error, by hand.
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in model.get_weights())
    hidden = x @ w1 + b1
    d_out = 2.0 * (hidden @ w2 + b2 - y) / y.size
    d_hidden = d_out @ w2.T
    g = np.concatenate([np.ravel(t) for t in (
        x.T @ d_hidden, d_hidden.sum(0), hidden.T @ d_out, d_out.sum(0))])
    lost = np.mean(np.abs(g) * 2.0**-18 < 2.0**-24)
    assert 0.1 < lost < 0.9  # the setup: part of the values underflow
    assert float(opt.gradient_zeros) > 0
    # float16 loses at least what the final values predict (products inside
    # the backward pass underflow too); values lost to zero are not hidden.
    assert lost - 0.02 <= float(opt.underflow_fraction) <= lost + 0.2
