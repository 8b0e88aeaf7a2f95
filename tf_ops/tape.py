"""``DistributedGradientTape``: Horovod's TF2 tape wrapper, with gradient compression.

Drop-in for ``horovod.tensorflow.DistributedGradientTape``: ``tape.gradient(loss, variables)``
returns the gradients compressed, exchanged among the ranks and averaged (or summed). The result
is an instance of a subclass of the wrapped tape's class that records into the same tape::

    compression = hvc.GradientCompression("topk:ratio=0.01")   # once, outside the step

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvc.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

A tape lives for one step, so compressors with state between steps (error feedback, random-k's
step counter, DGC's momenta) need the ``GradientCompression`` object made once; stateless specs
(``none``, ``fp16``, ``bf16``) may be given as a string. Gradients that are None stay None (every
rank has the same graph, so every rank skips the same ones).

Merged groups (``tf_ops.grouping``): ``schedule=`` goes to the ``GradientCompression`` made from a
stateless spec (``DistributedGradientTape(tape, compression="fp16", schedule="single")``); a
``GradientCompression`` object carries its own (``GradientCompression("topk:ratio=0.01",
schedule="size:4")``). The default is "layerwise": the tape hands over every gradient at once, so
merging saves start-ups and per-tensor overhead only. Positions are those of the flattened
``sources`` given to ``gradient``.

Delayed averaging (``tf_ops.delayed``): ``hvc.GradientCompression(spec, delay=D, sync_every=K)``,
made once, keeps the corrections in flight; the tape then returns ``g_i - g_(i-D) + R_(i-D)``.
On TensorFlow the arithmetic is the paper's but the exchange still completes within its step
(the link latency is not overlapped, unlike PyTorch). Between steps, on every rank,
``compression.flush(opt, model.trainable_variables)`` applies what is pending and makes the
replicas identical::

    compression = hvc.GradientCompression("topk:ratio=0.01", delay=2)
    ...                                             # train_step as above
    compression.flush(opt, model.trainable_variables)   # before evaluating
"""

from __future__ import annotations

import tensorflow as tf

from .exchanger import Exchanger, make_exchanger


class _TapeMixin:
    """Methods added to the wrapped tape's class (first in the MRO)."""

    _hvc: Exchanger

    @property
    def compression(self):
        """The ``GradientCompression`` doing the exchange (its ``stats`` count the bytes)."""
        return self._hvc.compression

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, self._hvc.exchange(flat, tf.nest.flatten(sources)))


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=None, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=None, schedule=None, cost_model=None,
                            delay=None, sync_every=None, topology=None):
    """Wrap ``gradtape`` so ``gradient()`` returns compressed, exchanged, averaged gradients.

    Args mirror ``horovod.tensorflow.DistributedGradientTape``:
        gradtape: the ``tf.GradientTape`` that recorded the forward pass.
        device_dense, device_sparse: accepted and ignored.
        compression: a ``GradientCompression`` (required for stateful compressors), or a spec for
            a stateless one (``"fp16"``, Horovod's ``Compression.fp16``). Default: none.
        sparse_as_dense: False (default): sparse gradients (``tf.IndexedSlices``, e.g. from an
            embedding) are exchanged sparse and uncompressed, as Horovod does (allgather of
            values and indices, the values divided by the size to average), returned as
            ``IndexedSlices``, never merged into a group, with no compression state
            (``tf_ops.sparse_grads``). True: converted to dense tensors first, then compressed
            like the other gradients.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size/factor after (> 0).
        num_groups, groups: must stay 0 / None (Horovod's explicit grouping; use ``schedule``).
        process_set: a Horovod process set (default: all ranks).

    hvdcompress's own:
        schedule: for a spec given as ``compression``: which gradients are exchanged together
            ("layerwise" when None, "single", "size:<MB>", "mgs", "mgwfbp", "auto" or explicit
            groups of positions; see ``tf_ops.grouping``).
        cost_model: an ``hvdcompress.schedule.costmodel.CostModel`` for the cost-model schedules (None:
            the cached one; a ValueError here if there is none).
        delay, sync_every: delayed averaging (``tf_ops.delayed``). They keep state between steps,
            so they belong to the ``GradientCompression`` (``GradientCompression(spec, delay=2)``);
            here None (default) takes its values, and anything else must equal them (0 / 1 with a
            spec: other values raise, pointing there).
        topology: where the ranks sit (docs/two-level.md): None (default) the launcher's, two-level
            on several nodes of several ranks whose process sets ``hvdcompress.tensorflow.init()``
            registered; "flat" opts out; "NxL" / "L" / a ``Topology``. A ``GradientCompression``
            carries its own (``GradientCompression(spec, topology=...)``); here None takes it.

    Returns a tape of ``gradtape``'s class whose ``gradient()`` exchanges the gradients (eagerly or
    inside ``tf.function``). Raises ``ValueError`` naming the argument, here, on every rank, before
    any collective. Guide: docs/tensorflow.md.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"gradtape: expected a tf.GradientTape; got {type(gradtape).__name__}")
    exchanger = make_exchanger("DistributedGradientTape", compression, device_dense, device_sparse,
                               sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
                               process_set, persistent_only=True, schedule=schedule, cost_model=cost_model,
                               delay=delay, sync_every=sync_every, topology=topology)
    base = type(gradtape)
    cls = type(base.__name__, (_TapeMixin, base), {})
    tape = cls(persistent=gradtape._persistent,
               watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape  # record into (and read from) the same tape as the original
    tape._hvc = exchanger
    return tape
