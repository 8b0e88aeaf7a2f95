"""Which transport carries the collectives: Horovod (process sets) or torch.distributed (process groups).

``DistributedOptimizer(..., backend="horovod")`` (the default) runs on Horovod, as launched by
``horovodrun``; ``backend="torch"`` on torch.distributed, as launched by ``torchrun`` (any
torch.distributed backend: Gloo, NCCL), and never imports Horovod. Everything above the
``Communicator`` (compressors, schedules, delayed averaging, checkpoints) is the same on both.

The reduction ops are plain ints with Horovod's values (``horovod/common/message.h``: AVERAGE = 0,
SUM = 1, ADASUM = 2), so ``hvd.Average == Average`` and either may be passed as ``op``, with or
without Horovod installed.
"""

from __future__ import annotations

Average = 0
Sum = 1
Adasum = 2

BACKENDS = ("horovod", "torch")


def check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: accepted values are {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    return backend


def make_communicator(backend: str, process_set=None, driver=None):
    """The communicator every collective of an optimizer goes through: ``driver`` when given, else
    Horovod's on ``process_set`` (a Horovod process set; Horovod must be initialized) or
    torch.distributed's on ``process_set`` taken as a process group (torch.distributed must be
    initialized). ValueError, before any collective, when the transport is not ready."""
    check_backend(backend)
    if backend == "torch":
        if driver is not None:
            return driver
        from .dist_collectives import TorchDistCommunicator
        return TorchDistCommunicator(process_set)
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise ValueError("backend='horovod' needs Horovod (horovod.torch could not be imported: "
                         f"{e}); under torchrun use backend='torch'") from e
    if not hvd.is_initialized():
        raise ValueError("horovod is not initialized: call hvd.init() before DistributedOptimizer "
                         "(or, under torchrun, pass backend='torch')")
    if driver is not None:
        return driver
    from .collectives import Communicator
    return Communicator(process_set)
