"""The optimizer's state, declared.

Each part of the step (the step protocol, the scale's state, the statistics,
each clipper, the accumulation window) declares its variables as a tuple of
`StateVariable`s; `make` creates them on the optimizer, in that order, so
that they are saved with it, and a readable one is also its attribute of the
same name. `AdaptiveLossScaleOptimizer.declared_state()` lists them all.
"""

import types
from typing import NamedTuple

import keras


class StateVariable(NamedTuple):
    """One optimizer variable, declared.

    Attributes:
        name: Its name, unique in the optimizer (and its attribute's name).
        initial: Its initial value (every element).
        shape: Its shape.
        dtype: Its dtype.
        aggregation: How replicas' writes combine (`"sum"`: added up).
        readable: Whether it is read as an attribute of the optimizer.
    """

    name: str
    initial: object = 0.0
    shape: tuple = ()
    dtype: str = "float32"
    aggregation: str = "only_first_replica"
    readable: bool = True


def make(optimizer, declared, made, prefix=""):
    """Creates `declared` on `optimizer` and returns them by name.

    Args:
        optimizer: The optimizer that owns and saves the variables.
        declared: A sequence of `StateVariable`s.
        made: The `StateVariable`s made on `optimizer` so far, extended here
            (a name made twice is refused).
        prefix: Put before each declared name on the optimizer (a second
            clipper of a class: `auto_clip_1_`).

    Returns:
        A namespace of the new variables, by their declared names.
    """
    taken = {s.name for s in made}
    variables = {}
    for local in declared:
        spec = local._replace(name=prefix + local.name)
        if spec.name in taken or (spec.readable and hasattr(type(optimizer), spec.name)):
            raise ValueError(
                f"The optimizer state variable {spec.name!r} is declared twice "
                "(or shadows an attribute): give each one its own name."
            )
        taken.add(spec.name)
        variable = optimizer.add_variable(
            shape=spec.shape, initializer=keras.initializers.Constant(spec.initial),
            dtype=spec.dtype, aggregation=spec.aggregation, name=spec.name,
        )
        if spec.readable:  # also a named TensorFlow checkpoint dependency, as stock's
            setattr(optimizer, spec.name, variable)
        variables[local.name] = variable
        made.append(spec)
    return types.SimpleNamespace(**variables)
