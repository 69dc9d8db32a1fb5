"""ScaleMonitor: the Keras callback that reports the loss scale, skipped
steps and per-layer gradients, and warns of trouble.

The callback reads the optimizer; what it records is `monitor_log`'s
`LogRecord`, what it warns of comes from `diagnoses`.
"""

import dataclasses
import inspect
import os
import warnings

import keras

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.monitor import diagnoses
from tf_adaptive_scale.monitor import forward_check
from tf_adaptive_scale.numerics import gradient_statistics as stats  # noqa: F401 (monitor.stats)
from tf_adaptive_scale.backend import keras_internals
from tf_adaptive_scale.monitor import monitor_log
from tf_adaptive_scale.numerics import validation
from tf_adaptive_scale.monitor.float16_analysis import float16_fractions  # noqa: F401
from tf_adaptive_scale.monitor.float16_analysis import scale_window  # noqa: F401

JSON_LINES_FILE = monitor_log.FILE_NAME


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class ScaleMonitor(keras.callbacks.Callback):
    __doc__ = """Logs the loss scale and per-layer gradients, and warns of trouble.

    Every `every_n_steps` and at each epoch's end it reads what the
    `AdaptiveLossScaleOptimizer` measured, records `scale/...` and
    `layer/<name>/...` keys in `History` (only `scale/loss_scale` and
    `scale/skipped_steps` in `logs`, which Keras's progress bar prints; per
    layer, `scale/layer_scale_min` and `scale/layer_scale_max` in place of
    the global scale, which stays 1),
    writes TensorBoard events and `scale_monitor.jsonl` lines to `log_dir`,
    and warns once per layer and kind of what `diagnoses` finds (`flags`
    keeps it). It stops `fit` after `max_consecutive_skips` skipped steps
    (`stop_error`). Layers are named by their path in the model (`dense`,
    `block/dense_2`). docs/monitor.md tells the keys, the names, the
    diagnoses and the probe.

    The gradient figures are the optimizer's last measured step's (it
    measures every `update_every` steps), told by `scale/measured_step`:
    where none is new since the last report (in `History`, since the last
    epoch) they are NaN, and TensorBoard has them once, at the step they
    were measured. A monitor that reports between measurements says so once.

    Args:
        every_n_steps: Steps between two reports.
        log_dir: Optional directory for TensorBoard events and JSON lines.
        json_lines: Write `scale_monitor.jsonl` into `log_dir`.
        optimizer: The optimizer, for custom loops (`fit` uses the model's).
        per_layer_logs: Put every key in `logs` (the progress bar and the
            callbacks after this one see them all), not only
            `scale/loss_scale` (per layer, the layers' range of scales) and
            `scale/skipped_steps`.
{thresholds}
        probe: Optional batch of the model's inputs: after a non-finite
            loss, names the first layer whose output is not finite (not
            saved in `get_config`).
        verbose: 0 to print no summary at the end of training.

    Example:

    >>> monitor = tas.ScaleMonitor(every_n_steps=100, log_dir="logs")
    >>> model.fit(x, y, callbacks=[monitor])
    >>> monitor.flags  # what the diagnoses found
    """.format(thresholds=diagnoses.args_doc(indent=8))

    def __init__(self, every_n_steps=100, log_dir=None, json_lines=True, optimizer=None,
                 per_layer_logs=False, probe=None, verbose=1, **thresholds):
        super().__init__()
        self.every_n_steps = validation.positive_int("every_n_steps", every_n_steps)
        self.log_dir = _directory("log_dir", log_dir)
        self.json_lines = validation.boolean("json_lines", json_lines)
        self.per_layer_logs = validation.boolean("per_layer_logs", per_layer_logs)
        unknown = sorted(set(thresholds) - set(diagnoses.ARGUMENTS))
        if unknown:
            raise TypeError(f"ScaleMonitor got unexpected arguments {unknown}; its "
                            f"thresholds are {list(diagnoses.ARGUMENTS)}.")
        self.settings = diagnoses.Settings(**thresholds)
        self.probe = probe
        self.verbose = verbose
        self._optimizer = _adaptive("`optimizer`", optimizer) if optimizer is not None else None
        self.stop_error = None
        self.flags = []
        self.records = []  # the JSON form of each report
        self._latest = None  # the last report's `LogRecord`
        self._memory = diagnoses.Memory()
        self._writer = None
        self._warned_stale = False  # said once that reports outrun measurements
        self._begin()

    # For help() and IDEs: the thresholds (`diagnoses.Settings`, each
    # declared once there) are keyword arguments with their defaults.
    __init__.__signature__ = inspect.Signature([
        *list(inspect.signature(__init__).parameters.values())[:-1],
        *[inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                            default=diagnoses.Settings.__dataclass_fields__[name].default)
          for name in diagnoses.ARGUMENTS],
    ])

    def __getattr__(self, name):
        # The thresholds read as attributes (`monitor.patience`).
        settings = self.__dict__.get("settings")
        if settings is not None and name in diagnoses.ARGUMENTS:
            return getattr(settings, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _begin(self):
        """What a report is relative to: this run's batches, the counts."""
        self._step = self._steps_before_epoch = self._reported_batch = 0
        self._since = monitor_log.Counts()
        self._measurements_before_epoch = 0

    def _adaptive_optimizer(self):
        return self._optimizer or _adaptive(
            "the model's optimizer", getattr(self.model, "optimizer", None)
        )

    @property
    def optimizer(self):
        optimizer = self._adaptive_optimizer()
        if not optimizer.built:
            raise ValueError("ScaleMonitor reads a built optimizer: call it after "
                             "the first training step.")
        return optimizer

    # Keras hooks.

    def on_train_begin(self, logs=None):
        # Checked before the first batch, not `every_n_steps` batches in.
        optimizer = self._adaptive_optimizer()
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
        self._begin()
        if self.model is not None:
            optimizer.name_layers(self.model)
        self._memory = self._memory._replace(loss_finite=True)
        if optimizer.built:  # a resumed run: its counts so far are not news
            self._since = monitor_log.Counts.of(optimizer.read())
        self._measurements_before_epoch = self._since.measurements

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, `batch` is the execution's last step.
        self._step = self._steps_before_epoch + batch + 1
        if self._step - self._reported_batch >= self.every_n_steps:
            record = self._report(logs)
            if logs is not None:
                logs.update(self._logged(record, record.new_measurement))
            if not record.new_measurement:
                self._stale_report(record)

    def on_epoch_end(self, epoch, logs=None):
        if self._step > self._reported_batch:
            self._report(logs)
        if self.records:
            # The epoch's entry: its measured figures if it measured any.
            fresh = self._since.measurements > self._measurements_before_epoch
            if logs is not None:
                logs.update(self._logged(self._latest, fresh))
            self._to_history(self._latest, fresh)
            if not fresh:
                self._stale_epoch(epoch, self._step - self._steps_before_epoch)
        self._measurements_before_epoch = self._since.measurements
        self._steps_before_epoch = self._step

    def on_train_end(self, logs=None):
        if self.verbose:
            print(self.summary())
        if self._writer is not None:
            self._writer.flush()

    def _report(self, logs):
        """Reads and keeps a report in `fit`; returns its `LogRecord`."""
        loss = None if logs is None else logs.get("loss")
        record = self._read(None, loss, getattr(self, "_epoch", 0))
        record = dataclasses.replace(record, from_fit=True,
                                     interval_loss=self._interval_loss(loss))
        self._keep(record, record.measured_step)
        self._reported_batch = self._step
        return record

    def _logged(self, record, fresh):
        """A record's keys for `logs` (its measured figures NaN unless
        `fresh`): all with `per_layer_logs`, else the few the progress bar
        shows on one line (read at the report: never NaN)."""
        keys = monitor_log.scalars(record, per_layer=True, fresh=fresh)
        if self.per_layer_logs:
            return keys
        return {key: keys[key] for key in monitor_log.progress_keys(record)}

    def _to_history(self, record, fresh):
        """Appends the epoch's keys that `logs` did not carry to the
        `History` of `fit` (which records `logs`' own after this callback);
        its measured figures NaN unless `fresh`, so that every key keeps
        one value per epoch."""
        history = getattr(self.model, "history", None)
        if self.per_layer_logs or not isinstance(history, keras.callbacks.History):
            return
        in_logs = monitor_log.progress_keys(record)
        for key, value in monitor_log.scalars(record, per_layer=True, fresh=fresh).items():
            if key not in in_logs:
                history.history.setdefault(key, []).append(value)

    # Reports that find no new measurement (`every_n_steps` counts batches,
    # `update_every` optimizer steps: windows of `accumulation_steps` batches).

    def _stale_report(self, record):
        """Warns (once) of a report on schedule without a new measurement."""
        opt = self._adaptive_optimizer()
        self._stale(
            f"the report at step {record.step}", record,
            f"more seldom than this monitor reports (`every_n_steps`={self.every_n_steps})",
            "set `every_n_steps` to a multiple of "
            f"{opt.update_every * opt.accumulation_steps}, or the optimizer's `update_every` "
            f"to {max(self.every_n_steps // opt.accumulation_steps, 1)}")

    def _stale_epoch(self, epoch, steps):
        """Warns (once) of an epoch of `steps` batches without a measurement."""
        self._stale(
            f"epoch {epoch + 1} ({steps} steps)", self._latest,
            "more seldom than once an epoch; this monitor reports at each epoch's end and "
            f"every `every_n_steps`={self.every_n_steps} steps",
            "set the optimizer's `update_every` to "
            f"{max(steps // self._adaptive_optimizer().accumulation_steps, 1)} or fewer")

    def _stale(self, where, record, how_often, advice):
        """Warns, once, that `where` saw no new measurement because the
        optimizer measures `how_often`; not where a measurement is overdue
        (skipped steps postpone it) or none was ever taken."""
        update_every = self._adaptive_optimizer().update_every
        due = self._since.total_steps - record.measured_step <= update_every
        if self._warned_stale or record.measured_step < 0 or not due:
            return
        self._warned_stale = True
        warnings.warn(
            f"ScaleMonitor: {where} has no new gradient measurement (the last was at step "
            f"{record.measured_step}): the optimizer measures every `update_every`="
            f"{update_every} steps, {how_often}. Gradient figures not measured since the "
            "report before (in History: during the epoch) are NaN in History and logs, marked "
            "`new_measurement: false` in the JSON lines, and in TensorBoard once, at their "
            f"measured step. For new ones at every report, {advice}.",
            UserWarning, stacklevel=3)

    def _interval_loss(self, loss):
        """The mean loss of the batches since the last report, from Keras's
        running mean over the epoch so far (which jumps at every epoch)."""
        if loss is None:
            return None
        done = self._step - self._steps_before_epoch  # batches of this epoch
        before = max(self._reported_batch - self._steps_before_epoch, 0)
        # The last report, of this epoch, holds the running mean then.
        mean_before = self._latest.loss if before else 0.0
        return (done * float(loss) - before * mean_before) / max(done - before, 1)

    # The work.

    def log(self, step=None, loss=None, epoch=0):
        """Reads the optimizer's state now and reports it (custom loops).

        Args:
            step: The step to record; default: the optimizer's own count of
                steps (applied and skipped), which a restored optimizer
                continues.
            loss: Optional loss value to record.
            epoch: Optional epoch to record.

        Returns:
            The report, a dict (the JSON line's content).
        """
        if self.model is not None:
            self._adaptive_optimizer().name_layers(self.model)
        record = self._read(step, loss, epoch)
        if not record.new_measurement:
            self._stale(f"the report at step {record.step}", record,
                        "more seldom than `log()` is called",
                        "call `log()` once per measurement, or set the optimizer's "
                        "`update_every` to the steps between two calls")
        # A step of the caller's own may not count the optimizer's steps.
        return self._keep(record, record.measured_step if step is None else record.step)

    def _read(self, step, loss, epoch):
        """The optimizer's state now, diagnosed: a `LogRecord`."""
        opt = self.optimizer
        reading = opt.read()
        rate = self.settings.window_underflow or opt.underflow_rate
        record = monitor_log.LogRecord.of_reading(
            reading, self._since, step=step, epoch=epoch, loss=loss, policy=opt.policy,
            underflow_rate=rate)
        observation = diagnoses.Observation(
            record, record.new_measurement, self.settings, rate,
            # Read only where a diagnosis reads them: on a new measurement.
            weight_dtypes=_weight_dtypes(opt) if record.new_measurement else (),
            stall=self._check_progress(opt),
            probe=None if self.probe is None else self._first_non_finite_layer,
            past=self._memory)
        self._since = monitor_log.Counts.of(reading)
        flags, self._memory = diagnoses.diagnose(observation)
        for flag in flags:
            self._warn(record, flag)
        return dataclasses.replace(record, flags=tuple((f.kind, f.layer) for f in flags))

    def _check_progress(self, opt):
        """The optimizer's stalled-training message, or None; stops `fit`
        (like TerminateOnNaN) once it has skipped `max_consecutive_skips`
        steps in a row."""
        try:
            opt.check_progress()
        except RuntimeError as error:
            self.stop_error = error
            if self.model is not None:
                self.model.stop_training = True
            return str(error)
        return None

    def _first_non_finite_layer(self):
        if self.model is None:
            return None
        return forward_check.first_non_finite_layer(self.model, self.probe)

    def _warn(self, record, flag):
        message = f"Step {record.step}: layer '{flag.layer}': {flag.message}"
        if flag.measured_step is not None:
            message += f" (measured at step {flag.measured_step})"
        self.flags.append({"step": record.step, "layer": flag.layer, "kind": flag.kind,
                           "message": message})
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _keep(self, record, measured_at):
        """Keeps a report and writes it, its new measured figures at step
        `measured_at`; returns its JSON form."""
        self._latest = record
        self.records.append(record.to_json())
        if self.log_dir is not None:
            self._write(record, measured_at)
        return self.records[-1]

    def _write(self, record, measured_at):
        os.makedirs(self.log_dir, exist_ok=True)
        if self.json_lines:
            monitor_log.append(self.log_dir, record)
        if self._writer is None:
            self._writer = _event_writer(self.log_dir)
        scalars = monitor_log.scalars(record, per_layer=True)
        if record.new_measurement:  # once, at its step (before the report's: steps ascend)
            self._writer.write(measured_at, {
                key: value for key, value in scalars.items() if monitor_log.measured(key)}, {
                f"layer/{name}/exponents": layer.histogram
                for name, layer in record.layers.items()})
        self._writer.write(record.step, {
            key: value for key, value in scalars.items() if not monitor_log.measured(key)}, {})

    def summary(self):
        """A short text: final scales, skipped steps, flagged layers."""
        return monitor_log.summary(self._latest if self.records else None, self.flags)

    def get_config(self):
        return {
            "every_n_steps": self.every_n_steps,
            "log_dir": self.log_dir,
            "json_lines": self.json_lines,
            "per_layer_logs": self.per_layer_logs,
            **{name: getattr(self.settings, name) for name in diagnoses.ARGUMENTS},
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _weight_dtypes(opt):
    """`(layer, dtype)` of each variable whose gradient the optimizer measures."""
    return tuple(
        (scale[0], keras.backend.standardize_dtype(variable.dtype))
        for variable, scale in zip(keras_internals.built_variables(opt), opt.gradient_scales())
        if scale is not None
    )


def _directory(name, path):
    """`path` (None or a directory, existing or not), or a clear error."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"`{name}` must be a directory path or None. Received: {name}={path!r}")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"`{name}` must be a directory; {path!r} is an existing file.")
    return path


def _adaptive(what, optimizer):
    """`optimizer` if it is an `AdaptiveLossScaleOptimizer`, else a clear error."""
    from tf_adaptive_scale.step.optimizer import AdaptiveLossScaleOptimizer

    if not isinstance(optimizer, AdaptiveLossScaleOptimizer):
        raise ValueError(
            f"ScaleMonitor reads a tas.AdaptiveLossScaleOptimizer; {what} is "
            f"{type(optimizer).__name__}. Compile the model with "
            "tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()) (say), or "
            "pass `optimizer=` for a custom loop."
        )
    return optimizer


def _event_writer(log_dir):
    """TensorBoard events on TensorFlow; elsewhere none (JSON lines only)."""
    if not backends.TENSORFLOW:
        return _NoEvents()
    from tf_adaptive_scale.monitor import tensorboard_events

    return tensorboard_events.EventWriter(log_dir)


class _NoEvents:
    """The event writer where TensorBoard's needs TensorFlow."""

    def write(self, step, scalars, histograms):
        pass

    def flush(self):
        pass
