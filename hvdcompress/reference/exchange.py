"""Reference payloads and a simulated N-worker exchange with error feedback.

A payload is a dict of numpy arrays: exactly what one rank hands to the collective.

    none       {"values": x}                       summed
    fp16       {"values": fp16(x)}                 summed (in fp16)
    bf16       {"codes": bf16 codes as int16}      gathered, decoded and summed in fp32
    topk       {"indices": int32, "values": x[i]}  gathered, scatter-added
    threshold  {"indices": int32, "values": x[i]}  gathered, scatter-added
    randomk    {"values": x[i]}                    summed; i from hvdcompress.sampling (shared seed)

Error feedback (when the spec's ``residual`` is on): a = g + r; send C(a); r = a - D(C(a)).
The exchanged result is the sum over ranks of D(C(a_rank)), times ``scale`` (1/N to average).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..sampling import random_indices
from ..spec import CompressionSpec, num_selected
from .codecs import bf16_decode, bf16_encode, fp16_decode, fp16_encode
from .selection import threshold_indices, topk_indices


def reference_payload(spec: CompressionSpec, a: np.ndarray, key: str = "", step: int = 0) -> Dict[str, np.ndarray]:
    """What one rank sends for the (already compensated) flat tensor ``a``."""
    a = np.asarray(a).reshape(-1)
    name = spec.name
    if name == "none":
        return {"values": a.copy()}
    if name == "fp16":
        return {"values": fp16_encode(a)}
    if name == "bf16":
        return {"codes": bf16_encode(a)}
    if name == "topk":
        idx = topk_indices(a, num_selected(spec["ratio"], a.size))
        return {"indices": idx, "values": a[idx]}
    if name == "threshold":
        idx = threshold_indices(a, spec["threshold"])
        return {"indices": idx, "values": a[idx]}
    if name == "randomk":
        idx = random_indices(a.size, num_selected(spec["ratio"], a.size), spec["seed"], step, key)
        return {"values": a[idx]}
    raise ValueError(f"reference: no numpy reference for compressor {name!r}")


def reference_decompress(spec: CompressionSpec, payload: Dict[str, np.ndarray], numel: int,
                         dtype=np.float32, key: str = "", step: int = 0) -> np.ndarray:
    """The dense tensor one payload stands for (used for the residual and for aggregation)."""
    name = spec.name
    if name in ("none",):
        return payload["values"].astype(dtype)
    if name == "fp16":
        return fp16_decode(payload["values"], dtype)
    if name == "bf16":
        return bf16_decode(payload["codes"], dtype)
    out = np.zeros(numel, dtype=dtype)
    if name in ("topk", "threshold"):
        np.add.at(out, payload["indices"].astype(np.int64), payload["values"].astype(dtype))
        return out
    if name == "randomk":
        idx = random_indices(numel, num_selected(spec["ratio"], numel), spec["seed"], step, key)
        out[idx] = payload["values"]
        return out
    raise ValueError(f"reference: no numpy reference for compressor {name!r}")


def reference_exchange(spec: CompressionSpec, grads: Sequence[np.ndarray],
                       residuals: Optional[Sequence[Optional[np.ndarray]]] = None,
                       key: str = "", step: int = 0, scale: Optional[float] = None,
                       ) -> Tuple[np.ndarray, List[Optional[np.ndarray]], List[Dict[str, np.ndarray]]]:
    """Simulate one exchange among len(grads) workers.

    Returns (result every rank ends with, new residual per rank, payload per rank).
    ``scale`` defaults to 1/N (op=Average).
    """
    n = len(grads)
    scale = 1.0 / n if scale is None else scale
    residuals = list(residuals) if residuals is not None else [None] * n
    use_residual = bool(spec.params.get("residual", False))
    payloads, new_residuals, parts = [], [], []
    for g, r in zip(grads, residuals):
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        a = g + r if (use_residual and r is not None) else g
        p = reference_payload(spec, a, key, step)
        d = reference_decompress(spec, p, a.size, a.dtype, key, step)
        new_residuals.append(a - d if use_residual else None)
        payloads.append(p)
        parts.append(d)
    if spec.name == "fp16":  # summed on the wire in half precision
        total = fp16_decode(np.sum(np.stack([p["values"] for p in payloads]), axis=0, dtype=np.float16))
    else:
        total = np.zeros_like(parts[0])
        for d in parts:  # rank order, as the gathered buffers are concatenated
            total = total + d
    return (total * np.float32(scale)).astype(np.float32), new_residuals, payloads
