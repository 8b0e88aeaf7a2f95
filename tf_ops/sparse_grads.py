"""Sparse gradients (``tf.IndexedSlices``, e.g. from ``tf.keras.layers.Embedding``), exchanged sparse.

Horovod's own TensorFlow wrappers exchange an ``IndexedSlices`` gradient as two allgathers, of its
values and of its indices, and return an ``IndexedSlices`` of everything gathered (the rows of
every rank, duplicates included, in rank order), the values divided by the world size to average.
``DistributedGradientTape`` and the Keras ``DistributedOptimizer`` of hvdcompress do the same by
default, as an exchange generator of the usual shape (``tf_ops.collectives``)::

    values, indices = yield (Allgather(g.values), Allgather(g.indices))
    return IndexedSlices(values / N, indices, g.dense_shape)       (op=Sum: values as gathered)

**Compression is not applied to sparse gradients**: they are already sparse (the rows a batch
touched), and every compressor here is defined on dense tensors. Their values and indices travel
uncompressed, on the transport of the ``GradientCompression``'s exchange session
(``exchange_sparse``: the session's ``run``, their bytes added to its ``stats``), they are never
merged into a group and keep no compression state (no residual), whatever the spec. Non-finite values are never hidden: they are gathered as
they are, so every rank sees them. ``gradient_predivide_factor`` does not change them (it only
matters for a sum that could overflow, and nothing is summed here; Horovod refuses it for sparse
gradients).

``sparse_as_dense=True`` (Horovod's argument, the same meaning) converts them to dense tensors
first, so they are compressed, merged and error-fed like any other gradient. Paths whose state is
dense densify them as well, with a warning unless ``sparse_as_dense=True``: delayed averaging
(its corrections are dense) and ``backward_passes_per_step`` > 1 (the local sums are dense
variables; Horovod refuses sparse gradients there unless ``sparse_as_dense=True``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from .collectives import Allgather, Exchange


def sparse_positions(grads: Sequence[Optional[object]]) -> List[int]:
    return [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]


def sparse_exchange(grad: tf.IndexedSlices, world_size: int, average: bool) -> Exchange:
    """Generator: the averaged (``average``) or summed ``IndexedSlices``, the same on every rank.
    The division is Horovod's (``values / N`` in the values' dtype), so results match its bit for bit."""
    values, indices = yield (Allgather(grad.values), Allgather(grad.indices))
    if average and world_size != 1:
        values = values / tf.cast(world_size, values.dtype)
    return tf.IndexedSlices(values, indices, grad.dense_shape)


def exchange_sparse(session, grads: Sequence[tf.IndexedSlices], names: Sequence[str], world_size: int,
                    average: bool, process_set=None) -> List[tf.IndexedSlices]:
    """Exchange ``grads`` (``sparse_exchange`` each, named ``names``) on ``session``'s transport
    (``tf_ops.session.ExchangeSession.run``) and add their bytes to the session's ``stats``, beside
    the step's compressed exchanges: every front end's collectives go through its session."""
    results, sent = session.run([sparse_exchange(g, world_size, average) for g in grads], names, process_set)
    session.add(sent, sum(dense_bytes(g) for g in grads))
    return results


def dense_bytes(grad: tf.IndexedSlices) -> int:
    """Bytes of the dense tensor ``grad`` stands for (what a dense allreduce would send)."""
    return int(grad.shape.num_elements()) * grad.dtype.size


def split_sparse(grads: Sequence[Optional[object]]) -> Tuple[List[Optional[object]], List[int]]:
    """``grads`` with every ``IndexedSlices`` replaced by None (what the compressed exchange gets),
    and the positions taken out."""
    positions = sparse_positions(grads)
    taken = set(positions)
    return [None if i in taken else g for i, g in enumerate(grads)], positions
