"""A custom `tf.GradientTape` loop compiled with XLA, written twice: with the
Keras 3 optimizer API and with the legacy tf-keras one.

- Keras 3: `scaled = optimizer.scale_loss(loss)`, then
  `optimizer.apply(grads, variables)`, which unscales, checks, clips and
  applies (or skips) the step.
- tf-keras (legacy): `optimizer.get_scaled_loss(loss)`, then
  `optimizer.get_unscaled_gradients(grads)`, then
  `optimizer.apply_gradients(zip(grads, variables))`. The unscaled gradients
  carry a mark in the graph, so `apply_gradients` does not unscale them a
  second time.

Both build the optimizer before tracing: building inside the traced function
would create variables in it and retrace. Both call
`optimizer.check_progress()` now and then, which raises
`tas.SkippedStepsError` if training stalls (endless skipped steps); in
`model.fit`, `tas.ScaleMonitor` does that. Data is generated in code.

Run: python examples/gradient_tape_loop.py [--steps 300] [--api keras3|legacy|both]
"""

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

BATCH = 64
CHECK_EVERY = 50  # steps between two check_progress() calls (a host sync)


def pow2(scale):
    """A power-of-two scale as `2**k`."""
    return f"2**{round(math.log2(scale))}"


def make_data(n=4096, features=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    w = rng.standard_normal((features, 1)).astype("float32")
    y = np.tanh(x @ w) + 0.1 * rng.standard_normal((n, 1)).astype("float32")
    return x, y.astype("float32")


def make_model(features):
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            # float32 output: the loss is computed in float32.
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def keras3_step(model, optimizer, loss_fn):
    variables = model.trainable_variables

    @tf.function(jit_compile=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            # Also notes whether the loss is finite: a NaN loss is bad data,
            # skipped without lowering the scale.
            scaled_loss = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, variables)
        optimizer.apply(grads, variables)  # unscales, checks, clips, applies
        return loss

    return train_step


def legacy_step(model, optimizer, loss_fn):
    variables = model.trainable_variables

    @tf.function(jit_compile=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, variables)
        # Marked as unscaled: apply_gradients applies them as they are.
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    return train_step


def train(api, x, y, steps):
    keras.utils.set_random_seed(0)  # same weights for both APIs
    model = make_model(x.shape[1])
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3), update_every=20
    )
    # Before tracing: variables created inside the trace would retrace it.
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    make_step = keras3_step if api == "keras3" else legacy_step
    train_step = make_step(model, optimizer, loss_fn)

    batches = len(x) // BATCH
    losses = []
    for step in range(steps):
        i = step % batches
        # Same shapes every step: the step is traced once.
        loss = train_step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        losses.append(loss)
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == steps:
            optimizer.check_progress()  # raises tas.SkippedStepsError if stalled
            print(
                f"[{api}] step {step + 1}: loss {float(np.mean(losses)):.4f} "
                f"scale {pow2(float(optimizer.loss_scale))} "
                f"skipped {int(optimizer.skipped_steps)}/{int(optimizer.total_steps)}"
            )
            losses = []
    print(
        f"[{api}] done: scaling {optimizer.scaling!r}, "
        f"applied steps {int(optimizer.iterations)}, "
        f"traced {train_step.experimental_get_tracing_count()} time(s)"
    )
    return model.get_weights()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--api", choices=["keras3", "legacy", "both"], default="both")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")  # before building
    x, y = make_data()
    apis = ("keras3", "legacy") if args.api == "both" else (args.api,)
    weights = {api: train(api, x, y, args.steps) for api in apis}
    if len(weights) == 2:
        # Same start, same batches: the two APIs do the same arithmetic.
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(weights["keras3"], weights["legacy"]))
        print(f"keras3 vs legacy: largest weight difference {diff:g}")


if __name__ == "__main__":
    main()
