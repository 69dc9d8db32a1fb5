"""The demo (the README's first command) at its quick size."""

import pytest

from helpers import child_env, run_child

pytestmark = pytest.mark.slow  # a child process


def test_quick_demo_prints_the_table_and_writes_the_report(tmp_path):
    env = child_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL")  # as a new user runs it
    proc = run_child("-m", "tf_adaptive_scale.demo", "--quick", "--out", str(tmp_path),
                     env=env)
    out = proc.stdout
    for method in ("| float32 |", "| float16, Keras LossScaleOptimizer |",
                   "| float16, tas adaptive (one scale) |",
                   "| float16, tas per layer |"):
        assert method in out
    assert "Skipped steps: Keras's optimizer skipped" in out
    # A healthy model: the diagnosis finds nothing, and says what it checked.
    assert "The monitors flagged nothing. In the one-scale run every layer's window" in out
    # TensorFlow's start-up lines went to the log, not to the console.
    assert "I0000" not in out + proc.stderr
    assert "cuInit" not in out + proc.stderr
    report = tmp_path / "report"
    for name in ("scales.png", "gradient_norms.png", "histograms.png",
                 "loss_and_skips.png"):
        assert (report / name).stat().st_size > 0
    assert (tmp_path / "per_layer" / "scale_monitor.jsonl").exists()
