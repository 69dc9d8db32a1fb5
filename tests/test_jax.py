"""What exists on JAX only: custom JAX loops (`jax.grad` over
`stateless_call`, `stateless_apply`), `keras.distribution` data parallelism,
and TensorFlow never imported. What runs on both backends is in the modules
of both passes (`conftest.ON_JAX`): `test_fit.py` (fit against the stock
optimizer, float32 exactness of scaled training, per layer too, a gradient
no global scale reaches, the monitor, save and resume), `test_gradient_paths.py`,
the drop-in, stock-compatibility and scaling tests. And one float16 result
of JAX's own: the global adaptive scale applies nothing of a gradient at
float16's smallest subnormal.
"""

import functools
import json

import keras
import numpy as np
import pytest

import tf_adaptive_scale as tas
from helpers import (
    applied_update, attenuated_problem, attenuated_training, linear_data, run_python,
    three_layer_mlp, twin,
)


# One fresh JAX process (two CPU devices) for what needs one: whether
# TensorFlow was imported, and `keras.distribution` over two devices.
_CHILD = r"""
import json, sys, keras, numpy as np
import tf_adaptive_scale as tas

model = tas.instrument(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())
model.compile(opt, 'mse')
tas.ScaleMonitor()
try:
    tas.make_train_step
    refused = False
except AttributeError as e:
    refused = 'TensorFlow-specific' in str(e)
never_imports = [opt.scaling, 'tensorflow' in sys.modules, refused]

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

# (keras.utils.set_random_seed imports TensorFlow where it is installed.)
print(json.dumps({
    "never_imports": never_imports,
    "data_parallel": [len(keras.distribution.list_devices("cpu")), train(False), train(True)],
}))
"""


@functools.lru_cache(maxsize=None)
def _child():
    out = run_python(
        "-c", _CHILD, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # starts a child process
class TestOneFreshJaxProcess:
    """What needs a fresh JAX process (`_child`, run once: one worker runs this class)."""

    def test_jax_never_imports_tensorflow(self):
        assert _child()["never_imports"] == ["per_layer", False, True]

    def test_data_parallel_devices_agree_on_skips(self):
        """`keras.distribution.DataParallel` over two CPU devices: an overflow
        in one device's shard skips the step on both, and training equals the
        single-device run."""
        devices, single, parallel = _child()["data_parallel"]
        assert devices == 2
        assert single[0] == parallel[0] >= 2  # one overflowing batch per epoch
        # Equal up to float16 rounding: each device reduces its own half first.
        for a, b in zip(single[1], parallel[1]):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_custom_jax_loop_with_stateless_apply(float16_policy):
    """The JAX custom loop: `jax.value_and_grad` over `stateless_call`, the
    loss scaled in a StatelessScope, `stateless_apply`, all jitted; equal to
    `fit` on a twin model."""
    import jax

    x, y = linear_data()
    model = three_layer_mlp()
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


def test_no_global_scale_reaches_a_gradient_below_two_to_the_minus_30():
    """float16: the lowest layer's gradient lies below 2**-30 (float64, by
    hand), out of reach of any global scale (at most 2**24): the global
    adaptive optimizer applies zeros there (per layer: test_fit.py, both
    backends). JAX only: at the search's last scale, 2**16, that gradient
    lies at float16's smallest subnormal; TensorFlow's float16 backward
    pass keeps a few of its values there (it sees them and applies them),
    JAX's none."""
    x, y, reference, expected = attenuated_problem()
    assert 0 < np.abs(expected[0]).max() < 2.0**-30
    model, trained, opt = attenuated_training("adaptive", reference, x, y)
    applied = applied_update(model, trained, opt, x, y)
    # Its rule sees weight gradients only, all zero in float16: the
    # search for a scale that shows them skips every step (2**15 blind,
    # 2**23 overflows the frozen layers' activation gradients, then
    # 2**-16 ... 2**16 blind), applying nothing.
    assert int(opt.skipped_steps) == 7 and int(opt.iterations) == 0
    np.testing.assert_array_equal(applied[0], 0.0)  # lost to float16


def test_a_jax_embedding_whose_batches_use_20_ids(float16_policy):
    """Keras on JAX gives an Embedding a dense gradient: the 2048-value
    sample read about one value in each of 2048 evenly spaced rows of a
    50,000-row table, so a batch using ids 1-20 read as all zero (norm 0 in
    every report, the monitor flagging the learning table `never_updates`).
    The recorded norm is within 10% of float32's, and nothing is flagged."""
    import jax

    def build(dtype=None):
        return keras.Sequential([
            keras.Input((8,), dtype="int32"),
            keras.layers.Embedding(50_000, 16, name="embedding", dtype=dtype),
            keras.layers.GlobalAveragePooling1D(dtype=dtype),
            keras.layers.Dense(1, name="head", dtype=dtype),
        ])

    keras.utils.set_random_seed(0)
    model, reference = build(), build("float32")
    reference.set_weights(model.get_weights())
    rng = np.random.default_rng(0)
    x = rng.integers(1, 21, (32, 8)).astype("int32")
    y = rng.standard_normal((32, 1)).astype("float32")
    # A zero learning rate keeps the weights, so every step's gradient is
    # the reference's.
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), update_every=1)
    model.compile(optimizer, "mse")
    monitor = tas.ScaleMonitor(every_n_steps=1, patience=2, verbose=0)
    model.fit(x, y, batch_size=32, epochs=4, callbacks=[monitor], verbose=0)

    def loss(trainable):
        out, _ = reference.stateless_call(trainable, [], x)
        return keras.ops.mean(keras.losses.mean_squared_error(y, out))

    exact = jax.grad(loss)([v.value for v in reference.trainable_variables])[0]
    recorded = float(optimizer.variable_gradient_norms.numpy()[0])
    assert recorded == pytest.approx(float(np.linalg.norm(np.asarray(exact))), rel=0.1)
    assert [f for f in monitor.flags if f["kind"] == "never_updates"] == []
    layers = monitor.records[-1]["layers"]
    (table,) = [name for name in layers if name.endswith("embedding")]
    assert layers[table]["grad_norm"] > 0
