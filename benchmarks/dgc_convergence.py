"""Convergence of DGC vs dense vs plain top-k, each at its own best learning rate, with an ablation.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/dgc_convergence.py --dataset mnist1d

One Horovod job (2 Gloo workers) trains every configuration from the same initialisation per
seed. First the *sweep*: each method of ``--methods`` at every rate of ``--lrs`` (mean of
``--seeds``); each method's best rate is the one with the highest mean test accuracy. Then the
*ablation*: DGC with one technique switched off (or changed), at DGC's best rate. Rank 0 prints
markdown tables (best-vs-best, the whole sweep, the ablation) and writes everything as JSON.

    dense          no compression
    dgc            DGC at 0.1% density: momentum correction, local clipping (``--clip-scope``,
                   default global: the paper's whole-gradient norm), momentum factor masking,
                   4 warm-up epochs (25% -> 6.3% -> 1.6% -> 0.4% -> 0.1%)
    topk           plain top-k 0.1% with error feedback; the optimizer applies momentum after the
                   exchange (no DGC technique)
    dgc-no-<x>     (ablation) DGC with one technique off: correction, clipping, masking, warmup
    dgc-other-clip-scope   (ablation) clipping by the other scope (tensor <-> global)
    dgc-min-sparse-1       (ablation) min_sparse_numel=1: every multi-dimensional tensor sparsified,
                   as the paper does (the default sends tensors under 1024 entries dense); 1-D
                   tensors (biases) stay dense, as in the paper's reference code

Learning rate (the paper's recipe, optional): ``--lr-warmup-epochs W`` ramps the rate linearly,
per step, from lr/N to lr over W epochs (Goyal et al., as the DGC reference code does); then
``--lr-schedule`` cosine (to 0 at the end, as the reference code's configs) or step (x0.1 at 50%
and 75% of the remaining epochs, the paper's CIFAR recipe), or constant.

For DGC with global clipping the run also measures the price of clipping with the previous step's
norm: after each backward it computes the coefficient exact whole-gradient clipping would have used
(this step's local norm) next to the one used (the previous step's), and reports how often each
clipped and how far apart they were.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import hvdcompress.torch as hvc
from hvdcompress.clipping import clip_coefficient
from hvdcompress.datasets import load
from hvdcompress.bench.example_models import for_dataset

RATIO = 0.001
METHODS = ("dense", "dgc", "topk")
ABLATION = ("dgc-no-correction", "dgc-no-clipping", "dgc-no-masking", "dgc-no-warmup", "dgc-other-clip-scope",
            "dgc-min-sparse-1")


def configs(clip_norm: float, scope: str):
    other = "tensor" if scope == "global" else "global"
    base = f"dgc:ratio={RATIO}"
    dgc = f"{base},clip_norm={clip_norm},clip_scope={scope}"
    return {
        "dense": "none",
        "dgc": dgc,
        "topk": f"topk:ratio={RATIO}",
        "dgc-no-correction": dgc + ",momentum_correction=false",
        "dgc-no-clipping": base,
        "dgc-no-masking": dgc + ",momentum_masking=false",
        "dgc-no-warmup": dgc + ",warmup_epochs=0",
        "dgc-other-clip-scope": f"{base},clip_norm={clip_norm},clip_scope={other}",
        "dgc-min-sparse-1": dgc + ",min_sparse_numel=1",
    }


def lr_at(args, lr: float, step: int, steps_per_epoch: int, world: int) -> float:
    """The learning rate at ``step`` (module doc: linear warm-up from lr/N, then the schedule)."""
    warm = args.lr_warmup_epochs * steps_per_epoch
    if step < warm:
        return lr * (1 + step * (world - 1) / warm) / world
    total = args.epochs * steps_per_epoch - warm
    t = (step - warm) / max(total, 1)
    if args.lr_schedule == "cosine":
        return lr * 0.5 * (1 + math.cos(math.pi * t))
    if args.lr_schedule == "step":
        return lr * (0.01 if t >= 0.75 else 0.1 if t >= 0.5 else 1.0)
    return lr


def train_one(spec: str, data, args, seed: int, lr: float) -> dict:
    rank, size = hvc.rank(), hvc.size()
    torch.manual_seed(seed)
    model = for_dataset(args.dataset)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay)
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                   schedule=args.schedule)
    x_tr = torch.from_numpy(data.x_train)[rank::size]
    y_tr = torch.from_numpy(data.y_train)[rank::size]
    steps = len(data.x_train) // size // args.batch_size
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    clip = opt.compression.params.get("clip_norm") if opt.compression.name == "dgc" else None
    measure_clip = clip is not None and opt.compression["clip_scope"] == "global"
    coefs = []  # (exact: this step's norm, used: the previous step's)
    prev_norm, step = None, 0
    for epoch in range(args.epochs):
        opt.set_epoch(epoch)
        perm = torch.randperm(len(x_tr), generator=gen)
        for i in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(args, lr, step, steps, size)
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            if measure_clip:  # .grad still holds the local gradient until step() synchronizes
                norm = math.sqrt(math.fsum(float(torch.sum(p.grad.double() ** 2)) for p in model.parameters()))
                coefs.append((clip_coefficient(norm, clip, size) or 1.0,
                              clip_coefficient(prev_norm, clip, size) or 1.0))
                prev_norm = norm
            opt.step()
            step += 1
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(data.x_test)).argmax(1).numpy() == data.y_test).mean()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvc.allgather(flat.unsqueeze(0), name=f"check.{spec}.{seed}.{lr}")
    stats = opt.stats.as_dict()
    out = {"accuracy": float(acc), "bytes_per_step": stats["bytes_per_step"],
           "dense_bytes_per_step": stats["dense_bytes_per_step"],
           "identical": all(torch.equal(rows[0], r) for r in rows)}
    if coefs:
        exact, used = np.array(coefs).T
        rel = np.abs(used / exact - 1)
        out["clip_lag"] = {"steps": len(coefs), "clipped_exact": float(np.mean(exact < 1)),
                           "clipped_used": float(np.mean(used < 1)),
                           "rel_diff_median": float(np.median(rel)), "rel_diff_p95": float(np.quantile(rel, 0.95)),
                           "rel_diff_max": float(rel.max())}
    return out


def run_config(name: str, spec: str, data, args, lr: float, seeds) -> dict:
    per_seed = []
    for seed in seeds:
        start = time.perf_counter()
        r = train_one(spec, data, args, seed, lr)
        r["seconds"] = time.perf_counter() - start
        per_seed.append(r)
        if hvc.rank() == 0:
            print(f"{name:22s} lr {lr:<6g} seed {seed}: accuracy {r['accuracy']:.4f}  "
                  f"{r['bytes_per_step']:.0f} B/step  ({r['seconds']:.0f} s)", flush=True)
    accs = [r["accuracy"] for r in per_seed]
    out = {"spec": spec, "lr": lr, "runs": per_seed, "mean_accuracy": float(np.mean(accs)),
           "std_accuracy": float(np.std(accs)),
           "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in per_seed])),
           "dense_bytes_per_step": per_seed[0]["dense_bytes_per_step"],
           "identical": all(r["identical"] for r in per_seed)}
    lags = [r["clip_lag"] for r in per_seed if "clip_lag" in r]
    if lags:
        out["clip_lag"] = {k: float(np.mean([x[k] for x in lags])) for k in lags[0]}
    return out


def _row(name: str, r: dict, ref) -> str:
    accs = ", ".join(f"{x['accuracy']:.4f}" for x in r["runs"])
    delta = "" if ref is None else f"{100 * (r['mean_accuracy'] - ref):+.2f}"
    return (f"| {name} | {r['lr']:g} | {accs} | {r['mean_accuracy']:.4f} | {delta} | {r['bytes_per_step']:.0f} | "
            f"{r['dense_bytes_per_step'] / r['bytes_per_step']:.1f}x |")


def report(args, sweep, best, ablation) -> None:
    head = ("| configuration | lr | accuracy per seed | mean | vs dense at its best (pp) | bytes/step per worker "
            "| smaller than dense |\n|---|---|---|---|---|---|---|")
    dense = best.get("dense", {}).get("mean_accuracy")
    print(f"\n{args.dataset}, {hvc.size()} workers, {args.epochs} epochs, seeds {args.seeds}, lrs {args.lrs}, "
          f"lr warm-up {args.lr_warmup_epochs} epochs, schedule {args.lr_schedule}, weight decay {args.weight_decay}")
    print("\nBest vs best (each method at its own best rate):\n\n" + head)
    for name, r in best.items():
        print(_row(name, r, dense))
    print("\nThe sweep (mean accuracy):\n\n| method | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " |")
    print("|---|" + "---|" * len(args.lrs))
    for name, per_lr in sweep.items():
        print(f"| {name} | " + " | ".join(f"{per_lr[str(lr)]['mean_accuracy']:.4f}" if str(lr) in per_lr else "not run"
                                         for lr in args.lrs) + " |")
    if ablation:
        print(f"\nAblation at DGC's best rate ({best['dgc']['lr']:g}), seeds {args.ablation_seeds or args.seeds}:\n\n"
              + head)
        print(_row("dgc", best["dgc"], dense))
        for name, r in ablation.items():
            print(_row(name, r, dense))
    lags = {n: r["clip_lag"] for n, r in [("dgc", best.get("dgc", {}))] + list(ablation.items()) if "clip_lag" in r}
    for name, lag in lags.items():
        print(f"\nclip lag ({name}): steps clipped, exact {100 * lag['clipped_exact']:.1f}%, previous-step norm "
              f"{100 * lag['clipped_used']:.1f}%; |used/exact - 1| median {lag['rel_diff_median']:.3g}, "
              f"p95 {lag['rel_diff_p95']:.3g}, max {lag['rel_diff_max']:.3g}")


SAME = ("dataset", "seeds", "epochs", "batch_size", "lr_warmup_epochs", "lr_schedule", "weight_decay", "schedule")


def _earlier(out: str, args) -> dict:
    """--resume: the sweep entries of an earlier run of ``out`` with the same training settings."""
    try:
        with open(out) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    same = all(old["args"].get(k) == getattr(args, k) for k in SAME)
    return old.get("sweep", {}) if same else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["digits", "mnist1d"], default="mnist1d")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lrs", type=float, nargs="+", default=[0.025, 0.05, 0.1, 0.2],
                   help="learning rates of the sweep (SGD, momentum 0.9)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), help="configurations swept over --lrs")
    p.add_argument("--method-lrs", nargs="*", default=[], metavar="METHOD=LR,LR",
                   help="a smaller sweep for one method (e.g. topk=0.1,0.2), to fit a time budget")
    p.add_argument("--ablation", nargs="*", default=list(ABLATION),
                   help="configurations run at DGC's best rate (none: no ablation)")
    p.add_argument("--ablation-seeds", type=int, nargs="+", help="seeds of the ablation (default: --seeds)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr-warmup-epochs", type=int, default=0, help="linear warm-up from lr/N to lr, per step")
    p.add_argument("--lr-schedule", choices=["constant", "cosine", "step"], default="constant")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-norm", type=float, default=2.0, help="DGC's clip_norm (before the 1/sqrt(N) scaling)")
    p.add_argument("--clip-scope", choices=["global", "tensor"], default="global",
                   help="DGC's clip_scope (global: the paper's whole-gradient clipping)")
    p.add_argument("--schedule", default="layerwise",
                   help="merge schedule (DistributedOptimizer(schedule=...)); default layerwise: every tensor is "
                        "sparsified on its own, as in the DGC paper (the optimizer's own default, auto, merges "
                        "tensors into cost-model groups)")
    p.add_argument("--out", default="benchmarks/results/accuracy/dgc_convergence_{dataset}.json")
    p.add_argument("--resume", action="store_true",
                   help="reuse the sweep entries of --out measured with the same spec, seeds and training settings")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    all_configs = configs(args.clip_norm, args.clip_scope)
    for name in args.methods + args.ablation:
        if name not in all_configs:
            p.error(f"unknown configuration {name!r}; accepted: {', '.join(all_configs)}")
    if args.ablation and "dgc" not in args.methods:
        p.error("--ablation runs at DGC's best rate: --methods must include dgc")
    method_lrs = {}
    for item in args.method_lrs:
        name, _, lrs = item.partition("=")
        if name not in args.methods or not lrs:
            p.error(f"--method-lrs: expected METHOD=LR,LR with METHOD in --methods; got {item!r}")
        method_lrs[name] = [float(x) for x in lrs.split(",")]
    hvc.init()
    data = load(args.dataset)
    started = time.time()
    sweep, best, ablation = {}, {}, {}
    out = args.out.format(dataset=args.dataset)

    def save(complete: bool) -> None:  # after every configuration: a cut-off run keeps what it measured
        if hvc.rank() == 0:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "w") as f:
                json.dump({"dataset": args.dataset, "world_size": hvc.size(), "args": vars(args), "complete": complete,
                           "seconds": time.time() - started, "best": best, "sweep": sweep, "ablation": ablation},
                          f, indent=2)

    earlier = _earlier(out, args) if args.resume else {}
    for name in args.methods:
        sweep[name] = {}
        for lr in method_lrs.get(name, args.lrs):
            old = earlier.get(name, {}).get(str(lr))
            if old is not None and old["spec"] == all_configs[name] and len(old["runs"]) == len(args.seeds):
                sweep[name][str(lr)] = dict(old, reused=True)
                continue
            sweep[name][str(lr)] = run_config(name, all_configs[name], data, args, lr, args.seeds)
            save(False)
        # the best rate: highest mean accuracy; a tie goes to the smaller rate
        best[name] = max(sweep[name].values(), key=lambda r: (r["mean_accuracy"], -r["lr"]))
    for name in args.ablation:
        ablation[name] = run_config(name, all_configs[name], data, args, best["dgc"]["lr"],
                                   args.ablation_seeds or args.seeds)
        save(False)
    save(True)
    if hvc.rank() == 0:
        report(args, sweep, best, ablation)
        print(f"\nwrote {out}")
    hvc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
