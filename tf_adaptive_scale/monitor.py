"""ScaleMonitor: the loss scale, skipped steps and per-layer gradients, made
visible (logs, TensorBoard, JSON lines) and diagnosed.

The numbers come from the real training step: the optimizer measures every
`update_every` steps, inside the compiled step and in fixed-size variables
(per variable: gradient norm and exponent histogram of the unscaled
gradients). The monitor reads them from the host every `every_n_steps`, so
other steps pay nothing, and names them by layer.
"""

import collections
import json
import math
import os
import warnings

import keras
import numpy as np

from tf_adaptive_scale import backends
from tf_adaptive_scale import float16
from tf_adaptive_scale import forward_check
from tf_adaptive_scale import gradient_statistics as stats
from tf_adaptive_scale import keras_internals
from tf_adaptive_scale import validation

JSON_LINES_FILE = "scale_monitor.jsonl"
# What the last report had seen: batches of this fit, the optimizer's counts.
_NOTHING_REPORTED = {"batch": 0, "total": 0, "skipped": 0, "clipped": 0, "measurements": 0}


def float16_fractions(histogram, log2_scale):
    """Fractions of a histogram's values that underflow and overflow float16
    once multiplied by `2**log2_scale`.

    Args:
        histogram: Exponent histogram (`gradient_statistics` bins).
        log2_scale: Exponent of the scale the values are held at.

    Returns:
        A tuple of floats `(underflow, overflow)`; zeros for an empty one.
    """
    histogram = np.asarray(histogram, np.float64)
    total = histogram.sum()
    if total == 0:
        return 0.0, 0.0
    exponents = np.arange(histogram.size) + stats.EXPONENT_MIN + log2_scale
    under = histogram[exponents < float16.SUBNORMAL_EXPONENT].sum() / total
    over = histogram[exponents >= float16.OVERFLOW_EXPONENT].sum() / total
    return float(under), float(over)


def scale_window(layer, underflow_rate):
    """The window of scale exponents a layer's gradients fit in float16.

    Read from a measurement (`LayerStatistics`) taken at the layer's scale:
    `high` from its highest occupied exponent bin (whose values may reach
    twice the bin's lower edge), `low` from its histogram as the adaptive
    rule reads it. Where more than `underflow_rate` of its values are zero
    and its histogram runs into float16's lowest binade at its scale (the
    values went on below and were lost), the histogram cannot say how far
    they went: `low` is then estimated as for normally distributed values
    of the layer's gradient norm (whose `underflow_rate` quantile is
    `underflow_rate * sigma * sqrt(pi / 2)`), and is at least one above the
    layer's scale. Gradients are heavier-tailed towards zero than normal
    values, so the estimate errs low. Zeros with no such edge (dead units,
    unused rows) are not underflow and are left out.

    Args:
        layer: A `LayerStatistics`.
        underflow_rate: Largest tolerated fraction of underflowing values.

    Returns:
        A tuple `(low, high, extrapolated)`: `2**low` is the smallest
        power-of-two scale at which at most `underflow_rate` of the values
        underflow, `2**high` the largest at which none can overflow; or None
        for a layer with no nonzero value.
    """
    histogram = np.asarray(layer.histogram, np.float64)
    occupied = np.flatnonzero(histogram)
    if occupied.size == 0:
        return None
    high = float(float16.OVERFLOW_EXPONENT - 2 - (occupied[-1] + stats.EXPONENT_MIN))
    edge = float16.SUBNORMAL_EXPONENT - round(layer.log2_scale) - stats.EXPONENT_MIN
    at_edge = histogram[edge] if 0 <= edge < histogram.size else 0.0
    lost = layer.zeros - underflow_rate * (histogram.sum() + layer.zeros)
    if lost > 0 and at_edge > underflow_rate * histogram.sum():
        sigma = layer.norm / math.sqrt(histogram.sum() + layer.zeros)
        quantile = underflow_rate * sigma * math.sqrt(math.pi / 2)
        low = math.ceil(float16.SUBNORMAL_EXPONENT - math.log2(quantile))
        return float(max(low, round(layer.log2_scale) + 1)), high, True
    low, _ = stats.scale_bounds(histogram, 1.0, underflow_rate)
    return float(low), high, False


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class ScaleMonitor(keras.callbacks.Callback):
    """Logs the loss scale and per-layer gradients, and warns of trouble.

    Every `every_n_steps` (and at each epoch's end) it reads what the
    `AdaptiveLossScaleOptimizer` measured on its last measured step and:
    adds scalar keys to `logs` (`scale/loss_scale`, `scale/skipped_steps`,
    `scale/skipped_since_last`, `scale/grad_norm`, `scale/clip_rate`, and
    per layer `layer/<name>/grad_norm`, `.../scale`, `.../underflow`,
    `.../overflow`), so `History`, `CSVLogger` and callbacks after it see
    them; writes them, with each layer's gradient-exponent histogram, to
    TensorBoard in `log_dir`; appends a JSON line to
    `log_dir/scale_monitor.jsonl` (`tas.plot_report(log_dir, out_dir)`
    draws it). Records are numbered by the optimizer's own step counter
    (applied and skipped steps; with accumulation, windows), so a run
    resumed from a checkpoint or `BackupAndRestore` continues its log where
    the restored state is, and nothing is ever truncated. Without float16
    scaling (bfloat16, float32) underflow and overflow are left out.

    Diagnosis, on each new measurement, warns once per layer and kind:
    vanishing gradients (a layer's norm below `vanishing_ratio` times the
    largest layer norm for `patience` measurements, or fallen
    `vanishing_orders` orders of magnitude within `window`), exploding ones
    (log10 norm `exploding_zscore` standard deviations and a factor
    `exploding_factor` above its recent history), layers whose gradient is
    always zero, persistent underflow (above `underflow_warning` for
    `patience` measurements) and runs of `skipped_run` skipped steps between
    two reports. In float16 it also reads each layer's window of scales from
    its histogram (the scales at which at most `window_underflow` of its
    values underflow and none overflows; each record keeps it as `window`):
    a layer whose window is empty spans more than float16 holds, which no
    scale fixes; with one global scale, a layer whose window starts above
    another's end means that no single scale fits the model, and the flag
    names both and says that `tas.instrument(model)` gives each its own.
    Layers whose weights are float16 or bfloat16 are flagged as precision
    limited: their gradients are summed in that precision, which no scale
    fixes. `flags` keeps them; training's end prints a summary. When
    the optimizer has skipped `max_consecutive_skips` steps in a row, it
    stops `fit` cleanly (like `keras.callbacks.TerminateOnNaN`) and keeps the
    `SkippedStepsError` in `stop_error`. A report after a step whose loss
    was not finite says where the forward pass stopped being finite: given
    a batch of inputs `probe`, it runs it through the model call by call
    (`tas.first_non_finite_layer`, eagerly, once per run of such reports),
    in training mode as the step ran it (dropout, batch statistics; up to 3
    runs with new dropout draws, no state changed), and names the first
    layer whose output is not finite from finite inputs, which no loss
    scale fixes (custom loops: `monitor.set_model(model)`).

    Args:
        every_n_steps: Steps between two reports.
        log_dir: Optional directory for TensorBoard events (TensorFlow
            backend) and JSON lines.
        json_lines: Write `scale_monitor.jsonl` into `log_dir`.
        optimizer: The optimizer, for custom loops (`model.fit` uses the
            model's).
        per_layer_logs: Add the per-layer keys to `logs`.
        window: Measurements of history per layer.
        patience: Consecutive measurements before a lasting condition warns.
        vanishing_ratio: See above.
        vanishing_orders: See above.
        exploding_zscore: See above.
        exploding_factor: See above.
        underflow_warning: See above.
        skipped_run: See above.
        window_underflow: The underflow tolerated in a layer's window (see
            above); None: the optimizer's `underflow_rate`.
        probe: Optional batch of the model's inputs for the forward check
            (see above); not saved in `get_config`.
        verbose: 0 to print nothing at the end of training.

    Example:

    >>> monitor = tas.ScaleMonitor(every_n_steps=100, log_dir="logs")
    >>> model.fit(x, y, callbacks=[monitor])
    >>> monitor.flags  # what the diagnosis found
    """

    def __init__(
        self,
        every_n_steps=100,
        log_dir=None,
        json_lines=True,
        optimizer=None,
        per_layer_logs=True,
        window=20,
        patience=3,
        vanishing_ratio=1e-6,
        vanishing_orders=4.0,
        exploding_zscore=6.0,
        exploding_factor=10.0,
        underflow_warning=0.05,
        skipped_run=5,
        window_underflow=None,
        probe=None,
        verbose=1,
    ):
        super().__init__()
        self.every_n_steps = validation.positive_int("every_n_steps", every_n_steps)
        self.log_dir = _directory("log_dir", log_dir)
        self.json_lines = validation.boolean("json_lines", json_lines)
        self.per_layer_logs = validation.boolean("per_layer_logs", per_layer_logs)
        self.window = validation.positive_int("window", window)
        self.patience = validation.positive_int("patience", patience)
        self.vanishing_ratio = validation.positive_float("vanishing_ratio", vanishing_ratio)
        self.vanishing_orders = validation.positive_float("vanishing_orders", vanishing_orders)
        self.exploding_zscore = validation.positive_float("exploding_zscore", exploding_zscore)
        self.exploding_factor = validation.positive_float("exploding_factor", exploding_factor)
        self.underflow_warning = validation.positive_float(
            "underflow_warning", underflow_warning
        )
        self.skipped_run = validation.positive_int("skipped_run", skipped_run)
        self.window_underflow = None if window_underflow is None else (
            validation.open_unit_interval("window_underflow", window_underflow))
        self.probe = probe
        self.verbose = verbose
        self._optimizer = _adaptive("`optimizer`", optimizer) if optimizer is not None else None
        self.stop_error = None
        self.flags = []
        self.records = []
        self._history = collections.defaultdict(
            lambda: collections.deque(maxlen=self.window)
        )
        self._streaks = collections.Counter()
        self._flagged = set()
        self._writer = None
        self._last = dict(_NOTHING_REPORTED)
        self._loss_was_finite = True
        self._steps_before_epoch = 0
        self._step = 0

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
        self._step = self._steps_before_epoch = 0
        self._last = dict(_NOTHING_REPORTED)
        self._loss_was_finite = True
        if optimizer.built:  # a resumed run: its counts so far are not news
            self._note(optimizer.read())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, `batch` is the execution's last step.
        self._step = self._steps_before_epoch + batch + 1
        if self._step - self._last["batch"] >= self.every_n_steps:
            self._report(logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._step > self._last["batch"]:
            self._report(logs)
        elif logs is not None and self.records:
            logs.update(self._flat(self.records[-1]))
        self._steps_before_epoch = self._step

    def on_train_end(self, logs=None):
        if self.verbose:
            print(self.summary())
        if self._writer is not None:
            self._writer.flush()

    def _report(self, logs):
        loss = None if logs is None else logs.get("loss")
        record = self._read(None, loss, getattr(self, "_epoch", 0))
        record["interval_loss"] = self._interval_loss(loss)
        self._keep(record)
        self._last["batch"] = self._step
        if logs is not None:
            logs.update(self._flat(record))

    def _interval_loss(self, loss):
        """The mean loss of the batches since the last report, from Keras's
        running mean over the epoch so far (which jumps at every epoch)."""
        if loss is None:
            return None
        done = self._step - self._steps_before_epoch  # batches of this epoch
        before = max(self._last["batch"] - self._steps_before_epoch, 0)
        # The last report, of this epoch, holds the running mean then.
        mean_before = self.records[-1]["loss"] if before else 0.0
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
        record = self._read(step, loss, epoch)
        self._keep(record)
        return record

    def _read(self, step, loss, epoch):
        """The report of the optimizer's state now, diagnosed."""
        opt = self.optimizer
        reading = opt.read()
        flagged_before = len(self.flags)
        # Rates per optimizer step (with accumulation, per window).
        steps = max(reading.total_steps - self._last["total"], 1)
        record = {
            "step": int(reading.total_steps if step is None else step),
            "epoch": int(epoch),
            "scaling": None if opt.policy is None else opt.policy.name,
            "loss": None if loss is None else float(loss),
            "loss_scale": reading.loss_scale,
            "skipped_steps": reading.skipped_steps,
            "skipped_since_last": reading.skipped_steps - self._last["skipped"],
            "loss_finite": reading.loss_finite,
            "grad_norm": reading.gradient_norm,
            "clip_rate": (reading.clipped_steps - self._last["clipped"]) / steps,
            "measured_step": reading.measured_step,
            "exponent_min": stats.EXPONENT_MIN,
            "layers": {},
        }
        rate = self._window_rate()
        for name, layer in reading.layers.items():
            entry = {
                "grad_norm": layer.norm,
                "scale": 2.0**layer.log2_scale,
                "histogram": layer.histogram.tolist(),
                "zeros": layer.zeros,
            }
            if reading.in_float16:
                entry["underflow"], entry["overflow"] = float16_fractions(
                    layer.histogram, layer.log2_scale
                )
                window = scale_window(layer, rate)
                if window is not None:
                    entry["window"] = list(window)
            record["layers"][name] = entry
        self._check_progress(opt, record)
        new_measurement = reading.measurements > self._last["measurements"]
        self._note(reading)
        self._diagnose(record, new_measurement)
        # What this report flagged, for the pictures' markers.
        record["flags"] = [{"kind": f["kind"], "layer": f["layer"]}
                           for f in self.flags[flagged_before:]]
        return record

    def _note(self, reading):
        """The optimizer's counts that the next report is relative to."""
        self._last.update(total=reading.total_steps, skipped=reading.skipped_steps,
                          clipped=reading.clipped_steps, measurements=reading.measurements)

    def _keep(self, record):
        self.records.append(record)
        self._write(record)

    def _check_progress(self, opt, record):
        """Stops `fit` (like TerminateOnNaN) once the optimizer has skipped
        `max_consecutive_skips` steps in a row."""
        try:
            opt.check_progress()
        except RuntimeError as error:
            self.stop_error = error
            self._flag(record, "(all)", "stalled", str(error))
            if self.model is not None:
                self.model.stop_training = True

    def _flat(self, record):
        keys = {
            "scale/loss_scale": record["loss_scale"],
            "scale/skipped_steps": record["skipped_steps"],
            "scale/skipped_since_last": record["skipped_since_last"],
            "scale/grad_norm": record["grad_norm"],
            "scale/clip_rate": record["clip_rate"],
        }
        if self.per_layer_logs:
            for name, entry in record["layers"].items():
                for key, value in entry.items():
                    if key not in ("histogram", "window"):  # scalars only
                        keys[f"layer/{name}/{key}"] = value
        return keys

    def _write(self, record):
        if self.log_dir is None:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        if self.json_lines:
            # Appended: a resumed run continues the records of the one before.
            with open(os.path.join(self.log_dir, JSON_LINES_FILE), "a") as f:
                f.write(json.dumps(record) + "\n")
        if self._writer is None:
            self._writer = _event_writer(self.log_dir)
        scalars = self._flat(record)
        if not self.per_layer_logs:
            for name, entry in record["layers"].items():
                scalars[f"layer/{name}/grad_norm"] = entry["grad_norm"]
        self._writer.write(
            record["step"],
            scalars,
            {f"layer/{name}/exponents": entry["histogram"]
             for name, entry in record["layers"].items()},
        )

    def _flag(self, record, layer, kind, message):
        if (layer, kind) in self._flagged:
            return
        self._flagged.add((layer, kind))
        message = f"Step {record['step']}: layer '{layer}': {message}"
        self.flags.append({"step": record["step"], "layer": layer, "kind": kind,
                           "message": message})
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _diagnose(self, record, new_measurement):
        if record["skipped_since_last"] >= self.skipped_run:
            self._flag(record, "(all)", "skipped",
                       f"{record['skipped_since_last']} steps skipped since the last "
                       "report (non-finite gradients or loss)")
            self._flagged.discard(("(all)", "skipped"))  # every run is news
        # Searched once per run of reports with a non-finite loss, not at
        # each (the probe's forward pass runs eagerly).
        if not record["loss_finite"] and self._loss_was_finite:
            self._flag(record, *self._forward_check())
        self._loss_was_finite = record["loss_finite"]
        if not new_measurement:
            return  # the same statistics as last time
        self._diagnose_windows(record)
        self._diagnose_precision(record)
        layers = record["layers"]
        largest = max((e["grad_norm"] for e in layers.values()), default=0.0)
        for name, entry in layers.items():
            norm = entry["grad_norm"]
            history = self._history[name]
            streak = lambda kind, hit: self._count(name, kind, hit)  # noqa: E731
            if streak("zero", norm == 0.0) >= self.patience:
                self._flag(record, name, "never_updates",
                           f"its gradient has been exactly zero for {self.patience} "
                           "measurements: it does not learn (disconnected, dead "
                           "units, or everything underflowed)")
            if norm > 0:
                level = math.log10(norm)
                if streak("small", norm < self.vanishing_ratio * largest) >= self.patience:
                    self._flag(record, name, "vanishing",
                               f"gradient norm {norm:.3g} is below {self.vanishing_ratio:g} "
                               f"times the largest layer's ({largest:.3g})")
                if history and max(history) - level >= self.vanishing_orders:
                    self._flag(record, name, "vanishing",
                               f"gradient norm fell {max(history) - level:.1f} orders of "
                               f"magnitude within {len(history)} measurements, to {norm:.3g}")
                if len(history) >= 5:
                    mean, std = np.mean(history), max(np.std(history), 0.1)
                    if ((level - mean) / std >= self.exploding_zscore
                            and level - np.median(history) >= math.log10(self.exploding_factor)):
                        self._flag(record, name, "exploding",
                                   f"gradient norm {norm:.3g} is {(level - mean) / std:.1f} "
                                   "standard deviations (log10) above its recent history")
                history.append(level)
            underflow = entry.get("underflow", 0.0)
            if streak("underflow", underflow > self.underflow_warning) >= self.patience:
                self._flag(record, name, "underflow",
                           f"{100 * underflow:.1f}% of its gradient values underflow "
                           f"float16 at its scale 2**{math.log2(entry['scale']):g}")

    def _window_rate(self):
        """The underflow a layer's window tolerates."""
        return self.window_underflow or self.optimizer.underflow_rate

    def _diagnose_windows(self, record):
        """The layers that no scale fits, and, with one global scale, two
        layers that no single scale fits together."""
        rate = self._window_rate()
        windows = {n: e["window"] for n, e in record["layers"].items() if "window" in e}
        for name, (low, high, extrapolated) in windows.items():
            if low > high and not extrapolated:
                self._flag(record, name, "beyond_float16",
                           f"its gradients span more than float16 holds: keeping "
                           f"underflow under {rate:.2%} needs a scale of 2**{low:g} or more, "
                           f"and its largest values overflow above 2**{high:g}; no loss "
                           "scale fixes that: compute it in float32 or train in bfloat16")
        policy = self.optimizer.policy
        if not windows or policy is None or policy.per_layer:
            return
        needy = max(windows, key=lambda n: windows[n][0])
        low, high = windows[needy][0], min(w[1] for w in windows.values())
        tight = " and ".join(f"'{n}'" for n, w in windows.items() if w[1] == high)
        if windows[needy][1] > high and low > high:
            entry = record["layers"][needy]
            zeros = entry["zeros"] / (entry["zeros"] + sum(entry["histogram"]))
            self._flag(record, "(all)", "no_single_scale",
                       f"no single scale fits: '{needy}' needs 2**{low:g} or more to keep "
                       f"underflow under {rate:.2%} ({zeros:.1%} of its gradient values are "
                       f"zero at 2**{math.log2(entry['scale']):g}), and {tight} "
                       f"overflow{'s' if ' and ' not in tight else ''} above 2**{high:g}; "
                       "tas.instrument(model) gives each layer its own scale")

    def _diagnose_precision(self, record):
        """Layers whose weights are half precision: their gradients are
        summed, and their updates applied, at that precision, a loss that
        grows with the terms summed and that no loss scale changes
        (`tests/test_monitor.py` measures it against float64)."""
        opt = self.optimizer
        for variable, scale in zip(keras_internals.built_variables(opt), opt.gradient_scales()):
            dtype = keras.backend.standardize_dtype(variable.dtype)
            if scale is not None and dtype in ("float16", "bfloat16"):
                self._flag(record, scale[0], "precision_limited",
                           f"its weights are {dtype}, so their gradient is summed and their "
                           f"update applied in {dtype}, whose rounding grows with the terms "
                           "summed (a float16 embedding table's gradient over 2**14 tokens "
                           "loses 0.6% at every loss scale); no loss scale fixes that: keep "
                           "the weights in float32, as the 'mixed_float16' policy does "
                           "(a layer built with dtype='float16' does not)")

    def _forward_check(self):
        """`(layer, kind, message)` on a step whose loss was not finite."""
        found = None
        if self.probe is not None and self.model is not None:
            found = forward_check.first_non_finite_layer(self.model, self.probe)
        if found is not None:
            layer, dtype = found
            return layer, "forward_overflow", (
                f"its {dtype} output is not finite from finite inputs, so the loss "
                "was not finite; no loss scale fixes that: compute this layer in "
                "float32 (`dtype='float32'`) or train in bfloat16 ('mixed_bfloat16')"
            )
        why = ("and the probe's forward pass, in training mode, is finite: bad data?"
               if self.probe is not None
               else "(bad data, or a forward pass that overflows float16: "
                    "ScaleMonitor(probe=x_batch) names the layer)")
        return "(all)", "loss_not_finite", f"the loss was not finite {why}"

    def _count(self, layer, kind, hit):
        key = (layer, kind)
        self._streaks[key] = self._streaks[key] + 1 if hit else 0
        return self._streaks[key]

    def summary(self):
        """A short text: final scales, skipped steps, flagged layers."""
        if not self.records:
            return "ScaleMonitor: nothing recorded."
        last = self.records[-1]
        lines = [
            f"ScaleMonitor summary at step {last['step']}: loss scale "
            f"2**{math.log2(last['loss_scale']):g}, {last['skipped_steps']} skipped steps, "
            f"gradient norm {last['grad_norm']:.3g}."
        ]
        scales = {e["scale"] for e in last["layers"].values()}
        if len(scales) > 1:
            lines.append("Layer scales: " + ", ".join(
                f"{n} 2**{math.log2(e['scale']):g}" for n, e in last["layers"].items()))
        if self.flags:
            lines.append("Flagged:")
            lines += [f"  {f['message']}" for f in self.flags]
        else:
            lines.append("No layer flagged.")
        return "\n".join(lines)

    def get_config(self):
        return {
            "every_n_steps": self.every_n_steps,
            "log_dir": self.log_dir,
            "json_lines": self.json_lines,
            "per_layer_logs": self.per_layer_logs,
            "window": self.window,
            "patience": self.patience,
            "vanishing_ratio": self.vanishing_ratio,
            "vanishing_orders": self.vanishing_orders,
            "exploding_zscore": self.exploding_zscore,
            "exploding_factor": self.exploding_factor,
            "underflow_warning": self.underflow_warning,
            "skipped_run": self.skipped_run,
            "window_underflow": self.window_underflow,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


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
    from tf_adaptive_scale.optimizer import AdaptiveLossScaleOptimizer

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
    from tf_adaptive_scale import tensorboard_events

    return tensorboard_events.EventWriter(log_dir)


class _NoEvents:
    """The event writer where TensorBoard's needs TensorFlow."""

    def write(self, step, scalars, histograms):
        pass

    def flush(self):
        pass
