"""DGC's selection on the PyTorch side: the sampled threshold (``sampled_threshold_select``) and
the fused state update + selection of one DGC step (``accumulate_and_select``), matching
``hvdcompress.reference.dgc`` exactly. The scan machinery (numpy chunks, block maxima, reused
buffers) is shared with the exact top-k in ``selection``.
"""

from __future__ import annotations

import ctypes
import math
from typing import Optional

import numpy as np
import torch

from hvdcompress.sampling import ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, sample_k, sample_stride

from . import native
from .cpu_selection import _TORCH_SUFFIX, _ge_numpy, _np_kth_largest, _np_positions, _numpy_view
from .selection import CHUNK, DIRECT_BELOW, Blocks, _at_least, _empty, _scratch, _topk_positions, block_absmax, block_size


def _sampled_select(v: torch.Tensor, k: int, sample: torch.Tensor, adapt_iters: int,
                    blocks: Optional[Blocks]) -> torch.Tensor:
    n = v.numel()
    if k <= 0:
        return _empty(v.device)
    ks = sample_k(k, sample.numel(), n)
    thr = torch.topk(sample, ks, sorted=False).values.min()
    lower = torch.tensor(LOWER_FACTOR, dtype=v.dtype, device=v.device)
    idx = mag = None
    for it in range(adapt_iters + 1):
        if not bool(thr > 0):  # |v| >= 0 everywhere: no filter to apply
            mag = v.abs()
            idx = torch.arange(n, device=v.device)
        else:
            idx, mag = _at_least(v, thr, blocks)
        c = idx.numel()
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return idx.index_select(0, _topk_positions(mag, k))
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return idx
        thr = thr * lower
    return idx


def _np_sampled_select(x: np.ndarray, k: int, sample: np.ndarray, adapt_iters: int) -> np.ndarray:
    """``_sampled_select`` in numpy (the threshold arithmetic in x's dtype, as the oracle's)."""
    n = x.size
    if k <= 0:
        return np.empty(0, np.int64)
    thr = _np_kth_largest(sample, sample_k(k, sample.size, n))
    lower = x.dtype.type(LOWER_FACTOR)
    idx = None
    for it in range(adapt_iters + 1):
        if not thr > 0:  # |x| >= 0 everywhere: no filter to apply
            mag, idx = np.abs(x), np.arange(n)
        else:
            idx, mag = _ge_numpy(x, thr)
        c = idx.size
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return idx[_np_positions(mag, k)]
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return idx
        thr = thr * lower
    return idx


def sampled_threshold_select(v: torch.Tensor, k: int, sample_ratio: float, adapt_iters: int,
                             offset: int) -> torch.Tensor:
    """Indices (int64, ascending) chosen by DGC's sampled threshold on |v|."""
    v = v.reshape(-1)
    if not v.is_contiguous():
        v = v.contiguous()
    x = _numpy_view(v)
    if x is not None:
        sample = np.abs(x[offset::sample_stride(sample_ratio)])
        return torch.from_numpy(_np_sampled_select(x, k, sample, adapt_iters))
    sample = v[offset::sample_stride(sample_ratio)].abs()
    size = block_size(k / v.numel()) if v.numel() >= DIRECT_BELOW else None
    return _sampled_select(v, k, sample, adapt_iters, None if size is None else block_absmax(v, size))


def accumulate_and_select(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: Optional[float],
                          nesterov: bool, k: int, sample_ratio: float, adapt_iters: int,
                          offset: int) -> torch.Tensor:
    """DGC's state update, in place, then its selection: the indices of
    ``sampled_threshold_select(v_new, ...)``.

        momentum given:  u <- m*u + g;  v <- v + u   (nesterov: v <- v + (g + m*u))
        momentum None:   v <- v + g

    Chunk by chunk (CHUNK entries), while the chunk is in cache: the update, DGC's strided sample
    of |v| and (off CPU) the block maxima of |v|. So the update reads g, u and v once and writes u
    and v once; the selection then scans v once (on CPU with numpy, which compares and finds
    nonzeros several times faster than torch; a scan fused into this loop, behind a threshold
    estimated beforehand, measured no faster). The rounding is the oracle's (one float operation
    at a time, in its order, the momentum a Python scalar as in the unfused update).

    With the compiled kernels (``native``; contiguous CPU float32/float64) it is one pass: see
    ``_native_accumulate_and_select``."""
    n = v.numel()
    if k > 0:
        idx = _native_accumulate_and_select(g, u, v, momentum, nesterov, k, sample_ratio, adapt_iters, offset)
        if idx is not None:
            return idx
    if not (g.is_contiguous() and u.is_contiguous() and v.is_contiguous()) or n < DIRECT_BELOW:
        _update(g, u, v, momentum, nesterov)
        return sampled_threshold_select(v, k, sample_ratio, adapt_iters, offset)
    stride = sample_stride(sample_ratio)
    sample = _scratch.get(len(range(offset, n, stride)), v.dtype, v.device, "sample")
    x = _numpy_view(v)
    size = None if x is not None else block_size(k / n)  # numpy scans need no blocks
    nb = n // size if size else 0
    bmax = _scratch.get(nb, v.dtype, v.device, "bmax")
    bmin = _scratch.get(nb, v.dtype, v.device, "bmin")
    tmp = _scratch.get(min(CHUNK, n), v.dtype, v.device, "tmp") if nesterov else None
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        gc, vc = g[lo:hi], v[lo:hi]
        if momentum is None:
            vc.add_(gc)
        else:
            uc = u[lo:hi]
            uc.mul_(momentum).add_(gc)
            if nesterov:
                t = tmp[:hi - lo]
                vc.add_(torch.add(gc, torch.mul(uc, momentum, out=t), out=t))
            else:
                vc.add_(uc)
        if size:
            b0, b1 = lo // size, min(hi // size, nb)
            rows = v[b0 * size:b1 * size].view(-1, size)
            torch.amax(rows, 1, out=bmax[b0:b1])
            torch.amin(rows, 1, out=bmin[b0:b1])
        first = offset if lo <= offset else offset + -(-(lo - offset) // stride) * stride
        if first < hi:  # the sample's entries in this chunk
            j = (first - offset) // stride
            cnt = len(range(first, hi, stride))
            torch.abs(vc[first - lo::stride], out=sample[j:j + cnt])
    if x is not None:
        return torch.from_numpy(_np_sampled_select(x, k, sample.numpy(), adapt_iters))
    blocks = Blocks(torch.maximum(bmax, bmin.neg_(), out=bmax), size) if size else None
    return _sampled_select(v, k, sample, adapt_iters, blocks)


SUBSAMPLE = 8  # the start threshold is estimated from every SUBSAMPLE-th entry of DGC's sample


def _start_threshold(lib, suffix, g, u, v, n, m, mode, k, offset, stride, sample) -> float:
    """Where the compiled pass starts collecting candidates: a few standard deviations below the
    k-th largest |v| after the update, estimated before the update from every SUBSAMPLE-th entry
    of DGC's sample (computed at those positions as the update computes them). Each sampled entry
    is a memory access of its own (1% of the entries, a cache line each, in three arrays): the
    whole sample costs about half a pass, an eighth of it a sixteenth. Where that subsample is too
    small to estimate from, the whole sample is taken. Only speed depends on this value: the list
    is exact for wherever it ends, and the rule rescans v below it."""
    sub_stride = stride * SUBSAMPLE
    ms = len(range(offset, n, sub_stride))
    ks = sample_k(k, ms, n)
    r = ks + int(4 * math.sqrt(ks)) + 4
    if 8 * r > ms:  # too few: the whole sample (the exact thr0)
        sub_stride, ms = stride, sample.numel()
        r = sample_k(k, ms, n)
    buf = _scratch.get(ms, v.dtype, v.device, "dgc_subsample") if sub_stride != stride else sample
    getattr(lib, "hvdc_dgc_sample_" + suffix)(g.data_ptr(), u.data_ptr(), v.data_ptr(), n, m, mode, offset,
                                              sub_stride, buf.data_ptr())
    t0 = _np_kth_largest(buf.numpy(), r)
    return float(t0) if t0 > 0 else float("inf")


def _native_accumulate_and_select(g, u, v, momentum, nesterov, k, sample_ratio, adapt_iters, offset):
    """``accumulate_and_select`` in one compiled pass over g, u and v (None where it does not apply).

    The pass (``dgc_pass``) updates u and v and, with v still in registers, writes DGC's sample of
    the new |v| and collects candidates {i : |v_i| >= t} with their |v|. It starts at t0, a few
    standard deviations below the k-th largest, estimated beforehand from an eighth of the sample
    computed at its positions as the update will compute them (``_start_threshold``), so about
    2-3k entries are collected. The list is capped at 8k + 4096 entries and tightens itself
    instead of overflowing (t raised to the (cap/2)-th largest collected, the list cut there:
    still exact for the final t). Then the rule runs: thr0 from the whole sample (exact), and the
    candidates while its threshold is >= the list's; when it needs a lower one (fewer than 0.8k
    passed thr0: the x0.8 adaptation, or an estimate that missed) v is scanned again, so the answer
    is always the rule's. (Collecting down to 0.8 thr0 in the pass does not pay: in DGC's steady
    state |v| is flat near the top -- many entries grow towards the threshold -- and 30x more
    entries pass 0.8 thr0 than thr0.)"""
    suffix = _TORCH_SUFFIX.get(v.dtype)
    if (suffix is None or g.dtype != v.dtype or u.dtype != v.dtype or not (g.is_cpu and u.is_cpu and v.is_cpu)
            or not (g.is_contiguous() and u.is_contiguous() and v.is_contiguous())
            or v.is_neg() or g.is_neg() or u.is_neg()):
        return None
    lib = native.lib()
    x = _numpy_view(v) if lib is not None else None
    if x is None:
        return None
    n = v.numel()
    dt = x.dtype.type
    mode, m = (0, 0.0) if momentum is None else ((2 if nesterov else 1), momentum)
    stride = sample_stride(sample_ratio)
    sample = _scratch.get(len(range(offset, n, stride)), v.dtype, v.device, "dgc_sample")
    cap = 8 * k + 4096
    if 4 * cap > n:  # a dense selection: no list, the rule scans v
        cap, t0 = 0, float("inf")
    else:
        t0 = _start_threshold(lib, suffix, g, u, v, n, m, mode, k, offset, stride, sample)
    cidx = _scratch.get(cap, torch.int64, v.device, "dgc_idx")
    cmag = _scratch.get(cap, v.dtype, v.device, "dgc_mag")
    work = _scratch.get(cap, v.dtype, v.device, "dgc_work")
    t_have = (ctypes.c_float if suffix == "f32" else ctypes.c_double)()
    c = getattr(lib, "hvdc_dgc_pass_" + suffix)(g.data_ptr(), u.data_ptr(), v.data_ptr(), n, m, mode, offset,
                                                stride, sample.data_ptr(), t0, cidx.data_ptr(), cmag.data_ptr(),
                                                cap, work.data_ptr(), ctypes.byref(t_have))
    sample = sample.numpy()
    thr0 = _np_kth_largest(sample, sample_k(k, sample.size, n))
    lower = dt(LOWER_FACTOR)
    t_have = dt(t_have.value)  # the list holds exactly the indices with |v| >= t_have
    if cap == 0 or c < 0 or not thr0 > 0:  # no (usable) candidate list, or no filter: the rule on the updated v
        return torch.from_numpy(_np_sampled_select(x, k, sample, adapt_iters))
    cidx, cmag = cidx.numpy()[:c], cmag.numpy()[:c]
    thr = thr0
    for it in range(adapt_iters + 1):  # the rule of _np_sampled_select, on the candidates while thr >= t_have
        if not thr > 0:
            mag, idx = np.abs(x), np.arange(n)
        elif thr >= t_have:
            keep = cmag >= thr
            idx, mag = cidx[keep], cmag[keep]
        else:
            idx, mag = _ge_numpy(x, thr, 2 * k + 1024)
        c = idx.size
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return torch.from_numpy(idx[_np_positions(mag, k)])
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return torch.from_numpy(idx)
        thr = thr * lower
    return torch.from_numpy(idx)


def take_and_zero(v: torch.Tensor, u: Optional[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """DGC's send and masking: the values v[idx], then v[idx] <- 0 and (u given) u[idx] <- 0.
    One compiled loop over the k indices where it applies (indices outside v: nothing written,
    the torch calls then raise as they would), else ``index_select`` and
    ``index_fill_`` (several times faster than ``v[idx]``); the same result either way."""
    suffix = _TORCH_SUFFIX.get(v.dtype)
    lib = native.lib() if suffix is not None else None
    if (lib is not None and v.is_cpu and v.is_contiguous() and not v.is_neg() and idx.dtype == torch.int64
            and idx.is_cpu and idx.is_contiguous() and idx.dim() == 1
            and (u is None or (u.is_cpu and u.dtype == v.dtype and u.is_contiguous() and not u.is_neg()
                               and u.numel() == v.numel()))):
        values = torch.empty(idx.numel(), dtype=v.dtype)
        if getattr(lib, "hvdc_take_and_zero_" + suffix)(v.data_ptr(), None if u is None else u.data_ptr(),
                                                        v.numel(), idx.data_ptr(), idx.numel(),
                                                        values.data_ptr()) == idx.numel():
            return values
    values = v.index_select(0, idx)
    v.index_fill_(0, idx, 0)
    if u is not None:
        u.index_fill_(0, idx, 0)
    return values


def _update(g, u, v, momentum, nesterov) -> None:
    if momentum is None:
        v.add_(g)
        return
    u.mul_(momentum).add_(g)
    v.add_(g + u * momentum if nesterov else u)
