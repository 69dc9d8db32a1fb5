"""Step-time cost under `tf.distribute.MirroredStrategy`, against stock Keras.

Splits the CPU into `--replicas` logical devices (before TensorFlow starts),
and trains two copies of an MLP (same weights, `mixed_float16`, `Adam`) by
`model.fit` under a `MirroredStrategy`: one with the stock
`keras.mixed_precision.LossScaleOptimizer`, one with
`tas.AdaptiveLossScaleOptimizer`. Epochs alternate in random order
(`timing.interleave`); the ratio of the median epoch times is printed
(target: at most 1.05). Without XLA: XLA with MirroredStrategy fails on CPU
(keras#19005). The MLP is `zoo.mlp` with 256 inputs.

Run: python -m benchmarks.replicas_cost [--replicas 2] [--steps 50] [--rounds 7]
"""

import argparse
import sys

import numpy as np
import tensorflow as tf

from benchmarks import timing


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed epoch")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args(argv)
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * args.replicas,
    )
    import keras

    import tf_adaptive_scale as tas
    from benchmarks import zoo

    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(args.replicas)]
    )
    rng = np.random.default_rng(0)
    batch = 64 * args.replicas
    x = rng.standard_normal((batch * args.steps, 256)).astype("float32")
    y = rng.integers(0, 10, batch * args.steps)
    keras.utils.set_random_seed(0)

    def make_model():
        return zoo.mlp(256, (args.width, args.width))

    optimizers = {
        "stock": lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam()),
        "adaptive": lambda: tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
    }
    models = {}
    with strategy.scope():
        reference = make_model()
        for name, make_optimizer in optimizers.items():
            model = make_model()
            model.set_weights(reference.get_weights())
            model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(
                from_logits=True), jit_compile=False)
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # trace, warm up
            models[name] = model

    def epoch(model):
        return lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0)

    epochs = {name: epoch(model) for name, model in models.items()}
    median = timing.medians(timing.interleave(epochs, args.rounds, seed=0))
    ratio = median["adaptive"] / median["stock"]
    print("| replicas | steps per epoch | rounds | step-time ratio, adaptive / stock |")
    print("|---|---|---|---|")
    print(f"| {args.replicas} | {args.steps} | {args.rounds} | {ratio:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
