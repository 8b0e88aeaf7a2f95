"""The contract every algorithm and every backend is written against, framework-neutral.

Defined once here and used by the numpy oracle (``hvdcompress.reference``), PyTorch
(``torch_ops``) and TensorFlow (``tf_ops``); it imports neither torch nor TensorFlow.

**Requests.** An exchange is a generator over one rank's flat tensor that yields rounds -- tuples
of requests -- and is sent back the tuple of their results; it returns the dense result::

    Allreduce(t)         the sum of every rank's t (torch: in place into t)
    Allgather(t)         every rank's t concatenated along dim 0, in rank order (sizes may
                         differ between ranks, even be 0); ``same_shape=True`` promises that
                         every rank gathers the same shape and dtype (a payload whose size
                         depends only on the tensor's), which lets a transport send it as a sum
    Alltoall(t, splits)  rank r receives, in rank order, the splits[r]-th piece of every rank
    Flag(t)              an Allreduce of a control value (the non-finite count): not payload,
                         so the byte counts leave it out
    Hop(level, r)        request r on one level of a two-level topology (the node's ranks or
                         the cross-node peers), for a transport of two levels

**Context.** ``ExchangeContext`` is what an exchange may know besides its tensor (one class for
every backend; fields a backend does not use stay at their defaults).

**Members.** ``Member`` is one tensor of a merged group (name, shape, offset in the flat buffer),
as DDP's ``GradBucket`` describes its parameters.

**Merge rules.** How a compressor's tensors may be merged into one exchange: ``ELEMENTWISE``,
``PER_MEMBER``, ``LAYERWISE`` (see their comments).

**Registries.** ``Registered`` is the base of every registry of implementations keyed by spec
name (oracles, torch and TF compressors): a subclass that sets ``name`` is entered into its
family's table. ``discover(package)`` imports every module of a package folder (a package calls
it on itself, ``discover(__name__)``), so a family module registers its algorithms by being there.

**Transport.** ``Transport`` is what carries the requests between ranks (Horovod, torch.distributed,
a test's world of one): every front end takes any object with its methods, as ``transport=``
(``transport_argument``: ``driver=``, its former name, is deprecated).

**Lockstep.** ``lockstep(gens, answer)`` drives one generator per simulated rank round by round;
the oracle's ``simulate`` and the tests' single-process worlds supply ``answer`` (how a round's
requests are summed or gathered in their framework).
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Generator, List, Optional, Protocol, Sequence, Tuple

# -- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allreduce:
    tensor: Any


@dataclass(frozen=True)
class Allgather:
    tensor: Any
    same_shape: bool = False  # every rank gathers this shape and dtype (see the module doc)


@dataclass(frozen=True)
class Flag(Allreduce):
    """A control value summed with a round (the non-finite count): a 4-byte allreduce that the
    wire statistics do not count as payload."""


@dataclass(frozen=True)
class Alltoall:
    tensor: Any
    splits: Tuple[int, ...]  # rows of ``tensor`` for each rank, in rank order


@dataclass(frozen=True)
class Hop:
    """A request on one level of a two-level topology (``hvdcompress.topology``): ``level`` is
    ``"local"`` (the ranks of this rank's node) or ``"cross"`` (the ranks at this rank's local
    position on every node); a transport of two levels sends ``request`` on that level's group.
    Untagged requests go to the whole world."""

    level: str
    request: Any

    @property
    def tensor(self) -> Any:
        return self.request.tensor


Request = Any  # Allreduce | Allgather | Alltoall | Flag | Hop
Exchange = Generator[Tuple[Request, ...], Tuple[Any, ...], Any]


def payload_requests(requests: Sequence[Request]) -> List[Request]:
    """The requests of a round that carry payload (every one but ``Flag``)."""
    return [r for r in requests if not isinstance(r.request if isinstance(r, Hop) else r, Flag)]


# -- transport --------------------------------------------------------------------------------------


class Transport(Protocol):
    """What carries an exchange's requests between the ranks of one set (a Horovod process set, a
    torch.distributed process group). Implementations are peers: none derives from another.

    who         ``rank()`` / ``size()`` in the set; ``included()``: this process is in the set (a
                rank outside exchanges nothing); ``process_set``: the set as its framework names
                it; ``versions()``: the transport's name and version (recorded with cost models)
    requests    ``launch(requests, name)`` starts one round (``Allreduce`` / ``Flag``,
                ``Allgather``, ``Alltoall``) and returns its handles; ``wait(handles)`` returns
                the results, in request order; ``poll(handles)``: complete, so waiting will not
                block (a transport that matches collectives by issue order answers False);
                ``name`` keys the collectives where the transport matches them by name
    batching    ``batch()``: a context whose launches may be fused into fewer collectives when
                it ends (a no-op where the transport fuses by itself)
    blocking    ``allreduce_(t, name, average)`` in place, ``allgather(t, name)``, ``barrier()``,
                ``allgather_object(obj, name)`` (every rank's, rank order),
                ``broadcast_object(obj, name, root)`` -- for planning, profiling and checkpoints

    A graph-mode transport (TensorFlow's ``tf_ops.collectives.Communicator``: a round is ops of a
    traced function, completed by its executor) implements all of it, its handles being the round's
    output tensors: ``launch`` builds the ops, ``wait`` returns their outputs, ``poll`` is True.
    """

    process_set: Any

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def included(self) -> bool: ...

    def versions(self) -> Dict[str, str]: ...

    def launch(self, requests: Sequence[Request], name: str) -> List[Any]: ...

    def wait(self, handles: Sequence[Any]) -> Tuple[Any, ...]: ...

    def poll(self, handles: Sequence[Any]) -> bool: ...

    def batch(self) -> ContextManager[Any]: ...

    def allreduce_(self, t: Any, name: str, average: bool = False) -> Any: ...

    def allgather(self, t: Any, name: str) -> Any: ...

    def barrier(self) -> None: ...

    def allgather_object(self, obj: Any, name: str) -> List[Any]: ...

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any: ...


def transport_argument(transport: Any, driver: Any, where: str) -> Any:
    """The transport a front end was given as ``transport=``; ``driver=``, its former name, still
    works for one release with a ``DeprecationWarning`` naming ``transport=``. Both given: a
    ValueError (before any collective)."""
    if driver is None:
        return transport
    if transport is not None:
        raise ValueError(f"{where}: transport= and driver= name the same argument (driver is its former "
                         "name); pass transport= only")
    warnings.warn(f"{where}: driver= is deprecated and will be removed in the next release; pass the same "
                  "object as transport=", DeprecationWarning, stacklevel=3)
    return driver


# -- members and context ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One tensor of a (possibly merged) exchange: name, original shape, offset in the flat buffer."""

    name: str
    shape: Tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass
class ExchangeContext:
    """What an exchange may know besides the tensor.

    key         the tensor's (or merged group's) name, identical on all ranks (seeds selections)
    step        how many exchanges of this state came before, identical on all ranks (TF: may be
                an int64 tensor)
    world_size  number of ranks taking part
    scale       factor for the summed result: 1/world_size for op=Average, 1 for Sum
    state       this key's persistent tensors (residual, momenta, ...), saved with the optimizer
                (TF: flat variables, see the compressor's ``state_slots``)
    shape       the tensor's original shape (x arrives flattened); a merged group's shape is
                ``hvdcompress.schedule.groups`` 's rule ((n,) when every member is 1-D, else (1, n))
    epoch       the training epoch (drives warm-up schedules)
    rank        this rank's index in the process set
    members     the tensors of the exchange (name, shape, offset into x): per-tensor rules
                (dense 1-D tensors, per-tensor scales, matrix shapes) apply to each member. One
                member at offset 0 when not merged.
    density     TF: the fraction a ratio-based sparsifier sends this step (a float or a float64
                tensor the warm-up callback moves); None: the spec's value for ``epoch``
    out         PyTorch: None, or a buffer the size and dtype of x that the exchange may build its
                result in (and return) once it no longer reads x -- the caller would copy the
                result there anyway. Only an optimisation: returning a new tensor is fine.
    """

    key: str
    step: Any
    world_size: int
    scale: float
    state: Dict[str, Any] = field(default_factory=dict)
    shape: Tuple[int, ...] = ()
    epoch: int = 0
    rank: int = 0
    members: Tuple[Member, ...] = ()
    density: Any = None
    out: Any = None

    def member_list(self, numel: Optional[int] = None) -> Tuple[Member, ...]:
        """The members, or the one implied by ``key`` and ``shape`` (``numel`` when shape is unset)."""
        if self.members:
            return tuple(self.members)
        shape = tuple(self.shape) or ((int(numel),) if numel is not None else ())
        return (Member(self.key, shape, 0),)

    def member_views(self, x: Any, reshape: Optional[Callable[[Any, Tuple[int, ...]], Any]] = None) -> list:
        """(member, its slice of the flat ``x`` in the member's shape) for every member;
        ``reshape(t, shape)`` defaults to ``t.reshape(shape)`` (numpy, torch: a view)."""
        reshape = reshape or (lambda t, shape: t.reshape(shape))
        members = self.members or (Member(self.key, tuple(self.shape) or tuple(x.shape), 0),)
        return [(m, reshape(x[m.offset:m.offset + m.numel], m.shape)) for m in members]


# -- merge rules ------------------------------------------------------------------------------------

ELEMENTWISE = "elementwise"  # every state tensor has one entry per element; merging tensors does
#                              not change their results (a flat buffer is exchanged)
PER_MEMBER = "per-member"    # merged groups are fine: the compressor applies its per-tensor rules
#                              to each member of the group (``ExchangeContext.members``)
LAYERWISE = "layerwise"      # one exchange per tensor only (state shaped by the tensor, e.g.
#                              low-rank factors): "auto" resolves to "layerwise"
MERGE_POLICIES = (ELEMENTWISE, PER_MEMBER, LAYERWISE)


# -- registries -------------------------------------------------------------------------------------


class Registered:
    """Base of a family of implementations keyed by spec name.

    The family's root class sets ``registry`` (a dict) and, optionally, ``_check_name`` (called
    with the name before it is entered, e.g. to require that the algorithm is declared). A
    subclass that sets ``name`` in its own body is entered as ``registry[name]``.
    """

    name: Optional[str] = None
    registry: Dict[str, type] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        name = cls.__dict__.get("name")
        if name:
            cls._check_name(name)
            cls.registry[name] = cls

    @classmethod
    def _check_name(cls, name: str) -> None:
        """Hook: raise if ``name`` may not be registered."""


_DISCOVERED: set = set()


def discover(package: str) -> None:
    """Import every module of ``package`` 's folder (once), so that the algorithm families there
    register themselves: adding an algorithm is adding its module, nothing else."""
    if package in _DISCOVERED:
        return
    _DISCOVERED.add(package)
    pkg = importlib.import_module(package)
    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{package}.{mod.name}")


# -- lockstep ---------------------------------------------------------------------------------------

Answer = Callable[[List[Tuple[Request, ...]]], List[Tuple[Any, ...]]]


def check_round(requests_per_rank: List[Tuple[Request, ...]]) -> None:
    """Every rank must yield the same kinds of requests in a round, or a real run would hang."""
    kinds = [tuple(type(r).__name__ for r in reqs) for reqs in requests_per_rank]
    if len(set(kinds)) != 1:
        raise AssertionError(f"ranks yielded different rounds {kinds}: a real run would hang")


def lockstep(gens: Sequence[Exchange], answer: Answer,
             on_round: Optional[Callable[[int, Tuple[Request, ...]], None]] = None) -> List[Any]:
    """Drive one exchange generator per simulated rank in lockstep; returns each rank's result.

    ``answer(requests_per_rank)`` returns each rank's tuple of results for one round;
    ``on_round(rank, requests)`` sees every rank's requests (to count bytes or keep payloads).
    Raises AssertionError if the ranks disagree on the number of rounds or on a round's requests.
    """
    world = len(gens)
    results: List[Any] = [None] * world
    inbox: Optional[List[Tuple[Any, ...]]] = None
    while True:
        requests, finished = [], 0
        for r, gen in enumerate(gens):
            try:
                reqs = next(gen) if inbox is None else gen.send(inbox[r])
            except StopIteration as stop:
                results[r] = stop.value
                finished += 1
                continue
            requests.append(tuple(reqs))
            if on_round is not None:
                on_round(r, tuple(reqs))
        if finished:
            if finished != world:
                raise AssertionError("some ranks finished while others yielded another round")
            return results
        check_round(requests)
        inbox = answer(requests)
