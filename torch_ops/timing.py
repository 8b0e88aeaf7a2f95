"""Clock readings that wait for the device the work runs on: the host clock for CPU tensors, a
synchronizing one for CUDA tensors (kernels run after the call that queued them returns). Used by
the scheduler's step clock, the profiler, the bench and ``advise``."""

from __future__ import annotations

import time

import torch


def now() -> float:
    """The host clock (``HostTimer.now``)."""
    return time.perf_counter()


class HostTimer:
    """Clock readings for work on the CPU: a CPU tensor's work is done when the call that does it
    returns, so the host clock is the measurement (what every timing here read before devices)."""

    device = torch.device("cpu")

    def now(self) -> float:
        return time.perf_counter()

    def wait(self) -> None:
        """Wait for the work queued so far (nothing is queued on the CPU)."""


class CudaTimer(HostTimer):
    """Clock readings for work on a CUDA device: kernels run after the call that queued them
    returns, so a host timestamp alone times the launch, not the kernel. Each reading first waits
    for the work queued on the device (``torch.cuda.synchronize``), which makes a reading cost a
    device round trip and keeps the host from running ahead: use it where the time is measured
    (profiling, the scheduler's measured steps, benchmarks), not on every step of a run."""

    def __init__(self, device):
        self.device = torch.device(device)

    def now(self) -> float:
        torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)


HOST_TIMER = HostTimer()


def timer_for(*items) -> HostTimer:
    """The timer for the device the work runs on: ``items`` are tensors, devices, device strings
    or iterables of tensors; the first CUDA one found picks a ``CudaTimer`` on its device, else
    the ``HostTimer``."""
    stack = list(items)
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            device = item.device
        elif isinstance(item, (str, torch.device)):
            device = torch.device(item)
        elif item is None:
            continue
        else:
            stack[:0] = list(item)
            continue
        if device.type == "cuda":
            return CudaTimer(device)
    return HostTimer()
