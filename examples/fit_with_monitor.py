"""`model.fit` in mixed_float16 under XLA, watched by `tas.ScaleMonitor`.

A small MLP trains on generated data with `tas.AdaptiveLossScaleOptimizer`.
Every `--every` steps the monitor reads what the optimizer measured inside
the compiled step and records it in the `History` that `fit` returns:
`scale/...` keys (loss scale, skipped steps, gradient norm, clip rate)
and per-layer `layer/<name>/...` keys (gradient norm, scale, share of the
gradient values that underflow or overflow float16). It also writes them to
TensorBoard and to `OUT/logs/scale_monitor.jsonl`; `tas.plot_report` then
draws PNG pictures into `OUT/report` (when matplotlib is installed).

Run: python examples/fit_with_monitor.py [--epochs 8] [--every 20]
     [--out scale_monitor_logs]
     (then, optionally: tensorboard --logdir scale_monitor_logs/logs)
"""

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402


def pow2(scale):
    """A power-of-two scale as `2**k`."""
    return f"2**{round(math.log2(scale))}"


def make_data(n=4096, features=32, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x[:, :12] @ rng.standard_normal((12, classes))).argmax(axis=1)
    return x, y.astype("int32")


def make_model(features, classes):
    inputs = keras.Input((features,))
    h = keras.layers.Dense(128, activation="relu", name="hidden_1")(inputs)
    h = keras.layers.Dense(128, activation="relu", name="hidden_2")(h)
    h = keras.layers.Dense(64, activation="relu", name="hidden_3")(h)
    outputs = keras.layers.Dense(classes, name="logits")(h)
    return keras.Model(inputs, outputs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--every", type=int, default=20,
                        help="steps between two monitor reports")
    parser.add_argument("--out", default="scale_monitor_logs",
                        help="directory for the logs and the report")
    args = parser.parse_args(argv)

    # The policy must be set before the layers are built.
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x, y = make_data(n=args.samples)
    model = make_model(x.shape[1], 10)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        # Measure as often as the monitor reports: each report then shows
        # fresh statistics (other steps pay nothing for them).
        update_every=args.every,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=True,  # on CPU Keras's "auto" means no XLA
    )
    log_dir = os.path.join(args.out, "logs")
    # verbose=0: this script prints its own summary below.
    monitor = tas.ScaleMonitor(every_n_steps=args.every, log_dir=log_dir, verbose=0)
    history = model.fit(
        x, y, batch_size=64, epochs=args.epochs, verbose=0, callbacks=[monitor]
    ).history

    # One value per epoch for every key (the last report of the epoch).
    for epoch in range(args.epochs):
        print(
            f"epoch {epoch + 1}: loss {history['loss'][epoch]:.4f} "
            f"accuracy {history['accuracy'][epoch]:.3f} "
            f"scale {pow2(history['scale/loss_scale'][epoch])} "
            f"skipped {int(history['scale/skipped_steps'][epoch])} "
            f"grad norm {history['scale/grad_norm'][epoch]:.3g}"
        )
    scale_keys = sorted(k for k in history if k.startswith("scale/"))
    layer_keys = sorted(k for k in history if k.startswith("layer/"))
    print("History gained:", ", ".join(scale_keys))
    print(f"  and {len(layer_keys)} per-layer keys, e.g.",
          ", ".join(k for k in layer_keys if k.startswith("layer/hidden_1/")))
    # "layer/<name>/<key>", the name the layer's path in the model
    # (docs/monitor.md, "Layer names").
    layers = sorted({k[len("layer/"):].rsplit("/", 1)[0] for k in layer_keys})
    for name in layers:
        print(
            f"  {name}: grad norm {history[f'layer/{name}/grad_norm'][-1]:.3g} "
            f"underflow {100 * history[f'layer/{name}/underflow'][-1]:.2f}% "
            f"overflow {100 * history[f'layer/{name}/overflow'][-1]:.2f}%"
        )
    print(f"final: scale {pow2(float(optimizer.loss_scale))}, "
          f"skipped steps {int(optimizer.skipped_steps)}/{int(optimizer.total_steps)}, "
          f"monitor reports {len(monitor.records)}, flags {len(monitor.flags)}")
    for flag in monitor.flags:
        print("  flagged:", flag["message"])
    print("logs in", log_dir)

    try:
        import matplotlib  # noqa: F401  (optional: pip install -e ".[plot]")
    except ImportError:
        print("matplotlib not installed: no report pictures")
        return
    for path in tas.plot_report(log_dir, os.path.join(args.out, "report")):
        print("wrote", path)


if __name__ == "__main__":
    main()
