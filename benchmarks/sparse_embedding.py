"""Sparse embedding gradients: step time and peak memory against stock.

A small causal transformer language model (`--blocks` blocks of width
`--width`, sequences of `--seq` tokens, batches of `--batch`) reads a
`--vocab` (32768) token embedding of `--embed-dim` columns (projected to the
width by a Dense layer when the two differ) and predicts the next token with
its own Dense head (no position embedding: the causal mask orders the
tokens, which is all a benchmark needs). The head is not tied to the
embedding, so the embedding's gradient is the `tf.IndexedSlices` of a
gather, with at most batch x seq of its rows. `mixed_float16`, compiled `model.fit`-style train
steps (`train_on_batch`, `jit_compile=True`), `SparseCategoricalCrossentropy`
over the next token. Inner optimizers (`--inner`): `Adam()`, and `SGD(0.01)`
without momentum, whose Keras update of an `IndexedSlices` gradient is a
scatter of its rows (Keras's Adam computes `gradient - m`, which densifies
it: its moments decay everywhere, a dense update in any case).

Variants, each wrapping a fresh inner optimizer:

- `stock`: `keras.mixed_precision.LossScaleOptimizer(inner)`, twice: the
  second copy's ratio to the first ("stock again") is the run's noise;
- `adaptive`: `tas.AdaptiveLossScaleOptimizer(inner)` (default arguments:
  the global adaptive scale under `mixed_float16`);
- `dynamic`: `tas.AdaptiveLossScaleOptimizer(inner, scaling="dynamic")`.

(a) Step time: every variant gets its own copy of the model with the same
initial weights, in one fresh process per inner optimizer; after three
warm-up steps each, `--steps` rounds of one `train_on_batch` per variant in
a fresh random order each round (`timing.interleave`, as `step_cost.py`);
the ratio of each variant's median step time to stock's.

(b) Peak memory: every sample is a fresh Python process (glibc told to
give every allocation from 64 KiB up pages of its own and return them on
free, `MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`, so that
resident memory follows the live buffers rather than what the heap kept of
earlier steps) that builds one model, compiles it and makes its batch, then
reads its resident set size (`VmRSS`, "built"). It runs one step (tracing,
XLA compiling, building the optimizer) and two more;
`resource.getrusage(RUSAGE_SELF).ru_maxrss` minus "built" is the "peak over
built" (compiling included). Then it resets the kernel's high-water mark
(writing 5 to `/proc/self/clear_refs`; Linux >= 4.0, which resets
`ru_maxrss` too) and reads `VmRSS` again ("warm": minus "built", what
stayed resident: optimizer slots, compiled programs, allocator caches). It
runs `--mem-steps` steps and reads `ru_maxrss`: minus "warm", the "step
peak", the most one compiled step holds beyond what stays resident (its
gradients and temporaries: a densified embedding gradient is `--vocab` x
`--embed-dim` x 4 bytes, printed as "dense gradient"). Where the reset is
refused the step peak is not reported. Variants alternate in a fresh random
order each of `--mem-rounds` rounds; medians.

The gradient reaching the inner optimizer is recorded for the embedding
(by a subclass of the inner optimizer's class whose `apply` and
`update_step` note their gradient's type while the step is traced; a
benchmark-only wrapper, the arithmetic is the inner optimizer's):
"IndexedSlices" or "Tensor" (dense), at `apply` / at `update_step`.

Absolute times and sizes on a shared CPU mean little: ratios. On CPU, XLA
computes float16 matmuls in float32, and one step's temporaries are
allocated and freed by the host allocator, so the step peak is what a
device's allocator would also need to find, approximately.

Run: python -m benchmarks.sparse_embedding [--inner adam,sgd]
     [--variants adaptive,dynamic] [--embed-dim 1024] [--width 128] [--blocks 1]
     [--seq 16] [--batch 8] [--steps 20] [--mem-rounds 1] [--mem-steps 5]
     [--json out.json] [--quick]
`--embed-dim 1024` makes the embedding 32768 x 1024 (128 MiB of float32),
projected to the width: the dense-gradient cost shows in memory.
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("stock", "stock_again", "adaptive", "dynamic")
EMBEDDING = "token_embedding"


# --- Model, optimizers (imported lazily: the parent process stays light) ---


def build_model(args):
    from benchmarks import zoo

    # Not tied: the head has its own kernel.
    return zoo.transformer(
        args.seq, args.width, args.blocks, vocab=args.vocab, outputs=args.vocab,
        per_token=True, causal=True, embed_dim=args.embed_dim,
        names={"embedding": EMBEDDING, "projection": "embedding_projection", "logits": "head"})


def recording(cls):
    """A subclass of optimizer class `cls` that notes, while tracing, the
    type of the embedding's gradient at `apply` and at `update_step`."""

    class Recording(cls):
        def apply(self, grads, trainable_variables=None):
            variables = trainable_variables or self._trainable_variables
            for g, v in zip(grads, variables):
                if EMBEDDING in v.path:
                    self.seen_apply = type(g).__name__
                    self.embedding_key = self._var_key(v)
            return super().apply(grads, trainable_variables)

        def update_step(self, gradient, variable, learning_rate):
            # Keras hands the backend's own variable here on TensorFlow.
            if self._var_key(variable) == getattr(self, "embedding_key", None):
                self.seen_update = type(gradient).__name__
            return super().update_step(gradient, variable, learning_rate)

    Recording.__name__ = "Recording" + cls.__name__
    return Recording


def make_optimizer(variant, inner_name):
    import keras

    import tf_adaptive_scale as tas

    if inner_name == "adam":
        inner = recording(keras.optimizers.Adam)()
    else:
        inner = recording(keras.optimizers.SGD)(learning_rate=0.01)
    if variant in ("stock", "stock_again"):
        return keras.mixed_precision.LossScaleOptimizer(inner), inner
    if variant == "adaptive":
        return tas.AdaptiveLossScaleOptimizer(inner), inner
    if variant == "dynamic":
        return tas.AdaptiveLossScaleOptimizer(inner, scaling="dynamic"), inner
    raise ValueError(variant)


def make_batch(args, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype("int32")
    return x[:, :-1], x[:, 1:]


def gradient_types(inner):
    def kind(name):
        return name if name in ("IndexedSlices", "?") else "dense"

    return (f"{kind(getattr(inner, 'seen_apply', '?'))} / "
            f"{kind(getattr(inner, 'seen_update', '?'))}")


def setup(args):
    import keras

    from benchmarks import timing

    timing.set_threads(args.threads)
    keras.mixed_precision.set_global_policy("mixed_float16")
    return keras, timing


# --- Workers (each in a fresh process) ---


def timing_variants(args):
    """`--variants` in table order, with both stock copies."""
    chosen = set(args.variants.split(",")) | {"stock", "stock_again"}
    return [v for v in VARIANTS if v in chosen]


def timing_worker(args, inner_name):
    """Interleaved step times of every variant (this process)."""
    keras, timing = setup(args)
    keras.utils.set_random_seed(0)
    weights = build_model(args).get_weights()
    batch = make_batch(args)
    models, inners, traces = {}, {}, {}
    names = timing_variants(args)
    for name in names:
        keras.utils.set_random_seed(0)
        model = build_model(args)
        model.set_weights(weights)
        optimizer, inners[name] = make_optimizer(name, inner_name)
        timing.compile_counted(model, optimizer, True, traces, name)
        for _ in range(3):
            model.train_on_batch(*batch)
        models[name] = model
    warm = dict(traces)
    ratios = timing.step_ratios(models, batch, args.steps, seed=0)
    return {
        "ratios": {name: r["wall_median"] for name, r in ratios.items()},
        "types": {name: gradient_types(inners[name]) for name in names},
        "retraces": {n: traces[n] - warm[n] for n in names if traces[n] != warm[n]},
        "params": models["stock"].count_params(),
    }


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_worker(args, inner_name, variant):
    """Peak RSS of one variant's steps (this process: call it in a new one)."""
    keras, timing = setup(args)
    keras.utils.set_random_seed(0)
    model = build_model(args)
    optimizer, inner = make_optimizer(variant, inner_name)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    batch = make_batch(args)
    built = _status_kib("VmRSS")
    for _ in range(3):
        model.train_on_batch(*batch)
    peak_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {"peak_over_built": (peak_first - built) / 1024, "step_peak": None}
    if _reset_peak():
        warm = _status_kib("VmRSS")
        for _ in range(args.mem_steps):
            model.train_on_batch(*batch)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["step_peak"] = (peak - warm) / 1024
        result["warm_over_built"] = (warm - built) / 1024
    result["types"] = gradient_types(inner)
    return result


# --- Parent ---


def _worker(args, kind, inner_name, variant=""):
    command = [sys.executable, "-m", "benchmarks.sparse_embedding", "--worker", kind,
               "--worker-inner", inner_name, "--worker-variant", variant]
    for name in ("vocab", "embed_dim", "width", "blocks", "seq", "batch", "steps",
                 "mem_steps", "threads", "variants"):
        command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if kind == "memory":
        # Every allocation from 64 KiB up gets pages of its own, returned on
        # free: resident memory follows the live buffers, not what glibc's
        # heaps kept of earlier steps (see the module docstring).
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise RuntimeError(f"worker {kind} {inner_name} {variant} failed")
    return json.loads(lines[-1].split(" ", 1)[1])


def measure(args, inner_name, log):
    began = time.perf_counter()
    timed = _worker(args, "timing", inner_name)
    log(f"  {inner_name}: step times done, {time.perf_counter() - began:.0f} s")
    variants = [v for v in timing_variants(args) if v != "stock_again"]
    samples = {v: [] for v in variants}
    shuffler = random.Random(0)
    for _ in range(args.mem_rounds):
        order = list(variants)
        shuffler.shuffle(order)
        for variant in order:
            samples[variant].append(_worker(args, "memory", inner_name, variant))
    log(f"  {inner_name}: memory done, {time.perf_counter() - began:.0f} s")
    memory = {}
    for variant, runs in samples.items():
        steps = [r["step_peak"] for r in runs if r["step_peak"] is not None]
        memory[variant] = {
            "peak_over_built": float(np.median([r["peak_over_built"] for r in runs])),
            "step_peak": float(np.median(steps)) if steps else None,
            "warm_over_built": float(np.median(
                [r.get("warm_over_built", np.nan) for r in runs])),
            "types": runs[0]["types"],
            "all": runs,
        }
    return {"timing": timed, "memory": memory}


def _ratio(value, reference):
    if value is None or not reference:
        return "n/a"
    return f"{value / reference:.2f}"


def markdown(results, args):
    dense_mib = args.vocab * args.embed_dim * 4 / 2**20
    lines = [
        f"Embedding {args.vocab} x {args.embed_dim} (dense gradient "
        f"{dense_mib:.0f} MiB in float32), {args.blocks} block(s) of width "
        f"{args.width}, batch {args.batch} x {args.seq} tokens, XLA, "
        f"mixed_float16; step time: medians of {args.steps} interleaved rounds; "
        f"memory: medians of {args.mem_rounds} fresh process(es) per variant, "
        f"step peak over {args.mem_steps} steps.",
        "",
        "| inner | variant | step time / stock | peak over built, MiB (/ stock) "
        "| resident after warm-up over built, MiB | step peak, MiB (/ stock) "
        "| embedding gradient at inner: apply / update_step |",
        "|---|---|---|---|---|---|---|",
    ]
    for inner_name, r in results.items():
        ratios, memory = r["timing"]["ratios"], r["memory"]
        stock = memory["stock"]
        for variant in ratios:
            if variant == "stock_again":
                lines.append(f"| {inner_name} | stock again (noise) "
                             f"| {ratios[variant]:.3f} | | | | |")
                continue
            m = memory[variant]
            step = ("n/a" if m["step_peak"] is None else
                    f"{m['step_peak']:.0f} ({_ratio(m['step_peak'], stock['step_peak'])})")
            lines.append(
                f"| {inner_name} | {variant} | {ratios[variant]:.3f} "
                f"| {m['peak_over_built']:.0f} "
                f"({_ratio(m['peak_over_built'], stock['peak_over_built'])}) "
                f"| {m['warm_over_built']:.0f} | {step} | {r['timing']['types'][variant]} |"
            )
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner", default="adam,sgd", help="adam,sgd or one of them")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--embed-dim", type=int, default=None,
                        help="embedding columns (default: --width; e.g. 1024)")
    parser.add_argument("--width", type=int, default=128, help="d_model")
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="interleaved timed rounds")
    parser.add_argument("--mem-rounds", type=int, default=1,
                        help="fresh processes per variant for memory")
    parser.add_argument("--mem-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="TensorFlow threads (0: default)")
    parser.add_argument("--variants", default="adaptive,dynamic",
                        help="besides stock (always, twice): adaptive,dynamic or one")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: Adam, adaptive only, width 64, 8 tokens x 4, "
                        "3 rounds")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-inner", help=argparse.SUPPRESS)
    parser.add_argument("--worker-variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and not args.worker:
        args.inner, args.variants = "adam", "adaptive"
        args.width, args.seq, args.batch = 64, 8, 4
        args.steps, args.mem_rounds, args.mem_steps = 3, 1, 2
    if args.embed_dim is None:
        args.embed_dim = args.width
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker == "timing":
        print("RESULT " + json.dumps(timing_worker(args, args.worker_inner)), flush=True)
        return
    if args.worker == "memory":
        print("RESULT " + json.dumps(
            memory_worker(args, args.worker_inner, args.worker_variant)), flush=True)
        return

    def log(text):
        print(text, file=sys.stderr, flush=True)

    began = time.perf_counter()
    results = {}
    for inner_name in args.inner.split(","):
        results[inner_name] = measure(args, inner_name, log)
    table = markdown(results, args)
    print(table)
    retraced = {k: r["timing"]["retraces"] for k, r in results.items() if r["timing"]["retraces"]}
    print(f"\nRetraces during timing: {retraced or 'none'}; "
          f"{time.perf_counter() - began:.0f} s in all.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
