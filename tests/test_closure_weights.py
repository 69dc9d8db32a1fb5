"""Per-layer scaling of a weight read inside another layer's call (a
`Lambda` closure): the reader joins the weight's unit, or `instrument`
refuses the model, naming the layer and the weight."""

import keras
import numpy as np
import pytest
from keras import layers
from keras import ops

import tf_adaptive_scale as tas
from helpers import normal

LR = 0.1


def closure_model(policy):
    """Under `policy` (then float32 again), seed 0: Dense "dense", Dense
    "mix", a Lambda "reuse" multiplying by "dense"'s kernel transposed (read
    in its closure, not passed), Dense "head"."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        x = keras.Input((6,))
        dense = layers.Dense(4, activation="tanh", name="dense")
        h = layers.Dense(4, activation="tanh", name="mix")(dense(x))
        h = layers.Lambda(lambda z: ops.matmul(z, ops.transpose(dense.kernel)), name="reuse")(h)
        return keras.Model(x, layers.Dense(2, name="head")(h))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def step_update(model, optimizer, x, y):
    """`{path: update}` of one `train_on_batch` step of `model`."""
    before = {v.path: v.numpy().copy() for v in model.trainable_weights}
    model.compile(optimizer, "mse")
    model.train_on_batch(x, y)
    return {v.path: v.numpy() - before[v.path] for v in model.trainable_weights if v.path in before}


def test_weight_read_in_a_closure_trains_as_float32_with_scales_far_apart():
    # The gradient through the closure's read carried the Lambda's scale and
    # was divided by the Dense's (0.49 relative error at 2**-1 and 2**-5).
    x, y = normal((32, 6)), normal((32, 2), 1)
    reference = step_update(closure_model("float32"), keras.optimizers.SGD(LR), x, y)
    instrumented = tas.instrument(closure_model("mixed_float16"))
    table = instrumented.scale_table
    units = len(table.unit_names)
    # Units 1, 2, 3... at 2**-3, 2**6, 2**-9...: no two alike; the loss unit at 1.
    table.log2_scales.assign(np.array([0] + [3 * i * (-1) ** i for i in range(1, units)], "float32"))
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling="per_layer")
    got = step_update(instrumented, optimizer, x, y)
    assert int(optimizer.skipped_steps) == 0
    for path, update in reference.items():
        error = np.linalg.norm(got[path] - update) / np.linalg.norm(update)
        assert error < 1e-2, f"{path}: relative error {error:.3g}"


def test_closure_reader_joins_the_weight_owners_unit():
    instrumented = tas.instrument(closure_model("float32"))
    table = instrumented.scale_table
    kernel = instrumented.get_layer("dense").kernel
    (unit,) = [n for n, members in instrumented.unit_members.items() if "reuse" in members]
    assert "dense" in instrumented.unit_members[unit]
    assert table.unit_of(kernel) == table.unit_names.index(unit)


def test_weight_of_no_layer_of_the_model_is_refused_naming_it():
    outside = layers.Dense(4, name="outside")
    outside.build((None, 6))
    x = keras.Input((4,))
    h = layers.Lambda(lambda z: ops.matmul(z, ops.transpose(outside.kernel)), name="reader")(x)
    model = keras.Model(x, layers.Dense(2)(h))
    with pytest.raises(ValueError, match="(?s)layer 'reader' .*'outside/kernel'"):
        tas.instrument(model)


class Tied(layers.Layer):
    """Logits through an embedding's weights, the embedding a sublayer."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def test_models_reading_only_their_own_or_passed_weights_are_not_refused():
    tokens = keras.Input((5,), dtype="int32")
    embedding = layers.Embedding(11, 4, name="emb")
    h = layers.Lambda(lambda z: ops.tanh(z), name="closure_free")(embedding(tokens))
    logits = ops.einsum("btd,vd->btv", h, embedding.embeddings) + Tied(embedding, name="tied")(h)
    instrumented = tas.instrument(keras.Model(tokens, logits))
    assert "closure_free" in instrumented.layer_scales()
