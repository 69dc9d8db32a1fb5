"""ScaleMonitor: logs, TensorBoard, JSON lines and diagnosis, read back and
checked against independently computed gradients."""

import json
import re
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adaptive_scale as tas
from tf_adaptive_scale.monitor import callback as monitor_lib
from tf_adaptive_scale.numerics.float16 import NUM_BINS
from tf_adaptive_scale.step.measurement import LayerStatistics
from helpers import named_mlp, run_python


def data(n=64, inputs=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, inputs)).astype("float32")
    return x, (x[:, :1] * 0.5).astype("float32")


def fit(model, monitor, steps_per_execution=1, epochs=2, update_every=5, **opt_args):
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.01), update_every=update_every, **opt_args)
    model.compile(opt, "mse", jit_compile=True, steps_per_execution=steps_per_execution)
    x, y = data()
    return model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[monitor]), opt


def test_history_has_the_documented_keys_with_the_optimizer_values(float16_policy, tmp_path):
    model = named_mlp()
    monitor = tas.ScaleMonitor(every_n_steps=5, log_dir=str(tmp_path), verbose=0)
    history, opt = fit(model, monitor, clipnorm=1e-3)
    keys = history.history
    for key in ("scale/loss_scale", "scale/skipped_steps", "scale/skipped_since_last",
                "scale/grad_norm", "scale/clip_rate"):
        assert len(keys[key]) == 2, key
    for layer in ("hidden_0", "hidden_1", "head"):
        for metric in ("grad_norm", "scale", "underflow", "overflow"):
            assert f"layer/{layer}/{metric}" in keys
    assert keys["scale/loss_scale"][-1] == float(opt.loss_scale)
    assert keys["scale/skipped_steps"][-1] == int(opt.skipped_steps)
    assert keys["scale/grad_norm"][-1] == pytest.approx(float(opt.gradient_norm))
    assert keys["scale/clip_rate"][-1] == pytest.approx(1.0)  # clipnorm 1e-3 always acts
    # Per-layer norms add up (in squares) to the optimizer's global norm.
    total = sum(keys[f"layer/{n}/grad_norm"][-1] ** 2 for n in ("hidden_0", "hidden_1", "head"))
    assert math.sqrt(total) == pytest.approx(float(opt.gradient_norm), rel=1e-5)


def test_layer_norms_equal_an_independent_float32_gradient():
    """Custom loop, float32: the monitor's per-layer norms are those of the
    gradients a separate tape computes."""
    model = named_mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), scaling="none")
    x, y = data()
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
    grads = tape.gradient(loss, variables)
    opt.apply(grads, variables)
    monitor = tas.ScaleMonitor(optimizer=opt, verbose=0)
    record = monitor.log(1)
    for layer in ("hidden_0", "hidden_1", "head"):
        expected = math.sqrt(sum(
            float(np.sum(np.square(g.numpy()))) for g, v in zip(grads, variables)
            if v.path.startswith(layer + "/")))
        assert record["layers"][layer]["grad_norm"] == pytest.approx(expected, rel=1e-5)
        assert "underflow" not in record["layers"][layer]  # no float16 scaling
    hist = np.asarray(record["layers"]["head"]["histogram"])
    head = [g.numpy() for g, v in zip(grads, variables) if v.path.startswith("head/")]
    values = np.abs(np.concatenate([g.ravel() for g in head]))
    values = values[values > 0]
    expected = np.bincount(np.floor(np.log2(values)).astype(int) - monitor_lib.stats.EXPONENT_MIN,
                           minlength=hist.size)
    np.testing.assert_array_equal(hist, expected)


def test_tensorboard_events_hold_the_recorded_values(float16_policy, tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    model = named_mlp()
    monitor = tas.ScaleMonitor(every_n_steps=4, log_dir=str(tmp_path), verbose=0)
    fit(model, monitor)
    events = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    tags = events.Tags()["tensors"]
    record = monitor.records[-1]
    # The scale at each report; the measured figures at their step, every
    # `update_every`=5 steps of the 16.
    assert [e.step for e in events.Tensors("scale/loss_scale")] == [
        r["step"] for r in monitor.records]
    for layer in ("hidden_0", "head"):
        scalar = events.Tensors(f"layer/{layer}/grad_norm")
        assert [e.step for e in scalar] == [0, 5, 10, 15]
        assert float(tf.make_ndarray(scalar[-1].tensor_proto)) == pytest.approx(
            record["layers"][layer]["grad_norm"], rel=1e-6)
        tag = f"layer/{layer}/exponents"
        assert tag in tags
        assert events.SummaryMetadata(tag).plugin_data.plugin_name == "histograms"
        buckets = tf.make_ndarray(events.Tensors(tag)[-1].tensor_proto)
        np.testing.assert_array_equal(buckets[:, 2], record["layers"][layer]["histogram"])
        assert buckets[0, 0] == monitor_lib.stats.EXPONENT_MIN
    lines = (tmp_path / monitor_lib.JSON_LINES_FILE).read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert [p["step"] for p in parsed] == [r["step"] for r in monitor.records]
    assert parsed[-1]["layers"]["head"]["grad_norm"] == record["layers"]["head"]["grad_norm"]


def test_steps_per_execution_reports_on_schedule(float16_policy):
    model = named_mlp()
    monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
    history, opt = fit(model, monitor, steps_per_execution=4, epochs=2)
    # 8 steps an epoch, executions of 4: reports every 4 steps, 16 in all.
    assert [r["step"] for r in monitor.records] == [4, 8, 12, 16]
    assert int(opt.total_steps) == 16
    assert "scale/loss_scale" in history.history


def test_statistics_are_computed_only_on_measured_steps(float16_policy):
    """Counted, not timed: the per-variable statistics run once per measured
    step however often the monitor reads them."""
    model = named_mlp()
    monitor = tas.ScaleMonitor(every_n_steps=1, verbose=0)
    _, opt = fit(model, monitor, epochs=4, update_every=10)  # 32 steps
    assert int(opt.measurements) == 4  # steps 0, 10, 20, 30
    assert int(opt.measured_step) == 30
    assert len(monitor.records) == 32
    assert {r["measured_step"] for r in monitor.records} == {0, 10, 20, 30}


def test_per_layer_mode_reports_each_unit_scale(float16_policy):
    model = tas.instrument(named_mlp())
    monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), scaling="per_layer",
                                         update_every=4)
    model.compile(opt, "mse", jit_compile=True)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    scales = opt.layer_scales()
    record = monitor.records[-1]
    for layer in ("hidden_0", "hidden_1", "head"):
        assert record["layers"][layer]["scale"] == scales[layer]
        assert record["layers"][layer]["grad_norm"] > 0


def deep_sigmoid(depth=14):
    return named_mlp(inputs=8, width=8, depth=depth, activation="sigmoid", prefix="sig", seed=0)


def test_vanishing_gradients_are_flagged_at_the_early_layers(float16_policy):
    monitor = tas.ScaleMonitor(every_n_steps=2, verbose=0)
    with pytest.warns(RuntimeWarning, match="vanishing|below"):
        fit(deep_sigmoid(), monitor, epochs=2, update_every=2)
    vanishing = {f["layer"] for f in monitor.flags if f["kind"] == "vanishing"}
    assert "sig_0" in vanishing and "head" not in vanishing
    assert "sig_0" in monitor.summary()


def test_a_healthy_run_warns_nothing(float16_policy):
    monitor = tas.ScaleMonitor(every_n_steps=2, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(named_mlp(), monitor, epochs=4, update_every=2)
    assert monitor.flags == []
    assert "No layer flagged" in monitor.summary()


def test_exploding_gradient_is_flagged_naming_the_layer():
    model = named_mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3), update_every=1)
    monitor = tas.ScaleMonitor(optimizer=opt, verbose=0)
    x, y = data()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for i in range(8):
        step(x, y)
        monitor.log(i + 1)
    assert monitor.flags == []
    with pytest.warns(RuntimeWarning, match="hidden_0"):
        step(x * 1e4, y)  # a wild batch: the first layer's gradient jumps
        monitor.log(9)
    exploding = [f for f in monitor.flags if f["kind"] == "exploding"]
    assert exploding and exploding[0]["layer"] == "hidden_0" and exploding[0]["step"] == 9


def test_layers_that_never_update_and_skipped_runs_are_flagged():
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    dead = keras.layers.Dense(4, name="dead")(x)
    out = keras.layers.Dense(1, name="head")(x + 0.0 * keras.ops.sum(dead, axis=-1, keepdims=True))
    model = keras.Model(x, out)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3), update_every=1)
    monitor = tas.ScaleMonitor(optimizer=opt, verbose=0, skipped_run=3)
    xs, ys = data()
    variables = model.trainable_variables
    for i in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(ys, model(xs)))
        opt.apply(tape.gradient(loss, variables), variables)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monitor.log(i + 1)
    assert [f["layer"] for f in monitor.flags if f["kind"] == "never_updates"] == ["dead"]
    for i in range(3):
        opt.apply([tf.fill(v.shape, np.nan) for v in variables], variables)
    with pytest.warns(RuntimeWarning, match="3 steps skipped"):
        monitor.log(7)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="every_n_steps"):
        tas.ScaleMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="vanishing_ratio"):
        tas.ScaleMonitor(vanishing_ratio=-1)
    with pytest.raises(ValueError, match="window_underflow"):
        tas.ScaleMonitor(window_underflow=1.5)
    with pytest.raises(ValueError, match="AdaptiveLossScaleOptimizer"):
        tas.ScaleMonitor(optimizer=keras.optimizers.SGD())  # at once, not at `log`


def test_config_round_trips():
    monitor = tas.ScaleMonitor(every_n_steps=7, log_dir="x", patience=2, exploding_zscore=4.0,
                               window_underflow=0.01)
    clone = tas.ScaleMonitor.from_config(monitor.get_config())
    assert clone.get_config() == monitor.get_config()


def test_bfloat16_reports_norms_without_float16_fractions():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = named_mlp()
        monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
        history, opt = fit(model, monitor, epochs=1, update_every=4)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert opt.scaling == "none"
    layers = monitor.records[-1]["layers"]
    assert all(e["grad_norm"] > 0 and "underflow" not in e for e in layers.values())
    assert "layer/head/grad_norm" in history.history
    assert "layer/head/underflow" not in history.history


@pytest.mark.slow  # starts a child process
def test_monitor_writes_tensorboard_logs_without_the_tensorboard_package(tmp_path):
    # The demo's extra does not install tensorboard; tf.summary.scalar
    # needs it, the monitor's own writer does not.
    script = f"""
import sys
sys.modules["tensorboard"] = None  # as if not installed
import numpy as np, keras
import tf_adaptive_scale as tas
keras.mixed_precision.set_global_policy("mixed_float16")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0,
          callbacks=[tas.ScaleMonitor(every_n_steps=1, log_dir={str(tmp_path)!r}, verbose=0)])
"""
    run_python("-c", script)
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


class KillIn(keras.callbacks.Callback):
    """Stops training with an error at `batch` of `epoch`, as a crash."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("killed")


def test_kill_and_resume_keeps_every_record_with_continuous_steps(float16_policy, tmp_path):
    """`BackupAndRestore` + the monitor, killed in epoch 3 and run again (the
    usual resume): the first run's records stay, and the resumed run numbers
    its own from the restored optimizer's step on, in the JSON lines and in
    TensorBoard (read back with its reader)."""
    from tensorboard.backend.event_processing import event_accumulator

    log_dir = str(tmp_path / "logs")
    x, y = data()

    def run(*callbacks):
        model = named_mlp()
        opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2)
        model.compile(opt, "mse", jit_compile=False)
        monitor = tas.ScaleMonitor(every_n_steps=4, log_dir=log_dir, verbose=0)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False,
                  callbacks=[backup, monitor, *callbacks])
        return monitor, opt

    with pytest.raises(RuntimeError, match="killed"):
        run(KillIn(epoch=2, batch=3))  # 8 steps an epoch: killed after step 20
    with open(f"{log_dir}/{monitor_lib.JSON_LINES_FILE}") as f:
        first = [json.loads(line) for line in f]
    assert [r["step"] for r in first] == [4, 8, 12, 16, 20]
    monitor, opt = run()
    with open(f"{log_dir}/{monitor_lib.JSON_LINES_FILE}") as f:
        every = [json.loads(line) for line in f]
    assert every[: len(first)] == first  # nothing truncated
    # Restored at the end of epoch 2 (step 16): the resumed run goes on from there.
    assert [r["step"] for r in every[len(first):]] == [20, 24, 28, 32]
    assert [r["step"] for r in monitor.records] == [20, 24, 28, 32]
    assert int(opt.total_steps) == 32
    events = event_accumulator.EventAccumulator(
        log_dir, size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    # TensorBoard holds every record too: step 20, done by the killed run
    # after its last backup, was done again by the resumed one.
    steps = [e.step for e in events.Tensors("scale/loss_scale")]
    assert steps == [r["step"] for r in every] == [4, 8, 12, 16, 20, 20, 24, 28, 32]


def test_clip_rate_is_per_optimizer_step_under_accumulation(float16_policy):
    """With `accumulation_steps=2` a run clipped on every optimizer step
    reports a clip rate of 1, clipped steps over optimizer steps."""
    model = named_mlp()
    monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
    history, opt = fit(model, monitor, clipnorm=1e-6, accumulation_steps=2)
    assert int(opt.total_steps) == 8 and int(opt.clipped_steps) == 8  # 16 batches
    assert history.history["scale/clip_rate"] == [1.0, 1.0]
    assert [r["step"] for r in monitor.records] == [2, 4, 6, 8]


def test_bad_arguments_and_a_stock_optimizer_fail_before_the_first_batch(tmp_path):
    a_file = tmp_path / "not_a_directory"
    a_file.write_text("")
    with pytest.raises(ValueError, match="`log_dir` must be a directory"):
        tas.ScaleMonitor(log_dir=str(a_file))
    with pytest.raises(TypeError, match="`json_lines` must be a bool"):
        tas.ScaleMonitor(json_lines="no")
    with pytest.raises(ValueError, match="`optimizer` is Adam"):
        tas.ScaleMonitor(optimizer=keras.optimizers.Adam())
    model = named_mlp()
    stock = keras.optimizers.Adam()
    model.compile(stock, "mse")
    seen = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(b))
    x, y = data()
    with pytest.raises(ValueError, match="the model's optimizer is Adam"):
        model.fit(x, y, verbose=0, callbacks=[tas.ScaleMonitor(every_n_steps=1000), probe])
    assert seen == [] and int(stock.iterations) == 0


def test_reports_carry_the_mean_loss_since_the_last_report_and_the_mode(tmp_path):
    """Keras's `loss` is a running mean over the epoch (it jumps at every
    epoch); each record also holds the mean loss of its own batches, here
    against the batch losses evaluated one by one (SGD(0): fixed weights)."""
    model = named_mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), "dynamic")
    model.compile(opt, "mse")
    x, y = data()
    monitor = tas.ScaleMonitor(every_n_steps=3, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    batch = [float(model.evaluate(x[i:i + 8], y[i:i + 8], verbose=0)) for i in range(0, 64, 8)]
    # 8 batches an epoch, a report every 3 and at each epoch's end.
    expected = [np.mean(batch[0:3]), np.mean(batch[3:6]), np.mean(batch[6:8])] * 2
    got = [r["interval_loss"] for r in monitor.records]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert [r["step"] for r in monitor.records] == [3, 6, 8, 11, 14, 16]
    assert {r["scaling"] for r in monitor.records} == {"dynamic"}


def overflowing_middle_layer(nested=False):
    """A float16 model whose middle layer's output overflows (8 inputs of
    about 10 times 1e3 each: 8e4 > 65504); the layers before it are finite,
    the ones after it and the loss are not."""
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, kernel_initializer="ones", name="first")(inputs)
    block = keras.Sequential([
        keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(1e3),
                           name="blows_up"),
        keras.layers.Dense(8, name="after"),
    ], name="block")
    h = block(h) if nested else block.layers[1](block.layers[0](h))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    x = np.full((16, 4), 2.5, "float32")
    return model, x, np.zeros((16, 1), "float32")


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_non_finite_loss_names_the_layer_whose_float16_output_overflows(nested, float16_policy):
    keras.mixed_precision.set_global_policy("float32")
    model, x, y = overflowing_middle_layer(nested)
    assert tas.first_non_finite_layer(model, x) is None  # float32 holds 8e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, x, y = overflowing_middle_layer(nested)
    name = "block/blows_up" if nested else "blows_up"
    assert not np.all(np.isfinite(np.asarray(model(x))))
    assert tas.first_non_finite_layer(model, x) == (name, "float16")
    monitor = tas.ScaleMonitor(every_n_steps=1, probe=x[:4], verbose=0)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()), "mse")
    with pytest.warns(RuntimeWarning, match=f"layer '{name}': its float16 output is not finite"):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)
    assert [(f["layer"], f["kind"]) for f in monitor.flags] == [(name, "forward_overflow")]
    assert monitor.records[-1]["loss_finite"] is False
    assert "bfloat16" in monitor.summary()


def test_finite_forward_pass_names_no_layer_and_bad_data_says_so(float16_policy):
    model = named_mlp()
    xs, ys = data()
    assert tas.first_non_finite_layer(model, xs) is None
    monitor = tas.ScaleMonitor(every_n_steps=1, probe=xs[:4], verbose=0)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()), "mse")
    ys = ys.copy()
    ys[:8] = np.nan  # the first batch's labels: bad data, not the model
    with pytest.warns(RuntimeWarning, match="the loss was not finite and the probe"):
        model.fit(xs, ys, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)
    assert [(f["layer"], f["kind"]) for f in monitor.flags] == [("(all)", "loss_not_finite")]


def two_heads(quiet_weight, loud_weight, instrument=False):
    """A trunk and two heads whose loss weights set their gradients
    `loud_weight / quiet_weight` apart; compiled, with its data."""
    keras.utils.set_random_seed(0)
    x = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="trunk")(x)
    heads = {n: keras.layers.Activation("linear", dtype="float32", name=n)(
        keras.layers.Dense(64, name=f"{n}_head")(h)) for n in ("quiet", "loud")}
    model = keras.Model(x, heads)
    if instrument:
        model = tas.instrument(model)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3), update_every=1),
                  {"quiet": "mse", "loud": "mse"},
                  loss_weights={"quiet": quiet_weight, "loud": loud_weight}, jit_compile=True)
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((64, 16)).astype("float32"), {
        n: rng.standard_normal((64, 64)).astype("float32") for n in ("quiet", "loud")}


def fit_two_heads(instrument):
    model, x, y = two_heads(2.0**-22, 2.0**8, instrument)
    monitor = tas.ScaleMonitor(every_n_steps=2, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[monitor])
    return monitor


def test_no_single_scale_is_flagged_naming_both_layers_and_gone_once_instrumented(
        float16_policy):
    """Heads 2**30 apart: at the global scale the loud head's overflow caps,
    the quiet head loses part of its gradient to zero. Per layer, each head
    measures its whole gradient at its own scale: the window read there,
    from an exact histogram, is the reference for the global run's estimate."""
    monitor = fit_two_heads(instrument=False)
    [flag] = [f for f in monitor.flags if f["kind"] == "no_single_scale"]
    assert "'quiet_head' needs 2**" in flag["message"]
    assert re.search(r"'loud_head'( and '\w+')? overflows? above 2\*\*", flag["message"])
    assert "tas.instrument(model)" in flag["message"] and "no single scale" in monitor.summary()
    estimated = monitor.records[-1]["layers"]
    assert estimated["quiet_head"]["zeros"] > 0 and estimated["quiet_head"]["window"][2]

    per_layer = fit_two_heads(instrument=True)
    assert not [f for f in per_layer.flags if f["kind"] in ("no_single_scale", "beyond_float16")]
    exact = per_layer.records[-1]["layers"]
    assert exact["quiet_head"]["zeros"] == 0 and not exact["quiet_head"]["window"][2]
    # The estimate errs low, within a binade of the exact window here.
    assert 0 <= exact["quiet_head"]["window"][0] - estimated["quiet_head"]["window"][0] <= 1
    assert exact["quiet_head"]["window"][0] > estimated["loud_head"]["window"][1]
    assert abs(exact["loud_head"]["window"][1] - estimated["loud_head"]["window"][1]) <= 1


def test_a_layer_beyond_float16_is_named(float16_policy):
    """A layer whose own gradient values span more than float16's 40
    binades at the tolerated underflow: no scale of its own fits it."""
    histogram = np.zeros(NUM_BINS)
    histogram[[0, 60, 127]] = 1.0  # exponents -88, -28 and 39
    layer = LayerStatistics(0.0, 1.0, histogram, 0.0)
    low, high, extrapolated = monitor_lib.scale_window(layer, 1e-3)
    assert (low, high, extrapolated) == (-24 + 88, 14 - 39, False)
    assert monitor_lib.scale_window(layer._replace(histogram=histogram * 0), 1e-3) is None


def embedding_gradient_errors(dtype, tokens, log2_scales=(0, 8, 16)):
    """The relative error, against float64, of an 8-row embedding table's
    gradient over `tokens` tokens, at each loss scale."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 8, tokens).astype("int32")
    upstream = rng.standard_normal((tokens, 16))
    reference = np.zeros((8, 16))
    np.add.at(reference, ids, upstream / tokens)
    errors = []
    for log2_scale in log2_scales:
        table = keras.layers.Embedding(8, 16, dtype=dtype)
        table.build((None,))
        with tf.GradientTape() as tape:
            out = tf.cast(table(ids), "float32")
            loss = tf.reduce_sum(out * upstream.astype("float32")) / tokens * 2.0**log2_scale
        grad = tf.convert_to_tensor(tape.gradient(loss, table.embeddings))
        grad = np.asarray(grad, np.float64) / 2.0**log2_scale
        errors.append(np.linalg.norm(grad - reference) / np.linalg.norm(reference))
    return np.array(errors)


def test_half_precision_weights_are_flagged_as_precision_limited(float16_policy):
    """The check reads the weights' dtype; measured against float64 here:
    a float16 table's gradient loses more as tokens grow, the same at every
    scale, where float32 weights (the mixed policy's) lose float16's
    rounding of the upstream gradient only."""
    half = [embedding_gradient_errors("float16", n) for n in (2**10, 2**14)]
    for errors in half:
        assert errors.max() < 1.2 * errors.min()  # no scale helps
    assert half[1].min() > 3 * half[0].max() and half[1].min() > 4e-3
    assert embedding_gradient_errors("mixed_float16", 2**14)[1:].max() < 5e-4

    x = keras.Input((32,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(8, 16, dtype="float16", name="table")(x))
    model = keras.Model(x, keras.layers.Dense(1, dtype="float32", name="head")(h))
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-2), update_every=1),
                  "mse")
    monitor = tas.ScaleMonitor(every_n_steps=2, verbose=0)
    rng = np.random.default_rng(0)
    with pytest.warns(RuntimeWarning, match="layer 'table': its weights are float16"):
        model.fit(rng.integers(0, 8, (32, 32)).astype("int32"),
                  rng.standard_normal((32, 1)).astype("float32"),
                  batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    assert [(f["layer"], f["kind"]) for f in monitor.flags] == [("table", "precision_limited")]


def test_the_forward_search_runs_once_per_run_of_non_finite_losses(float16_policy, monkeypatch):
    """Every batch's labels are NaN: every report sees a non-finite loss,
    and the probe's eager search runs at the first only."""
    searched = []
    search = monitor_lib.forward_check.first_non_finite_layer
    monkeypatch.setattr(monitor_lib.forward_check, "first_non_finite_layer",
                        lambda model, x: searched.append(1) or search(model, x))
    model = named_mlp()
    xs, ys = data()
    monitor = tas.ScaleMonitor(every_n_steps=1, probe=xs[:4], verbose=0)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(),
                                                 max_consecutive_skips=None), "mse")
    with pytest.warns(RuntimeWarning, match="the loss was not finite and the probe"):
        model.fit(xs, np.full_like(ys, np.nan), batch_size=8, epochs=1, callbacks=[monitor],
                  verbose=0)
    assert len(monitor.records) == 8 and not any(r["loss_finite"] for r in monitor.records)
    assert len(searched) == 1


# One name per layer (docs/monitor.md, "Layer names").


def dead_first_layer_sequential():
    """A Sequential `dense` (16, relu) -> `dense_1` (1) whose first layer is
    dead (zero kernel, bias -1: its ReLU output and gradient always 0)."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    kernel, bias = model.layers[0].get_weights()
    model.layers[0].set_weights([np.zeros_like(kernel), np.full_like(bias, -1.0)])
    return model


def test_sequential_snippet_keys_are_the_names_layer_scales_and_flags_use(float16_policy):
    """The README's monitor snippet on a Sequential model: Keras's variable
    paths carry the model's scope (`sequential/dense/kernel`), the monitor's
    keys, `gradient_scales()`, `layer_scales()` (per layer) and the flags
    do not (`dense`)."""
    keras.backend.clear_session()  # fresh automatic names: dense, dense_1
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = dead_first_layer_sequential()
    assert [layer.name for layer in model.layers] == ["dense", "dense_1"]
    assert model.layers[0].kernel.path == "sequential/dense/kernel"
    x, y = data()
    runs = {}
    for mode in ("adaptive", "per_layer"):
        trained = tas.instrument(model) if mode == "per_layer" else model
        opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), scaling=mode,
                                             update_every=1)
        trained.compile(opt, "mse", jit_compile=True)
        monitor = tas.ScaleMonitor(every_n_steps=2, patience=2, verbose=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            history = trained.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
        runs[mode] = history, opt, monitor
    for mode, (history, opt, monitor) in runs.items():
        assert "layer/dense/grad_norm" in history.history, mode
        assert "layer/dense_1/grad_norm" in history.history, mode
        assert not any("sequential" in key for key in history.history), mode
        assert set(monitor.records[-1]["layers"]) == {"dense", "dense_1"}, mode
        assert {s[0] for s in opt.gradient_scales() if s is not None} == {"dense", "dense_1"}
        never = [f["layer"] for f in monitor.flags if f["kind"] == "never_updates"]
        assert never == ["dense"], (mode, monitor.flags)
    assert set(runs["per_layer"][1].layer_scales()) == {"dense", "dense_1"}
    # A custom loop's optimizer, never shown the model, names them alike
    # from the variables' paths.
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), update_every=1)
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
    opt.apply(tape.gradient(loss, variables), variables)
    assert [s[0] for s in opt.gradient_scales()] == ["dense"] * 2 + ["dense_1"] * 2


class _Net(keras.Model):
    """A subclassed model of two Dense layers `a`, `b`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(16, activation="relu", name="a")
        self.b = keras.layers.Dense(1, name="b")

    def call(self, x):
        return self.b(self.a(x))


def named_models():
    """`{kind: (model, Keras's path of `a`'s kernel, expected names)}`."""
    def block(functional):
        if functional:
            inputs = keras.Input((16,))
            out = keras.layers.Dense(1, name="d")(keras.layers.Dense(16, name="c")(inputs))
            return keras.Model(inputs, out, name="block")
        return keras.Sequential(
            [keras.layers.Dense(16, name="c"), keras.layers.Dense(1, name="d")], name="block")

    def functional(nested=None):
        x = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu", name="a")(x)
        out = keras.layers.Dense(1, name="b")(h) if nested is None else block(nested)(h)
        return keras.Model(x, out, name="outer")

    subclassed = _Net(name="net")
    subclassed(np.zeros((1, 8), "float32"))
    flat, nested = {"a", "b"}, {"a", "block/c", "block/d"}
    return {
        "functional": (functional(), "a/kernel", flat),
        "nested_sequential": (functional(nested=False), "a/kernel", nested),
        "nested_functional": (functional(nested=True), "a/kernel", nested),
        "sequential_in_sequential": (keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="a"),
             block(functional=False)], name="outer"), "outer/a/kernel", nested),
        "subclassed": (subclassed, "net/a/kernel", flat),
    }


@pytest.mark.parametrize("kind", ["functional", "nested_sequential", "nested_functional",
                                  "sequential_in_sequential", "subclassed"])
def test_layers_are_named_by_their_path_in_the_model_whatever_keras_paths_say(kind):
    """Keras's variable paths differ by how the model was built (Sequential
    and subclassed models put their own scope first; a nested Functional
    model's layers carry none); the monitor's names are the layers' paths
    in the model as built, in both modes."""
    model, path, names = named_models()[kind]
    assert model.get_layer("a").kernel.path == path  # what Keras gives
    monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
    history, opt = fit(model, monitor, epochs=1, update_every=4)
    assert set(monitor.records[-1]["layers"]) == names
    assert {s[0] for s in opt.gradient_scales()} == names
    assert {k.split("/grad_norm")[0][len("layer/"):] for k in history.history
            if k.endswith("/grad_norm") and k.startswith("layer/")} == names
    if kind.startswith("nested"):  # per layer: the nested model inlined, its units alike
        instrumented = tas.instrument(model)
        monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
        fit(instrumented, monitor, epochs=1, update_every=4, scaling="per_layer")
        assert set(instrumented.layer_scales()) == names
        assert set(monitor.records[-1]["layers"]) == names


# The progress bar.


def progress_widths(capsys, model, monitor_args):
    """The visible width of every progress-bar line of a 2-epoch `fit`
    (verbose=1: Keras redraws the line after backspaces and a carriage
    return, or prints a line per update; colour codes and the padding of a
    shorter redraw are not counted), with a monitor unless `monitor_args`
    is None."""
    callbacks = [] if monitor_args is None else [tas.ScaleMonitor(verbose=0, **monitor_args)]
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=2),
                  "mse", jit_compile=True)
    x, y = data()
    capsys.readouterr()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=1, callbacks=callbacks)
    out = re.sub(r"\x1b\[[0-9;]*m|\x08", "", capsys.readouterr().out)  # colours, backspaces
    lines = [line.rstrip() for line in re.split(r"[\r\n]", out) if "/step" in line]
    assert lines
    return [len(line) for line in lines], history


def test_the_progress_bar_stays_one_short_line_for_a_twenty_layer_model(float16_policy, capsys):
    """Keras prints every key of `logs` on the bar: the monitor puts two
    there; the per-layer keys reach `History` all the same."""
    def model():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(8, activation="relu", name=f"l{i}") for i in range(19)]
        return keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(1, name="l19")])

    plain, _ = progress_widths(capsys, model(), None)
    monitored, history = progress_widths(capsys, model(), {"every_n_steps": 2})
    flood, _ = progress_widths(capsys, model(), {"every_n_steps": 2, "per_layer_logs": True})
    print(f"progress line widths: plain {max(plain)}, monitored {max(monitored)}, "
          f"per_layer_logs=True {max(flood)}")
    assert max(monitored) <= min(max(plain) + 80, 160), (plain, monitored)
    assert max(flood) > 20 * 100  # every layer's keys, as before
    for i in range(20):
        for field in ("grad_norm", "scale", "zeros", "zero_fraction", "underflow", "overflow"):
            assert len(history.history[f"layer/l{i}/{field}"]) == 2
    assert len(history.history["scale/grad_norm"]) == 2


# Underflow and exact zeros, apart.


def dead_units_model(dead=6):
    """Functional `hidden` (16, relu) -> `head` (4) whose first `dead` hidden
    units are dead (zero weights, bias -1: output and gradient always 0)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")
    model = keras.Model(x, keras.layers.Dense(4, name="head")(hidden(x)))
    kernel, bias = (np.array(w) for w in hidden.get_weights())
    kernel[:, :dead], bias[:dead] = 0.0, -1.0
    hidden.set_weights([kernel, bias])
    return model


def float64_gradients(model, x, y):
    """`{layer: its gradient values}` of the mean squared error, in float64,
    by hand."""
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in model.get_weights())
    x = np.asarray(x, np.float64)
    before = x @ w1 + b1
    hidden = np.maximum(before, 0.0)
    d_out = 2.0 * (hidden @ w2 + b2 - y) / y.size
    d_hidden = (d_out @ w2.T) * (before > 0)
    return {"hidden": np.concatenate([(x.T @ d_hidden).ravel(), d_hidden.sum(0)]),
            "head": np.concatenate([(hidden.T @ d_out).ravel(), d_out.sum(0)])}


def test_underflow_and_exact_zeros_are_reported_apart():
    """Dead units' exact zeros go to `zero_fraction`; `underflow` counts
    only nonzero values below float16's smallest subnormal (2**-24) at the
    scale used. float32 gradients at a static scale 2**4 (what float16
    would lose there), against float64 gradients computed by hand."""
    model = dead_units_model()
    rng = np.random.default_rng(0)
    # Inputs spanning 2**0 to 2**-28: part of the first layer's gradient
    # falls below 2**-24 / 2**4.
    x = (rng.standard_normal((64, 8)) * 2.0 ** (-4.0 * np.arange(8))).astype("float32")
    y = rng.standard_normal((64, 4)).astype("float32")
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), scaling="static",
                                         initial_scale=2.0**4, update_every=1)
    model.compile(opt, "mse")
    monitor = tas.ScaleMonitor(verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[monitor])
    record = monitor.records[-1]
    reference = float64_gradients(model, x, y)
    values = zeros = lost = 0
    for name, g in reference.items():
        nonzero = g[g != 0]
        below = np.sum(np.abs(nonzero) * 2.0**4 < 2.0**-24)
        layer = record["layers"][name]
        assert layer["zeros"] == np.sum(g == 0)
        assert layer["zero_fraction"] == pytest.approx(np.mean(g == 0))
        assert layer["underflow"] == pytest.approx(below / nonzero.size, abs=1.5 / nonzero.size)
        assert history.history[f"layer/{name}/zero_fraction"] == [layer["zero_fraction"]]
        values, zeros, lost = values + g.size, zeros + np.sum(g == 0), lost + below
    # The setup: dead units' zeros, and some nonzero values underflow.
    assert record["layers"]["hidden"]["zero_fraction"] == pytest.approx(6 / 16)
    assert 0.05 < record["layers"]["hidden"]["underflow"] < 0.5
    assert record["zero_fraction"] == pytest.approx(zeros / values)
    assert record["underflow"] == pytest.approx(lost / (values - zeros), abs=1.5 / values)
    # The optimizer's `underflow_fraction` counts the zeros as underflowed.
    assert float(opt.underflow_fraction) == pytest.approx((zeros + lost) / values, abs=2 / values)


def test_a_healthy_float16_model_with_dead_units_shows_zeros_not_underflow(float16_policy):
    """mixed_float16, adaptive scale: the dead units make many of the
    values zero (about half); nothing underflows. `underflow_fraction`, which
    counts them as underflowed, says about half too."""
    model = dead_units_model(dead=8)
    x, _ = data()
    y = np.random.default_rng(1).standard_normal((64, 4)).astype("float32")
    monitor = tas.ScaleMonitor(every_n_steps=8, verbose=0)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), update_every=1),
                  "mse", jit_compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[monitor])
    record = monitor.records[-1]
    reference = float64_gradients(model, x, y)
    expected = sum(np.sum(g == 0) for g in reference.values()) / sum(
        g.size for g in reference.values())
    assert expected > 0.2  # the dead units' zeros
    assert record["zero_fraction"] == pytest.approx(expected, abs=0.02)
    assert record["underflow"] < 0.002
    assert float(monitor.optimizer.underflow_fraction) > 0.2  # zeros counted there


# The measured figures, at the step they were measured (the optimizer
# measures every `update_every` steps; the monitor reports more often).


class MeasuredSteps(keras.callbacks.Callback):
    """Reads the optimizer after every batch, apart from the monitor: the
    steps it measured, with the global gradient norm each gave."""

    def __init__(self, optimizer):
        super().__init__()
        self.opt = optimizer
        self.measured = []  # (measured step, gradient norm)

    def on_train_batch_end(self, batch, logs=None):
        if int(self.opt.measurements) > len(self.measured):
            self.measured.append((int(self.opt.measured_step), float(self.opt.gradient_norm)))


def small_cnn(steps):
    """A 4-layer CNN (8x8 images), 4 images a batch for `steps` batches."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv2"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(2, dtype="float32", name="head"),
    ])
    rng = np.random.default_rng(0)
    return (model, rng.standard_normal((4 * steps, 8, 8, 1)).astype("float32"),
            rng.standard_normal((4 * steps, 2)).astype("float32"))


def stale_warnings(caught):
    return [str(w.message) for w in caught if "no new gradient measurement" in str(w.message)]


def assert_history_holds_only_what_each_epoch_measured(history, measured, epoch_steps, keys):
    """Each epoch's measured figures are finite where the epoch measured a
    step (the global norm: its last one's), NaN where it did not."""
    for epoch, value in enumerate(history["scale/grad_norm"]):
        steps = range(epoch * epoch_steps, (epoch + 1) * epoch_steps)
        norms = [norm for step, norm in measured if step in steps]
        if norms:
            assert value == pytest.approx(norms[-1], rel=1e-6), epoch
        else:
            assert np.isnan(value), epoch
        for key in keys:
            assert np.isfinite(history[key][epoch]) == bool(norms), (key, epoch)


def test_the_issue_run_shows_no_figure_under_a_step_it_was_not_measured_at(
        float16_policy, tmp_path):
    """The issue's run: 78 steps (3 epochs of 26) of a small CNN, a report
    every 10 steps, the optimizer measuring every 100 (its default): one
    measurement, at step 0. History, the JSON lines, TensorBoard, the
    summary and the pictures' titles show its figures at step 0 only, and
    the monitor says once why the reports in between have none."""
    from matplotlib.figure import Figure
    from tensorboard.backend.event_processing import event_accumulator

    from tf_adaptive_scale import report

    model, x, y = small_cnn(26)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(opt, "mse", jit_compile=True)
    monitor = tas.ScaleMonitor(every_n_steps=10, log_dir=str(tmp_path), verbose=0)
    reads = MeasuredSteps(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=4, epochs=3, verbose=0,
                            callbacks=[monitor, reads]).history
    assert int(opt.total_steps) == 78 and opt.update_every == 100
    measured = reads.measured
    assert [step for step, _ in measured] == [0]

    # History: epoch 1 holds step 0's figures, epochs 2 and 3 none; what
    # is read at the report (the scales, the counts) every epoch.
    layer_keys = [f"layer/{name}/{field}" for name in ("conv1", "conv2", "head")
                  for field in ("grad_norm", "zeros", "zero_fraction", "underflow", "overflow")]
    assert_history_holds_only_what_each_epoch_measured(
        history, measured, 26, ["scale/underflow", "scale/zero_fraction", *layer_keys])
    assert history["scale/measured_step"] == [0, 0, 0]
    for key in ("scale/loss_scale", "layer/conv1/scale", "scale/clip_rate"):
        assert np.isfinite(history[key]).all(), key

    # The JSON lines: each report tells its measured step, and only the
    # first after a measurement calls its figures new.
    reported = [r["step"] for r in monitor.records]
    assert reported == [10, 20, 26, 36, 46, 52, 62, 72, 78]
    assert [r["measured_step"] for r in monitor.records] == [0] * 9
    before = [0] + reported[:-1]
    assert [r["new_measurement"] for r in monitor.records] == [
        any(start <= step < end for step, _ in measured) for start, end in zip(before, reported)]
    lines = (tmp_path / monitor_lib.JSON_LINES_FILE).read_text().splitlines()
    assert [json.loads(line)["new_measurement"] for line in lines] == [True] + [False] * 8

    # TensorBoard: the scale at every report, the measured figures once, at step 0.
    events = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    assert [e.step for e in events.Tensors("scale/loss_scale")] == reported
    for tag in ("scale/grad_norm", "layer/conv1/grad_norm", "layer/conv1/exponents"):
        assert [e.step for e in events.Tensors(tag)] == [0], tag
    assert float(tf.make_ndarray(events.Tensors("scale/grad_norm")[0].tensor_proto)) == (
        pytest.approx(measured[0][1], rel=1e-6))

    # The summary quotes the norm with its step.
    summary = monitor.summary()
    assert summary.count("gradient norm") == 1
    assert re.findall(r"gradient norm ([^,]+), measured at step (\d+)", summary) == [
        (f"{measured[0][1]:.3g}", "0")]

    # The pictures: the gradient norms one column, titled by its step; the
    # histograms the step they show.
    run = report._load(tmp_path)
    fig = Figure()
    report._draw_gradient_norms(fig, run)
    assert fig.axes[0].get_title().startswith("one measurement, at step 0 ")
    assert fig.axes[0].collections[0].get_array().shape == (3, 1)
    fig = Figure()
    report._draw_histograms(fig, run)
    assert fig.get_supxlabel() == "each layer at the last measurement, step 0"

    # Said once, naming both arguments.
    [message] = stale_warnings(caught)
    assert "the report at step 20" in message
    assert "`every_n_steps`=10" in message and "`update_every`=100" in message


def fit_measuring(model, monitor, update_every, epochs, samples, *callbacks):
    """`fit` of `model` (8 inputs) with batches of 8; the optimizer and
    what `MeasuredSteps` read."""
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), update_every=update_every)
    model.compile(opt, "mse", jit_compile=True)
    x, y = data(n=samples)
    reads = MeasuredSteps(opt)
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0,
                        callbacks=[monitor, *callbacks, reads])
    return history.history, reads.measured


def test_an_epoch_without_a_measurement_has_nan_in_history_and_says_so(float16_policy):
    """Epochs of 8 steps, a measurement every 20 (steps 0 and 20): the
    second epoch measures nothing, and History shows nothing for it; the
    reports come at the epochs' ends only (`every_n_steps`=100)."""
    monitor = tas.ScaleMonitor(every_n_steps=100, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, measured = fit_measuring(named_mlp(), monitor, 20, 3, 64)
    steps = [step for step, _ in measured]
    assert len(steps) == 2 and steps[0] < 8 and steps[1] >= 16
    assert_history_holds_only_what_each_epoch_measured(
        history, measured, 8, ["layer/hidden_0/grad_norm", "layer/head/zero_fraction"])
    assert history["scale/measured_step"] == [steps[0], steps[0], steps[1]]
    [message] = stale_warnings(caught)
    assert message.startswith("ScaleMonitor: epoch 2 (8 steps) has no new gradient measurement")
    assert "`update_every`=20" in message and "`every_n_steps`=100" in message
    assert "`update_every` to 8 or fewer" in message


def test_reports_that_see_every_measurement_do_not_warn(float16_policy):
    """A report every 4 steps and a measurement every 4, in epochs of 6: the
    reports at the epochs' ends fall between two measurements, yet every
    epoch measures, and each report on schedule sees a new one."""
    monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, measured = fit_measuring(named_mlp(), monitor, 4, 3, 48)
    steps = [step for step, _ in measured]
    assert np.diff(steps).tolist() == [4] * 4
    assert stale_warnings(caught) == []
    reported = [r["step"] for r in monitor.records]
    assert reported == [4, 6, 10, 12, 16, 18]
    new = [any(start <= step < end for step in steps)
           for start, end in zip([0] + reported[:-1], reported)]
    assert [r["new_measurement"] for r in monitor.records] == new
    assert new.count(False) == 1  # the report at the end of epoch 2
    assert_history_holds_only_what_each_epoch_measured(
        history, measured, 6, ["layer/hidden_0/grad_norm"])


def test_per_layer_logs_carry_the_measured_figures_only_where_new(float16_policy):
    """`per_layer_logs=True`: the keys a callback after the monitor (and
    the progress bar) reads are NaN where the report has no new
    measurement, the measured step always."""
    seen = []
    after = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(
        dict(logs)) if "scale/measured_step" in logs else None)
    monitor = tas.ScaleMonitor(every_n_steps=2, per_layer_logs=True, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        history, measured = fit_measuring(named_mlp(), monitor, 4, 1, 64, after)
    steps = [step for step, _ in measured]
    assert len(steps) == 2
    # Reports at steps 2, 4, 6, 8: the first after each measurement is new.
    reported = [2, 4, 6, 8]
    assert [logs["scale/measured_step"] for logs in seen] == [
        max(step for step in steps if step < end) for end in reported]
    new = [any(start <= step < end for step in steps)
           for start, end in zip([0] + reported[:-1], reported)]
    assert new.count(True) == 2
    for logs, fresh in zip(seen, new):
        for key in ("scale/grad_norm", "layer/head/grad_norm", "layer/head/zeros"):
            assert np.isfinite(logs[key]) == fresh, (key, logs)
        assert np.isfinite(logs["layer/head/scale"]) and np.isfinite(logs["scale/loss_scale"])
    last = max(i for i, fresh in enumerate(new) if fresh)
    assert history["layer/head/grad_norm"] == [pytest.approx(seen[last]["layer/head/grad_norm"])]


def test_the_advice_counts_batches_under_accumulation(float16_policy):
    """`every_n_steps` counts batches, `update_every` optimizer steps: with
    windows of 2 batches, a measurement every 5 steps is one every 10
    batches, and a report every 4 batches matches `update_every`=2."""
    monitor = tas.ScaleMonitor(every_n_steps=4, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(named_mlp(), monitor, update_every=5, accumulation_steps=2)
    [message] = stale_warnings(caught)
    assert message.endswith("set `every_n_steps` to a multiple of 10, or the optimizer's "
                            "`update_every` to 2.")
