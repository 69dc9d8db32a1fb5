"""Gradient magnitude statistics: what a gradient measures, not what to do about it.

The statistic is a histogram of float exponents, `floor(log2(|g|))`, over the
nonzero finite values of one or more tensors: O(N), one pass, fixed size, and
XLA-friendly (a segment sum). From it the adaptive rule (`rules.adaptive_rule`)
reads the fraction of values that would fall below float16's smallest
subnormal at any power-of-two scale, without a second pass over the gradients.

All functions work on the last axis, so a stack of histograms (one row per
tensor, as the per-layer scales need) goes through the same code.
"""

import typing

import keras
import numpy as np
from keras import ops

from tf_adaptive_scale.backend import sparse_gradients as sparse
from tf_adaptive_scale.numerics.float16 import EXPONENT_MIN
from tf_adaptive_scale.numerics.float16 import NUM_BINS

_ZERO_BIN = NUM_BINS
_NON_FINITE_BIN = NUM_BINS + 1
_BINS_WITH_EXTRAS = NUM_BINS + 2
# `_bin_counts`' last column: the sum of squares of the finite values.
_SQUARES = _BINS_WITH_EXTRAS
# Tensors of fewer values share one segment sum (see `grouped_statistics`).
_SMALL = 1 << 14
# The optimizer counts exponents on every step on a fixed strided sample of
# at most this many values per activation gradient at a per-layer boundary
# (see `grouped_statistics`): at 8192 a transformer unit's underflow bound
# missed the exact one by 2 binades.
SAMPLE = 1 << 14
# ... and of at most this many per weight gradient: they are summed over the
# variables for the global rule and the monitor, and a sample's scatter is a
# serial loop on CPU (an MLP's step: 1.06x stock at 16384, 1.00x at 2048).
VARIABLE_SAMPLE = 1 << 11


def pow2(exponent):
    """`2**exponent`, exact, for integer-valued float exponents.

    `ops.power(2.0, x)` goes through exp/log and can miss the power of two by
    an ulp (2**13 -> 8191.9946 under XLA on CPU); this builds the float32
    bits instead. Exponents are clipped to float32's normal range [-126, 127].

    Args:
        exponent: float or int tensor of integer values.

    Returns:
        float32 tensor of the same shape.
    """
    exponent = ops.convert_to_tensor(exponent, "float32")
    # Rounded: exponents from ops.log2 can be an ulp off an integer.
    biased = ops.cast(ops.round(ops.clip(exponent, -126, 127)), "int32") + 127
    return ops.view(ops.left_shift(biased, 23), "float32")


def times(x, factor, dtype=None):
    """`x * factor` (a float32 power of two), computed in float32, or in
    float64 where `x` or `dtype` is float64 (exact there too), returned in
    `dtype` (default: `x`'s).

    Args:
        x: A float tensor.
        factor: A float32 scalar tensor.
        dtype: Optional dtype of the result.

    Returns:
        The product.
    """
    dtype = dtype or x.dtype
    dtypes = {keras.backend.standardize_dtype(d) for d in (x.dtype, dtype)}
    wide = "float64" if "float64" in dtypes else "float32"
    return ops.cast(ops.cast(x, wide) * ops.cast(factor, wide), dtype)


class GroupStatistics(typing.NamedTuple):
    """What `grouped_statistics` returns, per group (see there)."""

    histograms: typing.Any
    max_abs: typing.Any
    zeros: typing.Any
    non_finite: typing.Any
    squares: typing.Any
    # `(groups, _SQUARES + 1)`: the histograms, zeros, sampled non-finite
    # counts and squares, as one matrix (`total` sums it in one reduction).
    counts: typing.Any

    def total(self):
        """All groups as one, each field without its group axis: counts
        and squares summed, the largest peak, and the largest `non_finite`
        (nonzero where any group's is), in two reductions over the groups
        whatever their number."""
        summed = ops.sum(self.counts, axis=0)
        max_abs, non_finite = ops.unstack(
            ops.max(ops.stack([self.max_abs, self.non_finite], axis=1), axis=0))
        return GroupStatistics(
            histograms=summed[:NUM_BINS], max_abs=max_abs, zeros=summed[_ZERO_BIN],
            non_finite=non_finite, squares=summed[_SQUARES], counts=summed[None],
        )


def exponent_histogram(tensors, log2_scale=0.0):
    """Counts the nonzero finite values of `tensors` by binary exponent.

    Args:
        tensors: A list of tensors (any shape, any float dtype).
        log2_scale: The tensors hold values multiplied by `2**log2_scale`
            (an integer-valued scalar); the histogram and max are of the
            values divided back, without a pass to divide them.

    Returns:
        A tuple `(histogram, max_abs)`: a float32 vector of `NUM_BINS` counts,
        and the largest finite |value| (0 when there is none).

    Example:

    >>> hist, max_abs = exponent_histogram([keras.ops.array([0.5, 3.0])])
    >>> int(hist[-1 - EXPONENT_MIN]), int(hist[1 - EXPONENT_MIN])
    (1, 1)
    """
    group = grouped_statistics(tensors, [0] * len(tensors), 1, log2_scale)
    return group.histograms[0], group.max_abs[0]


def grouped_statistics(tensors, groups, num_groups, log2_scale=0.0, sample=None):
    """Per group of tensors, in one pass over all their values: the exponent
    histogram and largest |value| (as `exponent_histogram`), the numbers of
    exact zeros and of non-finite values, and the sum of squares of the
    finite values.

    The counts take one segment sum per tensor of `_SMALL` values or more
    and one for all smaller ones; peaks and squared norms are plain
    reductions per tensor, grouped afterwards.

    Args:
        tensors: A list of tensors (any shape, any float dtype).
        groups: The group index (int) of each tensor.
        num_groups: Number of groups.
        log2_scale: As in `exponent_histogram`.
        sample: Optional, for statistics on every step: all but the peaks
            are then estimated from a fixed strided sample of at most
            `sample` values per tensor (of static size), each standing for
            its share of the tensor, at a cost that does not grow with it.
            The peaks take one exact pass, which also finds non-finite
            values: a tensor holding one has the peak 0 (its step is
            skipped), and `non_finite` counts the tensors holding one. A
            tensor whose sample skips rows (see `_skips_rows`) has its
            zeros and squares exact, and its histogram from the rows
            holding its largest values where the sample saw no nonzero
            value. A group whose samples saw no nonzero value (none whose
            float32 square is not 0) though its exact peak is not 0 is
            unmeasured: its `squares` are NaN.

    Returns:
        A `GroupStatistics` of float32 tensors: `histograms`
        `(num_groups, NUM_BINS)`; `max_abs`, `zeros`, `non_finite` and
        `squares`, `(num_groups,)`; zero for an empty group.
    """
    flat = _flat_values(tensors)
    counts, partial = _counts(tensors, flat, log2_scale, sample)
    counts = _per_group(ops.segment_sum, counts, groups, num_groups)
    non_finite = counts[:, _NON_FINITE_BIN]
    if sample is None:
        peaks = _per_group(ops.segment_max, [ops.max(_of_finite(ops.abs, f)) for f in flat],
                           groups, num_groups)
    else:
        # Whether each holds one, exactly, from the peak pass alone: what
        # the finite check reads needs no sample.
        peaks, non_finite = peaks_and_non_finite(tensors, groups, num_groups)
    # An empty group's segment max is the lowest float: no peak is 0.
    peaks = ops.maximum(peaks, 0.0)
    counts = _unseen_unmeasured(counts, peaks, groups, num_groups, partial)
    return GroupStatistics(
        histograms=counts[:, :NUM_BINS],
        max_abs=peaks * pow2(-log2_scale),
        zeros=counts[:, _ZERO_BIN],
        non_finite=non_finite,
        squares=counts[:, _SQUARES],
        counts=counts,
    )


def _unseen_unmeasured(counts, peaks, groups, num_groups, partial):
    """`counts` (a row per group) with NaN squares where the samples (of
    the tensors `partial` marks) saw no nonzero value of a group whose
    exact peak is not 0: nothing of it but its peak is known.

    Read from the squares, which a sample's nonzero values make positive
    (but values below 2**-75, whose float32 squares are 0): a sum over
    each histogram would cost a reduction, a kernel of its own."""
    sampled = np.zeros(num_groups, bool)
    sampled[np.asarray(groups, int)[partial]] = True
    if not sampled.any():
        return counts
    unseen = ops.logical_and(ops.logical_and(sampled, peaks > 0), counts[:, _SQUARES] == 0)
    column = np.arange(counts.shape[1]) == _SQUARES
    return ops.where(ops.logical_and(unseen[:, None], column), np.nan, counts)


def _counts(tensors, flat, log2_scale, sample):
    """Each tensor's counts (`_counts_per_tensor`'s columns), from its sample
    (`sample`: None, all its values) scaled to its size; and per tensor
    whether its sample leaves values out (a numpy bool vector)."""
    sampled = [_strided_sample(f, sample) for f in flat]
    skipping = [i for i, t in enumerate(tensors) if _skips_rows(t, sample)]
    # Where the sample skips rows: a second sample from the rows holding
    # its largest values, counted in rows after the others'.
    sampled += [_strided_sample(_top_rows(tensors[i], sample), sample) for i in skipping]
    counts = _counts_per_tensor([f for f, _ in sampled], log2_scale)
    weights = np.array([weight for _, weight in sampled], "float32")
    counts = counts * weights[:, None]
    partial = weights[: len(tensors)] != 1.0
    if skipping:
        counts = _with_top_rows(counts, tensors, skipping)
    exact = [i for i, (t, (_, weight)) in enumerate(zip(tensors, sampled))
             if weight == 1.0 and sparse.is_sparse(t)]
    if not exact:
        return counts, partial
    # Every row: a sparse gradient's norm is of its rows summed.
    summed = [ops.reshape(sparse.values(sparse.summed(tensors[i])), (-1,)) for i in exact]
    squares = ops.scatter_update(
        counts[:, _SQUARES], [[i] for i in exact],
        ops.stack([ops.sum(_of_finite(ops.square, s)) for s in summed]),
    )
    return ops.concatenate([counts[:, :_SQUARES], squares[:, None]], axis=1), partial


def _skips_rows(tensor, size):
    """Whether `tensor` is a dense gradient of static shape whose strided
    sample of `size` values does not read each of its rows: rows that
    outnumber the sample (an embedding table's), or shorter than the
    stride (a (1000, 3) kernel's, stride 7, reads 3 rows in 7). The
    sample can miss every row that holds gradient (a multi-hot input's
    kernel, an embedding's)."""
    # A sparse one's `shape` is not read: its `dense_shape` may be a tuple.
    if size is None or sparse.is_sparse(tensor):
        return False
    shape = tuple(tensor.shape)
    if len(shape) < 2 or None in shape:
        return False
    n = int(np.prod(shape))
    if n <= size:
        return False
    stride, width = _stride(n, size), n // shape[0]
    # Any `width` consecutive values hold a multiple of a stride <= width.
    return stride > width and len(np.unique(np.arange(0, n, stride) // width)) < shape[0]


def _top_rows(tensor, size):
    """The values of the rows of `tensor` holding its largest finite
    values, `size` values' worth (at least one row), as a 1-D tensor."""
    rows = tensor.shape[0]
    matrix = ops.reshape(tensor, (rows, -1))
    taken = max(1, min(rows, size // matrix.shape[1]))
    peaks = ops.max(_of_finite(ops.abs, matrix), axis=1)
    _, index = ops.top_k(peaks, taken)
    return ops.reshape(ops.take(matrix, index, axis=0), (-1,))


def _with_top_rows(counts, tensors, skipping):
    """`counts` (a row per tensor, then one per `skipping` tensor's top rows)
    with each `skipping` tensor's zeros, non-finite count and squares exact
    (one reduction over it), and its histogram that of its strided sample,
    or of its top rows where the strided one saw no nonzero value, scaled
    to its exact number of nonzero finite values; the top rows' rows
    dropped."""
    fixed = []
    for j, i in enumerate(skipping):
        values = ops.cast(tensors[i], "float32")
        finite = ops.isfinite(values)
        exact = ops.stack([
            ops.sum(ops.cast(ops.equal(values, 0.0), "float32")),
            ops.sum(ops.cast(ops.logical_not(finite), "float32")),
            ops.sum(ops.where(finite, ops.square(values), 0.0)),
        ])
        strided, top = counts[i, :NUM_BINS], counts[len(tensors) + j, :NUM_BINS]
        histogram = ops.where(ops.sum(strided) > 0, strided, top)
        nonzero = float(np.prod(tensors[i].shape)) - exact[0] - exact[1]
        histogram = histogram * nonzero / ops.maximum(ops.sum(histogram), 1.0)
        fixed.append(ops.concatenate([histogram, exact]))
    rows = [skipping.index(i) + len(tensors) if i in skipping else i
            for i in range(len(tensors))]
    return ops.take(ops.concatenate([counts[: len(tensors)], ops.stack(fixed)]), rows, axis=0)


def _strided_sample(flat, size):
    """At most `size` values of the 1-D tensor `flat`, evenly strided (all
    of them without `size`, or when its length is not static), and how
    many values each stands for."""
    n = flat.shape[0]
    if size is None or n is None or n <= size:
        return flat, 1.0
    stride = _stride(n, size)
    kept = -(-n // stride)
    return flat[::stride], n / kept


def _stride(n, size):
    """The stride of a sample of at most `size` of `n` values: a prime that
    does not divide `n`. Every axis length of the gradient divides `n`, so
    the stride is coprime with each and the sample walks every column of a
    kernel (a round stride of 256 on a 1024-wide one reads 4 of them; a
    stride of 5 on a (2048, 5) head, one)."""
    stride = _next_prime(-(-n // size))
    while n % stride == 0:
        stride = _next_prime(stride + 1)
    return stride


def _next_prime(n):
    while n < 2 or any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n += 1
    return n


def peaks_and_non_finite(tensors, groups, num_groups):
    """Per group of tensors, the largest |value| of its finite tensors and
    the number of its tensors that hold a non-finite value, in one
    reduction per tensor (which XLA fuses with its producer): no histogram.

    Args:
        tensors: A list of tensors (any shape, any float dtype).
        groups: The group index (int) of each tensor.
        num_groups: Number of groups.

    Returns:
        A tuple `(max_abs, non_finite)` of float32 `(num_groups,)` tensors.
    """
    tops = []
    for t in tensors:
        # Over the tensor's own shape and dtype: flattening a gradient whose
        # layout is not row-major would copy it.
        values = sparse.values(t)
        magnitude = ops.abs(values)
        tops.append(ops.cast(ops.max(ops.where(ops.isfinite(values), magnitude,
                                               ops.cast(np.inf, magnitude.dtype))), "float32"))
    # On the vector of peaks: one kernel, not one per tensor.
    tops = ops.stack(tops)
    bad = ops.cast(ops.isinf(tops), "float32")
    peaks = ops.where(ops.isinf(tops), 0.0, tops)
    return (
        ops.maximum(_per_group(ops.segment_max, peaks, groups, num_groups), 0.0),
        _per_group(ops.segment_sum, bad, groups, num_groups),
    )


def _flat_values(tensors):
    """Each tensor's values (a sparse one's stored rows) as a 1-D tensor."""
    return [ops.reshape(sparse.values(t), (-1,)) for t in tensors]


def _counts_per_tensor(flat, log2_scale):
    """`_bin_counts` of each 1-D tensor of `flat`: one matrix, a row each,
    in order.

    A segment sum per large tensor, one over all small ones concatenated.
    One over everything made the compiled step slower (7x on an MLP's 1.5M
    gradient values), one per tensor made its program, and its compile
    time, grow by dozens of instructions per variable. The rows stay one
    matrix: split into a row per tensor, each was a kernel of its own.
    """
    small = [i for i, f in enumerate(flat) if (f.shape[0] or _SMALL) < _SMALL]
    large = [i for i in range(len(flat)) if i not in small]
    parts = []
    if small:
        # Bins and squares a few tensors at a time (see `_FUSED_OPERANDS`),
        # then one segment sum over all.
        chunks = [small[i:i + _FUSED_OPERANDS] for i in range(0, len(small), _FUSED_OPERANDS)]
        binned = [_binned(
            ops.concatenate([flat[i] for i in chunk]) if len(chunk) > 1 else flat[chunk[0]],
            ops.concatenate([ops.zeros_like(flat[i], "int32") + small.index(i) for i in chunk]),
            log2_scale,
        ) for chunk in chunks]
        parts.append(_bin_counts(*[
            ops.concatenate(list(column)) if len(binned) > 1 else column[0]
            for column in zip(*binned)
        ], len(small)))
    parts += [_bin_counts(*_binned(flat[i], 0, log2_scale), 1) for i in large]
    counts = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)
    order = small + large
    if order != sorted(order):
        counts = ops.take(counts, np.argsort(order), axis=0)
    return counts


# XLA on CPU fuses a concatenation of at most this many operands with their
# producers (a sample's slice, an unscaling multiply); one of more operands
# is a kernel of its own, and so is each operand's producer.
_FUSED_OPERANDS = 8


def _of_finite(fn, values):
    """`fn(values)` in float32 (where a float16 square can overflow), zero
    where a value is not finite."""
    values = ops.cast(values, "float32")
    return ops.where(ops.isfinite(values), fn(values), 0.0)


def _per_group(segment_reduce, each, groups, num_groups):
    """`segment_reduce` (`ops.segment_sum` or `ops.segment_max`) of the
    per-tensor results `each` (a list, or stacked) by group, as
    `(num_groups, ...)`."""
    each = ops.stack(each) if isinstance(each, (list, tuple)) else each
    if num_groups == 1:
        reduce = ops.max if segment_reduce is ops.segment_max else ops.sum
        return ops.expand_dims(reduce(each, axis=0), 0)
    if list(groups) == list(range(num_groups)):
        return each
    return segment_reduce(each, np.asarray(groups, "int32"), num_segments=num_groups)


def _binned(values, owner, log2_scale):
    """Each value of `values` (1-D)'s segment in `_bin_counts` (its exponent
    bin, zero or non-finite, in the row `owner` says, an int tensor or int)
    and its square where finite (0 elsewhere)."""
    values = ops.cast(values, "float32")
    magnitude = ops.abs(values)
    finite = ops.isfinite(magnitude)
    counted = ops.logical_and(finite, ops.greater(magnitude, 0.0))
    exponent = _exponent(ops.where(counted, magnitude, 1.0)) - log2_scale
    bins = ops.cast(ops.clip(exponent - EXPONENT_MIN, 0, NUM_BINS - 1), "int32")
    # Zeros and non-finite values are counted in two more bins of the same
    # segment sum, so that they cost no pass (or compiled loop) of their own.
    bins = ops.where(finite, ops.where(counted, bins, _ZERO_BIN), _NON_FINITE_BIN)
    segments = owner * _BINS_WITH_EXTRAS + bins
    return segments, ops.where(finite, ops.square(values), 0.0), owner


def _bin_counts(segments, squares, owner, rows):
    """`(rows, _BINS_WITH_EXTRAS + 1)`: counts of values by `_binned`
    segment, and per row the sum of their squares."""
    width = _BINS_WITH_EXTRAS + 1
    if rows > 1:
        # The small tensors' rows (fewer than `_SMALL` values each: counts
        # exact in float32): counts and squares in one segment sum, the
        # squares a few thousand values per segment (within 1e-5).
        table = ops.segment_sum(
            ops.concatenate([ops.ones_like(squares), squares]),
            ops.concatenate([segments + owner, owner * width + _BINS_WITH_EXTRAS]),
            num_segments=rows * width,
        )
        return ops.reshape(table, (rows, width))
    # Integer counts: a float32 sum of ones stops growing at 2**24, which a
    # large kernel or activation gradient exceeds. Squares by a tree
    # reduction: XLA's segment sum is a sequential scatter on CPU, 5e-4
    # off float64 over a million values.
    counts = ops.segment_sum(ops.ones_like(segments), segments, num_segments=_BINS_WITH_EXTRAS)
    return ops.concatenate([
        ops.reshape(ops.cast(counts, "float32"), (1, _BINS_WITH_EXTRAS)),
        ops.reshape(ops.sum(squares), (1, 1)),
    ], axis=1)


def _exponent(magnitude):
    """`floor(log2(magnitude))`, exactly, for positive float32 values, as a
    float32: read from the bits (`ops.log2` misses exact powers of two by an
    ulp, 32768 -> 14.999999). float32 subnormals read as -127."""
    # A static last axis: `ops.view` cannot check a dynamic one.
    bits = ops.reshape(ops.view(ops.reshape(magnitude, (-1, 1)), "int32"), (-1,))
    # The sign bit is clear: a shift, where a division costs a dozen steps.
    return ops.cast(ops.right_shift(bits, 23) - 127, "float32")


__all__ = [
    "EXPONENT_MIN",
    "NUM_BINS",
    "pow2",
    "exponent_histogram",
    "grouped_statistics",
    "peaks_and_non_finite",
    "combine_measurements",
    "unscale",
]


def combine_measurements(measurements):
    """Several packed measurements as one: counts add up, the peak is the
    largest.

    Args:
        measurements: `(n, NUM_BINS + 2)` float32, each row a histogram, a
            zero count and a peak (one replica's, or one micro-batch's).

    Returns:
        `(NUM_BINS + 2,)` float32.
    """
    return ops.concatenate(
        [ops.sum(measurements[:, :-1], axis=0), ops.max(measurements[:, -1:], axis=0)]
    )


def unscale(grads, log2_divisors):
    """`grads` with those at the indices of `log2_divisors` divided by their
    power of two, exactly (a sparse gradient's stored values).

    Args:
        grads: A list of gradients.
        log2_divisors: `{index: integer-valued exponent}`.

    Returns:
        The new list.
    """
    unscaled, factors = list(grads), {}
    for i, log2_divisor in log2_divisors.items():
        # One factor per divisor: in the global modes all share one.
        if id(log2_divisor) not in factors:
            factors[id(log2_divisor)] = pow2(-log2_divisor)
        factor = factors[id(log2_divisor)]
        unscaled[i] = sparse.map_values(lambda g: times(g, factor), grads[i])
    return unscaled
