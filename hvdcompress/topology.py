"""Where the ranks sit: nodes of ``local_size`` ranks joined by slower links than the ranks inside a node.

A two-level exchange (reduce inside a node over its fast links, compress across nodes, gather back
inside) and a sharded model's hybrid layout (shard inside a node, replicate across nodes) both need
the same few facts, and they are the same for every framework and launcher, so they live here as
plain data: which node a rank is on, which ranks share its node, which ranks share its position on
the other nodes, and how a flat tensor splits into one contiguous slice per local rank.

Launchers number ranks node by node (``horovodrun -H a:4,b:4`` and ``torchrun --nproc_per_node 4``
give node ``n`` the ranks ``n*L .. n*L+L-1``), which is the layout assumed here: a rank's node is
``rank // local_size``. Every node holds the same number of ranks.

    topo = Topology(world=8, local_size=4)      # 2 nodes of 4
    topo.local_group(5)   -> (4, 5, 6, 7)       # ranks on rank 5's node
    topo.cross_group(5)   -> (1, 5)             # rank 5's peers on the other nodes
    slices(10, 4)         -> ((0, 3), (3, 6), (6, 8), (8, 10))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple


ENV_KEYS = ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class Topology:
    """``world`` ranks on ``world // local_size`` nodes of ``local_size`` ranks each."""

    world: int
    local_size: int

    def __post_init__(self):
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"topology: world must be an integer >= 1, got {self.world!r}")
        if not isinstance(self.local_size, int) or not 1 <= self.local_size <= self.world:
            raise ValueError(f"topology: local_size must be an integer in [1, world={self.world}], "
                             f"got {self.local_size!r}")
        if self.world % self.local_size:
            raise ValueError(f"topology: world={self.world} is not a whole number of nodes of "
                             f"local_size={self.local_size} ranks (every node must hold the same number)")

    @property
    def nodes(self) -> int:
        return self.world // self.local_size

    @property
    def flat(self) -> bool:
        """True when there is only one level: one node, or one rank per node."""
        return self.nodes == 1 or self.local_size == 1

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise ValueError(f"topology: rank must be in [0, {self.world - 1}], got {rank!r}")
        return rank

    def node_of(self, rank: int) -> int:
        return self._check(rank) // self.local_size

    def local_rank(self, rank: int) -> int:
        return self._check(rank) % self.local_size

    def local_group(self, rank: int) -> Tuple[int, ...]:
        """The ranks on ``rank``'s node, in rank order (``rank`` included)."""
        first = self.node_of(rank) * self.local_size
        return tuple(range(first, first + self.local_size))

    def cross_group(self, rank: int) -> Tuple[int, ...]:
        """The ranks at ``rank``'s local position on every node, in node order (``rank`` included)."""
        return tuple(range(self.local_rank(rank), self.world, self.local_size))

    def local_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Every node's ranks, node by node (the groups a transport creates once, on every rank)."""
        return tuple(self.local_group(n * self.local_size) for n in range(self.nodes))

    def cross_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Every local position's ranks across the nodes, position by position."""
        return tuple(self.cross_group(r) for r in range(self.local_size))

    def __str__(self) -> str:
        return f"{self.nodes}x{self.local_size}"


def parse_topology(text: str, world: int) -> Topology:
    """``"NxL"`` (N nodes of L ranks) or ``"L"`` (ranks per node) for a world of ``world`` ranks."""
    raw = str(text).strip().lower()
    try:
        if "x" in raw:
            nodes, local = (int(p) for p in raw.split("x"))
            if nodes * local != world:
                raise ValueError(f"topology={text!r}: {nodes} nodes x {local} ranks is {nodes * local} ranks, "
                                 f"but the world has {world}")
            return Topology(world, local)
        return Topology(world, int(raw))
    except ValueError as e:
        if str(e).startswith("topology"):
            raise
        raise ValueError(f"topology={text!r}: expected 'NxL' (nodes x ranks per node) or 'L' (ranks per node), "
                         f"e.g. '2x4' or '4'") from None


def topology_from_env(world: int, env: Optional[Mapping[str, str]] = None) -> Topology:
    """The topology the launcher states (torchrun's ``LOCAL_WORLD_SIZE``, Horovod's
    ``HOROVOD_LOCAL_SIZE``, Open MPI's local size); flat (one node) when none is set."""
    import os
    env = os.environ if env is None else env
    for key in ENV_KEYS:
        if env.get(key):
            try:
                local = int(env[key])
            except ValueError:
                raise ValueError(f"topology: {key}={env[key]!r} is not an integer") from None
            return Topology(world, local)
    return Topology(world, world)


def slices(numel: int, parts: int) -> Tuple[Tuple[int, int], ...]:
    """``parts`` contiguous ``(start, stop)`` slices covering ``range(numel)``, sizes differing by at
    most one (the first ``numel % parts`` one longer): one per local rank in a reduce-scatter."""
    if parts < 1:
        raise ValueError(f"slices: parts must be >= 1, got {parts!r}")
    if numel < 0:
        raise ValueError(f"slices: numel must be >= 0, got {numel!r}")
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


FLAT = "flat"
FORMS = "None (the launcher's: LOCAL_WORLD_SIZE / HOROVOD_LOCAL_SIZE), 'flat', 'NxL' (N nodes of L ranks), " \
        "'L' (ranks per node) or a Topology"


def resolve_topology(topology, world: int, env: Optional[Mapping[str, str]] = None) -> Topology:
    """A front end's ``topology=`` argument for a world of ``world`` ranks -> a ``Topology`` (flat
    when ``.flat``). None: the launcher's (``topology_from_env``), flat when the launcher's numbers do
    not make whole nodes of this world (a process group smaller than the job, say); ``"flat"``: one
    level; ``"NxL"`` / ``"L"``: explicit; a ``Topology`` of this world. ValueError naming
    ``topology`` and the accepted forms otherwise (a pure function of its arguments: every rank
    raises the same error before any collective)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"topology: world must be an integer >= 1, got {world!r}")
    if topology is None:
        try:
            return topology_from_env(world, env)
        except ValueError:
            return Topology(world, world)
    if isinstance(topology, Topology):
        if topology.world != world:
            raise ValueError(f"topology={topology}: a layout of {topology.world} ranks, but the world has {world}; "
                             f"accepted: {FORMS}")
        return topology
    if isinstance(topology, str) and not isinstance(topology, bool):
        if topology.strip().lower() == FLAT:
            return Topology(world, world)
        try:
            return parse_topology(topology, world)
        except ValueError as e:
            raise ValueError(f"{e}; accepted: {FORMS}") from None
    raise ValueError(f"topology={topology!r}: accepted: {FORMS}")


# -- the launcher's layout as Horovod's process sets (pure: environment reads only) ---------------
# A two-level exchange on Horovod runs on process sets (a node's ranks, the ranks at one local
# position of every node), registered at ``hvd.init(process_sets=[...])`` or added later when
# Horovod allows it. Each backend's ``init`` registers ``launcher_groups()``; these answers are the
# same for every framework.
DYNAMIC_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"


def dynamic_process_sets() -> bool:
    """Whether Horovod lets process sets be added after ``hvd.init`` (``HOROVOD_DYNAMIC_PROCESS_SETS``
    a positive integer, as Horovod reads it; ``hvd.init(process_sets="dynamic")`` sets it)."""
    import os
    try:
        return int(os.environ.get(DYNAMIC_ENV, "0").strip() or 0) > 0
    except ValueError:
        return False


def launcher_homogeneous(env=None) -> bool:
    """Whether the launcher's layout has the same number of ranks on every node, as far as this
    rank can tell: horovodrun's ``HOROVOD_LOCAL_SIZE`` x ``HOROVOD_CROSS_SIZE`` (the nodes holding
    this local rank) is ``HOROVOD_SIZE`` (``-H a:4,b:2`` fails it on every rank), or it does not say.
    A two-level default needs it: ranks that read different local sizes would make different sets."""
    import os
    env = os.environ if env is None else env
    try:
        local, cross, size = (int(env[k]) for k in ("HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_SIZE", "HOROVOD_SIZE"))
    except (KeyError, ValueError):
        return True
    return local * cross == size


def launcher_groups(env=None) -> List[Tuple[int, ...]]:
    """The node and cross-node groups of the launcher's topology (``HOROVOD_SIZE`` or Open MPI's
    world size, and ``HOROVOD_LOCAL_SIZE``, as horovodrun sets them;
    ``hvdcompress.topology.resolve_topology``), nodes first; none when it is flat, not the same on
    every node (``launcher_homogeneous``) or the launcher does not say. Pure."""
    import os
    env = os.environ if env is None else env
    try:
        world = int(env.get("HOROVOD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or "")
    except ValueError:
        return []
    if world < 1 or not launcher_homogeneous(env):
        return []
    topo = resolve_topology(None, world, env)
    return [] if topo.flat else list(topo.local_groups() + topo.cross_groups())


# -- a two-level transport's levels ----------------------------------------------------------------
LOCAL, CROSS, WORLD = "local", "cross", "world"
LEVELS = (WORLD, LOCAL, CROSS)


class LevelTransports:
    """What a two-level ``Transport`` is on every backend (``torch_ops.twolevel``,
    ``tf_ops.twolevel``): three transports, the world's (``world``: untagged requests, every
    blocking and object collective; ``rank`` / ``size`` are its), the node's (``local``) and the
    cross-node peers' (``cross``) for ``Hop`` requests, by level in ``by_level``. A backend adds
    the exchange around a spec's (``compose``) and how requests are sent to their level."""

    def __init__(self, world, local, cross, topology: Topology):
        self.world, self.local, self.cross = world, local, cross
        self.topology = topology
        self.process_set = world.process_set
        self.by_level = {WORLD: world, LOCAL: local, CROSS: cross}

    # -- who ------------------------------------------------------------------------------------
    def rank(self) -> int:
        return self.world.rank()

    def size(self) -> int:
        return self.world.size()

    def included(self) -> bool:
        return self.world.included()

    def versions(self) -> Dict[str, str]:
        return dict(self.world.versions(), topology=str(self.topology))

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


class HorovodProcessSets:
    """The Horovod process sets hvdcompress registered in one framework's Horovod, by their ranks
    (global, sorted): the sets a two-level exchange runs on. Horovod has no public lookup of a set
    by its ranks, so the sets made here are kept here; each framework's Horovod library
    (``horovod.torch``, ``horovod.tensorflow``) keeps its own sets, so each backend holds one of
    these (``torch_ops.collectives``, ``tf_ops.collectives``), made with a function returning that
    library's module (imported when first needed) and the name of the ``init`` a user calls there."""

    def __init__(self, horovod: Callable[[], Any], front: str):
        self._hvd, self.front = horovod, front
        self.sets: Dict[Tuple[int, ...], Any] = {}

    def can_make(self, groups: Sequence[Sequence[int]]) -> bool:
        """Whether ``get(groups)`` can give every set: each was registered here already, or Horovod
        adds sets after its init. A pure local check: no collective."""
        return all(tuple(sorted(g)) in self.sets for g in groups) or dynamic_process_sets()

    def get(self, groups: Sequence[Sequence[int]]) -> List[Any]:
        """One Horovod process set per group of global ranks, in order: the one registered here if
        there is one (``init`` made it, or an earlier call), else ``hvd.add_process_set`` (every rank
        must call this with the same groups in the same order: Horovod registers a set on all
        ranks). ValueError when a set is missing and Horovod was not initialized for dynamic sets."""
        out = []
        for g in groups:
            ranks = tuple(sorted(int(r) for r in g))
            if ranks not in self.sets:
                if not dynamic_process_sets():
                    raise ValueError(f"process set {list(ranks)}: not registered, and Horovod adds sets only with "
                                     f"{DYNAMIC_ENV}=1 ({self.front}.init() registers the launcher's node sets; "
                                     "hvd.init(process_sets='dynamic') lets any topology be made)")
                self.sets[ranks] = self._hvd().add_process_set(list(ranks))
            out.append(self.sets[ranks])
        return out

    def init(self, comm=None, process_sets=None, elastic: bool = False):
        """``hvd.init(comm, process_sets)``, registering beside the given sets the node and
        cross-node sets of the launcher's topology (``launcher_groups``: several nodes of several
        ranks), so that a two-level exchange on the launcher's topology needs no other call. With
        ``process_sets="dynamic"`` Horovod adds sets later, so none is added here. The sets are
        registered on the whole job only (``comm`` None), and not under Horovod Elastic
        (``elastic``: its world changes size)."""
        hvd = self._hvd()
        if isinstance(process_sets, str):
            return hvd.init(comm, process_sets=process_sets)
        given = list(process_sets or [])
        have = {tuple(ps.ranks) for ps in given if ps.ranks is not None} | set(self.sets)
        groups = launcher_groups() if comm is None and not hvd.is_initialized() and not elastic else []
        extra = [hvd.ProcessSet(list(g)) for g in groups if tuple(g) not in have]
        result = hvd.init(comm, process_sets=given + extra)
        for ps in given + extra:
            if ps.ranks is not None and ps.process_set_id is not None:
                self.sets.setdefault(tuple(ps.ranks), ps)
        return result
