"""Every argument is validated, naming the argument and what is allowed."""

import pytest
import keras

import tf_adaptive_scale as tas


def make(**kwargs):
    return tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(scaling="auto"), ValueError, "`scaling` must be one of"),
        (dict(initial_scale=-1.0), ValueError, "`initial_scale` must be a positive"),
        (dict(initial_scale=3.0), ValueError, "`initial_scale` must be a power of two"),
        (dict(initial_scale=float("inf")), ValueError, "`initial_scale`"),
        (dict(initial_scale="big"), TypeError, "`initial_scale`"),
        (dict(min_scale=0.0), ValueError, "`min_scale`"),
        (dict(initial_scale=float("nan")), ValueError, "`initial_scale`"),
        (dict(initial_scale=2.0**-140), ValueError, r"`initial_scale` must be a power of two from 2\*\*-126"),
        (dict(initial_scale=2.0**200), ValueError, "`initial_scale`"),
        (dict(min_scale=2.0**-140), ValueError, "`min_scale`"),
        (dict(max_scale=2.0**200), ValueError, "`max_scale`"),
        (dict(scaling="adaptive", max_scale=2.0**10), ValueError, "min_scale <= initial_scale <= max_scale"),
        (dict(scaling="static", min_scale=2.0**16), ValueError, "min_scale <= initial_scale <= max_scale"),
        (dict(scaling="per_layer", min_scale=2.0**16, max_scale=2.0**8), ValueError, "`min_scale` must be <= `max_scale`"),
        (dict(dynamic_growth_steps=0), ValueError, "`dynamic_growth_steps` must be an int >= 1"),
        (dict(dynamic_growth_steps=2.5), TypeError, "`dynamic_growth_steps`"),
        (dict(hysteresis=0), ValueError, "`hysteresis`"),
        (dict(update_every=True), TypeError, "`update_every`"),
        (dict(underflow_rate=0.0), ValueError, "`underflow_rate`"),
        (dict(underflow_rate=1.0), ValueError, r"`underflow_rate` must be in the open interval \(0, 1\)"),
        (dict(headroom=0.5), ValueError, r"`headroom` must be in \[1, 2\*\*15\]"),
        (dict(underflow_criterion="norm"), ValueError, "`underflow_criterion` must be one of"),
        (dict(max_scale_rise=0), ValueError, "`max_scale_rise` must be an int >= 1"),
        (dict(headroom=3.0), ValueError, "`headroom` must be a power of two"),
        (dict(clipnorm=-1.0), ValueError, "`clipnorm`"),
        (dict(clipvalue=0), ValueError, "`clipvalue`"),
        (dict(global_clipnorm="1"), TypeError, "`global_clipnorm`"),
        (dict(autoclip_percentile=0), ValueError, "`autoclip_percentile`"),
        (dict(autoclip_percentile=101), ValueError, r"`autoclip_percentile` must be in \(0, 100\]"),
        (dict(autoclip_window=0), ValueError, "`autoclip_window`"),
        (dict(autoclip_per_variable=1), TypeError, "`autoclip_per_variable` must be a bool"),
        (dict(agc_factor=-0.01), ValueError, "`agc_factor`"),
        (dict(agc_eps=0.0), ValueError, "`agc_eps`"),
        (dict(weight_decay=0.1), ValueError, "does not support `weight_decay`"),
        (dict(bogus=1), ValueError, "does not support arguments: `bogus`"),
    ],
)
def test_bad_argument_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        make(**kwargs)


def test_inner_optimizer_must_be_a_plain_keras_optimizer():
    with pytest.raises(TypeError, match="`inner_optimizer` must be a keras.optimizers.Optimizer"):
        tas.AdaptiveLossScaleOptimizer("adam")
    stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        tas.AdaptiveLossScaleOptimizer(stock)
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        tas.AdaptiveLossScaleOptimizer(make())


def test_per_layer_does_not_check_the_unused_initial_scale():
    opt = make(scaling="per_layer", initial_scale=2.0**15, max_scale=2.0**10)
    assert opt.scaling == "per_layer" and opt.max_scale == 2.0**10


def test_a_deferred_global_mode_checks_initial_scale_when_resolved(float16_policy):
    opt = make(max_scale=2.0**10)
    var = keras.Variable([1.0])
    with pytest.raises(ValueError, match="min_scale <= initial_scale <= max_scale"):
        opt.apply([keras.ops.ones((1,))], [var])


def test_valid_edge_values_are_accepted():
    opt = make(initial_scale=1, min_scale=1, max_scale=1, headroom=1, autoclip_percentile=100)
    assert opt.min_scale == opt.max_scale == 1.0


def test_compile_step_needs_a_built_adaptive_optimizer():
    with pytest.raises(ValueError,
                       match="`optimizer` must be a built tas.AdaptiveLossScaleOptimizer"):
        tas.compile_step(lambda: None, keras.optimizers.SGD())
    with pytest.raises(ValueError, match="call optimizer.build"):
        tas.compile_step(lambda: None, tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()))
