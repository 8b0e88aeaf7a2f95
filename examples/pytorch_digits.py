"""Train a small CNN on scikit-learn's bundled digits (no download) with compressed gradients.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py --compression topk:ratio=0.01

Each rank trains on its own shard of the training set; gradients are compressed with the given
spec on every group (``--codec-choice off``, this script's default), exchanged with Horovod and
averaged. At the end rank 0 prints the test accuracy, the bytes each rank put on the wire per step
next to what dense allreduce would have sent, and per group what was sent with the predicted
times; every rank checks that all ranks hold identical parameters.

Then (``--probe-steps``, on by default) it shows what the optimizer's default (``codec_choice``
unset: the measured per-group decision) would send on this link and why: a fresh copy of the model
trains a few steps with the default until its measured validation has decided, and rank 0 prints
per group the spec, fp16 or dense it chose, the predicted times, and every candidate's measured
median step. ``--codec-choice auto`` trains with the decision itself instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import hvdcompress.torch as hvc
from hvdcompress.datasets import load_digits
from hvdcompress.bench.example_models import DigitsCNN


def load_data(seed: int):
    d = load_digits(seed)
    return (torch.from_numpy(d.x_train), torch.from_numpy(d.y_train)), (torch.from_numpy(d.x_test), torch.from_numpy(d.y_test))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="none", help="spec, e.g. none, fp16, topk:ratio=0.01")
    p.add_argument("--schedule", default="auto", help="merge schedule: auto (cost model), mgs, mgwfbp, "
                   "layerwise, single, size:<MB>")
    p.add_argument("--codec-choice", choices=("auto", "off", "default"), default="off",
                   help="per-group choice of the spec, fp16 or dense while training: off (the spec on every "
                   "group; this script's default), auto, or default (the optimizer's: on for a compressing "
                   "spec under a cost-model schedule)")
    p.add_argument("--probe-steps", type=int, default=200,
                   help="after training, at most this many steps of a fresh model under the optimizer's default "
                   "codec choice, to show what it decides on this link (0: skip)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay", type=int, default=0, help="delayed averaging: steps an exchange stays in flight")
    p.add_argument("--sync-every", type=int, default=1, help="temporal sparsity: exchange every K steps")
    p.add_argument("--json", help="write the final figures to this file (rank 0)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def evaluate(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def probe_default_choice(args, compression, x_tr, y_tr, size: int):
    """What the optimizer's default codec choice decides on this link: a fresh model trains under it
    until its measured validation has kept a plan (at most ``args.probe_steps`` steps); returns its
    ``Decisions`` (rank 0 prints them), or None when the default is "off" here."""
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   schedule=args.schedule, delay=args.delay, sync_every=args.sync_every)
    if opt.codec_choice == "off":
        return None
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)
    n = len(x_tr) // args.batch_size
    for step in range(args.probe_steps):
        i = step % n
        opt.zero_grad()
        F.cross_entropy(model(x_tr[i * args.batch_size:(i + 1) * args.batch_size]),
                        y_tr[i * args.batch_size:(i + 1) * args.batch_size]).backward()
        opt.step()
        plan = opt.plan  # the same on every rank, so every rank stops at the same step
        if plan is not None and plan.tuning and "candidates" in plan.tuning:
            break
    return opt.decisions()


def main(argv=None) -> int:
    args = parse_args(argv)
    compression = hvc.parse_spec(args.compression)  # bad specs fail here, on every rank, before any collective
    torch.set_num_threads(1)  # ranks share the machine's cores
    hvc.init()
    rank, size = hvc.rank(), hvc.size()
    device = torch.device("cpu")
    if torch.cuda.is_available():  # every rank on its own GPU (Horovod built with NCCL: make install does it)
        torch.cuda.set_device(hvc.local_rank())
        device = torch.device("cuda", hvc.local_rank())

    (x_tr, y_tr), (x_te, y_te) = (tuple(t.to(device) for t in pair) for pair in load_data(args.seed))
    steps_per_epoch = len(x_tr) // size // args.batch_size  # the same on every rank
    x_tr, y_tr = x_tr[rank::size], y_tr[rank::size]
    torch.manual_seed(args.seed)
    model = DigitsCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   schedule=args.schedule, delay=args.delay, sync_every=args.sync_every,
                                   codec_choice=None if args.codec_choice == "default" else args.codec_choice)
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)
    hvc.broadcast_optimizer_state(opt, root_rank=0)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    bar = tqdm(range(args.epochs), desc=f"{compression}", disable=rank != 0 or args.no_progress, file=sys.stdout)
    start = time.perf_counter()
    for epoch in bar:
        perm = torch.randperm(len(x_tr), generator=gen).to(device)
        opt.set_epoch(epoch)  # drives warm-up schedules (DGC); harmless for the others
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", test_acc=f"{evaluate(model, x_te, y_te):.3f}")
    elapsed = time.perf_counter() - start
    opt.flush()  # delayed averaging: apply what is in flight; replicas identical again (no-op when synchronous)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvc.allgather(flat.unsqueeze(0), name="final.params")
    identical = all(torch.equal(rows[0], r) for r in rows)
    stats = opt.stats.as_dict()
    result = {
        "compression": str(compression), "world_size": size, "epochs": args.epochs,
        "test_accuracy": evaluate(model, x_te, y_te), "bytes_per_step": stats["bytes_per_step"],
        "dense_bytes_per_step": stats["dense_bytes_per_step"], "compression_ratio": stats["ratio"],
        "steps": stats["steps"], "parameters_identical_across_ranks": identical, "seconds": elapsed,
        "schedule": args.schedule, "groups": opt.groups, "codec_choice": opt.codec_choice,
        "delay": args.delay, "sync_every": args.sync_every,
        "predicted_step_seconds": opt.plan.predicted_seconds if opt.plan else None,
        "last_step_timings": opt.timings, "decisions": opt.decisions().as_dict(),
    }
    default = probe_default_choice(args, compression, x_tr, y_tr, size) if args.probe_steps > 0 else None
    result["default_decision"] = None if default is None else default.as_dict()
    if rank == 0:
        print(f"compression           {result['compression']}")
        print(f"test accuracy         {result['test_accuracy']:.4f}")
        print(f"bytes/step per rank   {result['bytes_per_step']:.0f} (dense {result['dense_bytes_per_step']:.0f}, "
              f"{result['compression_ratio']:.1f}x smaller)")
        print(f"identical parameters  {identical}")
        plan = opt.plan
        predicted = f", predicted step {plan.predicted_seconds * 1e3:.1f} ms" if plan and plan.predicted_seconds else ""
        print(f"schedule              {args.schedule} -> {plan.schedule if plan else 'layerwise'}: "
              f"{len(opt.groups)} group(s) of {[len(g) for g in opt.groups]} tensors{predicted}; "
              f"last step {opt.timings['iteration_seconds'] * 1e3:.1f} ms; codec choice {opt.codec_choice}")
        print("sent per group (trained with):")
        print("\n".join("  " + line for line in opt.decisions().lines()))
        if default is not None:
            print("what the default (codec_choice unset: the measured per-group decision) sends on this link:")
            print("\n".join("  " + line for line in default.lines()))
        elif args.probe_steps > 0:
            print("the default codec choice is off for this spec and schedule: the spec is sent on every group")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    hvc.shutdown()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
