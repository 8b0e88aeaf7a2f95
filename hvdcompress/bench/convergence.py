"""Accuracy runs for the convergence benchmarks: train an example model under Horovod with one
compression spec, and choose each method's learning rate from a small sweep.

Used by ``benchmarks/fidelity.py``; the loop is the one of ``benchmarks/dgc_convergence.py``
(SGD with momentum, every rank on its own shard ``rank::size`` of the training set, a per-rank
shuffle, ``opt.set_epoch`` at every epoch) with the learning rate, schedule and momentum as
arguments, so other scripts can call it instead of keeping their own copy.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

import torch
import torch.nn.functional as F

import hvdcompress.torch as hvc

from .example_models import for_dataset


def train_and_test(spec: str, data, dataset: str, *, lr: float, seed: int, epochs: int, batch_size: int,
                   schedule: str = "layerwise", momentum: float = 0.9, weight_decay: float = 0.0,
                   check_name: Optional[str] = None) -> Dict[str, object]:
    """Train ``for_dataset(dataset)`` from ``torch.manual_seed(seed)`` with ``compression=spec`` on
    every rank (call it on every rank with the same arguments) and return rank-independent figures:
    test accuracy, this rank's payload bytes per step (``opt.stats``), whether every rank ended with
    identical parameters, and whether they are finite."""
    rank, size = hvc.rank(), hvc.size()
    torch.manual_seed(seed)
    model = for_dataset(dataset)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule)
    x_tr = torch.from_numpy(data.x_train)[rank::size]
    y_tr = torch.from_numpy(data.y_train)[rank::size]
    steps = len(data.x_train) // size // batch_size
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    for epoch in range(epochs):
        opt.set_epoch(epoch)
        perm = torch.randperm(len(x_tr), generator=gen)
        for i in range(steps):
            idx = perm[i * batch_size:(i + 1) * batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(data.x_test)).argmax(1).numpy() == data.y_test).mean()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvc.allgather(flat.unsqueeze(0), name=check_name or f"check.{spec}.{lr}.{seed}")
    stats = opt.stats.as_dict()
    return {"accuracy": float(acc), "bytes_per_step": stats["bytes_per_step"],
            "dense_bytes_per_step": stats["dense_bytes_per_step"],
            "identical": bool(all(torch.equal(rows[0], r) for r in rows)),
            "finite": bool(torch.isfinite(flat).all())}


def best_lr(accuracy_by_lr: Mapping[float, float]) -> float:
    """The learning rate with the highest accuracy; a tie goes to the smaller rate. A diverged run
    (NaN accuracy) never wins unless every run diverged."""
    if not accuracy_by_lr:
        raise ValueError("best_lr: accuracy_by_lr is empty; give at least one learning rate")

    def key(item):
        lr, acc = item
        return (-(acc if not math.isnan(acc) else -1.0), lr)

    return min(accuracy_by_lr.items(), key=key)[0]
