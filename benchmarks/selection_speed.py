"""Selection and compression speed against the memory limit, side by side in one run (torch, CPU).

    python benchmarks/selection_speed.py       # 1K, 100K, 1M, 10M, 25M float32 x densities 0.1%, 1%

Columns, all on the same tensor, alternating within every repeat (median of ``--repeats``):

    torch.topk    ``torch.topk(a.abs(), k, sorted=False)`` -- unordered, no tie rule
    topk (ours)   ``topk_indices``: the oracle's exact set (ties to the lower index), ascending,
                  with the compiled kernels (``hvdcompress/native``)
    topk (pure)   the same call on the pure numpy/torch path (kernels switched off)
    DGC select    ``sampled_threshold_select`` (sample ratio 0.01, 4 adaptations)
    a.max()       one read of a: the memory floor of any selection
    a.abs().max() one pass that also writes |a| (the baseline quoted in issue 11)
    EF top-k step the error-feedback top-k compression (``topk:residual=true`` up to its send):
                  a = g + r, selection, values, zeroing of the sent entries in the residual
                  (compiled: a = g + r and the candidate scan in one pass)
    EF pure       the same on the pure path (a = g + r, then the chunked numpy scan)
    DGC step      DGC's compression (``DGCCompressor.exchange`` up to its send): u = m*u + g,
                  v += u, sampled selection, values, zeroing of v[I] and u[I] (compiled: the
                  update, DGC's sample and a self-tightening candidate list in one pass, then
                  the rule on the sample and the candidates, one loop to take and zero the sent
                  entries)
    DGC pure      the same on the pure path (chunked torch update, then a numpy scan of v)
    (g,u,v) pass  ``v.addcmul_(u, g)``: one read of g, u, v and one write of v -- the floor of a
                  step that must read g and update u and v

Single-threaded by default (``--threads``) so the figures do not depend on what else the machine
does with its other cores. Tiny tensors run each call many times per repeat (per-call times are
reported). Writes the rows to ``--out`` (JSON).
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

from hvdcompress import parse_spec
from hvdcompress.sampling import sample_offset, sample_stride
from hvdcompress.spec import num_selected
from torch_ops.compressors import ExchangeContext, build_compressor, native
from torch_ops.compressors.dgc_selection import sampled_threshold_select
from torch_ops.compressors.selection import topk_indices

COLUMNS = ["torch_topk", "topk", "topk_pure", "dgc_select", "read", "abs_max", "ef_topk_step", "ef_topk_step_pure",
           "dgc_step", "dgc_step_pure", "guv_pass"]
HEAD = ["torch.topk", "topk (ours)", "topk (pure)", "DGC select", "a.max()", "a.abs().max()", "EF top-k step",
        "EF pure", "DGC step", "DGC pure", "(g,u,v) pass"]


def _pure(fn):
    """``fn`` run on the pure numpy/torch path (compiled kernels switched off for the call)."""
    def call():
        native.set_enabled(False)
        try:
            return fn()
        finally:
            native.set_enabled(True)
    return call


def _first_round(comp, x, ctx):
    """Run an exchange up to its first send (the compression step) and return that round."""
    return next(comp.exchange(x, ctx))


def bench(size: int, density: float, repeats: int, gen: torch.Generator):
    a = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)  # gradient-like spread
    g = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)
    u0, v0, w = torch.zeros(size), torch.zeros(size), torch.randn(size, generator=gen)
    k = num_selected(density, size)
    dgc = build_compressor(parse_spec(f"dgc:ratio={density},warmup_epochs=0,min_sparse_numel=1"))
    ef = build_compressor(parse_spec(f"topk:ratio={density},residual=true"))
    dgc_state, ef_state = {"u": u0, "v": v0}, {}
    inner = max(1, min(1000, 200_000 // size))  # calls per timing sample for tiny tensors
    step = [0]

    def dgc_step():
        step[0] += 1
        ctx = ExchangeContext("w", step[0], 2, 0.5, dgc_state, (1, size))
        return _first_round(dgc, g, ctx)

    def ef_step():
        return _first_round(ef, g, ExchangeContext("w", step[0], 2, 0.5, ef_state, (1, size)))

    fns = {
        "torch_topk": lambda: torch.topk(a.abs(), k, sorted=False),
        "topk": lambda: topk_indices(a, k),
        "topk_pure": _pure(lambda: topk_indices(a, k)),
        "dgc_select": lambda: sampled_threshold_select(
            a, k, 0.01, 4, sample_offset(sample_stride(0.01), size, 0, step[0], "bench")),
        "read": lambda: a.max(),
        "abs_max": lambda: a.abs().max(),
        "ef_topk_step": ef_step,
        "ef_topk_step_pure": _pure(ef_step),
        "dgc_step": dgc_step,
        "dgc_step_pure": _pure(dgc_step),
        "guv_pass": lambda: w.addcmul_(u0, g),
    }
    times = {c: [] for c in COLUMNS}
    selected = []
    for rep in range(repeats + 1):
        for c in COLUMNS:
            t0 = time.perf_counter()
            for _ in range(inner):
                out = fns[c]()
            dt = (time.perf_counter() - t0) / inner
            if rep:  # the first round warms caches, the allocator and the scratch buffers
                times[c].append(dt)
            if c in ("dgc_step", "dgc_step_pure") and rep:
                selected.append(out[1].tensor.numel())
    row = {"numel": size, "density": density, "k": k, "inner_calls": inner}
    row.update({f"{c}_s": statistics.median(times[c]) for c in COLUMNS})
    row["topk_speedup"] = row["torch_topk_s"] / row["topk_s"]
    row["topk_x_read"] = row["topk_s"] / row["read_s"]
    row["topk_pure_speedup"] = row["torch_topk_s"] / row["topk_pure_s"]
    row["dgc_step_x_pass"] = row["dgc_step_s"] / row["guv_pass_s"]
    row["dgc_step_pure_x_pass"] = row["dgc_step_pure_s"] / row["guv_pass_s"]
    row["ef_topk_step_x_pass"] = row["ef_topk_step_s"] / row["guv_pass_s"]
    row["ef_topk_step_pure_x_pass"] = row["ef_topk_step_pure_s"] / row["guv_pass_s"]
    row["dgc_selected_median"] = statistics.median(selected)
    return row


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 1e-3 else f"{s * 1e3:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e3, 1e4, 1e5, 1e6, 1e7, 2.5e7])
    p.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/kernels/selection_speed.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    load_start = os.getloadavg()
    rows = []
    for size in map(int, args.sizes):
        for density in args.densities:
            row = bench(size, density, args.repeats, gen)
            rows.append(row)
            print(f"numel {size:>10,} density {density:.1%}: torch.topk {_ms(row['torch_topk_s'])} ms, "
                  f"topk {_ms(row['topk_s'])} ms ({row['topk_speedup']:.1f}x), DGC step "
                  f"{_ms(row['dgc_step_s'])} ms ({row['dgc_step_x_pass']:.2f}x of a (g,u,v) pass)", flush=True)
    load_end = os.getloadavg()
    print(f"\ntorch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} repeats, "
          f"milliseconds per call; compiled kernels: {native.lib() is not None}; load average (1 min) "
          f"{load_start[0]:.1f} at start, {load_end[0]:.1f} at end\n")
    print("| elements | density | k | " + " | ".join(HEAD) + " | topk speed-up (pure) | topk / a.max() "
          "| EF step / pass (pure) | DGC step / pass (pure) |")
    print("|---" * (len(HEAD) + 7) + "|")
    for r in rows:
        cells = " | ".join(_ms(r[f"{c}_s"]) for c in COLUMNS)
        print(f"| {r['numel']:,} | {r['density']:.1%} | {r['k']:,} | {cells} | {r['topk_speedup']:.1f}x "
              f"({r['topk_pure_speedup']:.1f}x) | {r['topk_x_read']:.1f}x | {r['ef_topk_step_x_pass']:.2f}x "
              f"({r['ef_topk_step_pure_x_pass']:.2f}x) | {r['dgc_step_x_pass']:.2f}x ({r['dgc_step_pure_x_pass']:.2f}x) |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
                   "machine": platform.processor() or platform.machine(), "unit": "seconds per call",
                   "compiled_kernels": native.lib() is not None,
                   "load_average_1_5_15_at_start": list(load_start), "load_average_1_5_15_at_end": list(load_end),
                   "columns": dict(zip(COLUMNS, HEAD)), "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
