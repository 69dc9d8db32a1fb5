"""Invariants of one optimizer step that the rest of the suite left open.

Each test checks a behaviour the README and the optimizer's docstring
promise against a reference worked out apart (a schedule by hand, numpy):

- a step skipped for a non-finite loss counts down to the next measurement
  like any other step (it neither restarts the countdown nor measures), in
  global adaptive mode and per layer;
- a skipped step records no statistics (`measurements`, `measured_step`,
  `gradient_histogram` stay), after an overflow and after a NaN loss, global
  adaptive and per layer; AutoClip's ring buffer stays too;
- AGC floors the weight norm at `agc_eps` (a zero-initialised bias is not
  clipped to zero);
- `ScaleMonitor`'s `scale/skipped_since_last` counts the skips since the
  previous report, not since the start;
- statistics of replicas and micro-batches combine with counts summed and
  peaks taken as the largest, never summed;
- `accumulation_steps=K` applies the mean of the K unscaled gradients.

Backend-neutral: steps go through `backend_step.stepper` (`apply` in
`tf.function` on TensorFlow, `stateless_apply` under `jax.jit` on JAX) or
`train_on_batch`/`fit`, so the file runs in the JAX pass as well.
"""

import keras
import numpy as np
import pytest
from backend_step import stepper

import tf_adaptive_scale as tas
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.numerics import gradient_statistics
from tf_adaptive_scale.step import gradient_window

# Compiled steps: a jitted `stateless_apply` on JAX; a `tf.function` graph
# on TensorFlow, where XLA would only add compile time (the XLA paths are
# the other tests' business).
JIT = keras.backend.backend() == "jax"
NAN = float("nan")
INF = float("inf")
NUM_BINS = gradient_statistics.NUM_BINS
EXPONENT_MIN = gradient_statistics.EXPONENT_MIN


def tensor(value):
    return keras.ops.convert_to_tensor(np.asarray(value, "float32"))


def variable_named(opt, name):
    """The optimizer state declared as `name` (a variable, or a scalar
    packed in a vector: `optimizer_state.StateSlot`)."""
    assert [s.name for s in opt.declared_state()].count(name) == 1, opt.declared_state()
    return getattr(opt, name)


def numpy_histogram(values):
    """Counts of the nonzero finite values by binary exponent, by hand."""
    values = np.abs(np.asarray(values, np.float64).ravel())
    values = values[np.isfinite(values) & (values > 0)]
    counts = np.zeros(NUM_BINS)
    for e in np.floor(np.log2(values)).astype(int):
        counts[e - EXPONENT_MIN] += 1
    return counts


def measurement_record(opt):
    """What a skipped step must leave as it was."""
    return (
        int(opt.measurements.numpy()),
        int(opt.measured_step.numpy()),
        np.array(opt.gradient_histogram.numpy()),
    )


def assert_record_unchanged(before, opt, what):
    measurements, measured_step, histogram = measurement_record(opt)
    assert measurements == before[0], f"{what}: measurements moved"
    assert measured_step == before[1], f"{what}: measured_step moved"
    np.testing.assert_array_equal(histogram, before[2], err_msg=f"{what}: histogram moved")


# ------------------------------------------------------- global adaptive steps


class GlobalRun:
    """One float32 variable in global adaptive mode, stepped with hand-made
    gradients that arrive multiplied by the current scale (as gradients of
    `scale_loss(loss)` do)."""

    def __init__(self, shape=(6,), lr=0.1, **kwargs):
        kwargs.setdefault("scaling", "adaptive")
        self.var = keras.Variable(np.linspace(-1.0, 1.0, int(np.prod(shape)))
                                  .reshape(shape).astype("float32"))
        self.opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(lr), **kwargs)
        self.opt.build([self.var])
        self._step = stepper(self.opt, [self.var], jit=JIT)

    def step(self, unscaled, loss=1.0):
        """One step of gradient `unscaled`, its loss `loss` (noted as
        `scale_loss` notes it: NaN makes it a bad-data step)."""
        self.opt.observe_loss(tensor(loss))
        scale = float(self.opt.loss_scale.numpy())
        self._step(tensor(np.asarray(unscaled, "float32") * np.float32(scale)))


# ------------------------------------------------------------ per-layer steps


def per_layer_run(update_every, lr=1e-3):
    """A small float16 model, instrumented, trained per layer with a loss
    whose value is NaN on a batch whose target's second column is NaN, while
    its gradients stay those of the finite part (the NaN enters through
    `stop_gradient`): a bad-data step with finite gradients. (Its tests
    build it under `float16_policy`.)"""
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(4, activation="tanh", name="hidden"),
        keras.layers.Dense(1, name="head"),
    ])
    inst = tas.instrument(model)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(lr), scaling="per_layer", update_every=update_every
    )

    def loss(y, p):
        target, poison = y[:, :1], y[:, 1:]
        p = keras.ops.cast(p, "float32")
        return keras.ops.mean(keras.ops.square(p - target), axis=-1) + keras.ops.stop_gradient(
            keras.ops.mean(poison, axis=-1)
        )

    inst.compile(opt, loss, jit_compile=JIT)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (8, 4)).astype("float32")
    y = np.zeros((8, 2), "float32")
    y[:, 0] = rng.uniform(-1, 1, 8)
    bad_y = y.copy()
    bad_y[:, 1] = NAN

    def step(nan_loss=False):
        if nan_loss:
            # Keras's JAX trainer calls `scale_loss` in a scope it discards,
            # so there `fit` loses the note of a NaN loss (docs/jax.md, "Keras on
            # JAX"): note it eagerly first, which reaches the variables. On
            # TensorFlow the trainer's `scale_loss` replaces this note with
            # its own, from the poisoned loss.
            opt.observe_loss(tensor(NAN))
        inst.train_on_batch(x, bad_y if nan_loss else y)

    return inst, opt, step


def backward_measured(inst):
    """Whether the last backward pass took statistics (its histograms)."""
    statistics = np.asarray(inst.scale_table.statistics.numpy())
    return statistics[:, :NUM_BINS].sum() > 0


# ---------------------------------------- (1) NaN-loss skips and the countdown

# update_every=3, NaN losses on steps 1 and 3. By hand: step 0 measures
# (3 steps to the next: 0 -> 3); step 1 is a NaN skip and counts as a step;
# step 2 is clean; step 3 is the scheduled measurement, missed for its NaN
# loss, so the next step, 4, measures; then every third: 7.
SCHEDULE_STEPS = 9
SCHEDULE_NAN = {1, 3}
SCHEDULE_MEASURED = [0, 4, 7]
# The steps whose backward pass is asked to measure (per layer): every
# scheduled one, the NaN-loss step 3 included.
SCHEDULE_BACKWARD = [0, 3, 4, 7]


def test_nan_loss_skips_keep_the_global_measurement_schedule():
    run = GlobalRun(update_every=3)
    opt = run.opt
    grad = np.array([0.5, -0.25, 2.0**-10, 3.0, -1e-3, 0.125], "float32")
    measured = []
    for i in range(SCHEDULE_STEPS):
        before = int(opt.measurements.numpy())
        scale_before = float(opt.loss_scale.numpy())
        run.step(grad, loss=NAN if i in SCHEDULE_NAN else 1.0)
        if int(opt.measurements.numpy()) > before:
            assert int(opt.measured_step.numpy()) == i
            measured.append(i)
        if i in SCHEDULE_NAN:
            # Bad data: nothing backs off.
            assert float(opt.loss_scale.numpy()) == scale_before
    assert measured == SCHEDULE_MEASURED
    assert int(opt.skipped_steps.numpy()) == len(SCHEDULE_NAN)
    assert int(opt.total_steps.numpy()) == SCHEDULE_STEPS
    assert int(opt.iterations.numpy()) == SCHEDULE_STEPS - len(SCHEDULE_NAN)


def test_nan_loss_skips_keep_the_per_layer_measurement_schedule(float16_policy):
    inst, opt, step = per_layer_run(update_every=3)
    measured, backward = [], []
    for i in range(SCHEDULE_STEPS):
        before = int(opt.measurements.numpy())
        scales_before = inst.layer_scales()
        step(nan_loss=i in SCHEDULE_NAN)
        if int(opt.measurements.numpy()) > before:
            assert int(opt.measured_step.numpy()) == i
            measured.append(i)
        if backward_measured(inst):
            backward.append(i)
        if i in SCHEDULE_NAN:
            # Bad data: nothing backs off.
            assert inst.layer_scales() == scales_before
    assert measured == SCHEDULE_MEASURED
    assert backward == SCHEDULE_BACKWARD
    assert int(opt.skipped_steps.numpy()) == len(SCHEDULE_NAN)
    assert int(opt.total_steps.numpy()) == SCHEDULE_STEPS
    assert int(opt.iterations.numpy()) == SCHEDULE_STEPS - len(SCHEDULE_NAN)


# ------------------------------------ (2) no statistics on a skipped step


def test_skipped_steps_record_no_global_statistics():
    # update_every=1: every step is a scheduled measurement.
    run = GlobalRun(update_every=1)
    opt = run.opt
    clean = np.array([0.5, -0.25, 2.0**-10, 3.0, -1e-3, 0.125], "float32")
    run.step(clean)
    assert int(opt.measurements.numpy()) == 1
    assert int(opt.measured_step.numpy()) == 0
    # The histogram of the unscaled gradient, by hand.
    np.testing.assert_array_equal(opt.gradient_histogram.numpy(), numpy_histogram(clean))
    record = measurement_record(opt)
    weights = run.var.numpy().copy()

    # An overflow: one value non-finite, the others unlike the clean step's
    # (a measurement would change the histogram).
    run.step(np.array([INF, 7.0, 2.0**-20, 1e-5, 4.0, 100.0], "float32"))
    assert int(opt.skipped_steps.numpy()) == 1
    assert_record_unchanged(record, opt, "overflow skip")
    # A NaN loss with finite gradients, unlike the clean step's.
    run.step(np.array([9.0, 2.0**-30, 6.0, 1e-6, 50.0, 0.75], "float32"), loss=NAN)
    assert int(opt.skipped_steps.numpy()) == 2
    assert_record_unchanged(record, opt, "NaN-loss skip")
    np.testing.assert_array_equal(run.var.numpy(), weights)

    # The next clean step measures again, as step 3.
    run.step(2.0 * clean)
    assert int(opt.measurements.numpy()) == 2
    assert int(opt.measured_step.numpy()) == 3
    np.testing.assert_array_equal(
        opt.gradient_histogram.numpy(), numpy_histogram(2.0 * clean)
    )


def test_skipped_steps_record_no_per_layer_statistics(float16_policy):
    inst, opt, step = per_layer_run(update_every=1)
    step()
    assert int(opt.measurements.numpy()) == 1
    record = measurement_record(opt)
    assert record[2].sum() > 0

    # An overflow: the head's scale so high that converting its gradient
    # to float16 overflows.
    table = inst.scale_table
    head = table.unit_names.index("head")
    log2 = np.array(table.log2_scales.numpy())
    log2[head] = 40.0
    table.log2_scales.assign(log2)
    step()
    assert int(opt.skipped_steps.numpy()) == 1
    assert_record_unchanged(record, opt, "per-layer overflow skip")
    # A NaN loss with finite gradients.
    step(nan_loss=True)
    assert int(opt.skipped_steps.numpy()) == 2
    assert_record_unchanged(record, opt, "per-layer NaN-loss skip")

    step()
    assert int(opt.skipped_steps.numpy()) == 2
    assert int(opt.measurements.numpy()) == 2
    assert int(opt.measured_step.numpy()) == 3


# ------------------------------------------ AutoClip's history on skipped steps


@pytest.mark.parametrize("per_variable", [False, True])
def test_autoclip_history_is_untouched_by_skipped_steps(per_variable):
    window = 4
    a = keras.Variable(np.ones((3,), "float32"))
    b = keras.Variable(np.ones((2, 2), "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.0), scaling="none", autoclip_percentile=50.0,
        autoclip_window=window, autoclip_per_variable=per_variable,
    )
    opt.build([a, b])
    step = stepper(opt, [a, b], jit=JIT)
    history = variable_named(opt, "norm_history")
    count = variable_named(opt, "norm_history_count")
    rows = (2,) if per_variable else ()
    expected = np.zeros(rows + (window,))

    def norms(ga, gb):
        if per_variable:
            return np.array([np.linalg.norm(ga), np.linalg.norm(gb)])
        return np.sqrt(np.sum(np.square(ga)) + np.sum(np.square(gb)))

    def clean(ga, gb, pushed):
        step(tensor(ga), tensor(gb))
        expected[..., pushed % window] = norms(ga, gb)
        assert int(count.numpy()) == pushed + 1
        np.testing.assert_allclose(history.numpy(), expected, rtol=1e-6)

    g1 = (np.array([3.0, 0.0, 4.0]), np.array([[1.0, 0.0], [0.0, 1.0]]))
    clean(*g1, 0)
    snapshot = np.array(history.numpy())
    # An overflow, then a NaN loss whose gradients are finite (and large:
    # pushing their norm would shift the percentile).
    step(tensor([INF, 1.0, 1.0]), tensor(np.ones((2, 2))))
    opt.observe_loss(tensor(NAN))
    step(tensor([300.0, 0.0, 400.0]), tensor(np.full((2, 2), 50.0)))
    assert int(opt.skipped_steps.numpy()) == 2
    assert int(count.numpy()) == 1
    np.testing.assert_array_equal(history.numpy(), snapshot)
    # The next clean step writes slot 1, not slot 3.
    clean(np.array([6.0, 0.0, 8.0]), np.array([[2.0, 0.0], [0.0, 2.0]]), 1)


# ------------------------------------------------ (3) AGC's weight-norm floor


def numpy_agc(grad, weight, factor, eps):
    """Unit-wise AGC by hand: a unit is a kernel's output column (all axes
    but the last) or a vector's element."""
    grad, weight = np.asarray(grad, np.float64), np.asarray(weight, np.float64)
    if grad.ndim <= 1:
        g_norm, w_norm = np.abs(grad), np.abs(weight)
    else:
        axes = tuple(range(grad.ndim - 1))
        g_norm = np.sqrt(np.sum(grad**2, axis=axes, keepdims=True))
        w_norm = np.sqrt(np.sum(weight**2, axis=axes, keepdims=True))
    limit = np.maximum(w_norm, eps) * factor
    shrink = np.where(g_norm > limit, limit / np.maximum(g_norm, 1e-30), 1.0)
    return grad * shrink


def test_agc_floors_the_weight_norm_at_agc_eps():
    """A zero-initialised bias has weight norm 0: AGC must clip its
    gradient to `agc_eps * agc_factor` per unit, not to zero."""
    factor, eps, lr = 0.05, 1e-2, 1.0
    kernel0 = np.array([[0.3, -1.0], [0.4, 2.0], [0.0, 0.5]], "float32")
    bias0 = np.zeros((2,), "float32")
    kernel = keras.Variable(kernel0)
    bias = keras.Variable(bias0)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(lr), scaling="none", agc_factor=factor, agc_eps=eps
    )
    opt.build([kernel, bias])
    g_kernel = np.array([[1.0, 0.01], [-2.0, 0.02], [0.5, -0.01]], "float32")
    g_bias = np.array([0.3, -2.0e-4], "float32")
    stepper(opt, [kernel, bias], jit=JIT)(tensor(g_kernel), tensor(g_bias))

    expected_bias = bias0 - lr * numpy_agc(g_bias, bias0, factor, eps)
    expected_kernel = kernel0 - lr * numpy_agc(g_kernel, kernel0, factor, eps)
    # By hand: the bias's limit is eps * factor = 5e-4: 0.3 is clipped to
    # 5e-4 (not to 0), -2e-4 passes.
    np.testing.assert_allclose(expected_bias, [-5e-4, 2e-4], rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), expected_bias, rtol=1e-5)
    np.testing.assert_allclose(kernel.numpy(), expected_kernel, rtol=1e-5, atol=1e-7)
    assert int(opt.clipped_steps.numpy()) == 1


# ------------------------------- (4) the monitor's skips since the last report


def test_monitor_reports_skips_since_the_previous_report_in_a_custom_loop():
    run = GlobalRun(update_every=1)
    monitor = tas.ScaleMonitor(optimizer=run.opt, verbose=0, skipped_run=100)
    good = np.array([0.5, -0.25, 0.125, 1.0, -1.0, 0.75], "float32")
    bad = np.array([INF, 0, 0, 0, 0, 0], "float32")
    # Per report: the steps run since the last one (True: skipped).
    segments = [[True, True, False], [False, True, False, False], [False, False], [True]]
    done = 0
    reported = []
    for segment in segments:
        for skipped in segment:
            run.step(bad if skipped else good)
        done += len(segment)
        record = monitor.log(done)
        reported.append((record["skipped_since_last"], record["skipped_steps"]))
    expected_since = [sum(s) for s in segments]  # 2, 1, 0, 1
    expected_total = [int(t) for t in np.cumsum(expected_since)]  # 2, 3, 3, 4
    assert reported == list(zip(expected_since, expected_total))


def test_monitor_reports_skips_since_the_previous_report_in_fit():
    """One NaN batch per epoch, reports at epoch ends only: each report's
    `scale/skipped_since_last` is 1, while the total grows 1, 2, 3."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype("float32")
    y = rng.standard_normal((16, 1)).astype("float32")
    x[9] = NAN  # the third batch of four
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01))
    monitor = tas.ScaleMonitor(every_n_steps=1000, verbose=0, skipped_run=100)
    model.compile(opt, "mse", jit_compile=JIT)
    history = model.fit(
        x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[monitor]
    )
    assert int(opt.skipped_steps.numpy()) == 3
    assert history.history["scale/skipped_since_last"] == [1, 1, 1]
    assert history.history["scale/skipped_steps"] == [1, 2, 3]
    assert [r["step"] for r in monitor.records] == [4, 8, 12]


# --------------------- combining replicas' and micro-batches' statistics


PEAKS = (gradient_scale.OUTPUT_MAX, gradient_scale.INPUT_MAX, gradient_scale.WIDE_OUTPUT_MAX)


def table_statistics(rng, units=3):
    """A `(units, NUM_COLUMNS)` table: histogram counts, peaks and flags."""
    table = np.zeros((units, gradient_scale.NUM_COLUMNS), "float32")
    table[:, :NUM_BINS] = rng.integers(0, 5, (units, NUM_BINS))
    for column in PEAKS:
        table[:, column] = rng.uniform(0.1, 100.0, units).astype("float32")
    for column in (gradient_scale.PRODUCED_NON_FINITE, gradient_scale.CONVERSION_OVERFLOW,
                   gradient_scale.RECEIVED_NON_FINITE):
        table[:, column] = rng.integers(0, 2, units)
    return table


def expected_combination(tables):
    """By hand: every column summed, except the three peaks: the largest."""
    tables = np.asarray(tables, np.float64)
    combined = tables.sum(axis=0)
    for column in PEAKS:
        combined[:, column] = tables[:, :, column].max(axis=0)
    return combined


def test_per_layer_peaks_combine_by_max_across_replicas():
    rng = np.random.default_rng(1)
    tables = np.stack([table_statistics(rng) for _ in range(3)])
    combined = keras.ops.convert_to_numpy(gradient_scale.combine_replicas(tensor(tables)))
    np.testing.assert_allclose(combined, expected_combination(tables), rtol=1e-6)
    # Not their sum: every peak here is strictly below the sum.
    for column in PEAKS:
        assert (combined[:, column] < tables[:, :, column].sum(axis=0)).all()


def test_per_layer_peaks_combine_by_max_across_micro_batches():
    rng = np.random.default_rng(2)
    batches = [table_statistics(rng) for _ in range(3)]
    total = np.zeros_like(batches[0])
    for batch in batches:
        total = keras.ops.convert_to_numpy(
            gradient_window.accumulate(tensor(total), tensor(batch), True)
        )
    np.testing.assert_allclose(total, expected_combination(batches), rtol=1e-6)
    # A gradient (not statistics) adds up.
    summed = keras.ops.convert_to_numpy(
        gradient_window.accumulate(tensor([1.0, 2.0]), tensor([3.0, -5.0]), False)
    )
    np.testing.assert_array_equal(summed, [4.0, -3.0])


def test_global_measurements_combine_counts_and_take_the_largest_peak():
    rng = np.random.default_rng(3)
    rows = np.zeros((3, NUM_BINS + 2), "float32")
    rows[:, :NUM_BINS] = rng.integers(0, 5, (3, NUM_BINS))
    rows[:, NUM_BINS] = [4.0, 0.0, 7.0]  # zeros
    rows[:, NUM_BINS + 1] = [2.5, 9.0, 0.5]  # peaks
    combined = keras.ops.convert_to_numpy(gradient_statistics.combine_measurements(tensor(rows)))
    np.testing.assert_array_equal(combined[:NUM_BINS], rows[:, :NUM_BINS].sum(axis=0))
    assert combined[NUM_BINS] == 11.0
    assert combined[NUM_BINS + 1] == 9.0


# -------------------------------------------- the accumulation window's mean


def test_accumulation_applies_the_mean_of_the_unscaled_micro_batch_gradients():
    k, lr, windows = 3, 0.1, 3
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((5,)).astype("float32")
    run = GlobalRun(shape=(5,), lr=lr, update_every=1, accumulation_steps=k)
    run.var.assign(w0)
    grads = rng.standard_normal((windows, k, 5)).astype("float32")
    expected = w0.astype(np.float64)
    for window in range(windows):
        for micro in range(k):
            before = run.var.numpy().copy()
            run.step(grads[window, micro])
            if micro < k - 1:  # nothing is applied inside a window
                np.testing.assert_array_equal(run.var.numpy(), before)
        # Plain SGD on the mean gradient, in numpy.
        expected = expected - lr * grads[window].astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(run.var.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert int(run.opt.iterations.numpy()) == windows
    assert int(run.opt.total_steps.numpy()) == windows
    assert int(run.opt.skipped_steps.numpy()) == 0


def test_accumulation_window_peak_is_the_largest_micro_batch_peak():
    """The window's measured peak is the largest of its micro-batches'
    peaks: not their sum (8), nor the peak of their mean (2.5)."""
    run = GlobalRun(shape=(2,), update_every=1, accumulation_steps=2)
    run.step(np.array([3.0, 0.0], "float32"))
    run.step(np.array([0.0, 5.0], "float32"))
    assert int(run.opt.measurements.numpy()) == 1
    assert float(run.opt.gradient_max.numpy()) == 5.0
    assert float(run.opt.gradient_zeros.numpy()) == 2.0
    np.testing.assert_array_equal(
        run.opt.gradient_histogram.numpy(), numpy_histogram([3.0, 5.0])
    )
    # And the step applied their mean, [1.5, 2.5], to the initial [-1, 1].
    np.testing.assert_allclose(run.var.numpy(), [-1.0 - 0.15, 1.0 - 0.25], rtol=1e-6)
