"""Pictures of a training run's loss-scaling monitor log.

`plot_report` reads the JSON-lines log that the scale monitor writes into its
`log_dir` (`monitor_log.FILE_NAME`), or the epoch-level metrics of a
`keras.callbacks.History`, and writes PNG pictures of the scales, gradient
norms, gradient exponents and skipped steps. The same works from a shell:

    python -m tf_adaptive_scale.report LOG_DIR --out DIR

Matplotlib is an optional dependency: `pip install matplotlib`, or the
`[plot]` extra of a checkout (`pip install ".[plot]"`; not on PyPI).

The pictures read at any run length and layer count: the scales and the
gradient norms are heatmaps, one named row per layer (no legend, no line
hidden under another), over a step axis from the first report's stretch of
training to the last report, so that a single report still spans the steps
it stands for; few reports get their values written in. What there is
nothing to draw for (no step skipped, no loss recorded) is said in words.

The figures of the optimizer's measured steps (gradient norms, exponent
histograms) are drawn once per measurement, at the step it was measured
(`measured_step`), not again at each report that carried it; their titles
count measurements and name their steps.
"""

import argparse
import math
import os
import textwrap
import warnings

import numpy as np

from tf_adaptive_scale.monitor import monitor_log
from tf_adaptive_scale.numerics import float16

# Fewer reports than this are drawn with a marker at each (one point draws
# no line).
MARKED_POINTS = 30
# At most this many reports: each loss value and gradient norm is written in.
WRITTEN_POINTS = 5
# A scale held over at least this share of the step axis has its exponent
# written in.
WRITTEN_SPAN = 0.04
# A loss whose largest value is more than this many times its smallest is
# drawn on a log axis.
LOG_LOSS_RATIO = 20
MAX_HISTOGRAM_LAYERS = 16


def float16_zones():
    """The binary exponents where float16 stops representing a value.

    A scaled gradient `g` underflows to zero when `log2|g| < underflow_upper`
    (below the smallest subnormal, 2**-24) and overflows to infinity when
    `log2|g| >= overflow_lower` (above the largest finite value, 65504 < 2**16).

    Returns:
        A tuple of ints `(underflow_upper, overflow_lower)`, that is `(-24, 16)`.
    """
    return float16.SUBNORMAL_EXPONENT, float16.OVERFLOW_EXPONENT


def plot_report(source, out_dir):
    """Writes PNG pictures of a loss-scaling monitor log to `out_dir`.

    `scales.png` (log2 of each layer's scale and of the global loss scale,
    a row per layer), `gradient_norms.png` (a heatmap of the layers'
    gradient norms, a column per measurement), `histograms.png` (each
    layer's last measured gradient exponents, shifted by its scale, against
    float16's range; flagged layers' titles in red) and
    `loss_and_skips.png` (the loss, skipped steps, a dotted line at each
    flag). Each PNG stores its title in its metadata, under "Title".
    The layers drawn are those the log names: the monitor logs the layers
    with weights (per layer, `tas.instrument` also scales the gradients
    passing through layers without weights; they are not logged).

    Args:
        source: A JSON-lines monitor log, a directory holding one, a
            `keras.callbacks.History` or its `.history` dict (one value per
            epoch, no histograms). A log whose steps start again (a second
            run into the same `log_dir`) is drawn from its last run on,
            with a warning.
        out_dir: The directory to write to; created if missing.

    Returns:
        The list of the paths written (a picture without data is not).

    Example:

    ```python
    for path in tas.plot_report("logs/scale_monitor.jsonl", "report"):
        print(path)
    tas.plot_report(model.fit(x, y, epochs=5), "report")  # No histograms.png.
    ```
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plot_report needs matplotlib: pip install matplotlib (or, from a "
            "checkout of tf_adaptive_scale, pip install \".[plot]\")"
        ) from error

    run = _load(source)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for file_name, title, draw, drawn in PICTURES:
        if not drawn(run):
            continue
        fig = Figure(layout="constrained")
        draw(fig, run)
        fig.suptitle(title)
        paths.append(os.path.join(out_dir, file_name))
        fig.savefig(paths[-1], metadata={"Title": title})
    return paths


def layer_scales(source):
    """Each layer's scale at its last report, as `scales.png` draws it.

    The layers are the log's (the monitor logs the layers with weights): the
    rows of `scales.png` (which counts them in one row where every layer
    carries the global loss scale), so a table built from this counts the
    layers that the pictures draw.

    Args:
        source: As for `plot_report`.

    Returns:
        `{layer name: scale}`, in the log's order.
    """
    scales = {}
    for name, layer in _load(source)["layers"].items():
        known = layer["scale"][np.isfinite(layer["scale"])]
        if known.size:
            scales[name] = float(known[-1])
    return scales


def _load(source):
    """Reads `source` into the columns the pictures need (see `plot_report`)."""
    if hasattr(source, "history"):
        source = source.history
    if isinstance(source, dict):
        return _from_history(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, monitor_log.FILE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No scale monitor log at {path}")
    records = monitor_log.read_lines(path)
    if not records:
        raise ValueError(f"The scale monitor log {path} has no records")
    return _from_records(_last_run(records, path))


def _last_run(records, path="the log"):
    """The records from the last place where the steps go back (a second
    run appended to the same log; a resumed run continues the steps)."""
    steps = [r.get("step", 0) for r in records]
    starts = [i for i in range(1, len(steps)) if steps[i] < steps[i - 1]]
    if not starts:
        return records
    warnings.warn(
        f"{path}: the steps start again {len(starts)} time(s) (a new run into the "
        f"same log); drawing the last run, its {len(records) - starts[-1]} of "
        f"{len(records)} records", stacklevel=3)
    return records[starts[-1]:]


def _from_records(records):
    """Columns of a JSON-lines log (its dicts): one value per report, and
    the measured figures one per measurement (a log that does not tell
    its measured steps, another writer's: one per report)."""
    stepped = any("measured_step" in r for r in records)
    records = [monitor_log.LogRecord.from_json(r) for r in records]
    names = list(dict.fromkeys(n for r in records for n in r.layers))
    layers = {name: {"scale": _column([getattr(r.layers.get(name), "scale", None)
                                       for r in records])}
              for name in names}
    measured = records
    if stepped:  # the first report of each measurement (the next ones repeat it)
        measured = [r for i, r in enumerate(records) if r.measured_step >= 0
                    and (i == 0 or r.measured_step != records[i - 1].measured_step)]
    histograms = {}  # Each layer's last histogram, as (exponents, counts, step measured).
    for record in records:
        for name, layer in record.layers.items():
            if layer.histogram is not None and (record.measured_step >= 0 or not stepped):
                counts = np.asarray(layer.histogram, dtype=float)
                shift = record.exponent_min + np.log2(layer.scale)
                histograms[name] = (np.arange(len(counts)) + shift, counts,
                                    record.measured_step if stepped else record.step)
    from_fit = {r.from_fit for r in records}
    return {
        "step_label": "step",
        "steps": np.array([r.step for r in records]),
        "measured_steps": np.array([r.measured_step for r in measured]) if stepped else None,
        "grad_norms": {name: _column([getattr(r.layers.get(name), "grad_norm", None)
                                      for r in measured]) for name in names},
        # The mean loss since the report before (other reports: the loss
        # given, in `fit` Keras's running epoch mean, which jumps at every epoch).
        "loss": _column([r.interval_loss if r.from_fit else r.loss for r in records]),
        "loss_label": ("mean loss since the report before" if from_fit == {True}
                       else "loss" if from_fit == {False}
                       else "loss (in fit: mean since the report before)"),
        "global_scale": records[-1].global_scale,
        "loss_scale": _column([r.loss_scale for r in records]),
        "skipped_steps": _column([r.skipped_steps for r in records]),
        "skipped_since_last": _column([r.skipped_since_last for r in records]),
        "skipped_at": sorted(s for r in records for s in r.skipped_at or []),
        "flags": [(r.step, kind, layer) for r in records for kind, layer in r.flags],
        "layers": layers,
        "histograms": histograms,
    }


def _from_history(history):
    """Columns of a `History.history` dict: one value per epoch."""
    epochs = max((len(values) for values in history.values()), default=0)
    if not epochs:
        raise ValueError("The history has no epochs")

    def column(key):
        return _column(history.get(key, [None] * epochs))

    names = list(dict.fromkeys(
        key[len("layer/"):].rsplit("/", 1)[0] for key in history if key.startswith("layer/")
    ))
    skipped = column("scale/skipped_steps")
    return {
        "step_label": "epoch",
        "steps": np.arange(1, epochs + 1),  # Keras counts epochs from 1
        "measured_steps": None,  # one value per epoch, NaN where none was measured
        "grad_norms": {name: column(f"layer/{name}/grad_norm") for name in names},
        "loss": column("loss"),
        "loss_label": "loss (epoch mean)",
        "global_scale": True,
        "loss_scale": column("scale/loss_scale"),
        "skipped_steps": skipped,
        "skipped_since_last": np.diff(skipped, prepend=0.0),
        "skipped_at": [],
        "flags": [],
        "layers": {name: {"scale": column(f"layer/{name}/scale")} for name in names},
        "histograms": {},
    }


def _column(values):
    """A float array with NaN for missing (None) values."""
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _marker(run):
    return "o" if len(run["steps"]) < MARKED_POINTS else None


def _x_axis(run):
    """Where each report sits on the x axis, the edges of the stretch of
    training each stands for (`len(steps) + 1` of them) and the axis label.

    A report at step s stands for the steps since the report before; the
    first, for as many steps before it as the next is after it (a single
    report: from step 0), so one report still spans an axis."""
    steps = np.asarray(run["steps"], dtype=float)
    gap = steps[1] - steps[0] if steps.size > 1 else steps[0]
    if gap <= 0:
        gap = 1.0
    start = steps[0] - gap
    if steps[0] > 0:
        start = max(start, 0.0)
    return steps, np.concatenate([[start], steps]), run["step_label"]


def _measured_axis(run):
    """As `_x_axis`, for the measured figures: each measurement at its step,
    drawn until the next (the last, until the last report); without
    measured steps, `_x_axis`."""
    if run["measured_steps"] is None:
        return _x_axis(run)
    steps = run["measured_steps"].astype(float)
    end = max(float(run["steps"][-1]), steps[-1] + 1.0)
    return steps, np.concatenate([steps, [end]]), "measured step"


def _measured_span(run):
    """What the measured figures' x axis covers, in words: how many
    measurements, at which steps (their pictures' subtitle)."""
    if run["measured_steps"] is None:
        if run["step_label"] != "epoch":
            return _span(run)
        known = np.isfinite(np.array(list(run["grad_norms"].values()))).any(axis=0)
        return f"{_span(run)}; {int(known.sum())} with a measurement"
    steps, edges, _ = _measured_axis(run)
    if len(steps) == 1:
        return (f"one measurement, at step {int(steps[0])} "
                f"(drawn until the last report, step {edges[-1]:g})")
    return (f"{len(steps)} measurements, steps {int(steps[0])} to {int(steps[-1])} "
            f"(each drawn until the next; the last, until step {edges[-1]:g})")


def _span(run):
    """What the x axis covers, in words (each picture's subtitle)."""
    steps, label = run["steps"], run["step_label"]
    if label == "epoch":
        return f"{len(steps)} epoch{'s' if len(steps) > 1 else ''} (History: one value per epoch)"
    if len(steps) == 1:
        first, step = _x_axis(run)[1][0], int(steps[0])
        return f"one report, at step {step} (drawn over steps {first:g} to {step})"
    return f"{len(steps)} reports, steps {int(steps[0])} to {int(steps[-1])}"


def _row_height(rows):
    """The height in inches of a picture with a row per layer: the names
    stay legible at any count."""
    return max(3.2, 1.6 + 0.3 * min(rows, 40) + 0.16 * max(rows - 40, 0))


def _label_rows(ax, names):
    ax.set_yticks(np.arange(len(names)) + 0.5, names,
                  fontsize="small" if len(names) <= 40 else "x-small")
    ax.set_ylim(len(names), 0)  # The first row at the top.


def _ink(mesh, value):
    """Black or white, whichever reads on the cell's colour."""
    red, green, blue, _ = mesh.cmap(mesh.norm(value))
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"


def _runs(values):
    """The stretches of equal finite values: `(first, stop, value)`."""
    found, first = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[first]:
            if np.isfinite(values[first]):
                found.append((first, i, values[first]))
            first = i
    return found


def _say(ax, text):
    """Writes why there is nothing to draw where the drawing would be."""
    ax.text(0.5, 0.5, textwrap.fill(text, 50), transform=ax.transAxes, ha="center",
            va="center")
    ax.set_xticks([])
    ax.set_yticks([])


def _scale_rows(run):
    """The rows of `scales.png`: `(name, log2 scales)`. The global loss
    scale has a row where it multiplies the loss; when every layer carries
    just that scale, the one row says so and counts them."""
    layers = [(name, np.log2(layer["scale"])) for name, layer in run["layers"].items()]
    if not (run["global_scale"] and np.isfinite(run["loss_scale"]).any()):
        return layers
    global_row = np.log2(run["loss_scale"])
    if layers and all(np.allclose(v, global_row, equal_nan=True) for _, v in layers):
        count = f"{len(layers)} layer{'s' if len(layers) > 1 else ''}"
        return [(f"global loss scale\n(every layer's: {count})", global_row)]
    if layers and np.all(global_row[np.isfinite(global_row)] == 0):
        return layers  # A global scale of 1 beside layers' own (a per-layer History).
    return [("global loss scale", global_row)] + layers


def _draw_scales(fig, run):
    from matplotlib import colormaps
    from matplotlib import colors
    from matplotlib import ticker

    rows = _scale_rows(run)
    fig.set_figheight(_row_height(len(rows)))
    ax = fig.subplots()
    ax.set_title(_span(run) + "\nnumbers: log2 of the scale", fontsize="small")
    values = np.ma.masked_invalid(np.array([v for _, v in rows], dtype=float))
    if not rows or not values.count():
        _say(ax, "Nothing to draw: the log holds no scales (no layer reported).")
        return
    _, edges, label = _x_axis(run)
    low, high = math.floor(values.min()), math.ceil(values.max())
    cmap = colormaps["viridis"].with_extremes(bad="white")
    # One colour per power of two; the written exponents say which.
    norm = colors.BoundaryNorm(np.arange(low, high + 2) - 0.5, cmap.N)
    mesh = ax.pcolormesh(edges, np.arange(len(rows) + 1), values, cmap=cmap, norm=norm)
    width = edges[-1] - edges[0]
    for row, (_, line) in enumerate(rows):
        for first, stop, value in _runs(line):
            if (edges[stop] - edges[first]) / width >= WRITTEN_SPAN:
                ax.text((edges[first] + edges[stop]) / 2, row + 0.5, f"{value:g}",
                        ha="center", va="center", fontsize="x-small",
                        color=_ink(mesh, value))
    _label_rows(ax, [name for name, _ in rows])
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel(label)
    ticks = [low] if low == high else ticker.MaxNLocator(integer=True).tick_values(low, high)
    fig.colorbar(mesh, ax=ax, label="log2 scale",
                 ticks=[t for t in ticks if low <= t <= high])


def _draw_gradient_norms(fig, run):
    from matplotlib import colormaps

    names = list(run["grad_norms"])
    fig.set_figheight(_row_height(len(names)))
    ax = fig.subplots()
    if run["measured_steps"] is not None and not run["measured_steps"].size:
        _say(ax, "Nothing to draw: the log holds no measurement.")
        return
    norms = np.array([run["grad_norms"][name] for name in names])
    ax.set_title(_measured_span(run), fontsize="small")
    if not (norms > 0).any():
        _say(ax, "Nothing to draw: the log holds no gradient norm above zero.")
        return
    with np.errstate(divide="ignore"):
        logs = np.log10(norms)
    logs[np.isneginf(logs)] = logs[np.isfinite(logs)].min()  # zero: the darkest
    logs = np.ma.masked_invalid(logs)  # not measured: white
    _, edges, label = _measured_axis(run)
    mesh = ax.pcolormesh(edges, np.arange(len(names) + 1), logs,
                         cmap=colormaps["viridis"].with_extremes(bad="white"))
    if norms.shape[1] <= WRITTEN_POINTS:
        for row, column in np.ndindex(norms.shape):
            norm = norms[row, column]
            if np.isfinite(norm):
                positive = norm > 0
                ax.text((edges[column] + edges[column + 1]) / 2, row + 0.5,
                        f"{np.log10(norm):.1f}" if positive else "zero",
                        ha="center", va="center", fontsize="x-small",
                        color=_ink(mesh, logs[row, column]) if positive else "white")
    _label_rows(ax, names)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel(label)
    fig.colorbar(mesh, ax=ax, label="log10 gradient norm (zero: darkest)")


def _draw_histograms(fig, run):
    names = list(run["histograms"])
    shown, rest = names[:MAX_HISTOGRAM_LAYERS], names[MAX_HISTOGRAM_LAYERS:]
    ncols = min(4, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    fig.set_size_inches(3.5 * ncols, 2.5 * nrows + 1)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    underflow, overflow = float16_zones()
    flagged = {}
    for _, kind, layer in run["flags"]:
        flagged.setdefault(layer, []).append(kind)
    for ax, name in zip(axes, shown):
        exponents, counts, _ = run["histograms"][name]
        occupied = exponents[counts > 0]
        low = occupied.min(initial=underflow) - 2
        high = occupied.max(initial=overflow) + 3  # A bar spans [x, x + 1).
        ax.bar(exponents, counts, width=1, align="edge")
        if not occupied.size:
            ax.text(0.5, 0.5, "all zero", transform=ax.transAxes, ha="center")
        ax.axvspan(low, underflow, color="tab:red", alpha=0.15, label="float16 underflow")
        ax.axvspan(overflow, high, color="grey", alpha=0.3, label="float16 overflow")
        ax.set_xlim(low, high)
        if name in flagged:
            ax.set_title(f"{name}\nflagged: {', '.join(flagged[name])}", fontsize="small",
                         color="tab:red")
        else:
            ax.set_title(name, fontsize="small")
        ax.set_xlabel("log2 |scaled gradient|")
    for ax in axes[len(shown):]:
        ax.set_axis_off()
    axes[0].legend(fontsize="x-small", loc="upper left")
    steps = sorted({int(run["histograms"][name][2]) for name in names})
    # A log that does not tell its measured steps tells its reports'.
    at = "report" if run["measured_steps"] is None else "measurement"
    note = (f"each layer at the last {at}, step {steps[0]}" if len(steps) == 1
            else f"each layer at its last {at} (steps {steps[0]} to {steps[-1]})")
    if rest:
        note += f"; {len(rest)} more not shown: " + ", ".join(rest)
    fig.supxlabel(textwrap.fill(note, 30 * ncols), fontsize="small")


def _draw_loss_and_skips(fig, run):
    steps, edges, label = _x_axis(run)
    ax = fig.subplots()
    ax.set_title(_span(run), fontsize="small")
    known = np.isfinite(run["loss"])
    if known.any():
        losses = run["loss"][known]
        if losses.min() > 0 and losses.max() > LOG_LOSS_RATIO * losses.min():
            ax.set_yscale("log")  # the first steps' loss would flatten the rest
        ax.plot(steps[known], losses, marker=_marker(run), label="loss")
        if known.sum() <= WRITTEN_POINTS:
            for step, loss in zip(steps[known], losses):
                ax.annotate(f"{loss:.4g}", (step, loss), xytext=(0, 7),
                            textcoords="offset points", ha="center", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no loss recorded", transform=ax.transAxes, ha="center")
    ax.set(xlabel=label, ylabel=run["loss_label"])
    # From the first report's stretch to just past the last report.
    ax.set_xlim(edges[0], edges[-1] + 0.03 * (edges[-1] - edges[0]))
    for step, kind, layer in run["flags"]:
        ax.axvline(step, color="tab:orange", linestyle=":")
        ax.annotate(f"{kind}: {layer}", (step, 0.98), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize="x-small", color="tab:orange")
    skipped = run["skipped_steps"]
    total = np.nanmax(skipped) if np.isfinite(skipped).any() else None
    if not run["skipped_at"] and not total:
        # Nothing skipped: said in words, no row of zeros drawn.
        ax.text(0.99, 0.98, "skipped steps not recorded" if total is None
                else "no step skipped", transform=ax.transAxes, ha="right", va="top",
                fontsize="small", color="grey")
        return
    if run["skipped_at"]:
        ax.vlines(
            run["skipped_at"], 0, 1, transform=ax.get_xaxis_transform(),
            colors="red", alpha=0.6, label="skipped step",
        )
    twin = ax.twinx()
    twin.plot(
        steps, skipped, color="grey", drawstyle="steps-post",
        marker=_marker(run), label="skipped steps (cumulative)",
    )
    new = run["skipped_since_last"] > 0
    if not run["skipped_at"] and new.any():
        twin.plot(steps[new], skipped[new], "rv", label="report with skipped steps")
    twin.set_ylabel("skipped steps (cumulative)")
    # Counts: from zero, whole numbers.
    twin.set_ylim(0, max(1.0, total or 0.0) * 1.05)
    twin.yaxis.get_major_locator().set_params(integer=True)
    handles, labels = ax.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    twin.legend(handles + twin_handles, labels + twin_labels, fontsize="small")


# The pictures, in order: file name, title, drawing, and whether a run's
# columns hold its data.
PICTURES = (
    ("scales.png", "Loss scale per layer", _draw_scales, lambda run: True),
    ("gradient_norms.png", "Gradient norm per layer", _draw_gradient_norms,
     lambda run: run["grad_norms"]),
    ("histograms.png", "Gradient exponents vs float16 range", _draw_histograms,
     lambda run: run["histograms"]),
    ("loss_and_skips.png", "Loss and skipped steps", _draw_loss_and_skips,
     lambda run: True),
)


def main(argv=None):
    """Command line: writes the pictures of a monitor log and prints their paths."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_adaptive_scale.report",
        description="Writes PNG pictures of a loss-scaling monitor log.",
    )
    parser.add_argument(
        "log", help=f"a JSON-lines monitor log, or a directory holding {monitor_log.FILE_NAME}")
    parser.add_argument("--out", required=True, help="the directory to write the pictures to")
    args = parser.parse_args(argv)
    for path in plot_report(args.log, args.out):
        print(path)


if __name__ == "__main__":
    main()
