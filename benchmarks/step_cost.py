"""Step-time cost of adaptive and per-layer loss scaling, per architecture.

For each family of `zoo.FAMILIES` (an MLP, a small CNN, a U-Net, a
transformer encoder, and `keras.applications` ResNet50 and MobileNetV2 with
`weights=None` at small inputs) and with and without XLA, every variant gets its own copy of the
model with the same initial weights, `mixed_float16`, `Adam()`:

- `stock`: `keras.mixed_precision.LossScaleOptimizer`, twice (the second
  copy's ratio to the first says how noisy the run was);
- `adaptive`: `tas.AdaptiveLossScaleOptimizer` (global adaptive scale);
- `per_layer_100`, `per_layer_1`: `tas.instrument(model)` with
  `scaling="per_layer"` at `update_every=100` and `=1`;
- `train_step`: `tas.make_train_step` with the adaptive optimizer, its loss
  read back every step as `train_on_batch` does.

Reported, as ratios to `stock` (interleaved `train_on_batch` steps in random
order, medians; `timing.interleave`): the step time; the first step's time
(tracing and compiling included); and `tas.instrument`'s own time in
seconds. The table is printed as Markdown and written, with the machine and
the command, to `benchmarks/RESULTS.md` (`--out`).

Run: python -m benchmarks.step_cost [--steps 40] [--families mlp,cnn]
     [--no-xla | --xla-only] [--out benchmarks/RESULTS.md]
"""

import argparse
import os
import sys
import time

import keras

import tf_adaptive_scale as tas
from benchmarks import timing
from benchmarks.zoo import FAMILIES
from benchmarks.zoo import batch_for

VARIANTS = {
    "stock": (False, lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())),
    # A second stock copy: its ratio to the first is the run's noise.
    "stock_again": (False, lambda: keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam())),
    "adaptive": (False, lambda: tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())),
    "per_layer_100": (True, lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="per_layer")),
    "per_layer_1": (True, lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="per_layer", update_every=1)),
}


class CompiledStep:
    """`tas.make_train_step` (adaptive) behind `train_on_batch`, which it
    matches by returning the loss as a number (one host sync per step)."""

    def __init__(self, model, jit_compile):
        self.step = tas.make_train_step(
            model,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
            jit_compile=jit_compile,
        )

    def train_on_batch(self, x, y):
        return float(self.step(x, y)["loss"])


def measure_family(family, jit_compile, steps, seed=0):
    """Builds, compiles and times every variant of one family."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(seed)
    reference, shape = FAMILIES[family]()
    weights = reference.get_weights()
    batch = batch_for(reference, shape, seed)
    models, first, instrument_seconds, traces = {}, {}, None, {}
    for name, (per_layer, make_optimizer) in VARIANTS.items():
        keras.utils.set_random_seed(seed)
        model, _ = FAMILIES[family]()
        model.set_weights(weights)
        if per_layer:
            began = time.perf_counter()
            model = tas.instrument(model)
            instrument_seconds = time.perf_counter() - began
        timing.compile_counted(model, make_optimizer(), jit_compile, traces, name)
        began = time.perf_counter()
        model.train_on_batch(*batch)
        first[name] = time.perf_counter() - began
        for _ in range(2):
            model.train_on_batch(*batch)
        models[name] = model
    keras.utils.set_random_seed(seed)
    model, _ = FAMILIES[family]()
    model.set_weights(weights)
    began = time.perf_counter()
    models["train_step"] = CompiledStep(model, jit_compile)
    models["train_step"].train_on_batch(*batch)
    first["train_step"] = time.perf_counter() - began
    for _ in range(2):
        models["train_step"].train_on_batch(*batch)
    traces["train_step"] = models["train_step"].step.tracing_count()
    warm_traces = dict(traces)
    ratios = timing.step_ratios(models, batch, steps, seed)
    traces["train_step"] = models["train_step"].step.tracing_count()
    result = {
        name: dict(
            ratios[name],
            first_step=first[name] / first["stock"],
            retraces=traces[name] - warm_traces[name],
        )
        for name in models
    }
    keras.backend.clear_session()
    return {"ratios": result, "instrument_seconds": instrument_seconds,
            "params": reference.count_params(), "batch": list(shape)}


def markdown(results):
    lines = [
        "| family | XLA | stock again (noise) | adaptive | per-layer, every 100 "
        "| per-layer, every step | `make_train_step` | first step: adaptive "
        "| first step: per-layer | `tas.instrument` (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (family, jit), r in results.items():
        q = r["ratios"]
        lines.append(
            f"| {family} | {'yes' if jit else 'no'} "
            f"| {q['stock_again']['wall_median']:.3f} "
            f"| {q['adaptive']['wall_median']:.3f} "
            f"| {q['per_layer_100']['wall_median']:.3f} "
            f"| {q['per_layer_1']['wall_median']:.3f} "
            f"| {q['train_step']['wall_median']:.3f} "
            f"| {q['adaptive']['first_step']:.2f} "
            f"| {q['per_layer_100']['first_step']:.2f} "
            f"| {r['instrument_seconds']:.2f} |"
        )
    return "\n".join(lines)


def write_results(path, table, results, args, seconds):
    env = timing.environment()
    retraced = {
        f"{family}/{'xla' if jit else 'no-xla'}/{name}": q["retraces"]
        for (family, jit), r in results.items()
        for name, q in r["ratios"].items() if q["retraces"]
    }
    with open(path, "w") as f:
        f.write("# Step-time cost per architecture\n\n")
        f.write("Written by `python -m benchmarks.step_cost "
                + " ".join(args) + f"` in {seconds:.0f} s.\n\n")
        f.write("Medians of interleaved `train_on_batch` step times, as ratios to "
                "the stock `keras.mixed_precision.LossScaleOptimizer` on the same "
                "model (`mixed_float16`, `Adam()`); first step: tracing and "
                "compiling included, ratio to stock's first step.\n\n")
        f.write(table + "\n\n")
        f.write("Machine: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n\n")
        f.write("Retraces during timing: " + (str(retraced) if retraced else "none") + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--no-xla", dest="xla", action="store_const", const=(False,),
                        default=(True, False), help="only jit_compile=False")
    parser.add_argument("--xla-only", dest="xla", action="store_const", const=(True,),
                        help="only jit_compile=True")
    parser.add_argument("--threads", type=int, default=0, help="TensorFlow threads (0: default)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = parser.parse_args(argv)
    timing.set_threads(args.threads)
    began = time.perf_counter()
    results = {}
    for family in args.families.split(","):
        for jit in args.xla:
            results[(family, jit)] = measure_family(family, jit, args.steps)
            print(f"  {family} (XLA {'on' if jit else 'off'}) done, "
                  f"{time.perf_counter() - began:.0f} s", flush=True)
            if args.out:  # after every family: a long run keeps what it measured
                write_results(args.out, markdown(results), results, argv,
                              time.perf_counter() - began)
    print(markdown(results))
    if args.out:
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
