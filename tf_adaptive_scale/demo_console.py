"""The demo's console: TensorFlow's start-up lines out of sight.

TensorFlow prints log lines from C++ before any log level applies (when it
is imported, and when XLA first starts), an error-level `failed call to
cuInit` among them on machines without a GPU. Run as `python -m
tf_adaptive_scale.demo`, the package imports this module first, and it sends
the process's standard error to a log file from then on; the demo puts it
back when it ends and says where the log is. In any other use it does
nothing.
"""

import os
import sys
import tempfile

_saved_stderr = None
log_path = None


def hide_stderr():
    """Sends standard error (file descriptor 2) to a fresh log file."""
    global _saved_stderr, log_path
    if _saved_stderr is not None:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    fd, log_path = tempfile.mkstemp(prefix="tf_adaptive_scale_demo_", suffix=".log")
    sys.stderr.flush()
    _saved_stderr = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)


def restore_stderr():
    """Puts standard error back; returns the log file's path (or None)."""
    global _saved_stderr
    if _saved_stderr is None:
        return None
    sys.stderr.flush()
    os.dup2(_saved_stderr, 2)
    os.close(_saved_stderr)
    _saved_stderr = None
    return log_path


if getattr(sys, "orig_argv", [])[1:3] == ["-m", "tf_adaptive_scale.demo"]:
    hide_stderr()
