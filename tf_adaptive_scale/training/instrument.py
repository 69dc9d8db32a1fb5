"""`instrument`: places gradient-scale boundaries on every edge of a model."""

import functools

import keras

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.backend import keras_internals
from tf_adaptive_scale.numerics import validation
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.per_layer import step_programs
from tf_adaptive_scale.rules import scale_policy

from tf_adaptive_scale.per_layer.gradient_scale import GradientScale
from tf_adaptive_scale.per_layer.gradient_scale import LOSS_UNIT
from tf_adaptive_scale.per_layer.gradient_scale import ScaleTable
from tf_adaptive_scale.step import optimizer as optimizer_lib
from tf_adaptive_scale.step.optimizer import AdaptiveLossScaleOptimizer


def instrument(model, initial_scale=1.0):
    """Returns a model with per-layer gradient scales, sharing `model`'s weights.

    Every layer and every operation on symbolic tensors becomes a unit with
    its own loss scale; a `GradientScale` boundary on each graph edge converts
    gradients between the consumer's and the producer's scales. Gradients
    enter and leave at scale 1, so the result works as a block in any model.
    Which layers become units, nested models and shared variables included,
    is in docs/per_layer.md, "What becomes a unit". The original model is
    left as it is.

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
    _check_instrumentable(model)
    # A Sequential model's `input` is undefined until it is called.
    structure = model.inputs[0] if isinstance(model, keras.Sequential) else model.input
    input_names = [x.name for x in keras.tree.flatten(structure)]
    inlined, groups, paths = _plan(model, structure, input_names)
    inputs = keras.tree.map_structure(
        lambda x: keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x.name),
        structure,
    )
    table = _scale_table(groups, paths, input_names, initial_scale)
    outputs = _InstrumentedGraph(table, inputs, inlined, groups).outputs(model)
    return InstrumentedModel(
        inputs,
        outputs,
        name=f"{model.name}_instrumented",
        output_names=getattr(model, "output_names", None),
        unit_members=_unit_members(groups, paths) or None,
    )


def _check_instrumentable(model):
    """Refuses a model whose layer graph cannot be followed."""
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
            "keras.Input) before it can be instrumented. Received the "
            f"unbuilt model '{model.name}'."
        )


def _scale_table(groups, paths, input_names, initial_scale):
    """The `ScaleTable` of the loss unit and one unit per group, named by its
    first operation's path in `model` (`block/dense_2` for a layer of an
    inlined model `block`: `layer_names`), under a name no unit or input
    has."""
    units = ["loss"] + [paths[id(group[0])] for group in groups]
    taken = set(units) | set(input_names)
    name = "gradient_scales"
    while name in taken:
        name += "_"
    return ScaleTable(units, initial_scale=initial_scale, name=name)


def _unit_members(groups, paths):
    """`{unit name: operation names}` for the units of several operations,
    or named by a path (an inlined model's layer)."""
    return {
        paths[id(group[0])]: [op.name for op in group]
        for group in groups
        if len(group) > 1 or paths[id(group[0])] != group[0].name
    }


class _InstrumentedGraph:
    """The instrumented graph, built by calling the original's operations
    again with a `GradientScale` boundary on each edge.

    Args:
        table: The `ScaleTable` of the units.
        inputs: The new model inputs.
        inlined: Ids of the nested models to inline.
        groups: The units, as lists of operations (from `_plan`).
    """

    def __init__(self, table, inputs, inlined, groups):
        self.inlined = inlined
        self.unit_of = {
            id(op): unit for unit, group in enumerate(groups, start=1) for op in group
        }
        self.control, self.statistics = table(keras.tree.flatten(inputs)[0])
        self.inputs = inputs
        # Gradients leave through the inputs at scale 1, like they enter at the
        # outputs: an instrumented model nests in any model as a plain layer.
        self.producer_of = {id(x): LOSS_UNIT for x in keras.tree.flatten(inputs)}

    def outputs(self, model):
        """`model`'s outputs on the new inputs, cast by their boundaries to
        float32 (float64 stays), with the loss gradient entering at scale 1."""
        outputs = keras_internals.run_graph(model, self.inputs, self.call)
        return keras.tree.map_structure(
            lambda t: self.boundary(t, LOSS_UNIT, output_dtype=_output_dtype(t)),
            outputs,
        )

    def boundary(self, tensor, consumer, output_dtype=None):
        """`tensor` through a boundary from its producer's scale to
        `consumer`'s; as it is where no gradient flows."""
        producer = self.producer_of.get(id(tensor))
        if producer is None or not _is_float(tensor):
            return tensor
        return GradientScale(producer, consumer, output_dtype=output_dtype)(
            tensor, self.control, self.statistics
        )

    def call(self, op, *args, **kwargs):
        """Calls `op` on its arguments through boundaries into its unit (an
        inlined model: its own graph), recording its outputs' unit."""
        if id(op) in self.inlined:
            return keras_internals.run_graph(op, args[0], self.call)
        unit = self.unit_of[id(op)]
        args, kwargs = keras.tree.map_structure(
            lambda t: self.boundary(t, unit) if _is_tensor(t) else t,
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
                self.producer_of[id(t)] = unit
        return outputs


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class InstrumentedModel(keras.Model):
    """A Functional model with per-layer gradient scales (see `instrument`).

    On construction (also when loaded) its `ScaleTable` records the unit
    whose scale each weight's gradient carries, for the optimizer to unscale
    (the weights themselves are left as they are: they may serve other
    models too).

    Args:
        inputs: Model inputs, as for a Functional model.
        outputs: Model outputs, as for a Functional model.
        name: Optional name.
        output_names: Optional names of the outputs (the original model's,
            which a loss or metric dict is keyed by); by default those of
            the layers producing them, the boundaries.
        unit_members: Optional dict from a unit's name to the names of all
            the operations it holds, for units of several operations (that
            share variables); other units hold the operation they are named
            after.

    Returns:
        A Keras model.

    Example:

    >>> instrumented = tas.instrument(model)
    >>> instrumented.layer_scales()
    """

    def __init__(self, *args, **kwargs):
        output_names = kwargs.pop("output_names", None)
        unit_members = kwargs.pop("unit_members", None)
        super().__init__(*args, **kwargs)
        tables = [l for l in self.layers if isinstance(l, ScaleTable)]
        if len(tables) != 1:
            raise ValueError(
                "An InstrumentedModel needs exactly one ScaleTable layer; "
                "build it with tas.instrument(model)."
            )
        if output_names is not None:
            output_names = list(output_names)
            if len(output_names) != len(self.outputs):
                raise ValueError(
                    f"`output_names` has {len(output_names)} names for "
                    f"{len(self.outputs)} outputs: {output_names}"
                )
            self.output_names = output_names
        self._original_output_names = output_names
        self.unit_members = dict(unit_members or {})
        self.scale_table = tables[0]
        arguments = _argument_variables(_calls(self))
        # Frozen weights too: unfrozen later, their gradients carry the
        # unit's scale like any other.
        weight_units = [
            (variable, unit)
            for unit, op in self._unit_operations()
            for variable in _variables_of(op, arguments)
        ]
        self.scale_table.bind(weight_units)

    @property
    def losses(self):
        """The additional losses (`add_loss`, activity and weight
        regularisers), each with its gradient at its unit's scale.

        Their values are the original model's; their gradients reach the
        weights at the scale the optimizer divides those weights' gradients
        by (`gradient_scale.scale_gradient`). Add them to the loss in a
        custom loop as for any model (`fit` does).
        """
        losses = super().losses
        if not losses or keras_internals.collected_losses(self):
            return losses  # none, or collected through here already (JAX)
        table = self.scale_table
        log2_scales = table.log2_scales.value
        owner = {}
        for unit, op in self._unit_operations():
            if isinstance(op, keras.layers.Layer):
                owner.update(dict.fromkeys(keras_internals.own_loss_ids(op), unit))
        scaled = [
            gradient_scale.scale_gradient(loss, log2_scales[owner[id(loss)]])
            for loss in losses
            if id(loss) in owner
        ]
        regularised = [
            (v, table.unit_of(v))
            for v in self.trainable_weights
            if v.regularizer is not None
        ]
        if len(losses) - len(scaled) != len(regularised) or any(
            unit is None for _, unit in regularised
        ):
            raise ValueError(
                f"The instrumented model '{self.name}' has losses that no "
                "layer of its graph added: their gradients would carry no "
                "known scale. Add losses inside a layer (add_loss in call, "
                "or a regulariser)."
            )
        return scaled + [
            gradient_scale.scale_gradient(v.regularizer(v.value), log2_scales[unit])
            for v, unit in regularised
        ]

    def _unit_operations(self):
        """`(unit index, operation)` for every operation of every unit.

        An operation can be absent: one that made the mask argument of an
        inlined model (whose layers take the mask their inputs carry).
        """
        operations = {op.name: op for op in self.operations}
        for unit, name in enumerate(self.scale_table.unit_names):
            if unit == LOSS_UNIT:
                continue
            for member in self.unit_members.get(name, [name]):
                if member in operations:
                    yield unit, operations[member]

    def get_config(self):
        config = super().get_config()
        if self._original_output_names is not None:
            config["output_names"] = list(self._original_output_names)
        if self.unit_members:
            config["unit_members"] = {
                name: list(members) for name, members in self.unit_members.items()
            }
        return config

    def layer_scales(self):
        """The current scale of every layer (unit) by layer name."""
        return self.scale_table.scales()

    def compile(self, optimizer=None, *args, **kwargs):
        """Compiles for training with a per-layer optimizer, or, without an
        optimizer (`optimizer=None`), for `evaluate`/`predict` only."""
        ours = isinstance(optimizer, AdaptiveLossScaleOptimizer)
        if ours and optimizer.policy is None:
            optimizer_lib.resolve_scaling(optimizer, scale_policy.PerLayerScaling.name)
        if ours and not optimizer.policy.per_layer:
            raise ValueError(
                "An instrumented model carries per-layer scales in its "
                f"gradients; its optimizer has scaling={optimizer.policy.name!r}. "
                "Make the optimizer with scaling='per_layer' (or scaling=None, "
                "resolved to per layer here)."
            )
        if optimizer is not None and not ours:
            raise ValueError(
                "An instrumented model carries per-layer scales in its "
                "gradients: compile it with tas.AdaptiveLossScaleOptimizer(..., "
                "scaling='per_layer') (or with no optimizer, to evaluate "
                f"only). Received: optimizer={optimizer!r}"
            )
        super().compile(optimizer, *args, **kwargs)
        # Built now, not inside the first traced step: variables created
        # while tracing make TensorFlow trace the step a second time (about
        # a third of a per-layer model's first step). Under a strategy,
        # Keras builds it in the strategy's scope when `fit` starts.
        if optimizer is not None and not backends.has_strategy():
            self.optimizer.build(self.trainable_variables)

    def train_step(self, *args, **kwargs):
        if getattr(self, "optimizer", None) is None:
            raise ValueError(
                "This instrumented model was compiled without an optimizer, "
                "for evaluation only. To train it, compile it with "
                "tas.AdaptiveLossScaleOptimizer(..., scaling='per_layer')."
            )
        outputs = super().train_step(*args, **kwargs)
        measure = self.scale_table.measure
        if isinstance(outputs, tuple):  # JAX: the new value is in the new state
            _, (trainable, *_) = outputs
            measure = trainable[[id(v) for v in self.trainable_variables].index(id(measure))]
        return step_programs.with_request(outputs, step_programs.requested([measure]))

    def fit(self, *args, **kwargs):
        """`keras.Model.fit`; the step count that chooses its programs
        restarts from the optimizer's when training begins (after a
        `BackupAndRestore` restored it)."""
        callbacks = kwargs.get("callbacks")
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            kwargs["callbacks"] = list(callbacks or []) + [_RestartSchedule()]
        return super().fit(*args, **kwargs)

    def make_train_function(self, force=False):
        """Two programs, measuring and plain (`step_programs`): each call
        runs the measuring one where one of its steps is due for the
        optimizer's statistics (every `update_every` steps, counted here),
        the plain one, with the boundaries' multiplies only, otherwise."""
        if self.train_function is not None and not force:
            return self.train_function
        optimizer = self.optimizer
        if not isinstance(optimizer, AdaptiveLossScaleOptimizer):
            # Without one, `train_step` says how to compile for training.
            return super().make_train_function(force)
        schedule = step_programs.Schedule(
            optimizer.update_every, self.steps_per_execution, optimizer.accumulation_steps,
            start=functools.partial(optimizer_lib.micro_batches_taken, optimizer))

        def make():
            # A step function of its own per program: JAX caches traces by
            # function, and would run the first program traced for both.
            step, own = self.train_step, "train_step" in self.__dict__
            self.train_step = lambda *args, **kwargs: step(*args, **kwargs)
            try:
                super(InstrumentedModel, self).make_train_function(force=True)
            finally:
                if own:  # set on the instance before (a test's counter, say)
                    self.train_step = step
                else:
                    del self.train_step
            program, self.train_function = self.train_function, scheduled
            return program

        scheduled = step_programs.ScheduledPrograms(make, schedule)
        self.train_function = scheduled
        return scheduled

    def compile_from_config(self, config):
        # Keras skips this for models whose compile() is overridden.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)


class _RestartSchedule(keras.callbacks.Callback):
    """Last of `fit`'s callbacks: restarts the step count of an instrumented
    model's programs from its optimizer's, once the others have restored
    it and before Keras on JAX empties the variables to train."""

    def on_train_begin(self, logs=None):
        function = self.model.train_function
        if isinstance(function, step_programs.ScheduledPrograms):
            function.schedule.restart(optimizer_lib.micro_batches_taken(self.model.optimizer))


def _is_graph(model):
    return isinstance(model, keras.Sequential) or keras_internals.is_functional(
        model
    )


def _is_tensor(x):
    return isinstance(x, keras.KerasTensor)


def _is_float(x):
    return "float" in keras.backend.standardize_dtype(x.dtype)


def _output_dtype(x):
    """float32, or the output's own dtype where it is wider (float64)."""
    dtype = keras.backend.standardize_dtype(x.dtype)
    return dtype if dtype == "float64" else "float32"


def _describe(op):
    kind = "layer" if isinstance(op, keras.layers.Layer) else "operation"
    return f"{kind} '{op.name}' ({type(op).__name__})"


def _operations(model):
    """The operations `model`'s graph calls, in order, its inputs excepted."""
    if isinstance(model, keras.Sequential):
        return list(model.layers)
    return [
        op for op in model.operations if not isinstance(op, keras.layers.InputLayer)
    ]


def _calls(model):
    """`(operation, args, kwargs)` for every call in a Functional model's
    graph (none for a Sequential one: its layers take what comes)."""
    if isinstance(model, keras.Sequential):
        return []
    return keras_internals.graph_calls(model)


def _inlinable_call(args, kwargs):
    """Whether a nested model's call can be replaced by its own graph.

    Its layers then see what its `call` would give them: the inputs, their
    masks (carried by the boundaries) and the outer `training` flag.
    """
    if len(args) != 1 or set(kwargs) - {"training", "mask"}:
        return False
    # `training=True` holds when the outer call leaves `training` unset;
    # its layers, inlined, would not see it.
    if kwargs.get("training") not in (None, False):
        return False
    mask = kwargs.get("mask")
    if mask is None:
        return True
    attached = keras.tree.map_structure(keras_internals.mask_of, args[0])
    flat_masks = keras.tree.flatten(mask)
    flat_attached = keras.tree.flatten(attached)
    return len(flat_masks) == len(flat_attached) and all(
        m is None or m is a for m, a in zip(flat_masks, flat_attached)
    )


def _plan(model, structure, input_names):
    """Which nested models to inline, and the operations of each unit.

    Nested Sequential/Functional models are inlined (their operations become
    units) unless a call passes them more than their inputs, mask and
    training flag, or inlining would put two operations of one name in the
    graph (two sub-models from one factory with an explicitly named layer):
    then the innermost model holding a clashing name stays whole, one unit.
    Operations sharing a variable share a unit, so that its gradient is
    summed at one scale; so does an operation reading a variable another
    holds (in a `Lambda`'s closure, say).

    Args:
        model: The model.
        structure: Its inputs.
        input_names: Their names.

    Returns:
        `(inlined, groups, paths)`: ids of the inlined models, the units as
        lists of operations (the first names the unit), in graph order, and
        `{id(operation): its path in model}` (`block/dense_2` inside an
        inlined `block`).
    """
    graphs, refused = _nested_graphs(model)
    inlined = {id(g) for g in graphs[1:] if id(g) not in refused}
    inlined, ops, paths = _without_name_clashes(model, inlined, input_names)
    arguments = {}
    for graph in graphs:
        arguments.update(_argument_variables(_calls(graph)))
    reads = _read_variables(model, structure, inlined)
    return inlined, _group_by_variables(ops, arguments, reads), paths


def _nested_graphs(model):
    """`(graphs, refused)`: `model` and every Sequential/Functional model
    nested in it, outermost first, and the ids of those called in a way
    that cannot be inlined."""
    graphs, refused = [model], set()
    for graph in graphs:  # grows while it is walked
        for op, args, kwargs in _calls(graph):
            if _is_graph(op) and not _inlinable_call(args, kwargs):
                refused.add(id(op))
        for op in _operations(graph):
            if isinstance(op, (ScaleTable, GradientScale)):
                where = "" if graph is model else f" in its sub-model '{graph.name}'"
                raise ValueError(
                    f"`model` ('{model.name}') is already instrumented{where} "
                    "(it holds gradient-scale boundaries); instrument the "
                    "original model instead."
                )
            if _is_graph(op) and all(op is not g for g in graphs):
                graphs.append(op)
    return graphs, refused


def _without_name_clashes(model, inlined, input_names):
    """`(inlined, ops, paths)`: `inlined` less the models whose inlining
    would give two operations (or an operation and an input) one name, the
    unit operations that leaves, in graph order, and their paths.

    Each round keeps whole the innermost models holding a clashing name;
    a clash no model holds (two top-level operations) is an error.
    """
    while True:
        ops, parents, paths = [], {}, {}
        _collect(model, None, inlined, ops, parents, paths)
        clashes = _name_clashes(ops, input_names)
        if not clashes:
            return inlined, ops, paths
        collapse = {
            id(parent)
            for keys in clashes.values()
            for key in keys
            for parent in parents[key]
            if parent is not None
        }
        if not collapse:
            raise ValueError(
                f"Cannot instrument `model`: the name '{next(iter(clashes))}' "
                "names more than one operation or input of its graph, and "
                "the instrumented model needs unique names. Rename one of them."
            )
        inlined -= collapse


def _name_clashes(ops, input_names):
    """`{name: ids of the operations of that name}` for each name of `ops`
    that several of them, or an input (the new inputs keep theirs), have."""
    by_name = {}
    for op in ops:
        by_name.setdefault(op.name, {})[id(op)] = op
    input_names = set(input_names)
    return {
        name: list(same)
        for name, same in by_name.items()
        if len(same) > 1 or name in input_names
    }


def _collect(graph, parent, inlined, ops, parents, paths, prefix=""):
    """Appends the unit operations under `graph` (each once) to `ops`, and
    their paths (`prefix` and their names) to `paths`."""
    for op in _operations(graph):
        if id(op) in inlined:
            _collect(op, op, inlined, ops, parents, paths, f"{prefix}{op.name}/")
            continue
        if id(op) not in parents:
            ops.append(op)
            parents[id(op)] = []
            paths[id(op)] = prefix + op.name
        if all(p is not parent for p in parents[id(op)]):
            parents[id(op)].append(parent)


def _argument_variables(calls):
    """`{id(operation): [variables]}`: the variables passed to operations
    as arguments (`ops.einsum(h, embedding.embeddings)`, tied weights)."""
    found = {}
    for op, args, kwargs in calls:
        arguments = keras.tree.flatten((args, kwargs))
        variables = [a for a in arguments if isinstance(a, keras.Variable)]
        if variables:
            found.setdefault(id(op), []).extend(variables)
    return found


def _read_variables(model, structure, inlined):
    """`{id(operation): [variables]}`: the float variables each unit
    operation's call reads (its weights, those it is called on, and any
    other: a `Lambda`'s closure can read any), from a trace of the graph on
    `structure` that changes no variable."""
    reads = {}

    def call(op, *args, **kwargs):
        if id(op) in inlined:
            return keras_internals.run_graph(op, args[0], call)
        try:
            outputs, variables = keras_internals.traced_reads(op, *args, **kwargs)
        except Exception as error:
            raise ValueError(
                f"Cannot instrument {_describe(op)}: tracing its call, to "
                "find the variables it reads, failed with "
                f"{type(error).__name__}: {error}"
            ) from error
        reads.setdefault(id(op), []).extend(v for v in variables if _is_float(v))
        return outputs

    keras_internals.run_graph(model, structure, call)
    return reads


def _variables_of(op, arguments):
    """The weights `op` holds and the variables it is called on."""
    return list(getattr(op, "weights", [])) + arguments.get(id(op), [])


def _group_by_variables(ops, arguments, reads):
    """Units of operations: those sharing a variable are one unit (a weight
    an operation is called on or reads included: its gradient through that
    call must be summed with the rest at one scale).

    Raises:
        ValueError: An operation reads a float variable that no operation
            holds or is called on: no unit would know the scale of its
            gradient through that read.
    """
    root = list(range(len(ops)))

    def find(i):
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    def join(i, j):
        a, b = find(i), find(j)
        if a != b:
            root[max(a, b)] = min(a, b)

    owner = {}
    for i, op in enumerate(ops):
        for variable in _variables_of(op, arguments):
            join(i, owner.setdefault(id(variable), i))
    for i, op in enumerate(ops):
        for variable in reads.get(id(op), []):
            if id(variable) not in owner:
                raise ValueError(
                    f"Cannot instrument {_describe(op)}: its call reads the "
                    f"weight '{variable.path}', which no layer of the model "
                    "holds and no operation of its graph is called on: no "
                    "unit would divide its gradient through that read by the "
                    "scale it carries. Make it a weight of this layer (a "
                    "custom layer instead of a Lambda) or of another layer "
                    "of the model, or pass it to a keras.ops call in the "
                    "model's graph (keras.ops.matmul(h, variable))."
                )
            join(i, owner[id(variable)])
    groups = {}
    for i, op in enumerate(ops):
        groups.setdefault(find(i), []).append(op)
    return list(groups.values())
