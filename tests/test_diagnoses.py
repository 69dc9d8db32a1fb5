"""The monitor's pure parts: its thresholds (`diagnoses.Settings`), its log
record (`monitor_log`) and the diagnoses, on records made by hand."""

import dataclasses
import inspect

import numpy as np
import pytest

import tf_adaptive_scale as tas
from tf_adaptive_scale.monitor import diagnoses
from tf_adaptive_scale.monitor import monitor_log
from tf_adaptive_scale.numerics.float16 import NUM_BINS
from tf_adaptive_scale.monitor.monitor_log import LayerRecord
from tf_adaptive_scale.monitor.monitor_log import LogRecord


def record(step, norms, skipped=0, loss_finite=True, global_scale=True, **layer_fields):
    """A record of layers with gradient norms `norms` (name: norm)."""
    layers = {name: LayerRecord(norm, 1.0, [1.0] + [0.0] * (NUM_BINS - 1), 0.0, **layer_fields)
              for name, norm in norms.items()}
    return LogRecord(step, scaling="adaptive", global_scale=global_scale, loss_scale=1.0,
                     skipped_steps=skipped, skipped_since_last=skipped,
                     loss_finite=loss_finite, grad_norm=1.0, clip_rate=0.0,
                     exponent_min=-88, layers=layers)


def run(records, kinds, settings=None, new_measurement=True, **fields):
    """The flags of `kinds` that `diagnose` raises over `records`, as
    `(step, layer, kind)` (other diagnoses may flag more)."""
    settings = settings or diagnoses.Settings()
    memory, found = diagnoses.Memory(), []
    for r in records:
        obs = diagnoses.Observation(r, new_measurement, settings, 1e-3, past=memory, **fields)
        flags, memory = diagnoses.diagnose(obs)
        found += [(r.step, f.layer, f.kind) for f in flags if f.kind in kinds]
    return found


def test_settings_name_the_bad_argument_and_feed_the_monitor():
    with pytest.raises(ValueError, match="`patience` must be an int >= 1"):
        diagnoses.Settings(patience=0)
    with pytest.raises(ValueError, match="`window_underflow` must be in the open interval"):
        diagnoses.Settings(window_underflow=1.0)
    settings = diagnoses.Settings(window=4, exploding_history=3)
    assert diagnoses.Settings(**settings.get_config()) == settings
    monitor_arguments = inspect.signature(tas.ScaleMonitor).parameters
    assert set(diagnoses.ARGUMENTS) <= set(monitor_arguments)
    assert "exploding_history" not in monitor_arguments
    monitor = tas.ScaleMonitor(patience=2, vanishing_ratio=1e-3)
    assert monitor.settings == diagnoses.Settings(patience=2, vanishing_ratio=1e-3)
    assert (monitor.patience, monitor.window) == (2, 20)


def test_a_record_survives_its_json_form():
    r = record(7, {"a": 1.0}, underflow=0.5, overflow=0.0, window=[-3.0, 9.0, False])
    for from_fit in (False, True):
        made = dataclasses.replace(r, from_fit=from_fit, interval_loss=None,
                                   flags=(("vanishing", "a"),))
        data = made.to_json()
        assert ("interval_loss" in data) == from_fit and "from_fit" not in data
        assert data["flags"] == [{"kind": "vanishing", "layer": "a"}]
        assert LogRecord.from_json(data) == made
    assert "underflow" not in record(1, {"a": 1.0}).to_json()["layers"]["a"]


@pytest.mark.parametrize("scaling,expected", [
    ("adaptive", True), ("dynamic", True), ("per_layer", False), ("none", False), (None, True)])
def test_a_log_written_before_global_scale_tells_it_by_its_mode(scaling, expected):
    assert LogRecord.from_json({"step": 1, "scaling": scaling}).global_scale is expected
    assert LogRecord.from_json({"step": 1, "scaling": scaling, "global_scale": True}).global_scale


def test_lasting_conditions_warn_after_patience_measurements_once():
    records = [record(i, {"dead": 0.0, "live": 1.0}) for i in range(1, 6)]
    kinds = {"never_updates"}
    assert run(records, kinds) == [(3, "dead", "never_updates")]
    assert run(records, kinds, diagnoses.Settings(patience=1)) == [(1, "dead", "never_updates")]
    assert run(records, kinds, new_measurement=False) == []  # the same statistics again


def test_a_zero_norm_does_not_break_a_vanishing_streak():
    """The `small` streak is not judged where the norm is zero."""
    norms = [1e-9, 0.0, 1e-9, 0.0, 1e-9]
    records = [record(i, {"low": n, "high": 1.0}) for i, n in enumerate(norms)]
    assert run(records, {"vanishing"}) == [(4, "low", "vanishing")]


def test_skipped_runs_are_news_each_time():
    records = [record(i, {"a": 1.0}, skipped=s) for i, s in enumerate([5, 0, 6])]
    assert run(records, {"skipped"}) == [(0, "(all)", "skipped"), (2, "(all)", "skipped")]


def test_exploding_needs_its_history():
    norms = [1.0, 1.1, 0.9, 1.0, 1.05, 1e4]
    records = [record(i, {"a": n}) for i, n in enumerate(norms)]
    assert run(records, {"exploding"}) == [(5, "a", "exploding")]
    assert run(records, {"exploding"}, diagnoses.Settings(exploding_history=6)) == []


def test_no_single_scale_is_judged_with_a_global_scale_only():
    windows = {"quiet": [20.0, 30.0, False], "loud": [-10.0, 5.0, False]}

    def windowed(global_scale):
        r = record(1, {"quiet": 1.0, "loud": 1.0}, global_scale=global_scale)
        return dataclasses.replace(r, layers={
            n: dataclasses.replace(layer, window=windows[n]) for n, layer in r.layers.items()})

    assert run([windowed(True)], {"no_single_scale"}) == [(1, "(all)", "no_single_scale")]
    assert run([windowed(False)], {"no_single_scale"}) == []


def test_a_non_finite_loss_runs_the_probe_once_per_run():
    calls = []
    probe = lambda: calls.append(1) or ("blows_up", "float16")  # noqa: E731
    finite = [True, False, False, True, False]
    records = [record(i, {"a": 1.0}, loss_finite=f) for i, f in enumerate(finite)]
    kinds = {"forward_overflow", "loss_not_finite"}
    assert run(records, kinds, probe=probe) == [(1, "blows_up", "forward_overflow")]
    assert len(calls) == 2  # at steps 1 and 4; the second is flagged already
    assert run(records[:2], kinds) == [(1, "(all)", "loss_not_finite")]


def test_half_precision_weights_and_a_stall_are_flagged():
    dtypes = (("table", "float16"), ("table", "float16"), ("head", "float32"))
    found = run([record(1, {"table": 1.0, "head": 1.0})], {"stalled", "precision_limited"},
                weight_dtypes=dtypes, stall="stuck")
    assert found == [(1, "(all)", "stalled"), (1, "table", "precision_limited")]


def test_summary_and_scalars_come_from_the_record():
    r = record(3, {"a": 1.0, "b": 2.0}, underflow=0.25, overflow=0.0)
    keys = monitor_log.scalars(r, per_layer=True)
    assert keys["layer/a/underflow"] == 0.25 and "layer/a/histogram" not in keys
    assert list(monitor_log.scalars(r, per_layer=False)) == [
        "scale/loss_scale", "scale/skipped_steps", "scale/skipped_since_last",
        "scale/grad_norm", "scale/clip_rate", "scale/measured_step"]
    assert monitor_log.summary(None, []) == "ScaleMonitor: nothing recorded."
    assert monitor_log.summary(r, []).endswith("No layer flagged.")
    assert np.isclose(diagnoses.largest_norm(r), 2.0)


def test_a_fall_counts_from_the_highest_level_not_the_oldest():
    """A norm that rises 3 orders, then falls 5: 5 orders below its peak
    (`vanishing_orders`=4) is vanishing, though only 2 below where it began."""
    records = [record(i, {"a": n, "b": 1.0}) for i, n in enumerate([1.0, 1e3, 1e-2])]
    found = run(records, {"vanishing"})
    assert found == [(2, "a", "vanishing")]
    flags, memory = [], diagnoses.Memory()
    for r in records:
        new, memory = diagnoses.diagnose(
            diagnoses.Observation(r, True, diagnoses.Settings(), 1e-3, past=memory))
        flags += new
    assert "fell 5.0 orders of magnitude within 2 measurements" in flags[-1].message


def test_the_history_kept_is_the_last_window_measurements():
    """`window`=3: each layer keeps its last 3 levels, and a fall is judged
    within them: a peak 4 measurements back is forgotten."""
    norms = [1e3, 1.0, 1.0, 1.0, 1e-2]
    records = [record(i, {"a": n, "b": 1.0}) for i, n in enumerate(norms)]
    settings = diagnoses.Settings(window=3)
    memory = diagnoses.Memory()
    for r in records:
        _, memory = diagnoses.diagnose(diagnoses.Observation(r, True, settings, 1e-3, past=memory))
        assert len(memory.levels["a"]) <= 3
    assert memory.levels["a"] == pytest.approx(np.log10(norms[-3:]).tolist())
    assert run(records, {"vanishing"}, settings) == []
    # Within a window of 5 the peak is still there: 5 orders down.
    assert run(records, {"vanishing"}, diagnoses.Settings(window=5)) == [(4, "a", "vanishing")]


def test_flags_of_the_measured_figures_carry_their_step():
    """A flag on a measured figure carries the step measured; one on what a
    report reads (skipped steps) does not."""
    records = [dataclasses.replace(record(i, {"dead": 0.0, "live": 1.0}, skipped=5 * (i == 2)),
                                   measured_step=10 * i - 1) for i in range(1, 4)]
    flags, memory = [], diagnoses.Memory()
    for r in records:
        new, memory = diagnoses.diagnose(
            diagnoses.Observation(r, True, diagnoses.Settings(), 1e-3, past=memory))
        flags += new
    assert [(f.kind, f.measured_step) for f in flags] == [("skipped", None),
                                                          ("never_updates", 29)]


def test_figures_not_measured_since_are_nan_and_the_summary_names_the_step():
    layer = dict(underflow=0.25, overflow=0.0, zero_fraction=0.0)
    r = dataclasses.replace(record(78, {"a": 0.5}, **layer), measured_step=0,
                            zero_fraction=0.1, underflow=0.2)
    fresh = monitor_log.scalars(r, per_layer=True)
    stale = monitor_log.scalars(r, per_layer=True, fresh=False)
    assert list(stale) == list(fresh)
    nan = {key for key, value in stale.items() if np.isnan(value)}
    assert nan == {"scale/grad_norm", "scale/underflow", "scale/zero_fraction",
                   "layer/a/grad_norm", "layer/a/zeros", "layer/a/underflow",
                   "layer/a/overflow", "layer/a/zero_fraction"}
    assert {key: stale[key] for key in stale if key not in nan} == {
        key: fresh[key] for key in fresh if key not in nan}
    assert stale["scale/measured_step"] == 0 and stale["layer/a/scale"] == 1.0
    text = monitor_log.summary(r, [])
    assert text.startswith("ScaleMonitor summary at step 78: loss scale 2**0, 0 skipped steps; "
                           "gradient norm 1, measured at step 0.")
    unmeasured = monitor_log.summary(dataclasses.replace(r, measured_step=-1), [])
    assert "no gradient measured yet" in unmeasured and "gradient norm" not in unmeasured


def test_new_measurement_survives_the_json_form():
    r = dataclasses.replace(record(7, {"a": 1.0}), measured_step=3, new_measurement=False)
    assert r.to_json()["new_measurement"] is False
    assert LogRecord.from_json(r.to_json()) == r
    assert LogRecord.from_json({"step": 7}).new_measurement  # an older log's
