"""Where a per-layer step's cost over stock comes from: an ablation.

Every variant gets its own copy of one family's model (`zoo.FAMILIES`,
same weights, `mixed_float16`, `Adam()`, XLA unless `--no-xla`), timed
interleaved (`timing.interleave`), as ratios to the stock optimizer:

- `stock_again`: a second stock copy, the run's noise;
- `adaptive`: the global adaptive optimizer (its own bookkeeping);
- `per_layer`: `tas.instrument` + `scaling="per_layer"`, `update_every=100`;
- `no_statistics`: the same, with edges that only convert the gradient
  (the statistics conditionals removed; scales held at 1, so that units
  seeing nothing do not ask to be measured every step);
- `boundaries_only`: the same, with edges that pass the gradient unchanged;
- `stock_on_boundaries`: the stock optimizer on the instrumented graph whose
  edges only convert (the boundaries' cost without the per-layer optimizer);
- `none_mode`: `scaling="none"`, the same bookkeeping without scaling.

The edge variants replace `gradient_scale._convert` while their model's
step is traced
(benchmark-only surgery: training with them is meaningless); no step is
retraced afterwards.

Run: python -m benchmarks.per_layer_ablation [--families cnn,unet]
     [--steps 150] [--no-xla]
"""

import argparse
import contextlib

import keras
from keras import ops

import tf_adaptive_scale as tas
from benchmarks import step_cost
from benchmarks import timing
from benchmarks import zoo
from tf_adaptive_scale.per_layer import gradient_scale


def _convert_only(dy, control, statistics_shape, producer, consumer, input_dtype):
    factor = gradient_scale.stats.pow2(control[producer] - control[consumer])
    dx = ops.cast(ops.cast(dy, "float32") * factor, input_dtype)
    return dx, ops.zeros_like(control), ops.zeros(statistics_shape, "float32")


def _pass_through(dy, control, statistics_shape, producer, consumer, input_dtype):
    return (
        ops.cast(dy, input_dtype),
        ops.zeros_like(control),
        ops.zeros(statistics_shape, "float32"),
    )


@contextlib.contextmanager
def _replaced(owner, name, replacement):
    """`owner.name` is `replacement` inside (unchanged where it is None)."""
    original = getattr(owner, name)
    setattr(owner, name, replacement or original)
    try:
        yield
    finally:
        setattr(owner, name, original)


_stock = step_cost.VARIANTS["stock"][1]
_adaptive = step_cost.VARIANTS["adaptive"][1]
_per_layer = step_cost.VARIANTS["per_layer_100"][1]


def _per_layer_blind():
    """Per layer, held at scale 1: with no statistics every unit would look
    all-underflowed and be measured again each step, climbing."""
    return tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="per_layer", max_scale=1.0
    )


# name: (instrumented, edge function, optimizer). (The global optimizer's
# measurement is selects since issue 24, no conditional to empty: its cost is
# in `kernel_census`.)
VARIANTS = {
    "stock": (False, None, _stock),
    "stock_again": (False, None, _stock),
    "adaptive": (False, None, _adaptive),
    "per_layer": (True, None, _per_layer),
    "no_statistics": (True, _convert_only, _per_layer_blind),
    "boundaries_only": (True, _pass_through, _per_layer_blind),
    "stock_on_boundaries": (True, _convert_only, _stock),
    "none_mode": (False, None, lambda: tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(), scaling="none")),
}


def measure_family(family, jit_compile, steps, seed=0):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(seed)
    reference, shape = zoo.FAMILIES[family]()
    weights = reference.get_weights()
    batch = zoo.batch_for(reference, shape, seed)
    models, traces = {}, {}
    for name, (instrumented, convert, make_optimizer) in VARIANTS.items():
        keras.utils.set_random_seed(seed)
        model, _ = zoo.FAMILIES[family]()
        model.set_weights(weights)
        if instrumented:
            model = tas.instrument(model)
            if make_optimizer is _stock:  # a plain model over the same graph
                model = keras.Model(model.inputs, model.outputs)
        timing.compile_counted(model, make_optimizer(), jit_compile, traces, name)
        with _replaced(gradient_scale, "_convert", convert):
            for _ in range(3):
                model.train_on_batch(*batch)
        models[name] = model
    warm = dict(traces)
    ratios = timing.step_ratios(models, batch, steps, seed)
    retraced = [name for name in models if traces[name] != warm[name]]
    keras.backend.clear_session()
    return {name: r["wall_median"] for name, r in ratios.items()}, retraced


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="cnn,unet,transformer")
    parser.add_argument("--steps", type=int, default=150, help="timed rounds")
    parser.add_argument("--no-xla", dest="xla", action="store_false")
    args = parser.parse_args(argv)
    names = [n for n in VARIANTS if n != "stock"]
    print(f"Median step time / stock's, XLA {'on' if args.xla else 'off'}, "
          f"{args.steps} interleaved rounds\n")
    print("| family | " + " | ".join(f"`{n}`" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for family in args.families.split(","):
        ratios, retraced = measure_family(family, args.xla, args.steps)
        row = " | ".join(f"{ratios[n]:.3f}" for n in names)
        print(f"| {family} | {row} |" + (f" retraced: {retraced}" if retraced else ""),
              flush=True)


if __name__ == "__main__":
    main()
