"""Code that runs inside real Horovod worker processes (launched by tests/test_multiprocess.py).

Each scenario returns plain Python data; the pytest side asserts on it. Parameters are compared
across ranks bit for bit by allgathering them.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.nn as nn

from scenarios import kit

TRAIN_SPECS = ["none", "fp16", "bf16", "topk:ratio=0.05", "topk:ratio=0.01,residual=false",
               "randomk:ratio=0.1,seed=1", "threshold:threshold=0.05",
               "dgc:ratio=0.05,warmup_epochs=2,min_sparse_numel=256",
               "dgc:ratio=0.05,nesterov=true,clip_norm=1.0,fp16_values=true,min_sparse_numel=256"]


def _train(spec, steps=6, opt_cls=torch.optim.SGD, bpps=1, epoch_every=2, schedule="layerwise", **opt_kw):
    """``steps`` steps of ``kit.torch_mlp()``; per-tensor exchanges unless another ``schedule`` is asked
    for (the default "auto" would profile the transport after 6 steps)."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    model = kit.torch_mlp()
    opt_kw = opt_kw or {"lr": 0.1, "momentum": 0.9}
    opt = hvc.DistributedOptimizer(opt_cls(model.parameters(), **opt_kw),
                                   named_parameters=model.named_parameters(), compression=spec,
                                   backward_passes_per_step=bpps, schedule=schedule)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        opt.set_epoch(step // epoch_every)
        opt.zero_grad()
        for micro in range(bpps):
            x, y = kit.torch_batch(hvd.rank(), step * bpps + micro)
            loss_fn(model(x), y).backward()
        opt.step()
    return model, opt


def training(world_expected: int) -> dict:
    """Every compressor trains a few steps; all ranks must end with identical parameters."""
    import horovod.torch as hvd
    hvd.init()
    assert hvd.size() == world_expected
    out = {"identical": {}, "bytes": {}, "moved": {}}
    start = kit.torch_flat(kit.torch_mlp())
    for spec in TRAIN_SPECS:
        model, opt = _train(spec)
        out["identical"][spec] = kit.torch_identical(model)
        out["bytes"][spec] = opt.stats.as_dict()
        out["moved"][spec] = float((kit.torch_flat(model) - start).abs().max())
    model, _ = _train("topk:ratio=0.1", opt_cls=torch.optim.Adam, lr=1e-3)
    out["identical"]["adam+topk"] = kit.torch_identical(model)

    # top-k at ratio 1.0 must give exactly the dense averaged update
    dense, _ = _train("none")
    full, _ = _train("topk:ratio=1.0")
    diff = (kit.torch_flat(dense) - kit.torch_flat(full)).abs().max()
    out["ratio1_max_diff"] = float(diff)

    # backward_passes_per_step=2: the exchanged gradient is the average of the accumulated ones
    model = kit.torch_mlp()
    opt = __import__("hvdcompress.torch", fromlist=["x"]).DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        compression="topk:ratio=1.0", backward_passes_per_step=2, schedule="layerwise")
    for micro in range(2):
        x, y = kit.torch_batch(hvd.rank(), micro)
        nn.CrossEntropyLoss()(model(x), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    opt.synchronize()
    want = [hvd.allreduce(g, name=f"check.bpps.{i}") for i, g in enumerate(local)]
    out["bpps_max_diff"] = float(max((p.grad - w).abs().max() for p, w in zip(model.parameters(), want)))
    with opt.skip_synchronize():
        opt.step()
    out["identical"]["bpps2"] = kit.torch_identical(model)
    hvd.shutdown()
    return out


def empty_selection() -> dict:
    """Rank 1's gradient is all zero, so its threshold selection is empty; nothing may hang.
    The optimizer keeps the default schedule ("auto"): these 3 steps run layerwise, measuring."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    hvd.init()
    model = kit.torch_mlp()
    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression="threshold:threshold=1e-4")
    sent = []
    for step in range(3):
        opt.zero_grad()
        x, y = kit.torch_batch(hvd.rank(), step)
        loss = nn.CrossEntropyLoss()(model(x), y)
        (loss * (0.0 if hvd.rank() == 1 else 1.0)).backward()
        opt.step()
        sent.append(opt.stats.last_bytes)
    result = {"identical": kit.torch_identical(model), "sent": sent, "schedule": opt.schedule,
              "plan": opt.plan, "groups": opt.groups}
    hvd.shutdown()
    return result


def bad_arguments() -> dict:
    """Bad input raises ValueError on every rank before any collective; a collective still works after."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    hvd.init()
    model = kit.torch_mlp()
    errors = {}
    cases = {
        "ratio": dict(compression="topk:ratio=2"),
        "unknown": dict(compression="zip"),
        "bpps": dict(backward_passes_per_step=0),
        "predivide": dict(gradient_predivide_factor=0.0),
        "adasum": dict(op=hvd.Adasum),
        "names": dict(named_parameters=[("same", p) for p in model.parameters()]),
        "warmup": dict(compression="dgc:warmup_schedule=0.25/0.3"),
        "momentum": dict(compression="dgc:momentum=-0.9"),
    }
    for label, kwargs in cases.items():
        try:
            hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    # a checkpoint of another compressor is refused before anything is loaded
    _, opt_a = _train("topk:ratio=0.05", steps=1)
    _, opt_b = _train("threshold:threshold=0.05", steps=1)
    try:
        opt_b.load_state_dict(opt_a.state_dict())
        errors["state_dict"] = None
    except ValueError as e:
        errors["state_dict"] = str(e)
    after = hvd.allreduce(torch.ones(1), name="check.after", op=hvd.Sum)
    hvd.shutdown()
    return {"errors": errors, "after": float(after)}


RESUME_SPECS = {"topk:ratio=0.05": ("residual",),
                "dgc:ratio=0.05,warmup_epochs=3,min_sparse_numel=256": ("u",)}


def checkpoint_resume() -> dict:
    """Save every rank's optimizer state mid-run, restore it into fresh objects: the continuation
    must be bit-identical to never stopping (residuals, DGC momenta and epoch are state)."""
    import horovod.torch as hvd
    hvd.init()
    out = {spec: _resume_one(spec, names) for spec, names in RESUME_SPECS.items()}
    hvd.shutdown()
    return out


def _resume_one(spec, state_names) -> dict:
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    try:
        model, opt = _train(spec, steps=3, epoch_every=1)
        saved_model = copy.deepcopy(model.state_dict())
        saved_opt = copy.deepcopy(opt.state_dict())
        has_residual = all(all(n in st for n in state_names)
                           for st in saved_opt["hvdcompress"]["state"].values())

        def cont(model, opt):
            for step in range(3, 6):
                opt.set_epoch(step)
                opt.zero_grad()
                x, y = kit.torch_batch(hvd.rank(), step)
                nn.CrossEntropyLoss()(model(x), y).backward()
                opt.step()
            return kit.torch_flat(model)

        straight = cont(model, opt)
        model2 = kit.torch_mlp()
        opt2 = hvc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model2.named_parameters(), compression=spec,
                                        schedule="layerwise")
        model2.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
        resumed = cont(model2, opt2)
        result = {"has_residual": has_residual, "equal": bool(torch.equal(straight, resumed)),
                  "identical": kit.torch_identical(model2), "epoch": opt2.epoch}
    except Exception:  # report, do not hang the test on a worker traceback
        result = {"error": traceback.format_exc()}
    return result


def _state_tensors(opt) -> list:
    """The wrapped optimizer's per-parameter state, flattened in parameter order (Horovod's
    ``broadcast_optimizer_state`` moves these)."""
    sd = opt.state_dict()
    out = []
    for pid in sorted(sd["state"]):
        for key in sorted(sd["state"][pid]):
            v = sd["state"][pid][key]
            out.append(torch.as_tensor(v, dtype=torch.float64).reshape(-1))
    return out


def broadcast_optimizer_state() -> dict:
    """Horovod's own ``hvd.broadcast_optimizer_state`` on our optimizer and on Horovod's, side by
    side: (a) every rank without state yet: filled by the wrapped optimizer's step on zero
    gradients, without an exchange; (b) rank 0 with a loaded state, rank 1 without (Horovod's
    checkpoint recipe): rank 0's state on both. Parameters and state must be the same with both
    optimizers, bit for bit. (b) runs only if (a) made no exchange: one made there would have
    no partner in (b), and the launch would hang."""
    import horovod.torch as hvd
    import hvdcompress.torch as hvc
    hvd.init()
    wrappers = {"horovod": lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters()),
                "hvdcompress": lambda o, m: hvc.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                                     compression="none", schedule="layerwise")}

    def build(wrap):
        model = kit.torch_mlp()
        return model, wrap(torch.optim.Adam(model.parameters(), lr=0.01), model)  # (a zero-gradient step
        # with weight decay would move rank 1's parameters after their broadcast, with either optimizer)

    out = {}
    try:
        for name, wrap in wrappers.items():
            res = {}
            model, opt = build(wrap)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            res["fresh"] = [kit.torch_flat(model)] + _state_tensors(opt)
            if name == "hvdcompress":
                res["fresh_steps"] = opt.engine.step
                if opt.engine.step != 0:
                    out[name] = res
                    continue
            x, y = kit.torch_batch(hvd.rank(), 0)
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model, opt = build(wrap)
            if hvd.rank() == 0:
                model.load_state_dict(saved_model)
                opt.load_state_dict(saved_opt)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            res["restored"] = [kit.torch_flat(model)] + _state_tensors(opt)
            res["identical"] = kit.torch_identical(model, name=f"bos.{name}")
            out[name] = res
    except Exception:
        out = {"error": traceback.format_exc()}
    hvd.shutdown()
    return out
