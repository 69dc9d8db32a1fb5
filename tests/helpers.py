"""What the tests share (not a test module): small model builders, data,
compiled optimizer steps on either backend, and child Python processes.

Fixtures live in `conftest.py`. The worker scripts (`*_worker.py`) run as
child processes of this checkout with `tests/` on their path, so they can
import this module too.

Builders build under the current dtype policy; those given a `seed` set it
first, so float32 and mixed_float16 twins share their initial weights
(Keras initializers draw their seed when a layer is constructed).
"""

import os
import subprocess
import sys

import keras
import numpy as np
from keras import layers

import tf_adaptive_scale as tas
# The kernel census's models and HLO counting, shared with the benchmarks.
from benchmarks.hlo import optimized_fit_program, top_level_kernels  # noqa: F401
from benchmarks.zoo import census_mlp, conv_net  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
BACKEND = keras.backend.backend()
TF = BACKEND == "tensorflow"
JAX = BACKEND == "jax"
INF, NAN = float("inf"), float("nan")


# ------------------------------------------------------------------- data


def normal(shape, seed=0, scale=1.0):
    """Standard-normal float32 values (times `scale`), from `seed`."""
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal(shape)).astype("float32")


def linear_data(n=64, features=6, seed=0):
    """`(x, y)`: `n` standard-normal rows and a random linear function of them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x @ rng.standard_normal((features, 1))).astype("float32")
    return x, y


def tensor(value):
    """`value` as a float32 tensor of the backend."""
    return keras.ops.convert_to_tensor(np.asarray(value, "float32"))


# ----------------------------------------------------------- small models


def dense_model(inputs, *stack, seed=None, sequential=False):
    """Dense layers on `inputs` features, the last one the output.

    Each of `stack` is `units`, `(units, activation)`, `(units, activation,
    name)` or a dict of `keras.layers.Dense` arguments. A `keras.Sequential`
    if `sequential`, else a Functional model. Seeds first if `seed` is given.
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    specs = []
    for spec in stack:
        if isinstance(spec, dict):
            specs.append(dict(spec))
        else:
            spec = spec if isinstance(spec, tuple) else (spec,)
            specs.append(dict(zip(("units", "activation", "name"), spec)))
    if sequential:
        return keras.Sequential([keras.Input((inputs,))] + [layers.Dense(**s) for s in specs])
    x = h = keras.Input((inputs,))
    for s in specs:
        h = layers.Dense(**s)(h)
    return keras.Model(x, h)


def named_mlp(inputs=8, width=16, depth=2, activation="relu", prefix="hidden", seed=0):
    """Functional: `depth` Dense layers `{prefix}_{i}`, then a Dense(1) "head"."""
    hidden = [(width, activation, f"{prefix}_{i}") for i in range(depth)]
    return dense_model(inputs, *hidden, (1, None, "head"), seed=seed)


def three_layer_mlp(features=6):
    """Sequential "hidden" (16, relu), "middle" (8, tanh), "head" (1)."""
    return dense_model(
        features, (16, "relu", "hidden"), (8, "tanh", "middle"), (1, None, "head"),
        sequential=True,
    )


def twin(model):
    """A copy of `model` (`clone_model`) holding its weights."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def shared_backbone():
    """Functional "backbone": a Dense(8, tanh) "trunk" on 6 features."""
    x = keras.Input((6,))
    return keras.Model(x, layers.Dense(8, activation="tanh", name="trunk")(x), name="backbone")


def head_on(backbone, name):
    """Functional `name`: `backbone`, then a Dense(3) "{name}_out"."""
    x = keras.Input((6,))
    return keras.Model(x, layers.Dense(3, name=f"{name}_out")(backbone(x)), name=name)


def set_random_scales(instrumented, rng, bound):
    """Gives every unit of `instrumented` a random scale 2**k, k an integer
    in [-bound, bound] drawn from `rng` (a seed or a Generator); the loss
    unit keeps 1. Returns the log2 scales."""
    table = instrumented.scale_table
    log2 = np.random.default_rng(rng).integers(-bound, bound + 1, len(table.unit_names))
    log2 = log2.astype("float32")
    log2[0] = 0.0
    table.log2_scales.assign(log2)
    return log2


class Attenuate(layers.Layer):
    """Multiplies by 2**-36: the gradients below it are 2**-36 smaller
    (exact in float32)."""

    def call(self, x):
        return x * 2.0**-36


def attenuated_model(policy):
    """Under `policy` (left set), seed 3: a trainable Dense "below", then
    `Attenuate` in float32, then the frozen "above" and "head": no global
    float16 scale reaches the gradient of "below"."""
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((8,)),
        layers.Dense(16, name="below"),
        Attenuate(dtype="float32", name="attenuate"),
        layers.Dense(16, name="above", trainable=False),
        layers.Dense(1, name="head", trainable=False),
    ])


def attenuated_problem():
    """`(x, y, reference, expected)`: a batch, the float32 `attenuated_model`
    and the float64 gradient of its mean squared error with respect to
    "below"'s kernel and bias, by hand."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype("float32")
    y = np.ones((32, 1), "float32")
    reference = attenuated_model("float32")
    w1, b1, w2, b2, w3, b3 = (np.asarray(w, np.float64) for w in reference.get_weights())
    out = ((x @ w1 + b1) * 2.0**-36 @ w2 + b2) @ w3 + b3
    d_below = 2.0 * (out - y) / y.size @ w3.T @ w2.T * 2.0**-36
    return x, y, reference, (x.T @ d_below, d_below.sum(0))


def attenuated_training(scaling, reference, x, y, steps=6):
    """`(model, trained, optimizer)`: `reference`'s mixed_float16 twin
    (`trained` is it instrumented for `scaling="per_layer"`), compiled with
    XLA and an SGD at learning rate 0, after `steps` steps on `(x, y)`."""
    model = attenuated_model("mixed_float16")
    model.set_weights(reference.get_weights())
    trained = tas.instrument(model) if scaling == "per_layer" else model
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), scaling=scaling, update_every=100)
    trained.compile(opt, "mse", jit_compile=True)
    for _ in range(steps):
        trained.train_on_batch(x, y)
    return model, trained, opt


def applied_update(model, trained, opt, x, y, learning_rate=2.0**30):
    """One more step at `learning_rate` (which makes the weight change
    readable); the update of "below"'s kernel and bias divided by it."""
    opt.inner_optimizer.learning_rate.assign(learning_rate)
    before = model.get_layer("below").get_weights()
    trained.train_on_batch(x, y)
    after = model.get_layer("below").get_weights()
    return [(b - a) / learning_rate for b, a in zip(before, after)]


# ------------------------------------------- graph families (per-layer tests)
#
# Each returns `(model, inputs, targets)`: the structures per-layer scaling
# must handle.


def _zoo_data(shapes, seed=0, ints=None):
    if ints:
        return np.random.default_rng(seed).integers(1, ints, shapes).astype("int32")
    return normal(shapes, seed)


def sequential():
    model = keras.Sequential(
        [keras.Input((12,)), layers.Dense(16, activation="tanh"), layers.Dense(16), layers.Dense(3)]
    )
    return model, _zoo_data((32, 12)), _zoo_data((32, 3), 1)


def residual():
    x = keras.Input((12,))
    h = layers.Dense(16, activation="relu")(x)
    r = layers.Dense(16)(h)
    h = layers.Add()([h, r])  # fork at h: Dense and Add consume it
    h = layers.Activation("relu")(h)
    return keras.Model(x, layers.Dense(2)(h)), _zoo_data((32, 12)), _zoo_data((32, 2), 1)


def shared_and_concat():
    x = keras.Input((10,))
    shared = layers.Dense(10, activation="tanh")
    a = shared(x)
    b = shared(a)  # the same layer twice: its weight gradient sums both calls
    h = layers.Concatenate()([a, b, x])
    return keras.Model(x, layers.Dense(4)(h)), _zoo_data((32, 10)), _zoo_data((32, 4), 1)


def multi_io():
    xa, xb = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = layers.Concatenate()([layers.Dense(8)(xa), layers.Dense(8)(xb)])
    h = layers.Dense(8, activation="relu")(h)
    out1 = layers.Dense(2, name="first")(h)
    out2 = layers.Dense(1, name="second")(layers.Multiply()([h, h]))
    model = keras.Model({"a": xa, "b": xb}, {"first": out1, "second": out2})
    inputs = {"a": _zoo_data((32, 6)), "b": _zoo_data((32, 4), 2)}
    return model, inputs, {"first": _zoo_data((32, 2), 3), "second": _zoo_data((32, 1), 4)}


def nested():
    inner_seq = keras.Sequential([keras.Input((8,)), layers.Dense(8, activation="relu"), layers.Dense(8)])
    y = keras.Input((8,))
    inner_fn = keras.Model(y, layers.Dense(8, activation="tanh")(y))
    x = keras.Input((8,))
    h = inner_seq(x)
    h = inner_fn(h)
    h = inner_fn(layers.Add()([h, x]))  # a nested model called twice
    return keras.Model(x, layers.Dense(2)(h)), _zoo_data((32, 8)), _zoo_data((32, 2), 1)


def convolutional():
    x = keras.Input((16, 16, 3))
    h = layers.Conv2D(8, 3, padding="same")(x)
    h = layers.BatchNormalization()(h)
    h = layers.Activation("relu")(h)
    h = layers.Dropout(0.2, seed=1)(h)
    h = layers.Reshape((16, 16 * 8))(h)
    h = layers.Conv1D(8, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(x, layers.Dense(5)(h)), _zoo_data((8, 16, 16, 3)), _zoo_data((8, 5), 1)


def transformer():
    tokens = keras.Input((12,), dtype="int32")
    h = layers.Embedding(50, 16)(tokens)
    a = layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    h = layers.LayerNormalization()(layers.Add()([h, a]))
    f = layers.Dense(32, activation="relu")(h)
    f = layers.Dense(16)(f)
    h = layers.LayerNormalization()(layers.Add()([h, f]))
    out = layers.Dense(50)(h)
    return keras.Model(tokens, out), _zoo_data((8, 12), ints=50), _zoo_data((8, 12, 50), 1)


FAMILIES = {
    "sequential": sequential,
    "residual": residual,
    "shared_and_concat": shared_and_concat,
    "multi_io": multi_io,
    "nested": nested,
    "convolutional": convolutional,
    "transformer": transformer,
}


def build(family, policy, seed=0):
    """Builds `family` under `policy` from `seed`; restores the policy."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        return FAMILIES[family]()
    finally:
        keras.mixed_precision.set_global_policy(previous)


# ------------------------------------------- compiled steps, either backend


def stepper(optimizer, variables, jit=True):
    """`step(*grads)`: one `optimizer.apply(grads, variables)`, compiled.

    TensorFlow: `apply` inside a `tf.function` (XLA if `jit`). JAX: a
    jitted `optimizer.stateless_apply` whose results are written back to
    the variables (what Keras's JAX trainer does); eagerly without `jit`.
    """
    variables = list(variables)
    if TF:
        import tensorflow as tf

        @tf.function(jit_compile=jit)
        def step(*grads):
            optimizer.apply(list(grads), variables)

        return step
    import jax

    def pure(optimizer_values, values, grads):
        return optimizer.stateless_apply(optimizer_values, grads, values)

    pure = jax.jit(pure) if jit else pure

    def step(*grads):
        grads = [keras.ops.convert_to_tensor(np.asarray(g, "float32")) for g in grads]
        new_values, new_optimizer_values = pure(
            [v.value for v in optimizer.variables], [v.value for v in variables], grads
        )
        for v, value in zip(variables, new_values):
            v.assign(value)
        for v, value in zip(optimizer.variables, new_optimizer_values):
            v.assign(value)

    return step


_STEPS = {}


def compiled_once(objects, make, *extra):
    """`make()`'s compiled step, made once per `objects` (an optimizer and
    its variables) and `extra` in a test and reused: a new one would
    compile again. Holds `objects` (their ids stay theirs); conftest
    forgets them all after each test."""
    key = (*map(id, objects), *extra)
    if key not in _STEPS:
        _STEPS[key] = (objects, make())
    return _STEPS[key][1]


def padded_sequences(n, seed=0, vocab=20, length=12, classes=5):
    """`n` token sequences padded with 0, of bucketed lengths (sorted, so
    that consecutive batches hold very different token counts), and a class
    per token."""
    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, length + 1, n))[::-1]
    x = np.zeros((n, length), "int32")
    for row, count in enumerate(lengths):
        x[row, :count] = rng.integers(1, vocab, count)
    return x, rng.integers(0, classes, (n, length)).astype("int32")


def masked_sequence_model(seed=1, vocab=20, length=12, classes=5, mask_zero=True):
    """`Embedding(mask_zero=True)` and two Dense layers per token: a loss
    on its output averages over the valid tokens (without `mask_zero`,
    over those the loss itself leaves in)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((length,), dtype="int32")
    h = layers.Embedding(vocab, 8, mask_zero=mask_zero)(inputs)
    return keras.Model(inputs, layers.Dense(classes)(layers.Dense(8, activation="tanh")(h)))


def token_labels(x, ignored=0.0, seed=7, classes=5):
    """A class in 1..classes-1 per token of `padded_sequences`' `x`, and 0
    (the class a loss's `ignore_class=0` leaves out) where it pads and, with
    `ignored`, at that fraction of the other tokens too."""
    rng = np.random.default_rng(seed)
    y = rng.integers(1, classes, x.shape)
    y[(x == 0) | (rng.uniform(size=x.shape) < ignored)] = 0
    return y.astype("int32")


class IgnoringLoss(keras.losses.Loss):
    """A custom loss that masks its values: Keras's token cross-entropy of
    logits, class 0 ignored, sets the mask on them."""

    def call(self, y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True, ignore_class=0)


# ----------------------------------------------------- child processes


def child_env(**overrides):
    """`os.environ` for a child that imports this checkout's package (and
    this directory's modules), on the TensorFlow backend, with
    TensorFlow's logs quiet; `overrides` win."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, TESTS, env.get("PYTHONPATH")) if p)
    env["KERAS_BACKEND"] = "tensorflow"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(overrides)
    return env


# A child takes up to 80 s on a quiet 2-core machine (conftest.LONGEST_FIRST):
# generous for one under load.
CHILD_TIMEOUT = 900

_CHILDREN = {}


def child(*args, key=None, cwd=ROOT, timeout=CHILD_TIMEOUT, env=None, **overrides):
    """Runs `python *args` (`"-c", code, ...`, `"-m", module, ...` or a
    script) in a child of this checkout (`child_env(**overrides)`, or
    `env`), once per `key` and session (by default the command, `cwd` and
    the environment asked for); returns the `CompletedProcess`, whatever its exit status.

    The outcome is cached, a timeout included: a child that timed out fails
    this test and every later one that asks for it, without starting it
    again (raised and not cached, the timeout started the same child for
    every test that shares it: a loaded 2-core machine ran 43 minutes)."""
    if key is None:  # not os.environ: pytest names the current test there
        given = None if env is None else tuple(sorted(
            (k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
        key = (args, str(cwd), tuple(sorted(overrides.items())), given)
    env = child_env(**overrides) if env is None else env
    if key not in _CHILDREN:
        try:
            _CHILDREN[key] = subprocess.run(
                [sys.executable, *args], env=env, cwd=cwd,
                capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            _CHILDREN[key] = (
                f"child {' '.join(map(str, args))[:300]} timed out after {e.timeout} s"
                " (cached: not started again)"
            )
    outcome = _CHILDREN[key]
    if isinstance(outcome, str):
        import pytest

        pytest.fail(outcome, pytrace=False)
    return outcome


def run_child(*args, **kwargs):
    """`child(*args, **kwargs)`; asserts it exited 0."""
    result = child(*args, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result


def run_python(*args, **kwargs):
    """`run_child(*args, **kwargs)`'s stdout."""
    return run_child(*args, **kwargs).stdout
