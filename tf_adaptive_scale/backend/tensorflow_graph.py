"""What the optimizer reads off TensorFlow graphs while a step is traced.

TensorFlow-specific by nature: Keras has no backend-neutral view of how a
tensor was computed. One question is answered here: did the model compute
in float16? A float32 weight used by a float16 layer has a gradient made by
a `Cast` from float16 (autocasting), which the optimizer's default mode
keys on. (Whether gradients are unscaled already is the step's state, not
read off the graph: see `AdaptiveLossScaleOptimizer.get_unscaled_gradients`.)
"""

import contextlib

import tensorflow as tf

# Ops a gradient passes through between a float16 computation and the
# optimizer (sums of shared weights' gradients, identities, slices).
_PASS_THROUGH = {"AddN", "AddV2", "Identity", "IdentityN", "Reshape"}


def computes_in_float16(grads):
    """Whether any gradient comes from a float16 computation.

    Args:
        grads: Gradient tensors (dense; graph or eager).

    Returns:
        A Python bool (eager tensors are judged by their dtype alone).
    """
    return any(_from_float16(g, depth=4) for g in grads)


def _from_float16(tensor, depth):
    if tensor.dtype == tf.float16:
        return True
    if tf.executing_eagerly() or not hasattr(tensor, "op") or depth == 0:
        return False
    op = tensor.op
    if op.type == "Cast":
        return op.inputs[0].dtype == tf.float16
    if op.type in _PASS_THROUGH:
        return any(_from_float16(t, depth - 1) for t in op.inputs)
    return False


def assign_now(variable, value):
    """Sets `variable` to `value` outside any trace, on every device.

    For a decision taken once, by whichever replica traces first: assigning
    a mirrored variable from one replica would wait for the others (a
    `merge_call` they never make), so each device's copy is set directly.
    """
    with tf.init_scope():
        mirrored = variable.value
        for copy in getattr(mirrored, "values", (mirrored,)):
            copy.assign(value)


@contextlib.contextmanager
def variables_made_now():
    """Variables created in this scope are made eagerly, as if before the
    trace, even when the step that builds the optimizer is being traced.

    A `tf.function` that creates variables on its first trace (Keras's
    `train_step` builds the optimizer lazily there) traces and compiles
    the whole step a second time, without them. Made outside the trace
    (`init_scope`) and not lifted into it, they are ordinary variables to
    the function, which then traces once. Under a `tf.distribute` strategy
    Keras builds the optimizer before tracing, and the strategy's own
    variable creators stay untouched.
    """
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        yield
        return

    def not_lifted(next_creator, **kwargs):
        return next_creator(**dict(kwargs, experimental_enable_variable_lifting=False))

    with tf.init_scope(), tf.variable_creator_scope(not_lifted):
        yield
