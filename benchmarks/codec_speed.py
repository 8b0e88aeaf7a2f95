"""Encode + decode time of every compressor against one memory pass, optionally side by side with
GRACE's torch compressors, in one run (CPU, one thread; PyTorch, or TensorFlow with ``--framework tf``).

    python benchmarks/codec_speed.py                                   # 100K .. 25M entries
    python benchmarks/codec_speed.py --grace /tmp/grace                # with GRACE's compressors
    python benchmarks/codec_speed.py --paths compiled torch --sizes 1e7   # the torch-only branch too
    python benchmarks/codec_speed.py --quick                           # a smoke test (seconds)
    python benchmarks/codec_speed.py --framework tf --paths compiled pure --modes eager graph
    python benchmarks/codec_speed.py --framework tf --ops               # TF ops per traced exchange

Each spec's exchange runs on a world of one rank (the collective returns its input), so the time
is this rank's own work: error feedback, encode (scales, rounding, packing), and decode + sum of
the gathered payload (every round, for the multi-round sketch and PowerSGD), with the state
(residuals, momenta) carried from repeat to repeat as in training. ``memory passes`` is that
time over one ``x * 1.0`` (a read and a write of the tensor, into a new tensor) timed in the same
repeat. Paths: ``compiled`` is what a CPU run takes (the compiled kernels, numpy views);
``torch`` forces the torch-only branch that CUDA tensors take (``native.set_torch_only``).

GRACE (github.com/sands-lab/grace) is not a dependency and none of its code is in this project:
``--grace DIR`` imports ``grace_dl.torch.compressor`` from a checkout at DIR at run time and times
``compress`` then ``decompress`` of its compressor for the same spec (its qsgd has no buckets: one
norm per tensor; it sends a byte per sign or ternary code and keeps no residual; its memories are
not timed). Specs without a GRACE counterpart show "-".

TensorFlow (``--framework tf``): the same exchanges of ``tf_ops.compressors`` on a ``tf.constant``,
with state in ``tf.Variable`` s, eagerly (``eager``: op by op) and inside ``tf.function`` (``graph``:
traced once at the warm-up repeat, then called with the step as a tensor -- what Keras runs); the
memory pass is ``x * one`` timed the same way (in graph mode ``one`` is an argument, so Grappler
cannot fold the product away). Paths: ``compiled`` (the shared kernels through
``tf.numpy_function`` on CPU), ``pure`` (TF ops only: ``hvdcompress.native.set_enabled(False)``).
``--ops`` instead counts the operations of one traced exchange on ``--world`` ranks (a gather
answered with copies of the rank's own payload), of one tensor and of a merged group of
``--members`` tensors, per spec and path.

DGC exchanges 1-D tensors dense, so its spec is timed on a (1, n) tensor, past its warm-up (at
its ratio); every other spec on a 1-D tensor (``onebit``: one column).

Everything alternates within each repeat on the same tensor; the table shows medians. Targets
(from the project's issue) are printed next to the ratio: signsgd/efsignsgd/onebit <= 3 passes,
terngrad/qsgd <= 4, sketch <= 10, at 10M and 25M entries.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvdcompress import native, parse_spec  # noqa: E402
from hvdcompress.contract import Member  # noqa: E402

SPECS = ["signsgd", "efsignsgd", "onebit", "terngrad", "qsgd:levels=127,bucket=512", "qsgd",
         "topk:ratio=0.001", "dgc:ratio=0.001", "randomk:ratio=0.001", "sketch:ratio=0.001", "fp16"]
SIZES = [1e5, 1e6, 1e7, 2.5e7]
TARGETS = {"signsgd": 3, "efsignsgd": 3, "onebit": 3, "terngrad": 4, "qsgd": 4, "sketch": 10}
PAST_WARMUP = 10 ** 6  # an epoch after any warm-up: ratio-based specs run at their ratio


def bench_shape(spec_text: str, n: int):
    """The tensor shape a spec is timed on: (1, n) for DGC (it exchanges 1-D tensors dense), else (n,)."""
    return (1, n) if parse_spec(spec_text).name == "dgc" else (n,)


def grace_factory(spec_text: str):
    """(module, class name, constructor kwargs) of GRACE's compressor for a spec, or None."""
    spec = parse_spec(spec_text)
    p = spec.params
    table = {
        "none": ("none", "NoneCompressor", {}),
        "fp16": ("fp16", "FP16Compressor", {}),
        "signsgd": ("signsgd", "SignSGDCompressor", {}),
        "efsignsgd": ("efsignsgd", "EFSignSGDCompressor", {"lr": 0.1}),
        "onebit": ("onebit", "OneBitCompressor", {}),
        "terngrad": ("terngrad", "TernGradCompressor", {}),
        "qsgd": ("qsgd", "QSGDCompressor", {"quantum_num": p.get("levels", 7)}),
        "topk": ("topk", "TopKCompressor", {"compress_ratio": p.get("ratio")}),
        "dgc": ("dgc", "DgcCompressor", {"compress_ratio": p.get("ratio")}),
        "randomk": ("randomk", "RandomKCompressor", {"compress_ratio": p.get("ratio")}),
        "threshold": ("threshold", "ThresholdCompressor", {"threshold": p.get("threshold")}),
    }
    return table.get(spec.name)


def load_grace(path: str, specs):
    """GRACE's compressor instances by spec, imported from the checkout at ``path``."""
    if not os.path.isdir(os.path.join(path, "grace_dl", "torch")):
        raise SystemExit(f"--grace: {path} holds no grace_dl/torch (a checkout of github.com/sands-lab/grace)")
    sys.path.insert(0, os.path.abspath(path))
    out = {}
    for s in specs:
        f = grace_factory(s)
        if f is None:
            continue
        mod = importlib.import_module(f"grace_dl.torch.compressor.{f[0]}")
        out[s] = getattr(mod, f[1])(**f[2])
    return out


def _drive(gen, world: int = 1, concat=None):
    """Runs an exchange on a world of one rank: every round is answered with its input. With
    ``world`` > 1 (op counts only) a gather is answered with ``world`` copies of its input
    (``concat``), as if every rank had sent the same."""
    from hvdcompress.contract import Allgather

    reqs = next(gen)
    while True:
        answer = tuple(concat([r.tensor] * world) if world > 1 and isinstance(r, Allgather) else r.tensor
                       for r in reqs)
        try:
            reqs = gen.send(answer)
        except StopIteration as stop:
            return stop.value


def run_ours(comp, x, state, step: int, shape) -> float:
    """Seconds of one exchange on a world of one rank (every round answered with its input)."""
    from torch_ops.compressors import ExchangeContext

    ctx = ExchangeContext("bench.w", step, 1, 1.0, state, shape, PAST_WARMUP)
    t0 = time.perf_counter()
    _drive(comp.exchange(x, ctx))
    return time.perf_counter() - t0


def run_grace(comp, x) -> float:
    t0 = time.perf_counter()
    compressed, ctx = comp.compress(x, "bench.w")
    comp.decompress(compressed, ctx)
    return time.perf_counter() - t0


def one_pass(x) -> float:
    t0 = time.perf_counter()
    y = x * 1.0
    dt = time.perf_counter() - t0
    del y
    return dt


def _target(spec: str):
    return TARGETS.get(spec.split(":")[0])


def _row(size, s, path, ms, passes_ms, grace_ms=None, mode=None):
    t = _target(s)
    row = {"size": size, "spec": s, "path": path, "ms": ms, "passes": ms / passes_ms, "target_passes": t,
           "grace_ms": grace_ms, "one_pass_ms": passes_ms, "target_met": (ms / passes_ms <= t) if t else None,
           "faster_than_grace": (ms < grace_ms) if grace_ms is not None else None}
    if mode is not None:
        row["mode"] = mode
    return row


def torch_main(args, argv) -> dict:
    import torch
    from torch_ops.compressors import build_compressor

    torch.set_num_threads(args.threads)
    grace = load_grace(args.grace, args.specs) if args.grace else {}
    gen = torch.Generator().manual_seed(0)
    rows, baselines = [], {}
    for size in map(int, args.sizes):
        x = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)
        names = [(s, path) for path in args.paths for s in args.specs]
        comps = {k: build_compressor(parse_spec(k[0])) for k in names}
        states = {k: {} for k in names}
        times = {k: [] for k in names}
        gtimes = {s: [] for s in grace}
        base = []
        for rep in range(args.repeats + 1):  # repeat 0 warms up (allocations, state, caches)
            dt = one_pass(x)
            if rep:
                base.append(dt)
            for k in names:
                native.set_torch_only(k[1] == "torch")
                try:
                    dt = run_ours(comps[k], x, states[k], rep, bench_shape(k[0], size))
                finally:
                    native.set_torch_only(False)
                if rep:
                    times[k].append(dt)
            for s, comp in grace.items():
                dt = run_grace(comp, x)
                if rep:
                    gtimes[s].append(dt)
        passes = statistics.median(base)
        baselines[size] = passes
        print(f"\n{size:,} float32 entries, {args.threads} thread(s); one memory pass (x * 1.0): {passes * 1e3:.2f} ms")
        print(f"{'spec':28s} {'path':9s} {'ms':>9s} {'passes':>7s} {'target':>7s} {'GRACE ms':>9s} {'vs GRACE':>9s}")
        for k in names:
            s, path = k
            ms = statistics.median(times[k]) * 1e3
            g = statistics.median(gtimes[s]) * 1e3 if s in gtimes else None
            t = _target(s)
            row = _row(size, s, path, ms, passes * 1e3, g)
            rows.append(row)
            print(f"{s:28s} {path:9s} {ms:9.2f} {row['passes']:7.2f} {(str(t) if t else '-'):>7s} "
                  f"{(f'{g:9.2f}' if g is not None else '        -')} "
                  f"{(f'{g / ms:8.2f}x' if g is not None else '        -')}")
    return {"torch": torch.__version__, "grace": args.grace, "one_pass_ms": {str(k): v * 1e3 for k, v in baselines.items()},
            "rows": rows}


# -- TensorFlow ------------------------------------------------------------------------------------
def _tf_setup(threads: int):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


class TFExchange:
    """One spec's exchange on a world of one rank, eager or traced, with its state variables."""

    def __init__(self, spec_text: str, shape, mode: str, members=(), world: int = 1):
        import tensorflow as tf
        from tf_ops.compressors import ExchangeContext, build_compressor

        self.comp = comp = build_compressor(parse_spec(spec_text))
        self.shape, self.mode, self.members = tuple(shape), mode, tuple(members)
        self.state = comp.new_state(self.shape, tf.float32)
        self.density = comp.scheduled_density(PAST_WARMUP) if comp.has_schedule else None

        def exchange(x, step, density):
            ctx = ExchangeContext("bench.w", step, world, 1.0 / world, self.state, self.shape, PAST_WARMUP,
                                  members=self.members, density=density)
            return _drive(comp.exchange(x, ctx), world, lambda ts: tf.concat(ts, 0))

        self.fn = tf.function(exchange) if mode == "graph" else exchange

    def args(self, step: int):
        import tensorflow as tf

        if self.mode == "eager":
            return step, None
        density = None if self.density is None else tf.constant(self.density, tf.float64)
        return tf.constant(step, tf.int64), density

    def __call__(self, x, step: int) -> float:
        s, d = self.args(step)
        t0 = time.perf_counter()
        self.fn(x, s, d)
        return time.perf_counter() - t0

    def op_count(self, n: int) -> int:
        """Operations of the traced exchange (graph mode)."""
        import tensorflow as tf

        density = None if self.density is None else tf.TensorSpec([], tf.float64)
        fn = self.fn if self.mode == "graph" else tf.function(self.fn)
        graph = fn.get_concrete_function(tf.TensorSpec([n], tf.float32), tf.TensorSpec([], tf.int64), density).graph
        return len(graph.get_operations())


def _set_path(path: str) -> None:
    native.set_enabled(path == "compiled")


def merged_members(n: int, count: int):
    """``count`` members tiling n entries: matrices, vectors and a few biases of odd sizes."""
    sizes, left = [], n
    for i in range(count - 1):
        take = max(1, left // (count - i) + (7 if i % 3 == 0 else -5))
        take = min(take, left - (count - 1 - i))
        sizes.append(take)
        left -= take
    sizes.append(left)
    out, off = [], 0
    for i, sz in enumerate(sizes):
        shape = (sz // 8, 8) if i % 2 == 0 and sz % 8 == 0 and sz >= 16 else (sz,)
        out.append(Member(f"m{i}", shape, off))
        off += sz
    return tuple(out)


def tf_ops_main(args) -> dict:
    """Ops per traced exchange, per spec and path: one tensor, and a merged group."""
    _tf_setup(args.threads)
    n = int(args.sizes[0])
    members = merged_members(n, args.members)
    rows = []
    print(f"TF ops per traced exchange on {args.world} ranks: one tensor of {n:,} entries; a merged group of "
          f"{len(members)} members")
    print(f"{'spec':28s} {'path':9s} {'one tensor':>11s} {'merged':>8s}")
    for s in args.specs:
        for path in args.paths:
            _set_path(path)
            try:
                one = TFExchange(s, bench_shape(s, n), "graph", world=args.world).op_count(n)
                info = parse_spec(s).info
                merged = None
                if info.merge != "layerwise":
                    shape = (n,) if all(len(m.shape) == 1 for m in members) else (1, n)
                    merged = TFExchange(s, shape, "graph", members, args.world).op_count(n)
            finally:
                native.set_enabled(True)
            rows.append({"spec": s, "path": path, "numel": n, "members": len(members), "world": args.world, "ops": one,
                         "ops_merged": merged})
            print(f"{s:28s} {path:9s} {one:11d} {('-' if merged is None else str(merged)):>8s}")
    return {"ops_rows": rows}


def tf_main(args) -> dict:
    tf = _tf_setup(args.threads)
    import numpy as np

    rng = np.random.default_rng(0)
    rows, baselines = [], {}
    one = tf.constant(1.0)
    graph_pass = tf.function(lambda x, c: x * c)
    for size in map(int, args.sizes):
        x = tf.constant((rng.standard_normal(size) * rng.random(size)).astype(np.float32))
        names = [(s, path, mode) for mode in args.modes for path in args.paths for s in args.specs]
        runs = {k: TFExchange(k[0], bench_shape(k[0], size), k[2]) for k in names}
        times = {k: [] for k in names}
        base = {m: [] for m in args.modes}
        for rep in range(args.repeats + 1):  # repeat 0 warms up (tracing, state, caches)
            for m in args.modes:
                t0 = time.perf_counter()
                y = x * 1.0 if m == "eager" else graph_pass(x, one)
                dt = time.perf_counter() - t0
                del y
                if rep:
                    base[m].append(dt)
            for k in names:
                _set_path(k[1])
                try:
                    dt = runs[k](x, rep)
                finally:
                    native.set_enabled(True)
                if rep:
                    times[k].append(dt)
        passes = {m: statistics.median(base[m]) for m in args.modes}
        baselines[size] = passes
        print(f"\n{size:,} float32 entries, {args.threads} thread(s); one memory pass (x * 1.0): "
              + ", ".join(f"{m} {v * 1e3:.2f} ms" for m, v in passes.items()))
        print(f"{'spec':28s} {'path':9s} {'mode':6s} {'ms':>9s} {'passes':>7s} {'target':>7s}")
        for k in names:
            s, path, mode = k
            ms = statistics.median(times[k]) * 1e3
            row = _row(size, s, path, ms, passes[mode] * 1e3, mode=mode)
            rows.append(row)
            t = _target(s)
            print(f"{s:28s} {path:9s} {mode:6s} {ms:9.2f} {row['passes']:7.2f} {(str(t) if t else '-'):>7s}")
    return {"tensorflow": tf.__version__,
            "one_pass_ms": {str(k): {m: v * 1e3 for m, v in d.items()} for k, d in baselines.items()}, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=["torch", "tf"], default="torch")
    p.add_argument("--sizes", type=float, nargs="+", default=SIZES)
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--paths", nargs="+", default=None, choices=["compiled", "torch", "pure"],
                   help="torch: compiled, torch (default compiled); tf: compiled, pure (default both)")
    p.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"], help="tf only")
    p.add_argument("--ops", action="store_true", help="tf: count the ops of one traced exchange instead of timing")
    p.add_argument("--members", type=int, default=16, help="tf --ops: members of the merged group")
    p.add_argument("--world", type=int, default=2, help="tf --ops: ranks the traced exchange decodes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grace", default=None, help="a checkout of github.com/sands-lab/grace to compare with")
    p.add_argument("--json", default=None, help="default: benchmarks/results/kernels/codec_speed[_tf].json")
    p.add_argument("--quick", action="store_true", help="smoke test: 100K and 1M entries, 2 repeats")
    args = p.parse_args(argv)
    tf = args.framework == "tf"
    if args.paths is None:
        args.paths = ["compiled", "pure"] if tf else ["compiled"]
    allowed = {"compiled", "pure"} if tf else {"compiled", "torch"}
    if not set(args.paths) <= allowed:
        p.error(f"--paths: {args.framework} takes {sorted(allowed)}")
    if tf and args.grace:
        p.error("--grace: GRACE's compressors are timed with --framework torch")
    if args.json is None:
        args.json = "benchmarks/results/kernels/" + ("codec_speed_tf_ops.json" if args.ops else
                                                      "codec_speed_tf.json" if tf else "codec_speed.json")
    if args.quick:
        args.sizes, args.repeats = ([1e5] if args.ops else [1e5, 1e6]), 2
    if "compiled" in args.paths and native.lib() is None:
        print("note: the compiled kernels are not loaded (no compiler?): 'compiled' runs the pure paths")
    if args.ops:
        if not tf:
            p.error("--ops counts TF ops: use it with --framework tf")
        result = tf_ops_main(args)
    else:
        result = tf_main(args) if tf else torch_main(args, argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = {"framework": args.framework, "threads": args.threads, "repeats": args.repeats,
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_avg_1min": load,
           "compiled_kernels": native.lib() is not None,
           "command": "python " + " ".join(["benchmarks/codec_speed.py"] + (argv if argv is not None else sys.argv[1:])),
           **result}
    print(f"\nload average (1 min): {load}; compiled kernels: {native.lib() is not None}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
