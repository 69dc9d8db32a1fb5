"""What a Keras loss divides by: the normaliser of its reduction.

Gradient accumulation equals one step on the whole batch only when each
micro-batch weighs in by its share of the whole batch's normaliser. One rule
serves every accumulation path (`make_train_step`, plain or per layer, and
`fit` on `exact_accumulation`): `"sum_over_batch_size"` (Keras's default)
divides by the number of loss values, unless a Keras mask leaves some out:
then by the number of valid ones, which differs between micro-batches. The
mask is wherever Keras takes it from: the prediction's (`Embedding(
mask_zero=True)`, `Masking`) and the loss values' (`ignore_class`,
`keras.losses.Circle`, a custom loss that masks its values), both together.
`"mean_with_sample_weight"` divides by the sum of the (masked) sample
weights. Mirrors `keras.losses.Loss.__call__` and its reduction.
"""

import collections

import keras
from keras import ops

from tf_adaptive_scale.backend import keras_internals

ADDITIVE = ("sum", "none", None)

Normaliser = collections.namedtuple("Normaliser", ["value", "depends_on_data"])
Normaliser.__doc__ = """A batch's normaliser.

`value`: a float32 scalar; `depends_on_data`: a Python bool, known while
tracing, whether it can be other than the number of loss values or 1 (so
that micro-batches of one size can weigh differently).
"""


def of_batch(loss, y_true, y_pred, sample_weight):
    """What `loss(y_true, y_pred, sample_weight)` divides its weighted sum
    by, and whether that depends on the data.

    Args:
        loss: A `keras.losses.Loss`.
        y_true, y_pred, sample_weight: Its arguments.

    Returns:
        A `Normaliser`. Its value is 1 for a `"sum"` reduction; for
        `"mean_with_sample_weight"`, the sum of the (masked) sample weights,
        or the valid entries without them; otherwise the number of loss
        values, or of the valid ones under a Keras mask.
    """
    if loss.reduction in ADDITIVE:
        return Normaliser(ops.ones((), "float32"), False)
    values, mask = _values_and_mask(loss, y_true, y_pred)
    return Normaliser(
        _divisor(values, mask, sample_weight, loss.reduction),
        depends_on_data(loss.reduction, mask, sample_weight),
    )


def depends_on_data(reduction, mask, sample_weight):
    """Whether the normaliser of a loss of `reduction` can be other than
    its number of values or 1, given the mask Keras applies (or None) and
    the `sample_weight` (or None)."""
    masked = mask is not None
    if reduction == "mean_with_sample_weight":
        return masked or sample_weight is not None
    return reduction not in ADDITIVE and masked


def _values_and_mask(loss, y_true, y_pred):
    """The loss values and the mask `Loss.__call__` applies to them: the
    prediction's and the values' own, together (None without either)."""
    # Read before the cast, which may make a tensor without it, as Keras does.
    in_mask = keras_internals.mask_of(y_pred)

    def convert(tensor):
        return ops.convert_to_tensor(tensor, loss.dtype)

    values = loss.call(keras.tree.map_structure(convert, y_true),
                       keras.tree.map_structure(convert, y_pred))
    out_mask = keras_internals.mask_of(values)
    if in_mask is None or out_mask is None:
        return values, out_mask if in_mask is None else in_mask
    return values, ops.logical_and(in_mask, out_mask)


def _divisor(values, mask, sample_weight, reduction):
    """`reduce_weighted_values`' divisor of the loss's weighted sum: the
    sample weights merged with the mask, as Keras merges them."""
    weights = None if sample_weight is None else ops.cast(sample_weight, "float32")
    if mask is not None:
        mask = ops.cast(mask, "float32")
        if weights is None:
            weights = mask
        else:
            mask, weights = _same_rank(mask, weights)
            weights = weights * mask
    if weights is None:
        return ops.cast(ops.size(values), "float32")
    values, weights = _same_rank(values, weights)
    if reduction == "mean_with_sample_weight":
        return ops.sum(weights)
    # Keras divides by the number of weighted values and weighs the valid
    # ones by all / valid (mask entries): by valid * values / all in effect.
    count = ops.cast(ops.size(values * weights), "float32")
    if mask is None:
        return count
    return ops.sum(mask) * (count / ops.cast(ops.size(mask), "float32"))


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


def of_compiled(model, y_true, y_pred, sample_weight):
    """The normaliser of `model`'s compiled loss on one batch, for weighing
    batches against each other (after `model.compute_loss` on it).

    Args:
        model: A Keras model compiled with a `loss`.
        y_true, y_pred, sample_weight: The batch, as `compute_loss` gets it.

    Returns:
        A float32 scalar: the normaliser of its one loss; for several
        (outputs or losses), none of whose normalisers depends on the data,
        the number of samples.

    Raises:
        ValueError: A loss adds up (`"sum"`: batches sum, they are not
            weighed), or there are several and one's normaliser depends on
            the data (no one weight per batch is exact for all).
    """
    losses, output_names = keras_internals.compiled_losses(model)
    for _, loss in losses:
        if loss.reduction in ADDITIVE:
            raise ValueError(
                f"A loss with reduction={loss.reduction!r} adds its batches up; "
                "weighing them by a normaliser cannot give the sum. Use "
                "tas.make_train_step(..., accumulation_steps=K), which sums it."
            )
    nested = keras.tree.is_nested(y_true) or keras.tree.is_nested(y_pred)
    normalisers = []
    for path, loss in losses:
        if nested:  # as Keras's compiled loss picks each loss's arguments
            args = [_at(value, path, output_names, what)
                    for value, what in ((y_true, "y"), (y_pred, "the outputs"))]
            weights = sample_weight
            if keras.tree.is_nested(sample_weight):
                weights = _at(sample_weight, path, output_names, "sample_weight")
            normalisers.append(of_batch(loss, *args, weights))
        else:
            normalisers.append(of_batch(loss, y_true, y_pred, sample_weight))
    if len(normalisers) == 1:
        return normalisers[0].value
    if any(n.depends_on_data for n in normalisers):
        raise ValueError(
            f"The model has {len(normalisers)} losses and one's normaliser depends "
            "on the data (a Keras mask, `ignore_class`, or 'mean_with_sample_weight' "
            "with sample weights): no one weight per batch is exact for all. Use "
            "accumulation_steps=1, or one output and loss."
        )
    return ops.cast(ops.shape(keras.tree.flatten(y_pred)[0])[0], "float32")


def _at(value, path, output_names, what):
    """The entry of `value` (`y`, the outputs or `sample_weight`) at a
    compiled loss's `path`: by index or output name, in a list or a dict."""
    try:
        for key in path:
            if isinstance(value, dict) and not isinstance(key, str):
                key = output_names[key]
            elif isinstance(value, (list, tuple)) and isinstance(key, str):
                key = list(output_names).index(key)
            value = value[key]
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(
            f"Cannot tell which entry of {what} the loss at {path} takes: give "
            "`y` and `sample_weight` as the model's outputs, a list in output "
            "order or a dict by output name."
        ) from None
    return value


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
