"""Per-layer scaling on residual blocks that end in a LayerScale initialised
to 1e-6 (ConvNeXt's): no more skipped steps than the stock optimizer.

The first step measures the units behind the LayerScale where their
gradients are 1e-6 of the trunk's; Adam's first update moves every gamma
to about 1e-3, and their gradients grow a thousandfold. A scale set for
the first step alone overflowed on the second, and each skipped step then
lowered only the unit where the overflow started, one unit per step (7
skipped steps of 20 here, against 0 and 2 for the stock optimizer)."""

import keras
import numpy as np
import pytest
from keras import layers, ops

import tf_adaptive_scale as tas
from tf_adaptive_scale.per_layer import gradient_scale as gs
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.per_layer import layer_scaling


class LayerScale(layers.Layer):
    """`x * gamma`, gamma trainable and initialised to `init` (ConvNeXt's)."""

    def __init__(self, init=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, shape):
        self.gamma = self.add_weight(
            shape=(shape[-1],), initializer=keras.initializers.Constant(self.init)
        )

    def call(self, x):
        return x * ops.cast(self.gamma, x.dtype)


def residual_model(blocks=3, width=32):
    x = keras.Input((16,))
    h = layers.Dense(width, name="stem")(x)
    for i in range(blocks):
        r = layers.Dense(2 * width, activation="gelu", name=f"block{i}_up")(h)
        r = layers.Dense(width, name=f"block{i}_down")(r)
        r = LayerScale(name=f"block{i}_scale")(r)
        h = layers.Add(name=f"block{i}_add")([h, r])
    return keras.Model(x, layers.Dense(8, name="head")(h))


def skipped_steps(per_layer, batches, weights):
    """The steps `residual_model` (from `weights`, float16 under its test's
    `float16_policy`) skips over `batches`: per layer, or with stock's
    LossScaleOptimizer."""
    keras.utils.set_random_seed(0)
    model = residual_model()
    model.set_weights(weights)
    if per_layer:
        model = tas.instrument(model)
        optimizer = tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-3), scaling="per_layer"
        )
    else:
        optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer, "mse", jit_compile=False)
    for x, y in batches:
        model.train_on_batch(x, y)
    if per_layer:
        return int(optimizer.skipped_steps.numpy())
    return len(batches) - int(optimizer.inner_optimizer.iterations.numpy())


# Targets 3: the gradients behind each LayerScale mostly underflow at scale 1
# on the first, measured step. Targets 30: the trunk's gradients are near 1,
# and those behind the LayerScales mostly fit float16 at scale 1.
@pytest.mark.parametrize("target", [3.0, 30.0])
def test_layer_scale_blocks_skip_no_more_than_stock(target, float16_policy):
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((32, 16)).astype("float32"),
         (target * rng.standard_normal((32, 8))).astype("float32"))
        for _ in range(20)
    ]
    keras.utils.set_random_seed(0)
    weights = residual_model().get_weights()
    stock = skipped_steps(False, batches, weights)
    per_layer = skipped_steps(True, batches, weights)
    assert per_layer <= stock, (per_layer, stock)
    # One overflow corrects every unit it reveals: never a skip per unit.
    assert per_layer <= 1, per_layer


def test_mostly_underflowed_is_a_histogram_cut_off_at_its_scale():
    def row(counts):
        statistics = np.zeros((1, gs.NUM_COLUMNS), "float32")
        for exponent, count in counts.items():
            statistics[0, exponent - stats.EXPONENT_MIN] = count
        return statistics

    # At scale 2**4 float16 holds unscaled values down to 2**-28.
    cut = row({-28: 50, -27: 20, -20: 1})  # most populated where it is cut
    whole = row({-28: 1, -22: 30, -20: 50})  # its lower tail visible
    for statistics, expected in ((cut, True), (whole, False), (row({}), False)):
        found = layer_scaling.mostly_underflowed(statistics, np.array([4.0], "float32"))
        assert bool(np.asarray(found)[0]) is expected
