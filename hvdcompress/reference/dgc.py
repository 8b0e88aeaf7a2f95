"""Deep Gradient Compression (Lin et al., ICLR 2018), step by step, in numpy: the oracle.

Per worker and tensor, with state u (momentum) and v (accumulated velocity), gradient g, world N:

    g  <- g * min(1, (clip_norm / sqrt(N)) / (||g|| + 1e-6))     local clipping (if clip_norm)
    sparse tensors (>= min_sparse_numel entries and not 1-D):
      momentum correction on:  u <- m*u + g;  v <- v + u      (Nesterov: v <- v + (g + m*u))
      momentum correction off: v <- v + g
      select I by the sampled threshold on |v| (hvdcompress.sampling), k = ceil(density * n)
      send (I, v[I]);  v[I] <- 0;  u[I] <- 0 if momentum masking
      result = sum over ranks scattered, * scale; with correction off: u <- m*u + result; result = u
               (Nesterov: result + m*u)
    dense tensors:
      correction on:  u <- m*u + g;  send u (Nesterov: g + m*u);  result = sum * scale
      correction off: send g;  avg = sum * scale;  u <- m*u + avg;  result = u (Nesterov: avg + m*u)

All arithmetic is float32, one operation at a time, in the order written (the norm in float64),
so the PyTorch and TensorFlow implementations can match it bit for bit.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..sampling import (ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, index_dtype, sample_k,
                        sample_offset, sample_stride)
from ..spec import CompressionSpec, num_selected
from ..warmup import density_at
from .selection import topk_indices

F32 = np.float32


def sampled_threshold_select(v: np.ndarray, k: int, sample_ratio: float, adapt_iters: int,
                             offset: int) -> np.ndarray:
    """Indices (ascending) chosen by DGC's sampled threshold on |v|."""
    mag = np.abs(v)
    n = mag.size
    sample = mag[offset::sample_stride(sample_ratio)]
    ks = sample_k(k, sample.size, n)
    thr = np.sort(sample)[::-1][ks - 1]  # the ks-th largest sampled magnitude
    for it in range(adapt_iters + 1):
        idx = np.flatnonzero(mag >= thr)
        c = idx.size
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            idx = idx[topk_indices(mag[idx], k)]
            break
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            break
        thr = F32(thr) * F32(LOWER_FACTOR)
    return idx.astype(index_dtype(n))


def _clip(g: np.ndarray, clip_norm, world: int) -> np.ndarray:
    if clip_norm is None:
        return g
    norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
    coef = (clip_norm / np.sqrt(world)) / (norm + 1e-6)
    return g * F32(coef) if coef < 1.0 else g


def is_dense(spec: CompressionSpec, shape: Tuple[int, ...]) -> bool:
    return len(shape) <= 1 or int(np.prod(shape)) < spec["min_sparse_numel"]


def dgc_exchange(spec: CompressionSpec, grads: Sequence[np.ndarray], states: List[Dict[str, np.ndarray]],
                 shape: Tuple[int, ...], key: str = "", step: int = 0, epoch: int = 0, scale=None
                 ) -> Tuple[np.ndarray, List[Dict[str, np.ndarray]]]:
    """One DGC exchange among len(grads) workers. ``states[r]`` holds "u" and "v" (created as
    zeros); updated in place. Returns (result on every rank, payload per rank)."""
    p = spec.params
    world = len(grads)
    scale = F32(1.0 / world if scale is None else scale)
    m = F32(p["momentum"])
    dense = is_dense(spec, shape)
    payloads, parts = [], []
    for g, st in zip(grads, states):
        g = _clip(np.asarray(g, dtype=F32).reshape(-1), p["clip_norm"], world)
        u = st.setdefault("u", np.zeros_like(g))
        if dense:
            if p["momentum_correction"]:
                u[:] = u * m + g
                send = g + u * m if p["nesterov"] else u.copy()
            else:
                send = g.copy()
            payloads.append({"values": send})
            parts.append(send)
            continue
        v = st.setdefault("v", np.zeros_like(g))
        if p["momentum_correction"]:
            u[:] = u * m + g
            v[:] = v + ((g + u * m) if p["nesterov"] else u)
        else:
            v[:] = v + g
        k = num_selected(density_at(epoch, p["ratio"], p["warmup_epochs"], p["warmup_schedule"]), v.size)
        stride = sample_stride(p["sample_ratio"])
        idx = sampled_threshold_select(v, k, p["sample_ratio"], p["adapt_iters"],
                                       sample_offset(stride, v.size, p["seed"], step, key))
        values = v[idx].astype(np.float16) if p["fp16_values"] else v[idx].copy()
        v[idx] = 0
        if p["momentum_masking"] and p["momentum_correction"]:
            u[idx] = 0
        payloads.append({"indices": idx, "values": values})
        part = np.zeros_like(g)
        np.add.at(part, idx.astype(np.int64), values.astype(F32))
        parts.append(part)
    total = np.zeros_like(parts[0])
    for part in parts:  # rank order
        total = total + part
    total = total * scale
    if not p["momentum_correction"]:
        for st in states:  # identical on every rank: applied to the exchanged average
            u = st["u"]
            u[:] = u * m + total
        u = states[0]["u"]
        total = total + u * m if p["nesterov"] else u.copy()
    return total, payloads
