"""The step protocol (docs/custom_loops.md): `scale_loss` begins a step,
`get_unscaled_gradients` marks it unscaled, `apply` consumes the mark.

Every update is compared with the same computation in float32 from the
same weights and data (no scaling at all), run eagerly and traced: SAM and
MAML-style steps, which unscale one gradient for their own use and apply
another, and the tf-keras idiom (clip after unscaling).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import dense_model, normal
from keras import ops

import tf_adaptive_scale as tas

LR = 0.1
RHO = 0.05
INNER_LR = 0.1
MODES = [dict(scaling="static", initial_scale=2.0**10), dict(initial_scale=2.0**8)]
MODE_IDS = ["static", "adaptive"]


def mse(y, p):
    return ops.mean(ops.square(ops.cast(y, "float32") - ops.cast(p, "float32")))


def models():
    """A model computing in float16 (the tests run under `mixed_float16`)
    and its float32 twin, with the same weights."""
    model = dense_model(4, dict(units=16, activation="tanh"), dict(units=1), seed=1)
    twin = dense_model(4, dict(units=16, activation="tanh", dtype="float32"),
                       dict(units=1, dtype="float32"))
    twin.set_weights(model.get_weights())
    return model, twin


def batches():
    return (normal((32, 4), 0), normal((32, 1), 1), normal((32, 4), 2), normal((32, 1), 3))


class Plain:
    """No scaling: the float32 reference's stand-in for the optimizer."""

    def scale_loss(self, loss):
        return loss

    get_scaled_loss = scale_loss

    def get_unscaled_gradients(self, grads):
        return grads

    def apply(self, grads, variables):
        for g, v in zip(grads, variables):
            v.assign_sub(LR * g)

    def apply_gradients(self, pairs):
        self.apply(*zip(*pairs))


def sam_step(optimizer, model, x, y, *unused):
    """Sharpness-aware minimisation, written functionally: the unscaled
    gradient sets the perturbation, the gradient at the perturbed weights
    (through `stateless_call`) is applied to the weights."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        scaled = optimizer.scale_loss(mse(y, model(x, training=True)))
    grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
    norm = tf.linalg.global_norm(grads)
    perturbation = [RHO * g / norm for g in grads]
    with tf.GradientTape() as tape:
        perturbed = [v + e for v, e in zip(variables, perturbation)]
        pred, _ = model.stateless_call(perturbed, model.non_trainable_variables, x,
                                       training=True)
        scaled = optimizer.scale_loss(mse(y, pred))
    optimizer.apply(tape.gradient(scaled, variables), variables)


def maml_step(optimizer, model, x, y, x_query, y_query):
    """A MAML-style step: an inner SGD step on unscaled gradients (second
    order, inside the outer tape), the query loss at the adapted weights."""
    variables = model.trainable_variables
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            scaled = optimizer.scale_loss(mse(y, model(x, training=True)))
        grads = optimizer.get_unscaled_gradients(inner.gradient(scaled, variables))
        adapted = [v - INNER_LR * g for v, g in zip(variables, grads)]
        pred, _ = model.stateless_call(adapted, model.non_trainable_variables, x_query,
                                       training=True)
        scaled = optimizer.scale_loss(mse(y_query, pred))
    optimizer.apply(outer.gradient(scaled, variables), variables)


def update(step, optimizer, model, eager):
    before = [v.numpy() for v in model.trainable_variables]
    run = step if eager else tf.function(step, autograph=False)
    run(optimizer, model, *batches())
    return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]


def assert_same_update(update, reference, rtol):
    flat = np.concatenate([u.ravel() for u in update])
    ref = np.concatenate([u.ravel() for u in reference])
    error = np.linalg.norm(flat - ref) / np.linalg.norm(ref)
    assert error < rtol, f"update error {error:.3g}, norm {np.linalg.norm(flat):.4g} " \
        f"against {np.linalg.norm(ref):.4g}"


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("step", [sam_step, maml_step], ids=["sam", "maml"])
def test_a_step_that_unscales_for_its_own_use_applies_float32s_update(
    step, mode, eager, float16_policy
):
    model, twin = models()
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), **mode)
    optimizer.build(model.trainable_variables)
    reference = update(step, Plain(), twin, eager=True)
    ours = update(step, optimizer, model, eager)
    assert int(optimizer.skipped_steps) == 0
    assert_same_update(ours, reference, rtol=2e-2)
    # The adaptive scale saw gradients at the scale they carried.
    assert float(optimizer.loss_scale) >= 2.0**8


def tf_keras_idiom(optimizer, model, x, y, *unused):
    """tf-keras's loop: unscale, clip (by a norm never reached), apply."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        scaled = optimizer.get_scaled_loss(mse(y, model(x, training=True)))
    grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
    grads, _ = tf.clip_by_global_norm(grads, 1e6)
    optimizer.apply_gradients(zip(grads, variables))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_the_tf_keras_idiom_gives_one_update_eager_and_traced(mode, eager, float16_policy):
    model, twin = models()
    unscaled, _ = models()
    optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), **mode)
    ours = update(tf_keras_idiom, optimizer, model, eager)
    # float32's update, to float16's rounding: eager and traced float16
    # kernels round differently (oneDNN's eager float16 matmul on a CPU with
    # AVX-512 float16, 5e-4 apart), so the two paths are compared with it.
    assert_same_update(ours, update(tf_keras_idiom, Plain(), twin, eager=True), rtol=2e-2)
    # The same float16 kernels without any scaling: a power-of-two scale and
    # its exact unscaling change nothing but underflow (1.4e-6 here), so one update,
    # divided once, equals it.
    assert_same_update(ours, update(tf_keras_idiom, Plain(), unscaled, eager), rtol=1e-5)


def test_unscaling_in_one_function_and_applying_in_another(float16_policy):
    """The mark is state, not graph: it crosses `tf.function` boundaries,
    and a later `scale_loss` clears it."""
    model, twin = models()
    optimizer = tas.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(LR), scaling="static", initial_scale=2.0**10
    )
    variables = model.trainable_variables
    x, y = batches()[:2]

    @tf.function
    def unscaled_gradients(x, y):
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(mse(y, model(x, training=True)))
        return optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))

    @tf.function
    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))

    optimizer.build(variables)
    assert not optimizer.gradients_unscaled.numpy()
    before = [v.numpy() for v in variables]
    apply(unscaled_gradients(x, y))
    assert not optimizer.gradients_unscaled.numpy()  # consumed
    reference = update(tf_keras_idiom, Plain(), twin, eager=True)
    assert_same_update([v.numpy() - b for v, b in zip(variables, before)], reference, 2e-2)
    # A mark left by a call whose gradients were never applied (logging,
    # say) is cleared by the next step's `scale_loss`.
    unscaled_gradients(x, y)
    before = [v.numpy() for v in variables]
    with tf.GradientTape() as tape:
        scaled = optimizer.scale_loss(mse(y, model(x, training=True)))
    optimizer.apply(tape.gradient(scaled, variables), variables)
    changes = [np.linalg.norm(v.numpy() - b) for v, b in zip(variables, before)]
    assert max(changes) < 1.0, changes  # divided by 2**10, not applied scaled
