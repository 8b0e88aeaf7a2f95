"""Every registered spec through the three torch.distributed front ends on one device, end to end.

    python benchmarks/gpu_e2e.py                       # CUDA: 2 ranks sharing GPU 0 over Gloo, then NCCL x1
    python benchmarks/gpu_e2e.py --device cpu --steps 2 --timing-steps 2     # the same on the CPU (smoke)

Part 1, correctness (2 ranks over torch.distributed Gloo, both on ``--device``; for CUDA the same
GPU, tensors on it): for every spec of ``SPECS`` (every registered algorithm, with parameters that
make it act on the small model) the DDP comm hook (``hvdcompress.ddp``), ``DistributedOptimizer(
backend="torch")`` and DiLoCo (``torch_ops.diloco.DiLoCo`` on a ``TorchDistCommunicator``) train a
small MLP for ``--steps`` steps. Checked: the replicas are identical after every step (DiLoCo: after
every outer sync) and every exchange, logged with each rank's input and state, equals the numpy
oracle's replay (``hvdcompress.reference.simulate``): bit for bit, PowerSGD within 1e-4.

Gloo and CUDA tensors: before the runs each rank tries every collective the front ends issue
(all_reduce, all_gather_single or all_gather_into_tensor, all_gather, all_to_all_single,
broadcast) on a CUDA tensor.
A collective Gloo refuses is then staged through pinned host memory (copied there, run on the CPU,
copied back, synchronously) for every caller in the process, and the JSON says which
(``gloo_staged``): what a user of Gloo with CUDA tensors would need to do for that collective.

Part 2, step time (same 2 ranks): a wider MLP (``--width``), median step of plain DDP (no hook)
against DDP with each spec's hook, ``--timing-steps`` timed steps after 3 untimed ones, the device
synchronised around each step (``torch_ops.scheduling.timer_for``).

Part 3, NCCL smoke test (CUDA only, world size 1): every spec through the three front ends on an
NCCL process group for 2 steps; checked that they run and the parameters stay finite.

Writes one JSON (``--out``, default ``benchmarks/results/gpu/e2e-<device>.json``) with the device
name, torch / CUDA / NCCL versions, every check and every timing; the exit status is 1 when a check
failed. Made to finish in a few minutes on one GPU (``--steps 3``, ``--timing-steps 10``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# every registered algorithm, with parameters that make it act on a small MLP (no dense fallback)
SPECS = ("none", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1", "threshold:threshold=0.05",
         "dgc:ratio=0.05,min_sparse_numel=64,warmup_epochs=0,clip_norm=5.0",
         "sketch:ratio=0.1,cols_ratio=0.3,min_sketch_numel=64", "signsgd", "efsignsgd", "onebit",
         "terngrad", "qsgd:levels=3,bucket=64", "powersgd:rank=2", "sparseloco:ratio=0.1")
FRONT_ENDS = ("hook", "opt", "diloco")
PROBED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all_single", "broadcast")
TOLERANCE = {"powersgd": 1e-4}  # Gram-Schmidt amplifies last-bit differences of the matmuls


# --- the model and data ---------------------------------------------------------------------------
def make_model(device, width=24, seed=0):
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 4)).to(device)


def batch(rank, step, device, rows=8):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(rows, 12, generator=g)
    return x.to(device), x[:, :4].argmax(1).to(device)


def flat(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def identical(model) -> bool:
    """Every rank's parameters equal rank 0's (gathered on the CPU under Gloo: no staged collective
    involved; on the device under NCCL, which moves CUDA tensors only)."""
    import torch
    import torch.distributed as dist
    mine = flat(model)
    if str(dist.get_backend()) != "nccl":
        mine = mine.cpu()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return all(torch.equal(rows[0], r) for r in rows)


def to_np(t):
    import torch
    t = t.detach().cpu()
    return t.to(torch.float64).numpy() if t.dtype == torch.bfloat16 else t.numpy().copy()


# --- Gloo with CUDA tensors ---------------------------------------------------------------------
class Done:
    """A finished collective's handle (a staged collective ran synchronously)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def probe_gloo(device) -> dict:
    """{collective: None if Gloo ran it on ``device``'s tensors, else the error}."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    out = {}
    x = torch.ones(4, device=device)
    tries = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_gather_single": lambda: dist.all_gather_single(x.new_empty(4 * world), x.clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(x.new_empty(4 * world), x.clone()),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x.clone()),
        "all_to_all_single": lambda: dist.all_to_all_single(x.new_empty(4), x.clone()),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
    }
    for name in PROBED:
        if not hasattr(dist, name):  # all_gather_single: newer torch versions only
            continue
        try:
            tries[name]()
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            out[name] = None
        except Exception as exc:  # Gloo's refusal: RuntimeError / ValueError, message recorded
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def stage_through_host(names) -> None:
    """Replace the torch.distributed functions in ``names`` by versions that copy CUDA tensors to
    pinned host memory, run the collective there synchronously and copy the results back."""
    import torch
    import torch.distributed as dist

    def host(t):
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t)
        return h

    def staged(fn, outputs_of):
        def call(*args, **kwargs):
            async_op = kwargs.pop("async_op", False)
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
            lists = [a for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)]
            if not tensors and not any(t.is_cuda for lst in lists for t in lst):
                return fn(*args, async_op=async_op, **kwargs)
            moved = []
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_cuda:
                    moved.append(host(a))
                elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
                    moved.append([host(t) for t in a])
                else:
                    moved.append(a)
            fn(*moved, **kwargs)
            for i in outputs_of:  # the arguments the collective writes
                if isinstance(args[i], list):
                    for d, h in zip(args[i], moved[i]):
                        d.copy_(h)
                else:
                    args[i].copy_(moved[i])
            return Done() if async_op else None
        return call

    writes = {name: (0,) for name in PROBED}  # each writes its first argument
    for name in names:
        setattr(dist, name, staged(getattr(dist, name), writes[name]))


# --- logging every exchange for the oracle ------------------------------------------------------
class Recorder:
    """Wraps every compressor class's ``exchange`` to log what went in and came out."""

    def __init__(self):
        from torch_ops.compressors import COMPRESSORS
        self.log, self.tag = [], None
        for cls in set(COMPRESSORS.values()):
            cls.exchange = self._wrap(cls.exchange)

    def _wrap(self, orig):
        rec = self

        def exchange(comp, x, ctx):
            xin = to_np(x)
            before = {k: to_np(v) for k, v in ctx.state.items()}
            result = yield from orig(comp, x, ctx)
            if rec.tag is not None:
                rec.log.append({"tag": rec.tag, "spec": str(comp.spec), "key": ctx.key, "step": int(ctx.step),
                                "shape": tuple(ctx.shape), "members": tuple(ctx.members), "scale": ctx.scale,
                                "epoch": ctx.epoch, "x": xin, "before": before, "result": to_np(result),
                                "after": {k: to_np(v) for k, v in ctx.state.items()}})
            return result

        return exchange


# --- the three front ends -------------------------------------------------------------------------
def run_hook(spec, device, steps, rec=None, width=24, timer=None, plain=False):
    """DDP with our hook (tiny buckets: several per step), SGD with momentum and weight decay;
    ``plain``: DDP's own allreduce, no hook. Returns (identical per step, step seconds)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    model = make_model(device, width)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002 if timer is None else 25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    if not plain:
        state, hook = hddp.comm_hook(spec, model=ddp, optimizer=opt)
        ddp.register_comm_hook(state, hook)
    same, times = [], []
    for step in range(steps):
        x, y = batch(dist.get_rank(), step, device, rows=8 if timer is None else 64)
        start = timer.now() if timer else 0.0
        if rec is not None:
            rec.tag = ("hook", spec)
        opt.zero_grad()
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
        if rec is not None:
            rec.tag = None
        if timer is not None:
            times.append(timer.now() - start)
        else:
            same.append(identical(model))
    return same, times


def run_opt(spec, device, steps, rec=None):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.torch as hvc
    from hvdcompress.spec import LAYERWISE, resolve
    model = make_model(device)
    schedule = "layerwise" if resolve(spec).info.merge == LAYERWISE else "single"
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule, backend="torch")
    same = []
    for step in range(steps):
        if rec is not None:
            rec.tag = ("opt", spec)
        opt.zero_grad()
        x, y = batch(dist.get_rank(), step, device)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        if rec is not None:
            rec.tag = None
        same.append(identical(model))
    return same


def run_diloco(spec, device, steps, rec=None):
    """DiLoCo syncing every 2 inner steps: identical after each sync."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch_ops.diloco import DiLoCo
    from torch_ops.dist_collectives import TorchDistCommunicator
    model = make_model(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = DiLoCo(model, inner, sync_every=2, compression=outer_spec(spec), transport=TorchDistCommunicator())
    same = []
    for step in range(2 * steps):
        if rec is not None:
            rec.tag = ("diloco", spec)
        inner.zero_grad()
        x, y = batch(dist.get_rank(), step, device)
        nn.CrossEntropyLoss()(model(x), y).backward()
        outer.step()
        if rec is not None:
            rec.tag = None
        if (step + 1) % 2 == 0:
            same.append(identical(model))
    return same


def outer_spec(spec):
    """``spec`` for DiLoCo: a compressor's own momentum off (the outer optimizer holds the momentum)."""
    from hvdcompress.spec import resolve
    if not float(resolve(spec).params.get("momentum") or 0.0):
        return spec
    return spec + ("," if ":" in spec else ":") + "momentum=0"


def guarded(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception:
        return None, traceback.format_exc(limit=6)


# --- the processes ------------------------------------------------------------------------------
def gloo_worker(rank, world, init, device_kind, args, out_dir):
    import torch
    import torch.distributed as dist
    from torch_ops.timing import timer_for
    device = "cuda:0" if device_kind == "cuda" else "cpu"  # 2 ranks sharing one GPU
    if device_kind == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = {"rank": rank, "device": device}
    out["gloo_probe"] = probe_gloo(device) if device_kind == "cuda" else {}
    refused = [name for name, err in out["gloo_probe"].items() if err]
    agreed = [refused]
    dist.broadcast_object_list(agreed, 0)  # the same staging on every rank
    refused = agreed[0]
    stage_through_host(refused)
    out["gloo_staged"] = refused
    rec = Recorder()
    checks = {}
    for spec in args.specs:
        for name, fn in (("hook", lambda s: run_hook(s, device, args.steps, rec)[0]),
                         ("opt", lambda s: run_opt(s, device, args.steps, rec)),
                         ("diloco", lambda s: run_diloco(s, device, args.steps, rec))):
            same, err = guarded(fn, spec)
            checks[f"{name} {spec}"] = {"identical": same, "error": err}
    out["checks"] = checks
    out["log"] = rec.log
    rec.tag = None
    timer = timer_for(device)
    timing = {}
    _, plain = run_hook("none", device, 3 + args.timing_steps, width=args.width, timer=timer, plain=True)
    timing["plain DDP"] = statistics.median(plain[3:])
    for spec in args.specs:
        res, err = guarded(run_hook, spec, device, 3 + args.timing_steps, width=args.width, timer=timer)
        timing[spec] = statistics.median(res[1][3:]) if res else None
        if err:
            checks[f"timing {spec}"] = {"identical": None, "error": err}
    out["step_seconds"] = timing
    with open(os.path.join(out_dir, f"gloo-{rank}.json.tmp"), "wb") as f:
        import pickle
        pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def nccl_worker(rank, world, init, args, out_dir):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    device = f"cuda:{rank}"
    checks = {}
    for spec in args.specs:
        for name, fn in (("hook", lambda s: run_hook(s, device, 2)[0]), ("opt", lambda s: run_opt(s, device, 2)),
                         ("diloco", lambda s: run_diloco(s, device, 1))):
            model_ok, err = guarded(fn, spec)
            checks[f"{name} {spec}"] = {"ran": err is None and bool(model_ok) and all(model_ok), "error": err}
    out = {"checks": checks, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    with open(os.path.join(out_dir, "nccl.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def spawn(target, world, extra):
    import torch.multiprocessing as mp
    store = os.path.join(tempfile.mkdtemp(prefix="hvdc-e2e-"), "store")
    mp.spawn(target, args=(world, f"file://{store}", *extra), nprocs=world, join=True)


# --- the oracle replay ----------------------------------------------------------------------------
def replay(logs) -> dict:
    """Every logged exchange of the 2 ranks through the oracle: {tag: {"exchanges", "exact", "ok"}}."""
    from hvdcompress import parse_spec
    from hvdcompress.reference import simulate
    out = {}
    if len({len(log) for log in logs}) != 1:
        return {"error": f"the ranks logged different numbers of exchanges: {[len(x) for x in logs]}"}
    for entries in zip(*logs):
        e0 = entries[0]
        tag = f"{e0['tag'][0]} {e0['tag'][1]}"
        row = out.setdefault(tag, {"exchanges": 0, "exact": True, "ok": True, "worst": 0.0})
        row["exchanges"] += 1
        if any((e["tag"], e["key"], e["step"]) != (e0["tag"], e0["key"], e0["step"]) for e in entries):
            row["ok"] = False
            continue
        spec = parse_spec(e0["spec"])
        want, after, _ = simulate(spec, [e["x"] for e in entries], [copy.deepcopy(e["before"]) for e in entries],
                                  key=e0["key"], step=e0["step"], scale=e0["scale"], shape=e0["shape"],
                                  epoch=e0["epoch"], members=e0["members"])
        tol = TOLERANCE.get(spec.name, 0.0)
        pairs = [(e["result"], want) for e in entries]
        pairs += [(e["after"].get(k), v) for r, e in enumerate(entries) for k, v in after[r].items()]
        for got, ref in pairs:
            if got is None:
                row["ok"] = False
                continue
            got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
            if got.shape != ref.shape:
                row["ok"] = False
                continue
            if not np.array_equal(got, ref, equal_nan=True):
                row["exact"] = False
                scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
                err = float(np.nanmax(np.abs(got - ref))) / scale if ref.size else 0.0
                row["worst"] = max(row["worst"], err)
                if not err <= tol:
                    row["ok"] = False
        row["ok"] = row["ok"] and all(np.array_equal(e["result"], e0["result"], equal_nan=True) for e in entries)
    return out


def versions(device_kind) -> dict:
    import torch
    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
         "host": socket.gethostname()}
    if device_kind == "cuda":
        v["device_name"] = torch.cuda.get_device_name(0)
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        v["device_name"] = platform.processor() or "cpu"
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=3, help="steps per spec and front end (DiLoCo: outer syncs)")
    ap.add_argument("--timing-steps", type=int, default=10, help="timed steps per spec (after 3 untimed)")
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the timed MLP")
    ap.add_argument("--specs", nargs="+", default=list(SPECS))
    ap.add_argument("--no-nccl", action="store_true", help="skip the NCCL smoke test")
    ap.add_argument("--out", help="the JSON (default benchmarks/results/gpu/e2e-<device>.json)")
    args = ap.parse_args(argv)
    import torch
    from hvdcompress.registry import registered
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device; run with --device cpu for the CPU smoke run")
    if args.steps < 1 or args.timing_steps < 1 or args.width < 4:
        ap.error("--steps and --timing-steps must be >= 1, --width >= 4")
    started = time.time()
    missing = sorted(set(registered()) - {s.split(":")[0] for s in args.specs})
    report = {"argv": sys.argv[1:], "versions": versions(args.device), "specs": args.specs,
              "registered_not_run": missing, "world": 2, "transport": "torch.distributed gloo"}
    with tempfile.TemporaryDirectory(prefix="hvdc-e2e-out-") as tmp:
        spawn(gloo_worker, 2, (args.device, args, tmp))
        import pickle
        ranks = []
        for r in range(2):
            with open(os.path.join(tmp, f"gloo-{r}.json.tmp"), "rb") as f:
                ranks.append(pickle.load(f))
        report["gloo_probe"] = ranks[0]["gloo_probe"]
        report["gloo_staged"] = ranks[0]["gloo_staged"]
        oracle = replay([r["log"] for r in ranks])
        checks = {}
        for key, c0 in ranks[0]["checks"].items():
            c1 = ranks[1]["checks"].get(key, {})
            row = {"identical": c0["identical"], "error": c0["error"] or c1.get("error")}
            if key in oracle:
                row["oracle"] = oracle[key]
            elif not key.startswith("timing") and "error" not in oracle:
                row["oracle"] = None  # nothing logged (the front end failed before its first exchange)
            row["ok"] = (row["error"] is None and bool(row["identical"]) and all(row["identical"])
                         and bool(row.get("oracle")) and row["oracle"]["ok"]) if not key.startswith("timing") else False
            checks[key] = row
        if "error" in oracle:
            report["oracle_error"] = oracle["error"]
        report["gloo_checks"] = checks
        plain = ranks[0]["step_seconds"]["plain DDP"]
        report["step_seconds"] = {"model": f"MLP 12-{args.width}-{args.width}-4, batch 64 per rank",
                                  "plain_ddp": plain,
                                  "hook": {s: t for s, t in ranks[0]["step_seconds"].items() if s != "plain DDP"},
                                  "hook_over_plain": {s: (t / plain if t else None)
                                                      for s, t in ranks[0]["step_seconds"].items()
                                                      if s != "plain DDP"}}
        failed = [k for k, c in checks.items() if not c["ok"]]
        if args.device == "cuda" and not args.no_nccl:
            spawn(nccl_worker, 1, (args, tmp))
            with open(os.path.join(tmp, "nccl.json")) as f:
                nccl = json.load(f)
            report["nccl_world1"] = nccl
            failed += [f"nccl {k}" for k, c in nccl["checks"].items() if not c["ran"]]
    report["failed"] = failed
    report["seconds"] = round(time.time() - started, 1)
    name = "cpu" if args.device == "cpu" else report["versions"]["device_name"].split()[-1].lower()
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu", f"e2e-{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    n = sum(1 for k in checks if not k.startswith("timing"))
    print(f"gpu_e2e: {n - len([k for k in failed if not k.startswith(('timing', 'nccl'))])}/{n} Gloo checks ok on "
          f"{report['versions']['device_name']}; staged through host memory: {report['gloo_staged'] or 'none'}; "
          f"plain DDP step {plain * 1e3:.2f} ms; {report['seconds']} s; wrote {path}")
    for k in failed:
        print(f"  FAILED {k}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
