"""Two-level exchanges on TensorFlow: dense inside a node, the spec's exchange across nodes.

The same three steps as ``torch_ops.twolevel`` (docs/two-level.md), on Horovod's TF collectives
over process sets, for a ``hvdcompress.topology.Topology`` of N nodes of L ranks:

1. a dense reduce-scatter inside the node: the flat x is cut into L parts
   (``schedule.groups.split_layout``), every rank sends part j to local rank j (one ``Alltoall`` on
   the node's set) and sums the L pieces it receives in local rank order, so local rank l holds its
   node's sum of part l;
2. the spec's own exchange generator, unchanged, on that part, over the ranks at local position l
   of every node (the cross set: ``world_size`` N, ``rank`` the node), with the flat exchange's
   ``scale``;
3. an allgather of the exchanged parts inside the node: the result on every rank.

``hvdcompress.reference.twolevel`` is the numpy oracle of these steps and says what the cross
exchange's state means: the state of (local rank l, part l), on that rank only, kept in the flat
layout (an entry as large as the whole tensor holds the part at its place, zeros elsewhere; any
other entry, PowerSGD's ``q``, as it is), so the slot variables, checkpoints and merged groups keep
their shapes. The cross exchange works on part-sized variables (``part_state``) copied from the
whole slot before it and written back after it (``store_state``), as a merged group's working
state is joined and split (``tf_ops.slots``).

**Why every rank's collectives match without the per-round flag of the PyTorch side.** A node's L
cross exchanges work on different parts, so they may run different numbers of rounds (an empty
part; a part under a compressor's dense rule, as a PowerSGD block too thin to factor). PyTorch's
torch.distributed matches collectives by issue order, so there every round carries a flag and a
node's ranks run until none has a request left. Horovod matches TF collectives by *name*, within
each process set, and a traced graph fixes every rank's collectives when it is traced (a graph
cannot loop on a flag read each round), so the design here is names that are equal wherever the
ranks must meet, whatever the rounds:

* the cross rounds of part l run on the cross set of local position l only; every member of that
  set holds a part of the same shape, traces the same generator with the same static shapes and
  so the same rounds, named ``<exchange>.r<round>.cross.<i>``. What a data-dependent exchange
  decides at run time (top-k's or threshold's selection, global top-k's merges) changes payload
  sizes and values, never the rounds of a traced graph (its rounds are Python, fixed when traced:
  ``tf_ops.compressors.base``), and Horovod's allgather and alltoall take sizes that differ per
  rank;
* the node's two collectives (the all-to-all and the allgather) are named by what they are,
  ``<exchange>.scatter.local`` and ``<exchange>.gather.local`` (``Tagged`` requests), not by their
  round, so local ranks whose cross exchanges took different numbers of rounds still name the
  gather alike;
* the non-finite guard's flag stays on the whole job in the first round, as flat.

No collective waits for another of the same rank in issue order: each runs when its inputs are
ready (TensorFlow's executor, Horovod's background thread), so no extra round is paid.

A group whose compressor needs state the flat layout cannot hold for some part (a part-sized
entry that is neither a slice of a whole-sized slot nor a slot of the same size) goes flat, the
same decision on every rank (it looks at every part), logged once (``fits``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from hvdcompress.contract import Allgather, Alltoall, ExchangeContext, Hop, payload_requests
from hvdcompress.schedule.groups import Part, process_set_size, split_layout
from hvdcompress.topology import (CROSS, FORMS, LEVELS, LOCAL, WORLD, LevelTransports, Topology,
                                  launcher_homogeneous, resolve_topology)

from .collectives import Communicator, can_make_process_sets, process_sets, request_bytes
from .variables import state_variable

_ROUND = re.compile(r"\.r\d+$")
_LOG = logging.getLogger("hvdcompress")


@dataclass(frozen=True)
class Tagged(Hop):
    """A ``Hop`` named by ``tag`` instead of its round: ``<exchange>.<tag>.<level>`` (module doc)."""

    tag: str = ""


def check_topology(topology, process_set=None, transport=None) -> Topology:
    """The ``topology=`` argument of a TF front end -> a ``Topology`` (flat: one level), with the
    rules of the PyTorch Horovod optimizer (``torch_ops.arguments.check_topology``): None takes
    the launcher's (``HOROVOD_LOCAL_SIZE``) where a two-level exchange can run (Horovod's transport
    on the whole job, not under Elastic, the same layout on every node, the node and cross-node
    process sets at hand: registered by ``hvdcompress.tensorflow.init`` or addable), else flat; an
    explicit one must be runnable. ``transport``: the one given to ``GradientCompression`` (None:
    Horovod's). ValueError naming ``topology`` and the accepted forms, raised by every rank alike
    before any collective."""
    import os
    if transport is not None:
        if topology is None:  # the launcher's layout, on a transport without two levels: flat
            return Topology(1, 1)
        topo = resolve_topology(topology, int(transport.size()))
        if topo.flat:
            return topo
        raise ValueError(f"topology={topology!r}: a two-level exchange runs on Horovod's transport, not on "
                         f"{type(transport).__name__}; accepted here: topology='flat' or None. Forms: {FORMS}")
    try:
        import horovod.tensorflow as hvd
        initialized = hvd.is_initialized()
    except ImportError:
        initialized = False
    if not initialized:
        if topology is None or (isinstance(topology, str) and topology.strip().lower() == "flat"):
            return Topology(1, 1)
        raise ValueError(f"topology={topology!r}: Horovod is not initialized (call hvdcompress.tensorflow.init() "
                         "first); accepted without it: topology='flat' or None")
    process_set = hvd.global_process_set if process_set is None else process_set
    world, job = process_set_size(process_set), hvd.size()
    elastic = os.environ.get("HOROVOD_ELASTIC", "0") == "1"
    if topology is None and (not process_set.included() or world != job or elastic or not launcher_homogeneous()):
        return Topology(world, world)
    topo = resolve_topology(topology, world)
    if topo.flat:
        return topo
    if elastic:
        raise ValueError(f"topology={topology!r}: a two-level exchange does not run under Horovod Elastic (the "
                         "world changes size, its process sets would not follow); accepted here: topology='flat' "
                         f"or None. Forms: {FORMS}")
    if world == job and can_make_process_sets(topo.local_groups() + topo.cross_groups()):
        return topo
    if topology is None:
        return Topology(world, world)
    why = (f"on Horovod it runs on the whole job (process_set of {world} of {job} ranks here)" if world != job else
           "on Horovod it needs the node and cross-node process sets: call hvdcompress.tensorflow.init() (or "
           "hvdcompress.keras.init()) instead of hvd.init() (it registers the launcher's), or "
           "hvd.init(process_sets='dynamic') / HOROVOD_DYNAMIC_PROCESS_SETS=1 (any topology)")
    raise ValueError(f"topology={topology!r}: a two-level exchange {why}; accepted here: topology='flat' or None. "
                     f"Forms: {FORMS}")


def check_topology_form(topology) -> None:
    """A ``topology=`` argument's type, checked where the world is not known yet (the full check,
    ``check_topology``, runs when the front end knows its process set)."""
    if topology is not None and not isinstance(topology, (str, Topology)):
        raise ValueError(f"topology={topology!r}: accepted: {FORMS}")


def fits(compressor, state: Dict[str, tf.Variable], parts: Sequence[Part], numel: int,
         codec: Optional[str]) -> Optional[str]:
    """None when the flat-layout ``state`` can hold the cross exchange's state of every part, else
    why not. Pure (static sizes only), so every rank decides alike. A codec (fp16 / dense fallback)
    uses the elementwise entries only, which always fit."""
    if codec is not None:
        return None
    for part in parts:
        if not part.numel or part.numel == numel:
            continue
        for name in compressor.state_slots(part.shape):
            need = compressor.slot_numel(name, part.shape)
            var = state.get(name)
            have = None if var is None else var.shape.num_elements()
            if have is None:
                return f"its state '{name}' of a part of shape {part.shape} has no slot of the whole tensor"
            if not ((have == numel and need == part.numel) or (have != numel and need == have)):
                return (f"its state '{name}' holds {need} entries for a part of shape {part.shape}, neither a slice "
                        f"of the whole tensor's {numel} nor the slot's own {have}")
    return None


def node_sum(pieces: tf.Tensor, L: int, numel: int) -> tf.Tensor:
    """The ``L`` pieces an all-to-all brought (one per local rank) summed in local rank order, as the
    oracle adds."""
    pieces = tf.reshape(pieces, [L, numel])
    mine = pieces[0]
    for i in range(1, L):
        mine = mine + pieces[i]
    return mine


class TwoLevelTransport(LevelTransports):
    """The TensorFlow ``Transport`` over three Horovod ``Communicator``s
    (``hvdcompress.topology.LevelTransports``: the world's, the node's and the cross-node peers').
    ``compose`` makes the two-level
    exchange around a spec's exchange (``tf_ops.session.ExchangeSession.start`` calls it);
    ``take_hop_bytes`` gives the payload bytes handed to each hop since the last call (tensors of
    the trace that built them)."""

    def __init__(self, world, local, cross, topology: Topology, compressor):
        super().__init__(world, local, cross, topology)
        self.compressor = compressor
        self._hop_bytes: Dict[str, List[tf.Tensor]] = {LOCAL: [], CROSS: []}
        self._parts: Dict[Tuple, tf.Variable] = {}  # part-sized working state (not checkpointed)
        self._flat: Dict[str, str] = {}  # group key -> why it goes flat (logged once)

    # -- the exchange ---------------------------------------------------------------------------
    def compose(self, make, x: tf.Tensor, ctx: ExchangeContext, codec: Optional[str] = None):
        """The exchange around ``make(x, ctx)`` (the spec's exchange, or a codec's) on this rank:
        two-level, or ``make(x, ctx)`` on the world where the group's state cannot be laid out
        per part (``fits``; logged once per group)."""
        numel = int(x.shape.num_elements())
        parts = split_layout(numel, tuple(ctx.shape), ctx.member_list(numel), self.topology.local_size)
        why = fits(self.compressor, ctx.state, parts, numel, codec)
        if why is not None:
            if ctx.key not in self._flat:
                self._flat[ctx.key] = why
                _LOG.warning("hvdcompress: group %s goes flat, not two-level (topology %s): %s", ctx.key,
                             self.topology, why)
            return make(x, ctx)
        return self._two_level(make, x, ctx, parts, numel)

    def _two_level(self, make, x, ctx, parts: Sequence[Part], numel: int):
        topo, rank = self.topology, self.rank()
        L = topo.local_size
        part = parts[topo.local_rank(rank)]
        flat = tf.reshape(x, [-1])
        (got,) = yield (Tagged(LOCAL, Alltoall(flat, tuple(p.numel for p in parts)), "scatter"),)
        result = mine = node_sum(got, L, part.numel)
        if part.numel:
            view = self._part_state(ctx, part, numel)
            inner = ExchangeContext(ctx.key, ctx.step, topo.nodes, ctx.scale, view, part.shape, ctx.epoch,
                                    topo.node_of(rank), part.members, density=ctx.density)
            result = yield from _across(make(mine, inner))
            store_state(ctx.state, view, part)
        (whole,) = yield (Tagged(LOCAL, Allgather(tf.reshape(result, [-1])), "gather"),)
        return tf.reshape(whole, [numel])

    def _part_state(self, ctx: ExchangeContext, part: Part, numel: int) -> Dict[str, Any]:
        """The cross exchange's state (``part_state``), its part-sized variables made once per
        (group, entry, part)."""
        def variable(name, var):
            key = (ctx.key, name, part.start, part.numel, var.dtype.name)
            if key not in self._parts:
                self._parts[key] = state_variable(lambda: tf.zeros([part.numel], var.dtype), trainable=False,
                                                  name=f"part_{name}")
            return self._parts[key]
        return part_state(ctx.state, part, numel, variable)

    def take_hop_bytes(self) -> Dict[str, tf.Tensor]:
        """Payload bytes handed to each hop since the last call (int64 tensors)."""
        out = {level: (tf.add_n(ts) if ts else tf.constant(0, tf.int64)) for level, ts in self._hop_bytes.items()}
        self._hop_bytes = {LOCAL: [], CROSS: []}
        return out

    # -- requests -------------------------------------------------------------------------------
    def run(self, requests: Sequence[Any], name: str) -> Tuple[tf.Tensor, ...]:
        return self.wait(self.launch(requests, name))

    def launch(self, requests: Sequence[Any], name: str) -> List[tf.Tensor]:
        """Each level's requests built on its communicator, named ``<name>.<level>.<i>``; a ``Tagged``
        one ``<exchange>.<tag>.<level>`` (``name`` without its round). Outputs in request order."""
        by: Dict[str, List[Any]] = {level: [] for level in LEVELS}
        where: List[Tuple[str, int]] = []
        tagged: Dict[int, tf.Tensor] = {}
        for j, req in enumerate(requests):
            level = req.level if isinstance(req, Hop) else WORLD
            inner = req.request if isinstance(req, Hop) else req
            if level not in self.by_level:
                raise ValueError(f"Hop: level must be one of {LEVELS[1:]}; got {level!r}")
            if level in self._hop_bytes and payload_requests((inner,)):
                self._hop_bytes[level].append(request_bytes((inner,)))
            if isinstance(req, Tagged):
                (tagged[j],) = self.by_level[level].launch((inner,), f"{_ROUND.sub('', name)}.{req.tag}.{level}")
                where.append((level, -1))
                continue
            where.append((level, len(by[level])))
            by[level].append(inner)
        built = {level: self.by_level[level].launch(reqs, f"{name}.{level}") for level, reqs in by.items() if reqs}
        return [tagged[j] if i < 0 else built[level][i] for j, (level, i) in enumerate(where)]

    def wait(self, handles: Sequence[tf.Tensor]) -> Tuple[tf.Tensor, ...]:
        return tuple(handles)

    def poll(self, handles) -> bool:
        return True

    def batch(self):
        return self.world.batch()



def _across(gen):
    """``gen``'s rounds sent on the cross set (each request a ``Hop(CROSS, ...)``); its result."""
    try:
        requests = next(gen)
    except StopIteration as stop:
        return stop.value
    while True:
        got = yield tuple(Hop(CROSS, r) for r in requests)
        try:
            requests = gen.send(tuple(got))
        except StopIteration as stop:
            return stop.value


def part_state(state: Dict[str, tf.Variable], part: Part, numel: int, variable) -> Dict[str, Any]:
    """The cross exchange's state: an entry as large as the whole tensor as a part-sized variable
    (``variable(name, whole)``) holding the whole's slice now; any other entry as it is."""
    view = {}
    for name, var in state.items():
        if var.shape.num_elements() == numel and part.numel != numel:
            mine = variable(name, var)
            mine.assign(var[part.start:part.stop])
            view[name] = mine
        else:
            view[name] = var
    return view


def store_state(state: Dict[str, tf.Variable], view: Dict[str, Any], part: Part) -> None:
    """The part-sized variables of ``part_state`` written back to their place in the whole slots."""
    for name, mine in view.items():
        whole = state[name]
        if mine is not whole:
            whole[part.start:part.stop].assign(mine.read_value())


def two_level_transport(process_set, topology: Topology, compressor) -> TwoLevelTransport:
    """A ``TwoLevelTransport`` on ``process_set`` (the whole job) for a two-level ``topology``: the
    node and cross-node Horovod process sets (``collectives.process_sets``: the ones
    ``hvdcompress.tensorflow.init`` registered, or added now where Horovod allows it; every rank
    makes them in the same order)."""
    world = Communicator(process_set)
    rank = world.rank()
    sets = process_sets(topology.local_groups() + topology.cross_groups())
    local, cross = sets[topology.node_of(rank)], sets[topology.nodes + topology.local_rank(rank)]
    return TwoLevelTransport(world, Communicator(local), Communicator(cross), topology, compressor)


__all__ = ["TwoLevelTransport", "check_topology", "two_level_transport"]
