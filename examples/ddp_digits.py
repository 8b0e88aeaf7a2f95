"""Train a small CNN on scikit-learn's bundled digits with DDP and a compressing communication hook.

    torchrun --nproc_per_node 2 examples/ddp_digits.py --compression dgc:ratio=0.01

No Horovod: torchrun starts the processes, ``torch.distributed`` (Gloo on CPU; NCCL on GPUs, the
default where CUDA is available) carries the collectives, and two lines hand DDP's gradient
buckets to an hvdcompress compressor::

    state, hook = hvdcompress.ddp.comm_hook(spec, model=ddp_model, optimizer=opt)
    ddp_model.register_comm_hook(state, hook)

Where CUDA is available every rank is pinned to its own GPU (``LOCAL_RANK``, which torchrun sets:
``torch.cuda.set_device``) before the process group is made, and with NCCL the model and data live
there: ``torchrun --nproc_per_node 8 examples/ddp_digits.py`` trains on 8 GPUs. Each rank trains on its own shard. At the end rank 0 prints the test accuracy and the bytes each
rank put on the wire per step next to what DDP's dense allreduce sends, and every rank checks that
all ranks hold identical parameters (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcompress.ddp
from hvdcompress import parse_spec
from hvdcompress.bench.example_models import DigitsCNN
from hvdcompress.datasets import load_digits


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="topk:ratio=0.01", help="spec, e.g. none, fp16, dgc:ratio=0.01")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist-backend", default=None,
                   help="torch.distributed backend: gloo, nccl (default: nccl where CUDA is available, else gloo)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    p.add_argument("--json", help="write the final figures to this file (rank 0)")
    return p.parse_args(argv)


def evaluate(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def main(argv=None) -> dict:
    args = parse_args(argv)
    spec = parse_spec(args.compression)  # a bad spec fails here, on every rank, before any collective
    torch.set_num_threads(1)  # ranks share the machine's cores
    if torch.cuda.is_available():  # every rank on its own GPU (torchrun sets LOCAL_RANK), before NCCL starts
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = args.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)  # torchrun's environment: rank, world size, master
    rank, size = dist.get_rank(), dist.get_world_size()
    nccl = str(dist.get_backend()) == "nccl"  # NCCL moves CUDA tensors only; Gloo: the CPU
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    d = load_digits(args.seed)
    x_tr, y_tr = torch.from_numpy(d.x_train).to(device), torch.from_numpy(d.y_train).to(device)
    x_te, y_te = torch.from_numpy(d.x_test).to(device), torch.from_numpy(d.y_test).to(device)
    steps_per_epoch = len(x_tr) // size // args.batch_size  # the same on every rank
    x_tr, y_tr = x_tr[rank::size], y_tr[rank::size]
    torch.manual_seed(args.seed)
    model = DDP(DigitsCNN().to(device), bucket_cap_mb=args.bucket_cap_mb)  # DDP broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    state, hook = hvdcompress.ddp.comm_hook(spec, model=model, optimizer=opt)  # DGC takes the momentum over
    model.register_comm_hook(state, hook)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    start, step, loss = time.perf_counter(), 0, torch.zeros(())
    for epoch in range(args.epochs):
        state.set_epoch(epoch)  # drives warm-up schedules (DGC); harmless for the others
        perm = torch.randperm(len(x_tr), generator=gen).to(device)
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            step += 1
            if step == args.max_steps:
                break
        if rank == 0 and not args.max_steps:
            print(f"epoch {epoch}: loss {loss.item():.3f}, test accuracy {evaluate(model, x_te, y_te):.3f}", flush=True)
        if step == args.max_steps:
            break
    elapsed = time.perf_counter() - start
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(rows, flat)
    identical = all(torch.equal(rows[0], r) for r in rows)
    stats = state.stats.as_dict()
    result = {"compression": str(state.spec), "world_size": size, "steps": step, "loss": loss.item(),
              "test_accuracy": evaluate(model, x_te, y_te), "bytes_per_step": stats["bytes_per_step"],
              "dense_bytes_per_step": stats["dense_bytes_per_step"], "compression_ratio": stats["ratio"],
              "parameters_identical_across_ranks": identical, "seconds": elapsed}
    if rank == 0:
        print(f"compression           {result['compression']}")
        print(f"test accuracy         {result['test_accuracy']:.4f} after {step} steps")
        print(f"bytes/step per rank   {result['bytes_per_step']:.0f} (dense {result['dense_bytes_per_step']:.0f}, "
              f"{result['compression_ratio']:.1f}x smaller)")
        print(f"identical parameters  {identical}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    if owns_group:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["parameters_identical_across_ranks"] else 1)
