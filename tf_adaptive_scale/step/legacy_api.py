"""The tf-keras loss-scaling API's unscaling (`get_unscaled_gradients`), for
loops written for tf-keras's `LossScaleOptimizer`."""

import keras

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.backend import sparse_gradients as sparse
from tf_adaptive_scale.numerics import gradient_statistics as stats


def check_unscaling(policy):
    """Refuses `get_unscaled_gradients` where it cannot be exact: off
    TensorFlow, and per layer (`policy`: the optimizer's, or None)."""
    if not backends.TENSORFLOW:
        raise ValueError(
            "get_unscaled_gradients() is a legacy tf-keras API, TensorFlow "
            f"only (backend: {keras.backend.backend()!r}): pass the gradients "
            "of the scaled loss to apply() or stateless_apply() as they are."
        )
    if policy is not None and policy.per_layer:
        raise ValueError(
            "get_unscaled_gradients() knows no per-layer scales: with "
            "scaling='per_layer', pass the gradients to apply() as they are."
        )


def unscaled(grads, log2_scale):
    """`grads` divided by `2**log2_scale` (None entries kept; sparse ones
    stay sparse)."""
    reciprocal = stats.pow2(-log2_scale)
    return [
        None if g is None else sparse.with_values(g, stats.times(sparse.values(g), reciprocal))
        for g in grads
    ]
