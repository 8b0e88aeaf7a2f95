"""Speed of DGC's sampled-threshold selection vs exact ``torch.topk``, side by side in one run.

    python benchmarks/selection_speed.py            # 1M, 10M, 25M float32 x densities 0.1%, 1%

For each size and density both selections run on the same tensor, alternating, ``--repeats``
times; the table shows the median seconds of each and their ratio, and the number of entries the
sampled threshold selected (it aims at 0.8k..1.3k). Single-threaded by default (``--threads``) so
the figures do not depend on what else the machine is doing with its other core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from hvdcompress.sampling import sample_offset, sample_stride
from hvdcompress.spec import num_selected
from torch_ops.compressors.selection import sampled_threshold_select


def exact(v: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(v.abs(), k, sorted=False).indices


def sampled(v: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    return sampled_threshold_select(v, k, 0.01, 4, offset)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7])
    p.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/selection_speed.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for size in map(int, args.sizes):
        v = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)  # gradient-like spread
        for density in args.densities:
            k = num_selected(density, size)
            times = {"exact": [], "sampled": []}
            selected = []
            for rep in range(args.repeats + 1):
                offset = sample_offset(sample_stride(0.01), size, 0, rep, "bench")
                t0 = time.perf_counter()
                exact(v, k)
                t1 = time.perf_counter()
                idx = sampled(v, k, offset)
                t2 = time.perf_counter()
                if rep:  # the first round warms caches and allocator
                    times["exact"].append(t1 - t0)
                    times["sampled"].append(t2 - t1)
                    selected.append(idx.numel())
            row = {"numel": size, "density": density, "k": k,
                   "exact_s": statistics.median(times["exact"]),
                   "sampled_s": statistics.median(times["sampled"]),
                   "selected_median": statistics.median(selected)}
            row["speedup"] = row["exact_s"] / row["sampled_s"]
            rows.append(row)
            print(f"numel {size:>10,} density {density:.3%}: exact {row['exact_s'] * 1e3:8.1f} ms, "
                  f"sampled {row['sampled_s'] * 1e3:7.1f} ms, {row['speedup']:5.1f}x", flush=True)
    print(f"\ntorch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} repeats\n")
    print("| elements | density | k | exact torch.topk | sampled threshold | speed-up | selected |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['numel'] / 1e6:g}M | {r['density']:.1%} | {r['k']:,} | {r['exact_s'] * 1e3:.1f} ms | "
              f"{r['sampled_s'] * 1e3:.1f} ms | {r['speedup']:.1f}x | {r['selected_median']:,.0f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
                   "machine": platform.processor() or platform.machine(), "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
