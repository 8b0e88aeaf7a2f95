"""Encode + decode time of every compressor against one memory pass, optionally side by side with
GRACE's torch compressors, in one run (PyTorch CPU, one thread).

    python benchmarks/codec_speed.py                                   # 100K .. 25M entries
    python benchmarks/codec_speed.py --grace /tmp/grace                # with GRACE's compressors
    python benchmarks/codec_speed.py --paths compiled torch --sizes 1e7   # the torch-only branch too
    python benchmarks/codec_speed.py --quick                           # a smoke test (seconds)

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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvdcompress import parse_spec  # noqa: E402
from torch_ops.compressors import ExchangeContext, build_compressor, native  # noqa: E402

SPECS = ["signsgd", "efsignsgd", "onebit", "terngrad", "qsgd:levels=127,bucket=512", "qsgd",
         "topk:ratio=0.001", "dgc:ratio=0.001", "randomk:ratio=0.001", "sketch:ratio=0.001", "fp16"]
SIZES = [1e5, 1e6, 1e7, 2.5e7]
TARGETS = {"signsgd": 3, "efsignsgd": 3, "onebit": 3, "terngrad": 4, "qsgd": 4, "sketch": 10}


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


def run_ours(comp, x: torch.Tensor, state, step: int) -> float:
    """Seconds of one exchange on a world of one rank (every round answered with its input)."""
    ctx = ExchangeContext("bench.w", step, 1, 1.0, state, (x.numel(),), 0)
    t0 = time.perf_counter()
    gen = comp.exchange(x, ctx)
    reqs = next(gen)
    while True:
        try:
            reqs = gen.send(tuple(r.tensor for r in reqs))
        except StopIteration:
            return time.perf_counter() - t0


def run_grace(comp, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    compressed, ctx = comp.compress(x, "bench.w")
    comp.decompress(compressed, ctx)
    return time.perf_counter() - t0


def one_pass(x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    y = x * 1.0
    dt = time.perf_counter() - t0
    del y
    return dt


def _target(spec: str):
    return TARGETS.get(spec.split(":")[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=SIZES)
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--paths", nargs="+", default=["compiled"], choices=["compiled", "torch"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grace", default=None, help="a checkout of github.com/sands-lab/grace to compare with")
    p.add_argument("--json", default="benchmarks/results/kernels/codec_speed.json")
    p.add_argument("--quick", action="store_true", help="smoke test: 100K and 1M entries, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = [1e5, 1e6], 2
    torch.set_num_threads(args.threads)
    grace = load_grace(args.grace, args.specs) if args.grace else {}
    if "compiled" in args.paths and native.lib() is None:
        print("note: the compiled kernels are not loaded (no compiler?): 'compiled' runs the pure paths")
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
                    dt = run_ours(comps[k], x, states[k], rep)
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
            row = {"size": size, "spec": s, "path": path, "ms": ms, "passes": ms / (passes * 1e3),
                   "target_passes": t, "grace_ms": g, "one_pass_ms": passes * 1e3,
                   "target_met": (ms / (passes * 1e3) <= t) if t else None,
                   "faster_than_grace": (ms < g) if g is not None else None}
            rows.append(row)
            print(f"{s:28s} {path:9s} {ms:9.2f} {row['passes']:7.2f} {(str(t) if t else '-'):>7s} "
                  f"{(f'{g:9.2f}' if g is not None else '        -')} "
                  f"{(f'{g / ms:8.2f}x' if g is not None else '        -')}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_avg_1min": load,
           "compiled_kernels": native.lib() is not None, "grace": args.grace,
           "command": "python " + " ".join(["benchmarks/codec_speed.py"] + (argv if argv is not None else sys.argv[1:])),
           "one_pass_ms": {str(k): v * 1e3 for k, v in baselines.items()}, "rows": rows}
    print(f"\nload average (1 min): {load}; compiled kernels: {native.lib() is not None}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
