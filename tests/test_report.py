"""plot_report writes titled PNG pictures from a monitor log or a History."""

import json

import keras
import numpy as np
import pytest
from PIL import Image

from helpers import child
from tf_adaptive_scale.report import float16_zones
from tf_adaptive_scale.report import plot_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TITLES = {
    "scales.png": "Loss scale per layer",
    "gradient_norms.png": "Gradient norm per layer",
    "histograms.png": "Gradient exponents vs float16 range",
    "loss_and_skips.png": "Loss and skipped steps",
}
LAYERS = ("dense", "block/conv2d", "head")  # "head"'s gradients vanish.
EXPONENT_MIN = -88
BINS = 128


def histogram(grads):
    """Counts of floor(log2|g|) per exponent bin, as the monitor records them."""
    exponents = np.floor(np.log2(np.abs(grads[grads != 0]))).astype(int) - EXPONENT_MIN
    return np.bincount(np.clip(exponents, 0, BINS - 1), minlength=BINS).astype(float).tolist()


def records(reports=10, every=100):
    rng = np.random.default_rng(0)
    skipped = 0
    for i in range(reports):
        step = (i + 1) * every
        skipped_at = [step - 7, step - 6] if i in (2, 6) else []
        skipped += len(skipped_at)
        scale = 2.0 ** (15 - i // 3)
        layers = {}
        vanishing = 10.0 ** (-4 * i) if i < reports - 1 else 0.0
        for name, magnitude in zip(LAYERS, (1e-3, 1e-5, vanishing)):
            grads = rng.standard_normal(1000) * magnitude
            layers[name] = {
                "grad_norm": float(np.linalg.norm(grads)),
                "scale": scale,
                "underflow": float(np.mean(np.abs(grads * scale) < 2.0**-24)),
                "overflow": 0.0,
                "histogram": histogram(grads),
            }
        yield {
            "step": step,
            "epoch": i // 5,
            "loss": None if i == 4 else 1.0 / (i + 1),
            "loss_scale": scale,
            "skipped_steps": skipped,
            "skipped_since_last": len(skipped_at),
            "grad_norm": float(np.sqrt(sum(l["grad_norm"] ** 2 for l in layers.values()))),
            "clip_rate": 0.0,
            "skipped_at": skipped_at,
            "exponent_min": EXPONENT_MIN,
            "layers": layers,
        }


@pytest.fixture
def log_dir(tmp_path):
    directory = tmp_path / "logs"
    directory.mkdir()
    with open(directory / "scale_monitor.jsonl", "w") as f:
        for record in records():
            f.write(json.dumps(record) + "\n")
    return directory


def history_dict(epochs=4):
    history = {
        "loss": [1.0, 0.5, 0.4, 0.3][:epochs],
        "scale/loss_scale": [1.0] * epochs,
        "scale/skipped_steps": [0, 2, 2, 5][:epochs],
        "scale/grad_norm": [1.0] * epochs,
        "scale/clip_rate": [0.0] * epochs,
    }
    for name in LAYERS:
        history[f"layer/{name}/grad_norm"] = [1e-3, 1e-4, 0.0, 1e-6][:epochs]
        history[f"layer/{name}/scale"] = [2.0**10, 2.0**12, 2.0**12, 2.0**11][:epochs]
        history[f"layer/{name}/underflow"] = [0.0] * epochs
        history[f"layer/{name}/overflow"] = [0.0] * epochs
    return history


def assert_pictures(paths, out_dir, names):
    assert [str(p) for p in paths] == [str(out_dir / name) for name in names]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        with Image.open(path) as image:
            assert image.size[0] > 100 and image.size[1] > 100
            assert image.text["Title"] == TITLES[out_dir.joinpath(path).name]


def test_jsonl_file_gives_four_titled_pictures(log_dir, tmp_path):
    out = tmp_path / "out"
    paths = plot_report(log_dir / "scale_monitor.jsonl", out)
    assert_pictures(paths, out, list(TITLES))


def test_directory_form(log_dir, tmp_path):
    out = tmp_path / "out"
    assert_pictures(plot_report(str(log_dir), str(out)), out, list(TITLES))


@pytest.mark.parametrize("as_object", [False, True])
def test_history_gives_pictures_without_histograms(tmp_path, as_object):
    source = history_dict()
    if as_object:
        source = keras.callbacks.History()
        source.history = history_dict()
    out = tmp_path / "out"
    paths = plot_report(source, out)
    assert_pictures(paths, out, ["scales.png", "gradient_norms.png", "loss_and_skips.png"])
    assert not (out / "histograms.png").exists()


def test_many_layers_are_drawn_and_listed(tmp_path):
    """More layers than the legend (12) and the histogram panels (16) take."""
    with open(tmp_path / "many.jsonl", "w") as f:
        for record in records():
            for i in range(20):
                record["layers"][f"model/block_{i}/conv"] = record["layers"]["dense"]
            f.write(json.dumps(record) + "\n")
    out = tmp_path / "out"
    assert_pictures(plot_report(tmp_path / "many.jsonl", out), out, list(TITLES))


@pytest.mark.slow  # starts a child process
def test_command_line(log_dir, tmp_path):
    out = tmp_path / "cli"
    result = child("-m", "tf_adaptive_scale.report", str(log_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    printed = result.stdout.split()
    assert printed == [str(out / name) for name in TITLES]
    assert_pictures(printed, out, list(TITLES))


def test_missing_log_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        plot_report(missing, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="scale_monitor.jsonl"):
        plot_report(tmp_path, tmp_path / "out")


def test_float16_zones_are_where_float16_loses_values():
    underflow, overflow = float16_zones()
    assert (underflow, overflow) == (-24, 16)
    assert np.float16(2.0**underflow) > 0  # The smallest subnormal.
    assert np.float16(2.0 ** (underflow - 1)) == 0  # Half of it rounds to zero.
    assert np.isfinite(np.float16(2.0**overflow - 2.0 ** (overflow - 11)))  # 65504.
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(2.0**overflow))


def test_histograms_are_shifted_by_the_scale_and_shaded_at_float16_limits(log_dir):
    from matplotlib.figure import Figure

    from tf_adaptive_scale import report

    fig = Figure()
    report._draw_histograms(fig, report._load(log_dir))
    ax = fig.axes[0]
    assert ax.get_title() == "dense"
    last = list(records())[-1]
    counts = np.array(last["layers"]["dense"]["histogram"])
    shift = EXPONENT_MIN + np.log2(last["loss_scale"])
    bars = [p for p in ax.patches if p.get_label() == "_nolegend_" and p.get_height() > 0]
    assert sorted(p.get_x() for p in bars) == list(np.flatnonzero(counts) + shift)
    spans = {p.get_label(): p for p in ax.patches if p.get_label().startswith("float16")}
    underflow = spans["float16 underflow"]
    assert underflow.get_x() + underflow.get_width() == -24
    assert spans["float16 overflow"].get_x() == 16


def test_a_cut_last_line_is_skipped_with_a_warning_naming_it(log_dir, tmp_path):
    """A run killed while writing a record leaves a cut last line: the
    report draws the rest and names the line; a bad line elsewhere fails."""
    path = log_dir / "scale_monitor.jsonl"
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[-1][:40])
    with pytest.warns(UserWarning, match=r"line 11: skipped a cut last line"):
        paths = plot_report(str(log_dir), str(tmp_path / "out"))
    assert len(paths) == 4
    lines = whole.splitlines()
    path.write_text("\n".join([lines[0], lines[1][:40], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=r"line 2: not a JSON record"):
        plot_report(str(log_dir), str(tmp_path / "out2"))


def test_flags_are_marked_where_and_on_what_they_were_raised(tmp_path):
    """A report's flags draw a labelled line at its step, and the flagged
    layer's histogram panel names them."""
    from matplotlib.figure import Figure

    from tf_adaptive_scale import report

    logged = list(records())
    logged[3]["flags"] = [{"kind": "no_single_scale", "layer": "(all)"}]
    logged[8]["flags"] = [{"kind": "vanishing", "layer": "head"}]
    run = report._from_records(logged)
    fig = Figure()
    report._draw_loss_and_skips(fig, run)
    ax = fig.axes[0]
    lines = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert sorted(line.get_xdata()[0] for line in lines) == [400, 900]
    assert {t.get_text() for t in ax.texts} == {"no_single_scale: (all)", "vanishing: head"}
    fig = Figure()
    report._draw_histograms(fig, run)
    titles = {ax.get_title() for ax in fig.axes}
    assert "head\nflagged: vanishing" in titles and "dense" in titles


def _drawn(draw, run):
    """The axes of one picture drawn from `run` (its first and the rest)."""
    from matplotlib.figure import Figure

    fig = Figure()
    draw(fig, run)
    return fig.axes


def _row_names(ax):
    return [label.get_text() for label in ax.get_yticklabels()]


def per_layer_records(reports=10):
    """records() of a per-layer run: no global scale, a scale per layer."""
    for record in records(reports):
        record["global_scale"] = False
        record["loss_scale"] = 1.0
        for exponent, layer in zip((8, 12, 20), record["layers"].values()):
            layer["scale"] = 2.0**exponent
        yield record


def test_one_report_draws_readable_pictures(tmp_path):
    """One report (a short `fit`, the demo's --quick before): the step axis
    spans the steps it stands for, from 0, not a point; the values are
    written in; nothing skipped is said, not drawn."""
    from tf_adaptive_scale import report

    with open(tmp_path / "one.jsonl", "w") as f:
        f.write(json.dumps(next(records(reports=1))) + "\n")
    out = tmp_path / "out"
    assert_pictures(plot_report(tmp_path / "one.jsonl", out), out, list(TITLES))
    run = report._load(tmp_path / "one.jsonl")
    ax = _drawn(report._draw_scales, run)[0]
    assert ax.get_xlim() == (0.0, 100.0)
    assert "15" in {t.get_text() for t in ax.texts}  # 2**15, written in
    assert _row_names(ax) == ["global loss scale\n(every layer's: 3 layers)"]
    assert "one report, at step 100" in ax.get_title()
    ax = _drawn(report._draw_gradient_norms, run)[0]
    assert ax.get_xlim() == (0.0, 100.0)
    assert _row_names(ax) == list(LAYERS)
    assert len(ax.texts) == 3 and "zero" in {t.get_text() for t in ax.texts}
    axes = _drawn(report._draw_loss_and_skips, run)
    assert len(axes) == 1  # no axis of skipped steps
    left, right = axes[0].get_xlim()
    assert left == 0 and right > 100
    assert {t.get_text() for t in axes[0].texts} == {"1", "no step skipped"}


def test_nothing_skipped_draws_no_dots_and_says_so():
    from tf_adaptive_scale import report

    logged = list(records())
    for record in logged:
        record.update(skipped_steps=0, skipped_since_last=0, skipped_at=[])
    axes = _drawn(report._draw_loss_and_skips, report._from_records(logged))
    assert len(axes) == 1
    for line in axes[0].get_lines():  # the loss only
        assert np.isfinite(line.get_ydata()).all() and (line.get_ydata() > 0).all()
    assert "no step skipped" in {t.get_text() for t in axes[0].texts}
    assert not axes[0].collections  # no skipped-step lines either


def test_skipped_steps_are_drawn_when_there_are_some():
    from tf_adaptive_scale import report

    axes = _drawn(report._draw_loss_and_skips, report._from_records(list(records())))
    assert len(axes) == 2  # the loss, and the cumulative skipped steps
    assert "no step skipped" not in {t.get_text() for t in axes[0].texts}
    assert axes[0].collections  # a red line at each skipped step


def test_table_and_pictures_count_the_same_layers(tmp_path):
    """The demo's table counts the layers of `layer_scales`, which are the
    rows that scales.png and gradient_norms.png draw, many layers too."""
    from tf_adaptive_scale import demo
    from tf_adaptive_scale import report

    logged = list(per_layer_records())
    for record in logged:
        for i in range(20):
            record["layers"][f"model/block_{i}/conv"] = dict(
                record["layers"]["dense"], scale=2.0 ** (i % 5))
    with open(tmp_path / "scale_monitor.jsonl", "w") as f:
        for record in logged:
            f.write(json.dumps(record) + "\n")
    scales = report.layer_scales(tmp_path)
    assert list(scales) == list(logged[-1]["layers"])  # 23 layers
    run = report._load(tmp_path)
    ax = _drawn(report._draw_scales, run)[0]
    assert _row_names(ax) == list(scales)  # no global row: per layer, it is 1
    assert _row_names(_drawn(report._draw_gradient_norms, run)[0]) == list(scales)
    last = {name: 2.0 ** ax.collections[0].get_array().reshape(len(scales), -1)[row, -1]
            for row, name in enumerate(scales)}
    assert last == scales
    assert demo.scale_range(scales.values()) == "2**0 to 2**20"
    note = demo.layers_note({"logged": scales, "unlogged": {"pool": 2.0**25}})
    assert "the 23 layers with weights" in note and "pool" in note and "2**25" in note


def test_a_log_of_two_runs_draws_the_last(tmp_path):
    """A second run appended to the same log (its steps start again) is
    drawn alone, with a warning."""
    from tf_adaptive_scale import report

    with open(tmp_path / "scale_monitor.jsonl", "w") as f:
        for record in [*records(reports=4), *records(reports=2)]:
            f.write(json.dumps(record) + "\n")
    with pytest.warns(UserWarning, match="start again 1 time"):
        run = report._load(tmp_path)
    assert list(run["steps"]) == [100, 200]


def test_a_history_without_scales_says_so(tmp_path):
    from tf_adaptive_scale import report

    run = report._from_history({"loss": [1.0, 0.5]})
    ax = _drawn(report._draw_scales, run)[0]
    assert any(t.get_text().startswith("Nothing to draw") for t in ax.texts)
    ax = _drawn(report._draw_loss_and_skips, run)[0]
    assert "skipped steps not recorded" in {t.get_text() for t in ax.texts}
    assert ax.get_xlim()[0] == 0  # epochs 1 and 2, from 0


def measured_every(every, reports=10):
    """records() of a run measured every `every` steps (its reports every
    100): each report carries the last measurement, at `measured_step`,
    the same figures until the next."""
    logged, first = list(records(reports)), None
    for record in logged:
        measured = (record["step"] - 1) // every * every
        new = first is None or first["measured_step"] != measured
        if new:
            first = record
        else:
            record["grad_norm"] = first["grad_norm"]
            for name, layer in record["layers"].items():
                layer.update({key: first["layers"][name][key]
                              for key in ("grad_norm", "underflow", "histogram")})
        record.update(measured_step=measured, new_measurement=new)
    return logged


def test_measured_figures_are_drawn_once_at_their_step(tmp_path):
    """Reports every 100 steps, measurements every 300: the gradient norms
    have a column per measurement, from its step to the next, titled by
    the measurements; the histograms name the step measured."""
    from tf_adaptive_scale import report

    logged = measured_every(300)
    with open(tmp_path / "scale_monitor.jsonl", "w") as f:
        for record in logged:
            f.write(json.dumps(record) + "\n")
    out = tmp_path / "out"
    assert_pictures(plot_report(tmp_path, out), out, list(TITLES))
    run = report._load(tmp_path)
    ax = _drawn(report._draw_gradient_norms, run)[0]
    assert ax.get_title() == ("4 measurements, steps 0 to 900 "
                              "(each drawn until the next; the last, until step 1000)")
    assert ax.get_xlim() == (0.0, 1000.0)
    cells = ax.collections[0].get_array()
    firsts = [logged[i] for i in (0, 3, 6, 9)]  # the first report of each measurement
    for row, name in enumerate(LAYERS):
        norms = np.array([r["layers"][name]["grad_norm"] for r in firsts])
        np.testing.assert_allclose(cells[row][norms > 0], np.log10(norms[norms > 0]))
    assert len(ax.texts) == 3 * 4  # few measurements: written in
    axes = _drawn(report._draw_histograms, run)
    assert axes[0].figure.get_supxlabel() == "each layer at the last measurement, step 900"
    # The scales, read at each report, stay one column per report.
    assert _drawn(report._draw_scales, run)[0].get_title().startswith("10 reports, steps 100 to")


def test_reports_before_the_first_measurement_draw_no_figure(tmp_path):
    from tf_adaptive_scale import report

    logged = measured_every(300)
    for record in logged:
        record.update(measured_step=-1, new_measurement=False)
    run = report._from_records(logged)
    ax = _drawn(report._draw_gradient_norms, run)[0]
    assert [t.get_text() for t in ax.texts] == ["Nothing to draw: the log holds no measurement."]
    assert run["histograms"] == {}
    logged[4].update(measured_step=350, new_measurement=True)
    run = report._from_records(logged)
    assert list(run["measured_steps"]) == [350]
    assert {step for _, _, step in run["histograms"].values()} == {350}


def test_a_history_counts_the_epochs_with_a_measurement():
    from tf_adaptive_scale import report

    history = history_dict(epochs=3)
    for name in LAYERS:
        history[f"layer/{name}/grad_norm"] = [1e-3, np.nan, np.nan]
    ax = _drawn(report._draw_gradient_norms, report._from_history(history))[0]
    assert ax.get_title() == "3 epochs (History: one value per epoch); 1 with a measurement"
    assert np.ma.count_masked(ax.collections[0].get_array()) == 2 * len(LAYERS)
