"""Our DDP communication hook next to torch's own, in the same run, on the same model and data.

Pairs (torch.distributed, Gloo; every configuration runs in the same processes, one after the other):

    compute          a hook that exchanges nothing (the bucket's own gradients, at once): the
                     compute-only step, the floor every other configuration is measured against
    ddp              DDP's default hook (dense fp32 allreduce, averaged)
    torch-fp16       torch's ``fp16_compress_hook``            vs  ours-fp16       ``fp16``
    torch-powersgd   torch's ``powerSGD_hook`` (rank r, warm     vs  ours-powersgd   ``powersgd:rank=r``
                     start, error feedback, start_powerSGD_iter=2)   (warm start and error feedback
                                                                      are what ours always does)
    ours-topk        ``topk:ratio=0.01``                       vs  ddp
    ours-dgc         ``dgc:ratio=0.001`` (the optimizer's momentum taken over)  vs  ddp

Three parts (``--part``):

* ``timing``: seconds per training step (slowest rank, median over the measured steps, after
  warm-up steps that cover DDP's bucket rebuild and torch PowerSGD's dense start) of a model from
  ``hvdcompress.bench.torch_models`` on synthetic batches (``--model``: ``vgg``, 6.4M parameters,
  compute-bound on a CPU; ``mlp``, 12.6M parameters in 8 tensors and little compute per byte of
  gradient, where the link dominates; ``deep``, 0.33M parameters in 100 tensors).
  ``--link 100mbit,1gbit`` runs the workers in network namespaces whose veth links are rate-limited
  by ``tbf`` (``hvdcompress.bench.netns``: an emulated network; no latency is added; needs root);
  ``--link loopback`` runs them on the machine's loopback. On an emulated link each configuration
  also gets its *limit*: the compute-only step plus the bytes per step over the link rate, where
  the bytes are what the busiest rank's link carried per measured step in its busier direction
  (the interface's counters, ``/proc/net/dev``: headers and the loop's own per-step barrier and
  timing allreduce included), and the distance to it (step / limit).
* ``accuracy``: the digits CNN of ``examples/ddp_digits.py`` trained for ``--epochs`` with each
  configuration on the same shards and batch order; test accuracy and final loss.
* ``degenerate``: 5 steps on 2 ranks of a 64-64-10 MLP with loss ``output.sum()`` (the last
  layer's gradient has rank 1), PowerSGD rank 2 starting at step 2: whether each configuration's
  parameters stay finite on every rank.

Figures are printed and written as JSON (``--json``). Timings need a quiet machine. Examples::

    python benchmarks/ddp_hooks.py --part timing --workers 2,4 --link 100mbit,1gbit --model vgg --json t.json
    python benchmarks/ddp_hooks.py --part timing --workers 2,4 --link 100mbit,1gbit --model mlp --json m.json
    python benchmarks/ddp_hooks.py --part accuracy --workers 2 --epochs 20 --json a.json
    python benchmarks/ddp_hooks.py --part degenerate --json d.json
    python benchmarks/ddp_hooks.py --quick            # a smoke run of all three parts, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("vgg", "mlp", "deep")  # hvdcompress.bench.torch_models.MODELS
CONFIGS = ("compute", "ddp", "torch-fp16", "ours-fp16", "torch-powersgd", "ours-powersgd", "ours-topk", "ours-dgc")


# -- inside a worker ---------------------------------------------------------------------------------
def _register(name: str, ddp, opt, rank_r: int):
    """Put configuration ``name``'s hook on ``ddp``; returns our hook state (or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import hvdcompress.ddp as hddp
    if name == "ddp":
        return None
    if name == "compute":
        ddp.register_comm_hook(None, _no_exchange)
        return None
    if name == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if name == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    spec = {"ours-fp16": "fp16", "ours-powersgd": f"powersgd:rank={rank_r}", "ours-topk": "topk:ratio=0.01",
            "ours-dgc": "dgc:ratio=0.001,warmup_epochs=0"}[name]
    state, hook = hddp.comm_hook(spec, model=ddp, optimizer=opt)
    ddp.register_comm_hook(state, hook)
    return state


def _no_exchange(state, bucket):
    """A DDP hook that exchanges nothing: the bucket's own gradients, in a completed future."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _link_bytes(iface: str):
    """(received, sent) bytes so far on ``iface`` in this process's network namespace, or None
    when the interface is not listed."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface and rest:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return None


def _flat(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _all_ranks(t):
    import torch
    import torch.distributed as dist
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return rows


def _timing(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvdcompress.bench import torch_models
    rank = dist.get_rank()
    x, y = torch_models.synthetic_batch(cfg["batch_size"], seed=rank)
    out = {}
    for name in cfg["configs"]:
        model = DDP(torch_models.build(cfg["model"], seed=0))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        state = _register(name, model, opt, cfg["rank"])
        times = []
        iface = cfg.get("iface")
        counted = None
        for step in range(cfg["warmup"] + cfg["steps"]):
            if step == cfg["warmup"] and iface:
                counted = _link_bytes(iface)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank's does
            if step >= cfg["warmup"]:
                times.append(float(took))
        link = None
        if counted is not None:
            now = _link_bytes(iface)
            mine = torch.tensor([(now[0] - counted[0]) / len(times), (now[1] - counted[1]) / len(times)],
                                dtype=torch.float64)
            link = [r.tolist() for r in _all_ranks(mine)]  # every rank's (received, sent) bytes per step
        rows = _all_ranks(_flat(model))
        out[name] = {"median_step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
                     "steps": len(times),
                     "identical": None if name == "compute" else all(bool((r == rows[0]).all()) for r in rows),
                     "bytes_per_step": state.stats.as_dict()["bytes_per_step"] if state is not None else None,
                     "link_bytes_per_step": link}
    return out


def _accuracy(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvdcompress.bench.example_models import DigitsCNN
    from hvdcompress.datasets import load_digits
    rank, size = dist.get_rank(), dist.get_world_size()
    d = load_digits(0)
    x_tr, y_tr = torch.from_numpy(d.x_train)[rank::size], torch.from_numpy(d.y_train)[rank::size]
    x_te, y_te = torch.from_numpy(d.x_test), torch.from_numpy(d.y_test)
    steps = len(d.x_train) // size // cfg["batch_size"]
    out = {}
    for name in cfg["configs"]:
        torch.manual_seed(0)
        model = DDP(DigitsCNN())
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        state = _register(name, model, opt, cfg["rank"])
        gen = torch.Generator().manual_seed(rank)
        start, loss = time.perf_counter(), torch.zeros(())
        for epoch in range(cfg["epochs"]):
            if state is not None:
                state.set_epoch(epoch)
            perm = torch.randperm(len(x_tr), generator=gen)
            for i in range(steps):
                idx = perm[i * cfg["batch_size"]:(i + 1) * cfg["batch_size"]]
                opt.zero_grad()
                loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(x_te).argmax(1) == y_te).float().mean().item()
        rows = _all_ranks(_flat(model))
        out[name] = {"test_accuracy": acc, "final_loss": loss.item(), "epochs": cfg["epochs"],
                     "seconds": time.perf_counter() - start,
                     "identical": all(bool(torch.equal(r, rows[0])) for r in rows)}
    return out


def _degenerate(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    out = {}
    for name in cfg["configs"]:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        _register(name, model, opt, 2)
        finite = []
        for step in range(5):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * rank + step))
            opt.zero_grad()
            model(x).sum().backward()  # the last layer's gradient: every row the same (rank 1)
            opt.step()
            finite.append(bool(torch.isfinite(_flat(model)).all()))
        every = [bool(torch.isfinite(r).all()) for r in _all_ranks(_flat(model))]
        out[name] = {"finite_after_each_step": finite, "finite_on_every_rank": every}
    return out


PARTS = {"timing": _timing, "accuracy": _accuracy, "degenerate": _degenerate}


def worker_main(part: str, cfg_json: str, out_path: str) -> None:
    """One rank (torch.distributed's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    import warnings

    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    torch.set_num_threads(int(os.environ.get("HVC_THREADS", "1")))
    dist.init_process_group("gloo")
    result = PARTS[part](json.loads(cfg_json))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(part: str, cfg: dict, workers: int, link: str = "loopback") -> dict:
    """``workers`` processes running ``part``; on loopback, or in namespaces with ``link`` tbf links."""
    from contextlib import ExitStack
    with tempfile.TemporaryDirectory(prefix="hvc-ddp-bench-") as tmp, ExitStack() as stack:
        out = os.path.join(tmp, "result.json")
        prefixes, addr, iface = [[] for _ in range(workers)], "127.0.0.1", "lo"
        if link != "loopback":
            from hvdcompress.bench.netns import EmulatedNetwork, parse_bandwidth
            net = stack.enter_context(EmulatedNetwork(workers, parse_bandwidth(link), f"ddp{part[:3]}"))
            prefixes, addr, iface = [net.exec_prefix(r) for r in range(workers)], net.addresses[0], net.iface
            cfg = dict(cfg, iface=iface)  # the workers count the bytes their link carries
        port = _free_port()
        procs = []
        for r in range(workers):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r), MASTER_ADDR=addr,
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=iface, OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
            cmd = prefixes[r] + [sys.executable, os.path.abspath(__file__), "--worker", part, json.dumps(cfg), out]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"{part}: workers exited with {codes}")
        with open(out) as f:
            return json.load(f)


def _timing_rows(got: dict, link: str, world: int) -> List[Dict[str, object]]:
    """One row per configuration of one (link, world) run: step time, speed-up over DDP, and on an
    emulated link the bytes the busiest link carried per step, the limit and the distance to it."""
    base = got.get("ddp", {}).get("median_step_s")
    compute = got.get("compute", {}).get("median_step_s")
    bps = None
    if link != "loopback":
        from hvdcompress.bench.netns import parse_bandwidth
        bps = parse_bandwidth(link)
    rows = []
    for name, r in got.items():
        step = r["median_step_s"]
        wire = max(max(rank) for rank in r["link_bytes_per_step"]) if r.get("link_bytes_per_step") else None
        limit = compute + wire * 8 / bps if None not in (compute, wire, bps) else None
        rows.append({"link": link + (" (tbf, emulated)" if link != "loopback" else ""), "workers": world,
                     "config": name, "median_step_ms": step * 1e3,
                     "speedup_vs_ddp": base / step if base else float("nan"),
                     "link_mb_per_step": wire / 1e6 if wire is not None else None,
                     "limit_ms": limit * 1e3 if limit is not None else None,
                     "step_over_limit": step / limit if limit else None,
                     "payload_mb_per_step": r["bytes_per_step"] / 1e6 if r.get("bytes_per_step") is not None else None,
                     "identical": "n/a" if r["identical"] is None else r["identical"]})
    return rows


def _print_table(title: str, rows: List[Dict[str, object]]) -> None:
    print(f"\n{title}")
    if not rows:
        return
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)
                                for v in row.values()) + " |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=("all", "timing", "accuracy", "degenerate"))
    p.add_argument("--workers", default="2", help="comma-separated world sizes (timing, accuracy)")
    p.add_argument("--link", default="loopback", help="timing: comma-separated: loopback, 100mbit, 1gbit, ...")
    p.add_argument("--model", default="vgg", choices=MODELS,
                   help="timing: vgg (6.4M parameters, compute-bound on a CPU), mlp (12.6M parameters, little "
                        "compute: link-bound, where top-k / DGC can reach 10x over dense) or deep (0.33M in 100 "
                        "tensors); hvdcompress.bench.torch_models")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timing: measured steps per configuration")
    p.add_argument("--warmup", type=int, default=5, help="timing: steps before measuring (>= 3)")
    p.add_argument("--epochs", type=int, default=20, help="accuracy: epochs on digits")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's rank, ours and torch's")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, loopback, 2 workers")
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}; accepted: {', '.join(CONFIGS)}")
    if args.warmup < 3:
        p.error("--warmup must be >= 3 (DDP rebuilds its buckets after step 1, torch's PowerSGD starts at step 2)")
    if args.quick:
        args.workers, args.link, args.model, args.steps, args.warmup, args.epochs = "2", "loopback", "deep", 3, 3, 1
    parts = ["timing", "accuracy", "degenerate"] if args.part == "all" else [args.part]
    worlds = [int(w) for w in args.workers.split(",")]
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "host": socket.gethostname(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "configs": configs}
    if "timing" in parts:
        rows = []
        for link in args.link.split(","):
            for world in worlds:
                cfg = {"model": args.model, "batch_size": args.batch_size, "steps": args.steps,
                       "warmup": args.warmup, "rank": args.rank, "configs": configs}
                got = launch("timing", cfg, world, link)
                rows += _timing_rows(got, link, world)
        result["timing"] = {"model": args.model, "batch_size": args.batch_size, "rows": rows,
                            "limit": "compute-only step + link bytes per step (busiest rank, busier direction) / "
                                     "link rate; step_over_limit = median step / limit"}
        _print_table(f"step time, model {args.model}, batch {args.batch_size} per rank", rows)
    if "accuracy" in parts:
        rows = []
        for world in worlds:
            got = launch("accuracy", {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
                                      "rank": args.rank, "configs": [c for c in configs if c != "compute"]}, world)
            rows += [{"workers": world, "config": n, "test_accuracy": r["test_accuracy"], "final_loss": r["final_loss"],
                      "epochs": r["epochs"], "identical": r["identical"]} for n, r in got.items()]
        result["accuracy"] = rows
        _print_table(f"digits, {args.epochs} epochs", rows)
    if "degenerate" in parts:
        got = launch("degenerate", {"configs": [c for c in configs if c in ("ddp", "torch-powersgd", "ours-powersgd")]}, 2)
        rows = [{"config": n, "finite_after_each_step": r["finite_after_each_step"],
                 "finite_on_every_rank": r["finite_on_every_rank"]} for n, r in got.items()]
        result["degenerate"] = rows
        _print_table("64-64-10 MLP, loss output.sum(), PowerSGD rank 2 from step 2, 5 steps, 2 ranks", rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, ROOT)
        worker_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
