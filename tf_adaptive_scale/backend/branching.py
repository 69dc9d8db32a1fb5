"""Conditionals whose branches assign Keras variables, on any backend.

TensorFlow orders a branch's variable assignments itself: `ops.cond` serves.
JAX's branches must be pure. Keras's JAX trainer runs the optimizer in a
`keras.StatelessScope` (`stateless_apply`), where assigning a variable
records its new value in the scope. Here each branch runs in a scope of its
own, seeded with the enclosing scope's values; the values the branches
assigned come out of the conditional and are recorded in the enclosing
scope.
"""

import keras
from keras import ops

from tf_adaptive_scale.backend import keras_internals


def cond(pred, true_fn, false_fn):
    """Runs `true_fn()` where `pred` holds, else `false_fn()`.

    For branches that assign variables; their return values are dropped.
    Only the branch taken is computed (JAX traces both twice: once to learn
    which variables they assign).

    Args:
        pred: A scalar bool tensor.
        true_fn: A function of no arguments.
        false_fn: A function of no arguments.
    """
    if _ran_directly(pred, true_fn, false_fn):
        return
    import jax

    variables = _union(_run(true_fn).assigned, _run(false_fn).assigned)
    values = jax.lax.cond(
        pred,
        lambda: _values_after(true_fn, variables),
        lambda: _values_after(false_fn, variables),
    )
    for variable, value in zip(variables, values):
        variable.assign(value)


def select(pred, true_fn, false_fn):
    """`cond` for cheap elementwise branches: on JAX both run and every
    variable either assigns takes its value from the one `pred` picks.

    On TensorFlow this is `ops.cond`, which XLA turns into the same selects
    when both branches are elementwise. Arguments as `cond`'s.
    """
    if _ran_directly(pred, true_fn, false_fn):
        return
    # Each assignment is selected as it is made. A select of each variable's
    # value after the branch made XLA copy every optimizer slot on every
    # step (Adam's new `m` fused into both its select and the weight update,
    # which read the donated old `m`: 180 MiB a step on ResNet50,
    # benchmarks/RESULTS.md, "Where the time goes").
    taken, other = _run(true_fn, pred), _run(false_fn, ops.logical_not(pred))
    for variable in _union(taken.assigned, other.assigned):
        if id(variable) not in other.assigned:
            variable.assign(taken.value(variable))
        elif id(variable) not in taken.assigned:
            variable.assign(other.value(variable))
        else:
            variable.assign(ops.where(pred, taken.value(variable), other.value(variable)))


def _ran_directly(pred, true_fn, false_fn):
    """Runs the conditional where no state needs threading through it:
    TensorFlow's `ops.cond`, or eager JAX's branch `pred` picks."""
    if keras.backend.backend() != "jax":
        ops.cond(pred, true_fn, false_fn)
        return True
    if _concrete(pred):
        (true_fn if bool(pred) else false_fn)()
        return True
    return False


def _concrete(pred):
    """Whether `pred` has a value now (eager JAX, outside any trace)."""
    import jax

    return not isinstance(pred, jax.core.Tracer)


def _union(first, second):
    variables = dict(first)
    variables.update(second)
    return list(variables.values())


def _values_after(fn, variables):
    branch = _run(fn)
    return [branch.value(v) for v in variables]


def _run(fn, pred=None):
    with _BranchScope(pred) as scope:
        fn()
    return scope


class _BranchScope(keras.StatelessScope):
    """A stateless scope that starts from the enclosing one's values and
    remembers which variables were assigned in it; with `pred`, each
    assignment takes effect only where `pred` holds."""

    def __init__(self, pred=None):
        super().__init__()
        enclosing = _enclosing_scope()
        if enclosing is not None:
            self.state_mapping = dict(enclosing.state_mapping)
        self.pred = pred
        self.assigned = {}

    def add_update(self, update):
        variable, value = update
        if self.pred is not None:
            value = ops.where(self.pred, value, self.value(variable))
        super().add_update((variable, value))
        self.assigned[id(variable)] = variable

    def value(self, variable):
        """The variable's value at the end of the branch."""
        value = self.get_current_value(variable)
        if value is None:  # never assigned nor mapped: its stored value
            value = variable.value
        return value


def _enclosing_scope():
    # The branch must start from the active StatelessScope's values.
    return keras_internals.stateless_scope()
