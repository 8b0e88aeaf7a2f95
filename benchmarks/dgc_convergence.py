"""Convergence of DGC vs dense vs plain top-k, with an ablation of DGC's four techniques.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/dgc_convergence.py --dataset mnist1d

Every configuration trains the same model from the same initialisation, per seed, inside one
Horovod job (2 Gloo workers); rank 0 prints a markdown table (final test accuracy per seed and
their mean, bytes per step) and writes the figures as JSON. Configurations (``--configs``):

    dense          no compression
    dgc            DGC at 0.1% density: momentum correction, local clipping, momentum factor
                   masking, 4 warm-up epochs (25% -> 6.3% -> 1.6% -> 0.4% -> 0.1%)
    topk           plain top-k 0.1% with error feedback; the optimizer applies momentum after the
                   exchange (no DGC technique)
    dgc-no-<x>     DGC with one technique switched off: correction, clipping, masking, warmup
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import hvdcompress.torch as hvc
from hvdcompress.datasets import load
from hvdcompress.bench.example_models import for_dataset

RATIO = 0.001


def configs(clip_norm: float):
    dgc = f"dgc:ratio={RATIO},clip_norm={clip_norm}"
    return {
        "dense": "none",
        "dgc": dgc,
        "topk": f"topk:ratio={RATIO}",
        "dgc-no-correction": dgc + ",momentum_correction=false",
        "dgc-no-clipping": f"dgc:ratio={RATIO}",
        "dgc-no-masking": dgc + ",momentum_masking=false",
        "dgc-no-warmup": dgc + ",warmup_epochs=0",
    }


def train_one(spec: str, data, args, seed: int) -> dict:
    rank, size = hvc.rank(), hvc.size()
    torch.manual_seed(seed)
    model = for_dataset(args.dataset)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                   schedule=args.schedule)
    x_tr = torch.from_numpy(data.x_train)[rank::size]
    y_tr = torch.from_numpy(data.y_train)[rank::size]
    steps = len(data.x_train) // size // args.batch_size
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    for epoch in range(args.epochs):
        opt.set_epoch(epoch)
        perm = torch.randperm(len(x_tr), generator=gen)
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(data.x_test)).argmax(1).numpy() == data.y_test).mean()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvc.allgather(flat.unsqueeze(0), name=f"check.{spec}.{seed}")
    stats = opt.stats.as_dict()
    return {"accuracy": float(acc), "bytes_per_step": stats["bytes_per_step"],
            "dense_bytes_per_step": stats["dense_bytes_per_step"],
            "identical": all(torch.equal(rows[0], r) for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["digits", "mnist1d"], default="mnist1d")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", help="subset of configurations (default: all)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-norm", type=float, default=2.0, help="DGC's clip_norm (before the 1/sqrt(N) scaling)")
    p.add_argument("--schedule", default="layerwise",
                   help="merge schedule (DistributedOptimizer(schedule=...)); default layerwise: every tensor is "
                        "sparsified on its own, as in the DGC paper and as the published figures were measured "
                        "(the optimizer's own default, auto, merges tensors into cost-model groups)")
    p.add_argument("--out", default="benchmarks/results/dgc_convergence_{dataset}.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    all_configs = configs(args.clip_norm)
    chosen = args.configs or list(all_configs)
    for name in chosen:
        if name not in all_configs:
            p.error(f"--configs: unknown configuration {name!r}; accepted: {', '.join(all_configs)}")
    hvc.init()
    data = load(args.dataset)
    results = {}
    for name in chosen:
        per_seed = []
        for seed in args.seeds:
            start = time.perf_counter()
            r = train_one(all_configs[name], data, args, seed)
            r["seconds"] = time.perf_counter() - start
            per_seed.append(r)
            if hvc.rank() == 0:
                print(f"{name:20s} seed {seed}: accuracy {r['accuracy']:.4f}  "
                      f"{r['bytes_per_step']:.0f} B/step  ({r['seconds']:.0f} s)", flush=True)
        accs = [r["accuracy"] for r in per_seed]
        results[name] = {"spec": all_configs[name], "runs": per_seed, "mean_accuracy": float(np.mean(accs)),
                         "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in per_seed])),
                         "dense_bytes_per_step": per_seed[0]["dense_bytes_per_step"],
                         "identical": all(r["identical"] for r in per_seed)}
    if hvc.rank() == 0:
        dense_acc = results.get("dense", {}).get("mean_accuracy")
        print(f"\n{args.dataset}, {hvc.size()} workers, {args.epochs} epochs, seeds {args.seeds}\n")
        print("| configuration | accuracy per seed | mean | vs dense (pp) | bytes/step per worker | smaller than dense |")
        print("|---|---|---|---|---|---|")
        for name, r in results.items():
            accs = ", ".join(f"{x['accuracy']:.4f}" for x in r["runs"])
            delta = "" if dense_acc is None else f"{100 * (r['mean_accuracy'] - dense_acc):+.2f}"
            print(f"| {name} | {accs} | {r['mean_accuracy']:.4f} | {delta} | {r['bytes_per_step']:.0f} | "
                  f"{r['dense_bytes_per_step'] / r['bytes_per_step']:.1f}x |")
        out = args.out.format(dataset=args.dataset)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"dataset": args.dataset, "world_size": hvc.size(), "args": vars(args),
                       "results": results}, f, indent=2)
        print(f"\nwrote {out}")
    hvc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
