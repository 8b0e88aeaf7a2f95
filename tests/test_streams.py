"""torch_ops.streams: exchanges of CUDA tensors on a side stream.

On the CPU: nothing is wrapped and CUDA is never touched; the ordering the side stream gets (wait
for the caller, every step on the side stream, the caller waits for the result) is checked with
stand-in streams. On a GPU (scripts/gpu_check.sh): results bit for bit the same with and without
the side stream, and an encode that spins does not hold up the compute stream.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import pytest
import torch

from torch_ops import streams
from torch_ops.streams import OnStream, SideStreams, on_side


def test_cpu_exchanges_are_not_wrapped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a CUDA stream made on the CPU path"))
    gen, transport = object(), object()
    s = SideStreams()
    assert s.route(gen, torch.zeros(3), transport) == (gen, transport)
    assert s.transport(transport, torch.device("cpu")) is transport


class _Stream:
    def __init__(self, name, log):
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


class _Input:
    device = torch.device("cpu")

    def __init__(self, log):
        self.log = log

    def record_stream(self, stream):
        self.log.append(f"input used on {stream.name}")


def test_the_order_on_the_side_stream(monkeypatch):
    """Stand-in streams: the side stream waits for the caller before the encode, every step runs
    with the side stream current, the caller waits for the side stream when the result is out."""
    log = []
    current = [_Stream("compute", log)]
    side = _Stream("side", log)

    @contextlib.contextmanager
    def use(stream):
        saved, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = saved

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", use)

    def exchange():
        log.append(f"encode on {current[0].name}")
        got = yield ("round 1",)
        log.append(f"decode {got} on {current[0].name}")
        return torch.ones(2)

    gen = on_side(exchange(), _Input(log), side)
    assert next(gen) == ("round 1",)
    with pytest.raises(StopIteration) as stop:
        gen.send("r1")
    assert torch.equal(stop.value.value, torch.ones(2))
    assert log == ["side waits for compute", "input used on side", "encode on side", "decode r1 on side",
                   "compute waits for side"]

    class Transport:
        def launch(self, requests, name):
            return current[0].name

        @contextlib.contextmanager
        def batch(self):
            log.append(f"batch on {current[0].name}")
            yield

        def size(self):
            return current[0].name

    log.clear()
    t = OnStream(Transport(), side)
    assert t.launch((), "x") == "side" and t.size() == "side"
    with t.batch():
        pass
    assert log == ["side waits for compute", "batch on side"]


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("HVDCOMPRESS_SIDE_STREAM", "0")
    assert not streams.enabled()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
SPECS = ("none", "topk:ratio=0.1", "dgc:ratio=0.05,min_sparse_numel=64,warmup_epochs=0,clip_norm=5.0",
         "signsgd", "qsgd:levels=3,bucket=64", "powersgd:rank=2", "sparseloco:ratio=0.1")


@pytest.fixture(scope="module")
def world1():
    """A one-rank Gloo group in this process (Gloo takes CUDA tensors)."""
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _ddp_params(spec):
    import torch.nn as nn
    import hvdcompress.ddp as hddp
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 4)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state, hook = hddp.comm_hook(spec, model=ddp, optimizer=opt)
    ddp.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 12, generator=g).cuda()
        opt.zero_grad()
        nn.CrossEntropyLoss()(ddp(x), x[:, :4].argmax(1)).backward()
        opt.step()
    torch.cuda.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


@CUDA
@pytest.mark.parametrize("spec", SPECS)
def test_results_are_the_same_on_the_side_stream(world1, monkeypatch, spec):
    monkeypatch.setenv("HVDCOMPRESS_SIDE_STREAM", "0")
    plain = _ddp_params(spec)
    monkeypatch.setenv("HVDCOMPRESS_SIDE_STREAM", "1")
    assert torch.equal(_ddp_params(spec), plain)


def _blocked_seconds(spin):
    """(seconds the host waits for the compute stream once an exchange whose encode spins ``spin``
    cycles is started, seconds between events recorded on the compute stream before and after the
    start, the exchange's result). "none": an encode with no host synchronisation after the
    spin (one that reads a value back, as a data-dependent selection does, holds the host there
    whatever the stream)."""
    from hvdcompress.spec import resolve
    from torch_ops.collectives import finish_all
    from torch_ops.dist_collectives import TorchDistCommunicator
    from torch_ops.session import ExchangeSession
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).cuda()  # the same in every call
    session = ExchangeSession(resolve("none"), {"w": x}, TorchDistCommunicator())
    encode = session.compressor.exchange

    def spinning(t, ctx):
        torch.cuda._sleep(spin)
        return (yield from encode(t, ctx))

    session.compressor.exchange = spinning
    torch.cuda.synchronize()
    begin, mark = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    ex = session.start(x, ("w",), key="w", step=0, name="hvc.w")
    mark.record()  # on the compute stream, right after the exchange was started
    t0 = time.perf_counter()
    mark.synchronize()
    waited = time.perf_counter() - t0  # the compute stream's queue drained after start returned
    finish_all([ex])
    torch.cuda.synchronize()
    return waited, begin.elapsed_time(mark) / 1e3, ex.result.cpu()


@CUDA
def test_the_compute_stream_does_not_wait_for_the_encode(world1, monkeypatch):
    spin = 100_000_000  # clock cycles: 50-100 ms at 1-2 GHz
    _blocked_seconds(1000)  # warm-up (CUDA's lazy set-up, the first kernels' loads)
    monkeypatch.setenv("HVDCOMPRESS_SIDE_STREAM", "0")
    waited, span, plain = _blocked_seconds(spin)
    on_compute = max(waited, span)  # the spin sits in the compute stream's timeline either way
    monkeypatch.setenv("HVDCOMPRESS_SIDE_STREAM", "1")
    on_side_stream, span, result = _blocked_seconds(spin)
    assert on_compute > 0.02, on_compute  # the spin is long enough to see
    assert on_side_stream < on_compute / 5, (on_side_stream, span, on_compute)
    assert torch.equal(result, plain)
