"""Worker code for tests/test_two_level_route.py: flat or two-level per group on real
torch.distributed (Gloo) processes, 2 nodes x 2 ranks emulated with an explicit ``topology="2x2"``.

``launch(names)`` spawns 4 processes once and runs the named scenarios in each:

* ``switching``: one exchange session (the front-end API) on a route-choosing transport whose
  routes the scenario sets per step (flat, two-level, back and forth), beside sessions on a plain
  two-level transport and on the world's alone fed the same gradients; every exchange is logged
  at its outer level (input, state before, result, state after) for the pytest side;
* ``picks``: ``DistributedOptimizer(backend="torch")`` given a two-level cost model (intra link
  fast, inter link slow) and ``tune_steps=0``: the model's routes are kept, per spec;
* ``validated``: the default path (cost-model schedule, codec choice, measured validation):
  the routes' measured validation runs and decides alike on every rank.
"""

from __future__ import annotations


from scenarios import kit

MLP = (32, 96, 96, 4)
TOPOLOGY = "2x2"
# the model the ``picks`` runs plan with: a node's links fast, the links between nodes slow
LINKS = dict(nodes=2, local_size=2, intra_gbps=0.02, inter_gbps=0.001, intra_latency_s=2e-6, inter_latency_s=1e-6)
PICKS = ("qsgd:levels=3,bucket=64", "dgc:ratio=0.001,min_sparse_numel=64,warmup_epochs=0")
SWITCH_SPEC = "topk:ratio=0.1"
ROUTES = ("flat", "two-level", "two-level", "flat", "two-level", "flat", "flat", "two-level")


def _np(t):
    return t.detach().numpy().copy()


def _batch(rank, step):
    return kit.torch_batch(rank, step, n=8, features=MLP[0])


def _train(opt, model, steps):
    """``steps`` steps; per step whether the replicas are identical, and the stats' routes."""
    import torch.distributed as dist
    import torch.nn as nn
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        out.append({"identical": kit.dist_identical(model), "routes": dict(opt.stats.routes)})
    return out


def switching() -> dict:
    """Sessions fed the same gradients: ``switching`` (routes set per step from ROUTES),
    ``fixed-two-level`` / ``fixed-flat`` (route-choosing transports held on one route),
    ``two-level`` (the plain two-level transport) and ``flat`` (the world's); step 4 regroups."""
    import torch
    import torch.distributed as dist
    from hvdcompress.spec import resolve
    from hvdcompress.topology import resolve_topology
    from torch_ops.dist_collectives import TorchDistCommunicator
    from torch_ops.session import ExchangeSession
    from torch_ops.twolevel import two_level_transport

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = resolve_topology(TOPOLOGY, world)
    params = {"w": torch.zeros(6, 10), "b": torch.zeros(7)}
    spec = resolve(SWITCH_SPEC)
    world_t = TorchDistCommunicator()
    transports = {"switching": two_level_transport(world_t, topo, choose_routes=True),
                  "fixed-two-level": two_level_transport(world_t, topo, choose_routes=True),
                  "fixed-flat": two_level_transport(world_t, topo, choose_routes=True),
                  "two-level": two_level_transport(world_t, topo), "flat": world_t}
    sessions = {k: ExchangeSession(spec, params, t) for k, t in transports.items()}
    log = {k: [] for k in sessions}
    for step, route in enumerate(ROUTES):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        groups = [("w", "b")] if step == 4 else [("w",), ("b",)]  # a regrouping, and back
        for kind, session in sessions.items():
            choice = getattr(session.transport, "route_choice", None)
            if choice is not None:
                choice.assign(groups, [sum(params[n].numel() * 4 for n in g) for g in groups],
                              [str(spec)] * len(groups))
                held = {"switching": route, "fixed-two-level": "two-level", "fixed-flat": "flat"}[kind]
                choice.routes = {k: held for k in choice.routes}
            for names in groups:
                key = names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}"
                x = torch.cat([grads[n].reshape(-1) for n in names])
                state = session.state_for(names)
                before = {k: _np(v) for k, v in state.items()}
                ex = session.start(x.clone(), names, key=key, step=step, name=f"hvc.{kind}.{key}.{step}")
                session.pending.add(key, ex, step)
                done = session.pending.finish(step)
                log[kind].append({"step": step, "key": key, "route": route, "x": _np(x), "before": before,
                                  "result": _np(done[key].result), "after": {k: _np(v) for k, v in state.items()}})
            session.end_step([], 0)
    return {"log": log, "labels": dict(sessions["switching"].stats.routes)}


def _fitted_links(spec, optimizer):
    """``LINKS`` as a two-level cost model with compression fits for the spec (as the optimizer
    adapts it), fp16 and dense, so that nothing is timed: the picks are the model's alone."""
    from hvdcompress.schedule.costmodel import ComputeFit
    from hvdcompress.schedule.twolevel import TwoLevelCostModel
    from hvdcompress.spec import resolve
    from torch_ops.compressors import compressor_class
    groups = [dict(g) for g in optimizer.param_groups]
    adapted = compressor_class(resolve(spec)).adapt_optimizer(resolve(spec), groups)
    fits = {str(resolve(s)): ComputeFit("linear", 2e-10, 1e-4) for s in (adapted, "fp16", "none")}
    return TwoLevelCostModel.from_links(**LINKS, compress=fits, decompress=dict(fits))


def picks() -> dict:
    import torch
    import hvdcompress.torch as hvc
    out = {}
    for spec in PICKS:
        model = kit.torch_mlp(MLP)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=spec,
                                       backend="torch", topology=TOPOLOGY, codec_choice="auto", tune_steps=0,
                                       schedule="single", profile_steps=2, cost_model=_fitted_links(spec, sgd))
        steps = _train(opt, model, 6)
        choice = opt.engine.transport.route_choice
        out[spec] = {"steps": steps, "modelled": dict(choice.modelled), "routes": dict(choice.routes),
                     "labels": dict(opt.stats.routes), "codecs": opt.plan.codecs, "notes": list(opt.plan.notes)}
    return out


def validated() -> dict:
    import torch
    import hvdcompress.torch as hvc
    model = kit.torch_mlp(MLP)
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression="topk:ratio=0.05",
                                   backend="torch", topology=TOPOLOGY, tune_steps=1)
    steps = []
    for _ in range(80):
        steps += _train(opt, model, 1)
        if opt.engine.transport.route_choice.record is not None and opt.engine.scheduler.done:
            break
    steps += _train(opt, model, 2)
    choice = opt.engine.transport.route_choice
    saved = opt.state_dict()
    return {"steps": steps, "record": choice.record, "routes": dict(choice.routes), "codec_choice": opt.codec_choice,
            "saved_routes": saved.get("hvdcompress", {}).get("plan", {}).get("routes") if isinstance(saved, dict)
            else None, "notes": list(opt.plan.notes)}


def _worker(rank, world, port, names, out_dir):
    kit.gloo_init(rank, world, port)
    out = kit.run_scenarios(names, lambda name: globals()[name]())
    kit.gloo_finish(out, out_dir, rank)


def launch(names) -> list:
    """One spawn of 4 Gloo processes (2 nodes x 2) running ``names``; every rank's results."""
    return kit.gloo_spawn(_worker, 4, (list(names),), prefix="hvc-route-")
