"""The tf-keras loss-scaling API (`get_scaled_loss`, `get_unscaled_gradients`),
for loops written for tf-keras's `LossScaleOptimizer`."""

from keras import ops

from tf_adaptive_scale import backends
from tf_adaptive_scale import gradient_statistics as stats
from tf_adaptive_scale import sparse_gradients as sparse


class LegacyLossScaleAPI:
    """Mixed into `AdaptiveLossScaleOptimizer`: the tf-keras names, on top
    of its `scale_loss`, `dynamic_scale` and `policy`."""

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
        """Legacy tf-keras API: divides `grads` by the current scale.

        Its results (or tensors computed from them in the same traced
        function) passed to `apply` are applied as they are; eagerly, only
        its very results are recognised.

        Args:
            grads: Gradients of the scaled loss (None entries kept; sparse
                ones stay sparse).

        Returns:
            The list of unscaled gradients.
        """
        if self.policy is not None and self.policy.per_layer:
            raise ValueError(
                "get_unscaled_gradients() knows no per-layer scales: with "
                "scaling='per_layer', pass the gradients to apply() as they are."
            )
        reciprocal = stats.pow2(-ops.log2(self.dynamic_scale.value))
        unscaled = [
            None if g is None else stats.times(sparse.values(g), reciprocal) for g in grads
        ]
        return [
            None if g is None else sparse.with_values(g, u)
            for g, u in zip(grads, backends.mark_unscaled(unscaled))
        ]
