"""One-round oracles with optional error feedback: the numpy twin of the backends'
``OneRoundCompressor``.

    a = g + r (when the spec's ``residual`` is on and a residual exists)
    payload = C(a);  r = a - D(C(a))
    result = aggregate(collective results) * scale

Subclasses define ``payload`` (a dict of arrays, in wire order), ``decompress`` (own payload ->
dense) and ``aggregate`` (the collective results -> the dense sum over ranks).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Dict, Tuple

import numpy as np

from ..contract import Allgather, Allreduce, ExchangeContext
from .oracle import Oracle


class OneRoundOracle(Oracle):
    summed = True
    fields: Tuple[str, ...] = ()  # the payload dict's keys, in wire order

    @abstractmethod
    def payload(self, a: np.ndarray, ctx: ExchangeContext) -> Dict[str, np.ndarray]:
        """What this rank puts on the wire for the compensated ``a``, by field name."""

    @abstractmethod
    def decompress(self, payload: Dict[str, np.ndarray], numel: int, dtype, ctx: ExchangeContext) -> np.ndarray:
        """The dense tensor this rank's own payload stands for."""

    @abstractmethod
    def aggregate(self, results, numel: int, dtype, ctx: ExchangeContext) -> np.ndarray:
        """The collective results -> the dense sum over ranks."""

    def exchange(self, x, ctx):
        use_residual = bool(self.spec.params.get("residual", False))
        r = ctx.state.get("residual")
        a = x + r if (use_residual and r is not None) else x
        p = self.payload(a, ctx)
        if use_residual:
            ctx.state["residual"] = a - self.decompress(p, a.size, a.dtype, ctx)
        same = self.spec.info.same_shape
        results = yield tuple(Allreduce(t) if self.summed else Allgather(t, same) for t in p.values())
        total = self.aggregate(results, a.size, a.dtype, ctx)
        return (total * np.float32(ctx.scale)).astype(np.float32)
