"""`tas.instrument` on every kind of Functional graph Keras builds: operator
and keras.ops nodes, masking, nested models with clashing layer names,
named outputs, keras.applications; exact in float32 with random scales."""

import numpy as np
import pytest
import keras
import tensorflow as tf
from keras import layers

import tf_adaptive_scale as tas
from helpers import normal, set_random_scales


_data = normal


def _tokens(shape, vocabulary, seed=0):
    """Token ids with trailing zeros (padding) of varying length."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocabulary, shape).astype("int32")
    for row, keep in zip(ids, rng.integers(1, shape[1], shape[0])):
        row[keep:] = 0
    return ids


def _gradients(model, variables, x, y):
    """Gradients of a mean-squared loss, dropout seeds replayed."""
    states = [v for v in model.non_trainable_variables if "seed_generator" in v.path]
    saved = [v.numpy() for v in states]
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = sum(
            tf.reduce_mean(tf.square(tf.cast(p, "float32") - t))
            for p, t in zip(keras.tree.flatten(pred), keras.tree.flatten(y))
        )
    for v, s in zip(states, saved):
        v.assign(s)
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables)]


def _assert_forward_equal(model, instrumented, x):
    got, want = keras.tree.flatten(instrumented(x)), keras.tree.flatten(model(x))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _instrument(model):
    instrumented = tas.instrument(model)
    names = instrumented.scale_table.unit_names
    assert names[0] == "loss" and len(set(names)) == len(names)
    ids = {id(v) for v in instrumented.weights}
    assert all(id(v) in ids for v in model.weights)  # shared, not copied
    return instrumented


def assert_exact(model, x, y, seed=0):
    """Forward equal, and with random per-unit scales every weight gradient
    divided by its unit's scale equals the original's float32 gradient."""
    instrumented = _instrument(model)
    _assert_forward_equal(model, instrumented, x)
    table = instrumented.scale_table
    log2 = set_random_scales(instrumented, seed, 12)
    weights = [
        v for v in instrumented.trainable_variables if table.unit_of(v) is not None
    ]
    got = {
        id(v): g / 2.0 ** log2[table.unit_of(v)]
        for v, g in zip(weights, _gradients(instrumented, weights, x, y))
    }
    assert len(got) == len(model.trainable_variables)
    reference = _gradients(model, model.trainable_variables, x, y)
    for v, ref in zip(model.trainable_variables, reference):
        scale = np.abs(ref).max() + 1e-30
        np.testing.assert_allclose(
            got[id(v)], ref, rtol=1e-5, atol=1e-6 * scale, err_msg=v.path
        )
    return instrumented


# 1. Operator and keras.ops nodes.


def ops_model():
    x = keras.Input((6,))
    h = layers.Dense(6, activation="relu")(x)
    h = keras.ops.tanh(h) + x  # keras.ops node, then an operator node
    g = layers.Dense(4)(h)
    g = g * g - h[:, :4]  # a tensor used twice by one op; a slice
    h = keras.ops.concatenate([g, keras.ops.mean(h, axis=-1, keepdims=True)], axis=-1)
    return keras.Model(x, layers.Dense(3)(2.0 * h))


def test_operator_and_ops_nodes_are_weightless_units(tmp_path):
    model = ops_model()
    operations = [op for op in model.operations if not isinstance(op, keras.layers.Layer)]
    assert len(operations) >= 5
    instrumented = assert_exact(model, _data((16, 6)), _data((16, 3), 1))
    units = instrumented.scale_table.unit_names
    assert all(op.name in units for op in operations)
    assert set(instrumented.layer_scales()) == set(units[1:])
    # The operations travel through save/load, and so do the unit tags.
    path = str(tmp_path / "ops.keras")
    instrumented.save(path)
    loaded = keras.models.load_model(path)
    _assert_forward_equal(model, loaded, _data((4, 6), 2))
    assert loaded.scale_table.unit_names == units
    tagged = [v for v in loaded.trainable_variables if loaded.scale_table.unit_of(v) is not None]
    assert len(tagged) == len(model.trainable_variables)


# 2. Masking.


def embedding_lstm():
    tokens = keras.Input((7,), dtype="int32")
    h = layers.Embedding(20, 6, mask_zero=True)(tokens)
    h = layers.LSTM(5, return_sequences=True)(h)
    return keras.Model(tokens, layers.GRU(3)(h)), _tokens((8, 7), 20), _data((8, 3), 1)


def masking_average():
    x = keras.Input((7, 4))
    h = layers.Masking(mask_value=0.0)(x)
    h = layers.Dense(5, activation="tanh")(h)  # passes the mask on
    h = layers.GlobalAveragePooling1D()(h)  # masked average
    data = _data((8, 7, 4))
    data[:, 4:] = 0.0
    data[0, 2:] = 0.0
    return keras.Model(x, layers.Dense(2)(h)), data, _data((8, 2), 1)


def nested_masked():
    # The mask is made outside a nested model and used inside it.
    tokens = keras.Input((7,), dtype="int32")
    h = layers.Embedding(20, 6, mask_zero=True)(tokens)
    inner = keras.Sequential([keras.Input((7, 6)), layers.Dense(6), layers.GRU(4)])
    return keras.Model(tokens, layers.Dense(2)(inner(h))), _tokens((8, 7), 20), _data((8, 2), 1)


@pytest.mark.parametrize("build", [embedding_lstm, masking_average, nested_masked])
def test_masking_models_match(build):
    model, x, y = build()
    # The padding matters: without the mask the outputs would differ.
    instrumented = assert_exact(model, x, y)
    units = instrumented.scale_table.unit_names
    assert any("not_equal" in name for name in units) or build is masking_average
    # A nested model fed a masked tensor is inlined; its layers get the mask
    # (units named by their path: docs/monitor.md, "Layer names").
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            assert layer.name not in units and f"{layer.name}/{layer.layers[-1].name}" in units


def test_mask_reaches_the_loss_and_evaluate_needs_no_optimizer():
    tokens = keras.Input((7,), dtype="int32")
    h = layers.Embedding(20, 6, mask_zero=True)(tokens)
    h = layers.LSTM(5, return_sequences=True)(h)
    model = keras.Model(tokens, layers.Dense(3)(h))  # a masked sequence output
    x, y = _tokens((8, 7), 20), _data((8, 7, 3), 1)
    instrumented = _instrument(model)
    assert instrumented(x)._keras_mask is not None
    model.compile(loss="mse")
    instrumented.compile(loss="mse")  # no optimizer: evaluation only
    want = model.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(instrumented.evaluate(x, y, verbose=0), want, rtol=1e-6)
    # The mask is applied: padded steps would change the loss.
    unmasked = float(np.mean((np.asarray(model(x)) - y) ** 2))
    assert abs(unmasked - want) > 1e-3
    with pytest.raises(ValueError, match="without an optimizer"):
        instrumented.train_on_batch(x, y)
    with pytest.raises(ValueError, match="scaling='per_layer'"):
        instrumented.compile(keras.optimizers.Adam(), loss="mse")
    with pytest.raises(ValueError, match="scaling='per_layer'"):
        instrumented.compile("adam", loss="mse")


# 3. Nested models with clashing layer names.


def _block(width, shared=None):
    x = keras.Input((width,))
    h = layers.Dense(width, activation="tanh", name="proj")(x)
    if shared is not None:
        h = shared(h)
    return keras.Model(x, layers.Dense(width)(h) + x)


def test_nested_models_with_clashing_layer_names():
    shared = layers.Dense(6, name="shared_dense")
    first, second = _block(6, shared), _block(6)
    clean = keras.Sequential([keras.Input((6,)), layers.Dense(6, activation="relu")])
    x = keras.Input((6,))
    h = clean(first(x))
    h = second(h)
    h = shared(h)  # also used inside `first`: one weight, one unit
    model = keras.Model(x, layers.Dense(2)(h))
    instrumented = assert_exact(model, _data((16, 6)), _data((16, 2), 1))
    units = instrumented.scale_table.unit_names
    # The clashing blocks are units of their own; the clean one is inlined.
    assert first.name in units and second.name in units and "proj" not in units
    assert clean.name not in units and f"{clean.name}/{clean.layers[0].name}" in units
    assert units.count(first.name) == 1 and "shared_dense" not in units
    assert instrumented.unit_members[first.name] == [first.name, "shared_dense"]
    unit_of = {id(v): instrumented.scale_table.unit_of(v) for v in instrumented.trainable_variables
               if instrumented.scale_table.unit_of(v) is not None}
    assert unit_of[id(shared.kernel)] == units.index(first.name)


def test_clashing_names_survive_save_and_load(tmp_path):
    x = keras.Input((4,))
    model = keras.Model(x, layers.Dense(2)(_block(4)(_block(4)(x))))
    instrumented = _instrument(model)
    path = str(tmp_path / "clash.keras")
    instrumented.save(path)
    loaded = keras.models.load_model(path)
    _assert_forward_equal(model, loaded, _data((4, 4)))
    assert loaded.scale_table.unit_names == instrumented.scale_table.unit_names
    tagged = [v for v in loaded.trainable_variables if loaded.scale_table.unit_of(v) is not None]
    assert len(tagged) == len(model.trainable_variables)


def test_unit_of_shared_variables_survives_config():
    # (Keras itself cannot save a layer shared by a nested model and its
    # parent, so the config is tested, not a file.)
    shared = layers.Dense(4, name="shared_dense")
    x = keras.Input((4,))
    model = keras.Model(x, shared(_block(4, shared)(_block(4)(x))))
    instrumented = _instrument(model)
    assert instrumented.unit_members
    revived = tas.InstrumentedModel.from_config(instrumented.get_config())
    assert revived.unit_members == instrumented.unit_members
    units = revived.scale_table.unit_names
    (holder,) = [n for n, members in revived.unit_members.items() if "shared_dense" in members]
    kernel = revived.get_layer("shared_dense").kernel
    assert revived.scale_table.unit_of(kernel) == units.index(holder)
    assert revived.scale_table.unit_of(revived.get_layer(holder).weights[0]) == units.index(holder)


def test_nested_model_called_with_training_true_stays_whole():
    inner_x = keras.Input((5,))
    inner = keras.Model(inner_x, layers.BatchNormalization()(layers.Dense(5)(inner_x)))
    x = keras.Input((5,))
    model = keras.Model(x, layers.Dense(2)(inner(x, training=True)))
    # Called without `training`, the inner BatchNormalization uses batch
    # statistics: inlined, it would not.
    instrumented = assert_exact(model, 3.0 + _data((8, 5)), _data((8, 2), 1))
    assert inner.name in instrumented.scale_table.unit_names


# 4. Output names.


def named_outputs():
    x = keras.Input((5,))
    h = layers.Dense(8, activation="relu")(x)
    model = keras.Model(x, [layers.Dense(2, name="first")(h), layers.Dense(1, name="second")(h)])
    return model, _data((16, 5)), [_data((16, 2), 1), _data((16, 1), 2)]


def test_loss_dict_by_output_name_trains_and_names_survive_save(tmp_path):
    model, x, y = named_outputs()
    instrumented = _instrument(model)
    assert instrumented.output_names == model.output_names == ["first", "second"]
    losses = {"first": "mse", "second": "mae"}
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), scaling="per_layer")
    instrumented.compile(optimizer, loss=losses)
    targets = {"first": y[0], "second": y[1]}
    assert np.all(np.isfinite(instrumented.train_on_batch(x, targets)))
    path = str(tmp_path / "named.keras")
    instrumented.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.output_names == ["first", "second"]
    assert loaded.get_config()["output_names"] == ["first", "second"]
    loaded.compile(
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01), scaling="per_layer"),
        loss=losses,
    )
    assert np.all(np.isfinite(loaded.train_on_batch(x, targets)))
    # A dict-output model keeps its keys and names too.
    a = keras.Input((3,), name="a")
    out = {"p": layers.Dense(2, name="p")(a), "q": layers.Dense(1, name="q")(a)}
    dict_model = keras.Model(a, out)
    assert _instrument(dict_model).output_names == dict_model.output_names


# 5. keras.applications.


def _application(name):
    keras.utils.set_random_seed(0)
    return getattr(keras.applications, name)(
        weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None
    )


@pytest.mark.parametrize("name", ["MobileNetV2", "ConvNeXtTiny"])
def test_application_exact_in_float32(name):
    model = _application(name)
    x = 10.0 * _data((2, 32, 32, 3))
    assert_exact(model, x, _data((2, 10), 1))


@pytest.mark.parametrize("name", ["ResNet50", "ResNet50V2", "EfficientNetB0", "DenseNet121"])
def test_application_instruments_and_matches(name):
    model = _application(name)
    instrumented = _instrument(model)
    _assert_forward_equal(model, instrumented, 10.0 * _data((2, 32, 32, 3)))
    tagged = [v for v in instrumented.trainable_variables if instrumented.scale_table.unit_of(v) is not None]
    assert len(tagged) == len(model.trainable_variables)


# 6. What cannot be handled is named.


class _ToSparse(layers.Layer):
    def call(self, x):
        return tf.sparse.from_dense(x)

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype, sparse=True)


class _OnlyOnce(layers.Layer):
    calls = 0

    def call(self, x):
        return x

    def compute_output_spec(self, x):
        type(self).calls += 1
        if type(self).calls > 1:
            raise RuntimeError("this layer can be called only once")
        return keras.KerasTensor(x.shape, x.dtype)


def test_sparse_edge_is_exact():
    x = keras.Input((6,))
    h = layers.Dense(6, activation="relu")(x)  # zeros: a real sparse tensor
    h = _ToSparse(name="to_sparse")(h)
    model = keras.Model(x, layers.Dense(2, name="reader")(h))
    assert_exact(model, _data((16, 6)), _data((16, 2), 1))


def test_what_cannot_be_handled_raises_naming_it():
    x = keras.Input((4,))
    model = keras.Model(x, _OnlyOnce(name="only_once")(layers.Dense(4)(x)))
    with pytest.raises(ValueError, match="(?s)layer 'only_once' .*only once"):
        tas.instrument(model)
