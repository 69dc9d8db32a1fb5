"""Settings: every argument of `AdaptiveLossScaleOptimizer`, written once.

Each field is an argument with its default and its check; the optimizer's
signature, validation, attributes and `get_config` all come from this record
(and a test holds the class docstring and docs/arguments.md's table to it).
"""

import dataclasses
import functools
import inspect
import math

import keras

from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import validation
from tf_adaptive_scale.rules import adaptive_rule
from tf_adaptive_scale.rules import clipping
from tf_adaptive_scale.rules import scale_policy

_optional_float = functools.partial(validation.positive_float, allow_none=True)
# The arguments that make the default clipping chain.
_CLIPPING_ARGUMENTS = (
    "clipnorm", "clipvalue", "global_clipnorm", "autoclip_percentile",
    "autoclip_window", "autoclip_per_variable", "agc_factor", "agc_eps",
)


def _scaling(name, value):
    return validation.one_of(name, value, scale_policy.SCALING_MODES)


# The modes, as the docstring lists them (a new mode lists itself).
_MODES_TEXT = (", ".join(f'`"{m}"`' for m in scale_policy.SCALING_MODES[:-1])
               + f' or `"{scale_policy.SCALING_MODES[-1]}"`')


def _criterion(name, value):
    return validation.one_of(name, value, ("count", "mass"))


def _headroom(name, value):
    value = validation.power_of_two(name, value)
    if not 1 <= value <= 2.0**15:
        # Above 2**15 the target peak, 65504 / headroom, is below 2:
        # float16's range would be given up, not kept.
        raise ValueError(f"`{name}` must be in [1, 2**15]. Received: {value}")
    return value


def _percentile(name, value):
    value = validation.positive_float(name, value, allow_none=True)
    if value > 100:
        raise ValueError(f"`{name}` must be in (0, 100]. Received: {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    """The optimizer's arguments, checked (see its docstring for each).

    Example:

    >>> Settings(update_every=10).update_every
    10
    """

    scaling: object = validation.setting(None, validation.optional(_scaling), (
        f"{_MODES_TEXT}. "
        "`None`: resolved at the first step (when an instrumented model is "
        "compiled; on JAX at `build`) from what the model computes: per "
        "layer for an instrumented model, adaptive where it computes in "
        "float16, else none. The resolved mode is saved."))
    initial_scale: float = validation.setting(2.0**15, validation.power_of_two, (
        "Power of two, the global scale before the first update (unused "
        "per layer)."))
    dynamic_growth_steps: int = validation.setting(2000, validation.positive_int, (
        'Clean steps before a `"dynamic"` scale doubles.'))
    min_scale: float = validation.setting(2.0**-32, validation.power_of_two, (
        "Power of two, the smallest scale."))
    max_scale: object = validation.setting(None, validation.optional(validation.power_of_two), (
        "Power of two, the largest scale (`None`: 2**24, or 2**64 per layer)."))
    hysteresis: int = validation.setting(1, validation.positive_int, (
        "Consecutive overflows before the scale backs off."))
    update_every: int = validation.setting(100, validation.positive_int, (
        "Steps between two measurements of the statistics."))
    underflow_rate: float = validation.setting(1e-3, validation.open_unit_interval, (
        "In (0, 1), the tolerated fraction of the nonzero gradient values "
        "below float16's smallest subnormal (2**-24)."))
    underflow_criterion: str = validation.setting("count", _criterion, (
        '`"count"` (of the values) or `"mass"` (of the squared norm).'))
    headroom: float = validation.setting(2.0**4, _headroom, (
        "Power of two in [1, 2**15] kept below float16's maximum."))
    max_scale_rise: object = validation.setting(
        None, validation.optional(validation.positive_int), (
        "Optional most binades a scale rises per update."))
    clipnorm: object = validation.setting(None, _optional_float, (
        "Clip each gradient tensor to this L2 norm."))
    clipvalue: object = validation.setting(None, _optional_float, (
        "Clip each element to `[-clipvalue, clipvalue]`."))
    global_clipnorm: object = validation.setting(None, _optional_float, (
        "Clip all gradients together to this L2 norm."))
    autoclip_percentile: object = validation.setting(None, validation.optional(_percentile), (
        "In (0, 100]: AutoClip to this percentile of past norms."))
    autoclip_window: int = validation.setting(1000, validation.positive_int, (
        "AutoClip's number of past norms."))
    autoclip_per_variable: bool = validation.setting(False, validation.boolean, (
        "AutoClip each variable against its own history."))
    agc_factor: object = validation.setting(None, _optional_float, (
        "AGC: the largest unit gradient/weight norm ratio."))
    agc_eps: float = validation.setting(1e-3, validation.positive_float, (
        "AGC's smallest weight norm."))
    clippers: object = validation.setting(None, validation.optional(clipping.check_chain), (
        "Optional list of `tas.clipping` clippers, run in its order (instead "
        "of the clipping arguments)."))
    max_consecutive_skips: object = validation.setting(
        1000, validation.optional(validation.positive_int), (
        "Skips in a row after which `check_progress()` raises "
        "`SkippedStepsError` (`None`: never)."))
    accumulation_steps: int = validation.setting(1, validation.positive_int, (
        "Micro-batches (calls of `apply`, e.g. `fit`'s batches) per "
        "optimizer step: their unscaled gradients are summed in float32 "
        "and checked, clipped and applied (their mean) or skipped once; a "
        "window spans epochs and `fit` calls."))

    def __post_init__(self):
        validation.check_fields(self)
        if self.min_scale > (self.max_scale or 2.0**float16.PER_LAYER_MAX_EXPONENT):
            # Wrong in every mode: refused now, not at the first step.
            raise ValueError(
                "`min_scale` must be <= `max_scale` (default: 2**24, or "
                f"2**64 per layer). Received: min_scale={self.min_scale}, "
                f"max_scale={self.max_scale}"
            )
        if self.autoclip_per_variable and self.autoclip_percentile is None:
            raise ValueError(
                "`autoclip_per_variable=True` needs `autoclip_percentile` "
                "(AutoClip is off without it)."
            )
        clipping_arguments = [
            f.name for f in dataclasses.fields(self)
            if f.name in _CLIPPING_ARGUMENTS and getattr(self, f.name) != f.default
        ]
        if self.clippers is not None and clipping_arguments:
            raise ValueError(
                "Pass either `clippers` or the clipping arguments, not both: "
                f"put every clipper in `clippers`. Received: clippers and "
                f"{', '.join(clipping_arguments)}"
            )

    @classmethod
    def take(cls, kwargs):
        """The settings among `kwargs`, checked.

        Args:
            kwargs: A dict of arguments; the settings are removed from it
                (the rest are Keras's).

        Returns:
            A `Settings`.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: kwargs.pop(n) for n in names if n in kwargs})

    def with_scaling(self, scaling):
        """These settings, the mode resolved to `scaling`."""
        return dataclasses.replace(self, scaling=scaling)

    def policy(self, scaling):
        """The policy of mode `scaling`, its scale bounds checked.

        Args:
            scaling: One of `scale_policy.SCALING_MODES`.

        Returns:
            A `scale_policy.Policy`.
        """
        mode = scale_policy.MODES[_scaling("scaling", scaling)]
        max_scale = self.max_scale or 2.0**mode.default_log2_max
        if self.min_scale > max_scale:
            raise ValueError(
                "`min_scale` must be <= `max_scale`. Received: "
                f"min_scale={self.min_scale}, max_scale={max_scale}"
            )
        if mode.scales_loss and not self.min_scale <= self.initial_scale <= max_scale:
            raise ValueError(
                "Scales must satisfy `min_scale <= initial_scale <= max_scale`."
                f" Received: min_scale={self.min_scale}, "
                f"initial_scale={self.initial_scale}, max_scale={max_scale}"
            )
        return scale_policy.make_policy(
            scaling, self.update_every, self.dynamic_growth_steps, self.hysteresis,
            math.log2(self.min_scale), math.log2(max_scale), self.max_scale_rise,
            adaptive_rule.AdaptiveRule(
                self.underflow_rate, math.log2(self.headroom), self.underflow_criterion),
        )

    def clipping_chain(self):
        """Fresh clippers, in order: `clippers`' copies (their state is the
        optimizer's, not the caller's objects'), else the clipping arguments'
        in the default order AGC, value, norm, global norm, AutoClip."""
        if self.clippers is not None:
            return [type(c).from_config(c.get_config()) for c in self.clippers]
        return self._argument_clippers()

    def _argument_clippers(self):
        chain = []
        if self.agc_factor is not None:
            chain.append(clipping.AdaptiveGradClip(self.agc_factor, self.agc_eps))
        if self.clipvalue is not None:
            chain.append(clipping.ClipByValue(self.clipvalue))
        if self.clipnorm is not None:
            chain.append(clipping.ClipByNorm(self.clipnorm))
        if self.global_clipnorm is not None:
            chain.append(clipping.ClipByGlobalNorm(self.global_clipnorm))
        if self.autoclip_percentile is not None:
            chain.append(clipping.AutoClip(
                self.autoclip_percentile, self.autoclip_window,
                self.autoclip_per_variable,
            ))
        return chain

    def get_config(self):
        """Every setting (`clippers` serialized, and left out when unused:
        configs stay loadable by versions without it)."""
        config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.clippers is None:
            del config["clippers"]
        else:
            config["clippers"] = [
                keras.saving.serialize_keras_object(c) for c in self.clippers
            ]
        return config


def check_inner_optimizer(inner_optimizer):
    """Refuses what `AdaptiveLossScaleOptimizer` cannot wrap."""
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer "
            f"instance. Received: {inner_optimizer!r}"
        )
    if isinstance(inner_optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a LossScaleOptimizer; wrap the "
            "optimizer inside it instead."
        )
    if inner_optimizer.gradient_accumulation_steps:
        steps = inner_optimizer.gradient_accumulation_steps
        raise ValueError(
            f"The inner optimizer has gradient_accumulation_steps={steps}, "
            "which would decide each micro-batch on its own: pass "
            f"AdaptiveLossScaleOptimizer(..., accumulation_steps={steps}) "
            "instead (one skip decision and one scale update per window)."
        )


NAMES = tuple(f.name for f in dataclasses.fields(Settings))


def signature():
    """The optimizer's `__init__` signature, for `help` and IDEs: the
    settings are keyword arguments with their defaults."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("inner_optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("scaling", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        *[inspect.Parameter(f.name, keyword, default=f.default)
          for f in dataclasses.fields(Settings) if f.name != "scaling"],
        inspect.Parameter("name", keyword, default=None),
    ])


def args_doc(indent):
    """The `Args:` entries of the settings, Keras style, each line indented
    by `indent` spaces (the optimizer's docstring is made with them)."""
    lines = []
    for field in dataclasses.fields(Settings):
        words = f"{field.name}: {field.metadata['doc']}".split()
        line = ""
        for word in words:
            if line and len(line) + len(word) + 1 > 72:
                lines.append(" " * indent + line)
                line = "    " + word
            else:
                line = f"{line} {word}" if line else word
        lines.append(" " * indent + line)
    return "\n".join(lines)
