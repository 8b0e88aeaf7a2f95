"""``import hvdcompress.tensorflow as hvc``: the TensorFlow 2 face of hvdcompress.

Hands on the names of ``tf_ops`` and, for convenience, Horovod's own ones a custom training loop
needs next to them (init, rank, size, broadcasts, allgather_object, Average/Sum)::

    import hvdcompress.tensorflow as hvc
    hvc.init()
    compression = hvc.GradientCompression("topk:ratio=0.01")
    ...
    tape = hvc.DistributedGradientTape(tape, compression=compression)

Names:

* ``GradientCompression(compression=None, name="hvc", schedule="layerwise", cost_model=None,
  delay=0, sync_every=1)``: the spec, its compressor and the state kept between steps
  (residuals, momenta, step, epoch): make it once, checkpoint it with ``tf.train.Checkpoint``.
* ``DistributedGradientTape(tape, compression=...)``: wrap the tape every step, eagerly or inside
  ``tf.function``; ``tape.gradient()`` returns the exchanged, averaged gradients.
* ``DistributedOptimizer``: the Keras one (as in ``horovod.tensorflow`` for Keras optimizers).
* ``Compression.<name>(**params)``, ``parse_spec``, ``CompressionSpec``: the specs.
* ``elastic``: Horovod's TF elastic names with ``elastic.TensorFlowKerasState``.
* ``init(comm=None, process_sets=None)``: Horovod's ``hvd.init``, which also registers the process
  sets of the launcher's nodes when it has several nodes of several ranks (the two-level exchange
  runs on them: ``topology=``, docs/two-level.md).
* Horovod's own, unchanged: ``shutdown``, ``is_initialized``, ``rank``, ``size``,
  ``local_rank``, ``local_size``, ``Average``, ``Sum``, ``allreduce``, ``allgather``,
  ``broadcast``, ``broadcast_variables``, ``broadcast_object``, ``allgather_object``.

Bad arguments raise ``ValueError`` naming them, on every rank, before any collective.
Guide: docs/tensorflow.md.
"""

import tf_ops  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from horovod.tensorflow import (Average, Sum, allgather, allgather_object, allreduce, broadcast,  # noqa: E402
                                broadcast_object, broadcast_variables, init, is_initialized, local_rank,
                                local_size, rank, shutdown, size)
from tf_ops import *  # noqa: F401,F403,E402
from tf_ops import __all__ as _backend_all  # noqa: E402
from tf_ops.collectives import init  # noqa: E402,F811  (hvd.init, plus the launcher's node process sets)



def _elastic():
    """``hvc.elastic``: Horovod's ``hvd.elastic`` names for TensorFlow 2, with
    ``TensorFlowKerasState`` carrying the compression state through resets (``tf_ops.elastic``)."""
    from types import SimpleNamespace

    import horovod.tensorflow.elastic as hvd_elastic
    from tf_ops.elastic import TensorFlowKerasState
    return SimpleNamespace(run=hvd_elastic.run, TensorFlowKerasState=TensorFlowKerasState)


elastic = _elastic()

__all__ = list(_backend_all) + ["elastic", 
    "Average", "Sum", "allgather", "allgather_object", "allreduce", "broadcast", "broadcast_object",
    "broadcast_variables", "init", "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size"]
