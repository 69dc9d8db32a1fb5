"""Kept so that `from backend_step import stepper` (tests/test_step_invariants.py,
tests/test_settings.py) keeps working: the step lives in `helpers`."""

from helpers import stepper  # noqa: F401
