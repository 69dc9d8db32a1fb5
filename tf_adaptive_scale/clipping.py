"""Gradient clipping transforms, applied to unscaled gradients.

Each transform takes a list of gradient tensors and returns the clipped list
and a boolean scalar telling whether it changed anything, so the optimizer can
count how often clipping acted. AutoClip's history is a fixed-size ring buffer
that the caller keeps in a variable; these functions only compute.
"""

from keras import ops


def global_norm(grads):
    """The L2 norm of all `grads` taken together, as float32.

    Args:
        grads: A list of tensors.

    Returns:
        A float32 scalar.
    """
    return ops.sqrt(sum(ops.sum(ops.square(_f32(g))) for g in grads))


def clip_by_value(grads, limit):
    """Clips every element to `[-limit, limit]`.

    Args:
        grads: A list of tensors.
        limit: Positive float.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    acted = _any([ops.max(ops.abs(g)) > limit for g in grads])
    return [ops.clip(g, -limit, limit) for g in grads], acted


def clip_by_norm(grads, max_norm):
    """Rescales each tensor whose own L2 norm exceeds `max_norm`.

    Args:
        grads: A list of tensors.
        max_norm: Positive float or float32 tensor of shape `(len(grads),)`.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    norms = ops.stack([ops.sqrt(ops.sum(ops.square(_f32(g)))) for g in grads])
    factors = _shrink_factors(norms, max_norm)
    clipped = [_scale(g, factors[i]) for i, g in enumerate(grads)]
    return clipped, ops.any(norms > max_norm)


def clip_by_global_norm(grads, max_norm):
    """Rescales all tensors together when their global norm exceeds `max_norm`.

    Args:
        grads: A list of tensors.
        max_norm: Positive float or float32 scalar tensor.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    norm = global_norm(grads)
    factor = _shrink_factors(norm, max_norm)
    return [_scale(g, factor) for g in grads], norm > max_norm


def adaptive_grad_clip(grads, params, factor, eps):
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021).

    A unit (one output unit of a kernel: all axes but the last; one element of
    a vector) is clipped when its gradient norm exceeds `factor` times its
    weight norm, the weight norm being at least `eps`.

    Args:
        grads: A list of tensors.
        params: The matching list of weights.
        factor: Positive float, the largest allowed gradient/weight ratio.
        eps: Positive float, the smallest weight norm.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    clipped, acted = [], []
    for g, p in zip(grads, params):
        max_norm = ops.maximum(_unitwise_norm(p), eps) * factor
        g_norm = _unitwise_norm(g)
        clipped.append(_scale(g, _shrink_factors(g_norm, max_norm)))
        acted.append(ops.any(g_norm > max_norm))
    return clipped, _any(acted)


def push_history(history, count, values):
    """Writes `values` into slot `count % window` of a ring buffer.

    Args:
        history: float32 tensor `(..., window)`.
        count: int scalar, how many values were pushed before.
        values: float32 tensor `(...)`.

    Returns:
        The new history.
    """
    window = history.shape[-1]
    slot = ops.one_hot(ops.mod(count, window), window, dtype="bool")
    return ops.where(slot, ops.expand_dims(values, -1), history)


def history_percentile(history, count, percentile):
    """The `percentile` of the filled part of a ring buffer.

    Linear interpolation between order statistics, as `numpy.percentile`.

    Args:
        history: float32 tensor `(..., window)`.
        count: int scalar, how many values were pushed (at least 1).
        percentile: float in (0, 100].

    Returns:
        float32 tensor `(...)`.
    """
    window = history.shape[-1]
    filled = ops.cast(ops.minimum(count, window), "float32")
    unfilled = ops.arange(window, dtype="float32") >= filled
    ordered = ops.sort(ops.where(unfilled, float("inf"), history), axis=-1)
    position = percentile / 100.0 * (filled - 1.0)
    below = ops.floor(position)
    above = ops.minimum(below + 1.0, filled - 1.0)
    low = _take_last(ordered, below)
    high = _take_last(ordered, above)
    return low + (position - below) * (high - low)


def _take_last(x, index):
    index = ops.cast(index, "int32") * ops.ones(x.shape[:-1], "int32")
    return ops.squeeze(
        ops.take_along_axis(x, ops.expand_dims(index, -1), axis=-1), -1
    )


def _unitwise_norm(x):
    x = _f32(x)
    if len(x.shape) <= 1:
        return ops.abs(x)
    axes = tuple(range(len(x.shape) - 1))
    return ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=True))


def _shrink_factors(norms, max_norm):
    """max_norm / norm where the norm exceeds it, else 1 (never divides 0)."""
    return ops.where(
        norms > max_norm, max_norm / ops.maximum(norms, 1e-30), 1.0
    )


def _scale(g, factor):
    return g * ops.cast(factor, g.dtype)


def _f32(x):
    return ops.cast(x, "float32")


def _any(flags):
    return ops.any(ops.stack(flags))
