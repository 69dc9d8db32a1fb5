"""The examples run as documented (short settings), in child processes."""

import os
import re
import subprocess
import sys

import pytest

from child_process import ROOT, child_env

EXAMPLES = os.path.join(ROOT, "examples")


def run_example(*args, cwd=ROOT):
    proc = subprocess.run(
        [sys.executable, *args], env=child_env(), cwd=cwd,
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("extra", [[], ["--global-scale", "--accumulate", "2"]],
                         ids=["per_layer", "global"])
def test_compiled_train_step_example(extra):
    out = run_example(os.path.join(EXAMPLES, "compiled_train_step.py"),
                      "--epochs", "2", *extra)
    assert "epoch 2:" in out and "skipped 0/" in out
    assert "traced 1 time(s)" in out


def _scale_printed_as_power_of_two(out):
    """Every scale the examples print reads `scale 2**k`."""
    scales = re.findall(r"\bscale (\S+)", out)
    assert scales and all(re.fullmatch(r"2\*\*-?\d+,?", s) for s in scales), scales


def test_fit_with_monitor_example(tmp_path):
    out = run_example(os.path.join(EXAMPLES, "fit_with_monitor.py"),
                      "--epochs", "1", "--samples", "1024", "--every", "4",
                      "--out", str(tmp_path))
    assert "epoch 1:" in out and "skipped 0" in out
    assert "scale/loss_scale" in out and "scale/skipped_steps" in out
    assert "layer/hidden_1/grad_norm" in out and "layer/hidden_1/underflow" in out
    assert "skipped steps 0/16" in out and "monitor reports 4" in out
    _scale_printed_as_power_of_two(out)
    assert (tmp_path / "logs" / "scale_monitor.jsonl").is_file()
    assert (tmp_path / "report" / "scales.png").is_file()


def test_gradient_tape_loop_example():
    out = run_example(os.path.join(EXAMPLES, "gradient_tape_loop.py"),
                      "--steps", "20")
    for api in ("keras3", "legacy"):
        assert f"[{api}] step 20:" in out
        assert f"[{api}] done: scaling 'adaptive', applied steps 20, traced 1 time(s)" in out
    assert out.count("skipped 0/20") == 2
    # Same weights, same batches: the two APIs agree exactly.
    assert "keras3 vs legacy: largest weight difference 0\n" in out
    _scale_printed_as_power_of_two(out)


def test_distributed_example():
    out = run_example(os.path.join(EXAMPLES, "distributed.py"),
                      "--epochs", "1", "--samples", "512")
    assert "replicas in sync: 2" in out
    assert "epoch 1:" in out and "skipped steps 0/8, applied steps 8" in out
    assert "replicas agree (weights, scale, counters, Adam slots): True" in out
    assert "MultiWorkerMirroredStrategy" in out
    _scale_printed_as_power_of_two(out)


def test_clipping_example():
    out = run_example(os.path.join(EXAMPLES, "clipping.py"),
                      "--steps", "60", "--no-jit")
    lines = {}
    for method in ("none", "fixed", "autoclip", "agc"):
        (line,) = [l for l in out.splitlines() if l.strip().startswith(method + ":")]
        lines[method] = line
        assert "skipped 0," in line, line  # a 30x spike fits in float16 here
    spike = {m: float(re.search(r"at the spike (\S+) ", l).group(1))
             for m, l in lines.items()}
    # Every clipping method holds the spike's update well below no clipping's.
    for method in ("fixed", "autoclip", "agc"):
        assert spike[method] < spike["none"] / 5, (method, spike)
    assert "clipped 0/60" in lines["none"]
    assert "clipped 0/" not in lines["fixed"]
    _scale_printed_as_power_of_two(out)


def test_bfloat16_example():
    out = run_example(os.path.join(EXAMPLES, "bfloat16.py"),
                      "--epochs", "1", "--samples", "1024")
    assert "before training: scaling None" in out
    assert "resolved: scaling 'none', scale 2**0" in out
    assert "skipped steps 1/16" in out and "non-finite loss (bad data)" in out
    assert "weights finite: True" in out
    _scale_printed_as_power_of_two(out)


def test_keras_applications_example():
    # Eagerly: compiling the instrumented MobileNetV2 takes a minute or more
    # on a small CPU; the instrumentation and the per-layer optimizer are the
    # same.
    out = run_example(os.path.join(EXAMPLES, "keras_applications.py"),
                      "--steps", "3", "--batch", "8", "--execution", "eager")
    units = int(re.search(r"(\d+) units with their own scale", out).group(1))
    assert units > 100, out
    assert "trained 3 steps (eager)" in out and "skipped 0" in out
    assert re.search(r"scales from 2\*\*-?\d+ to 2\*\*-?\d+", out)
    assert re.search(r"^  Conv1: 2\*\*-?\d+$", out, re.M)
