"""Top-level kernels of `fit`'s optimized XLA step, per mode: count before
you time.

A top-level kernel is an instruction of the optimized entry computation
other than parameter, constant, tuple, get-tuple-element and bitcast: one
launch each on a GPU. The counts do not change with machine load. For MLPs
of two depths the table gives each mode's kernels over stock's and that
excess per trainable variable (its slope between the depths): a constant
excess has slope 0.

    python -m benchmarks.kernel_census            # depths 4 and 16, the CNN
    python -m benchmarks.kernel_census --by-kind  # and what the kernels are
"""

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402
from benchmarks.hlo import optimized_fit_program  # noqa: E402
from benchmarks.hlo import top_level_kernels  # noqa: E402
from benchmarks.zoo import census_mlp as mlp  # noqa: E402
from benchmarks.zoo import conv_net  # noqa: E402

MODES = {
    "stock": lambda model: (model, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())),
    "adaptive": lambda model: (model, tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())),
    "per layer": lambda model: (tas.instrument(model), tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(), scaling="per_layer", update_every=100)),
}
# Per layer: the measuring program (as above) and the plain one.
MODES["per layer, plain"] = MODES["per layer"]


def census(depths):
    """`{(mode, depth): (kernels, variables)}`; depth "cnn": `zoo.conv_net`."""
    found = {}
    for depth in depths:
        for mode, make in MODES.items():
            if depth == "cnn":
                keras.mixed_precision.set_global_policy("mixed_float16")
                keras.utils.set_random_seed(0)
            model, x, y = conv_net() if depth == "cnn" else mlp(depth)
            model, optimizer = make(model)
            kernels = top_level_kernels(optimized_fit_program(
                model, optimizer, x, y, measuring=not mode.endswith("plain")))
            found[mode, depth] = kernels, len(model.trainable_variables)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4,16")
    parser.add_argument("--by-kind", action="store_true")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    found = census(depths + ["cnn"])
    print(f"backend {keras.backend.backend()}; kernels of fit's optimized step, MLP depths "
          f"{depths} and a small CNN")
    print("| mode | " + " | ".join(f"depth {d}: kernels (over stock)" for d in depths)
          + " | CNN | MLP excess per variable |")
    print("|---" * (len(depths) + 3) + "|")
    for mode in MODES:
        cells, excess = [], []
        for depth in depths + ["cnn"]:
            kernels, variables = found[mode, depth]
            over = len(kernels) - len(found["stock", depth][0])
            cells.append(f"{len(kernels)} ({over:+d})")
            excess.append((variables, over))
        (v0, e0), (v1, e1) = excess[0], excess[-2]
        slope = (e1 - e0) / (v1 - v0) if v1 != v0 else 0.0
        print(f"| {mode} | " + " | ".join(cells) + f" | {slope:.2f} |")
    if args.by_kind:
        for (mode, depth), (kernels, _) in found.items():
            print(mode, depth, sorted(collections.Counter(kernels).items()))


if __name__ == "__main__":
    main()
