"""Time a gather of m bytes per rank three ways on an emulated link: Horovod's allgather, the same
gather declared same-shape (``Allgather(same_shape=True)``: between two ranks an allreduce of its
bytes as int32 words, ``torch_ops.collectives.SummedGather``), and an allreduce of m bytes of
float32 for scale. Links are EMULATED (one network namespace per worker, tbf on both directions
of each worker's link, ``hvdcompress.bench.netns``; needs root).

    python benchmarks/gather_as_sum.py -n 2 -b 100mbit,1gbit --sizes-mb 1 4 12 \
        --json benchmarks/results/kernels/gather_as_sum.json

Prints, per link and size, the median seconds of each (over ``--repeats``, a barrier before
each) and ``m / rate``, the time one direction of the link needs for m bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

KINDS = ("allgather", "same_shape_gather", "allreduce_f32")


def worker(config_path: str) -> None:
    import torch
    import horovod.torch as hvd

    from torch_ops.collectives import Allgather, Allreduce, Communicator

    with open(config_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(cfg["threads"])
    hvd.init()
    comm = Communicator()
    out = {"world": hvd.size(), "seconds": {}}
    for mb in cfg["sizes_mb"]:
        m = int(mb * 1e6)
        payload = torch.full((m,), hvd.rank() + 1, dtype=torch.uint8)
        requests = {"allgather": lambda: Allgather(payload),
                    "same_shape_gather": lambda: Allgather(payload, same_shape=True),
                    "allreduce_f32": lambda: Allreduce(torch.ones(m // 4))}
        for kind in KINDS:
            times = []
            for i in range(cfg["warmup"] + cfg["repeats"]):
                comm.barrier()
                start = time.perf_counter()
                (result,) = comm.wait(comm.launch((requests[kind](),), f"g.{kind}.{mb}.{i}"))
                elapsed = time.perf_counter() - start
                if kind != "allreduce_f32":  # every rank's bytes, in rank order
                    assert result.numel() == hvd.size() * m and int(result[-1]) == hvd.size()
                if i >= cfg["warmup"]:
                    times.append(elapsed)
            out["seconds"][f"{kind}@{mb}"] = statistics.median(times)
    with open(cfg["out"].format(rank=hvd.rank()), "w") as f:
        json.dump(out, f)


def main(argv=None) -> dict:
    from hvdcompress.bench import netns
    from hvdcompress.bench.launch import Placement, run_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--workers", type=int, default=2)
    ap.add_argument("-b", "--bandwidths", default="100mbit,1gbit")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 12.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error(f"--workers: at least 2; got {args.workers}")
    load = os.getloadavg()[0]
    report = {"workers": args.workers, "load_average_at_start": load, "links": {}}
    for bw in args.bandwidths.split(","):
        bps = netns.parse_bandwidth(bw)
        with netns.EmulatedNetwork(args.workers, bps, "gas") as net:
            results = run_workers(Placement.in_network(net),
                                  {"threads": 1, "sizes_mb": args.sizes_mb, "repeats": args.repeats,
                                   "warmup": args.warmup},
                                  os.path.join("/tmp", f"gather_as_sum-{os.getpid()}"), 900,
                                  worker_argv=[os.path.abspath(__file__), "--worker"])
        seconds = {k: max(r["seconds"][k] for r in results) for k in results[0]["seconds"]}  # the slowest rank
        report["links"][bw] = seconds
        print(f"{args.workers} workers, {bw} (EMULATED), load average {load:.2f} at the start")
        print(f"{'MB/rank':>8} {'m/rate':>8} " + " ".join(f"{k:>18}" for k in KINDS))
        for mb in args.sizes_mb:
            ideal = mb * 1e6 * 8 / bps if bps else float("nan")
            print(f"{mb:8g} {ideal:8.3f} " + " ".join(f"{seconds[f'{k}@{mb}']:18.3f}" for k in KINDS))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
