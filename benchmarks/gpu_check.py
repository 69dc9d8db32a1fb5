"""The GPU check: Keras on JAX, where only JAX, NumPy and Keras are installed.

Three sections (`--sections steps,unet,precision`), printed as Markdown:

1. `steps`: per family (`--families`: ResNet50 and MobileNetV2 at batch 128
   of 224x224, a transformer at batch 64 of 512 tokens) and mode (stock,
   adaptive, per layer every 100 steps and every step), fit's compiled step
   as Keras compiles it on JAX: the median step time over interleaved rounds,
   its ratio to stock's, stock's spread, the compile's time and ratio, and
   the number of `conditional`s in the optimized program.
2. `unet`: U-Net with a per-pixel sum loss (`mixed_float16`), 16 images per
   micro-batch at 2**24 and 2**25 pixels (1024x1024 and 1024x2048): for the
   stock `LossScaleOptimizer`, the best single global scale (scanned over
   powers of two) and per-layer scaling (`tas.instrument`), the largest
   per-kernel relative gradient error against a float32 reference of the
   same weights, where it is, and the steps skipped out of 20 (learning rate
   0, so every step sees the same gradients).
3. `precision`: a small transformer with a token-mean loss at 2**14 to 2**20
   tokens per batch: each variable's relative gradient error against
   float32 at loss scales 2**0, 2**8 and 2**16 (an error flat across scales
   is precision, which no scale fixes; one that falls is underflow).

`--tiny` runs the same code at CPU sizes (JAX on CPU has no float16
attention: the transformer families need a GPU).

The models are `zoo`'s (which, like `timing` and `hlo`, imports no
TensorFlow).

Run: KERAS_BACKEND=jax python -m benchmarks.gpu_check [--tiny]
     [--sections steps,unet,precision] [--families resnet50,transformer] [--rounds 20]
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402
from benchmarks import hlo  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks import zoo  # noqa: E402

STEPS = 20


def unet(height, width):
    """The U-Net with a per-pixel map for head."""
    return zoo.unet((height, width, 3), widths=(8, 16), bottom=32, head="map",
                    names={"map": "head"})


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


def _application(architecture):
    def build(tiny):
        size, batch = (32, 2) if tiny else (224, 128)
        return zoo.application(architecture, size, classes=1000), (batch, size, size, 3)

    return build


def transformer(tiny, blocks=4):
    batch, tokens, width = (2, 32, 64) if tiny else (64, 512, 512)
    model = zoo.transformer(tokens, width, blocks, heads=8, outputs=1000)
    return model, (batch, tokens)


FAMILIES = {"resnet50": _application("ResNet50"), "transformer": transformer,
            "mobilenetv2": _application("MobileNetV2")}
MODES = {
    "stock": lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam()),
    "adaptive": lambda: tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
    "per_layer_100": lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="per_layer"),
    "per_layer_1": lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="per_layer", update_every=1),
}


def compiled_step(model, optimizer, x, y):
    """fit's step, compiled as Keras compiles it on JAX (state donated):
    the executable, the state it takes, the seconds its trace and compile
    took, and the number of `conditional`s in its optimized program."""
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    model._symbolic_build(data_batch=(x, y))  # what fit does first; no public API
    state = hlo.fit_state(model)
    began = time.perf_counter()
    step = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y)).compile()
    return step, state, time.perf_counter() - began, hlo.conditionals(step.as_text())


def step_table(family, tiny, rounds):
    """Per mode: the median step time of fit's compiled step over `rounds`
    interleaved rounds (each step waited for), its ratio to stock's, the
    spread (interquartile range over median) of stock's, the first
    compile's ratio, and the conditionals in the program."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model, shape = FAMILIES[family](tiny)
    batch = shape[0]
    weights = model.get_weights()
    rng = np.random.default_rng(0)
    if len(shape) == 2:
        x = jax.device_put(rng.integers(0, 1000, shape).astype("int32"))
    else:
        x = jax.device_put(rng.standard_normal(shape).astype("float32"))
    y = jax.device_put(rng.integers(0, 1000, batch).astype("int32"))
    steps, states, compiled, found = {}, {}, {}, {}
    for mode, optimizer in MODES.items():
        model, _ = FAMILIES[family](tiny)
        model.set_weights(weights)
        if mode.startswith("per_layer"):
            model = tas.instrument(model)
        steps[mode], states[mode], compiled[mode], found[mode] = compiled_step(
            model, optimizer(), x, y)

    def step(mode):
        def run():
            logs, states[mode] = steps[mode](states[mode], (x, y))
            jax.block_until_ready(logs)

        return run

    times = timing.interleave({mode: step(mode) for mode in MODES}, rounds, seed=None, warmup=3)
    times = {mode: t["wall"] for mode, t in times.items()}
    stock = np.median(times["stock"])
    q1, q3 = np.percentile(times["stock"], [25, 75])
    rows = []
    for mode in MODES:
        rows.append((mode, np.median(times[mode]) * 1e3, np.median(times[mode]) / stock,
                     (q3 - q1) / stock, compiled[mode], compiled[mode] / compiled["stock"],
                     found[mode]))
    return rows


TOKEN_NAMES = {"embedding": "token_embedding", "attention": "attention_{i}",
               "norm_attention": "norm_{i}a", "ffn_in": "ffn_{i}_in", "ffn_out": "ffn_{i}_out",
               "norm_ffn": "norm_{i}b", "logits": "logits"}


def token_model(tokens_per_row=256, width=128, vocab=1024):
    """The 2-block transformer predicting every token, float32 logits."""
    return zoo.transformer(tokens_per_row, width, vocab=vocab, outputs=vocab, per_token=True,
                           float32_output=True, names=TOKEN_NAMES)


def token_mean_loss(y_true, y_pred):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True))


def variable_gradients(model, x, y, log2_scales):
    """Per scale in `log2_scales`, each trainable variable's float64
    gradient of the token-mean loss, the loss scaled by `2**log2_scale` and
    the gradient divided by it."""
    def loss(trainable, non_trainable, log2_scale):
        pred, _ = model.stateless_call(trainable, non_trainable, x)
        return token_mean_loss(y, pred) * 2.0**log2_scale

    gradient = jax.jit(jax.grad(loss))
    return [[np.asarray(g, np.float64) / 2.0**s
             for g in gradient([v.value for v in model.trainable_variables],
                               [v.value for v in model.non_trainable_variables],
                               np.float32(s))]
            for s in log2_scales]


def precision_rows(tiny):
    """Per tokens per batch: each variable's relative gradient error in
    `mixed_float16` against float32 from the same weights, at loss scales
    2^0, 2^8 and 2^16; the rows with the worst error at the best scale."""
    rows = []
    for rows_per_batch in ((2, 8) if tiny else (64, 256, 1024, 4096)):
        tokens_per_row = 16 if tiny else 256
        rng = np.random.default_rng(0)
        x = rng.integers(0, 1024, (rows_per_batch, tokens_per_row)).astype("int32")
        y = rng.integers(0, 1024, (rows_per_batch, tokens_per_row)).astype("int32")
        keras.mixed_precision.set_global_policy("float32")
        keras.utils.set_random_seed(0)
        reference_model = token_model(tokens_per_row)
        (reference,) = variable_gradients(reference_model, x, y, [0])
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = token_model(tokens_per_row)
        model.set_weights(reference_model.get_weights())
        errors = {}
        for grads in variable_gradients(model, x, y, [0, 8, 16]):
            for v, g, ref in zip(reference_model.trainable_variables, grads, reference):
                path = v.path
                error = (np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-30)
                         if np.all(np.isfinite(g)) else float("inf"))
                errors.setdefault(path, []).append(error)
        worst = sorted(errors, key=lambda p: -min(errors[p]))[:3]
        counts = np.bincount(x.ravel(), minlength=1024)
        for path in worst:
            rows.append((rows_per_batch * tokens_per_row, path, *errors[path], counts.max()))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU sizes")
    parser.add_argument("--sections", default="steps,unet,precision")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    print(f"Devices: {jax.devices()}; jax {jax.__version__}, keras {keras.__version__}\n")
    if "steps" in args.sections:
        print("| family | mode | step ms | / stock | stock IQR / median | compile s | / stock "
              "| conditionals |")
        print("|---|---|---|---|---|---|---|---|")
        for family in args.families.split(","):
            for mode, ms, ratio, spread, seconds, compile_ratio, found in step_table(
                    family, args.tiny, args.rounds):
                print(f"| {family} | {mode} | {ms:.2f} | {ratio:.3f} | {spread:.3f} "
                      f"| {seconds:.1f} | {compile_ratio:.2f} | {found} |", flush=True)
            print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    if "unet" in args.sections:
        sizes = [(4, 32, 32), (4, 32, 64)] if args.tiny else [(16, 1024, 1024), (16, 1024, 2048)]
        print("\n| pixels | method | scale | worst kernel error | kernel (0: input side) "
              "| skipped / 20 |")
        print("|---|---|---|---|---|---|")
        for images, height, width in sizes:
            pixels = f"2^{int(np.log2(images * height * width))}"
            for method, scale, error, where, skipped in unet_row(images, height, width):
                print(f"| {pixels} | {method} | {scale} | {error:.2e} | {where} | {skipped} |",
                      flush=True)
        print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    if "precision" in args.sections:
        print("\n| tokens | variable | error at 2^0 | 2^8 | 2^16 | most repeated token |")
        print("|---|---|---|---|---|---|")
        for tokens, path, *errors, repeats in precision_rows(args.tiny):
            print(f"| 2^{int(np.log2(tokens))} | {path} | "
                  + " | ".join(f"{e:.2e}" for e in errors) + f" | {repeats} |", flush=True)
    print(f"\nTotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
