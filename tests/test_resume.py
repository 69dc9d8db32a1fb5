"""Exact resume in a fresh process, for every scaling mode and save format.

Per mode (`"adaptive"`, `"dynamic"`, `"static"`, `"none"`, and `"per_layer"`
on a `tas.instrument`-ed model), this process trains with mixed_float16, XLA,
an inner Adam and AutoClip, on deterministic data whose every epoch holds a
gradient overflow and a non-finite loss (so steps are skipped and measured
before and after the save point). At the end of epoch 2 it writes
`model.save(".keras")` and `tf.train.Checkpoint(...).write`, and trains on
uninterrupted: the reference. It then resets every variable to its initial
value, trains again with `keras.callbacks.BackupAndRestore` and is interrupted
by a callback mid epoch 3 (the backup holds the end of epoch 2).

`tests/resume_worker.py`, in one fresh process, restores each (mode, format)
as a user would (`keras.models.load_model` without custom objects;
`tf.train.Checkpoint(model=, optimizer=).read(...).assert_consumed()`; `fit`
with a new `BackupAndRestore` on the same directory), and trains to the end.
(The last two restore into the model `load_model` gave, reset to the values a
freshly built model and optimizer hold: XLA compiles once per mode there.)
Every model variable (an instrumented model's scale table included) and every
optimizer variable (inner slots included) must equal, bitwise, the saved state
right after restoring and the reference after training on.

Also: a checkpoint of the stock `keras.mixed_precision.LossScaleOptimizer`
loaded into a model whose optimizer is `AdaptiveLossScaleOptimizer`.
"""

import os
import re
import warnings

import numpy as np
import pytest
import keras
import tensorflow as tf

import resume_worker as rw
from helpers import ROOT, child

WORKER = os.path.join(ROOT, "tests", "resume_worker.py")


class Interrupted(Exception):
    pass


class SaveAt(keras.callbacks.Callback):
    """At the end of epoch `SAVED_EPOCHS`, saves both formats and the state."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def on_epoch_end(self, epoch, logs=None):
        if epoch == rw.SAVED_EPOCHS - 1:
            self.model.save(self.where["keras"])
            tf.train.Checkpoint(
                model=self.model, optimizer=self.model.optimizer
            ).write(self.where["checkpoint"])
            self.saved = rw.snapshot(self.model)
            optimizer = self.model.optimizer
            self.counters = {name: int(getattr(optimizer, name))
                             for name in ("skipped_steps", "measurements", "total_steps")}


class InterruptAfter(keras.callbacks.Callback):
    """Raises after `batches` batches; records the state at the end of
    epoch `SAVED_EPOCHS` (what BackupAndRestore backs up)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches
        self.seen = 0

    def on_epoch_end(self, epoch, logs=None):
        if epoch == rw.SAVED_EPOCHS - 1:
            self.backed_up = rw.snapshot(self.model)

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.batches:
            raise Interrupted(f"interrupted after {self.seen} batches")


def _counters(model):
    opt = model.optimizer
    return int(opt.skipped_steps), int(opt.measurements), int(opt.total_steps)


def train_and_save(mode, workdir):
    """Saves `mode` three ways; returns the saved and the reference states."""
    where = rw.paths(workdir, mode)
    model = rw.compiled_model(mode, seed=0)
    _, initial = rw.snapshot(model)
    saver = SaveAt(where)
    rw.fit(model, callbacks=[saver])
    reference = rw.snapshot(model)
    skipped, measured, total = _counters(model)
    saved_names, saved_values = saver.saved
    counters = saver.counters
    # The protocol exercises what it claims: measurements and skipped steps
    # both before the save point and after it.
    steps = rw.SAVED_EPOCHS * rw.BATCHES_PER_EPOCH
    assert counters["total_steps"] == steps, counters
    assert counters["skipped_steps"] >= 1 and counters["measurements"] >= 1, counters
    assert skipped > counters["skipped_steps"], (mode, skipped, counters)
    assert measured > counters["measurements"], (mode, measured, counters)
    assert total == rw.EPOCHS * rw.BATCHES_PER_EPOCH

    # Same run again from the very same initial values, interrupted mid-way.
    for variable, value in zip(rw.tracked_variables(model), initial):
        variable.assign(value)
    backup = keras.callbacks.BackupAndRestore(where["backup"], save_freq="epoch")
    interrupt = InterruptAfter(rw.INTERRUPT_AFTER)
    with pytest.raises(Interrupted):
        rw.fit(model, callbacks=[backup, interrupt])
    assert os.path.exists(os.path.join(where["backup"], "latest.weights.h5"))
    # The backup holds the state the other two formats hold.
    _, backed_up = interrupt.backed_up
    for name, a, b in zip(saved_names, saved_values, backed_up):
        assert a.tobytes() == b.tobytes(), f"{mode}: the rerun differs at {name}"
    return saver.saved, reference


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Trains and saves every mode here, restores them all in one fresh
    process; returns `{mode: (saved, reference)}` and the worker's arrays."""
    workdir = str(tmp_path_factory.mktemp("resume"))
    here = {}
    try:
        for mode in rw.MODES:
            here[mode] = train_and_save(mode, workdir)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    output = os.path.join(workdir, "resumed.npz")
    proc = child(WORKER, workdir, output)
    if proc.returncode != 0 or not os.path.exists(output):
        pytest.fail(
            f"resume worker failed (exit status {proc.returncode})\n"
            f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    with np.load(output) as arrays:
        return here, dict(arrays)


def _differences(names, expected, got):
    """`(max |difference| over all variables, [(name, diff) that are not
    bitwise equal])`; NaNs in the same place and equal infs count as equal."""
    worst, unequal = 0.0, []
    for name, a, b in zip(names, expected, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            unequal.append((name, f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"))
            worst = float("inf")
            continue
        if a.tobytes() == b.tobytes():
            continue
        x, y = a.astype("float64"), b.astype("float64")
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        diff = np.where(same, 0.0, np.abs(x - y))
        d = float(np.nan_to_num(np.max(diff), nan=np.inf)) if diff.size else 0.0
        worst = max(worst, d)
        unequal.append((name, d))
    return worst, unequal


@pytest.mark.slow  # starts a child process
class TestFreshProcessResume:
    """Every mode and format restored in one fresh process (the `resumed` fixture: one worker runs this class)."""

    @pytest.mark.parametrize("fmt", rw.FORMATS)
    @pytest.mark.parametrize("mode", rw.MODES)
    def test_fresh_process_resume_is_bitwise_exact(self, resumed, mode, fmt):
        here, arrays = resumed
        (names, saved), (_, reference) = here[mode]
        key = f"{mode}/{fmt}"
        if f"{key}/error" in arrays:
            pytest.fail(f"{key} raised in the fresh process:\n{arrays[key + '/error']}")
        if f"{key}/paths" not in arrays:
            pytest.fail(f"{key}: the fresh process reported nothing")
        got_names = [str(n) for n in arrays[f"{key}/paths"]]
        assert len(got_names) == len(names), (got_names, names)
        # Same variables in the same order (paths may differ in prefixes: Keras
        # uniquifies names within a process, and slot names of a loaded model
        # lack the model's name).
        for got, name in zip(got_names, names):
            a, b = got.rsplit("/", 1)[-1], name.rsplit("/", 1)[-1]
            assert a.endswith(b) or b.endswith(a), (got, name)
        restored = [arrays[f"{key}/restored/{i}"] for i in range(len(names))]
        final = [arrays[f"{key}/final/{i}"] for i in range(len(names))]
        at_restore, unequal_restore = _differences(names, saved, restored)
        at_end, unequal_end = _differences(names, reference, final)
        print(
            f"\nresume[{mode}/{fmt}]: {len(names)} variables, "
            f"max |diff| after restore {at_restore:g}, "
            f"after {rw.EPOCHS - rw.SAVED_EPOCHS} more epochs {at_end:g}"
        )
        assert not unequal_restore, f"restored state differs: {unequal_restore}"
        assert not unequal_end, f"resumed training differs: {unequal_end}"


# ---------------------------------------------------------------------------
# A stock LossScaleOptimizer checkpoint, loaded with AdaptiveLossScaleOptimizer.
# ---------------------------------------------------------------------------

STOCK_SHARED = ("iteration", "learning_rate", "dynamic_scale", "step_counter")


@pytest.fixture(scope="module")
def stock_saved(tmp_path_factory):
    """A model trained with the stock LossScaleOptimizer (overflows and a
    non-finite step back its scale off from the initial 2**15), saved both
    ways."""
    workdir = str(tmp_path_factory.mktemp("stock"))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = rw.make_model("adaptive")
        opt = keras.mixed_precision.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**15,
            dynamic_growth_steps=1000,
        )
        model.compile(opt, "mse", jit_compile=True)
        x, y = rw.data()
        model.fit(x, y, batch_size=rw.BATCH, shuffle=False, verbose=0)
        prefix = tf.train.Checkpoint(model=model, optimizer=opt).write(
            os.path.join(workdir, "stock_ckpt")
        )
        path = os.path.join(workdir, "stock.keras")
        model.save(path)
        # Backed off: a scale the adaptive optimizer does not start from.
        assert float(opt.dynamic_scale) < 2.0**15
        return {
            "checkpoint": prefix,
            "keras": path,
            "weights": [np.array(w) for w in model.get_weights()],
            "inner": [
                (v.path, np.array(v.numpy())) for v in opt.inner_optimizer.variables
            ],
            "scale": float(opt.dynamic_scale),
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")


class TestStockCheckpoint:
    """A stock checkpoint restored into ours (the `stock_saved` fixture: one worker runs this class)."""

    @pytest.mark.parametrize("fmt", ["checkpoint", "checkpoint_unbuilt", "keras"])
    @pytest.mark.parametrize("mode", ["dynamic", "adaptive"])
    def test_stock_loss_scale_checkpoint_restores_into_adaptive(
            self, stock_saved, mode, fmt, float16_policy):
        """What a demanding user migrating from the stock optimizer wants: the
        restore does not raise; weights and the inner optimizer (iterations,
        slots) are restored bitwise; the scale is taken over; and, for `.keras`,
        a warning says the file came from a stock `LossScaleOptimizer` and names
        the AdaptiveLossScaleOptimizer state it could not restore (that starts
        fresh). `.keras` files are loaded into the existing model with
        `model.load_weights`; checkpoints with `tf.train.Checkpoint(...).read`,
        into a built optimizer or (`checkpoint_unbuilt`) into one built after the
        read (TensorFlow's deferred restoration), as before the first `fit`."""
        keras.utils.set_random_seed(rw.RESTORE_SEED)
        model = rw.make_model(mode)
        opt = rw.make_optimizer(mode)
        model.compile(opt, "mse", jit_compile=True)
        if fmt != "checkpoint_unbuilt":
            opt.build(model.trainable_variables)
        problems = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if fmt == "keras":
                    model.load_weights(stock_saved["keras"])
                else:
                    tf.train.Checkpoint(model=model, optimizer=opt).read(
                        stock_saved["checkpoint"]
                    )
                if not opt.built:
                    opt.build(model.trainable_variables)
            except Exception as error:  # noqa: BLE001 - reported below
                problems.append(f"restore raised {type(error).__name__}: {error}")
        messages = [str(w.message) for w in caught]
        # The optimizer's own state by name (a packed scalar is no variable).
        own = ["iteration", "learning_rate"] + [s.name for s in opt.declared_state()]
        fresh_only = [name for name in own if name not in STOCK_SHARED]

        for i, (a, b) in enumerate(zip(stock_saved["weights"], model.get_weights())):
            if a.tobytes() != b.tobytes():
                problems.append(f"model weight {i} not restored")
        inner = opt.inner_optimizer.variables
        if len(inner) != len(stock_saved["inner"]):
            problems.append("inner optimizer has another number of variables")
        for (name, a), v in zip(stock_saved["inner"], inner):
            if a.tobytes() != np.array(v.numpy()).tobytes():
                problems.append(f"inner optimizer variable {name} not restored")
        if float(opt.loss_scale) != stock_saved["scale"]:
            problems.append(
                f"scale not taken over: loss_scale={float(opt.loss_scale)}, "
                f"checkpoint's={stock_saved['scale']}"
            )
        explained = [
            m for m in messages
            if "LossScaleOptimizer" in m and any(
                re.search(rf"\b{re.escape(n)}\b", m) for n in fresh_only
            )
        ]
        # tf.train.Checkpoint restores by name, with TensorFlow's partial-restore
        # semantics (its status object reports what it did not match): only the
        # `.keras` path, which loads by position, can and does warn.
        if not explained and fmt == "keras":
            problems.append(
                "no warning names the stock LossScaleOptimizer and the state "
                f"that starts fresh ({', '.join(fresh_only)}); warnings: {messages}"
            )
        keras.mixed_precision.set_global_policy("float32")
        assert not problems, "\n".join(problems)
