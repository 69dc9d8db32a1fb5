"""The settings record: every argument once, and everything that lists them
(the docstring, the table of docs/arguments.md, get_config) agrees with it;
the clipping chain runs in the order given."""

import dataclasses
import os
import re

import keras
import numpy as np
import pytest

import tf_adaptive_scale as tas
from tf_adaptive_scale.rules import clipping
from tf_adaptive_scale.rules import settings

from backend_step import stepper

ARGUMENTS_PAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "arguments.md")


def _documented_arguments():
    """`{name: default}` from the argument table of docs/arguments.md."""
    with open(ARGUMENTS_PAGE) as f:
        text = f.read()
    table = text[text.index("| argument | default | meaning |"):].split("\n\n")[0]
    found = {}
    for row in table.splitlines()[2:]:
        names_cell, defaults_cell = row.split(" | ")[:2]
        names = re.findall(r"`(\w+)`", names_cell)
        defaults = [d.strip().strip("`") for d in defaults_cell.split(", ")]
        if defaults == ["required"]:
            defaults = [None]
        assert len(names) == len(defaults), row
        found.update(zip(names, defaults))
    return found


def test_arguments_page_lists_every_argument_with_its_default():
    table = _documented_arguments()
    expected = ["inner_optimizer", *settings.NAMES, "name"]
    assert list(table) == expected
    for field in dataclasses.fields(settings.Settings):
        assert eval(table[field.name]) == field.default, field.name  # noqa: S307


def test_docstring_documents_every_argument_in_order():
    doc = tas.AdaptiveLossScaleOptimizer.__doc__
    args = doc[doc.index("Args:"):doc.index("Example:")]
    names = re.findall(r"^        (\w+): ", args, flags=re.M)
    assert names == ["inner_optimizer", *settings.NAMES, "name"]


def test_get_config_and_attributes_hold_every_setting():
    values = dict(scaling="static", initial_scale=2.0**3, dynamic_growth_steps=9,
                  min_scale=2.0**-4, max_scale=2.0**9, hysteresis=3, update_every=4,
                  underflow_rate=0.25, underflow_criterion="mass", headroom=2.0,
                  max_scale_rise=2, clipnorm=1.5, clipvalue=2.5, global_clipnorm=3.5,
                  autoclip_percentile=75.0, autoclip_window=6, autoclip_per_variable=True,
                  agc_factor=0.5, agc_eps=0.25, max_consecutive_skips=11,
                  accumulation_steps=2)
    assert sorted(values) == sorted(n for n in settings.NAMES if n != "clippers")
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), **values)
    config = opt.get_config()
    for name, value in values.items():
        assert config[name] == value and getattr(opt, name) == value, name
    # Unused, `clippers` stays out of the config (older versions load it).
    assert "clippers" not in config
    chained = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(), clippers=[clipping.ClipByNorm(1.0)]
    )
    assert chained.get_config()["clippers"][0]["config"] == {"max_norm": 1.0}


def test_clippers_and_clipping_arguments_are_exclusive():
    with pytest.raises(ValueError, match="either `clippers` or the clipping arguments"):
        tas.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(), clipnorm=1.0, clippers=[clipping.ClipByValue(1.0)]
        )
    with pytest.raises(TypeError, match="`clippers` must hold tas.clipping.Clipper"):
        tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), clippers=["norm"])
    with pytest.raises(ValueError, match="`percentile` must be in"):
        clipping.AutoClip(120.0)


def _run(clippers=None, steps=3, **kwargs):
    """Weights after `steps` SGD(1) steps of fixed gradients, per variable."""
    keras.utils.set_random_seed(0)
    variables = [keras.Variable(np.full((3, 2), 0.5, "float32")),
                 keras.Variable(np.zeros((2,), "float32"))]
    opt = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1.0), scaling="none", clippers=clippers, **kwargs
    )
    opt.build(variables)
    step = stepper(opt, variables)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        step(*[rng.standard_normal(v.shape).astype("float32") * 4 for v in variables])
    return [v.numpy() for v in variables], opt


def _numpy_chain(order, steps=3):
    """The same run in numpy, clipping by value 1 and global norm 2 in
    `order`."""
    weights = [np.full((3, 2), 0.5), np.zeros((2,))]
    rng = np.random.default_rng(1)
    for _ in range(steps):
        grads = [rng.standard_normal(w.shape).astype("float32") * 4.0 for w in weights]
        for kind in order:
            if kind == "value":
                grads = [np.clip(g, -1.0, 1.0) for g in grads]
            else:
                norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads))
                grads = [g * min(1.0, 2.0 / norm) for g in grads]
        weights = [w - g for w, g in zip(weights, grads)]
    return weights


@pytest.mark.parametrize("order", [("value", "global"), ("global", "value")])
def test_clippers_run_in_the_order_given(order):
    make = {"value": lambda: clipping.ClipByValue(1.0),
            "global": lambda: clipping.ClipByGlobalNorm(2.0)}
    weights, opt = _run([make[kind]() for kind in order])
    for got, want in zip(weights, _numpy_chain(order)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(opt.clipped_steps) == 3


def test_clipping_arguments_keep_the_default_order():
    legacy, _ = _run(agc_factor=0.5, clipvalue=1.0, clipnorm=1.5, global_clipnorm=2.0,
                     autoclip_percentile=50.0, autoclip_window=4)
    chain, _ = _run([clipping.AdaptiveGradClip(0.5), clipping.ClipByValue(1.0),
                     clipping.ClipByNorm(1.5), clipping.ClipByGlobalNorm(2.0),
                     clipping.AutoClip(50.0, window=4)])
    for a, b in zip(legacy, chain):
        np.testing.assert_array_equal(a, b)


def test_clippers_round_trip_and_keep_their_state_in_the_optimizer():
    autoclip = clipping.AutoClip(90.0, window=5, per_variable=True)
    _, opt = _run([clipping.ClipByNorm(3.0), autoclip])
    # The caller's clipper carries no state: the optimizer built a copy.
    assert not hasattr(autoclip, "history")
    assert int(opt.norm_history_count) == 3
    config = opt.get_config()
    clone = tas.AdaptiveLossScaleOptimizer.from_config(config)
    assert clone.get_config() == config
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert [c.get_config() for c in again.clippers] == [
        {"max_norm": 3.0}, {"percentile": 90.0, "window": 5, "per_variable": True}
    ]


def test_the_docs_list_every_scaling_mode():
    """A new mode (`scale_policy.MODES`) lists itself in the docstring; the
    arguments page must name it too."""
    from tf_adaptive_scale.rules import scale_policy

    row = next(line for line in open(ARGUMENTS_PAGE) if line.startswith("| `scaling` |"))
    assert set(re.findall(r'`"([a-z_]+)"`', row)) == set(scale_policy.SCALING_MODES)
    doc = tas.AdaptiveLossScaleOptimizer.__doc__
    assert all(f'`"{mode}"`' in doc for mode in scale_policy.SCALING_MODES)
