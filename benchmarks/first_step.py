"""The first training step's time (`compile`, tracing and XLA compiling),
each in a fresh process, per-layer and adaptive against stock.

`step_cost.py` times every variant's first step in one process, one sample
each, after the variants compiled before it: the first variant also pays
for starting XLA, later ones find caches warm. Here every sample is a new
Python process that builds one model and times its `compile`
(`mixed_float16`, `Adam()`, XLA unless `--no-xla`) and first
`train_on_batch`; the variants alternate, in a fresh random order each
round (`timing.interleave`), and the ratios of the medians to stock's are
printed as Markdown.

Run: python -m benchmarks.first_step [--families mlp,cnn,unet,transformer]
     [--rounds 3] [--no-xla]
"""

import argparse
import json
import os
import random
import subprocess
import sys

from benchmarks import timing

# step_cost.VARIANTS names.
VARIANTS = ("stock", "adaptive", "per_layer_100")


def first_step(family, variant, jit_compile):
    """Seconds of `compile` and the first `train_on_batch` of a fresh model
    (in this process: call it in a new one)."""
    import time

    import keras

    import tf_adaptive_scale as tas
    from benchmarks import step_cost
    from benchmarks import zoo

    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model, shape = zoo.FAMILIES[family]()
    batch = zoo.batch_for(model, shape, 0)
    instrumented, make_optimizer = step_cost.VARIANTS[variant]
    if instrumented:
        model = tas.instrument(model)
    optimizer = make_optimizer()
    # `compile` is timed too: an instrumented model's builds its optimizer.
    began = time.perf_counter()
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    model.train_on_batch(*batch)
    return time.perf_counter() - began


def _sample(family, variant, jit_compile):
    code = (
        "import json; from benchmarks import first_step; "
        f"print('FIRST', json.dumps(first_step.first_step({family!r}, {variant!r}, "
        f"{jit_compile!r})))"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True,
    ).stdout
    (line,) = [l for l in out.splitlines() if l.startswith("FIRST ")]
    return json.loads(line.split(" ", 1)[1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="mlp,cnn,unet,transformer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-xla", dest="xla", action="store_false")
    args = parser.parse_args(argv)
    print(f"First step / stock's first step, each in a fresh process, medians of "
          f"{args.rounds}, XLA {'on' if args.xla else 'off'}\n")
    print("| family | stock (s) | adaptive | per-layer |")
    print("|---|---|---|---|")
    shuffler = random.Random(0)
    for family in args.families.split(","):
        samples = {v: (lambda v=v: _sample(family, v, args.xla)) for v in VARIANTS}
        # The seconds each child measured, not the child's whole life.
        median = timing.medians(timing.interleave(samples, args.rounds, shuffler), "value")
        print(f"| {family} | {median['stock']:.2f} | "
              f"{median['adaptive'] / median['stock']:.2f} | "
              f"{median['per_layer_100'] / median['stock']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
