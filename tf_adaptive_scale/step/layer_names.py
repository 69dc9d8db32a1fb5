"""One name per layer: its path in the model as the user built it.

A layer of the model is named by its own name (`dense`); a layer of a
nested model by the nested models' names and its own, joined by `/`
(`block/dense_2`); the model's own name is never part of it. A layer's
sub-layers (a `MultiHeadAttention`'s `query`) are the layer. Per layer, a
unit is named the same way (`instrument`). docs/monitor.md ("Layer names")
states the rule; `forward_check` names the layers it searches the same way.

Keras's variable paths are not that: a Sequential or subclassed model builds
its layers inside its own name scope (`sequential/dense/kernel`), a
Functional one outside it (`dense/kernel`), and a nested Functional model's
layers carry no scope of the model (`dense_2/kernel` inside `block`). So
`of_model` walks the model; `from_paths` is the fallback for an optimizer
that was never shown its model (a custom loop).
"""

import keras


def of_model(model):
    """`{id(variable): layer name}` for every weight of `model`.

    Args:
        model: A Keras model (Sequential, Functional or subclassed).

    Returns:
        A dict; a weight of the model itself (a subclassed model's
        `add_weight`) is named by its path without the model's scope.
    """
    names = {}
    _walk(model, "", names)
    for variable in model.weights:
        names.setdefault(id(variable), _path_name(variable, model.name))
    return names


def _walk(model, prefix, names):
    for layer in model.layers:
        name = prefix + layer.name
        if isinstance(layer, keras.Model):
            _walk(layer, name + "/", names)
            own = layer.weights
            for variable in own:
                names.setdefault(id(variable), prefix + _path_name(variable, None))
        else:
            for variable in layer.weights:
                names.setdefault(id(variable), name)


def _path_name(variable, scope):
    """A variable's path less its own name and, where it starts with it,
    the scope `scope`."""
    path = getattr(variable, "path", variable.name)
    parent = path.rsplit("/", 1)[0] if "/" in path else path
    if scope is not None and parent.startswith(scope + "/"):
        parent = parent[len(scope) + 1:]
    return parent


def from_paths(variables):
    """Layer names of `variables` from their paths alone: each path less its
    last component, less the first one where every path starts with the
    same scope and keeps more below it (a Sequential's `sequential/`, a
    subclassed model's own name).

    Args:
        variables: Keras variables (or objects with a `path` or `name`).

    Returns:
        A list of names, one per variable.
    """
    parents = [_path_name(v, None) for v in variables]
    firsts = {parent.split("/", 1)[0] for parent in parents}
    if len(firsts) == 1 and parents and all("/" in parent for parent in parents):
        return [parent.split("/", 1)[1] for parent in parents]
    return parents
