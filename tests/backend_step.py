"""Compiled optimizer steps on whichever Keras backend the tests run on.

TensorFlow: `optimizer.apply` inside a `tf.function`. JAX: a jitted
`optimizer.stateless_apply` whose results are written back to the variables
(what Keras's JAX trainer does); eagerly, without `jit`.
"""

import keras
import numpy as np


def stepper(optimizer, variables, jit=True):
    """`step(*grads)`: one `optimizer.apply(grads, variables)`, compiled."""
    variables = list(variables)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=jit)
        def step(*grads):
            optimizer.apply(list(grads), variables)

        return step
    import jax

    def pure(optimizer_values, values, grads):
        return optimizer.stateless_apply(optimizer_values, grads, values)

    pure = jax.jit(pure) if jit else pure

    def step(*grads):
        grads = [keras.ops.convert_to_tensor(np.asarray(g, "float32")) for g in grads]
        new_values, new_optimizer_values = pure(
            [v.value for v in optimizer.variables], [v.value for v in variables], grads
        )
        for v, value in zip(variables, new_values):
            v.assign(value)
        for v, value in zip(optimizer.variables, new_optimizer_values):
            v.assign(value)

    return step
