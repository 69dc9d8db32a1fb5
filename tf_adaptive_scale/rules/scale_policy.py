"""Loss-scale policies: one small object per scaling mode.

A policy's `next_state(state, observation)` is a pure function of tensors:
the optimizer gathers what one step saw into an `Observation`, asks its
policy for the next `ScaleState` and only writes it to its variables. Scales
are held as base-2 exponents, so every scale is an exact power of two.

Shared rules:
- A step whose loss is not finite is bad data, not an overflow: it is skipped
  and nothing backs off (a burst of NaN batches leaves the scale as it was).
- An overflow (finite loss, non-finite gradients) measures again on the next
  step, so the scale is set from clean statistics as soon as there are some.
- Statistics are taken every `update_every` steps (`steps_to_measure`
  counts down to the next measured step).
"""

import inspect
from typing import NamedTuple

from keras import ops

from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.rules import adaptive_rule

# Binades a scale rises when a measurement saw no nonzero gradient at all
# (everything may have underflowed).
UNSEEN_STEP = 8.0
# Binades an uncalibrated scale drops on an overflow. float16 holds 40
# binades (2**-24 to 2**16): a peak that just overflowed is still seen 39
# binades lower, and anything up to 2**39 times larger no longer overflows,
# so the next step measures it.
CALIBRATION_DROP = 39.0


class ScaleState(NamedTuple):
    """A policy's state; every field is a tensor.

    Attributes:
        log2_scale: Exponent of the scale (a vector, one per unit, per layer).
        log2_ceiling: Exponent(s) of the cap an overflow put on the scale.
        growth_count: Clean steps since the scale last grew (dynamic mode).
        overflow_streak: Consecutive overflows since the last applied step.
        steps_to_measure: Steps before the next measured step (0: this one).
        calibrated: A clean measurement has set the scale (before that, the
            initial scale is only a guess).
    """

    log2_scale: object
    log2_ceiling: object
    growth_count: object
    overflow_streak: object
    steps_to_measure: object
    calibrated: object


class Observation(NamedTuple):
    """What one step saw.

    Attributes:
        finite: The gradients to apply were all finite (the step ran).
        loss_finite: The loss was finite: a non-finite step is an overflow.
        measured: Statistics were taken on this step.
        proposed: The adaptive rule's exponent(s) from those statistics.
        seen: The statistics held nonzero values (per unit, per layer).
        origins: Per layer: the units where an overflow started.
        involved: Per layer: the units a non-finite gradient reached.
        weight_only: Per layer: units where only a weight-gradient sum
            overflowed (its activation gradients were finite).
        cut: Per layer: units whose measured values were mostly lost to
            underflow (their most populated binade is the lowest float16
            holds at their scale), so that the statistics show only the
            top of their gradients.
    """

    finite: object
    loss_finite: object
    measured: object
    proposed: object = 0.0
    seen: object = False
    origins: object = True
    involved: object = True
    weight_only: object = False
    cut: object = False


class Policy:
    """Base policy: the scale never changes; only the schedule moves.

    A mode's facts are class attributes: `name` (its `scaling` argument),
    `scales_loss` (the loss is multiplied by a global scale; else the scale
    stays 1), `per_layer` (scales live in an instrumented model's tables),
    `in_float16` (the gradients come from float16: their underflow and
    overflow are reported) and `default_log2_max` (the exponent of the default
    `max_scale`).

    Args:
        update_every: Steps between two measurements.
        rule: The `AdaptiveRule` its measurements are read with (default
            arguments if None).
    """

    name = None
    scales_loss = True
    per_layer = False
    in_float16 = True
    default_log2_max = float16.GLOBAL_MAX_EXPONENT

    def __init__(self, update_every, rule=None):
        self.update_every = update_every
        self.rule = rule or adaptive_rule.AdaptiveRule()

    @classmethod
    def make(cls, **arguments):
        """The policy from the optimizer's arguments (see `make_policy`), by
        name: a mode takes those its constructor names."""
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in arguments.items() if k in names})

    def next_state(self, state, observation):
        """The state after a step.

        Args:
            state: The `ScaleState` the step ran with.
            observation: The step's `Observation`.

        Returns:
            The next `ScaleState`.
        """
        return self._schedule(state, observation, self._overflowed(observation))

    def blind(self, state, measured, seen):
        """Whether a finite step is not applied because its gradients tell
        nothing: only a scale still searching for the gradients skips one.

        Args:
            state: The `ScaleState` the step ran with.
            measured: bool, the step was measured.
            seen: bool, any gradient value was nonzero.

        Returns:
            A boolean tensor.
        """
        return ops.convert_to_tensor(False)

    def _bound(self, hysteresis, log2_min, log2_max):
        """Sets what a changing scale obeys: its back-off's hysteresis and
        its exponent's bounds."""
        self.hysteresis = hysteresis
        self.log2_min = log2_min
        self.log2_max = log2_max

    @staticmethod
    def _overflowed(obs):
        return ops.logical_and(ops.logical_not(obs.finite), obs.loss_finite)

    def _schedule(self, state, obs, overflow, **changes):
        """Counts down to the next measurement; an overflow measures next."""
        took = ops.logical_and(obs.measured, obs.finite)
        countdown = ops.where(
            took,
            self.update_every - 1,
            ops.maximum(state.steps_to_measure - 1, 0),
        )
        streak = ops.where(obs.finite, 0, state.overflow_streak)
        defaults = dict(
            steps_to_measure=ops.where(overflow, 0, countdown),
            overflow_streak=streak,
        )
        defaults.update(changes)
        return state._replace(**defaults)

    def _streak(self, state, obs, hysteresis):
        """The overflow streak and whether it backs the scale off now: on
        every `hysteresis`-th consecutive overflow."""
        overflow = self._overflowed(obs)
        streak = ops.where(
            overflow,
            state.overflow_streak + 1,
            ops.where(obs.finite, 0, state.overflow_streak),
        )
        back_off = ops.logical_and(overflow, ops.mod(streak, hysteresis) == 0)
        return overflow, streak, back_off


class NoScaling(Policy):
    """Mode `"none"`: scale 1; non-finite steps are still skipped."""

    name = "none"
    scales_loss = False
    in_float16 = False

    def next_state(self, state, observation):
        state = super().next_state(state, observation)
        return state._replace(log2_scale=ops.zeros_like(state.log2_scale))


class StaticScaling(Policy):
    """Mode `"static"`: the scale stays at `initial_scale`."""

    name = "static"


class DynamicScaling(Policy):
    """Mode `"dynamic"`: Keras's rule, bounded.

    The scale doubles after `growth_steps` consecutive clean steps and halves
    after `hysteresis` consecutive overflows, within `[log2_min, log2_max]`.

    Args:
        update_every: Steps between two measurements (statistics only).
        growth_steps: Clean steps before the scale doubles.
        hysteresis: Consecutive overflows before it halves.
        log2_min: Exponent of the smallest scale.
        log2_max: Exponent of the largest scale.
        rule: See `Policy`.

    Example:

    >>> policy = DynamicScaling(100, 2000, 1, -16.0, 24.0)
    """

    name = "dynamic"

    def __init__(self, update_every, growth_steps, hysteresis, log2_min, log2_max,
                 rule=None):
        super().__init__(update_every, rule)
        self.growth_steps = growth_steps
        self._bound(hysteresis, log2_min, log2_max)

    def next_state(self, state, obs):
        overflow, streak, back_off = self._streak(state, obs, self.hysteresis)
        count = state.growth_count + 1
        grow = ops.logical_and(obs.finite, count >= self.growth_steps)
        count = ops.where(
            obs.finite, ops.where(grow, 0, count),
            ops.where(overflow, 0, state.growth_count),
        )
        scale = state.log2_scale
        scale = ops.where(grow, ops.minimum(scale + 1.0, self.log2_max), scale)
        scale = ops.where(back_off, ops.maximum(scale - 1.0, self.log2_min), scale)
        return self._schedule(
            state, obs, overflow,
            log2_scale=scale, growth_count=count, overflow_streak=streak,
        )


def adaptive_update(
    log2_scale, log2_ceiling, proposed, seen, log2_min, log2_max, max_rise=None
):
    """The scale and cap after a clean measurement (elementwise).

    The scale takes the rule's exponent, within the bounds. An overflow's cap
    holds it at most one binade below what the clean measurement allows, for
    one measurement; each clean measurement lifts the cap one binade, so a
    burst of overflows costs one binade, not the whole way down.
    Where nothing nonzero was seen the scale stays and the cap with it.

    Args:
        log2_scale: Current exponent(s).
        log2_ceiling: Current cap(s).
        proposed: The rule's exponent(s).
        seen: Whether the measurement saw nonzero values.
        log2_min: Exponent of the smallest scale.
        log2_max: Exponent of the largest scale.
        max_rise: Optional most binades a scale may rise in one update.

    Returns:
        A tuple `(log2_scale, log2_ceiling)`.
    """
    proposed = ops.clip(ops.convert_to_tensor(proposed, "float32"), log2_min, log2_max)
    cap = ops.maximum(log2_ceiling, proposed - 1.0)
    scale = ops.minimum(proposed, cap)
    if max_rise is not None:
        scale = ops.minimum(scale, log2_scale + max_rise)
    ceiling = ops.minimum(cap + 1.0, log2_max)
    return (
        ops.where(seen, scale, log2_scale),
        ops.where(seen, ceiling, log2_ceiling),
    )


class AdaptiveScaling(Policy):
    """Mode `"adaptive"`: the scale follows measured gradient statistics.

    On a clean measured step the scale takes the rule's exponent (see
    `adaptive_update`). On an overflow, after `hysteresis` in a row, it halves
    and is capped there, and the next step measures again. Before the first
    clean measurement the initial scale is a guess: an overflow then drops it
    `CALIBRATION_DROP` binades (down to the smallest scale), where the next,
    measured step sees the gradient's peak, so finding a working scale costs
    one skipped step whatever the loss's magnitude; a measurement that saw
    only zeros raises the guess `UNSEEN_STEP` binades and measures again.
    Once calibrated, consecutive back-offs step 1, 2, 4, ... binades.

    Args:
        update_every: Steps between two measurements.
        hysteresis: Consecutive overflows before the scale backs off.
        log2_min: Exponent of the smallest scale.
        log2_max: Exponent of the largest scale.
        max_rise: Optional most binades the scale may rise in one update.
        rule: The `AdaptiveRule` that proposes the scale.

    Example:

    >>> policy = AdaptiveScaling(100, 1, -16.0, 24.0)
    """

    name = "adaptive"

    def __init__(self, update_every, hysteresis, log2_min, log2_max, max_rise=None,
                 rule=None):
        super().__init__(update_every, rule)
        self.max_rise = max_rise
        self._bound(hysteresis, log2_min, log2_max)

    def blind(self, state, measured, seen):
        """Before calibration, a measured step whose gradients all
        underflowed (all zero) while the scale can still rise changes no
        weight, yet would count as a step (Adam's moments, schedules): it is
        skipped, and the scale rises `UNSEEN_STEP` binades, up to one binade
        below the lowest scale that overflowed (so a model whose gradients
        float16 cannot hold at any scale stops searching)."""
        top = ops.minimum(state.log2_ceiling, self.log2_max)
        return ops.logical_and(
            ops.logical_and(measured, ops.logical_not(seen)),
            ops.logical_and(ops.logical_not(state.calibrated), state.log2_scale < top),
        )

    def next_state(self, state, obs):
        overflow, streak, back_off = self._streak(state, obs, self.hysteresis)
        clean = ops.logical_and(obs.finite, obs.measured)
        # Before calibration the cap only bounds the search (below).
        scale, ceiling = adaptive_update(
            state.log2_scale,
            ops.where(state.calibrated, state.log2_ceiling, float16.NO_CAP_EXPONENT),
            obs.proposed, ops.logical_and(clean, obs.seen),
            self.log2_min, self.log2_max, self.max_rise,
        )
        ceiling = ops.where(
            ops.logical_and(clean, obs.seen), ceiling, state.log2_ceiling
        )
        # Before calibration, a measurement of nothing but zeros: look higher,
        # never as high as a scale that overflowed.
        blind = ops.logical_and(
            ops.logical_and(clean, ops.logical_not(obs.seen)),
            ops.logical_not(state.calibrated),
        )
        scale = ops.where(
            blind,
            ops.minimum(scale + UNSEEN_STEP, ops.minimum(ceiling, self.log2_max)),
            scale,
        )
        # Consecutive back-offs step 1, 2, 4, ... binades (at most 32): a
        # sudden 2**20 spike in the loss costs 5 skipped steps, not 20.
        backoffs = ops.maximum(streak // self.hysteresis, 1)
        step = ops.cast(ops.left_shift(1, ops.minimum(backoffs - 1, 5)), "float32")
        halved = ops.maximum(scale - step, self.log2_min)
        # A guess drops far; once a search below a known overflow has seen
        # nothing up to it, the next overflow just halves.
        searched = state.log2_ceiling < float16.NO_CAP_EXPONENT
        dropped = ops.maximum(
            scale - ops.where(searched, 1.0, CALIBRATION_DROP), self.log2_min
        )
        scale = ops.where(
            back_off, ops.where(state.calibrated, halved, dropped), scale
        )
        # The cap stays within the bounds (an overflow at `min_scale` caps it there).
        ceiling = ops.where(
            back_off,
            ops.where(state.calibrated, halved,
                      ops.maximum(state.log2_scale - 1.0, self.log2_min)),
            ceiling,
        )
        state = self._schedule(
            state, obs, ops.logical_or(overflow, blind),
            log2_scale=scale, log2_ceiling=ceiling, overflow_streak=streak,
        )
        return state._replace(
            calibrated=ops.logical_or(
                state.calibrated, ops.logical_and(clean, obs.seen)
            )
        )


class PerLayerScaling(AdaptiveScaling):
    """Mode `"per_layer"`: the adaptive rule for every unit of a model.

    `log2_scale` and `log2_ceiling` are vectors (one entry per unit), as are
    the observation's per-unit fields. A clean measured step sets every unit
    by `adaptive_update`; an overflow seen by a measured step backs off the
    units where it started and drops the units it reached as far (see
    `next_state`).

    Args: those of `AdaptiveScaling`, applied to every unit.

    Example:

    >>> policy = PerLayerScaling(100, 1, -16.0, 64.0)
    """

    name = "per_layer"
    scales_loss = False
    per_layer = True
    default_log2_max = float16.PER_LAYER_MAX_EXPONENT
    WEIGHT_OVERFLOW_STEP = 4.0

    # A unit that saw only zeros rises `UNSEEN_STEP` binades up to its
    # cap, and so at most does a unit whose values mostly underflowed
    # (`cut`): its scale was a guess the next update can invalidate (the
    # gradients behind a LayerScale initialised to 1e-6 grow a
    # thousandfold when Adam's first update moves it to 1e-3), and the
    # next step measures again (`layer_scaling.TableStep.record`).
    #
    # On an overflow only a measured step knows where it started: there,
    # after `hysteresis` overflows, the units where it started back off
    # one binade below the smaller of their scale and the rule's
    # (`WEIGHT_OVERFLOW_STEP` binades where only a weight-gradient sum
    # overflowed, which the rule cannot see), and are capped one binade
    # down; units the overflow did not reach take the rule's scale. The
    # units it reached, whose own gradients the non-finite values hid,
    # drop as far as the furthest origin did: their gradients come
    # through it and grew with it, so one overflow corrects every unit
    # it reveals at once, and the next, measured step sets them all from
    # clean statistics. Before the first clean measurement
    # (`calibrated`) they drop below the lowest unit that backed off.
    def next_state(self, state, obs):
        overflow, streak, back_off = self._streak(state, obs, self.hysteresis)
        current, ceilings = state.log2_scale, state.log2_ceiling
        clean = ops.logical_and(obs.finite, obs.measured)
        proposed = ops.where(
            obs.seen, obs.proposed, ops.minimum(current + UNSEEN_STEP, ceilings)
        )
        # Mostly underflowed: rise as if unseen, and measure again.
        proposed = ops.where(
            ops.logical_and(obs.seen, obs.cut),
            ops.minimum(proposed, current + UNSEEN_STEP),
            proposed,
        )
        proposed = ops.clip(proposed, self.log2_min, self.log2_max)
        if self.max_rise is not None:
            proposed = ops.minimum(proposed, current + self.max_rise)
        rose, lifted = adaptive_update(
            current, ceilings, proposed, obs.seen, self.log2_min, self.log2_max, self.max_rise
        )
        rose = ops.where(obs.seen, rose, proposed)
        # An overflow seen by a measured step: back off where it started.
        located = ops.logical_and(overflow, obs.measured)
        backs_off = ops.logical_and(obs.origins, back_off)
        below = ops.minimum(proposed, current)
        capped = ops.maximum(below - 1.0, self.log2_min)
        lowered = ops.where(
            obs.weight_only,
            ops.maximum(below - self.WEIGHT_OVERFLOW_STEP, self.log2_min),
            capped,
        )
        untouched = ops.minimum(proposed, ceilings)
        # The units the overflow reached drop as far as the furthest origin
        # of a gradient overflow did (a weight-gradient sum's reaches none).
        spreads = ops.logical_and(backs_off, ops.logical_not(obs.weight_only))
        drop = ops.max(ops.where(spreads, current - lowered, 0.0))
        # Before calibration: the units below drop with the lowest origin, and
        # `UNSEEN_STEP` further for their weight-gradient sums (reductions
        # over the batch), which the origins' statistics do not show.
        lowest = ops.min(ops.where(backs_off, lowered, self.log2_max))
        reached = ops.where(
            state.calibrated,
            ops.maximum(current - drop, ops.minimum(current, self.log2_min)),
            ops.minimum(current, ops.maximum(lowest - UNSEEN_STEP, self.log2_min)),
        )
        after_overflow = ops.where(
            backs_off, lowered, ops.where(obs.involved, reached, untouched)
        )
        scale = ops.where(clean, rose, ops.where(located, after_overflow, current))
        ceiling = ops.where(
            clean, lifted, ops.where(ops.logical_and(located, backs_off), capped, ceilings)
        )
        state = self._schedule(
            state, obs, overflow,
            log2_scale=scale, log2_ceiling=ceiling, overflow_streak=streak,
        )
        return state._replace(
            calibrated=ops.logical_or(
                state.calibrated, ops.logical_and(clean, ops.any(obs.seen))
            )
        )


# The scaling modes by name, in the order error messages list them.
MODES = {
    mode.name: mode
    for mode in (AdaptiveScaling, DynamicScaling, StaticScaling, NoScaling, PerLayerScaling)
}
SCALING_MODES = tuple(MODES)


def make_policy(scaling, update_every, growth_steps, hysteresis, log2_min,
                log2_max, max_rise=None, rule=None):
    """The policy object for a scaling mode.

    Args:
        scaling: One of `SCALING_MODES`.
        update_every: Steps between two measurements.
        growth_steps: Clean steps before a dynamic scale doubles.
        hysteresis: Consecutive overflows before a scale backs off.
        log2_min: Exponent of the smallest scale.
        log2_max: Exponent of the largest scale.
        max_rise: Optional most binades an adaptive scale rises per update.
        rule: Optional `AdaptiveRule` (default arguments if None).

    Returns:
        A `Policy`.
    """
    return MODES[scaling].make(
        update_every=update_every, growth_steps=growth_steps, hysteresis=hysteresis,
        log2_min=log2_min, log2_max=log2_max, max_rise=max_rise, rule=rule,
    )


def default_mode(instrumented, computes_in_float16):
    """The mode `scaling=None` resolves to.

    Args:
        instrumented: The gradients come from a `tas.instrument`ed model.
        computes_in_float16: The model computes in float16.

    Returns:
        Per layer for an instrumented model, else adaptive where the model
        computes in float16, else none.
    """
    if instrumented:
        return PerLayerScaling.name
    return AdaptiveScaling.name if computes_in_float16 else NoScaling.name
