"""tf_adaptive_scale: adaptive, bounded, observable loss scaling for Keras 3."""

from tf_adaptive_scale import clipping
from tf_adaptive_scale import gradient_statistics
from tf_adaptive_scale import scale_policy
from tf_adaptive_scale.gradient_scale import GradientScale
from tf_adaptive_scale.gradient_scale import ScaleTable
from tf_adaptive_scale.instrument import InstrumentedModel
from tf_adaptive_scale.instrument import instrument
from tf_adaptive_scale.optimizer import AdaptiveLossScaleOptimizer

__version__ = "0.1.0"

__all__ = [
    "AdaptiveLossScaleOptimizer",
    "GradientScale",
    "InstrumentedModel",
    "ScaleTable",
    "instrument",
    "clipping",
    "gradient_statistics",
    "scale_policy",
]
