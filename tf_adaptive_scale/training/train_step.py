"""Ready compiled train steps for custom loops, with gradient accumulation.

TensorFlow-specific: `tf.function`, XLA and `tf.distribute`.
"""

import functools

import keras
import tensorflow as tf
from keras import ops

from tf_adaptive_scale.backend import sparse_gradients as sparse
from tf_adaptive_scale.backend.distribution import replica_weight
from tf_adaptive_scale.numerics import validation
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.per_layer import step_programs
from tf_adaptive_scale.step import gradient_window
from tf_adaptive_scale.step import loss_normaliser
from tf_adaptive_scale.step import optimizer as optimizer_lib
from tf_adaptive_scale.step.optimizer import AdaptiveLossScaleOptimizer


def make_train_step(
    model, loss_fn, optimizer, *, jit_compile=True, accumulation_steps=1, strategy=None
):
    """Builds a compiled train step for a custom loop.

    The optimizer is built before tracing, the loss (with `model.losses`) is
    scaled as the mode needs, every trainable variable's gradient goes to
    `optimizer.apply`, and what a monitor reads comes back as tensors (no
    host synchronisation). With `accumulation_steps=K` each call runs one
    window of K micro-batches, decided on once and equal to one step on the
    whole batch (docs/custom_loops.md, "Gradient accumulation"). As in
    `model.fit`, AutoGraph is off: branch on tensors with `ops.cond`.

    Args:
        model: A built Keras model, plain or made by `tas.instrument`.
        loss_fn: A Keras loss (name, function or `keras.losses.Loss`),
            called as `loss_fn(y_true, y_pred, sample_weight)` and reduced
            over the batch. For several outputs, as in `compile(loss=...)`,
            it is applied to each and the results summed: `y` (and
            `sample_weight`, unless one serves every output) is then a list
            or tuple in output order, or a dict keyed by output name.
        optimizer: A `tas.AdaptiveLossScaleOptimizer`, or a Keras optimizer,
            which is wrapped in one with its defaults.
        jit_compile: Whether to compile the step with XLA (under a strategy,
            the forward and backward passes, not the cross-replica step).
        accumulation_steps: Micro-batches per window (an int >= 1).
        strategy: Optional `tf.distribute.Strategy`; by default the one in
            scope. Create the model inside its scope. The step takes the
            global batch, as plain tensors (split evenly over the replicas)
            or as an element of `strategy.experimental_distribute_dataset`.

    Returns:
        `step(x, y, sample_weight=None)`, which returns a dict of tensors:
        `loss` (the window's mean), `loss_scale`, `skipped_steps`,
        `consecutive_skips`, `step_finite`, `measured` (whether this step
        measured the gradients), `gradient_norm` and `underflow_fraction`
        (from the last measurement) and, for an instrumented model,
        `layer_log2_scales`. `step.tracing_count()` counts its traces.

    Example:

    >>> step = tas.make_train_step(model, "mse", keras.optimizers.Adam())
    >>> for x, y in dataset:
    ...     logs = step(x, y)
    """
    return _TrainStep(model, loss_fn, optimizer, jit_compile=jit_compile,
                      accumulation_steps=accumulation_steps, strategy=strategy)


class _TrainStep:
    """The step `make_train_step` builds (its arguments are explained there)."""

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        *,
        jit_compile=True,
        accumulation_steps=1,
        strategy=None,
    ):
        _check_model(model)
        optimizer = _adaptive_optimizer(optimizer)
        if not isinstance(jit_compile, bool):
            raise TypeError(
                f"`jit_compile` must be True or False. Received: {jit_compile!r}"
            )
        self.model = model
        self.loss_fn = loss_normaliser.keras_loss(loss_fn)
        self.optimizer = optimizer
        self.accumulation_steps = validation.positive_int(
            "accumulation_steps", accumulation_steps
        )
        # Any strategy but the default one runs the step through
        # `strategy.run`, even with one replica (the optimizer's merge_call).
        self._distributed = strategy is not None or tf.distribute.has_strategy()
        self.strategy = strategy or tf.distribute.get_strategy()
        if not optimizer.built:
            with self.strategy.scope():
                optimizer.build(model.trainable_variables)
        tables = [gradient_scale.table_of_statistics(v) for v in model.trainable_variables]
        self._is_statistics = [t is not None for t in tables]
        self._tables = [t for t in tables if t is not None]
        # Per layer, two programs: one for the steps the optimizer measures
        # (every `update_every`, counted here), one for the others.
        self._programs = step_programs.ScheduledPrograms(
            functools.partial(self._compile, jit_compile),
            step_programs.Schedule(
                optimizer.update_every if self._tables else 1,
                start=functools.partial(optimizer_lib.micro_batches_taken, optimizer)),
        )

    def _compile(self, jit_compile):
        """A new traced step: what `__call__` runs."""
        if not self._distributed:
            return tf.function(functools.partial(self._replica_step, self._gradients),
                               jit_compile=jit_compile, autograph=False)
        # The optimizer's cross-replica step cannot run inside XLA.
        gradients = tf.function(self._gradients, jit_compile=jit_compile, autograph=False)
        return tf.function(functools.partial(self._distributed_step, gradients),
                           autograph=False)

    def __call__(self, x, y, sample_weight=None):
        if self._distributed:
            x, y, sample_weight = (
                self._distribute(t) for t in (x, y, sample_weight)
            )
        if tf.inside_function():  # called from a traced function: no count to keep
            return self._programs.run(True, x, y, sample_weight)
        return self._programs(x, y, sample_weight)

    def compiled_program(self, x, y, sample_weight=None, measuring=True):
        """The optimized XLA program (HLO text) of the step for these
        inputs, as XLA compiles it (`jit_compile=True`, no strategy); per
        layer, of the measuring program or (`measuring=False`) the plain one."""
        with step_programs.measuring(measuring):
            return self._programs.program(measuring).experimental_get_compiler_ir(
                x, y, sample_weight)(stage="optimized_hlo")

    def tracing_count(self):
        """How many times the step has been traced (per layer, both
        programs together)."""
        return sum(p.experimental_get_tracing_count() for p in self._programs.programs.values())

    def _distribute(self, value):
        """Splits a global batch of plain tensors evenly over the replicas."""
        if value is None or isinstance(value, tf.distribute.DistributedValues):
            return value
        replicas = self.strategy.num_replicas_in_sync
        shards = _map(lambda t: _split(t, replicas), value)
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: _map(
                lambda t: t[context.replica_id_in_sync_group], shards
            )
        )

    def _distributed_step(self, gradient_fn, x, y, sample_weight):
        logs = self.strategy.run(functools.partial(self._replica_step, gradient_fn),
                                 args=(x, y, sample_weight))
        loss = self.strategy.reduce(
            tf.distribute.ReduceOp.MEAN, logs.pop("loss"), axis=None
        )
        # The rest is mirrored state, equal on every replica.
        logs = {
            k: self.strategy.experimental_local_results(v)[0]
            for k, v in logs.items()
        }
        return {"loss": loss, **logs}

    def _replica_step(self, gradient_fn, x, y, sample_weight):
        variables = self.model.trainable_variables
        grads, loss, normaliser = gradient_fn(x, y, sample_weight)
        batch = ops.cast(_batch_size(x), "float32")
        if self._distributed:
            # Only an empty global batch is skipped: a replica's shard of a
            # short one may be empty alone.
            batch = tf.distribute.get_replica_context().all_reduce("sum", batch)
        if normaliser is not None:  # weighed by it: divided by the sum
            grads, loss = self._normalised(grads, loss, normaliser)
        # An empty batch has zero gradients, which Adam's momentum would still
        # apply: a non-finite loss makes the optimizer skip the step instead.
        self.optimizer.observe_loss(ops.where(batch > 0, loss, float("nan")))
        self.optimizer.apply(grads, variables)
        return self._logs(loss)

    def _normalised(self, grads, loss, normaliser):
        """The weighed sums divided by the sum of the weights: the loss by
        this replica's, the gradients by the global one (`replica_weight`:
        the replicas' gradients are summed, each of a mean that Keras
        divided by the replica count)."""
        factor = ops.divide_no_nan(replica_weight(normaliser), normaliser)
        grads = [
            g if statistics else sparse.map_values(lambda v: v * factor, g)
            for g, statistics in zip(grads, self._is_statistics)
        ]
        return grads, ops.divide_no_nan(loss, normaliser)

    def _gradients(self, x, y, sample_weight):
        """The window's gradients and loss, each micro-batch's weighed by
        its normaliser where the loss's depends on the data, and the sum of
        those normalisers (which divides both; None where none is)."""
        k = self.accumulation_steps
        if k == 1:
            return self._micro_batch(x, y, sample_weight, 1.0)
        # `rest` micro-batches of `size + 1` samples, then `k - rest` of
        # `size`: any batch splits into two groups of static shapes (XLA
        # needs them). The batch size is a tensor where the trace does not
        # know it (a dataset's batches under a strategy, say).
        batch = _batch_size(x)
        static = isinstance(batch, int)
        size, rest = batch // k, batch % k
        # Float32 sums at the window's one scale: gradients of float16
        # variables too.
        carry = (
            [ops.zeros(v.shape, "float32") for v in self.model.trainable_variables],
            ops.zeros((), "float32"),
            ops.zeros((), "float32"),
        )
        start, weighed = 0, []
        for count, length in ((rest, size + 1), (k - rest, size)):
            if static and count * length == 0:
                continue  # nothing to run, so nothing to trace
            group = _map(
                lambda t: _micro_batches(t, start, count, length, static),
                (x, y, sample_weight),
            )
            start = start + count * length
            share = ops.cast(length, "float32") / ops.cast(batch, "float32")

            def body(i, carry, group=group, share=share):
                grads, loss, normaliser = self._micro_batch(
                    *_map(lambda t: t[i], group), share
                )
                summed, total, normalisers = carry
                weighed.append(normaliser is not None)  # known when traced
                return [
                    gradient_window.accumulate(a, g, statistics)
                    for a, g, statistics in zip(summed, grads, self._is_statistics)
                ], total + loss, normalisers + (share if normaliser is None else normaliser)

            # A micro-batch of no samples (a batch smaller than k) is not run.
            carry = ops.fori_loop(0, ops.where(length > 0, count, 0), body, carry)
        summed, total, normalisers = carry
        return summed, total, normalisers if any(weighed) else None

    def _micro_batch(self, x, y, sample_weight, share):
        """One micro-batch's gradients and loss and, where its loss's
        normaliser depends on the data, that normaliser `n`: then gradients
        and loss are weighed, times `n / share`, and the window divides by
        the sum of the `n` (else `n` is None)."""
        variables = self.model.trainable_variables
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            # As in `model.fit`: a Keras loss already divides its mean by
            # the number of replicas, and `model.losses` are divided here.
            loss, normaliser = self._total_loss(y, y_pred, sample_weight, share)
            if self.model.losses:
                loss = loss + share * ops.sum(
                    ops.stack([ops.cast(l, "float32") for l in self.model.losses])
                ) / replicas
            # `scale_loss`'s product; the loss is observed once per window,
            # outside the loop (an update of a variable summed over replicas
            # cannot run in a loop or a nested function).
            scaled = loss * self.optimizer.loss_scale
        grads = tape.gradient(scaled, variables)
        grads = [ops.zeros_like(v) if g is None else ops.convert_to_tensor(g)
                 for g, v in zip(grads, variables)]
        if normaliser is None:
            return grads, loss * replicas, None
        # The backward pass ran at the share of the samples (the float16
        # magnitudes of one step on the whole batch); the float32 gradients
        # weigh by the normaliser instead. Statistics are not weighed.
        weight = normaliser / share
        return [
            g if statistics else sparse.map_values(lambda v: v * weight, g)
            for g, statistics in zip(grads, self._is_statistics)
        ], loss * weight * replicas, normaliser

    def _total_loss(self, y, y_pred, sample_weight, share):
        """`loss_fn` as a float32 scalar, summed over several outputs, each
        weighted for the window: a mean by `share` (its share of the samples),
        a sum by 1. Returns it and, where a single output's normaliser
        depends on the data, that normaliser (else None)."""
        if not isinstance(y_pred, (list, tuple, dict)):
            terms = [(y, y_pred, sample_weight)]
        else:
            if isinstance(y_pred, dict):
                names, outputs = list(y_pred), list(y_pred.values())
            else:
                names, outputs = getattr(self.model, "output_names", None), list(y_pred)
            terms = zip(
                _per_output(y, names, len(outputs), "y"),
                outputs,
                _per_output(sample_weight, names, len(outputs), "sample_weight"),
            )
        terms = list(terms)
        fn = self.loss_fn
        normalisers = [loss_normaliser.of_batch(fn, t, p, w) for t, p, w in terms]
        dependent = any(n.depends_on_data for n in normalisers)
        replicas = self.strategy.num_replicas_in_sync
        if dependent and len(terms) > 1 and (self.accumulation_steps > 1 or replicas > 1):
            raise ValueError(
                f"accumulation_steps={self.accumulation_steps} with {len(terms)} "
                "outputs whose loss normalisers differ (a Keras mask, on the outputs "
                "or on the loss values as `ignore_class` puts it, or "
                f"'mean_with_sample_weight'), on {replicas} replica(s): no single "
                "weight per micro-batch or replica equals the whole batch's step. "
                "Use accumulation_steps=1 on one replica, or one output."
            )
        # A sum, as the gradient of an unreduced loss is; Keras leaves an
        # empty batch's loss unreduced, of shape (0,).
        weight = 1.0 if fn.reduction in loss_normaliser.ADDITIVE else share
        loss = weight * sum(ops.sum(ops.cast(fn(t, p, w), "float32")) for t, p, w in terms)
        # Several outputs get here as one micro-batch on one replica: no weight.
        if dependent and len(terms) == 1:
            return loss, normalisers[0].value
        return loss, None

    def _logs(self, loss):
        opt = self.optimizer
        logs = {
            "loss": loss,
            "loss_scale": ops.convert_to_tensor(opt.loss_scale),
            "skipped_steps": ops.convert_to_tensor(opt.skipped_steps),
            "consecutive_skips": ops.convert_to_tensor(opt.consecutive_skips),
            "step_finite": ops.convert_to_tensor(opt.last_step_finite),
            "measured": ops.equal(opt.measured_step, opt.total_steps - 1),
            "gradient_norm": ops.convert_to_tensor(opt.gradient_norm),
            "underflow_fraction": ops.convert_to_tensor(opt.underflow_fraction),
        }
        if self._tables:
            logs["layer_log2_scales"] = ops.concatenate(
                [ops.convert_to_tensor(t.log2_scales) for t in self._tables]
            )
            logs[step_programs.REQUEST] = step_programs.requested(
                [t.measure for t in self._tables])
        return logs


def compile_step(fn, optimizer, *, jit_compile=True):
    """Compiles a custom loop's train step that calls `optimizer.apply`,
    per layer as two programs chosen on the host (`step_programs`): the
    measuring one on the steps the optimizer measures, on schedule and two
    steps after it asks (an overflow, a unit whose scale rises blind), the
    plain one otherwise; one program in the other modes.

    Args:
        fn: The step, `fn(*args, **kwargs)`: forward pass, `scale_loss`,
            gradients and `optimizer.apply`; returns what the loop wants
            back (tensors).
        optimizer: The `tas.AdaptiveLossScaleOptimizer` `fn` applies,
            built (`optimizer.build(model.trainable_variables)`).
        jit_compile: Whether to compile the step with XLA.

    Returns:
        `step(*args, **kwargs)`, which returns what `fn` returns.

    Example:

    >>> def train_step(x, y):
    ...     with tf.GradientTape() as tape:
    ...         scaled = optimizer.scale_loss(loss_fn(y, model(x, training=True)))
    ...     optimizer.apply(tape.gradient(scaled, model.trainable_variables))
    >>> train_step = tas.compile_step(train_step, optimizer)
    """
    if not isinstance(optimizer, AdaptiveLossScaleOptimizer) or not optimizer.built:
        raise ValueError(
            "`optimizer` must be a built tas.AdaptiveLossScaleOptimizer: call "
            f"optimizer.build(model.trainable_variables) first. Received: {optimizer!r}"
        )
    flags = [t.measure for t in optimizer_lib.scale_tables(optimizer)]

    def traced(*args, **kwargs):
        outputs = {"outputs": fn(*args, **kwargs)}
        if flags:
            outputs = step_programs.with_request(outputs, step_programs.requested(flags))
        return outputs

    programs = step_programs.ScheduledPrograms(
        lambda: tf.function(traced, jit_compile=jit_compile, autograph=False),
        step_programs.Schedule(
            optimizer.update_every if flags else 1,
            start=functools.partial(optimizer_lib.micro_batches_taken, optimizer)),
    )
    return lambda *args, **kwargs: programs(*args, **kwargs)["outputs"]


def _map(fn, structure):
    """`fn` on every tensor of `structure`, leaving `None` as it is."""
    return keras.tree.map_structure(fn, structure, none_is_leaf=False)


def _split(tensor, parts, length=-1):
    """`tensor` cut along its first axis into `parts` of `length`."""
    return ops.reshape(tensor, (parts, length, *ops.shape(tensor)[1:]))


def _micro_batches(tensor, start, count, length, static):
    """Rows `[start, start + count * length)` of `tensor`, as `count`
    micro-batches of `length` along a new first axis."""
    rows = tensor[start : start + count * length]
    if static:
        return _split(rows, count, length)
    # XLA compiles the loop body even where no micro-batch runs, and cannot
    # take one from a group of none: one spare of zeros, never run.
    spare = ops.zeros((length, *ops.shape(tensor)[1:]), tensor.dtype)
    return _split(ops.concatenate([rows, spare]), count + 1, length)


def _batch_size(x):
    """The first axis of the inputs: an int, or a tensor if not static."""
    return ops.shape(keras.tree.flatten(x)[0])[0]


def _check_model(model):
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(
            "`model` must be a built Keras model (give it an Input, or "
            f"call it once). Received: {model!r}"
        )


def _adaptive_optimizer(optimizer):
    """`optimizer` as a `tas.AdaptiveLossScaleOptimizer` (a Keras optimizer
    wrapped with the defaults); refuses one that scales or accumulates
    itself, which the step would do twice."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a tas.AdaptiveLossScaleOptimizer or a "
            f"Keras optimizer. Received: {optimizer!r}"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and not (
        isinstance(optimizer, AdaptiveLossScaleOptimizer)
    ):
        raise TypeError(
            "`optimizer` is a stock keras LossScaleOptimizer: pass its "
            "inner optimizer, or a tas.AdaptiveLossScaleOptimizer."
        )
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner.gradient_accumulation_steps or (
        getattr(optimizer, "accumulation_steps", 1) > 1
    ):
        raise ValueError(
            "The optimizer accumulates gradients itself: pass "
            "make_train_step(..., accumulation_steps=K) instead, which "
            "runs a window in one call (one skip decision per window)."
        )
    if not isinstance(optimizer, AdaptiveLossScaleOptimizer):
        optimizer = AdaptiveLossScaleOptimizer(optimizer)
    return optimizer


def _per_output(value, names, outputs, what):
    """`y` or `sample_weight` as a list, one per output: from a dict by
    output name, a list or tuple in order, or a `sample_weight` (or a
    single output's `y`) the same for every output."""
    if isinstance(value, dict):
        if names is None or set(names) - set(value):
            raise ValueError(
                f"`{what}` is a dict, so it needs one entry per output name "
                f"{names}. Received keys: {sorted(value)}"
            )
        return [value[name] for name in names]
    if isinstance(value, (list, tuple)):
        if len(value) != outputs:
            raise ValueError(
                f"The model has {outputs} outputs, but `{what}` has "
                f"{len(value)} entries."
            )
        return list(value)
    if what == "y" and outputs > 1:
        raise ValueError(
            f"The model has {outputs} outputs: give `y` as a list, tuple or "
            "dict with one target per output."
        )
    return [value] * outputs

