"""Floor 2, numerics: float16 facts, gradient statistics, argument checks.

What a gradient measures (`gradient_statistics`: peaks, exponent histograms,
norms, in a constant number of kernels), float16's range in the exponents every
module uses (`float16`) and the argument checks that name what is allowed
(`validation`). Imports only `backend`.
"""
