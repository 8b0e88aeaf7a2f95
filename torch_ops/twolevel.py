"""Two-level exchanges: dense inside a node, the spec's exchange across nodes (PyTorch).

A node's ranks share fast links (NVLink, PCIe, shared memory), nodes share slow ones. Given a
``hvdcompress.topology.Topology`` of N nodes of L ranks, one exchange of a flat tensor x is

1. a dense reduce-scatter inside the node: x is cut into L parts (``schedule.groups.split_layout``), every
   rank sends part j to local rank j (one ``Alltoall`` on the node's group) and sums the L pieces it
   receives in local rank order, so local rank l holds its node's sum of part l;
2. the spec's own exchange generator, unchanged, on that part, over the ranks at local position l
   of every node (the cross group: N ranks, ``world_size`` N, ``rank`` the node), with the flat
   exchange's ``scale`` (so the result is the mean over all ranks where the flat one averages);
3. an allgather of the exchanged parts inside the node, which is the result on every rank.

``hvdcompress.reference.twolevel`` is the numpy oracle of the same steps, and says what the state
of the cross exchange means (the state of local rank l's part, on that rank only, kept in the flat
layout so checkpoints and merged groups are unchanged).

The cross exchanges of a node's L ranks work on different parts and may take different numbers of
rounds (a part may be empty, or fall under a compressor's dense rule). Every round therefore
carries a 4-byte local ``Flag``: 1 while this rank still had cross requests; the ranks go on, a
rank that is done sending only its flag, until a round where none had any, and then gather. So
every rank of the job runs the same rounds, which a transport that matches collectives by issue
order (torch.distributed) needs when several exchanges are in flight. It costs one flag round on
the node's links per exchange.

``TwoLevelTransport`` is the ``Transport`` the session sees: the world's transport for everything
untagged (the non-finite guard's flag, object collectives, profiling, barriers), the local and
cross groups' transports for ``Hop`` requests; ``compose`` makes the two-level exchange around a
compressor's exchange, which ``torch_ops.session.ExchangeSession.start`` calls when its transport
has it. Payload bytes are counted per hop (``take_hop_bytes``, read into ``stats.hops``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from hvdcompress.contract import Allgather, Alltoall, ExchangeContext, Flag, Hop, payload_requests
from hvdcompress.schedule.groups import Part, split_layout
from hvdcompress.topology import Topology

LOCAL, CROSS, WORLD = "local", "cross", "world"
LEVELS = (WORLD, LOCAL, CROSS)


def part_state(state: Dict[str, Any], part: Part, numel: int) -> Dict[str, Any]:
    """The cross exchange's state: entries as large as the whole tensor as views of the part (in-place
    updates reach the flat-layout state), others as they are."""
    return {k: (v.reshape(-1)[part.start:part.stop] if torch.is_tensor(v) and v.numel() == numel else v)
            for k, v in state.items()}


def store_state(state: Dict[str, Any], inner: Dict[str, Any], part: Part, numel: int) -> None:
    """Write the cross exchange's state back into the flat-layout ``state``: an entry as large as the
    part into its place of a whole-size tensor (zeros elsewhere when new), any other as it is."""
    for k, v in inner.items():
        if torch.is_tensor(v) and v.numel() == part.numel and part.numel != numel:
            whole = state.get(k)
            if not torch.is_tensor(whole) or whole.numel() != numel:
                whole = state[k] = v.new_zeros(numel)
            place = whole.reshape(-1)[part.start:part.stop]
            if place.data_ptr() != v.data_ptr() or place.numel() != v.numel():
                place.copy_(v.reshape(-1))
        else:
            state[k] = v


def two_level_exchange(make: Callable[[torch.Tensor, ExchangeContext], Any], x: torch.Tensor,
                       ctx: ExchangeContext, topology: Topology, rank: int):
    """The two-level exchange of ``x`` on ``rank`` (module doc): ``make(part, ctx)`` is the spec's
    exchange generator; yields ``Hop`` requests, returns the dense result."""
    L = topology.local_size
    flat = x.reshape(-1)
    numel = flat.numel()
    parts = split_layout(numel, tuple(ctx.shape), ctx.member_list(numel), L)
    part = parts[topology.local_rank(rank)]
    (pieces,) = yield (Hop(LOCAL, Alltoall(flat.contiguous(), tuple(p.numel for p in parts))),)
    pieces = pieces.reshape(L, part.numel)
    mine = pieces[0].clone()
    for i in range(1, L):  # local rank order, as the oracle adds
        mine.add_(pieces[i])
    view = part_state(ctx.state, part, numel)
    inner = ExchangeContext(ctx.key, ctx.step, topology.nodes, ctx.scale, view, part.shape, ctx.epoch,
                            topology.node_of(rank), part.members, density=ctx.density)
    result, gen, requests = mine, None, None
    if part.numel:
        gen = make(mine, inner)
        try:
            requests = next(gen)
        except StopIteration as stop:
            result = stop.value
    while True:
        running = requests is not None
        flag = torch.tensor([1.0 if running else 0.0], dtype=torch.float32)
        got = yield tuple(Hop(CROSS, r) for r in (requests or ())) + (Hop(LOCAL, Flag(flag)),)
        if running:
            try:
                requests = gen.send(tuple(got[:-1]))
            except StopIteration as stop:
                requests, result = None, stop.value
        if float(got[-1][0]) == 0.0:
            break
    store_state(ctx.state, view, part, numel)
    (whole,) = yield (Hop(LOCAL, Allgather(result.reshape(-1).contiguous())),)
    return whole


class TwoLevelTransport:
    """A ``Transport`` over three: the world's (``world``: untagged requests, every blocking and
    object collective), the node's (``local``) and the cross-node peers' (``cross``), for ``Hop``
    requests; ``rank`` / ``size`` are the world's (module doc)."""

    def __init__(self, world, local, cross, topology: Topology):
        self.world, self.local, self.cross = world, local, cross
        self.topology = topology
        self.process_set = world.process_set
        self._by_level = {WORLD: world, LOCAL: local, CROSS: cross}
        self._hop_bytes = {LOCAL: 0, CROSS: 0}

    # -- who ------------------------------------------------------------------------------------
    def rank(self) -> int:
        return self.world.rank()

    def size(self) -> int:
        return self.world.size()

    def included(self) -> bool:
        return self.world.included()

    def versions(self) -> Dict[str, str]:
        return dict(self.world.versions(), topology=str(self.topology))

    # -- the exchange ---------------------------------------------------------------------------
    def compose(self, make, x: torch.Tensor, ctx: ExchangeContext):
        """The two-level exchange around ``make(x, ctx)`` (the spec's exchange) on this rank."""
        return two_level_exchange(make, x, ctx, self.topology, self.rank())

    def take_hop_bytes(self) -> Dict[str, int]:
        """Payload bytes handed to each hop since the last call."""
        out, self._hop_bytes = self._hop_bytes, {LOCAL: 0, CROSS: 0}
        return out

    # -- requests -------------------------------------------------------------------------------
    def launch(self, requests: Sequence[Any], name: str) -> List[Tuple[str, int, Any]]:
        """Each level's requests launched on its transport (world, local, cross: the same order on
        every rank); handles are (level, index in that level's round, the level's handles)."""
        by: Dict[str, List[Any]] = {level: [] for level in LEVELS}
        where = []
        for req in requests:
            level = req.level if isinstance(req, Hop) else WORLD
            inner = req.request if isinstance(req, Hop) else req
            if level not in self._by_level:
                raise ValueError(f"Hop: level must be one of {LEVELS[1:]}; got {level!r}")
            where.append((level, len(by[level])))
            by[level].append(inner)
            if level in self._hop_bytes and payload_requests((inner,)):
                self._hop_bytes[level] += inner.tensor.numel() * inner.tensor.element_size()
        handles = {level: self._by_level[level].launch(reqs, f"{name}.{level}")
                   for level, reqs in by.items() if reqs}
        return [(level, i, handles[level]) for level, i in where]

    def wait(self, handles: Sequence[Tuple[str, int, Any]]) -> Tuple[Any, ...]:
        for t in self._by_level.values():  # issue every level's deferred stages before blocking on one
            t.launch((), "flush")
        got: Dict[int, Tuple[Any, ...]] = {}
        for level, _, hs in handles:
            if id(hs) not in got:
                got[id(hs)] = self._by_level[level].wait(hs)
        return tuple(got[id(hs)][i] for _, i, hs in handles)

    def poll(self, handles) -> bool:
        return all(self._by_level[level].poll(hs) for level, _, hs in handles)

    @contextlib.contextmanager
    def batch(self):
        with contextlib.ExitStack() as stack:
            for t in self._by_level.values():
                stack.enter_context(t.batch())
            yield self

    # -- blocking collectives: the world's ------------------------------------------------------
    def allreduce_(self, t, name: str, average: bool = False):
        return self.world.allreduce_(t, name, average)

    def allgather(self, t, name: str):
        return self.world.allgather(t, name)

    def barrier(self) -> None:
        self.world.barrier()

    def allgather_object(self, obj, name: str):
        return self.world.allgather_object(obj, name)

    def broadcast_object(self, obj, name: str, root: int = 0):
        return self.world.broadcast_object(obj, name, root)


def two_level_transport(transport, topology: Topology):
    """``transport`` itself when ``topology`` is flat, else a ``TwoLevelTransport`` over it and the
    node and cross-node groups, made here (``dist_collectives.new_subgroups``: every rank makes
    every group, in the same order). Needs a torch.distributed transport (ValueError otherwise,
    raised by every rank before any collective)."""
    if topology.flat:
        return transport
    from .dist_collectives import TorchDistCommunicator, new_subgroups
    if not isinstance(transport, TorchDistCommunicator):
        raise ValueError(f"topology={topology}: a two-level exchange runs on torch.distributed (backend='torch', "
                         f"or the DDP hook); this transport is {type(transport).__name__}. Accepted here: "
                         "topology='flat' (or None)")
    if topology.world != transport.size():
        raise ValueError(f"topology={topology}: a layout of {topology.world} ranks, but the process group has "
                         f"{transport.size()}")
    groups = new_subgroups(topology.local_groups() + topology.cross_groups(), transport.group)
    rank = transport.rank()
    local = groups[topology.node_of(rank)]
    cross = groups[topology.nodes + topology.local_rank(rank)]
    return TwoLevelTransport(transport, TorchDistCommunicator(local), TorchDistCommunicator(cross), topology)
