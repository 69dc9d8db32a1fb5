"""Per layer, two compiled programs: measuring and plain (`step_programs`).

The boundaries take the statistics of every activation gradient only in
the measuring program, which runs on the steps the optimizer measures
(every `update_every`, counted on the host); the plain program holds their
multiplies alone. Both backends run `fit`'s tests; `make_train_step` is
TensorFlow's.
"""

import keras
import numpy as np
import pytest
from helpers import TF
from helpers import census_mlp
from helpers import optimized_fit_program
from helpers import top_level_kernels

import tf_adaptive_scale as tas
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.per_layer import step_programs


def test_the_schedule_measures_the_first_calls_then_every_nth_step():
    first = step_programs.CALIBRATION_STEPS
    assert first == 8  # a blind unit's scale from 1 to 2**64, 2**8 a call
    one = step_programs.Schedule(every=3)
    assert [one.next_call_measures() for _ in range(first + 4)] == (
        [True] * first + [False, True, False, False])  # steps 8 to 11
    # Two steps a call: (8, 9), (10, 11), (12, 13) after the first 8.
    two = step_programs.Schedule(every=3, steps_per_call=2)
    assert [two.next_call_measures() for _ in range(first // 2 + 3)] == (
        [True] * (first // 2) + [True, False, True])
    assert [tas.measuring_step(s, 3) for s in range(first, first + 4)] == [
        False, True, False, False]
    # Two micro-batches a step (accumulation), resumed after 16 of them
    # (8 steps): step 8's micro-batches do not measure, step 9's both do.
    resumed = step_programs.Schedule(every=3, micro_batches=2, start=lambda: 16)
    assert [resumed.next_call_measures() for _ in range(4)] == [False, False, True, True]


def instrumented_mlp(update_every):
    """`(instrumented model, per-layer optimizer, x, y)`: the census's MLP
    of depth 3, SGD."""
    model, x, y = census_mlp(3)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.01), scaling="per_layer", update_every=update_every)
    return tas.instrument(model), optimizer, x, y


def training(update_every, steps_per_execution=1, steps=12, programs=True):
    """An instrumented MLP trained by `fit` for `steps` steps; with
    `programs=False` every step runs the measuring program (one program,
    the step before this change)."""
    model, optimizer, x, y = instrumented_mlp(update_every)
    model.compile(optimizer, "mse", jit_compile=True, steps_per_execution=steps_per_execution)
    xs = np.concatenate([x * (1 + 0.1 * i) for i in range(steps)])
    ys = np.concatenate([y] * steps)
    if not programs:
        model.make_train_function()
        model.train_function.schedule.every = 1  # every call measuring
    model.fit(xs, ys, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return model, optimizer


def test_fit_measures_only_in_the_measuring_program(float16_policy):
    # Steps 0 to 7 calibrate, 8 is due, 9 to 11 are plain.
    model, optimizer = training(update_every=4)
    assert sorted(model.train_function.programs) == [False, True]
    assert int(optimizer.measurements) == 3  # steps 0, 4 and 8


def test_the_plain_program_trains_as_the_measuring_one(float16_policy):
    """Where the optimizer measures on schedule (no overflow, no scale
    rising blind), the weights and scales are the one program's, exactly:
    the plain program leaves out what the measuring one computes and then
    drops."""
    model, optimizer = training(update_every=4)
    reference, reference_optimizer = training(update_every=4, programs=False)
    assert sorted(reference.train_function.programs) == [True]
    assert int(optimizer.measurements) == int(reference_optimizer.measurements) == 3
    assert list(model.layer_scales().values()) == list(reference.layer_scales().values())
    # The table's `statistics` differ by design: a plain step keeps the
    # last measured ones, a measuring step that did not measure zeros them.
    weights = [[v.numpy() for v in m.weights if not gradient_scale.written_by_optimizer(v)]
               for m in (model, reference)]
    assert len(weights[0]) == 8
    for got, want in zip(*weights):
        np.testing.assert_array_equal(got, want)


def test_a_plain_first_call_leaves_the_measuring_program_its_own(float16_policy):
    """A resumed run's first call can be plain: the measuring program traced
    after it still measures (JAX caches traces by function: both programs
    ran the plain trace, and a resumed run stopped measuring)."""
    model, optimizer, x, y = instrumented_mlp(update_every=3)
    model.compile(optimizer, "mse", jit_compile=True)
    model.make_train_function()
    model.train_function.schedule.restart(8)  # steps 8 (plain) and 9 (measuring)
    model.train_on_batch(x, y)
    assert int(optimizer.measurements) == 0
    model.train_on_batch(x, y)
    assert int(optimizer.measurements) == 1


def test_steps_per_execution_measures_in_calls_holding_a_due_step(float16_policy):
    # Two steps a call: the first 4 calls (steps 0 to 7) calibrate, then
    # (10, 11) and (16, 17) hold no multiple of 3, the others do.
    model, optimizer = training(update_every=3, steps_per_execution=2, steps=20)
    assert sorted(model.train_function.programs) == [False, True]
    assert int(optimizer.measurements) == 7  # steps 0, 3, ..., 18


# The per-layer plain program's kernels over stock's (on the uninstrumented
# model), at most this many on an MLP of depth 4 and 16 (6 and 18
# boundaries): the boundaries' multiplies fuse into the backward pass;
# what remains is the optimizer's state written on every step, and the
# copy of the device's request to measure among the step's outputs.
PLAIN_EXCESS = {"tensorflow": 20, "jax": 13}


def test_the_plain_program_adds_a_constant_over_stock(float16_policy):
    """Counted (`benchmarks/kernel_census.py`): the measuring program adds
    the boundaries' statistics (+131 / +223 at depth 4 / 16); the plain one
    a constant, whatever the number of boundaries."""
    excess = {}
    for depth in (4, 16):
        kernels = {}
        for measuring in (True, False):
            model, x, y = census_mlp(depth)
            optimizer = tas.AdaptiveLossScaleOptimizer(
                keras.optimizers.SGD(), scaling="per_layer", update_every=100)
            kernels[measuring] = len(top_level_kernels(optimized_fit_program(
                tas.instrument(model), optimizer, x, y, measuring=measuring)))
        model, x, y = census_mlp(depth)
        stock = len(top_level_kernels(optimized_fit_program(
            model, keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()), x, y)))
        excess[depth] = kernels[False] - stock
        assert kernels[True] - kernels[False] > 50 + 5 * depth  # the statistics
    assert max(excess.values()) <= PLAIN_EXCESS[keras.backend.backend()], excess


@pytest.mark.skipif(not TF, reason="make_train_step is TensorFlow's")
def test_make_train_step_runs_two_programs(float16_policy):
    model, optimizer, x, y = instrumented_mlp(update_every=4)
    step = tas.make_train_step(model, keras.losses.MeanSquaredError(), optimizer)
    for _ in range(12):
        step(x, y)
    assert step.tracing_count() == 2  # one trace of each program
    assert int(optimizer.measurements) == 3


@pytest.mark.skipif(not TF, reason="tf.function is TensorFlow's")
def test_a_custom_loop_passes_the_flag(float16_policy):
    """docs/per_layer.md's loop: a Python bool argument, a trace each."""
    import tensorflow as tf

    model, optimizer, x, y = instrumented_mlp(update_every=4)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=True)
    def train_step(xb, yb, measure):
        with tas.measuring(measure):
            with tf.GradientTape() as tape:
                scaled = optimizer.scale_loss(loss_fn(yb, model(xb, training=True)))
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

    for step in range(12):
        train_step(x, y, tas.measuring_step(step, optimizer.update_every))
    assert train_step.experimental_get_tracing_count() == 2
    assert int(optimizer.measurements) == 3
