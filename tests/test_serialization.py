"""get_config, model.save/load_model and tf.train.Checkpoint restore everything."""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import dense_model

ALL_ARGUMENTS = dict(
    scaling="adaptive",
    initial_scale=2.0**12,
    dynamic_growth_steps=7,
    min_scale=2.0**-3,
    max_scale=2.0**20,
    hysteresis=2,
    update_every=3,
    underflow_rate=0.01,
    underflow_criterion="mass",
    headroom=8.0,
    max_scale_rise=3,
    clipnorm=5.0,
    clipvalue=4.0,
    global_clipnorm=6.0,
    autoclip_percentile=90.0,
    autoclip_window=5,
    autoclip_per_variable=True,
    agc_factor=0.5,
    agc_eps=1e-2,
    max_consecutive_skips=77,
    accumulation_steps=3,
)


def test_get_config_round_trips_every_argument():
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(3e-3), name="als", **ALL_ARGUMENTS)
    config = opt.get_config()
    for key, value in ALL_ARGUMENTS.items():
        assert config[key] == value, key
    clone = tas.AdaptiveLossScaleOptimizer.from_config(config)
    assert clone.get_config() == config
    assert clone.name == "als"
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert float(clone.inner_optimizer.learning_rate) == pytest.approx(3e-3)
    # Through Keras's generic (de)serialization, without custom_objects.
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is tas.AdaptiveLossScaleOptimizer
    assert again.get_config() == config


def trained_model(steps=6):
    """A small model (float16 under its tests' `float16_policy`) and its
    optimizer with every argument set, after `steps` steps and one skipped."""
    model = dense_model(4, 8, 1, sequential=True)
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        **{**ALL_ARGUMENTS, "autoclip_per_variable": False, "accumulation_steps": 1}
    )
    model.compile(opt, "mse", jit_compile=True)
    x, y = batches()
    model.fit(x[: 4 * steps], y[: 4 * steps], batch_size=4, shuffle=False, verbose=0)
    x[2] = 1e30  # one overflowing step, so skipped_steps is not 0
    model.fit(x[:4], y[:4], batch_size=4, shuffle=False, verbose=0)
    return model, opt


def batches():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 4)).astype("float32"), rng.standard_normal((64, 1)).astype("float32")


def state(opt):
    return {v.path: np.array(v.numpy()) for v in opt.variables}


def assert_same_state(a, b):
    sa, sb = state(a), state(b)
    assert len(sa) == len(sb)
    for (ka, va), vb in zip(sa.items(), sb.values()):
        np.testing.assert_array_equal(va, vb, err_msg=ka)


def continue_training(model):
    x, y = batches()
    model.fit(x[32:], y[32:], batch_size=4, shuffle=False, verbose=0)
    return model.get_weights()


def test_model_save_and_load_restore_whole_state_and_resume(tmp_path, float16_policy):
    model, opt = trained_model()
    assert int(opt.skipped_steps) >= 1 and int(opt.norm_history_count) > 0
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    lopt = loaded.optimizer
    assert type(lopt) is tas.AdaptiveLossScaleOptimizer
    assert_same_state(opt, lopt)
    assert float(lopt.loss_scale) == float(opt.loss_scale)
    # Training continues identically from the restored state.
    for a, b in zip(continue_training(model), continue_training(loaded)):
        np.testing.assert_array_equal(a, b)
    assert_same_state(opt, lopt)


def test_checkpoint_restores_whole_state_and_resumes(tmp_path, float16_policy):
    model, opt = trained_model()
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    saved_state = state(opt)
    expected = continue_training(model)
    expected_state = state(opt)

    keras.utils.set_random_seed(7)  # different initial weights
    fresh = dense_model(4, 8, 1, sequential=True)
    fopt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        **{**ALL_ARGUMENTS, "autoclip_per_variable": False, "accumulation_steps": 1}
    )
    fresh.compile(fopt, "mse", jit_compile=True)
    fopt.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fopt).restore(prefix).assert_consumed()
    for (k, v), e in zip(state(fopt).items(), saved_state.values()):
        np.testing.assert_array_equal(v, e, err_msg=k)
    for a, b in zip(continue_training(fresh), expected):
        np.testing.assert_array_equal(a, b)
    for (k, v), e in zip(state(fopt).items(), expected_state.values()):
        np.testing.assert_array_equal(v, e, err_msg=k)


def test_a_window_cut_by_a_save_resumes_exactly(tmp_path):
    """Gradient accumulation: the window's sums are optimizer state, saved
    mid-window and restored."""
    x, y = batches()
    model = dense_model(4, 3, 1, sequential=True)
    model.compile(tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2), scaling="adaptive", accumulation_steps=2), "mse")
    model.fit(x[:12], y[:12], batch_size=4, shuffle=False, verbose=0)  # 1.5 windows
    assert int(model.optimizer._window.count.numpy()) == 1
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for m in (model, loaded):
        m.fit(x[12:16], y[12:16], batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.optimizer.total_steps.numpy()) == 2
