"""`instrument`: places gradient-scale boundaries on every edge of a model."""

import keras

from tf_adaptive_scale import validation

from tf_adaptive_scale.gradient_scale import LOSS_UNIT
from tf_adaptive_scale.gradient_scale import GradientScale
from tf_adaptive_scale.gradient_scale import ScaleTable
from tf_adaptive_scale.optimizer import AdaptiveLossScaleOptimizer


def instrument(model, initial_scale=1.0):
    """Returns a model with per-layer gradient scales, sharing `model`'s weights.

    Every layer becomes a unit with its own loss scale; a `GradientScale`
    boundary on each graph edge converts gradients between the consumer's and
    the producer's scales, so gradients meeting at a fork are summed at one
    scale. Nested Sequential/Functional models are inlined (their layers become
    units). Model outputs are cast to float32 by their boundaries, so the loss
    gradient is scaled before any float16 rounding; gradients enter at the
    outputs and leave at the inputs at scale 1, so an instrumented model can
    be used as a block inside any model (a subclassed one included), with its
    own scales. The original model is left as it is; both share the same
    weight variables.

    Train the result with `AdaptiveLossScaleOptimizer(..., scaling="per_layer")`.

    Args:
        model: A built Sequential or Functional Keras model.
        initial_scale: Power of two, every unit's scale before the first
            measurement (on the first step). The default 1 rarely overflows
            (a large float16 sum reduction can, at the cost of one skipped
            step); what underflows on that step is measured as zero, and a
            unit whose gradient all underflowed rises 2**8 per step until it
            sees values.

    Returns:
        An `InstrumentedModel`.

    Example:

    >>> fast = tas.instrument(model)
    >>> fast.compile(tas.AdaptiveLossScaleOptimizer(
    ...     keras.optimizers.Adam(), scaling="per_layer"), loss="mse")
    """
    initial_scale = validation.power_of_two("initial_scale", initial_scale)
    if not isinstance(model, keras.Model) or not _is_graph(model):
        raise TypeError(
            "`model` must be a built Sequential or Functional keras.Model: "
            "per-layer scaling follows the layer graph, which a subclassed "
            "model does not expose. Instrument its Functional/Sequential "
            "blocks instead (self.block = tas.instrument(block)), or use the "
            f"global adaptive scale. Received: {model!r}"
        )
    if not model.built or not model.inputs:
        raise ValueError(
            "`model` must be built on known inputs (e.g. start it with "
            "keras.Input) before it can be instrumented."
        )
    # A Sequential model's `input` is undefined until it is called.
    structure = model.inputs[0] if isinstance(model, keras.Sequential) else model.input
    input_names = [x.name for x in keras.tree.flatten(structure)]
    inlined, groups = _plan(model, input_names)
    unit_of = {}
    for unit, group in enumerate(groups, start=1):
        for op in group:
            unit_of[id(op)] = unit
    units = ["loss"] + [group[0].name for group in groups]
    members = {
        group[0].name: [op.name for op in group] for group in groups if len(group) > 1
    }
    inputs = keras.tree.map_structure(
        lambda x: keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x.name),
        structure,
    )
    taken = set(units) | set(input_names)
    table_name = "gradient_scales"
    while table_name in taken:
        table_name += "_"
    table = ScaleTable(units, initial_scale=initial_scale, name=table_name)
    control, statistics = table(keras.tree.flatten(inputs)[0])
    # Gradients leave through the inputs at scale 1, like they enter at the
    # outputs: an instrumented model nests in any model as a plain layer.
    producer_of = {id(x): LOSS_UNIT for x in keras.tree.flatten(inputs)}

    def boundary(tensor, consumer, consumer_name, output_dtype=None):
        producer = producer_of.get(id(tensor))
        if producer is None or not _is_float(tensor):
            return tensor  # no gradient flows
        if getattr(tensor, "sparse", False) or getattr(tensor, "ragged", False):
            if producer == LOSS_UNIT and output_dtype is None:
                return tensor  # a model input: no weight's gradient passes
            raise ValueError(
                f"Cannot instrument the edge from unit "
                f"'{units[producer]}' to '{consumer_name}': it carries a "
                "sparse or ragged tensor, which a gradient-scale boundary "
                "cannot convert. Make it dense (e.g. keras.ops.convert_to_"
                "tensor in a layer) or use the global adaptive scale."
            )
        return GradientScale(producer, consumer, output_dtype=output_dtype)(
            tensor, control, statistics
        )

    def call(op, *args, **kwargs):
        if id(op) in inlined:
            return _run(op, args[0], call)  # inline nested models
        unit = unit_of[id(op)]
        args, kwargs = keras.tree.map_structure(
            lambda t: boundary(t, unit, op.name) if _is_tensor(t) else t,
            (args, kwargs),
        )
        try:
            outputs = op(*args, **kwargs)
        except Exception as error:
            raise ValueError(
                f"Cannot instrument {_describe(op)}: calling it again on the "
                "instrumented graph (with a gradient-scale boundary on each "
                f"input) failed with {type(error).__name__}: {error}"
            ) from error
        for t in keras.tree.flatten(outputs):
            if _is_tensor(t):
                producer_of[id(t)] = unit
        return outputs

    outputs = _run(model, inputs, call)
    outputs = keras.tree.map_structure(
        lambda t: boundary(t, LOSS_UNIT, "loss", output_dtype="float32"), outputs
    )
    output_names = getattr(model, "output_names", None)
    return InstrumentedModel(
        inputs,
        outputs,
        name=f"{model.name}_instrumented",
        output_names=None if output_names is None else list(output_names),
        unit_members=members or None,
    )


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class InstrumentedModel(keras.Model):
    """A Functional model with per-layer gradient scales (see `instrument`).

    On construction (also when loaded) it tags every weight with the index of
    the unit whose scale its gradient carries, for the optimizer to unscale.

    Args:
        inputs: Model inputs, as for a Functional model.
        outputs: Model outputs, as for a Functional model.
        name: Optional name.

    Returns:
        A Keras model.

    Example:

    >>> instrumented = tas.instrument(model)
    >>> instrumented.layer_scales()
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tables = [l for l in self.layers if isinstance(l, ScaleTable)]
        if len(tables) != 1:
            raise ValueError(
                "An InstrumentedModel needs exactly one ScaleTable layer; "
                "build it with tas.instrument(model)."
            )
        self.scale_table = tables[0]
        for unit, name in enumerate(self.scale_table.unit_names):
            if unit == LOSS_UNIT:
                continue
            # Frozen weights too: unfrozen later, their gradients carry the
            # unit's scale like any other.
            for variable in self.get_layer(name).weights:
                variable.gradient_scale_table = self.scale_table
                variable.gradient_scale_unit = unit

    def layer_scales(self):
        """The current scale of every layer (unit) by layer name."""
        return self.scale_table.scales()

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        if (
            isinstance(optimizer, AdaptiveLossScaleOptimizer)
            and optimizer.scaling is None
        ):
            optimizer._resolve("per_layer")
        if getattr(optimizer, "scaling", None) != "per_layer":
            raise ValueError(
                "An instrumented model carries per-layer scales in its "
                "gradients: compile it with tas.AdaptiveLossScaleOptimizer(..., "
                f"scaling='per_layer'). Received: optimizer={optimizer!r}"
            )
        super().compile(optimizer, *args, **kwargs)

    def compile_from_config(self, config):
        # Keras skips this for models whose compile() is overridden.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)


def _is_graph(model):
    return isinstance(model, keras.Sequential) or hasattr(
        model, "_run_through_graph"
    )


def _is_tensor(x):
    return isinstance(x, keras.KerasTensor)


def _is_float(x):
    return "float" in keras.backend.standardize_dtype(x.dtype)


def _leaf_layers(model):
    """Every layer of `model`, nested models expanded, each once, in order."""
    seen, leaves = set(), []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        for leaf in _leaf_layers(layer) if _is_graph(layer) else [layer]:
            if id(leaf) not in seen:
                seen.add(id(leaf))
                leaves.append(leaf)
    return leaves


def _run(model, inputs, call):
    """Runs `model`'s graph on `inputs`, calling each layer through `call`."""
    if isinstance(model, keras.Sequential):
        x = inputs
        for layer in model.layers:
            x = call(layer, x)
        return x
    # Functional models expose no public graph walker; this one is the one
    # keras.models.clone_model uses.
    return model._run_through_graph(inputs, operation_fn=lambda op: op, call_fn=call)
