"""AdaptiveLossScaleOptimizer: bounded, observable loss scaling with clipping."""

import functools
import math
import warnings

import keras
from keras import ops

from tf_adaptive_scale import backends
from tf_adaptive_scale import branching
from tf_adaptive_scale import clipping
from tf_adaptive_scale import float16
from tf_adaptive_scale import gradient_scale
from tf_adaptive_scale import gradient_statistics as stats
from tf_adaptive_scale import gradient_window
from tf_adaptive_scale import layer_scaling
from tf_adaptive_scale import scale_policy
from tf_adaptive_scale import sparse_gradients as sparse
from tf_adaptive_scale import validation

SCALING_MODES = ("adaptive", "dynamic", "static", "none", "per_layer")
GLOBAL_MAX_SCALE = 2.0**float16.GLOBAL_MAX_EXPONENT
PER_LAYER_MAX_SCALE = 2.0**float16.PER_LAYER_MAX_EXPONENT


class SkippedStepsError(RuntimeError):
    """Training skipped `max_consecutive_skips` steps in a row."""


@keras.saving.register_keras_serializable(package="tf_adaptive_scale")
class AdaptiveLossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """A loss scale optimizer whose scale follows the gradients themselves.

    Wraps a Keras optimizer. `scale_loss` multiplies the loss by the scale;
    `apply` divides every gradient by that same scale (in float32), clips,
    and checks what is about to be applied: a non-finite value anywhere, on
    any replica, skips the whole step (no weight, slot or clipping history
    changes). A step whose loss was not finite is bad data: it is skipped
    without backing the scale off. Otherwise the inner optimizer applies it.

    Each mode is a policy in `scale_policy`, a pure state transition:

    - `"adaptive"`: every `update_every` steps the optimizer takes a histogram
      of the binary exponents of the unscaled gradients (O(N), fused by XLA)
      and sets the largest power-of-two scale that keeps `headroom` below
      float16's maximum; where that would leave more than `underflow_rate` of
      the nonzero values below float16's smallest subnormal (2**-24), headroom
      is given up as far as needed, never past overflow. The first step is
      measured: an overflow before any clean measurement drops the scale 39
      binades, so any loss magnitude costs at most one skipped step (a step
      whose gradients then all underflowed is skipped while the scale rises
      8 binades a step, below the overflow). Later,
      an overflow skips the step, halves the scale, caps it there and
      measures the next step (consecutive back-offs step 1, 2, 4, ...
      binades); each clean measurement lifts the cap a binade.
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
    (`gradient_histogram`, `gradient_zeros`, `gradient_max`,
    `gradient_norm`, `underflow_fraction`, `scale_window`) are measured every
    `update_every` steps in every mode; other steps pay for none of them.
    `underflow_fraction` counts exact zeros as underflowed: float16 cannot
    tell a gradient lost to underflow from a true zero. Per trainable
    variable (in the order of `model.trainable_variables`), the same
    measurement keeps `variable_gradient_norms` and
    `variable_gradient_histograms`; `measurements` counts measured steps and
    `measured_step` is the last one (`tas.ScaleMonitor` reads them all).

    Clipping acts on unscaled gradients, in this order: AGC, `clipvalue`,
    `clipnorm`, `global_clipnorm`, AutoClip. Unlike Keras optimizers, which
    refuse `clipnorm` with `global_clipnorm`, they combine: each tensor is
    clipped to `clipnorm`, then all together to `global_clipnorm`. `clipped_steps` counts the steps
    on which any of them changed a gradient.

    Counters: `iterations` is the inner optimizer's count of *applied* steps
    (learning-rate schedules see it, so skipped steps do not advance them);
    `total_steps` counts every step, `skipped_steps` the skipped ones.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        scaling: One of `"adaptive"`, `"dynamic"`, `"static"`, `"none"`,
            `"per_layer"`. Defaults to `None`: resolved at the first step
            (or when an instrumented model is compiled) from what the model
            computes: `"per_layer"` for an instrumented model, `"adaptive"`
            where any gradient comes from a float16 computation (or, eagerly,
            where the global dtype policy computes in float16), `"none"`
            otherwise (bfloat16, float32). On JAX it is resolved at `build`
            (from the variables and the global dtype policy). The resolved
            mode is saved.
        initial_scale: Power of two, the scale before the first update
            (unused per layer: `tas.instrument` sets the layers' first scale).
        dynamic_growth_steps: Clean steps before a `"dynamic"` scale doubles.
        min_scale: Power of two, the smallest scale. All scale arguments lie
            in float32's normal range, 2**-126 to 2**127.
        max_scale: Power of two, the largest scale. Defaults to 2**24 for a
            global scale and to 2**64 per layer: a layer's gradients may sit
            far below the loss's, and 2**64 is where the statistics' reach
            ends (unscaled values down to 2**-88).
        hysteresis: Consecutive overflows before the scale backs off.
        update_every: Steps between two measurements of the statistics.
        underflow_rate: In (0, 1), the tolerated fraction of nonzero gradient
            values below float16's smallest subnormal.
        underflow_criterion: `"count"` (the paper's: a fraction of the
            values) or `"mass"` (a fraction of the squared gradient norm,
            which tiny values barely carry).
        headroom: Power of two in [1, 2**15] kept between the largest scaled
            gradient and float16's maximum.
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
        max_consecutive_skips: Optional int: after this many consecutive
            skipped steps, `check_progress()` raises `SkippedStepsError`
            naming the layers whose gradients were not finite, and a
            `tas.ScaleMonitor` in `fit` stops training. `None` never stops.
        accumulation_steps: Int >= 1, micro-batches per optimizer step
            (gradient accumulation, e.g. in `model.fit`: each batch is a
            micro-batch). Within a window the scale stays; the unscaled
            gradients are summed in float32, then checked, clipped and
            applied (their mean) or skipped once, and the scale is updated
            once: an overflow in any micro-batch skips the window. Counters
            (`total_steps`, `skipped_steps`, the inner `iterations`) count
            windows. A window ignores epochs: micro-batches left at an
            epoch's end (batches per epoch not a multiple of K) open the
            next epoch's first window; those left when `fit` ends stay in
            the optimizer's state (saved with it) and join the next `fit`'s
            first window. Use this, not the inner optimizer's
            `gradient_accumulation_steps`, which is refused.
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
        min_scale=2.0**-32,
        max_scale=None,
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
        max_consecutive_skips=1000,
        accumulation_steps=1,
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
        if inner_optimizer.gradient_accumulation_steps:
            raise ValueError(
                "The inner optimizer has gradient_accumulation_steps="
                f"{inner_optimizer.gradient_accumulation_steps}, which would "
                "decide each micro-batch on its own: pass "
                "AdaptiveLossScaleOptimizer(..., accumulation_steps="
                f"{inner_optimizer.gradient_accumulation_steps}) instead (one "
                "skip decision and one scale update per window)."
            )
        accumulation_steps = validation.positive_int(
            "accumulation_steps", accumulation_steps
        )
        if scaling is not None:
            validation.one_of("scaling", scaling, SCALING_MODES)
        initial_scale = validation.power_of_two("initial_scale", initial_scale)
        min_scale = validation.power_of_two("min_scale", min_scale)
        if max_scale is not None:
            max_scale = validation.power_of_two("max_scale", max_scale)
        if min_scale > (max_scale or PER_LAYER_MAX_SCALE):
            # Wrong in every mode: refused now, not at the first step.
            raise ValueError(
                "`min_scale` must be <= `max_scale` (default: 2**24, or "
                f"2**64 per layer). Received: min_scale={min_scale}, "
                f"max_scale={max_scale}"
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
        if not 1 <= headroom <= 2.0**15:
            # Above 2**15 the target peak, 65504 / headroom, is below 2:
            # float16's range would be given up, not kept.
            raise ValueError(
                f"`headroom` must be in [1, 2**15]. Received: {headroom}"
            )
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
        if autoclip_per_variable and autoclip_percentile is None:
            raise ValueError(
                "`autoclip_per_variable=True` needs `autoclip_percentile` "
                "(AutoClip is off without it)."
            )
        agc_factor = validation.positive_float(
            "agc_factor", agc_factor, allow_none=True
        )
        agc_eps = validation.positive_float("agc_eps", agc_eps)
        if max_consecutive_skips is not None:
            max_consecutive_skips = validation.positive_int(
                "max_consecutive_skips", max_consecutive_skips
            )

        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
            **kwargs,
        )
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
        self.max_consecutive_skips = max_consecutive_skips
        self.accumulation_steps = accumulation_steps
        # The scale exists before `build` so that `scale_loss` reads a
        # variable from the first trace on (no retrace once built).
        self.dynamic_scale = self._state("dynamic_scale", initial_scale)
        # Non-finite losses seen by `scale_loss` since the last step, summed
        # over replicas: such a step is bad data, not an overflow.
        self.non_finite_losses = self._state(
            "non_finite_losses", 0.0, aggregation="sum"
        )
        # The scale `scale_loss` multiplied this step's loss by (0: none
        # noted): the mode may be resolved between the two calls.
        self.loss_scale_used = self._state("loss_scale_used", 0.0)
        self.scaling = None
        if scaling is not None:
            self._resolve(scaling)

    def _state(self, name, value, shape=(), dtype="float32",
               aggregation="only_first_replica"):
        return self.add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            aggregation=aggregation,
            name=name,
        )

    def _resolve(self, scaling):
        """Fixes the scaling mode and the policy that implements it."""
        per_layer = scaling == "per_layer"
        max_scale = self.max_scale or (
            PER_LAYER_MAX_SCALE if per_layer else GLOBAL_MAX_SCALE
        )
        if self.min_scale > max_scale:
            raise ValueError(
                "`min_scale` must be <= `max_scale`. Received: "
                f"min_scale={self.min_scale}, max_scale={max_scale}"
            )
        if scaling in ("static", "dynamic", "adaptive") and not (
            self.min_scale <= self.initial_scale <= max_scale
        ):
            raise ValueError(
                "Scales must satisfy `min_scale <= initial_scale <= max_scale`."
                f" Received: min_scale={self.min_scale}, "
                f"initial_scale={self.initial_scale}, max_scale={max_scale}"
            )
        self.scaling = scaling
        self._policy = scale_policy.make_policy(
            scaling,
            self.update_every,
            self.dynamic_growth_steps,
            self.hysteresis,
            math.log2(self.min_scale),
            math.log2(max_scale),
            self.max_scale_rise,
        )
        if scaling in ("none", "per_layer"):
            # Outside any trace: the scale is 1 from the next step on.
            backends.assign_now(self.dynamic_scale, 1.0)

    def build(self, var_list):
        """Creates the optimizer's state for `var_list`.

        Building again is a no-op (`InstrumentedModel.compile` builds it
        already, and scripts often build first to keep the first step's
        trace single); a different variable list is refused.

        Args:
            var_list: The model's trainable variables.
        """
        if self.built:
            if [id(v) for v in var_list] != [id(v) for v in self._trainable_variables]:
                raise ValueError(
                    f"The optimizer '{self.name}' is already built for "
                    f"{len(self._trainable_variables)} other variables; "
                    f"received `var_list` of {len(var_list)}. Create a new "
                    "optimizer for another set of variables."
                )
            return
        # int64 on TensorFlow as in the stock optimizer, whose checkpoints
        # restore into this one.
        self.step_counter = self._state("step_counter", 0, dtype=backends.COUNTER_DTYPE)
        self.overflow_streak = self._state("overflow_streak", 0, dtype="int32")
        self.scale_ceiling = self._state("scale_ceiling", 2.0**float16.NO_CAP_EXPONENT)
        self.steps_to_measure = self._state("steps_to_measure", 0, dtype="int32")
        self.calibrated = self._state("calibrated", False, dtype="bool")
        self.total_steps = self._state("total_steps", 0, dtype=backends.COUNTER_DTYPE)
        self.skipped_steps = self._state("skipped_steps", 0, dtype=backends.COUNTER_DTYPE)
        self.consecutive_skips = self._state("consecutive_skips", 0, dtype=backends.COUNTER_DTYPE)
        self.last_loss_finite = self._state("last_loss_finite", True, dtype="bool")
        # 1 where the last skipped step's gradient of a variable was not finite.
        self.non_finite_gradients = self._state(
            "non_finite_gradients", 0.0, shape=(len(var_list),)
        )
        self.last_step_finite = self._state(
            "last_step_finite", True, dtype="bool"
        )
        self.gradient_histogram = self._state(
            "gradient_histogram", 0.0, shape=(stats.NUM_BINS,)
        )
        self.gradient_zeros = self._state("gradient_zeros", 0.0)
        self.gradient_max = self._state("gradient_max", 0.0)
        self.underflow_fraction = self._state("underflow_fraction", 0.0)
        self.scale_window = self._state("scale_window", 0.0, shape=(2,))
        self.gradient_norm = self._state("gradient_norm", 0.0)
        # Per trainable variable, of the last measured step: for monitoring.
        self.variable_gradient_norms = self._state(
            "variable_gradient_norms", 0.0, shape=(len(var_list),)
        )
        self.variable_gradient_histograms = self._state(
            "variable_gradient_histograms", 0.0, shape=(len(var_list), stats.NUM_BINS)
        )
        self.measurements = self._state("measurements", 0, dtype=backends.COUNTER_DTYPE)
        self.measured_step = self._state("measured_step", -1, dtype=backends.COUNTER_DTYPE)
        self.clipped_steps = self._state("clipped_steps", 0, dtype=backends.COUNTER_DTYPE)
        if self.autoclip_percentile is not None:
            rows = (len(var_list),) if self.autoclip_per_variable else ()
            self.norm_history = self._state(
                "norm_history", 0.0, shape=rows + (self.autoclip_window,)
            )
            self.norm_history_count = self._state(
                "norm_history_count", 0, dtype="int32"
            )
        if self.accumulation_steps > 1:
            self._window = gradient_window.GradientWindow(
                self, var_list, self.accumulation_steps
            )
        self._scale_tables = [v.scale_table for v in var_list if hasattr(v, "scale_table")]
        for v in var_list:
            owners = [t for t in self._scale_tables if t.unit_of(v) is not None]
            if len(owners) > 1:
                raise ValueError(
                    f"The weight '{v.path}' belongs to {len(owners)} "
                    "instrumented models trained in one step by this "
                    "optimizer; its gradient would sum contributions at "
                    "different per-layer scales. Instrument the model that "
                    "holds all of them once instead."
                )
        # An instrumented model's `statistics` is written here, never trained.
        self.inner_optimizer.build(
            [v for v in var_list if not gradient_scale.written_by_optimizer(v)]
        )
        # Skip LossScaleOptimizer.build: its state is created above.
        keras.optimizers.Optimizer.build(self, var_list)
        if self.scaling is None and not backends.TENSORFLOW:
            # Decided now, eagerly: a JAX trace has no graph to read, and
            # `scale_loss` must use the mode's scale from the first step on.
            tables = [v for v in var_list if hasattr(v, "scale_table")]
            self._resolve(self._default_scaling([], tables))

    @property
    def loss_scale(self):
        """The current global loss scale (a float32 variable)."""
        return self.dynamic_scale

    def scale_loss(self, loss):
        """Multiplies `loss` by the current scale, noting whether it is finite.

        One step is `scale_loss` then `apply`: that `apply` divides the
        gradients by this same scale (1 where scaling is `"none"` or
        `"per_layer"`) and treats a non-finite loss as bad data: the step is
        skipped without backing the scale off. Each call replaces the note of
        the one before, so a loss scaled and then abandoned (no `apply`)
        leaves the next step alone.

        Args:
            loss: The loss: a tensor or a Python number.

        Returns:
            The scaled loss, in the loss's float dtype (float32 for a number
            or an integer).
        """
        loss = _float_tensor(loss)
        self.observe_loss(loss)
        scale = self.dynamic_scale.value
        self.loss_scale_used.assign(scale)
        return ops.cast(ops.cast(loss, "float32") * scale, loss.dtype)

    def observe_loss(self, loss):
        """Notes whether `loss` is finite, for the next `apply` (what
        `scale_loss` does besides scaling; for losses scaled elsewhere).
        The note replaces any earlier one not yet consumed by `apply`.

        Args:
            loss: The loss: a tensor or a Python number.
        """
        # Summed over replicas: a non-finite loss on any one is noted.
        self.non_finite_losses.assign(
            ops.cast(ops.logical_not(ops.all(ops.isfinite(_float_tensor(loss)))), "float32")
        )

    def get_scaled_loss(self, loss):
        """Legacy tf-keras name of `scale_loss`; `loss` may be a callable
        returning the loss, as tf-keras accepted.

        Args:
            loss: The loss, or a callable returning it.

        Returns:
            The scaled loss (a callable returning it, for a callable).
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Legacy tf-keras API: divides `grads` by the current scale.

        Pure: passing its results (or tensors computed from them, such as
        clipped ones) to `apply`/`apply_gradients` in the same traced
        function applies them as they are, as tf-keras did; any other
        gradients are unscaled by `apply` itself. Eagerly, only its very
        results are recognised.

        Args:
            grads: A list of gradients of the scaled loss (entries may be
                None; sparse ones stay sparse).

        Returns:
            The list of unscaled gradients.
        """
        if self.scaling == "per_layer":
            raise ValueError(
                "get_unscaled_gradients() knows no per-layer scales: with "
                "scaling='per_layer', pass the gradients to apply() as they are."
            )
        reciprocal = stats.pow2(-ops.log2(self.dynamic_scale.value))
        unscaled = [
            None if g is None else stats.times(sparse.values(g), reciprocal)
            for g in grads
        ]
        return [
            None if g is None else sparse.with_values(g, u)
            for g, u in zip(grads, backends.mark_unscaled(unscaled))
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
            (g, v)  # sparse gradients stay sparse
            for g, v in zip(grads, trainable_variables)
            if g is not None and not hasattr(v, "scale_state")
        ]
        if not pairs:
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        self._check_known([v for _, v in pairs])
        pairs, tables = self._split_scale_tables(pairs)
        grads, variables = (list(x) for x in zip(*pairs))
        if self.scaling is None:
            self._resolve(self._default_scaling(grads, tables))
        unscaled = self._already_unscaled(grads)
        backends.run_step(
            lambda g, apply_fn: self._step(g, variables, apply_fn, unscaled, tables),
            self.inner_optimizer,
            grads,
            variables,
            statistics=[(g, gradient_scale.combine_replicas) for g, _ in tables],
            replica_statistics=None if tables else (
                lambda: self._replica_measurement(grads, variables, unscaled)
            ),
        )

    def _check_known(self, variables):
        """Refuses variables this optimizer was not built for (one optimizer
        compiled into two models, say), as Keras optimizers do."""
        known = {id(v) for v in self._trainable_variables}
        for v in variables:
            if id(v) not in known:
                raise ValueError(
                    f"Unknown variable: '{getattr(v, 'path', v.name)}'. The "
                    f"optimizer '{self.name}' was built for "
                    f"{len(self._trainable_variables)} other variables and can "
                    "only be called for those: create a new optimizer for "
                    "another model or set of variables."
                )

    def _replica_measurement(self, grads, variables, already_unscaled):
        """This replica's own histogram, zero count and peak of its unscaled
        gradients on a scheduled step (zeros otherwise), packed in one vector
        for `combine_measurements`: float16 underflow happens in each
        replica's gradients, before they are summed."""
        grads = [grads[i] for i in self._regular(variables)]
        log2_scale = 0.0 if already_unscaled else ops.round(
            ops.log2(self.dynamic_scale.value)
        )

        def measure():
            total = stats.grouped_statistics(grads, [0] * len(grads), 1, log2_scale)
            return ops.concatenate([total.histograms[0], total.zeros, total.max_abs])

        packed = ops.cond(
            ops.equal(self.steps_to_measure.value, 0),
            measure,
            lambda: ops.zeros((stats.NUM_BINS + 2,), "float32"),
        )
        return packed, stats.combine_measurements

    def _default_scaling(self, grads, tables):
        """`scaling=None`: per layer for an instrumented model; else adaptive
        where the model computes in float16, found from its gradients or, when
        they cannot tell (eagerly), from the global dtype policy."""
        if tables:
            return "per_layer"
        if backends.computes_in_float16([sparse.values(g) for g in grads]):
            return "adaptive"
        if keras.config.dtype_policy().compute_dtype == "float16":
            return "adaptive"
        return "none"

    def _already_unscaled(self, grads):
        """Whether `grads` came from `get_unscaled_gradients` (all or none)."""
        marks = backends.unscaled_marks([sparse.values(g) for g in grads])
        if any(marks) and not all(marks):
            raise ValueError(
                "Some gradients passed to apply() come from "
                "get_unscaled_gradients() and some do not: pass all the "
                "gradients of a step through it, or none."
            )
        return all(marks)

    def _split_scale_tables(self, pairs):
        """Separates the statistics of instrumented models' ScaleTables."""
        tables = [p for p in pairs if hasattr(p[1], "scale_table")]
        rest = [p for p in pairs if not hasattr(p[1], "scale_table")]
        if self.scaling == "per_layer" and not tables:
            raise ValueError(
                "scaling='per_layer' needs the gradients of a model made by "
                "tas.instrument(model), including its `statistics` variable "
                "(pass all of model.trainable_variables)."
            )
        if self.scaling not in (None, "per_layer") and tables:
            raise ValueError(
                "These gradients come from an instrumented model (per-layer "
                "scales): use AdaptiveLossScaleOptimizer(..., "
                f"scaling='per_layer'), not scaling={self.scaling!r}."
            )
        return rest, [(g, v.scale_table) for g, v in tables]

    def stalled_layers(self):
        """The layers whose gradients were not finite on the last skipped
        step, in the order of the model's trainable variables (a model's
        last layers, nearest the loss, come last)."""
        flags = self.non_finite_gradients.numpy()
        names = []
        for flag, scale in zip(flags, self.gradient_scales()):
            if flag > 0 and scale is not None and scale[0] not in names:
                names.append(scale[0])
        return names

    def gradient_scales(self):
        """Where each trained variable's gradient was scaled, and by what.

        Returns:
            A list in the order of the variables the optimizer was built
            for: `(layer name, log2 of the scale its gradient carries)` per
            variable (per layer, its unit's name and scale in the
            instrumented model whose gradients this optimizer trains), None
            for an instrumented model's own statistics and scales. Empty
            before `build`.
        """
        if not self.built:
            return []
        global_log2 = math.log2(float(self.dynamic_scale.numpy()))
        tables = [(t, t.log2_scales.numpy()) for t in self._scale_tables]
        scales = []
        for variable in self._trainable_variables:
            if gradient_scale.written_by_optimizer(variable):
                scales.append(None)
                continue
            path = getattr(variable, "path", variable.name)
            entry = (path.rsplit("/", 1)[0], global_log2)
            for table, log2 in tables:
                unit = table.unit_of(variable)
                if unit is not None:
                    entry = (table.unit_names[unit], global_log2 + float(log2[unit]))
            scales.append(entry)
        return scales

    def check_progress(self):
        """Raises if training has stopped making progress.

        For custom loops (in `fit`, `tas.ScaleMonitor` does it): after
        `max_consecutive_skips` consecutive skipped steps, raises
        `SkippedStepsError` saying why the steps were skipped and where.

        Raises:
            SkippedStepsError: When the limit is reached.
        """
        if not self.built or self.max_consecutive_skips is None:
            return
        skips = int(self.consecutive_skips.numpy())
        if skips < self.max_consecutive_skips:
            return
        step = int(self.total_steps.numpy())
        if not bool(self.last_loss_finite.numpy()):
            why = "the loss itself was not finite (bad data or a diverged model)"
        else:
            layers = self.stalled_layers()
            why = (
                "the gradients overflowed at every scale tried; non-finite "
                f"gradients in layers {layers}"
                + (f" (nearest the loss: '{layers[-1]}')" if layers else "")
            )
        raise SkippedStepsError(
            f"{skips} consecutive steps skipped, up to step {step} "
            f"(max_consecutive_skips={self.max_consecutive_skips}): {why}."
        )

    def layer_scales(self):
        """The current per-layer scales by layer name (per-layer mode).

        Returns:
            A dict of Python floats; empty before the first step.
        """
        scales = {}
        for table in getattr(self, "_scale_tables", []):
            scales.update(table.scales())
        return scales

    def _scale_state(self):
        return scale_policy.ScaleState(
            log2_scale=ops.round(ops.log2(self.dynamic_scale.value)),
            log2_ceiling=ops.round(ops.log2(self.scale_ceiling.value)),
            growth_count=self.step_counter.value,
            overflow_streak=self.overflow_streak.value,
            steps_to_measure=self.steps_to_measure.value,
            calibrated=self.calibrated.value,
        )

    def _step(self, grads, variables, apply_fn, already_unscaled, tables):
        """One step on the (replica-summed) gradients, or one micro-batch of
        a window."""
        grads, table_grads, replica_measurement = (
            grads[: len(variables)],
            grads[len(variables) : len(variables) + len(tables)],
            grads[len(variables) + len(tables) :],
        )
        step = self._decide if self.accumulation_steps == 1 else self._add_to_window
        step(
            grads, table_grads, replica_measurement, variables, apply_fn,
            already_unscaled, tables,
            ops.equal(self.non_finite_losses.value, 0.0),
        )
        # This step's notes on its loss are used up (see `scale_loss`).
        self.non_finite_losses.assign(0.0)
        self.loss_scale_used.assign(0.0)

    def _add_to_window(
        self, grads, table_grads, replica_measurement, variables, apply_fn,
        already_unscaled, tables, loss_finite,
    ):
        """Adds one micro-batch to the window (its unscaled gradients and
        statistics); the window's last micro-batch decides for all."""
        regular = self._regular(variables)
        state = self._scale_state()
        steps = [
            self._table_step(table, statistics, variables, regular)
            for (_, table), statistics in zip(tables, table_grads)
        ]
        unscaled = grads if already_unscaled else _unscale(
            grads, self._log2_divisors(state, steps, regular)
        )
        if tables:  # per layer, the tables carry the statistics
            measurement = ops.zeros((stats.NUM_BINS + 2,))
        elif replica_measurement:  # each replica's, combined
            (measurement,) = replica_measurement
        else:
            measurement, _ = self._replica_measurement(grads, variables, already_unscaled)
        index = self._get_variable_index
        # The window's sums are dense: a sparse gradient is summed into them.
        values = {index(variables[i]): sparse.dense(unscaled[i]) for i in regular}
        values.update(
            {index(t.statistics): s for (_, t), s in zip(tables, table_grads)}
        )
        last = self._window.add(values, measurement, loss_finite)

        def window(grads):
            """The window's mean in place of a micro-batch's gradients."""
            mean = list(grads)
            for i in regular:
                mean[i] = self._window.contents(index(variables[i]))
            return mean

        def decide():
            self._decide(
                window(grads),
                [self._window.contents(index(t.statistics)) for _, t in tables],
                [] if tables else [self._window.measurement.value],
                variables,
                # Each replica reads its own copy of the window's sums.
                lambda applied, transform: apply_fn(
                    applied, lambda summed: transform(window(summed))
                ),
                True,
                tables,
                self._window.loss_finite.value,
            )
            self._window.reset()

        branching.cond(last, decide, lambda: None)

    def _log2_divisors(self, state, steps, regular):
        """Every gradient is divided by the scale `scale_loss` applied and, in
        an instrumented model, by its layer's; in float32 (a float16 scale of
        2**16 would be inf)."""
        # The scale `scale_loss` used, else the current one (a loss scaled
        # by `loss_scale` directly): they differ only on the step that
        # resolves `scaling=None`.
        used = self.loss_scale_used.value
        log2_loss_scale = ops.where(
            used > 0, ops.round(ops.log2(ops.maximum(used, 2.0**-126))),
            state.log2_scale,
        )
        log2_divisors = {i: log2_loss_scale for i in regular}
        for step in steps:
            for i, log2_unit in step.log2_divisors().items():
                log2_divisors[i] = log2_divisors[i] + log2_unit
        return log2_divisors

    def _decide(
        self, grads, table_grads, replica_measurement, variables, apply_fn,
        already_unscaled, tables, loss_finite,
    ):
        """Checks, applies or skips, measures and updates the scales once."""
        regular = self._regular(variables)
        state = self._scale_state()
        scheduled = ops.equal(state.steps_to_measure, 0)
        steps = [
            self._table_step(table, statistics, variables, regular)
            for (_, table), statistics in zip(tables, table_grads)
        ]
        log2_divisors = self._log2_divisors(state, steps, regular)

        def transform(grads):
            """The unscaled and the clipped (applied) gradients; a pure
            function of the summed gradients, so every replica can apply it
            to its own copy of the sum."""
            unscaled = grads if already_unscaled else _unscale(grads, log2_divisors)
            clipped, commit = self._clip(
                [unscaled[i] for i in regular], [variables[i] for i in regular]
            )
            applied = list(unscaled)
            for i, g in zip(regular, clipped):
                applied[i] = g
            return unscaled, applied, commit

        unscaled, applied, commit_clipping = transform(grads)
        regular_grads = [unscaled[i] for i in regular]
        # Where each regular gradient's per-variable records go.
        rows = [[self._get_variable_index(variables[i])] for i in regular]
        # What reaches the weights is what is checked.
        finite_each = [
            ops.all(ops.isfinite(sparse.values(applied[i]))) for i in regular
        ]
        # Variables overwritten with their gradients (float8 scales) are
        # checked too, as the stock optimizer checks them.
        overwritten = [
            ops.all(ops.isfinite(sparse.values(g)))
            for i, g in enumerate(applied) if i not in regular
        ]
        # A step whose loss was not finite is bad data: skipped as well.
        finite = ops.logical_and(_all(finite_each + overwritten), loss_finite)
        for step in steps:
            finite = ops.logical_and(finite, step.backward_finite())
        # Only variables overwritten with their gradients: nothing to measure.
        measure = ops.logical_and(scheduled, finite) if regular else _any([])
        applies = finite
        if not steps:
            # A step whose gradients all underflowed is not applied as one.
            seen = _any(
                [ops.any(ops.not_equal(sparse.values(g), 0)) for g in regular_grads]
            )
            applies = ops.logical_and(
                finite, ops.logical_not(self._policy.blind(state, measure, seen))
            )

        def on_finite():
            apply_fn(applied, lambda grads: transform(grads)[1])
            commit_clipping()

        def on_non_finite():
            self.skipped_steps.assign_add(1)

        # Both branches hold elementwise updates only, so that XLA turns the
        # conditional into selects fused with the update, as for the stock
        # optimizer (a scatter or a nested measurement in a branch keeps the
        # conditional around the whole update: no faster on CPU, measured,
        # and on GPU XLA waits on the host for every conditional's branch).
        branching.select(applies, on_finite, on_non_finite)
        if regular:
            self.non_finite_gradients.assign(
                ops.where(
                    finite,
                    self.non_finite_gradients.value,
                    ops.scatter_update(
                        ops.zeros(self.non_finite_gradients.shape), rows,
                        ops.cast(ops.logical_not(ops.stack(finite_each)), "float32"),
                    ),
                )
            )
            branching.cond(
                measure,
                lambda: self._measure(regular_grads, rows, *replica_measurement),
                lambda: None,
            )
        if steps:
            for step in steps:
                observation = step.observation(unscaled, finite, loss_finite)
                new = step.advance(state, observation)
                step.record(
                    scheduled, ops.equal(new.steps_to_measure, 0), observation
                )
            # The global scale stays 1: each table holds the scales.
            new = new._replace(
                log2_scale=ops.zeros_like(state.log2_scale),
                log2_ceiling=state.log2_ceiling,
            )
        else:
            proposed, seen = self._proposal()
            new = self._policy.next_state(
                state,
                scale_policy.Observation(
                    finite=finite,
                    loss_finite=loss_finite,
                    measured=measure,
                    proposed=proposed,
                    seen=seen,
                ),
            )
        self._write_state(new, measure)
        self.total_steps.assign_add(1)
        self.last_step_finite.assign(applies)
        self.last_loss_finite.assign(loss_finite)
        self.consecutive_skips.assign(
            ops.where(applies, 0, self.consecutive_skips.value + 1)
        )

    def _write_state(self, state, measured):
        self.dynamic_scale.assign(stats.pow2(state.log2_scale))
        self.scale_ceiling.assign(stats.pow2(state.log2_ceiling))
        self.step_counter.assign(state.growth_count)
        self.overflow_streak.assign(state.overflow_streak)
        self.steps_to_measure.assign(state.steps_to_measure)
        self.calibrated.assign(state.calibrated)
        # Reported at the scale the next steps use.
        self.underflow_fraction.assign(
            ops.where(
                measured,
                stats.underflow_fraction(
                    self._criterion_weights(self.gradient_histogram.value),
                    state.log2_scale,
                    zeros=self.gradient_zeros.value,
                ),
                self.underflow_fraction.value,
            )
        )

    def _table_step(self, table, statistics, variables, regular):
        units = [(i, table.unit_of(variables[i])) for i in regular]
        members = [(i, unit) for i, unit in units if unit is not None]
        rule = functools.partial(
            layer_scaling.layer_log2_scales,
            underflow_rate=self.underflow_rate,
            log2_headroom=math.log2(self.headroom),
            weigh=self._criterion_weights,
        )
        return layer_scaling.TableStep(
            table, statistics, members, rule, self._policy
        )

    def _regular(self, variables):
        """Indices of the variables updated from their gradients."""
        return [
            i
            for i, v in enumerate(variables)
            if not self._overwrite_variable_with_gradient(v)
        ]

    def _measure(self, unscaled, rows, replica_measurement=None):
        """Records the statistics of a finite step's unscaled gradients, per
        variable (at `rows`) and in total (one pass over each gradient).

        With several replicas, the total histogram, zero count and peak that
        the scale is chosen from are the replicas' own, combined
        (`replica_measurement`); the per-variable records are of the sum.
        """
        each = stats.grouped_statistics(
            unscaled, range(len(unscaled)), len(unscaled)
        )
        histograms = each.histograms
        histogram = ops.sum(histograms, axis=0)
        max_abs = ops.max(each.max_abs)
        zeros = ops.sum(each.zeros)
        if replica_measurement is not None:
            histogram = replica_measurement[: stats.NUM_BINS]
            zeros, max_abs = ops.unstack(replica_measurement[stats.NUM_BINS :])
        norms = ops.sqrt(each.squares)
        self.variable_gradient_histograms.assign(
            ops.scatter_update(self.variable_gradient_histograms.value, rows, histograms)
        )
        self.variable_gradient_norms.assign(
            ops.scatter_update(self.variable_gradient_norms.value, rows, norms)
        )
        self.gradient_histogram.assign(histogram)
        self.gradient_zeros.assign(zeros)
        self.gradient_max.assign(max_abs)
        self.gradient_norm.assign(ops.sqrt(ops.sum(ops.square(norms))))
        self.scale_window.assign(
            ops.stack(
                stats.scale_bounds(
                    self._criterion_weights(histogram), max_abs, self.underflow_rate
                )
            )
        )
        self.measurements.assign_add(1)
        self.measured_step.assign(self.total_steps.value)

    def _proposal(self):
        """The adaptive rule's exponent from the last measurement."""
        log2_scale, _, _ = stats.adaptive_log2_scale(
            self._criterion_weights(self.gradient_histogram.value),
            self.gradient_max.value,
            self.underflow_rate,
            math.log2(self.headroom),
        )
        return log2_scale, ops.sum(self.gradient_histogram.value) > 0

    def _criterion_weights(self, histogram):
        if self.underflow_criterion == "mass":
            return stats.mass_histogram(histogram)
        return histogram

    def _clip(self, grads, variables):
        """Clips unscaled gradients.

        Returns:
            The clipped gradients and a function that records, on a step
            that is applied, that clipping acted and AutoClip's new norm.
        """
        if not self._clips():
            return grads, lambda: None
        # Clippers see a sparse gradient's rows summed per index (its norms
        # and elements are the dense gradient's) and give it back sparse.
        summed = [sparse.summed(g) for g in grads]
        clipped, commit = self._clip_values([sparse.values(g) for g in summed], [
            sparse.rows_of(v, g) for g, v in zip(summed, variables)
        ])
        return [sparse.with_values(g, c) for g, c in zip(summed, clipped)], commit

    def _clips(self):
        """Whether any clipper is on."""
        return any(
            x is not None
            for x in (self.agc_factor, self.clip_value, self.clip_norm,
                      self.global_clip_norm, self.autoclip_percentile)
        )

    def _clip_values(self, grads, variables):
        """`_clip` on dense values (`variables` their weights' values)."""
        acted, commits = [], []
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
            grads, a, commit = self._autoclip(grads, variables)
            acted.append(a)
            commits.append(commit)

        def commit():
            for c in commits:
                c()
            if acted:
                self.clipped_steps.assign_add(
                    ops.cast(ops.any(ops.stack(acted)), backends.COUNTER_DTYPE)
                )

        return grads, commit

    def _autoclip(self, grads, variables):
        count = self.norm_history_count.value
        if self.autoclip_per_variable:
            rows = [self._get_variable_index(v) for v in variables]
            norms = ops.stack([clipping.global_norm([g]) for g in grads])
            history = ops.take(self.norm_history.value, rows, axis=0)
        else:
            norms = clipping.global_norm(grads)
            history = self.norm_history.value
        history = clipping.push_history(history, count, norms)
        threshold = clipping.history_percentile(
            history, count + 1, self.autoclip_percentile
        )
        if self.autoclip_per_variable:
            grads, acted = clipping.clip_by_norm(grads, threshold)
            history = ops.scatter_update(
                self.norm_history.value, [[r] for r in rows], history
            )
        else:
            grads, acted = clipping.clip_by_global_norm(grads, threshold)

        def commit():
            self.norm_history.assign(history)
            self.norm_history_count.assign_add(1)

        return grads, acted, commit

    def finalize_variable_values(self, var_list):
        """Lets the inner optimizer finalize the model's weights (EMA, say).

        Args:
            var_list: The model's trainable variables; an instrumented
                model's `statistics` is left out, as the inner optimizer
                never saw it.
        """
        self.inner_optimizer.finalize_variable_values(
            [v for v in var_list if not gradient_scale.written_by_optimizer(v)]
        )

    def load_own_variables(self, store):
        """Loads this optimizer's state, or a stock `LossScaleOptimizer`'s.

        A `.keras` file saved with the stock optimizer (same inner
        optimizer) restores the inner optimizer's variables, the scale and
        the growth count; a warning names the state that starts fresh.

        Args:
            store: The saved variables, by position.
        """
        stock = None
        if self.built and len(store.keys()) != len(self.variables):
            stock = keras.mixed_precision.LossScaleOptimizer(
                self.inner_optimizer.__class__.from_config(
                    self.inner_optimizer.get_config()
                )
            )
            stock.build([v for v in self._trainable_variables
                         if not gradient_scale.written_by_optimizer(v)])
        if stock is None or len(store.keys()) != len(stock.variables):
            return super().load_own_variables(store)
        outer = len(stock.variables) - len(stock.inner_optimizer.variables)
        for variable, i in zip(self.inner_optimizer.variables, range(outer, len(store.keys()))):
            variable.assign(store[str(i)])
        own = {v.path.rsplit("/", 1)[-1]: v for v in self._variables}
        restored = []
        for i, variable in enumerate(stock.variables[:outer]):
            name = variable.path.rsplit("/", 1)[-1]
            if name == "dynamic_scale" and self.scaling in ("none", "per_layer"):
                continue  # this mode's scale stays 1
            if name in own:
                own[name].assign(store[str(i)])
                restored.append(name)
        fresh = [name for name in own if name not in restored]
        warnings.warn(
            "Loaded the state of a stock keras LossScaleOptimizer: restored "
            f"the inner optimizer and {', '.join(restored)}; these start "
            f"fresh: {', '.join(fresh)}.",
            stacklevel=2,
        )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """`apply` on values instead of variables (JAX: `model.fit` and
        custom loops over `model.stateless_call`).

        Args:
            optimizer_variables: Values of `optimizer.variables`.
            grads: Gradients of the scaled loss, one per trainable variable.
            trainable_variables: Values of the variables it was built for.

        Returns:
            The new values of the trainable variables and of
            `optimizer.variables`.
        """
        if backends.TENSORFLOW:
            raise NotImplementedError(
                "On TensorFlow, use apply(): its conditionals assign the "
                "optimizer's variables in place."
            )
        # The generic stateless step (Keras's LossScaleOptimizer replaces it
        # with its own decision): `apply` in a StatelessScope.
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The parent pops from `config`; leave the caller's dict intact.
        return super().from_config(dict(config), custom_objects=custom_objects)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                # The resolved mode: a reloaded optimizer scales as this one.
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
                "max_consecutive_skips": self.max_consecutive_skips,
                "accumulation_steps": self.accumulation_steps,
            }
        )
        return config


def _unscale(grads, log2_divisors):
    """`grads` with those at the indices of `log2_divisors` divided by their
    power of two (a sparse gradient's stored values)."""
    unscaled = list(grads)
    for i, log2_divisor in log2_divisors.items():
        factor = stats.pow2(-log2_divisor)
        unscaled[i] = sparse.map_values(lambda g: stats.times(g, factor), grads[i])
    return unscaled


def _all(flags):
    """Whether all boolean scalars `flags` hold (True for none)."""
    return ops.all(ops.stack(flags)) if flags else ops.convert_to_tensor(True)


def _any(flags):
    """Whether any boolean scalar of `flags` holds (False for none)."""
    return ops.any(ops.stack(flags)) if flags else ops.convert_to_tensor(False)


def _float_tensor(loss):
    """`loss` as a float tensor (a Python number or an int: float32, the
    dtype the stock optimizer's product has)."""
    loss = ops.convert_to_tensor(loss)
    if not keras.backend.is_float_dtype(loss.dtype):
        loss = ops.cast(loss, "float32")
    return loss
