"""Property-based tests (hypothesis): what holds for every input, not one.

What is proven, on random inputs drawn from the valid ranges:

1. Scale transitions, on the pure policies of `scale_policy` (driven eagerly
   with `keras.ops`): for every mode, every policy that `make_policy` builds
   from valid arguments, every valid starting `ScaleState` and every sequence
   of up to 40 observations (finite or non-finite gradients, finite or
   non-finite loss, measured or not, any proposed exponent, +-1000 and +-inf
   included, and NaN where the statistics saw nothing, as the rule's exponent
   is meaningless there; per layer a vector per unit, with random
   origins/involved/weight-only units):
   - every log2 scale is a finite integer in `[log2_min, log2_max]`
     (elementwise per layer, every unit, the loss unit included: the policy
     does not treat it specially); `"none"` holds 0 and `"static"` its scale;
   - the ceiling is the "no cap" (127) or a finite integer in
     `[scale, log2_max]`; modes without a cap never touch it;
   - the counters stay non-negative, `steps_to_measure` below `update_every`,
     a dynamic growth count below `growth_steps`; `calibrated` never reverts
     and turns on exactly with a clean measurement that saw values;
   - bad data (non-finite loss, non-finite gradients) changes nothing but
     the measurement countdown: no back-off, no cap, no streak, however many
     in a row; the loss's finiteness matters only when the gradients are not
     finite;
   - an overflow (finite loss, non-finite gradients) measures the next step,
     lengthens the streak, and changes a global scale exactly on every
     `hysteresis`-th consecutive one, downwards (unless already at the
     floor); per layer, an unmeasured overflow changes no scale and the
     origins of a measured one back off; an unmeasured clean step changes no
     adaptive scale.
2. `AdaptiveLossScaleOptimizer.apply`, eagerly, on two small variables with
   SGD, in modes "adaptive", "dynamic", "static", for any sequence of up to 8
   steps, each finite, with a NaN/Inf at a random position, or bad data
   (`scale_loss` of a NaN loss, then non-finite gradients): a skipped step
   changes no weight (bitwise), an applied one subtracts exactly
   `lr * (g / scale)` in float32; `skipped_steps`, `total_steps` and
   `iterations` count the non-finite, all and applied steps; `loss_scale` is
   always a finite power of two in `[min_scale, max_scale]`; bad data leaves
   it as it was, an overflow changes it exactly on every `hysteresis`-th
   consecutive one, downwards (unless at `min_scale`); "dynamic" follows
   Keras's rule exactly (double after `dynamic_growth_steps` clean steps,
   halve), "static" never moves.
3. `tas.instrument` on what it cannot handle raises an error that names the
   model or layer and says why.

Hypothesis runs derandomized (fixed examples, no database), so CI is
deterministic.
"""

import math

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from keras import layers

import tf_adaptive_scale as tas
from tf_adaptive_scale.rules import scale_policy as sp
from tf_adaptive_scale.numerics.float16 import NO_CAP_EXPONENT as NO_CAP

MODES = ("none", "static", "dynamic", "adaptive", "per_layer")
# Modes whose scale moves by the overflow streak (the others keep theirs).
STREAK_MODES = ("dynamic", "adaptive", "per_layer")
CAPPING_MODES = ("adaptive", "per_layer")


def _settings(max_examples):
    # Per test, not a loaded profile: loading one would change the settings of
    # every other test module in the session.
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# 1. Scale transitions on the pure policies.

EXPONENTS = st.one_of(
    st.integers(-1000, 1000).map(float),
    st.sampled_from([-1000.0, 1000.0, -math.inf, math.inf]),
)
# Where the statistics saw nothing the rule's exponent is meaningless.
UNSEEN_EXPONENTS = st.one_of(EXPONENTS, st.just(math.nan))


@st.composite
def observations(draw, units):
    """One step's `Observation`; `units` is None for a global scale."""
    size = 1 if units is None else units

    def vector(values, dtype):
        array = np.asarray(values, dtype)
        return array[0] if units is None else array

    seen = [draw(st.booleans()) for _ in range(size)]
    proposed = [draw(EXPONENTS if s else UNSEEN_EXPONENTS) for s in seen]
    flags = {
        name: vector([draw(st.booleans()) for _ in range(size)], bool)
        for name in ("origins", "involved", "weight_only")
    }
    return sp.Observation(
        finite=np.bool_(draw(st.booleans())),
        loss_finite=np.bool_(draw(st.booleans())),
        measured=np.bool_(draw(st.booleans())),
        proposed=vector(proposed, "float32"),
        seen=vector(seen, bool),
        **(flags if units is not None else {}),
    )


@st.composite
def scenarios(draw, mode):
    """`(policy, arguments, start state, observations)` for one mode."""
    args = dict(
        update_every=draw(st.integers(1, 5)),
        growth_steps=draw(st.integers(1, 5)),
        hysteresis=draw(st.integers(1, 3)),
        log2_min=float(draw(st.integers(-32, 0))),
        log2_max=float(draw(st.integers(1, 64))),
        max_rise=draw(st.one_of(st.none(), st.integers(1, 10)))
        if mode in CAPPING_MODES else None,
    )
    lo, hi = int(args["log2_min"]), int(args["log2_max"])
    units = draw(st.integers(1, 4)) if mode == "per_layer" else None
    scales, ceilings = [], []
    for _ in range(1 if units is None else units):
        scale = 0 if mode == "none" else draw(st.integers(lo, hi))
        scales.append(float(scale))
        ceilings.append(draw(st.one_of(st.just(NO_CAP), st.integers(scale, hi).map(float))))
    as_state = (lambda v: np.float32(v[0])) if units is None else (
        lambda v: np.asarray(v, "float32"))
    start = sp.ScaleState(
        log2_scale=as_state(scales),
        log2_ceiling=as_state(ceilings),
        growth_count=np.int32(draw(st.integers(0, args["growth_steps"] - 1))),
        overflow_streak=np.int32(draw(st.integers(0, 10))),
        steps_to_measure=np.int32(draw(st.integers(0, args["update_every"] - 1))),
        calibrated=np.bool_(draw(st.booleans())),
    )
    # Lengths drawn first: plain `st.lists` keeps most sequences short.
    length = draw(st.integers(1, 40))
    steps = draw(st.lists(observations(units), min_size=length, max_size=length))
    return sp.make_policy(mode, **args), args, start, steps


def _values(state):
    return sp.ScaleState(*(np.asarray(v) for v in state))


def _same(a, b):
    return all(
        np.array_equal(x, y, equal_nan=np.issubdtype(x.dtype, np.floating))
        for x, y in zip(_values(a), _values(b))
    )


def _check_transition(mode, args, prev, obs, new):
    lo, hi = args["log2_min"], args["log2_max"]
    scale = new.log2_scale.astype("float64")
    ceiling = new.log2_ceiling.astype("float64")

    # The scale: a finite integer within the bounds.
    assert np.all(np.isfinite(scale)), scale
    assert np.all(scale == np.round(scale)), scale
    assert np.all((lo <= scale) & (scale <= hi)), (scale, lo, hi)
    if mode == "none":
        assert np.all(scale == 0)
    if mode == "static":
        np.testing.assert_array_equal(new.log2_scale, prev.log2_scale)

    # The ceiling: no cap, or a cap within the bounds at or above the scale.
    if mode in CAPPING_MODES:
        assert np.all(np.isfinite(ceiling) & (ceiling == np.round(ceiling))), ceiling
        capped = (scale <= ceiling) & (lo <= ceiling) & (ceiling <= hi)
        assert np.all((ceiling == NO_CAP) | capped), (scale, ceiling, lo, hi)
    else:
        np.testing.assert_array_equal(new.log2_ceiling, prev.log2_ceiling)

    # Counters.
    assert new.growth_count >= 0 and new.overflow_streak >= 0
    assert 0 <= new.steps_to_measure < args["update_every"]
    if mode == "dynamic":
        assert new.growth_count < args["growth_steps"]
    if prev.calibrated:
        assert new.calibrated
    if mode in CAPPING_MODES:
        took = bool(obs.finite and obs.measured and np.any(obs.seen))
        assert bool(new.calibrated) == bool(prev.calibrated or took)

    finite, loss_finite = bool(obs.finite), bool(obs.loss_finite)
    overflow = not finite and loss_finite
    if not finite and not loss_finite:
        # Bad data: nothing backs off; only the countdown moves.
        expected = prev._replace(
            steps_to_measure=np.asarray(max(int(prev.steps_to_measure) - 1, 0))
        )
        for name, want, got in zip(sp.ScaleState._fields, expected, new):
            np.testing.assert_array_equal(got, want, err_msg=f"bad data moved {name}")
    elif finite:
        assert new.overflow_streak == 0
        if mode == "dynamic":
            assert np.all(scale >= prev.log2_scale)  # a clean step never lowers
        if mode in CAPPING_MODES and not obs.measured:
            np.testing.assert_array_equal(new.log2_scale, prev.log2_scale)
    if overflow:
        assert new.steps_to_measure == 0  # an overflow measures next
        if mode in STREAK_MODES:
            assert new.overflow_streak == prev.overflow_streak + 1
        due = (int(prev.overflow_streak) + 1) % args["hysteresis"] == 0
        before = prev.log2_scale.astype("float64")
        if mode in ("dynamic", "adaptive"):
            if due:
                assert scale < before or before == lo, (before, scale)
            else:
                assert scale == before, (before, scale)
            if mode == "dynamic":
                assert new.growth_count == 0
        if mode == "per_layer":
            if not obs.measured:
                np.testing.assert_array_equal(new.log2_scale, prev.log2_scale)
            elif due:
                origins = np.asarray(obs.origins, bool)
                backed = (scale < before) | (before == lo)
                assert np.all(backed[origins]), (before, scale, origins)


@pytest.mark.parametrize("mode", MODES)
@_settings(max_examples=50)
@given(data=st.data())
def test_every_transition_keeps_the_scale_bounded_and_bad_data_never_backs_off(
    mode, data
):
    policy, args, state, steps = data.draw(scenarios(mode))
    for step, obs in enumerate(steps):
        new = _values(policy.next_state(state, obs))
        try:
            _check_transition(mode, args, _values(state), obs, new)
            if obs.finite:
                # With finite gradients the loss's finiteness is irrelevant.
                flipped = obs._replace(loss_finite=np.bool_(not obs.loss_finite))
                assert _same(policy.next_state(state, flipped), new)
        except AssertionError as error:
            raise AssertionError(
                f"step {step}: {obs}\nfrom {_values(state)}\nto {new}"
            ) from error
        state = new


# 2. The optimizer.

GRADIENT_ELEMENTS = st.integers(-4000, 4000).map(lambda i: i / 4.0)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
SHAPES = [(3,), (2, 2)]


@st.composite
def optimizer_steps(draw):
    kind = draw(st.sampled_from(["finite", "non_finite", "bad_data"]))
    grads = [
        np.asarray([draw(GRADIENT_ELEMENTS) for _ in range(math.prod(s))], "float32")
        .reshape(s)
        for s in SHAPES
    ]
    if kind != "finite":
        which = draw(st.integers(0, len(SHAPES) - 1))
        index = draw(st.integers(0, grads[which].size - 1))
        grads[which].reshape(-1)[index] = draw(NON_FINITE)
    return kind, grads


@pytest.mark.parametrize("mode", ["adaptive", "dynamic", "static"])
@_settings(max_examples=25)
@given(
    log2_bounds=st.tuples(st.integers(-16, 0), st.integers(1, 24)),
    initial=st.integers(-16, 24),
    hysteresis=st.integers(1, 2),
    update_every=st.integers(1, 3),
    growth_steps=st.integers(1, 3),
    learning_rate=st.sampled_from([1.0, 0.5, 0.1, 2.0**-5]),
    steps=st.integers(1, 8).flatmap(
        lambda n: st.lists(optimizer_steps(), min_size=n, max_size=n)
    ),
)
def test_skipped_steps_change_nothing_and_counters_count(
    mode, log2_bounds, initial, hysteresis, update_every, growth_steps,
    learning_rate, steps,
):
    keras.mixed_precision.set_global_policy("float32")
    lo, hi = log2_bounds
    initial = min(max(initial, lo), hi)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(learning_rate),
        scaling=mode,
        initial_scale=2.0**initial,
        min_scale=2.0**lo,
        max_scale=2.0**hi,
        hysteresis=hysteresis,
        update_every=update_every,
        dynamic_growth_steps=growth_steps,
    )
    variables = [
        keras.Variable(np.linspace(-1.0, 1.0, math.prod(s), dtype="float32").reshape(s))
        for s in SHAPES
    ]
    lr = np.float32(learning_rate)
    skipped = applied = 0
    # Keras's dynamic rule, replayed: clean steps since growth, overflows.
    count = streak = 0
    for number, (kind, grads) in enumerate(steps, start=1):
        before = [v.numpy().copy() for v in variables]
        scale = float(opt.loss_scale.numpy())
        # Adaptive, uncalibrated, measuring, below the maximum: an all-zero
        # gradient tells nothing; the step is skipped and the scale rises.
        blind = (
            mode == "adaptive" and kind == "finite"
            and not any(np.any(g) for g in grads)
            and not (opt.built and bool(opt.calibrated.numpy()))
            and (not opt.built or int(opt.steps_to_measure.numpy()) == 0)
            and scale < 2.0**hi
        )
        if kind == "bad_data":
            opt.scale_loss(keras.ops.convert_to_tensor(np.float32(math.nan)))
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
        after = [v.numpy() for v in variables]
        if blind:
            skipped += 1
            for b, a in zip(before, after):
                np.testing.assert_array_equal(a, b)
        elif kind == "finite":
            applied += 1
            divisor = np.float32(1.0 / scale)  # exact: a power of two
            for b, a, g in zip(before, after, grads):
                np.testing.assert_array_equal(a, b - lr * (g * divisor))
        else:
            skipped += 1
            for b, a in zip(before, after):
                np.testing.assert_array_equal(a, b)  # bitwise, NaN-free
        new_scale = float(opt.loss_scale.numpy())
        if blind:
            streak = 0
            assert new_scale == min(scale * 2.0**8, 2.0**hi)
        elif kind == "bad_data":
            assert new_scale == scale, "bad data backed the scale off"
        elif kind == "non_finite":
            streak += 1
            due = streak % hysteresis == 0
            if mode == "dynamic":
                count = 0  # any overflow restarts the growth count
                assert new_scale == (max(scale / 2, 2.0**lo) if due else scale)
            elif mode == "adaptive":  # halves or drops, floored
                assert (new_scale < scale or scale == 2.0**lo) if due else new_scale == scale
        else:
            streak = 0
            if mode == "dynamic":
                count += 1
                grow = count >= growth_steps
                count = 0 if grow else count
                assert new_scale == (min(2 * scale, 2.0**hi) if grow else scale)
        if mode == "static":
            assert new_scale == 2.0**initial
        assert int(opt.skipped_steps.numpy()) == skipped
        assert int(opt.total_steps.numpy()) == number
        assert int(opt.iterations.numpy()) == applied
        exponent = math.log2(new_scale)
        assert math.isfinite(new_scale) and exponent == round(exponent), new_scale
        assert lo <= exponent <= hi, (new_scale, lo, hi)


@pytest.mark.parametrize("mode", ["adaptive", "dynamic", "static"])
def test_a_step_whose_loss_was_not_finite_is_skipped(mode):
    """The optimizer's docstring: "A step whose loss was not finite is bad
    data: it is skipped without backing the scale off." Here the loss is NaN
    and the gradients finite (a loss term with no gradient path)."""
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.5), scaling=mode, initial_scale=4.0
    )
    variable = keras.Variable(np.ones(3, "float32"))
    opt.scale_loss(keras.ops.convert_to_tensor(np.float32(math.nan)))
    opt.apply([np.ones(3, "float32")], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(3, "float32"))
    assert int(opt.skipped_steps.numpy()) == 1


# 3. What `tas.instrument` cannot handle is named, with the reason.


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(2)

    def call(self, x):
        return self.dense(x)


class _Refuses(layers.Layer):
    """Builds once; a second symbolic call (the instrumented graph's) fails."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, x):
        return x

    def compute_output_spec(self, x):
        self.calls += 1
        if self.calls > 1:
            raise NotImplementedError("no second graph for this layer")
        return keras.KerasTensor(x.shape, x.dtype)


def test_a_subclassed_model_is_named_and_refused():
    model = _Subclassed(name="my_subclassed")
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(TypeError, match="(?s)subclassed.*my_subclassed"):
        tas.instrument(model)


def test_a_layer_that_cannot_be_called_again_is_named_with_its_error():
    x = keras.Input((4,))
    model = keras.Model(x, _Refuses(name="refuses")(layers.Dense(4)(x)))
    with pytest.raises(
        ValueError,
        match="(?s)layer 'refuses' \\(_Refuses\\).*NotImplementedError.*no second graph",
    ):
        tas.instrument(model)


def test_an_unbuilt_model_is_named_and_refused():
    model = keras.Sequential([layers.Dense(2)], name="never_built")
    with pytest.raises(ValueError, match="(?s)built.*never_built"):
        tas.instrument(model)


def test_an_already_instrumented_nested_model_is_named_and_refused():
    x = keras.Input((4,))
    inner = tas.instrument(keras.Model(x, layers.Dense(2)(x), name="inner"))
    y = keras.Input((4,))
    outer = keras.Model(y, layers.Dense(1)(inner(y)), name="outer")
    with pytest.raises(ValueError, match="(?s)already instrumented.*inner_instrumented"):
        tas.instrument(outer)
