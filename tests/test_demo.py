"""The demo (the README's first command) at its quick size, and its
verdict's parts."""

import os
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
    # Its standard output is a pipe here: a line per epoch, no progress bar's
    # carriage returns (thousands of them, 1.2 MB of one line, before).
    assert "\r" not in out + proc.stderr
    assert len(out.splitlines()) < 60 and len(out) < 10_000, out
    assert "  epoch 1/1: loss " in out
    # Each run's progress shows its scale as a scale (not a log2 that reads
    # -24 as an error), per layer the range the table gives (the global
    # scale, 1, read as "scaling off").
    epochs = [line for line in out.splitlines() if line.startswith("  epoch 1/1: ")]
    low, high = row.split("|")[2].strip().split(" to ")
    assert f"lowest layer scale {low}, highest layer scale {high}," in epochs[3]
    assert re.search(r", scale 2\*\*-?\d+, \d+ skipped", epochs[1]), epochs
    assert "log2" not in "".join(epochs)
    # Step times: from steady steps (XLA, compiling left out), float16 within
    # 3x float32's (78-91x before, float16 without XLA on oneDNN); or no
    # column, and the verdict says why.
    header = next(line for line in out.splitlines() if line.startswith("| method |"))
    if "step time / float32" in header:
        ratios = [float(line.split("|")[-2]) for line in out.splitlines()
                  if line.startswith("| float")]
        assert len(ratios) == 4 and ratios[0] == 1.0 and max(ratios) <= 3, ratios
        assert f"the median of each run's full steps after its first {demo.WARMUP_STEPS}" in out
    else:
        assert "- Step times are not compared" in out
    # The README's start-up claim is what the demo shows (the quick run
    # skips as the default one does).
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    claimed = re.search(r"Keras's skips (\d+) on the demo \(it starts at\s+2\^15\), the default "
                        r"mode (\d+), per layer (\d+)", readme)
    skipped = [line.split("|")[6].strip() for line in out.splitlines()
               if line.startswith("| float16")]
    assert claimed and list(claimed.groups()) == skipped, (claimed, skipped)
    # The picture that compares the four ways, named first.
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert out.index(f"The four ways compared: {tmp_path / 'compare.png'}") < out.index(
        "Per-layer monitor report")


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


class _Counter:
    """An optimizer's step count, as the demo's recorder reads it."""

    def __init__(self):
        self.value = 0

    def numpy(self):
        return self.value


def test_the_recorder_keeps_each_steps_loss_skip_and_time():
    from tf_adaptive_scale import demo

    class Optimizer:
        iterations = _Counter()

    recorder = demo.Recorder(Optimizer(), [64, 64, 32], terminal=False)
    recorder.params = {"epochs": 1}
    recorder.on_train_begin()
    recorder.on_epoch_begin(0)
    seen, total = 0, 0.0
    for batch, (loss, applied) in enumerate([(9.0, False), (5.0, True), (2.0, True)]):
        recorder.on_train_batch_begin(batch)
        Optimizer.iterations.value += applied
        seen += recorder.sizes[batch]
        total += loss * recorder.sizes[batch]
        # Keras logs the epoch's running mean, weighted by batch size.
        recorder.on_train_batch_end(batch, {"loss": total / seen})
    assert recorder.loss == pytest.approx([9.0, 5.0, 2.0])
    assert recorder.skipped == [True, False, False]
    assert recorder.full == [True, True, False]
    assert len(recorder.wall) == 3 and recorder.wall == sorted(recorder.wall)
    # Too few steps to time: the first WARMUP_STEPS and the partial batch are left out.
    assert recorder.timed() == []


def test_the_table_leaves_out_step_times_a_run_could_not_measure():
    from tf_adaptive_scale import demo

    row = {"scale": "-", "loss": 1.0, "accuracy": 0.5, "image_error": 1.0, "skipped": 0,
           "gradient_error": 0.0, "underflow": 0.0, "step_time": 0.01, "timed_steps": 27}
    runs = {m: dict(row) for m in demo.METHODS}
    assert demo.table(runs).splitlines()[0].endswith("| step time / float32 |")
    runs["keras"].update(step_time=None, timed_steps=3)
    assert "step time" not in demo.table(runs)
    assert demo.step_time_line(runs).startswith(
        "- Step times are not compared: 3 full steps to time after the first 5")


def test_skipped_steps_are_named_by_number():
    from tf_adaptive_scale import demo

    assert demo.step_numbers([True] * 7 + [False]) == "steps 1 to 7"
    assert demo.step_numbers([True, True, False]) == "steps 1, 2"
    assert demo.step_numbers([False, True, False, True]) == "steps 2, 4"
    assert demo.step_numbers([False, True]) == "step 2"


def test_the_compare_picture_marks_each_skipped_step():
    from tf_adaptive_scale import demo

    def run(skipped):
        return {"skipped": sum(skipped), "course": {
            "loss": [9.0 - i for i in range(len(skipped))],
            "wall": [0.5 * i + 4 for i in range(len(skipped))], "skipped": skipped}}

    runs = {"float32": run([False] * 4), "keras": run([True, True, False, False]),
            "adaptive": run([True, False, False, False]), "per_layer": run([False] * 4)}
    by_step, by_time = demo.compare_figure(runs).axes
    # Per way, its line then its skipped steps' x markers, in both panels.
    marked = [list(m.get_xdata()) for m in by_step.lines if m.get_marker() == "x"]
    assert marked == [[], [1, 2], [1], []]
    assert [list(m.get_xdata()) for m in by_time.lines if m.get_marker() == "x"][1] == [4, 4.5]
    assert [t.get_text() for t in by_step.figure.legends[0].texts][1] == (
        "float16, Keras LossScaleOptimizer (2 skipped)")
