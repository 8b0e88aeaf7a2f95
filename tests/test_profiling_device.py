"""The link fit's collectives move tensors of the device the gradients live on (issue 40): a
CUDA gradient travels by the path CUDA tensors take, so the fit must time that path. Checked with
a transport that records each tensor's device and torch's "meta" device standing in for a GPU (it
exists in every build; the CUDA run of the same calls is in scripts/gpu_check.sh's tests)."""

import pytest
import torch

from torch_ops import profiling


class RecordingTransport:
    """One rank; every collective returns its input and notes the device of each payload tensor."""

    def __init__(self):
        self.devices = []

    def rank(self):
        return 0

    def size(self):
        return 1

    def barrier(self):
        pass

    def allreduce_(self, t, name, average=False):
        if not name.startswith(("hvc.profile.allreduce", "hvc.profile.allgather", "hvc.profile.seq",
                                "hvc.profile.burst", "hvc.profile.launch")):  # not _rank_mean's CPU means
            self.devices.append(t.device.type)
        return t

    def allgather(self, t, name):
        self.devices.append(t.device.type)
        return t

    def launch(self, requests, name):
        self.devices.extend(r.tensor.device.type for r in requests)
        return requests

    def wait(self, handles):
        return tuple(r.tensor for r in handles)


def test_link_fit_tensors_follow_the_device():
    comm = RecordingTransport()
    samples = profiling.time_collectives(("allreduce", "allgather", "allreduce_half"), (4096, 65536), repeats=1,
                                         warmup=0, comm=comm, device="meta")
    assert [b for b, _ in samples["allreduce"]] == [4096, 65536]
    profiling.time_launch(repeats=1, warmup=0, comm=comm, device="meta")
    profiling.time_sequence(count=2, repeats=1, warmup=0, comm=comm, device="meta")
    profiling.time_burst(count=2, repeats=1, warmup=0, comm=comm, device="meta")
    # 3 kinds x 2 sizes x 1 call, launch 2 requests, sequence 2, burst 1 + 2
    assert comm.devices == ["meta"] * 13


def test_hop_fits_follow_the_device():
    """The two-level route choice's per-hop fits (``profile_hops``) time tensors of the gradients' device too."""
    from hvdcompress.topology import Topology

    local, cross = RecordingTransport(), RecordingTransport()
    fits = profiling.profile_hops(local, cross, Topology(4, 2), max_bytes=65536, repeats=1, device="meta")
    assert set(fits) == {"intra", "inter"}
    assert set(local.devices) == set(cross.devices) == {"meta"} and local.devices


def test_link_fit_defaults_to_the_cpu():
    comm = RecordingTransport()
    profiling.time_collectives(("allreduce",), (4096,), repeats=1, warmup=0, comm=comm)
    profiling.time_burst(count=2, repeats=1, warmup=0, comm=comm)
    assert comm.devices == ["cpu"] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it)")
def test_link_fit_on_cuda_waits_for_the_device():
    comm = RecordingTransport()
    samples = profiling.time_collectives(("allreduce",), (4096, 1 << 22), repeats=2, warmup=1, comm=comm,
                                         device="cuda")
    assert set(comm.devices) == {"cuda"}
    assert all(t > 0 for _, t in samples["allreduce"])
