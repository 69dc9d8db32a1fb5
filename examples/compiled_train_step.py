"""A custom loop with `tas.make_train_step`: XLA, per-layer scales and
gradient accumulation, in mixed_float16, on the 8x8 digits of scikit-learn
when it is installed (else on generated data).

Each call of the step takes one window of `--accumulate` micro-batches and
makes one decision (apply or skip, and one scale update) for the window.
The logs it returns are tensors: reading them is the loop's only host
synchronisation, done here once per epoch.

Run: python examples/compiled_train_step.py [--epochs 5] [--accumulate 4]
     [--global-scale] [--no-jit]
"""

import argparse

import keras
import numpy as np

import tf_adaptive_scale as tas


def load_digits():
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        rng = np.random.default_rng(0)
        labels = rng.integers(0, 10, 1797)
        centers = rng.uniform(0, 16, (10, 64))
        x = centers[labels] + rng.normal(0, 2, (1797, 64))
        return (x / 16).astype("float32"), labels.astype("int32")
    digits = sklearn_digits()
    return (digits.data / 16).astype("float32"), digits.target.astype("int32")


def make_model():
    inputs = keras.Input((64,))
    h = keras.layers.Dense(128, activation="relu", name="hidden")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="middle")(h)
    outputs = keras.layers.Dense(10, name="logits")(h)
    return keras.Model(inputs, outputs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128, help="window size")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--global-scale", action="store_true")
    parser.add_argument("--no-jit", action="store_true")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x, y = load_digits()
    model = make_model()
    if not args.global_scale:
        model = tas.instrument(model)
    step = tas.make_train_step(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-3),
        jit_compile=not args.no_jit,
        accumulation_steps=args.accumulate,
    )
    windows = len(x) // args.batch
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x))
        losses = []
        for i in range(windows):
            rows = order[i * args.batch : (i + 1) * args.batch]
            logs = step(x[rows], y[rows])
            losses.append(logs["loss"])
        step.optimizer.check_progress()  # raises after endless skipping
        accuracy = np.mean(
            np.argmax(model.predict(x, verbose=0), axis=-1) == y
        )
        print(
            f"epoch {epoch + 1}: loss {float(np.mean(losses)):.4f} "
            f"accuracy {accuracy:.3f} "
            f"skipped {int(logs['skipped_steps'])}/{step.optimizer.total_steps.numpy()} "
            f"windows of {args.accumulate} micro-batches"
        )
    if args.global_scale:
        print(f"loss scale 2**{np.log2(float(logs['loss_scale'])):.0f}")
    else:
        print("layer scales:", {k: f"2**{np.log2(v):.0f}"
                                for k, v in step.optimizer.layer_scales().items()})
    print(f"traced {step.tracing_count()} time(s)")


if __name__ == "__main__":
    main()
