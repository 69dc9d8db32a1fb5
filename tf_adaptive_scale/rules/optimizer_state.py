"""The optimizer's state, declared.

Each part of the step (the step protocol, the scale's state, the statistics,
each clipper, the accumulation window) declares its variables as a tuple of
`StateVariable`s; `DeclaredState.make` creates them on the optimizer, in that
order, so that they are saved with it, and a readable one is also its
attribute of the same name. `AdaptiveLossScaleOptimizer.declared_state()`
lists them all.

The readable scalars are packed: a vector of float32 (values and flags) and
one of integers (counters) for the step protocol's and for `build`'s, whose
writes XLA fuses into a kernel per vector, where a variable each cost a
kernel each (benchmarks/RESULTS.md, "Kernel census"). Each reads and writes
as a variable (`StateSlot`), and is saved as one: `.keras` files and
TensorFlow checkpoints hold an entry per declared variable, as before the
packing.
"""

import types
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

from tf_adaptive_scale.backend import backends


class StateVariable(NamedTuple):
    """One optimizer variable, declared.

    Attributes:
        name: Its name, unique in the optimizer (and its attribute's name).
        initial: Its initial value (every element).
        shape: Its shape.
        dtype: Its dtype.
        aggregation: How replicas' writes combine (`"sum"`: added up).
        readable: Whether it is read as an attribute of the optimizer.
        packed: Whether a readable scalar goes in a packed vector (not a
            variable Keras's own `LossScaleOptimizer` reads: its scale).
        retired: No longer kept; declared where 0.1.0's files (by position)
            hold its entry, so that they still load (`positional`).
        since_0_1_0: Added after 0.1.0, whose files (by position) do not hold
            it. Files since are by name: a variable they lack keeps its
            initial value.
    """

    name: str
    initial: object = 0.0
    shape: tuple = ()
    dtype: str = "float32"
    aggregation: str = "only_first_replica"
    readable: bool = True
    packed: bool = True
    retired: bool = False
    since_0_1_0: bool = False


class DeclaredState:
    """Every variable one optimizer declared, in declaration order.

    Args:
        optimizer: The optimizer that owns and saves the variables.
    """

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.specs = []  # `StateVariable`s, as made (prefixed)
        self.handles = []  # each one's variable or `StateSlot`
        self._unpacked = []  # slots declared, not yet in a vector
        self._vectors = 0
        self._retired = []  # where a retired variable's entry stood in `handles`
        self._since_0_1_0 = set()  # positions in `handles` 0.1.0's files lack

    def make(self, declared, prefix=""):
        """Creates `declared` and returns them by name.

        Args:
            declared: A sequence of `StateVariable`s.
            prefix: Put before each declared name on the optimizer (a second
                clipper of a class: `auto_clip_1_`).

        Returns:
            A namespace of the new variables (or slots, placed in their
            vector by the next `pack`), by declared name.
        """
        optimizer = self._optimizer
        taken = {s.name for s in self.specs}
        handles = {}
        for local in declared:
            spec = local._replace(name=prefix + local.name)
            if spec.name in taken or (spec.readable and not spec.retired
                                       and hasattr(type(optimizer), spec.name)):
                raise ValueError(
                    f"The optimizer state variable {spec.name!r} is declared twice "
                    "(or shadows an attribute): give each one its own name."
                )
            taken.add(spec.name)
            if spec.retired:
                self._retired.append(len(self.handles))
                continue
            if spec.since_0_1_0:
                self._since_0_1_0.add(len(self.handles))
            if _packable(spec):
                handle = StateSlot(spec)
                self._unpacked.append(handle)
            else:
                handle = optimizer.add_variable(
                    shape=spec.shape, initializer=keras.initializers.Constant(spec.initial),
                    dtype=spec.dtype, aggregation=spec.aggregation, name=spec.name,
                )
                _track(optimizer, spec, handle)
            handles[local.name] = handle
            self.specs.append(spec)
            self.handles.append(handle)
        return types.SimpleNamespace(**handles)

    def pack(self):
        """Makes the vectors of the slots declared since the last `pack`."""
        for dtype in ("float32", backends.COUNTER_DTYPE):
            slots = [s for s in self._unpacked if _storage_dtype(s.spec) == dtype]
            if not slots:
                continue
            initial = np.array([s.spec.initial for s in slots], dtype)
            vector = self._optimizer.add_variable(
                shape=initial.shape, dtype=dtype, name=f"packed_{dtype}_{self._vectors}",
                initializer=lambda shape, dtype, initial=initial: ops.convert_to_tensor(
                    initial, dtype),
            )
            self._vectors += 1
            for i, slot in enumerate(slots):
                slot.bind(vector, i)
                _track(self._optimizer, slot.spec, slot)
        self._unpacked = []

    def variables(self):
        """The Keras variables this state made (the vectors, not the slots)."""
        made = {id(h): h for h in self.handles if not isinstance(h, StateSlot)}
        made.update((id(h.vector), h.vector) for h in self.handles
                    if isinstance(h, StateSlot) and h.vector is not None)
        return list(made.values())

    def positional(self):
        """The declared state as 0.1.0's files hold it, by position: None
        where a retired variable's entry stood, none added since."""
        entries = []
        for i in range(len(self.handles) + 1):
            entries += [None] * self._retired.count(i)
            if i < len(self.handles) and i not in self._since_0_1_0:
                entries.append(self.handles[i])
        return entries

    def by_name(self):
        """`{name: variable or slot}`."""
        return {spec.name: h for spec, h in zip(self.specs, self.handles)}


class StateSlot(backends.Trackable):
    """A declared scalar held in a packed vector, read and written as a
    variable of its own (`value`, `assign`, `assign_add`, `numpy`); a
    TensorFlow checkpoint saves it under its name, as a variable.

    Args:
        spec: Its `StateVariable`.
    """

    def __init__(self, spec):
        self.spec = spec
        self.name, self.dtype, self.shape = spec.name, spec.dtype, ()
        self.vector = None

    def bind(self, vector, index):
        """Places it at `vector[index]`."""
        self.vector, self.index = vector, index
        self._mask = np.arange(vector.shape[0]) == index

    @property
    def value(self):
        element = self.vector.value[self.index]
        if self.dtype == "bool":
            return ops.not_equal(element, 0)
        return ops.cast(element, self.dtype)

    def assign(self, value):
        # An elementwise select, not a scatter: XLA fuses a step's writes
        # to one vector into one kernel.
        value = ops.cast(ops.convert_to_tensor(value), self.vector.dtype)
        self.vector.assign(ops.where(self._mask, value, self.vector.value))

    def assign_add(self, delta):
        self.assign(ops.cast(self.value, self.vector.dtype) + ops.cast(delta, self.vector.dtype))

    def numpy(self):
        return np.asarray(self.vector.numpy()[self.index]).astype(self.dtype)

    def __array__(self, dtype=None, copy=None):
        return self.numpy().astype(dtype) if dtype is not None else self.numpy()

    def __jax_array__(self):
        return self.value

    def __int__(self):
        return int(self.numpy())

    def __float__(self):
        return float(self.numpy())

    def __bool__(self):
        return bool(self.numpy())

    def __repr__(self):
        value = self.numpy() if self.vector is not None else "unbuilt"
        return f"<StateSlot {self.name} dtype={self.dtype} value={value}>"

    # A TensorFlow checkpoint entry of its own, named as the variable it
    # was before the packing (files written then restore).
    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.value}

    def _restore_from_tensors(self, restored_tensors):
        self.assign(restored_tensors["VARIABLE_VALUE"])


backends.convert_with(StateSlot, lambda slot: slot.value)


def _operator(name):
    def apply(self, *other):
        return getattr(self.value, name)(*other)

    return apply


# Arithmetic and comparisons on its value, as a variable's.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__neg__", "__lt__", "__le__", "__gt__",
              "__ge__"):
    setattr(StateSlot, _name, _operator(_name))


def _track(optimizer, spec, handle):
    """A readable one is an attribute, also a named TensorFlow checkpoint
    dependency (as stock's), another a private one; a slot once bound
    (tracking restores it)."""
    setattr(optimizer, spec.name if spec.readable else "_" + spec.name, handle)


def _packable(spec):
    return (spec.packed and spec.readable and spec.shape == ()
            and spec.aggregation == "only_first_replica")


def _storage_dtype(spec):
    # Flags as 0 and 1 beside the float32 values: one vector fewer.
    return "float32" if spec.dtype in ("float32", "bool") else backends.COUNTER_DTYPE
