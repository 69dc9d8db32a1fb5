"""tas.make_train_step: the same training as model.fit, traced once, with
gradient accumulation that equals one step on the whole batch."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import dense_model

BATCH = 16
STEPS = 6


def make_model(seed=0, middle_activation="relu"):
    hidden = dict(units=16, activation="tanh", name="hidden",
                  kernel_regularizer=keras.regularizers.L2(1e-3))
    return dense_model(6, hidden, (8, middle_activation, "middle"), (1, None, "head"), seed=seed)


def data(seed=0, n=BATCH * STEPS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.1 * x[:, 1:2]).astype("float32")
    return x, y


def optimizer(scaling):
    return tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling=scaling, update_every=2
    )


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


@pytest.mark.parametrize("instrumented", [False, True], ids=["plain", "instrumented"])
def test_compiled_step_trains_as_fit(float16_policy, instrumented):
    x, y = data()
    scaling = "per_layer" if instrumented else "adaptive"
    runs = []
    for use_fit in (True, False):
        base = model = make_model()
        if instrumented:
            model = tas.instrument(base)  # shares base's weights
        opt = optimizer(scaling)
        if use_fit:
            model.compile(optimizer=opt, loss="mse", jit_compile=True)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        else:
            step = tas.make_train_step(model, "mse", opt)
            for i in range(STEPS):
                logs = step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
            assert step.tracing_count() == 1
            assert int(logs["skipped_steps"]) == int(opt.skipped_steps)
            assert float(logs["loss_scale"]) == float(opt.loss_scale)
        runs.append((weights(base), opt))
    (fit_w, fit_opt), (step_w, step_opt) = runs
    moved = [np.abs(f - w0).max() for f, w0 in zip(fit_w, weights(make_model()))]
    assert min(moved) > 1e-3  # it trained
    for f, s in zip(fit_w, step_w):
        np.testing.assert_allclose(s, f, rtol=1e-4, atol=1e-5)
    assert int(step_opt.total_steps) == int(fit_opt.total_steps) == STEPS
    if instrumented:
        assert step_opt.layer_scales() == fit_opt.layer_scales()
    else:
        assert float(step_opt.loss_scale) == float(fit_opt.loss_scale)


def test_one_trace_over_many_steps_and_logs_are_tensors():
    x, y = data()
    model = make_model()
    step = tas.make_train_step(model, keras.losses.MeanSquaredError(),
                               keras.optimizers.SGD(1e-2))
    assert isinstance(step.optimizer, tas.AdaptiveLossScaleOptimizer)
    for i in range(STEPS):
        logs = step(x[:BATCH], y[:BATCH], np.ones((BATCH,), "float32"))
    assert step.tracing_count() == 1
    assert set(logs) >= {"loss", "loss_scale", "skipped_steps", "consecutive_skips",
                         "step_finite", "measured", "gradient_norm",
                         "underflow_fraction"}
    assert bool(logs["step_finite"])


def test_measured_flag_follows_the_schedule():
    x, y = data()
    model = make_model()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-2),
                                         scaling="adaptive", update_every=3)
    step = tas.make_train_step(model, "mse", opt)
    measured = [bool(step(x[:BATCH], y[:BATCH])["measured"]) for _ in range(7)]
    assert measured == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_one_step_on_the_whole_batch(k):
    x, y = data(1, n=BATCH * 2)
    results = []
    for steps in (1, k):
        model = make_model()
        opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                             scaling="adaptive")
        step = tas.make_train_step(model, "mse", opt, accumulation_steps=steps)
        for i in range(2):
            logs = step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        results.append((weights(model), float(logs["loss"]), opt))
    (w1, loss1, opt1), (wk, lossk, optk) = results
    for a, b in zip(w1, wk):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert lossk == pytest.approx(loss1, rel=1e-5)
    # One decision per window: as many optimizer steps as windows.
    assert int(optk.total_steps) == int(optk.iterations) == 2
    assert int(opt1.total_steps) == 2


def test_accumulation_in_float16_matches_a_float32_step(float16_policy):
    """Micro-batches summed at one scale in float16 give the float32
    full-batch update (SGD: the update is the gradient). Smooth activations:
    a ReLU whose input rounds across zero in float16 changes the gradient
    by up to 10% on its own, with or without loss scaling."""
    x, y = data(2, n=BATCH)
    model = make_model(middle_activation="tanh")
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1.0))
    step = tas.make_train_step(model, "mse", opt, accumulation_steps=4)
    w0 = weights(model)
    step(x, y)
    keras.mixed_precision.set_global_policy("float32")
    reference = make_model(middle_activation="tanh")
    reference.set_weights(w0)
    with tf.GradientTape() as tape:
        pred = reference(x)
        loss = keras.ops.mean(keras.ops.square(pred - y)) + keras.ops.sum(
            keras.ops.stack(reference.losses))
    grads = tape.gradient(loss, reference.trainable_variables)
    assert int(opt.skipped_steps) == 0
    for w, before, g in zip(weights(model), w0, grads):
        update = before - w
        np.testing.assert_allclose(update, np.asarray(g), rtol=1e-2,
                                   atol=2e-3 * np.abs(np.asarray(g)).max())


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
def test_overflow_in_one_micro_batch_skips_the_window(scaling):
    x, y = data(3, n=BATCH)
    base = model = make_model()
    if scaling == "per_layer":
        model = tas.instrument(base)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                         scaling=scaling)
    step = tas.make_train_step(model, "mse", opt, accumulation_steps=4)
    step(x, y)  # a clean window builds Adam's slots
    before = (weights(base), [np.asarray(v) for v in opt.inner_optimizer.variables])
    iterations, skipped = int(opt.iterations), int(opt.skipped_steps)
    poisoned = x.copy()
    poisoned[BATCH // 4 * 2] = np.inf  # inside the third micro-batch only
    logs = step(poisoned, y)
    assert not bool(logs["step_finite"])
    assert int(opt.skipped_steps) == skipped + 1
    assert int(opt.iterations) == iterations
    for a, b in zip(before[0], weights(base)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(before[1], opt.inner_optimizer.variables):
        np.testing.assert_array_equal(a, np.asarray(b))
    logs = step(x, y)  # and the next window applies
    assert bool(logs["step_finite"])


@pytest.mark.parametrize("k, bad", [(2, 0), (3, 1)], ids=["first_of_2", "middle_of_3"])
def test_a_nan_loss_in_any_micro_batch_skips_the_window(k, bad):
    """A NaN loss whose gradients are finite, in one micro-batch only (not
    the last): the whole window is skipped, and the next one applies."""
    x, y = data(6, n=4 * k)
    poison = np.zeros((4 * k, 1), "float32")
    poison[4 * bad + 1] = np.nan

    def poisoned_mse(t, p):
        return keras.ops.mean(keras.ops.square(p - t[:, :1]), axis=-1) + t[:, 1]

    model = make_model()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1), scaling="adaptive")
    step = tas.make_train_step(model, poisoned_mse, opt, accumulation_steps=k)
    w0, scale = weights(model), float(opt.loss_scale)
    logs = step(x, np.concatenate([y, poison], axis=1))
    assert not bool(logs["step_finite"])
    # Bad data, not an overflow: the scale stays.
    assert not bool(opt.last_loss_finite.numpy()) and float(opt.loss_scale) == scale
    assert int(opt.skipped_steps) == int(opt.total_steps) == 1
    assert int(opt.iterations) == 0
    for a, b in zip(w0, weights(model)):
        np.testing.assert_array_equal(b, a)
    logs = step(x, np.concatenate([y, np.zeros_like(poison)], axis=1))
    assert bool(logs["step_finite"]) and int(opt.iterations) == 1


def test_bad_arguments_are_refused():
    model = make_model()
    with pytest.raises(ValueError, match="accumulation_steps"):
        tas.make_train_step(model, "mse", keras.optimizers.SGD(), accumulation_steps=0)
    with pytest.raises(TypeError, match="optimizer"):
        tas.make_train_step(model, "mse", "adam")
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        tas.make_train_step(model, "mse", keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="accumulation_steps=K"):
        tas.make_train_step(model, "mse", keras.optimizers.SGD(
            gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="loss_fn"):
        tas.make_train_step(model, 3, keras.optimizers.SGD())
    with pytest.raises(ValueError, match="built"):
        tas.make_train_step(keras.Sequential([keras.layers.Dense(1)]), "mse",
                            keras.optimizers.SGD())


# ------------------------------------------------- accumulation in model.fit


def fit_run(scaling, window, batch, x, y, instrumented=False):
    base = model = make_model(middle_activation="tanh")
    if instrumented:
        model = tas.instrument(base)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling=scaling, accumulation_steps=window)
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return weights(base), opt


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
def test_fit_accumulation_equals_steps_on_the_whole_windows(scaling):
    """`accumulation_steps=4` in `fit` with batches of 4 is one step per 16
    samples: the same as batches of 16 without accumulation (float32)."""
    x, y = data(4, n=64)
    per_layer = scaling == "per_layer"
    w_window, opt_window = fit_run(scaling, 4, 4, x, y, per_layer)
    w_whole, opt_whole = fit_run(scaling, 1, 16, x, y, per_layer)
    for a, b in zip(w_window, w_whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(opt_window.total_steps) == int(opt_window.iterations) == 4
    assert int(opt_window._window.count) == 0


def test_fit_accumulation_overflow_in_one_micro_batch_skips_the_window(float16_policy):
    x, y = data(5, n=32)
    x[9] = 1e30  # overflows float16 in the forward pass of micro-batch 3 of window 1
    base = make_model()
    # A scale this model's gradients fit at (2**15 overflows them).
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                         initial_scale=2.0**8,
                                         accumulation_steps=4)
    base.compile(optimizer=opt, loss="mse", jit_compile=True)
    w0 = weights(base)
    base.fit(x[:16], y[:16], batch_size=4, shuffle=False, verbose=0)
    # The window was skipped: nothing changed, one skip counted.
    for a, b in zip(w0, weights(base)):
        np.testing.assert_array_equal(a, b)
    assert int(opt.skipped_steps) == int(opt.total_steps) == 1
    assert int(opt.iterations) == 0
    assert all(not np.any(np.asarray(v)) for v in opt.inner_optimizer.variables[2:])
    base.fit(x[16:], y[16:], batch_size=4, shuffle=False, verbose=0)
    assert int(opt.skipped_steps) == 1 and int(opt.total_steps) == 2
    assert bool(opt.last_step_finite.numpy())
    assert any(np.any(a != b) for a, b in zip(w0, weights(base)))


def test_window_statistics_combine_its_micro_batches():
    """A measured window's histogram is the sum of its micro-batches' (each
    underflows in float16 on its own) and its peak their largest; the update
    is their mean."""
    var = keras.Variable(np.zeros(4, "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1.0), scaling="adaptive", update_every=1,
        accumulation_steps=2)
    opt.build([var])
    micro = [np.array([2.0**-30, 0.5, 3.0, -1.0], "float32"),
             np.array([8.0, 2.0**-3, 0.0, 1.0], "float32")]

    @tf.function
    def step(g):
        opt.apply([opt.scale_loss(g)], [var])

    for g in micro:
        step(tf.constant(g))
    histograms = [np.asarray(tas.gradient_statistics.exponent_histogram([g])[0])
                  for g in micro]
    np.testing.assert_array_equal(opt.gradient_histogram.numpy(), sum(histograms))
    assert float(opt.gradient_max) == 8.0
    assert float(opt.gradient_zeros) == 1.0
    np.testing.assert_allclose(var.numpy(), -(micro[0] + micro[1]) / 2, rtol=1e-6)
    assert int(opt.total_steps) == int(opt.measurements) == 1


# ------------------------------------------------ losses, batches, outputs


def sgd_reference(model, x, y, loss, learning_rate, sample_weight=None):
    """The weights after one float32 step of a plain Keras SGD on a copy of
    `model`, with gradients from a GradientTape of `loss(y, y_pred, w)` on
    the whole batch (plus the weight penalties)."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    with tf.GradientTape() as tape:
        value = loss(y, copy(x), sample_weight) + sum(copy.losses)
    variables = copy.trainable_variables
    grads = tape.gradient(value, variables)
    keras.optimizers.SGD(learning_rate).apply(grads, variables)
    return weights(copy)


def test_a_lambda_or_partial_loss_function_works():
    """A loss function's name becomes a name scope: '<lambda>' is not one."""
    x, y = data(6, n=8)
    mse = keras.losses.MeanSquaredError()
    for loss_fn in (lambda t, p: keras.ops.mean(keras.ops.square(p - t), axis=-1),
                    functools.partial(keras.losses.mean_squared_error)):
        model = make_model()
        expected = sgd_reference(model, x, y, mse, 0.5)
        step = tas.make_train_step(model, loss_fn, keras.optimizers.SGD(0.5),
                                   jit_compile=False)
        assert bool(step(x, y)["step_finite"])
        for a, b in zip(weights(model), expected):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch, weighted", [(10, False), (10, True), (3, True)],
                         ids=["10", "10-weighted", "3-weighted"])
def test_accumulation_of_a_partial_batch_equals_one_step_on_it(batch, weighted):
    """The last batch of a dataset, which 4 does not divide (3 < 4 too): one
    step on its samples, weight penalty and sample weights included (XLA)."""
    x, y = data(7, n=batch)
    sample_weight = (np.random.default_rng(7).uniform(0.5, 2.0, batch).astype("float32")
                     if weighted else None)
    model = make_model()
    expected = sgd_reference(model, x, y, keras.losses.MeanSquaredError(), 0.5,
                             sample_weight)
    step = tas.make_train_step(model, "mse", keras.optimizers.SGD(0.5),
                               accumulation_steps=4)
    logs = step(x, y, sample_weight)
    assert bool(logs["step_finite"]) and int(step.optimizer.iterations) == 1
    for a, b in zip(weights(model), expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert step.tracing_count() == 1


def test_accumulation_with_batch_sizes_unknown_to_the_trace():
    """Inside a function traced for any batch size (as a dataset's batches
    under a strategy are), every size works with one trace under XLA: a
    multiple of 4 (one group of micro-batches is empty) and an empty batch
    (both are)."""
    model = make_model()
    step = tas.make_train_step(model, "mse", keras.optimizers.SGD(0.5),
                               accumulation_steps=4)
    loop = tf.function(step, input_signature=[tf.TensorSpec((None, 6)),
                                              tf.TensorSpec((None, 1))])
    x, y = data(10, n=8)
    expected = sgd_reference(model, x, y, keras.losses.MeanSquaredError(), 0.5)
    loop(x, y)
    for a, b in zip(weights(model), expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    loop(x[:0], y[:0])
    assert int(step.optimizer.iterations) == int(step.optimizer.skipped_steps) == 1
    assert loop.experimental_get_tracing_count() == step.tracing_count() == 1


@pytest.mark.parametrize("targets", ["list", "dict"])
def test_one_loss_for_two_outputs_is_summed_over_them(targets):
    """As Keras's compile(loss="mse"): the loss of each output, summed."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(h),
                                 keras.layers.Dense(2, name="b")(h)])
    x, y = data(8, n=8)
    y2 = np.concatenate([y, -2 * y], axis=1)
    mse = keras.losses.MeanSquaredError()

    def summed(t, p, w):
        return mse(t[0], p[0]) + mse(t[1], p[1])

    loss = float(summed([y, y2], model(x), None))
    expected = sgd_reference(model, x, [y, y2], summed, 0.5)
    step = tas.make_train_step(model, "mse", keras.optimizers.SGD(0.5),
                               jit_compile=False)
    logs = step(x, [y, y2] if targets == "list" else {"b": y2, "a": y})
    assert float(logs["loss"]) == pytest.approx(loss, rel=1e-6)
    for a, b in zip(weights(model), expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 4])
def test_an_empty_batch_is_skipped(k):
    """Zero gradients are no step: Adam's momentum would move the weights."""
    x, y = data(9, n=8)
    model = make_model()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2))
    step = tas.make_train_step(model, "mse", opt, accumulation_steps=k)
    step(x, y)
    before = weights(model)
    scale = float(opt.loss_scale)
    step(x[:0], y[:0])
    for a, b in zip(before, weights(model)):
        np.testing.assert_array_equal(a, b)
    assert int(opt.inner_optimizer.iterations) == 1
    assert int(opt.skipped_steps) == 1
    assert float(opt.loss_scale) == scale  # bad data, not an overflow
