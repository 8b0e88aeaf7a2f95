"""The two-level layout (shard inside a node, our compressor across nodes) and the reduce-scatter's
``async_op``, on 4 real gloo processes as 2 "nodes" x 2 (tests/test_fsdp_hybrid.py).

One spawn runs every scenario named; each rank writes its results to a pickle. Every reduction
records, per rank, the reduce-scatter's input inside the node (FSDP's own dense one is wrapped by a
recording comm that calls ``torch.distributed.reduce_scatter_tensor``, as FSDP's default does), the
shard the all-reduce hook receives and what it leaves, for the test to replay the numpy oracle
(``hvdcompress.reference.fsdp.hybrid_reduce_scatter``).
"""

from __future__ import annotations

import os
import sys

from scenarios import kit
from scenarios.fsdp import _batch, _full, _numpy

TOPOLOGY = "2x2"
STEPS = 3
# (across spec, its residual mode, inside spec): dense inside (FSDP's own), 8-bit inside / 4-bit
# across (SDP4Bit's layout) with an 8-bit residual, fp16 inside with top-k across, a layerwise
# two-round compressor across (PowerSGD: one exchange per parameter piece)
CONFIGS = [
    ("qsgd:levels=7,bucket=16", "none", None),
    ("qsgd:levels=7,bucket=16", "int8", "qsgd:levels=127,bucket=16"),
    ("topk:ratio=0.2", "full", "fp16"),
    ("powersgd:rank=1", None, None),
]
CKPT = ("qsgd:levels=3,bucket=16", "int8", "topk:ratio=0.3")
SAVE_AT, TOTAL = 2, 4


def _model(shard_mesh, seed=0, reduce_dtype=None):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 5))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model


class RecordingReduceScatter:
    """FSDP's dense reduce-scatter (``reduce_scatter_tensor``), recording input, output and op."""

    def __init__(self, log):
        self.log = log

    def allocate(self, size, *, dtype, device):
        import torch
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist
        seen = _numpy(input_tensor)
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
        self.log.append({"input": seen, "output": _numpy(output_tensor), "op": str(op)})
        return None


def _recording(model, front, inside):
    """Wrap the hops of ``front``: returns (reduce-scatter log, all-reduce log), rank-local."""
    rs_log, ar_log = [], []
    if inside is None:
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule) and m is not model:
                m.set_custom_reduce_scatter(RecordingReduceScatter(rs_log))
    else:
        inner_rs = front.reduce_scatter

        def record_rs(prefix, output, input, group, op):
            seen = _numpy(input)
            inner_rs(prefix, output, input, group, op)
            rs_log.append({"input": seen, "output": _numpy(output), "op": str(op)})
        front.reduce_scatter = record_rs
    inner_ar = front.all_reduce

    def record_ar(prefix, shard):
        step = front.session.step
        seen = _numpy(shard)
        inner_ar(prefix, shard)
        ar_log.append({"prefix": prefix, "step": step, "input": seen, "output": _numpy(shard),
                       "layout": front.layout(prefix)})
    front.all_reduce = record_ar
    return rs_log, ar_log


def _train(shard_mesh, spec, residual, inside, steps, *, nan_at=None, start=0, model=None, front=None,
           record=True):
    import torch
    import torch.distributed as dist
    import hvdcompress.fsdp
    rank = dist.get_rank()
    model = model if model is not None else _model(shard_mesh)
    if front is None:
        front = hvdcompress.fsdp.compress(model, spec, residual=residual, topology=TOPOLOGY, inside=inside)
    rs_log, ar_log = _recording(model, front, inside) if record else ([], [])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fulls, finite = [], []
    for step in range(start, start + steps):
        x, y = _batch(rank, step, nan=(step == nan_at and rank == 1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == nan_at:
            grads = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
            states = all(bool(torch.isfinite(t).all()) for st in front.session.param_state().values()
                         for t in st.values() if t.is_floating_point())
            finite.append((grads, states))
            continue
        opt.step()
        fulls.append(_full(model))
    return {"rs": rs_log, "ar": ar_log, "full": fulls, "finite": finite, "model": model, "front": front,
            "bytes": front.stats.as_dict()["bytes_per_step"]}


def every_spec(meshes) -> dict:
    out = {}
    for spec, residual, inside in CONFIGS:
        got = _train(meshes["shard"], spec, residual, inside, STEPS)
        out[f"{spec}|{residual}|{inside}"] = {k: got[k] for k in ("rs", "ar", "full", "bytes")}
    return out


def nonfinite(meshes) -> dict:
    """A NaN in rank 1's gradient at step 1, dense inside: NaN on all four ranks, state finite."""
    got = _train(meshes["shard"], "topk:ratio=0.2", "full", None, 3, nan_at=1)
    return {k: got[k] for k in ("rs", "ar", "full", "finite")}


def checkpoint(meshes) -> dict:
    """TOTAL steps in one run, and SAVE_AT steps saved and resumed in fresh objects."""
    import hvdcompress.fsdp
    spec, residual, inside = CKPT
    shard = meshes["shard"]
    whole = _train(shard, spec, residual, inside, TOTAL, record=False)
    first = _train(shard, spec, residual, inside, SAVE_AT, record=False)
    saved = {"model": {k: v.detach().clone() for k, v in first["model"].state_dict().items()},
             "hvc": first["front"].state_dict()}
    model = _model(shard, seed=123)
    model.load_state_dict(saved["model"])
    front = hvdcompress.fsdp.compress(model, spec, residual=residual, topology=TOPOLOGY, inside=inside)
    front.load_state_dict(saved["hvc"])
    rest = _train(shard, spec, residual, inside, TOTAL - SAVE_AT, start=SAVE_AT, model=model, front=front,
                  record=False)
    out = {"whole": whole["full"][-1], "resumed": rest["full"][-1], "step": front.step,
           "keys": sorted(saved["hvc"]["state"]), "inside_keys": sorted(saved["hvc"]["inside"]["state"])}
    for name, kw in (("flat", dict(mesh=meshes["world"])), ("dense_inside", dict(mesh=shard))):
        m = _model(kw["mesh"])
        other = (hvdcompress.fsdp.compress(m, spec, residual=residual) if name == "flat" else
                 hvdcompress.fsdp.compress(m, spec, residual=residual, topology=TOPOLOGY))
        try:
            other.load_state_dict(saved["hvc"])
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def refusals(meshes) -> dict:
    """Bad layouts and specs refused on every rank before any collective (an all-reduce after
    them proves no rank was left waiting)."""
    import torch
    import torch.distributed as dist
    import hvdcompress.fsdp
    from torch.distributed.fsdp import fully_shard
    out = {}
    cases = {
        "nodes": (meshes["shard"], dict(topology="3x1")),
        "one_node": (meshes["world"], dict(topology="1x4")),
        "world_mesh": (meshes["world"], dict(topology=TOPOLOGY)),
        "replicate_mesh": (meshes["replicate"], dict(topology=TOPOLOGY)),
        "inside_powersgd": (meshes["shard"], dict(topology=TOPOLOGY, inside="powersgd")),
        "inside_flat": (meshes["world"], dict(inside="fp16")),
        "onebitadam": (meshes["shard"], dict(topology=TOPOLOGY, spec="onebitadam")),
        "bad_spec": (meshes["shard"], dict(topology=TOPOLOGY, spec="qsgd:levels=0")),
    }
    for name, (mesh, kw) in cases.items():
        spec = kw.pop("spec", "qsgd")
        try:
            hvdcompress.fsdp.compress(_model(mesh), spec, **kw)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6))
    fully_shard(m, mesh=meshes["hybrid"])  # native HSDP
    try:
        hvdcompress.fsdp.compress(m, "qsgd", topology=TOPOLOGY)
        out["native_hsdp"] = "accepted"
    except ValueError as e:
        out["native_hsdp"] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def async_op(meshes) -> dict:
    """The reduce-scatter called with async_op=True (FSDP2 never does; a caller may): two modules'
    reduce-scatters in flight, then waited for in order; flat layout over the 4 ranks."""
    import torch
    import torch.distributed as dist
    import hvdcompress.fsdp
    from hvdcompress.fsdp import CompressedReduceScatter
    rank = dist.get_rank()
    out = {}
    for spec in ("qsgd:levels=7,bucket=16", "topk:ratio=0.2"):
        model = _model(meshes["world"])
        front = hvdcompress.fsdp.compress(model, spec)
        group = meshes["world"].get_group()
        calls, works = [], []
        for prefix in ("0", "2"):
            _, _, size = front.layout(prefix)
            g = torch.Generator().manual_seed(77 * rank + len(prefix) + int(prefix))
            x = torch.randn(4 * size, generator=g)
            y = torch.empty(size)
            work = CompressedReduceScatter(front, prefix)(y, x, group, dist.ReduceOp.AVG, async_op=True)
            calls.append({"prefix": prefix, "input": x.numpy().copy(), "output": y, "layout": front.layout(prefix)})
            works.append(work)
        pending = [w.is_completed() for w in works]
        for w in works:
            w.wait()
        out[spec] = {"pending": pending, "done": [w.is_completed() for w in works], "step": front.step,
                     "calls": [dict(c, output=c["output"].numpy().copy()) for c in calls]}
    return out


def mixed_precision(meshes) -> dict:
    """fp16 (FSDP pre-divides inside the node and asks for SUM) and bf16 (AVG) reduce dtypes, dense
    and 8-bit inside, 4-bit across: all four replicas identical and finite."""
    import torch
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for inside in (None, "qsgd:levels=127,bucket=16"):
            got = _train(meshes["shard"], "qsgd:levels=7,bucket=16", "full", inside, 3,
                         model=_model(meshes["shard"], reduce_dtype=dtype), record=False)
            out[f"{dtype}|{inside}"] = got["full"]
    return out


def example(meshes) -> dict:
    """examples/fsdp_charlm.py as 2 nodes x 2, fp16 inside, 4-bit codes across: 3 steps."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    import fsdp_charlm
    args = fsdp_charlm.parse_args(["--steps", "3", "--width", "32", "--layers", "1", "--context", "16",
                                   "--compression", "qsgd:levels=7,bucket=128", "--topology", TOPOLOGY,
                                   "--inside", "fp16"])
    return fsdp_charlm.train(args)


def _worker(rank, world, port, names, out_dir):
    kit.gloo_init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    import hvdcompress.fsdp
    hybrid = hvdcompress.fsdp.hybrid_mesh(TOPOLOGY)
    meshes = {"world": init_device_mesh("cpu", (world,)), "hybrid": hybrid, "shard": hybrid["shard"],
              "replicate": hybrid["replicate"]}
    out = kit.run_scenarios(names, lambda name: globals()[name](meshes))
    kit.gloo_finish(out, out_dir, rank)


def launch(names) -> list:
    from scenarios.fsdp import launch as spawn
    return spawn(4, names, worker=_worker)
