"""`fit` with gradient accumulation that equals one step on the whole window.

The optimizer's `accumulation_steps=K` sums K of `fit`'s batches. With equal
weights that is one step on their union only where every batch's loss
divides by the same number; under a Keras mask (padded sequences, a loss's
`ignore_class`) it divides by its valid entries, which differ from batch to
batch. Keras's trainer
hands an optimizer a batch's scaled loss and gradients, nothing else (on
JAX not even a variable written by `scale_loss`), so the model says it: the
loss of a model wrapped by `exact_accumulation` carries the batch's
normaliser (`loss_normaliser.of_compiled`) as the gradient of a variable of
its own, a term of value 0. The optimizer reads that gradient and weighs
the batch by it, on TensorFlow and JAX alike, under a strategy by the
global batch's.
"""

import keras
from keras import ops

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.step import loss_normaliser

# The attribute that marks the variable whose gradient is the normaliser.
CARRIES_NORMALISER = "carries_loss_normaliser"


def exact_accumulation(model):
    """Wraps `model` so that `fit` with `accumulation_steps=K` equals one
    step on the K batches together, whatever its compiled loss divides by.

    Each batch weighs by its compiled loss's normaliser
    (`loss_normaliser.of_compiled`): the valid entries under a Keras mask,
    on the outputs or on the loss values (`ignore_class`), the sample
    weights under `"mean_with_sample_weight"`, the samples otherwise. The
    model must be compiled with a `loss`: one trained through `add_loss`
    alone is refused at its first batch, since what such a loss divides by
    (a batch mean, a mean over valid tokens, a sum) is not known. Several
    outputs or losses, one of whose normalisers depends on the data, are
    refused too (no one weight per batch is exact for all).

    Args:
        model: A Keras model.

    Returns:
        An `ExactAccumulationModel`: compile and fit it in place of `model`
        (which it calls, and whose weights it trains).

    Example:

    >>> model = tas.exact_accumulation(model)  # Embedding(mask_zero=True) inside
    >>> model.compile(tas.AdaptiveLossScaleOptimizer(
    ...     keras.optimizers.Adam(), accumulation_steps=4),
    ...     loss="sparse_categorical_crossentropy")
    >>> model.fit(padded_batches)
    """
    return ExactAccumulationModel(model)


def normaliser_variables(variables):
    """Indices of the variables whose gradient is a batch's normaliser."""
    return [i for i, v in enumerate(variables) if getattr(v, CARRIES_NORMALISER, False)]


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class ExactAccumulationModel(keras.Model):
    """`model`, whose training loss also carries its batch's normaliser
    (see `exact_accumulation`).

    Args:
        model: The Keras model to train.
        **kwargs: `keras.Model` arguments (`name`).
    """

    def __init__(self, model, **kwargs):
        if hasattr(model, "scale_table"):
            raise ValueError(
                "`model` is instrumented (per-layer scales): accumulate with "
                "tas.make_train_step(model, loss, optimizer, accumulation_steps=K), "
                "which weighs micro-batches by their normaliser too."
            )
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a Keras model. Received: {model!r}")
        super().__init__(**kwargs)
        self.inner = model
        if hasattr(model, "output_names"):  # for losses and metrics by output name
            self.output_names = model.output_names
        # Its gradient is the batch's normaliser; overwritten with it, so
        # that any optimizer leaves the model as it would without it.
        self.normaliser = self.add_weight(shape=(), initializer="zeros", name="loss_normaliser")
        self.normaliser.overwrite_with_gradient = True
        setattr(self.normaliser, CARRIES_NORMALISER, True)
        self.built = model.built

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if training and self.loss is None:  # `add_loss` alone: see `exact_accumulation`
            raise ValueError(
                "tas.exact_accumulation(model) was compiled without a `loss`: "
                "each batch weighs by what the compiled loss divides by, and "
                "what a loss added by `add_loss` divides by is not known. "
                "Compile it with `loss=...`, or fit the unwrapped model (its "
                "batches then weigh equally)."
            )
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        if not training or loss is None:
            return loss
        normaliser = loss_normaliser.of_compiled(self, y, y_pred, sample_weight)
        # Under a tf.distribute strategy, replicas weigh by their normaliser.
        loss = loss * ops.cast(backends.replica_weight(normaliser), loss.dtype)
        probe = ops.cast(self.normaliser.value, loss.dtype)
        # Adds 0; its gradient for `self.normaliser` is the normaliser.
        return loss + (probe - ops.stop_gradient(probe)) * ops.cast(normaliser, loss.dtype)

    def get_config(self):
        return {"name": self.name, "model": keras.saving.serialize_keras_object(self.inner)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        return cls(model, **config)
