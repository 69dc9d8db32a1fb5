"""AdaptiveLossScaleOptimizer: bounded, observable loss scaling with clipping."""

import functools
import math

import keras
from keras import ops

from tf_adaptive_scale import clipping
from tf_adaptive_scale import distribution
from tf_adaptive_scale import gradient_statistics as stats
from tf_adaptive_scale import layer_scaling
from tf_adaptive_scale import validation

SCALING_MODES = ("adaptive", "dynamic", "static", "none", "per_layer")


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class AdaptiveLossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """A loss scale optimizer whose scale follows the gradients themselves.

    Wraps a Keras optimizer. Each step it checks the gradients of all replicas
    for non-finite values: a non-finite gradient anywhere skips the whole step
    (no weight, slot or clipping history changes) and backs the scale off.
    Otherwise it unscales the gradients, clips them, and applies them with the
    inner optimizer.

    Scaling modes (`scaling`):

    - `"adaptive"`: every `update_every` steps the optimizer takes a histogram
      of the binary exponents of the unscaled gradients (O(N), fused by XLA)
      and sets the largest power-of-two scale that keeps `headroom` below
      float16's maximum; where that would leave more than `underflow_rate` of
      the nonzero values below float16's smallest subnormal (2**-24), headroom
      is given up as far as needed, never past overflow. An overflow skips the
      step, halves the scale, caps later updates at the halved scale (the cap
      doubles back after `dynamic_growth_steps` clean steps) and re-measures
      on the next step.
    - `"dynamic"`: Keras-compatible: the scale doubles after
      `dynamic_growth_steps` clean steps and halves after `hysteresis`
      consecutive overflows.
    - `"static"`: the scale stays at `initial_scale`; overflows still skip.
    - `"none"`: no scaling (scale 1); non-finite steps are still skipped.
    - `"per_layer"`: for models made by `tas.instrument`: every layer has its
      own scale, applied inside the backward pass (the loss itself is not
      scaled). Each weight gradient is unscaled by its layer's scale; every
      `update_every` steps each layer's scale is set by the adaptive rule from
      the statistics its boundaries gathered in the backward pass; an
      overflow skips the step and halves only the scales of the layers where
      it started. `layer_scales()` returns them by layer name.

    Scales are always powers of two in `[min_scale, max_scale]`. Statistics
    (`gradient_histogram`, `gradient_max`, `gradient_norm`,
    `underflow_fraction`, `scale_window`) are measured every `update_every`
    steps in every mode; other steps pay for none of them.

    Clipping acts on unscaled gradients, in this order: AGC, `clipvalue`,
    `clipnorm`, `global_clipnorm`, AutoClip. `clipped_steps` counts the steps
    on which any of them changed a gradient.

    Counters: `iterations` is the inner optimizer's count of *applied* steps
    (learning-rate schedules see it, so skipped steps do not advance them);
    `total_steps` counts every step, `skipped_steps` the skipped ones.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        scaling: One of `"adaptive"`, `"dynamic"`, `"static"`, `"none"`,
            `"per_layer"`.
            Defaults to `None`: `"adaptive"` when the global dtype policy
            computes in float16, `"none"` otherwise (bfloat16, float32).
        initial_scale: Power of two, the scale before the first update.
        dynamic_growth_steps: Clean steps before the scale (`"dynamic"`) or the
            cap on the scale (`"adaptive"`) doubles.
        min_scale: Power of two, the smallest scale.
        max_scale: Power of two, the largest scale.
        hysteresis: Consecutive overflows before the scale backs off.
        update_every: Steps between two measurements of the statistics.
        underflow_rate: In (0, 1), the tolerated fraction of nonzero gradient
            values below float16's smallest subnormal.
        underflow_criterion: `"count"` (the paper's: a fraction of the
            values) or `"mass"` (a fraction of the squared gradient norm,
            which tiny values barely carry).
        headroom: Power of two >= 1 kept between the largest scaled gradient
            and float16's maximum.
        max_scale_rise: Optional int, the most binades an adaptive or
            per-layer scale may rise in one update (falls are never capped).
        clipnorm: Clip each gradient tensor to this L2 norm.
        clipvalue: Clip each gradient element to `[-clipvalue, clipvalue]`.
        global_clipnorm: Clip all gradients together to this global norm.
        autoclip_percentile: In (0, 100]; enables AutoClip: clip the norm to
            this percentile of the last `autoclip_window` norms.
        autoclip_window: Size of AutoClip's ring buffer of norms.
        autoclip_per_variable: AutoClip each variable's norm against its own
            history instead of the global norm.
        agc_factor: Enables AGC: clip a unit whose gradient norm exceeds this
            multiple of its weight norm.
        agc_eps: Smallest weight norm in AGC.
        name: Optional name.

    Example:

    >>> keras.mixed_precision.set_global_policy("mixed_float16")
    >>> optimizer = AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    >>> model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    >>> model.fit(x, y)
    >>> float(optimizer.loss_scale), int(optimizer.skipped_steps)
    """

    def __init__(
        self,
        inner_optimizer,
        scaling=None,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        min_scale=2.0**-16,
        max_scale=2.0**24,
        hysteresis=1,
        update_every=100,
        underflow_rate=1e-3,
        underflow_criterion="count",
        headroom=2.0**4,
        max_scale_rise=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        autoclip_percentile=None,
        autoclip_window=1000,
        autoclip_per_variable=False,
        agc_factor=None,
        agc_eps=1e-3,
        name=None,
        **kwargs,
    ):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`inner_optimizer` must be a keras.optimizers.Optimizer "
                f"instance. Received: {inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, keras.mixed_precision.LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` is already a LossScaleOptimizer; wrap the "
                "optimizer inside it instead."
            )
        if scaling is not None:
            validation.one_of("scaling", scaling, SCALING_MODES)
        initial_scale = validation.power_of_two("initial_scale", initial_scale)
        min_scale = validation.power_of_two("min_scale", min_scale)
        max_scale = validation.power_of_two("max_scale", max_scale)
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                "Scales must satisfy `min_scale <= initial_scale <= max_scale`."
                f" Received: min_scale={min_scale}, "
                f"initial_scale={initial_scale}, max_scale={max_scale}"
            )
        dynamic_growth_steps = validation.positive_int(
            "dynamic_growth_steps", dynamic_growth_steps
        )
        hysteresis = validation.positive_int("hysteresis", hysteresis)
        update_every = validation.positive_int("update_every", update_every)
        underflow_rate = validation.open_unit_interval(
            "underflow_rate", underflow_rate
        )
        validation.one_of(
            "underflow_criterion", underflow_criterion, ("count", "mass")
        )
        if max_scale_rise is not None:
            max_scale_rise = validation.positive_int("max_scale_rise", max_scale_rise)
        headroom = validation.power_of_two("headroom", headroom)
        if headroom < 1:
            raise ValueError(f"`headroom` must be >= 1. Received: {headroom}")
        clip_norm = validation.positive_float(
            "clipnorm", clipnorm, allow_none=True
        )
        clip_value = validation.positive_float(
            "clipvalue", clipvalue, allow_none=True
        )
        global_clip_norm = validation.positive_float(
            "global_clipnorm", global_clipnorm, allow_none=True
        )
        autoclip_percentile = validation.positive_float(
            "autoclip_percentile", autoclip_percentile, allow_none=True
        )
        if autoclip_percentile is not None and autoclip_percentile > 100:
            raise ValueError(
                "`autoclip_percentile` must be in (0, 100]. "
                f"Received: {autoclip_percentile}"
            )
        autoclip_window = validation.positive_int(
            "autoclip_window", autoclip_window
        )
        if not isinstance(autoclip_per_variable, bool):
            raise TypeError(
                "`autoclip_per_variable` must be a bool. "
                f"Received: {autoclip_per_variable!r}"
            )
        agc_factor = validation.positive_float(
            "agc_factor", agc_factor, allow_none=True
        )
        agc_eps = validation.positive_float("agc_eps", agc_eps)

        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        self.scaling = scaling
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis
        self.update_every = update_every
        self.underflow_rate = underflow_rate
        self.underflow_criterion = underflow_criterion
        self.max_scale_rise = max_scale_rise
        self.headroom = headroom
        self.clip_norm = clip_norm
        self.clip_value = clip_value
        self.global_clip_norm = global_clip_norm
        self.autoclip_percentile = autoclip_percentile
        self.autoclip_window = autoclip_window
        self.autoclip_per_variable = autoclip_per_variable
        self.agc_factor = agc_factor
        self.agc_eps = agc_eps
        self.mode = scaling or (
            "adaptive"
            if keras.config.dtype_policy().compute_dtype == "float16"
            else "none"
        )
        # The scale exists before `build` so that `scale_loss` reads a
        # variable from the first trace on (no retrace once built).
        self.dynamic_scale = self._state(
            "dynamic_scale",
            1.0 if self.mode in ("none", "per_layer") else initial_scale,
        )
        self._gradients_unscaled = False

    def _state(self, name, value, shape=(), dtype="float32"):
        return self.add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            aggregation="only_first_replica",
            name=name,
        )

    def build(self, var_list):
        """Creates the optimizer's state for `var_list`.

        Args:
            var_list: The model's trainable variables.
        """
        self.step_counter = self._state("step_counter", 0, dtype="int32")
        self.overflow_streak = self._state("overflow_streak", 0, dtype="int32")
        self.scale_ceiling = self._state("scale_ceiling", self.max_scale)
        self.total_steps = self._state("total_steps", 0, dtype="int64")
        self.skipped_steps = self._state("skipped_steps", 0, dtype="int64")
        self.last_step_finite = self._state(
            "last_step_finite", True, dtype="bool"
        )
        self.steps_since_update = self._state(
            "steps_since_update", 0, dtype="int32"
        )
        self.gradient_histogram = self._state(
            "gradient_histogram", 0.0, shape=(stats.NUM_BINS,)
        )
        self.gradient_max = self._state("gradient_max", 0.0)
        self.underflow_fraction = self._state("underflow_fraction", 0.0)
        self.scale_window = self._state("scale_window", 0.0, shape=(2,))
        self.gradient_norm = self._state("gradient_norm", 0.0)
        self.clipped_steps = self._state("clipped_steps", 0, dtype="int64")
        if self.autoclip_percentile is not None:
            rows = (len(var_list),) if self.autoclip_per_variable else ()
            self.norm_history = self._state(
                "norm_history", 0.0, shape=rows + (self.autoclip_window,)
            )
            self.norm_history_count = self._state(
                "norm_history_count", 0, dtype="int32"
            )
        # An instrumented model's `statistics` is written here, never trained.
        self.inner_optimizer.build(
            [v for v in var_list if not hasattr(v, "scale_table")]
        )
        # Skip LossScaleOptimizer.build: its state is created above.
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def loss_scale(self):
        """The current global loss scale (a float32 variable)."""
        return self.dynamic_scale

    def scale_loss(self, loss):
        """Multiplies `loss` by the current scale.

        Args:
            loss: The loss tensor.

        Returns:
            The scaled loss (the loss itself when scaling is `"none"`).
        """
        if self.mode in ("none", "per_layer"):
            return loss
        return loss * ops.cast(self.dynamic_scale, loss.dtype)

    def get_scaled_loss(self, loss):
        """Legacy tf-keras name of `scale_loss`."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Legacy tf-keras API: divides `grads` by the current scale.

        The next `apply`/`apply_gradients` then takes its gradients as already
        unscaled, as tf-keras did.

        Args:
            grads: A list of gradients of the scaled loss (entries may be None).

        Returns:
            The list of unscaled gradients.
        """
        if self.mode == "per_layer":
            raise ValueError(
                "get_unscaled_gradients() knows no per-layer scales: with "
                "scaling='per_layer', pass the gradients to apply() as they are."
            )
        self._gradients_unscaled = True
        return [
            None if g is None else g / ops.cast(self.dynamic_scale, g.dtype)
            for g in grads
        ]

    def apply(self, grads, trainable_variables=None):
        """Checks, unscales, clips and applies `grads`, or skips the step.

        Args:
            grads: Gradients of the scaled loss (entries may be None).
            trainable_variables: The matching variables; optional once built.
        """
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        pairs = [
            (ops.convert_to_tensor(g), v)  # densifies IndexedSlices
            for g, v in zip(grads, trainable_variables)
            if g is not None
        ]
        if not pairs:
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        pairs, tables = self._split_scale_tables(pairs)
        grads, variables = (list(x) for x in zip(*pairs))
        scaled = not self._gradients_unscaled
        self._gradients_unscaled = False
        distribution.run_step(
            lambda g, apply_fn: self._step(g, variables, apply_fn, scaled, tables),
            self.inner_optimizer.apply,
            grads + [g for g, _ in tables],
            variables,
        )

    def _split_scale_tables(self, pairs):
        """Separates the statistics of instrumented models' ScaleTables."""
        tables = [p for p in pairs if hasattr(p[1], "scale_table")]
        rest = [p for p in pairs if not hasattr(p[1], "scale_table")]
        if self.mode == "per_layer" and not tables:
            raise ValueError(
                "scaling='per_layer' needs the gradients of a model made by "
                "tas.instrument(model), including its `statistics` variable "
                "(pass all of model.trainable_variables)."
            )
        if self.mode != "per_layer" and tables:
            raise ValueError(
                "These gradients come from an instrumented model (per-layer "
                "scales): use AdaptiveLossScaleOptimizer(..., "
                f"scaling='per_layer'), not scaling={self.mode!r}."
            )
        self._scale_tables = [v.scale_table for _, v in tables]
        return rest, [(g, v.scale_table) for g, v in tables]

    def layer_scales(self):
        """The current per-layer scales by layer name (per-layer mode).

        Returns:
            A dict of Python floats; empty before the first step.
        """
        scales = {}
        for table in getattr(self, "_scale_tables", []):
            scales.update(table.scales())
        return scales

    def _step(self, grads, variables, apply_fn, scaled, tables):
        """One step on the (replica-summed) gradients."""
        grads, table_grads = grads[: len(variables)], grads[len(variables) :]
        regular = [
            i
            for i, v in enumerate(variables)
            if not self._overwrite_variable_with_gradient(v)
        ]
        scale = ops.convert_to_tensor(self.dynamic_scale)
        scheduled = ops.equal(self.steps_since_update, 0)
        finite = self.check_finite(grads)
        steps = [
            self._table_step(table, statistics, variables, regular)
            for (_, table), statistics in zip(tables, table_grads)
        ]
        if self.mode == "per_layer":
            # Weights outside every instrumented block carry no scale.
            divisors = {i: ops.ones((), "float32") for i in regular}
            for step in steps:
                divisors.update(step.divisors())
                finite = ops.logical_and(finite, step.backward_finite())
        else:
            divisors = {i: scale for i in regular}
        unscaled = [
            g / ops.cast(divisors[i], g.dtype) if i in divisors and scaled else g
            for i, g in enumerate(grads)
        ]

        def on_finite():
            regular_grads = [unscaled[i] for i in regular]
            ops.cond(
                scheduled, lambda: self._measure(regular_grads, scale), lambda: None
            )
            for step in steps:
                step.update(unscaled)
            clipped = self._clip(regular_grads, [variables[i] for i in regular])
            applied = list(unscaled)
            for i, g in zip(regular, clipped):
                applied[i] = g
            apply_fn(applied)
            self._after_finite_step(steps)

        def on_non_finite():
            self._after_non_finite_step(steps)
            allowed = ops.equal(self.overflow_streak, 0)  # hysteresis reached
            for step in steps:
                step.back_off(unscaled, allowed)

        ops.cond(finite, on_finite, on_non_finite)
        self.total_steps.assign_add(1)
        self.last_step_finite.assign(finite)
        for step in steps:
            step.record(scheduled, ops.equal(self.steps_since_update, 0))

    def _table_step(self, table, statistics, variables, regular):
        members = [
            (i, variables[i].gradient_scale_unit)
            for i in regular
            if getattr(variables[i], "gradient_scale_table", None) is table
        ]
        log2_min, log2_max = math.log2(self.min_scale), math.log2(self.max_scale)
        rule = functools.partial(
            layer_scaling.layer_log2_scales,
            underflow_rate=self.underflow_rate,
            log2_headroom=math.log2(self.headroom),
            log2_min=log2_min,
            log2_max=log2_max,
            weigh=self._criterion_weights,
            max_rise=self.max_scale_rise,
        )
        return layer_scaling.TableStep(
            table, statistics, members, rule, log2_min, log2_max
        )

    def _measure(self, unscaled, scale):
        """Records the statistics and, in adaptive mode, sets the scale."""
        histogram, max_abs = stats.exponent_histogram(unscaled)
        weights = self._criterion_weights(histogram)
        log2_scale, low, high = stats.adaptive_log2_scale(
            weights, max_abs, self.underflow_rate, math.log2(self.headroom)
        )
        if self.mode == "adaptive":
            log2_scale = stats.bounded_log2_scale(
                log2_scale,
                ops.round(ops.log2(scale)),
                ops.log2(self.scale_ceiling),
                math.log2(self.min_scale),
                math.log2(self.max_scale),
                self.max_scale_rise,
            )
            # Nothing nonzero to measure: keep the scale.
            scale = ops.where(
                ops.sum(histogram) > 0, stats.pow2(log2_scale), scale
            )
            self.dynamic_scale.assign(scale)
        self.gradient_histogram.assign(histogram)
        self.gradient_max.assign(max_abs)
        self.gradient_norm.assign(clipping.global_norm(unscaled))
        self.scale_window.assign(ops.stack([low, high]))
        self.underflow_fraction.assign(
            stats.underflow_fraction(weights, ops.round(ops.log2(scale)))
        )

    def _criterion_weights(self, histogram):
        if self.underflow_criterion == "mass":
            return stats.mass_histogram(histogram)
        return histogram

    def _clip(self, grads, variables):
        """Clips unscaled gradients; counts the steps where clipping acted."""
        acted = []
        if self.agc_factor is not None:
            grads, a = clipping.adaptive_grad_clip(
                grads, variables, self.agc_factor, self.agc_eps
            )
            acted.append(a)
        if self.clip_value is not None:
            grads, a = clipping.clip_by_value(grads, self.clip_value)
            acted.append(a)
        if self.clip_norm is not None:
            grads, a = clipping.clip_by_norm(grads, self.clip_norm)
            acted.append(a)
        if self.global_clip_norm is not None:
            grads, a = clipping.clip_by_global_norm(grads, self.global_clip_norm)
            acted.append(a)
        if self.autoclip_percentile is not None:
            grads, a = self._autoclip(grads, variables)
            acted.append(a)
        if acted:
            self.clipped_steps.assign_add(
                ops.cast(ops.any(ops.stack(acted)), "int64")
            )
        return grads

    def _autoclip(self, grads, variables):
        count = self.norm_history_count
        if self.autoclip_per_variable:
            rows = [self._get_variable_index(v) for v in variables]
            norms = ops.stack([clipping.global_norm([g]) for g in grads])
            history = ops.take(self.norm_history, rows, axis=0)
        else:
            norms = clipping.global_norm(grads)
            history = self.norm_history
        history = clipping.push_history(history, count, norms)
        threshold = clipping.history_percentile(
            history, count + 1, self.autoclip_percentile
        )
        if self.autoclip_per_variable:
            self.norm_history.assign(
                ops.scatter_update(
                    self.norm_history, [[r] for r in rows], history
                )
            )
            grads, acted = clipping.clip_by_norm(grads, threshold)
        else:
            self.norm_history.assign(history)
            grads, acted = clipping.clip_by_global_norm(grads, threshold)
        self.norm_history_count.assign_add(1)
        return grads, acted

    def _after_finite_step(self, table_steps):
        self.overflow_streak.assign(0)
        self.steps_since_update.assign(
            ops.mod(self.steps_since_update + 1, self.update_every)
        )
        if self.mode not in ("dynamic", "adaptive", "per_layer"):
            return
        grow = ops.equal(self.step_counter, self.dynamic_growth_steps - 1)
        self.step_counter.assign(ops.where(grow, 0, self.step_counter + 1))
        if self.mode == "per_layer":
            for step in table_steps:
                step.raise_ceilings(grow)
            return
        # Dynamic mode grows the scale; adaptive mode the cap on its updates.
        grown = (
            self.dynamic_scale if self.mode == "dynamic" else self.scale_ceiling
        )
        grown.assign(
            ops.where(grow, ops.minimum(grown * 2.0, self.max_scale), grown)
        )

    def _after_non_finite_step(self, table_steps):
        self.skipped_steps.assign_add(1)
        if self.mode not in ("dynamic", "adaptive", "per_layer"):
            return
        streak = self.overflow_streak + 1
        back_off = streak >= self.hysteresis
        self.overflow_streak.assign(ops.where(back_off, 0, streak))
        self.step_counter.assign(0)
        self.steps_since_update.assign(0)  # measure again on the next step
        if self.mode == "per_layer":
            return  # each table backs off where the overflow started
        scale = ops.where(
            back_off,
            ops.maximum(self.dynamic_scale * 0.5, self.min_scale),
            self.dynamic_scale,
        )
        self.dynamic_scale.assign(scale)
        if self.mode == "adaptive":
            self.scale_ceiling.assign(
                ops.where(back_off, scale, self.scale_ceiling)
            )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "AdaptiveLossScaleOptimizer supports the TensorFlow backend only."
        )

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The parent pops from `config`; leave the caller's dict intact.
        return super().from_config(dict(config), custom_objects=custom_objects)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "scaling": self.scaling,
                "min_scale": self.min_scale,
                "max_scale": self.max_scale,
                "hysteresis": self.hysteresis,
                "update_every": self.update_every,
                "underflow_rate": self.underflow_rate,
                "underflow_criterion": self.underflow_criterion,
                "max_scale_rise": self.max_scale_rise,
                "headroom": self.headroom,
                "clipnorm": self.clip_norm,
                "clipvalue": self.clip_value,
                "global_clipnorm": self.global_clip_norm,
                "autoclip_percentile": self.autoclip_percentile,
                "autoclip_window": self.autoclip_window,
                "autoclip_per_variable": self.autoclip_per_variable,
                "agc_factor": self.agc_factor,
                "agc_eps": self.agc_eps,
            }
        )
        return config
