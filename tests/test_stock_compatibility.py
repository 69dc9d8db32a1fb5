"""`AdaptiveLossScaleOptimizer` as a drop-in for Keras's `LossScaleOptimizer`.

The stock optimizer and ours run side by side on the same scenarios and must
give equal numbers (weights, optimizer slots, scale, `iterations`,
`step_counter`) wherever one of our documented differences does not apply:

- Scales are powers of two: `initial_scale` must be one (stock takes any
  positive float).
- A step whose *loss* is not finite is bad data: it is skipped without
  backing the scale off (stock halves the scale, as for an overflow).
- Clipping (`clipnorm`, `clipvalue`, `global_clipnorm`, AutoClip, AGC) is
  taken on the outer optimizer (stock refuses these arguments there).

`scaling="dynamic"` is the Keras-compatible mode, the one compared number for
number. The default mode (`scaling=None`) picks its own scale, so it is
compared where the scale policy does not matter: Python-number losses,
legacy tf-keras calls, variables overwritten with their gradient.

Backend-neutral: runs on TensorFlow (`apply` in a `tf.function`, with and
without XLA, or eagerly) and on JAX (jitted `stateless_apply`; un-jitted in
`fit(jit_compile=False)`), through `backend_step.stepper` and `model.fit`.
What exists on TensorFlow only (`tf.IndexedSlices`, the legacy
`get_unscaled_gradients`, the stock optimizer's eager stateful `apply`) is
skipped on JAX.
"""

import re

import keras
import numpy as np
import pytest
from helpers import INF, NAN, TF, dense_model, stepper

import tf_adaptive_scale as tas

if TF:
    import tensorflow as tf

# The cheaper compiled path where a scenario does not depend on it: XLA
# compiles slowly on TensorFlow; JAX runs slowly op by op.
FAST_JIT = not TF
# Weights are bit-equal on TensorFlow. On JAX, stock's update runs inside
# `lax.cond`, compiled by XLA (which may fuse a multiply-add) even where
# ours runs op by op (no `jit`): the last bit may differ there.
WEIGHT_RTOL = 0.0 if TF else 1e-6


# ----------------------------------------------------------------- helpers


def stepper_jit(jit):
    """`jit` on TensorFlow (a `tf.function` with or without XLA). On JAX a
    step here is always jitted: un-jitted, `stateless_apply` is what
    `fit(jit_compile=False)` runs, compared in the `fit` tests (and op by op
    it is slow)."""
    return jit or not TF


def copy_of(optimizer):
    """A fresh optimizer with `optimizer`'s class and configuration."""
    return optimizer.__class__.from_config(optimizer.get_config())


def stock_and_ours(inner, scaling="dynamic", **kwargs):
    """The stock optimizer and ours, each around its own copy of `inner`."""
    stock = keras.mixed_precision.LossScaleOptimizer(copy_of(inner), **kwargs)
    ours = tas.AdaptiveLossScaleOptimizer(copy_of(inner), scaling=scaling, **kwargs)
    return stock, ours


def two_variables(overwrite=(False, False)):
    """A (2, 3) kernel and a (3,) bias; `overwrite` flags each for
    `overwrite_with_gradient` (as Keras does for float8 scale variables)."""
    kernel = keras.Variable(
        np.linspace(-1, 1, 6).reshape(2, 3).astype("float32"), name="kernel"
    )
    bias = keras.Variable(np.array([0.5, -0.25, 2.0], "float32"), name="bias")
    for variable, flag in zip((kernel, bias), overwrite):
        variable.overwrite_with_gradient = flag
    return [kernel, bias]


def numbers(optimizer):
    """What must be equal between the two optimizers after a step."""
    return {
        "scale": float(optimizer.dynamic_scale.numpy()),
        "iterations": int(optimizer.iterations.numpy()),
        "step_counter": int(optimizer.step_counter.numpy()),
    }


def assert_same_values(ours, stock, rtol=0.0, what="weights"):
    ours, stock = list(ours), list(stock)
    assert len(ours) == len(stock)
    for i, (a, b) in enumerate(zip(ours, stock)):
        a, b = np.asarray(a), np.asarray(b)
        if rtol:
            # Relative to the tensor's scale: a weight that cancels to near
            # zero keeps the absolute error of its neighbours.
            atol = rtol * float(np.max(np.abs(b), initial=0.0))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{what} {i}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {i}")


def assert_same_slots(ours, stock, rtol=0.0):
    assert_same_values(
        [v.numpy() for v in ours.inner_optimizer.variables],
        [v.numpy() for v in stock.inner_optimizer.variables],
        rtol,
        what="inner optimizer variable",
    )


def scaled_gradients(seed, steps, bad):
    """`steps` gradient pairs (kernel, bias) of a scaled loss (about 2**10);
    `bad[step] = (which, index, value)` puts a non-finite value there."""
    rng = np.random.default_rng(seed)
    sequence = []
    for step in range(steps):
        grads = [
            (2.0**10 * rng.standard_normal((2, 3))).astype("float32"),
            (2.0**10 * rng.standard_normal(3)).astype("float32"),
        ]
        if step in bad:
            which, index, value = bad[step]
            grads[which][index] = value
        sequence.append(grads)
    return sequence


# ------------------------------------------- 1. growth and back-off sequences


@pytest.mark.parametrize(
    "inner, initial_scale, growth_steps, jit",
    [
        # Stock argument forms: an int scale and an integral float count.
        (lambda: keras.optimizers.SGD(0.01, momentum=0.9), 2**15, 2, True),
        (lambda: keras.optimizers.Adam(0.01), 2.0**15, 3.0, False),
    ],
    ids=["sgd-int_scale-jit", "adam-float_growth_steps-no_jit"],
)
def test_growth_and_back_off_match_stock_step_by_step(
    inner, initial_scale, growth_steps, jit
):
    stock, ours = stock_and_ours(
        inner(), initial_scale=initial_scale, dynamic_growth_steps=growth_steps
    )
    stock_vars, our_vars = two_variables(), two_variables()
    stock.build(stock_vars)
    ours.build(our_vars)
    jit = stepper_jit(jit)
    stock_step, our_step = stepper(stock, stock_vars, jit), stepper(ours, our_vars, jit)
    # Overflows alone, back to back, and right after a growth.
    bad = {2: (0, (0, 1), INF), 5: (1, 2, NAN), 6: (0, (1, 0), -INF), 12: (1, 0, INF)}
    scales = []
    for step, grads in enumerate(scaled_gradients(0, 13, bad)):
        stock_step(*grads)
        our_step(*grads)
        assert numbers(ours) == numbers(stock), f"step {step}"
        assert_same_values(
            [v.numpy() for v in our_vars], [v.numpy() for v in stock_vars], WEIGHT_RTOL
        )
        scales.append(numbers(stock)["scale"])
    assert_same_slots(ours, stock, WEIGHT_RTOL)
    # The sequence did grow and back off (the test sees both).
    changes = np.diff([2.0**15] + scales)
    assert np.any(changes > 0) and np.any(changes < 0), scales
    assert int(ours.skipped_steps.numpy()) == len(bad)


def test_documented_differences_non_finite_loss_keeps_the_scale():
    """A non-finite loss skips the step in both; only stock backs off."""
    stock, ours = stock_and_ours(keras.optimizers.SGD(0.1), dynamic_growth_steps=2)
    stock_vars, our_vars = two_variables(), two_variables()
    stock.build(stock_vars)
    ours.build(our_vars)
    stock_step = stepper(stock, stock_vars, jit=FAST_JIT)
    our_step = stepper(ours, our_vars, jit=FAST_JIT)
    finite, = scaled_gradients(1, 1, {})
    nan_grads = [np.full_like(g, NAN) for g in finite]
    for optimizer, step in ((stock, stock_step), (ours, our_step)):
        step(*finite)
        optimizer.scale_loss(keras.ops.convert_to_tensor(NAN))
        step(*nan_grads)
    assert_same_values(
        [v.numpy() for v in our_vars], [v.numpy() for v in stock_vars], WEIGHT_RTOL
    )
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy()) == 1
    assert float(stock.dynamic_scale.numpy()) == 2.0**14
    assert float(ours.dynamic_scale.numpy()) == 2.0**15
    assert int(ours.skipped_steps.numpy()) == 1


def test_documented_differences_in_arguments():
    # Scales are powers of two.
    keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=1000.0)
    with pytest.raises(ValueError, match="initial_scale"):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), initial_scale=1000.0)
    # Clipping on the outer optimizer: refused by stock, taken by ours.
    for argument in ("clipnorm", "clipvalue", "global_clipnorm"):
        with pytest.raises(ValueError, match=argument):
            keras.mixed_precision.LossScaleOptimizer(
                keras.optimizers.SGD(), **{argument: 1.0}
            )
        ours = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), **{argument: 1.0})
        assert ours.get_config()[argument] == 1.0


@pytest.mark.skipif(
    not TF, reason="the stock optimizer's eager stateful apply does not run on JAX"
)
def test_default_mode_unscales_by_the_scale_scale_loss_applied():
    """An eager custom loop (float32 policy): `scale_loss`, the gradients of
    the scaled loss, `apply`. Whatever scale the default mode settles on,
    the first step must divide by the one its loss was scaled with."""
    stock, ours = stock_and_ours(keras.optimizers.SGD(0.1), scaling=None)
    stock_vars, our_vars = two_variables(), two_variables()
    for optimizer, variables in ((stock, stock_vars), (ours, our_vars)):
        for _ in range(2):
            # loss = sum(kernel * 1) + sum(bias * 2): gradients 1 and 2.
            scaled = optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
            optimizer.apply(
                [keras.ops.ones((2, 3)) * scaled, keras.ops.ones((3,)) * 2 * scaled],
                variables,
            )
    assert_same_values(
        [v.numpy() for v in our_vars], [v.numpy() for v in stock_vars], WEIGHT_RTOL
    )
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy()) == 2


# ------------------------------------------------- 2. Python-number losses


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
@pytest.mark.parametrize("scaling", ["dynamic", None])
@pytest.mark.parametrize("loss", [1.0, 1], ids=["float", "int"])
def test_python_number_losses_scale_as_stock(loss, scaling, built):
    stock, ours = stock_and_ours(keras.optimizers.SGD(), scaling=scaling)
    if built:
        stock.build(two_variables())
        ours.build(two_variables())
    expected = stock.scale_loss(loss)
    scaled = ours.scale_loss(loss)
    assert type(scaled) is type(expected)
    assert keras.backend.standardize_dtype(scaled.dtype) == (
        keras.backend.standardize_dtype(expected.dtype)
    )
    assert tuple(scaled.shape) == tuple(expected.shape) == ()
    # Our own scale (the default mode may have resolved to "none" at build).
    assert float(scaled) == loss * float(ours.loss_scale.numpy())
    if scaling == "dynamic" or not built:
        assert float(scaled) == float(expected)


# --------------------------------------- 3. overwrite_with_gradient variables


def default_mode_policy(scaling):
    """In the default mode the scale is ours to choose: under mixed_float16
    it starts at stock's 2**15 (adaptive) and is then set by the gradients."""
    if scaling is None:
        keras.mixed_precision.set_global_policy("mixed_float16")


def run_side_by_side(stock, ours, overwrite, gradient_sequence, jit):
    """Steps both optimizers on their own copies of `two_variables`.

    Each optimizer is fed the gradients times its own current scale (as
    from its `scale_loss`; overwritten variables get their gradient as it
    is, as Keras sends it), so the weights compare exactly in the default
    mode too (scales are powers of two).
    """
    stock_vars, our_vars = two_variables(overwrite), two_variables(overwrite)
    stock.build(stock_vars)
    ours.build(our_vars)
    jit = stepper_jit(jit)
    steps = [(stock, stepper(stock, stock_vars, jit)), (ours, stepper(ours, our_vars, jit))]
    for grads in gradient_sequence:
        for optimizer, step in steps:
            scale = float(optimizer.dynamic_scale.numpy())
            step(*[
                g if flag else (g * scale).astype("float32")
                for g, flag in zip(grads, overwrite)
            ])
    return stock_vars, our_vars


def unscaled_sequence(seed, steps, bad=()):
    rng = np.random.default_rng(seed)
    sequence = [
        [rng.standard_normal((2, 3)).astype("float32"),
         rng.standard_normal(3).astype("float32")]
        for _ in range(steps)
    ]
    for step, which in bad:
        sequence[step][which][0] = INF
    return sequence


@pytest.mark.parametrize(
    "scaling, jit", [("dynamic", True), (None, False)], ids=["dynamic-jit", "default-no_jit"]
)
def test_step_of_overwrite_variables_only_matches_stock(scaling, jit):
    default_mode_policy(scaling)
    overwrite = (True, True)
    stock, ours = stock_and_ours(
        keras.optimizers.SGD(0.1), scaling=scaling, dynamic_growth_steps=2
    )
    sequence = unscaled_sequence(2, 3)
    stock_vars, our_vars = run_side_by_side(stock, ours, overwrite, sequence, jit)
    # Overwritten with the last gradient, not unscaled nor stepped.
    assert_same_values([v.numpy() for v in stock_vars], sequence[-1])
    assert_same_values([v.numpy() for v in our_vars], sequence[-1])
    if scaling == "dynamic":
        assert numbers(ours) == numbers(stock)
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy()) == 3


@pytest.mark.parametrize(
    "scaling, jit", [("dynamic", False), (None, True)], ids=["dynamic-no_jit", "default-jit"]
)
def test_mixed_step_overwrites_and_unscales_as_stock(scaling, jit):
    default_mode_policy(scaling)
    overwrite = (False, True)  # the bias is a float8-style scale variable
    stock, ours = stock_and_ours(
        keras.optimizers.Adam(0.1), scaling=scaling, dynamic_growth_steps=2
    )
    sequence = unscaled_sequence(3, 4)
    stock_vars, our_vars = run_side_by_side(stock, ours, overwrite, sequence, jit)
    assert_same_values(
        [v.numpy() for v in our_vars], [v.numpy() for v in stock_vars], WEIGHT_RTOL
    )
    np.testing.assert_array_equal(our_vars[1].numpy(), sequence[-1][1])
    assert_same_slots(ours, stock, WEIGHT_RTOL)
    if scaling == "dynamic":
        assert numbers(ours) == numbers(stock)
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy()) == 4


@pytest.mark.parametrize("which", [0, 1], ids=["regular_inf", "overwrite_inf"])
def test_non_finite_gradient_of_either_kind_skips_as_stock(which):
    """Stock checks every gradient, an overwritten variable's too: it would
    be written into the weight as it is."""
    overwrite = (False, True)
    stock, ours = stock_and_ours(keras.optimizers.SGD(0.1), dynamic_growth_steps=2)
    sequence = unscaled_sequence(4, 3, bad=[(1, which)])
    stock_vars, our_vars = run_side_by_side(stock, ours, overwrite, sequence, FAST_JIT)
    assert_same_values(
        [v.numpy() for v in our_vars], [v.numpy() for v in stock_vars], WEIGHT_RTOL
    )
    assert all(np.all(np.isfinite(v.numpy())) for v in our_vars)
    assert numbers(ours) == numbers(stock)
    assert int(ours.skipped_steps.numpy()) == 1


# ------------------------------------------------------ 4. sparse embeddings


def recording(cls, seen):
    """`cls` whose `apply` notes the type of every gradient it receives (at
    trace time under `tf.function`)."""

    class Recording(cls):
        def apply(self, grads, trainable_variables=None):
            seen.append([type(g) for g in grads])
            return super().apply(grads, trainable_variables)

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


def embedding_model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(12, 4),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])


def embedding_data():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 12, (16, 3)).astype("int32")
    return x, rng.standard_normal((16, 1)).astype("float32")


# Compiled only: the trainer-path tests compare every other fit path (and
# the TensorFlow ones keep the gradient sparse without XLA as well).
@pytest.mark.parametrize("jit", [True], ids=["jit"])
@pytest.mark.parametrize("inner", ["SGD", "Adam"])
def test_embedding_fit_matches_stock_and_keeps_gradients_sparse(inner, jit, float16_policy):
    x, y = embedding_data()
    results = {}
    for name in ("stock", "ours"):
        seen = []
        cls = recording(getattr(keras.optimizers, inner), seen)
        optimizer = {
            "stock": keras.mixed_precision.LossScaleOptimizer,
            "ours": lambda o, **k: tas.AdaptiveLossScaleOptimizer(o, scaling="dynamic", **k),
        }[name](cls(0.05), dynamic_growth_steps=2)
        model = embedding_model()
        model.compile(optimizer, "mse", jit_compile=jit)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        results[name] = (model, optimizer, seen)
    (stock_model, stock, stock_seen), (our_model, ours, our_seen) = (
        results["stock"], results["ours"]
    )
    assert_same_values(our_model.get_weights(), stock_model.get_weights(), rtol=1e-6)
    assert_same_slots(ours, stock, rtol=1e-6)
    assert numbers(ours) == numbers(stock)
    assert int(ours.total_steps.numpy()) == 4
    if TF:
        # The embedding's gradient reaches the inner optimizer sparse.
        assert stock_seen and stock_seen[-1][0] is tf.IndexedSlices
        assert our_seen, "the inner optimizer's apply was never called"
        assert [t is tf.IndexedSlices for t in our_seen[-1]] == [
            t is tf.IndexedSlices for t in stock_seen[-1]
        ], f"ours: {our_seen[-1]}, stock: {stock_seen[-1]}"


# ----------------------------------------------- 5. legacy tf-keras calls


@pytest.mark.parametrize("scaling", ["dynamic", None])
def test_get_scaled_loss_of_a_tensor_and_of_a_callable(scaling):
    """tf-keras's `get_scaled_loss` (stock Keras 3 has none: by hand)."""
    ours = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling=scaling)
    ours.build(two_variables())
    scale = float(ours.loss_scale.numpy())
    loss = keras.ops.convert_to_tensor(np.float32(0.75))
    scaled = ours.get_scaled_loss(loss)
    assert float(scaled) == 0.75 * scale
    assert keras.backend.standardize_dtype(scaled.dtype) == "float32"
    # A callable loss gives a callable, as tf-keras did.
    scaled_fn = ours.get_scaled_loss(lambda: loss)
    assert callable(scaled_fn)
    assert float(scaled_fn()) == 0.75 * scale


@pytest.mark.skipif(not TF, reason="tf-keras API on tf.IndexedSlices: TensorFlow only")
@pytest.mark.parametrize("scaling", ["dynamic", None])
def test_get_unscaled_gradients_keeps_indexed_slices(scaling):
    ours = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(), scaling=scaling, initial_scale=2.0**10
    )
    ours.build(two_variables())
    scale = float(ours.loss_scale.numpy())
    dense = tf.constant([[2.0, -4.0, 8.0], [1.0, 0.5, 0.0]])
    sparse = tf.IndexedSlices(
        values=tf.constant([[512.0, -3.0, 1.0]]),
        indices=tf.constant([1]),
        dense_shape=tf.constant([2, 3]),
    )
    unscaled_dense, unscaled_sparse, none = ours.get_unscaled_gradients(
        [dense, sparse, None]
    )
    np.testing.assert_array_equal(unscaled_dense.numpy(), dense.numpy() / scale)
    assert isinstance(unscaled_sparse, tf.IndexedSlices), type(unscaled_sparse)
    np.testing.assert_array_equal(
        unscaled_sparse.values.numpy(), sparse.values.numpy() / scale
    )
    np.testing.assert_array_equal(unscaled_sparse.indices.numpy(), [1])
    np.testing.assert_array_equal(unscaled_sparse.dense_shape.numpy(), [2, 3])
    assert none is None


@pytest.mark.skipif(not TF, reason="tf-keras API with tf.GradientTape: TensorFlow only")
@pytest.mark.parametrize("eager", [False, True], ids=["traced", "eager"])
def test_legacy_loop_matches_stock_loop(eager, float16_policy):
    """tf-keras's loop (`get_scaled_loss`, `get_unscaled_gradients`,
    `apply_gradients`) with ours equals Keras 3's with stock (`scale_loss`,
    `apply` of the scaled gradients), embedding gradients sparse, in a
    `tf.function` and eagerly."""
    x, y = embedding_data()
    stock, ours = stock_and_ours(keras.optimizers.Adam(0.05), dynamic_growth_steps=2)
    stock_model, our_model = embedding_model(), embedding_model()

    @tf.function(jit_compile=False)
    def stock_step(x, y):
        with tf.GradientTape() as tape:
            pred = keras.ops.cast(stock_model(x, training=True), "float32")
            loss = keras.ops.mean((pred - y) ** 2)
            scaled = stock.scale_loss(loss)
        grads = tape.gradient(scaled, stock_model.trainable_variables)
        stock.apply(grads, stock_model.trainable_variables)

    @tf.function(jit_compile=False)
    def legacy_step(x, y):
        with tf.GradientTape() as tape:
            pred = keras.ops.cast(our_model(x, training=True), "float32")
            loss = keras.ops.mean((pred - y) ** 2)
            scaled = ours.get_scaled_loss(loss)
        grads = tape.gradient(scaled, our_model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        grads = ours.get_unscaled_gradients(grads)
        assert isinstance(grads[0], tf.IndexedSlices)
        ours.apply_gradients(zip(grads, our_model.trainable_variables))

    if eager:
        stock_step, legacy_step = stock_step.python_function, legacy_step.python_function
    for start in range(0, 16, 4):
        stock_step(x[start : start + 4], y[start : start + 4])
        legacy_step(x[start : start + 4], y[start : start + 4])
        assert numbers(ours) == numbers(stock)
    assert_same_values(our_model.get_weights(), stock_model.get_weights(), rtol=1e-6)


# tf-keras's own LossScaleOptimizer tests of the legacy calls, ported
# (tf_keras/mixed_precision/loss_scale_optimizer_test.py), eager and traced.

TF_ONLY = pytest.mark.skipif(not TF, reason="the tf-keras API: TensorFlow only")


def run(fn, eager):
    return fn() if eager else tf.function(fn, autograph=False)()


@TF_ONLY
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced"])
def test_tf_keras_get_scaled_loss(eager):
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(), scaling="static", initial_scale=2.0
    )
    for dtype in ("float32", "float16"):
        loss = tf.convert_to_tensor(5.0, dtype=dtype)
        assert float(run(lambda: opt.get_scaled_loss(loss), eager)) == 10.0
        assert float(run(lambda: opt.get_scaled_loss(lambda: loss)(), eager)) == 10.0


@TF_ONLY
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced"])
def test_tf_keras_get_unscaled_gradients(eager):
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(), scaling="static", initial_scale=2.0
    )
    scaled = [tf.constant(3.0), None, tf.constant(-4.0, dtype="float16")]
    grads = run(lambda: opt.get_unscaled_gradients(scaled), eager)
    assert [None if g is None else float(g) for g in grads] == [1.5, None, -2.0]
    sparse = tf.IndexedSlices(tf.constant([[4.0, 2.0], [8.0, 5.0]]), tf.constant([1, 3]),
                              dense_shape=tf.constant([5, 2]))
    (grad,) = run(lambda: opt.get_unscaled_gradients([sparse]), eager)
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(grad.values.numpy(), [[2.0, 1.0], [4.0, 2.5]])


@TF_ONLY
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced"])
def test_tf_keras_dynamic_loss_scale_with_the_legacy_calls(eager):
    """tf-keras's testDynamicLossScale through get_scaled_loss,
    get_unscaled_gradients and apply_gradients: the loss is the variable,
    so the scaled gradient is the scale; the scale doubles every step."""
    var = keras.Variable([5.0])
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(2.0), scaling="dynamic", initial_scale=2.0,
        dynamic_growth_steps=1,
    )
    opt.build([var])

    def step():
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(keras.ops.sum(var.value))
        (grad,) = tape.gradient(scaled, [var])
        (unscaled,) = opt.get_unscaled_gradients([grad])
        opt.apply_gradients([(unscaled, var)])
        return grad

    step_fn = step if eager else tf.function(step, autograph=False)
    assert float(step_fn()[0]) == 2.0
    np.testing.assert_array_equal(var.numpy(), [3.0])
    assert float(opt.loss_scale) == 4.0
    assert float(step_fn()[0]) == 4.0
    np.testing.assert_array_equal(var.numpy(), [1.0])


@pytest.mark.skipif(TF, reason="the refusal off TensorFlow")
def test_get_unscaled_gradients_is_refused_off_tensorflow():
    """A JAX step is stateless: the legacy call could not mark it."""
    ours = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="TensorFlow only"):
        ours.get_unscaled_gradients([keras.ops.ones((2,))])


# ------------------------------------------------------- 6. serialization

STOCK_FORMS = [
    dict(),
    dict(initial_scale=2**15, dynamic_growth_steps=3),  # int scale
    dict(initial_scale=2.0**12, dynamic_growth_steps=3.0, name="scaled"),
    dict(initial_scale=1024, dynamic_growth_steps=2.0, name="lso"),
]


@pytest.mark.parametrize("form", STOCK_FORMS, ids=lambda f: ",".join(
    f"{k}={v!r}" for k, v in f.items()) or "defaults")
def test_config_round_trips_every_stock_argument_form(form):
    stock, ours = stock_and_ours(keras.optimizers.Adam(3e-3, name="inner"), **form)
    stock_config, config = stock.get_config(), ours.get_config()
    for key in ("initial_scale", "dynamic_growth_steps", "inner_optimizer"):
        assert config[key] == stock_config[key], key
    if "name" in form:
        assert config["name"] == stock_config["name"] == form["name"]
    clone = tas.AdaptiveLossScaleOptimizer.from_config(config)
    assert clone.get_config() == config
    assert clone.name == ours.name
    again = keras.optimizers.deserialize(keras.optimizers.serialize(ours))
    assert type(again) is tas.AdaptiveLossScaleOptimizer
    assert again.get_config() == config
    # A stock configuration builds ours (drop-in), in the default mode.
    from_stock = tas.AdaptiveLossScaleOptimizer.from_config(stock_config)
    assert from_stock.scaling is None
    for key in ("initial_scale", "dynamic_growth_steps", "name"):
        assert from_stock.get_config()[key] == stock_config[key], key


def dense_net(seed=2):
    return dense_model(4, 6, 1, seed=seed, sequential=True)


def dense_data(n=24):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, 4)).astype("float32")
    return x, rng.standard_normal((n, 1)).astype("float32")


def test_saved_model_reloads_and_continues_as_stock(tmp_path, float16_policy):
    x, y = dense_data()
    form = dict(initial_scale=2**15, dynamic_growth_steps=2.0, name="lso")
    stock, ours = stock_and_ours(keras.optimizers.Adam(0.01), **form)
    models = {}
    for name, optimizer in (("stock", stock), ("ours", ours)):
        models[name] = dense_net()
        models[name].compile(optimizer, "mse", jit_compile=FAST_JIT)
        models[name].fit(x[:12], y[:12], batch_size=4, shuffle=False, verbose=0)
    path = str(tmp_path / "ours.keras")
    models["ours"].save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    assert type(loaded.optimizer) is tas.AdaptiveLossScaleOptimizer
    assert loaded.optimizer.get_config() == ours.get_config()
    assert numbers(loaded.optimizer) == numbers(ours) == numbers(stock)
    for model in (*models.values(), loaded):
        model.fit(x[12:16], y[12:16], batch_size=4, shuffle=False, verbose=0)
    # The reloaded model continues exactly as the original, and as stock.
    assert_same_values(loaded.get_weights(), models["ours"].get_weights())
    assert_same_slots(loaded.optimizer, ours)
    assert numbers(loaded.optimizer) == numbers(ours)
    assert_same_values(models["ours"].get_weights(), models["stock"].get_weights())
    assert_same_slots(ours, stock)
    assert numbers(ours) == numbers(stock)
    assert int(ours.total_steps.numpy()) == 4


# -------------------------------------------------- 7. every trainer path

TRAINER_PATHS = {
    "jit": dict(jit_compile=True),
    "no_jit": dict(jit_compile=False),
    # On JAX the same path as jit_compile=False (no `jax.jit`).
    **({"eager": dict(run_eagerly=True)} if TF else {}),
    # On TensorFlow with XLA each of the steps is the "jit" path's step.
    "steps_per_execution": dict(jit_compile=FAST_JIT, steps_per_execution=3),
}


@pytest.mark.parametrize("path", list(TRAINER_PATHS))
def test_fit_matches_stock_on_every_trainer_path(path, float16_policy):
    x, y = dense_data()
    stock, ours = stock_and_ours(
        keras.optimizers.SGD(0.02, momentum=0.5), dynamic_growth_steps=2
    )
    models = {}
    for name, optimizer in (("stock", stock), ("ours", ours)):
        model = dense_net()
        model.compile(optimizer, "mse", auto_scale_loss=True, **TRAINER_PATHS[path])
        assert model.optimizer is optimizer  # not wrapped again
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        models[name] = model
    assert_same_values(models["ours"].get_weights(), models["stock"].get_weights(), rtol=1e-6)
    assert_same_slots(ours, stock, rtol=1e-6)
    assert numbers(ours) == numbers(stock)
    assert int(ours.total_steps.numpy()) == 6


def test_fit_matches_auto_wrapped_stock(float16_policy):
    """`compile` wraps a plain optimizer in the stock one under
    mixed_float16 (its defaults): ours with `scaling="dynamic"` and the
    defaults trains the same."""
    x, y = dense_data()
    stock_model, our_model = dense_net(), dense_net()
    stock_model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=FAST_JIT)
    stock = stock_model.optimizer
    assert type(stock) is keras.mixed_precision.LossScaleOptimizer
    ours = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(0.01), scaling="dynamic")
    our_model.compile(ours, "mse", jit_compile=FAST_JIT)
    assert our_model.optimizer is ours
    for model in (stock_model, our_model):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_same_values(our_model.get_weights(), stock_model.get_weights(), rtol=1e-6)
    assert_same_slots(ours, stock, rtol=1e-6)
    assert numbers(ours) == numbers(stock)


# ------------------------------------ 8. one optimizer in two models (a slip)


def train_second_model(optimizer, units):
    x, y = dense_data(8)
    first = dense_net()
    first.compile(optimizer, "mse", jit_compile=FAST_JIT)
    first.fit(x, y, batch_size=4, verbose=0)
    second = dense_model(4, units, 1, seed=3, sequential=True)
    second.compile(optimizer, "mse", jit_compile=FAST_JIT)
    with pytest.raises(ValueError) as raised:
        second.fit(x, y, batch_size=4, verbose=0)
    return second, str(raised.value)


def test_one_optimizer_in_two_models_is_refused_by_name():
    stock, ours = stock_and_ours(keras.optimizers.SGD(0.1))
    if TF:
        # Stock refuses variables it was not built with, naming them.
        second, message = train_second_model(stock, units=6)
        assert "Unknown variable" in message
        assert "can only be called for the variables it was" in message
        second, message = train_second_model(ours, units=6)
        assert re.search(
            r"Unknown variable|can only be called for the variables it was", message
        ), message
        assert any(v.path in message for v in second.trainable_variables), message
    else:
        # The JAX trainer hands the optimizer values, not variables: no
        # optimizer can name them; one built for other shapes refuses them.
        train_second_model(stock, units=5)
        train_second_model(ours, units=5)
