"""Where one step's scales come from: the global scale, or per layer.

The optimizer runs every step through one interface, `ScaleStep`, made by
`for_policy`: `GlobalStep` (one scale, from the optimizer's own statistics)
or `LayerStep` (an instrumented model's tables, `layer_scaling`). Everything
that differs by mode is a method here; the optimizer asks no mode question.
The step calls it in this order, each call taking what the one before
returned: `own_measurements` (each replica's and micro-batch's),
`log2_divisors` and `backward_finite` (before the update), `measured`, then
`applies`, then `next_state` with the statistics the step recorded.

A new granularity (one scale per block of layers, say) is a subclass
registered in `_STEPS` under its policy's name (`scale_policy`).
"""

from typing import NamedTuple

from keras import ops

from tf_adaptive_scale.per_layer import layer_scaling
from tf_adaptive_scale.per_layer import step_programs
from tf_adaptive_scale.rules import scale_policy


class ScaleStep:
    """One step's scale source (the interface; `GlobalStep` implements it).

    Args:
        policy: The mode's `scale_policy.Policy`.
        state: The optimizer's `ScaleState` the step runs with.
        step: What the step holds (`StepInputs`).
    """

    def __init__(self, policy, state, step):
        self.policy = policy
        self.state = state

    @staticmethod
    def own_measurements(measure):
        """The optimizer's own measurements of each replica's (and
        micro-batch's) gradients this mode reads: `[measure()]` (a packed
        histogram, zeros and peak, `measurement.Measurement.packed`), where
        float16 underflows, before the replicas' gradients are summed."""
        return [measure()]

    def log2_divisors(self):
        """`{position: log2}`: what divides a gradient besides the loss's
        scale (per layer, its unit's scale)."""
        return {}

    def backward_finite(self):
        """Whether the backward pass saw no non-finite value (per layer, its
        boundaries tell; globally the gradients alone do)."""
        return ops.convert_to_tensor(True)

    def measured(self, wanted):
        """Whether the optimizer records this step's statistics, given that
        it `wanted` to (scheduled and finite)."""
        return wanted

    def applies(self, finite, measured, seen):
        """Whether a step is applied: it is `finite`, and (see
        `Policy.blind`) not a blind search step."""
        blind = self.policy.blind(self.state, measured, seen)
        return ops.logical_and(finite, ops.logical_not(blind))

    def next_state(self, observation, unscaled, latest):
        """The optimizer's next `ScaleState`.

        Args:
            observation: The step's `Observation` (finite, loss_finite,
                measured); the source adds what it proposes.
            unscaled: The step's unscaled gradients, by position.
            latest: The optimizer's `measurement.Latest` statistics, as this
                step recorded them.
        """
        raise NotImplementedError


class GlobalStep(ScaleStep):
    """One scale for every gradient, set from the optimizer's statistics
    (`ScaleStep`'s arguments)."""

    def next_state(self, observation, unscaled, latest):
        proposed, seen = self.policy.rule.proposal(latest.histogram, latest.max_abs)
        return self.policy.next_state(
            self.state, observation._replace(proposed=proposed, seen=seen)
        )


class LayerStep(ScaleStep):
    """Per layer: each instrumented model's `ScaleTable` holds its units'
    scales, which `layer_scaling.TableStep` sets; the global scale stays 1.

    Args:
        policy: The `scale_policy.PerLayerScaling`.
        state: The optimizer's `ScaleState` (its scalar fields).
        step: What the step holds (`StepInputs`): the tables' statistics.
    """

    def __init__(self, policy, state, step):
        super().__init__(policy, state, step)
        # Read once, where the program is traced: measuring or plain.
        self.measuring = step_programs.is_measuring()
        self.tables = layer_scaling.table_steps(
            step.tables, step.statistics, step.variables, step.regular, policy, self.measuring)

    @staticmethod
    def own_measurements(measure):
        return []  # the tables' statistics measure each replica's gradients

    def log2_divisors(self):
        divisors = {}
        for table in self.tables:  # a weight belongs to one table at most
            divisors.update(table.log2_divisors())
        return divisors

    def backward_finite(self):
        return ops.all(ops.stack([t.backward_finite() for t in self.tables]))

    def measured(self, wanted):
        # A plain program (`step_programs`) records no statistics: False
        # when traced, so that it writes none (`Measurement.record`).
        return wanted if self.measuring else False

    def applies(self, finite, measured, seen):
        # A unit that saw nothing rises on its own; the step is applied.
        return finite

    def next_state(self, observation, unscaled, latest):
        """Writes every table's next scales; returns the optimizer's scalar
        state: the schedule measures when any table is due, and the scale
        counts as calibrated once every table is."""
        scheduled = ops.equal(self.state.steps_to_measure, 0)
        new = [t.step(self.state, observation, unscaled, scheduled) for t in self.tables]
        return new[0]._replace(
            log2_scale=ops.zeros_like(self.state.log2_scale),
            log2_ceiling=self.state.log2_ceiling,
            steps_to_measure=ops.min(ops.stack([n.steps_to_measure for n in new])),
            calibrated=ops.all(ops.stack([n.calibrated for n in new])),
        )


class StepInputs(NamedTuple):
    """What one step holds, for any `ScaleStep`.

    Attributes:
        tables: The `ScaleTable`s whose statistics this step received.
        statistics: Their statistics, in the same order.
        variables: The step's variables.
        regular: Positions of the variables updated from their gradients.
    """

    tables: list
    statistics: list
    variables: list
    regular: list


# The granularities other than one global scale, by policy name.
_STEPS = {"per_layer": LayerStep}


def for_policy(policy):
    """The `ScaleStep` class of a mode: its own (`_STEPS`), else `GlobalStep`."""
    return _STEPS.get(policy.name, GlobalStep)


def observation(finite, loss_finite, measured):
    """The part of a step's `Observation` every source shares."""
    return scale_policy.Observation(finite=finite, loss_finite=loss_finite, measured=measured)
