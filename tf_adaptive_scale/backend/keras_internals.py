"""The private Keras APIs this package reads, each where no public one serves.

Kept in one place so that a Keras upgrade that moves them breaks here. Each
function says what it reads and why no public API serves.
"""

import contextlib

import keras


# Layers and models: losses.


def own_loss_ids(layer):
    """The ids of the losses `layer` and its sublayers added in their last
    call (`add_loss`, activity regularisers), weight regularisers excepted.

    `Layer.losses` mixes these with regularisation losses made afresh on
    each read and says nothing of who added what; an instrumented model
    needs the owner to give each loss its unit's scale. Eagerly and on
    TensorFlow a layer keeps its losses in `_losses`; inside a JAX stateless
    scope, their ids in `_loss_ids`.
    """
    ids = set()
    for sublayer in layer._flatten_layers(include_self=True):
        ids.update(sublayer._loss_ids)
        ids.update(id(loss) for loss in sublayer._losses)
    return ids


def collected_losses(model):
    """The losses a JAX `stateless_call(..., return_losses=True)` collected
    and the trainer set on `model` for `compute_loss` (empty elsewhere):
    they went through `model.losses` once already.

    Keras keeps them in `_losses_override`, with no public accessor.
    """
    return model._losses_override


def compiled_losses(model):
    """The losses `model.compile(loss=...)` made, as `(path, keras.losses.Loss)`
    pairs (the path of each one's output in `y_pred`), and the output names
    the paths may use; built by the first `compute_loss`.

    Keras resolves names, functions and structures of losses into
    `CompileLoss._flat_losses`, with no public accessor.
    """
    compiled = model._compile_loss
    return [(flat.path, flat.loss) for flat in compiled._flat_losses], compiled.output_names


# Functional graphs (`instrument` rebuilds a model's graph call by call).


def is_functional(model):
    """Whether `model` is a Functional model (Keras's `Functional` class is
    not exported): it has the graph walker `run_graph` uses."""
    return hasattr(model, "_run_through_graph")


def graph_calls(model):
    """`(operation, args, kwargs)` for every call in a Functional model's
    graph, its inputs excepted.

    `model.operations` lists the operations but not the arguments of each
    call (which tensors, masks, flags or variables it was passed); only the
    graph's nodes, in `_nodes_by_depth`, hold them.
    """
    return [
        (node.operation, node.arguments.args, node.arguments.kwargs)
        for nodes in model._nodes_by_depth.values()
        for node in nodes
        if node.operation is not None and not node.is_input
    ]


def run_graph(model, inputs, call):
    """Runs a Functional (or Sequential) model's graph on `inputs`, making
    each call as `call(operation, *args, **kwargs)`.

    Keras has no public graph walker that hands back the output tensors;
    `_run_through_graph` is the one `keras.models.clone_model` uses.
    """
    if isinstance(model, keras.Sequential):
        for layer in model.layers:
            inputs = call(layer, inputs)
        return inputs
    return model._run_through_graph(inputs, operation_fn=lambda op: op, call_fn=call)


def traced_reads(operation, *args, **kwargs):
    """`(outputs, variables)`: `operation` called on the symbolic `args` and
    `kwargs`, and the variables that call read, in order.

    Keras has no public record of the variables a call reads (a `Lambda`
    can read any in its closure). Traced by `compute_output_spec` (private),
    which touches no variable on either backend; a variable's `value` asks
    the innermost `StatelessScope` for its value, so a scope entered inside
    the trace hears every read.
    """
    from keras.src.backend import compute_output_spec

    read = {}

    class Recorder(keras.StatelessScope):
        def get_current_value(self, variable):
            read[id(variable)] = variable
            return super().get_current_value(variable)

    def is_symbolic(x):
        return isinstance(x, keras.KerasTensor)

    structure = (args, kwargs)
    symbolic = [x for x in keras.tree.flatten(structure) if is_symbolic(x)]

    # Only the symbolic tensors go through the trace's arguments: JAX's
    # refuses variables (`ops.einsum(h, embedding.embeddings)`).
    def call(*traced):
        traced = iter(traced)
        args, kwargs = keras.tree.map_structure(
            lambda x: next(traced) if is_symbolic(x) else x, structure
        )
        with Recorder():
            return operation(*args, **kwargs)

    outputs = compute_output_spec(call, *symbolic)
    return outputs, list(read.values())


def mask_of(tensor):
    """The mask Keras attached to a tensor (`mask_zero`, `Masking`), or
    None: symbolic in a graph, or computed in a step (Keras's losses read it
    to leave masked entries out of their mean).

    Keras keeps it in the tensor's `_keras_mask` or, for tensors that take
    no attribute (JAX arrays), in a table by id; its accessor
    `get_keras_mask` is not exported.
    """
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


# Optimizers: the state `build` sets up.


def built_variables(optimizer):
    """The variables `optimizer` was built for, in order.

    Keras keeps them in `_trainable_variables`; `optimizer.variables` lists
    the optimizer's own (iterations, slots) instead.
    """
    return optimizer._trainable_variables


def own_variables(optimizer):
    """The variables a wrapping optimizer made itself, without its inner
    optimizer's.

    Keras keeps them in `_variables`; a `LossScaleOptimizer`'s `variables`
    adds the inner optimizer's.
    """
    return optimizer._variables


def variable_index(optimizer, variable):
    """The position of `variable` among those `optimizer` was built for,
    the row of its slots and per-variable records.

    Keras looks it up with `_get_variable_index`, by its own key; no public
    method does.
    """
    return optimizer._get_variable_index(variable)


def overwrites_with_gradient(optimizer, variable):
    """Whether `optimizer` sets `variable` to its "gradient" rather than
    stepping it (float8 scaling factors, for instance).

    The variable's public `overwrite_with_gradient` says so by default, but
    Keras's apply asks the optimizer's `_overwrite_variable_with_gradient`,
    which an optimizer may override: this asks the same.
    """
    return optimizer._overwrite_variable_with_gradient(variable)


@contextlib.contextmanager
def gradients_already_summed(optimizer):
    """The optimizer updates each replica's weights from that replica's
    gradients as they are, without all-reducing them again.

    Keras has no public switch for this: its TensorFlow optimizers all-reduce
    in `_all_reduce_sum_gradients` (keras/src/backend/tensorflow/optimizer.py),
    replaced here on the instance, while the step is traced.
    """
    # Plain attribute access: Keras tracks what is set on an optimizer.
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", list)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "_all_reduce_sum_gradients")


# Backends.


def stateless_scope():
    """The active `keras.StatelessScope`, or None.

    Keras exports the scope class but no accessor for the active one, which
    a scope nested inside it must start from.
    """
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()

