"""Step-time cost of `tas.ScaleMonitor`, in one run.

Two copies of a model (same weights, `mixed_float16`, XLA, the adaptive
optimizer at `update_every=100`) train by `model.fit` on the same data, one
with `ScaleMonitor(every_n_steps=100, log_dir=...)` (TensorBoard and JSON
lines on), one without. Epochs of `--steps` steps alternate in random order
(`timing.interleave`); the ratio of the median epoch times is printed
(target: at most 1.02). The models are `zoo.FAMILIES`'.

Run: python -m benchmarks.monitor_cost [--family cnn] [--steps 200] [--rounds 7]
"""

import argparse
import tempfile

import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from benchmarks import timing
from benchmarks import zoo


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="cnn", choices=sorted(zoo.FAMILIES))
    parser.add_argument("--steps", type=int, default=200, help="steps per timed epoch")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    reference, shape = zoo.FAMILIES[args.family]()
    x, y = zoo.batch_for(reference, shape, 0)
    data = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps).cache()
    log_dir = tempfile.mkdtemp(prefix="monitor_cost_")
    runs = {}
    for name in ("without", "with"):
        model, _ = zoo.FAMILIES[args.family]()
        model.set_weights(reference.get_weights())
        model.compile(
            tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), update_every=100),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
        callbacks = [tas.ScaleMonitor(100, log_dir=log_dir, verbose=0)] if name == "with" else []
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)  # compile, warm up
        runs[name] = (model, callbacks)

    def epoch(model, callbacks):
        return lambda: model.fit(data, epochs=1, verbose=0, callbacks=callbacks)

    epochs = {name: epoch(*run) for name, run in runs.items()}
    median = timing.medians(timing.interleave(epochs, args.rounds, seed=0))
    ratio = median["with"] / median["without"]
    reports = len(runs["with"][1][0].records)
    print(f"| family | steps per epoch | rounds | reports | step-time ratio, monitor every 100 / none |")
    print(f"|---|---|---|---|---|")
    print(f"| {args.family} | {args.steps} | {args.rounds} | {reports} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
