"""Speed of Sketched-SGD's compute side vs top-k selections, side by side in one run (PyTorch CPU).

    python benchmarks/sketch_speed.py               # 1M and 25M float32, r = 5, ratio 1%

For each size, on the same gradient-like tensor, alternating, ``--repeats`` times (median shown):

    max pass     v.abs().max(): one read of the tensor, the floor for anything that looks at it
    torch.topk   exact top-k of |v| (k = ratio * d), unsorted
    DGC sampled  ``torch_ops.compressors.dgc_selection.sampled_threshold_select`` (sample 1%)
    hash tables  the r rows' tabulation tables (LOW: 65536, HIGH: d/65536 entries), built from
                 scratch (the optimizer's exchanges find them in a cache after the first step)
    sketch       building the r x c count sketch of v (hashes computed per chunk; round 1 payload)
    estimate     the median-of-rows estimate of every coordinate from a table
    candidates   the P*k largest |estimate| (``topk_indices``, ties to the lower index)
    sketch total tables + sketch + estimate + candidates (what a worker computes besides the two
                 allreduces)

The torch table and estimates are checked bit for bit against the numpy oracle at the first size.

``--phases`` times instead the phases of one exchange on the compiled kernels (what a CPU run
takes; ``hvdcompress.native.sketch``), with the state carried from repeat to repeat, in units of
one memory pass (``x * 1.0``, as ``codec_speed.py``), alternating in every repeat:

    python benchmarks/sketch_speed.py --phases --sizes 1e7 2.5e7 --spec sketch:ratio=0.001

    update+sketch  u = m*u + g; v = v + u; the r x c table (round 1's payload)
    candidates     the P*k largest |estimate| from the summed table
    second round   v at the candidates, the k largest of the summed values, u = v = 0 there
    result         the dense result (zeros, the k values set)

Single-threaded by default (``--threads``), so the figures do not depend on the other core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from hvdcompress.hashing import row_keys
from hvdcompress.reference import sketch as ref
from hvdcompress.reference.sketch import geometry
from hvdcompress.sampling import sample_offset, sample_stride
from hvdcompress.spec import parse_spec
from torch_ops.compressors import sketch as sk
from torch_ops.compressors.dgc_selection import sampled_threshold_select
from torch_ops.compressors.selection import topk_indices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 2.5e7])
    p.add_argument("--spec", default="sketch:ratio=0.01,rows=5,cols_ratio=0.02,p2=4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=sk.CHUNK, help="entries per chunk (whole 65536-entry blocks)")
    p.add_argument("--phases", action="store_true", help="the compiled kernels' phases of one exchange, in passes")
    p.add_argument("--out", default=None, help="default: benchmarks/results/kernels/sketch_speed[_phases].json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.phases:
        return phases(args)
    args.out = args.out or "benchmarks/results/kernels/sketch_speed.json"
    spec = parse_spec(args.spec)
    gen = torch.Generator().manual_seed(0)
    rows = []
    load_before = os.getloadavg()
    for size in map(int, args.sizes):
        v = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)  # gradient-like spread
        geo = geometry(spec.params, size)
        keys = row_keys(spec["seed"], "bench", geo.rows)
        hashes = sk.Hashes(keys, size, geo.cols, chunk=args.chunk)
        table = sk.sketch_table(v, keys, geo.cols, hashes=hashes)
        est = sk.estimates(table, keys, size, hashes=hashes)
        if size == int(args.sizes[0]):  # the same bits as the oracle
            assert np.array_equal(table.numpy(), ref.sketch_table(v.numpy(), keys, geo.cols))
            assert np.array_equal(est.abs().numpy(), np.abs(ref.estimates(table.numpy(), keys, size)))
        steps = {
            "max pass": lambda: v.abs().max(),
            "torch.topk": lambda: torch.topk(v.abs(), geo.k, sorted=False),
            "DGC sampled": lambda: sampled_threshold_select(v, geo.k, 0.01, 4,
                                                            sample_offset(sample_stride(0.01), size, 0, 0, "b")),
            "hash tables": lambda: (sk._table_cache.clear(), sk.Hashes(keys, size, geo.cols, chunk=args.chunk)),
            "sketch": lambda: sk.sketch_table(v, keys, geo.cols, hashes=hashes),
            "estimate": lambda: sk.estimates(table, keys, size, hashes=hashes),
            "candidates": lambda: topk_indices(est, geo.candidates),
        }
        times = {name: [] for name in steps}
        for rep in range(args.repeats + 1):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                if rep:  # the first round warms caches and the allocator
                    times[name].append(time.perf_counter() - t0)
        row = {"numel": size, "k": geo.k, "rows": geo.rows, "cols": geo.cols, "candidates": geo.candidates,
               "wire_floats": geo.rows * geo.cols + geo.candidates,
               "seconds": {name: statistics.median(t) for name, t in times.items()}}
        row["seconds"]["sketch total"] = sum(row["seconds"][n] for n in ("hash tables", "sketch", "estimate",
                                                                          "candidates"))
        rows.append(row)
        print(f"numel {size:>11,}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in row["seconds"].items()),
              flush=True)
    names = list(rows[0]["seconds"])
    print(f"\n{spec}; torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats}\n")
    print("| elements | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        base = r["seconds"]["max pass"]
        print(f"| {r['numel'] / 1e6:g}M | " + " | ".join(f"{r['seconds'][n] * 1e3:.1f} ms ({r['seconds'][n] / base:.0f}x)"
                                                       for n in names) + " |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"spec": str(spec), "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
                   "machine": platform.processor() or platform.machine(), "chunk": args.chunk,
                   "hash": "simple tabulation (2 x 16-bit characters) + odd multiply + multiply-shift to 2c signed cells",
                   "oracle_bits_equal_at": int(args.sizes[0]),
                   "load_average_before": load_before, "load_average_after": os.getloadavg(),
                   "note": "(Nx) = multiples of one max pass over the tensor", "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


def phases(args) -> int:
    """The compiled path's phases of one exchange (``--phases``), in memory passes."""
    spec = parse_spec(args.spec)
    gen = torch.Generator().manual_seed(0)
    out, load_before = [], os.getloadavg()
    for size in map(int, args.sizes):
        x = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)
        u, v = torch.zeros_like(x), torch.zeros_like(x)
        geo = geometry(spec.params, size)
        if geo.dense:
            raise SystemExit(f"{spec} exchanges {size} entries dense: no sketch to time")
        keys = row_keys(spec["seed"], "bench.w", geo.rows)
        fast = sk.Native.plan(x, u, v, keys, geo.rows, geo.cols)
        if fast is None:
            raise SystemExit("the compiled kernels are not loaded (no compiler, or HVDCOMPRESS_NATIVE=0)")
        times = {n: [] for n in ("one pass", "update+sketch", "candidates", "second round", "result")}
        for rep in range(args.repeats + 1):  # repeat 0 warms up
            t = {}
            t0 = time.perf_counter()
            y = x * 1.0
            t["one pass"] = time.perf_counter() - t0
            del y
            t0 = time.perf_counter()
            table = fast.update_sketch(x, u, v, spec["momentum"])
            t["update+sketch"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            cand = fast.candidates(table, size, geo.candidates)
            t["candidates"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            w = v[cand]
            pos = topk_indices(w, geo.k)
            sel = cand[pos]
            u[sel] = 0
            v[sel] = 0
            t["second round"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            total = torch.zeros_like(v)
            total[sel] = w[pos]
            t["result"] = time.perf_counter() - t0
            del total
            if rep:
                for name, dt in t.items():
                    times[name].append(dt)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = med["one pass"]
        total = sum(s for name, s in med.items() if name != "one pass")
        print(f"\n{size:,} float32 entries, {args.threads} thread(s), median of {args.repeats}; "
              f"one memory pass (x * 1.0): {base * 1e3:.2f} ms")
        for name, s in list(med.items())[1:] + [("total", total)]:
            print(f"  {name:14s} {s * 1e3:9.2f} ms {s / base:6.2f} passes")
        out.append({"numel": size, "k": geo.k, "rows": geo.rows, "cols": geo.cols, "candidates": geo.candidates,
                    "seconds": med, "total_seconds": total, "passes": {n: s / base for n, s in med.items()},
                    "total_passes": total / base})
    path = args.out or "benchmarks/results/kernels/sketch_speed_phases.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"spec": str(spec), "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
                   "machine": platform.processor() or platform.machine(), "load_average_before": load_before,
                   "load_average_after": os.getloadavg(), "rows": out}, f, indent=2)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
