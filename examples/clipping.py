"""Gradient clipping on unscaled gradients: fixed, AutoClip and AGC against
one bad batch.

The same small regression MLP trains four times in mixed_float16 from the
same weights on the same batches, with `tas.AdaptiveLossScaleOptimizer`:

- `none`: no clipping (the reference);
- `fixed`: `global_clipnorm`, a fixed bound on the global gradient norm;
- `autoclip`: `autoclip_percentile=10`, AutoClip: the bound is the 10th
  percentile of the gradient norms seen so far (no threshold to tune);
- `agc`: `agc_factor=0.01`, adaptive gradient clipping: each unit's gradient
  norm is kept below 1% of its weight norm (a factor meant for large batches:
  with batches of 32 it clips every step here and learns slowly).

One batch half-way through is corrupted: its targets are multiplied by
`--spike`. With plain SGD (and momentum) the update follows the gradient, so
the spike shows in the size of that step's weight update. The optimizer
clips after dividing the gradients by the loss scale, so the bounds are in
the gradients' own units whatever the scale is.

Clipping can only act on a spike that float16 holds: the adaptive scale
keeps `headroom` between the largest gradient it measured and float16's
maximum (2**4 by default, 2**10 here). A larger spike overflows; its step is
skipped and counted, with every method (try `--spike 1000`).

Run: python examples/clipping.py [--steps 400] [--spike 30] [--no-jit]
"""

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

BATCH = 32
METHODS = {
    "none": {},
    "fixed": {"global_clipnorm": 1.0},
    "autoclip": {"autoclip_percentile": 10},
    "agc": {"agc_factor": 0.01},
}


def pow2(scale):
    """A power-of-two scale as `2**k`."""
    return f"2**{round(math.log2(scale))}"


def make_data(n, features=16, seed=0):
    """`(x, y)` from one fixed function; `seed` draws the inputs."""
    w = np.random.default_rng(0).standard_normal((features, 1)) / 2
    x = np.random.default_rng(seed).standard_normal((n, features))
    return x.astype("float32"), np.tanh(x @ w).astype("float32")


def make_model(features):
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),  # float32 loss
        ]
    )


def clean_loss(model, x, y):
    # One eager call: evaluate() would compile a second function per model.
    return float(np.mean(np.square(np.asarray(model(x)) - y)))


class UpdateNorms(keras.callbacks.Callback):
    """Records the global norm of each step's weight update (a host sync
    per step: fine for a demonstration, not for real training)."""

    def on_train_begin(self, logs=None):
        self.norms = []
        self._last = self.model.get_weights()

    def on_train_batch_end(self, batch, logs=None):
        weights = self.model.get_weights()
        self.norms.append(math.sqrt(sum(
            float(np.sum(np.square(a - b))) for a, b in zip(weights, self._last)
        )))
        self._last = weights


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--spike", type=float, default=30.0,
                        help="factor applied to one batch's targets")
    parser.add_argument("--no-jit", action="store_true", help="without XLA")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")  # before building
    # One epoch over fresh batches: the bad batch is seen once.
    x, y = make_data(args.steps * BATCH)
    x_test, y_test = make_data(1024, seed=1)  # clean, for the test loss
    spike_step = args.steps // 2  # 0-based
    y[spike_step * BATCH : (spike_step + 1) * BATCH] *= args.spike
    print(f"spike: targets x{args.spike:g} at step {spike_step + 1} of {args.steps}")

    keras.utils.set_random_seed(0)
    initial = make_model(x.shape[1]).get_weights()
    for method, clip in METHODS.items():
        keras.utils.set_random_seed(0)
        model = make_model(x.shape[1])
        model.set_weights(initial)
        optimizer = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.02, momentum=0.9),
            update_every=20,
            # Room for a 2**10-fold gradient spike above the largest gradient
            # measured (default 2**4): a larger spike overflows float16 and
            # its step is skipped, so there is nothing left to clip.
            headroom=2**10,
            **clip,
        )
        model.compile(optimizer=optimizer, loss="mse",
                      jit_compile=not args.no_jit)
        updates = UpdateNorms()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[updates])
        norms = np.array(updates.norms)
        typical = float(np.median(norms))
        print(
            f"{method:>8}: update norm at the spike {norms[spike_step]:.3g} "
            f"= {norms[spike_step] / typical:.1f}x the median step's, "
            f"clipped {int(optimizer.clipped_steps)}/{int(optimizer.total_steps)} steps, "
            f"skipped {int(optimizer.skipped_steps)}, "
            f"scale {pow2(float(optimizer.loss_scale))}, "
            f"test loss {clean_loss(model, x_test, y_test):.4f}"
        )


if __name__ == "__main__":
    main()
