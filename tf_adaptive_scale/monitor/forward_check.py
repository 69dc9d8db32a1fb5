"""Where a forward pass stops being finite.

A loss that is not finite while its data is comes from the forward pass: a
float16 activation above 65504, or `0 * inf` (an attention mask built as
`(1 - mask) * -1e9` is `-inf` in float16). No loss scale fixes that, since
the loss is scaled after it; what helps is that layer computing in float32,
or bfloat16. `first_non_finite_layer` names the layer by running a batch
through the model call by call, eagerly, in training mode as a step runs it
(dropout's `1 / (1 - rate)`, batch statistics); `tas.ScaleMonitor(probe=x)`
runs it when a step is skipped for its loss.
"""

import keras
from keras import ops
from keras import tree

from tf_adaptive_scale.backend import keras_internals
from tf_adaptive_scale.numerics import validation


def first_non_finite_layer(model, x, training=True, tries=3):
    """The first layer, in the order the model calls them, whose output
    holds a non-finite value while its inputs are all finite.

    The batch runs as a training step runs it: every layer is called with
    `training`, so dropout scales what it keeps by `1 / (1 - rate)` and
    batch normalization uses the batch's statistics. Dropout may or may not
    drop the units that overflow, so in training mode the batch runs up to
    `tries` times, each with the next random draws of the model's own seed
    generators (seeded by `keras.utils.set_random_seed` or the layers'
    `seed`), and the search stops at the first run that names a layer. It
    changes no state: the runs are in a `keras.StatelessScope`, which drops
    their variable updates (moving statistics, seed generators, Keras's
    global seed generator).

    Nested Functional and Sequential models are searched too; a subclassed
    model's own calls cannot be followed, so it is named as a whole.

    Args:
        model: A Keras model (an unbuilt one is built by an inference call).
        x: A batch of the model's inputs.
        training: Whether to run the layers in training mode, as `fit` does;
            False: as `predict` does, once.
        tries: Runs at most in training mode, each with new random draws.

    Returns:
        The layer's path (`"block/dense_2"` inside a nested model) and
        compute dtype, as a tuple; None when every output is finite in every
        run.

    Example:

    >>> tas.first_non_finite_layer(model, x_batch)
    ('dropout', 'float16')
    >>> tas.first_non_finite_layer(model, x_batch, training=False)  # predict
    """
    training = validation.boolean("training", training)
    tries = validation.positive_int("tries", tries)
    if not model.built:
        # In inference, before the scope: a variable created in a
        # StatelessScope holds no value until the scope ends.
        model(x, training=False)
    found = []
    # Updates made in the scope are dropped at its exit.
    with keras.StatelessScope():
        for _ in range(tries if training else 1):
            _call(model, (x,), {"training": training}, found, "", training)
            if found:
                return found[0]
    return None


def _call(layer, args, kwargs, found, path, training):
    """`layer(*args, **kwargs)`, followed call by call where it is a graph;
    the first call whose finite inputs gave a non-finite output is appended
    to `found` as `(path, dtype)`. Every layer of a graph is called with
    `training`, as Keras's `Functional.call` calls them."""
    if not found and args and _walkable(layer):
        def inner(sublayer, *args, **kwargs):
            # Keras's own operations (`ops.add` in a graph) take no `training`.
            if isinstance(sublayer, keras.Layer):
                kwargs["training"] = training
            prefix = f"{path}/" if path else ""
            return _call(sublayer, args, kwargs, found, prefix + sublayer.name,
                         training)

        return keras_internals.run_graph(layer, args[0], inner)
    outputs = layer(*args, **kwargs)
    if not found and _finite((args, kwargs)) and not _finite(outputs):
        found.append((path or layer.name,
                      keras.backend.standardize_dtype(layer.compute_dtype)))
    return outputs


def _walkable(layer):
    return isinstance(layer, keras.Sequential) or keras_internals.is_functional(layer)


def _finite(values):
    """Whether every float tensor in the nest `values` is finite."""
    return all(
        bool(ops.all(ops.isfinite(v)))
        for v in tree.flatten(values)
        if hasattr(v, "dtype") and keras.backend.is_float_dtype(v.dtype)
    )
