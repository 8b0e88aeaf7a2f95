"""Worker code for tests/test_delayed.py (delayed gradient averaging, temporal sparsity)."""

from __future__ import annotations

import copy
import traceback
from functools import partial

from scenarios import kit

FLUSH_SPECS = ["none", "fp16", "topk:ratio=0.1", "dgc:ratio=0.1,warmup_epochs=0,min_sparse_numel=16",
               "randomk:ratio=0.2,seed=3"]

_model = partial(kit.torch_mlp, (10, 16, 3), ("tanh",))
_batch = partial(kit.torch_batch, n=8, features=10, classes=3, stride=97)


def _opt(model, spec, **kw):
    import torch
    import hvdcompress.torch as hvc
    momentum = kw.pop("momentum", 0.9)
    return hvc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                    named_parameters=model.named_parameters(), compression=spec,
                                    schedule=kw.pop("schedule", "layerwise"), **kw)


def _steps(model, opt, first, last):
    import horovod.torch as hvd
    import torch.nn as nn
    for step in range(first, last):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()


def unrolled_identity() -> dict:
    """Plain SGD on a parameter whose gradient is a fixed vector per rank and step, so the whole
    trajectory is known: w_n,j = w_0 - lr*sum_(t<n-D) mean_k c_t,k - lr*sum_(n-D<=t<n) c_t,j."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        for delay in (0, 1, 2, 3):
            w = torch.nn.Parameter(torch.zeros(6))
            opt = hvc.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                           delay=delay, schedule="layerwise")
            for step in range(7):
                c = torch.from_numpy(_fixed(hvd.rank(), step))
                opt.zero_grad()
                (w * c).sum().backward()
                opt.step()
            out[delay] = w.detach().numpy().tolist()
            opt.flush()
            out[f"{delay}.flushed"] = w.detach().numpy().tolist()
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


MOMENTUM_IDENTITY_SPECS = ["dgc:ratio=1.0,warmup_epochs=0",  # a 6-entry tensor: DGC sends it dense (u)
                           "dgc:ratio=1.0,warmup_epochs=0,min_sparse_numel=1,sample_ratio=1.0,momentum_masking=false"]


def unrolled_identity_with_momentum() -> dict:
    """DGC keeps SGD's momentum (0.9) in its memory; at density 1 without masking it sends its
    whole velocity U_t,k = sum_(s<=t) m^(t-s) c_s,k every step. Delayed, the local term is the
    local velocity (torch_ops.delayed), so the trajectory is known:
    w_n,j = w_0 - lr*sum_(t<n-D) mean_k U_t,k - lr*sum_(n-D<=t<n) U_t,j."""
    import horovod.torch as hvd
    import torch
    import hvdcompress.torch as hvc
    hvd.init()
    out = {}
    try:
        for si, spec in enumerate(MOMENTUM_IDENTITY_SPECS):
            for delay in (0, 1, 3):
                w = torch.nn.Parameter(torch.zeros(2, 3))
                opt = hvc.DistributedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9), named_parameters=[("w", w)],
                                               compression=spec, delay=delay, schedule="layerwise")
                for step in range(7):
                    c = torch.from_numpy(_fixed(hvd.rank(), step)).reshape(2, 3)
                    opt.zero_grad()
                    (w * c).sum().backward()
                    opt.step()
                out[f"{si}|{delay}"] = w.detach().reshape(-1).numpy().tolist()
                opt.flush()
                out[f"{si}|{delay}.flushed"] = w.detach().reshape(-1).numpy().tolist()
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


def _fixed(rank, step):
    import numpy as np
    return np.random.default_rng(1000 * rank + step).standard_normal(6).astype(np.float32)


def zero_delay_is_the_synchronous_optimizer() -> dict:
    import horovod.torch as hvd
    import torch
    hvd.init()
    out = {}
    try:
        for spec in FLUSH_SPECS:
            a, b = _model(), _model()
            oa, ob = _opt(a, spec), _opt(b, spec, delay=0, sync_every=1)
            _steps(a, oa, 0, 5)
            _steps(b, ob, 0, 5)
            out[spec] = bool(torch.equal(kit.torch_flat(a), kit.torch_flat(b)))
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


def flush_makes_replicas_identical() -> dict:
    import horovod.torch as hvd
    hvd.init()
    out = {}
    try:
        for spec in FLUSH_SPECS:
            for delay, every in ((1, 1), (2, 1), (4, 1), (0, 2), (2, 3)):
                model = _model()
                opt = _opt(model, spec, delay=delay, sync_every=every)
                _steps(model, opt, 0, 7)
                before = kit.torch_identical(model, f"before.{spec}.{delay}.{every}")
                opt.flush()
                after = kit.torch_identical(model, f"after.{spec}.{delay}.{every}")
                _steps(model, opt, 7, 9)  # training goes on after a flush
                opt.flush()
                again = kit.torch_identical(model, f"again.{spec}.{delay}.{every}")
                out[f"{spec}|{delay}|{every}"] = (before, after, again)
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


def resume_with_exchanges_in_flight() -> dict:
    import horovod.torch as hvd
    import torch
    hvd.init()
    out = {}
    try:
        for spec, delay, every in (("topk:ratio=0.2", 2, 1), ("dgc:ratio=0.1,warmup_epochs=0,min_sparse_numel=16", 3, 1),
                                   ("none", 1, 2), ("dgc:ratio=0.1,warmup_epochs=0,min_sparse_numel=16", 2, 2)):
            model = _model()
            opt = _opt(model, spec, delay=delay, sync_every=every)
            _steps(model, opt, 0, 5)
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            _steps(model, opt, 5, 9)
            straight = kit.torch_flat(model)
            opt.state_dict()  # completes opt's exchanges in flight: opt2 reuses their Horovod op names
            model2 = _model()
            opt2 = _opt(model2, spec, delay=delay, sync_every=every)
            model2.load_state_dict(saved[0])
            opt2.load_state_dict(saved[1])
            _steps(model2, opt2, 5, 9)
            resumed = kit.torch_flat(model2)
            opt.flush()
            opt2.flush()
            same_after_flush = bool(torch.equal(kit.torch_flat(model), kit.torch_flat(model2)))
            out[f"{spec}|{delay}|{every}"] = (bool(torch.equal(straight, resumed)), same_after_flush,
                         len(saved[1]["hvdcompress"]["delayed"]["corrections"])
                         + len(saved[1]["hvdcompress"]["delayed"]["accumulated"]))  # in flight or unsent
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out


NONFINITE_SPECS = ["none", "topk:ratio=0.1", "dgc:ratio=0.1,warmup_epochs=0,min_sparse_numel=16"]
NONFINITE_DELAY = 2


def nonfinite_with_exchanges_in_flight() -> dict:
    """One bad value (inf or NaN) in one gradient entry on rank 1 at step 2, delay 2: rank 1 must
    see it in its gradient at step 2 (its local term) and every rank at step 4 (the guarded
    exchange's correction); with the AMP-style skip, training goes on finite and a flush makes
    the replicas identical; no non-finite value stays in the saved state, and a checkpoint whose
    delayed state holds one is refused on load."""
    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    hvd.init()
    out = {}
    try:
        for spec in NONFINITE_SPECS:
            for bad in (float("inf"), float("nan")):
                for mode in ("plain", "skip"):
                    model = _model()
                    opt = _opt(model, spec, delay=NONFINITE_DELAY)
                    when = {"step": -1}

                    def inject(grad, when=when, bad=bad):
                        if when["step"] == 2 and hvd.rank() == 1:
                            grad = grad.clone()
                            grad[1, 3] = bad
                        return grad
                    model[0].weight.register_hook(inject)
                    seen = []
                    for step in range(8):
                        when["step"] = step
                        opt.zero_grad()
                        x, y = _batch(hvd.rank(), step)
                        nn.CrossEntropyLoss()(model(x), y).backward()
                        opt.synchronize()
                        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                            seen.append(step)
                            if mode == "skip":
                                continue
                        with opt.skip_synchronize():
                            opt.step()
                    key = f"{spec}|{bad}|{mode}"
                    finite = bool(torch.isfinite(kit.torch_flat(model)).all())
                    sd = opt.state_dict()["hvdcompress"]
                    tensors = [t for st in sd["state"].values() for t in st.values() if torch.is_tensor(t)]
                    tensors += [t for part in ("velocity", "accumulated", "applied")
                                for t in sd["delayed"][part].values()]
                    tensors += [t for cs in sd["delayed"]["corrections"].values() for t in cs.values()]
                    state_finite = all(bool(torch.isfinite(t).all()) for t in tensors)
                    identical = None
                    if finite:
                        opt.flush()
                        identical = kit.torch_identical(model, "nonfinite." + key)
                    out[key] = {"seen": seen, "params_finite": finite, "state_finite": state_finite,
                                "identical_after_flush": identical}
        # a checkpoint whose delayed state holds NaN is refused, naming it
        model = _model()
        opt = _opt(model, NONFINITE_SPECS[2], delay=NONFINITE_DELAY)
        _steps(model, opt, 0, 3)
        sd = opt.state_dict()
        name = sorted(sd["hvdcompress"]["delayed"]["velocity"])[0]
        sd["hvdcompress"]["delayed"]["velocity"][name][0] = float("nan")
        try:
            _opt(_model(), NONFINITE_SPECS[2], delay=NONFINITE_DELAY).load_state_dict(sd)
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
    except Exception:
        out["error"] = traceback.format_exc()
    hvd.shutdown()
    return out
