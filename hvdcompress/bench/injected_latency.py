"""``LatencyTransport``: a Horovod transport whose exchange rounds complete no sooner than a fixed
delay after they were launched.

``netem`` (``tc``'s delay) needs a kernel module a host may lack, so link latency is not emulated
by ``tc``. The benchmark harness (``hvdcompress bench --latency-ms``) instead passes this transport
to ``DistributedOptimizer(transport=...)``: each round of collectives is launched at once, as usual,
but ``wait()`` does not return (and ``poll()`` does not report completion) before
``launch time + latency``. The delay is *injected* in the training process, not emulated on
the network: rounds launched during backward overlap their delays with computation, as they
would overlap a real link's latency, but the collectives themselves run at link speed.
"""

from __future__ import annotations

import time
from typing import Any, List, Sequence, Tuple

import torch

from torch_ops.collectives import Communicator, Request


class _LaunchedRound(list):
    """The handles of one round, tagged with the time they were launched."""

    __slots__ = ("launched_at",)


class LatencyTransport(Communicator):
    """``Communicator`` that adds ``latency_s`` seconds to the completion of every round."""

    def __init__(self, latency_s: float, process_set=None):
        if not latency_s >= 0:
            raise ValueError(f"latency_s: must be >= 0 seconds; got {latency_s!r}")
        super().__init__(process_set)
        self.latency_s = float(latency_s)

    def launch(self, requests: Sequence[Request], name: str) -> List[Any]:
        handles = _LaunchedRound(super().launch(requests, name))
        handles.launched_at = time.perf_counter()
        return handles

    def _remaining(self, handles: Sequence[Any]) -> float:
        return getattr(handles, "launched_at", float("-inf")) + self.latency_s - time.perf_counter()

    def wait(self, handles: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        results = super().wait(handles)
        remaining = self._remaining(handles)
        if remaining > 0:
            time.sleep(remaining)
        return results

    def poll(self, handles: Sequence[Any]) -> bool:
        return self._remaining(handles) <= 0 and super().poll(handles)
