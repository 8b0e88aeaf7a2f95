"""Worker code for tests/test_gtopk.py: gTop-k on real torch.distributed (Gloo) processes, no Horovod.

``launch(world)`` spawns ``world`` processes once; each runs, in order:

* ``exchanges``: gtopk's and topk's exchanges driven straight through the transport
  (``TorchDistCommunicator``) for a few steps on seeded inputs, logging inputs, states, results and
  the payload bytes each request delivered to this rank (what the transport handed back: an
  alltoall's received rows, a gather's rows from the other ranks);
* ``optimizer``: ``DistributedOptimizer(backend="torch", compression=gtopk)`` on a small MLP,
  parameters compared across ranks every step, a checkpoint after ``SAVE_AT`` steps resumed in a
  fresh optimizer and run to the end (equal to the uninterrupted run), every exchange logged
  (``scenarios.ddp.Recorder``) for the oracle;
* ``hook``: the DDP communication hook with gtopk, parameters compared every step.
"""

from __future__ import annotations

import copy

from scenarios import kit

SPEC = "gtopk:ratio=0.05"
NUMEL = 4000          # the exchanges' tensor
RATIO = 0.01          # their density: k = 40
EXCHANGE_STEPS = 3
STEPS = 4
SAVE_AT = 2


def _np(t):
    return t.detach().numpy().copy()


def _received(requests, results, rank: int) -> int:
    """Payload bytes this round delivered to this rank from the other ranks."""
    from hvdcompress.contract import Allgather, Alltoall, Flag
    total = 0
    for req, got in zip(requests, results):
        if isinstance(req, Flag):
            continue
        if isinstance(req, Alltoall):
            total += got.numel() * got.element_size()  # this rank never sends itself a piece here
        elif isinstance(req, Allgather):
            total += got.numel() * got.element_size() - req.tensor.numel() * req.tensor.element_size()
    return total


def exchanges() -> dict:
    import torch
    import torch.distributed as dist
    from hvdcompress import parse_spec
    from torch_ops import compressors as tc
    from torch_ops.dist_collectives import TorchDistCommunicator
    transport = TorchDistCommunicator()
    rank, world = transport.rank(), transport.size()
    out = {}
    for text in (f"gtopk:ratio={RATIO}", f"topk:ratio={RATIO}"):
        comp = tc.build_compressor(parse_spec(text))
        state, log = {}, []
        for step in range(EXCHANGE_STEPS):
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(NUMEL, generator=g) * (1.0 + rank)
            before = {k: _np(v) for k, v in state.items()}
            ctx = tc.ExchangeContext("w", step, world, 1.0 / world, state, (NUMEL,), 0, rank)
            gen = comp.exchange(x.clone(), ctx)
            received, rounds, results = 0, 0, None
            while True:
                try:
                    requests = next(gen) if results is None else gen.send(results)
                except StopIteration as stop:
                    result = stop.value
                    break
                results = transport.wait(transport.launch(requests, f"{text}.{step}.r{rounds}"))
                received += _received(requests, results, rank)
                rounds += 1
            log.append({"x": _np(x), "before": before, "result": _np(result),
                        "after": {k: _np(v) for k, v in state.items()}, "received": received, "rounds": rounds})
        out[text] = log
    dist.barrier()
    return out


def _model():
    return kit.torch_mlp((12, 24, 4))


def _batch(rank, step):
    return kit.torch_batch(rank, step, n=8, features=12)


def _train(steps, first=0, saved=None, rec=None):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.torch as hvc
    model = _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=SPEC,
                                   schedule="layerwise", backend="torch")
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    identical, checkpoint = [], None
    for step in range(first, first + steps):
        if rec is not None:
            rec.tag = "opt"
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        if rec is not None:
            rec.tag = None
        identical.append(kit.dist_identical(model))
        if step + 1 == SAVE_AT and saved is None:
            checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    return model, opt, identical, checkpoint


def optimizer() -> dict:
    import torch
    from scenarios.ddp import Recorder
    rec = Recorder()
    try:
        model, opt, identical, ckpt = _train(STEPS, rec=rec)
    finally:
        rec.restore()
    resumed, _, identical2, _ = _train(STEPS - SAVE_AT, first=SAVE_AT, saved=ckpt)
    saved_state = ckpt["opt"]["hvdcompress"]
    return {"identical": identical + identical2, "resumed_equal": bool(torch.equal(kit.torch_flat(model), kit.torch_flat(resumed))),
            "moved": float((kit.torch_flat(model) - kit.torch_flat(_model())).abs().max()),
            "saved": repr(saved_state)[:20000], "log": rec.log, "ratio": opt.stats.ratio}


def hook() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state, fn = hddp.comm_hook(SPEC, model=ddp, optimizer=opt)
    ddp.register_comm_hook(state, fn)
    identical = []
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(dist.get_rank(), step)
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
        identical.append(kit.dist_identical(model))
    return {"identical": identical, "moved": float((kit.torch_flat(model) - kit.torch_flat(_model())).abs().max())}


SCENARIOS = ("exchanges", "optimizer", "hook")


def _worker(rank, world, port, out_dir):
    kit.gloo_init(rank, world, port)
    out = kit.run_scenarios(SCENARIOS, lambda name: globals()[name]())
    kit.gloo_finish(out, out_dir, rank)


def launch(world: int) -> list:
    """One spawn of ``world`` Gloo processes running ``SCENARIOS``; every rank's results, rank order."""
    return kit.gloo_spawn(_worker, world, prefix="hvc-gtopk-")


def horovod_optimizer() -> dict:
    """On Horovod (in the session's shared 3-worker launch, ``shared_launch.TORCH_3``): the optimizer's
    default transport, the Horovod ``Communicator``, carries the same rounds; replicas compared every
    step, exchanges logged."""
    import torch
    import torch.nn as nn
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    from scenarios.ddp import Recorder
    hvd.init()
    rec = Recorder()
    model = _model()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=SPEC, schedule="layerwise")
    identical = []
    try:
        for step in range(3):
            rec.tag = "hvd"
            opt.zero_grad()
            x, y = _batch(hvd.rank(), step)
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            rec.tag = None
            identical.append(kit.torch_identical(model, name=f"gtopk.check.{step}"))
    finally:
        rec.restore()
    return {"identical": identical, "log": rec.log, "moved": float((kit.torch_flat(model) - kit.torch_flat(_model())).abs().max())}
