"""The one-round oracles as plain functions (what the tests of the one-round compressors call).

``reference_payload`` / ``reference_decompress`` ask the algorithm's oracle class
(``hvdcompress.reference.<module>``) for one rank's payload dict and its dense meaning;
``reference_exchange`` simulates N ranks with error feedback through ``oracle.simulate``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..spec import CompressionSpec
from ..contract import ExchangeContext
from .oracle import oracle_for, simulate


def _ctx(key: str, step: int, numel: int) -> ExchangeContext:
    return ExchangeContext(key, step, 1, 1.0, {}, (numel,))


def reference_payload(spec: CompressionSpec, a: np.ndarray, key: str = "", step: int = 0) -> Dict[str, np.ndarray]:
    """What one rank sends for the (already compensated) flat tensor ``a``."""
    a = np.asarray(a).reshape(-1)
    return oracle_for(spec).payload(a, _ctx(key, step, a.size))


def reference_decompress(spec: CompressionSpec, payload: Dict[str, np.ndarray], numel: int,
                         dtype=np.float32, key: str = "", step: int = 0) -> np.ndarray:
    """The dense tensor one payload stands for (used for the residual and for aggregation)."""
    return oracle_for(spec).decompress(payload, numel, dtype, _ctx(key, step, numel))


def reference_exchange(spec: CompressionSpec, grads: Sequence[np.ndarray],
                       residuals: Optional[Sequence[Optional[np.ndarray]]] = None,
                       key: str = "", step: int = 0, scale: Optional[float] = None,
                       ) -> Tuple[np.ndarray, List[Optional[np.ndarray]], List[Dict[str, np.ndarray]]]:
    """Simulate one exchange among len(grads) workers.

    Returns (result every rank ends with, new residual per rank, payload per rank).
    ``scale`` defaults to 1/N (op=Average).
    """
    n = len(grads)
    residuals = list(residuals) if residuals is not None else [None] * n
    use_residual = bool(spec.params.get("residual", False))
    grads = [np.asarray(g, dtype=np.float32).reshape(-1) for g in grads]
    states = [{"residual": r} if r is not None else {} for r in residuals]
    total, states, sent = simulate(spec, grads, states, key, step, scale, shape=(grads[0].size,))
    fields = oracle_for(spec).fields
    payloads = [dict(zip(fields, rounds[0])) for rounds in sent]
    return total, [st.get("residual") if use_residual else None for st in states], payloads
