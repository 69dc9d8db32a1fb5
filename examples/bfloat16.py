"""mixed_bfloat16: no loss scaling needed, the optimizer's guarantees kept.

bfloat16 has float32's exponent range (8 bits): gradients neither underflow
nor overflow where float32's would not, so there is nothing for a loss scale
to do. `tas.AdaptiveLossScaleOptimizer` with `scaling=None` (the default)
sees that at the first step, from what the model computes, and resolves to
`"none"`: the scale is 1. What it still gives:

- clipping on the gradients (here `global_clipnorm`, counted in
  `clipped_steps`);
- the skip-on-non-finite guarantee: a step whose loss or gradients are not
  finite changes no weight and no optimizer state, and is counted. One batch
  of the data is corrupted with NaN to show it;
- the counters and statistics (`gradient_norm`, `tas.ScaleMonitor`).

The same code under `mixed_float16` would resolve to `"adaptive"`.

Run: python examples/bfloat16.py [--epochs 4] [--no-jit]
"""

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

BATCH = 64


def pow2(scale):
    """A power-of-two scale as `2**k`."""
    return f"2**{round(math.log2(scale))}"


def make_data(n, features=32, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)) * 0.4
    labels = rng.integers(0, classes, n)
    x = centers[labels] + rng.standard_normal((n, features))
    return x.astype("float32"), labels.astype("int32")


class SkipLog(keras.callbacks.Callback):
    """Notes every skipped step and why (reads two flags per step: fine
    for a demonstration)."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer
        self.skips = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        opt = self.optimizer_
        if not bool(opt.last_step_finite.numpy()):
            bad_data = not bool(opt.last_loss_finite.numpy())
            self.skips.append((self.epoch + 1, batch + 1, bad_data))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--no-jit", action="store_true")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # before building
    keras.utils.set_random_seed(0)
    x, y = make_data(args.samples)
    bad_batch = (args.samples // BATCH) // 2
    x[bad_batch * BATCH] = np.nan  # one corrupted row poisons its batch's loss

    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3), global_clipnorm=1.0, update_every=20
    )  # scaling=None: resolved at the first step
    print(f"before training: scaling {optimizer.scaling!r}, "
          f"compute dtype {model.layers[0].compute_dtype}, "
          f"variable dtype {model.layers[0].variable_dtype}")
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=not args.no_jit,
    )
    skips = SkipLog(optimizer)
    model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False,
              verbose=0, callbacks=[skips])

    print(f"resolved: scaling {optimizer.scaling!r}, "
          f"scale {pow2(float(optimizer.loss_scale))}")
    # Each epoch sees the NaN batch once: one skipped step per epoch.
    print(f"skipped steps {int(optimizer.skipped_steps)}/{int(optimizer.total_steps)} "
          f"(the NaN batch, once per epoch), "
          f"applied {int(optimizer.iterations)}")
    for epoch, batch, bad_data in skips.skips:
        why = "non-finite loss (bad data)" if bad_data else "non-finite gradients"
        print(f"  skipped: epoch {epoch} batch {batch}: {why}")
    print(f"clipped steps {int(optimizer.clipped_steps)} (global_clipnorm=1.0), "
          f"last measured gradient norm {float(optimizer.gradient_norm):.3g}")
    finite = all(np.all(np.isfinite(w)) for w in model.get_weights())
    print(f"weights finite: {finite}")
    clean = np.ones(len(x), bool)
    clean[bad_batch * BATCH] = False
    accuracy = np.mean(
        np.argmax(model.predict(x[clean], verbose=0), axis=-1) == y[clean]
    )
    print(f"accuracy on the clean rows {accuracy:.3f}")


if __name__ == "__main__":
    main()
