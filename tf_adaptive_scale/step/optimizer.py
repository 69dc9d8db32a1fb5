"""AdaptiveLossScaleOptimizer: bounded, observable loss scaling with clipping."""

import functools
import sys
import typing
import warnings

import keras
import numpy as np
from keras import ops

from tf_adaptive_scale.backend import backends
from tf_adaptive_scale.backend import branching
from tf_adaptive_scale.backend import keras_internals
from tf_adaptive_scale.backend import sparse_gradients as sparse
from tf_adaptive_scale.numerics import gradient_statistics as stats
from tf_adaptive_scale.per_layer import gradient_scale
from tf_adaptive_scale.per_layer import layer_scaling
from tf_adaptive_scale.rules import clipping
from tf_adaptive_scale.rules import optimizer_state
from tf_adaptive_scale.rules import scale_policy
from tf_adaptive_scale.rules import settings as settings_lib
from tf_adaptive_scale.rules.optimizer_state import StateVariable
from tf_adaptive_scale.step import accumulation_model
from tf_adaptive_scale.step import gradient_window
from tf_adaptive_scale.step import layer_names
from tf_adaptive_scale.step import legacy_api
from tf_adaptive_scale.step import measurement
from tf_adaptive_scale.step import scale_step
from tf_adaptive_scale.step import step_state
from tf_adaptive_scale.step import stock_state


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class AdaptiveLossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    __doc__ = """A loss scale optimizer whose scale follows the gradients themselves.

    One step, `scale_loss` then `apply`:

    1. `scale_loss` multiplies the loss by the scale (a power of two) and
       notes whether the loss is finite.
    2. `apply` divides every gradient by that scale (per layer, also by its
       layer's), in float32, and runs the clipping chain.
    3. A non-finite value anywhere, on any replica, skips the step (no
       weight, slot or clipping history changes); a non-finite loss is bad
       data, skipped without backing the scale off.
    4. Every `update_every` steps a finite step is measured: one fused pass
       of exponent histograms over the unscaled gradients.
    5. The mode's policy (`scale_policy`) turns what the step saw into the
       next scale, which is written to the optimizer's variables.

    What a user reads, beside Keras's `LossScaleOptimizer`'s: every argument
    as an attribute (`update_every`; all in `settings`) and the mode's
    `policy`; the state variables (`loss_scale`, `skipped_steps`,
    `measurements`, ...: docs/monitor.md, "What you can read";
    `declared_state()` lists them; `scale_window` is worked out when read);
    `read()`, `layer_scales()`, `gradient_scales()`, `stalled_layers()`,
    `check_progress()` and `name_layers(model)`; the step protocol's
    `scale_loss`, `observe_loss` and `apply`, and tf-keras's
    `get_scaled_loss`/`get_unscaled_gradients`. `iterations` counts applied
    steps only. The rules are in docs/arguments.md ("Arguments", "The
    adaptive rule") and docs/per_layer.md.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
{args}
        name: Optional name.

    Example:

    >>> keras.mixed_precision.set_global_policy("mixed_float16")
    >>> optimizer = AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    >>> model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    >>> model.fit(x, y)
    >>> float(optimizer.loss_scale), int(optimizer.skipped_steps)
    """.format(args=settings_lib.args_doc(indent=8))

    def __init__(self, inner_optimizer, scaling=None, *, name=None, **kwargs):
        settings_lib.check_inner_optimizer(inner_optimizer)
        kwargs = dict(kwargs, scaling=scaling)
        settings = settings_lib.Settings.take(kwargs)  # the rest are Keras's
        super().__init__(
            inner_optimizer, initial_scale=settings.initial_scale,
            dynamic_growth_steps=settings.dynamic_growth_steps, name=name, **kwargs,
        )
        self.settings = settings
        # Keras's base set these to None (only the inner optimizer clips
        # itself); here they read as the arguments, like the others.
        self.clipnorm, self.clipvalue = settings.clipnorm, settings.clipvalue
        self.global_clipnorm = settings.global_clipnorm
        self._clippers = self.settings.clipping_chain()
        self._policy = None
        self._layer_names = _LayerNames()
        self._state = optimizer_state.DeclaredState(self)
        self._protocol = self._state.make(_protocol_state(self.initial_scale))
        self._state.pack()
        if scaling is not None:
            self._resolve_scaling(scaling)
    __init__.__signature__ = settings_lib.signature()  # for help() and IDEs

    def __getattr__(self, name):
        # Only when ordinary lookup fails; `__dict__`: `settings` may not be set yet.
        settings = self.__dict__.get("settings")
        if settings is not None and name in settings_lib.NAMES:
            return getattr(settings, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def declared_state(self):
        """The optimizer's own variables, as declared
        (`optimizer_state.StateVariable`s, in the order they are saved)."""
        return tuple(self._state.specs)

    @property
    def scale_window(self):
        """`[low, high]`, a NumPy array: the exponents the rule allows for the
        last measured step's gradients (`adaptive_rule.AdaptiveRule.bounds`,
        worked out when read; the default rule's before the mode is
        resolved)."""
        rule = (self._policy.rule if self._policy is not None
                else self.settings.policy("adaptive").rule)
        window = rule.bounds(self._measurement.gradient_histogram.value,
                             self._measurement.gradient_max.value)
        return np.array([float(bound) for bound in window], "float32")

    @property
    def policy(self):
        """The mode's `scale_policy.Policy` (None until resolved)."""
        return self._policy

    def _resolve_scaling(self, scaling):
        """Fixes the mode (in `scale_policy.SCALING_MODES`) of an optimizer made
        with `scaling=None` (at the first step, or by an instrumented model)."""
        if self._policy is not None and self._policy.name != scaling:
            raise ValueError(
                f"The optimizer's scaling is already {self._policy.name!r}; "
                f"received scaling={scaling!r}."
            )
        self._policy = self.settings.policy(scaling)
        self.settings = self.settings.with_scaling(scaling)
        if not self._policy.scales_loss:
            # Outside any trace: the scale is 1 from the next step on.
            backends.assign_now(self.dynamic_scale, 1.0)

    def build(self, var_list):
        """Creates the optimizer's state for `var_list` (the model's trainable
        variables); building again for the same list is a no-op."""
        if self.built:
            self._check_known(var_list, all_of_them=True)
            return
        _refuse_a_wrapper(self)
        n = len(var_list)
        make = self._state.make
        self._step_state = step_state.StepState(make(step_state.declared(n)), self.dynamic_scale)
        self._measurement = measurement.Measurement(make(measurement.declared(n)))
        self._clipping_state = make(_CLIPPING_STATE)
        taken = [spec.name for spec in self._state.specs]
        for clipper, prefix in zip(self._clippers,
                                   clipping.state_prefixes(self._clippers, n, taken)):
            clipper.bind(make(clipper.declared(n), prefix))
        if self.accumulation_steps > 1:
            self._window = gradient_window.GradientWindow(
                make(gradient_window.declared(var_list)), var_list, self.accumulation_steps,
            )
        self._state.pack()
        self._scale_tables = layer_scaling.tables_of(var_list)
        if not self._scale_tables:
            _warn_of_an_instrumented_original(var_list)
        # An instrumented model's `statistics` is written here, never trained.
        self.inner_optimizer.build(_trained(var_list))
        # Skip LossScaleOptimizer.build: its state is created above.
        keras.optimizers.Optimizer.build(self, var_list)
        if self._policy is None and not backends.TENSORFLOW:
            # Decided now, eagerly: a JAX trace has no graph to read, and
            # `scale_loss` must use the mode's scale from the first step on.
            self._resolve_scaling(self._default_scaling([], self._scale_tables))

    @property
    def loss_scale(self):
        """The current global loss scale (a float32 variable)."""
        return self.dynamic_scale

    @backends.not_converted
    def scale_loss(self, loss):
        """Multiplies `loss` (a tensor or a number) by the current scale, in
        its float dtype (float32 for a number), and begins a step: the next
        `apply` divides its gradients by this scale and skips the step if
        this loss is not finite (without backing off). A later call begins
        the step anew (docs/custom_loops.md, "The step protocol")."""
        loss = _float_tensor(loss)
        self.observe_loss(loss)
        scale = self.dynamic_scale.value
        self._protocol.loss_scale_used.assign(scale)
        return ops.cast(ops.cast(loss, "float32") * scale, loss.dtype)

    @backends.not_converted
    def observe_loss(self, loss):
        """Begins a step for a loss scaled elsewhere (by `loss_scale`): what
        `scale_loss` does besides scaling, noting whether `loss` is finite."""
        # Summed over replicas: a non-finite loss on any one is noted.
        finite = ops.all(ops.isfinite(_float_tensor(loss)))
        self._protocol.non_finite_losses.assign(ops.cast(ops.logical_not(finite), "float32"))
        self._protocol.gradients_unscaled.assign(False)

    @backends.not_converted
    def apply(self, grads, trainable_variables=None):
        """Checks, unscales, clips and applies `grads` (of the scaled loss,
        or unscaled by `get_unscaled_gradients` since the last `scale_loss`;
        None entries ignored) to `trainable_variables` (optional once built),
        or skips the step."""
        if trainable_variables is None:
            trainable_variables = keras_internals.built_variables(self)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables)
                 if g is not None and not gradient_scale.is_scale_state(v)]
        if not pairs:
            return
        if not self.built:
            with backends.variables_made_now(), keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        self._check_known([v for _, v in pairs])
        pairs, tables = layer_scaling.split_tables(pairs, self._policy)
        grads, variables = (list(x) for x in zip(*pairs))
        if self._policy is None:
            self._resolve_scaling(self._default_scaling(grads, tables))
        mode = scale_step.for_policy(self._policy)
        backends.run_step(
            lambda g, apply_fn: self._step(g, variables, apply_fn, tables),
            self.inner_optimizer, grads, variables,
            statistics=[(g, gradient_scale.combine_replicas) for g, _ in tables],
            replica_statistics=lambda: [
                (m, stats.combine_measurements) for m in mode.own_measurements(
                    lambda: self._packed_measurement(grads, variables))],
        )

    def _check_known(self, variables, all_of_them=False):
        """Refuses variables this optimizer was not built for, as Keras's do
        (`all_of_them`: `variables` must be exactly those)."""
        built = keras_internals.built_variables(self)
        if all_of_them and [id(v) for v in variables] != [id(v) for v in built]:
            raise ValueError(
                f"The optimizer '{self.name}' is already built for {len(built)} "
                f"other variables; received `var_list` of {len(variables)}. "
                "Create a new optimizer for another set of variables."
            )
        known = {id(v) for v in built}
        for v in variables:
            if id(v) not in known:
                raise ValueError(
                    f"Unknown variable: '{getattr(v, 'path', v.name)}'. The "
                    f"optimizer '{self.name}' was built for {len(built)} other "
                    "variables and can only be called for those: create a new "
                    "optimizer for another model or set of variables."
                )

    def _packed_measurement(self, grads, variables):
        """This replica's (or micro-batch's) own packed measurement."""
        log2_scale = self._log2_gradient_scale(ops.round(ops.log2(self.dynamic_scale.value)))
        return measurement.Measurement.packed([grads[i] for i in self._regular(variables)],
                                              log2_scale)

    def _default_scaling(self, grads, tables):
        """`scaling=None`, from the model: instrumented, or computing in
        float16 (its gradients tell or, eagerly, the global dtype policy).
        Scaling off is said, with why: a forgotten `mixed_float16` policy
        would otherwise look like a run with nothing to scale."""
        mode = scale_policy.default_mode(
            instrumented=bool(tables),
            computes_in_float16=backends.computes_in_float16([sparse.values(g) for g in grads])
            or keras.config.dtype_policy().compute_dtype == "float16",
        )
        if not scale_policy.MODES[mode].scales_loss:
            warnings.warn(
                f"AdaptiveLossScaleOptimizer '{self.name}': the model computes in "
                f"{keras.config.dtype_policy().compute_dtype} (dtype policy "
                f"{keras.config.dtype_policy().name!r}), so loss scaling is off "
                "(scaling='none'): only float16 gradients underflow. For float16 "
                "training, call keras.mixed_precision.set_global_policy('mixed_float16') "
                "before building the model.",
                stacklevel=3,
            )
        return mode

    def _step(self, grads, variables, apply_fn, tables):
        """One step on the (replica-summed) gradients, or one micro-batch."""
        n, t = len(variables), len(tables)
        step = self._decide if self.accumulation_steps == 1 else self._add_to_window
        step(
            _Inputs(grads[:n], grads[n : n + t], grads[n + t :], variables, False, tables),
            apply_fn,
            ops.equal(self._protocol.non_finite_losses.value, 0.0),
        )
        # This step's notes are used up (see `scale_loss`).
        self._protocol.non_finite_losses.assign(0.0)
        self._protocol.loss_scale_used.assign(0.0)
        self._protocol.gradients_unscaled.assign(False)

    def _add_to_window(self, inputs, apply_fn, loss_finite):
        """Adds one micro-batch to the window (its unscaled gradients and
        statistics, weighted by its loss's normaliser where the model says
        it: `exact_accumulation`); the window's last micro-batch decides for
        all."""
        regular = self._regular(inputs.variables)
        source = self._scale_step(inputs, regular)
        unscaled = stats.unscale(inputs.grads, self._log2_divisors(source, regular))
        weight = 1.0
        for i in accumulation_model.normaliser_variables(inputs.variables):
            log2_scale = self._log2_gradient_scale(source.state.log2_scale)
            weight = inputs.grads[i] * stats.pow2(-log2_scale)
        # Each replica's, combined, where a strategy measured them.
        packed = inputs.packed or source.own_measurements(
            lambda: self._packed_measurement(inputs.grads, inputs.variables))
        index = functools.partial(keras_internals.variable_index, self)
        rows = {i: index(inputs.variables[i]) for i in regular}
        statistics = [index(t.statistics) for _, t in inputs.tables]
        # The window's sums are dense: a sparse gradient is summed into them.
        values = {rows[i]: sparse.dense(unscaled[i]) * weight for i in regular}
        values.update(zip(statistics, inputs.table_grads))

        def decide(contents, window_packed, window_loss_finite):
            def window(grads):
                """The window's weighted mean in place of a micro-batch's
                gradients."""
                return [contents(rows[i]) if i in rows else g for i, g in enumerate(grads)]

            self._decide(
                inputs._replace(
                    grads=window(inputs.grads),
                    table_grads=[contents(s) for s in statistics],
                    packed=window_packed,
                    already_unscaled=True,
                ),
                # Each replica reads its own copy of the window's sums.
                lambda applied, transform: apply_fn(
                    applied, lambda summed: transform(window(summed))
                ),
                window_loss_finite,
            )

        self._window.add_and_decide(values, weight, packed, loss_finite, decide)

    def _scale_step(self, inputs, regular):
        """The step's `scale_step.ScaleStep`, the mode's."""
        return scale_step.for_policy(self._policy)(
            self._policy, self._step_state.scale_state(), scale_step.StepInputs(
                [t for _, t in inputs.tables], inputs.table_grads, inputs.variables, regular),
        )

    def _log2_loss_scale(self, log2_current):
        """The scale `scale_loss` used this step, else the current one (a
        loss scaled by `loss_scale` directly): they differ only on the step
        that resolves `scaling=None`."""
        used = self._protocol.loss_scale_used.value
        return ops.where(
            used > 0, ops.round(ops.log2(ops.maximum(used, 2.0**-126))), log2_current,
        )

    def _log2_gradient_scale(self, log2_current):
        """The scale the gradients `apply` receives carry: the loss's, or 1
        where `get_unscaled_gradients` divided them already."""
        return ops.where(
            self._protocol.gradients_unscaled.value, 0.0, self._log2_loss_scale(log2_current)
        )

    def _log2_divisors(self, source, regular):
        """Every gradient is divided by the scale it carries and, in an
        instrumented model, by its layer's; in float32 (a float16 scale of
        2**16 would be inf)."""
        log2_loss_scale = self._log2_gradient_scale(source.state.log2_scale)
        log2_divisors = {i: log2_loss_scale for i in regular}
        for i, log2_unit in source.log2_divisors().items():
            log2_divisors[i] = log2_divisors[i] + log2_unit
        return log2_divisors

    def _decide(self, inputs, apply_fn, loss_finite):
        """The step pipeline: observe, decide, apply or skip, write the state."""
        regular = self._regular(inputs.variables)
        source = self._scale_step(inputs, regular)
        log2_divisors = self._log2_divisors(source, regular)
        weights = [inputs.variables[i] for i in regular]
        rows = [keras_internals.variable_index(self, v) for v in weights]

        def transform(grads):
            """The unscaled and the clipped (applied) gradients; a pure
            function of the summed gradients, so every replica can apply it
            to its own copy of the sum."""
            unscaled = grads if inputs.already_unscaled else stats.unscale(grads, log2_divisors)
            clipped, acted, commit = [unscaled[i] for i in regular], None, None
            if self._clippers:
                clipped, acted, commit = clipping.clip(self._clippers, clipped, weights, rows)
            applied = list(unscaled)
            for i, g in zip(regular, clipped):
                applied[i] = g
            return unscaled, applied, (acted, commit)

        unscaled, applied, clipping_record = transform(inputs.grads)
        # Each gradient's statistics, taken once: its peak pass also says
        # whether it is finite and whether it holds any nonzero value.
        each = measurement.Measurement.statistics([unscaled[i] for i in regular]) if regular \
            else None
        finite_each, finite = self._finite(applied, regular, loss_finite, source, each)
        scheduled = ops.equal(source.state.steps_to_measure, 0)
        # Only variables overwritten with their gradients: nothing to measure.
        measure = source.measured(ops.logical_and(scheduled, finite)) if regular else _any([])
        seen = each.total().max_abs > 0 if regular else _any([])
        applies = source.applies(finite, measure, seen)
        self._apply_or_skip(applies, applied, transform, apply_fn, clipping_record)
        latest = (self._record(regular, rows, each, finite, finite_each, measure, inputs.packed)
                  if regular else self._measurement.latest())
        new = source.next_state(
            scale_step.observation(finite, loss_finite, measure), unscaled, latest)
        # Reported at the scale the next steps use.
        self._measurement.report_underflow(measure, new.log2_scale, self._policy.rule, latest)
        self._step_state.write(new, applies, loss_finite)

    def _finite(self, applied, regular, loss_finite, source, each):
        """Per regular gradient, whether what reaches its weight is finite;
        and whether the whole step is (its loss and backward pass too).
        Unclipped, what reaches a weight is the unscaled gradient, whose
        statistics `each` already tell."""
        # One vector, not a scalar per variable (a kernel each).
        if not regular:  # only variables overwritten with their gradients
            finite_each = ops.zeros((0,), "bool")
        elif self._clippers:
            finite_each = ops.stack(
                [ops.all(ops.isfinite(sparse.values(applied[i]))) for i in regular])
        else:
            finite_each = ops.equal(each.non_finite, 0)
        # Variables overwritten with their gradients (float8 scales) are
        # checked too, as the stock optimizer checks them.
        overwritten = [
            ops.all(ops.isfinite(sparse.values(g)))
            for i, g in enumerate(applied) if i not in regular
        ]
        # Without clippers, from the statistics' totals (which XLA computes
        # once): a reduction over the variables fewer.
        all_finite = ops.all(finite_each) if self._clippers or not regular \
            else ops.equal(each.total().non_finite, 0)
        finite = ops.logical_and(_all([all_finite] + overwritten), loss_finite)
        return finite_each, ops.logical_and(finite, source.backward_finite())

    def _apply_or_skip(self, applies, applied, transform, apply_fn, clipping_record):
        acted, commit_clipping = clipping_record

        def on_finite():
            apply_fn(applied, lambda grads: transform(grads)[1])
            if commit_clipping is not None:
                commit_clipping()
                self._clipping_state.clipped_steps.assign_add(
                    ops.cast(acted, backends.COUNTER_DTYPE))

        def on_non_finite():
            self._step_state.skipped_steps.assign_add(1)

        # Both branches hold elementwise updates only (an empty one does
        # not do), so that XLA turns the conditional into selects fused with
        # the update, as for the stock optimizer (a scatter or a nested
        # measurement in a branch keeps the conditional around the whole
        # update; on GPU XLA waits on the host for every conditional).
        branching.select(applies, on_finite, on_non_finite)

    def _record(self, regular, rows, each, finite, finite_each, measure, packed):
        """Flags non-finite gradients (on a skipped step) and, on a measured
        one, records the statistics `each`, per variable at its row; returns
        the `measurement.Latest` statistics."""
        self._step_state.note_non_finite(finite, finite_each, rows)
        return self._measurement.record(
            measure, each, rows, self._step_state.total_steps.value, *packed)

    def _regular(self, variables):
        """Indices of the variables updated from their gradients."""
        overwritten = functools.partial(keras_internals.overwrites_with_gradient, self)
        return [i for i, v in enumerate(variables) if not overwritten(v)]

    def finalize_variable_values(self, var_list):
        """Lets the inner optimizer finalize the model's weights (EMA, say),
        an instrumented model's `statistics` left out."""
        self.inner_optimizer.finalize_variable_values(_trained(var_list))

    def save_own_variables(self, store):
        """Saves this optimizer's state: Keras's own variables and the inner
        optimizer's by position, each declared variable (`declared_state()`,
        packed or not) by its name, so that state added or retired later
        loads by name."""
        for i, variable in enumerate(self._keras_own()):
            store[f"{_KERAS}{i}"] = variable.numpy()
        for name, variable in self._state.by_name().items():
            store[name] = variable.numpy()
        for i, variable in enumerate(self.inner_optimizer.variables):
            store[f"{_INNER}{i}"] = variable.numpy()

    def load_own_variables(self, store):
        """Loads this optimizer's state (a declared variable the file lacks
        keeps its initial value), or one saved by position (0.1.0's files),
        or a stock `LossScaleOptimizer`'s (see `stock_state`)."""
        keys = set(store.keys())
        if f"{_KERAS}0" not in keys:
            self._load_by_position(store)
            return
        by_position = ((_KERAS, self._keras_own()), (_INNER, list(self.inner_optimizer.variables)))
        for prefix, variables in by_position:
            held = sum(k.startswith(prefix) for k in keys)
            if held != len(variables):
                warnings.warn(
                    f"Skipping variable loading for optimizer '{self.name}': it has "
                    f"{len(variables)} `{prefix}` variables and the file {held} (another "
                    "inner optimizer or learning rate, or the optimizer is not built).",
                    stacklevel=2,
                )
                return
        for prefix, variables in by_position:
            for i, variable in enumerate(variables):
                variable.assign(store[f"{prefix}{i}"])
        for name, variable in self._state.by_name().items():
            if name in keys:  # retired entries are left unread
                variable.assign(store[name])

    def _load_by_position(self, store):
        """A file of 0.1.0 (an entry per variable, by position; `retired`
        variables in their places), or a stock optimizer's."""
        saved = self._keras_own() + self._state.positional() + list(
            self.inner_optimizer.variables)
        if len(store.keys()) == len(saved):
            for i, variable in enumerate(saved):
                if variable is not None:  # None: a retired variable's entry
                    variable.assign(store[str(i)])
            return
        if self.built and stock_state.load(
            store, self.inner_optimizer, _trained(keras_internals.built_variables(self)),
            {**{v.name: v for v in self._keras_own()}, **self._state.by_name()},
            restore_scale=self._policy is None or self._policy.scales_loss,
        ):
            return
        warnings.warn(
            f"Skipping variable loading for optimizer '{self.name}': it held "
            f"{len(saved)} entries by position and the file has {len(store.keys())} "
            "(another inner optimizer or `accumulation_steps`, or the optimizer "
            "is not built).",
            stacklevel=2,
        )

    # TensorFlow checkpoints hold the declared state by name
    # (`optimizer_state`), not by position in Keras's variable list, which
    # the packing changed: a checkpoint written before restores by name.
    def _trackable_children(self, *args, **kwargs):
        children = super()._trackable_children(*args, **kwargs)
        children.pop("_variables", None)
        return children

    def _lookup_dependency(self, name, *args, **kwargs):
        return None if name == "_variables" else super()._lookup_dependency(
            name, *args, **kwargs)

    def _keras_own(self):
        """The variables Keras's base optimizer made on this one (its
        iterations and learning rate), not the declared state."""
        made = {id(v) for v in self._state.variables()}
        return [v for v in keras_internals.own_variables(self) if id(v) not in made]

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """`apply` on values instead of variables (JAX: `model.fit` and
        loops over `model.stateless_call`); returns the new values of the
        trainable variables and of `optimizer.variables`."""
        if backends.TENSORFLOW:
            raise NotImplementedError("On TensorFlow, use apply(): its conditionals "
                                      "assign the optimizer's variables in place.")
        # The generic stateless step, `apply` in a StatelessScope (stock's
        # LossScaleOptimizer replaces it with its own decision).
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    # The tf-keras loss-scaling API, for loops written for tf-keras.

    @backends.not_converted
    def get_scaled_loss(self, loss):
        """Legacy tf-keras name of `scale_loss` (`loss` may be a callable).

        Args:
            loss: The loss, or a callable returning it.

        Returns:
            The scaled loss (a callable returning it, for a callable).
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    @backends.not_converted
    def get_unscaled_gradients(self, grads):
        """Legacy tf-keras API: divides `grads` by the scale of this step's
        loss, and marks the step: the next `apply` takes its gradients as
        unscaled, unless a `scale_loss` begins a new step first
        (docs/custom_loops.md, "The step protocol").

        Args:
            grads: Gradients of the scaled loss (None entries kept; sparse
                ones stay sparse).

        Returns:
            The list of unscaled gradients.
        """
        legacy_api.check_unscaling(self.policy)
        log2_current = ops.round(ops.log2(self.dynamic_scale.value))
        self._protocol.gradients_unscaled.assign(True)
        return legacy_api.unscaled(grads, self._log2_loss_scale(log2_current))

    # Host-side reads of what the optimizer measured and counted.

    def read(self):
        """What the optimizer measured and counted, read on the host (all
        that `tas.ScaleMonitor` reports).

        Returns:
            A `measurement.Reading`.
        """
        state = self._step_state
        return measurement.read(
            self._measurement, self.dynamic_scale, state.total_steps, state.skipped_steps,
            state.last_loss_finite, self._clipping_state.clipped_steps, self.policy,
            self.gradient_scales(),
        )

    def gradient_scales(self):
        """Per variable the optimizer was built for, `(layer name, log2 of the
        scale its gradient carries)` (per layer, its unit's), None for an
        instrumented model's own statistics; empty before `build`."""
        if not self.built:
            return []
        return measurement.gradient_scales(
            keras_internals.built_variables(self), self._scale_tables, self.dynamic_scale,
            self._layer_names.names,
        )

    def name_layers(self, model):
        """Names the layers of what `read()`, `gradient_scales()` and
        `stalled_layers()` report by their path in `model` (docs/monitor.md,
        "Layer names"): `dense`, `block/dense_2` in a nested model, never
        the model's own name. `tas.ScaleMonitor` calls it in `fit`; an
        optimizer never shown its model names them from the variables'
        paths.

        Args:
            model: The Keras model this optimizer trains.
        """
        self._layer_names.names = layer_names.of_model(model)

    def stalled_layers(self):
        """The layers whose gradients were not finite on the last skipped
        step, nearest the loss last."""
        return measurement.stalled_layers(self._step_state.non_finite_gradients,
                                           self.gradient_scales())

    def check_progress(self):
        """Raises `SkippedStepsError`, saying why and where, after
        `max_consecutive_skips` consecutive skipped steps (for custom loops;
        in `fit`, `tas.ScaleMonitor` calls it).

        Raises:
            SkippedStepsError: When the limit is reached.
        """
        limit = self.max_consecutive_skips
        state = self._step_state if self.built else None
        skips = int(state.consecutive_skips.numpy()) if self.built else 0
        if limit is not None and skips >= limit:
            raise measurement.SkippedStepsError(measurement.stall_report(
                skips, int(state.total_steps.numpy()), limit,
                bool(state.last_loss_finite.numpy()), self.stalled_layers(),
            ))

    def layer_scales(self):
        """The current per-layer scales by layer name (per-layer mode), as
        Python floats; empty before the first step."""
        scales = {}
        for table in scale_tables(self):
            scales.update(table.scales())
        return scales

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The parent pops from `config`; leave the caller's dict intact.
        return super().from_config(dict(config), custom_objects=custom_objects)

    def get_config(self):
        # The resolved mode is saved: a reloaded optimizer scales as this one.
        return {**super().get_config(), **self.settings.get_config()}


class _Inputs(typing.NamedTuple):
    """What `apply` hands the step: the gradients, the tables' statistics,
    the packed replica measurement (under a strategy), their owners, and
    whether the gradients are unscaled (a window's mean is)."""

    grads: list
    table_grads: list
    packed: list
    variables: list
    already_unscaled: bool
    tables: list


class _LayerNames:
    """`{id(variable): layer name}` of the model trained, once shown it (a
    holder: Keras's optimizer would track a dict attribute)."""

    def __init__(self):
        self.names = {}


def _protocol_state(initial_scale):
    """Made before `build`, for `scale_loss`'s first trace: the scale, the
    non-finite losses since the last step (summed over replicas: bad data,
    not an overflow), the scale the loss was multiplied by (0: none; the mode
    may be resolved between `scale_loss` and `apply`), and whether the caller
    unscaled this step's gradients already (`get_unscaled_gradients`): the
    step protocol, in variables so that eager and traced calls, in one
    function or several, agree."""
    return (
        StateVariable("dynamic_scale", initial_scale, packed=False),
        StateVariable("non_finite_losses", aggregation="sum"),
        StateVariable("loss_scale_used"),
        StateVariable("gradients_unscaled", False, dtype="bool"),
    )


# The keys of Keras's own variables and the inner optimizer's in saved files
# (by position: the declared state is saved by name).
_KERAS, _INNER = "keras_", "inner_"

# Applied steps on which a clipper acted.
_CLIPPING_STATE = (StateVariable("clipped_steps", 0, dtype=backends.COUNTER_DTYPE),)


def _refuse_a_wrapper(optimizer):
    """Raises where a loss-scale optimizer wrapping `optimizer` builds it:
    Keras's `LossScaleOptimizer(AdaptiveLossScaleOptimizer(...))` unscales
    by its own scale, and this one would divide again (an update 2**-15 of
    float32's). Read from the stack: nothing else tells the inner optimizer
    (Keras's wrapper builds it before any step, on every backend)."""
    frame = sys._getframe(1)
    while frame is not None:
        caller = frame.f_locals.get("self")
        if caller is not optimizer and getattr(caller, "__dict__", {}).get(
                "inner_optimizer") is optimizer:
            raise ValueError(
                f"An AdaptiveLossScaleOptimizer cannot be the `inner_optimizer` of "
                f"{type(caller).__name__} '{caller.name}': both scale the loss, and "
                "the gradients would be divided twice. Use one of them: pass the "
                "AdaptiveLossScaleOptimizer to `compile` itself (Keras does not "
                "wrap it again)."
            )
        frame = frame.f_back


def _warn_of_an_instrumented_original(var_list):
    """Warns where `var_list` holds weights an instrumented model scales but
    not its `ScaleTable`: the model `tas.instrument` was given is fitted,
    not the one it returned, and trains without per-layer scales."""
    if any(gradient_scale.instrumented_weight(v) for v in var_list):
        warnings.warn(
            "These weights belong to a model that tas.instrument() instrumented, "
            "but the model being trained is the original: it trains without the "
            "per-layer scales. Fit the model tas.instrument(model) returned.",
            stacklevel=3,
        )


def _trained(var_list):
    """The variables the inner optimizer trains (not an instrumented
    model's `statistics`, which the optimizer writes)."""
    return [v for v in var_list if not gradient_scale.written_by_optimizer(v)]


def _all(flags):
    return ops.all(ops.stack(flags)) if flags else ops.convert_to_tensor(True)


def _any(flags):
    return ops.any(ops.stack(flags)) if flags else ops.convert_to_tensor(False)


def _float_tensor(loss):
    """`loss` as a float tensor (a number or an int: float32, as stock's)."""
    loss = ops.convert_to_tensor(loss)
    if not keras.backend.is_float_dtype(loss.dtype):
        loss = ops.cast(loss, "float32")
    return loss


# What the library's own modules (`instrument`, `train_step`) read and set on
# an optimizer: kept off the surface a user reads.


def resolve_scaling(optimizer, scaling):
    """Fixes the mode (in `scale_policy.SCALING_MODES`) of an optimizer made
    with `scaling=None`: an instrumented model does, at `compile`."""
    optimizer._resolve_scaling(scaling)


def micro_batches_taken(optimizer):
    """Micro-batches `optimizer` took so far, read on the host: steps
    (applied and skipped) times `accumulation_steps`, and the open window's.
    Where a step count kept on the host starts (`step_programs.Schedule`)."""
    if not optimizer.built:
        return 0
    window = getattr(optimizer, "_window", None)
    open_window = 0 if window is None else int(window.count.numpy())
    steps = int(optimizer._step_state.total_steps.numpy())
    return steps * optimizer.accumulation_steps + open_window


def scale_tables(optimizer):
    """The instrumented models' `ScaleTable`s among the variables
    `optimizer` was built for (empty before `build`)."""
    return list(getattr(optimizer, "_scale_tables", []))
