"""The tf-keras loss-scaling API (`get_scaled_loss`, `get_unscaled_gradients`),
for loops written for tf-keras's `LossScaleOptimizer`."""

import keras
from keras import ops

from tf_adaptive_scale import backends
from tf_adaptive_scale import gradient_statistics as stats
from tf_adaptive_scale import sparse_gradients as sparse


class LegacyLossScaleAPI:
    """Mixed into `AdaptiveLossScaleOptimizer`: the tf-keras names, on top
    of its `scale_loss`, step state and `policy`."""

    @backends.not_converted
    def get_scaled_loss(self, loss):
        """Legacy tf-keras name of `scale_loss` (`loss` may be a callable).

        Args:
            loss: The loss, or a callable returning it.

        Returns:
            The scaled loss (a callable returning it, for a callable).
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    @backends.not_converted
    def get_unscaled_gradients(self, grads):
        """Legacy tf-keras API: divides `grads` by the scale of this step's
        loss, and marks the step: the next `apply` (or `apply_gradients`)
        takes its gradients as unscaled, unless a `scale_loss` begins a new
        step first (docs/custom_loops.md, "The step protocol").

        Args:
            grads: Gradients of the scaled loss (None entries kept; sparse
                ones stay sparse).

        Returns:
            The list of unscaled gradients.
        """
        if not backends.TENSORFLOW:
            raise ValueError(
                "get_unscaled_gradients() is a legacy tf-keras API, TensorFlow "
                f"only (backend: {keras.backend.backend()!r}): pass the gradients "
                "of the scaled loss to apply() or stateless_apply() as they are."
            )
        if self.policy is not None and self.policy.per_layer:
            raise ValueError(
                "get_unscaled_gradients() knows no per-layer scales: with "
                "scaling='per_layer', pass the gradients to apply() as they are."
            )
        log2_current = ops.round(ops.log2(self.dynamic_scale.value))
        reciprocal = stats.pow2(-self._log2_loss_scale(log2_current))
        self.gradients_unscaled.assign(True)
        return [
            None if g is None else sparse.with_values(g, stats.times(sparse.values(g), reciprocal))
            for g in grads
        ]
