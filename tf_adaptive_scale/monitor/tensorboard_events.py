"""TensorBoard event files for `ScaleMonitor` (TensorFlow-specific:
`tf.summary`; on other backends the monitor writes JSON lines only)."""

import numpy as np
import tensorflow as tf

from tf_adaptive_scale.numerics import gradient_statistics as stats


class EventWriter:
    """Writes scalars and exponent histograms into one log directory.

    Args:
        log_dir: The directory.
    """

    def __init__(self, log_dir):
        self._writer = tf.summary.create_file_writer(log_dir)

    def write(self, step, scalars, histograms):
        """Writes `{tag: float}` scalars and `{tag: counts}` exponent
        histograms at `step`."""
        with self._writer.as_default(step=step):
            for tag, value in scalars.items():
                _write_scalar(tag, value)
            for tag, histogram in histograms.items():
                _write_exponent_histogram(tag, histogram)

    def flush(self):
        self._writer.flush()


def _write_scalar(tag, value):
    """A TensorBoard scalar, in the scalars plugin's format, written without
    the `tensorboard` package (`tf.summary.scalar` needs it installed)."""
    metadata = tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=metadata)


def _write_exponent_histogram(tag, histogram):
    """A TensorBoard histogram whose buckets are the binary exponents
    (`[left, right, count]` rows, the histogram plugin's format)."""
    histogram = np.asarray(histogram, np.float64)
    left = np.arange(histogram.size, dtype=np.float64) + stats.EXPONENT_MIN
    buckets = np.stack([left, left + 1.0, histogram], axis=1)
    metadata = tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="histograms"),
        summary_description="log2 |unscaled gradient| (binary exponent) counts",
    )
    tf.summary.write(tag, tf.constant(buckets), metadata=metadata)
