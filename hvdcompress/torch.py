"""``import hvdcompress.torch as hvc``: the PyTorch face of hvdcompress.

One import serves a training script (with Horovod; under ``torchrun`` see ``backend="torch"``
below)::

    import hvdcompress.torch as hvc
    hvc.init()
    opt = hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvc.Compression.topk(ratio=0.01))
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)
    hvc.broadcast_optimizer_state(opt, root_rank=0)

Names:

* ``DistributedOptimizer(optimizer, named_parameters=None, compression=None, ...)``: wraps any
  ``torch.optim`` optimizer; Horovod's arguments keep their meaning, plus ``schedule=``,
  ``cost_model=``, ``profile_steps=``, ``tune_steps=``, ``codec_choice=``, ``revalidate_every=``,
  ``delay=``, ``sync_every=`` (its docstring
  lists each with its default and range). Bad arguments raise ``ValueError`` before any collective.
* ``Compression.<name>(**params)``, ``parse_spec("name:key=value")``, ``CompressionSpec``: the
  compression specs (``hvdcompress specs`` lists them; docs/algorithms.md has every parameter).
* ``elastic``: Horovod's ``hvd.elastic`` names, with ``elastic.TorchState`` carrying our
  optimizers through resets (docs/reliability.md).
* ``init(comm=None, process_sets=None)``: Horovod's ``hvd.init``, which also registers the process
  sets of the launcher's nodes when it has several nodes of several ranks (the two-level exchange
  runs on them: ``topology=``, docs/two-level.md).
* Horovod's own, handed on unchanged when Horovod is installed: ``shutdown``, ``is_initialized``, ``rank``,
  ``size``, ``local_rank``, ``local_size``, ``Average``, ``Sum``, ``allreduce``, ``allgather``,
  ``broadcast_object``, ``broadcast_parameters``, ``broadcast_optimizer_state``.
* ``Compressor``, ``ExchangeContext``, ``COMPRESSORS``, ``build_compressor``: the backend's
  compressor contract, for adding an algorithm (docs/design.md).

Guide: docs/pytorch.md; the runnable quickstart is in README.md.

Horovod is optional: without it (under ``torchrun``), ``DistributedOptimizer(..., backend="torch")``
and ``hvdcompress.ddp`` work, ``Average``/``Sum`` are ``torch_ops.transport``'s (Horovod's values),
and the Horovod names raise an ImportError saying so when used.
"""

from torch_ops import *  # noqa: F401,F403
from torch_ops import __all__ as _backend_all
from torch_ops.transport import Average, Sum  # noqa: F401  (Horovod's values: hvd.Average == Average)

_HOROVOD_NAMES = ("allgather", "allreduce", "broadcast_object", "broadcast_optimizer_state",
                  "broadcast_parameters", "init", "is_initialized", "local_rank", "local_size", "rank",
                  "shutdown", "size")

try:
    import horovod.torch as _hvd
except ImportError as _e:  # torch.distributed only
    _hvd, _missing = None, str(_e)
else:
    globals().update({n: getattr(_hvd, n) for n in _HOROVOD_NAMES})
    from torch_ops.collectives import init  # noqa: F811  (hvd.init, plus the launcher's node process sets)


def __getattr__(name):
    if name in _HOROVOD_NAMES:
        raise ImportError(f"hvdcompress.torch.{name} is Horovod's, and Horovod could not be imported ({_missing}); "
                          "under torchrun use torch.distributed's own (init_process_group, get_rank, ...) with "
                          "DistributedOptimizer(..., backend='torch') or hvdcompress.ddp")
    if name == "elastic":
        value = globals()["elastic"] = _elastic()
        return value
    raise AttributeError(f"module 'hvdcompress.torch' has no attribute {name!r}")


def _elastic():
    """``hvc.elastic``: Horovod's ``hvd.elastic`` names, with ``TorchState`` carrying hvdcompress
    optimizers through resets (``torch_ops.elastic`` says what a reset does to them). Built on first
    use (it needs Horovod)."""
    from types import SimpleNamespace

    import horovod.torch.elastic as hvd_elastic
    from torch_ops.elastic import make_torch_state
    return SimpleNamespace(run=hvd_elastic.run, TorchState=make_torch_state(), ElasticSampler=hvd_elastic.ElasticSampler)


__all__ = list(_backend_all) + ["Average", "Sum"] + (list(_HOROVOD_NAMES) + ["elastic"] if _hvd is not None else [])
