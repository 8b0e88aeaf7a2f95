"""Worker code for tests/test_twolevel.py: two-level exchanges on real torch.distributed (Gloo)
processes, nodes emulated on one machine with an explicit ``topology="NxL"``.

``launch(world, local_size, names)`` spawns ``world`` processes once and runs the named scenarios
in each. Every two-level exchange is logged at its outer level (the flat input, the state before,
the result and the state after, with its context), so the pytest side replays it through the
numpy oracle ``hvdcompress.reference.twolevel.simulate_two_level``.
"""

from __future__ import annotations

import copy
import os
from unittest import mock

from scenarios import kit

# one of each kind: dense, a sparsifier with error feedback, a quantizer, low rank, DGC
SPECS = ("none", "topk:ratio=0.1", "qsgd:levels=3,bucket=64", "powersgd:rank=2",
         "dgc:ratio=0.05,min_sparse_numel=64,warmup_epochs=0,clip_norm=5.0")
STEPS = 3
SAVE_AT = 2
BAD = ("3x3", "5", "0", "2x", "ring", 4.5)
MLP = (12, 24, 24, 4)  # Linear, ReLU, Linear, Tanh, Linear


def _model():
    return kit.torch_mlp(MLP)


def _batch(rank, step):
    return kit.torch_batch(rank, step, n=8, features=12)


def _np(t):
    return t.detach().numpy().copy()


class Recorder:
    """Wraps ``TwoLevelTransport.compose`` to log every two-level exchange at its outer level."""

    def __init__(self):
        from torch_ops.twolevel import TwoLevelTransport
        self.log, self.tag = [], None
        self._cls, self._orig = TwoLevelTransport, TwoLevelTransport.compose
        rec, orig = self, self._orig

        def compose(transport, make, x, ctx):
            xin = _np(x.reshape(-1))
            before = {k: _np(v) for k, v in ctx.state.items()}
            result = yield from orig(transport, make, x, ctx)
            if rec.tag is not None:
                rec.log.append({"tag": rec.tag, "spec": str(make.__self__.spec), "key": ctx.key, "step": ctx.step, "shape": tuple(ctx.shape),
                                "members": tuple(ctx.members), "scale": ctx.scale, "epoch": ctx.epoch, "x": xin,
                                "before": before, "result": _np(result),
                                "after": {k: _np(v) for k, v in ctx.state.items()}})
            return result

        TwoLevelTransport.compose = compose

    def restore(self):
        self._cls.compose = self._orig


def _hook_run(spec, topology, steps, first=0, saved=None, rec=None, tag=None):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    state, hook = hddp.comm_hook(spec, model=ddp, optimizer=opt, topology=topology)
    ddp.register_comm_hook(state, hook)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
    identical, checkpoint = [], None
    for step in range(first, first + steps):
        rec.tag = tag
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
        rec.tag = None
        identical.append(kit.dist_identical(model))
        if step + 1 == SAVE_AT and saved is None:
            checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                          "hook": copy.deepcopy(state.state_dict())}
    return model, state, identical, checkpoint


def _opt_run(spec, topology, steps, first=0, saved=None, rec=None, tag=None):
    import torch
    import torch.distributed as dist
    import hvdcompress.torch as hvc
    from hvdcompress.spec import LAYERWISE, resolve
    model = _model()
    schedule = "layerwise" if resolve(spec).info.merge == LAYERWISE else "single"
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   schedule=schedule, backend="torch", topology=topology)
    return recorded_steps(model, opt, dist.get_rank(), steps, first, saved, rec, tag, kit.dist_identical)


def recorded_steps(model, opt, rank, steps, first, saved, rec, tag, same):
    """``steps`` optimizer steps from step ``first`` (after loading ``saved``, a checkpoint), each
    logged under ``tag`` by ``rec``; per step ``same(model)`` (replicas identical), and the
    checkpoint after SAVE_AT steps of a fresh run. Returns (model, opt, identical, checkpoint)."""
    import torch.nn as nn
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    identical, checkpoint = [], None
    for step in range(first, first + steps):
        rec.tag = tag
        opt.zero_grad()
        x, y = _batch(rank, step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        rec.tag = None
        identical.append(same(model))
        if step + 1 == SAVE_AT and saved is None:
            checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    return model, opt, identical, checkpoint


def every_spec(rec, topology) -> dict:
    """Each spec through the DDP hook and the optimizer, two-level: identical parameters every step,
    the exchanges logged for the oracle, a checkpoint after SAVE_AT steps resumed exactly, and the
    bytes per hop."""
    import torch
    out = {}
    for spec in SPECS:
        for path, run in (("hook", _hook_run), ("opt", _opt_run)):
            model, obj, identical, ckpt = run(spec, topology, STEPS, rec=rec, tag=(path, spec))
            resumed, obj2, ident2, _ = run(spec, topology, STEPS - SAVE_AT, first=SAVE_AT, saved=ckpt, rec=rec,
                                           tag=(path + "-resumed", spec))
            out[(path, spec)] = {"identical": identical + ident2,
                                 "resumed_equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(resumed))),
                                 "moved": float((kit.torch_flat(model) - kit.torch_flat(_model())).abs().max()),
                                 "hops": dict(obj.stats.total_hop_bytes), "bytes": obj.stats.total_bytes,
                                 "two_level": type(obj.session.transport).__name__ if path == "hook" else
                                 type(obj.engine.transport).__name__}
    return out


DELAYED = (("topk:ratio=0.1", 2, 1), ("qsgd:levels=3,bucket=64", 1, 2))  # (spec, delay, sync_every)
DELAYED_STEPS = 5


def _delayed_run(spec, delay, every, topology, first, saved, rec, tag):
    """``DELAYED_STEPS - first`` steps of delayed averaging from step ``first`` (after loading
    ``saved``), then ``flush``; the checkpoint taken after SAVE_AT steps of a fresh run."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.torch as hvc
    model = _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=spec, schedule="single",
                                   backend="torch", topology=topology, delay=delay, sync_every=every)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    checkpoint, rec.tag = None, tag
    for step in range(first, DELAYED_STEPS):
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        if step + 1 == SAVE_AT and saved is None:
            checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    opt.flush()
    rec.tag = None
    return model, opt, checkpoint


def delayed(rec, topology) -> dict:
    """Delayed averaging (``delay``, ``sync_every``) on the two-level exchange: every exchange the
    policy launches is a two-level one (logged for the oracle), replicas identical after ``flush``,
    and a run resumed from a checkpoint taken with exchanges in flight ends where the first did."""
    import torch
    out = {}
    for spec, delay, every in DELAYED:
        model, opt, ckpt = _delayed_run(spec, delay, every, topology, 0, None, rec, ("delayed", spec))
        resumed, _, _ = _delayed_run(spec, delay, every, topology, SAVE_AT, ckpt, rec, ("delayed-resumed", spec))
        out[spec] = {"identical": kit.dist_identical(model),
                     "resumed_equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(resumed))),
                     "transport": type(opt.engine.transport).__name__,
                     "hops": dict(opt.stats.total_hop_bytes)}
    return out


def bad_topology(rec, topology) -> dict:
    """Every bad ``topology=`` is a ValueError on every rank, before any collective (the world's
    next collective still lines up), from both front ends."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    import hvdcompress.torch as hvc
    out = {}
    for bad in BAD:
        for path in ("opt", "hook"):
            model = _model()
            try:
                if path == "opt":
                    hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression="topk:ratio=0.1",
                                             backend="torch", topology=bad)
                else:
                    hddp.comm_hook("topk:ratio=0.1", model=nn.parallel.DistributedDataParallel(model),
                                   topology=bad)
                out[(path, str(bad))] = "accepted"
            except ValueError as e:
                out[(path, str(bad))] = str(e)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def nonfinite(rec, topology) -> dict:
    """A NaN in one rank's gradient: NaN in every rank's exchanged gradient, no NaN left in any
    rank's cross-hop state, and the next step finite and identical again."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.torch as hvc
    model = _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression="topk:ratio=0.1",
                                   schedule="single", backend="torch", topology=topology)
    out = {}
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        if step == 1 and dist.get_rank() == dist.get_world_size() - 1:
            x[0, 0] = float("nan")  # the gradients are exchanged as backward makes them
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.synchronize()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        state = opt.engine.session.param_state()
        out[step] = {"all_nan": bool(torch.isnan(grads).all()), "finite": bool(torch.isfinite(grads).all()),
                     "state_finite": all(bool(torch.isfinite(t).all()) for st in state.values() for t in st.values()),
                     "state_keys": sorted({k for st in state.values() for k in st})}
        if step == 1:
            opt.zero_grad()
            with opt.skip_synchronize():
                opt.step()
        else:
            with opt.skip_synchronize():
                opt.step()
        out[step]["identical"] = kit.dist_identical(model)
    return out


def launcher_default(rec, topology) -> dict:
    """topology=None follows LOCAL_WORLD_SIZE (torchrun's); "flat" opts out."""
    import torch
    import hvdcompress.torch as hvc
    out = {}
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": topology.split("x")[1]}):  # restored after
        for arg in (None, "flat"):
            model = _model()
            opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression="topk:ratio=0.1",
                                           backend="torch", topology=arg)
            out[str(arg)] = type(opt.engine.transport).__name__
    return out


def _worker(rank, world, port, topology, names, out_dir):
    kit.gloo_init(rank, world, port)
    rec = Recorder()
    out = kit.run_scenarios(names, lambda name: globals()[name](rec, topology))
    rec.restore()
    out["log"] = rec.log
    kit.gloo_finish(out, out_dir, rank)


def launch(world: int, topology: str, names) -> list:
    """One spawn of ``world`` Gloo processes running ``names`` with ``topology``; every rank's results."""
    return kit.gloo_spawn(_worker, world, (topology, list(names)), prefix="hvc-twolevel-")
