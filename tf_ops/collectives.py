"""The Horovod communicator that carries out the contract's collective requests, for TensorFlow.

The compressor contract is the one of ``torch_ops``: an exchange is a generator that *yields* a
tuple of requests and is *sent* their results.

    Allreduce(t)  -- sum ``t`` over all ranks; the result is a new tensor (TF tensors are
                     immutable, so "in place" does not apply).
    Allgather(t)  -- concatenate every rank's ``t`` along dim 0, in rank order; sizes may differ
                     per rank (an empty ``t`` on some rank is fine). With ``same_shape`` at two
                     ranks it travels as a sum (``summed_gather``).
    Alltoall(t, splits) -- send ``splits[r]`` rows of ``t`` to rank r; receive, in rank order,
                     what every rank sent to this one (Horovod's alltoall).

Inside ``tf.function`` the generators run while the function is traced: each round's requests
become ``horovod.tensorflow`` ops (``allreduce(op=Sum)`` / ``allgather``) in the graph, their
symbolic outputs are sent back, and the next round is built on them. TensorFlow's executor then
starts every collective as soon as its input is ready, while the rest of the step still runs;
Horovod fuses the small ones in its background cycle. Nothing of Horovod is patched.

Bytes are counted from the payload tensors themselves (``tf.size * itemsize``, a tensor, since a
threshold sparsifier's payload size is only known when the step runs).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from hvdcompress.contract import Allgather, Allreduce, Alltoall, Exchange, Flag, Request, payload_requests
from hvdcompress.topology import HorovodProcessSets


def request_bytes(requests: Sequence[Request]) -> tf.Tensor:
    """Bytes this rank contributes to the collectives of one round (an int64 scalar tensor). The
    tensors whose shape is known when traced are counted in Python (no ops to trace); only the
    others (a selection of data-dependent size) add a size op."""
    known, total = 0, None
    for r in payload_requests(requests):
        numel = r.tensor.shape.num_elements()
        if numel is not None:
            known += numel * r.tensor.dtype.size
        else:
            part = tf.size(r.tensor, out_type=tf.int64) * r.tensor.dtype.size
            total = part if total is None else total + part
    known = tf.constant(known, tf.int64)
    return known if total is None else known + total


def summed_gather(t, rank: int, allreduce) -> tf.Tensor:
    """A same-shape gather between two ranks, sent as a sum (``torch_ops.collectives.SummedGather``
    has the reasoning): ``t``'s bytes as int32 words (zero-padded), summed by ``allreduce``; the
    sum minus this rank's words is the other rank's bytes. Returns both ranks' ``t`` concatenated
    along dim 0 in rank order, as an allgather does."""
    t = tf.convert_to_tensor(t)
    dtype = t.dtype
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    shape = tf.shape(t)
    flat = tf.reshape(t, [-1])
    if dtype == tf.bool:
        raw = tf.cast(flat, tf.uint8)
    else:
        raw = tf.reshape(tf.bitcast(flat, tf.uint8), [-1])
    nbytes = tf.size(raw)
    words = tf.bitcast(tf.reshape(tf.pad(raw, [[0, tf.math.floormod(-nbytes, 4)]]), [-1, 4]), tf.int32)
    other = tf.reshape(tf.bitcast(allreduce(words) - words, tf.uint8), [-1])[:nbytes]
    both = tf.concat([raw, other] if rank == 0 else [other, raw], 0)
    if dtype == tf.bool:
        values = tf.cast(both, tf.bool)
    elif dtype.size == 1:
        values = tf.bitcast(both, dtype)
    else:
        values = tf.bitcast(tf.reshape(both, [-1, dtype.size]), dtype)
    return tf.reshape(values, tf.concat([[2 * shape[0]], shape[1:]], 0))


class Communicator:
    """Turns requests into ``horovod.tensorflow`` collectives on one process set: the one object
    every collective of a TF front end goes through, a ``hvdcompress.contract.Transport`` as
    ``torch_ops.collectives``'s ``Communicator`` is. In graph mode a round is a set of graph ops
    rather than async handles (the protocol's docstring says what that means): ``launch`` builds
    the round's ops and its handles are their output tensors, ``wait`` returns them, ``poll`` is
    always True, ``batch`` changes nothing (Horovod fuses); ``run`` is launch-then-wait.

    ``name`` prefixes every op: Horovod matches collectives across ranks by name, and every rank
    traces the same code, so every rank names the same operation the same way.
    """

    def __init__(self, process_set=None):
        import horovod.tensorflow as hvd  # imported here: compressors and tests never need it

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set

    # -- who ---------------------------------------------------------------------------------------
    def rank(self) -> int:
        return int(self.process_set.rank())

    def size(self) -> int:
        from hvdcompress.schedule.groups import process_set_size
        return process_set_size(self.process_set)

    def included(self) -> bool:
        return bool(self.process_set.included())

    def versions(self) -> Dict[str, str]:
        """The transport's name and version (recorded with profiled cost models)."""
        import horovod
        return {"horovod": horovod.__version__}

    # -- rounds (the exchanges) ----------------------------------------------------------------------
    def run(self, requests: Sequence[Request], name: str) -> Tuple[tf.Tensor, ...]:
        """One round, built and returned: ``wait(launch(requests, name))``."""
        return self.wait(self.launch(requests, name))

    def wait(self, handles: Sequence[tf.Tensor]) -> Tuple[tf.Tensor, ...]:
        """The round's results (graph mode: the ops' outputs, which the executor completes)."""
        return tuple(handles)

    def poll(self, handles: Sequence[tf.Tensor]) -> bool:
        """Always True: a TF round has no handle to wait on outside the graph that runs it."""
        return True

    def batch(self):
        """A no-op context: Horovod's background cycle fuses the collectives submitted together."""
        return contextlib.nullcontext()

    def launch(self, requests: Sequence[Request], name: str) -> List[tf.Tensor]:
        """Build one round's collectives (named ``<name>.<i>``); returns their outputs, in request order."""
        hvd = self._hvd
        out = []
        pair = any(isinstance(r, Allgather) and r.same_shape for r in requests) and self.size() == 2
        for i, req in enumerate(requests):
            op_name = f"{name}.{i}"
            if pair and isinstance(req, Allgather) and req.same_shape:
                out.append(summed_gather(req.tensor, self.process_set.rank(),
                                         lambda w: hvd.allreduce(w, op=hvd.Sum, name=op_name,
                                                                 process_set=self.process_set)))
            elif isinstance(req, Allreduce):
                out.append(hvd.allreduce(req.tensor, op=hvd.Sum, name=op_name, process_set=self.process_set))
            elif isinstance(req, Allgather):
                out.append(hvd.allgather(req.tensor, name=op_name, process_set=self.process_set))
            elif isinstance(req, Alltoall):
                received = hvd.alltoall(req.tensor, splits=tf.constant(list(req.splits), tf.int32), name=op_name,
                                        process_set=self.process_set)
                out.append(received[0] if isinstance(received, tuple) else received)
            else:
                raise TypeError(f"exchange yielded {req!r}; expected Allreduce, Allgather or Alltoall requests")
        return out

    # -- blocking collectives (planning, checkpoints) ---------------------------------------------------
    def allreduce_(self, t, name: str, average: bool = False) -> tf.Tensor:
        """The sum (or average) of every rank's ``t``: a new tensor, or assigned into ``t`` when it
        is a ``tf.Variable`` (the protocol's in place)."""
        hvd = self._hvd
        out = hvd.allreduce(tf.convert_to_tensor(t), op=hvd.Average if average else hvd.Sum, name=name,
                            process_set=self.process_set)
        if isinstance(t, tf.Variable):
            t.assign(out)
        return out

    def allgather(self, t, name: str) -> tf.Tensor:
        return self._hvd.allgather(tf.convert_to_tensor(t), name=name, process_set=self.process_set)

    def barrier(self) -> None:
        """Returns once every rank of the set called it (an allreduce of one value)."""
        self.allreduce_(tf.constant(0, tf.int32), name="hvc.barrier")

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order (Horovod's pickled allgather on the process set)."""
        return list(self._hvd.allgather_object(obj, name=name, process_set=self.process_set))

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """``obj`` of the rank with index ``root`` in the process set, on every rank of the set."""
        return self.allgather_object(obj if self.rank() == root else None, name)[root]


def run_exchanges(gens: Sequence[Exchange], names: Sequence[str], driver) -> Tuple[List[tf.Tensor], tf.Tensor]:
    """Drive every exchange to completion, round-robin: round r of every exchange is issued
    before round r+1 of any, so multi-round exchanges interleave. Returns (results in the order
    of ``gens``, bytes this rank handed to the collectives as an int64 tensor)."""
    results: List[Optional[tf.Tensor]] = [None] * len(gens)
    inbox: List[Optional[tuple]] = [None] * len(gens)
    sent = [tf.constant(0, tf.int64)]
    rounds = [0] * len(gens)
    live = list(range(len(gens)))
    while live:
        still = []
        for i in live:
            try:
                requests = gens[i].send(inbox[i]) if inbox[i] is not None else next(gens[i])
            except StopIteration as stop:
                results[i] = stop.value
                continue
            sent.append(request_bytes(requests))
            inbox[i] = driver.run(requests, f"{names[i]}.r{rounds[i]}")
            rounds[i] += 1
            still.append(i)
        live = still
    return results, tf.add_n(sent)


# -- the process sets of a two-level topology ------------------------------------------------------
# The sets a two-level exchange runs on (``tf_ops.twolevel``) in TensorFlow's Horovod, which keeps
# its sets apart from PyTorch's: ``hvdcompress.topology.HorovodProcessSets``.
def _horovod():
    import horovod.tensorflow as hvd
    return hvd


PROCESS_SETS = HorovodProcessSets(_horovod, "hvdcompress.tensorflow")
can_make_process_sets = PROCESS_SETS.can_make
process_sets = PROCESS_SETS.get


def init(comm=None, process_sets=None):
    """``hvd.init`` (TensorFlow's Horovod) registering the launcher's node and cross-node sets
    (``HorovodProcessSets.init``); not under Horovod Elastic."""
    import os
    elastic = os.environ.get("HOROVOD_ELASTIC", "0") == "1"  # as tf_ops.elastic.elastic_mode reads it
    return PROCESS_SETS.init(comm, process_sets, elastic=elastic)
