"""Step-time ratios to the stock LossScaleOptimizer, interleaved step by step.

`step_time.py` and `per_layer.py` time blocks of `fit` steps; on a shared
machine whole blocks land on different speed levels, which leaves ratios
uncertain by several per cent. Here every variant runs one
`train_on_batch` in turn, in a fresh random order each round, N rounds, so
slow spells hit all variants alike; the ratio of the mean step times
(measured steps included, at their real frequency) is the cost a run pays.
Besides wall time it records the process's CPU time per step: the work done,
which other tenants of a shared machine disturb much less than wall time.
Ratios only: absolute times on a shared CPU mean nothing.

Variants: stock, adaptive (global, `update_every=100`), dynamic, and the
model instrumented by `tas.instrument` with `scaling="per_layer"` at
`update_every=100` and `update_every=1`; MLP 512-1024-1024-10, batch 128,
mixed_float16, jit_compile=True (the model of `step_time.py`).

Run: PYTHONPATH=. python benchmarks/per_step_cost.py [--steps 300] [--threads 1]
"""

import argparse
import os
import random
import sys
import time

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time  # noqa: E402  (its model and thread pinning)

import tf_adaptive_scale as tas  # noqa: E402

VARIANTS = {
    "stock": (False, lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())),
    "adaptive": (False, lambda: tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())),
    "dynamic": (False, lambda: tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="dynamic")),
    "per_layer_100": (True, lambda: tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="per_layer")),
    "per_layer_1": (True, lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="per_layer", update_every=1)),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per variant")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow threads (0: TF's default)")
    args = parser.parse_args(argv)
    step_time.set_threads(args.threads)
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, step_time.INPUT_DIM)).astype("float32")
    y = rng.integers(0, step_time.CLASSES, 128)
    weights = step_time.build_model(0).get_weights()
    models = {}
    for name, (instrumented, make_optimizer) in VARIANTS.items():
        model = step_time.build_model(0)
        model.set_weights(weights)
        if instrumented:
            model = tas.instrument(model)
        model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(), jit_compile=True)
        for _ in range(3):  # trace and compile
            model.train_on_batch(x, y)
        models[name] = model
    wall = {name: [] for name in models}
    cpu = {name: [] for name in models}
    order, shuffler = list(models), random.Random(0)
    for _ in range(args.steps):
        shuffler.shuffle(order)
        for name in order:
            began, began_cpu = time.perf_counter(), time.process_time()
            models[name].train_on_batch(x, y)
            cpu[name].append(time.process_time() - began_cpu)
            wall[name].append(time.perf_counter() - began)
    print(f"{args.steps} steps per variant, interleaved one by one in random "
          f"order, threads={args.threads}")
    print(f"{'variant':16} {'wall, mean':>10} {'wall, median':>13} {'CPU, mean':>10}")
    for name in models:
        ratios = [np.mean(t[name]) / np.mean(t["stock"]) for t in (wall, cpu)]
        median = np.median(wall[name]) / np.median(wall["stock"])
        print(f"{name:16} {ratios[0]:10.3f} {median:13.3f} {ratios[1]:10.3f}")
    for name in models:
        if name != "stock":
            print(f"ratio {name}/stock: wall {np.mean(wall[name]) / np.mean(wall['stock']):.3f}, "
                  f"CPU {np.mean(cpu[name]) / np.mean(cpu['stock']):.3f}")


if __name__ == "__main__":
    main()
