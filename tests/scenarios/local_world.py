"""A single-process stand-in for N ranks, for unit tests of exchange *semantics* only.

It drives N exchange generators in lockstep and answers their requests the way the collectives
define them (Allreduce: sum in rank order; Allgather: concatenate in rank order; Alltoall: rank r
gets every rank's piece r, in rank order). The same driver
serves both backends: requests from ``torch_ops`` are answered with torch (the sum is written into
every rank's tensor, as Horovod's in-place allreduce does), requests from ``tf_ops`` with
TensorFlow ops -- which also works while a ``tf.function`` is traced, so graph mode is checked the
same way. The tests that matter for distributed behaviour run real Horovod processes
(tests/test_multiprocess.py, tests/test_tf_multiprocess.py); this one lets the numpy oracle be
compared quickly and exactly.
"""

from __future__ import annotations

from typing import Sequence

from hvdcompress.contract import Allgather, Allreduce, Alltoall, lockstep


class _Torch:
    @staticmethod
    def nbytes(requests):
        from torch_ops.collectives import request_bytes
        return request_bytes(requests)

    @staticmethod
    def allreduce(tensors):
        total = tensors[0].clone()
        for t in tensors[1:]:
            total += t
        for t in tensors:
            t.copy_(total)
        return list(tensors)

    @staticmethod
    def allgather(tensors):
        import torch
        cat = torch.cat(tensors)
        return [cat.clone() for _ in tensors]

    @staticmethod
    def alltoall(tensors, splits):
        import torch
        pieces = [torch.split(t, list(s)) for t, s in zip(tensors, splits)]
        return [torch.cat([pieces[src][r] for src in range(len(tensors))]) for r in range(len(tensors))]


class _TF:
    @staticmethod
    def nbytes(requests):
        import tensorflow as tf
        from tf_ops.collectives import request_bytes
        n = request_bytes(requests)
        return int(n) if tf.executing_eagerly() else n

    @staticmethod
    def allreduce(tensors):
        import tensorflow as tf

        def add_in_rank_order(*parts):
            total = parts[0]
            for t in parts[1:]:
                total = total + t
            return total

        if tf.executing_eagerly():
            total = add_in_rank_order(*tensors)
        else:  # opaque, like a real collective: Grappler must not merge it with the ranks' own adds
            total = tf.numpy_function(add_in_rank_order, list(tensors), tensors[0].dtype, stateful=False)
            total.set_shape(tensors[0].shape)
        return [total] * len(tensors)

    @staticmethod
    def allgather(tensors):
        import tensorflow as tf
        cat = tf.concat(tensors, axis=0)
        return [cat] * len(tensors)

    @staticmethod
    def alltoall(tensors, splits):
        import tensorflow as tf
        pieces = [tf.split(t, list(s), axis=0) for t, s in zip(tensors, splits)]
        return [tf.concat([pieces[src][r] for src in range(len(tensors))], axis=0) for r in range(len(tensors))]


def _backend(tensor):
    return _TF if type(tensor).__module__.startswith("tensorflow") else _Torch


def _answer(rounds):
    """Each rank's results for one round (``hvdcompress.contract.lockstep``'s ``answer``)."""
    n = len(rounds)
    assert len({len(x) for x in rounds}) == 1, "ranks disagree on the number of requests"
    answers = [[] for _ in range(n)]
    for i in range(len(rounds[0])):
        backend = _backend(rounds[0][i].tensor)
        tensors = [rounds[r][i].tensor for r in range(n)]
        if isinstance(rounds[0][i], Allreduce):  # Flag too: a control value summed with a round
            out = backend.allreduce(tensors)
        elif isinstance(rounds[0][i], Allgather):
            out = backend.allgather(tensors)
        elif isinstance(rounds[0][i], Alltoall):
            out = backend.alltoall(tensors, [rounds[r][i].splits for r in range(n)])
        else:
            raise TypeError(rounds[0][i])
        for r in range(n):
            answers[r].append(out[r])
    return [tuple(a) for a in answers]


def run_lockstep(gens: Sequence) -> tuple:
    """Returns (result per rank, bytes sent per rank)."""
    sent = [0] * len(gens)

    def count(rank, requests):
        if requests:
            sent[rank] += _backend(requests[0].tensor).nbytes(requests)

    return lockstep(gens, _answer, count), sent
