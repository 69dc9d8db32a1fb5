import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

# The suite runs twice (README): on TensorFlow, everything; with
# KERAS_BACKEND=jax, the backend-neutral core below, the rest being
# TensorFlow-specific (tf.function, tf.distribute, TensorBoard, GradientTape).
BACKEND_NEUTRAL = {
    "test_arguments.py",
    "test_backends.py",
    "test_properties.py",
    "test_scale_policy.py",
    "test_scaling.py",
}
if keras.backend.backend() != "tensorflow":
    collect_ignore_glob = [
        name for name in os.listdir(os.path.dirname(__file__))
        if name.startswith("test_") and name.endswith(".py") and name not in BACKEND_NEUTRAL
    ]


@pytest.fixture(autouse=True)
def float32_policy_and_seed():
    """Every test starts from float32 and a fixed seed, and leaves it so."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")
