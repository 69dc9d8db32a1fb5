"""Per-layer gradient scales applied inside the backward pass.

Every layer of an instrumented model is a *unit* with its own loss scale: the
gradient of its outputs, its own backward pass and its weight gradients are
represented multiplied by that scale. A `GradientScale` boundary sits on each
edge of the graph, between a producer unit and one consumer: the identity in
the forward pass, it converts the gradient from the consumer's scale to the
producer's in the backward pass, so gradients from several consumers meet at
one common scale before they are summed.

All scales live in one `ScaleTable` layer per model. Its outputs feed every
boundary: `control` (log2 scales, then a measure flag) and `statistics`. The
latter is a trainable variable read through the identity: whatever the
boundaries return as *its* gradient is the per-unit statistics of this very
backward pass (the Keras float8 pattern), which the optimizer reads and writes
back. So the statistics cost no extra pass and work under XLA. They are taken
on every step with no conditional (peaks as reductions XLA fuses with the
gradient's producer, the histogram on a fixed sample of each edge's
gradient) and kept only on measured steps: a conditional in the step gives
its operands buffers of their own on CPU and waits on the host on a GPU.
(A conditional around the whole step is worse still: XLA on CPU compiles
the convolutions inside it as naive loops, 50x slower.)

Statistics columns, per unit (row), all zero on steps that do not measure
(histogram counts are estimates from the sample, scaled to the whole):
- `[0, NUM_BINS)`: exponent histogram of the unscaled gradients held at the
  unit's scale: its output gradients and the input gradients its backward
  produced;
- `OUTPUT_MAX`: sum over its output edges of max |unscaled gradient|;
- `INPUT_MAX`: sum over its input edges of the max |unscaled gradient| its
  backward produced (so overflow of its input gradients is seen too), the
  model's inputs excepted;
- `PRODUCED_NON_FINITE`: its backward produced a non-finite input gradient;
- `CONVERSION_OVERFLOW`: converting a finite gradient to its scale overflowed;
- `RECEIVED_NON_FINITE`: its output gradient was non-finite;
- `WIDE_OUTPUT_MAX`: like `OUTPUT_MAX`, over its float32 (or wider) output
  gradients, which need no scale themselves: the only evidence for a float32
  unit (a model's float32 head, say) whose float16 input gradients, cast in
  its own backward, all overflowed.
"""

import functools
import math
import weakref

import keras
import ml_dtypes
import numpy as np
from keras import ops

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.numerics import float16
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.numerics import validation
from tf_adaptive_scale.per_layer import step_programs

OUTPUT_MAX = stats.NUM_BINS
INPUT_MAX = OUTPUT_MAX + 1
PRODUCED_NON_FINITE = INPUT_MAX + 1
CONVERSION_OVERFLOW = PRODUCED_NON_FINITE + 1
RECEIVED_NON_FINITE = CONVERSION_OVERFLOW + 1
WIDE_OUTPUT_MAX = RECEIVED_NON_FINITE + 1
NUM_COLUMNS = WIDE_OUTPUT_MAX + 1

# Unit 0 is the loss: gradients reach the model outputs in float32 at scale 1.
LOSS_UNIT = 0

PEAK_COLUMNS = (OUTPUT_MAX, INPUT_MAX, WIDE_OUTPUT_MAX)


def combine_replicas(statistics):
    """One table from every replica's statistics of a step.

    Counts and flags add up; peaks take the largest replica's (their sum
    would overstate a unit's peak up to the number of replicas, and lower
    its scale below one device's).

    Args:
        statistics: `(replicas, units, NUM_COLUMNS)` float32.

    Returns:
        `(units, NUM_COLUMNS)` float32.
    """
    is_peak = np.isin(np.arange(NUM_COLUMNS), PEAK_COLUMNS)
    return ops.where(
        is_peak, ops.max(statistics, axis=0), ops.sum(statistics, axis=0)
    )


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class ScaleTable(keras.layers.Layer):
    """Holds the per-unit scales and statistics of an instrumented model.

    Args:
        unit_names: Names of the units, index 0 being `"loss"`.
        initial_scale: Power of two, every unit's first scale.

    Returns:
        Called on any model input, `(control, statistics)`: float32 tensors of
        shape `(units + 1,)` and `(units, NUM_COLUMNS)`.

    Example:

    >>> table = ScaleTable(["loss", "dense"])
    """

    def __init__(self, unit_names, initial_scale=1.0, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(autocast=False, **kwargs)
        self.unit_names = list(unit_names)
        self.initial_scale = validation.power_of_two("initial_scale", initial_scale)
        units = len(self.unit_names)
        initial = [0.0] + [math.log2(initial_scale)] * (units - 1)
        # The optimizer writes the scales. On JAX it can only return new
        # values of trainable and optimizer variables (`stateless_apply`):
        # they are trainable, tagged `scale_state`, and never trained; on
        # every backend alike, so that the optimizer's per-variable state
        # has one shape and a saved model loads on either backend.
        self.log2_scales = self.add_weight(
            shape=(units,),
            initializer=keras.initializers.Constant(initial),
            trainable=True,
            name="log2_scales",
        )
        # The cap on each unit's scale, lowered where it overflowed; 127
        # (float32's largest exponent) is no cap, kept finite for tools that
        # check every model variable is.
        self.log2_ceilings = self.add_weight(
            shape=(units,),
            initializer=keras.initializers.Constant(float16.NO_CAP_EXPONENT),
            trainable=True,
            name="log2_ceilings",
        )
        self.measure = self.add_weight(
            shape=(),
            initializer="ones",
            trainable=True,
            name="measure",
        )
        for state in (self.log2_scales, self.log2_ceilings, self.measure):
            state.scale_state = self
        self.statistics = self.add_weight(
            shape=(units, NUM_COLUMNS),
            initializer="zeros",
            trainable=True,  # receives the statistics as its gradient
            name="statistics",
        )
        self.statistics.overwrite_with_gradient = True
        self.statistics.scale_table = self
        self._weight_units = _WeightUnits([])

    def bind(self, weight_units):
        """Records which unit's scale each weight's gradient carries.

        The map lives here, not on the weights: the same weights can serve
        several instrumented models (two heads on one backbone, a model
        instrumented twice), each with its own table and units.

        Args:
            weight_units: `(variable, unit index)` pairs.
        """
        self._weight_units = _WeightUnits(weight_units)
        _BOUND.add(self)

    def unit_of(self, variable):
        """The index of the unit whose scale `variable`'s gradient carries
        in this table's model, or None where the model holds no such weight.
        """
        return self._weight_units.unit_of(variable)

    def save_own_variables(self, store):
        # A fixed order, not Keras's trainable-first one, which changed when
        # the scale state became trainable on TensorFlow too: files written
        # before (statistics first) still load, on either backend.
        for i, variable in enumerate(self._state_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        variables = self._state_variables()
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"ScaleTable '{self.name}' holds {len(variables)} variables; "
                f"the file has {len(store.keys())}."
            )
        values = [store[str(i)] for i in range(len(variables))]
        if np.ndim(values[0]) == 2:
            # Written before the order was fixed, on TensorFlow (statistics,
            # the only trainable variable there, first).
            values = values[1:] + values[:1]
        for variable, value in zip(variables, values):
            variable.assign(value)

    def _state_variables(self):
        return [self.log2_scales, self.log2_ceilings, self.measure, self.statistics]

    def call(self, anchor):
        control = ops.concatenate(
            [self.log2_scales.value, ops.reshape(self.measure.value, (1,))]
        )
        # `statistics` passes through the identity so that it has a gradient.
        return ops.stop_gradient(control), ops.convert_to_tensor(
            self.statistics
        )

    def compute_output_spec(self, anchor):
        units = len(self.unit_names)
        return (
            keras.KerasTensor((units + 1,), "float32"),
            keras.KerasTensor((units, NUM_COLUMNS), "float32"),
        )

    def scales(self):
        """The current scale of every unit by name (Python floats)."""
        values = 2.0 ** np.asarray(self.log2_scales.numpy(), np.float64)
        return dict(zip(self.unit_names[1:], values[1:].tolist()))

    def get_config(self):
        config = super().get_config()
        config.update(
            unit_names=self.unit_names,
            initial_scale=self.initial_scale,
        )
        return config


class _WeightUnits:
    """A map from weight to unit, by identity. A plain object, so that Keras
    does not track the weights it holds as the table's own."""

    def __init__(self, weight_units):
        self._units = {id(v): (v, int(u)) for v, u in weight_units}

    def unit_of(self, variable):
        held, unit = self._units.get(id(variable), (None, None))
        return unit if held is variable else None


# The tags a `ScaleTable` puts on its variables, read only here.

def table_of_statistics(variable):
    """The `ScaleTable` whose `statistics` `variable` is (its gradient is the
    table's statistics), else None."""
    return getattr(variable, "scale_table", None)


def is_scale_state(variable):
    """Whether `variable` is a `ScaleTable`'s scale state (its scales, caps
    or measure flag): written by the optimizer, never given a gradient."""
    return hasattr(variable, "scale_state")


def instrumented_weight(variable):
    """Whether any live `ScaleTable` scales `variable`'s gradient: a weight
    of a model `tas.instrument` was given."""
    return any(table.unit_of(variable) is not None for table in list(_BOUND))


# Every bound table, while its model lives (`instrumented_weight`).
_BOUND = weakref.WeakSet()


def written_by_optimizer(variable):
    """Whether `variable` belongs to a `ScaleTable` (its statistics or scale
    state): the optimizer writes it and never trains it."""
    return table_of_statistics(variable) is not None or is_scale_state(variable)


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class GradientScale(keras.layers.Layer):
    """A gradient-scale boundary on one edge of the graph.

    The identity in the forward pass. In the backward pass it multiplies the
    gradient by `scale[producer] / scale[consumer]` (in float32, then back to
    the gradient's dtype) and reports statistics of it to the `ScaleTable`.

    Args:
        producer: Unit index of the layer that produced the tensor.
        consumer: Unit index of the layer that consumes it.
        output_dtype: Optional dtype to cast to in the forward pass (model
            outputs are cast to float32, so that the loss gradient reaches the
            boundary before any float16 rounding).

    Returns:
        Called as `boundary(x, control, statistics)`, returns `x`.

    Example:

    >>> y = GradientScale(producer=1, consumer=2)(x, control, statistics)
    """

    def __init__(self, producer, consumer, output_dtype=None, **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.producer = int(producer)
        self.consumer = int(consumer)
        self.output_dtype = output_dtype
        self.supports_masking = True

    def call(self, x, control, statistics):
        def convert(values):
            return _boundary(
                values, control, statistics, self.producer, self.consumer,
                self.output_dtype or values.dtype,
            )

        # A sparse or ragged tensor's gradient flows through its values.
        if not backends.TENSORFLOW:
            return convert(x)
        import tensorflow as tf

        if isinstance(x, tf.SparseTensor):
            return tf.SparseTensor(x.indices, convert(x.values), x.dense_shape)
        if isinstance(x, tf.RaggedTensor):
            return x.with_flat_values(convert(x.flat_values))
        return convert(x)

    def compute_output_spec(self, x, control, statistics):
        return keras.KerasTensor(
            x.shape, self.output_dtype or x.dtype, sparse=x.sparse, ragged=x.ragged
        )

    def compute_mask(self, x, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update(
            producer=self.producer,
            consumer=self.consumer,
            output_dtype=self.output_dtype,
        )
        return config


def _boundary(x, control, statistics, producer, consumer, output_dtype):
    input_dtype = x.dtype

    @ops.custom_gradient
    def identity(x, control, statistics):
        def backward(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            return _convert(
                upstream, control, statistics.shape, producer, consumer,
                input_dtype,
            )

        # ops.identity is the identity *matrix*; ops.copy is tf.identity.
        if output_dtype == input_dtype:
            return ops.copy(x), backward
        return ops.cast(x, output_dtype), backward

    return identity(x, control, statistics)


def _convert(dy, control, statistics_shape, producer, consumer, input_dtype):
    """The converted gradient, and this edge's statistics on measured steps."""
    factor = stats.pow2(control[producer] - control[consumer])
    dx = stats.times(dy, factor, input_dtype)
    # Gradients leaving through the model's inputs are not measured: a
    # top-level model never uses them (measuring would compute them for
    # nothing, and an overflow there would skip a step that harms no weight);
    # in a block, the layers they reach have their own checks.
    # ... and a plain program (`step_programs`) measures nothing.
    if producer == LOSS_UNIT or not step_programs.is_measuring():
        return dx, ops.zeros_like(control), ops.zeros(statistics_shape, "float32")
    standard = keras.backend.standardize_dtype
    rows = _measured_rows(standard(dy.dtype), standard(input_dtype))(
        dy, control, ops.convert_to_tensor(producer, "int32"),
        ops.convert_to_tensor(consumer, "int32"),
    )
    # Placing the edge's two rows in the table is a constant one-hot product
    # XLA fuses into the sum over edges (a full table per edge would be
    # materialised on every step).
    units = statistics_shape[0]
    table = ops.one_hot(producer, units)[:, None] * rows[0][None, :]
    table = table + ops.one_hot(consumer, units)[:, None] * rows[1][None, :]
    return dx, ops.zeros_like(control), table


@functools.cache
def _measured_rows(dtype, input_dtype):
    """`rows(dy, control, producer, consumer)`: an edge's statistics
    rows on measured steps, zeros on others, for gradients `dy` of `dtype`
    converted to `input_dtype`.

    Taken on every step, with no conditional (XLA gives a conditional's
    operands buffers of their own, a float16 copy of every edge's gradient
    per step, and on a GPU waits on the host for its predicate); the
    histogram is of a fixed sample of `dy`, so its cost does not grow with
    the tensor. One graph function per dtype and shape, traced once and
    called by every edge of that shape: tracing each edge's own statistics
    made a deep model's first step several times stock's. XLA inlines it.
    """

    def rows(dy, control, producer, consumer):
        statistics = _statistics(dy, control, producer, consumer, input_dtype)
        return ops.where(control[-1] > 0, statistics, 0.0)

    if not backends.TENSORFLOW:
        return rows
    import tensorflow as tf

    return tf.function(rows, autograph=False)


def _statistics(dy, control, producer, consumer, input_dtype):
    """This edge's statistics: its producer's row and its consumer's."""
    # Reductions over dy in its own dtype where they can, which XLA fuses
    # with its producer; the histogram over a sample.
    measured = stats.grouped_statistics([dy], [0], 1, control[consumer], sample=stats.SAMPLE)
    histogram, unscaled_peak = measured.histograms[0], measured.max_abs[0]
    produced_bad = measured.non_finite[0] > 0
    dtype_max = float(ml_dtypes.finfo(keras.backend.standardize_dtype(input_dtype)).max)
    converted_bad = unscaled_peak * stats.pow2(control[producer]) > dtype_max
    wide_peak = ops.zeros((), "float32")
    if keras.backend.standardize_dtype(input_dtype) != "float16":
        # Only float16 tensors have a range to fit the scale to; a wider one's
        # peak is kept apart, for a unit that sees nothing else.
        wide_peak, unscaled_peak = unscaled_peak, ops.zeros((), "float32")
        histogram = ops.zeros((stats.NUM_BINS,), "float32")
    producer_row = ops.concatenate(
        [
            histogram,
            ops.stack(
                [
                    unscaled_peak,
                    0.0,
                    0.0,
                    ops.cast(ops.logical_and(converted_bad, ~produced_bad), "float32"),
                    ops.cast(ops.logical_or(converted_bad, produced_bad), "float32"),
                    wide_peak,
                ]
            ),
        ]
    )
    consumer_row = ops.concatenate(
        [
            histogram,  # the consumer's backward produced these values
            ops.stack(
                [0.0, unscaled_peak, ops.cast(produced_bad, "float32"), 0.0, 0.0, 0.0]
            ),
        ]
    )
    return ops.stack([producer_row, consumer_row])


def scale_gradient(loss, log2_scale):
    """`loss` as float32, whose gradient is multiplied by `2**log2_scale`.

    An additional loss (a weight regulariser, `add_loss`) enters its unit's
    backward pass directly, not through a boundary: this brings its gradient
    to the unit's scale, which the optimizer divides by, and leaves its value
    as it is (the reported loss stays the model's).

    Args:
        loss: A scalar loss tensor.
        log2_scale: The unit's integer-valued float32 exponent.

    Returns:
        The float32 loss.
    """

    @ops.custom_gradient
    def identity(loss, log2_scale):
        def backward(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            return upstream * stats.pow2(log2_scale), ops.zeros_like(log2_scale)

        return ops.copy(loss), backward

    return identity(ops.cast(loss, "float32"), ops.stop_gradient(log2_scale))
