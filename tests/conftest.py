import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

# The suite runs twice (README): on TensorFlow, everything but test_jax.py;
# with KERAS_BACKEND=jax, the backend-neutral core and test_jax.py, the rest
# being TensorFlow-specific (tf.function, tf.distribute, TensorBoard,
# GradientTape) with test_jax.py as their JAX counterpart.
ON_JAX = {
    "test_jax.py", "test_scale_policy.py", "test_scaling.py", "test_stock_compatibility.py",
    "test_drop_in.py", "test_settings.py", "test_step_invariants.py",
}
_here = os.path.dirname(__file__)
if keras.backend.backend() == "tensorflow":
    collect_ignore = ["test_jax.py"]
else:
    collect_ignore = [
        name for name in os.listdir(_here)
        if name.startswith("test_") and name.endswith(".py") and name not in ON_JAX
    ]


@pytest.fixture(autouse=True)
def float32_policy_and_seed():
    """Every test starts from float32 and a fixed seed, and leaves it so."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")
