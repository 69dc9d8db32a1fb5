"""The examples run as documented (short settings), in fresh processes: two
children (`examples_worker.py`), each running its share of the examples in
turn (one TensorFlow start-up per child; the two run in parallel in the
suite's two workers)."""

import functools
import json
import os
import re

import pytest

from helpers import ROOT, run_python

WORKER = os.path.join(ROOT, "tests", "examples_worker.py")

pytestmark = pytest.mark.slow  # child processes

# name: (child, script, arguments). The two children take about as long.
RUNS = {
    "compiled_per_layer": ("a", "compiled_train_step.py", ["--epochs", "2"]),
    "compiled_global": ("a", "compiled_train_step.py",
                        ["--epochs", "2", "--global-scale", "--accumulate", "2"]),
    "bfloat16": ("a", "bfloat16.py", ["--epochs", "1", "--samples", "1024"]),
    "distributed": ("a", "distributed.py", ["--epochs", "1", "--samples", "512"]),
    "fit_with_monitor": ("b", "fit_with_monitor.py",
                         ["--epochs", "1", "--samples", "1024", "--every", "4", "--out", "{out}"]),
    "keras_applications": ("b", "keras_applications.py",
                           # Eagerly: compiling the instrumented MobileNetV2
                           # takes a minute or more on a small CPU; the
                           # instrumentation and the per-layer optimizer are
                           # the same.
                           ["--steps", "3", "--batch", "8", "--execution", "eager"]),
    "gradient_tape_loop": ("b", "gradient_tape_loop.py", ["--steps", "20"]),
    "clipping": ("a", "clipping.py", ["--steps", "60", "--no-jit"]),
}


@pytest.fixture(scope="module")
def examples_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


@functools.lru_cache(maxsize=None)
def _child(child, directory):
    """Runs child `child`'s examples; `{name: {"stdout", "error"}}`."""
    runs = [
        [name, script, [a.format(out=os.path.join(directory, name)) for a in arguments]]
        for name, (which, script, arguments) in RUNS.items() if which == child
    ]
    output = os.path.join(directory, f"child_{child}.json")
    run_python(WORKER, json.dumps(runs), output)
    with open(output) as f:
        return json.load(f)


def run_example(name, directory):
    """The example's stdout; fails with its traceback if it raised."""
    result = _child(RUNS[name][0], str(directory))[name]
    assert result["error"] is None, result["error"][-3000:]
    return result["stdout"]


def _scale_printed_as_power_of_two(out):
    """Every scale the examples print reads `scale 2**k`."""
    scales = re.findall(r"\bscale (\S+)", out)
    assert scales and all(re.fullmatch(r"2\*\*-?\d+,?", s) for s in scales), scales


class TestFirstChild:
    """The examples of child "a" (it runs once: one worker runs this class)."""

    @pytest.mark.parametrize("name", ["compiled_per_layer", "compiled_global"],
                             ids=["per_layer", "global"])
    def test_compiled_train_step_example(self, name, examples_dir):
        out = run_example(name, examples_dir)
        assert "epoch 2:" in out and "skipped 0/" in out
        # Per layer, a measuring program and a plain one (step_programs).
        assert f"traced {2 if name == 'compiled_per_layer' else 1} time(s)" in out

    def test_distributed_example(self, examples_dir):
        out = run_example("distributed", examples_dir)
        assert "replicas in sync: 2" in out
        assert "epoch 1:" in out and "skipped steps 0/8, applied steps 8" in out
        assert "replicas agree (weights, scale, counters, Adam slots): True" in out
        assert "MultiWorkerMirroredStrategy" in out
        _scale_printed_as_power_of_two(out)

    def test_bfloat16_example(self, examples_dir):
        out = run_example("bfloat16", examples_dir)
        assert "before training: scaling None" in out
        assert "resolved: scaling 'none', scale 2**0" in out
        assert "skipped steps 1/16" in out and "non-finite loss (bad data)" in out
        assert "weights finite: True" in out
        _scale_printed_as_power_of_two(out)

    def test_clipping_example(self, examples_dir):
        out = run_example("clipping", examples_dir)
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


class TestSecondChild:
    """The examples of child "b" (it runs once: one worker runs this class)."""

    def test_fit_with_monitor_example(self, examples_dir):
        out = run_example("fit_with_monitor", examples_dir)
        out_dir = examples_dir / "fit_with_monitor"
        assert "epoch 1:" in out and "skipped 0" in out
        assert "scale/loss_scale" in out and "scale/skipped_steps" in out
        assert "layer/hidden_1/grad_norm" in out and "layer/hidden_1/underflow" in out
        assert "skipped steps 0/16" in out and "monitor reports 4" in out
        _scale_printed_as_power_of_two(out)
        assert (out_dir / "logs" / "scale_monitor.jsonl").is_file()
        assert (out_dir / "report" / "scales.png").is_file()

    def test_gradient_tape_loop_example(self, examples_dir):
        out = run_example("gradient_tape_loop", examples_dir)
        for api in ("keras3", "legacy"):
            assert f"[{api}] step 20:" in out
            assert f"[{api}] done: scaling 'adaptive', applied steps 20, traced 1 time(s)" in out
        assert out.count("skipped 0/20") == 2
        # Same weights, same batches: the two APIs agree exactly.
        assert "keras3 vs legacy: largest weight difference 0\n" in out
        _scale_printed_as_power_of_two(out)

    def test_keras_applications_example(self, examples_dir):
        out = run_example("keras_applications", examples_dir)
        units = int(re.search(r"(\d+) units with their own scale", out).group(1))
        assert units > 100, out
        assert "trained 3 steps (eager)" in out and "skipped 0" in out
        assert re.search(r"scales from 2\*\*-?\d+ to 2\*\*-?\d+", out)
        assert re.search(r"^  Conv1: 2\*\*-?\d+$", out, re.M)
