"""`model.fit` under `tf.distribute.MirroredStrategy`, two replicas on one CPU.

The one physical CPU is split into two logical devices (this must happen
before anything starts TensorFlow's runtime), and a `MirroredStrategy` runs
one replica on each. The model and the `tas.AdaptiveLossScaleOptimizer` are
created inside `strategy.scope()`; `fit` splits each global batch between the
replicas. The gradients are all-reduced once and every replica takes the same
decision from the sum: a non-finite gradient on *any* replica skips the step
on all of them (stock Keras checks replica 0 only), and the scale, the
counters and the weights stay identical on every replica, which the script
checks at the end. XLA is off (`jit_compile=False`): XLA with
`MirroredStrategy` fails on CPU.

Going multi-worker: use `tf.distribute.MultiWorkerMirroredStrategy()`
instead, created at the very start of each worker process (before TensorFlow
initialises), with the environment variable `TF_CONFIG` naming the cluster
and this worker's index, for instance on worker 0 of two:

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 0}}'

and the same script on every worker. The optimizer needs nothing else: its
decision is taken from the all-reduced gradients, so every worker skips or
applies the same steps and keeps the same scale.
`tests/multi_worker_worker.py` is a working two-worker setup.

Run: python examples/distributed.py [--epochs 4] [--samples 4096]
"""

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two logical CPU devices. This must run before anything initialises
# TensorFlow's runtime (a first tensor, a strategy), so it comes first.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import keras  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

MULTI_WORKER_NOTE = (
    "Multi-worker: create tf.distribute.MultiWorkerMirroredStrategy() first "
    "thing in every worker, with TF_CONFIG naming the cluster and the worker's "
    "index; the optimizer needs nothing else (see this file's docstring and "
    "tests/multi_worker_worker.py)."
)


def pow2(scale):
    """A power-of-two scale as `2**k`."""
    return f"2**{round(math.log2(scale))}"


def value(variable):
    """A variable's value: `.numpy()`, since `int(v)` and `float(v)` fail on a
    Keras variable created under a strategy scope (a MirroredVariable)."""
    return variable.numpy()


def replica_values(variable):
    """The copy of `variable` held by each replica."""
    mirrored = variable.value  # a tf.distribute MirroredVariable
    return [np.asarray(v) for v in mirrored.values]


def make_data(n, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x[:, :8] @ rng.standard_normal((8, classes))).argmax(axis=1)
    return x, y.astype("int32")


class PrintEpoch(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer

    def on_epoch_end(self, epoch, logs=None):
        opt = self.optimizer_
        print(
            f"epoch {epoch + 1}: loss {logs['loss']:.4f} "
            f"accuracy {logs['accuracy']:.3f} "
            f"scale {pow2(value(opt.loss_scale))} "
            f"skipped {int(value(opt.skipped_steps))}/{int(value(opt.total_steps))}"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")  # before building
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print(f"replicas in sync: {strategy.num_replicas_in_sync}")
    x, y = make_data(args.samples)

    # Everything with variables is created inside the scope: the model, the
    # optimizer and (in compile) the metrics.
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((x.shape[1],)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(4),
            ]
        )
        optimizer = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-3), update_every=20, global_clipnorm=5.0
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=False,  # XLA with MirroredStrategy fails on CPU
        )
    model.fit(
        x, y, batch_size=args.batch, epochs=args.epochs, verbose=0,
        callbacks=[PrintEpoch(optimizer)],
    )

    print(
        f"final: scaling {optimizer.scaling!r}, "
        f"scale {pow2(value(optimizer.loss_scale))}, "
        f"skipped steps {int(value(optimizer.skipped_steps))}/"
        f"{int(value(optimizer.total_steps))}, "
        f"applied steps {int(value(optimizer.iterations))}"
    )
    # Every replica holds its own copy of each weight and of the optimizer's
    # state; one decision from the all-reduced gradients keeps them equal.
    checked = [*model.weights, *optimizer.variables]  # the inner optimizer's too
    copies = [replica_values(v) for v in checked]
    assert all(len(c) == strategy.num_replicas_in_sync for c in copies)
    agree = all(all(np.array_equal(c[0], other) for other in c[1:]) for c in copies)
    print(f"replicas agree (weights, scale, counters, Adam slots): {agree}")
    print(MULTI_WORKER_NOTE)


if __name__ == "__main__":
    main()
