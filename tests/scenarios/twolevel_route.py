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
  the routes' measured validation runs and decides alike on every rank;
* ``hook_validated``: the DDP hook with ``routes="auto"``: the links fitted after the first step,
  the trial restarted when DDP rebuilds its buckets, the routes measured and kept alike on every
  rank, a checkpoint after the decision resumed exactly; every exchange logged (``RouteLog``)
  with its route and fold for the oracle's replay;
* ``hook_picks``: the DDP hook given a two-level cost model and ``tune_steps=0``: the model's
  route per bucket, per spec;
* ``hook_arguments``: ``routes=`` / ``tune_steps=`` / ``cost_model=`` resolved or refused on every
  rank before any collective.
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


# -- the DDP hook ------------------------------------------------------------------------------------
HOOK_SPEC = "topk:ratio=0.05"
HOOK_TUNE_STEPS = 1
HOOK_MAX_STEPS = 30  # the decision comes after 2 + 3 x (1 + HOOK_TUNE_STEPS) steps
HOOK_AFTER = 3  # steps after the decision; the checkpoint after the first of them
HOOK_BUCKET_MB = 0.01  # DDP's first step: one bucket (its first-bucket cap); then several


class RouteLog:
    """Logs every exchange of a route-choosing transport at its outer level (input, state before,
    result, state after, context) with its route and whether its state was folded
    (``RouteChoice.take``), under ``tag``, for the oracle's replay on the pytest side."""

    def __init__(self):
        from torch_ops.twolevel import RouteChoice, TwoLevelTransport
        self.log, self.tag, self._taken = [], None, None
        self._patched = [(TwoLevelTransport, "compose", TwoLevelTransport.compose),
                         (RouteChoice, "take", RouteChoice.take)]
        log, compose, take = self, TwoLevelTransport.compose, RouteChoice.take

        def taking(choice, key):
            log._taken = take(choice, key)
            return log._taken

        def composing(transport, make, x, ctx):
            xin, before = _np(x.reshape(-1)), {k: _np(v) for k, v in ctx.state.items()}
            log._taken = None
            inner = compose(transport, make, x, ctx)  # takes the route now
            route, fold = log._taken if log._taken is not None else ("two-level", False)
            result = yield from inner
            if log.tag is not None:
                log.log.append({"tag": log.tag, "spec": str(make.__self__.spec), "key": ctx.key, "step": ctx.step,
                                "shape": tuple(ctx.shape), "members": tuple(ctx.members), "scale": ctx.scale,
                                "epoch": ctx.epoch, "route": route, "fold": fold, "x": xin, "before": before,
                                "result": _np(result), "after": {k: _np(v) for k, v in ctx.state.items()}})
            return result

        TwoLevelTransport.compose, RouteChoice.take = composing, taking

    def restore(self):
        for cls, name, fn in self._patched:
            setattr(cls, name, fn)


def _hook_model(spec, bucket_mb=25.0, saved=None, **kw):
    import torch
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    model = kit.torch_mlp(MLP)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state, hook = hddp.comm_hook(spec, model=ddp, optimizer=sgd, **kw)
    ddp.register_comm_hook(state, hook)
    if saved is not None:
        model.load_state_dict(saved["model"])
        sgd.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
    return model, ddp, sgd, state


def _hook_step(model, ddp, sgd, state, step, log, tag) -> dict:
    import torch.distributed as dist
    import torch.nn as nn
    log.tag = tag
    sgd.zero_grad()
    x, y = _batch(dist.get_rank(), step)
    nn.CrossEntropyLoss()(ddp(x), y).backward()
    sgd.step()
    log.tag = None
    choice = state.route_choice
    return {"identical": kit.dist_identical(model), "labels": dict(state.stats.routes),
            "routes": dict(choice.routes), "groups": [list(g) for g in choice.groups],
            "validating": choice.validating}


def hook_validated(log) -> dict:
    """routes="auto" on 2x2: trained until the routes are decided, then HOOK_AFTER steps with a
    checkpoint after the first; a new DDP model resumed from it runs the rest."""
    import copy
    import torch
    model, ddp, sgd, state = _hook_model(HOOK_SPEC, HOOK_BUCKET_MB, topology=TOPOLOGY, routes="auto",
                                         tune_steps=HOOK_TUNE_STEPS)
    choice = state.route_choice
    steps, step = [], 0
    while step < HOOK_MAX_STEPS and (step < 2 or choice.validating):
        steps.append(_hook_step(model, ddp, sgd, state, step, log, ("hook", step)))
        step += 1
    decided_at, saved = step, None
    for _ in range(HOOK_AFTER):
        steps.append(_hook_step(model, ddp, sgd, state, step, log, ("hook", step)))
        step += 1
        if saved is None:
            saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(sgd.state_dict()),
                     "hook": copy.deepcopy(state.state_dict()), "step": step}
    resumed = _hook_model(HOOK_SPEC, HOOK_BUCKET_MB, saved=saved, topology=TOPOLOGY, routes="auto",
                          tune_steps=HOOK_TUNE_STEPS)
    again = [_hook_step(*resumed, s, log, ("resumed", s)) for s in range(saved["step"], step)]
    return {"steps": steps, "decided_at": decided_at, "record": choice.record, "routes": dict(choice.routes),
            "modelled": dict(choice.modelled), "fitted": choice.model is not None,
            "saved_routes": saved["hook"].get("ddp_routes"), "resumed": again,
            "resumed_fitted": resumed[3].route_choice.model is not None,
            "resumed_equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(resumed[0])))}


def hook_picks(log) -> dict:
    """A given two-level cost model and tune_steps=0: each bucket takes the model's route."""
    import torch
    out = {}
    for spec in PICKS:
        sgd = torch.optim.SGD(kit.torch_mlp(MLP).parameters(), lr=0.05, momentum=0.9)
        links = _fitted_links(spec, sgd)
        model, ddp, sgd, state = _hook_model(spec, topology=TOPOLOGY, routes="auto", tune_steps=0, cost_model=links)
        steps = [_hook_step(model, ddp, sgd, state, s, log, ("picks " + spec, s)) for s in range(4)]
        choice = state.route_choice
        out[spec] = {"steps": steps, "spec": str(state.spec), "modelled": dict(choice.modelled),
                     "routes": dict(choice.routes), "groups": [list(g) for g in choice.groups],
                     "record": choice.record}
    return out


def hook_arguments(log) -> dict:
    """Which hooks choose routes (the launcher's topology, explicit ones, routes=), and the refusals:
    each a ValueError on every rank before any collective (the world's next collective lines up)."""
    import os
    from unittest import mock
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    from hvdcompress.schedule.twolevel import TwoLevelCostModel

    def chooses(**kw):
        state, _ = hddp.comm_hook(HOOK_SPEC, model=nn.parallel.DistributedDataParallel(kit.torch_mlp(MLP)), **kw)
        return type(state.transport).__name__, state.route_choice is not None

    out = {}
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2"}):  # restored after
        for name, kw in (("launcher", {}), ("launcher two-level", {"routes": "two-level"}),
                         ("launcher tune_steps=0", {"tune_steps": 0}), ("explicit", {"topology": TOPOLOGY}),
                         ("explicit auto", {"topology": TOPOLOGY, "routes": "auto"}),
                         ("flat auto", {"topology": "flat", "routes": "auto"})):
            out[name] = chooses(**kw)
        other = TwoLevelCostModel.from_links(1, 4, 10.0, 1.0)
        for name, kw in (("routes", {"routes": "flat"}), ("tune_steps", {"tune_steps": -1}),
                         ("cost_model", {"cost_model": "fast"}), ("cost_model topology", {"cost_model": other}),
                         ("adam", {"routes": "auto", "spec": "onebitadam"})):
            try:
                spec = kw.pop("spec", HOOK_SPEC)
                model = kit.torch_mlp(MLP)
                hddp.comm_hook(spec, model=nn.parallel.DistributedDataParallel(model),
                               optimizer=torch.optim.Adam(model.parameters()), **kw)
                out[name] = "accepted"
            except ValueError as e:
                out[name] = str(e)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


HOOK_SCENARIOS = ("hook_validated", "hook_picks", "hook_arguments")


def _worker(rank, world, port, names, out_dir):
    kit.gloo_init(rank, world, port)
    log = RouteLog()
    out = kit.run_scenarios(names, lambda name: globals()[name](log) if name in HOOK_SCENARIOS else globals()[name]())
    log.restore()
    out["log"] = log.log
    kit.gloo_finish(out, out_dir, rank)


def launch(names) -> list:
    """One spawn of 4 Gloo processes (2 nodes x 2) running ``names``; every rank's results."""
    return kit.gloo_spawn(_worker, 4, (list(names),), prefix="hvc-route-")
