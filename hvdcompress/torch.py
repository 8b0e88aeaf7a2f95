"""``import hvdcompress.torch as hvc``: the PyTorch face of hvdcompress.

One import serves a training script::

    import hvdcompress.torch as hvc
    hvc.init()
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvc.Compression.topk(ratio=0.01))
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)
    hvc.broadcast_optimizer_state(opt, root_rank=0)

Names:

* ``DistributedOptimizer(optimizer, named_parameters=None, compression=None, ...)``: wraps any
  ``torch.optim`` optimizer; Horovod's arguments keep their meaning, plus ``schedule=``,
  ``cost_model=``, ``profile_steps=``, ``tune_steps=``, ``delay=``, ``sync_every=`` (its docstring
  lists each with its default and range). Bad arguments raise ``ValueError`` before any collective.
* ``Compression.<name>(**params)``, ``parse_spec("name:key=value")``, ``CompressionSpec``: the
  compression specs (``hvdcompress specs`` lists them; docs/algorithms.md has every parameter).
* ``elastic``: Horovod's ``hvd.elastic`` names, with ``elastic.TorchState`` carrying our
  optimizers through resets (docs/reliability.md).
* Horovod's own, handed on unchanged: ``init``, ``shutdown``, ``is_initialized``, ``rank``,
  ``size``, ``local_rank``, ``local_size``, ``Average``, ``Sum``, ``allreduce``, ``allgather``,
  ``broadcast_object``, ``broadcast_parameters``, ``broadcast_optimizer_state``.
* ``Compressor``, ``ExchangeContext``, ``COMPRESSORS``, ``build_compressor``: the backend's
  compressor contract, for adding an algorithm (docs/design.md).

Guide: docs/pytorch.md; the runnable quickstart is in README.md.
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
