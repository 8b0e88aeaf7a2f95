"""Which transport carries the collectives: Horovod (process sets) or torch.distributed (process groups).

``DistributedOptimizer(..., backend="horovod")`` (the default) runs on Horovod, as launched by
``horovodrun``; ``backend="torch"`` on torch.distributed, as launched by ``torchrun`` (any
torch.distributed backend: Gloo, NCCL), and never imports Horovod; so does ``DiLoCo``. Everything
above the transport (compressors, schedules, delayed averaging, checkpoints) is the same on both:
``torch_ops.collectives.Communicator`` and ``torch_ops.dist_collectives.TorchDistCommunicator``
are peers implementing ``hvdcompress.contract.Transport``.

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


def make_transport(backend: str, process_set=None, transport=None):
    """The transport (``hvdcompress.contract.Transport``) every collective of a front end goes
    through: ``transport`` when given (any object with the protocol's methods), else Horovod's on
    ``process_set`` (a Horovod process set; Horovod must be initialized) or torch.distributed's on
    ``process_set`` taken as a process group (torch.distributed must be initialized). ValueError,
    before any collective, when the backend is unknown or not ready."""
    check_backend(backend)
    if transport is not None:
        return transport
    if backend == "torch":
        from .dist_collectives import TorchDistCommunicator
        return TorchDistCommunicator(process_set)
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise ValueError("backend='horovod' needs Horovod (horovod.torch could not be imported: "
                         f"{e}); under torchrun use backend='torch'") from e
    if not hvd.is_initialized():
        raise ValueError("horovod is not initialized: call hvd.init() first "
                         "(or, under torchrun, pass backend='torch')")
    from .collectives import Communicator
    return Communicator(process_set)
