"""What a conditional around a compiled training step costs: why
`tas.branch_on_measure` puts the whole step, optimizer included, in its branch.

Variants, all on the instrumented MLP of `step_time.py` with the per-layer
optimizer and a custom XLA step (`jit_compile=True`), except `stock`:
- `no_conditional`: statistics code traced out, never measures (the floor);
- `whole_step`: `branch_on_measure` around forward, backward and `apply`;
- `gradients_out`: `branch_on_measure` around forward and backward only, the
  gradients returned from the branch and applied after it;
- `tf_cond`: a TensorFlow `tf.cond` (not compiled) choosing between two
  separately compiled forward/backward functions, then a compiled `apply`;
- `stock`: the uninstrumented model with the stock LossScaleOptimizer.
The per-layer variants measure every 100 steps (the default `update_every`).
Each variant's steps are interleaved one by one in random order; printed are
ratios to `no_conditional` of the mean wall and CPU time per step (its
measured steps traced out, so it is a floor, not a usable mode).

Run: PYTHONPATH=. python benchmarks/conditional_cost.py [--steps 400] [--threads 1]
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
from tf_adaptive_scale import gradient_scale  # noqa: E402

VARIANTS = ("stock", "no_conditional", "whole_step", "gradients_out", "tf_cond")


def make_step(variant, x, y):
    model = step_time.build_model(0)
    if variant == "stock":
        optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())
    else:
        model = tas.instrument(model)
        optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="per_layer")
        model.scale_table.measure.assign(0.0)
    variables = model.trainable_variables
    optimizer.build(variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def gradients():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(loss_fn(y, model(x, training=True)))
        return tape.gradient(loss, variables)

    def without_statistics():
        with gradient_scale._statistics_off():
            return gradients()

    def whole_step():
        optimizer.apply(gradients(), variables)

    compiled = {
        "stock": lambda: optimizer.apply(gradients(), variables),
        "no_conditional": lambda: optimizer.apply(without_statistics(), variables),
        "whole_step": lambda: tas.branch_on_measure(model, whole_step),
        "gradients_out": lambda: optimizer.apply(
            tas.branch_on_measure(model, gradients), variables
        ),
    }
    if variant in compiled:
        return tf.function(compiled[variant], jit_compile=True)
    with_stats = tf.function(gradients, jit_compile=True)
    plain = tf.function(without_statistics, jit_compile=True)
    apply = tf.function(lambda g: optimizer.apply(g, variables), jit_compile=True)

    @tf.function
    def tf_cond():
        apply(tf.cond(model.scale_table.measure > 0, with_stats, plain))

    return tf_cond


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per variant")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow threads (0: TF's default)")
    args = parser.parse_args(argv)
    step_time.set_threads(args.threads)
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((step_time.BATCH, step_time.INPUT_DIM)), "float32")
    y = tf.constant(rng.integers(0, step_time.CLASSES, step_time.BATCH))
    steps = {name: make_step(name, x, y) for name in VARIANTS}
    for step in steps.values():
        for _ in range(3):  # trace and compile
            step()
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    order, shuffler = list(steps), random.Random(0)
    for _ in range(args.steps):
        shuffler.shuffle(order)
        for name in order:
            began, began_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            cpu[name].append(time.process_time() - began_cpu)
            wall[name].append(time.perf_counter() - began)
    floor = "no_conditional"
    print(f"{args.steps} steps per variant, interleaved, threads={args.threads}; "
          f"ratios to {floor}")
    print(f"{'variant':16} {'wall':>6} {'CPU':>6}")
    for name in steps:
        print(f"{name:16} {np.mean(wall[name]) / np.mean(wall[floor]):6.3f} "
              f"{np.mean(cpu[name]) / np.mean(cpu[floor]):6.3f}")


if __name__ == "__main__":
    main()
