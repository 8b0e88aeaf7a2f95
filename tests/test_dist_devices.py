"""TorchDistCommunicator and devices: which device types a group's backend moves, and the staging
of a tensor on any other (a CPU tensor on NCCL) through the group's device and back.

On the CPU the staging is driven on a one-rank Gloo group told that it moves no CPU tensor (so
each tensor travels as a staged copy); on a GPU (scripts/gpu_check.sh), on a one-rank NCCL group
with CPU tensors, as the profiler and the scheduler hand them over.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from torch_ops.collectives import Allgather, Allreduce, Alltoall, Flag
from torch_ops.dist_collectives import TorchDistCommunicator, carried_device_types

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")


def test_carried_device_types():
    assert carried_device_types("nccl") == {"cuda"}
    assert carried_device_types("gloo") == {"cpu", "cuda"}
    assert carried_device_types("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert carried_device_types("cuda:nccl") == {"cuda"}
    assert carried_device_types("ucc") is None


@pytest.fixture(scope="module")
def groups():
    """The default group: one Gloo rank; and a one-rank NCCL group where there is a GPU."""
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"), rank=0, world_size=1)
        try:
            nccl = dist.new_group([0], backend="nccl") if torch.cuda.is_available() else None
            yield nccl
        finally:
            dist.destroy_process_group()


def _round(comm):
    t, f = torch.arange(6, dtype=torch.float32), torch.tensor([2.0])
    g, h = torch.arange(8, dtype=torch.int16).reshape(4, 2), torch.ones(3)
    a = torch.arange(5, dtype=torch.float64)
    handles = comm.launch((Allreduce(t), Flag(f), Allgather(g), Allgather(h, True), Alltoall(a, (5,))), "x")
    out = comm.wait(handles)
    return (t, f, g, h, a), out


def _check(comm):
    (t, f, g, h, a), out = _round(comm)
    assert out[0] is t and out[1] is f  # allreduces sum in place: the result is the request's tensor
    assert torch.equal(t, torch.arange(6, dtype=torch.float32)) and float(f[0]) == 2.0
    assert torch.equal(out[2], g) and out[2].device == g.device and out[2].dtype == torch.int16
    assert torch.equal(out[3], h) and torch.equal(out[4], a) and out[4].device == a.device
    x = torch.full((4,), 3.0)
    assert comm.allreduce_(x, "b", average=True) is x and torch.equal(x, torch.full((4,), 3.0))
    assert comm.allgather_object({"k": 1}, "o") == [{"k": 1}]


def test_staged_tensors_travel_and_come_back(groups, monkeypatch):
    """A group that moves no CPU tensor: each request is a staged copy; results as without it."""
    import torch.distributed as dist
    comm = TorchDistCommunicator()
    _check(comm)  # as it is
    comm._carried = frozenset({"meta"})  # stand-in for NCCL: CPU tensors are not moved as they are
    assert comm.device() == torch.device("cpu")
    sent = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: sent.append(t) or real(t, *a, **k))
    x = torch.ones(4)
    assert comm.allreduce_(x, "s") is x and torch.equal(x, torch.ones(4))
    assert len(sent) == 1 and sent[0] is not x  # a copy travelled
    _check(comm)


@CUDA
def test_cpu_tensors_on_nccl(groups):
    comm = TorchDistCommunicator(groups)
    assert comm.device().type == "cuda"
    _check(comm)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_nonfinite_flag_counts_on_the_tensors_device(device):
    from torch_ops.nonfinite import count_nonfinite, nonfinite_flag
    for values in ([1.0, 2.0], [float("nan"), 1.0, float("inf"), -float("inf")], [], [3e38, 3e38]):
        x = torch.tensor(values, dtype=torch.float32, device=device)
        flag = nonfinite_flag(x)
        assert flag.device == x.device and flag.dtype == torch.float32 and flag.shape == (1,)
        assert float(flag[0]) == count_nonfinite(x.cpu())
