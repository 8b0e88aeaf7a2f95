"""Deep Gradient Compression (Lin et al., ICLR 2018), step by step, in numpy: the oracle.

Per worker and tensor, with state u (momentum) and v (accumulated velocity), gradient g, world N:

    g  <- g * c, c = (clip_norm / sqrt(N)) / (norm + 1e-6) when below 1   local clipping (if clip_norm;
          clip_scope=tensor: norm of each member tensor of the exchange, each with its own c;
          clip_scope=global: the whole local gradient's norm of the previous step, given by the
          caller in the state as "global_norm" (``hvdcompress.clipping``); absent: not clipped)
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

Weight decay (the wrapped SGD's ``weight_decay`` wd, taken over with its momentum) never enters
the exchange: ``weight_decay_step`` keeps its own momentum w per parameter, identical on every
rank, and adds its term to the exchanged result before the optimizer's step:

    d <- wd * p;  w <- m*w + d;  result <- result + w        (Nesterov: result + (d + m*w))

This is the placement of the paper's reference implementation (its DGC-SGD step), and by
linearity it is dense momentum SGD with L2 weight decay when everything is sent: the exchanged
velocity is the momentum of the averaged gradient, w the momentum of wd*p, their sum the momentum
of (g + wd*p). Decay costs no bandwidth, is never delayed by the sparsification, and takes no
top-k slots from the gradient.

All arithmetic is float32, one operation at a time, in the order written (the norm in float64),
so the PyTorch and TensorFlow implementations can match it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..sampling import (ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, index_dtype, sample_k,
                        sample_offset, sample_stride)
from ..spec import GATHERED, RATIO_RANGE, CompressionSpec, Param, num_selected, register
from ..warmup import density_at
from ..wire import sparse_gathered
from ..clipping import CLIP_SCOPES, clip_coefficient
from ..contract import Allgather, Allreduce, ExchangeContext
from .oracle import Oracle, simulate
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


def sum_of_squares(g: np.ndarray) -> float:
    """A tensor's squared norm, in float64."""
    return float(np.sum(np.asarray(g, dtype=np.float64) ** 2))


def _clip(g: np.ndarray, p: Dict[str, Any], ctx: ExchangeContext) -> np.ndarray:
    """Local clipping (the module doc): per member tensor, or by the previous step's global norm."""
    if p["clip_norm"] is None:
        return g
    if p["clip_scope"] == "global":
        coef = clip_coefficient(ctx.state.get("global_norm"), p["clip_norm"], ctx.world_size)
        return g if coef is None else g * F32(coef)
    out = g
    for m in ctx.member_list():
        part = g[m.offset:m.offset + m.numel]
        coef = clip_coefficient(math.sqrt(sum_of_squares(part)), p["clip_norm"], ctx.world_size)
        if coef is not None:
            out = out.copy() if out is g else out
            out[m.offset:m.offset + m.numel] = part * F32(coef)
    return out


def weight_decay_step(w: np.ndarray, param: np.ndarray, weight_decay: float, momentum: float,
                      nesterov: bool) -> np.ndarray:
    """The taken-over weight decay (the module doc): updates its momentum ``w`` in place and
    returns the term added to the exchanged result."""
    d = np.asarray(param, dtype=F32) * F32(weight_decay)
    w[:] = w * F32(momentum) + d
    return d + w * F32(momentum) if nesterov else w.copy()


def is_dense(spec: CompressionSpec, shape: Tuple[int, ...]) -> bool:
    return len(shape) <= 1 or int(np.prod(shape)) < spec["min_sparse_numel"]


def dgc_density(spec: CompressionSpec, epoch: int) -> float:
    """DGC's density during ``epoch``: its warm-up schedule, then the target ratio."""
    p = spec.params
    return density_at(epoch, p["ratio"], p["warmup_epochs"], p["warmup_schedule"])


def dgc_sends_dense(spec: CompressionSpec, shape: Tuple[int, ...]) -> bool:
    """DGC exchanges 1-D tensors and tensors under ``min_sparse_numel`` elements dense."""
    return len(shape) <= 1 or math.prod(shape) < spec["min_sparse_numel"]


class DGCOracle(Oracle):
    """One rank's DGC exchange (the module doc, in order); state "u", "v" in ``ctx.state``."""

    name = "dgc"

    def exchange(self, x, ctx: ExchangeContext):
        p = self.spec.params
        world = ctx.world_size
        scale = F32(ctx.scale)
        m = F32(p["momentum"])
        st = ctx.state
        g = _clip(np.asarray(x, dtype=F32).reshape(-1), p, ctx)
        u = st.setdefault("u", np.zeros_like(g))
        if is_dense(self.spec, ctx.shape):
            if p["momentum_correction"]:
                u[:] = u * m + g
                send = g + u * m if p["nesterov"] else u.copy()
            else:
                send = g.copy()
            (total,) = yield (Allreduce(send),)
        else:
            v = st.setdefault("v", np.zeros_like(g))
            if p["momentum_correction"]:
                u[:] = u * m + g
                v[:] = v + ((g + u * m) if p["nesterov"] else u)
            else:
                v[:] = v + g
            k = num_selected(dgc_density(self.spec, ctx.epoch), v.size)
            stride = sample_stride(p["sample_ratio"])
            idx = sampled_threshold_select(v, k, p["sample_ratio"], p["adapt_iters"],
                                           sample_offset(stride, v.size, p["seed"], ctx.step, ctx.key))
            values = v[idx].astype(np.float16) if p["fp16_values"] else v[idx].copy()
            v[idx] = 0
            if p["momentum_masking"] and p["momentum_correction"]:
                u[idx] = 0
            indices, gathered = yield (Allgather(idx), Allgather(values))
            total = np.zeros_like(g)
            np.add.at(total, indices.astype(np.int64), gathered.astype(F32))  # rank order
        total = total * scale
        if not p["momentum_correction"]:  # identical on every rank: applied to the exchanged average
            u[:] = u * m + total
            total = total + u * m if p["nesterov"] else u.copy()
        return total


def dgc_exchange(spec: CompressionSpec, grads: Sequence[np.ndarray], states: List[Dict[str, np.ndarray]],
                 shape: Tuple[int, ...], key: str = "", step: int = 0, epoch: int = 0, scale=None
                 ) -> Tuple[np.ndarray, List[Dict[str, np.ndarray]]]:
    """One DGC exchange among len(grads) workers. ``states[r]`` holds "u" and "v" (created as
    zeros); updated in place. Returns (result on every rank, payload per rank)."""
    total, _, sent = simulate(spec, [np.asarray(g, dtype=F32).reshape(-1) for g in grads], states, key, step,
                              scale, tuple(shape), epoch)
    fields = ("values",) if is_dense(spec, tuple(shape)) else ("indices", "values")
    return total, [dict(zip(fields, rounds[0])) for rounds in sent]


def _wire(params, d, itemsize, world, density):
    """Sparse tensors: (indices, values) gathered at the spec's ratio (or the measured density);
    fp16_values halves the value bytes. (Dense 1-D / small tensors are not told apart here.)"""
    return sparse_gathered(params, d, itemsize, world, density, 2 if params["fp16_values"] else None)


def _check_dgc(p: Dict[str, Any]) -> None:
    from ..warmup import warmup_densities

    if p["warmup_schedule"]:  # an explicit schedule sets the warm-up length
        p["warmup_epochs"] = len(p["warmup_schedule"])
    try:
        warmup_densities(p["ratio"], p["warmup_epochs"], p["warmup_schedule"])
    except ValueError as e:
        raise ValueError(f"dgc: {e}".replace("warm-up: ", "")) from None


register("dgc", GATHERED, "Deep Gradient Compression (Lin et al., ICLR 2018): top-k by a sampled "
         "threshold on the accumulated velocity, with momentum correction, local gradient clipping, "
         "momentum factor masking and sparsity warm-up; small and 1-D tensors are sent dense",
         Param("ratio", float, 0.001, "target density (fraction of entries sent)", **RATIO_RANGE),
         Param("momentum", float, 0.9, "momentum, applied in the compressor memory", low=0.0, high=1.0,
               high_open=True),
         Param("nesterov", bool, False, "Nesterov momentum"),
         Param("momentum_correction", bool, True, "accumulate velocity (u = m*u + g; v += u) instead of "
               "gradients; off: accumulate gradients, apply momentum to the exchanged average"),
         Param("clip_norm", float, None, "local clipping: the gradient norm is clipped to "
               "clip_norm / sqrt(world size) before accumulation", low=0.0, low_open=True, optional=True),
         Param("clip_scope", str, "tensor", "whose norm clip_norm bounds: 'tensor' (each tensor's own), "
               "'global' (the worker's whole gradient, as in the paper; the previous step's norm, so "
               "exchanges still launch during backward)", choices=CLIP_SCOPES),
         Param("momentum_masking", bool, True, "zero the momentum u where an entry was sent"),
         Param("warmup_epochs", int, 4, "epochs of exponentially falling density", low=0),
         Param("warmup_schedule", tuple, (), "explicit warm-up densities, one per epoch, decreasing "
               "(sets warmup_epochs to its length); empty: exponential from 1 to ratio"),
         Param("warmup_epoch_steps", int, 100, "when set_epoch() is never called, the warm-up counts "
               "epochs of this many steps (exchanges), so the target ratio is reached after "
               "warmup_epochs * warmup_epoch_steps steps", low=1),
         Param("sample_ratio", float, 0.01, "fraction of |v| sampled to estimate the threshold", **RATIO_RANGE),
         Param("adapt_iters", int, 4, "times the threshold may be lowered (x0.8) when fewer than 0.8k "
               "entries pass it", low=0, high=32),
         Param("min_sparse_numel", int, 1024, "tensors with fewer elements (and 1-D tensors) are sent "
               "dense", low=1),
         Param("fp16_values", bool, False, "send the selected values as fp16"),
         Param("seed", int, 0, "seed of the sampling offset, shared by all ranks", low=0, high=2**63 - 1),
         check=_check_dgc, wire=_wire)
