"""The GPU check: Keras on JAX, where only JAX, NumPy and Keras are installed.

Two measurements, printed as Markdown:

1. U-Net with a per-pixel sum loss (float16, `mixed_float16`), 16 images per
   micro-batch at 2**24 and 2**25 pixels (1024x1024 and 1024x2048): for the
   stock `LossScaleOptimizer`, the best single global scale (scanned over
   powers of two) and per-layer scaling (`tas.instrument`), the largest
   per-kernel relative gradient error against a float32 reference of the
   same weights, where it is, and the steps skipped out of 20 (learning rate
   0, so every step sees the same gradients).
2. ResNet50 (`weights=None`), batch 128 of 224x224, XLA: median step-time
   ratios adaptive/stock and per-layer/stock, interleaved.

`--tiny` runs the same code at CPU sizes (2**12 and 2**13 pixels, ResNet50 at
batch 2 of 64x64) in about a minute.

Run: KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/gpu_check.py [--tiny]
"""

import argparse
import os
import random
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

STEPS = 20


def unet(height, width):
    # Not step_cost.py's: that module needs TensorFlow (timing.py), which the
    # GPU machine lacks; and this one's head is a per-pixel map.
    x = keras.Input((height, width, 3))
    skips, h = [], x
    for channels in (8, 16):
        h = layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
        skips.append(h)
        h = layers.MaxPooling2D()(h)
    h = layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    for channels, skip in zip((16, 8), reversed(skips)):
        h = layers.Conv2DTranspose(channels, 2, strides=2)(h)
        h = layers.Concatenate()([h, skip])
        h = layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
    h = layers.Conv2D(1, 1, name="head")(h)
    return keras.Model(x, layers.Activation("linear", dtype="float32")(h))


def sum_loss(y_true, y_pred):
    return keras.ops.sum(keras.ops.square(y_pred - y_true))


_GRADIENT_FUNCTIONS = {}


def kernel_gradients(model, x, y, log2_scale=0.0, unit_scales=None):
    """Float32 gradients of the sum loss, kernel by kernel in model order:
    the loss scaled by `2**log2_scale`, each kernel's gradient divided by
    its scale."""
    if id(model) not in _GRADIENT_FUNCTIONS:

        def loss(trainable, non_trainable, x, y, log2_scale):
            pred, _ = model.stateless_call(trainable, non_trainable, x)
            return sum_loss(y, pred) * 2.0**log2_scale  # float32 outputs

        _GRADIENT_FUNCTIONS[id(model)] = jax.jit(jax.grad(loss))
    grads = _GRADIENT_FUNCTIONS[id(model)](
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        x, y, np.float32(log2_scale),
    )
    result = []
    for v, g in zip(model.trainable_variables, grads):
        if not v.path.endswith("kernel"):
            continue
        log2 = log2_scale
        if unit_scales is not None:
            log2 = unit_scales[model.scale_table.unit_of(v)]
        result.append(np.asarray(g, np.float64) / 2.0**log2)
    return result


def worst_error(grads, reference):
    """The largest relative L2 error over kernels (in model order), and the
    kernel's index (0: nearest the input)."""
    errors = []
    for i, (g, ref) in enumerate(zip(grads, reference, strict=True)):
        if not np.all(np.isfinite(g)):
            return float("inf"), i
        errors.append(np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-30))
    i = int(np.argmax(errors))
    return float(errors[i]), i


def skipped_in_fit(model, optimizer, x, y):
    model.compile(optimizer, sum_loss, jit_compile=True)
    for _ in range(STEPS):
        model.train_on_batch(x, y)
    return optimizer


def unet_row(images, height, width):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((images, height, width, 3)).astype("float32")
    y = rng.standard_normal((images, height, width, 1)).astype("float32")
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    reference_model = unet(height, width)
    weights = reference_model.get_weights()
    reference = kernel_gradients(reference_model, x, y)

    keras.mixed_precision.set_global_policy("mixed_float16")

    def half():
        model = unet(height, width)
        model.set_weights(weights)
        return model

    rows = []
    stock = skipped_in_fit(
        half(), keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.0)), x, y
    )
    log2_stock = float(np.log2(stock.dynamic_scale.numpy()))
    model = half()
    error, where = worst_error(kernel_gradients(model, x, y, log2_stock), reference)
    skipped = STEPS - int(stock.iterations.numpy())
    rows.append(("stock", f"2^{log2_stock:.0f}", error, where, skipped))

    scan = {
        s: worst_error(kernel_gradients(model, x, y, s), reference) for s in range(-24, 25)
    }
    finite = [s for s in scan if np.isfinite(scan[s][0])]
    best = min(finite, key=lambda s: scan[s][0]) if finite else None
    window = f"[{min(finite)}, {max(finite)}]" if finite else "none"
    if best is not None:
        rows.append((f"best global (finite: {window})", f"2^{best}", *scan[best], "-"))

    instrumented = tas.instrument(half())
    per_layer = skipped_in_fit(
        instrumented,
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), update_every=1),
        x, y,
    )
    unit_scales = np.asarray(instrumented.scale_table.log2_scales.numpy())
    error, where = worst_error(
        kernel_gradients(instrumented, x, y, unit_scales=unit_scales), reference
    )
    rows.append(
        ("per-layer", f"2^{unit_scales[1:].min():.0f}..2^{unit_scales[1:].max():.0f}",
         error, where, int(per_layer.skipped_steps.numpy()))
    )
    return rows


def step_ratios(batch, size, steps):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    keras.utils.set_random_seed(0)
    base = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
    weights = base.get_weights()
    models = {}
    for name in ("stock", "adaptive", "per_layer"):
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
        model.set_weights(weights)
        if name == "stock":
            optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())
        else:
            if name == "per_layer":
                model = tas.instrument(model)
            optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
        for _ in range(3):
            model.train_on_batch(x, y)
        models[name] = model
    times = {name: [] for name in models}
    order = list(models)
    for _ in range(steps):
        random.shuffle(order)
        for name in order:
            began = time.perf_counter()
            models[name].train_on_batch(x, y)  # returns host floats: synchronised
            times[name].append(time.perf_counter() - began)
    stock = np.median(times["stock"])
    return {name: float(np.median(t) / stock) for name, t in times.items()}, stock


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU sizes")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    print(f"Devices: {jax.devices()}; jax {jax.__version__}, keras {keras.__version__}\n")
    sizes = [(4, 32, 32), (4, 32, 64)] if args.tiny else [(16, 1024, 1024), (16, 1024, 2048)]
    print("| pixels | method | scale | worst kernel error | kernel (0: input side) | skipped / 20 |")
    print("|---|---|---|---|---|---|")
    for images, height, width in sizes:
        pixels = f"2^{int(np.log2(images * height * width))}"
        for method, scale, error, where, skipped in unet_row(images, height, width):
            print(f"| {pixels} | {method} | {scale} | {error:.2e} | {where} | {skipped} |",
                  flush=True)
    batch, size, steps = (2, 64, 5) if args.tiny else (128, 224, 20)
    ratios, stock = step_ratios(batch, size, steps)
    print(f"\nResNet50, batch {batch} of {size}x{size}, XLA, {steps} interleaved rounds "
          f"(stock median {stock * 1e3:.1f} ms): adaptive/stock {ratios['adaptive']:.3f}, "
          f"per-layer/stock {ratios['per_layer']:.3f}")
    print(f"\nTotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
