"""float16's range, and the exponents every module measures it in.

One home for these numbers: the statistics' bins, the policies' bounds, the
per-layer boundaries and the monitor all read them from here.
"""

# The largest finite float16.
MAX = 65504.0
# floor(log2(x)) < -24  <=>  x < 2**-24, float16's smallest subnormal: below
# it a value underflows to zero.
SUBNORMAL_EXPONENT = -24
# From 2**16 a value overflows (65504 < 2**16).
OVERFLOW_EXPONENT = 16

# Exponent bins of the gradient statistics: bin `i` counts values with
# floor(log2|g|) == i + EXPONENT_MIN; values outside the range land in the
# first or last bin. The range covers unscaled gradients from 2**-88
# (float16's smallest subnormal at a per-layer scale of 2**64) up to 2**39.
EXPONENT_MIN = -88
NUM_BINS = 128

# Default `max_scale` exponents: a global scale multiplies the loss, which
# 2**24 keeps well inside float32; per-layer scales reach gradients far below
# the loss, down to the histogram's floor (2**-24 / 2**64 = 2**EXPONENT_MIN).
GLOBAL_MAX_EXPONENT = 24
PER_LAYER_MAX_EXPONENT = SUBNORMAL_EXPONENT - EXPONENT_MIN
# The exponent of "no cap": above every allowed scale.
NO_CAP_EXPONENT = 127.0
