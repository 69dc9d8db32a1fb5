"""Shared setup and subprocess body for tests/test_resume.py (not a test module).

The test process trains every scaling mode and saves it three ways; this
worker is the *fresh process* that restores each of them, trains the same
remaining steps and writes what it sees to an `.npz` file, so the test can
compare it bitwise with the run that never left its process.

Usage: python tests/resume_worker.py WORKDIR OUTPUT.npz

WORKDIR holds, per mode, `<mode>.keras` (`model.save`), `<mode>_ckpt`
(`tf.train.Checkpoint.write`) and `<mode>_backup/` (what
`keras.callbacks.BackupAndRestore` left behind when `fit` was interrupted
mid-epoch). For each `(mode, format)` the output holds `<mode>/<format>/paths`,
`.../restored/<i>` (every variable right after the restore) and
`.../final/<i>` (after training to the last epoch); a pair that raised holds
`.../error` (its traceback) instead, so the other pairs still report.

The setup both processes share (data, model, optimizer, `fit`) lives here too:
the test module imports it, so both train with the very same code.
"""

import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

MODES = ("adaptive", "dynamic", "static", "none", "per_layer")
FORMATS = ("keras", "checkpoint", "backup")
FEATURES = 4
BATCH = 4
BATCHES_PER_EPOCH = 6
EPOCHS = 4
# Saved after this many epochs (12 steps); the resumed runs train the last two
# (12 more steps).
SAVED_EPOCHS = 2
# `fit` is interrupted this many batches in (mid third epoch), after
# BackupAndRestore wrote its end-of-second-epoch backup.
INTERRUPT_AFTER = SAVED_EPOCHS * BATCHES_PER_EPOCH + 3
# A different seed than the saving run's: restored state must come from the
# files, not from identical initialisers.
RESTORE_SEED = 123


def data():
    """Deterministic batches; each epoch holds two steps that are skipped.

    Batch 1 carries one input of 300: forward values stay finite in float16,
    but gradients scaled by 2**15 overflow (the scale backs off, caps, ...).
    Batch 4 carries an input of 1e30 (inf in float16): a non-finite loss,
    skipped in every mode ("none" included) as bad data.
    """
    rng = np.random.default_rng(1234)
    n = BATCH * BATCHES_PER_EPOCH
    x = rng.standard_normal((n, FEATURES)).astype("float32")
    y = rng.standard_normal((n, 1)).astype("float32")
    x[1 * BATCH + 2, 0] = 300.0
    x[4 * BATCH + 1, 3] = 1e30
    return x, y


def make_model(mode):
    base = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ],
        name="net",
    )
    return tas.instrument(base) if mode == "per_layer" else base


def make_optimizer(mode):
    """Adam (slots matter) with AutoClip (its ring buffer is state too)."""
    return tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        scaling=mode,
        initial_scale=2.0**15,
        dynamic_growth_steps=3,
        update_every=2,
        autoclip_percentile=90.0,
        autoclip_window=4,
    )


def compiled_model(mode, seed):
    """A model and its built optimizer, as a training script makes them."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(seed)
    model = make_model(mode)
    optimizer = make_optimizer(mode)
    model.compile(optimizer, "mse", jit_compile=True)
    optimizer.build(model.trainable_variables)
    return model


def fit(model, initial_epoch=0, callbacks=()):
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def tracked_variables(model):
    """Every model variable (an instrumented model's scale table: its
    `log2_scales`, `log2_ceilings`, `measure`, `statistics`, included), then
    every optimizer variable (the inner optimizer's slots included)."""
    return list(model.weights) + list(model.optimizer.variables)


def snapshot(model):
    """`(paths, values)` of `tracked_variables`, as numpy copies."""
    variables = tracked_variables(model)
    return [v.path for v in variables], [np.array(v.numpy()) for v in variables]


class Snapshot(keras.callbacks.Callback):
    """Records `snapshot(model)` once fit begins (after earlier callbacks,
    BackupAndRestore's restore included, have run)."""

    def on_train_begin(self, logs=None):
        self.taken = snapshot(self.model)


def paths(workdir, mode):
    return {
        "keras": os.path.join(workdir, f"{mode}.keras"),
        "checkpoint": os.path.join(workdir, f"{mode}_ckpt"),
        "backup": os.path.join(workdir, f"{mode}_backup"),
    }


def fresh_values(mode):
    """The values of `tracked_variables` of a model and optimizer just built
    (not compiled, so not traced: cheap) with another seed than the saving
    run's."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(RESTORE_SEED)
    model = make_model(mode)
    optimizer = make_optimizer(mode)
    optimizer.build(model.trainable_variables)
    return [np.array(v.numpy()) for v in list(model.weights) + optimizer.variables]


def reset(model, values):
    variables = tracked_variables(model)
    if len(variables) != len(values):
        raise AssertionError(f"{len(variables)} variables, {len(values)} values")
    for variable, value in zip(variables, values):
        variable.assign(value)


def resume(mode, workdir):
    """Restores `mode` from each format the way a user does and trains on.

    Yields `(format, restored, final)` per format: the snapshot right after
    restoring and the one after the remaining epochs (or the exception).
    `"keras"` loads a new model with `keras.models.load_model`. The other two
    formats restore into that same model (one XLA compilation per mode, not
    three), first reset to the values a freshly built one holds (another
    seed, initial optimizer state): `tf.train.Checkpoint(...).read`, then
    `fit` with a new `BackupAndRestore` on the interrupted run's directory.
    """
    where = paths(workdir, mode)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.models.load_model(where["keras"])  # no custom_objects
        restored = snapshot(model)
        fit(model, initial_epoch=SAVED_EPOCHS)
        yield "keras", restored, snapshot(model)
    except Exception as error:  # reported per pair, the other modes still run
        yield "keras", _failure(error), None
        for fmt in FORMATS[1:]:
            skipped = RuntimeError("not run: they restore into the model "
                                   "that load_model failed to give")
            skipped.formatted = str(skipped)
            yield fmt, skipped, None
        return
    fresh = fresh_values(mode)

    try:
        reset(model, fresh)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
            where["checkpoint"]
        ).assert_consumed()
        restored = snapshot(model)
        fit(model, initial_epoch=SAVED_EPOCHS)
        yield "checkpoint", restored, snapshot(model)
    except Exception as error:
        yield "checkpoint", _failure(error), None

    try:
        reset(model, fresh)
        backup = keras.callbacks.BackupAndRestore(where["backup"], save_freq="epoch")
        first = Snapshot()
        history = fit(model, callbacks=[backup, first])
        epochs_run = len(history.history["loss"])
        if epochs_run != EPOCHS - SAVED_EPOCHS:
            raise AssertionError(
                f"BackupAndRestore resumed {epochs_run} epochs, expected "
                f"{EPOCHS - SAVED_EPOCHS}"
            )
        yield "backup", first.taken, snapshot(model)
    except Exception as error:
        yield "backup", _failure(error), None


def _failure(error):
    error.formatted = traceback.format_exc()
    return error


def main(workdir, output):
    arrays = {}
    for mode in MODES:
        for fmt, restored, final in resume(mode, workdir):
            key = f"{mode}/{fmt}"
            if isinstance(restored, Exception):
                arrays[f"{key}/error"] = np.array(restored.formatted)
                continue
            names, restored = restored
            arrays[f"{key}/paths"] = np.array(names)
            for i, value in enumerate(restored):
                arrays[f"{key}/restored/{i}"] = value
            for i, value in enumerate(final[1]):
                arrays[f"{key}/final/{i}"] = value
    np.savez(output, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])
