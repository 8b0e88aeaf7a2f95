"""``import hvdcompress.keras as hvc``: the Keras (tf.keras 2) face of hvdcompress.

Import it before TensorFlow: it sets ``TF_USE_LEGACY_KERAS=1`` (Horovod's Keras layer needs
Keras 2). One import serves a Keras script::

    import hvdcompress.keras as hvc
    hvc.init()
    opt = hvc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05 * hvc.size(), momentum=0.9),
                                   compression=hvc.Compression.dgc(ratio=0.001))
    model.compile(optimizer=opt, loss=...)
    model.fit(..., callbacks=[hvc.BroadcastGlobalVariablesCallback(0), hvc.MetricAverageCallback(),
                              hvc.SparsityWarmupCallback(), hvc.CompressionStatsCallback()])

Names:

* ``DistributedOptimizer(optimizer, compression=None, ...)``: wraps a ``tf.keras`` optimizer (new
  or legacy); Horovod's arguments keep their meaning, plus ``schedule=``, ``cost_model=``,
  ``delay=``, ``sync_every=``. Bad arguments raise ``ValueError`` before any collective.
* ``GradientCompression(spec, ...)`` and ``DistributedGradientTape``: for custom loops (as in
  ``hvdcompress.tensorflow``).
* Callbacks: ``SparsityWarmupCallback`` (DGC's density warm-up, or ``warmup_epochs=`` for
  top-k/random-k), ``CompressionStatsCallback`` (bytes per step, ratio and density into the
  logs), ``DelayedAveragingFlushCallback`` (flush before evaluation and at epoch ends with
  ``delay``/``sync_every``); Horovod's ``BroadcastGlobalVariablesCallback``,
  ``MetricAverageCallback``, ``LearningRateWarmupCallback``, ``LearningRateScheduleCallback``
  given the Keras 2 backend (``tf_ops.horovod_callbacks``).
* ``Compression.<name>(**params)``, ``parse_spec``, ``CompressionSpec``: the specs.
* ``elastic``: Horovod's Keras elastic names with ``elastic.KerasState`` (docs/reliability.md).
* ``init(comm=None, process_sets=None)``: Horovod's ``hvd.init``, which also registers the process
  sets of the launcher's nodes when it has several nodes of several ranks (the two-level exchange
  runs on them: ``topology=``, docs/two-level.md).
* Horovod's own, unchanged: ``shutdown``, ``is_initialized``, ``rank``, ``size``,
  ``local_rank``, ``local_size``, ``Average``, ``Sum``, ``allreduce``, ``allgather``,
  ``broadcast``, ``broadcast_object``, ``allgather_object``, ``broadcast_global_variables``,
  ``callbacks``.

Guide: docs/tensorflow.md; the runnable quickstart is in README.md.
"""

import tf_ops  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from horovod.tensorflow import allgather_object, broadcast_object  # noqa: E402
from horovod.tensorflow.keras import (Average, Sum, allgather, allreduce, broadcast,  # noqa: E402
                                      broadcast_global_variables, callbacks, init, is_initialized,
                                      local_rank, local_size, rank, shutdown, size)
from tf_ops.horovod_callbacks import (BroadcastGlobalVariablesCallback,  # noqa: E402
                                      LearningRateScheduleCallback, LearningRateWarmupCallback,
                                      MetricAverageCallback)
from tf_ops import *  # noqa: F401,F403,E402
from tf_ops import __all__ as _backend_all  # noqa: E402
from tf_ops.collectives import init  # noqa: E402,F811  (hvd.init, plus the launcher's node process sets)



def _elastic():
    """``hvc.elastic``: Horovod's ``hvd.elastic`` names for Keras, with ``KerasState`` carrying the
    compression state through resets (``tf_ops.elastic`` says what a reset does to it)."""
    from types import SimpleNamespace

    import horovod.tensorflow.keras.elastic as hvd_elastic
    from tf_ops.elastic import KerasState
    return SimpleNamespace(run=hvd_elastic.run, KerasState=KerasState,
                           CommitStateCallback=hvd_elastic.CommitStateCallback,
                           UpdateBatchStateCallback=hvd_elastic.UpdateBatchStateCallback,
                           UpdateEpochStateCallback=hvd_elastic.UpdateEpochStateCallback)


elastic = _elastic()

__all__ = list(_backend_all) + ["elastic", 
    "Average", "Sum", "allgather", "allgather_object", "allreduce", "broadcast", "broadcast_object",
    "broadcast_global_variables", "callbacks", "init", "is_initialized", "local_rank", "local_size", "rank",
    "shutdown", "size", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback"]
