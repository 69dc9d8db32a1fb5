"""The monitor's diagnoses: pure functions of what a report saw.

A diagnosis reads an `Observation` (the report's `monitor_log.LogRecord`,
what the reports before left in `Memory`, the thresholds in `Settings`) and
yields `Flag`s. `diagnose` runs them in their lists' order and keeps the
first flag of each layer and kind. A new diagnosis is a function and a line
in `EVERY_REPORT`, `EACH_MEASUREMENT` or `EACH_LAYER`.
"""

import dataclasses
import math
import textwrap
import typing

import numpy as np

from tf_adaptive_scale.numerics import validation

# The layer of a flag about the whole model.
ALL = "(all)"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The diagnoses' thresholds, checked.

    Example:

    >>> Settings(patience=2).patience
    2
    """

    window: int = validation.setting(
        20, validation.positive_int, "Measurements of history per layer.")
    patience: int = validation.setting(3, validation.positive_int, (
        "Consecutive measurements before a lasting condition warns."))
    vanishing_ratio: float = validation.setting(1e-6, validation.positive_float, (
        "A layer's gradient norm below this times the largest layer's, for "
        "`patience` measurements, is vanishing."))
    vanishing_orders: float = validation.setting(4.0, validation.positive_float, (
        "So is a norm fallen this many orders of magnitude within `window`."))
    exploding_zscore: float = validation.setting(6.0, validation.positive_float, (
        "A log10 norm this many standard deviations above its recent history "
        "(and `exploding_factor` times its median) is exploding."))
    exploding_factor: float = validation.setting(10.0, validation.positive_float, (
        "See `exploding_zscore`."))
    underflow_warning: float = validation.setting(0.05, validation.positive_float, (
        "Underflow above this, for `patience` measurements, warns."))
    skipped_run: int = validation.setting(5, validation.positive_int, (
        "Skipped steps between two reports that warn."))
    window_underflow: object = validation.setting(
        None, validation.optional(validation.open_unit_interval), (
        "The underflow a layer's window of scales tolerates (None: the "
        "optimizer's `underflow_rate`)."))
    exploding_history: int = validation.setting(5, validation.positive_int, (
        "Fewest measurements of history before a norm can explode."), argument=False)
    exploding_spread: float = validation.setting(0.1, validation.positive_float, (
        "Least standard deviation (log10) of that history."), argument=False)

    def __post_init__(self):
        validation.check_fields(self)

    def get_config(self):
        """Every setting, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


ARGUMENTS = tuple(f.name for f in dataclasses.fields(Settings) if f.metadata.get("argument", True))


def args_doc(indent):
    """The `Args:` entries of the monitor's thresholds (`ARGUMENTS`), Keras
    style, each line indented by `indent` spaces."""
    return "\n".join(
        textwrap.fill(f"{f.name}: {f.metadata['doc']}", 72 + indent,
                      initial_indent=" " * indent, subsequent_indent=" " * (indent + 4))
        for f in dataclasses.fields(Settings) if f.metadata.get("argument", True))


class Flag(typing.NamedTuple):
    """What a diagnosis found: the layer (or `ALL`), its kind, a message
    and, for one of the measured figures, the step they were measured at
    (`LogRecord.measured_step`; set by `diagnose`)."""

    layer: str
    kind: str
    message: str
    measured_step: typing.Optional[int] = None


class Memory(typing.NamedTuple):
    """What the diagnoses keep between reports (`diagnose` returns the next).

    Attributes:
        flagged: `(layer, kind)` already flagged.
        streaks: `{(layer, condition): n}`: for `n` measurements in a row
            the `CONDITIONS` entry held.
        levels: `{layer: log10 gradient norms}` of its last `window`
            measurements with a nonzero gradient, oldest first.
        loss_finite: Whether the last report's loss was finite.
    """

    flagged: frozenset = frozenset()
    streaks: typing.Mapping = {}
    levels: typing.Mapping = {}
    loss_finite: bool = True


class Observation(typing.NamedTuple):
    """What a diagnosis reads.

    Attributes:
        record: The report's `monitor_log.LogRecord`.
        new_measurement: Whether its statistics are new since the last report.
        settings: The `Settings`.
        underflow_rate: The underflow a layer's window tolerates.
        weight_dtypes: `(layer, dtype)` of each measured variable.
        stall: The optimizer's stalled-training message, or None.
        probe: None without a probe; else a function giving the first
            layer whose output is not finite, `(name, dtype)`, or None.
        past: The `Memory` of the reports before.
        now: The `Memory` with this report in (set by `diagnose`).
    """

    record: typing.Any
    new_measurement: bool
    settings: Settings
    underflow_rate: float
    weight_dtypes: tuple = ()
    stall: typing.Optional[str] = None
    probe: typing.Optional[typing.Callable] = None
    past: Memory = Memory()
    now: Memory = Memory()

    def streak(self, layer, condition):
        """Measurements in a row, this one included, that `condition` held."""
        return self.now.streaks.get((layer, condition), 0)


def largest_norm(record):
    """The largest layer gradient norm of a record (0 without layers)."""
    return max((layer.grad_norm for layer in record.layers.values()), default=0.0)


# Conditions counted per layer over consecutive measurements, of the layer's
# `LayerRecord`, the record's largest norm and the settings: True counts,
# False resets, None (not judged) keeps the count.
CONDITIONS = {
    # Exact: a measured norm is 0 only where the gradient's exact peak is
    # (a layer whose sample saw none of its nonzero values is unmeasured,
    # not reported: `measurement.layers`).
    "zero": lambda layer, largest, settings: layer.grad_norm == 0.0,
    "small": lambda layer, largest, settings: (
        layer.grad_norm < settings.vanishing_ratio * largest if layer.grad_norm > 0 else None),
    "underflow": lambda layer, largest, settings: (
        (layer.underflow or 0.0) > settings.underflow_warning),
}


def remember(memory, record, new_measurement, settings):
    """The `Memory` after a report: on a new measurement, each layer's
    streaks and levels."""
    memory = memory._replace(loss_finite=record.loss_finite)
    if not new_measurement:
        return memory
    streaks, levels, largest = dict(memory.streaks), dict(memory.levels), largest_norm(record)
    for name, layer in record.layers.items():
        for condition, holds in CONDITIONS.items():
            hit = holds(layer, largest, settings)
            if hit is not None:
                streaks[(name, condition)] = streaks.get((name, condition), 0) + 1 if hit else 0
        if layer.grad_norm > 0:
            levels[name] = (*levels.get(name, ()), math.log10(layer.grad_norm))[-settings.window:]
    return memory._replace(streaks=streaks, levels=levels)


# On every report.


def stalled(obs):
    if obs.stall is not None:
        yield Flag(ALL, "stalled", obs.stall)


def skipped_run(obs):
    skipped = obs.record.skipped_since_last
    if skipped >= obs.settings.skipped_run:
        yield Flag(ALL, "skipped", f"{skipped} steps skipped since the last report "
                                   "(non-finite gradients or loss)")


def non_finite_loss(obs):
    """Where the forward pass stopped being finite: searched once per run of
    reports with a non-finite loss (the probe runs eagerly)."""
    if obs.record.loss_finite or not obs.past.loss_finite:
        return
    found = None if obs.probe is None else obs.probe()
    if found is not None:
        layer, dtype = found
        yield Flag(layer, "forward_overflow", (
            f"its {dtype} output is not finite from finite inputs, so the loss "
            "was not finite; no loss scale fixes that: compute this layer in "
            "float32 (`dtype='float32'`) or train in bfloat16 ('mixed_bfloat16')"))
        return
    why = ("and the probe's forward pass, in training mode, is finite: bad data?"
           if obs.probe is not None
           else "(bad data, or a forward pass that overflows float16: "
                "ScaleMonitor(probe=x_batch) names the layer)")
    yield Flag(ALL, "loss_not_finite", f"the loss was not finite {why}")


# On a new measurement.


def _windows(record):
    return {name: layer.window for name, layer in record.layers.items()
            if layer.window is not None}


def beyond_float16(obs):
    """Layers that no scale fits: their own window is empty."""
    for name, (low, high, extrapolated) in _windows(obs.record).items():
        if low > high and not extrapolated:
            yield Flag(name, "beyond_float16", (
                f"its gradients span more than float16 holds: keeping "
                f"underflow under {obs.underflow_rate:.2%} needs a scale of 2**{low:g} or "
                f"more, and its largest values overflow above 2**{high:g}; no loss "
                "scale fixes that: compute it in float32 or train in bfloat16"))


def no_single_scale(obs):
    """With one global scale, the layer that needs the most lies above the
    end of another's window."""
    windows = _windows(obs.record)
    if not windows or not obs.record.global_scale:
        return
    needy = max(windows, key=lambda n: windows[n][0])
    low, high = windows[needy][0], min(w[1] for w in windows.values())
    tight = " and ".join(f"'{n}'" for n, w in windows.items() if w[1] == high)
    if windows[needy][1] > high and low > high:
        layer = obs.record.layers[needy]
        zeros = layer.zeros / (layer.zeros + sum(layer.histogram))
        yield Flag(ALL, "no_single_scale", (
            f"no single scale fits: '{needy}' needs 2**{low:g} or more to keep "
            f"underflow under {obs.underflow_rate:.2%} ({zeros:.1%} of its gradient values "
            f"are zero at 2**{math.log2(layer.scale):g}), and {tight} "
            f"overflow{'s' if ' and ' not in tight else ''} above 2**{high:g}; "
            "tas.instrument(model) gives each layer its own scale"))


def precision_limited(obs):
    """Layers whose weights are half precision: their gradients are summed,
    and their updates applied, at that precision (`tests/test_monitor.py`
    measures it against float64)."""
    for layer, dtype in obs.weight_dtypes:
        if dtype in ("float16", "bfloat16"):
            yield Flag(layer, "precision_limited", (
                f"its weights are {dtype}, so their gradient is summed and their "
                f"update applied in {dtype}, whose rounding grows with the terms "
                "summed (a float16 embedding table's gradient over 2**14 tokens "
                "loses 0.6% at every loss scale); no loss scale fixes that: keep "
                "the weights in float32, as the 'mixed_float16' policy does "
                "(a layer built with dtype='float16' does not)"))


# On a new measurement, for each layer.


def never_updates(obs, name):
    if obs.streak(name, "zero") >= obs.settings.patience:
        yield Flag(name, "never_updates", (
            f"its gradient has been exactly zero for {obs.settings.patience} "
            "measurements: it does not learn (disconnected, dead units, or "
            "everything underflowed)"))


def vanishing_against_largest(obs, name):
    norm, settings = obs.record.layers[name].grad_norm, obs.settings
    if norm > 0 and obs.streak(name, "small") >= settings.patience:
        yield Flag(name, "vanishing", (
            f"gradient norm {norm:.3g} is below {settings.vanishing_ratio:g} "
            f"times the largest layer's ({largest_norm(obs.record):.3g})"))


def vanishing_fall(obs, name):
    norm, history = obs.record.layers[name].grad_norm, obs.past.levels.get(name, ())
    if norm > 0 and history and max(history) - math.log10(norm) >= obs.settings.vanishing_orders:
        yield Flag(name, "vanishing", (
            f"gradient norm fell {max(history) - math.log10(norm):.1f} orders of "
            f"magnitude within {len(history)} measurements, to {norm:.3g}"))


def exploding(obs, name):
    norm, history = obs.record.layers[name].grad_norm, obs.past.levels.get(name, ())
    settings = obs.settings
    if not norm > 0 or len(history) < settings.exploding_history:
        return
    level, mean = math.log10(norm), np.mean(history)
    zscore = (level - mean) / max(np.std(history), settings.exploding_spread)
    if (zscore >= settings.exploding_zscore
            and level - np.median(history) >= math.log10(settings.exploding_factor)):
        yield Flag(name, "exploding", (
            f"gradient norm {norm:.3g} is {zscore:.1f} standard deviations (log10) "
            "above its recent history"))


def underflow(obs, name):
    layer = obs.record.layers[name]
    if obs.streak(name, "underflow") >= obs.settings.patience:
        yield Flag(name, "underflow", (
            f"{100 * layer.underflow:.1f}% of its gradient values underflow "
            f"float16 at its scale 2**{math.log2(layer.scale):g}"))


EVERY_REPORT = (stalled, skipped_run, non_finite_loss)
EACH_MEASUREMENT = (beyond_float16, no_single_scale, precision_limited)
EACH_LAYER = (never_updates, vanishing_against_largest, vanishing_fall, exploding, underflow)
# The diagnoses of the measured figures: their flags carry its step.
OF_MEASURED_FIGURES = frozenset({beyond_float16, no_single_scale, *EACH_LAYER})
# Kinds flagged every time they are found, not once: each run is news.
REPEATED = frozenset({"skipped"})


def diagnose(obs):
    """Runs the diagnoses on an observation.

    Args:
        obs: An `Observation` (its `past`, the last call's memory).

    Returns:
        A tuple `(flags, memory)`: the new `Flag`s, in order, each
        `(layer, kind)` once (but `REPEATED` kinds); the next `Memory`.

    Example:

    >>> flags, memory = diagnose(Observation(record, True, Settings(), 1e-3))
    """
    obs = obs._replace(now=remember(obs.past, obs.record, obs.new_measurement, obs.settings))
    found = [flag for diagnosis in EVERY_REPORT for flag in diagnosis(obs)]
    if obs.new_measurement:
        found += [_measured(flag, diagnosis, obs) for diagnosis in EACH_MEASUREMENT
                  for flag in diagnosis(obs)]
        found += [_measured(flag, diagnosis, obs) for name in obs.record.layers
                  for diagnosis in EACH_LAYER for flag in diagnosis(obs, name)]
    flags, flagged = [], set(obs.past.flagged)
    for flag in found:
        if (flag.layer, flag.kind) not in flagged:
            flags.append(flag)
            if flag.kind not in REPEATED:
                flagged.add((flag.layer, flag.kind))
    return flags, obs.now._replace(flagged=frozenset(flagged))


def _measured(flag, diagnosis, obs):
    """`flag`, with the measured step where `diagnosis` reads the measured figures."""
    if diagnosis not in OF_MEASURED_FIGURES:
        return flag
    return flag._replace(measured_step=obs.record.measured_step)
