"""The Horovod transport that carries out the contract's collective requests.

The compressor contract (``hvdcompress.contract``) keeps compressors free of Horovod: an exchange
is a generator that *yields* a tuple of requests and is *sent* their results.

    Allreduce(t)        -- sum ``t`` over all ranks, in place; the result is ``t`` itself.
    Allgather(t)        -- concatenate every rank's ``t`` along dim 0, in rank order; sizes may
                           differ (an empty ``t`` on some rank is fine). With ``same_shape`` at
                           two ranks it travels as a sum (``SummedGather``).
    Alltoall(t, splits) -- send ``splits[r]`` rows of ``t`` to rank r (in order); the result is
                           what every rank sent to this one, in rank order (Horovod's alltoall).

``Communicator`` implements the contract's ``Transport`` on Horovod: the one object through which
the project makes collectives of any kind, on the user's process set: the exchanges' async requests
(``launch`` / ``poll`` / ``wait``, from outside Horovod: ``allreduce_async_``, ``allgather_async``,
``alltoall_async``, ``synchronize``; ``batch()`` around launches that may be fused, a no-op where
the transport fuses by itself), and the scheduler's and profiler's object broadcasts, gathers,
barriers and timed collectives. ``PendingExchange`` counts the bytes each rank hands to the
transport, so compression ratios are measured from the real payload tensors, not claimed.
``PendingQueue`` keeps exchanges in flight across hooks and steps, advancing them by polling.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hvdcompress.contract import Allgather, Allreduce, Alltoall, Exchange, Flag, Request, Transport, payload_requests
from hvdcompress.topology import HorovodProcessSets


def request_bytes(requests: Sequence[Request]) -> int:
    """Bytes this rank contributes to the collectives of one round."""
    return sum(r.tensor.numel() * r.tensor.element_size() for r in payload_requests(requests))


# Waiting for a collective (``Communicator._synchronize``): polls before the first sleep, and the
# sleeps, doubling from the first to the last.
SPIN_POLLS = 20
MIN_PAUSE_S = 2e-5
MAX_PAUSE_S = 2e-4


class SummedGather:
    """A same-shape gather between two ranks, sent as a sum: every rank allreduces its payload's
    bytes as int32 words (zero-padded to a multiple of 4) and subtracts its own words from the
    sum, which leaves the other rank's bytes exactly (two's-complement addition is undone by
    subtraction, overflow included). Gloo's allgather over the one TCP connection between two
    ranks moves one direction at a time (about 2 m / rate for m bytes per rank), its allreduce
    both at once (about m / rate), so this halves the transfer of every ``Allgather(same_shape=
    True)`` at two ranks; at three or more ranks a sum no longer separates the payloads.

    ``words`` is the buffer to allreduce in place (None for an empty payload: no collective);
    once it holds the sum, ``result()`` is the gather's result, rank order along dim 0, as
    ``allgather`` gives."""

    __slots__ = ("shape", "dtype", "device", "rank", "nbytes", "own", "words", "handle")

    def __init__(self, tensor: torch.Tensor, rank: int):
        t = tensor.contiguous()
        if t.dim() == 0:
            t = t.reshape(1)
        self.shape, self.dtype, self.device, self.rank = tuple(t.shape), t.dtype, t.device, int(rank)
        raw = t.reshape(-1).view(torch.uint8)
        self.nbytes = raw.numel()
        self.handle = None
        if self.nbytes == 0:
            self.own = self.words = None
            return
        words = torch.empty((self.nbytes + 3) // 4, dtype=torch.int32, device=t.device)
        words[-1] = 0  # the padding bytes, if any, are zero on every rank
        words.view(torch.uint8)[:self.nbytes] = raw
        self.own = words.clone()
        self.words = words

    def result(self) -> torch.Tensor:
        shape = (2 * self.shape[0],) + self.shape[1:]
        nb = self.nbytes
        if nb == 0:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        out = torch.empty(2 * nb, dtype=torch.uint8, device=self.words.device)
        other = self.words.sub_(self.own).view(torch.uint8)[:nb]
        mine = self.own.view(torch.uint8)[:nb]
        out[:nb] = mine if self.rank == 0 else other
        out[nb:] = other if self.rank == 0 else mine
        return out.view(self.dtype).reshape(shape)


def sums_gathers(req, world_size: int) -> bool:
    """Whether the request travels as a ``SummedGather``: a same-shape gather between two ranks."""
    return isinstance(req, Allgather) and req.same_shape and world_size == 2


class Communicator:
    """The ``Transport`` (``hvdcompress.contract``) on one Horovod process set (default: all ranks).

    The optimizer builds one from its ``process_set`` and hands it to the exchanges, the scheduler
    and the profiler, so no collective ever runs on a set of ranks other than the user's (one
    that did would hang: ranks outside the set never join it). ``rank``/``size`` are this
    process's index in the set and the set's size. A subclass may change how requests complete
    (``injected_latency.LatencyTransport`` delays them): ``DistributedOptimizer(transport=...)``.

    Op names: ``launch`` appends the request's position to the name it is given; the optimizer
    names each exchange by group key, step and round, so ops stay unique across steps when
    exchanges span steps (Horovod matches ops across ranks by name).
    """

    def __init__(self, process_set=None):
        import horovod.torch as hvd  # imported here: compressors and planning never need it

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set

    # -- who --------------------------------------------------------------------------------------
    def rank(self) -> int:
        return self.process_set.rank()

    def size(self) -> int:
        from hvdcompress.schedule.groups import process_set_size
        return process_set_size(self.process_set)

    def included(self) -> bool:
        return bool(self.process_set.included())

    def world_size(self) -> int:
        """The whole job's size (``hvd.size()``), which a process set may be part of."""
        return self._hvd.size()

    def versions(self) -> Dict[str, str]:
        """The transport's name and version (recorded with profiled cost models)."""
        import horovod
        return {"horovod": horovod.__version__}

    # -- async requests (the exchanges) -------------------------------------------------------------
    def launch(self, requests: Sequence[Request], name: str) -> List[Any]:
        hvd = self._hvd
        handles = []
        world = self.size() if any(isinstance(r, Allgather) and r.same_shape for r in requests) else 0
        for i, req in enumerate(requests):
            op_name = f"{name}.{i}"
            if sums_gathers(req, world):
                g = SummedGather(req.tensor, self.rank())
                if g.words is not None:
                    g.handle = hvd.allreduce_async_(g.words, name=op_name, op=hvd.Sum, process_set=self.process_set)
                handles.append(g)
            elif isinstance(req, Allreduce):
                handles.append(hvd.allreduce_async_(req.tensor, name=op_name, op=hvd.Sum,
                                                    process_set=self.process_set))
            elif isinstance(req, Allgather):
                handles.append(hvd.allgather_async(req.tensor, name=op_name, process_set=self.process_set))
            elif isinstance(req, Alltoall):
                splits = torch.tensor(list(req.splits), dtype=torch.int32)
                handles.append(hvd.alltoall_async(req.tensor, splits=splits, name=op_name,
                                                  process_set=self.process_set))
            else:
                raise TypeError(f"exchange yielded {req!r}; expected Allreduce, Allgather or Alltoall requests")
        return handles

    def wait(self, handles: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        out = []
        for h in handles:
            if isinstance(h, SummedGather):
                if h.handle is not None:
                    self._synchronize(h.handle)
                out.append(h.result())
                continue
            r = self._synchronize(h)
            out.append(r[0] if isinstance(r, tuple) else r)  # alltoall: (output, received splits)
        return tuple(out)

    def _synchronize(self, handle):
        """``hvd.synchronize(handle)`` without its busy wait: Horovod's ``WaitAndClear`` loops on
        ``std::this_thread::yield()``, holding a whole core while the collective runs, the core
        that Horovod's background thread (which runs the collective) and, where ranks share a
        machine's cores, the other ranks' compute need. The handle is polled a few times, then
        with sleeps that grow to ``MAX_PAUSE_S`` (at most that much latency added), and
        synchronized once done."""
        hvd = self._hvd
        for _ in range(SPIN_POLLS):
            if hvd.poll(handle):
                return hvd.synchronize(handle)
        pause = MIN_PAUSE_S
        while not hvd.poll(handle):
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
        return hvd.synchronize(handle)

    def poll(self, handles: Sequence[Any]) -> bool:
        return all(self._hvd.poll(h.handle if isinstance(h, SummedGather) else h) for h in handles
                   if not (isinstance(h, SummedGather) and h.handle is None))

    def batch(self):
        """A context in which ``launch`` calls may be issued together at its end, fused where the
        transport allows (``TorchDistCommunicator``: one collective per dtype for the batch's
        small allreduces). Here it changes nothing: Horovod's background thread already fuses
        the allreduces that are submitted together into one buffer."""
        return contextlib.nullcontext()

    # -- blocking collectives (scheduler, profiler) ------------------------------------------------
    def allreduce_(self, t: torch.Tensor, name: str, average: bool = False) -> torch.Tensor:
        hvd = self._hvd
        return self._synchronize(hvd.allreduce_async_(t, op=hvd.Average if average else hvd.Sum, name=name,
                                                      process_set=self.process_set))

    def allgather(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return self._synchronize(self._hvd.allgather_async(t, name=name, process_set=self.process_set))

    def barrier(self) -> None:
        self._hvd.barrier(process_set=self.process_set)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order (pickled; two allgathers on the process set)."""
        data = pickled(obj)
        sizes = self.allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sizes")
        return unpickled(self.allgather(data, name=f"{name}.data"), sizes.tolist())

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """``obj`` of the rank with index ``root`` in the process set, on every rank of the set."""
        return self.allgather_object(obj if self.rank() == root else None, name)[root]


# -- the process sets of a two-level topology ------------------------------------------------------
# The sets a two-level exchange runs on (a node's ranks, the ranks at one local position of every
# node) in PyTorch's Horovod: ``hvdcompress.topology.HorovodProcessSets``.
def _horovod():
    import horovod.torch as hvd
    return hvd


PROCESS_SETS = HorovodProcessSets(_horovod, "hvdcompress.torch")
can_make_process_sets = PROCESS_SETS.can_make
process_sets = PROCESS_SETS.get


def init(comm=None, process_sets=None):
    """``hvd.init`` registering the launcher's node and cross-node sets
    (``HorovodProcessSets.init``); not under Horovod Elastic."""
    from .elastic import elastic_mode
    return PROCESS_SETS.init(comm, process_sets, elastic=elastic_mode())


def pickled(obj: Any, device: Optional[torch.device] = None) -> torch.Tensor:
    """``obj`` as a uint8 tensor (cloudpickle), for the object collectives of a transport."""
    import cloudpickle

    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    return data if device is None else data.to(device)


def unpickled(blob: torch.Tensor, sizes: Sequence[int]) -> List[Any]:
    """The objects of a gathered ``blob`` holding one pickle per rank of ``sizes`` bytes each."""
    import cloudpickle

    blob = blob.cpu()
    out, offset = [], 0
    for n in sizes:
        out.append(cloudpickle.loads(blob[offset:offset + n].numpy().tobytes()))
        offset += n
    return out


class PendingExchange:
    """One exchange in flight: its generator, the current round's handles, its byte count, and
    (``apply``) what to do with its result when it is written back."""

    __slots__ = ("gen", "name", "transport", "handles", "round", "bytes_sent", "result", "compute_seconds",
                 "first_seconds", "apply")

    def __init__(self, gen: Exchange, name: str, transport: Transport):
        self.gen, self.name, self.transport = gen, name, transport
        self.handles: Optional[List[Any]] = None
        self.round = 0
        self.bytes_sent = 0
        self.compute_seconds = 0.0  # time spent in the exchange's own code (compress, decompress)
        self.result: Optional[torch.Tensor] = None
        self.apply = None  # where the result goes when written back (set by whoever launched it)
        self._advance(None)
        self.first_seconds = self.compute_seconds  # the compress step, before the first round

    def _advance(self, results) -> None:
        start = time.perf_counter()
        try:
            requests = self.gen.send(results) if results is not None else next(self.gen)
        except StopIteration as stop:
            self.handles, self.result = None, stop.value
            return
        finally:
            self.compute_seconds += time.perf_counter() - start
        self.bytes_sent += request_bytes(requests)
        self.handles = self.transport.launch(requests, f"{self.name}.r{self.round}")
        self.round += 1

    @property
    def done(self) -> bool:
        return self.handles is None

    def step(self) -> bool:
        """Wait for the current round, feed its results, launch the next. True when finished."""
        if not self.done:
            self._advance(self.transport.wait(self.handles))
        return self.done

    def poll(self) -> bool:
        """Without blocking: while the current round has completed, feed its results and launch
        the next. True when finished."""
        while not self.done and self.transport.poll(self.handles):
            self._advance(self.transport.wait(self.handles))
        return self.done


class PendingQueue:
    """Exchanges in flight, in launch order, each due at a step.

    ``add`` puts a launched exchange in; ``poll`` (called from later gradient hooks, cheap and
    non-blocking) moves every exchange whose round has completed on to its next round, so a
    multi-round exchange does not wait for ``synchronize()`` to launch round two; ``finish(step)``
    drives the exchanges due by ``step`` to completion (round-robin) and hands them out. An
    exchange may be due steps after it was launched (delayed averaging), so the queue outlives
    ``synchronize()``.
    """

    def __init__(self):
        self._items: List[Tuple[Any, int, PendingExchange]] = []  # (key, due step, exchange)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, key: Any, exchange: PendingExchange, due: int) -> None:
        self._items.append((key, due, exchange))

    def keys(self, due: Optional[int] = None) -> List[Any]:
        return [k for k, d, _ in self._items if due is None or d <= due]

    def poll(self) -> None:
        """Advance the exchanges in flight, oldest first, up to the first whose current round is
        still running (rounds complete about in launch order): one Horovod poll per call in the
        common case, not one per exchange in flight, so the backward hooks stay cheap."""
        for _, _, ex in self._items:
            if not ex.done and not ex.poll():
                break

    def finish(self, due: Optional[int] = None, by_key: bool = False) -> Dict[Any, PendingExchange]:
        """Complete and remove the exchanges due by ``due`` (all with None); {key: exchange}.
        They are driven in launch order, or with ``by_key`` in the order of their keys (a
        transport that matches collectives by issue order needs an order that is the same on
        every rank whatever the launch order was)."""
        mine = [(k, ex) for k, d, ex in self._items if due is None or d <= due]
        if by_key:
            mine.sort(key=lambda item: item[0])
        self._items = [(k, d, ex) for k, d, ex in self._items if not (due is None or d <= due)]
        finish_all([ex for _, ex in mine])
        return dict(mine)


def finish_all(pending: Sequence[PendingExchange]) -> None:
    """Drive every exchange to completion, round-robin, so multi-round exchanges interleave:
    while one exchange's second round is in flight, the others' first rounds are collected.

    Each pass (every exchange waits for its current round and launches its next) runs inside its
    communicators' ``batch()``: the next rounds launched in one pass go out together, fused into
    one collective per dtype on torch.distributed. The order of the pass is the order of
    ``pending``, so it is the same on every rank. A stand-in transport without ``batch`` is driven
    one launch at a time."""
    queue = [p for p in pending if not p.done]
    while queue:
        with contextlib.ExitStack() as stack:
            for transport in dict.fromkeys(p.transport for p in queue):
                batch = getattr(transport, "batch", None)
                if batch is not None:
                    stack.enter_context(batch())
            queue = [p for p in queue if not p.step()]
