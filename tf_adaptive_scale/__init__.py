"""tf_adaptive_scale: adaptive, bounded, observable loss scaling for Keras 3."""

# First, before Keras starts TensorFlow: the demo's quiet start (a no-op in
# any other use).
from tf_adaptive_scale import demo_console  # noqa: I001
from tf_adaptive_scale.rules import clipping
from tf_adaptive_scale.numerics import gradient_statistics
from tf_adaptive_scale.rules import optimizer_state
from tf_adaptive_scale.rules import scale_policy
from tf_adaptive_scale.step.accumulation_model import ExactAccumulationModel
from tf_adaptive_scale.step.accumulation_model import exact_accumulation
from tf_adaptive_scale.monitor.forward_check import first_non_finite_layer
from tf_adaptive_scale.per_layer.gradient_scale import GradientScale
from tf_adaptive_scale.per_layer.gradient_scale import ScaleTable
from tf_adaptive_scale.training.instrument import InstrumentedModel
from tf_adaptive_scale.training.instrument import instrument
from tf_adaptive_scale.monitor.callback import ScaleMonitor
from tf_adaptive_scale.step.optimizer import AdaptiveLossScaleOptimizer
from tf_adaptive_scale.step.measurement import SkippedStepsError
from tf_adaptive_scale.per_layer.step_programs import measuring
from tf_adaptive_scale.per_layer.step_programs import measuring_step

__version__ = "0.1.0"

# TensorFlow-specific, imported on first use: on JAX, TensorFlow is never
# imported.
_TENSORFLOW_ONLY = {"make_train_step", "compile_step"}


def __getattr__(name):
    # Imported on first use: `python -m tf_adaptive_scale.report` must not
    # find the module already imported by the package.
    if name == "plot_report":
        from tf_adaptive_scale.report import plot_report

        return plot_report
    if name in _TENSORFLOW_ONLY:
        import keras

        if keras.backend.backend() != "tensorflow":
            raise AttributeError(
                f"tf_adaptive_scale.{name} is TensorFlow-specific (tf.function, "
                f"tf.distribute); the Keras backend is {keras.backend.backend()!r}. "
                "On JAX, use model.fit or optimizer.stateless_apply in your loop."
            )
        from tf_adaptive_scale.training import train_step

        return getattr(train_step, name)
    raise AttributeError(f"module 'tf_adaptive_scale' has no attribute {name!r}")


__all__ = [
    "AdaptiveLossScaleOptimizer",
    "ExactAccumulationModel",
    "GradientScale",
    "InstrumentedModel",
    "ScaleMonitor",
    "ScaleTable",
    "SkippedStepsError",
    "exact_accumulation",
    "first_non_finite_layer",
    "instrument",
    "make_train_step",
    "compile_step",
    "measuring",
    "measuring_step",
    "plot_report",
    "clipping",
    "gradient_statistics",
    "scale_policy",
]
