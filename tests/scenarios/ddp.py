"""Worker code for tests/test_torch_distributed.py: real torch.distributed (Gloo) processes, no Horovod.

``launch(world, names)`` starts ``world`` processes with ``torch.multiprocessing`` (spawn) once and
runs the named scenarios in sequence in each; every process blocks Horovod's import first
(``sys.modules["horovod"] = None``), so any import of it on these paths fails the scenario. Each
rank returns plain Python / numpy data: per-step parameter equality across ranks, and a log of
every exchange (key, step, layout, input, state before, result, state after) for the pytest side
to replay through the numpy oracle.
"""

from __future__ import annotations

import os
import sys

from scenarios import kit

# every registered algorithm, with parameters that make it act on a 1k-parameter MLP (no dense fallback)
SPECS = ("none", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1", "threshold:threshold=0.05",
         "dgc:ratio=0.05,min_sparse_numel=64,warmup_epochs=0,clip_norm=5.0",
         "sketch:ratio=0.1,cols_ratio=0.3,min_sketch_numel=64", "signsgd", "efsignsgd", "onebit",
         "terngrad", "qsgd:levels=3,bucket=64", "powersgd:rank=2")
STEPS = 4  # the first runs on DDP's initial bucket, the others on the rebuilt ones
SAVE_AT = 2  # checkpoint after this many steps, resume, compare the last STEPS - SAVE_AT steps
BAD = {"ratio": "topk:ratio=2", "unknown": "dgc:colums=3", "name": "nosuch"}


def _model():
    return kit.torch_mlp((12, 24, 24, 4))  # Linear, ReLU, Linear, Tanh, Linear


def _batch(rank, step):
    return kit.torch_batch(rank, step, n=8, features=12)


def _np(t):
    import torch
    return t.detach().to(torch.float64).numpy() if t.dtype == torch.bfloat16 else t.detach().numpy().copy()


class Recorder:
    """Wraps every compressor class's ``exchange`` to log what went in and came out."""

    def __init__(self):
        from torch_ops.compressors import COMPRESSORS
        self.log, self.tag = [], None
        self._saved = {}
        for cls in set(COMPRESSORS.values()):
            self._saved[cls] = cls.exchange
            cls.exchange = self._wrap(cls.exchange)

    def _wrap(self, orig):
        rec = self

        def exchange(comp, x, ctx):
            xin = _np(x)
            before = {k: _np(v) for k, v in ctx.state.items()}
            result = yield from orig(comp, x, ctx)
            if rec.tag is not None:
                rec.log.append({"tag": rec.tag, "spec": str(comp.spec), "key": ctx.key, "step": ctx.step, "shape": tuple(ctx.shape),
                                "members": tuple(ctx.members), "scale": ctx.scale, "epoch": ctx.epoch, "x": xin,
                                "before": before, "result": _np(result),
                                "after": {k: _np(v) for k, v in ctx.state.items()}})
            return result

        return exchange

    def restore(self):
        for cls, fn in self._saved.items():
            cls.exchange = fn


def _hook_run(spec, steps, first=0, saved=None, rec=None, tag=None):
    """A DDP model with our hook (tiny buckets: several per step, rebuilt after the first), SGD
    with momentum and weight decay (taken over by DGC and the sketch)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    state, hook = hddp.comm_hook(spec, model=ddp, optimizer=opt)
    ddp.register_comm_hook(state, hook)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
    identical, checkpoint = [], None
    for step in range(first, first + steps):
        if rec is not None:
            rec.tag = tag
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
        if rec is not None:
            rec.tag = None
        identical.append(kit.dist_identical(model))
        if step + 1 == SAVE_AT and saved is None:
            import copy
            checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                          "hook": copy.deepcopy(state.state_dict())}
    return model, state, identical, checkpoint


def _opt_run(spec, steps, first=0, saved=None, rec=None, tag=None, **kw):
    """Our DistributedOptimizer on torch.distributed (backend="torch"), merged groups where the
    compressor allows ("single"), else layerwise."""
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    from hvdcompress.spec import LAYERWISE, resolve
    model = _model()
    schedule = kw.pop("schedule", "layerwise" if resolve(spec).info.merge == LAYERWISE else "single")
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule, backend="torch", **kw)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    identical, checkpoint = [], None
    import torch.distributed as dist
    for step in range(first, first + steps):
        if rec is not None:
            rec.tag = tag
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        if rec is not None:
            rec.tag = None
        identical.append(kit.dist_identical(model))
        if step + 1 == SAVE_AT and saved is None:
            import copy
            checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    return model, opt, identical, checkpoint


def every_compressor(rec) -> dict:
    """Each spec through the hook and through the optimizer: identical parameters every step, the
    exchanges logged for the oracle, and a checkpoint after SAVE_AT steps resumed exactly."""
    import torch
    out = {}
    for spec in SPECS:
        for path, run in (("hook", _hook_run), ("opt", _opt_run)):
            model, obj, identical, ckpt = run(spec, STEPS, rec=rec, tag=(path, spec))
            resumed, _, ident2, _ = run(spec, STEPS - SAVE_AT, first=SAVE_AT, saved=ckpt)
            out[(path, spec)] = {"identical": identical + ident2,
                                 "resumed_equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(resumed))),
                                 "moved": float((kit.torch_flat(model) - kit.torch_flat(_model())).abs().max()),
                                 "ratio": obj.stats.ratio}
    return out


FUSED_SPEC = "powersgd:rank=2"
FUSED_STEPS = 3


def fused(rec) -> dict:
    """PowerSGD (layerwise: every bucket split per parameter) through the hook, with one bucket for
    the whole model and with tiny buckets: the collectives the communicator issued in each step and
    the buckets DDP handed over, identical parameters every step; the one-bucket run's exchanges are
    logged (tag ``("hook-one-bucket", FUSED_SPEC)``) for the oracle replay."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    out = {}
    for tag, cap in (("one_bucket", 25.0), ("tiny_buckets", 0.002)):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        state, hook = hddp.comm_hook(FUSED_SPEC, model=ddp, optimizer=opt)
        calls = []

        def counting(st, bucket, calls=calls):
            calls[-1] += 1
            return hook(st, bucket)

        ddp.register_comm_hook(state, counting)
        steps = []
        for step in range(FUSED_STEPS):
            calls.append(0)
            before = dict(state.transport.collectives)
            if tag == "one_bucket":
                rec.tag = ("hook-one-bucket", FUSED_SPEC)
            opt.zero_grad()
            x, y = _batch(dist.get_rank(), step)
            nn.CrossEntropyLoss()(ddp(x), y).backward()
            opt.step()
            rec.tag = None
            after = state.transport.collectives
            steps.append({"buckets": calls[-1], "collectives": {k: after[k] - before[k] for k in after},
                          "identical": kit.dist_identical(model)})
        out[tag] = steps
    return out


def bad_specs() -> dict:
    """Bad specs and arguments raise ValueError on every rank, before any collective (the next
    collective, a barrier, then meets on every rank)."""
    import torch
    import torch.nn as nn
    import torch.distributed as dist
    import hvdcompress.ddp as hddp
    import hvdcompress.torch as hvc
    ddp = nn.parallel.DistributedDataParallel(_model())
    out = {}
    cases = {f"hook.{k}": (lambda s=s: hddp.comm_hook(s, model=ddp)) for k, s in BAD.items()}
    cases.update({f"opt.{k}": (lambda s=s: hvc.DistributedOptimizer(
        torch.optim.SGD(_model().parameters(), lr=0.1), compression=s, backend="torch")) for k, s in BAD.items()})
    cases["opt.backend"] = lambda: hvc.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1),
                                                            backend="mpi")
    cases["opt.horovod_missing"] = lambda: hvc.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    cases["hook.optimizer"] = lambda: hddp.comm_hook("topk", model=ddp, optimizer="sgd")
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    dist.barrier()
    out["met_again"] = True
    return out


def nonfinite() -> dict:
    """A NaN gradient on one rank: NaN parameters on every rank (not hidden), compression state finite."""
    import torch
    import torch.nn as nn
    import torch.distributed as dist
    import hvdcompress.ddp as hddp
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state, hook = hddp.comm_hook("topk:ratio=0.1", model=ddp, optimizer=opt)
    ddp.register_comm_hook(state, hook)
    finite = []
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        if step == 1 and dist.get_rank() == 1:
            x[0, 0] = float("nan")
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
        finite.append(bool(torch.isfinite(kit.torch_flat(model)).all()))
    st = state.param_state()
    return {"params_finite": finite, "any_param_nan": bool(torch.isnan(kit.torch_flat(model)).any()),
            "state_finite": all(bool(torch.isfinite(t).all()) for s in st.values() for t in s.values()),
            "state_keys": sorted(st)}


def auto_schedule() -> dict:
    """The default cost-model schedule on torch.distributed: the profiler's timed collectives, the
    scheduler's object collectives and a plan, identical parameters throughout."""
    _, opt, identical, _ = _opt_run("topk:ratio=0.1", 5, schedule="mgs", profile_steps=2, tune_steps=0)
    return {"identical": identical, "plan": None if opt.plan is None else opt.plan.schedule,
            "world": opt.cost_model.world_size if opt.cost_model is not None else None,
            "meta": {k: v for k, v in (opt.cost_model.meta or {}).items() if k in ("torch.distributed", "horovod")}}


def default_choice() -> dict:
    """The per-group codec choice as the default on torch.distributed: top-k under "auto" with
    measured validation (a hand-built cost model in which top-k is dear, so the choice sends its
    groups with fp16 or dense, and one profiled step, for speed): the plan's object collectives,
    the candidates' fp16 / dense allreduces and identical parameters every step."""
    from hvdcompress.schedule.costmodel import ComputeFit, CostModel
    import torch.distributed as dist
    spec = "topk:ratio=0.1"
    model = CostModel.from_link(dist.get_world_size(), gbit_per_s=1.0, latency_s=5e-3,
                                compress={spec: ComputeFit("linear", 1e-9, 5e-2),
                                          "fp16": ComputeFit("linear", 1e-12, 1e-7)})
    from hvdcompress.schedule.tuning import MAX_CHOICE_CANDIDATES
    # profiled at step 1, then at most MAX_CHOICE_CANDIDATES candidates x (1 + 3) steps
    steps = 4 + 4 * MAX_CHOICE_CANDIDATES
    _, opt, identical, _ = _opt_run(spec, steps, schedule="auto", cost_model=model, profile_steps=1)
    tuning = opt.plan.tuning
    return {"steps": steps, "identical": identical, "codec_choice": opt.codec_choice, "tuning_now": opt.engine.scheduler.tuning,
            "candidates": [c["codecs"] for c in tuning["candidates"]], "kept": tuning["kept"]}


def delayed() -> dict:
    """Delayed averaging on torch.distributed: exchanges in flight across steps, then a flush makes
    the replicas identical."""
    _, opt, identical, _ = _opt_run("topk:ratio=0.1", 4, delay=1)
    opt.flush()
    import torch.distributed as dist
    import torch
    flat = torch.cat([p.detach().reshape(-1) for g in opt.param_groups for p in g["params"]])
    rows = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, flat)
    return {"identical_before_flush": identical, "identical_after_flush": all(torch.equal(rows[0], r) for r in rows)}


def communicator() -> dict:
    """Requests of every kind and size (empty, uneven), several in one round, rounds interleaved."""
    import torch
    import torch.distributed as dist
    from torch_ops.collectives import Allgather, Allreduce, Alltoall, Flag
    from torch_ops.dist_collectives import TorchDistCommunicator
    c = TorchDistCommunicator()
    r, n = c.rank(), c.size()
    a = c.launch((Allgather(torch.arange(r + 1, dtype=torch.int32)), Allreduce(torch.full((3,), float(r + 1))),
                  Allgather(torch.zeros(0)), Flag(torch.ones(1)), Allgather(torch.ones(2, 3) * r)), "a")
    splits = tuple((r + d) % 2 + 1 for d in range(n))
    b = c.launch((Alltoall(torch.arange(sum(splits), dtype=torch.float64) + 100 * r, splits),), "b")
    odd = c.launch((Allgather(torch.arange(r, dtype=torch.int16) - 300), Allreduce(torch.full((2,), r + 7, dtype=torch.int16))),
                   "odd")  # a dtype Gloo does not move: bytes / a wider sum
    rb = c.wait(b)
    ra = c.wait(a)
    ro = c.wait(odd)
    # a batch: the small float32 allreduces of three launches in one collective, float64 in another,
    # the large one alone, one row-count collective for both gathers, and a wait inside the batch
    from torch_ops.dist_collectives import FUSE_REQUEST_BYTES
    counted = dict(c.collectives)
    big = torch.full((FUSE_REQUEST_BYTES // 4 + 1,), float(r))
    small = torch.full((4,), float(r))
    with c.batch():
        f1 = c.launch((Allreduce(small), Flag(torch.ones(1)), Allgather(torch.full((r,), r))), "f1")
        f2 = c.launch((Allreduce(torch.full((2,), r + 0.5, dtype=torch.float64)), Allreduce(big),
                       Allreduce(torch.arange(3, dtype=torch.float32) * (r + 1)),
                       Allgather(torch.ones(1, 2) * r)), "f2")
        f3 = c.launch((Allreduce(torch.full((2,), 2.0 ** -30 * (r + 1))),), "f3")
        issued_inside = dict(c.collectives)
        rf3 = c.wait(f3)  # waited for inside the batch: the batch so far is issued
        f4 = c.launch((Allreduce(torch.ones(5)), Allreduce(torch.full((1,), 3.0, dtype=torch.float64))), "f4")
    rf1, rf2, rf4 = c.wait(f1), c.wait(f2), c.wait(f4)
    batch_counts = {k: c.collectives[k] - counted[k] for k in counted}
    batch_inside = {k: issued_inside[k] - counted[k] for k in counted}
    fused = {"f1": [t.tolist() for t in rf1],
             "f2": [rf2[0].tolist(), rf2[1][:3].tolist(), rf2[1].numel()] + [t.tolist() for t in rf2[2:]], "f3": rf3[0].tolist(), "f4": [t.tolist() for t in rf4],
             "in_place": rf2[1] is big and rf1[0] is small,  # allreduce sums in place, fused or not
             "counts": batch_counts, "inside": batch_inside}
    objs = c.allgather_object({"rank": r, "pad": "x" * (7 * r)}, "o")
    root = c.broadcast_object(("from", r), "bc", root=n - 1)
    # same-shape gathers: as an allreduce of their bytes at two ranks, without a sizes stage at more
    before = dict(c.collectives)
    same = c.wait(c.launch((Allgather(torch.ones(2, 3) * r, True), Allgather(torch.full((5,), r + 250, dtype=torch.uint8), True),
                            Allgather(torch.arange(3, dtype=torch.int16) - 300 * r, True), Allgather(torch.zeros(0), True)),
                           "same"))
    same = {"values": [t.tolist() for t in same], "dtypes": [str(t.dtype) for t in same],
            "counts": {k: c.collectives[k] - before[k] for k in before}}
    mean = c.allreduce_(torch.tensor([float(r)]), "m", average=True)
    c.barrier()
    return {"gather_int": ra[0].tolist(), "sum": ra[1].tolist(), "empty": list(ra[2].shape), "flag": ra[3].tolist(),
            "gather_2d": ra[4].tolist(), "alltoall": rb[0].tolist(), "splits": splits, "objs": objs, "root": root,
            "mean": mean.tolist(), "int16": [ro[0].tolist(), str(ro[0].dtype), ro[1].tolist(), str(ro[1].dtype)],
            "poll": c.poll(a), "rank": r, "size": n, "versions": c.versions(), "fused": fused,
            "backend": dist.get_backend(), "same": same}


def diloco() -> dict:
    """DiLoCo on this process group (``backend="torch"``, no Horovod): tests/test_diloco.py's
    reference runs, and a checkpoint taken with a fragment in flight, resumed."""
    from scenarios import diloco as sc
    return {"reference": sc.compare_with_reference(sc.TORCH_CONFIGS, sc.TORCH_STEPS, backend="torch"),
            "checkpoint": sc.checkpoint_resume(sc.CKPT, 9, 5, backend="torch")}


def example() -> dict:
    """examples/ddp_digits.py, 2 steps, in this process group."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    import ddp_digits
    return ddp_digits.main(["--compression", "dgc:ratio=0.01", "--max-steps", "2", "--epochs", "1"])


def _worker(rank, world, port, names, out_dir):
    kit.gloo_init(rank, world, port)
    rec = Recorder()
    out = kit.run_scenarios(names, lambda name: globals()[name](rec) if name in ("every_compressor", "fused") else globals()[name]())
    rec.restore()
    out["log"] = rec.log
    out["horovod_imported"] = sorted(m for m, v in sys.modules.items() if m.startswith("horovod") and v is not None)
    kit.gloo_finish(out, out_dir, rank)


def launch(world: int, names) -> list:
    """One spawn of ``world`` Gloo processes running ``names``; every rank's results, rank order."""
    return kit.gloo_spawn(_worker, world, (list(names),), prefix="hvc-ddp-")
