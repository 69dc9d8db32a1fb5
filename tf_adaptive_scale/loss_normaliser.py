"""What a Keras loss divides by: the normaliser of its reduction.

Gradient accumulation equals one step on the whole batch only when each
micro-batch weighs in by its share of the whole batch's normaliser. For
`"sum_over_batch_size"` (Keras's default) that is the number of loss
values, unless a Keras mask (`Embedding(mask_zero=True)`, `Masking`) leaves
some out: then it is the number of valid ones, which differs between
micro-batches. Mirrors `keras.losses.Loss.__call__` and its reduction.
"""

import keras
from keras import ops

from tf_adaptive_scale import keras_internals

ADDITIVE = ("sum", "none", None)


def depends_on_data(loss, y_pred, sample_weight):
    """Whether `loss`'s normaliser on a batch is something other than its
    number of values or 1 (known while tracing: masks and weights are)."""
    reduction = loss.reduction
    masked = keras_internals.mask_of(y_pred) is not None
    if reduction == "mean_with_sample_weight":
        return masked or sample_weight is not None
    return reduction not in ADDITIVE and masked


def normaliser(loss, y_true, y_pred, sample_weight):
    """What `loss(y_true, y_pred, sample_weight)` divides its weighted sum
    by, as a float32 scalar.

    Args:
        loss: A `keras.losses.Loss`.
        y_true, y_pred, sample_weight: Its arguments.

    Returns:
        1 for a `"sum"` reduction; for `"mean_with_sample_weight"`, the sum
        of the (masked) sample weights; otherwise the number of loss values,
        or of the unmasked ones under a Keras mask.
    """
    if loss.reduction in ADDITIVE:
        return ops.ones((), "float32")
    values = loss.call(ops.convert_to_tensor(y_true, loss.dtype),
                       ops.convert_to_tensor(y_pred, loss.dtype))
    masks = [m for m in (keras_internals.mask_of(y_pred),
                         keras_internals.mask_of(values)) if m is not None]
    mask = None
    if masks:
        mask = ops.cast(masks[0] if len(masks) == 1 else ops.logical_and(*masks), "float32")
    if loss.reduction == "mean_with_sample_weight" and sample_weight is not None:
        weights = ops.cast(sample_weight, "float32")
        if mask is not None:
            mask, weights = _same_rank(mask, weights)
            weights = weights * mask
        return ops.sum(weights)
    if mask is not None:
        return ops.sum(mask)
    return ops.cast(ops.size(values), "float32")


def _same_rank(x1, x2):
    """Keras's alignment of a mask and sample weights: a trailing axis of
    size 1 squeezed, or a rank-1 one expanded, where ranks differ by one."""
    for a, b, swap in ((x1, x2, False), (x2, x1, True)):
        if len(a.shape) == len(b.shape) + 1 and a.shape[-1] == 1:
            if len(b.shape) == 1:
                b = ops.expand_dims(b, -1)
            else:
                a = ops.squeeze(a, -1)
            return (b, a) if swap else (a, b)
    return x1, x2


def of_compiled(loss, y_true, y_pred, sample_weight):
    """The normaliser of a model's compiled `loss` (as given to `compile`)
    on one batch, for weighing batches against each other.

    Args:
        loss: The `loss` argument of `compile`: a name, function or
            `keras.losses.Loss`, or a list or dict of them, one per output.
        y_true, y_pred, sample_weight: The batch, as `compute_loss` gets it.

    Returns:
        A float32 scalar: the loss's normaliser for one output; for several
        outputs, none of whose normalisers depend on the data, the number of
        samples.

    Raises:
        ValueError: The loss adds up (`"sum"`: batches sum, they are not
            weighed), or several outputs have a normaliser that depends on
            the data (no one weight per batch is exact for all).
    """
    outputs = keras.tree.flatten(y_pred)
    if len(outputs) == 1 and not isinstance(loss, (list, tuple, dict)):
        fn = keras_loss(loss)
        if fn.reduction in ADDITIVE:
            raise ValueError(
                f"A loss with reduction={fn.reduction!r} adds its batches up; "
                "weighing them by a normaliser cannot give the sum. Use "
                "tas.make_train_step(..., accumulation_steps=K), which sums it."
            )
        return normaliser(fn, y_true, y_pred, sample_weight)
    if any(keras_internals.mask_of(p) is not None for p in outputs):
        raise ValueError(
            f"The model has {len(outputs)} outputs and a Keras mask: their "
            "normalisers differ, and no one weight per batch is exact for all. "
            "Use accumulation_steps=1, or one output."
        )
    return ops.cast(ops.shape(outputs[0])[0], "float32")


def keras_loss(loss):
    """A reducing `keras.losses.Loss` from a name, function or `Loss`, as
    `compile` makes one (a function reduces by `"sum_over_batch_size"`)."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        return loss
    if not callable(loss):
        raise ValueError(
            "`loss_fn` must be a Keras loss name, a loss function "
            f"`fn(y_true, y_pred)` or a keras.losses.Loss. Received: {loss!r}"
        )
    return _FunctionLoss(loss)


class _FunctionLoss(keras.losses.Loss):
    """A per-sample loss function, reduced and weighted as Keras does."""

    def __init__(self, fn):
        # The name becomes a name scope: a lambda's '<lambda>' is none.
        name = getattr(fn, "__name__", "")
        valid = name.isidentifier() and name.isascii()
        super().__init__(name=name if valid else "loss")
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)
