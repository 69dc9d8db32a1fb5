"""Gradient clipping of unscaled gradients: pure transforms and clippers.

Each transform takes a list of gradient tensors and returns the clipped list
and a boolean scalar telling whether it changed anything, so the optimizer can
count how often clipping acted.

A clipper wraps one transform with its arguments and any state of its own
(AutoClip's ring buffer of past norms); `clip` runs a chain of them in the
order given, optax style. A new clipper is one `Clipper` subclass here:

>>> optimizer = tas.AdaptiveLossScaleOptimizer(
...     keras.optimizers.Adam(),
...     clippers=[tas.clipping.AutoClip(10.0), tas.clipping.ClipByValue(1.0)])
"""

import re

import keras
from keras import ops

from tf_adaptive_scale.backend import sparse_gradients as sparse
from tf_adaptive_scale.numerics import validation
from tf_adaptive_scale.rules.optimizer_state import StateVariable


def global_norm(grads):
    """The L2 norm of all `grads` taken together, as float32.

    Args:
        grads: A list of tensors.

    Returns:
        A float32 scalar.
    """
    return ops.sqrt(sum(ops.sum(ops.square(_f32(g))) for g in grads))


def clip_by_value(grads, limit):
    """Clips every element to `[-limit, limit]`.

    Args:
        grads: A list of tensors.
        limit: Positive float.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    acted = _any([ops.max(ops.abs(g)) > limit for g in grads])
    return [ops.clip(g, -limit, limit) for g in grads], acted


def clip_by_norm(grads, max_norm):
    """Rescales each tensor whose own L2 norm exceeds `max_norm`.

    Args:
        grads: A list of tensors.
        max_norm: Positive float or float32 tensor of shape `(len(grads),)`.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    norms = ops.stack([ops.sqrt(ops.sum(ops.square(_f32(g)))) for g in grads])
    factors = _shrink_factors(norms, max_norm)
    clipped = [_scale(g, factors[i]) for i, g in enumerate(grads)]
    return clipped, ops.any(norms > max_norm)


def clip_by_global_norm(grads, max_norm):
    """Rescales all tensors together when their global norm exceeds `max_norm`.

    Args:
        grads: A list of tensors.
        max_norm: Positive float or float32 scalar tensor.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    norm = global_norm(grads)
    factor = _shrink_factors(norm, max_norm)
    return [_scale(g, factor) for g in grads], norm > max_norm


def adaptive_grad_clip(grads, params, factor, eps):
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021).

    A unit (one output unit of a kernel: all axes but the last; one element of
    a vector) is clipped when its gradient norm exceeds `factor` times its
    weight norm, the weight norm being at least `eps`.

    Args:
        grads: A list of tensors.
        params: The matching list of weights.
        factor: Positive float, the largest allowed gradient/weight ratio.
        eps: Positive float, the smallest weight norm.

    Returns:
        A tuple `(clipped_grads, acted)`.
    """
    clipped, acted = [], []
    for g, p in zip(grads, params):
        max_norm = ops.maximum(_unitwise_norm(p), eps) * factor
        g_norm = _unitwise_norm(g)
        clipped.append(_scale(g, _shrink_factors(g_norm, max_norm)))
        acted.append(ops.any(g_norm > max_norm))
    return clipped, _any(acted)


def push_history(history, count, values):
    """Writes `values` into slot `count % window` of a ring buffer.

    Args:
        history: float32 tensor `(..., window)`.
        count: int scalar, how many values were pushed before.
        values: float32 tensor `(...)`.

    Returns:
        The new history.
    """
    window = history.shape[-1]
    slot = ops.one_hot(ops.mod(count, window), window, dtype="bool")
    return ops.where(slot, ops.expand_dims(values, -1), history)


def history_percentile(history, count, percentile):
    """The `percentile` of the filled part of a ring buffer.

    Linear interpolation between order statistics, as `numpy.percentile`.

    Args:
        history: float32 tensor `(..., window)`.
        count: int scalar, how many values were pushed (at least 1).
        percentile: float in (0, 100].

    Returns:
        float32 tensor `(...)`.
    """
    window = history.shape[-1]
    filled = ops.cast(ops.minimum(count, window), "float32")
    unfilled = ops.arange(window, dtype="float32") >= filled
    ordered = ops.sort(ops.where(unfilled, float("inf"), history), axis=-1)
    position = percentile / 100.0 * (filled - 1.0)
    below = ops.floor(position)
    above = ops.minimum(below + 1.0, filled - 1.0)
    low = _take_last(ordered, below)
    high = _take_last(ordered, above)
    return low + (position - below) * (high - low)


class Clipper:
    """A clipping step of a chain.

    `declared` names its state (`optimizer_state.StateVariable`s), which the
    optimizer makes (saved with it; each clipper instance's names its own, see
    `state_prefixes`) and hands to `bind`; a call clips and returns
    `(grads, acted, commit)`, `commit` a function writing the state on a
    step that is applied (None: no state). A subclass implements `__call__`
    (and `declared` and `bind` if it keeps state), keeps its checked arguments with
    `_keep` (its config; or defines `get_config`), and is registered with
    `keras.saving.register_keras_serializable` so an optimizer holding it
    saves and loads. The optimizer builds a copy made from the config: the
    caller's object never holds state.
    """

    def declared(self, num_variables):
        """The clipper's state variables, if any.

        Args:
            num_variables: How many variables the optimizer trains.

        Returns:
            A tuple of `optimizer_state.StateVariable`s.
        """
        return ()

    def bind(self, variables):
        """Takes the variables made from `declared` (a namespace, by the
        declared names)."""

    def __call__(self, grads, weights, rows):
        """Clips dense gradients.

        Args:
            grads: float gradient tensors.
            weights: The matching weights' values (rows, for a sparse one).
            rows: Each gradient's variable index in the optimizer.

        Returns:
            `(clipped_grads, acted, commit)`.
        """
        raise NotImplementedError

    def get_config(self):
        """The clipper's arguments."""
        return dict(self._arguments)

    @classmethod
    def from_config(cls, config):
        """A new clipper of the same arguments."""
        return cls(**config)

    def _keep(self, **arguments):
        """Sets the clipper's checked arguments as attributes; they are its
        config."""
        self._arguments = arguments
        self.__dict__.update(arguments)


def _clipper(cls):
    return keras.saving.register_keras_serializable(package="tf_adaptive_scale")(cls)


@_clipper
class ClipByValue(Clipper):
    """Clips every element to `[-limit, limit]` (`clip_by_value`).

    Args:
        limit: Positive float.
    """

    def __init__(self, limit):
        self._keep(limit=validation.positive_float("limit", limit))

    def __call__(self, grads, weights, rows):
        return (*clip_by_value(grads, self.limit), None)


@_clipper
class ClipByNorm(Clipper):
    """Clips each tensor's L2 norm to `max_norm` (`clip_by_norm`).

    Args:
        max_norm: Positive float.
    """

    def __init__(self, max_norm):
        self._keep(max_norm=validation.positive_float("max_norm", max_norm))

    def __call__(self, grads, weights, rows):
        return (*clip_by_norm(grads, self.max_norm), None)


@_clipper
class ClipByGlobalNorm(Clipper):
    """Clips the norm of all tensors together to `max_norm`
    (`clip_by_global_norm`).

    Args:
        max_norm: Positive float.
    """

    def __init__(self, max_norm):
        self._keep(max_norm=validation.positive_float("max_norm", max_norm))

    def __call__(self, grads, weights, rows):
        return (*clip_by_global_norm(grads, self.max_norm), None)


@_clipper
class AdaptiveGradClip(Clipper):
    """AGC: clips a unit whose gradient norm exceeds `factor` times its
    weight norm, at least `eps` (`adaptive_grad_clip`).

    Args:
        factor: Positive float, the largest gradient/weight norm ratio.
        eps: Positive float, the smallest weight norm.
    """

    def __init__(self, factor, eps=1e-3):
        self._keep(
            factor=validation.positive_float("factor", factor),
            eps=validation.positive_float("eps", eps),
        )

    def __call__(self, grads, weights, rows):
        return (*adaptive_grad_clip(grads, weights, self.factor, self.eps), None)


@_clipper
class AutoClip(Clipper):
    """AutoClip (Seetharaman et al. 2020): clips the global norm (or, with
    `per_variable`, each variable's norm) to the `percentile` of the last
    `window` norms, the current one included; the history only moves on
    applied steps.

    Args:
        percentile: In (0, 100].
        window: Int >= 1, how many past norms are kept.
        per_variable: Bool, one history per variable.
    """

    def __init__(self, percentile, window=1000, per_variable=False):
        percentile = validation.positive_float("percentile", percentile)
        if percentile > 100:
            raise ValueError(f"`percentile` must be in (0, 100]. Received: {percentile}")
        self._keep(
            percentile=percentile,
            window=validation.positive_int("window", window),
            per_variable=validation.boolean("per_variable", per_variable),
        )

    def declared(self, num_variables):
        rows = (num_variables,) if self.per_variable else ()
        return (StateVariable("norm_history", shape=rows + (self.window,)),
                StateVariable("norm_history_count", 0, dtype="int32"))

    def bind(self, variables):
        self.history, self.count = variables.norm_history, variables.norm_history_count

    def __call__(self, grads, weights, rows):
        count = self.count.value
        if self.per_variable:
            norms = ops.stack([global_norm([g]) for g in grads])
            history = ops.take(self.history.value, rows, axis=0)
        else:
            norms = global_norm(grads)
            history = self.history.value
        history = push_history(history, count, norms)
        threshold = history_percentile(history, count + 1, self.percentile)
        if self.per_variable:
            grads, acted = clip_by_norm(grads, threshold)
            history = ops.scatter_update(
                self.history.value, [[r] for r in rows], history
            )
        else:
            grads, acted = clip_by_global_norm(grads, threshold)

        def commit():
            self.history.assign(history)
            self.count.assign_add(1)

        return grads, acted, commit


def check_chain(name, clippers):
    """`clippers` as a list of `Clipper`s (serialized ones deserialized)."""
    if not isinstance(clippers, (list, tuple)):
        raise TypeError(f"`{name}` must be a list of clippers. Received: {clippers!r}")
    chain = [
        keras.saving.deserialize_keras_object(c) if isinstance(c, dict) else c
        for c in clippers
    ]
    for c in chain:
        if not isinstance(c, Clipper):
            raise TypeError(
                f"`{name}` must hold tas.clipping.Clipper objects (e.g. "
                f"ClipByNorm(1.0)). Received: {c!r}"
            )
    return list(chain)


def state_prefixes(chain, num_variables, taken=()):
    """What each clipper's state names start with, so that no two clippers
    (of one class, of a class and its subclass, or of two classes that
    declare the same names) share a variable: nothing where its names are
    free, else `"<class>_<k>_"` with the smallest `k` that frees them (a
    second `AutoClip`'s history is `auto_clip_1_norm_history`, as Keras
    names layers).

    Args:
        chain: A list of `Clipper`s.
        num_variables: How many variables the optimizer trains.
        taken: Names already used by the optimizer's other state.

    Returns:
        A list of prefixes, one per clipper.
    """
    taken, prefixes = set(taken), []
    for clipper in chain:
        names = [spec.name for spec in clipper.declared(num_variables)]
        kind = re.sub(r"(?<!^)(?=[A-Z])", "_", type(clipper).__name__).lower()
        prefix, count = "", 0
        while any(prefix + name in taken for name in names):
            count += 1
            prefix = f"{kind}_{count}_"
        taken.update(prefix + name for name in names)
        prefixes.append(prefix)
    return prefixes


def clip(chain, grads, weights, rows):
    """Runs `chain` on possibly sparse gradients.

    Clippers see a sparse gradient's rows summed per index (its norms and
    elements are the dense gradient's) and give it back sparse.

    Args:
        chain: A list of built `Clipper`s.
        grads: Gradients (dense or sparse).
        weights: The matching variables.
        rows: Each gradient's variable index in the optimizer.

    Returns:
        `(clipped_grads, acted, commit)`: `acted` whether any clipper changed
        a gradient, `commit` writing every clipper's state.
    """
    summed = [sparse.summed(g) for g in grads]
    values = [sparse.values(g) for g in summed]
    weights = [sparse.rows_of(v, g) for g, v in zip(summed, weights)]
    acted, commits = [], []
    for clipper in chain:
        values, did, commit = clipper(values, weights, rows)
        acted.append(did)
        commits.append(commit)

    def commit_all():
        for commit in commits:
            if commit is not None:
                commit()

    clipped = [sparse.with_values(g, v) for g, v in zip(summed, values)]
    return clipped, _any(acted), commit_all


def _take_last(x, index):
    index = ops.cast(index, "int32") * ops.ones(x.shape[:-1], "int32")
    return ops.squeeze(
        ops.take_along_axis(x, ops.expand_dims(index, -1), axis=-1), -1
    )


def _unitwise_norm(x):
    x = _f32(x)
    if len(x.shape) <= 1:
        return ops.abs(x)
    axes = tuple(range(len(x.shape) - 1))
    return ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=True))


def _shrink_factors(norms, max_norm):
    """max_norm / norm where the norm exceeds it, else 1 (never divides 0)."""
    return ops.where(
        norms > max_norm, max_norm / ops.maximum(norms, 1e-30), 1.0
    )


def _scale(g, factor):
    return g * ops.cast(factor, g.dtype)


def _f32(x):
    return ops.cast(x, "float32")


def _any(flags):
    return ops.any(ops.stack(flags)) if flags else ops.convert_to_tensor(False)
