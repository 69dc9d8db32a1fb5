"""Skipped steps at start-up, and recovery after a burst of non-finite data.

What it measures
----------------
A. Start-up skips. A loss scale that starts far from where the gradients need
   it either overflows (the step is skipped and the scale halved) or lets
   gradients underflow. For loss factors 1e-8, 1e-4, 1, 1e4, 1e8 (the training
   loss is the model's loss multiplied by the factor, in a custom loss
   function) and two model families, each run trains `--steps` (default 50)
   `train_on_batch` steps under `mixed_float16` with `jit_compile=True`,
   Adam(1e-3) inside, every optimizer with its DEFAULT arguments:

   =========  ===========================================================
   stock      keras.mixed_precision.LossScaleOptimizer(Adam(1e-3))
   adaptive   tas.AdaptiveLossScaleOptimizer(Adam(1e-3), scaling="adaptive")
   per-layer  tas.instrument(model) compiled with
              tas.AdaptiveLossScaleOptimizer(Adam(1e-3), scaling="per_layer")
   =========  ===========================================================

   Families: `mlp` (32-64-64-10, ReLU, float32 logits, sparse softmax
   cross-entropy averaged over a batch of 64) and `conv` (three 3x3 Conv2D
   layers and a 1x1 Conv2D on 16x16x3 inputs predicting a 16x16x1 map,
   float32 output, loss = squared error SUMMED over every pixel of a batch of
   8, the per-pixel sum loss of dense prediction, where the stock optimizer's
   2**15 start overflows). Adam's update does not depend on the gradient's
   magnitude, so every factor trains alike; only the scaling differs.

   Skipped steps: for stock, steps minus the inner optimizer's `iterations`
   (it only counts applied steps; cross-checked step by step against a
   falling `dynamic_scale`); for ours, `int(optimizer.skipped_steps)`. The
   steps at which skips happened are listed per row (0-based), so "at most
   one skipped step at start-up" can be read off directly. Final scales are
   log2 of `loss_scale` (stock: `dynamic_scale`); for per-layer, the min and
   max over `inst.layer_scales()` (every layer, weightless ones included).

B. Recovery after a burst. MLP, global adaptive optimizer (defaults,
   `mixed_float16`): 20 clean steps, then 30 steps whose batch has
   x[0, 0] = NaN (every one is skipped), then 100 clean steps. After each
   phase (and at a few points inside the recovery) it prints log2 of
   `loss_scale`, log2 of the adaptive ceiling (`scale_ceiling`, or whatever
   the optimizer now calls it; "n/a" if none is found), `skipped_steps`,
   the optimizer's own `underflow_fraction` (of its last measurement) and an
   independent underflow share: the float32 reference gradients of a float32
   copy of the model at the current weights on the clean batch, times the
   current scale; the share of the nonzero values with |g * scale| < 2**-24,
   i.e. that would flush to zero in float16. The same burst runs with the
   stock LossScaleOptimizer for comparison.

How to read the output
----------------------
Table A has one row per family x loss factor. `skips` columns are skipped
steps out of `--steps`; `log2` columns are the final scale exponents
(per-layer: min..max); the `skipped at` column lists the steps skipped by
stock / adaptive / per-layer as runs of 0-based steps ("0-9" = the first
ten steps). The `<=1` column says whether both of ours
skipped at most one step in that row. A summary line counts the rows where
either of ours skipped more than one step.

Table B: a scale that stays at its floor after the burst with a large
reference underflow share means the optimizer has not recovered: gradients
are being flushed to zero. The stock optimizer halves once per skipped step
and doubles only after 2000 clean steps, so it is shown for comparison.

Caveats: CPU float16 kernels are not GPU ones; models are tiny; one seed.
Times are wall times on whatever machine runs it, for orientation only.

How to run (from the repository root)::

    .venv/bin/python -m benchmarks.startup_and_recovery          # ~2.5-4 min, 2 cores
    .venv/bin/python -m benchmarks.startup_and_recovery --quick  # 3 factors, shorter phases
    .venv/bin/python -m benchmarks.startup_and_recovery --only recovery
"""

import argparse
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402
from benchmarks import zoo  # noqa: E402

FACTORS = (1e-8, 1e-4, 1.0, 1e4, 1e8)
QUICK_FACTORS = (1e-8, 1.0, 1e8)
OPTIMIZERS = ("stock", "adaptive", "per_layer")
FLOAT16_TINY = 2.0**-24  # smallest float16 subnormal
# Names the adaptive ceiling has had or may get; the first found is used.
CEILING_NAMES = ("scale_ceiling", "ceiling", "scale_cap", "_scale_ceiling")
LEARNING_RATE = 1e-3

MLP_BATCH, MLP_IN, MLP_CLASSES = 64, 32, 10
CONV_BATCH, CONV_SIDE = 8, 16


# --------------------------------------------------------------------------
# Models, data and losses
# --------------------------------------------------------------------------


def build_mlp():
    return zoo.mlp(MLP_IN, (64, 64), MLP_CLASSES, float32_output=True, names=zoo.MLP_NAMES,
                   name="mlp")


def build_conv():
    return zoo.cnn((CONV_SIDE, CONV_SIDE, 3), (16, 16, 16), head="map", float32_output=True,
                   names=zoo.CNN_NAMES, name="conv")


def data_mlp(rng, batches):
    """`batches` batches of Gaussian inputs, labels from a linear teacher."""
    teacher = rng.standard_normal((MLP_IN, MLP_CLASSES)).astype("float32")
    x = rng.standard_normal((batches, MLP_BATCH, MLP_IN)).astype("float32")
    return [(xb, np.argmax(xb @ teacher, axis=1).astype("int32")) for xb in x]


def data_conv(rng, batches):
    """Gaussian images; target map = a fixed smooth function of the input."""
    shape = (batches, CONV_BATCH, CONV_SIDE, CONV_SIDE, 3)
    x = rng.standard_normal(shape).astype("float32")
    y = np.tanh(x[..., :1] + 0.5 * x[..., 1:2] - x[..., 2:3]).astype("float32")
    return list(zip(x, y))


def loss_ce(y_true, y_pred):
    return ops.mean(
        keras.losses.sparse_categorical_crossentropy(
            y_true, ops.cast(y_pred, "float32"), from_logits=True
        )
    )


def loss_sse_sum(y_true, y_pred):
    """Squared error summed over every pixel of the batch."""
    return ops.sum(ops.square(ops.cast(y_pred, "float32") - y_true))


FAMILIES = {
    # name: (builder, data, base loss)
    "mlp": (build_mlp, data_mlp, loss_ce),
    "conv": (build_conv, data_conv, loss_sse_sum),
}


def scaled_loss(base, factor):
    """The training loss: `base` times `factor`."""

    def loss(y_true, y_pred):
        return base(y_true, y_pred) * factor

    loss.__name__ = f"{base.__name__}_x{factor:g}"
    return loss


def build_model(builder, seed, policy="mixed_float16"):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        return builder()
    finally:
        keras.mixed_precision.set_global_policy(previous)


def make_optimizer(kind):
    inner = keras.optimizers.Adam(LEARNING_RATE)
    if kind == "stock":
        return keras.mixed_precision.LossScaleOptimizer(inner)
    if kind == "adaptive":
        return tas.AdaptiveLossScaleOptimizer(inner, scaling="adaptive")
    return tas.AdaptiveLossScaleOptimizer(inner, scaling="per_layer")


def compiled(kind, model, loss):
    """`model` (instrumented for per-layer) compiled with a fresh `kind`."""
    trained = tas.instrument(model) if kind == "per_layer" else model
    trained.compile(optimizer=make_optimizer(kind), loss=loss, jit_compile=True)
    return trained


# --------------------------------------------------------------------------
# Reading optimizer state (tolerant of renamed attributes)
# --------------------------------------------------------------------------


def _value(variable):
    """A variable's (or a plain number's) value as a NumPy array."""
    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable)


def read_scale(optimizer):
    for name in ("loss_scale", "dynamic_scale"):
        value = getattr(optimizer, name, None)
        if value is not None:
            return float(_value(value))
    return None


def read_ceiling(optimizer):
    for name in CEILING_NAMES:
        value = getattr(optimizer, name, None)
        if value is not None:
            return float(_value(value))
    return None


def read_skipped(optimizer, steps):
    """Ours: `skipped_steps`; stock: steps minus applied (`iterations`)."""
    value = getattr(optimizer, "skipped_steps", None)
    if value is not None:
        return int(_value(value))
    return steps - int(_value(optimizer.iterations))


def read_attr(optimizer, name):
    value = getattr(optimizer, name, None)
    return None if value is None else float(_value(value))


def log2(value):
    if value is None:
        return None
    if value <= 0 or not math.isfinite(value):
        return value
    return math.log2(value)


def fmt(value, spec="g"):
    return "n/a" if value is None else format(value, spec)


# --------------------------------------------------------------------------
# A. Start-up skips
# --------------------------------------------------------------------------


def startup_run(kind, family, factor, steps, seed=0):
    """Trains `steps` steps; returns skips, the steps skipped and log2 scales."""
    builder, data, base = FAMILIES[family]
    batches = data(np.random.default_rng(seed), steps)
    model = build_model(builder, seed)
    trained = compiled(kind, model, scaled_loss(base, factor))
    optimizer = trained.optimizer
    skipped_at, previous = [], 0
    for step, (x, y) in enumerate(batches):
        trained.train_on_batch(x, y)
        skipped = read_skipped(optimizer, step + 1)
        if skipped > previous:
            skipped_at.append(step)
        previous = skipped
    result = {"skipped": previous, "skipped_at": skipped_at}
    if kind == "stock":
        # Cross-check: the stock scale halves exactly on skipped steps and
        # cannot double within 2000 steps.
        halvings = round(math.log2(optimizer.initial_scale / read_scale(optimizer)))
        result["cross_check"] = halvings == previous
    if kind == "per_layer":
        scales = [log2(s) for s in trained.layer_scales().values()]
        result["log2"] = (min(scales), max(scales))
    else:
        result["log2"] = (log2(read_scale(optimizer)),) * 2
    keras.backend.clear_session()
    return result


def startup(factors, steps):
    rows = []
    for family in FAMILIES:
        for factor in factors:
            began = time.perf_counter()
            row = {"family": family, "factor": factor}
            for kind in OPTIMIZERS:
                row[kind] = startup_run(kind, family, factor, steps)
            row["seconds"] = time.perf_counter() - began
            rows.append(row)
            print(f"  {family:4} x{factor:<6g} done in {row['seconds']:.0f} s", flush=True)
    return rows


def _fmt_log2(pair):
    low, high = pair
    if low == high:
        return f"{low:g}"
    return f"{low:g}..{high:g}"


def _fmt_at(at):
    """Steps as runs: [0, 1, 2, 7] -> "0-2,7"; none -> "-"."""
    if not at:
        return "-"
    runs, start = [], at[0]
    for previous, step in zip(at, at[1:] + [None]):
        if step is None or step != previous + 1:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
            start = step
    return ",".join(runs)


def print_startup(rows, steps):
    print()
    print(f"A. Start-up: skipped steps in the first {steps} and final log2 scale "
          "(mixed_float16, Adam(1e-3), defaults)")
    header = (f"{'family':6} {'factor':>6} | {'skips: stock':>12} {'adapt':>5} "
              f"{'per-layer':>9} | {'log2: stock':>11} {'adapt':>6} {'per-layer':>11}"
              f" | {'<=1':>3} | skipped at: stock / adaptive / per-layer")
    print(header)
    print("-" * len(header))
    for r in rows:
        s, a, p = (r[k] for k in OPTIMIZERS)
        ok = "yes" if max(a["skipped"], p["skipped"]) <= 1 else "NO"
        print(f"{r['family']:6} {r['factor']:>6g} | {s['skipped']:>12} {a['skipped']:>5} "
              f"{p['skipped']:>9} | {_fmt_log2(s['log2']):>11} {_fmt_log2(a['log2']):>6} "
              f"{_fmt_log2(p['log2']):>11} | {ok:>3} | "
              f"{_fmt_at(s['skipped_at'])} / {_fmt_at(a['skipped_at'])} / "
              f"{_fmt_at(p['skipped_at'])}")
    for kind in ("adaptive", "per_layer"):
        bad = [f"{r['family']} x{r['factor']:g} ({r[kind]['skipped']})"
               for r in rows if r[kind]["skipped"] > 1]
        print(f"{kind}: {len(rows) - len(bad)}/{len(rows)} rows with at most 1 "
              f"skipped step" + (f"; more in: {', '.join(bad)}" if bad else ""))
    mismatched = [f"{r['family']} x{r['factor']:g}" for r in rows
                  if not r["stock"]["cross_check"]]
    print("stock: skips (steps - iterations) match the scale's halvings in "
          + ("every row" if not mismatched else f"all rows but {', '.join(mismatched)}"))


# --------------------------------------------------------------------------
# B. Recovery after a burst of non-finite data
# --------------------------------------------------------------------------


def reference_underflow(reference, model, x, y, scale):
    """Share of the nonzero float32 reference weight gradients (float32 copy
    of `model` at its current weights, clean batch) with |g * scale| below
    float16's smallest subnormal."""
    reference.set_weights(model.get_weights())
    with tf.GradientTape() as tape:
        loss = loss_ce(y, reference(x, training=True))
    grads = tape.gradient(loss, reference.trainable_variables)
    g = np.abs(np.concatenate([np.ravel(t.numpy()) for t in grads]).astype(np.float64))
    nonzero = g[g > 0]
    if nonzero.size == 0:
        return None
    return float(np.mean(nonzero * scale < FLOAT16_TINY))


SPIKE = 1e7


def recovery_run(kind, phases, checkpoints, burst="nan", seed=0):
    """Clean / burst / clean phases; returns one dict per checkpoint.

    `burst`: `"nan"` puts a NaN in each burst batch (bad data: the loss is
    NaN); `"spike"` multiplies the loss by `SPIKE` (finite loss, gradients
    that overflow: a genuine overflow burst).
    """
    rng = np.random.default_rng(seed)
    batches = data_mlp(rng, 8)
    model = build_model(build_mlp, seed)
    reference = build_model(build_mlp, seed, policy="float32")
    spike = keras.Variable(1.0, trainable=False, name="spike")

    def loss(y_true, y_pred):
        return loss_ce(y_true, y_pred) * spike

    model.compile(optimizer=make_optimizer(kind), loss=loss, jit_compile=True)
    optimizer = model.optimizer
    x_clean, y_clean = batches[0]
    records, step = [], 0
    for phase, (name, count, poisoned) in enumerate(phases):
        for i in range(count):
            x, y = batches[step % len(batches)]
            spike.assign(SPIKE if poisoned and burst == "spike" else 1.0)
            if poisoned and burst == "nan":
                x = x.copy()
                x[0, 0] = np.nan
            model.train_on_batch(x, y)
            step += 1
            if i + 1 == count or (phase == len(phases) - 1 and i + 1 in checkpoints):
                scale = read_scale(optimizer)
                records.append({
                    "label": f"{name} ({i + 1}/{count})",
                    "step": step,
                    "log2_scale": log2(scale),
                    "log2_ceiling": log2(read_ceiling(optimizer)),
                    "skipped": read_skipped(optimizer, step),
                    "underflow_fraction": read_attr(optimizer, "underflow_fraction"),
                    "reference_underflow": reference_underflow(
                        reference, model, x_clean, y_clean, scale),
                })
    keras.backend.clear_session()
    return records


def recovery(clean, burst, after, kind_of_burst):
    name = {"nan": "NaN burst", "spike": "spike burst"}[kind_of_burst]
    phases = (("clean", clean, False), (name, burst, True), ("recovery", after, False))
    checkpoints = {1, 10, after // 2}
    return {
        kind: recovery_run(kind, phases, checkpoints, kind_of_burst)
        for kind in ("adaptive", "stock")
    }


def print_recovery(results, clean, burst, after, kind_of_burst):
    what = {"nan": "with x[0,0]=NaN (bad data: NaN loss)",
            "spike": f"with the loss x{SPIKE:g} (finite loss, overflowing gradients)"}
    print()
    print(f"B. Recovery: MLP, mixed_float16, defaults; {clean} clean steps, {burst} "
          f"steps {what[kind_of_burst]}, {after} clean steps")
    for kind, records in results.items():
        title = {"adaptive": "tas.AdaptiveLossScaleOptimizer(scaling='adaptive')",
                 "stock": "keras.mixed_precision.LossScaleOptimizer"}[kind]
        print(f"{kind}: {title}")
        header = (f"  {'after':22} {'step':>4} {'log2 scale':>10} {'log2 ceiling':>12} "
                  f"{'skipped':>7} {'underflow_fraction':>18} {'ref. underflow':>14}")
        print(header)
        print("  " + "-" * (len(header) - 2))
        for r in records:
            print(f"  {r['label']:22} {r['step']:>4} {fmt(r['log2_scale']):>10} "
                  f"{fmt(r['log2_ceiling']):>12} {r['skipped']:>7} "
                  f"{fmt(r['underflow_fraction'], '.4g'):>18} "
                  f"{fmt(r['reference_underflow'], '.4g'):>14}")
    print("ref. underflow: share of nonzero float32 reference weight gradients "
          "(clean batch, current weights) with |g*scale| < 2**-24")


# --------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="start-up steps per run (default 50; --quick: 30)")
    parser.add_argument("--quick", action="store_true",
                        help="factors 1e-8, 1, 1e8 only, 30 start-up steps, "
                        "recovery phases 10/10/50")
    parser.add_argument("--only", choices=("startup", "recovery"), default=None,
                        help="run one part only")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 30 if args.quick else 50
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    args.factors = QUICK_FACTORS if args.quick else FACTORS
    args.phases = (10, 10, 50) if args.quick else (20, 30, 100)
    return args


def main(argv=None):
    args = parse_args(argv)
    began = time.perf_counter()
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}, "
          f"tf_adaptive_scale {tas.__version__} "
          f"({os.path.dirname(os.path.abspath(tas.__file__))}), {os.cpu_count()} CPUs",
          flush=True)
    if args.only != "recovery":
        rows = startup(args.factors, args.steps)
        print_startup(rows, args.steps)
        print(f"(part A: {time.perf_counter() - began:.0f} s)", flush=True)
    if args.only != "startup":
        began_b = time.perf_counter()
        for kind_of_burst in ("nan", "spike"):
            results = recovery(*args.phases, kind_of_burst)
            print_recovery(results, *args.phases, kind_of_burst)
        print(f"(part B: {time.perf_counter() - began_b:.0f} s)")
    print(f"total: {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
