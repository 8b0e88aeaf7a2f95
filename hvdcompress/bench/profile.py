"""Profiling from the command line: the transport and compression costs a cost model is fitted
from, and the compute profiles the emulated benchmark replays.

    horovodrun -np 2 -H localhost:2 --gloo python -m hvdcompress.bench.profile transport \\
        --compression topk:ratio=0.01 --model deep --out profile.json
    python -m hvdcompress.bench.profile emulation list | show NAME | record --model vgg --out p.json

``transport`` times collectives and compression under horovodrun (``torch_ops.profiling``), fits
and caches the cost model, and with ``--model`` also profiles that model's backward pass and
prints the plans each schedule would make. ``emulation`` lists, shows or records the per-layer
compute profiles of ``hvdcompress.bench.emulated``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

import torch
from torch import nn

from hvdcompress.schedule.costmodel import cache_path, describe
from hvdcompress.spec import resolve
from torch_ops.profiling import DEFAULT_COMM_BYTES, profile_cost_model, profile_workload

from . import torch_models
from .emulated import load_profile, record_profile, shipped


def transport_main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvdcompress.bench.profile transport",
                                 description="Profile collectives, compression and (optionally) a model's "
                                             "backward pass under horovodrun; fit and cache the cost model.")
    ap.add_argument("--compression", action="append", default=None,
                    help="compressor spec to time (repeatable; default: none and topk:ratio=0.01)")
    ap.add_argument("--model", default=None, help="also profile this benchmark model's backward pass "
                    "(hvdcompress.bench.torch_models: e.g. deep, mlp, vgg)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-mib", type=float, default=16.0, help="largest collective timed, MiB per rank")
    ap.add_argument("--out", default=None, help="write {cost_model, workload, plans} JSON here (rank 0)")
    args = ap.parse_args(argv)

    import horovod.torch as hvd
    hvd.init()
    specs = args.compression or ["none", "topk:ratio=0.01"]
    comm_bytes = [b for b in DEFAULT_COMM_BYTES if b <= args.max_mib * (1 << 20)] or [DEFAULT_COMM_BYTES[0]]
    model = profile_cost_model(specs, comm_bytes=comm_bytes, repeats=args.repeats)
    report = {"cost_model": model.to_dict(), "cache": cache_path(model.world_size, model.hosts)}
    if args.model:
        net = torch_models.build(args.model)
        x, y = torch_models.synthetic_batch(args.batch_size, seed=hvd.rank())
        sgd = torch.optim.SGD(net.parameters(), lr=0.01)
        workload = profile_workload(net, lambda: torch.nn.functional.cross_entropy(net(x), y),
                                    optimizer=sgd)
        report["workload"] = workload.to_dict()
        report["plans"] = {}
        for spec in specs:
            for sched in ("layerwise", "single", "size:64", "auto"):
                plan = workload.plan(sched, model, spec)
                report["plans"][f"{resolve(spec)} {sched}"] = {
                    "schedule": plan.schedule, "groups": len(plan.groups),
                    "predicted_seconds": plan.predicted_seconds}
    if hvd.rank() == 0:
        print(describe(model))
        print(f"cached at {report['cache']}")
        for name, p in report.get("plans", {}).items():
            print(f"  predicted step {name:>40}: {p['predicted_seconds'] * 1e3:8.2f} ms "
                  f"({p['groups']} groups, {p['schedule']})")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    hvd.shutdown()
    return 0



def emulation_main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvdcompress.bench.profile emulation",
                                 description="Emulation profiles: list the shipped ones, show one, or record "
                                             "one from a model on this machine.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="shipped profiles")
    show = sub.add_parser("show", help="a profile's totals")
    show.add_argument("profile")
    rec = sub.add_parser("record", help="time a model here and write its profile (single process)")
    rec.add_argument("--model", default="deep", help="an hvdcompress.bench.torch_models model, or "
                     "module:function returning an nn.Module that takes (batch, 3, 32, 32) inputs")
    rec.add_argument("--batch", type=int, default=32)
    rec.add_argument("--iters", type=int, default=5)
    rec.add_argument("--threads", type=int, default=1)
    rec.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(shipped()))
        return 0
    if args.cmd == "show":
        p = load_profile(args.profile)
        n = sum(math.prod(s) for l in p["layers"] for s in l["params"].values())
        print(f"{p['name']}: {len(p['layers'])} layers, {n / 1e6:.2f}M parameters, batch {p['batch']}, "
              f"forward {sum(l['forward_s'] for l in p['layers']) * 1e3:.1f} ms, backward "
              f"{sum(l['backward_s'] for l in p['layers']) * 1e3:.1f} ms; {p.get('source', '')}")
        return 0
    torch.set_num_threads(args.threads)
    if ":" in args.model:
        import importlib
        mod, fn = args.model.split(":", 1)
        model = getattr(importlib.import_module(mod), fn)()
    else:
        model = torch_models.build(args.model)
    x, y = torch_models.synthetic_batch(args.batch, seed=1)
    prof = record_profile(model, lambda: nn.functional.cross_entropy(model(x), y), iters=args.iters,
                          name=os.path.splitext(os.path.basename(args.out))[0], batch=args.batch,
                          note=f"model {args.model}, batch {args.batch}, {args.threads} torch thread(s)")
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(prof['layers'])} layers, forward {prof['forward_s_total'] * 1e3:.1f} ms, "
          f"backward {prof['backward_s_total'] * 1e3:.1f} ms")
    return 0



def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"transport": transport_main, "emulation": emulation_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m hvdcompress.bench.profile {transport,emulation} ... (--help after either)",
              file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
