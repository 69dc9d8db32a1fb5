"""The compiled step holds no `conditional`, in any mode, like stock's.

XLA's GPU runtime runs a `conditional` by copying its predicate to the host
and waiting for the stream; on CPU its operands get buffers and layouts of
their own. So the optimized XLA program of every compiled step with
`accumulation_steps=1` (fit's on both backends, `make_train_step`'s and a
custom `GradientTape` loop's on TensorFlow) must hold none: statistics are
taken on every step and kept by selects. Stock's holds none on TensorFlow
and two on JAX; with accumulation the window's last micro-batch decides in
a conditional: the check finds those.
"""

import re

import keras
import numpy as np
import pytest
from helpers import JAX
from helpers import TF
from helpers import census_mlp
from helpers import conv_net
from helpers import optimized_fit_program
from helpers import top_level_kernels

import tf_adaptive_scale as tas

MODES = ["none", "static", "dynamic", "adaptive", "per_layer"]


def conditionals(hlo):
    """The number of `conditional` instructions in an HLO module's text."""
    return len(re.findall(r"\sconditional\(", hlo))


def optimizer_for(mode, **kwargs):
    if mode == "stock":
        return keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())
    return tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling=mode, **kwargs)


def fit_program(model, optimizer, x, y, loss="mse"):
    """The optimized program of fit's step; per layer, of the instrumented model."""
    if isinstance(optimizer, tas.AdaptiveLossScaleOptimizer) and optimizer.scaling == "per_layer":
        model = tas.instrument(model)
    return optimized_fit_program(model, optimizer, x, y, loss)


# The default mode's top-level kernels over stock's in fit's step, at most
# this many on an MLP of depth 4 and of 16 (10 and 34 trainable variables;
# `benchmarks/kernel_census.py`). Before the statistics were batched across
# variables: +142 / +364 on TensorFlow, +132 / +316 on JAX; before the
# scalar state was packed (issue 43): +73 / +80 and +63 / +33; before
# the rule shared its window and one segment sum took counts and squares:
# +58 / +65 and +46 / +16; since the scale window is no longer state
# (issue 44): +40 / +47 and +31 / +1. Issue 43 asks at most 50 (and on the
# CNN): the bound, so that a new scalar of state (2 kernels where written
# every step) fits.
DEFAULT_MODE_EXCESS = {"tensorflow": 50, "jax": 33}


def test_default_mode_adds_a_bounded_number_of_kernels_whatever_the_depth():
    """Counted, not timed (load changes no count): the statistics of every
    weight gradient take a constant number of kernels; what stock's finite
    check takes per gradient (its reduction), the peak pass replaces one
    for one. What remains grows by a concatenation per 8 small gradients
    (XLA on CPU fuses at most 8 operands into one) and a kernel per
    reduction over the variables past 32 (XLA splits it in two)."""
    excess = {}
    for depth in (4, 16):
        kernels = {}
        for mode, make in (("stock", keras.mixed_precision.LossScaleOptimizer),
                           ("adaptive", tas.AdaptiveLossScaleOptimizer)):
            model, x, y = census_mlp(depth)
            kernels[mode] = len(top_level_kernels(
                optimized_fit_program(model, make(keras.optimizers.SGD()), x, y)))
        excess[depth] = kernels["adaptive"] - kernels["stock"]
    assert max(excess.values()) <= DEFAULT_MODE_EXCESS[keras.backend.backend()], excess
    # 24 more variables: at most a third of a kernel each (9.25 before).
    assert excess[16] - excess[4] <= 8, excess


@pytest.mark.parametrize("mode", MODES)
def test_fit_step_holds_no_conditional(mode, float16_policy):
    model, x, y = conv_net()
    hlo = fit_program(model, optimizer_for(mode), x, y)
    assert " convolution(" in hlo  # the whole step, not a part of it
    assert conditionals(hlo) == 0


def _slot_copies(hlo, shapes):
    """The top-level copies in `hlo` of arrays of the given shapes."""
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    copied = re.findall(r"= f32\[([\d,]+)\]\S* copy\(", entry)
    return [c for c in copied if tuple(int(d) for d in c.split(",")) in shapes]


@pytest.mark.parametrize("mode", ["adaptive", "per_layer"])
def test_fit_step_copies_no_optimizer_slot(mode, float16_policy):
    """Adam's slots are updated in place, as in stock's step: on JAX, a
    select of each slot's final value once made XLA copy every slot on
    every step (fit donates the state; 180 MiB a step on ResNet50)."""
    programs = {}
    for name in ("stock", mode):
        model, x, y = census_mlp(4)
        if name == "stock":
            optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())
        else:
            model = tas.instrument(model) if mode == "per_layer" else model
            optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling=mode)
        shapes = {tuple(v.shape) for v in model.trainable_variables if len(v.shape) == 2}
        programs[name] = _slot_copies(optimized_fit_program(
            model, optimizer, x, y, measuring=False, donated=True), shapes)
    assert len(programs[mode]) <= len(programs["stock"]), programs


def test_stock_step_for_reference(float16_policy):
    """Stock's step holds none on TensorFlow (XLA turns its decision into
    selects); on JAX, Keras's own `stateless_apply` decides with
    `lax.cond`, which the check finds."""
    model, x, y = conv_net()
    found = conditionals(fit_program(model, optimizer_for("stock"), x, y))
    assert found > 0 if JAX else found == 0


@pytest.mark.skipif(not TF, reason="gradient accumulation compiles on TensorFlow")
def test_accumulation_keeps_its_window_conditional(float16_policy):
    """The check finds a conditional where there is one on TensorFlow too."""
    model, x, y = conv_net()
    assert conditionals(fit_program(model, optimizer_for("adaptive", accumulation_steps=2),
                                    x, y)) > 0


@pytest.mark.skipif(not TF, reason="make_train_step and tf.function are TensorFlow's")
@pytest.mark.parametrize("mode", ["adaptive", "per_layer"])
def test_make_train_step_and_custom_loop_hold_no_conditional(mode, float16_policy):
    import tensorflow as tf

    model, x, y = conv_net()
    if mode == "per_layer":
        model = tas.instrument(model)
    loss_fn = keras.losses.MeanSquaredError()
    step = tas.make_train_step(model, loss_fn, optimizer_for(mode), jit_compile=True)
    assert conditionals(step.compiled_program(x, y)) == 0

    optimizer = optimizer_for(mode)

    @tf.function(jit_compile=True)
    def custom_step(xb, yb):  # docs/custom_loops.md's GradientTape loop
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    optimizer.build(model.trainable_variables)
    custom_step(x, y)
    hlo = custom_step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")
    assert " convolution(" in hlo and conditionals(hlo) == 0


@pytest.mark.skipif(not TF, reason="one backend suffices for the large model's compile")
def test_instrumented_keras_application_step_holds_no_conditional(float16_policy):
    # VGG16's 13 convolutions (MobileNet's 91 layers took a minute to compile).
    model = keras.applications.VGG16(
        weights=None, include_top=False, input_shape=(32, 32, 3), pooling="avg"
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 32, 32, 3)).astype("float32")
    hlo = fit_program(model, optimizer_for("per_layer"), x, np.array([0, 1], "int32"),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Forward, and both gradients (but the input's).
    assert hlo.count(" convolution(") == 3 * 13 - 1
    assert conditionals(hlo) == 0
