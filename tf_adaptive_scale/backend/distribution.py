"""tf.distribute plumbing: one optimizer step over gradients of all replicas.

Stock Keras checks only replica 0's gradients for overflow under
`MirroredStrategy` (its merge_call path), so an overflow on another replica
reaches the weights. Here the gradients are summed over replicas first (the
step's one gradient all-reduce, as in stock Keras; each replica's own
gradient statistics travel in the same call), and the whole decision
(finite check, scale update, clipping) runs once, in cross-replica context,
on replica 0's copy of the sum and the replicas' statistics; every replica then
applies the same transformation to its own, equal, copy of the sum, and the
inner optimizer updates each replica's weights from it without reducing again.
"""

import tensorflow as tf

from tf_adaptive_scale.backend import keras_internals


def run_step(
    step_fn, inner_optimizer, grads, variables, statistics=(), replica_statistics=None
):
    """Runs one optimizer step on gradients summed over all replicas.

    Args:
        step_fn: `step_fn(grads, apply_fn)` decides and updates the optimizer's
            own state from the summed gradients and, to take the step, calls
            `apply_fn(applied, transform)`: the gradients to apply, and the
            pure function that makes them from the summed gradients.
        inner_optimizer: The wrapped Keras optimizer.
        grads: This replica's gradients (no `None`); the first
            `len(variables)` belong to `variables`.
        variables: The variables the inner optimizer updates.
        statistics: `(tensor, combine)` pairs of small per-replica statistics
            handed to `step_fn` after `grads`: each is gathered from every
            replica (stacked on a new first axis) and `combine`d.
        replica_statistics: Optional `() -> [(tensor, combine), ...]`,
            statistics taken only under a strategy (without one, the summed gradients
            are this replica's own), gathered like `statistics` and handed to
            `step_fn` last.

    Returns:
        None.
    """
    context = _replica_context()
    # The default strategy only: under any other, even with one replica, the
    # inner optimizer's apply makes a merge_call, which cannot run inside
    # the step's conditionals: it goes the cross-replica way below.
    if context.num_replicas_in_sync == 1 and not tf.distribute.has_strategy():
        step_fn(
            grads + [t for t, _ in statistics],
            lambda applied, _: inner_optimizer.apply(applied, variables),
        )
        return
    if replica_statistics is not None:
        statistics = [*statistics, *replica_statistics()]
    summed, gathered = _all_reduce(context, grads, statistics)
    context.merge_call(
        _step_once(step_fn, inner_optimizer, variables), args=(summed, gathered)
    )


def _replica_context():
    """The replica context `apply` runs in; refuses cross-replica context."""
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError(
            "`apply()` must be called in a replica context, e.g. inside "
            "`strategy.run`, not in cross-replica context."
        )
    return context


def _all_reduce(context, grads, statistics):
    """`(summed, gathered)`: the gradients summed over the replicas, and
    each statistic gathered from every replica and `combine`d.

    Gathered by the same all-reduce as the gradients: each replica sends
    its statistics in its own row of zeros. One collective kind, one call,
    a few kilobytes more.
    """
    replicas = context.num_replicas_in_sync
    rows = tf.one_hot(context.replica_id_in_sync_group, replicas)
    placed = [
        tf.reshape(rows, (replicas,) + (1,) * t.shape.rank) * t[None]
        for t, _ in statistics
    ]
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads + placed)
    gathered = [
        combine(t) for t, (_, combine) in zip(summed[len(grads) :], statistics)
    ]
    return summed[: len(grads)], gathered


def _step_once(step_fn, inner_optimizer, variables):
    """The `merge_call` function: `step_fn` decides once, in cross-replica
    context, on replica 0's copy of the sums (equal on every replica)."""

    def cross_replica(strategy, summed, gathered):
        local = [
            strategy.experimental_local_results(g)[0] for g in summed + gathered
        ]
        step_fn(
            local,
            lambda applied, transform: _apply_on_every_replica(
                strategy, inner_optimizer, variables, summed, transform
            ),
        )

    return cross_replica


def _apply_on_every_replica(strategy, inner_optimizer, variables, summed, transform):
    """Each replica applies `transform` of its own copy of the sums."""

    def apply_replica(summed):
        inner_optimizer.apply(transform(summed[: len(variables)]), variables)

    # Replicas run in threads of their own: switch around them all.
    with keras_internals.gradients_already_summed(inner_optimizer):
        strategy.extended.call_for_each_replica(apply_replica, args=(summed,))


def replica_weight(normaliser):
    """What one replica's mean loss is multiplied by so that the replicas'
    summed gradients are those of the global batch's mean: its normaliser
    times the replica count over the global normaliser (1 without replicas).

    Keras divides each replica's loss by the replica count and by its own
    normaliser, which differ where a mask leaves a different number of
    entries on each replica.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return 1.0
    total = context.all_reduce("sum", normaliser)
    return tf.math.divide_no_nan(normaliser * context.num_replicas_in_sync, total)
