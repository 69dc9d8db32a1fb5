"""The optimizer's state is what it declares: one saved entry per declared
variable (scalars packed in vectors, read as their own), readable ones as
attributes, each clipper instance its own."""

import numpy as np
import pytest
import keras

import tf_adaptive_scale as tas
from tf_adaptive_scale.backend import keras_internals
from tf_adaptive_scale.rules import optimizer_state
from helpers import three_layer_mlp
from test_clipping import LR, check_step, random_grads, ref_global, setup


class MyAutoClip(tas.clipping.AutoClip):
    """A user's subclass (docs/arguments.md invites them): its state has
    AutoClip's names."""


@pytest.mark.parametrize("second_class, prefix", [
    (tas.clipping.AutoClip, "auto_clip_1_"),
    # Numbered by the names it declares, not its class: a subclass's first
    # instance collides with an AutoClip's names all the same.
    (MyAutoClip, "my_auto_clip_1_"),
], ids=["AutoClip", "subclass"])
def test_two_autoclip_clippers_keep_separate_histories(second_class, prefix):
    # The first clips to the 25th percentile of its 4 last norms; the second
    # sees what the first let through and keeps its own 3 last norms.
    chain = [tas.clipping.AutoClip(25.0, window=4), second_class(50.0, window=3)]
    opt, variables, step = setup(clippers=chain)
    history, count = (getattr(opt, prefix + name)
                      for name in ("norm_history", "norm_history_count"))
    assert opt.norm_history.shape == (4,) and history.shape == (3,)
    rng = np.random.default_rng(7)
    first, second = [], []
    for magnitude in [1.0, 4.0, 0.5, 8.0, 0.1, 2.0]:
        grads = random_grads(variables, rng, magnitude)
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
        first = (first + [norm])[-4:]
        clipped = ref_global(np.percentile(first, 25.0))(grads, None)
        through = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in clipped))
        second = (second + [through])[-3:]

        def both(gs, _, clipped=clipped, threshold=np.percentile(second, 50.0)):
            return ref_global(threshold)(clipped, None)

        check_step(opt, variables, step, grads, both)
    np.testing.assert_allclose(np.sort(opt.norm_history.numpy()), np.sort(first), rtol=1e-5)
    np.testing.assert_allclose(np.sort(history.numpy()), np.sort(second), rtol=1e-5)
    assert int(opt.norm_history_count) == int(count) == 6


def _adaptive(**kwargs):
    model = three_layer_mlp()
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), **kwargs)
    opt.build(model.trainable_variables)
    return opt


def _per_layer():
    model = tas.instrument(three_layer_mlp())
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="per_layer")
    opt.build(model.trainable_variables)
    return opt


@pytest.mark.parametrize("make", [
    lambda: _adaptive(),
    lambda: _adaptive(scaling="dynamic", accumulation_steps=3),
    lambda: _adaptive(clippers=[tas.clipping.AutoClip(90.0, per_variable=True),
                                tas.clipping.ClipByNorm(1.0),
                                tas.clipping.AutoClip(50.0, window=8)]),
    _per_layer,
], ids=["adaptive", "accumulation", "clippers", "per_layer"])
def test_the_optimizer_state_is_exactly_its_declared_state(make):
    """What is saved is an entry per declared variable, under its name, with
    its shape, dtype and initial value (as before the scalars were packed);
    Keras's own and the inner optimizer's by position; the variables are the
    unpacked ones and vectors holding exactly the packed scalars; a readable
    one is the attribute of its name."""
    opt = make()
    declared = opt.declared_state()
    saved = {}
    opt.save_own_variables(saved)
    inner = len(opt.inner_optimizer.variables)
    entries = ([saved[f"keras_{i}"] for i in range(2)] + [saved[s.name] for s in declared]
               + [saved[f"inner_{i}"] for i in range(inner)])
    assert len(saved) == len(entries)  # nothing else
    # Keras's base optimizer makes two of its own first.
    assert len(entries) == 2 + len(declared) + inner
    unscaled = opt.policy is not None and not opt.policy.scales_loss
    for value, spec in zip(entries[2:], declared):
        assert np.shape(value) == tuple(spec.shape), spec.name
        assert np.asarray(value).dtype == np.dtype(spec.dtype), spec.name
        # A mode without a loss scale sets it to 1 when it is resolved.
        initial = 1.0 if spec.name == "dynamic_scale" and unscaled else spec.initial
        np.testing.assert_array_equal(value, np.full(spec.shape, initial), err_msg=spec.name)
        if spec.readable:
            handle = getattr(opt, spec.name)
            assert handle.name == spec.name
            np.testing.assert_array_equal(np.asarray(handle), value)
        else:
            assert not hasattr(opt, spec.name)
    packed = [s for s in declared if isinstance(getattr(opt, s.name, None),
                                                 optimizer_state.StateSlot)]
    assert {s.name for s in packed} == {
        s.name for s in declared
        if s.readable and s.shape == () and s.name != "dynamic_scale"
        and s.aggregation == "only_first_replica"}
    variables = keras_internals.own_variables(opt)[2:]
    vectors = [v for v in variables if v.name.startswith("packed_")]
    assert [v.name for v in variables if not v.name.startswith("packed_")] == [
        s.name for s in declared if s not in packed]
    assert sum(v.shape[0] for v in vectors) == len(packed)
    # Every variable the optimizer reads as an attribute is declared.
    attributes = {name for name, value in vars(opt).items()
                  if isinstance(value, (keras.Variable, optimizer_state.StateSlot))}
    assert attributes - {"_iterations", "_learning_rate"} == {
        d.name if d.readable else "_" + d.name for d in declared}


def test_a_name_declared_twice_is_refused():
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR))
    twice = [optimizer_state.StateVariable("extra"), optimizer_state.StateVariable("extra")]
    with pytest.raises(ValueError, match="'extra' is declared twice"):
        opt._state.make(twice)
    with pytest.raises(ValueError, match="'skipped_steps' is declared twice"):
        _adaptive()._state.make([optimizer_state.StateVariable("skipped_steps")])
