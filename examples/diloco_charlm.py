"""Train a small character-level transformer on the Python standard library's source with DiLoCo.

    horovodrun -np 2 -H localhost:2 --gloo python examples/diloco_charlm.py --sync-every 50
    # Streaming DiLoCo with 4-bit outer gradients
    horovodrun -np 2 -H localhost:2 --gloo python examples/diloco_charlm.py --sync-every 100 \\
        --fragments 4 --overlap-steps 5 --mix 0.5 --compression qsgd:levels=7,bucket=512
    # SparseLoCo-like: 2% top-k of the error-feedback accumulator, 2-bit values
    horovodrun -np 2 -H localhost:2 --gloo python examples/diloco_charlm.py --sync-every 50 \\
        --compression sparseloco:ratio=0.02,bits=2,beta=0.95

Each rank trains on its own random windows of the text with AdamW (the inner optimizer), and
exchanges nothing between syncs; every ``--sync-every`` steps (per fragment) the pseudo-gradients
are averaged and the outer SGD (lr 0.7, momentum 0.9, Nesterov) steps the global parameters. At
the end ``flush()`` makes every replica identical; rank 0 prints the held-out loss (nats per
character) and the bytes each rank sent per step, and every rank checks that all ranks agree.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hvdcompress.torch as hvc
from hvdcompress.bench.example_models import CharTransformer, char_batches, char_eval_loss
from hvdcompress.datasets import load_stdlib_text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--sync-every", type=int, default=50, help="H: inner steps between syncs of a fragment")
    p.add_argument("--fragments", type=int, default=1, help="P: fragments synchronised in turn")
    p.add_argument("--overlap-steps", type=int, default=0, help="tau: inner steps an exchange runs in flight")
    p.add_argument("--mix", type=float, default=0.0, help="alpha: weight of the local parameters after a sync")
    p.add_argument("--compression", default="none", help="spec for the pseudo-gradients")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3, help="inner AdamW learning rate")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--json", help="write the final figures to this file (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    hvc.init()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if torch.cuda.is_available():  # every rank on its own GPU (Horovod built with NCCL: make install does it)
        torch.cuda.set_device(hvc.local_rank())
        device = torch.device("cuda", hvc.local_rank())
    torch.manual_seed(0)
    text = load_stdlib_text()
    model = CharTransformer(width=args.width, layers=args.layers, context=args.context).to(device)
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)  # identical start: the first theta_global
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    opt = hvc.DiLoCo(model, inner, sync_every=args.sync_every, fragments=args.fragments,
                     overlap_steps=args.overlap_steps, mix=args.mix, compression=args.compression)
    batches = char_batches(text.train, args.batch_size, args.context, seed=1000 * (hvc.rank() + 1))
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in next(batches))
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        if hvc.rank() == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1}: train loss {float(loss):.3f}", flush=True)
    opt.flush()
    seconds = time.perf_counter() - start
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvc.allgather(flat[None], name="check")
    assert all(torch.equal(rows[0], r) for r in rows), "replicas differ after flush()"
    figures = {"held_out_loss": char_eval_loss(model.cpu(), text.test, args.context, windows=256),
               "bytes_per_step": opt.bytes_sent / args.steps, "seconds": seconds, "workers": hvc.size(),
               "corpus": text.source, "config": vars(args)}
    if hvc.rank() == 0:
        print(json.dumps(figures, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
    hvc.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
