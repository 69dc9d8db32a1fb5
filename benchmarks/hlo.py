"""`fit`'s compiled step as XLA optimizes it, and counts of its kernels.

Shared by `kernel_census.py`, `profile_step.py`, `gpu_check.py` and the
tests that count kernels (`tests/helpers.py` imports it). Only Keras is
imported at the top: TensorFlow where the backend is TensorFlow.
"""

import re

import keras

from tf_adaptive_scale.per_layer import step_programs

# Instructions of an entry computation that launch nothing.
NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def fit_state(model):
    """The `(trainable, non-trainable, optimizer, metrics)` state that
    Keras's JAX `train_step` takes (built: after a first step or
    `model._symbolic_build`)."""
    return tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))


def optimized_fit_program(model, optimizer, x, y, loss="mse", measuring=True, donated=False):
    """The optimized XLA program (HLO text) of `model.fit`'s step (per
    layer, its measuring program, or with `measuring=False` its plain one);
    on JAX with the state `donated` as `fit` donates it (its outputs may
    overwrite their inputs' buffers)."""
    model.compile(optimizer, loss, jit_compile=True)
    if keras.backend.backend() == "jax":
        import jax

        model.train_on_batch(x, y)  # builds the state the step takes
        with step_programs.measuring(measuring):
            return jax.jit(model.train_step, donate_argnums=0 if donated else ()).lower(
                fit_state(model), (x, y)).compile().as_text()
    import tensorflow as tf

    # Traced once, here (its first trace may create the metrics' variables;
    # a first `train_on_batch` would compile the same step twice).
    step = tf.function(lambda xb, yb: model.train_step((xb, yb)), jit_compile=True)
    with step_programs.measuring(measuring):
        return step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")


def top_level_kernels(hlo):
    """The opcodes of an optimized HLO module's top-level kernels: the
    instructions of its entry computation other than parameters,
    constants, tuples and bitcasts (one launch each on a GPU)."""
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    return [op for op in re.findall(r"= \S+ ([a-z\-]+)\(", entry) if op not in NOT_KERNELS]


def conditionals(hlo):
    """The number of `conditional` instructions in an HLO module's text."""
    return len(re.findall(r"\sconditional\(", hlo))
