"""Per-layer scaling on every path a weight's gradient can take.

Each test trains an instrumented float32 model at fixed, unequal per-unit
scales for one SGD step and compares the update with plain SGD on the same
weights: any contribution divided by the wrong scale shows as an update
2**k off. Backend-neutral: runs on TensorFlow and on JAX.
"""

import math

import keras
import numpy as np
import pytest
from keras import layers
from keras import ops

import tf_adaptive_scale as tas
from helpers import head_on as _head, normal, set_random_scales, shared_backbone as _backbone

LR = 0.1


_data = normal


def _set_scales(instrumented, seed=0):
    """Random unequal unit scales in [2**-8, 2**8]; the loss unit keeps 1."""
    set_random_scales(instrumented, seed, 8)


def _per_layer(inner=None):
    return tas.AdaptiveLossScaleOptimizer(
        inner or keras.optimizers.SGD(LR), scaling="per_layer"
    )


def _step_updates(model, optimizer, x, y, loss="mse"):
    """`{path: update}` of one `train_on_batch` step of `model`."""
    before = {v.path: v.numpy().copy() for v in model.trainable_weights}
    model.compile(optimizer, loss)
    model.train_on_batch(x, y)
    return {
        v.path: v.numpy() - before[v.path]
        for v in model.trainable_weights
        if v.path in before
    }


def _assert_updates_equal(got, reference):
    assert reference
    for path, update in reference.items():
        np.testing.assert_allclose(got[path], update, rtol=1e-5, atol=1e-7, err_msg=path)


def _twin(build, x, y, loss="mse"):
    """The plain SGD step on a fresh copy of `build()`, and the model."""
    reference = build()
    weights = reference.get_weights()
    updates = _step_updates(reference, keras.optimizers.SGD(LR), x, y, loss)
    model = build()
    model.set_weights(weights)
    return model, updates


def test_two_instrumented_models_on_one_backbone_each_train_exactly():
    # Instrumenting the second head re-tagged the backbone's weights to its
    # table: training the first then left them undivided (2**k too large).
    x, y = _data((16, 6)), _data((16, 3), 1)
    keras.utils.set_random_seed(0)
    backbone = _backbone()
    head_a, head_b = _head(backbone, "a"), _head(backbone, "b")
    plain_a = keras.models.clone_model(head_a)
    plain_a.set_weights(head_a.get_weights())
    reference = _step_updates(plain_a, keras.optimizers.SGD(LR), x, y)
    inst_a, inst_b = tas.instrument(head_a), tas.instrument(head_b)
    _set_scales(inst_a, seed=1)
    _set_scales(inst_b, seed=2)
    got = _step_updates(inst_a, _per_layer(), x, y)
    # clone_model names its copies like the originals: compare by layer.
    _assert_updates_equal(
        {k.split("/", 1)[-1]: v for k, v in got.items()},
        {k.split("/", 1)[-1]: v for k, v in reference.items()},
    )
    assert inst_a.scale_table.unit_of(backbone.weights[0]) is not None
    assert inst_b.scale_table.unit_of(backbone.weights[0]) is not None
    assert not hasattr(backbone.weights[0], "gradient_scale_unit")


def test_the_model_instrumented_first_of_two_trains_exactly():
    # Used to crash ("Index out of range" in grouped_statistics): no weight
    # was left tagged to the first table.
    x, y = _data((16, 6)), _data((16, 3), 1)
    model, reference = _twin(lambda: _head(_backbone(), "m"), x, y)
    first, second = tas.instrument(model), tas.instrument(model)
    _set_scales(first, seed=3)
    _set_scales(second, seed=4)
    _assert_updates_equal(_step_updates(first, _per_layer(), x, y), reference)


def test_the_original_model_reports_the_global_scale_after_instrumenting():
    model = _head(_backbone(), "m")
    inst = tas.instrument(model)
    _set_scales(inst, seed=5)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=2.0**10)
    model.compile(opt, "mse")
    model.train_on_batch(_data((8, 6)), _data((8, 3), 1))
    global_log2 = math.log2(float(opt.loss_scale.numpy()))
    assert [s[1] for s in opt.gradient_scales()] == [global_log2] * len(model.trainable_weights)


class TiedLogits(layers.Layer):
    """Logits through an embedding's own weights, read in `call`."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def _tied(kind):
    def build():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((5,), dtype="int32")
        emb = layers.Embedding(11, 4, name="emb")
        h = layers.Dense(4, activation="tanh", name="mix")(emb(tokens))
        if kind == "einsum":
            logits = ops.einsum("btd,vd->btv", h, emb.embeddings)
        else:
            logits = TiedLogits(emb, name="tied")(h)
        return keras.Model(tokens, logits)

    return build


@pytest.mark.parametrize("kind", ["einsum", "layer"])
def test_tied_embeddings_train_exactly(kind):
    # The einsum was a weightless unit of its own: the embedding gradient
    # through it carried that unit's scale, divided by the Embedding's.
    x = np.random.default_rng(0).integers(0, 11, (8, 5)).astype("int32")
    y = np.random.default_rng(1).integers(0, 11, (8, 5)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, reference = _twin(_tied(kind), x, y, loss)
    inst = tas.instrument(model)
    _set_scales(inst, seed=6)
    assert len(set(inst.scale_table.log2_scales.numpy()[1:])) > 1
    _assert_updates_equal(_step_updates(inst, _per_layer(), x, y, loss), reference)


class ActivityPenalty(layers.Layer):
    def call(self, x):
        self.add_loss(0.05 * ops.sum(ops.square(x)))
        return x


def _regularised():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1), name="d1")(x)
    h = ActivityPenalty(name="penalty")(h)
    h = layers.Dense(8, activity_regularizer=keras.regularizers.L1(0.01), name="d2")(h)
    return keras.Model(x, layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.1), name="d3")(h))


def test_regularisers_and_add_loss_train_exactly_at_every_step():
    # They were differentiated at scale 1 and divided by the unit's scale.
    x, y = _data((16, 6)), _data((16, 2), 1)
    model, reference = _twin(_regularised, x, y)
    inst = tas.instrument(model)
    _set_scales(inst, seed=7)
    _assert_updates_equal(_step_updates(inst, _per_layer(), x, y), reference)
    # Their values are the model's: the reported loss is unchanged.
    inst(x), model(x)
    np.testing.assert_allclose(
        [float(ops.sum(l)) for l in inst.losses], [float(ops.sum(l)) for l in model.losses], rtol=1e-6
    )


def test_counts_do_not_saturate_beyond_two_to_the_24():
    # float32 sums of ones stopped at 2**24: the same distribution at 2**25
    # values read a different underflow fraction and scale.
    from tf_adaptive_scale.numerics import gradient_statistics as stats
    from tf_adaptive_scale.rules import adaptive_rule

    def scale(n):
        values = np.full(n, 2.0**-10, "float32")
        values[: n // 1000] = 2.0**-30  # 0.1% far below
        hist, peak = stats.exponent_histogram([ops.convert_to_tensor(values)])
        assert float(ops.sum(hist)) == n
        return float(adaptive_rule.adaptive_log2_scale(hist, peak, 1e-4, 1.0)[0])

    assert scale(2**23) == scale(2**25)
