"""Worker side of tests/test_diloco.py: PyTorch ``DiLoCo`` on real Horovod (Gloo) workers (and, for
tests/test_torch_distributed.py, on torch.distributed Gloo processes: ``backend="torch"``).

Each scenario trains a small two-layer model with rank-dependent data and returns, per inner
step, every parameter after the inner step (recorded by a step post-hook of the inner optimizer,
i.e. before the outer loop ran) and after ``DiLoCo.step()``, so the test can replay the outer
loop with the numpy reference on exactly the same local parameters.
"""

from __future__ import annotations

import numpy as np

# The 2-worker runs (shared_launch.TORCH_2 runs them; tests/test_diloco.py checks them against the
# numpy reference): one config per outer-loop variant, and the checkpoint config.
TORCH_CONFIGS = {
    "diloco": dict(sync_every=3),
    "diloco_topk": dict(sync_every=2, compression="topk:ratio=0.2"),
    "streaming_sparseloco": dict(sync_every=4, fragments=2, overlap_steps=1, mix=0.5,
                                 compression="sparseloco:ratio=0.2,bits=2,beta=0.9"),
    "streaming_qsgd": dict(sync_every=6, fragments=3, overlap_steps=1, compression="qsgd:levels=3,bucket=8"),
}
TORCH_STEPS = 12
CKPT = dict(sync_every=4, fragments=2, overlap_steps=1, mix=0.25, compression="sparseloco:ratio=0.3")


def assert_matches_reference(runs, kw, steps=TORCH_STEPS):
    """Two ranks' ``compare_with_reference`` runs of one config replayed through the numpy
    reference (``hvdcompress.reference.diloco``): the same parameters after every step (within
    the outer step's last-bit rounding), identical replicas after each sync without mix, the same
    bytes and global parameters."""
    from hvdcompress.reference.diloco import DiLoCoReference

    ref = DiLoCoReference(runs[0]["init"], world=2, names=runs[0]["names"], **kw)
    for r in range(2):  # every rank started from the same parameters
        for a, b in zip(runs[r]["init"], runs[0]["init"]):
            assert np.array_equal(a, b)
    for t in range(steps):
        out = ref.step([runs[r]["locals"][t] for r in range(2)])
        synced = ref.cfg.applied_at(t + 1)
        for r in range(2):
            for i, (got, want) in enumerate(zip(runs[r]["after"][t], out[r])):
                # the outer SGD step may round differently in the last bit (a fused multiply-add)
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7, err_msg=f"t={t + 1} rank {r} p{i}")
        if synced is not None and ref.cfg.mix == 0.0:
            for i in ref.fragments[synced]:  # identical replicas after the outer step
                assert np.array_equal(runs[0]["after"][t][i], runs[1]["after"][t][i])
    for r in range(2):
        assert runs[r]["bytes"] == ref.bytes_sent[r]
        for got, want in zip(runs[r]["global"], ref.theta):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)


def _model(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(rank, step):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(model, opt, rank, steps, start=0, nan_at=None):
    import torch
    for t in range(start, start + steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if nan_at is not None and t == nan_at and rank == 1:
            with torch.no_grad():
                next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()


def _record(model, inner):
    """A list that receives the parameters after each inner step (before the outer loop)."""
    seen = []
    inner.register_step_post_hook(lambda *_: seen.append([p.detach().numpy().copy() for p in model.parameters()]))
    return seen


def _rank(backend: str) -> int:
    """This process's rank on the transport ``backend`` names (Horovod initialized here)."""
    if backend == "torch":
        import torch.distributed as dist
        return dist.get_rank()
    import horovod.torch as hvd
    hvd.init()
    return hvd.rank()


def compare_with_reference(configs, steps, backend="horovod"):
    """For each config (kwargs of DiLoCo, plus inner lr): per step, (locals after the inner step,
    parameters after DiLoCo.step), the bytes sent, the initial parameters and the names."""
    import torch
    from torch_ops.diloco import DiLoCo

    rank = _rank(backend)
    out = {}
    for name, kw in configs.items():
        kw = dict(kw)
        lr = kw.pop("inner_lr", 0.1)
        model = _model()
        init = [p.detach().numpy().copy() for p in model.parameters()]
        inner = torch.optim.SGD(model.parameters(), lr=lr)
        seen = _record(model, inner)
        opt = DiLoCo(model, inner, backend=backend, **kw)
        after = []
        for t in range(steps):
            _train(model, opt, rank, 1, start=t)
            after.append([p.detach().numpy().copy() for p in model.parameters()])
        out[name] = {"locals": seen, "after": after, "init": init, "bytes": opt.bytes_sent,
                     "names": [n for n, _ in model.named_parameters()],
                     "global": [g.numpy() for g in opt.global_parameters()]}
    return out


def checkpoint_resume(kw, steps, save_at, backend="horovod"):
    """Train ``steps`` straight; and train ``save_at`` steps, save (a fragment in flight), build a
    new model and DiLoCo, load, train the rest: both final parameters, and whether one was in flight."""
    import io
    import torch
    from torch_ops.diloco import DiLoCo

    rank = _rank(backend)

    def build():
        model = _model()
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, DiLoCo(model, inner, backend=backend, **kw)

    model, opt = build()
    _train(model, opt, rank, steps)
    straight = [p.detach().numpy().copy() for p in model.parameters()]

    model, opt = build()
    _train(model, opt, rank, save_at)
    in_flight = opt.state_dict()["hvdcompress_diloco"]["in_flight"] is not None
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, rank, 1, start=save_at)  # the saving run goes on (applying what was in flight), then is dropped
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _train(model, opt, rank, steps - save_at, start=save_at)
    resumed = [p.detach().numpy().copy() for p in model.parameters()]
    return {"straight": straight, "resumed": resumed, "in_flight": in_flight}


def non_finite(kw, steps, nan_at):
    """Rank 1 puts a NaN in one gradient at step ``nan_at``: the parameters after each step."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc

    hvd.init()
    model = _model()
    opt = hvc.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    after = []
    for t in range(steps):
        _train(model, opt, hvd.rank(), 1, start=t, nan_at=nan_at)
        after.append([bool(np.isnan(p.detach().numpy()).any()) for p in model.parameters()])
    return after


def flush_and_bad_arguments():
    """flush() leaves identical replicas; bad arguments raise ValueError (no collective started:
    the scenario would hang otherwise, since only the constructor's checks run)."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc

    hvd.init()
    model = _model()
    opt = hvc.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, fragments=2,
                     overlap_steps=1, mix=0.5, compression="topk:ratio=0.3")
    _train(model, opt, hvd.rank(), 3)
    opt.flush()
    flushed = [p.detach().numpy().copy() for p in model.parameters()]
    errors = []
    for bad in (dict(sync_every=0), dict(sync_every=6, fragments=4), dict(sync_every=4, overlap_steps=4),
                dict(sync_every=4, mix=2.0), dict(sync_every=4, compression="topk:ratio=0")):
        try:
            hvc.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **bad)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    try:
        other = torch.nn.Linear(2, 2)
        hvc.DiLoCo(model, torch.optim.SGD(other.parameters(), lr=0.1), sync_every=2)
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    return {"flushed": flushed, "global": [g.numpy() for g in opt.global_parameters()], "errors": errors}


def elastic_state(kw, steps, save_at):
    """Horovod Elastic's TorchState with a DiLoCo (no reset happens: the handler's save, restore and
    sync are called directly): restoring a commit with a fragment in flight continues exactly as a
    straight run; sync gives every rank rank 0's model, global parameters and counters."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc

    hvd.init()
    rank = hvd.rank()

    def build():
        model = _model()
        return model, hvc.DiLoCo(model, torch.optim.Adam(model.parameters(), lr=0.01), **kw)

    model, opt = build()
    _train(model, opt, rank, steps)
    straight = [p.detach().numpy().copy() for p in model.parameters()]
    model, opt = build()
    state = hvc.elastic.TorchState(model=model, diloco=opt)
    _train(model, opt, rank, save_at)
    state.save()
    _train(model, opt, rank, 1, start=save_at)  # applies the fragment that was in flight at the commit
    state.restore()
    _train(model, opt, rank, steps - save_at, start=save_at)
    restored = [p.detach().numpy().copy() for p in model.parameters()]
    if rank == 1:  # make rank 1 differ, then sync
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            opt.global_params[0].add_(1.0)
        opt.t += 3
    state.sync()
    return {"straight": straight, "restored": restored, "step": opt.t,
            "synced": [p.detach().numpy().copy() for p in model.parameters()],
            "global": [g.numpy() for g in opt.global_parameters()]}
