"""A model that differs across ranks is a clear error on every rank, not a hang (TensorFlow).

An extra variable on one rank means one more collective there, which the other ranks never join
(a hang); another shape means collectives of different sizes (Horovod's error for an allreduce,
silent garbage for an allgather of a sparse payload). So the first time the wrappers
(``DistributedGradientTape``, the Keras ``DistributedOptimizer``) see a list of gradients, while
the exchange is traced, every rank allgathers its list's signature (per position: shape, dtype,
whether the gradient is None) and compares; a difference raises ``ValueError`` on every rank,
naming the first variable that differs and what it is on each rank. Variable names are reported,
not compared (Keras numbers layers per process, so the same model may be named differently).

Cost: two small allgathers per gradient signature (once per trace), run eagerly under
``tf.init_scope`` even while a ``tf.function`` is traced.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

Entry = Tuple[Optional[Tuple[int, ...]], Optional[str]]  # (shape, dtype) or (None, None) for a None gradient


def signature(grads: Sequence[Any]) -> Tuple[Entry, ...]:
    """Per position: (shape, dtype), the dtype marked ``(IndexedSlices)`` for a sparse gradient (it is
    exchanged by allgathers, a dense one by the compressor's collectives), or (None, None)."""
    return tuple((None, None) if g is None else
                 (tuple(g.shape.as_list()),
                  g.dtype.name + (" (IndexedSlices)" if isinstance(g, tf.IndexedSlices) else "")) for g in grads)


def _describe(entry: Entry) -> str:
    shape, dtype = entry
    return "no gradient (None)" if shape is None else f"shape {shape} {dtype}"


def allgather_object(obj: Any, process_set, name: str) -> List[Any]:
    """Every rank's ``obj`` in rank order, eagerly (also while a ``tf.function`` is traced)."""
    import cloudpickle
    import horovod.tensorflow as hvd
    import numpy as np

    with tf.init_scope():
        data = tf.constant(np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8))
        sizes = hvd.allgather(tf.reshape(tf.size(data, out_type=tf.int64), [1]), name=f"{name}.sizes",
                              process_set=process_set).numpy()
        blob = hvd.allgather(data, name=f"{name}.data", process_set=process_set).numpy().tobytes()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(blob[offset:offset + n]))
        offset += n
    return out


def differences(sigs: Sequence[Tuple[Entry, ...]], names: Sequence[str], who: str) -> Optional[str]:
    """The first difference between the ranks' signatures as a message, or None."""
    base = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        for i in range(max(len(base), len(sig))):
            mine = base[i] if i < len(base) else None
            theirs = sig[i] if i < len(sig) else None
            if mine == theirs:
                continue
            name = names[i] if i < len(names) else f"gradient {i}"
            if mine is None or theirs is None:
                extra = 0 if mine is not None else rank
                return (f"{who}: the model differs across ranks: rank 0 has {len(base)} gradients, rank {rank} has "
                        f"{len(sig)}; the first extra one is position {i} ('{name}' on rank {extra}); every rank "
                        "must build the same model")
            return (f"{who}: the model differs across ranks: variable '{name}' (gradient {i}) has "
                    f"{_describe(mine)} on rank 0 but {_describe(theirs)} on rank {rank}; every rank must build "
                    "the same model")
    return None


def check_same_model(grads: Sequence[Any], names: Sequence[str], process_set, who: str, name: str) -> None:
    """ValueError on every rank if ``grads`` differ across the ranks of ``process_set`` (see the
    module doc). ``names``: this rank's variable names, per position (each rank sends its own, so
    the message names the variable as each rank calls it)."""
    gathered = allgather_object((signature(grads), list(names)), process_set, name)
    sigs = [s for s, _ in gathered]
    message = differences(sigs, gathered[0][1] if len(gathered[0][1]) >= max(map(len, sigs))
                          else next(n for s, n in gathered if len(n) == max(map(len, sigs))), who)
    if message is not None:
        raise ValueError(message)
