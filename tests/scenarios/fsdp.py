"""FSDP2 with our compressing reduce-scatter on real gloo processes (tests/test_fsdp.py).

One spawn per world size runs every scenario named; each rank writes its results to a pickle.
The model has sizes that do not divide by 2 or 3, so FSDP pads its shards. Every reduce-scatter's
input and output is recorded, with the step and the op, for the test to replay the numpy oracle
(``hvdcompress.reference.fsdp.reduce_scatter``) on all ranks' inputs.
"""

from __future__ import annotations

import os
import pickle
import sys

STEPS = 4
# (spec, residual mode): every kind of payload (summed, gathered of one shape, gathered of varying
# size), every residual mode
CONFIGS = [
    ("none", None), ("fp16", None), ("bf16", None),
    ("qsgd:levels=7,bucket=16", "none"), ("qsgd:levels=3,bucket=16", "full"), ("qsgd:levels=3,bucket=16", "int8"),
    ("terngrad:bucket=16", None), ("signsgd", None), ("efsignsgd:momentum=0", None), ("onebit:momentum=0", None),
    ("topk:ratio=0.2", None), ("topk:ratio=0.2", "int8"), ("randomk:ratio=0.3", None),
    ("threshold:threshold=0.02", None), ("sparseloco:ratio=0.2", None),
    ("dgc:ratio=0.2,warmup_epochs=0,momentum=0.5,min_sparse_numel=16", None),
]
CKPT = ("qsgd:levels=3,bucket=16", "int8")
CKPT_TOPK = ("topk:ratio=0.2", "full")
SAVE_AT, TOTAL = 2, 5


def _model(world_mesh, seed=0, reduce_dtype=None):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 5))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=world_mesh, mp_policy=policy)
    fully_shard(model, mesh=world_mesh, mp_policy=policy)
    return model


def _batch(rank, step, nan=False):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 7, generator=g)
    y = torch.randn(6, 5, generator=g)
    if nan:
        x[0, 0] = float("nan")
    return x, y


def _full(model):
    return {n: p.full_tensor().detach().clone().numpy() for n, p in model.named_parameters()}


def _numpy(t):
    import torch
    t = t.detach().clone()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _recording(front, log):
    inner = front.reduce_scatter

    def record(prefix, output, input, group, op):
        step = front.session.step
        seen = _numpy(input)
        inner(prefix, output, input, group, op)
        log.append({"prefix": prefix, "step": step, "input": seen, "output": _numpy(output),
                    "op": str(op), "layout": front.layout(prefix)})
    front.reduce_scatter = record


def _train(mesh, spec, residual, steps, *, nan_at=None, start=0, model=None, front=None, record=True):
    import torch
    import hvdcompress.fsdp
    import torch.distributed as dist
    rank = dist.get_rank()
    model = model if model is not None else _model(mesh)
    front = front if front is not None else hvdcompress.fsdp.compress(model, spec, residual=residual)
    log, fulls, states_finite = [], [], []
    if record:
        _recording(front, log)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        x, y = _batch(rank, step, nan=(step == nan_at and rank == 1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads_finite = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
        if step == nan_at:
            states_finite.append((grads_finite, all(bool(torch.isfinite(t).all())
                                                    for st in front.session.param_state().values()
                                                    for t in st.values() if t.is_floating_point())))
            continue  # the AMP pattern: a non-finite step is skipped
        opt.step()
        fulls.append(_full(model))
    return {"log": log, "full": fulls, "finite": states_finite, "model": model, "front": front}


def every_spec(mesh) -> dict:
    out = {}
    for spec, residual in CONFIGS:
        got = _train(mesh, spec, residual, STEPS)
        out[f"{spec}|{residual}"] = {k: got[k] for k in ("log", "full")}
    return out


def mixed_precision(mesh) -> dict:
    """Gradients reduced in fp16 (FSDP pre-divides and asks for SUM) and bf16 (AVG)."""
    import torch
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        got = _train(mesh, "qsgd:levels=7,bucket=16", "full", 3, model=_model(mesh, reduce_dtype=dtype))
        out[str(dtype)] = {"full": got["full"], "ops": sorted({c["op"] for c in got["log"]}),
                           "dtypes": sorted({str(c["input"].dtype) for c in got["log"]
                                             if hasattr(c["input"], "dtype")})}
    return out


TORCH_ONLY = [("qsgd:levels=3,bucket=16", "int8"), ("terngrad:bucket=16", None), ("topk:ratio=0.2", None),
              ("dgc:ratio=0.2,warmup_epochs=0,momentum=0.5,min_sparse_numel=16", None)]


def torch_only(mesh) -> dict:
    """The branch a GPU tensor takes (torch ops, no compiled kernels, no numpy views), on CPU."""
    from hvdcompress import native
    native.set_torch_only(True)
    try:
        out = {}
        for spec, residual in TORCH_ONLY:
            got = _train(mesh, spec, residual, 3)
            out[f"{spec}|{residual}"] = {k: got[k] for k in ("log", "full")}
        return out
    finally:
        native.set_torch_only(False)


def nonfinite(mesh) -> dict:
    got = _train(mesh, "topk:ratio=0.2", "full", 3, nan_at=1)
    return {k: got[k] for k in ("log", "full", "finite")}


def checkpoint(mesh) -> dict:
    """A run of TOTAL steps, and one saved after SAVE_AT steps and resumed in fresh objects."""
    import hvdcompress.fsdp
    out = {}
    for spec, residual in (CKPT, CKPT_TOPK):
        whole = _train(mesh, spec, residual, TOTAL, record=False)
        first = _train(mesh, spec, residual, SAVE_AT, record=False)
        saved = {"model": {k: v.detach().clone() for k, v in first["model"].state_dict().items()},
                 "hvc": first["front"].state_dict()}
        if (spec, residual) == CKPT:
            saved_int8 = saved["hvc"]
        model = _model(mesh, seed=123)  # other weights: all come from the checkpoint
        model.load_state_dict(saved["model"])
        front = hvdcompress.fsdp.compress(model, spec, residual=residual)
        front.load_state_dict(saved["hvc"])
        rest = _train(mesh, spec, residual, TOTAL - SAVE_AT, start=SAVE_AT, model=model, front=front, record=False)
        out[f"{spec}|{residual}"] = {"whole": whole["full"][-1], "resumed": rest["full"][-1],
                                     "step": front.step, "keys": sorted(saved["hvc"]["state"])}
    other = hvdcompress.fsdp.compress(_model(mesh), CKPT[0], residual="full")
    try:
        other.load_state_dict(saved_int8)
        out["mode_mismatch"] = "accepted"
    except ValueError as e:
        out["mode_mismatch"] = str(e)
    return out


def refusals(mesh) -> dict:
    """Bad specs and options are refused on every rank before any collective (a collective after
    them proves no rank was left waiting)."""
    import torch
    import torch.distributed as dist
    import hvdcompress.fsdp
    model = _model(mesh)
    out = {}
    for spec, residual in [("powersgd:rank=2", None), ("sketch", None), ("terngrad:share_scale=true", None),
                           ("dgc:momentum_correction=false", None), ("qsgd", "bogus"), ("signsgd", "int8"),
                           ("dgc", "none"), ("qsgd:levels=999", None)]:
        try:
            hvdcompress.fsdp.compress(model, spec, residual=residual)
            out[f"{spec}|{residual}"] = "accepted"
        except ValueError as e:
            out[f"{spec}|{residual}"] = str(e)
    try:
        hvdcompress.fsdp.compress(torch.nn.Linear(2, 2), "qsgd")
        out["unsharded"] = "accepted"
    except ValueError as e:
        out["unsharded"] = str(e)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    hsdp = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    layouts = {"hsdp": dict(mesh=hsdp),
               "dim1": dict(mesh=mesh, shard_placement_fn=lambda p: Shard(1)
                            if p.dim() == 2 else None)}
    for name, kw in layouts.items():
        m = torch.nn.Sequential(torch.nn.Linear(6, 6))
        fully_shard(m, **kw)
        try:
            hvdcompress.fsdp.compress(m, "qsgd")
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def example(mesh) -> dict:
    """examples/fsdp_charlm.py, 3 steps of a tiny model, in this process group."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    import fsdp_charlm
    args = fsdp_charlm.parse_args(["--steps", "3", "--width", "32", "--layers", "1", "--context", "16",
                                   "--compression", "qsgd:levels=7,bucket=128", "--residual", "int8"])
    return fsdp_charlm.train(args)


def _worker(rank, world, port, names, out_dir):
    sys.modules["horovod"] = None  # any import of Horovod on these paths fails
    import warnings
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    from scenarios.kit import run_scenarios
    out = run_scenarios(names, lambda name: globals()[name](mesh))
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def launch(world: int, names, worker=None) -> list:
    """One spawn of ``world`` gloo processes running ``names`` (``worker``: default this module's
    ``_worker``); every rank's results, rank order."""
    from scenarios.kit import gloo_spawn
    return gloo_spawn(worker or _worker, world, args=(list(names),), prefix="hvc-fsdp-")
