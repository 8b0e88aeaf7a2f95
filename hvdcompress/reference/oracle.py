"""The oracle's side of the compressor contract: numpy exchanges and a simulated N-rank driver.

An oracle is written like a backend compressor (``torch_ops.compressors.base``): its ``exchange``
is a generator over ONE rank's flat tensor that yields rounds of requests and returns the dense
result. ``simulate`` runs one generator per simulated rank in lockstep and answers each round the
way Horovod does:

    Allreduce(t)   the sum over ranks, added in rank order in t's dtype: ((t_0 + t_1) + t_2) ...
    Allgather(t)   the concatenation along dim 0, in rank order (sizes may differ, even be 0)
    Alltoall(t, splits)   rank r receives, in rank order, the splits[r]-th piece of every rank

so any number of rounds (count sketch, PowerSGD) is simulated without code of its own. An oracle
class registers itself by naming the algorithm: ``class TopK(Oracle): name = "topk"``.

Numbers: a Gloo ring allreduce of 3 or more ranks may add in another order than rank order, so a
backend's summed result can differ from the oracle's in the last bit there (tests use a tolerance
for 3 ranks; 2 ranks are exact).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

import numpy as np

from ..spec import CompressionSpec, resolve


@dataclass(frozen=True)
class Allreduce:
    tensor: np.ndarray


@dataclass(frozen=True)
class Allgather:
    tensor: np.ndarray


@dataclass(frozen=True)
class Alltoall:
    tensor: np.ndarray
    splits: Tuple[int, ...]  # rows sent to each rank, in rank order


@dataclass(frozen=True)
class Member:
    """One tensor of a (possibly merged) exchange: name, original shape, offset in the flat buffer."""

    name: str
    shape: Tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class OracleContext:
    """What an oracle exchange may know besides the tensor (as the backends' ExchangeContext)."""

    key: str
    step: int
    world_size: int
    scale: float
    state: Dict[str, np.ndarray] = field(default_factory=dict)
    shape: Tuple[int, ...] = ()
    epoch: int = 0
    rank: int = 0
    members: Tuple[Member, ...] = ()


ORACLES: Dict[str, type] = {}


class Oracle(ABC):
    """Base of the numpy oracles; subclasses set ``name`` and define ``exchange``."""

    name: Optional[str] = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("name"):
            ORACLES[cls.name] = cls

    def __init__(self, spec: CompressionSpec):
        self.spec = spec

    @abstractmethod
    def exchange(self, x: np.ndarray, ctx: OracleContext) -> Generator:
        """One rank's exchange: yields rounds of requests, returns the dense result (module doc)."""


def oracle_for(spec) -> Oracle:
    spec = resolve(spec)
    if spec.name not in ORACLES:
        raise ValueError(f"reference: no numpy oracle for compressor {spec.name!r}")
    return ORACLES[spec.name](spec)


def _answer(requests_per_rank: List[Tuple[Any, ...]]) -> List[Tuple[np.ndarray, ...]]:
    world = len(requests_per_rank)
    kinds = [tuple(type(r).__name__ for r in reqs) for reqs in requests_per_rank]
    if len(set(kinds)) != 1:
        raise AssertionError(f"simulate: ranks yielded different rounds {kinds}: a real run would hang")
    answers: List[List[np.ndarray]] = [[] for _ in range(world)]
    for i, req in enumerate(requests_per_rank[0]):
        parts = [np.asarray(reqs[i].tensor) for reqs in requests_per_rank]
        if isinstance(req, Allreduce):
            total = parts[0].copy()
            for p in parts[1:]:
                total = (total + p).astype(parts[0].dtype)
            for r in range(world):
                answers[r].append(total.copy())
        elif isinstance(req, Allgather):
            cat = np.concatenate(parts, axis=0)
            for r in range(world):
                answers[r].append(cat.copy())
        elif isinstance(req, Alltoall):
            pieces = [np.split(p, np.cumsum(reqs[i].splits)[:-1]) for p, reqs in zip(parts, requests_per_rank)]
            for r in range(world):
                answers[r].append(np.concatenate([pieces[src][r] for src in range(world)], axis=0))
        else:
            raise TypeError(f"simulate: unknown request {req!r}")
    return [tuple(a) for a in answers]


def simulate(spec, grads: Sequence[np.ndarray], states: Optional[List[Dict[str, np.ndarray]]] = None,
             key: str = "", step: int = 0, scale: Optional[float] = None, shape: Optional[Tuple[int, ...]] = None,
             epoch: int = 0, members: Sequence[Member] = ()) -> Tuple[np.ndarray, List[Dict[str, np.ndarray]],
                                                                      List[List[Tuple[np.ndarray, ...]]]]:
    """One exchange of ``spec`` among len(grads) simulated ranks.

    ``states[r]`` is rank r's state dict (updated in place; made empty when not given). Returns
    (the result, which must be the same on every rank, the states, and per rank the list of the
    tensors it put on the wire in each round).
    """
    spec = resolve(spec)
    world = len(grads)
    scale = 1.0 / world if scale is None else scale
    states = states if states is not None else [{} for _ in range(world)]
    flat = [np.asarray(g).reshape(-1) for g in grads]
    shape = tuple(shape) if shape is not None else tuple(np.asarray(grads[0]).shape)
    members = tuple(members) or (Member(key, shape, 0),)
    gens = [oracle_for(spec).exchange(x, OracleContext(key, step, world, scale, st, shape, epoch, r, members))
            for r, (x, st) in enumerate(zip(flat, states))]
    sent: List[List[Tuple[np.ndarray, ...]]] = [[] for _ in range(world)]
    answers: Optional[List[Tuple[np.ndarray, ...]]] = None
    results: List[Optional[np.ndarray]] = [None] * world
    while True:
        requests, finished = [], 0
        for r, gen in enumerate(gens):
            try:
                reqs = next(gen) if answers is None else gen.send(answers[r])
            except StopIteration as stop:
                results[r] = stop.value
                finished += 1
                continue
            requests.append(tuple(reqs))
            sent[r].append(tuple(np.asarray(q.tensor) for q in reqs))
        if finished:
            if finished != world:
                raise AssertionError("simulate: some ranks finished while others yielded another round")
            break
        answers = _answer(requests)
    for r in range(1, world):
        if not np.array_equal(results[r], results[0], equal_nan=True):
            raise AssertionError(f"simulate: rank {r} ended with another result than rank 0")
    return results[0], states, sent
