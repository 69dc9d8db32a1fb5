"""What a user sees says what is true (issue 45, item 7): per layer the
progress bar and `History` show the layers' range of scales, and quiet
misuse gets a hint that names what to change."""
import warnings

import keras
import numpy as np
import pytest

import tf_adaptive_scale as tas


def _model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1, dtype="float32")])


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype("float32")
    return x, x.sum(1, keepdims=True)


class _Logs(keras.callbacks.Callback):
    """The `logs` each batch ends with, after the monitor wrote into them."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))


def test_per_layer_shows_the_layers_range_of_scales_not_a_global_one(float16_policy):
    model = tas.instrument(_model())
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3), scaling="per_layer")
    model.compile(optimizer, "mse", jit_compile=True)
    logs = _Logs()
    history = model.fit(*_data(), batch_size=16, epochs=2, verbose=0,
                        callbacks=[tas.ScaleMonitor(every_n_steps=2), logs])
    last = logs.batches[-1]
    assert "scale/loss_scale" not in last  # 1 per layer: it read as "scaling off"
    scales = [2.0 ** log2 for entry in optimizer.gradient_scales() if entry
              for log2 in [entry[1]]]
    assert last["scale/layer_scale_min"] == min(scales)
    assert last["scale/layer_scale_max"] == max(scales)
    assert max(scales) > 1.0  # scaling is on, and the keys show it
    assert len(history.history["scale/layer_scale_min"]) == 2
    assert history.history["scale/layer_scale_max"][-1] == max(scales)


def test_one_scale_shows_the_loss_scale(float16_policy):
    model = _model()
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3))
    model.compile(optimizer, "mse", jit_compile=True)
    logs = _Logs()
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0,
              callbacks=[tas.ScaleMonitor(every_n_steps=2), logs])
    assert logs.batches[-1]["scale/loss_scale"] == float(optimizer.loss_scale)
    assert "scale/layer_scale_min" not in logs.batches[-1]


def _fit_warnings(model, optimizer):
    model.compile(optimizer, "mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*_data(), batch_size=16, epochs=1, verbose=0)
    return [str(w.message) for w in caught]


def test_a_float32_model_is_told_that_scaling_is_off():
    """The dtype policy is float32 (mixed_float16 forgotten): scaling=None
    resolves to none, and the user is told so, and how to turn it on."""
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3))
    said = [m for m in _fit_warnings(_model(), optimizer) if "loss scaling is off" in m]
    assert optimizer.policy.name == "none" and len(said) == 1
    assert "'float32'" in said[0] and "set_global_policy('mixed_float16')" in said[0]


def test_a_float16_model_is_not_told_so(float16_policy):
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3))
    assert not [m for m in _fit_warnings(_model(), optimizer) if "scaling is off" in m]
    assert optimizer.policy.name == "adaptive"


def test_fitting_the_original_of_an_instrumented_model_warns(float16_policy):
    original = _model()
    instrumented = tas.instrument(original)
    said = _fit_warnings(original, tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3)))
    assert any("tas.instrument(model) returned" in m for m in said), said
    said = _fit_warnings(instrumented, tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1e-3), scaling="per_layer"))
    assert not any("instrument" in m for m in said), said


@pytest.mark.parametrize("scaling", ["adaptive", "dynamic"])
def test_an_instrumented_model_names_the_scaling_to_change(scaling, float16_policy):
    model = tas.instrument(_model())
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling=scaling)
    with pytest.raises(ValueError, match=f"scaling='{scaling}'.*scaling='per_layer'"):
        model.compile(optimizer, "mse")
