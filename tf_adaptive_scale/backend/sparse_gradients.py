"""Sparse gradients kept sparse: what the optimizer does to their values.

An `Embedding` or a gather has a row-sparse gradient: `tf.IndexedSlices` on
TensorFlow, a `jax.experimental.sparse.BCOO` on JAX. Densifying it costs a
vocabulary-sized tensor and update per step, so the optimizer works on the
stored values instead: unscaling and clipping factors multiply them, the
finite check and the statistics read them, and the inner optimizer gets the
gradient back in its own sparse form.

The stored rows may repeat an index (one per occurrence of a token); their
sum is the gradient. Whatever is not linear in the gradient (norms,
elementwise clipping) takes `summed(g)`, where each index appears once.
"""

import keras

_TENSORFLOW = keras.backend.backend() == "tensorflow"

if _TENSORFLOW:
    import tensorflow as tf

    def is_sparse(gradient):
        """Whether `gradient` is a row-sparse gradient."""
        return isinstance(gradient, tf.IndexedSlices)

    def values(gradient):
        """The stored values of a sparse gradient; a dense one as it is."""
        return gradient.values if is_sparse(gradient) else gradient

    def with_values(gradient, new_values):
        """`gradient` with `new_values` in place of its stored values."""
        if not is_sparse(gradient):
            return new_values
        return tf.IndexedSlices(new_values, gradient.indices, gradient.dense_shape)

    def summed(gradient):
        """A sparse gradient whose repeated indices are summed into one row
        (what a dense gradient holds there); a dense one as it is."""
        if not is_sparse(gradient):
            return gradient
        unique, position = tf.unique(gradient.indices)
        rows = tf.math.unsorted_segment_sum(
            gradient.values, position, tf.shape(unique)[0]
        )
        return tf.IndexedSlices(rows, unique, gradient.dense_shape)

    def indices(gradient):
        """The row index of each stored value of a sparse gradient."""
        return gradient.indices

    def dense(gradient):
        """`gradient` as a dense tensor."""
        return tf.convert_to_tensor(gradient)

else:
    from jax.experimental import sparse as jax_sparse

    def is_sparse(gradient):
        """Whether `gradient` is a row-sparse gradient."""
        return isinstance(gradient, jax_sparse.BCOO)

    def values(gradient):
        """The stored values of a sparse gradient; a dense one as it is."""
        return gradient.data if is_sparse(gradient) else gradient

    def with_values(gradient, new_values):
        """`gradient` with `new_values` in place of its stored values."""
        if not is_sparse(gradient):
            return new_values
        return jax_sparse.BCOO((new_values, gradient.indices), shape=gradient.shape)

    def summed(gradient):
        """A sparse gradient whose repeated indices are summed into one row
        (what a dense gradient holds there); a dense one as it is."""
        if not is_sparse(gradient):
            return gradient
        # The same number of stored rows (static under jit); the freed ones
        # hold zeros.
        return jax_sparse.bcoo_sum_duplicates(gradient, nse=gradient.nse)

    def indices(gradient):
        """The row index of each stored value of a sparse gradient."""
        return gradient.indices[:, 0]

    def dense(gradient):
        """`gradient` as a dense tensor."""
        return gradient.todense() if is_sparse(gradient) else gradient


def map_values(fn, gradient):
    """`fn` applied to the stored values of `gradient` (a linear or
    elementwise map, for which the stored rows stand for the gradient)."""
    return with_values(gradient, fn(values(gradient)))


def rows_of(variable, gradient):
    """What of `variable` lines up with `values(gradient)` for unit-wise
    work (AGC): the variable itself, or a vector's entries at a sparse
    gradient's indices (the units of a vector are its entries; those of a
    matrix span all its rows, so it stays whole)."""
    if is_sparse(gradient) and len(variable.shape) == 1:
        return keras.ops.take(variable, indices(gradient), axis=0)
    return variable
