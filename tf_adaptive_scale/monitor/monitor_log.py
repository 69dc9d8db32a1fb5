"""The monitor's log record: one typed record, written and read here.

`tas.ScaleMonitor` makes a `LogRecord` per report and writes its JSON form
(`to_json`, a line of `FILE_NAME` in its `log_dir`); `tas.plot_report`
reads the lines back (`read_lines`, `LogRecord.from_json`). The logs'
keys (`scalars`) and the end-of-training text (`summary`) come from it too.

A record holds two kinds of figures: those read at the report (the scales,
the step counts) and those of the optimizer's last measured step
(`measured_step`; gradient norms, zeros, underflow, histograms), which it
takes every `update_every` steps. Reports between two measurements carry
the same measured figures: `new_measurement` marks the first report of each,
and `scalars` gives NaN for them where they are not news.
"""

import dataclasses
import json
import math
import os
import typing
import warnings

from tf_adaptive_scale.monitor import float16_analysis
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.rules import scale_policy

FILE_NAME = "scale_monitor.jsonl"


class Counts(typing.NamedTuple):
    """The optimizer's counts that a report's rates are taken since."""

    total_steps: int = 0
    skipped_steps: int = 0
    clipped_steps: int = 0
    measurements: int = 0

    @classmethod
    def of(cls, reading):
        """The counts of a `measurement.Reading`."""
        return cls(reading.total_steps, reading.skipped_steps, reading.clipped_steps,
                   reading.measurements)


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """One layer's entry of a record (None: not recorded; not written).

    Attributes:
        grad_norm: Its gradient norm at the last measured step.
        scale: The scale its gradients carry at the report (the other
            fields are of the last measured step's gradients).
        histogram: Its exponent histogram, a list (bins of
            `gradient_statistics`).
        zeros: Its gradient's exact zeros, a count.
        underflow: In float16, the fraction of its nonzero values that fall
            below float16's smallest subnormal at `scale` (zeros apart).
        overflow: In float16, the fraction that overflows.
        window: In float16, `[low, high, extrapolated]`
            (`float16_analysis.scale_window`).
        zero_fraction: The fraction of its values that are exact zeros (true
            ones, a dead unit's; in float16 also values already lost to
            underflow in the measured step's backward pass: float16 cannot
            tell them apart).
    """

    grad_norm: typing.Optional[float] = None
    scale: typing.Optional[float] = None
    histogram: typing.Optional[list] = None
    zeros: typing.Optional[float] = None
    underflow: typing.Optional[float] = None
    overflow: typing.Optional[float] = None
    window: typing.Optional[list] = None
    zero_fraction: typing.Optional[float] = None

    @classmethod
    def measured(cls, layer, in_float16, underflow_rate):
        """The entry of a `measurement.LayerStatistics`; in float16 with its
        fractions and window (tolerating `underflow_rate`)."""
        values = float(sum(layer.histogram)) + layer.zeros
        entry = cls(layer.norm, 2.0**layer.log2_scale, layer.histogram.tolist(), layer.zeros,
                    zero_fraction=layer.zeros / values if values else 0.0)
        if not in_float16:
            return entry
        underflow, overflow = float16_analysis.float16_fractions(
            layer.histogram, layer.log2_scale)
        window = float16_analysis.scale_window(layer, underflow_rate)
        return dataclasses.replace(entry, underflow=underflow, overflow=overflow,
                                   window=None if window is None else list(window))

    def to_json(self):
        """Its JSON form: the recorded fields, in order."""
        fields = (field.name for field in dataclasses.fields(self))
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}

    def scalars(self):
        """Its scalar fields (the logs' per-layer keys), in order."""
        return {key: value for key, value in self.to_json().items()
                if key not in ("histogram", "window")}


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """A monitor report: a line of the log, a row of the pictures.

    A record read from a log lacking a field has its default.

    Attributes:
        step: The optimizer's step count (or the step `log` was given).
        epoch: The epoch.
        scaling: The optimizer's mode (None: not resolved yet).
        global_scale: Whether one global scale multiplies the loss (not
            per layer, not without scaling): the pictures draw it.
        loss: The loss passed in (in `fit`, Keras's running epoch mean).
        loss_scale: The global loss scale.
        skipped_steps: Steps skipped so far.
        skipped_since_last: Steps skipped since the report before.
        loss_finite: Whether the last step's loss was finite.
        grad_norm: Global norm of the last measured unscaled gradients.
        underflow: In float16, the fraction of all layers' nonzero gradient
            values below float16's smallest subnormal at the scale each
            carries (zeros apart).
        zero_fraction: The fraction of all layers' gradient values that are
            exact zeros.
        clip_rate: Clipped steps per optimizer step since the report before.
        measured_step: The optimizer's `total_steps` at its last measured
            step (counted from 0, so a step measured just before a report at
            step `s` is `s - 1`; -1: none): the step of `grad_norm`,
            `underflow`, `zero_fraction` and the layers' figures but `scale`.
        new_measurement: Whether the measured figures are new since the
            report before (False: the same measurement again).
        exponent_min: The exponent of the histograms' first bin.
        layers: `{layer name: LayerRecord}`.
        flags: `(kind, layer)` of each flag this report raised.
        from_fit: Made in `fit` (it then has an `interval_loss`); not
            written, told by the `interval_loss` key.
        interval_loss: In `fit`, the mean loss of the batches since the
            report before.
        skipped_at: Optional steps that were skipped (other writers' logs).
    """

    step: int
    epoch: int = 0
    scaling: typing.Optional[str] = None
    global_scale: bool = True
    loss: typing.Optional[float] = None
    loss_scale: typing.Optional[float] = None
    skipped_steps: typing.Optional[int] = None
    skipped_since_last: typing.Optional[int] = None
    loss_finite: bool = True
    grad_norm: typing.Optional[float] = None
    underflow: typing.Optional[float] = None
    zero_fraction: typing.Optional[float] = None
    clip_rate: typing.Optional[float] = None
    measured_step: int = -1
    new_measurement: bool = True
    exponent_min: typing.Optional[int] = None
    layers: dict = dataclasses.field(default_factory=dict)
    flags: tuple = ()
    from_fit: bool = False
    interval_loss: typing.Optional[float] = None
    skipped_at: typing.Optional[list] = None

    @classmethod
    def of_reading(cls, reading, since, *, step, epoch, loss, policy, underflow_rate):
        """The record of a `measurement.Reading`.

        Args:
            reading: The optimizer's `read()`.
            since: The `Counts` of the report before (its measurements tell
                whether this one's are new).
            step: The step to record; None: the optimizer's count.
            epoch: The epoch to record.
            loss: The loss to record, or None.
            policy: The optimizer's `scale_policy.Policy`, or None.
            underflow_rate: The underflow a layer's window tolerates.

        Returns:
            A `LogRecord` (without flags).
        """
        layers = {name: LayerRecord.measured(layer, reading.in_float16, underflow_rate)
                  for name, layer in reading.layers.items()}
        return cls(
            step=int(reading.total_steps if step is None else step), epoch=int(epoch),
            scaling=None if policy is None else policy.name,
            global_scale=policy is None or policy.scales_loss,
            loss=None if loss is None else float(loss), loss_scale=reading.loss_scale,
            skipped_steps=reading.skipped_steps,
            skipped_since_last=reading.skipped_steps - since.skipped_steps,
            loss_finite=reading.loss_finite, grad_norm=reading.gradient_norm,
            **_totals(layers.values(), reading.in_float16),
            # Per optimizer step (with accumulation, per window).
            clip_rate=(reading.clipped_steps - since.clipped_steps)
            / max(reading.total_steps - since.total_steps, 1),
            measured_step=reading.measured_step,
            new_measurement=reading.measurements > since.measurements,
            exponent_min=stats.EXPONENT_MIN,
            layers=layers,
        )

    def to_json(self):
        """Its JSON form (a dict, the log line's content)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["layers"] = {name: layer.to_json() for name, layer in self.layers.items()}
        data["flags"] = [{"kind": kind, "layer": layer} for kind, layer in self.flags]
        if not data.pop("from_fit"):
            del data["interval_loss"]
        if self.skipped_at is None:
            del data["skipped_at"]
        if self.underflow is None:  # not float16
            del data["underflow"]
        return data

    @classmethod
    def from_json(cls, data):
        """The record of a JSON form (`to_json`'s, or an older log's)."""
        names = {field.name for field in dataclasses.fields(cls)}
        fields = {key: value for key, value in data.items() if key in names}
        fields["layers"] = {name: LayerRecord(**{k: v for k, v in layer.items()
                                                  if k in LayerRecord.__annotations__})
                            for name, layer in data.get("layers", {}).items()}
        fields["flags"] = tuple((f["kind"], f["layer"]) for f in data.get("flags", []))
        fields["from_fit"] = "interval_loss" in data
        fields["global_scale"] = _global_scale(data)
        return cls(**fields)


def _totals(layers, in_float16):
    """`underflow` (in float16) and `zero_fraction` of the `LayerRecord`s
    taken together."""
    nonzero = [float(sum(layer.histogram)) for layer in layers]
    zeros = sum(layer.zeros for layer in layers)
    values = sum(nonzero) + zeros
    totals = {"zero_fraction": zeros / values if values else 0.0}
    if in_float16:
        lost = sum(n * layer.underflow for n, layer in zip(nonzero, layers))
        totals["underflow"] = lost / sum(nonzero) if sum(nonzero) else 0.0
    return totals


def _global_scale(data):
    """A JSON record's `global_scale`; a log written before records carried
    it tells by its mode's (`scale_policy`) `scales_loss`."""
    if "global_scale" in data:
        return bool(data["global_scale"])
    mode = scale_policy.MODES.get(data.get("scaling"))
    return mode is None or mode.scales_loss


# The keys `tas.ScaleMonitor` puts in `logs` by default: Keras's progress bar
# prints every key of `logs`, so the rest go to `History`, TensorBoard and
# the JSON lines only (`per_layer_logs=True` puts them all in `logs`). Both
# are read at the report: nothing measured.
PROGRESS_KEYS = ("scale/loss_scale", "scale/skipped_steps")
# Per layer, in place of the global scale (1, which reads as "scaling off"):
# the range of the layers' scales.
LAYER_RANGE_KEYS = ("scale/layer_scale_min", "scale/layer_scale_max")


def progress_keys(record):
    """The keys of `logs` by default (`PROGRESS_KEYS`; per layer, the
    layers' range of scales in place of the global scale)."""
    if _per_layer(record):
        return LAYER_RANGE_KEYS + PROGRESS_KEYS[1:]
    return PROGRESS_KEYS


def _per_layer(record):
    mode = scale_policy.MODES.get(record.scaling)
    return mode is not None and mode.per_layer and bool(record.layers)


# The figures of a layer read at the report; its others are measured.
CURRENT_LAYER_FIELDS = ("scale",)
MEASURED_TOTALS = ("scale/grad_norm", "scale/underflow", "scale/zero_fraction")


def measured(key):
    """Whether a key of `scalars` is a figure of the last measured step."""
    if key.startswith("layer/"):
        return key.rsplit("/", 1)[1] not in CURRENT_LAYER_FIELDS
    return key in MEASURED_TOTALS


def scalars(record, per_layer, fresh=True):
    """The keys of a record (`scale/...`; with `per_layer`, also
    `layer/<name>/<field>` of its scalar fields).

    Args:
        record: A `LogRecord`.
        per_layer: Whether to give the per-layer keys too.
        fresh: Whether its measured figures (`measured`) are news where
            the keys go; if not, they are NaN: a report without a new
            measurement shows no old figure as current.

    Returns:
        `{key: value}`.
    """
    keys = {
        "scale/loss_scale": record.loss_scale,
        "scale/skipped_steps": record.skipped_steps,
        "scale/skipped_since_last": record.skipped_since_last,
        "scale/grad_norm": record.grad_norm,
        "scale/clip_rate": record.clip_rate,
        "scale/measured_step": record.measured_step,
    }
    keys.update({f"scale/{name}": value for name, value in (
        ("underflow", record.underflow), ("zero_fraction", record.zero_fraction))
        if value is not None})
    if _per_layer(record):
        scales = [layer.scale for layer in record.layers.values()]
        keys.update(zip(LAYER_RANGE_KEYS, (min(scales), max(scales))))
    if per_layer:
        for name, layer in record.layers.items():
            for key, value in layer.scalars().items():
                keys[f"layer/{name}/{key}"] = value
    if fresh:
        return keys
    return {key: math.nan if measured(key) else value for key, value in keys.items()}


def append(log_dir, record):
    """Appends a record's line to `log_dir`'s log: a resumed run continues
    the records of the one before."""
    with open(os.path.join(log_dir, FILE_NAME), "a") as f:
        f.write(json.dumps(record.to_json()) + "\n")


def read_lines(path):
    """The JSON records of a log (dicts); a cut last line (a run killed
    while writing it) is skipped with a warning, a bad line elsewhere is an
    error."""
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if i + 1 < len(lines):
                raise ValueError(f"{path}, line {number}: not a JSON record ({error})") from None
            warnings.warn(f"{path}, line {number}: skipped a cut last line "
                          "(the run was stopped while writing it)", stacklevel=3)
    return records


def summary(record, flags):
    """The end-of-training text: the last record's scales, skipped steps and
    gradient norm (with the step it was measured at), and the flags'
    messages."""
    if record is None:
        return "ScaleMonitor: nothing recorded."
    gradient = (f"gradient norm {record.grad_norm:.3g}, measured at step {record.measured_step}"
                if record.measured_step >= 0 else "no gradient measured yet")
    lines = [
        f"ScaleMonitor summary at step {record.step}: loss scale "
        f"2**{math.log2(record.loss_scale):g}, {record.skipped_steps} skipped steps; "
        f"{gradient}."
    ]
    if len({layer.scale for layer in record.layers.values()}) > 1:
        lines.append("Layer scales: " + ", ".join(
            f"{name} 2**{math.log2(layer.scale):g}" for name, layer in record.layers.items()))
    if flags:
        lines.append("Flagged:")
        lines += [f"  {flag['message']}" for flag in flags]
    else:
        lines.append("No layer flagged.")
    return "\n".join(lines)
