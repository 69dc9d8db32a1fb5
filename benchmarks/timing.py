"""Shared timing helpers for the benchmarks: interleaved step timing, trace
counting, thread pinning and the machine record.

Ratios only: absolute times on a shared CPU mean nothing. Every variant runs
one `train_on_batch` in turn, in a fresh random order each round, so slow
spells of the machine hit all variants alike.
"""

import os
import platform
import random
import time

import keras
import numpy as np
import tensorflow as tf

import tf_adaptive_scale as tas


def interleave(models, batch, steps, seed=0, reference="stock"):
    """Times `steps` rounds of one `train_on_batch` per model.

    Args:
        models: `{name: compiled, warmed-up model}`.
        batch: `(x, y)` for every step.
        steps: Rounds.
        seed: Seed of the random order.
        reference: The name the ratios are taken to.

    Returns:
        `{name: {"wall", "wall_median", "cpu"}}`: ratios to `reference` of
        the mean and median wall seconds and the mean CPU seconds per step.
    """
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
            "wall": float(np.mean(wall[name]) / np.mean(wall[reference])),
            "wall_median": float(np.median(wall[name]) / np.median(wall[reference])),
            "cpu": float(np.mean(cpu[name]) / np.mean(cpu[reference])),
        }
        for name in models
    }


def compile_counted(model, optimizer, jit_compile, counter, name):
    """Compiles `model` for the benchmarks' classification batches and
    counts its `train_step` traces in `counter[name]`."""
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    counter[name] = 0
    count_traces(model, counter, name)


def count_traces(model, counter, name):
    """Counts traces of `train_step` (its Python body runs only on tracing)."""
    train_step = model.train_step

    def counted(data):
        counter[name] += 1
        return train_step(data)

    model.train_step = counted


def set_threads(threads):
    """Pins TensorFlow's thread pools (before it starts) when `threads` > 0."""
    if threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def environment():
    """Versions and machine facts recorded with every result."""
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "tf_adaptive_scale": tas.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
