"""Where a forward pass stops being finite.

A loss that is not finite while its data is comes from the forward pass: a
float16 activation above 65504, or `0 * inf` (an attention mask built as
`(1 - mask) * -1e9` is `-inf` in float16). No loss scale fixes that, since
the loss is scaled after it; what helps is that layer computing in float32,
or bfloat16. `first_non_finite_layer` names the layer by running a batch
through the model call by call, eagerly; `tas.ScaleMonitor(probe=x)` runs it
when a step is skipped for its loss.
"""

import keras
from keras import ops
from keras import tree

from tf_adaptive_scale import keras_internals


def first_non_finite_layer(model, x):
    """The first layer, in the order the model calls them, whose output
    holds a non-finite value while its inputs are all finite.

    Nested Functional and Sequential models are searched too; a subclassed
    model's own calls cannot be followed, so it is named as a whole.

    Args:
        model: A Keras model.
        x: A batch of the model's inputs.

    Returns:
        The layer's path (`"block/dense_2"` inside a nested model) and
        compute dtype, as a tuple; None when every output is finite.

    Example:

    >>> tas.first_non_finite_layer(model, x_batch)
    ('dense_1', 'float16')
    """
    found = []
    _call(model, (x,), {}, found, path="")
    return found[0] if found else None


def _call(layer, args, kwargs, found, path):
    """`layer(*args, **kwargs)`, followed call by call where it is a graph;
    the first call whose finite inputs gave a non-finite output is appended
    to `found` as `(path, dtype)`."""
    if not found and args and _walkable(layer):
        def inner(sublayer, *args, **kwargs):
            prefix = f"{path}/" if path else ""
            return _call(sublayer, args, kwargs, found, prefix + sublayer.name)

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
