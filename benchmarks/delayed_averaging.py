"""Delayed gradient averaging, measured: step time under injected latency, and accuracy.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/delayed_averaging.py latency
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/delayed_averaging.py accuracy --dataset digits

``latency``: a 1.9M-parameter MLP (synthetic batches, one torch thread per worker) trained with
``DistributedOptimizer(delay=D)`` while every exchange round completes no sooner than ``L`` ms
after it was launched (``LatencyTransport``: the latency is INJECTED in the worker process, not
emulated on the network; transport is loopback). One exchange per step (``schedule="single"``).
For each compression, latency and delay: the median step time over the timed steps, next to the
compute-only step (the wrapped optimizer without any exchange) measured in the same run.

``accuracy``: the examples' digits CNN (or the mnist1d MLP) trained for ``--epochs`` with SGD
(momentum 0.9) under each (delay, sync_every), every configuration from the same initialisation,
per seed (every D of ``--delay`` at K = 1, every K > 1 of ``--sync-every`` at each D of
``--k-delays``); test accuracy after ``flush()``, mean over seeds, and whether the replicas ended
identical. The step time on an EMULATED network (namespaces + tbf, 4 workers) is measured by
``benchmarks/delayed_network.py``. Rank 0 prints a markdown table and writes JSON (and a PNG for ``latency``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdcompress.torch as hvc
from hvdcompress.bench.example_models import for_dataset
from hvdcompress.bench.injected_latency import LatencyTransport
from hvdcompress.datasets import load
from torch_ops.collectives import Communicator


def _ints(text):
    return [int(v) for v in str(text).split(",") if v.strip()]


def _floats(text):
    return [float(v) for v in str(text).split(",") if v.strip()]


# -- step time under latency ---------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _time_steps(model, opt, steps, warmup, batch):
    gen = torch.Generator().manual_seed(hvc.rank())
    x = torch.randn(batch, 784, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    # the slowest rank's median: a step ends when every rank has its update
    med = torch.tensor([statistics.median(times)], dtype=torch.float64)
    return float(hvc.allreduce(med, op=hvc.Sum, name="bench.med").item() / hvc.size()), \
        float(hvc.allgather(med, name="bench.max").max().item())


def run_latency(args) -> dict:
    rows = []
    model = _mlp()
    plain = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compute, _ = _time_steps(model, plain, args.steps, args.warmup, args.batch)
    for spec in args.compression:
        for latency in args.latency_ms:
            for delay in args.delay:
                model = _mlp()
                transport = LatencyTransport(latency / 1000.0) if latency > 0 else Communicator()
                opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                               named_parameters=model.named_parameters(), compression=spec,
                                               schedule="single", delay=delay, transport=transport)
                mean_med, max_med = _time_steps(model, opt, args.steps, args.warmup, args.batch)
                opt.flush()
                row = {"compression": spec, "latency_ms_injected": latency, "delay": delay,
                       "step_ms": mean_med * 1e3, "step_ms_slowest_rank": max_med * 1e3,
                       "compute_only_ms": compute * 1e3, "x_compute_only": mean_med / compute,
                       "bytes_per_step": opt.stats.as_dict()["bytes_per_step"]}
                rows.append(row)
                if hvc.rank() == 0:
                    print(f"{spec:>18} L={latency:>5.0f} ms D={delay}: {row['step_ms']:.1f} ms/step "
                          f"({row['x_compute_only']:.2f}x compute-only)", flush=True)
    return {"compute_only_ms": compute * 1e3, "rows": rows}


def latency_table(result) -> str:
    rows = result["rows"]
    delays = sorted({r["delay"] for r in rows})
    out = [f"compute only: {result['compute_only_ms']:.1f} ms/step (latency INJECTED per exchange round)", "",
           "| compression | injected latency (ms) | " + " | ".join(f"D={d} (ms, x compute)" for d in delays) + " |",
           "|---|---|" + "---|" * len(delays)]
    for spec in dict.fromkeys(r["compression"] for r in rows):
        for lat in dict.fromkeys(r["latency_ms_injected"] for r in rows):
            cells = []
            for d in delays:
                r = next(r for r in rows if r["compression"] == spec and r["latency_ms_injected"] == lat and r["delay"] == d)
                cells.append(f"{r['step_ms']:.1f} ({r['x_compute_only']:.2f}x)")
            out.append(f"| `{spec}` | {lat:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def latency_plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    specs = list(dict.fromkeys(r["compression"] for r in rows))
    fig, axes = plt.subplots(1, len(specs), figsize=(5.5 * len(specs), 4), squeeze=False)
    for ax, spec in zip(axes[0], specs):
        for d in sorted({r["delay"] for r in rows}):
            pts = sorted((r["latency_ms_injected"], r["step_ms"]) for r in rows if r["compression"] == spec and r["delay"] == d)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"delay={d}")
        ax.axhline(result["compute_only_ms"], color="gray", ls="--", label="compute only")
        ax.set_xlabel("latency injected per exchange round (ms)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{spec}, {hvc.size()} workers")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- accuracy -------------------------------------------------------------------------------------
def train_one(spec, delay, every, data, args, seed) -> dict:
    rank, size = hvc.rank(), hvc.size()
    torch.manual_seed(seed)
    model = for_dataset(args.dataset)
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule="layerwise", delay=delay, sync_every=every)
    x_tr = torch.from_numpy(data.x_train)[rank::size]
    y_tr = torch.from_numpy(data.y_train)[rank::size]
    steps = len(data.x_train) // size // args.batch_size
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_tr), generator=gen)
        opt.set_epoch(epoch)
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
    opt.flush()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvc.allgather(flat.unsqueeze(0), name="final.params")
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(data.x_test)).argmax(1) == torch.from_numpy(data.y_test)).float().mean().item()
    return {"accuracy": acc, "identical": bool(all(torch.equal(rows[0], r) for r in rows)),
            "bytes_per_step": opt.stats.as_dict()["bytes_per_step"]}


def run_accuracy(args, partial=None) -> dict:
    data = load(args.dataset)
    configs = [(spec, d, 1) for spec in args.compression for d in args.delay] + \
              [(spec, d, k) for spec in args.compression for d in args.k_delays for k in args.sync_every if k > 1]
    rows = []
    for spec, d, k in configs:
        per_seed = [train_one(spec, d, k, data, args, seed) for seed in args.seeds]
        row = {"compression": spec, "delay": d, "sync_every": k,
               "accuracy": [r["accuracy"] for r in per_seed],
               "mean_accuracy": float(np.mean([r["accuracy"] for r in per_seed])),
               "identical_after_flush": all(r["identical"] for r in per_seed),
               "bytes_per_step": per_seed[0]["bytes_per_step"]}
        rows.append(row)
        if hvc.rank() == 0:
            print(f"{spec:>16} D={d} K={k}: {row['mean_accuracy']:.4f} {row['accuracy']}", flush=True)
            if partial:  # an interrupted sweep keeps what it measured
                with open(partial, "w") as f:
                    json.dump({"rows": rows, "partial": True, "argv": sys.argv[1:], "workers": hvc.size(),
                               "dataset": args.dataset}, f, indent=2)
    return {"rows": rows}


def accuracy_table(result) -> str:
    rows = result["rows"]
    out = ["| compression | delay D | sync_every K | test accuracy (mean) | per seed | vs D=0,K=1 (pp) | "
           "identical after flush | bytes/step |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b for b in rows if b["compression"] == r["compression"] and b["delay"] == 0
                     and b["sync_every"] == 1), None)
        vs = f"{100 * (r['mean_accuracy'] - base['mean_accuracy']):+.2f}" if base else "-"
        out.append(f"| `{r['compression']}` | {r['delay']} | {r['sync_every']} | {r['mean_accuracy']:.4f} | "
                   f"{', '.join(f'{a:.4f}' for a in r['accuracy'])} | {vs} | {r['identical_after_flush']} | "
                   f"{r['bytes_per_step']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["latency", "accuracy"])
    p.add_argument("--compression", nargs="+", default=None)
    p.add_argument("--delay", type=_ints, default=None)
    p.add_argument("--latency-ms", type=_floats, default=[0, 50, 100, 200, 300])
    p.add_argument("--sync-every", type=_ints, default=[1, 2, 4])
    p.add_argument("--k-delays", type=_ints, default=[0],
                   help="accuracy: the delays at which every --sync-every K > 1 is trained (the delays of "
                        "--delay are trained at K = 1)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dataset", default="digits", choices=["digits", "mnist1d"])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9, help="accuracy: SGD momentum (DGC takes it over)")
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_start, started = os.getloadavg(), time.time()
    hvc.init()
    if args.what == "latency":
        args.compression = args.compression or ["none", "topk:ratio=0.001"]
        args.delay = args.delay or [0, 1, 2, 4, 8]
        result, table = None, None
        result = run_latency(args)
        table = latency_table(result)
        out = args.out or f"benchmarks/results/across-the-world/delayed-latency-{hvc.size()}workers"
    else:
        args.compression = args.compression or ["none"]
        args.delay = args.delay or [0, 1, 2, 4, 8]
        out = args.out or f"benchmarks/results/across-the-world/delayed-accuracy-{args.dataset}-{hvc.size()}workers"
        result = run_accuracy(args, partial=out + ".json")
        table = accuracy_table(result)
    if hvc.rank() == 0:
        result.update({"argv": sys.argv[1:], "workers": hvc.size(), "torch_threads": 1,
                       "dataset": args.dataset if args.what == "accuracy" else None,
                       "load_average": os.getloadavg(), "load_average_at_start": load_start,
                       "seconds": time.time() - started,
                       "conditions": "2-core machine shared with other jobs; Gloo over loopback"})
        print(table)
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        with open(out + ".md", "w") as f:
            f.write(table + "\n")
        if args.what == "latency":
            latency_plot(result, out + ".png")
    hvc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
