"""Per-layer scaling is exact on every graph family, and fits like stock."""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_adaptive_scale as tas
from helpers import FAMILIES, build, set_random_scales


def seed_states(model):
    return [v for v in model.non_trainable_variables if "seed_generator" in v.path]


def loss_of(model, x, y, scale=1.0):
    pred = model(x, training=True)
    loss = sum(
        tf.reduce_mean(tf.square(tf.cast(p, "float32") - t))
        for p, t in zip(keras.tree.flatten(pred), keras.tree.flatten(y))
    )
    return loss * scale


def gradients(model, variables, x, y, scale=1.0):
    """Gradients of the loss, with dropout seeds replayed for every call."""
    states = seed_states(model)
    saved = [v.numpy() for v in states]
    with tf.GradientTape() as tape:
        loss = loss_of(model, x, y, scale)
    for v, s in zip(states, saved):
        v.assign(s)
    return [g if g is None else tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables)]


def unscaled(instrumented, x, y):
    """The instrumented model's weight gradients divided by their unit scale."""
    log2 = instrumented.scale_table.log2_scales.numpy()
    weights = [v for v in instrumented.trainable_variables if instrumented.scale_table.unit_of(v) is not None]
    grads = gradients(instrumented, weights, x, y)
    return {id(v): g / 2.0 ** log2[instrumented.scale_table.unit_of(v)] for v, g in zip(weights, grads)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_in_float32_with_random_scales(family):
    model, x, y = build(family, "float32")
    instrumented = tas.instrument(model)
    set_random_scales(instrumented, 0, 12)
    forward = keras.tree.flatten(model(x)), keras.tree.flatten(instrumented(x))
    for a, b in zip(*forward):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    reference = gradients(model, model.trainable_variables, x, y)
    got = unscaled(instrumented, x, y)
    assert len(got) == len(model.trainable_variables)
    for v, ref in zip(model.trainable_variables, reference):
        scale = np.abs(ref).max() + 1e-30
        np.testing.assert_allclose(got[id(v)], ref, rtol=1e-6, atol=1e-6 * scale, err_msg=v.path)


def relative_errors(grads, reference):
    # Some gradients vanish in exact arithmetic (attention key bias): measure
    # them against a floor instead of against their own rounding noise.
    floor = 1e-3 * np.median([np.linalg.norm(r) for r in reference])
    return [
        np.linalg.norm(g - r) / max(np.linalg.norm(r), floor)
        for g, r in zip(grads, reference)
    ]


def settle_scales(instrumented, x, y, steps=3):
    """Lets the per-layer rule measure and set the scales (weights unchanged)."""
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0), scaling="per_layer", update_every=1)
    variables = instrumented.trainable_variables
    opt.build(variables)
    for _ in range(steps):
        opt.apply(gradients(instrumented, variables, x, y), variables)
    return opt


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_float16_no_worse_than_best_global_scale(family):
    reference_model, x, y = build(family, "float32")
    reference = gradients(reference_model, reference_model.trainable_variables, x, y)
    model, _, _ = build(family, "mixed_float16")
    # Worst relative error over the weights at every global scale.
    global_errors = {}
    for k in range(-4, 25, 2):
        grads = gradients(model, model.trainable_variables, x, y, scale=2.0**k)
        if all(np.all(np.isfinite(g)) for g in grads):
            global_errors[k] = max(relative_errors([g / 2.0**k for g in grads], reference))
    best_k = min(global_errors, key=global_errors.get)

    instrumented = tas.instrument(model)
    opt = settle_scales(instrumented, x, y)
    got = unscaled(instrumented, x, y)
    errors = relative_errors([got[id(v)] for v in model.trainable_variables], reference)
    assert max(errors) <= 1.05 * global_errors[best_k] + 1e-6, (
        f"per-layer {max(errors):.3g} vs best global 2**{best_k} {global_errors[best_k]:.3g}; "
        f"scales {instrumented.layer_scales()}"
    )
    assert int(opt.skipped_steps) <= 1, family


def test_layer_scales_by_name_and_weights_are_shared():
    model, x, y = build("residual", "float32")
    instrumented = tas.instrument(model)
    names = [l.name for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
    assert list(instrumented.layer_scales()) == names
    assert all(s == 1.0 for s in instrumented.layer_scales().values())
    ids = {id(v) for v in instrumented.trainable_variables}
    assert all(id(v) in ids for v in model.trainable_variables)


def test_subclassed_model_is_refused_clearly():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(np.ones((1, 3), "float32"))
    with pytest.raises(TypeError, match="Sequential or Functional"):
        tas.instrument(net)


def test_instrumented_model_needs_per_layer_optimizer():
    model, x, y = build("sequential", "float32")
    instrumented = tas.instrument(model)
    with pytest.raises(ValueError, match="scaling='per_layer'"):
        instrumented.compile(keras.optimizers.Adam(), loss="mse")
    with pytest.raises(ValueError, match="scaling='per_layer'"):
        instrumented.compile(tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="dynamic"), loss="mse")
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(), scaling="per_layer")
    with pytest.raises(ValueError, match="needs the gradients of a model made by"):
        opt.apply(gradients(model, model.trainable_variables, x, y), model.trainable_variables)


def test_default_scaling_selects_per_layer_for_an_instrumented_model():
    model, x, y = build("sequential", "mixed_float16")
    compiled = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())
    tas.instrument(model).compile(compiled, loss="mse")
    assert compiled.scaling == "per_layer" and float(compiled.loss_scale) == 1.0
    # In a custom loop, at the first step; and the explicit opposite still raises.
    looped = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.0))
    instrumented = tas.instrument(model)
    variables = instrumented.trainable_variables
    looped.apply(gradients(instrumented, variables, x, y), variables)
    assert looped.scaling == "per_layer" and looped.get_config()["scaling"] == "per_layer"
    assert int(looped.skipped_steps) == 0
    wrong = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), scaling="adaptive")
    with pytest.raises(ValueError, match="not scaling='adaptive'"):
        wrong.apply(gradients(instrumented, variables, x, y), variables)


def test_instrumenting_twice_is_refused():
    model, _, _ = build("sequential", "float32")
    with pytest.raises(ValueError, match="already instrumented"):
        tas.instrument(tas.instrument(model))
