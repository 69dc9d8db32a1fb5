"""Runs several examples in one fresh process for tests/test_examples.py (not
a test module): one TensorFlow start-up for all of them.

Usage: python tests/examples_worker.py RUNS_JSON OUTPUT_JSON

RUNS_JSON is a list of `[name, script, [arguments]]`; each script's
`main(arguments)` runs in turn, in this order, its stdout captured. OUTPUT_JSON
gets `{name: {"stdout": ..., "error": traceback or null}}`; a run that raised
holds its traceback, so the other runs still report.

`examples/distributed.py` splits the CPU into two logical devices when it is
imported, which must come before anything starts TensorFlow's runtime: every
script is imported first, that one before the others, then run.
"""

import contextlib
import importlib.util
import io
import json
import os
import sys
import traceback

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load(script):
    name = "example_" + os.path.splitext(script)[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(runs_json, output_json):
    runs = json.loads(runs_json)
    scripts = sorted({script for _, script, _ in runs}, key=lambda s: s != "distributed.py")
    modules = {script: load(script) for script in scripts}
    results = {}
    for name, script, arguments in runs:
        out = io.StringIO()
        error = None
        try:
            with contextlib.redirect_stdout(out):
                modules[script].main(list(arguments))
        except BaseException:  # noqa: BLE001 - reported to the test
            error = traceback.format_exc()
        results[name] = {"stdout": out.getvalue(), "error": error}
        print(f"{name}: {'failed' if error else 'ok'}", flush=True)
    with open(output_json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
