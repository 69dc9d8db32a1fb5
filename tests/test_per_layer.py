"""Per-layer scaling in training: the rule, statistics on update steps only,
overflow attribution, fit/XLA, custom loops (docs/per_layer.md's,
make_train_step), float64 models, save/load, checkpoints and a model saved on
one backend loaded on the other. (A unit far below the loss, beyond the global
bound: `test_fit.py`, on both backends.)"""

import contextlib
import inspect
import io
import math
import os
import re

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.per_layer import gradient_scale as gs
from helpers import build, conv_net, head_on, normal, optimized_fit_program, run_python
from helpers import dense_model, set_random_scales, shared_backbone


def per_layer_optimizer(inner=None, **kwargs):
    return tas.AdaptiveLossScaleOptimizer(
        inner or keras.optimizers.Adam(1e-2), scaling="per_layer", **kwargs
    )


def test_rule_matches_hand_computed_scale(float16_policy):
    """One Dense unit whose output gradient is a known tensor T."""
    rng = np.random.default_rng(0)
    # 32x8 output gradient: 5% of the entries tiny (2**-36), the rest 2**-12..2**-8.
    t = (2.0 ** rng.integers(-12, -8, (32, 8)) * rng.choice([-1, 1], (32, 8))).astype("float32")
    t[rng.random((32, 8)) < 0.05] = 2.0**-36
    x = rng.standard_normal((32, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, use_bias=False)])
    inst = tas.instrument(model)
    opt = per_layer_optimizer(keras.optimizers.SGD(0.0), underflow_rate=0.01, headroom=16.0)
    opt.build(inst.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(inst(x) * t)  # d loss / d output = t, exactly
    opt.apply(tape.gradient(loss, inst.trainable_variables), inst.trainable_variables)

    # By hand: the unit holds its output gradient t (its input is the model
    # input: no boundary) and its kernel gradient x^T t.
    nonzero = np.abs(t[t != 0])
    exponents = np.floor(np.log2(nonzero))
    peak = max(nonzero.max(), np.abs(x.T @ t).max())
    high = math.floor(math.log2(65504 / peak))
    low = min(
        k for k in range(-40, 60) if np.mean(exponents + k < -24) <= 0.01
    )
    expected = min(max(high - 4, low), high)
    assert low == 12  # 2**-36 * 2**12 = 2**-24: the 5% tail fits from 2**12 on
    assert inst.layer_scales() == {model.layers[0].name: 2.0**expected}
    histogram = inst.scale_table.statistics.numpy()[1, : gs.OUTPUT_MAX]
    assert histogram.sum() == t.size


def test_statistics_only_on_update_steps():
    model, x, y = build("residual", "mixed_float16")
    inst = tas.instrument(model)
    opt = per_layer_optimizer(update_every=3)
    inst.compile(opt, "mse", jit_compile=True)
    sums = []
    for i in range(5):
        inst.train_on_batch(x, y["first"] if isinstance(y, dict) else y)
        sums.append(float(inst.scale_table.statistics.numpy()[:, : gs.OUTPUT_MAX].sum()))
    # Steps 0 and 3 measure histograms; 1, 2 and 4 do not.
    assert [s > 0 for s in sums] == [True, False, False, True, False]
    assert int(opt.skipped_steps) == 0


def unit_of(inst, name):
    return inst.scale_table.unit_names.index(name)


def low_mid_top():
    """Three Dense units, instrumented (the tests build it under `float16_policy`)."""
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, name="low"), keras.layers.Dense(8, name="mid"),
         keras.layers.Dense(2, name="top")]
    )
    return model, tas.instrument(model)


def test_overflow_is_attributed_to_the_unit_where_it_started(float16_policy):
    model, inst = low_mid_top()
    table = inst.scale_table
    log2 = np.array([0, 2, 40, 2], "float32")  # converting into "mid" overflows float16
    table.log2_scales.assign(log2)
    opt = per_layer_optimizer(keras.optimizers.SGD(0.1), update_every=10**6, max_scale=2.0**60)
    inst.compile(opt, "mse", jit_compile=True)
    before = [w.copy() for w in model.get_weights()]
    inst.train_on_batch(np.ones((4, 8), "float32"), np.ones((4, 2), "float32"))
    assert int(opt.skipped_steps) == 1
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    stats = table.statistics.numpy()
    assert stats[unit_of(inst, "mid"), gs.CONVERSION_OVERFLOW] == 1
    low, mid, top = (unit_of(inst, n) for n in ("low", "mid", "top"))
    scales = table.log2_scales.numpy()
    # Bounded by the rule measured on this very step, then halved, and capped.
    assert scales[mid] < 39 and table.log2_ceilings.numpy()[mid] == scales[mid]
    assert scales[low] == 2  # received the overflow: kept
    assert (table.log2_ceilings.numpy()[[low, top]] == float16.NO_CAP_EXPONENT).all()  # nobody else capped
    assert float(table.measure.numpy()) == 1.0  # and the next step measures again


def test_overflow_on_a_step_that_does_not_measure_is_diagnosed_next_step(float16_policy):
    model, inst = low_mid_top()
    table = inst.scale_table
    opt = per_layer_optimizer(keras.optimizers.SGD(0.1), update_every=10**6, max_scale=2.0**60)
    inst.compile(opt, "mse", jit_compile=True)
    x, y = np.ones((4, 8), "float32"), np.ones((4, 2), "float32")
    inst.train_on_batch(x, y)  # the first, measured step
    log2 = np.array([0, 2, 40, 2], "float32")
    table.log2_scales.assign(log2)
    assert float(table.measure.numpy()) == 0.0
    inst.train_on_batch(x, y)  # overflows without statistics: nothing to blame yet
    assert int(opt.skipped_steps) == 1
    np.testing.assert_array_equal(table.log2_scales.numpy(), log2)
    assert float(table.measure.numpy()) == 1.0
    inst.train_on_batch(x, y)  # measured: the repeat is attributed to "mid"
    assert int(opt.skipped_steps) == 2
    ceilings = table.log2_ceilings.numpy()
    # Only "mid" is capped (the others are at or above max_scale: no cap).
    assert ceilings[unit_of(inst, "mid")] < 39 and (np.delete(ceilings, unit_of(inst, "mid")) >= 60).all()


def test_overflow_inside_a_layer_backward_blames_that_layer(float16_policy):
    model = keras.Sequential(
        # Small activations into "big", whose large weights blow up only the
        # backward pass: dx = dy W^T.
        [keras.Input((64,)),
         keras.layers.Dense(64, name="low", kernel_initializer=keras.initializers.Constant(1e-4)),
         keras.layers.Dense(64, name="big", kernel_initializer=keras.initializers.Constant(1e3)),
         keras.layers.Dense(1, name="top", kernel_initializer=keras.initializers.Constant(1e-3))]
    )
    inst = tas.instrument(model)
    table = inst.scale_table
    table.log2_scales.assign(np.array([0, 0, 8, 0], "float32"))  # "big"'s dx = dy W overflows
    opt = per_layer_optimizer(keras.optimizers.SGD(0.0), update_every=10**6)
    inst.compile(opt, "mse", jit_compile=True)
    inst.train_on_batch(np.ones((4, 64), "float32"), np.full((4, 1), 1e-2, "float32"))
    stats = table.statistics.numpy()
    assert stats[unit_of(inst, "big"), gs.PRODUCED_NON_FINITE] == 1
    assert stats[unit_of(inst, "low"), gs.RECEIVED_NON_FINITE] == 1
    ceilings = table.log2_ceilings.numpy()
    assert ceilings[unit_of(inst, "big")] <= 7 and (np.delete(ceilings, unit_of(inst, "big")) == float16.NO_CAP_EXPONENT).all()
    # "low" received it. Before any clean measurement (this is the first
    # step) it drops below "big" too, for the next step to measure it.
    low = table.log2_scales.numpy()[unit_of(inst, "low")]
    assert low <= table.log2_scales.numpy()[unit_of(inst, "big")] - 8


def test_overflow_of_the_unused_input_gradient_skips_nothing(float16_policy):
    model = keras.Sequential(
        [keras.Input((64,)),
         keras.layers.Dense(64, name="big", kernel_initializer=keras.initializers.Constant(1e3)),
         keras.layers.Dense(1, name="top", kernel_initializer=keras.initializers.Constant(1e-3))]
    )
    inst = tas.instrument(model)
    inst.scale_table.log2_scales.assign(np.array([0, 12, 0], "float32"))
    x, y = np.full((4, 64), 1e-3, "float32"), np.full((4, 1), 1e-2, "float32")
    x_var = tf.Variable(x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(inst(x_var) - y))
    assert not np.isfinite(tape.gradient(loss, x_var).numpy()).all()  # dx = dy W^T overflows
    opt = per_layer_optimizer(keras.optimizers.SGD(1e-3))
    inst.compile(opt, "mse", jit_compile=True)
    before = [w.copy() for w in model.get_weights()]
    inst.train_on_batch(x, y)  # measured (the first step)
    assert int(opt.skipped_steps) == 0
    after = model.get_weights()
    assert all(np.isfinite(w).all() for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("jit", [True, False])
def test_fit_learns_like_float32_and_skips_nothing(jit):
    reference, x, y = build("transformer", "float32")
    reference.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=jit)
    ref_loss = reference.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0).history["loss"]
    model, _, _ = build("transformer", "mixed_float16")
    inst = tas.instrument(model)
    opt = per_layer_optimizer(keras.optimizers.Adam(1e-3), update_every=2)
    inst.compile(opt, "mse", jit_compile=jit)
    loss = inst.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0).history["loss"]
    assert int(opt.skipped_steps) == 0 and int(opt.iterations) == 8
    np.testing.assert_allclose(loss, ref_loss, rtol=0.01)
    assert len(set(inst.layer_scales().values())) > 1  # the layers did pick different scales
    assert opt.layer_scales() == inst.layer_scales()


def test_custom_loop_traced_once_with_xla():
    model, x, y = build("shared_and_concat", "mixed_float16")
    inst = tas.instrument(model)
    opt = per_layer_optimizer(keras.optimizers.SGD(0.05), update_every=2)
    variables = inst.trainable_variables  # all of them, `statistics` included
    opt.build(variables)
    traces = []

    @tf.function(jit_compile=True)
    def step(xb, yb):  # docs/per_layer.md's loop
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(inst(xb, training=True) - yb))
            scaled = opt.scale_loss(loss)  # the identity: scales live in the model
        opt.apply(tape.gradient(scaled, variables), variables)
        return loss

    losses = [float(step(x, y)) for _ in range(6)]
    assert len(traces) == 1 and losses[-1] < losses[0]
    assert int(opt.total_steps) == 6 and int(opt.skipped_steps) == 0


def boundaries(inst):
    return sum(isinstance(layer, tas.GradientScale) for layer in inst.layers)


def measured_boundaries(inst):  # all but those on the model's inputs
    return sum(
        isinstance(layer, tas.GradientScale) and layer.producer != gs.LOSS_UNIT
        for layer in inst.layers
    )


CONDITIONALS = {"If", "StatelessIf"}


def test_measured_edges_share_statistics_functions_with_no_conditional():
    """Every measured edge calls a statistics function shared by the edges
    of its dtype and shape (traced once for all: the first step's cost),
    which holds no conditional and no layer's work (matmul, convolution)."""
    model, x, y = build("convolutional", "mixed_float16")
    inst = tas.instrument(model)
    variables = inst.trainable_variables

    @tf.function
    def forward_backward():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(inst(x, training=True) - y))
        return tape.gradient(loss, variables)

    concrete = forward_backward.get_concrete_function()
    graph = concrete.graph.as_graph_def()
    functions = {f.signature.name: f for f in graph.library.function}
    bodies = [graph.node] + [f.node_def for f in functions.values()]
    assert not [n for body in bodies for n in body if n.op in CONDITIONALS]
    calls = [op for op in concrete.graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")
             and "rows" in op.get_attr("f").name]
    assert len(calls) == measured_boundaries(inst) > 0
    kinds = {(op.inputs[0].dtype, tuple(op.inputs[0].shape)) for op in calls}
    assert len({op.get_attr("f").name for op in calls}) == len(kinds) < len(calls)
    # Gradients enter unflattened (this model has no rank-1 activations): a
    # reshape outside made XLA transpose non-row-major gradients every step.
    assert min(op.inputs[0].shape.rank for op in calls) > 1
    heavy = ("MatMul", "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "BatchMatMulV2")
    for op in calls:
        body = functions[op.get_attr("f").name]
        assert not [n.op for n in body.node_def if n.op in heavy]


def computations_under_conditionals(hlo):
    """Names of the computations a conditional runs, transitively."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if header and line.rstrip().endswith("{"):
            name = header.group(1)
            bodies[name] = []
        elif name:
            bodies[name].append(line)
    called = lambda text: set(re.findall(r"%([\w.\-]+)", text)) & set(bodies)
    pending = set()
    for lines in bodies.values():
        for line in lines:
            if " conditional(" in line:
                pending |= called(line.split("conditional(", 1)[1].split(")", 1)[1])
    seen = set()
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            pending |= called("\n".join(bodies[name]))
    return {name: bodies[name] for name in seen}


def test_compiled_per_layer_step_holds_stocks_convolutions_and_no_conditional(float16_policy):
    """XLA on CPU compiles convolutions inside a conditional as naive loops
    (50x slower): the per-layer step holds none, and every convolution of
    the stock step."""
    model, x, y = conv_net()
    stock_hlo = optimized_fit_program(model, keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()), x, y)
    inst = tas.instrument(model)
    hlo = optimized_fit_program(inst, per_layer_optimizer(keras.optimizers.SGD()), x, y)
    assert " conditional(" not in hlo
    assert hlo.count(" convolution(") == stock_hlo.count(" convolution(") > 0


@pytest.mark.parametrize("per_layer", [False, True], ids=["adaptive", "per_layer"])
def test_weight_update_compiles_to_selects_as_stock(per_layer, float16_policy):
    """The apply-or-skip decision becomes selects fused with the update, as
    for the stock optimizer, not a conditional holding the whole update (a
    scatter in its skip branch kept one: slower on CPU, a host sync on GPU).
    Adam's sqrt on the 5x7 kernel's slot marks the update."""
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(2)])
    x = np.random.default_rng(0).standard_normal((4, 5)).astype("float32")
    y = np.ones((4, 2), "float32")
    update = re.compile(r"= f32\[5,7\]\S* sqrt\(")
    stock = optimized_fit_program(model, keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam()), x, y)
    assert update.search(stock) and not [
        line for body in computations_under_conditionals(stock).values()
        for line in body if update.search(line)
    ]
    if per_layer:
        model, optimizer = tas.instrument(model), per_layer_optimizer(keras.optimizers.Adam())
    else:
        optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    hlo = optimized_fit_program(model, optimizer, x, y)
    assert update.search(hlo)
    assert not [
        line for body in computations_under_conditionals(hlo).values()
        for line in body if update.search(line)
    ]


def test_instrumented_model_traces_its_first_step_once(float16_policy):
    """`compile` builds the optimizer, so the first step creates no variable
    and TensorFlow traces it once, not twice (stock Keras builds it inside
    the first trace); building again changes nothing."""
    model, x, y = conv_net()
    inst = tas.instrument(model)
    optimizer = per_layer_optimizer()
    inst.compile(optimizer, "mse", jit_compile=True)
    assert optimizer.built
    count = len(optimizer.variables)
    optimizer.build(inst.trainable_variables)
    assert len(optimizer.variables) == count
    with pytest.raises(ValueError, match="already built"):
        optimizer.build(inst.trainable_variables[:1])
    traces = []
    train_step = inst.train_step

    def counted(data):
        traces.append(1)
        return train_step(data)

    inst.train_step = counted
    inst.train_on_batch(x, y)
    inst.train_on_batch(x, y)
    assert len(traces) == 1


def test_fit_updates_batch_norm_statistics_as_float32_does():
    reference, x, y = build("convolutional", "float32")
    weights = reference.get_weights()
    model, _, _ = build("convolutional", "mixed_float16")
    model.set_weights(weights)
    inst = tas.instrument(model)
    reference.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True)
    inst.compile(per_layer_optimizer(keras.optimizers.SGD(0.01), update_every=2),
                 "mse", jit_compile=True)
    for m in (reference, inst):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    (ref_bn,) = [l for l in reference.layers if isinstance(l, keras.layers.BatchNormalization)]
    (bn,) = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    moved = np.abs(ref_bn.moving_mean.numpy()).max()
    assert moved > 0
    np.testing.assert_allclose(bn.moving_mean.numpy(), ref_bn.moving_mean.numpy(), atol=1e-2 * moved)
    np.testing.assert_allclose(bn.moving_variance.numpy(), ref_bn.moving_variance.numpy(), rtol=1e-3)


def trained(steps=4):
    model, x, y = build("residual", "mixed_float16")
    inst = tas.instrument(model)
    opt = per_layer_optimizer(update_every=2, autoclip_percentile=50.0)
    inst.compile(opt, "mse", jit_compile=False)  # XLA is covered above
    inst.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return inst, x, y


def test_save_and_load_restore_every_scale_and_resume(tmp_path):
    inst, x, y = trained()
    path = str(tmp_path / "per_layer.keras")
    inst.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is tas.InstrumentedModel
    assert loaded.layer_scales() == inst.layer_scales()
    for a, b in zip(loaded.scale_table.weights, inst.scale_table.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert all(loaded.scale_table.unit_of(v) is not None for v in loaded.trainable_variables
               if not hasattr(v, "scale_table") and not hasattr(v, "scale_state"))
    for model in (inst, loaded):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(loaded.get_weights(), inst.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert loaded.layer_scales() == inst.layer_scales()


def test_checkpoint_restores_every_scale(tmp_path):
    inst, x, y = trained()
    prefix = tf.train.Checkpoint(model=inst, optimizer=inst.optimizer).save(str(tmp_path / "c"))
    scales = inst.layer_scales()
    inst.scale_table.log2_scales.assign(np.zeros_like(inst.scale_table.log2_scales.numpy()))
    tf.train.Checkpoint(model=inst, optimizer=inst.optimizer).restore(prefix).assert_consumed()
    assert inst.layer_scales() == scales


class TwoBlockNet(keras.Model):
    """A subclassed model: per-layer scaling comes from instrumented blocks."""

    def __init__(self, encoder, decoder, head):
        super().__init__()
        self.encoder, self.decoder, self.head = encoder, decoder, head

    def call(self, x):
        h = self.encoder(x)
        return self.head(self.decoder(h) + h)


def blocks(policy):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(3)
    encoder = dense_model(6, (8, "tanh"), 8, sequential=True)
    x = keras.Input((8,))
    decoder = keras.Model(x, keras.layers.Dense(8)(keras.layers.Dense(8, activation="relu")(x)))
    return encoder, decoder, keras.layers.Dense(2)


def test_subclassed_model_with_instrumented_blocks_is_exact():
    encoder, decoder, head = blocks("float32")
    plain = TwoBlockNet(encoder, decoder, head)
    net = TwoBlockNet(tas.instrument(encoder), tas.instrument(decoder), head)
    x = np.random.default_rng(0).standard_normal((16, 6)).astype("float32")
    np.testing.assert_allclose(net(x), plain(x), rtol=1e-6)
    rng = np.random.default_rng(1)
    for block in (net.encoder, net.decoder):
        set_random_scales(block, rng, 10)

    def grads(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        return dict(zip([id(v) for v in model.trainable_variables],
                        tape.gradient(loss, model.trainable_variables)))

    reference, got = grads(plain), grads(net)
    for v in plain.trainable_variables:
        (table,) = [b.scale_table for b in (net.encoder, net.decoder) if b.scale_table.unit_of(v) is not None] or [None]
        scale = 1.0 if table is None else 2.0 ** table.log2_scales.numpy()[table.unit_of(v)]
        np.testing.assert_allclose(got[id(v)].numpy() / scale, reference[id(v)].numpy(), rtol=1e-6, atol=1e-7)


def test_subclassed_model_with_instrumented_blocks_trains_in_float16():
    encoder, decoder, head = blocks("mixed_float16")
    net = TwoBlockNet(tas.instrument(encoder), tas.instrument(decoder), head)
    opt = per_layer_optimizer(keras.optimizers.Adam(1e-2), update_every=2)
    net.compile(opt, "mse", jit_compile=True)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((64, 6)).astype("float32"), rng.standard_normal((64, 2)).astype("float32")
    losses = net.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0
    assert set(opt.layer_scales()) == set(net.encoder.layer_scales()) | set(net.decoder.layer_scales())


def test_units_whose_gradient_all_underflowed_rise_at_once(float16_policy):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(4, name="b")])
    inst = tas.instrument(model)
    opt = per_layer_optimizer(keras.optimizers.SGD(0.0), update_every=100, max_scale=2.0**24)
    variables = inst.trainable_variables
    opt.build(variables)
    x = np.ones((8, 4), "float32")
    history = []
    for _ in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(inst(x)) * 2.0**-40
        opt.apply(tape.gradient(loss, variables), variables)
        history.append(inst.layer_scales())
    # Step 1: "b" sees its float32 output gradient (2**-40) and takes the top
    # scale; "a" gets b's float16 input gradient at scale 1, all underflowed,
    # so it rises by 2**8 and the next step measures again (not 100 later).
    assert history[0] == {"a": 2.0**8, "b": 2.0**24}
    assert history[1]["a"] > 2.0**8 and history[1]["b"] == 2.0**24
    assert history[2] == history[3] and float(inst.scale_table.measure.numpy()) == 0.0
    assert int(opt.skipped_steps) == 0


def test_fresh_optimizer_on_a_trained_instrumented_model_measures():
    inst, x, y = trained()
    table = inst.scale_table
    table.log2_scales.assign(np.zeros_like(table.log2_scales.numpy()))
    table.measure.assign(0.0)  # as left by an earlier optimizer mid-cycle
    opt = per_layer_optimizer(update_every=100)
    inst.compile(opt, "mse", jit_compile=False)
    inst.train_on_batch(x, y)
    assert float(table.measure.numpy()) == 1.0  # the missed measurement is made up
    inst.train_on_batch(x, y)
    assert any(v != 1.0 for v in inst.layer_scales().values())


def test_legacy_unscale_call_is_refused_in_per_layer_mode():
    opt = per_layer_optimizer()
    with pytest.raises(ValueError, match="pass the gradients to apply"):
        opt.get_unscaled_gradients([tf.ones((2,))])


def test_weight_gradient_sum_overflow_steps_down_far_enough_at_once(float16_policy):
    """A per-pixel sum loss: the kernel gradient sums 4096 rows of 100s."""
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="d")])
    inst = tas.instrument(model)
    opt = per_layer_optimizer(keras.optimizers.SGD(0.0), update_every=100)
    variables = inst.trainable_variables
    opt.build(variables)
    x = np.full((4096, 1), 100.0, "float32")  # d loss / d kernel = 409600 > 65504
    finite = []
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(inst(x))
        opt.apply(tape.gradient(loss, variables), variables)
        finite.append(bool(opt.last_step_finite.numpy()))
    assert finite == [False, True, True]  # one skip, not one per binade
    table = inst.scale_table
    # Step 1: the rule, bounded by the finite bias gradient (4096: at most
    # 2**-1 with 2**4 headroom), caps the unit one binade below (2**-2) and
    # steps four down (2**-5: 409600 * 2**-5 fits); step 2 measures the
    # kernel gradient itself and settles at 2**-7 (2**4 headroom); that
    # clean measurement lifts the cap one binade.
    assert table.log2_ceilings.numpy()[1] == -1
    assert table.log2_scales.numpy()[1] == -7


# ------------------------- moved from test_gradient_paths (TensorFlow only)


def test_float64_models_are_converted_exactly():
    # Boundaries rounded every float64 gradient to float32.
    keras.mixed_precision.set_global_policy("float64")
    keras.utils.set_random_seed(0)
    x = keras.Input((4,))
    h = keras.layers.Dense(5, activation="tanh")(x)
    model = keras.Model(x, keras.layers.Dense(2)(h))
    inst = tas.instrument(model)
    set_random_scales(inst, 8, 8)
    data = tf.constant(np.random.default_rng(0).standard_normal((8, 4)))
    table = inst.scale_table

    def grads(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(m(data) * 1.234567891))
        return tape.gradient(loss, model.trainable_weights)

    reference = grads(model)
    for v, g, r in zip(model.trainable_weights, grads(inst), reference):
        assert g.dtype == tf.float64
        scale = 2.0 ** float(table.log2_scales.numpy()[table.unit_of(v)])
        np.testing.assert_array_equal(g.numpy() / scale, r.numpy())


def _documented_per_layer_loop():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "per_layer.md")) as f:
        text = f.read()
    blocks = text.split("```python")[1:]
    (code,) = [b.split("```")[0] for b in blocks if "optimizer.build(instrumented" in b]
    return "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())


def test_documented_per_layer_loop_does_not_back_off_on_nan_batches():
    # The loop called no scale_loss/observe_loss: a NaN batch counted as an
    # overflow and backed every unit off a binade.
    # The block is self-contained: its model, optimizer and loop, as written.
    namespace = {}
    exec(_documented_per_layer_loop(), namespace)
    instrumented, optimizer = namespace["instrumented"], namespace["optimizer"]
    x, y = normal((8, 8)), normal((8, 1), 1)
    namespace["train_step"](x, y)  # after the block's 8 calibrating steps
    before = instrumented.scale_table.log2_scales.numpy().copy()
    bad = x.copy()
    bad[0, 0] = np.nan
    for _ in range(10):
        namespace["train_step"](bad, y)
    np.testing.assert_array_equal(instrumented.scale_table.log2_scales.numpy(), before)
    assert int(optimizer.skipped_steps) == 10


def test_make_train_step_does_not_back_off_on_nan_batches():
    model = head_on(shared_backbone(), "m")
    instrumented = tas.instrument(model)
    optimizer = per_layer_optimizer(keras.optimizers.SGD(0.1))
    step = tas.make_train_step(instrumented, "mse", optimizer)
    x, y = normal((8, 6)), normal((8, 3), 1)
    step(x, y)
    before = instrumented.scale_table.log2_scales.numpy().copy()
    bad = x.copy()
    bad[0, 0] = np.nan
    for _ in range(5):
        step(bad, y)
    np.testing.assert_array_equal(instrumented.scale_table.log2_scales.numpy(), before)


def _save_instrumented(path):
    """Trains an instrumented model, sets unequal unit scales and saves it,
    and its scale state (to compare) next to it."""
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(x)))
    inst = tas.instrument(model)
    inst.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), scaling="per_layer"), "mse")
    data = np.random.default_rng(0).standard_normal((16, 6)).astype("float32")
    inst.fit(data, data[:, :2], batch_size=8, epochs=2, verbose=0)
    inst.scale_table.log2_scales.assign(np.array([0, 3, -2, 5], "float32")[: len(inst.scale_table.unit_names)])
    inst.save(path)
    table = inst.scale_table
    np.save(path + ".npy", np.concatenate([np.ravel(v.numpy()) for v in (
        table.log2_scales, table.log2_ceilings, table.measure, table.statistics)]))


def _load_instrumented(path):
    """Loads it, checks the scale state and trains on."""
    inst = keras.models.load_model(path)
    table = inst.scale_table
    got = np.concatenate([np.ravel(v.numpy()) for v in (table.log2_scales, table.log2_ceilings, table.measure, table.statistics)])
    np.testing.assert_array_equal(got, np.load(path + ".npy"))
    data = np.random.default_rng(0).standard_normal((16, 6)).astype("float32")
    inst.fit(data, data[:, :2], batch_size=8, epochs=1, verbose=0)
    assert int(inst.optimizer.skipped_steps.numpy()) == 0
    print("loaded", keras.backend.backend())


# The JAX side, in a child: loads TensorFlow's file, then saves its own.
_ON_JAX = "\n".join([
    "import sys, numpy as np, keras, tf_adaptive_scale as tas",
    inspect.getsource(_save_instrumented),
    inspect.getsource(_load_instrumented),
    "_load_instrumented(sys.argv[1])",
    "_save_instrumented(sys.argv[2])",
])


@pytest.fixture(scope="module")
def loaded_on_the_other_backend(tmp_path_factory):
    """`{load_on: what the loading side printed}`: this (TensorFlow)
    process saves; a JAX child loads that file and saves its own; this
    process loads JAX's."""
    where = tmp_path_factory.mktemp("cross_backend")
    saved = {backend: str(where / f"{backend}.keras") for backend in ("tensorflow", "jax")}
    _save_instrumented(saved["tensorflow"])
    jax_out = run_python("-c", _ON_JAX, saved["tensorflow"], saved["jax"], KERAS_BACKEND="jax")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _load_instrumented(saved["jax"])
    return {"jax": jax_out, "tensorflow": printed.getvalue()}


@pytest.mark.slow  # starts a child process
class TestLoadOnTheOtherBackend:
    """The fixture runs once: one worker runs this class."""

    @pytest.mark.parametrize("save_on, load_on", [("tensorflow", "jax"), ("jax", "tensorflow")])
    def test_instrumented_model_loads_on_the_other_backend(
            self, loaded_on_the_other_backend, save_on, load_on):
        # The scale state is trainable on JAX only; Keras saved trainable
        # variables first, so the other backend read them in the wrong order.
        assert f"loaded {load_on}" in loaded_on_the_other_backend[load_on]
