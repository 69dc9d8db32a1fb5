"""Trains a small classifier in mixed_float16 with AdaptiveLossScaleOptimizer.

Prints, per epoch, the loss, the current loss scale, the skipped steps, the
last measured scale window and how often clipping acted. Data is generated in
code (no downloads).

With --per-layer, the model is instrumented (`tas.instrument`) and every layer
gets its own scale inside the backward pass; the per-layer scales are printed.

Run: python examples/train_mlp.py [--epochs 5] [--no-jit] [--per-layer]
"""

import argparse

import numpy as np
import keras

import tf_adaptive_scale as tas


def make_data(n=4096, features=32, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)) * 2.0
    labels = rng.integers(0, classes, n)
    x = centers[labels] + rng.standard_normal((n, features))
    return x.astype("float32"), labels.astype("int32")


class PrintScale(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer

    def on_epoch_end(self, epoch, logs=None):
        opt = self.optimizer_
        low, high = opt.scale_window.numpy()
        print(
            f"epoch {epoch + 1}: loss {logs['loss']:.4f} "
            f"accuracy {logs['accuracy']:.3f} "
            f"scale 2**{np.log2(float(opt.loss_scale)):.0f} "
            f"skipped {int(opt.skipped_steps)}/{int(opt.total_steps)} "
            f"window [2**{low:.0f}, 2**{high:.0f}] "
            f"clipped {int(opt.clipped_steps)}"
        )
        if opt.scaling == "per_layer":
            scales = ", ".join(
                f"{name} 2**{np.log2(scale):.0f}"
                for name, scale in opt.layer_scales().items()
            )
            print(f"  layer scales: {scales}")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--no-jit", action="store_true")
    parser.add_argument("--per-layer", action="store_true")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = make_data()
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    if args.per_layer:
        model = tas.instrument(model)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        scaling="per_layer" if args.per_layer else "adaptive",
        update_every=20,
        global_clipnorm=5.0,
    )
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=not args.no_jit,
    )
    model.fit(
        x, y, batch_size=64, epochs=args.epochs, verbose=0,
        callbacks=[PrintScale(optimizer)],
    )
    print(
        f"final: scale {float(optimizer.loss_scale):g}, "
        f"skipped steps {int(optimizer.skipped_steps)}, "
        f"applied steps {int(optimizer.iterations)}"
    )


if __name__ == "__main__":
    main()
