"""Where fit's compiled step spends its time, kernel by kernel: the stock
`LossScaleOptimizer` against the library's modes, on CPU (issue 43).

Keras on JAX. For one `zoo.FAMILIES` family (`mixed_float16`, `Adam()`,
its batch) every program is `fit`'s step as Keras compiles it,
`jax.jit(model.train_step, donate_argnums=0)`, lowered and compiled here
once, with XLA's default CPU optimisation:

- `stock`: `keras.mixed_precision.LossScaleOptimizer`, and `stock_again`,
  a second copy whose differences to the first are the run's noise;
- `adaptive`: `tas.AdaptiveLossScaleOptimizer(inner)`, the default mode
  (global adaptive scale);
- `per_layer`: `tas.instrument(model)` with `scaling="per_layer"`, its
  *plain* program (traced under `tas.measuring(False)`: the steps that take
  no statistics, all but one in `update_every`).

Every model starts from the same weights; its state is built by Keras's
symbolic build (no eager step), then `--warmup` steps run. The programs
then run in interleaved rounds (`timing.interleave`: a fresh random order
each round, every step waited for): `--timed` rounds without the profiler give the wall
time per step (medians), `--steps` rounds under `jax.profiler` give the
time of every XLA thunk. XLA's CPU runtime records each thunk with its HLO
instruction's name (`hlo_op`) and program (`hlo_module`); a thunk's time is
the median over its executions of the time from its start to its `end:`
event. Each instruction is classified from the optimized HLO text of its
program (`as_text()`): by opcode, and a fusion by the operations inside it.
A conditional's or a loop's own time excludes the thunks of the
computations it runs.

Printed (Markdown): per program the wall time, the span of a run (first
thunk's start to last thunk's end), the summed thunk time, the thunks run
and the MiB written per step (their outputs' sizes); the thunk time and the
MiB written per category, and their differences to stock; per mode the
(category, output shape) groups whose time differs most from stock's; and
the mode's most expensive kernels with no counterpart of the same category
and output shape (layout included) in stock's program.

Thunks run in parallel on the thread pool, so summed thunk time can exceed
the wall time. A thunk that completes on the pool (a copy of 1 MiB or more,
YNNPACK fusions, parallel loops: flagged "pool") counts its wait in the
pool's queue; on a loaded machine any thunk's time includes waits for a
core. Compare those by MiB, thunk counts and wall time.

Run: KERAS_BACKEND=jax python -m benchmarks.profile_step --family cnn
     [--modes adaptive,per_layer] [--warmup 3] [--timed 20] [--steps 20]
     [--batch N] [--top 15] [--no-noise] [--keep DIR]
"""

import argparse
import collections
import glob
import gzip
import json
import os
import platform
import re
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402
from benchmarks import hlo  # noqa: E402
from benchmarks import step_cost  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks import zoo  # noqa: E402

# `step_cost`'s variants: stock, a second stock program (its differences to
# the first are the run's noise), the default mode and per layer (profiled
# as its plain program).
MODES = {name: step_cost.VARIANTS[variant] for name, variant in (
    ("stock", "stock"), ("stock_again", "stock_again"), ("adaptive", "adaptive"),
    ("per_layer", "per_layer_100"))}
# At most this many elements: an elementwise kernel of the step's
# bookkeeping (scales, counters, flags), not of a tensor.
SCALAR_ELEMENTS = 16
CONTROL_FLOW = {"conditional", "while", "call"}
MOVEMENT = {"concatenate", "slice", "dynamic-slice", "dynamic-update-slice", "pad", "gather",
            "reverse"}
# Kinds of work, costliest first; the first five make a fusion theirs
# wherever they sit in it.
HEAVY = ("convolution", "dot", "scatter", "select-and-scatter", "sort", "reduce-window", "reduce")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f64": 8,
         "s64": 8, "u64": 8, "c64": 8}


# ------------------------------------------------------------ programs


def build(family, mode, weights, batch_size, seed=0):
    """One compiled model of `family` for `mode`, with `weights`; returns it
    and the batch."""
    per_layer, make_optimizer = MODES[mode]
    keras.utils.set_random_seed(seed)
    model, shape = zoo.FAMILIES[family]()
    model.set_weights(weights)
    if per_layer:
        model = tas.instrument(model)
    model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    shape = (batch_size or shape[0],) + tuple(shape[1:])
    x, y = zoo.batch_for(model, shape, seed)
    # Keras's own build before a first step: the optimizer's and metrics'
    # variables, no eager step and no compile of Keras's own.
    model._symbolic_build(data_batch=(x, y))
    return model, (x, y)


def compile_program(model, mode, state, data):
    """`fit`'s compiled step (per layer: the plain program) and its
    optimized HLO text."""

    def step(state, data):
        return model.train_step(state, data)

    step.__name__ = f"profiled_{mode}"  # the trace's hlo_module tells the programs apart
    with tas.measuring(not MODES[mode][0]):
        compiled = jax.jit(step, donate_argnums=0).lower(state, data).compile()
    return compiled, compiled.as_text()


# ------------------------------------------------------------ HLO


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


class Kernel:
    """One instruction of an optimized HLO module, as the profile sees it."""

    def __init__(self, name, shape, opcode, rest):
        self.name, self.shape, self.opcode = name, shape, opcode
        self.operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        self.calls = re.findall(
            r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)",
            rest)
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if branches:
            self.calls += re.findall(r"%([\w.\-]+)", branches.group(1))
        kind = re.search(r"kind=(k\w+)", rest)
        self.fusion_kind = kind.group(1) if kind else ""
        self.ynn = "__ynn_fusion" in rest
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        self.target = target.group(1) if target else ""
        source = re.search(r'op_name="([^"]*)"', rest)
        self.source = source.group(1) if source else ""
        self.category = None

    def arrays(self):
        """`(element type, element count)` of each array of its output."""
        return [(dtype, int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
                for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", self.shape)]

    def elements(self):
        """The element count of the largest array of its output."""
        return max([count for _, count in self.arrays()] or [0])

    def bytes(self):
        """The bytes it writes (its output's; a conditional's or loop's are
        its thunks')."""
        if self.opcode in CONTROL_FLOW:
            return 0
        return sum(count * BYTES.get(dtype, 4) for dtype, count in self.arrays())


def parse_hlo(text):
    """`(kernels by name, instruction names by computation, module name)`
    of an optimized HLO module's text, each kernel's category set."""
    kernels, members, computation = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        found = _INSTRUCTION.match(line)
        if found and computation is not None:
            kernel = Kernel(*found.groups())
            kernels[kernel.name] = kernel
            members[computation].append(kernel.name)
    for kernel in kernels.values():
        kernel.category = category(kernel, kernels, members)
    module = re.match(r"HloModule (\S+?),", text).group(1)
    return kernels, members, module


def category(kernel, kernels, members):
    """A kernel's kind: what it computes, from its opcode or, for a fusion,
    from the operations inside it that work on as many elements as it
    writes (a scale sliced from a vector and broadcast does not make a
    multiply a slice), the costliest kind first."""
    op = kernel.opcode
    if op in CONTROL_FLOW:
        return f"{op} (own time)"
    if op == "custom-call":
        return f"custom-call {kernel.target}"
    inside = {op}
    if op == "fusion":
        size = kernel.elements()
        inside = set()
        for name in (n for c in kernel.calls for n in members.get(c, ())):
            member = kernels[name]
            reads = max([kernels[o].elements() for o in member.operands if o in kernels] or [0])
            if member.opcode in HEAVY[:5] or max(member.elements(), reads) >= size:
                inside.add(member.opcode)
        inside -= hlo.NOT_KERNELS
    for kind in HEAVY:
        if kind in inside:
            return kind
    if inside & {"transpose", "copy"}:
        return "copy/transpose"
    if inside & MOVEMENT:
        return "concatenate/slice/pad/gather"
    if inside <= {"convert"}:
        return "convert only"
    if kernel.elements() <= SCALAR_ELEMENTS:
        return f"elementwise, scalar (<= {SCALAR_ELEMENTS} elements)"
    return "elementwise"


def shown(shape, width=48):
    """A shape for a table: a tuple by its size."""
    if shape.startswith("("):
        return f"tuple of {shape.count('[')}"
    return shape if len(shape) <= width else shape[:width - 3] + "..."


def label(kernel):
    """The kernel's opcode, with a fusion's kind."""
    if kernel.opcode != "fusion":
        return kernel.opcode
    return f"fusion {kernel.fusion_kind}" + (" (YNNPACK)" if kernel.ynn else "")


# ------------------------------------------------------------ running


def run_rounds(programs, states, data, rounds, seed):
    """`rounds` rounds of one step per program (`timing.interleave`), every
    step waited for; returns `{mode: [seconds of each step]}`."""

    def step(mode):
        def run():
            logs, states[mode] = programs[mode](states[mode], data[mode])
            jax.block_until_ready((logs, states[mode]))

        return run

    times = timing.interleave({mode: step(mode) for mode in programs}, rounds, seed)
    return {mode: t["wall"] for mode, t in times.items()}


def read_trace(directory):
    """`({hlo_module: {hlo_op: [(latency, own) microseconds of each
    execution]}}, {hlo_module: [microseconds of each run]})` from a
    `jax.profiler` trace. A thunk's latency runs from its start to its
    `end:` event, its own time is the call that started it: the same for a
    thunk that runs in the calling thread, less for one that completes on
    the thread pool. A run of a program spans its first thunk's start to
    its last thunk's end."""
    paths = glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.trace.json.gz"))
    if not paths:
        raise RuntimeError(f"no trace written under {directory}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    open_starts = collections.defaultdict(list)
    found = []
    for event in events:
        args = event.get("args", {})
        if "hlo_op" in args and "hlo_module" in args:
            own = event.get("dur", 0.0)
            record = [args["hlo_module"], args["hlo_op"], event["ts"], own, args.get("run_id"), own]
            open_starts[args["hlo_op"]].append(record)
            found.append(record)
        elif event["name"].startswith("end: "):
            starts = open_starts.get(event["name"][5:])
            if starts:  # executions of one thunk never overlap: the latest start is its own
                record = starts.pop()
                record[3] = max(record[3], event["ts"] - record[2])
    durations = collections.defaultdict(lambda: collections.defaultdict(list))
    runs = collections.defaultdict(lambda: [float("inf"), 0.0])
    for module, op, began, duration, run, own in found:
        durations[module][op].append((duration, own))
        span = runs[module, run]
        span[0], span[1] = min(span[0], began), max(span[1], began + duration)
    spans = collections.defaultdict(list)
    for (module, _), (first, last) in runs.items():
        spans[module].append(last - first)
    return durations, spans


def per_step(durations, steps):
    """Microseconds per step of each thunk: the median latency times the
    executions per step (a median: on a loaded machine a few executions
    wait long for a core)."""
    return {op: float(np.median([latency for latency, _ in d])) * len(d) / steps
            for op, d in durations.items()}


def asynchronous(durations):
    """The thunks that complete on the thread pool (median latency well
    above the call's own time): their latency includes waiting in its
    queue behind other thunks' work."""
    return {op for op, d in durations.items()
            if np.median([latency for latency, _ in d])
            > 1.5 * np.median([own for _, own in d]) + 5}


def own_times(kernels, members, raw):
    """`raw` (microseconds per step by kernel name) with a conditional's or
    loop's own time, without the thunks of the computations it runs
    (those count on their own)."""
    times = dict(raw)
    for name, us in raw.items():
        kernel = kernels.get(name)
        if kernel is not None and kernel.opcode in CONTROL_FLOW:
            inner = sum(raw.get(n, 0.0) for c in kernel.calls for n in members.get(c, ()))
            times[name] = max(us - inner, 0.0)
    return times


# ------------------------------------------------------------ report


def ms(us):
    return us / 1000.0


def matched_extras(stock_kernels, mode_kernels, times, stock_times):
    """The mode's kernels without a counterpart in stock's: per (category,
    output shape), each stock kernel takes the mode's kernel of that group
    nearest to it in time; the rest are extras."""
    groups = collections.defaultdict(list)
    for kernel in stock_kernels:
        groups[kernel.category, kernel.shape].append(stock_times.get(kernel.name, 0.0))
    pending = collections.defaultdict(list)
    for kernel in mode_kernels:
        pending[kernel.category, kernel.shape].append(kernel)
    extras = []
    for key, candidates in pending.items():
        for reference in sorted(groups.get(key, ()), reverse=True):
            if not candidates:
                break
            nearest = min(candidates, key=lambda k: abs(times.get(k.name, 0.0) - reference))
            candidates.remove(nearest)
        extras += candidates
    return extras


def short_source(kernel, width=60):
    """The JAX operation the kernel came from (the end of its op_name)."""
    source = kernel.source.split("/")
    source = "/".join(source[-2:]) if source != [""] else ""
    return source if len(source) <= width else "..." + source[-width + 3:]


def report(profiles, walls, steps, top):
    """Prints the tables (Markdown)."""
    modes = list(profiles)
    stock = profiles["stock"]
    for p in profiles.values():
        p["ran"] = [p["kernels"][n] for n in p["times"] if n in p["kernels"]]
        p["mib"] = {k.name: k.bytes() * len(p["durations"][k.name]) / steps / 2**20
                    for k in p["ran"]}
    print("\n| program | wall ms/step (median) | / stock | run span ms (median) | / stock "
          "| thunk ms/step (sum) | of which thunks completing on the pool | thunks run per step "
          "| MiB written per step | state arrays |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        p = profiles[mode]
        total = sum(p["times"].values())
        pooled = sum(us for name, us in p["times"].items() if name in p["async"])
        runs = sum(len(d) for d in p["durations"].values()) / steps
        print(f"| {mode} | {np.median(walls[mode]) * 1e3:.2f} "
              f"| {np.median(walls[mode]) / np.median(walls['stock']):.3f} "
              f"| {ms(p['span']):.2f} | {p['span'] / stock['span']:.3f} "
              f"| {ms(total):.2f} | {ms(pooled):.2f} | {runs:.0f} "
              f"| {sum(p['mib'].values()):.1f} | {p['state_arrays']} |")

    sums = {}
    for mode in modes:
        p = profiles[mode]
        sums[mode] = collections.defaultdict(lambda: [0.0, 0, 0.0])
        for name, us in p["times"].items():
            kernel = p["kernels"].get(name)
            total = sums[mode][kernel.category if kernel is not None else "not in the HLO text"]
            total[0] += us
            total[1] += 1
            total[2] += p["mib"].get(name, 0.0)
    categories = sorted(set().union(*sums.values()),
                        key=lambda c: -max(sums[m].get(c, [0, 0, 0])[0] for m in modes))
    for title, cell, delta in (
        ("Thunk ms/step per category (kernels of that category that ran)",
         lambda v: f"{ms(v[0]):.3f} ({v[1]})", lambda v, r: f"{ms(v[0] - r[0]):+.3f}"),
        ("MiB written per step per category",
         lambda v: f"{v[2]:.1f}", lambda v, r: f"{v[2] - r[2]:+.1f}"),
    ):
        print(f"\n{title}:\n")
        print("| category | " + " | ".join(
            m if m == "stock" else f"{m} | {m} - stock" for m in modes) + " |")
        print("|---|" + "---|" * (2 * len(modes) - 1))
        for c in categories:
            reference = sums["stock"].get(c, [0.0, 0, 0.0])
            cells = [cell(reference)]
            for mode in modes[1:]:
                value = sums[mode].get(c, [0.0, 0, 0.0])
                cells += [cell(value), delta(value, reference)]
            print(f"| {c} | " + " | ".join(cells) + " |")

    for mode in (m for m in modes if not m.startswith("stock")):
        p = profiles[mode]
        groups = collections.defaultdict(lambda: [0.0, 0, 0.0, 0])
        for program, offset in ((stock, 0), (p, 2)):
            for kernel in program["ran"]:
                group = groups[kernel.category, kernel.shape]
                group[offset] += program["times"][kernel.name]
                group[offset + 1] += 1
        ordered = sorted(groups.items(), key=lambda item: -abs(item[1][2] - item[1][0]))[:top]
        print(f"\n{mode}: the (category, output shape) groups whose time differs most "
              "from stock's:\n")
        print(f"| category | output shape | stock ms (kernels) | {mode} ms (kernels) "
              "| difference ms |")
        print("|---|---|---|---|---|")
        for (c, shape), (s_us, s_n, m_us, m_n) in ordered:
            print(f"| {c} | `{shown(shape)}` | {ms(s_us):.3f} ({s_n}) "
                  f"| {ms(m_us):.3f} ({m_n}) | {ms(m_us - s_us):+.3f} |")
        extras = matched_extras(stock["ran"], p["ran"], p["times"], stock["times"])
        extras.sort(key=lambda k: -p["times"][k.name])
        print(f"\n{mode}: {len(extras)} kernels without a same-category, same-shaped "
              f"counterpart in stock's, {ms(sum(p['times'][k.name] for k in extras)):.3f} "
              f"ms/step and {sum(p['mib'][k.name] for k in extras):.1f} MiB/step in all; "
              f"the top {top} by time (pool: completes on the thread pool, its time "
              "includes waiting there):\n")
        print("| kernel | opcode | category | output shape | ms/step | MiB/step | pool | from |")
        print("|---|---|---|---|---|---|---|---|")
        for kernel in extras[:top]:
            print(f"| `{kernel.name}` | {label(kernel)} | {kernel.category} "
                  f"| `{shown(kernel.shape)}` | {ms(p['times'][kernel.name]):.3f} "
                  f"| {p['mib'][kernel.name]:.2f} "
                  f"| {'yes' if kernel.name in p['async'] else ''} "
                  f"| `{short_source(kernel)}` |")


# ------------------------------------------------------------ main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="cnn", choices=sorted(zoo.FAMILIES))
    parser.add_argument("--modes", default="adaptive,per_layer",
                        help="modes compared with stock, of adaptive, per_layer")
    parser.add_argument("--batch", type=int, default=0, help="batch size (0: step_cost's)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--timed", type=int, default=20, help="rounds timed, no profiler")
    parser.add_argument("--steps", type=int, default=20, help="rounds under the profiler")
    parser.add_argument("--top", type=int, default=15, help="rows of the per-kernel tables")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default="",
                        help="a folder to keep the trace and each program's optimized HLO in")
    parser.add_argument("--no-noise", dest="noise", action="store_false",
                        help="leave out the second stock program (the noise yardstick)")
    args = parser.parse_args(argv)
    modes = ["stock"] + ["stock_again"] * args.noise + [
        m for m in args.modes.split(",") if m and not m.startswith("stock")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; allowed: adaptive, per_layer")
    if keras.backend.backend() != "jax":
        parser.error(f"needs KERAS_BACKEND=jax (got {keras.backend.backend()})")
    if "optimization_level" in os.environ.get("XLA_FLAGS", ""):
        print("warning: XLA_FLAGS sets an optimisation level:", os.environ["XLA_FLAGS"])

    began = time.perf_counter()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(args.seed)
    weights = zoo.FAMILIES[args.family]()[0].get_weights()
    programs, states, data, profiles = {}, {}, {}, {}
    for mode in modes:
        model, data[mode] = build(args.family, mode, weights, args.batch, args.seed)
        state = hlo.fit_state(model)
        compiling = time.perf_counter()
        programs[mode], text = compile_program(model, mode, state, data[mode])
        kernels, members, module = parse_hlo(text)
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            with open(os.path.join(args.keep, f"{mode}.hlo.txt"), "w") as f:
                f.write(text)
        profiles[mode] = {"kernels": kernels, "members": members, "module": module,
                          "state_arrays": len(jax.tree_util.tree_leaves(state))}
        # Copies: the programs donate their state, and the model's variables stay whole.
        states[mode] = jax.tree_util.tree_map(lambda v: v.copy(), state)
        print(f"  {mode}: compiled in {time.perf_counter() - compiling:.0f} s, "
              f"{len(kernels)} instructions", flush=True)
    run_rounds(programs, states, data, args.warmup, args.seed)
    walls = run_rounds(programs, states, data, args.timed, args.seed + 1)
    with tempfile.TemporaryDirectory() as directory:
        directory = args.keep or directory
        jax.profiler.start_trace(directory)
        run_rounds(programs, states, data, args.steps, args.seed + 2)
        jax.profiler.stop_trace()
        durations, spans = read_trace(directory)
    for mode, p in profiles.items():
        p["durations"] = durations.get(p["module"], {})
        p["span"] = float(np.median(spans[p["module"]]))
        p["async"] = asynchronous(p["durations"])
        p["times"] = own_times(p["kernels"], p["members"], per_step(p["durations"], args.steps))
    shape = data["stock"][0].shape
    print(f"\n{args.family}, batch {list(shape)}, mixed_float16, Adam, jit; "
          f"{args.warmup} warm-up, {args.timed} timed and {args.steps} profiled rounds; "
          f"jax {jax.__version__}, keras {keras.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs; {time.perf_counter() - began:.0f} s")
    report(profiles, walls, args.steps, args.top)


if __name__ == "__main__":
    main()
