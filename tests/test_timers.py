"""The device-aware timers (torch_ops.scheduling): which one a device picks, that a CUDA reading
waits for the device before it reads the clock, and that every CPU timing keeps the host clock."""

import time

import pytest
import torch

from torch_ops import profiling, scheduling
from torch_ops.timing import CudaTimer, HostTimer, timer_for


def test_cpu_work_takes_the_host_clock():
    for items in ((), (None,), (torch.zeros(3),), ([torch.zeros(1), torch.ones(2)],), ("cpu",),
                  (torch.device("cpu"),), (torch.zeros(1, device="meta"),), (iter([torch.zeros(1)]),)):
        t = timer_for(*items)
        assert type(t) is HostTimer and t.device == torch.device("cpu"), items


def test_cuda_devices_pick_the_waiting_timer_on_their_device():
    # devices and strings need no GPU to be named
    assert isinstance(timer_for("cuda"), CudaTimer)
    t = timer_for([torch.zeros(1)], torch.device("cuda", 3))
    assert isinstance(t, CudaTimer) and t.device == torch.device("cuda", 3)
    assert timer_for(None, "cpu", "cuda:1").device == torch.device("cuda", 1)


def test_a_cuda_reading_waits_for_the_device_first(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(time, "perf_counter", lambda: calls.append(("clock", None)) or 7.0)
    t = timer_for("cuda:2")
    assert t.now() == 7.0
    t.wait()
    assert calls == [("sync", torch.device("cuda", 2)), ("clock", None), ("sync", torch.device("cuda", 2))]


def test_host_timer_never_touches_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronize on the CPU path"))
    t = HostTimer()
    a = t.now()
    t.wait()
    assert t.now() >= a


def test_cpu_profiling_reads_the_host_clock(monkeypatch):
    """compress / decompress timings and the workload profile on CPU tensors: no device wait."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronize on the CPU path"))
    assert profiling.compress_seconds("topk:ratio=0.1", 256, repeats=2, warmup=0) > 0
    assert profiling.decompress_seconds("qsgd", 256, repeats=2, warmup=0) > 0
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    w = profiling.profile_workload(model, lambda: model(torch.randn(3, 4)).sum(), iters=2, warmup=1, average=False)
    assert len(w.names) == 4


def test_scheduler_timer_follows_what_it_measures():
    s = scheduling.Scheduler("layerwise", __import__("hvdcompress").resolve("none"), None, 1, {"a": 4.0}, 1)
    assert s.device == torch.device("cpu") and type(s.timer()) is HostTimer
    g = scheduling.Scheduler("mgs", __import__("hvdcompress").resolve("topk:ratio=0.1"), None, 1, {"a": 4.0}, 1,
                             device="cuda:1")
    assert not g.done and isinstance(g.timer(), CudaTimer) and g.timer().device == torch.device("cuda", 1)
    assert g.restarted(1).device == torch.device("cuda", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_advise_device_cuda_without_a_gpu_is_a_clear_error(capsys):
    from hvdcompress.bench import advise
    with pytest.raises(SystemExit):
        advise.main(["--profile", "vgg16-v100", "--device", "cuda", "--quick"])
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


def test_bench_memory_pass_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronize on the CPU path"))
    from hvdcompress.bench.torch_worker import memory_pass_seconds
    assert memory_pass_seconds(1024, repeats=3) > 0


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")


@CUDA
def test_the_cuda_timer_times_the_kernel_not_its_launch():
    """A kernel that spins ~50 ms: the host clock sees its launch (microseconds), the CUDA timer the kernel.
    The first launch of a process pays CUDA's lazy set-up on the host (module load, ~10 ms), so one
    short spin runs first and the launch is timed after it."""
    spin = 50_000_000  # clock cycles (about 25-50 ms at 1-2 GHz)
    host, dev = HostTimer(), timer_for("cuda")
    torch.cuda._sleep(1000)  # warm-up: the lazy set-up is not the launch being measured
    dev.now()
    torch.cuda.synchronize()
    t0 = host.now()
    torch.cuda._sleep(spin)
    launched = host.now() - t0
    torch.cuda.synchronize()
    t0 = dev.now()
    torch.cuda._sleep(spin)
    waited = dev.now() - t0
    assert waited > 0.01 and waited > 20 * launched, (waited, launched)


@CUDA
def test_codecs_and_workload_time_on_the_gpu():
    assert profiling.compress_seconds("topk:ratio=0.01", 1 << 16, repeats=2, warmup=1, device="cuda") > 0
    assert profiling.decompress_seconds("qsgd", 1 << 16, repeats=2, warmup=1, device="cuda") > 0
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")
    w = profiling.profile_workload(model, lambda: model(x).sum(), iters=2, warmup=1, average=False)
    assert len(w.names) == 4 and w.compute_seconds > 0


class _OneRank:
    """A communicator of one rank (what load_or_profile asks of one)."""

    def rank(self):
        return 0

    def size(self):
        return 1

    def broadcast_object(self, obj, name, root=0):
        return obj

    def allgather_object(self, obj, name):
        return [obj]


@pytest.mark.parametrize("cached_on, asked, reprofiled", [("cpu", None, False), ("cuda", None, True),
                                                         ("cpu", "cuda:0", True), ("cuda", "cuda:1", False)])
def test_the_cache_serves_a_model_only_to_the_device_type_it_was_timed_on(monkeypatch, cached_on, asked, reprofiled):
    from dataclasses import replace
    from hvdcompress.schedule.costmodel import CostModel
    model = CostModel.from_link(1, 10.0, 1e-5)
    model = replace(model, meta={"device": "cuda"} if cached_on == "cuda" else {})
    monkeypatch.setattr(CostModel, "cached", classmethod(lambda cls, world, names: model))
    calls = []
    monkeypatch.setattr(profiling, "profile_cost_model", lambda specs, **kw: calls.append(kw["device"]) or "fresh")
    monkeypatch.setattr(profiling, "with_fits", lambda m, specs, **kw: calls.append(("fits", kw["device"])) or m)
    got = profiling.load_or_profile(["none"], comm=_OneRank(), device=asked, save=False)
    want_device = torch.device(asked or "cpu")
    if reprofiled:
        assert got == "fresh" and calls == [want_device]
    else:
        assert isinstance(got, CostModel) and calls == [("fits", want_device)]
