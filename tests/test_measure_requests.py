"""Per layer reacts at once between measurements: each call of a step
returns the device's request to measure (an overflow, a unit rising
blind), which the host reads one call late and serves with the measuring
program on the call after (`step_programs`).

A surge (targets x 2**12 from step 40 of 160, the default
`update_every=100`) costs per layer what it costs the global adaptive mode,
which sees every step's statistics: 3 skipped steps, where waiting for the
next scheduled measurement cost 61. Both backends run `fit`; TensorFlow
also `make_train_step` and docs/per_layer.md's custom loop
(`tas.compile_step`).
"""

import keras
import numpy as np
import pytest
from helpers import TF

import tf_adaptive_scale as tas
from tf_adaptive_scale.per_layer import step_programs

STEPS, SURGE_AT, BATCH = 160, 40, 32


def surge_data(factor=2.0**12):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype("float32")
    y = (x @ rng.standard_normal((16, 1))).astype("float32")
    y[SURGE_AT * BATCH:] *= factor
    return x, y


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def optimizer(scaling):
    # A learning rate at which nothing but the surge overflows.
    return tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-7), scaling=scaling)


def skipped_in_fit(scaling, data):
    """The steps `fit` skipped, one step an epoch (each read as it ends:
    Keras on JAX syncs the variables at an epoch's end)."""
    model = tas.instrument(mlp()) if scaling == "per_layer" else mlp()
    opt = optimizer(scaling)
    model.compile(opt, "mse", jit_compile=True)
    counts = []
    watch = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: counts.append(int(opt.skipped_steps)))
    model.fit(*data, batch_size=BATCH, epochs=STEPS, steps_per_epoch=1, shuffle=False,
              verbose=0, callbacks=[watch])
    return np.flatnonzero(np.diff([0] + counts)).tolist()


def skipped_in_loop(step, opt, data):
    counts = []
    for i in range(STEPS):
        step(*(t[i * BATCH:(i + 1) * BATCH] for t in data))
        counts.append(int(opt.skipped_steps))
    return np.flatnonzero(np.diff([0] + counts)).tolist()


def skipped_by_make_train_step(data):
    model = tas.instrument(mlp())
    opt = optimizer("per_layer")
    return skipped_in_loop(tas.make_train_step(model, "mse", opt), opt, data)


def skipped_by_custom_loop(data):
    import tensorflow as tf

    model = tas.instrument(mlp())
    opt = optimizer("per_layer")
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    def train_step(x, y):  # docs/per_layer.md's loop
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn(y, model(x, training=True)))
        variables = model.trainable_variables
        opt.apply(tape.gradient(scaled, variables), variables)

    return skipped_in_loop(tas.compile_step(train_step, opt), opt, data)


PATHS = {"fit": lambda data: skipped_in_fit("per_layer", data)}
if TF:
    PATHS.update(make_train_step=skipped_by_make_train_step,
                 custom_loop=skipped_by_custom_loop)


@pytest.fixture(scope="module")
def global_skips():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return skipped_in_fit("adaptive", surge_data())
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("path", list(PATHS))
def test_a_surge_costs_per_layer_what_it_costs_the_global_mode(path, global_skips,
                                                               float16_policy):
    skipped = PATHS[path](surge_data())
    assert skipped[0] == SURGE_AT and global_skips[0] == SURGE_AT
    assert len(skipped) <= len(global_skips) + 2, (skipped, global_skips)
    # Not one skip per step until the scheduled measurement at step 100.
    assert all(s < SURGE_AT + 4 for s in skipped), skipped


def test_the_host_serves_a_request_two_calls_later_and_counts_on_from_it():
    first = step_programs.CALIBRATION_STEPS
    schedule = step_programs.Schedule(every=5)
    measured = [schedule.next_call_measures() for _ in range(first + 4)]  # steps 0-11
    assert measured == [True] * first + [False, False, True, False]
    schedule.ask()  # read after step 11 was dispatched: step 12 measures
    assert [schedule.next_call_measures() for _ in range(7)] == [
        True, False, False, False, False, True, False]  # 12, then 17 (not 15)


def test_a_call_takes_the_request_out_of_its_outputs_and_a_measuring_call_serves_it():
    calls = []

    def make():
        def program(request):
            calls.append(step_programs.is_measuring())
            return {"loss": 1.0, step_programs.REQUEST: request}
        return program

    # Steps 0-7 calibrate, then every 5th measures (10, ...).
    programs = step_programs.ScheduledPrograms(make, step_programs.Schedule(every=5))
    asks = {10, 16}
    for step in range(19):
        assert programs(float(step in asks)) == {"loss": 1.0}
    # Step 10 asks; step 11, dispatched before the host reads it, does not
    # measure, step 12 does, and the count restarts there (17, not 15).
    # Step 16 asks; step 17 measures anyway and serves it: 18 does not.
    assert calls[8:] == [False, False, True, False, True, False, False, False, False,
                         True, False]


def output_gradients(model, x, y, factor):
    """Per Dense layer of `mlp()`'s `model`, the |gradient| of the
    loss (the mean squared error times `factor`) at its output, by hand in
    float64 from its weights."""
    (w1, b1), (w2, b2), (w3, b3) = (
        [keras.ops.convert_to_numpy(v).astype("float64") for v in layer.weights]
        for layer in model.layers)
    h1 = np.maximum(x @ w1 + b1, 0.0)
    h2 = np.maximum(h1 @ w2 + b2, 0.0)
    g3 = 2.0 * (h2 @ w3 + b3 - y) / y.size * factor
    g2 = g3 @ w3.T
    g1 = (g2 * (h2 > 0)) @ w2.T
    names = [layer.name for layer in model.layers]
    return dict(zip(names, (np.abs(g) for g in (g1, g2, g3))))


def test_after_a_shrink_no_unit_underflows_past_the_next_measurement(float16_policy):
    """Sample weights of 2**-30 from step 40 (the loss times 2**-30): the
    layers' gradients underflow float16 at their scales until the next
    scheduled measurement (step 100), which sets every unit's scale at once."""
    shrink = 2.0**-30
    x, y = surge_data(factor=1.0)
    weights = np.where(np.arange(len(x)) < SURGE_AT * BATCH, 1.0, shrink).astype("float32")
    plain = mlp()
    model = tas.instrument(plain)  # shares `plain`'s weights
    model.compile(optimizer("per_layer"), "mse", jit_compile=True)
    underflowed = {}

    def check(epoch, logs):
        if epoch in (60, 102):
            batch = slice((epoch + 1) * BATCH, (epoch + 2) * BATCH)
            gradients = output_gradients(plain, x[batch], y[batch], shrink)
            scales = model.layer_scales()
            # float16 rounds what lies below half its smallest subnormal to 0.
            underflowed[epoch] = {name: float(np.mean(g[g > 0] * scales[name] < 2.0**-25))
                                  for name, g in gradients.items()}

    model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=103, steps_per_epoch=1,
              shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=check)])
    # Until then most of a layer's values underflow (none entirely: a plain
    # step cannot see them, and asks nothing); 2 steps after it, none do.
    assert max(underflowed[60].values()) > 0.5, underflowed
    assert max(underflowed[102].values()) == 0.0, underflowed
