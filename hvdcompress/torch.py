"""``import hvdcompress.torch as hvc``: the PyTorch face of hvdcompress.

Hands on the names of ``torch_ops`` and, for convenience, Horovod's own ones a training script
needs next to them (init, rank, size, broadcasts, Average/Sum), so one import serves::

    import hvdcompress.torch as hvc
    hvc.init()
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvc.Compression.topk(ratio=0.01))
"""

from horovod.torch import (Average, Sum, allgather, allreduce, broadcast_object, broadcast_optimizer_state,
                           broadcast_parameters, init, is_initialized, local_rank, local_size, rank,
                           shutdown, size)
from torch_ops import *  # noqa: F401,F403
from torch_ops import __all__ as _backend_all


def _elastic():
    """``hvc.elastic``: Horovod's ``hvd.elastic`` names, with ``TorchState`` carrying hvdcompress
    optimizers through resets (``torch_ops.elastic`` says what a reset does to them)."""
    from types import SimpleNamespace

    import horovod.torch.elastic as hvd_elastic
    from torch_ops.elastic import make_torch_state
    return SimpleNamespace(run=hvd_elastic.run, TorchState=make_torch_state(), ElasticSampler=hvd_elastic.ElasticSampler)


elastic = _elastic()

__all__ = list(_backend_all) + [
    "Average", "Sum", "allgather", "allreduce", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "init", "is_initialized", "local_rank", "local_size", "rank", "shutdown",
    "size", "elastic"]
