"""Step-time ratio of AdaptiveLossScaleOptimizer to Keras' LossScaleOptimizer.

What it measures
----------------
The training-step time of several `tas.AdaptiveLossScaleOptimizer`
configurations *relative to* the stock `keras.mixed_precision.
LossScaleOptimizer`, in one process, on one model:

- policy `mixed_float16`; MLP 512 -> 1024 -> 1024 -> 10 (ReLU, float32
  softmax), sparse softmax cross-entropy, batch 128, random data generated in
  code (no downloads);
- every variant gets its own freshly built model with identical initial
  weights, wraps `keras.optimizers.Adam()`, and is compiled with
  `jit_compile=True` (`--no-jit`: False) and `steps_per_execution=1`:

  ====================  ==================================================
  stock                 keras.mixed_precision.LossScaleOptimizer(Adam())
  adaptive              tas.AdaptiveLossScaleOptimizer(Adam())  (defaults,
                        update_every=100)
  adaptive_every_step   ... update_every=1 (statistics on every step)
  dynamic               ... scaling="dynamic"
  adaptive_autoclip     ... autoclip_percentile=10
  ====================  ==================================================

Each variant is warmed up first (one `fit` block: tracing, XLA compilation
and the dataset cache are excluded from the timings). Then, for R rounds
(`--repeats`), every variant runs one `model.fit(..., verbose=0)` block of K
steps (`--steps`) over a fixed in-memory dataset, in a freshly shuffled order
each round. For each variant the script reports the median over rounds of the
per-round ratio (variant seconds/step) / (stock seconds/step), its
inter-quartile range, and, as a cross-check, the ratio of the two medians.
A line `ratio adaptive/stock: X.XXX` is printed for grepping.

Only ratios are reported. Absolute times on a noisy, shared 2-core CPU mean
nothing (they move with other tenants, CPU frequency and thread scheduling);
interleaving the variants within each round and taking medians is what makes
the *ratios* usable. The raw per-block seconds/step are kept in the JSON
output for re-analysis only.

Caveats: each `fit` call has a small fixed cost (callbacks, iterator set-up)
that is the same for every variant and biases the ratios slightly towards 1;
a larger `--steps` reduces it. With the default `update_every=100` and
`--steps 50`, the `adaptive` variant measures its gradient statistics in
every second block; `adaptive_every_step` is the worst case. A variant that
skips steps (non-finite gradients) does less work; the table shows applied
steps / total steps for every variant so that this is visible.

How to run (from the repository root)::

    PYTHONPATH=. python benchmarks/step_time.py             # ~1-3 min, 2 cores
    PYTHONPATH=. python benchmarks/step_time.py --no-jit
    PYTHONPATH=. python benchmarks/step_time.py --quick     # < 60 s
    PYTHONPATH=. python benchmarks/step_time.py --repeats 25 --steps 100 \\
        --json step_time.json
"""

import argparse
import gc
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:
    import tf_adaptive_scale as tas
except ImportError:  # `python benchmarks/step_time.py` without PYTHONPATH
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _ROOT)
    import tf_adaptive_scale as tas

BATCH = 128
INPUT_DIM = 512
HIDDEN = (1024, 1024)
CLASSES = 10

QUICK_REPEATS = 5
QUICK_STEPS = 20

BASELINE = "stock"
VARIANTS = {
    "stock": lambda: keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam()
    ),
    "adaptive": lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam()
    ),
    "adaptive_every_step": lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), update_every=1
    ),
    "dynamic": lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="dynamic"
    ),
    "adaptive_autoclip": lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), autoclip_percentile=10
    ),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--repeats", type=int, default=None,
        help="interleaved rounds (default 15; 5 with --quick)",
    )
    parser.add_argument(
        "--steps", type=int, default=None,
        help="training steps per variant per round (default 50; 20 with "
        "--quick)",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help=f"{QUICK_REPEATS} rounds of {QUICK_STEPS} steps (< 60 s); "
        "explicit --repeats/--steps still win",
    )
    parser.add_argument(
        "--no-jit", dest="jit", action="store_false",
        help="compile with jit_compile=False (default: True)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        help="comma-separated subset of: " + ", ".join(VARIANTS)
        + f" ('{BASELINE}' is always included)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=0,
        help="TensorFlow intra/inter-op threads (0: TF's default); 1 gives "
        "far steadier ratios on a shared machine",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else 15
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else 50
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    args.variants = [n for n in VARIANTS if n in names]  # canonical order
    return args


def make_dataset(steps, seed):
    """K batches of random inputs with labels from a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * BATCH, INPUT_DIM)).astype("float32")
    teacher = rng.standard_normal((INPUT_DIM, CLASSES)).astype("float32")
    y = np.argmax(x @ teacher, axis=1).astype("int32")
    # Exactly `steps` full batches: no partial batch, so no retrace.
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache()


def build_model(seed):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((INPUT_DIM,))]
    layers += [keras.layers.Dense(n, activation="relu") for n in HIDDEN]
    layers += [
        keras.layers.Dense(CLASSES),
        # Softmax in float32, as the mixed-precision guide recommends.
        keras.layers.Activation("softmax", dtype="float32"),
    ]
    return keras.Sequential(layers)


def count_traces(model, counter, name):
    """Counts traces of `train_step` (its Python body runs only on tracing)."""
    train_step = model.train_step

    def counted(data):
        counter[name] += 1
        return train_step(data)

    model.train_step = counted


def run_block(model, dataset):
    """One `fit` block over `dataset`; returns (wall seconds, final loss)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        history = model.fit(dataset, epochs=1, verbose=0, shuffle=False)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return elapsed, float(history.history["loss"][-1])


def quartiles(values):
    q25, q50, q75 = np.percentile(np.asarray(values, dtype=np.float64),
                                  [25, 50, 75])
    return float(q25), float(q50), float(q75)


def environment():
    """Versions and machine facts recorded with every JSON result."""
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "tf_adaptive_scale": tas.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def set_threads(threads):
    """Pins TensorFlow's thread pools (before it starts) when `threads` > 0."""
    if threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    keras.mixed_precision.set_global_policy("mixed_float16")
    dataset = make_dataset(args.steps, args.seed)
    reference_weights = build_model(args.seed).get_weights()

    models, optimizers, traces, losses = {}, {}, {}, {}
    for name in args.variants:
        model = build_model(args.seed)
        model.set_weights(reference_weights)  # identical initial weights
        optimizer = VARIANTS[name]()
        traces[name] = 0
        count_traces(model, traces, name)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(),
            jit_compile=args.jit,
            steps_per_execution=1,
        )
        models[name], optimizers[name] = model, optimizer

    # Warm-up: tracing, XLA compilation and filling the dataset cache happen
    # here and are excluded from the timings.
    print(
        f"warming up {len(args.variants)} variants "
        f"(jit_compile={args.jit}) ...",
        flush=True,
    )
    for name in args.variants:
        run_block(models[name], dataset)
    traces_after_warmup = dict(traces)

    shuffler = random.Random(args.seed)
    seconds = {name: [] for name in args.variants}
    orders = []
    for round_index in range(args.repeats):
        order = list(args.variants)
        shuffler.shuffle(order)
        orders.append(order)
        for name in order:
            elapsed, losses[name] = run_block(models[name], dataset)
            seconds[name].append(elapsed / args.steps)
        print(f"  round {round_index + 1}/{args.repeats} done", flush=True)

    retraced = {
        n: traces[n] - traces_after_warmup[n]
        for n in args.variants
        if traces[n] != traces_after_warmup[n]
    }
    total_steps = args.steps * (1 + args.repeats)  # warm-up block included
    results = {}
    for name in args.variants:
        ratios = [v / s for v, s in zip(seconds[name], seconds[BASELINE])]
        q25, median, q75 = quartiles(ratios)
        optimizer = optimizers[name]
        results[name] = {
            "median_ratio": median,
            "ratio_q25": q25,
            "ratio_q75": q75,
            "ratio_of_medians": float(
                np.median(seconds[name]) / np.median(seconds[BASELINE])
            ),
            "per_round_ratio": ratios,
            "applied_steps": int(optimizer.iterations.numpy()),
            "total_steps": total_steps,
            "final_loss_scale": float(optimizer.dynamic_scale.numpy()),
            "final_loss": losses[name],
        }

    mode = "jit_compile=True" if args.jit else "jit_compile=False"
    print()
    print(
        f"Step-time ratio to '{BASELINE}': median over {args.repeats} "
        f"interleaved rounds of {args.steps} steps, {mode}, mixed_float16, "
        f"MLP {INPUT_DIM}-{'-'.join(map(str, HIDDEN))}-{CLASSES}, "
        f"batch {BATCH}."
    )
    print("Ratios only: absolute times on a shared CPU mean nothing.")
    header = (
        f"{'variant':<21} {'median':>7} {'IQR (q25-q75)':>15} "
        f"{'ratio of medians':>17} {'applied/total':>14} {'scale':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in args.variants:
        r = results[name]
        iqr = f"{r['ratio_q25']:.3f}-{r['ratio_q75']:.3f}"
        applied = f"{r['applied_steps']}/{r['total_steps']}"
        print(
            f"{name:<21} {r['median_ratio']:>7.3f} {iqr:>15} "
            f"{r['ratio_of_medians']:>17.3f} {applied:>14} "
            f"{r['final_loss_scale']:>9g}"
        )
    print()
    for name in args.variants:
        if name != BASELINE:
            ratio = results[name]["median_ratio"]
            print(f"ratio {name}/{BASELINE}: {ratio:.3f}")

    warnings = []
    if retraced:
        warnings.append(
            "train_step was retraced during timing (compilation inside the "
            f"timed blocks): {retraced}"
        )
    skipped = [n for n in args.variants
               if results[n]["applied_steps"] != total_steps]
    if skipped:
        warnings.append(
            "variants skipped steps (less work per step, ratios not "
            f"comparable): {skipped}"
        )
    if args.repeats < 4:
        warnings.append("fewer than 4 rounds: the IQR is not meaningful")
    for warning in warnings:
        print("WARNING:", warning)

    if args.json:
        payload = {
            "benchmark": "step_time",
            "note": (
                "Ratios only. raw_seconds_per_step is kept for re-analysis; "
                "absolute times on a shared CPU mean nothing."
            ),
            "config": {
                "policy": "mixed_float16",
                "model": f"MLP {INPUT_DIM}-"
                f"{'-'.join(map(str, HIDDEN))}-{CLASSES}",
                "batch_size": BATCH,
                "loss": "sparse softmax cross-entropy",
                "jit_compile": args.jit,
                "steps_per_execution": 1,
                "repeats": args.repeats,
                "steps": args.steps,
                "quick": args.quick,
                "seed": args.seed,
                "baseline": BASELINE,
                "variants": args.variants,
                "statistic": "median over rounds of per-round ratio "
                "variant/baseline seconds per step",
            },
            "environment": environment(),
            "results": results,
            "round_orders": orders,
            "retraces_during_timing": retraced,
            "warnings": warnings,
            "raw_seconds_per_step": seconds,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
