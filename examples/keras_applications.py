"""Per-layer loss scales on a `keras.applications` model.

`keras.applications.MobileNetV2` (or `--model resnet50`), untrained
(`weights=None`), on small 32x32 images, in mixed_float16.
`tas.instrument(model)` gives every layer its own scale, applied to the
gradients inside the backward pass (each residual add, batch norm and
activation is a unit of its own), and
`tas.AdaptiveLossScaleOptimizer(..., scaling="per_layer")` sets each scale
from that unit's own gradient statistics. A few `fit` steps on random data
show it running; the script prints how many units have a scale of their own
and the range and a sample of the scales (`optimizer.layer_scales()`).

`--execution` picks how `fit` runs the step: `graph` (the default: a
`tf.function` without XLA), `xla` (`jit_compile=True`, the fastest steps on
an accelerator, but on a small CPU compiling the instrumented MobileNetV2
takes minutes) or `eager` (`run_eagerly=True`: no compilation, slow steps; a
quick check that everything runs). Whatever the choice, the first step pays
for the compilation; later steps are fast.

Run: python examples/keras_applications.py [--model mobilenetv2|resnet50]
     [--steps 20] [--batch 16] [--execution graph|xla|eager]
"""

import argparse
import collections
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

MODELS = {
    "mobilenetv2": keras.applications.MobileNetV2,
    "resnet50": keras.applications.ResNet50,
}


def pow2(scale):
    """A power-of-two scale as `2**k`."""
    return f"2**{round(math.log2(scale))}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mobilenetv2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--execution", choices=["graph", "xla", "eager"],
                        default="graph")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")  # before building
    keras.utils.set_random_seed(0)
    model = MODELS[args.model](
        weights=None, input_shape=(32, 32, 3), classes=10,
        # Logits: the loss is computed in float32 from them.
        classifier_activation=None,
    )
    # Shares `model`'s weights: training one trains the other.
    instrumented = tas.instrument(model)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        scaling="per_layer",
        update_every=5,  # measure often: the scales settle within a few steps
    )
    instrumented.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=args.execution == "xla",
        run_eagerly=args.execution == "eager",
    )

    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x = rng.uniform(0, 1, (n, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    start = time.perf_counter()
    history = instrumented.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    seconds = time.perf_counter() - start

    scales = optimizer.layer_scales()
    print(f"{model.name}: {len(model.layers)} layers, "
          f"{len(scales)} units with their own scale")
    print(f"trained {int(optimizer.total_steps)} steps ({args.execution}) in "
          f"{seconds:.0f} s, compilation included: loss {history.history['loss'][-1]:.4f}, "
          f"skipped {int(optimizer.skipped_steps)}")
    exponents = collections.Counter(round(math.log2(s)) for s in scales.values())
    low, high = min(exponents), max(exponents)
    print(f"scales from 2**{low} to 2**{high}; units per scale:",
          ", ".join(f"2**{e}: {exponents[e]}" for e in sorted(exponents)))
    names = list(scales)
    sample = names[:3] + names[len(names) // 2 : len(names) // 2 + 2] + names[-3:]
    for name in sample:
        print(f"  {name}: {pow2(scales[name])}")


if __name__ == "__main__":
    main()
