"""Worker code for tests/test_reliability.py: sparse gradients, models that differ across ranks."""

from __future__ import annotations

import traceback

from scenarios import kit


class _EmbedNet:
    @staticmethod
    def make():
        import torch
        import torch.nn as nn
        torch.manual_seed(0)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 8, sparse=True)
                self.head = nn.Linear(8, 3)

            def forward(self, idx):
                return self.head(self.emb(idx).mean(1))
        return Net()


def _batch(rank, step):
    import torch
    g = torch.Generator().manual_seed(31 * rank + step)
    idx = torch.randint(0, 50, (6, 4), generator=g)
    return idx, idx[:, 0] % 3


def _train(make_opt, steps=5):
    import horovod.torch as hvd
    import torch.nn as nn
    model = _EmbedNet.make()
    opts = make_opt(model)
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        x, y = _batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        for o in opts:
            o.step()
    return model, opts


def sparse_gradients() -> dict:
    """SparseAdam on an embedding with sparse gradients (and dense Adam on the head), through our
    optimizer with its default schedule, next to Horovod's own DistributedOptimizer."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        def ours(model, **kw):
            sparse = hvc.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                              named_parameters=[("emb.weight", model.emb.weight)], **kw)
            dense = hvc.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.05),
                                             named_parameters=list(model.head.named_parameters()),
                                             compression="none")  # as Horovod: parity is checked below
            return [sparse, dense]

        def horovods(model):
            sparse = hvd.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                              named_parameters=[("emb.weight", model.emb.weight)])
            dense = hvd.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.05),
                                             named_parameters=list(model.head.named_parameters()))
            return [sparse, dense]

        model, opts = _train(ours, steps=8)
        out["identical"] = kit.torch_identical(model, "check.sparse")
        out["groups"] = opts[0].groups
        out["horovod_attributes"] = (list(opts[0]._parameter_names.values()), opts[0].backward_passes_per_step,
                                     opts[0].op == hvd.Average, opts[0].process_set.size())
        out["bytes"] = opts[0].stats.as_dict()["bytes_per_step"]
        ref, _ = _train(horovods, steps=8)
        out["max_diff_vs_horovod_emb"] = float((model.emb.weight - ref.emb.weight).abs().max())
        # SparseAdam with sparse_as_dense=True: exchanged dense, given back sparse, as Horovod does
        def ours_as_dense(model):
            return [hvc.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                             named_parameters=[("emb.weight", model.emb.weight)],
                                             compression="none", sparse_as_dense=True),
                    hvc.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.05),
                                             named_parameters=list(model.head.named_parameters()),
                                             compression="none")]

        def horovods_as_dense(model):
            return [hvd.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                             named_parameters=[("emb.weight", model.emb.weight)],
                                             sparse_as_dense=True),
                    hvd.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.05),
                                             named_parameters=list(model.head.named_parameters()))]

        as_dense, _ = _train(ours_as_dense, steps=4)
        ref_as_dense, _ = _train(horovods_as_dense, steps=4)
        out["as_dense_max_diff_vs_horovod"] = float((as_dense.emb.weight - ref_as_dense.emb.weight).abs().max())
        # SGD with sparse gradients, sparse_as_dense=True: densified and compressed
        model2 = _EmbedNet.make()
        opt2 = hvc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                        named_parameters=model2.named_parameters(), compression="topk:ratio=0.3",
                                        sparse_as_dense=True, schedule="single")
        for step in range(4):
            opt2.zero_grad()
            x, y = _batch(hvd.rank(), step)
            torch.nn.CrossEntropyLoss()(model2(x), y).backward()
            opt2.step()
        out["dense_identical"] = kit.torch_identical(model2, "check.dense")
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


def different_models() -> dict:
    """Rank 1's model has a differently shaped layer: a clear error on every rank, naming it."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        width = 16 if hvd.rank() == 0 else 17
        model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
        try:
            hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression="topk:ratio=0.1")
            out["raised"] = None
        except ValueError as e:
            out["raised"] = str(e)
        out["after"] = float(hvd.allreduce(torch.ones(1), name="still.works").item())
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


FAULT_SPECS = ["none", "topk:ratio=0.05", "threshold:threshold=0.05", "randomk:ratio=0.1,seed=2",
               "dgc:ratio=0.05,warmup_epochs=0,min_sparse_numel=64", "signsgd", "efsignsgd", "qsgd",
               "sketch:ratio=0.05,min_sketch_numel=64", "powersgd"]


def nonfinite_faults() -> dict:
    """One bad value (inf or NaN) in one entry of one layer's gradient on rank 1 at step 2: the
    exchanged gradient must show it on every rank (plain step), and the AMP-style skip
    (synchronize, check, skip) must leave training going with finite, identical parameters and
    finite compression state."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        for spec in FAULT_SPECS:
            for bad in (float("inf"), float("nan")):
                for mode in ("plain", "skip"):
                    torch.manual_seed(0)
                    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
                    opt = hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                                   named_parameters=model.named_parameters(), compression=spec,
                                                   schedule="layerwise")
                    seen, skipped = None, 0
                    when = {"step": -1}

                    def inject(grad, when=when, bad=bad):  # inside backward, before the exchange starts
                        if when["step"] == 2 and hvd.rank() == 1:
                            grad = grad.clone()
                            grad[2, 5] = bad
                        return grad
                    model[0].weight.register_hook(inject)
                    for step in range(6):
                        when["step"] = step
                        opt.zero_grad()
                        g = torch.Generator().manual_seed(7 * hvd.rank() + step)
                        x = torch.randn(8, 16, generator=g)
                        nn.CrossEntropyLoss()(model(x), x[:, :4].argmax(1)).backward()
                        opt.synchronize()
                        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
                        if step == 2:
                            seen = not finite
                        if mode == "skip" and not finite:
                            skipped += 1
                            continue
                        with opt.skip_synchronize():
                            opt.step()
                    params_finite = bool(torch.isfinite(kit.torch_flat(model)).all())
                    state = opt.state_dict()["hvdcompress"]["state"]
                    state_finite = all(bool(torch.isfinite(t).all()) for st in state.values() for t in st.values()
                                       if torch.is_tensor(t) and t.is_floating_point())
                    rows = hvd.allgather(kit.torch_flat(model).unsqueeze(0),
                                         name=f"check.{spec}.{bad}.{mode}")
                    identical = bool(torch.equal(rows[0], rows[1])) if params_finite else None
                    out[f"{spec}|{bad}|{mode}"] = {"seen": seen, "skipped": skipped, "params_finite": params_finite,
                                                   "state_finite": state_finite, "identical": identical}
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


class _BranchNet:
    """An MLP with an auxiliary branch that only some ranks use in some steps."""

    @staticmethod
    def make():
        import torch
        import torch.nn as nn
        torch.manual_seed(0)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(16, 8)
                self.aux = nn.Linear(16, 8)
                self.head = nn.Linear(8, 4)

            def forward(self, x, use_aux):
                h = self.body(x)
                if use_aux:
                    h = h + self.aux(x)
                return self.head(torch.tanh(h))
        return Net()


def _branch_steps(opt_for, steps=6):
    """Rank 0 uses the auxiliary branch in even steps, rank 1 never: ``aux`` gets a gradient on
    some ranks only. Returns the model and whether the ranks were identical after every step."""
    import horovod.torch as hvd
    import torch
    model = _BranchNet.make()
    opt = opt_for(model)
    identical = []
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(11 * hvd.rank() + step)
        x = torch.randn(8, 16, generator=g)
        model(x, use_aux=hvd.rank() == 0 and step % 2 == 0).pow(2).mean().backward()
        opt.step()
        identical.append(kit.torch_identical(model, f"check.branch.{step}"))
    return model, identical


def partial_gradients() -> dict:
    """A parameter with a gradient on some ranks only in a step: no hang, identical results, and
    (uncompressed) the same parameters as Horovod's own optimizer, for several schedules."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        ref, out["horovod_identical"] = _branch_steps(lambda m: hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), named_parameters=m.named_parameters()))
        for spec, schedule in (("none", "layerwise"), ("none", "single"), ("topk:ratio=0.2", "layerwise"),
                               ("dgc:ratio=0.2,warmup_epochs=0,min_sparse_numel=16", "single"),
                               ("sketch:ratio=0.2,min_sketch_numel=16", "layerwise")):
            model, identical = _branch_steps(lambda m: hvc.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), named_parameters=m.named_parameters(),
                compression=spec, schedule=schedule))
            out[f"{spec}|{schedule}"] = {"identical": identical, "aux_moved": float(
                (model.aux.weight - _BranchNet.make().aux.weight).abs().max()),
                "max_diff_vs_horovod": float((kit.torch_flat(model) - kit.torch_flat(ref)).abs().max())}
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


def dying_worker(kind: str, outdir: str) -> dict:
    """Rank 1 dies (os._exit) inside backward at step 3, after some of its gradients went out. The
    survivor writes what happened to it (exception, seconds from the step's start) to a file as
    soon as it knows, since the launcher may end it right after. ``kind``: "ours" or "horovod"."""
    import json
    import os
    import signal
    import time
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import hvdcompress.torch as hvc
    hvd.init()
    record = {"rank": hvd.rank(), "kind": kind}
    path = os.path.join(outdir, f"{kind}.{hvd.rank()}.json")
    clock = {"start": time.time()}

    def write(**kw):
        record.update(kw, seconds=time.time() - clock["start"])
        with open(path, "w") as f:
            json.dump(record, f)

    def terminated(signum, frame):  # the launcher ended this rank before Horovod reported anything
        write(outcome="terminated by the launcher")
        os._exit(143)
    signal.signal(signal.SIGTERM, terminated)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    if kind == "ours":
        opt = hvc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression="topk:ratio=0.1",
                                       schedule="layerwise")
    else:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    step = {"n": 0}

    def die(grad):  # the first layer's gradient comes last in backward: the others are in flight
        if step["n"] == 3 and hvd.rank() == 1:
            os._exit(3)
        return grad
    model[0].weight.register_hook(die)
    try:
        for n in range(30):
            step["n"] = n
            clock["start"] = time.time()
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        write(outcome="finished")
    except Exception as e:
        write(outcome="raised", error=f"{type(e).__name__}: {str(e)[:200]}")
    return record
