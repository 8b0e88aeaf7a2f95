"""Worker code for tests/test_twolevel.py's Horovod part: two-level exchanges of
``DistributedOptimizer`` (backend "horovod") through Horovod process sets, on 4 Horovod/Gloo
workers as 2 nodes x 2 ranks.

``launch(names)`` starts the 4 workers once (``horovodrun``'s Gloo, as the other Horovod scenarios)
and runs the named scenarios in each. One machine's launcher states one node, so the worker stands
in for a two-node launcher in ``init``: ``hvdcompress.torch.init()`` registers the node sets as it
does for a launcher of 2 nodes of 2 (its ``launcher_groups`` answered so), and the cross-node sets
are added when the first optimizer is built (the workers run with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``):
both ways a set is made are used. Every two-level exchange is logged at its outer level
(``scenarios.twolevel.Recorder``) for the pytest side's replay through the numpy oracle.
"""

from __future__ import annotations

import os
from unittest import mock

from scenarios import kit
from scenarios.twolevel import SAVE_AT, recorded_steps

TOPOLOGY = "2x2"
SPECS = ("none", "qsgd:levels=3,bucket=64", "topk:ratio=0.1", "powersgd:rank=2")
STEPS = 3
MLP = (12, 24, 24, 4)
NODE_SETS = [(0, 1), (2, 3)]


def _model():
    return kit.torch_mlp(MLP)


def _optimizer(model, spec, topology, **kw):
    import torch
    import hvdcompress.torch as hvc
    from hvdcompress.spec import LAYERWISE, resolve
    kw.setdefault("schedule", "layerwise" if resolve(spec).info.merge == LAYERWISE else "single")
    return hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                                    named_parameters=model.named_parameters(), compression=spec,
                                    topology=topology, **kw)


def _run(spec, steps, first=0, saved=None, rec=None, tag=None):
    import horovod.torch as hvd
    model = _model()
    opt = _optimizer(model, spec, TOPOLOGY)
    checks = iter(range(first, first + steps))
    return recorded_steps(model, opt, hvd.rank(), steps, first, saved, rec, tag,
                          lambda m: kit.torch_identical(m, name=f"check.{tag}.{next(checks)}"))


def every_spec(rec) -> dict:
    """Each spec two-level on Horovod: identical parameters every step, the exchanges logged for the
    oracle, a checkpoint after SAVE_AT steps resumed exactly, the bytes per hop and the transports."""
    import torch
    out = {}
    for spec in SPECS:
        model, opt, identical, ckpt = _run(spec, STEPS, rec=rec, tag=("opt", spec))
        resumed, _, ident2, _ = _run(spec, STEPS - SAVE_AT, first=SAVE_AT, saved=ckpt, rec=rec,
                                     tag=("opt-resumed", spec))
        t = opt.engine.transport
        out[spec] = {"identical": identical + ident2,
                     "resumed_equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(resumed))),
                     "moved": float((kit.torch_flat(model) - kit.torch_flat(_model())).abs().max()),
                     "hops": dict(opt.stats.total_hop_bytes), "bytes": opt.stats.total_bytes,
                     "transports": [type(t).__name__, type(t.local).__name__, type(t.cross).__name__],
                     "sets": [list(t.local.process_set.ranks), list(t.cross.process_set.ranks)]}
    return out


def launcher_default(rec) -> dict:
    """topology=None follows HOROVOD_LOCAL_SIZE (horovodrun's, read when the optimizer is built);
    "flat" opts out; an explicit topology on a process set smaller than the job is refused on every
    rank before any collective."""
    import horovod.torch as hvd
    import torch
    out = {}
    launcher = {"HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_SIZE": "2"}  # a launcher of 2 nodes of 2
    with mock.patch.dict(os.environ, launcher):  # restored after
        for arg in (None, "flat"):
            out[str(arg)] = type(_optimizer(_model(), "topk:ratio=0.1", arg).engine.transport).__name__
    from torch_ops.collectives import process_sets
    try:
        _optimizer(_model(), "topk:ratio=0.1", TOPOLOGY, process_set=process_sets(NODE_SETS)[hvd.rank() // 2])
        out["subset"] = "accepted"
    except ValueError as e:
        out["subset"] = str(e)
    out["after"] = float(hvd.allreduce(torch.ones(1), name="after.refusal", op=hvd.Sum))
    return out


def route_choice(rec) -> dict:
    """The default path on a two-level topology (cost-model schedule, codec choice, measured
    validation): each hop profiled on its process sets, the routes measured and kept alike on
    every rank, saved with the plan."""
    import horovod.torch as hvd
    import torch.nn as nn
    model = kit.torch_mlp((32, 96, 96, 4))
    opt = _optimizer(model, "topk:ratio=0.05", TOPOLOGY, schedule="auto", tune_steps=1, profile_steps=2)
    steps = []
    for step in range(80):
        opt.zero_grad()
        x, y = kit.torch_batch(hvd.rank(), step, n=8, features=32)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        steps.append({"identical": kit.torch_identical(model, name=f"check.route.{step}"),
                      "routes": dict(opt.stats.routes)})
        choice = opt.engine.transport.route_choice
        if choice.record is not None and opt.engine.scheduler.done:
            break
    saved = opt.state_dict()
    return {"steps": steps, "record": choice.record, "routes": dict(choice.routes), "model": choice.model is not None,
            "saved_routes": saved.get("hvdcompress", {}).get("plan", {}).get("routes"), "notes": list(opt.plan.notes)}


def _worker(names):
    """One worker: ``hvdcompress.torch.init()`` registering the node sets (a two-node launcher's,
    module doc), then the scenarios, each logged by one ``Recorder``."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    from scenarios.twolevel import Recorder
    from hvdcompress import topology
    launcher = topology.launcher_groups
    topology.launcher_groups = lambda env=None: list(NODE_SETS)
    try:
        hvc.init()
    finally:
        topology.launcher_groups = launcher
    rec = Recorder()
    out = kit.run_scenarios(names, lambda name: globals()[name](rec))
    rec.restore()
    out["log"] = rec.log
    hvd.barrier()
    hvd.shutdown()
    return out


def launch(names) -> list:
    """One launch of 4 Horovod/Gloo workers running ``names``; every rank's results."""
    from scenarios.launch import run_workers
    return run_workers(_worker, 4, list(names), env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, start_timeout=120)
