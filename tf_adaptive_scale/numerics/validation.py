"""Argument checks that name the argument and what is allowed."""

import dataclasses
import math
import numbers


def positive_int(name, value):
    """An int >= 1; an integral float (2.0) is taken, as Keras takes it."""
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and float(value).is_integer()
    )
    if isinstance(value, bool) or not integral:
        raise TypeError(f"`{name}` must be an int >= 1. Received: {value!r}")
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1. Received: {value}")
    return int(value)


def positive_float(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a positive float"
            f"{' or None' if allow_none else ''}. Received: {value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` must be a positive finite float. Received: {value}"
        )
    return float(value)


def power_of_two(name, value):
    """A power of two within float32's normal range, 2**-126 to 2**127."""
    value = positive_float(name, value)
    if math.frexp(value)[0] != 0.5 or not 2.0**-126 <= value <= 2.0**127:
        raise ValueError(
            f"`{name}` must be a power of two from 2**-126 to 2**127 "
            f"(e.g. 2**15). Received: {value}"
        )
    return value


def open_unit_interval(name, value):
    value = positive_float(name, value)
    if not value < 1:
        raise ValueError(
            f"`{name}` must be in the open interval (0, 1). Received: {value}"
        )
    return value


def one_of(name, value, allowed):
    if value not in allowed:
        raise ValueError(
            f"`{name}` must be one of {list(allowed)}. Received: {value!r}"
        )
    return value


def boolean(name, value):
    """A bool (not a truthy value: `"False"` would read as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool. Received: {value!r}")
    return value


def setting(default, check, doc, **metadata):
    """A field of a frozen settings dataclass: its default, its
    `check(name, value)` (returns the value to keep) and its doc."""
    return dataclasses.field(default=default, metadata=dict(metadata, check=check, doc=doc))


def optional(check):
    """`check`, letting None through."""
    return lambda name, value: None if value is None else check(name, value)


def check_fields(settings):
    """Runs every field's check on a frozen settings dataclass (from its
    `__post_init__`), keeping the values the checks return."""
    for field in dataclasses.fields(settings):
        value = field.metadata["check"](field.name, getattr(settings, field.name))
        object.__setattr__(settings, field.name, value)
