"""Gradient accumulation equals one step on the whole batch for any Keras
loss reduction: masked sequences (`Embedding(mask_zero=True)`, `Masking`),
losses that mask their values (`ignore_class`, a custom loss, `Circle`),
sample and class weights, `"mean_with_sample_weight"` and `"sum"`; plain
and per layer.

The reference is independent: the whole batch's float32 gradient from
`tf.GradientTape` and the same Keras loss, applied by SGD by hand. No
float16 anywhere (`scaling="none"`; per layer, float32 scaled by powers of
two): what is measured is the weighting.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import IgnoringLoss, masked_sequence_model, padded_sequences, token_labels
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


def ignore_class_problem(loss=None, mask_zero=False):
    x, _ = padded_sequences(BATCH)
    # With a mask on the prediction too, the loss ignores some valid tokens.
    y = token_labels(x, ignored=0.3 if mask_zero else 0.0)
    loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    return masked_sequence_model(mask_zero=mask_zero), loss, x, y, None


PROBLEMS = {
    "embedding_mask_zero": embedding_problem,
    "masking": masking_problem,
    "sample_weight": lambda: weighted_problem("sample"),
    "class_weight": lambda: weighted_problem("class"),
}
# Losses whose values carry the mask (Keras's `ignore_class`, a custom
# loss), alone and with a Keras mask on the prediction.
VALUE_MASKS = {
    "ignore_class": ignore_class_problem,
    "custom_loss": lambda: ignore_class_problem(IgnoringLoss()),
    "ignore_class_and_mask_zero": lambda: ignore_class_problem(mask_zero=True),
}


def reference_update(model, loss, x, y, w):
    """One float32 SGD step on the whole batch, by hand."""
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True), w)
    grads = tape.gradient(value, model.trainable_variables)
    return [-LR * tf.convert_to_tensor(g).numpy() for g in grads]


def step_update(model, loss, x, y, w, k, trained=None, scaling="none"):
    """The update of a `make_train_step` window on `trained` (`model`, or
    an instrumented copy of it that shares its weights)."""
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling=scaling)
    step = tas.make_train_step(trained or model, loss, optimizer, accumulation_steps=k,
                               jit_compile=False)
    before = [v.numpy() for v in model.trainable_variables]
    logs = step(x, y, w)
    assert int(optimizer.skipped_steps) == 0
    return [v.numpy() - b for v, b in zip(model.trainable_variables, before)], logs


def relative_error(update, reference):
    flat = np.concatenate([u.ravel() for u in update])
    ref = np.concatenate([u.ravel() for u in reference])
    return np.linalg.norm(flat - ref) / np.linalg.norm(ref)


def check(model, loss, x, y, w, k, per_layer=False):
    start = model.get_weights()
    reference = reference_update(model, loss, x, y, w)
    whole = float(loss(y, model(x, training=True), w))
    model.set_weights(start)
    if per_layer:
        update, logs = step_update(model, loss, x, y, w, k, tas.instrument(model), "per_layer")
    else:
        update, logs = step_update(model, loss, x, y, w, k)
    assert relative_error(update, reference) < 1e-5
    np.testing.assert_allclose(float(logs["loss"]), whole, rtol=1e-5)


@pytest.mark.parametrize("k", STEPS)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_accumulation_equals_the_whole_batch_step(problem, k):
    model, loss, x, y, w = PROBLEMS[problem]()
    check(model, loss, x, y, w, k)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("problem", list(VALUE_MASKS))
def test_a_loss_that_masks_its_values_weighs_by_its_valid_values(problem, k):
    """The mask on the loss values (`ignore_class`) counts as one on the
    prediction does: micro-batches of few valid tokens weigh little."""
    model, loss, x, y, w = VALUE_MASKS[problem]()
    check(model, loss, x, y, w, k)


@pytest.mark.parametrize("k", [2, 4])
def test_a_loss_function_that_masks_its_values_weighs_by_its_valid_values(k):
    model, loss, x, y, _ = ignore_class_problem(IgnoringLoss())
    start = model.get_weights()
    reference = reference_update(model, loss, x, y, None)
    model.set_weights(start)
    update, _ = step_update(model, loss.call, x, y, None, k)
    assert relative_error(update, reference) < 1e-5


@pytest.mark.parametrize("k", [2, 4])
def test_keras_sparse_crossentropy_function_with_ignore_class_weighs_by_its_valid_values(k):
    """`keras.losses.sparse_categorical_crossentropy(..., ignore_class=0)`
    as a loss function: Keras reduces it as the class's."""
    model, loss, x, y, _ = ignore_class_problem()
    start = model.get_weights()
    reference = reference_update(model, loss, x, y, None)
    model.set_weights(start)
    update, _ = step_update(model, lambda t, p: keras.losses.sparse_categorical_crossentropy(
        t, p, from_logits=True, ignore_class=0), x, y, None, k)
    assert relative_error(update, reference) < 1e-5


@pytest.mark.parametrize("k", [2, 4])
def test_per_layer_a_loss_that_masks_its_values_weighs_by_its_valid_values(k):
    model, loss, x, y, w = ignore_class_problem()
    check(model, loss, x, y, w, k, per_layer=True)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum"])
def test_ignore_class_under_other_reductions(reduction, k):
    """Per-token weights merge with the values' mask as Keras merges them."""
    model, _, x, y, _ = ignore_class_problem()
    w = np.random.default_rng(5).uniform(0.0, 2.0, (BATCH, 12)).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0, reduction=reduction)
    check(model, loss, x, y, w, k)


@pytest.mark.parametrize("k", [2, 4])
def test_mean_with_sample_weight_weighs_by_the_micro_batches_weights(k):
    """No mask: the sample weights alone make the normaliser, and they
    differ between micro-batches (growing along the batch)."""
    model, _, x, y, _ = weighted_problem("sample")
    w = np.linspace(0.1, 4.0, BATCH).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight")
    check(model, loss, x, y, w, k)


def circle_problem(k):
    """Unit embeddings and labels by micro-batch of 8: in every other one
    each sample has a partner of its class, in the others two samples do;
    Keras's `Circle` masks the values of samples without one."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, layers.UnitNormalization()(layers.Dense(4)(
        layers.Dense(8, activation="tanh")(inputs))))
    x = np.random.default_rng(8).normal(size=(8 * k, 6)).astype("float32")
    paired, singles = [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 1, 2, 3, 4, 5, 6]
    y = np.concatenate([paired if i % 2 == 0 else singles for i in range(k)]).astype("int32")
    return model, keras.losses.Circle(), x, y


def circle_valid(labels):
    """Samples with another of their class and one of another class."""
    return sum(int((labels == c).sum() > 1 and (labels != c).any()) for c in labels)


@pytest.mark.parametrize("k", [2, 4])
def test_circle_weighs_by_the_micro_batches_valid_samples(k):
    """`Circle` compares the samples of a batch with each other, so a window
    is not one batch; exact is the mean of all its micro-batches' valid
    values, which weighs each by its valid samples (counted here)."""
    model, loss, x, y = circle_problem(k)
    start = model.get_weights()
    parts = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for i in range(k)]
    summed = keras.losses.Circle(reduction="sum")
    with tf.GradientTape() as tape:
        total = sum(summed(t, model(s, training=True)) for s, t in parts)
        mean = total / sum(circle_valid(t) for _, t in parts)
    reference = [-LR * g.numpy() for g in tape.gradient(mean, model.trainable_variables)]
    model.set_weights(start)
    update, logs = step_update(model, loss, x, y, None, k)
    assert relative_error(update, reference) < 1e-5
    np.testing.assert_allclose(float(logs["loss"]), float(mean), rtol=1e-5)


@pytest.mark.parametrize("k", [2, 4])
def test_a_weight_regulariser_counts_once_per_window(k):
    """`model.losses` weigh with the loss's normaliser: a weight
    regulariser, the same in every micro-batch, counts once."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12,), dtype="int32")
    h = layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1))(
        layers.Embedding(20, 8)(inputs))
    model = keras.Model(inputs, layers.Dense(5)(h))
    _, loss, x, y, _ = ignore_class_problem()
    start = model.get_weights()
    with tf.GradientTape() as tape:
        total = loss(y, model(x, training=True)) + sum(model.losses)
    reference = [-LR * tf.convert_to_tensor(g).numpy()
                 for g in tape.gradient(total, model.trainable_variables)]
    model.set_weights(start)
    update, logs = step_update(model, loss, x, y, None, k)
    assert relative_error(update, reference) < 1e-5
    np.testing.assert_allclose(float(logs["loss"]), float(total), rtol=1e-5)


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


def test_several_masked_outputs_train_in_one_micro_batch():
    """At `accumulation_steps=1` there is nothing to weigh: the step is
    Keras's, the outputs' losses summed."""
    inputs = keras.Input((12,), dtype="int32")
    h = layers.Embedding(20, 8, mask_zero=True)(inputs)
    model = keras.Model(inputs, [layers.Dense(5)(h), layers.Dense(5)(h)])
    x, y = padded_sequences(BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    labels = [y, token_labels(x, ignored=0.3)]
    start = model.get_weights()
    with tf.GradientTape() as tape:
        outputs = model(x, training=True)
        total = loss(labels[0], outputs[0]) + loss(labels[1], outputs[1])
    reference = [-LR * tf.convert_to_tensor(g).numpy()
                 for g in tape.gradient(total, model.trainable_variables)]
    model.set_weights(start)
    update, logs = step_update(model, loss, x, labels, None, 1)
    assert relative_error(update, reference) < 1e-5
    np.testing.assert_allclose(float(logs["loss"]), float(total), rtol=1e-5)


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
