"""tf.distribute plumbing: one optimizer step over gradients of all replicas.

Stock Keras checks only replica 0's gradients for overflow under
`MirroredStrategy` (its merge_call path), so an overflow on another replica
reaches the weights. Here the gradients are summed over replicas first, and the
whole decision (finite check, statistics, scale update, clipping) runs once, in
cross-replica context, on the summed gradients; every replica then applies the
same result.
"""

import tensorflow as tf


def run_step(step_fn, inner_apply, grads, variables):
    """Runs one optimizer step on gradients summed over all replicas.

    Args:
        step_fn: `step_fn(grads, apply_fn)` decides and updates the optimizer's
            own state from the summed gradients and calls `apply_fn(grads)`
            with the gradients to apply (or not, to skip the step).
        inner_apply: `inner_apply(grads, variables)`, the inner optimizer's
            `apply`. It sums its gradients over replicas itself.
        grads: This replica's gradients (no `None`).
        variables: The matching variables.

    Returns:
        None.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError(
            "`apply()` must be called in a replica context, e.g. inside "
            "`strategy.run`, not in cross-replica context."
        )
    replicas = context.num_replicas_in_sync
    if replicas == 1:
        step_fn(grads, lambda applied: inner_apply(applied, variables))
        return

    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)

    def cross_replica(strategy, summed):
        # All replicas hold the same sum: decide once, on replica 0's copy.
        local = [strategy.experimental_local_results(g)[0] for g in summed]

        def apply_on_every_replica(applied):
            # The inner optimizer all-reduces (sums) again: hand each replica
            # an equal share so that the sum is the decided gradient. Each
            # replica makes its own share: one tensor passed to all replicas
            # would be merged back into a value with no device to reduce to.
            def apply_share(applied):
                inner_apply([g / replicas for g in applied], variables)

            strategy.extended.call_for_each_replica(
                apply_share, args=(applied,)
            )

        step_fn(local, apply_on_every_replica)

    context.merge_call(cross_replica, args=(summed,))
