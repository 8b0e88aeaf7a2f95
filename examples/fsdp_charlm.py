"""Train a small character-level transformer sharded with FSDP2, its reduce-scatter compressed.

    torchrun --nproc-per-node 2 examples/fsdp_charlm.py --compression qsgd:levels=7,bucket=128
    # without torchrun: spawns 2 gloo processes on this machine
    python examples/fsdp_charlm.py --spawn 2 --compression topk:ratio=0.05 --residual int8
    # plain FSDP2 (no compression), the baseline
    python examples/fsdp_charlm.py --spawn 2 --compression plain
    # two "nodes" of 2: sharded inside a node, 4-bit codes across, 8-bit inside (plain: native HSDP)
    python examples/fsdp_charlm.py --spawn 4 --topology 2x2 --inside qsgd:levels=127,bucket=128

Each block of the transformer and the model are sharded with ``fully_shard`` on a 1-D CPU mesh
(gloo); ``hvdcompress.fsdp.compress`` is the one added line. Each rank trains on its
own random windows of the Python standard library's source with AdamW. At the end every rank
checks that the gathered parameters agree, and rank 0 prints the held-out loss (nats per
character) and the bytes each rank sent per step in its reduce-scatters, next to what plain
FSDP2's ring reduce-scatter sends (with ``--topology``: the bytes across nodes, next to what native
HSDP's ring all-reduce of the shard sends).
"""

from __future__ import annotations

import argparse
import json
import socket

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--compression", default="qsgd:levels=7,bucket=128", help="a spec, or 'plain' for plain FSDP2")
    p.add_argument("--residual", default=None, choices=("none", "full", "int8"), help="error feedback's buffer")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--topology", default=None, help="e.g. 2x2: shard inside a node, compress across nodes")
    p.add_argument("--inside", default=None, help="with --topology: the spec inside a node (default dense)")
    p.add_argument("--spawn", type=int, default=0, help="spawn this many gloo processes (instead of torchrun)")
    p.add_argument("--json", help="write the final figures to this file (rank 0)")
    return p.parse_args(argv)


def train(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hvdcompress.fsdp
    from hvdcompress.bench.example_models import CharTransformer, char_batches, char_eval_loss
    from hvdcompress.datasets import load_stdlib_text

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if args.topology:  # shard inside a node; plain FSDP2 is then native HSDP on the 2-D mesh
        hybrid = hvdcompress.fsdp.hybrid_mesh(args.topology)
        mesh = hybrid if args.compression == "plain" else hybrid["shard"]
    torch.manual_seed(0)
    text = load_stdlib_text()
    model = CharTransformer(width=args.width, layers=args.layers, context=args.context)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp = None
    if args.compression != "plain":
        fsdp = hvdcompress.fsdp.compress(model, args.compression, residual=args.residual,  # the one line
                                         **(dict(topology=args.topology, inside=args.inside) if args.topology else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    batches = char_batches(text.train, args.batch_size, args.context, seed=1000 * (rank + 1))
    for step in range(args.steps):
        x, y = next(batches)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1}: train loss {float(loss):.3f}", flush=True)
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(rows, full)
    assert all(torch.equal(rows[0], r) for r in rows), "replicas differ"
    numel = sum(p.numel() for p in model.parameters())
    shard = world if not args.topology else hybrid["shard"].size()
    shard_bytes = sum(-(-p.shape[0] // shard) * (p[0].numel() if p.dim() > 1 else 1) * 4 for p in model.parameters())
    plain_bytes = shard_bytes * (shard - 1)  # what a ring reduce-scatter sends per rank and step
    if args.topology:  # across nodes: native HSDP's ring all-reduce of the shard
        nodes = world // shard
        plain_bytes = shard_bytes * 2 * (nodes - 1) // nodes
    figures = {"held_out_loss": char_eval_loss(model, text.test, args.context, windows=256),
               "bytes_per_step": fsdp.stats.as_dict()["bytes_per_step"] if fsdp else plain_bytes,
               "plain_bytes_per_step": plain_bytes, "parameters": numel, "workers": world,
               "corpus": text.source, "config": vars(args)}
    return figures


def _worker(rank, world, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        figures = train(args)
        if rank == 0:
            _report(figures, args)
    finally:
        dist.destroy_process_group()


def _report(figures, args):
    print(json.dumps(figures, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.spawn:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(args.spawn, port, args), nprocs=args.spawn, start_method="spawn")
        return 0
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        figures = train(args)
        if dist.get_rank() == 0:
            _report(figures, args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
