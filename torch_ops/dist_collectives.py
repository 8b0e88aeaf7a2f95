"""The ``Transport`` on torch.distributed: the same requests, on a process group, without Horovod.

Any backend torch.distributed has (Gloo on CPU, NCCL on GPUs) carries the exchanges' requests
(``torch_ops.collectives``: ``Allreduce`` / ``Flag``, ``Allgather``, ``Alltoall``), the
scheduler's object collectives and the profiler's timed ones, on one process group (the default
group unless one is given: process groups stand where Horovod has process sets). Requests are
async ops (``async_op=True``); their completion is waited on in ``wait``.

Three things differ from Horovod, and this class absorbs them:

* **Fusion.** Horovod's background thread fuses the allreduces submitted together into one
  buffer; torch.distributed issues one collective per call, and each pays a start-up (on Gloo,
  2(N-1) latency-bound messages for the ring). Here the requests launched inside one ``batch()``
  (one ``launch`` call is a batch of its own) are issued together at its end: the small
  allreduces of one dtype in one flat collective, the row counts of all gathers in one. Whoever
  drives several exchanges together opens the batch: ``finish_all`` for every pass of rounds
  (all the exchanges' next rounds), the DDP hook for the first rounds of a bucket it splits.
* **Sizes.** Horovod's allgather and alltoall take different sizes per rank and negotiate them in
  their background thread. Here the gathers of a batch first allgather every gathered tensor's
  row count (one int64 collective for all of them), then each tensor travels padded
  to the largest count (``all_gather_single``) and the padding is cut off; a gather with no rows
  anywhere issues no data collective. A same-shape gather (``Allgather(same_shape=True)``) skips
  the sizes stage, and between two ranks travels as an allreduce of its bytes (``SummedGather``),
  batched with the other allreduces. ``Alltoall`` first exchanges its split sizes
  (``all_to_all_single`` of one count per rank), then the rows (``all_to_all_single`` with the
  splits).
* **Matching.** Horovod matches collectives across ranks by name; torch.distributed by the order
  they are issued on the group, so every rank must issue the same collectives in the same order.
  This class issues collectives only inside ``launch``, ``wait``, at the end of ``batch`` and in
  the blocking methods (never from a completion callback), which the optimizer and the DDP hook
  call in the same sequence on every rank. The data stage of a gather, which needs the sizes, is
  issued at the next such call (first in, first out), waiting for the sizes collective if it is
  still running. And ``poll``
  answers False: what it would let a caller launch next (a later round, as ``PendingQueue.poll``
  does from the backward hooks) would depend on timing, which differs between ranks; later rounds
  are therefore launched when the caller waits for the earlier one (in ``synchronize`` / the DDP
  hook's last bucket), in the same order everywhere.

Results are the same as Horovod's: allreduce sums in place (the result is the request's tensor;
Gloo adds two ranks' values as a + b, so 2 ranks match the oracle bit for bit, fused or not, and
3 or more may differ from the rank-order sum in the last bit, by an order that depends on where an
entry falls in the ring's chunks, so on the fusion too), allgather concatenates in rank order.
``collectives`` counts the collectives issued, by kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from .collectives import Allgather, Allreduce, Alltoall, Request, SummedGather, pickled, sums_gathers, unpickled


# dtypes torch.distributed's Gloo and NCCL collectives take (Gloo refuses int16, for one). Other
# dtypes are gathered / sent as their bytes and summed as int64 (integers), the results cast back.
_MOVED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool)


def _as_bytes(t: torch.Tensor):
    """(the tensor to put on the wire, None or (dtype, trailing shape) to read the result back)."""
    if t.dtype in _MOVED:
        return t, None
    row = 1
    for d in t.shape[1:]:
        row *= int(d)
    return t.reshape(t.shape[0], row).view(torch.uint8), (t.dtype, tuple(t.shape[1:]))


def _gather_single(dist, out: torch.Tensor, inp: torch.Tensor, group):
    """``all_gather_single`` (``all_gather_into_tensor`` in torch versions without it), async."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def carried_device_types(backend: str) -> Optional[FrozenSet[str]]:
    """The device types a process group's backend moves tensors of, from its name as
    ``torch.distributed.get_backend`` gives it: NCCL CUDA only, Gloo both, a per-device map
    (``"cpu:gloo,cuda:nccl"``) its keys; None where unknown (every tensor is passed as it is)."""
    backend = backend.lower()
    if ":" in backend:
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(",") if ":" in part)
    return {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu", "cuda"}),
            "mpi": frozenset({"cpu", "cuda"})}.get(backend)


class _Op:
    """One request in flight: its data collective (``work``) and how to read its result."""

    __slots__ = ("kind", "tensor", "work", "out", "rows", "rest", "sizes", "column", "splits", "recv_splits", "trimmed",
                 "cast", "summed", "wire", "pending", "fused", "gather", "home")

    def __init__(self, kind: str, tensor: torch.Tensor):
        self.kind, self.tensor = kind, tensor
        self.work = None
        self.out: Optional[torch.Tensor] = None
        self.rows: List[int] = []  # allgather: every rank's row count (after the sizes stage)
        self.rest: Tuple[int, ...] = tuple(tensor.shape[1:])
        self.sizes: Optional[Tuple[Any, torch.Tensor]] = None  # (work, gathered counts) shared by the round
        self.column = 0  # this gather's column in the round's gathered counts
        self.splits: Optional[List[int]] = None  # alltoall: rows sent to each rank
        self.recv_splits: Optional[torch.Tensor] = None
        self.trimmed = False  # allgather: the padding was cut off the result
        self.cast = None  # (dtype, trailing shape) when the tensor travels as bytes
        self.summed: Optional[torch.Tensor] = None  # allreduce of a dtype summed in a wider copy
        self.wire: Optional[torch.Tensor] = None  # allreduce: the tensor summed (the request's, or ``summed``)
        self.pending = False  # launched in a batch not issued yet
        self.fused: Optional[Tuple[torch.Tensor, int]] = None  # allreduce: (flat buffer, offset) when fused
        self.gather: Optional[SummedGather] = None  # allreduce that carries a same-shape gather of two ranks
        self.home = None  # staged: (the request's own tensor, an allreduce's) when its device is one the group cannot carry


# Allreduces launched in one batch (``TorchDistCommunicator.batch``) are fused when each is at most
# FUSE_REQUEST_BYTES: fusing saves a collective's start-up (latency-bound for small tensors) and
# costs two copies, which only pay for small tensors. A fused collective holds at most
# FUSE_BUFFER_BYTES.
FUSE_REQUEST_BYTES = 1 << 20
FUSE_BUFFER_BYTES = 64 << 20


def _fusion_plan(ops: Sequence[_Op]) -> List[List[_Op]]:
    """The allreduces of a batch, partitioned into collectives: requests of at most
    FUSE_REQUEST_BYTES with the same dtype and device share one (in launch order, a new one when
    FUSE_BUFFER_BYTES would be exceeded), larger ones go alone; collectives in the order of their
    first request. A function of the requests' shapes and dtypes only, so the same on every rank."""
    plan: List[List[_Op]] = []
    open_: Dict[Any, List[int]] = {}  # (dtype, device) -> [index in plan, bytes]
    for op in ops:
        nbytes = op.wire.numel() * op.wire.element_size()
        if nbytes > FUSE_REQUEST_BYTES:
            plan.append([op])
            continue
        key = (op.wire.dtype, op.wire.device)
        slot = open_.get(key)
        if slot is None or slot[1] + nbytes > FUSE_BUFFER_BYTES:
            open_[key] = [len(plan), nbytes]
            plan.append([op])
        else:
            plan[slot[0]].append(op)
            slot[1] += nbytes
    return plan


class TorchDistCommunicator:
    """The ``Transport`` (``hvdcompress.contract``) on one torch.distributed process group (module
    doc); a peer of Horovod's ``torch_ops.collectives.Communicator``.

    ``group``: a process group (``torch.distributed.new_group``), default the default group.
    ``rank()``/``size()`` are this process's rank in the group and the group's size. Names are
    accepted for the interface and not used (torch.distributed matches by issue order).
    """

    transport = "torch.distributed"

    def __init__(self, group=None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("backend='torch': torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group(...) first (torchrun sets its environment)")
        self._dist = dist
        self.group = group
        self.process_set = group  # the interface's name for the set of ranks
        self._deferred: List[_Op] = []  # gathers / alltoalls whose data stage waits for their sizes
        self._batched: List[_Op] = []  # allreduces / gathers launched in the open batch, not issued yet
        self._depth = 0  # nesting of ``batch()``
        self._carried = carried_device_types(str(dist.get_backend(group)))
        # collectives issued on the group so far, by kind ("all_reduce", "all_gather", "all_to_all",
        # "barrier"): what tests and benchmarks count per step
        self.collectives: Dict[str, int] = {"all_reduce": 0, "all_gather": 0, "all_to_all": 0, "barrier": 0}

    def _count(self, kind: str) -> None:
        self.collectives[kind] += 1

    # -- who --------------------------------------------------------------------------------------
    def rank(self) -> int:
        return self._dist.get_rank(self.group)

    def size(self) -> int:
        return self._dist.get_world_size(self.group)

    def included(self) -> bool:
        return self._dist.get_rank(self.group) >= 0

    def versions(self) -> Dict[str, str]:
        return {"torch.distributed": str(self._dist.get_backend(self.group)), "torch": torch.__version__}

    def device(self) -> torch.device:
        """Where tensors made for this group's collectives belong when no gradient says otherwise
        (object collectives, control values): the current CUDA device where the backend moves
        CUDA tensors only (NCCL), else the CPU."""
        if self._carried is not None and "cpu" not in self._carried and "cuda" in self._carried:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _staged(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of ``t`` on ``device()`` when the backend cannot move tensors of ``t``'s device
        type (a CPU tensor on NCCL: the profiler's and the scheduler's timing tensors), else None.
        The library makes an exchange's tensors on its gradients' device, so they never pay this."""
        if self._carried is None or t.device.type in self._carried:
            return None
        return t.to(self.device(), copy=True)

    # -- async requests (the exchanges) -------------------------------------------------------------
    def launch(self, requests: Sequence[Request], name: str) -> List[_Op]:
        """Start one round's requests. Allreduces and gathers are issued when the enclosing
        ``batch()`` ends (a call outside one is its own batch), alltoalls at once."""
        dist, group = self._dist, self.group
        self._flush()
        ops: List[_Op] = []
        with self.batch():
            for req in requests:
                home = None
                staged = self._staged(req.tensor) if torch.is_tensor(req.tensor) else None
                if staged is not None:
                    home, req = req.tensor, dataclasses.replace(req, tensor=staged)
                if isinstance(req, Allreduce):  # Flag included
                    op = _Op("allreduce", req.tensor)
                    wire = req.tensor
                    if wire.dtype not in _MOVED:
                        if wire.is_floating_point() or wire.is_complex():
                            raise TypeError(f"Allreduce of {wire.dtype} is not supported by torch.distributed")
                        wire = op.summed = wire.to(torch.int64)
                    op.wire, op.out, op.pending = wire, req.tensor, True
                    self._batched.append(op)
                elif sums_gathers(req, self.size()):  # an allreduce of its bytes (``SummedGather``)
                    g = SummedGather(req.tensor, self.rank())
                    op = _Op("allreduce", req.tensor)
                    op.gather = g
                    if g.words is None:  # nothing to send on either rank
                        op.out = g.result()
                    else:
                        op.wire, op.out, op.pending = g.words, g.words, True
                        self._batched.append(op)
                elif isinstance(req, Allgather):
                    t = req.tensor.contiguous()
                    wire, cast = _as_bytes(t.reshape(1) if t.dim() == 0 else t)
                    op = _Op("allgather", wire)
                    op.cast, op.pending = cast, True
                    if req.same_shape:  # every rank's row count is this one: no sizes stage
                        op.rows = [wire.shape[0]] * self.size()
                    self._batched.append(op)
                elif isinstance(req, Alltoall):
                    t, cast = _as_bytes(req.tensor.contiguous())
                    op = _Op("alltoall", t)
                    op.cast = cast
                    op.splits = [int(s) for s in req.splits]
                    if len(op.splits) != self.size() or sum(op.splits) != t.shape[0]:
                        raise ValueError(f"Alltoall: splits {op.splits} must have one entry per rank ({self.size()}) "
                                         f"summing to the tensor's {t.shape[0]} rows")
                    send = torch.tensor(op.splits, dtype=torch.int64, device=t.device)
                    op.recv_splits = torch.empty_like(send)
                    op.work = dist.all_to_all_single(op.recv_splits, send, group=group, async_op=True)
                    self._count("all_to_all")
                    self._deferred.append(op)
                else:
                    raise TypeError(f"exchange yielded {req!r}; expected Allreduce, Allgather or Alltoall requests")
                op.home = None if home is None else (home, isinstance(req, Allreduce))
                ops.append(op)
        return ops

    @contextlib.contextmanager
    def batch(self):
        """Issue the allreduces and gathers launched inside together when the outermost ``batch``
        ends (or earlier, when one of them is waited for): the allreduces of at most
        ``FUSE_REQUEST_BYTES`` each go in one flat collective per dtype and device (concatenated,
        summed, copied back into each request's tensor), up to ``FUSE_BUFFER_BYTES`` per
        collective; larger ones travel alone; one collective carries the row counts of all the
        batch's gathers (their data stages stay one collective each). Which requests share a
        collective depends only on the sequence of launches, the same on every rank."""
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._issue()

    def _issue(self) -> None:
        """Issue the batched requests (``batch``): the gathers' row counts, then the allreduces."""
        dist, group = self._dist, self.group
        ops, self._batched = self._batched, []
        for op in ops:
            if op.kind == "allgather" and op.rows:  # same shape everywhere: straight to the data stage
                self._deferred.append(op)
        gathers = [op for op in ops if op.kind == "allgather" and not op.rows]
        if gathers:  # one collective carries the row counts of all the batch's gathers
            counts = torch.tensor([op.tensor.shape[0] for op in gathers], dtype=torch.int64,
                                  device=gathers[0].tensor.device)
            table = counts.new_empty(self.size() * len(gathers))
            sizes = (_gather_single(dist, table, counts, group), table)
            self._count("all_gather")
            for j, op in enumerate(gathers):
                op.sizes, op.column = sizes, j
                self._deferred.append(op)
        for fused in _fusion_plan([op for op in ops if op.kind == "allreduce"]):
            if len(fused) == 1:
                wire = fused[0].wire
            else:
                wire = torch.cat([op.wire.reshape(-1) for op in fused])
                offset = 0
                for op in fused:
                    op.fused = (wire, offset)
                    offset += op.wire.numel()
            work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True)
            self._count("all_reduce")
            for op in fused:
                op.work = work
        for op in ops:
            op.pending = False

    def _flush(self) -> None:
        """Issue the data stage of every deferred gather / alltoall, oldest first (module doc)."""
        pending, self._deferred = self._deferred, []
        for op in pending:
            self._start_data(op)

    def _start_data(self, op: _Op) -> None:
        dist, group, world = self._dist, self.group, self.size()
        if op.kind == "allgather":
            if op.sizes is not None:
                work, table = op.sizes
                work.wait()
                n = table.numel() // world
                op.rows = [int(r) for r in table.view(world, n)[:, op.column].tolist()]
                op.sizes = None
            top = max(op.rows)
            if top == 0:  # nothing anywhere: no data collective
                op.out = op.tensor.new_empty((0,) + op.rest)
            else:
                t = op.tensor
                if t.shape[0] != top:
                    padded = t.new_zeros((top,) + op.rest)
                    padded[:t.shape[0]] = t
                    t = padded
                op.out = t.new_empty((world * top,) + op.rest)
                op.work = _gather_single(dist, op.out, t, group)
                self._count("all_gather")
        else:  # alltoall
            op.work.wait()
            recv = [int(r) for r in op.recv_splits.tolist()]
            row = 1
            for d in op.rest:
                row *= int(d)
            op.out = op.tensor.new_empty((sum(recv),) + op.rest)
            op.recv_splits = recv
            # every rank takes part, one that sends and receives nothing too: the others' collective
            # includes it (it cannot tell from its own splits whether any rank sends anything)
            op.work = dist.all_to_all_single(op.out, op.tensor, recv, op.splits, group=group, async_op=True)
            self._count("all_to_all")

    def wait(self, handles: Sequence[_Op]) -> Tuple[torch.Tensor, ...]:
        if any(op.pending for op in handles):  # waited for inside the batch that launched it
            self._issue()
        self._flush()
        out = []
        for op in handles:
            if op.work is not None:
                op.work.wait()  # a fused collective's work is waited for once per request: a no-op after the first
                op.work = None
            if op.fused is not None:
                flat, offset = op.fused
                op.wire.copy_(flat[offset:offset + op.wire.numel()].view(op.wire.shape))
                op.fused = None
            if op.summed is not None:
                op.out.copy_(op.summed)
                op.summed = None
            if op.gather is not None and op.wire is not None:
                op.out, op.gather = op.gather.result(), None
            if op.kind == "allgather" and not op.trimmed:
                op.trimmed = True
                top = max(op.rows)
                if top != min(op.rows):  # cut each rank's padding off
                    op.out = torch.cat([op.out[r * top:r * top + n] for r, n in enumerate(op.rows)])
            if op.cast is not None:
                dtype, rest = op.cast
                op.out, op.cast = op.out.view(dtype).reshape((-1,) + rest), None
            if op.home is not None:  # staged: back where the request's tensor lives
                home, in_place = op.home
                # an allreduce's result is its request's tensor
                op.out = home.copy_(op.out) if in_place else op.out.to(home.device)
                op.home = None
            out.append(op.out)
        return tuple(out)

    def poll(self, handles: Sequence[_Op]) -> bool:
        """Always False: a caller that launched the next round when this one happened to be complete
        would issue collectives in a timing-dependent order (module doc)."""
        return False

    # -- blocking collectives (scheduler, profiler) ------------------------------------------------
    def allreduce_(self, t: torch.Tensor, name: str, average: bool = False) -> torch.Tensor:
        self._flush()
        staged = self._staged(t)
        self._dist.all_reduce(t if staged is None else staged, op=self._dist.ReduceOp.SUM, group=self.group)
        if staged is not None:
            t.copy_(staged)
        self._count("all_reduce")
        if average:
            if t.is_floating_point() or t.is_complex():
                t.div_(self.size())
            else:
                t.floor_divide_(self.size())
        return t

    def allgather(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return self.wait(self.launch((Allgather(t),), name))[0]

    def barrier(self) -> None:
        self._flush()
        self._dist.barrier(group=self.group)
        self._count("barrier")

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order (pickled bytes, gathered with their sizes)."""
        (op,) = self.launch((Allgather(pickled(obj, self.device())),), name)
        return unpickled(self.wait((op,))[0], op.rows)

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """``obj`` of the rank with index ``root`` in the group, on every rank of the group."""
        return self.allgather_object(obj if self.rank() == root else None, name)[root]


def new_subgroups(rank_lists: Sequence[Sequence[int]], group=None) -> List[Any]:
    """One process group per list of ranks (ranks of ``group``, default the whole world), made by
    ``torch.distributed.new_group`` in list order: every rank of the job calls it with the same
    lists (new_group's rule). Returns the groups in list order; a group this rank is not in is
    torch.distributed's non-member marker."""
    import torch.distributed as dist

    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return [dist.new_group([to_global(r) for r in ranks]) for ranks in rank_lists]
