"""Collective requests, and the Horovod driver that carries them out.

The compressor contract (see ``torch_ops.compressors.base``) keeps compressors free of Horovod:
an exchange is a generator that *yields* a tuple of requests and is *sent* their results.

    Allreduce(t)  -- sum ``t`` over all ranks, in place; the result is ``t`` itself.
    Allgather(t)  -- concatenate every rank's ``t`` along dim 0, in rank order; sizes may differ
                     (an empty ``t`` on some rank is fine).

``HorovodDriver`` turns requests into ``horovod.torch`` async handles from outside Horovod
(``allreduce_async_`` / ``allgather_async`` / ``synchronize``) and counts the bytes each rank hands
to the transport, so compression ratios are measured from the real payload tensors, not claimed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generator, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Allreduce:
    tensor: torch.Tensor


@dataclass(frozen=True)
class Allgather:
    tensor: torch.Tensor


Request = Any  # Allreduce | Allgather
Exchange = Generator[Tuple[Request, ...], Tuple[torch.Tensor, ...], torch.Tensor]


def request_bytes(requests: Sequence[Request]) -> int:
    """Bytes this rank contributes to the collectives of one round."""
    return sum(r.tensor.numel() * r.tensor.element_size() for r in requests)


class HorovodDriver:
    """Launches requests as Horovod async ops and waits for them.

    ``name`` prefixes every collective's Horovod name, so concurrent exchanges never collide and
    every rank names the same operation the same way (Horovod matches ops across ranks by name).
    """

    def __init__(self, process_set=None):
        import horovod.torch as hvd  # imported here: compressors and planning never need it

        self._hvd = hvd
        self._process_set = process_set if process_set is not None else hvd.global_process_set

    def launch(self, requests: Sequence[Request], name: str) -> List[Any]:
        hvd = self._hvd
        handles = []
        for i, req in enumerate(requests):
            op_name = f"{name}.{i}"
            if isinstance(req, Allreduce):
                handles.append(hvd.allreduce_async_(req.tensor, name=op_name, op=hvd.Sum,
                                                    process_set=self._process_set))
            elif isinstance(req, Allgather):
                handles.append(hvd.allgather_async(req.tensor, name=op_name,
                                                   process_set=self._process_set))
            else:
                raise TypeError(f"exchange yielded {req!r}; expected Allreduce or Allgather requests")
        return handles

    def wait(self, handles: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        return tuple(self._hvd.synchronize(h) for h in handles)

    def poll(self, handles: Sequence[Any]) -> bool:
        return all(self._hvd.poll(h) for h in handles)


class PendingExchange:
    """One exchange in flight: its generator, the current round's handles, and its byte count."""

    __slots__ = ("gen", "name", "driver", "handles", "round", "bytes_sent", "result", "compute_seconds",
                 "first_seconds")

    def __init__(self, gen: Exchange, name: str, driver: HorovodDriver):
        self.gen, self.name, self.driver = gen, name, driver
        self.handles: Optional[List[Any]] = None
        self.round = 0
        self.bytes_sent = 0
        self.compute_seconds = 0.0  # time spent in the exchange's own code (compress, decompress)
        self.result: Optional[torch.Tensor] = None
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
        self.handles = self.driver.launch(requests, f"{self.name}.r{self.round}")
        self.round += 1

    @property
    def done(self) -> bool:
        return self.handles is None

    def step(self) -> bool:
        """Wait for the current round, feed its results, launch the next. True when finished."""
        if not self.done:
            self._advance(self.driver.wait(self.handles))
        return self.done


def finish_all(pending: Sequence[PendingExchange]) -> None:
    """Drive every exchange to completion, round-robin, so multi-round exchanges interleave:
    while one exchange's second round is in flight, the others' first rounds are collected."""
    queue = [p for p in pending if not p.done]
    while queue:
        queue = [p for p in queue if not p.step()]
