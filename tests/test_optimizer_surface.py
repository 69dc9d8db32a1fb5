"""What a user reads on the optimizer is documented, and nothing else is public.

Every public name `AdaptiveLossScaleOptimizer` adds to Keras's
`LossScaleOptimizer` is either named in the class docstring's list of what a
user reads or is a state variable of docs/monitor.md's "What you can read";
what the library's own modules need (`resolve_scaling`, `micro_batches_taken`,
`scale_tables`) are functions of `step.optimizer`, off that surface.
"""
import pathlib
import re

import keras
import pytest

import tf_adaptive_scale as tas
from tf_adaptive_scale.step import optimizer as optimizer_lib

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "monitor.md"


def _public(optimizer):
    return {n for n in dir(optimizer) if not n.startswith("_")}


def _documented_state():
    table = DOCS.read_text().split("## What you can read", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z_0-9]+)`", row)}


@pytest.mark.parametrize("kwargs", [{}, {"clipnorm": 1.0, "accumulation_steps": 2},
                                    {"autoclip_percentile": 10.0}])
def test_every_public_name_is_what_a_user_reads(kwargs):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
    stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build(model.trainable_variables)
    stock.build(model.trainable_variables)
    added = _public(optimizer) - _public(stock)
    in_docstring = set(re.findall(r"`([a-z_]+)[(`]", type(optimizer).__doc__))
    undocumented = sorted(added - in_docstring - _documented_state())
    assert undocumented == []
    # Every declared variable a user reads is on the table (Keras's own aside).
    readable = {s.name for s in optimizer.declared_state() if s.readable}
    assert sorted(readable - _documented_state() - _public(stock)) == []


def test_the_library_reads_apart_from_the_user():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), accumulation_steps=3)
    for name in ("resolve_scaling", "micro_batches_taken", "scale_tables"):
        assert not hasattr(optimizer, name)
    assert optimizer_lib.micro_batches_taken(optimizer) == 0  # before build
    optimizer.build(model.trainable_variables)
    grads = [keras.ops.ones_like(v) for v in model.trainable_variables]
    for _ in range(4):  # one window of 3, then one micro-batch of the next
        optimizer.apply(grads)
    assert int(optimizer.total_steps) == 1
    assert optimizer_lib.micro_batches_taken(optimizer) == 4
    assert optimizer_lib.scale_tables(optimizer) == []
