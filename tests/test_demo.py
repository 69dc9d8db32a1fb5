"""The demo (the README's first command) at its quick size, and its
verdict's parts."""

import re

import pytest

from helpers import child_env, run_child


@pytest.mark.slow  # a child process
def test_quick_demo_prints_the_table_and_writes_the_report(tmp_path):
    from tf_adaptive_scale import demo
    from tf_adaptive_scale import report

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
    report_dir = tmp_path / "report"
    for name in ("scales.png", "gradient_norms.png", "histograms.png",
                 "loss_and_skips.png"):
        assert (report_dir / name).stat().st_size > 0
    assert (tmp_path / "per_layer" / "scale_monitor.jsonl").exists()
    # The quick run learns: every accuracy is above chance, and compared.
    accuracies = [float(a) for a in re.findall(r"^\| float[^|]*\| [^|]* \| [^|]* \| ([0-9.]+) \|",
                                               out, re.MULTILINE)]
    assert len(accuracies) == 4 and min(accuracies) >= demo.LEARNED
    assert "(all above chance, 0.10 for ten digits)" in out
    # The table's per-layer range counts the layers the pictures draw.
    logged = report.layer_scales(tmp_path / "per_layer")
    row = next(line for line in out.splitlines() if line.startswith("| float16, tas per layer |"))
    assert row.split("|")[2].strip() == demo.scale_range(logged.values())
    assert f"spans the {len(logged)} layers with weights" in out
    # More than one report: the pictures have a course to show.
    assert len(report._load(tmp_path / "per_layer")["steps"]) >= 10


def results(*accuracies):
    methods = ("float32", "keras", "adaptive", "per_layer")
    return {m: {"accuracy": a, "steps": 8} for m, a in zip(methods, accuracies)}


def test_accuracies_near_chance_are_not_compared():
    from tf_adaptive_scale import demo

    line = demo.accuracy_line(results(0.08, 0.17, 0.12, 0.1))
    assert line.startswith("- Test accuracy is not compared: 0.08 at worst after 8 steps")
    assert "ties" not in line and "differs" not in line
    assert demo.accuracy_line(results(0.83, 0.826, 0.826, 0.832)).startswith(
        "- Test accuracy ties: within 0.006")


def test_reports_come_often_enough_for_a_course():
    from tf_adaptive_scale import demo

    assert demo.report_every(32) == 1
    assert demo.report_every(189) == 9
    assert demo.report_every(2016) == 10
