"""`fit` with `accumulation_steps=K` on a model wrapped by
`tas.exact_accumulation` equals one step on the K batches together, for
masked sequences (`Embedding(mask_zero=True)`, `Masking`), losses that mask
their values (`ignore_class`, a custom loss, `Circle`), sample and class
weights and `"mean_with_sample_weight"`, on TensorFlow and JAX; a NaN loss
in any batch of a window skips the window.

The reference is Keras's own: `fit` with a plain SGD on one batch holding
the K batches (float32, nothing scaled), from the same weights.
"""

import json
import os

import keras
import numpy as np
import pytest
from helpers import (JAX, NAN, TESTS, IgnoringLoss, masked_sequence_model, padded_sequences,
                     token_labels)
from keras import layers

import tf_adaptive_scale as tas

LR = 0.5
BATCH = 8


def masking_model():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((12, 3))
    h = layers.Masking(0.0)(inputs)
    return keras.Model(inputs, layers.Dense(2)(layers.Dense(8, activation="tanh")(h)))


def dense_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    return keras.Model(inputs, layers.Dense(3)(layers.Dense(8, activation="tanh")(inputs)))


def problem(name, n):
    """`(model, loss, fit keyword arguments)` for `n` samples."""
    rng = np.random.default_rng(4)
    if name == "embedding_mask_zero":
        x, y = padded_sequences(n)
        return masked_sequence_model(), "sparse_categorical_crossentropy", dict(x=x, y=y)
    if name in ("ignore_class", "custom_loss"):
        x, _ = padded_sequences(n)
        loss = IgnoringLoss() if name == "custom_loss" else \
            keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
        return masked_sequence_model(mask_zero=False), loss, dict(x=x, y=token_labels(x))
    if name == "masking":
        x, _ = padded_sequences(n, seed=1)
        features = np.repeat(x[..., None].astype("float32") / 20.0, 3, axis=-1)
        y = rng.normal(size=(n, 12, 2)).astype("float32")
        return masking_model(), "mse", dict(x=features, y=y)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    if name == "sample_weight":
        weights = dict(sample_weight=rng.uniform(0.0, 3.0, n).astype("float32"))
    elif name == "class_weight":
        weights = dict(class_weight={0: 0.2, 1: 1.0, 2: 5.0})
    else:  # a loss that divides by the sum of the sample weights
        loss = keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight")
        return dense_model(), loss, dict(x=x, y=y, sample_weight=rng.uniform(0, 3, n))
    return dense_model(), "sparse_categorical_crossentropy", dict(x=x, y=y, **weights)


def fit_update(model, optimizer, loss, data, batch_size):
    inner = getattr(model, "inner", model)
    start = inner.get_weights()
    model.compile(optimizer, loss=loss)
    model.fit(**data, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return np.concatenate([(w - s).ravel() for w, s in zip(inner.get_weights(), start)])


def relative_error(name, k, wrap):
    model, loss, data = problem(name, BATCH * k)
    start = model.get_weights()
    reference = fit_update(model, keras.optimizers.SGD(LR), loss, data, BATCH * k)
    model, _, _ = problem(name, BATCH * k)
    model.set_weights(start)
    if wrap:
        model = tas.exact_accumulation(model)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="none", accumulation_steps=k
    )
    update = fit_update(model, optimizer, loss, data, BATCH)
    assert int(optimizer.skipped_steps) == 0
    return np.linalg.norm(update - reference) / np.linalg.norm(reference)


PROBLEMS = ["embedding_mask_zero", "masking", "sample_weight", "class_weight",
            "mean_with_sample_weight"]


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("name", PROBLEMS)
def test_fit_accumulation_equals_one_step_on_the_window(name, k):
    assert relative_error(name, k, wrap=True) < 1e-5


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", ["ignore_class", "custom_loss"])
def test_fit_accumulation_of_a_loss_that_masks_its_values(name, k):
    assert relative_error(name, k, wrap=True) < 1e-5


def circle_problem(k):
    """Unit embeddings and labels by batch of 8: in every other batch each
    sample has a partner of its class, in the others two samples do; Keras's
    `Circle` masks the values of samples without one."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, layers.UnitNormalization()(layers.Dense(4)(
        layers.Dense(8, activation="tanh")(inputs))))
    x = np.random.default_rng(8).normal(size=(BATCH * k, 6)).astype("float32")
    paired, singles = [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 1, 2, 3, 4, 5, 6]
    y = np.concatenate([paired if i % 2 == 0 else singles for i in range(k)]).astype("int32")
    return model, x, y


@pytest.mark.parametrize("k", [2, 4])
def test_fit_accumulation_of_circle_weighs_by_valid_samples(k):
    """`Circle` compares a batch's samples with each other, so a window is
    not one batch: exact is the mean of all its batches' valid values. The
    reference is stock Keras's accumulation (a mean of the K gradients) of
    the summed loss times K / (the valid samples, counted here: those with
    another of their class)."""
    model, x, y = circle_problem(k)
    start = model.get_weights()
    valid = sum(int((part == c).sum() > 1) for part in np.split(y, k) for c in part)
    model.compile(keras.optimizers.SGD(LR, gradient_accumulation_steps=k),
                  loss=keras.losses.Circle(reduction="sum"), loss_weights=k / valid)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    reference = np.concatenate([(w - s).ravel() for w, s in zip(model.get_weights(), start)])
    model, _, _ = circle_problem(k)
    model.set_weights(start)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="none", accumulation_steps=k)
    update = fit_update(tas.exact_accumulation(model), optimizer, keras.losses.Circle(),
                        dict(x=x, y=y), BATCH)
    assert int(optimizer.skipped_steps) == 0
    assert np.linalg.norm(update - reference) / np.linalg.norm(reference) < 1e-5


def test_without_the_wrapper_masked_batches_weigh_equally():
    """What the wrapper is for: a plain model's window is off by tenths."""
    assert relative_error("embedding_mask_zero", 4, wrap=False) > 0.1


def poisoned_mse(y, p):
    """The mean square error on `y`'s first three columns, NaN where its
    fourth is: a NaN loss whose gradients stay finite."""
    return keras.ops.mean(keras.ops.square(p - y[:, :3]), axis=-1) + y[:, 3]


@pytest.mark.parametrize("k, bad", [(2, 0), (3, 1)], ids=["first_of_2", "middle_of_3"])
def test_a_nan_loss_in_any_batch_skips_the_window(k, bad):
    """Not only the window's last batch's loss counts: one NaN loss skips
    the whole window (no weight changes, one skipped step), the next
    window applies."""
    model = dense_model()
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="none", accumulation_steps=k)
    model.compile(optimizer, loss=poisoned_mse)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = np.concatenate([rng.normal(size=(BATCH, 3)), np.zeros((BATCH, 1))], 1).astype("float32")
    bad_y = y.copy()
    bad_y[:, 3] = NAN
    start = model.get_weights()
    for i in range(k):
        if i == bad and JAX:
            # Keras's JAX trainer drops the note of its `scale_loss` (docs/jax.md):
            # noted eagerly, as that note would be.
            optimizer.observe_loss(keras.ops.convert_to_tensor(NAN))
        model.train_on_batch(x, bad_y if i == bad else y)
    for before, after in zip(start, model.get_weights()):
        np.testing.assert_array_equal(after, before)
    assert int(optimizer.skipped_steps) == int(optimizer.total_steps) == 1
    assert int(optimizer.iterations) == 0
    assert not bool(optimizer.last_loss_finite.numpy())
    for _ in range(k):
        model.train_on_batch(x, y)
    assert int(optimizer.skipped_steps) == 1 and int(optimizer.iterations) == 1
    assert any(np.any(a != b) for a, b in zip(start, model.get_weights()))


def test_a_summed_loss_is_refused():
    model = tas.exact_accumulation(dense_model())
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling="none",
                                                 accumulation_steps=2),
                  loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(ValueError, match="reduction='sum' adds its batches up"):
        model.fit(np.zeros((8, 6)), np.zeros((8, 3)), batch_size=4, verbose=0)


class SquaresLoss(layers.Layer):
    """Adds the mean square of its inputs as a loss (`add_loss`)."""

    def call(self, inputs):
        self.add_loss(keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def test_a_model_trained_through_add_loss_alone_is_refused():
    """What an `add_loss` loss divides by is not known (a batch mean, a
    mean over valid tokens, a sum), so no weight per batch is known to be
    exact: a compiled `loss` is asked for, at the first batch."""
    inputs = keras.Input((6,))
    model = tas.exact_accumulation(keras.Model(inputs, SquaresLoss()(layers.Dense(3)(inputs))))
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling="none",
                                                 accumulation_steps=2))
    with pytest.raises(ValueError, match=r"compiled without a `loss`.*`loss=\.\.\.`"):
        model.fit(np.ones((8, 6), "float32"), batch_size=4, verbose=0)


def two_output_model():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((12,), dtype="int32")
    h = layers.Dense(8, activation="tanh")(layers.Embedding(20, 8)(inputs))
    return keras.Model(inputs, [layers.Dense(5, name="tokens")(h),
                                layers.Dense(2, name="values")(h)])


@pytest.mark.parametrize("structure", ["list", "dict"])
def test_two_outputs_weigh_by_their_samples(structure):
    """Losses whose normalisers are their numbers of values: a window whose
    last batch is short weighs its batches by their samples."""
    n = BATCH * 3 - 3
    x, _ = padded_sequences(n)
    targets = [token_labels(x), np.random.default_rng(2).normal(size=(n, 12, 2))]
    losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
    if structure == "dict":
        targets, losses = (dict(zip(["tokens", "values"], v)) for v in (targets, losses))
    model = two_output_model()
    start = model.get_weights()
    reference = fit_update(model, keras.optimizers.SGD(LR), losses, dict(x=x, y=targets), n)
    model = two_output_model()
    model.set_weights(start)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="none", accumulation_steps=3)
    update = fit_update(tas.exact_accumulation(model), optimizer, losses,
                        dict(x=x, y=targets), BATCH)
    assert int(optimizer.total_steps) == 1
    assert np.linalg.norm(update - reference) / np.linalg.norm(reference) < 1e-5


def test_two_outputs_one_of_which_masks_its_values_are_refused():
    x, _ = padded_sequences(BATCH * 2)
    model = tas.exact_accumulation(two_output_model())
    model.compile(
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling="none",
                                       accumulation_steps=2),
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
              "mse"])
    with pytest.raises(ValueError, match="2 losses and one's normaliser depends on the data"):
        model.fit(x, [token_labels(x), np.zeros((BATCH * 2, 12, 2))], batch_size=BATCH,
                  verbose=0)


def test_bad_models_are_refused():
    with pytest.raises(TypeError, match="`model` must be a Keras model"):
        tas.exact_accumulation(layers.Dense(2))
    with pytest.raises(ValueError, match="instrumented"):
        tas.exact_accumulation(tas.instrument(dense_model()))


def test_the_wrapper_saves_and_loads(tmp_path):
    model = tas.exact_accumulation(masked_sequence_model())
    x, y = padded_sequences(16)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling="none",
                                                 accumulation_steps=2),
                  loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, tas.ExactAccumulationModel)
    np.testing.assert_array_equal(np.asarray(loaded.predict(x, verbose=0)),
                                  np.asarray(model.predict(x, verbose=0)))


def test_under_mixed_float16_the_window_matches_float32(float16_policy):
    """The normaliser arrives scaled with the loss and is unscaled with it."""
    x, y = padded_sequences(BATCH * 4)
    model = masked_sequence_model()
    keras.mixed_precision.set_global_policy("float32")
    twin = masked_sequence_model()
    twin.set_weights(model.get_weights())
    reference = fit_update(twin, keras.optimizers.SGD(LR), "sparse_categorical_crossentropy",
                           dict(x=x, y=y), BATCH * 4)
    keras.mixed_precision.set_global_policy("mixed_float16")
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), accumulation_steps=4,
                                               initial_scale=2.0**8)
    update = fit_update(tas.exact_accumulation(model), optimizer,
                        "sparse_categorical_crossentropy", dict(x=x, y=y), BATCH)
    assert int(optimizer.skipped_steps) == 0 and float(optimizer.loss_scale) > 1.0
    assert np.linalg.norm(update - reference) / np.linalg.norm(reference) < 2e-2


@pytest.mark.slow  # starts a child process
@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="tf.distribute: JAX computes the global batch's loss in one program")
def test_under_a_mirrored_strategy_the_window_matches_one_device():
    """Each replica's loss divides by its own token count: the replicas
    weigh by theirs, so two replicas give one device's update."""
    from helpers import run_python

    results = json.loads(run_python(os.path.join(TESTS, "accumulation_worker.py"))
                         .strip().splitlines()[-1])
    assert results["fit_plain"] > 0.1, results
    assert results["fit_wrapped"] < 1e-5, results
    assert results["make_train_step"] < 1e-5, results
