"""Tests that catch planted bugs in the scaling and clipping rules.

Each test drives `AdaptiveLossScaleOptimizer` end to end (`apply` in an XLA
step, or an instrumented model's training step) in the mode where its rule
matters, global adaptive or per layer, and checks what it does against values
worked out by hand from known gradients, or against a numpy reference. Each
test's docstring names the rule it guards; each was checked to fail with a
bug in that rule planted and to pass on the code as it is.
`tests/test_scale_policy.py` checks the same rules on the pure policies.
"""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import compiled_once

INF = float("inf")
LR = 0.5


# ------------------------------------------------------- global scale helpers


def global_optimizer(shape=(8,), seed=0, **kwargs):
    """An optimizer in global adaptive mode over one float32 variable."""
    rng = np.random.default_rng(seed)
    var = keras.Variable(rng.standard_normal(shape).astype("float32"))
    kwargs.setdefault("scaling", "adaptive")
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), **kwargs)
    opt.build([var])
    return opt, var


def global_stepper(opt, variables):
    """An XLA step applying unscaled gradients `grads` as the gradients of
    `scale_loss(sum(v * g))` would arrive: multiplied by the current scale.
    One per optimizer and variables in a test, reused."""

    def make():
        @tf.function(jit_compile=True)
        def step(grads):
            opt.apply([g * opt.loss_scale for g in grads], variables)

        return lambda grads: step([tf.constant(g, "float32") for g in grads])

    return compiled_once((opt, *variables), make)


def scales_after(opt, var, grads):
    """Applies each unscaled gradient; returns log2 of the scale after each."""
    step = global_stepper(opt, [var])
    trail = []
    for g in grads:
        step([np.broadcast_to(np.float32(g), var.shape)])
        trail.append(float(np.log2(float(opt.loss_scale))))
    return trail


# ---------------------------------------------------- per-layer scale helpers

# One Dense unit `d` (1 -> 1, no bias) over 16 inputs of 2**-4, trained on
# `k * sum(outputs)`: its output gradients are 16 values `k`, its kernel
# gradient 16 * 2**-4 * k = k, its input gradient leaves the model unmeasured.
# So its peak is `k` and the adaptive rule (headroom 2**4) gives
# floor(log2(65504 / k)) - 4: 11 for k = 1, 6 for k = 2**5. At scale 2**11,
# k = 2**5 overflows converting the output gradient (2**16 > 65504) into `d`.


def one_unit(**kwargs):
    """The unit above, instrumented (the tests build it under `float16_policy`)."""
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, name="d")]
    )
    inst = tas.instrument(model)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.1), scaling="per_layer", **kwargs
    )
    variables = inst.trainable_variables
    opt.build(variables)
    x = tf.constant(np.full((16, 1), 2.0**-4, "float32"))

    @tf.function(jit_compile=True)
    def step(k):
        with tf.GradientTape() as tape:
            loss = k * tf.reduce_sum(inst(x, training=True))
        opt.apply(tape.gradient(loss, variables), variables)

    table = inst.scale_table
    unit = table.unit_names.index("d")

    def run(factors):
        """Steps with each loss factor; the unit's log2 scale, cap, whether
        the next step measures, and whether the step was applied, after each."""
        trail = []
        for k in factors:
            step(tf.constant(k, "float32"))
            trail.append((
                float(table.log2_scales.numpy()[unit]),
                float(table.log2_ceilings.numpy()[unit]),
                float(table.measure.numpy()) > 0,
                bool(opt.last_step_finite.numpy()),
            ))
        return trail

    return opt, run


def column(trail, i):
    return [row[i] for row in trail]


# --------------------------------------------------------------------- tests


def test_per_layer_cap_lifts_a_binade_per_clean_measurement(float16_policy):
    """Per layer: each clean measurement lifts an overflow's cap one binade."""
    opt, run = one_unit(update_every=1)
    trail = run([1.0, 2.0**5, 1.0, 1.0, 1.0])
    # 1: rule 11, the cap min(127 + 1, 64). 2: overflow at 2**11: the rule on
    # the finite output gradient (peak 2**5) says 6: one below, capped there.
    # 3: the rule says 11, the cap lets it one below (10) and lifts to 11.
    # 4: the cap (11) allows the rule: 11; the cap rises on to 12, then 13.
    assert column(trail, 0) == [11, 5, 10, 11, 11]
    assert column(trail, 1) == [64, 5, 11, 12, 13]
    assert column(trail, 3) == [True, False, True, True, True]
    assert int(opt.skipped_steps) == 1


def test_per_layer_back_off_waits_for_hysteresis_overflows(float16_policy):
    """Per layer: a unit backs off only after `hysteresis` overflows in a row."""
    opt, run = one_unit(update_every=1, hysteresis=2)
    trail = run([1.0, 2.0**5, 2.0**5, 1.0, 1.0])
    # 2: the first overflow keeps 11 (and no cap); 3: the second backs off to
    # one below the rule's 6, capped; then as in the test above.
    assert column(trail, 0) == [11, 11, 5, 10, 11]
    assert column(trail, 1) == [64, 64, 5, 11, 12]
    assert column(trail, 3) == [True, False, False, True, True]
    assert int(opt.skipped_steps) == 2


def test_per_layer_overflow_on_an_unmeasured_step_measures_the_next(float16_policy):
    """Per layer: an overflow makes the next step measure (and attribute it)."""
    opt, run = one_unit(update_every=100)
    trail = run([1.0, 2.0**5, 2.0**5, 2.0**5, 2.0**5])
    # 1: measured, rule 11, next measurement 100 steps on. 2: overflow
    # without statistics: nothing to blame, the scale stays; measure next.
    # 3: the repeat is measured: back off to 5. 4: measured, clean at 5
    # (1024 fits): the rule's 6 is held one below by the cap. 5: unmeasured.
    assert column(trail, 0) == [11, 11, 5, 5, 5]
    assert column(trail, 2) == [False, True, True, False, False]
    assert column(trail, 3) == [True, False, False, True, True]
    assert int(opt.skipped_steps) == 2


def test_per_layer_scales_stay_within_max_scale(float16_policy):
    """Per layer: rule and unseen-unit rises are bounded by `max_scale`."""
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(4, name="b")]
    )
    inst = tas.instrument(model)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.0), scaling="per_layer", max_scale=2.0**4
    )
    variables = inst.trainable_variables
    opt.build(variables)
    x = tf.constant(np.ones((8, 4), "float32"))

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(inst(x, training=True)) * 2.0**-40
        opt.apply(tape.gradient(loss, variables), variables)

    for _ in range(3):
        step()
        # "b" sees its output gradient 2**-40: the rule says 55 - 4 = 51;
        # "a" gets only float16 zeros from b's backward at scale 1: unseen,
        # it rises 8 binades. Both stop at max_scale 2**4.
        assert inst.layer_scales() == {"a": 2.0**4, "b": 2.0**4}
    assert int(opt.skipped_steps) == 0


def test_per_layer_backward_overflow_skips_even_with_finite_weight_gradients(float16_policy):
    """Per layer: a boundary's non-finite flag skips the step (last_step_finite)."""
    # A frozen feature extractor under a trainable head: the head's weight
    # gradients stay finite while its input gradient, converted to the frozen
    # unit's scale 2**40, overflows.
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(4, name="frozen", trainable=False),
        keras.layers.Dense(1, name="head"),
    ])
    inst = tas.instrument(model)
    table = inst.scale_table
    frozen, head = (table.unit_names.index(n) for n in ("frozen", "head"))
    log2 = np.zeros(len(table.unit_names), "float32")
    log2[frozen] = 40.0
    table.log2_scales.assign(log2)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1), scaling="per_layer")
    inst.compile(opt, "mse", jit_compile=True)
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 1), "float32")
    head_before = [w.copy() for w in model.get_layer("head").get_weights()]
    inst.train_on_batch(x, y)
    assert not bool(opt.last_step_finite.numpy())
    assert int(opt.skipped_steps) == 1 and int(opt.total_steps) == 1
    for a, b in zip(model.get_layer("head").get_weights(), head_before):
        np.testing.assert_array_equal(a, b)
    # The overflow was attributed to "frozen", which backed off and is capped.
    scales, caps = table.log2_scales.numpy(), table.log2_ceilings.numpy()
    assert scales[frozen] < 40 and caps[frozen] == scales[frozen]
    assert caps[head] == 127.0
    inst.train_on_batch(x, y)  # measured again: clean now, applied
    assert bool(opt.last_step_finite.numpy()) and int(opt.skipped_steps) == 1
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(model.get_layer("head").get_weights(), head_before)
    )


def test_adaptive_overflow_measures_the_next_step():
    """Global adaptive: an overflow backs off, caps, and re-measures at once."""
    opt, var = global_optimizer(initial_scale=2.0**10, update_every=100, headroom=16.0)
    # 1: peak 2**-3: floor(log2(65504 * 8)) - 4 = 14. 2: overflow: 13, capped.
    # 3: measured: peak 1 -> rule 11 (under the cap). 4: not measured.
    assert scales_after(opt, var, [2.0**-3, INF, 1.0, 1.0]) == [14, 13, 11, 11]
    assert float(opt.gradient_max) == 1.0
    assert int(opt.skipped_steps) == 1 and int(opt.steps_to_measure) == 98


def test_adaptive_all_zero_gradients_leave_a_calibrated_scale():
    """Global adaptive: a measurement of only zeros moves no calibrated scale."""
    opt, var = global_optimizer(initial_scale=2.0**10, update_every=1, headroom=16.0)
    assert scales_after(opt, var, [2.0**-3]) == [14]
    assert bool(opt.calibrated.numpy())
    # Zeros: the empty histogram's rule would say floor(log2(65504)) - 4 = 11.
    assert scales_after(opt, var, [0.0, 0.0, 0.0]) == [14, 14, 14]
    assert float(opt.gradient_max) == 0.0 and float(opt.scale_ceiling) == 2.0**24
    # A measurement with values moves it again: peak 2**-1 -> 12.
    assert scales_after(opt, var, [2.0**-1]) == [12]


def test_adaptive_scale_stays_within_max_scale():
    """Global adaptive: the rule's scale is bounded by `max_scale`."""
    opt, var = global_optimizer(
        initial_scale=2.0**3, min_scale=2.0**-2, max_scale=2.0**6, update_every=1
    )
    # The rule says 14 (peak 2**-3), then 24 (peak 2**-13): both held at 6;
    # peak 2**8 -> 3 is inside the bounds.
    assert scales_after(opt, var, [2.0**-3, 2.0**-13, 2.0**8]) == [6, 6, 3]


def test_underflow_fraction_is_reported_at_the_new_scale():
    """Global adaptive: `underflow_fraction` is taken at the scale just chosen."""
    g = np.concatenate([
        np.zeros(5), np.full(3, 2.0**-45), np.full(100, 2.0**-30),
        np.full(900, 2.0**-10), [2.0**-3],
    ]).astype("float32")
    opt, var = global_optimizer(
        shape=g.shape, initial_scale=1.0, update_every=1, underflow_rate=0.2,
        headroom=16.0,
    )
    step = global_stepper(opt, [var])
    # 1: peak 2**-3 -> 14 (20% may underflow: low is -14); 2: the gradient
    # 2**8 larger: peak 2**5 -> 6. Zeros count as underflowed.
    for factor, log2_scale in [(1.0, 14), (2.0**8, 6)]:
        step([g * factor])
        scale = float(opt.loss_scale)
        assert scale == 2.0**log2_scale
        expected = np.mean(np.float16(g * factor * scale) == 0)
        assert expected == pytest.approx(8 / g.size)  # 5 zeros, 3 tiny
        assert float(opt.underflow_fraction) == pytest.approx(expected)


def test_clipnorm_counts_a_step_where_any_tensor_was_clipped():
    """clipnorm: `clipped_steps` counts a step where any one tensor was clipped."""
    kernel = keras.Variable(np.ones(2, "float32"))
    bias = keras.Variable(np.ones(2, "float32"))
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="adaptive", clipnorm=1.0
    )
    opt.build([kernel, bias])
    step = global_stepper(opt, [kernel, bias])
    small, large = np.array([0.3, 0.4]), np.array([3.0, 4.0])  # norms 0.5, 5
    counted = []
    for grads in [(large, small), (small, small), (small, large * 2), (large, large)]:
        before = [kernel.numpy().copy(), bias.numpy().copy()]
        step(list(grads))
        for v, b, g in zip((kernel, bias), before, grads):
            clipped = g * min(1.0, 1.0 / np.linalg.norm(g))
            np.testing.assert_allclose(v.numpy(), b - LR * clipped, rtol=1e-6)
        counted.append(int(opt.clipped_steps))
    assert counted == [1, 1, 2, 3]


def reference_clip(grads, weights, history, window, *, agc, value, norm, global_norm,
                   percentile):
    """The documented order: AGC, clipvalue, clipnorm, global_clipnorm,
    AutoClip (global, over a ring buffer of past global norms), in numpy."""

    def unit_norm(x):
        if x.ndim <= 1:
            return np.abs(x)
        return np.sqrt(np.sum(x**2, axis=tuple(range(x.ndim - 1)), keepdims=True))

    out = []
    for g, w in zip(grads, weights):
        limit = np.maximum(unit_norm(w), 1e-3) * agc
        n = unit_norm(g)
        out.append(np.where(n > limit, g * limit / np.maximum(n, 1e-30), g))
    out = [np.clip(g, -value, value) for g in out]
    out = [g * min(1.0, norm / np.linalg.norm(g)) for g in out]
    total = np.sqrt(sum(np.sum(g**2) for g in out))
    out = [g * min(1.0, global_norm / total) for g in out]
    total = np.sqrt(sum(np.sum(g**2) for g in out))
    history.append(total)
    del history[:-window]
    threshold = np.percentile(history, percentile)
    return [g * min(1.0, threshold / total) for g in out]


def test_clipping_runs_in_the_documented_order():
    """Clipping order: AGC, clipvalue, clipnorm, global_clipnorm, AutoClip."""
    rng = np.random.default_rng(0)
    variables = [
        keras.Variable(rng.standard_normal((3, 4)).astype("float32")),
        keras.Variable(rng.standard_normal(4).astype("float32")),
    ]
    settings = dict(agc=0.8, value=0.5, norm=1.0, global_norm=1.3, percentile=50.0)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="adaptive", update_every=1,
        agc_factor=settings["agc"], clipvalue=settings["value"],
        clipnorm=settings["norm"], global_clipnorm=settings["global_norm"],
        autoclip_percentile=settings["percentile"], autoclip_window=3,
    )
    opt.build(variables)
    step = global_stepper(opt, variables)
    history = []
    for magnitude in [2.0, 0.2, 4.0, 0.5, 8.0]:
        grads = [(rng.standard_normal(v.shape) * magnitude).astype("float32") for v in variables]
        before = [v.numpy().astype(np.float64) for v in variables]
        expected = reference_clip(
            [g.astype(np.float64) for g in grads], before, history, 3, **settings
        )
        step(grads)
        for v, b, e in zip(variables, before, expected):
            np.testing.assert_allclose(v.numpy(), b - LR * e, rtol=1e-5, atol=1e-6)
    assert int(opt.skipped_steps) == 0 and int(opt.norm_history_count) == 5
