"""The forward search runs the probe as a training step runs it
(`training=True`: dropout, batch statistics), and leaves the model's state
and the global random state as they were."""

import keras
import numpy as np
import pytest

import tf_adaptive_scale as tas


def dropout_overflow(nested=False):
    """A model whose float16 Dense output is 39008 (4 inputs of 2.5 times
    3900; float16 rounds 39000 up), finite in float16, followed by
    Dropout(0.5), which doubles the kept values to 78016 > 65504 in
    training only; the head's small weights keep inference finite.
    `nested`: the Dropout inside a nested Sequential `block`."""
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(3900.0),
                           name="wide")(inputs)
    drop = keras.layers.Dropout(0.5, name="drop")
    h = keras.Sequential([keras.Input((8,)), drop], name="block")(h) if nested else drop(h)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(1e-3),
                                 name="head")(h)
    model = keras.Model(inputs, outputs)
    x = np.full((64, 4), 2.5, "float32")
    return model, x, np.zeros((64, 1), "float32")


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_training_only_dropout_overflow_is_named_by_the_search(nested, float16_policy):
    keras.mixed_precision.set_global_policy("float32")
    model, x, _ = dropout_overflow(nested)
    wide = keras.Model(model.inputs, model.get_layer("wide").output)
    assert np.max(np.asarray(wide(x))) == pytest.approx(39000.0)  # < 65504
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, x, _ = dropout_overflow(nested)
    assert np.all(np.isfinite(np.asarray(model(x))))  # inference holds it
    assert not np.all(np.isfinite(np.asarray(model(x, training=True))))
    assert tas.first_non_finite_layer(model, x, training=False) is None
    # Dropout's input is finite, its output is not: it is the layer named.
    name = "block/drop" if nested else "drop"
    assert tas.first_non_finite_layer(model, x) == (name, "float16")
    assert tas.first_non_finite_layer(model, x, tries=1) == (name, "float16")


def test_the_monitor_names_the_dropout_layer_in_fit(float16_policy):
    model, x, y = dropout_overflow()
    monitor = tas.ScaleMonitor(every_n_steps=1, probe=x[:4], verbose=0)
    model.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(),
                                                 max_consecutive_skips=None), "mse")
    with pytest.warns(RuntimeWarning, match="layer 'drop': its float16 output is not finite"):
        history = model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)
    assert history.history["scale/skipped_steps"][-1] == 8  # every step overflows
    assert len(monitor.records) == 8 and not any(r["loss_finite"] for r in monitor.records)
    assert [(f["layer"], f["kind"]) for f in monitor.flags] == [("drop", "forward_overflow")]


def nested_batch_norm_and_dropout():
    """A nested Sequential block with BatchNormalization and Dropout, its
    moving statistics set away from their initial values."""
    block = keras.Sequential([
        keras.Input((4,)),
        keras.layers.BatchNormalization(name="norm"),
        keras.layers.Dropout(0.5, name="drop"),
    ], name="block")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(block(inputs)))
    norm = block.get_layer("norm")
    norm.moving_mean.assign(np.full((4,), 3.0, "float32"))
    norm.moving_variance.assign(np.full((4,), 5.0, "float32"))
    return model


def test_the_search_leaves_the_model_state_unchanged():
    model = nested_batch_norm_and_dropout()
    before = [keras.ops.convert_to_numpy(v) for v in model.variables]
    x = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    assert tas.first_non_finite_layer(model, x, tries=3) is None
    # Moving statistics and the dropout layer's seed state, all as they were.
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value,
                                      err_msg=variable.path)
    # A training call does move them: the search ran the same layers.
    model(x, training=True)
    norm = model.get_layer("block").get_layer("norm")
    assert not np.allclose(keras.ops.convert_to_numpy(norm.moving_mean), 3.0)


class UnseededNoise(keras.layers.Layer):
    """Adds noise drawn from Keras's global seed generator in training."""

    def call(self, inputs, training=False):
        if training:
            return inputs + keras.random.uniform(keras.ops.shape(inputs))
        return inputs


def test_the_search_leaves_the_global_random_state_unchanged():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, UnseededNoise()(inputs))
    x = np.zeros((2, 4), "float32")
    keras.utils.set_random_seed(1)
    keras.random.uniform(())  # the global generator exists before the search
    expected = np.array(keras.random.uniform((3,)))
    keras.utils.set_random_seed(1)
    keras.random.uniform(())
    assert tas.first_non_finite_layer(model, x) is None
    np.testing.assert_array_equal(np.array(keras.random.uniform((3,))), expected)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"training": 1}, TypeError, "`training` must be a bool"),
    ({"tries": 0}, ValueError, "`tries` must be an int >= 1"),
    ({"tries": 1.5}, TypeError, "`tries` must be an int >= 1"),
])
def test_bad_arguments_name_the_argument(kwargs, error, match):
    model = nested_batch_norm_and_dropout()
    with pytest.raises(error, match=match):
        tas.first_non_finite_layer(model, np.zeros((2, 4), "float32"), **kwargs)
