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
mixed_float16, jit_compile=True (the model of `step_time.py`); optionally
without XLA, or under MirroredStrategy over logical CPUs.

Run: PYTHONPATH=. python benchmarks/per_step_cost.py [--steps 400] [--threads 1]
     [--no-jit] [--replicas 2]
"""

import argparse
import os
import random
import sys
import time

import keras
import numpy as np
import tensorflow as tf

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


def build(names, seed=0, jit_compile=True):
    """`{name: compiled model}` for the named VARIANTS, warmed up (traced and
    compiled), all from the same initial weights; and the batch `(x, y)`.
    Models are built in the current `tf.distribute` strategy's scope."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((step_time.BATCH, step_time.INPUT_DIM)).astype("float32")
    y = rng.integers(0, step_time.CLASSES, step_time.BATCH)
    weights = step_time.build_model(seed).get_weights()
    models = {}
    for name in names:
        instrumented, make_optimizer = VARIANTS[name]
        model = step_time.build_model(seed)
        model.set_weights(weights)
        if instrumented:
            model = tas.instrument(model)
        model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(),
                      jit_compile=jit_compile)
        for _ in range(3):
            model.train_on_batch(x, y)
        models[name] = model
    return models, (x, y)


def interleave(models, batch, steps, seed=0):
    """Runs `steps` rounds of one `train_on_batch` per model, in a fresh
    random order each round. Returns `{name: {"wall", "cpu", "wall_median"}}`,
    ratios to `models["stock"]` of the mean wall and CPU seconds per step."""
    wall = {name: [] for name in models}
    cpu = {name: [] for name in models}
    order, shuffler = list(models), random.Random(seed)
    for _ in range(steps):
        shuffler.shuffle(order)
        for name in order:
            began, began_cpu = time.perf_counter(), time.process_time()
            models[name].train_on_batch(*batch)
            cpu[name].append(time.process_time() - began_cpu)
            wall[name].append(time.perf_counter() - began)
    return {
        name: {
            "wall": float(np.mean(wall[name]) / np.mean(wall["stock"])),
            "cpu": float(np.mean(cpu[name]) / np.mean(cpu["stock"])),
            "wall_median": float(np.median(wall[name]) / np.median(wall["stock"])),
        }
        for name in models
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per variant")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow threads (0: TF's default)")
    parser.add_argument("--no-jit", dest="jit", action="store_false",
                        help="jit_compile=False")
    parser.add_argument("--replicas", type=int, default=1,
                        help="MirroredStrategy over this many logical CPUs "
                        "(implies --no-jit: XLA clusters cannot reach the "
                        "other logical devices' variables)")
    args = parser.parse_args(argv)
    step_time.set_threads(args.threads)
    strategy = tf.distribute.get_strategy()
    if args.replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas
        )
        strategy = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(args.replicas)]
        )
        args.jit = False
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        models, batch = build(VARIANTS, jit_compile=args.jit)
    ratios = interleave(models, batch, args.steps)
    print(f"{args.steps} steps per variant, interleaved one by one in random "
          f"order, threads={args.threads}, jit_compile={args.jit}, "
          f"replicas={args.replicas}")
    print(f"{'variant':16} {'wall, mean':>10} {'wall, median':>13} {'CPU, mean':>10}")
    for name, r in ratios.items():
        print(f"{name:16} {r['wall']:10.3f} {r['wall_median']:13.3f} {r['cpu']:10.3f}")
    for name, r in ratios.items():
        if name != "stock":
            print(f"ratio {name}/stock: wall {r['wall']:.3f}, CPU {r['cpu']:.3f}")


if __name__ == "__main__":
    main()
