"""The package on Keras's JAX backend (the suite's second pass, README):
what the TensorFlow-specific files show there (`fit` against the stock
optimizer, float32 exactness of scaled training, per layer too, a gradient
no global scale reaches, the monitor, save and resume), plus custom JAX
loops, `keras.distribution` data parallelism and TensorFlow never imported.
References are computed apart: the stock optimizer, plain float32 training,
float64 gradients by hand.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from child_process import child_env
from test_gradient_paths import test_counts_do_not_saturate_beyond_two_to_the_24  # noqa: F401
from test_gradient_paths import test_regularisers_and_add_loss_train_exactly_at_every_step  # noqa: F401
from test_gradient_paths import test_the_model_instrumented_first_of_two_trains_exactly  # noqa: F401
from test_gradient_paths import test_tied_embeddings_train_exactly  # noqa: F401
from test_gradient_paths import test_two_instrumented_models_on_one_backbone_each_train_exactly  # noqa: F401

import tf_adaptive_scale as tas



def data(n=64, features=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x @ rng.standard_normal((features, 1))).astype("float32")
    return x, y


def mlp(features=6):
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(8, activation="tanh", name="middle"),
            keras.layers.Dense(1, name="head"),
        ]
    )


def twin(model):
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def run_python(code, **env):
    """Runs `code` in a fresh interpreter of this checkout with `env` added
    (`KERAS_BACKEND` among them); returns stdout."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_jax_never_imports_tensorflow():
    out = run_python(
        "import sys, keras, numpy as np\n"
        "import tf_adaptive_scale as tas\n"
        "model = tas.instrument(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))\n"
        "opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())\n"
        "model.compile(opt, 'mse')\n"
        "tas.ScaleMonitor()\n"
        "print(opt.scaling, 'tensorflow' in sys.modules)\n"
        "try:\n"
        "    tas.make_train_step\n"
        "except AttributeError as e:\n"
        "    print('refused:', 'TensorFlow-specific' in str(e))\n",
        KERAS_BACKEND="jax",
    )
    assert out.split("\n")[:2] == ["per_layer False", "refused: True"]


def test_fit_matches_stock_keras_side_by_side():
    """Dynamic mode is the stock optimizer's rule: same weights and scale
    after `fit`, overflowing batches included."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data()
    x[17] = 3e4  # overflows float16 in the backward pass of its batch
    ours_model = mlp()
    stock_model = twin(ours_model)
    ours = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.01), scaling="dynamic", dynamic_growth_steps=3,
        initial_scale=2.0**12,
    )
    stock = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), dynamic_growth_steps=3, initial_scale=2.0**12
    )
    for model, opt in ((ours_model, ours), (stock_model, stock)):
        model.compile(opt, "mse", jit_compile=True)
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
    x, y = data()
    plain = mlp()
    model = twin(plain)
    if scaling == "per_layer":
        model = tas.instrument(model, initial_scale=2.0**9)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling=scaling, update_every=2,
        initial_scale=2.0**7,
    )
    model.compile(opt, "mse", jit_compile=True)
    plain.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=True)
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


class Attenuate(keras.layers.Layer):
    """Multiplies by 2**-36: the gradients below it are 2**-36 smaller."""

    def call(self, x):
        return x * 2.0**-36


def attenuated_model(policy):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, name="below"),
        Attenuate(dtype="float32", name="attenuate"),  # exact in float32
        keras.layers.Dense(16, name="above", trainable=False),
        keras.layers.Dense(1, name="head", trainable=False),
    ])


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
def test_per_layer_reaches_a_gradient_no_global_scale_can(scaling):
    """float16: the lowest layer's gradient lies below 2**-30, out of reach of
    any global scale (at most 2**24): the global adaptive optimizer applies
    zeros there, per-layer scaling the float64 gradient (by hand)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype("float32")
    y = np.ones((32, 1), "float32")
    reference = attenuated_model("float32")
    w1, b1, w2, b2, w3, b3 = (np.asarray(w, np.float64) for w in reference.get_weights())
    out = ((x @ w1 + b1) * 2.0**-36 @ w2 + b2) @ w3 + b3
    d_below = 2.0 * (out - y) / y.size @ w3.T @ w2.T * 2.0**-36
    expected = (x.T @ d_below, d_below.sum(0))
    assert 0 < np.abs(expected[0]).max() < 2.0**-30

    model = attenuated_model("mixed_float16")
    model.set_weights(reference.get_weights())
    trained = tas.instrument(model) if scaling == "per_layer" else model
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.0), scaling=scaling, update_every=100
    )
    trained.compile(opt, "mse", jit_compile=True)
    for _ in range(6):  # per layer: all underflowed at first, rises, then the rule
        trained.train_on_batch(x, y)
    learning_rate = 2.0**30  # makes the update (weight change) readable
    opt.inner_optimizer.learning_rate.assign(learning_rate)
    before = model.get_layer("below").get_weights()
    trained.train_on_batch(x, y)
    after = model.get_layer("below").get_weights()
    applied = [(b - a) / learning_rate for b, a in zip(before, after)]
    if scaling == "adaptive":
        # Its rule sees weight gradients only, all zero in float16: the
        # search for a scale that shows them skips every step (2**15 blind,
        # 2**23 overflows the frozen layers' activation gradients, then
        # 2**-16 ... 2**16 blind), applying nothing.
        assert int(opt.skipped_steps) == 7 and int(opt.iterations) == 0
        np.testing.assert_array_equal(applied[0], 0.0)  # lost to float16
        return
    assert int(opt.skipped_steps) == 0
    assert opt.layer_scales()["below"] > 2.0**40
    for got, g in zip(applied, expected):
        np.testing.assert_allclose(got, g, rtol=2e-2, atol=2e-2 * np.abs(g).max())


def test_monitor_writes_json_lines_in_fit(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data()
    model = mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2)
    model.compile(opt, "mse", jit_compile=True)
    monitor = tas.ScaleMonitor(every_n_steps=2, log_dir=str(tmp_path), verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    lines = (tmp_path / "scale_monitor.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    layers = {name.rsplit("/", 1)[-1] for name in records[-1]["layers"]}
    assert layers == {"hidden", "middle", "head"}
    assert records[-1]["loss_scale"] == float(opt.loss_scale.numpy())


@pytest.mark.parametrize("scaling", ["adaptive", "per_layer"])
def test_saved_model_resumes_exactly(tmp_path, scaling):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data()

    def make():
        keras.utils.set_random_seed(1)
        model = mlp()
        if scaling == "per_layer":
            model = tas.instrument(model)
        opt = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-3), scaling=scaling, update_every=3
        )
        model.compile(opt, "mse", jit_compile=True)
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


def test_custom_jax_loop_with_stateless_apply():
    """The JAX custom loop: `jax.value_and_grad` over `stateless_call`, the
    loss scaled in a StatelessScope, `stateless_apply`, all jitted; equal to
    `fit` on a twin model."""
    import jax

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data()
    model = mlp()
    fitted = twin(model)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    def scaled_loss(trainable, non_trainable, opt_values, xb, yb):
        pred, non_trainable = model.stateless_call(trainable, non_trainable, xb)
        loss = loss_fn(yb, pred)
        with keras.StatelessScope(list(zip(opt.variables, opt_values))):
            return opt.scale_loss(loss), non_trainable

    @jax.jit
    def step(trainable, non_trainable, opt_values, xb, yb):
        grads, non_trainable = jax.grad(scaled_loss, has_aux=True)(
            trainable, non_trainable, opt_values, xb, yb
        )
        trainable, opt_values = opt.stateless_apply(opt_values, grads, trainable)
        return trainable, non_trainable, opt_values

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in opt.variables],
    )
    for i in range(0, len(x), 8):
        state = step(*state, x[i : i + 8], y[i : i + 8])
    for v, value in zip(opt.variables, state[2]):
        v.assign(value)
    for v, value in zip(model.trainable_variables, state[0]):
        v.assign(value)

    twin_opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2)
    fitted.compile(twin_opt, loss_fn, jit_compile=True)
    fitted.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.total_steps.numpy()) == 8 == int(twin_opt.total_steps.numpy())
    assert float(opt.loss_scale.numpy()) == float(twin_opt.loss_scale.numpy())
    for a, b in zip(model.get_weights(), fitted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_data_parallel_devices_agree_on_skips():
    """`keras.distribution.DataParallel` over two CPU devices: an overflow
    in one device's shard skips the step on both, and training equals the
    single-device run."""
    code = r"""
import json, keras, numpy as np
import tf_adaptive_scale as tas
keras.mixed_precision.set_global_policy("mixed_float16")

def train(distributed):
    if distributed:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=keras.distribution.list_devices("cpu")))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2)
    model.compile(opt, "mse", jit_compile=True)
    x = np.linspace(-1, 1, 64 * 4, dtype="float32").reshape(64, 4)
    x[13] = 6e4  # second half of the first batch of 16: the second device
    model.fit(x, x[:, :1], batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras.distribution.set_distribution(None)
    return int(opt.skipped_steps.numpy()), [w.tolist() for w in model.get_weights()]

print(json.dumps([len(keras.distribution.list_devices("cpu")), train(False), train(True)]))
"""
    out = run_python(
        code, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    devices, single, parallel = json.loads(out.strip().splitlines()[-1])
    assert devices == 2
    assert single[0] == parallel[0] >= 2  # one overflowing batch per epoch
    # Equal up to float16 rounding: each device reduces its own half first.
    for a, b in zip(single[1], parallel[1]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
