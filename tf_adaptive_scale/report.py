"""Pictures of a training run's loss-scaling monitor log.

`plot_report` reads the JSON-lines log that the scale monitor writes into its
`log_dir` (`monitor_log.FILE_NAME`), or the epoch-level metrics of a
`keras.callbacks.History`, and writes PNG pictures of the scales, gradient
norms, gradient exponents and skipped steps. The same works from a shell:

    python -m tf_adaptive_scale.report LOG_DIR --out DIR

Matplotlib is an optional dependency: `pip install tf_adaptive_scale[plot]`.
"""

import argparse
import math
import os
import textwrap

import numpy as np

from tf_adaptive_scale import float16
from tf_adaptive_scale import monitor_log

MAX_LEGEND_LAYERS = 12
# Fewer reports than this are drawn with a marker at each (one point draws
# no line).
MARKED_POINTS = 30
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

    `scales.png` (log2 of each layer's scale and of the global loss scale),
    `gradient_norms.png` (a heatmap of the layers' gradient norms),
    `histograms.png` (each layer's last gradient exponents, shifted by its
    scale, against float16's range; flagged layers' titles in red) and
    `loss_and_skips.png` (the loss, skipped steps, a dotted line at each
    flag). Each PNG stores its title in its metadata, under "Title".

    Args:
        source: A JSON-lines monitor log, a directory holding one, a
            `keras.callbacks.History` or its `.history` dict (one value per
            epoch, no histograms).
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
            "plot_report needs matplotlib: pip install tf_adaptive_scale[plot]"
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
    return _from_records(records)


def _from_records(records):
    """Columns of a JSON-lines log (its dicts): one value per report."""
    records = [monitor_log.LogRecord.from_json(r) for r in records]
    names = list(dict.fromkeys(n for r in records for n in r.layers))
    layers = {
        name: {
            metric: _column([getattr(r.layers.get(name), metric, None) for r in records])
            for metric in ("grad_norm", "scale")
        }
        for name in names
    }
    histograms = {}  # Each layer's last histogram, as (exponents, counts).
    for record in records:
        for name, layer in record.layers.items():
            if layer.histogram is not None:
                counts = np.asarray(layer.histogram, dtype=float)
                shift = record.exponent_min + np.log2(layer.scale)
                histograms[name] = (np.arange(len(counts)) + shift, counts)
    return {
        "step_label": "step",
        "steps": np.array([r.step for r in records]),
        # The mean loss since the report before (other reports: the loss
        # given, in `fit` Keras's running epoch mean, which jumps at every epoch).
        "loss": _column([r.interval_loss if r.from_fit else r.loss for r in records]),
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
        "steps": np.arange(epochs),
        "loss": column("loss"),
        "global_scale": True,
        "loss_scale": column("scale/loss_scale"),
        "skipped_steps": skipped,
        "skipped_since_last": np.diff(skipped, prepend=0.0),
        "skipped_at": [],
        "flags": [],
        "layers": {
            name: {m: column(f"layer/{name}/{m}") for m in ("grad_norm", "scale")}
            for name in names
        },
        "histograms": {},
    }


def _column(values):
    """A float array with NaN for missing (None) values."""
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _marker(run):
    return "o" if len(run["steps"]) < MARKED_POINTS else None


def _draw_scales(fig, run):
    ax = fig.subplots()
    few = len(run["layers"]) <= MAX_LEGEND_LAYERS
    for name, layer in run["layers"].items():
        ax.plot(run["steps"], np.log2(layer["scale"]), marker=_marker(run),
                label=name if few else None)
    if run["global_scale"]:
        ax.plot(run["steps"], np.log2(run["loss_scale"]), "k--", marker=_marker(run),
                label="global loss_scale")
    ax.set(xlabel=run["step_label"], ylabel="log2 scale")
    ax.yaxis.get_major_locator().set_params(integer=True)  # scales are powers of two
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _draw_gradient_norms(fig, run):
    from matplotlib import colormaps

    names = list(run["layers"])
    fig.set_figheight(2 + 0.3 * len(names))
    norms = np.array([run["layers"][name]["grad_norm"] for name in names])
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.ma.masked_invalid(np.log10(norms))  # Zero norms are masked.
    cmap = colormaps["viridis"]
    ax = fig.subplots()
    image = ax.imshow(
        logs, aspect="auto", interpolation="nearest", cmap=cmap.with_extremes(bad=cmap(0.0))
    )
    columns = np.unique(np.linspace(0, len(run["steps"]) - 1, 8).astype(int))
    ax.set_xticks(columns, run["steps"][columns])
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel(run["step_label"])
    fig.colorbar(image, ax=ax, label="log10 gradient norm")


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
        exponents, counts = run["histograms"][name]
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
    if rest:
        note = "Not shown: " + ", ".join(rest)
        fig.supxlabel(textwrap.fill(note, 30 * ncols), fontsize="small")


def _draw_loss_and_skips(fig, run):
    steps = run["steps"]
    ax = fig.subplots()
    known = np.isfinite(run["loss"])
    ax.plot(steps[known], run["loss"][known], marker=_marker(run), label="loss")
    ax.set(xlabel=run["step_label"], ylabel="loss")
    if run["skipped_at"]:
        ax.vlines(
            run["skipped_at"], 0, 1, transform=ax.get_xaxis_transform(),
            colors="red", alpha=0.6, label="skipped step",
        )
    for step, kind, layer in run["flags"]:
        ax.axvline(step, color="tab:orange", linestyle=":")
        ax.annotate(f"{kind}: {layer}", (step, 0.98), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize="x-small", color="tab:orange")
    twin = ax.twinx()
    twin.plot(
        steps, run["skipped_steps"], color="grey", drawstyle="steps-post",
        marker=_marker(run), label="skipped steps (cumulative)",
    )
    new = run["skipped_since_last"] > 0
    if not run["skipped_at"] and new.any():
        twin.plot(steps[new], run["skipped_steps"][new], "rv", label="report with skipped steps")
    twin.set_ylabel("skipped steps (cumulative)")
    # Counts: from zero, whole numbers (no -0.04..0.04 axis for no skips).
    twin.set_ylim(0, max(1.0, np.nanmax(run["skipped_steps"], initial=0.0)) * 1.05)
    twin.yaxis.get_major_locator().set_params(integer=True)
    handles, labels = ax.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    twin.legend(handles + twin_handles, labels + twin_labels, fontsize="small")


# The pictures, in order: file name, title, drawing, and whether a run's
# columns hold its data.
PICTURES = (
    ("scales.png", "Loss scale per layer", _draw_scales, lambda run: True),
    ("gradient_norms.png", "Gradient norm per layer", _draw_gradient_norms,
     lambda run: run["layers"]),
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
    parser.add_argument("log", help=f"a JSON-lines monitor log, or a directory holding {monitor_log.FILE_NAME}")
    parser.add_argument("--out", required=True, help="the directory to write the pictures to")
    args = parser.parse_args(argv)
    for path in plot_report(args.log, args.out):
        print(path)


if __name__ == "__main__":
    main()
