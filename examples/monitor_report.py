"""Train with `tas.ScaleMonitor` and draw its report.

A 6-layer MLP with per-layer loss scales (`tas.instrument`) trains on a
synthetic 10-class problem in `mixed_float16` under XLA. The monitor logs the
scales, skipped steps and each layer's gradient norm and exponent histogram
every 20 steps to `LOG_DIR` (TensorBoard events and `scale_monitor.jsonl`),
adds them to `History`, and prints its diagnosis at the end;
`tas.plot_report` then writes the PNG pictures to `OUT_DIR`.

Run: python examples/monitor_report.py [LOG_DIR] [OUT_DIR]
     (needs matplotlib: pip install -e ".[plot]")
"""

import sys

import keras
import numpy as np

import tf_adaptive_scale as tas


def main(log_dir="monitor_logs", out_dir="monitor_report"):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 32)).astype("float32")
    y = (x[:, :10] @ rng.standard_normal((10, 10))).argmax(axis=1)

    inputs = keras.Input((32,))
    h = inputs
    for i in range(6):
        h = keras.layers.Dense(64, activation="relu", name=f"dense_{i}")(h)
    model = tas.instrument(keras.Model(inputs, keras.layers.Dense(10, name="logits")(h)))
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3), scaling="per_layer", update_every=20
    )
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=True,
    )
    monitor = tas.ScaleMonitor(every_n_steps=20, log_dir=log_dir)
    history = model.fit(x, y, batch_size=64, epochs=6, verbose=0, callbacks=[monitor])
    print("final accuracy", round(history.history["accuracy"][-1], 3),
          "| layer scales (log2):",
          {name: int(np.log2(s)) for name, s in optimizer.layer_scales().items()})
    for path in tas.plot_report(log_dir, out_dir):
        print("wrote", path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
