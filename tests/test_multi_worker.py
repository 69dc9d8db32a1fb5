"""Per-layer scaling under `tf.distribute.MultiWorkerMirroredStrategy`.

Two worker processes on 127.0.0.1 (`tests/multi_worker_worker.py worker`, each
with its own TF_CONFIG, one CPU replica each) and a single-process reference
without any strategy (`tests/multi_worker_worker.py single`) train the same
instrumented model (`tas.instrument`) with
`AdaptiveLossScaleOptimizer(..., scaling="per_layer")` in a custom training
loop (`strategy.run`, `jit_compile=False`) on the same global batches: worker
`i` gets rows `[4 i, 4 i + 4)` of every global batch of 8. Each process prints
its results as JSON on its last stdout line. All three run concurrently, once
per session, in subprocesses, so no TensorFlow state leaks into other tests.

What each test shows:

- `test_fixed_scales_fp32_workers_agree_and_match_single_process`: float32,
  fixed random per-unit scales in [2**-8, 2**8] (never measured): both
  workers end with bitwise identical weights and the same `layer_scales()`,
  and the weights equal the single-process run within rtol 1e-5 / atol 1e-6,
  a tolerance that a doubled or halved update fails (checked).
- `test_measured_fp16_workers_agree_and_match_single_process`:
  `mixed_float16`, every unit's scale measured on every step: bitwise
  identical weights and identical scales on both workers; the scales equal
  the single process's exactly, the weights within rtol 1e-2 / atol 1e-3.
  Weights cannot match exactly: each worker runs its float16 forward and
  backward passes on half of the batch and the halves' float32 weight
  gradients are summed afterwards, while the single process reduces all 8
  rows in one float16 computation, so roundings differ (~5e-4 relative after
  4 steps here). Scales agree exactly for these batches, though not by
  construction: the per-unit statistics are summed over workers, and so are
  their peak columns (up to 2x the single-process peak), which can put a
  scale one binade lower than one process would on other data.
- `test_overflow_on_one_worker_skips_step_on_both`: `mixed_float16`, all unit
  scales at 2**15, inputs of 1e4 in worker 1's shard only: worker 0's own
  gradients are finite, worker 1's are not, and the step is skipped on both
  (weights bitwise unchanged, `skipped_steps == 1`), leaving the same scales
  and caps on both; the next, clean step is applied alike on both.
"""

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from helpers import CHILD_TIMEOUT, ROOT, child_env

WORKER = os.path.join(ROOT, "tests", "multi_worker_worker.py")

pytestmark = pytest.mark.slow  # child processes
# The three processes run side by side (a worker waits for its peer; one
# that fails stops the others), so not through `helpers.child`; like it,
# `_run_all` caches its outcome, a timeout included, and waits
# `CHILD_TIMEOUT` (generous for a loaded machine).
TIMEOUT_S = CHILD_TIMEOUT


def _free_ports(n):
    """`n` distinct free localhost ports (all bound at once, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _launch(mode, tf_config=None):
    """Starts `multi_worker_worker.py mode`; output goes to temporary files
    (a pipe left unread could fill up and block the process)."""
    env = child_env(CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, WORKER, mode],
        env=env,
        cwd=ROOT,
        stdout=stdout,
        stderr=stderr,
    )
    return proc, stdout, stderr


@functools.lru_cache(maxsize=None)
def _run_all():
    """Runs both workers and the reference once per session.

    Returns:
        `(results, failure)`: results keyed `"worker0"`, `"worker1"`,
        `"single"`, or `None` and a message with every process's output.
    """
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    runs = {
        f"worker{i}": _launch(
            "worker", {"cluster": cluster, "task": {"type": "worker", "index": i}}
        )
        for i in range(2)
    }
    runs["single"] = _launch("single")
    deadline = time.monotonic() + TIMEOUT_S
    # Wait for all; stop early if one fails (its peer would wait for it).
    while any(p.poll() is None for p, _, _ in runs.values()):
        failed = any(p.poll() not in (None, 0) for p, _, _ in runs.values())
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    timed_out = time.monotonic() > deadline
    for proc, _, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    results, report = {}, []
    for name, (proc, stdout, stderr) in runs.items():
        stdout.seek(0)
        stderr.seek(0)
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
        stdout.close()
        stderr.close()
        report.append(
            f"--- {name}: exit status {proc.returncode}\n"
            f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
        )
        lines = out.strip().splitlines()
        if proc.returncode == 0 and lines:
            try:
                results[name] = json.loads(lines[-1])
            except ValueError:
                pass
    if len(results) < len(runs):
        why = f"timed out after {TIMEOUT_S}s" if timed_out else "failed"
        return None, f"multi-worker run {why}\n" + "\n".join(report)
    return results, None


def _scenario(name, processes=("worker0", "worker1", "single")):
    """The scenario's results from each of `processes`, in that order."""
    results, failure = _run_all()
    if failure:
        pytest.fail(failure)
    found = []
    for process in processes:
        result = results[process][name]
        if "error" in result:
            pytest.fail(
                f"scenario {name!r} raised in {process}:\n{result['error']}"
            )
        found.append(result)
    return found


def _allclose(a, b, rtol, atol):
    return all(
        np.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b)
    )


def assert_workers_identical(w0, w1):
    """Both workers hold the very same weights and scales."""
    assert w0["weights"] == w1["weights"]  # exact: floats round-trip JSON
    assert w0["log2_scales"] == w1["log2_scales"]
    assert w0["layer_scales"] == w1["layer_scales"]
    assert w0["log2_ceilings"] == w1["log2_ceilings"]
    for key in ("iterations", "total_steps", "skipped_steps"):
        assert w0[key] == w1[key], key


def assert_matches_single_process(worker, single, rtol, atol):
    """Same step counts and weights within `(rtol, atol)`, a tolerance that
    an update applied twice or halved would not pass."""
    assert worker["iterations"] == single["iterations"] == 4
    assert worker["skipped_steps"] == single["skipped_steps"] == 0
    assert len(worker["weights"]) == len(single["weights"])
    for w, s in zip(worker["weights"], single["weights"]):
        np.testing.assert_allclose(w, s, rtol=rtol, atol=atol)
    initial = [np.asarray(w) for w in single["initial_weights"]]
    for factor in (2.0, 0.5):
        wrong = [
            w0 + factor * (np.asarray(s) - w0)
            for w0, s in zip(initial, single["weights"])
        ]
        assert not _allclose(wrong, single["weights"], rtol, atol), factor


class TestTwoWorkersAndOneProcess:
    """The three processes run once (`_run_all`); one worker runs this class."""

    def test_workers_form_one_two_replica_cluster(self):
        results, failure = _run_all()
        if failure:
            pytest.fail(failure)
        for i in range(2):
            assert results[f"worker{i}"]["task_index"] == i
            assert results[f"worker{i}"]["num_replicas_in_sync"] == 2

    def test_fixed_scales_fp32_workers_agree_and_match_single_process(self):
        w0, w1, single = _scenario("fixed_scales_fp32")
        assert_workers_identical(w0, w1)
        # The assigned scales stayed fixed, the same on workers and reference.
        assigned = single["assigned_log2_scales"]
        assert any(v != 0.0 for v in assigned[1:])  # not trivially scale 1
        assert w0["log2_scales"] == single["log2_scales"] == assigned
        assert w0["layer_scales"] == single["layer_scales"]
        assert_matches_single_process(w0, single, rtol=1e-5, atol=1e-6)

    def test_measured_fp16_workers_agree_and_match_single_process(self):
        w0, w1, single = _scenario("measured_fp16")
        assert_workers_identical(w0, w1)
        assert all(np.all(np.isfinite(w)) for w in w0["weights"])
        # The scales were measured (they left their initial 1) ...
        assert any(v != 1.0 for v in single["layer_scales"].values())
        # ... and equal the single process's (see the module docstring).
        assert w0["layer_scales"] == single["layer_scales"]
        assert w0["log2_ceilings"] == single["log2_ceilings"]
        # float16 rounding of per-shard computations: close, not exact.
        assert_matches_single_process(w0, single, rtol=1e-2, atol=1e-3)

    def test_overflow_on_one_worker_skips_step_on_both(self):
        w0, w1 = _scenario("overflow_fp16", processes=("worker0", "worker1"))
        # The setup: worker 0 has the clean half, worker 1 the 1e4 half, and
        # only worker 1's own float16 gradients overflow.
        assert w0["shard_max_abs"] < 1.0
        assert w1["shard_max_abs"] == 1e4
        assert w0["local_grads_finite"] is True
        assert w1["local_grads_finite"] is False
        # Skipped on both workers.
        for w in (w0, w1):
            assert w["weights_bitwise_unchanged"]
            assert w["skipped_steps"] == 1
            assert w["total_steps"] == 1
            assert w["iterations"] == 0
            assert w["last_step_finite"] is False
        # The same scales and caps on both, with the overflow backed off.
        assert_workers_identical(w0, w1)
        start = w0["initial_log2_scales"]
        assert any(s < b for s, b in zip(w0["log2_scales"][1:], start[1:]))
        assert any(c < 15.0 for c in w0["log2_ceilings"][1:])
        # The next, clean step is applied, alike on both.
        a0, a1 = w0["after_clean_step"], w1["after_clean_step"]
        for a in (a0, a1):
            assert a["weights_changed"]
            assert a["last_step_finite"] is True
            assert a["skipped_steps"] == 1
            assert a["iterations"] == 1
            assert a["total_steps"] == 2
        assert_workers_identical(a0, a1)
