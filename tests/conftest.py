import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# On a CPU with AVX-512 float16, TensorFlow's oneDNN runs eager float16
# slowly (a convolution's gradient 40x float32's): off, as on other CPUs.
# The TensorFlow half of the suite on such a CPU, quiet: 618 s off against
# 662 s on (3828cd4, one run each). Child processes inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# The tests' programs are small and run a few steps: LLVM's optimisation of
# XLA's CPU code cost more than it saved (a fifth of the time of the
# XLA-compiled tests). XLA's own HLO passes, which the tests read, still run.
# Child processes inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import keras  # noqa: E402
import pytest  # noqa: E402

import helpers  # noqa: E402

# The tests that start a child Python process are marked `slow`; the fast
# ones alone:
#     python -m pytest -m "not slow"
# The suite runs twice (README): on TensorFlow, everything but test_jax.py;
# with KERAS_BACKEND=jax, the backend-neutral modules (one body runs both
# execution paths: stateful `apply` on TensorFlow, `stateless_apply` on JAX)
# and test_jax.py (what exists on JAX only). The rest is TensorFlow-specific
# (tf.function, tf.distribute, TensorBoard, GradientTape).
ON_JAX = {
    "test_jax.py",
    "test_saved_files.py",
    "test_compiled_step.py",
    "test_fit.py",
    "test_fit_accumulation.py",
    "test_gradient_paths.py",
    "test_scale_policy.py",
    "test_scaling.py",
    "test_stock_compatibility.py",
    "test_drop_in.py",
    "test_settings.py",
    "test_step_invariants.py",
    "test_step_programs.py",
    "test_measure_requests.py",
}
_here = os.path.dirname(__file__)
if keras.backend.backend() == "tensorflow":
    collect_ignore = ["test_jax.py"]
else:
    collect_ignore = [
        name for name in os.listdir(_here)
        if name.startswith("test_") and name.endswith(".py") and name not in ON_JAX
    ]


@pytest.fixture(autouse=True)
def float32_policy_and_seed():
    """Every test starts from float32 and a fixed seed, and leaves it so;
    the compiled steps it made (`helpers.compiled_once`) are forgotten."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")
    helpers._STEPS.clear()


@pytest.fixture
def float16_policy():
    """The test runs under `mixed_float16` (then float32 again)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


# ------------------------------------------------------------- scheduling
#
# With `-n N` (pytest-xdist's default `--dist load`) each test goes to the
# next free worker, except that the tests of one `Test*` class run in one
# worker: a class holds the tests that share what is too expensive to make
# twice (a child process whose results they read, a module-scoped training),
# which a worker makes once. (xdist's own `--dist loadgroup` marks do not
# take under pytest 9: it renames nodeids, which pytest 9 ignores.) The
# longest scopes start first, so that no core idles at the end with one
# long test left; `LONGEST_FIRST` lists them, longest first (seconds on the
# 2-core CI machine in the comments), the rest keep their order.
LONGEST_FIRST = [
    "test_distribution.py::TestFirstWorkerProcess",  # 80
    "test_examples.py::TestSecondChild",  # 80
    "test_examples.py::TestFirstChild",  # 75
    "test_distribution.py::TestSecondWorkerProcess",  # 55
    "test_resume.py::TestFreshProcessResume",  # 50
    "test_demo.py",  # 40
    "test_per_layer.py::TestLoadOnTheOtherBackend",  # 35
    "test_multi_worker.py",  # 30
    "test_jax.py::TestOneFreshJaxProcess",  # JAX pass: 15
    "test_fit.py::test_saved_model_resumes_exactly",  # JAX pass: 15
]


def _rank(nodeid):
    name = nodeid.rsplit("/", 1)[-1]
    for rank, prefix in enumerate(LONGEST_FIRST):
        if name.startswith(prefix):
            return rank
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist keeps xdist's scheduler
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerPerClass(LoadScopeScheduling):
        """`load` for tests outside classes, one scope per class; the
        scopes in collection order (longest first, above)."""

        def _split_scope(self, nodeid):
            scope = nodeid.rsplit("::", 1)[0]
            return scope if "::" in scope else nodeid

    config.option.loadscopereorder = False
    return OneWorkerPerClass(config, log)
