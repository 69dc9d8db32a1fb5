"""The benchmarks' one timing harness, and what the timing scripts share:
trace counting, thread pinning and the machine record.

Ratios only: absolute times on a shared CPU mean nothing. `interleave` runs
every variant once per round, in a fresh random order each round, so slow
spells of the machine hit all variants alike; a second copy of the
reference (stock against stock) gives the run's noise.

Keras, TensorFlow and the package are imported only where they are used:
`gpu_check.py` times on a machine without TensorFlow, and a parent process
that times its children (`first_step.py`) stays light.
"""

import os
import platform
import random
import time

import numpy as np


def interleave(callables, rounds, seed=0, warmup=0):
    """Times `rounds` rounds of one call of each callable, in a fresh random
    order each round.

    Args:
        callables: `{name: callable}`, each called without arguments (one
            step, one epoch, one child process: what a sample is); it must
            wait for its work to finish.
        rounds: Timed rounds.
        seed: Seed of the random order, or a `random.Random` to draw it from.
        warmup: Untimed rounds first (same order draws).

    Returns:
        `{name: {"wall": [...], "cpu": [...], "value": [...]}}`: per timed
        call its wall and process CPU seconds and what it returned.
    """
    times = {name: {"wall": [], "cpu": [], "value": []} for name in callables}
    order = list(callables)
    shuffler = seed if isinstance(seed, random.Random) else random.Random(seed)
    for round_ in range(warmup + rounds):
        shuffler.shuffle(order)
        for name in order:
            began, began_cpu = time.perf_counter(), time.process_time()
            value = callables[name]()
            cpu = time.process_time() - began_cpu
            wall = time.perf_counter() - began
            if round_ >= warmup:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
                times[name]["value"].append(value)
    return times


def medians(times, key="wall"):
    """`{name: median of its key}` of `interleave`'s times."""
    return {name: float(np.median(t[key])) for name, t in times.items()}


def ratios(times, reference="stock"):
    """`{name: {"wall", "wall_median", "cpu"}}`: the ratios to `reference`'s
    of the mean and median wall seconds and the mean CPU seconds."""
    ref = times[reference]
    return {
        name: {
            "wall": float(np.mean(t["wall"]) / np.mean(ref["wall"])),
            "wall_median": float(np.median(t["wall"]) / np.median(ref["wall"])),
            "cpu": float(np.mean(t["cpu"]) / np.mean(ref["cpu"])),
        }
        for name, t in times.items()
    }


def step_ratios(models, batch, steps, seed=0, reference="stock"):
    """`ratios` of `steps` interleaved rounds of one `train_on_batch(*batch)`
    per model (`{name: compiled, warmed-up model}`)."""
    calls = {name: (lambda model=model: model.train_on_batch(*batch))
             for name, model in models.items()}
    return ratios(interleave(calls, steps, seed), reference)


def compile_counted(model, optimizer, jit_compile, counter, name):
    """Compiles `model` for the benchmarks' classification batches and
    counts its `train_step` traces in `counter[name]`."""
    import keras

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
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def environment():
    """Versions and machine facts recorded with every result."""
    import keras
    import tensorflow as tf

    import tf_adaptive_scale as tas

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
