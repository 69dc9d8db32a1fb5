"""What the optimizer needs that differs between Keras backends.

On TensorFlow: `tf.distribute` (`distribution`) and what can be read off a
traced graph (`tensorflow_graph`). On JAX neither exists and TensorFlow is
never imported: a step is one SPMD program (under `keras.distribution` XLA
sums the gradients over devices, so every decision taken on them is the
same on all devices), and a model's float16 computation is known from the
dtype policy only.
"""

import contextlib

import keras

TENSORFLOW = keras.backend.backend() == "tensorflow"
if keras.backend.backend() not in ("tensorflow", "jax"):
    raise ImportError(
        "tf_adaptive_scale runs on the TensorFlow and JAX Keras backends; "
        f"the backend is {keras.backend.backend()!r} (set KERAS_BACKEND)."
    )

if TENSORFLOW:
    import tensorflow as tf

    # Step counters, int64 as in the stock optimizer.
    COUNTER_DTYPE = "int64"

    # What a TensorFlow checkpoint saves by attribute name.
    Trackable = tf.__internal__.tracking.Trackable

    def convert_with(cls, to_tensor):
        """Lets TensorFlow ops take a `cls` as the tensor `to_tensor` gives."""
        tf.register_tensor_conversion_function(
            cls, lambda x, dtype=None, name=None, as_ref=False: to_tensor(x))

    from tf_adaptive_scale.backend.distribution import replica_weight
    from tf_adaptive_scale.backend.distribution import run_step
    from tf_adaptive_scale.backend.tensorflow_graph import assign_now
    from tf_adaptive_scale.backend.tensorflow_graph import computes_in_float16
    from tf_adaptive_scale.backend.tensorflow_graph import variables_made_now

    def has_strategy():
        """Whether a `tf.distribute` strategy is in scope."""
        return tf.distribute.has_strategy()

    # The optimizer's entry points, called from a user's `tf.function`, run
    # as written: AutoGraph would otherwise rewrite every function of the
    # package they call (it skips Keras's and TensorFlow's own), which made
    # tracing a step several seconds longer. Conditionals are `ops.cond`.
    not_converted = tf.autograph.experimental.do_not_convert

else:
    import jax

    # int64 only where JAX has it enabled (it would be truncated, warning).
    COUNTER_DTYPE = "int64" if jax.config.jax_enable_x64 else "int32"

    # No TensorFlow checkpoints.
    Trackable = object

    def convert_with(cls, to_tensor):
        """JAX asks the object itself (`__jax_array__`)."""

    def run_step(
        step_fn, inner_optimizer, grads, variables, statistics=(),
        replica_statistics=None,
    ):
        """One optimizer step: `distribution.run_step` without replicas."""
        step_fn(
            grads + [t for t, _ in statistics],
            lambda applied, _: inner_optimizer.apply(applied, variables),
        )

    def replica_weight(normaliser):
        """One program computes the global batch's loss: nothing to weigh."""
        return 1.0

    def assign_now(variable, value):
        """Sets `variable` to `value` (outside a trace: decided at `build`)."""
        variable.assign(value)

    def computes_in_float16(grads):
        """Whether any gradient is float16 (JAX traces keep no graph to read)."""
        return any(keras.backend.standardize_dtype(g.dtype) == "float16" for g in grads)

    def has_strategy():
        """No `tf.distribute` off TensorFlow."""
        return False

    def variables_made_now():
        """JAX traces never own variables: nothing to do."""
        return contextlib.nullcontext()

    def not_converted(fn):
        """No AutoGraph off TensorFlow."""
        return fn

