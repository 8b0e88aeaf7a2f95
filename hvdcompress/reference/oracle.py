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

from abc import abstractmethod
from typing import Dict, Generator, List, Optional, Sequence, Tuple

import numpy as np

from ..contract import Allgather, Allreduce, Alltoall, ExchangeContext, Flag, Member, Registered, lockstep
from ..spec import CompressionSpec, resolve

ORACLES: Dict[str, type] = {}


class Oracle(Registered):
    """Base of the numpy oracles; subclasses set ``name`` and define ``exchange``."""

    registry = ORACLES

    def __init__(self, spec: CompressionSpec):
        self.spec = spec

    @abstractmethod
    def exchange(self, x: np.ndarray, ctx: ExchangeContext) -> Generator:
        """One rank's exchange: yields rounds of requests, returns the dense result (module doc)."""


def oracle_for(spec) -> Oracle:
    spec = resolve(spec)
    if spec.name not in ORACLES:
        raise ValueError(f"reference: no numpy oracle for compressor {spec.name!r}")
    return ORACLES[spec.name](spec)


def answer_round(requests_per_rank: List[Tuple[object, ...]]) -> List[Tuple[np.ndarray, ...]]:
    """Each rank's results for one round, as the collectives define them (module doc)."""
    world = len(requests_per_rank)
    answers: List[List[np.ndarray]] = [[] for _ in range(world)]
    for i, req in enumerate(requests_per_rank[0]):
        parts = [np.asarray(reqs[i].tensor) for reqs in requests_per_rank]
        if isinstance(req, (Allreduce, Flag)):
            total = parts[0].copy()
            for p in parts[1:]:
                total = (total + p).astype(parts[0].dtype)
            for r in range(world):
                answers[r].append(total.copy())
        elif isinstance(req, Allgather):
            if req.same_shape and any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
                raise ValueError("Allgather(same_shape=True): the ranks gathered "
                                 f"{[(p.shape, str(p.dtype)) for p in parts]}")
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
    gens = [oracle_for(spec).exchange(x, ExchangeContext(key, step, world, scale, st, shape, epoch, r, members))
            for r, (x, st) in enumerate(zip(flat, states))]
    sent: List[List[Tuple[np.ndarray, ...]]] = [[] for _ in range(world)]

    def keep(rank, requests):
        sent[rank].append(tuple(np.asarray(q.tensor) for q in requests))

    results = lockstep(gens, answer_round, keep)
    for r in range(1, world):
        if not np.array_equal(results[r], results[0], equal_nan=True):
            raise AssertionError(f"simulate: rank {r} ended with another result than rank 0")
    return results[0], states, sent
