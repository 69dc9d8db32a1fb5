"""The environment of the tests' child Python processes (not a test module)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**overrides):
    """`os.environ` for a child that imports this checkout's package, on the
    TensorFlow backend, with TensorFlow's logs quiet; `overrides` win."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["KERAS_BACKEND"] = "tensorflow"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(overrides)
    return env
