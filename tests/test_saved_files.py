"""Files written by an earlier version load: `tests/data/v0_1_0/` holds a
`.keras` file and a TensorFlow checkpoint per mode, saved at 0.1.0, when
each scalar of the optimizer's state was a variable of its own (see its
`write.py`); they restore every declared value into today's packed state,
and training goes on from them."""

import json
import os

import keras
import numpy as np
import pytest

import tf_adaptive_scale as tas
from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.rules.optimizer_state import StateVariable
from tf_adaptive_scale.step import measurement

DATA = os.path.join(os.path.dirname(__file__), "data", "v0_1_0")
SAVED = json.load(open(os.path.join(DATA, "saved.json")))
MODES = ["adaptive", "per_layer"]


# Declared in 0.1.0, no longer kept.
RETIRED = {"scale_window"}


def _model(mode):
    """The saved model and optimizer, as `write.py` made them."""
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(1, dtype="float32", name="head")])
    if mode == "per_layer":
        model = tas.instrument(model)
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3), scaling=mode, update_every=2, clipnorm=1.0)
    model.compile(optimizer, "mse", jit_compile=True)
    return model, optimizer


def _assert_restored(mode, model, optimizer):
    saved = SAVED[mode]
    for got, want in zip(model.get_weights(), saved["weights"]):
        np.testing.assert_array_equal(got, np.asarray(want, got.dtype))
    values = {path.rsplit("/", 1)[-1]: v for path, v in saved["optimizer"].items()
              if path.startswith("adaptive_loss_scale_optimizer")}
    # Declared since 0.1.0 (`since_0_1_0`): not in its files.
    names = [s.name for s in optimizer.declared_state() if not s.since_0_1_0]
    assert names == [name for name in saved["declared"] if name not in RETIRED]
    # A retired variable's value is now worked out when read.
    np.testing.assert_array_equal(optimizer.scale_window, values["scale_window"])
    restored = 0
    for name in names:
        got = np.asarray(getattr(optimizer, name))
        np.testing.assert_array_equal(got, np.asarray(values[name], got.dtype), err_msg=name)
        restored += 1
    assert int(optimizer.total_steps) == 8 and restored == len(names)
    x = np.random.default_rng(1).standard_normal((8, 4)).astype("float32")
    model.fit(x, x.sum(1, keepdims=True) * 1e3, batch_size=8, verbose=0)
    assert int(optimizer.total_steps) == 9
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("mode", MODES)
def test_a_keras_file_of_0_1_0_loads(mode, float16_policy):
    model = keras.models.load_model(os.path.join(DATA, f"{mode}.keras"))
    _assert_restored(mode, model, model.optimizer)


@pytest.mark.skipif(not backends.TENSORFLOW, reason="TensorFlow checkpoints")
@pytest.mark.parametrize("built", [True, False], ids=["built", "built_after_read"])
@pytest.mark.parametrize("mode", MODES)
def test_a_tensorflow_checkpoint_of_0_1_0_restores(mode, built, float16_policy):
    import tensorflow as tf

    model, optimizer = _model(mode)
    if built:
        optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        os.path.join(DATA, f"{mode}_checkpoint"))
    if not built:  # TensorFlow's deferred restoration, as before a first fit
        optimizer.build(model.trainable_variables)
    if not any(s.since_0_1_0 for s in optimizer.declared_state()):
        status.assert_existing_objects_matched()  # else those are new objects
    _assert_restored(mode, model, optimizer)


# State declared after a file was written, or retired since: files load by
# name (and 0.1.0's by position), each entry into its own variable.
ADDED = StateVariable("added_later", 7.0, since_0_1_0=True)


def _declaring(monkeypatch, extra=(), retired=()):
    """The statistics' declaration with `extra` variables and `retired` ones."""
    original = measurement.declared

    def declared(n):
        specs = [s._replace(retired=True) if s.name in retired else s for s in original(n)]
        return tuple(specs) + tuple(extra)

    monkeypatch.setattr(measurement, "declared", declared)


def _trained_file(tmp_path, mode):
    model, optimizer = _model(mode)
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    values = {s.name: np.asarray(getattr(optimizer, s.name)) for s in optimizer.declared_state()}
    return path, values, model.get_weights()


@pytest.mark.parametrize("mode", MODES)
def test_a_file_loads_into_state_declared_since(tmp_path, monkeypatch, mode, float16_policy):
    path, values, weights = _trained_file(tmp_path, mode)
    _declaring(monkeypatch, extra=[ADDED])
    model = keras.models.load_model(path)
    optimizer = model.optimizer
    assert float(optimizer.added_later) == 7.0  # not in the file: its initial value
    for name, value in values.items():
        np.testing.assert_array_equal(np.asarray(getattr(optimizer, name)), value, err_msg=name)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_a_file_loads_after_a_variable_is_retired(tmp_path, monkeypatch, mode, float16_policy):
    path, values, _ = _trained_file(tmp_path, mode)
    _declaring(monkeypatch, retired=["gradient_norm"])
    optimizer = keras.models.load_model(path).optimizer
    assert "gradient_norm" not in [s.name for s in optimizer.declared_state()]
    for name, value in values.items():
        if name != "gradient_norm":
            np.testing.assert_array_equal(np.asarray(getattr(optimizer, name)), value,
                                          err_msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_a_keras_file_of_0_1_0_loads_beside_state_declared_since(monkeypatch, mode,
                                                                   float16_policy):
    """By position: the variable added since has no entry there (and a
    scalar added beside a retired window must not shift the others)."""
    _declaring(monkeypatch, extra=[ADDED])
    optimizer = keras.models.load_model(os.path.join(DATA, f"{mode}.keras")).optimizer
    values = {path.rsplit("/", 1)[-1]: v for path, v in SAVED[mode]["optimizer"].items()
              if path.startswith("adaptive_loss_scale_optimizer")}
    assert float(optimizer.added_later) == 7.0
    for name in SAVED[mode]["declared"]:
        if name not in RETIRED:
            got = np.asarray(getattr(optimizer, name))
            np.testing.assert_array_equal(got, np.asarray(values[name], got.dtype), err_msg=name)
