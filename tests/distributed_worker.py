"""Subprocess body for tests/test_distribution.py (not a test module itself).

Splits the one physical CPU into two logical devices *before* TensorFlow
initialises, runs the requested scenarios under a two-replica
`tf.distribute.MirroredStrategy` and prints one JSON object, keyed by scenario,
on its last stdout line. A scenario that raises reports
`{"error": "<traceback>"}` instead of its results, so the other scenarios in
the same process still report.

Usage: python tests/distributed_worker.py [scenario ...]   (default: all)

Scenarios whose first all-reduce differs in size cannot share a process:
every new MirroredStrategy restarts TensorFlow's collective instance keys, and
the runtime remembers each instance's shape ("Shape mismatch in the collective
instance 100", tensorflow#62790). Run the global-scale and the per-layer
scenarios in separate processes, as tests/test_distribution.py does.
"""

import functools
import functools
import json
import os
import sys
import traceback
from contextlib import nullcontext

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Must happen before anything initialises the TensorFlow runtime.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import keras  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

CPUS = ["/cpu:0", "/cpu:1"]


@functools.lru_cache(maxsize=None)
def mirrored_strategy():
    """One strategy for every scenario of the process: two strategies over
    the same devices reuse collective instance keys, and TensorFlow's
    collective executor then refuses the second one's different shapes."""
    return tf.distribute.MirroredStrategy(CPUS)
FEATURES = 3


def make_model():
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(4, name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )


def initial_weights(seed=0, make=make_model):
    keras.utils.set_random_seed(seed)
    return make().get_weights()


def _value(variable):
    """A scalar variable's value as a Python number.

    `int(v)`/`float(v)` fail on any Keras variable created under a strategy
    scope (its `.value` is a `MirroredVariable`): a Keras limitation that hits
    stock optimizers' `iterations` too.
    """
    return np.asarray(tf.convert_to_tensor(variable)).item()


def _value_array(variable):
    """A variable's value as a numpy array (replica 0's, under a strategy)."""
    return np.asarray(tf.convert_to_tensor(variable))


def finite_weights(model):
    return all(bool(np.all(np.isfinite(w))) for w in model.get_weights())


# ---------------------------------------------------------------------------
# Scenario 1: a non-finite gradient on replica 1 only (custom strategy.run).
# ---------------------------------------------------------------------------

PER_REPLICA = 2


def overflow_stock():
    """Stock Keras LossScaleOptimizer on the replica-1-only overflow."""
    return _overflow(
        lambda: keras.mixed_precision.LossScaleOptimizer(
            keras.optimizers.SGD(0.1)
        ),
        extra_clean_step=False,
    )


def overflow_dynamic():
    """AdaptiveLossScaleOptimizer (Keras's dynamic rule) on the
    replica-1-only overflow."""
    return _overflow(
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.1), scaling="dynamic"
        ),
        extra_clean_step=True,
    )


def overflow_adaptive():
    """The adaptive scale with a stateful inner optimizer (Adam) on the
    replica-1-only overflow: its slots must not move either."""
    return _overflow(
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-2), scaling="adaptive"
        ),
        extra_clean_step=True,
    )


def nan_loss_adaptive():
    """AdaptiveLossScaleOptimizer when only replica 1's shard holds a NaN:
    bad data on one replica skips the step everywhere, without back-off."""
    return _overflow(
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.1), scaling="dynamic"
        ),
        extra_clean_step=True,
        poison=np.nan,
    )


def _overflow(make_optimizer, extra_clean_step, poison=1e4):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _overflow_step(make_optimizer, extra_clean_step, poison)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _replica_one_overflow_batches(seed, poison=1e4):
    """A global batch whose second half (replica 1's shard) is `poison` (1e4
    overflows float16), its targets, and a clean batch."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, (2 * PER_REPLICA, FEATURES)).astype("float32")
    y = rng.uniform(-1.0, 1.0, (2 * PER_REPLICA, 1)).astype("float32")
    x[PER_REPLICA:] = poison
    clean_x = rng.uniform(-1.0, 1.0, (2 * PER_REPLICA, FEATURES)).astype("float32")
    return x, y, clean_x


def _shard(strategy, array):
    """Replica i gets rows [i * PER_REPLICA, (i + 1) * PER_REPLICA)."""

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return tf.constant(array[i * PER_REPLICA : (i + 1) * PER_REPLICA])

    return strategy.experimental_distribute_values_from_function(value_fn)


def _overflow_step(make_optimizer, extra_clean_step, poison=1e4):
    strategy = mirrored_strategy()
    assert strategy.num_replicas_in_sync == 2
    global_batch = 2 * PER_REPLICA
    weights0 = initial_weights()

    x, y, clean_x = _replica_one_overflow_batches(seed=0, poison=poison)
    shard = functools.partial(_shard, strategy)

    def replica_id_fn(ctx):
        return tf.constant(ctx.replica_id_in_sync_group, "int32")

    dist_x, dist_y = shard(x), shard(y)
    dist_clean_x = shard(clean_x)
    replica_ids = strategy.experimental_distribute_values_from_function(
        replica_id_fn
    )

    with strategy.scope():
        model = make_model()
        model.set_weights(weights0)
        opt = make_optimizer()
        # Built here, eagerly: building lazily in the first `apply` inside
        # strategy.run in a tf.function fails under MirroredStrategy for stock
        # Keras and this optimizer alike ("You must feed a value for
        # placeholder tensor 'cond/else/_1/cond/Placeholder'"). model.fit
        # builds the optimizer before tracing, so it is not affected.
        opt.build(model.trainable_variables)

    @tf.function(jit_compile=False)
    def train_step(xs, ys, ids):
        def step(xb, yb, rid):
            with tf.GradientTape() as tape:
                pred = tf.cast(model(xb, training=True), "float32")
                per_example = tf.reduce_mean(tf.square(pred - yb), axis=-1)
                loss = tf.nn.compute_average_loss(
                    per_example, global_batch_size=global_batch
                )
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            finite = tf.reduce_all(
                [tf.reduce_all(tf.math.is_finite(g)) for g in grads]
            )
            opt.apply(grads, model.trainable_variables)
            return rid, finite, tf.reduce_max(tf.abs(xb))

        return strategy.run(step, args=(xs, ys, ids))

    before = [w.copy() for w in model.get_weights()]
    slots_before = [np.array(_value_array(v)) for v in opt.inner_optimizer.variables]
    rids, finite, x_max = train_step(dist_x, dist_y, replica_ids)
    after = model.get_weights()
    local = strategy.experimental_local_results
    result = {
        # What each replica saw, recorded inside strategy.run.
        "replica_ids": [int(t) for t in local(rids)],
        "shard_max_abs": [float(t) for t in local(x_max)],
        "local_grads_finite": [bool(t) for t in local(finite)],
        "weights_finite": finite_weights(model),
        "weights_bitwise_unchanged": all(
            np.array_equal(a, b) for a, b in zip(before, after)
        ),
        "slots_bitwise_unchanged": all(
            np.array_equal(a, np.array(_value_array(v)))
            for a, v in zip(slots_before, opt.inner_optimizer.variables)
        ),
        "loss_scale": float(_value(opt.dynamic_scale)),
        "iterations": int(_value(opt.iterations)),
    }
    if extra_clean_step:
        result.update(
            {
                "skipped_steps": int(_value(opt.skipped_steps)),
                "total_steps": int(_value(opt.total_steps)),
                "last_step_finite": bool(_value(opt.last_step_finite)),
            }
        )
        # A clean step on both replicas afterwards is applied as usual.
        train_step(dist_clean_x, dist_y, replica_ids)
        result["after_clean_step"] = {
            "weights_finite": finite_weights(model),
            "weights_changed": any(
                not np.array_equal(a, b)
                for a, b in zip(after, model.get_weights())
            ),
            "iterations": int(_value(opt.iterations)),
            "skipped_steps": int(_value(opt.skipped_steps)),
            "total_steps": int(_value(opt.total_steps)),
            "loss_scale": float(_value(opt.dynamic_scale)),
        }
    return result


# ---------------------------------------------------------------------------
# Scenarios 2 and 3: model.fit under the strategy vs. one device.
# ---------------------------------------------------------------------------

STEPS = 5
GLOBAL_BATCH = 8


def _fit_data(seed):
    rng = np.random.default_rng(seed)
    n = STEPS * GLOBAL_BATCH
    x = rng.normal(0.0, 1.0, (n, FEATURES)).astype("float32")
    y = (x @ np.array([[2.0], [-3.0], [1.5]], "float32") + 4.0).astype(
        "float32"
    )
    return x, y


def _fit(strategy, weights0, make_optimizer, x, y):
    scope = strategy.scope() if strategy is not None else nullcontext()
    with scope:
        model = make_model()
        model.set_weights(weights0)
        opt = make_optimizer()
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0
    )
    return model, opt, history.history["loss"]


def _equivalence(policy, make_optimizer, seed):
    keras.mixed_precision.set_global_policy(policy)
    try:
        strategy = mirrored_strategy()
        assert strategy.num_replicas_in_sync == 2
        weights0 = initial_weights(seed)
        x, y = _fit_data(seed)
        runs = {}
        for name, strat in (("mirrored", strategy), ("single", None)):
            model, opt, losses = _fit(strat, weights0, make_optimizer, x, y)
            runs[name] = {
                "weights": [w.tolist() for w in model.get_weights()],
                "slots": [_value_array(v).tolist() for v in opt.inner_optimizer.variables],
                "losses": [float(v) for v in losses],
                "gradient_norm": float(_value(opt.gradient_norm)),
                "gradient_max": float(_value(opt.gradient_max)),
                "clipped_steps": int(_value(opt.clipped_steps)),
                "loss_scale": float(_value(opt.loss_scale)),
                "total_steps": int(_value(opt.total_steps)),
                "skipped_steps": int(_value(opt.skipped_steps)),
                "iterations": int(_value(opt.iterations)),
                "weights_changed": any(
                    not np.array_equal(a, b)
                    for a, b in zip(weights0, model.get_weights())
                ),
            }
        runs["initial"] = [w.tolist() for w in weights0]
        return runs
    finally:
        keras.mixed_precision.set_global_policy("float32")


def equivalence_dynamic_clipnorm():
    return _equivalence(
        "float32",
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-2), scaling="dynamic", global_clipnorm=0.5
        ),
        seed=1,
    )


def equivalence_adaptive_fp16():
    # SGD with momentum, not Adam: Adam turns the float16 rounding noise of
    # near-zero gradients into full-size steps, so its weights differ by
    # up to 7% between any two summation orders; SGD's follow the gradient.
    return _equivalence(
        "mixed_float16",
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(1e-2, momentum=0.9), scaling="adaptive",
            update_every=1,
        ),
        seed=2,
    )


def equivalence_accumulation():
    """`model.fit` with two micro-batches per window under the strategy."""
    return _equivalence(
        "float32",
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(1e-2, momentum=0.9), scaling="adaptive",
            accumulation_steps=2,
        ),
        seed=3,
    )


def equivalence_sparse_embedding():
    """An Embedding's sparse gradient under the strategy: summed over the
    replicas, clipped and applied as `tf.IndexedSlices`, as on one device."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    types = []

    class Recording(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            types.extend(type(g).__name__ for g in grads)
            return super().apply(grads, trainable_variables)

    def make():
        return keras.Sequential([
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])

    try:
        keras.utils.set_random_seed(4)
        weights0 = make().get_weights()
        rng = np.random.default_rng(4)
        x = rng.integers(0, 50, (STEPS * GLOBAL_BATCH, 5)).astype("int32")
        y = rng.normal(0.0, 1.0, (STEPS * GLOBAL_BATCH, 1)).astype("float32")
        runs = {}
        for name, strategy in (("mirrored", mirrored_strategy()), ("single", None)):
            types.clear()
            with strategy.scope() if strategy is not None else nullcontext():
                model = make()
                model.set_weights(weights0)
                opt = tas.AdaptiveLossScaleOptimizer(
                    Recording(0.5), scaling="dynamic", global_clipnorm=0.05
                )
                model.compile(optimizer=opt, loss="mse", jit_compile=False)
            model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
            runs[name] = {
                "weights": [w.tolist() for w in model.get_weights()],
                "types": sorted(set(types)),
                "clipped_steps": int(_value(opt.clipped_steps)),
            }
        runs["initial"] = [w.tolist() for w in weights0]
        return runs
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ---------------------------------------------------------------------------
# Scenarios 4-6: per-layer scaling (tas.instrument) under the strategy.
# ---------------------------------------------------------------------------


def make_graph_model():
    """A Functional model with a residual Add and a Dense layer called twice."""
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(4, activation="tanh", name="g_in")(x)
    shared = keras.layers.Dense(4, activation="tanh", name="g_shared")
    b = shared(shared(h))  # one layer, two calls: its gradient sums both
    s = keras.layers.Add(name="g_add")([h, b])  # residual: a fork at h
    return keras.Model(x, keras.layers.Dense(1, name="g_out")(s), name="graph")


def _replicas(strategy, variable):
    """The per-replica values of a (Keras) variable, as numpy arrays.

    A Keras variable made under the strategy scope wraps a `MirroredVariable`
    (its `.value`); outside a strategy there is one value.
    """
    inner = getattr(variable, "value", variable)
    if strategy is None:
        return [np.array(tf.convert_to_tensor(inner))]
    return [
        np.array(tf.convert_to_tensor(v))
        for v in strategy.experimental_local_results(inner)
    ]


def _replicas_identical(strategy, variable):
    values = _replicas(strategy, variable)
    return len(values) == 2 and all(
        np.array_equal(values[0], v) for v in values[1:]
    )


def _instrumented(strategy, weights0, make_optimizer, compile_kwargs=None):
    """Builds, instruments and compiles inside the strategy's scope."""
    scope = strategy.scope() if strategy is not None else nullcontext()
    with scope:
        model = make_graph_model()
        model.set_weights(weights0)
        instrumented = tas.instrument(model)
        opt = make_optimizer()
        opt.build(instrumented.trainable_variables)
        if compile_kwargs is not None:
            instrumented.compile(optimizer=opt, **compile_kwargs)
    return model, instrumented, opt


def per_layer_fit_fp16():
    """model.fit, per-layer scales re-measured every step, 2 replicas vs 1."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        strategy = mirrored_strategy()
        assert strategy.num_replicas_in_sync == 2
        weights0 = initial_weights(make=make_graph_model, seed=3)
        x, y = _fit_data(3)
        x = 8.0 * x  # larger first-layer gradients: the units' scales differ
        runs = {}
        for name, strat in (("mirrored", strategy), ("single", None)):
            model, instrumented, opt = _instrumented(
                strat,
                weights0,
                lambda: tas.AdaptiveLossScaleOptimizer(
                    keras.optimizers.SGD(0.01),
                    scaling="per_layer",
                    update_every=1,
                ),
                dict(loss="mse", jit_compile=False),
            )
            history = instrumented.fit(
                x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                verbose=0,
            )
            table = instrumented.scale_table
            weight_variables = [
                v for v in instrumented.trainable_variables
                if table.unit_of(v) is not None
            ]
            runs[name] = {
                "unit_names": table.unit_names,
                "layer_scales": instrumented.layer_scales(),
                "log2_scales_per_replica": [
                    v.tolist() for v in _replicas(strat, table.log2_scales)
                ],
                "log2_scales_identical": _replicas_identical(
                    strat, table.log2_scales
                ),
                "log2_ceilings_identical": _replicas_identical(
                    strat, table.log2_ceilings
                ),
                "measure_identical": _replicas_identical(strat, table.measure),
                "statistics_identical": _replicas_identical(
                    strat, table.statistics
                ),
                "statistics_nonzero": bool(
                    np.any(_replicas(strat, table.statistics)[0] != 0)
                ),
                "statistics": _value_array(table.statistics).tolist(),
                "weights_identical": all(
                    _replicas_identical(strat, v) for v in weight_variables
                ),
                "weights": [w.tolist() for w in model.get_weights()],
                "weights_finite": finite_weights(model),
                "weights_changed": any(
                    not np.array_equal(a, b)
                    for a, b in zip(weights0, model.get_weights())
                ),
                "losses": [float(v) for v in history.history["loss"]],
                "total_steps": int(_value(opt.total_steps)),
                "skipped_steps": int(_value(opt.skipped_steps)),
                "iterations": int(_value(opt.iterations)),
            }
        runs["initial"] = [w.tolist() for w in weights0]
        return runs
    finally:
        keras.mixed_precision.set_global_policy("float32")


FIXED_STEPS = 4


def per_layer_fixed_scales_fp32():
    """Fixed random per-unit scales (no measuring) on 2 replicas vs plain
    training of the uninstrumented model on one device."""
    strategy = mirrored_strategy()
    assert strategy.num_replicas_in_sync == 2
    weights0 = initial_weights(make=make_graph_model, seed=4)
    x, y = _fit_data(4)
    x, y = x[: FIXED_STEPS * GLOBAL_BATCH], y[: FIXED_STEPS * GLOBAL_BATCH]
    fit_kwargs = dict(
        batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0
    )

    def inner():
        return keras.optimizers.SGD(0.02, momentum=0.5)

    model, instrumented, opt = _instrumented(
        strategy,
        weights0,
        lambda: tas.AdaptiveLossScaleOptimizer(
            inner(), scaling="per_layer", update_every=10**6
        ),
        dict(loss="mse", jit_compile=False),
    )
    table = instrumented.scale_table
    rng = np.random.default_rng(4)
    log2 = rng.integers(-8, 9, len(table.unit_names)).astype("float32")
    log2[0] = 0.0
    table.log2_scales.assign(log2)
    table.measure.assign(0.0)
    # Not scheduled to measure (a fresh optimizer would measure at once).
    opt.steps_to_measure.assign(10**6)
    history = instrumented.fit(x, y, **fit_kwargs)

    keras.utils.set_random_seed(0)
    reference = make_graph_model()
    reference.set_weights(weights0)
    ref_opt = tas.AdaptiveLossScaleOptimizer(inner(), scaling="none")
    reference.compile(optimizer=ref_opt, loss="mse", jit_compile=False)
    ref_history = reference.fit(x, y, **fit_kwargs)

    weight_variables = [
        v for v in instrumented.trainable_variables
        if table.unit_of(v) is not None
    ]
    return {
        "unit_names": table.unit_names,
        "assigned_log2_scales": log2.tolist(),
        "log2_scales_per_replica": [
            v.tolist() for v in _replicas(strategy, table.log2_scales)
        ],
        "measure_per_replica": [
            float(v) for v in _replicas(strategy, table.measure)
        ],
        "weights_identical": all(
            _replicas_identical(strategy, v) for v in weight_variables
        ),
        "statistics_identical": _replicas_identical(strategy, table.statistics),
        "mirrored": {
            "weights": [w.tolist() for w in model.get_weights()],
            "losses": [float(v) for v in history.history["loss"]],
            "iterations": int(_value(opt.iterations)),
            "skipped_steps": int(_value(opt.skipped_steps)),
            "total_steps": int(_value(opt.total_steps)),
            "weights_changed": any(
                not np.array_equal(a, b)
                for a, b in zip(weights0, model.get_weights())
            ),
        },
        "single_plain": {
            "weights": [w.tolist() for w in reference.get_weights()],
            "losses": [float(v) for v in ref_history.history["loss"]],
            "iterations": int(_value(ref_opt.iterations)),
            "skipped_steps": int(_value(ref_opt.skipped_steps)),
        },
    }


def per_layer_overflow_fp16():
    """A per-layer step where only replica 1's shard overflows."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _per_layer_overflow()
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _per_layer_overflow():
    strategy = mirrored_strategy()
    assert strategy.num_replicas_in_sync == 2
    global_batch = 2 * PER_REPLICA
    weights0 = initial_weights(make=make_graph_model, seed=5)

    x, y, clean_x = _replica_one_overflow_batches(seed=5)
    shard = functools.partial(_shard, strategy)

    dist_x, dist_y, dist_clean_x = shard(x), shard(y), shard(clean_x)

    model, instrumented, opt = _instrumented(
        strategy,
        weights0,
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.1), scaling="per_layer", update_every=1
        ),
    )
    table = instrumented.scale_table
    start = np.full(len(table.unit_names), 15.0, "float32")
    start[0] = 0.0  # the loss unit stays at scale 1
    table.log2_scales.assign(start)
    table.measure.assign(1.0)
    variables = instrumented.trainable_variables
    weight_variables = [v for v in variables if table.unit_of(v) is not None]

    @tf.function(jit_compile=False)
    def train_step(xs, ys):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                pred = tf.cast(instrumented(xb, training=True), "float32")
                per_example = tf.reduce_mean(tf.square(pred - yb), axis=-1)
                loss = tf.nn.compute_average_loss(
                    per_example, global_batch_size=global_batch
                )
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, variables)
            finite = tf.reduce_all(
                [
                    tf.reduce_all(tf.math.is_finite(g))
                    for g, v in zip(grads, variables)
                    if table.unit_of(v) is not None
                ]
            )
            opt.apply(grads, variables)
            return finite

        return strategy.run(step, args=(xs, ys))

    def per_replica_weights():
        return [_replicas(strategy, v) for v in weight_variables]

    def table_state():
        return {
            "log2_scales_per_replica": [
                v.tolist() for v in _replicas(strategy, table.log2_scales)
            ],
            "log2_ceilings_per_replica": [
                v.tolist() for v in _replicas(strategy, table.log2_ceilings)
            ],
            "log2_scales_identical": _replicas_identical(
                strategy, table.log2_scales
            ),
            "log2_ceilings_identical": _replicas_identical(
                strategy, table.log2_ceilings
            ),
            "measure_identical": _replicas_identical(strategy, table.measure),
            "statistics_identical": _replicas_identical(
                strategy, table.statistics
            ),
            "skipped_steps": int(_value(opt.skipped_steps)),
            "total_steps": int(_value(opt.total_steps)),
            "iterations": int(_value(opt.iterations)),
            "last_step_finite": bool(_value(opt.last_step_finite)),
            "weights_finite": all(
                bool(np.all(np.isfinite(r)))
                for rs in per_replica_weights()
                for r in rs
            ),
        }

    before = per_replica_weights()
    finite = train_step(dist_x, dist_y)
    after = per_replica_weights()
    result = {
        "unit_names": table.unit_names,
        "initial_log2_scales": start.tolist(),
        "local_grads_finite": [
            bool(t) for t in strategy.experimental_local_results(finite)
        ],
        # Every weight, on every replica, bitwise as before the step.
        "weights_bitwise_unchanged": all(
            np.array_equal(a, b)
            for ra, rb in zip(before, after)
            for a, b in zip(ra, rb)
        ),
        **table_state(),
    }
    train_step(dist_clean_x, dist_y)
    result["after_clean_step"] = {
        "weights_changed": any(
            not np.array_equal(a, b)
            for ra, rb in zip(after, per_replica_weights())
            for a, b in zip(ra, rb)
        ),
        "weights_identical": all(
            _replicas_identical(strategy, v) for v in weight_variables
        ),
        **table_state(),
    }
    return result


def global_statistics_per_replica():
    """One measured `fit` step in global adaptive mode: the histogram, zeros
    and peak the scale is chosen from, with each replica's own reference
    gradient (its shard's loss sum over the global batch, as Keras's
    per-replica loss scaling gives) computed separately in float32."""
    strategy = mirrored_strategy()
    weights0 = initial_weights(5)
    x, y = _fit_data(5)
    x, y = x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]
    model, opt, _ = _fit(
        strategy, weights0,
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(1e-2), scaling="adaptive", update_every=1
        ),
        x, y,
    )
    reference = make_model()
    reference.set_weights(weights0)
    shards = []
    for rows in np.split(np.arange(GLOBAL_BATCH), 2):
        with tf.GradientTape() as tape:
            error = reference(x[rows]) - y[rows]
            loss = tf.reduce_sum(tf.square(error)) / GLOBAL_BATCH
        shards.append(tape.gradient(loss, reference.trainable_variables))
    summed = [a + b for a, b in zip(*shards)]
    per_replica = [tas.gradient_statistics.exponent_histogram(g) for g in shards]
    return {
        "histogram": _value_array(opt.gradient_histogram).tolist(),
        "zeros": _value(opt.gradient_zeros),
        "max": _value(opt.gradient_max),
        "measurements": _value(opt.measurements),
        "reference_histogram": np.sum(
            [np.asarray(h) for h, _ in per_replica], axis=0).tolist(),
        "reference_max": max(float(m) for _, m in per_replica),
        "summed_histogram": np.asarray(
            tas.gradient_statistics.exponent_histogram(summed)[0]).tolist(),
    }


def train_step_mirrored():
    """tas.make_train_step under the strategy against one device, same global
    batches, two micro-batches per window: plain and instrumented models, and
    a plain Keras optimizer (its mode resolved by the first replica to trace,
    which once hung the other's merge_call)."""
    x, y = _fit_data(6)
    results = {}
    for name, scaling in (
        ("plain", "adaptive"), ("instrumented", "per_layer"), ("default", None)
    ):
        runs = {}
        for where, strategy in (("mirrored", mirrored_strategy()), ("single", None)):
            scope = strategy.scope() if strategy else nullcontext()
            with scope:
                base = model = make_model()
                base.set_weights(initial_weights(6))
                if scaling == "per_layer":
                    model = tas.instrument(base)
                opt = keras.optimizers.SGD(1e-3, momentum=0.9)
                if scaling:
                    opt = tas.AdaptiveLossScaleOptimizer(opt, scaling=scaling)
                step = tas.make_train_step(
                    model, "mse", opt, accumulation_steps=2, strategy=strategy
                )
            losses = []
            for i in range(STEPS):
                rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
                losses.append(float(step(x[rows], y[rows])["loss"]))
            opt = step.optimizer
            runs[where] = {
                "weights": [w.tolist() for w in base.get_weights()],
                "losses": losses,
                "tracing_count": step.tracing_count(),
                "total_steps": _value(opt.total_steps),
                "skipped_steps": _value(opt.skipped_steps),
                "layer_scales": opt.layer_scales(),
            }
        runs["initial"] = [w.tolist() for w in initial_weights(6)]
        results[name] = runs
    return results


def all_reduce_count():
    """Gradient all-reduces per traced step: `ReplicaContext.all_reduce`
    calls while `model.fit` traces its train step, stock Keras vs ours (the
    gradients travel once; a second, inner all-reduce doubled the traffic)."""
    x, y = _fit_data(0)
    weights0 = initial_weights()
    original = tf.distribute.ReplicaContext.all_reduce
    counts = {}
    for name, make_optimizer in (
        ("stock", lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())),
        ("adaptive", lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(), scaling="adaptive", global_clipnorm=1.0)),
    ):
        sizes = []

        def counting(self, reduce_op, value, options=None):
            sizes.append(len(tf.nest.flatten(value)))
            return original(self, reduce_op, value, options)

        tf.distribute.ReplicaContext.all_reduce = counting
        try:
            _fit(mirrored_strategy(), weights0, make_optimizer, x, y)
        finally:
            tf.distribute.ReplicaContext.all_reduce = original
        counts[name] = sizes
    return counts


SCENARIOS = {
    "all_reduce_count": all_reduce_count,
    "overflow_stock": overflow_stock,
    "overflow_dynamic": overflow_dynamic,
    "overflow_adaptive": overflow_adaptive,
    "nan_loss_adaptive": nan_loss_adaptive,
    "equivalence_dynamic_clipnorm": equivalence_dynamic_clipnorm,
    "equivalence_adaptive_fp16": equivalence_adaptive_fp16,
    "equivalence_accumulation": equivalence_accumulation,
    "equivalence_sparse_embedding": equivalence_sparse_embedding,
    "per_layer_fit_fp16": per_layer_fit_fp16,
    "per_layer_fixed_scales_fp32": per_layer_fixed_scales_fp32,
    "global_statistics_per_replica": global_statistics_per_replica,
    "train_step_mirrored": train_step_mirrored,
    "per_layer_overflow_fp16": per_layer_overflow_fp16,
}


def main(names):
    results = {"meta": {"steps": STEPS, "global_batch": GLOBAL_BATCH}}
    for name in names or SCENARIOS:
        try:
            results[name] = SCENARIOS[name]()
        except Exception:  # reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
    sys.stdout.flush()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
