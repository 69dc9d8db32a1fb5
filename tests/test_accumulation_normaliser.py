"""Gradient accumulation equals one step on the whole batch for any Keras
loss reduction: masked sequences (`Embedding(mask_zero=True)`, `Masking`),
sample and class weights, `"mean_with_sample_weight"` and `"sum"`.

The reference is independent: the whole batch's float32 gradient from
`tf.GradientTape` and the same Keras loss, applied by SGD by hand. No
float16 anywhere (`scaling="none"`): what is measured is the weighting.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import masked_sequence_model, padded_sequences
from keras import layers

import tf_adaptive_scale as tas

LR = 0.5
BATCH = 32
STEPS = [1, 4, 7]


def embedding_problem():
    x, y = padded_sequences(BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy()
    return masked_sequence_model(), loss, x, y, None


def masking_problem():
    keras.utils.set_random_seed(2)
    x, _ = padded_sequences(BATCH, seed=1)
    features = np.repeat(x[..., None].astype("float32") / 20.0, 3, axis=-1)
    y = np.random.default_rng(3).normal(size=(BATCH, 12, 2)).astype("float32")
    inputs = keras.Input((12, 3))
    h = layers.Masking(0.0)(inputs)
    outputs = layers.Dense(2)(layers.Dense(8, activation="tanh")(h))
    return keras.Model(inputs, outputs), keras.losses.MeanSquaredError(), features, y, None


def weighted_problem(weights):
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, BATCH).astype("int32")
    inputs = keras.Input((6,))
    outputs = layers.Dense(3)(layers.Dense(8, activation="tanh")(inputs))
    if weights == "sample":
        w = rng.uniform(0.0, 3.0, BATCH).astype("float32")
    else:  # class_weight, as Keras turns it into sample weights
        class_weight = {0: 0.2, 1: 1.0, 2: 5.0}
        w = np.array([class_weight[c] for c in y], "float32")
    return keras.Model(inputs, outputs), keras.losses.SparseCategoricalCrossentropy(), x, y, w


PROBLEMS = {
    "embedding_mask_zero": embedding_problem,
    "masking": masking_problem,
    "sample_weight": lambda: weighted_problem("sample"),
    "class_weight": lambda: weighted_problem("class"),
}


def reference_update(model, loss, x, y, w):
    """One float32 SGD step on the whole batch, by hand."""
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True), w)
    grads = tape.gradient(value, model.trainable_variables)
    return [-LR * tf.convert_to_tensor(g).numpy() for g in grads]


def step_update(model, loss, x, y, w, k):
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling="none")
    step = tas.make_train_step(model, loss, optimizer, accumulation_steps=k, jit_compile=False)
    before = [v.numpy() for v in model.trainable_variables]
    logs = step(x, y, w)
    assert int(optimizer.skipped_steps) == 0
    return [v.numpy() - b for v, b in zip(model.trainable_variables, before)], logs


def relative_error(update, reference):
    flat = np.concatenate([u.ravel() for u in update])
    ref = np.concatenate([u.ravel() for u in reference])
    return np.linalg.norm(flat - ref) / np.linalg.norm(ref)


def check(model, loss, x, y, w, k):
    start = model.get_weights()
    reference = reference_update(model, loss, x, y, w)
    whole = float(loss(y, model(x, training=True), w))
    model.set_weights(start)
    update, logs = step_update(model, loss, x, y, w, k)
    assert relative_error(update, reference) < 1e-5
    np.testing.assert_allclose(float(logs["loss"]), whole, rtol=1e-5)


@pytest.mark.parametrize("k", STEPS)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_accumulation_equals_the_whole_batch_step(problem, k):
    model, loss, x, y, w = PROBLEMS[problem]()
    check(model, loss, x, y, w, k)


@pytest.mark.parametrize("k", [4, 7])
@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum"])
def test_accumulation_under_other_reductions(reduction, k):
    model, _, x, y, _ = embedding_problem()
    # Per token: Keras's "mean_with_sample_weight" sums them as given.
    w = np.random.default_rng(5).uniform(0.0, 2.0, (BATCH, 12)).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
    check(model, loss, x, y, w, k)


def test_several_outputs_with_a_mask_are_refused():
    inputs = keras.Input((12,), dtype="int32")
    h = layers.Embedding(20, 8, mask_zero=True)(inputs)
    model = keras.Model(inputs, [layers.Dense(5)(h), layers.Dense(5)(h)])
    x, y = padded_sequences(BATCH)
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling="none")
    step = tas.make_train_step(model, "sparse_categorical_crossentropy", optimizer,
                               accumulation_steps=4, jit_compile=False)
    with pytest.raises(ValueError, match="accumulation_steps=4 with 2 outputs"):
        step(x, [y, y])


@pytest.mark.parametrize("mask_zero", [True, False], ids=["masked", "unmasked"])
def test_one_micro_batch_keeps_an_embedding_gradient_sparse(mask_zero):
    """Weighing by the normaliser maps a sparse gradient's values: at
    `accumulation_steps=1` the embedding's reaches `apply` sparse."""
    inputs = keras.Input((12,), dtype="int32")
    h = layers.Embedding(20, 8, mask_zero=mask_zero)(inputs)
    model = keras.Model(inputs, layers.Dense(5)(h))
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling="none")
    received = []
    apply = optimizer.apply

    def recording_apply(grads, variables=None):
        received.append(type(grads[0]))
        return apply(grads, variables)

    optimizer.apply = recording_apply
    step = tas.make_train_step(model, "sparse_categorical_crossentropy", optimizer,
                               jit_compile=False)
    step(*padded_sequences(BATCH))
    assert received == [tf.IndexedSlices]
