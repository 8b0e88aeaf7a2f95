"""Encode + decode time of the quantizers and PowerSGD (PyTorch), side by side in one run.

    python benchmarks/quantizer_speed.py          # 1M and 25M float32 entries, single thread

Each compressor's exchange runs in a world of one rank (the collective returns its input), so the
time is this rank's own work: encode (everything before the first collective: error feedback,
scales, stochastic rounding, packing) and decode (after it: unpacking, decoding, the sum; for
PowerSGD the orthogonalisation and the second product too). Compressors alternate within each
repeat on the same tensor; the table shows medians, next to a one-pass baseline (``x * 1.0``, one
read and one write of the tensor) and the bits per entry really put on the wire. PowerSGD sees
the tensor as a square matrix (1000 x 1000, 5000 x 5000).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvdcompress import parse_spec  # noqa: E402
from torch_ops.compressors import ExchangeContext, build_compressor  # noqa: E402

SPECS = ["none", "fp16", "signsgd", "efsignsgd", "onebit", "terngrad", "qsgd:levels=7,bucket=512",
         "qsgd:levels=1,bucket=0", "powersgd:rank=2"]


def run_once(comp, x: torch.Tensor, shape, state, step: int):
    """(encode seconds, decode seconds, bytes sent) of one exchange on a world of one rank."""
    ctx = ExchangeContext("bench.w", step, 1, 1.0, state, shape, 0)
    t0 = time.perf_counter()
    gen = comp.exchange(x, ctx)
    reqs = next(gen)
    t1 = time.perf_counter()
    sent = sum(r.tensor.numel() * r.tensor.element_size() for r in reqs)
    encode, decode = t1 - t0, 0.0
    while True:
        t2 = time.perf_counter()
        try:
            reqs = gen.send(tuple(r.tensor for r in reqs))  # world of one: sum = gather = the input
        except StopIteration:
            decode += time.perf_counter() - t2
            return encode, decode, sent
        decode += time.perf_counter() - t2
        sent += sum(r.tensor.numel() * r.tensor.element_size() for r in reqs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 2.5e7])
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/kernels/quantizer_speed.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for size in map(int, args.sizes):
        side = int(math.isqrt(size))
        x = torch.randn(side * side, generator=gen) * torch.rand(side * side, generator=gen)
        n = x.numel()
        comps = {s: build_compressor(parse_spec(s)) for s in args.specs}
        states = {s: {} for s in args.specs}
        times = {s: ([], []) for s in args.specs}
        base, sent = [], {}
        for rep in range(args.repeats + 1):  # the first round warms up (allocations, state)
            t = time.perf_counter()
            y = x * 1.0
            dt = time.perf_counter() - t
            del y
            if rep:
                base.append(dt)
            for s in args.specs:
                shape = (side, side) if s.startswith("powersgd") else (n,)
                enc, dec, sent[s] = run_once(comps[s], x, shape, states[s], rep)
                if rep:
                    times[s][0].append(enc)
                    times[s][1].append(dec)
        one_pass = statistics.median(base)
        print(f"\n{n:,} entries (one pass x*1.0: {one_pass * 1e3:.1f} ms)")
        print(f"{'spec':28s} {'bits/entry':>10s} {'encode ms':>10s} {'decode ms':>10s} {'total ms':>10s} {'x pass':>7s}")
        for s in args.specs:
            enc, dec = statistics.median(times[s][0]), statistics.median(times[s][1])
            row = {"size": n, "spec": s, "bits_per_entry": sent[s] * 8 / n, "bytes": sent[s],
                   "encode_s": enc, "decode_s": dec, "total_s": enc + dec, "one_pass_s": one_pass,
                   "passes": (enc + dec) / one_pass}
            rows.append(row)
            print(f"{s:28s} {row['bits_per_entry']:10.4f} {enc * 1e3:10.1f} {dec * 1e3:10.1f} "
                  f"{(enc + dec) * 1e3:10.1f} {row['passes']:7.1f}")
    out = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
           "machine": platform.processor() or platform.machine(), "command": "python " + " ".join(
               ["benchmarks/quantizer_speed.py"] + (argv if argv is not None else sys.argv[1:])),
           "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
