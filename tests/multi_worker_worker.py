"""Subprocess body for tests/test_multi_worker.py (not a test module itself).

Trains an instrumented model (`tas.instrument`) with
`AdaptiveLossScaleOptimizer(..., scaling="per_layer")` in a custom training
loop and prints one JSON object, keyed by scenario, on its last stdout line.
A scenario that raises reports `{"error": "<traceback>"}` instead.

Usage:
    python tests/multi_worker_worker.py worker   # TF_CONFIG names the task
    python tests/multi_worker_worker.py single   # no strategy, reference

`worker`: one of the two workers of a `tf.distribute.MultiWorkerMirroredStrategy`
(one CPU replica per worker). Worker `i` trains on rows
`[i * PER_WORKER, (i + 1) * PER_WORKER)` of every global batch.
`single`: one process, no strategy, the whole global batches.

Both modes see the same global batches, initial weights and per-unit scales.
One strategy serves all scenarios of a worker: a MultiWorkerMirroredStrategy
must be created before TensorFlow initialises, once per process, and its
all-reduces of successive traced steps get fresh collective instance keys (the
"Shape mismatch in the collective instance" pitfall of tests/
distributed_worker.py comes from creating a *new* strategy, which this never
does). Both workers trace the same steps in the same order, so their
collective keys match.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "single"
# Created first: the strategy configures TensorFlow's collectives, which must
# happen before anything initialises the runtime.
STRATEGY = (
    tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=120.0
        )
    )
    if MODE == "worker"
    else None
)

import keras  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

FEATURES = 3
WORKERS = 2
PER_WORKER = 4
GLOBAL_BATCH = WORKERS * PER_WORKER
STEPS = 4


def make_model():
    """A Functional model with a residual Add and a Dense layer called twice."""
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(4, activation="tanh", name="g_in")(x)
    shared = keras.layers.Dense(4, activation="tanh", name="g_shared")
    b = shared(shared(h))
    s = keras.layers.Add(name="g_add")([h, b])
    return keras.Model(x, keras.layers.Dense(1, name="g_out")(s), name="graph")


def initial_weights(seed):
    keras.utils.set_random_seed(seed)
    return make_model().get_weights()


def global_batches(seed, steps=STEPS, x_scale=1.0):
    """`steps` global batches `(x, y)` of `GLOBAL_BATCH` rows each."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (steps, GLOBAL_BATCH, FEATURES)).astype("float32")
    w = np.array([[2.0], [-3.0], [1.5]], "float32")
    y = (x @ w + 4.0).astype("float32")
    return list(zip(x_scale * x, y))


def _value(variable):
    """A scalar variable's value as a Python number (works under a strategy,
    where `int(v)` on a Keras variable does not)."""
    return np.asarray(tf.convert_to_tensor(variable)).item()


def _vector(variable):
    return np.asarray(tf.convert_to_tensor(variable)).tolist()


class Trainer:
    """An instrumented model, its per-layer optimizer and a `train_step`.

    Built under `STRATEGY`'s scope in `worker` mode. `train_step(x, y)` takes
    one *global* batch (numpy); under the strategy each worker feeds only its
    own shard of it to its replica.

    Args:
        weights: Initial weights of `make_model()`.
        optimizer: An `AdaptiveLossScaleOptimizer(..., scaling="per_layer")`
            factory.
    """

    def __init__(self, weights, optimizer):
        scope = STRATEGY.scope() if STRATEGY else _NullScope()
        with scope:
            self.model = make_model()
            self.model.set_weights(weights)
            self.instrumented = tas.instrument(self.model)
            self.optimizer = optimizer()
            # Built eagerly: building in the first `apply` inside
            # `strategy.run` in a tf.function fails under a strategy.
            self.optimizer.build(self.instrumented.trainable_variables)
        self.table = self.instrumented.scale_table
        variables = self.instrumented.trainable_variables
        is_weight = [self.table.unit_of(v) is not None for v in variables]

        def step(x, y):
            with tf.GradientTape() as tape:
                pred = tf.cast(self.instrumented(x, training=True), "float32")
                per_example = tf.reduce_mean(tf.square(pred - y), axis=-1)
                loss = tf.nn.compute_average_loss(
                    per_example, global_batch_size=GLOBAL_BATCH
                )
                scaled = self.optimizer.scale_loss(loss)  # x1 per layer
            grads = tape.gradient(scaled, variables)
            # This replica's own weight gradients, before any all-reduce.
            local_finite = tf.reduce_all(
                [
                    tf.reduce_all(tf.math.is_finite(g))
                    for g, weight in zip(grads, is_weight)
                    if weight
                ]
            )
            self.optimizer.apply(grads, variables)
            return local_finite, tf.reduce_max(tf.abs(x))

        @tf.function(jit_compile=False)  # XLA + MirroredStrategy fails on CPU
        def run(x, y):
            if STRATEGY is None:
                return step(x, y)
            return STRATEGY.run(step, args=(x, y))

        self._run = run

    def train_step(self, x, y):
        """One step on global batch `(x, y)`; returns what this process's
        replica saw: `(its gradients were finite, max |x| of its shard)`."""
        if STRATEGY is None:
            local_finite, x_max = self._run(tf.constant(x), tf.constant(y))
            return bool(local_finite), float(x_max)

        def shard(array):
            def value_fn(ctx):
                i = ctx.replica_id_in_sync_group
                return tf.constant(array[i * PER_WORKER : (i + 1) * PER_WORKER])

            return STRATEGY.experimental_distribute_values_from_function(value_fn)

        local_finite, x_max = self._run(shard(x), shard(y))
        (local_finite,) = STRATEGY.experimental_local_results(local_finite)
        (x_max,) = STRATEGY.experimental_local_results(x_max)
        return bool(local_finite), float(x_max)

    def state(self):
        """Weights, scales and step counters, JSON-ready."""
        opt = self.optimizer
        return {
            "weights": [w.tolist() for w in self.model.get_weights()],
            "layer_scales": opt.layer_scales(),
            "log2_scales": _vector(self.table.log2_scales),
            "log2_ceilings": _vector(self.table.log2_ceilings),
            "iterations": int(_value(opt.iterations)),
            "total_steps": int(_value(opt.total_steps)),
            "skipped_steps": int(_value(opt.skipped_steps)),
            "last_step_finite": bool(_value(opt.last_step_finite)),
        }


class _NullScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fixed_scales_fp32():
    """float32, fixed random per-unit scales in [2**-8, 2**8] (never
    measured): unscaling is exact, so workers and one process must agree."""
    keras.mixed_precision.set_global_policy("float32")
    weights0 = initial_weights(seed=4)
    trainer = Trainer(
        weights0,
        lambda: tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.5),
            scaling="per_layer",
            update_every=10**6,
        ),
    )
    rng = np.random.default_rng(4)
    log2 = rng.integers(-8, 9, len(trainer.table.unit_names)).astype("float32")
    log2[0] = 0.0  # the loss unit
    trainer.table.log2_scales.assign(log2)
    trainer.table.measure.assign(0.0)
    trainer.optimizer.steps_to_measure.assign(10**6)
    for x, y in global_batches(seed=4):
        trainer.train_step(x, y)
    return {
        "initial_weights": [w.tolist() for w in weights0],
        "assigned_log2_scales": log2.tolist(),
        **trainer.state(),
    }


def measured_fp16():
    """mixed_float16, every unit's scale measured on every step."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        weights0 = initial_weights(seed=3)
        trainer = Trainer(
            weights0,
            lambda: tas.AdaptiveLossScaleOptimizer(
                keras.optimizers.SGD(0.01), scaling="per_layer", update_every=1
            ),
        )
        # Larger first-layer gradients: the units' scales differ.
        for x, y in global_batches(seed=3, x_scale=8.0):
            trainer.train_step(x, y)
        return {"initial_weights": [w.tolist() for w in weights0], **trainer.state()}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def overflow_fp16():
    """All unit scales at 2**15, and worker 1's half of the global batch is
    1e4: only worker 1's float16 gradients overflow. Then one clean step."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        trainer = Trainer(
            initial_weights(seed=5),
            lambda: tas.AdaptiveLossScaleOptimizer(
                keras.optimizers.SGD(0.1), scaling="per_layer", update_every=1
            ),
        )
        start = np.full(len(trainer.table.unit_names), 15.0, "float32")
        start[0] = 0.0  # the loss unit stays at scale 1
        trainer.table.log2_scales.assign(start)
        trainer.table.measure.assign(1.0)
        # Small inputs and targets: a clean shard's gradients fit float16
        # at 2**15 (the regression targets of `global_batches` would not).
        rng = np.random.default_rng(5)
        x, clean_x = rng.uniform(-1.0, 1.0, (2, GLOBAL_BATCH, FEATURES)).astype(
            "float32"
        )
        y = rng.uniform(-1.0, 1.0, (GLOBAL_BATCH, 1)).astype("float32")
        x[PER_WORKER:] = 1e4  # worker 1's shard only

        before = trainer.model.get_weights()
        local_finite, x_max = trainer.train_step(x, y)
        result = {
            "initial_log2_scales": start.tolist(),
            "local_grads_finite": local_finite,
            "shard_max_abs": x_max,
            "weights_bitwise_unchanged": all(
                np.array_equal(a, b)
                for a, b in zip(before, trainer.model.get_weights())
            ),
            **trainer.state(),
        }
        after = trainer.model.get_weights()
        trainer.train_step(clean_x, y)
        result["after_clean_step"] = {
            "weights_changed": any(
                not np.array_equal(a, b)
                for a, b in zip(after, trainer.model.get_weights())
            ),
            **trainer.state(),
        }
        return result
    finally:
        keras.mixed_precision.set_global_policy("float32")


SCENARIOS = {
    "fixed_scales_fp32": fixed_scales_fp32,
    "measured_fp16": measured_fp16,
    "overflow_fp16": overflow_fp16,  # workers only
}


def main():
    results = {"mode": MODE}
    if STRATEGY is not None:
        results["num_replicas_in_sync"] = STRATEGY.num_replicas_in_sync
        results["task_index"] = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    for name, scenario in SCENARIOS.items():
        if STRATEGY is None and name == "overflow_fp16":
            continue
        try:
            results[name] = scenario()
        except Exception:  # reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
    sys.stdout.flush()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
