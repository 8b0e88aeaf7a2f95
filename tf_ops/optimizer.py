"""Keras ``DistributedOptimizer``: Horovod's Keras optimizer wrapper, with gradient compression.

Drop-in for ``horovod.tensorflow.keras.DistributedOptimizer``: the same arguments keep their names
and meaning (name, device_dense, device_sparse, compression, sparse_as_dense,
gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, num_groups,
groups, process_set). As there, the result is a new optimizer of a subclass of the given one's
class, built from its config, whose gradient computation (``compute_gradients`` for Keras 2.11+
optimizers, ``_compute_gradients`` / ``get_gradients`` for ``tf.keras.optimizers.legacy`` ones)
returns the exchanged gradients; ``model.fit`` and ``optimizer.minimize`` go through it. Gradients
handed to ``apply_gradients`` directly are applied as given (as with Horovod).

The compression state is a ``GradientCompression`` tracked as ``optimizer.gradient_compression``,
so ``tf.train.Checkpoint(optimizer=...)`` and ``model.save_weights`` (TensorFlow checkpoint
format) save and restore it with the optimizer. Residuals differ per rank: to resume exactly,
every rank saves and restores its own checkpoint.

``schedule=`` / ``cost_model=`` (hvdcompress's own; ``tf_ops.grouping``) choose which gradients are
compressed and exchanged as one merged tensor: "layerwise" (default: Keras hands over every
gradient at once, so there is no backward pass to overlap and merging only saves start-ups and
per-tensor overhead), "single", "size:<MB>", "mgs"/"mgwfbp" planned with a cost model, or explicit
groups of positions in the optimizer's variable list. Positions are those of the gradients the
optimizer computes (``model.trainable_variables`` order for ``model.fit``).

Delayed averaging (``delay=D``, ``sync_every=K``; ``tf_ops.delayed`` states the math): the
gradient applied at step i is ``g_i - g_(i-D) + R_(i-D)``; the corrections in flight are optimizer
state (``gradient_compression.delayed``), so checkpoints resume exactly. On TensorFlow the
exchange still completes within its step: the arithmetic is the paper's, the link latency is not
overlapped (unlike PyTorch). ``opt.flush()`` (eagerly, on every rank, between steps) applies the
pending corrections as one more ``apply_gradients`` and averages the variables and the optimizer's
slot variables over the ranks; ``hvc.DelayedAveragingFlushCallback()`` calls it in ``model.fit``
before every evaluation and at the end of every epoch.

Sparse gradients (``tf.IndexedSlices``, e.g. from an Embedding layer) are exchanged sparse and
uncompressed, as Horovod does, and applied as ``IndexedSlices`` (the optimizer's sparse update);
``sparse_as_dense=True`` densifies and compresses them (``tf_ops.sparse_grads``).

A compressor may take settings over from the optimizer (``Compressor.adapt_optimizer``): DGC keeps
the momentum in its memory, so an optimizer whose config has ``momentum`` > 0 (SGD) is rebuilt
with momentum 0 and that momentum (and ``nesterov``)
moves into the DGC spec, with a warning when they differ from the spec's.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from hvdcompress.spec import CompressionSpec, resolve

from .accumulate import LocalAccumulator
from .compression import GradientCompression
from .compressors import compressor_class
from .exchanger import make_exchanger
from .variables import created_eagerly


class _KerasMixin:
    """Methods added to the wrapped optimizer's class (first in the MRO)."""

    @property
    def compression(self) -> CompressionSpec:
        return self.gradient_compression.compression

    @property
    def stats(self):
        """Bytes this rank handed to the collectives per step, next to dense (a WireStats)."""
        return self.gradient_compression.stats

    def _hvc_exchange_pairs(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return grads_and_vars
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        acc = self._hvc_accumulator
        if acc is None:
            out = self._hvc.exchange(grads, variables)
        else:
            present = [v for g, v in zip(grads, variables) if g is not None]  # what accumulate exchanges
            out = acc.accumulate(self._hvc.densify(grads), lambda gs: self._hvc.exchange(gs, present))
        self._hvc.variables = variables  # what flush() applies corrections to, in exchange order (untracked)
        return list(zip(out, variables))

    @property
    def delay(self) -> int:
        return self.gradient_compression.delay

    @property
    def sync_every(self) -> int:
        return self.gradient_compression.sync_every

    def flush(self) -> None:
        """Delayed averaging: apply every pending correction as one more optimizer step (the
        accumulated local gradients of ``sync_every`` are exchanged first), then average the
        variables and the optimizer's slot variables over the ranks, so every rank holds identical
        values. Call it on every rank between steps (``DelayedAveragingFlushCallback`` does in
        ``model.fit``). Nothing to do when synchronous (delay=0, sync_every=1) or before a step."""
        variables = getattr(self._hvc, "variables", None)
        if variables is None:
            return
        base = super(_KerasMixin, self)
        self.gradient_compression.flush(self, variables, lambda pairs: base.apply_gradients(pairs))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        # the wrapped optimizer creates its slots eagerly inside the first trace of the training step;
        # created_eagerly keeps that from tracing the step a second time (tf_ops.variables)
        acc = self._hvc_accumulator
        if acc is None:
            with created_eagerly():
                return super(_KerasMixin, self).apply_gradients(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)

        def apply():
            with created_eagerly():
                super(_KerasMixin, self).apply_gradients(grads_and_vars, *args, **kwargs)
            return tf.constant(True)

        def skip():  # a pass that only accumulated: no update, but the iteration counts
            self.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(acc.synced(), apply, skip)


class _OptimizerMixin(_KerasMixin):
    """For ``tf.keras.optimizers.Optimizer`` (Keras 2.11+)."""

    def compute_gradients(self, loss, var_list, tape=None):
        return self._hvc_exchange_pairs(super().compute_gradients(loss, var_list, tape))


class _LegacyOptimizerMixin(_KerasMixin):
    """For ``tf.keras.optimizers.legacy.Optimizer``."""

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        return self._hvc_exchange_pairs(super()._compute_gradients(loss, var_list, grad_loss, tape))

    def get_gradients(self, loss, params):
        grads = super().get_gradients(loss, params)
        return [g for g, _ in self._hvc_exchange_pairs(zip(grads, params))]


def _keras_bases():
    new = getattr(tf.keras.optimizers, "Optimizer", None)
    legacy = getattr(getattr(tf.keras.optimizers, "legacy", None), "Optimizer", None)
    if legacy is None or "tf_keras" not in getattr(new, "__module__", "tf_keras"):
        raise ValueError("optimizer: tf.keras is Keras 3 here; hvdcompress.keras (like "
                         "horovod.tensorflow.keras) needs Keras 2: install tf-keras and set "
                         "TF_USE_LEGACY_KERAS=1 before TensorFlow is first imported")
    return new, legacy


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=None,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None, schedule=None, cost_model=None,
                         delay=None, sync_every=None, topology=None):
    """Wrap a Keras optimizer so the gradients it computes are compressed, exchanged and averaged.

    Args mirror ``horovod.tensorflow.keras.DistributedOptimizer``:
        optimizer: a ``tf.keras.optimizers.Optimizer`` or ``tf.keras.optimizers.legacy.Optimizer``.
        name: prefix of the collectives' names (a Python identifier; default "Distributed<Class>").
        device_dense, device_sparse: accepted and ignored.
        compression: a spec string (``"topk:ratio=0.01"``), ``hvdcompress.Compression.<name>(...)``,
            Horovod's ``Compression.none`` / ``Compression.fp16``, or a ``GradientCompression``.
        sparse_as_dense: False (default): sparse gradients (``tf.IndexedSlices``, e.g. from an
            embedding) are exchanged sparse and uncompressed, as Horovod does (allgather of
            values and indices, the values divided by the size to average), returned as
            ``IndexedSlices``, never merged into a group, with no compression state
            (``tf_ops.sparse_grads``). True: converted to dense tensors first, then compressed
            like the other gradients.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size/factor after (> 0).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        backward_passes_per_step: passes accumulated locally before each exchange (>= 1).
        average_aggregated_gradients: divide the accumulated sum by backward_passes_per_step.
        num_groups, groups: must stay 0 / None (Horovod's explicit grouping; use ``schedule``).
        process_set: a Horovod process set (default: all ranks).

    hvdcompress's own:
        schedule: for a spec given as ``compression``: which gradients are exchanged together
            ("layerwise" when None, "single", "size:<MB>", "mgs", "mgwfbp", "auto" or explicit
            groups of positions; see ``tf_ops.grouping``). A ``GradientCompression`` carries its own.
        cost_model: an ``hvdcompress.schedule.costmodel.CostModel`` for the cost-model schedules (None:
            the cached one; a ValueError here if there is none).
        delay: steps between an exchange and applying its correction (int >= 0; None/0: synchronous,
            the same code path bit for bit). A ``GradientCompression`` carries its own.
        sync_every: exchange once every this many steps, local steps in between (int >= 1; None: 1).
        topology: where the ranks sit (docs/two-level.md): None (default) the launcher's, two-level
            on several nodes of several ranks whose process sets ``hvdcompress.keras.init()``
            registered (dense inside a node, the spec across nodes); "flat" opts out; "NxL" / "L" /
            a ``Topology``. A ``GradientCompression`` carries its own.

    Returns an optimizer of the wrapped one's class whose gradients are exchanged in
    ``apply_gradients`` (and so in ``model.fit``); its compression state is
    ``optimizer.gradient_compression`` (tracked by ``tf.train.Checkpoint`` / ``save_weights``),
    its byte counts ``optimizer.stats``. Raises ``ValueError`` naming the argument, here, on every
    rank, before any collective. Guide: docs/tensorflow.md.
    """
    new_base, legacy_base = _keras_bases()
    if not isinstance(optimizer, (new_base, legacy_base)):
        raise ValueError("optimizer: expected a tf.keras optimizer (tf.keras.optimizers.* or "
                         f"tf.keras.optimizers.legacy.*); got {type(optimizer).__name__}")
    name = name if name is not None else f"Distributed{type(optimizer).__name__}"
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: must be a Python identifier (it prefixes collective names); got {name!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step: must be an int >= 1; got {backward_passes_per_step!r}")
    if not isinstance(average_aggregated_gradients, bool):
        raise ValueError("average_aggregated_gradients: must be True or False; "
                         f"got {average_aggregated_gradients!r}")
    config = optimizer.get_config()
    if isinstance(compression, GradientCompression):
        spec = compression.compression
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, adapted = compressor_class(spec).adapt_optimizer(spec, config)
        if adapted != config:
            changed = ", ".join(f"{k}={config.get(k)!r}" for k in sorted(adapted) if adapted[k] != config.get(k))
            raise ValueError(f"compression: '{spec.name}' takes over the optimizer's {changed} (e.g. DGC applies "
                             "the momentum in its memory); give the optimizer the neutral value (set it in the "
                             "spec instead) or pass the spec instead of a GradientCompression so it is taken over")
    else:
        spec = resolve(compression)
        compression, config = compressor_class(spec).adapt_optimizer(spec, config)
    exchanger = make_exchanger("DistributedOptimizer", compression, device_dense, device_sparse,
                               sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
                               process_set, persistent_only=False, name=name, schedule=schedule,
                               cost_model=cost_model, delay=delay, sync_every=sync_every, topology=topology)
    mixin = _LegacyOptimizerMixin if isinstance(optimizer, legacy_base) else _OptimizerMixin
    cls = type(type(optimizer).__name__, (mixin, type(optimizer)), {})
    opt = cls.from_config(config)
    opt._hvc = exchanger
    opt.gradient_compression = exchanger.compression
    opt._hvc_accumulator = (LocalAccumulator(backward_passes_per_step, average_aggregated_gradients)
                            if backward_passes_per_step > 1 else None)
    if isinstance(optimizer, legacy_base):  # legacy optimizers do not track attributes: name the state for checkpoints
        opt._track_trackable(exchanger.compression, name="gradient_compression")
        if opt._hvc_accumulator is not None:
            opt._track_trackable(opt._hvc_accumulator, name="_hvc_accumulator")
    return opt
