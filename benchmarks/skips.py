"""Skipped steps in the first steps of training, per architecture and mode.

For each model (`keras.applications` ConvNeXtTiny, EfficientNetB0 and
MobileNetV2 with `weights=None` at 32x32 inputs (`--size`), batches of 8
(`--batch`) and 10 classes, and a
2-block transformer encoder), under `mixed_float16`, from the same initial
weights and on the same generated batches (no download), `Adam()` trains
`--steps` steps three ways:

- `stock`: `keras.mixed_precision.LossScaleOptimizer(Adam())`; a step is
  skipped where the inner optimizer's `iterations` did not advance;
- `adaptive`: `tas.AdaptiveLossScaleOptimizer(Adam())` (one global scale);
- `per_layer`: `tas.instrument(model)` compiled with
  `tas.AdaptiveLossScaleOptimizer(Adam(), scaling="per_layer")`.

Printed as Markdown: the number of skipped steps per model and mode, and
the steps (0-based) that were skipped. Exits 1 where per-layer skipped more
steps than stock.

Measured on 2 CPU cores, 50 steps, no XLA. Default sizes: stock 1, 11, 7,
3 skipped steps (ConvNeXtTiny, EfficientNetB0, MobileNetV2, transformer),
global adaptive 1, 2, 1, 3, per-layer 0, 0, 0, 0. At `--size 64`,
ConvNeXtTiny: stock 1, per-layer 1 (2 before overflows were corrected all
at once); EfficientNetB0 9 and 0; MobileNetV2 5 and 0.

Run: python -m benchmarks.skips [--steps 50]
     [--models convnext_tiny,efficientnet_b0,mobilenet_v2,transformer]
     [--modes stock,adaptive,per_layer] [--size 32] [--batch 8] [--xla]
"""

import argparse
import sys
import time

import keras
import numpy as np

import tf_adaptive_scale as tas
from benchmarks import zoo
from benchmarks.zoo import CLASSES

SIZE = 32  # --size: the images' side
BATCH = None  # --batch: the images' batch size (default: each model's own)


def _application(name, batch):
    return (lambda: zoo.application(name, SIZE)), (BATCH or batch, SIZE, SIZE, 3)


def transformer(batch=16, tokens=32):
    """step_cost's 2-block encoder (10 classes too), at `tokens` tokens."""
    return (lambda: zoo.transformer(tokens)), (batch, tokens)


MODELS = {
    "convnext_tiny": lambda: _application("ConvNeXtTiny", 8),
    "efficientnet_b0": lambda: _application("EfficientNetB0", 8),
    "mobilenet_v2": lambda: _application("MobileNetV2", 8),
    "transformer": transformer,
}
MODES = ("stock", "adaptive", "per_layer")


def batches(shape, steps, seed=0):
    """`steps` generated `(x, y)` batches, the same for every mode."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if len(shape) == 2:  # token ids
            x = rng.integers(0, 1000, shape).astype("int32")
        else:
            x = rng.standard_normal(shape).astype("float32")
        out.append((x, rng.integers(0, CLASSES, shape[0]).astype("int32")))
    return out


def optimizer_for(mode):
    if mode == "stock":
        return keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())
    if mode == "adaptive":
        return tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    return tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="per_layer")


def run(model_name, mode, steps, jit_compile=False, seed=0):
    """Trains one model one way; returns the 0-based skipped steps."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    build, shape = MODELS[model_name]()
    keras.utils.set_random_seed(seed)
    model = build()  # same seed, same initial weights in every mode
    if mode == "per_layer":
        model = tas.instrument(model)
    optimizer = optimizer_for(mode)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    skipped = []
    for step, (x, y) in enumerate(batches(shape, steps, seed)):
        before = _progress(optimizer, mode)
        model.train_on_batch(x, y)
        if _progress(optimizer, mode) == before:
            skipped.append(step)
    if mode != "stock":
        assert int(optimizer.skipped_steps.numpy()) == len(skipped)
    keras.backend.clear_session()
    return skipped


def _progress(optimizer, mode):
    """A number that changes on an applied step and not on a skipped one."""
    if mode == "stock":
        # The inner optimizer's iterations do not advance on a skipped step.
        return int(optimizer.inner_optimizer.iterations.numpy())
    if not hasattr(optimizer, "skipped_steps"):  # built at the first step
        return 0
    # Applied steps: every step counted, less the skipped ones.
    return int(optimizer.total_steps.numpy()) - int(optimizer.skipped_steps.numpy())


def markdown(results, modes):
    lines = [
        "| model | " + " | ".join(f"{m} skipped" for m in modes) + " | skipped steps |",
        "|---|" + "---|" * len(modes) + "---|",
    ]
    for name, per_mode in results.items():
        counts = " | ".join(str(len(per_mode[m])) for m in modes)
        which = "; ".join(
            f"{m}: {_ranges(per_mode[m])}" for m in modes if per_mode[m]
        )
        lines.append(f"| {name} | {counts} | {which or '-'} |")
    return "\n".join(lines)


def _ranges(steps):
    parts, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            parts.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ",".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument("--batch", type=int, default=None, help="image batch size")
    parser.add_argument("--xla", action="store_true", help="jit_compile=True")
    args = parser.parse_args(argv)
    global SIZE, BATCH
    SIZE, BATCH = args.size, args.batch
    modes = args.modes.split(",")
    began = time.perf_counter()
    results = {}
    for name in args.models.split(","):
        results[name] = {}
        for mode in modes:
            results[name][mode] = run(name, mode, args.steps, args.xla)
            print(f"  {name} {mode}: {len(results[name][mode])} skipped, "
                  f"{time.perf_counter() - began:.0f} s", flush=True)
    print(markdown(results, modes))
    worse = [
        name for name, r in results.items()
        if "stock" in r and "per_layer" in r and len(r["per_layer"]) > len(r["stock"])
    ]
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
