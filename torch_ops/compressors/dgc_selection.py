"""DGC's selection on the PyTorch side: the sampled threshold (``sampled_threshold_select``) and
the fused state update + selection of one DGC step (``accumulate_and_select``), matching
``hvdcompress.reference.dgc`` exactly. The scan machinery (numpy chunks, block maxima, reused
buffers) is shared with the exact top-k in ``selection``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from hvdcompress.native import select as shared
from hvdcompress.sampling import ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, sample_k, sample_stride

from ..gpu import select as gpu_select
from . import native
from .cpu_selection import KERNEL_SUFFIX, np_kth_largest, numpy_view
from .selection import (CHUNK, DIRECT_BELOW, Blocks, at_least, block_absmax, block_size, empty_indices, scratch,
                        topk_positions)


def _sampled_select(v: torch.Tensor, k: int, sample: torch.Tensor, adapt_iters: int,
                    blocks: Optional[Blocks]) -> torch.Tensor:
    n = v.numel()
    if k <= 0:
        return empty_indices(v.device)
    ks = sample_k(k, sample.numel(), n)
    thr = torch.topk(sample, ks, sorted=False).values.min()
    lower = torch.tensor(LOWER_FACTOR, dtype=v.dtype, device=v.device)
    idx = mag = None
    for it in range(adapt_iters + 1):
        if not bool(thr > 0):  # |v| >= 0 everywhere: no filter to apply
            mag = v.abs()
            idx = torch.arange(n, device=v.device)
        else:
            idx, mag = at_least(v, thr, blocks)
        c = idx.numel()
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return idx.index_select(0, topk_positions(mag, k))
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return idx
        thr = thr * lower
    return idx


def _np_sampled_select(x: np.ndarray, k: int, sample: np.ndarray, adapt_iters: int) -> np.ndarray:
    """``_sampled_select`` in numpy (``hvdcompress.native.select.sampled_select``)."""
    return shared.sampled_select(x, k, sample, adapt_iters, np_kth_largest)


def sampled_threshold_select(v: torch.Tensor, k: int, sample_ratio: float, adapt_iters: int,
                             offset: int) -> torch.Tensor:
    """Indices (int64, ascending) chosen by DGC's sampled threshold on |v|."""
    v = v.reshape(-1)
    if not v.is_contiguous():
        v = v.contiguous()
    x = numpy_view(v)
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
    updated, idx = gpu_select.accumulate_and_select(g, u, v, momentum, nesterov, k, sample_ratio, adapt_iters,
                                                    offset)  # CUDA tensors: the Triton kernels
    if updated:
        return sampled_threshold_select(v, k, sample_ratio, adapt_iters, offset) if idx is None else idx
    if not (g.is_contiguous() and u.is_contiguous() and v.is_contiguous()) or n < DIRECT_BELOW:
        _update(g, u, v, momentum, nesterov)
        return sampled_threshold_select(v, k, sample_ratio, adapt_iters, offset)
    stride = sample_stride(sample_ratio)
    sample = scratch.get(len(range(offset, n, stride)), v.dtype, v.device, "sample")
    x = numpy_view(v)
    size = None if x is not None else block_size(k / n)  # numpy scans need no blocks
    nb = n // size if size else 0
    bmax = scratch.get(nb, v.dtype, v.device, "bmax")
    bmin = scratch.get(nb, v.dtype, v.device, "bmin")
    tmp = scratch.get(min(CHUNK, n), v.dtype, v.device, "tmp") if nesterov else None
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


def _native_accumulate_and_select(g, u, v, momentum, nesterov, k, sample_ratio, adapt_iters, offset):
    """``accumulate_and_select`` in one compiled pass over g, u and v, in place
    (``hvdcompress.native.select.dgc_select``, shared with TensorFlow; its work buffers are this
    module's reused ones); None where it does not apply."""
    suffix = KERNEL_SUFFIX.get(v.dtype)
    if (suffix is None or g.dtype != v.dtype or u.dtype != v.dtype or not (g.is_cpu and u.is_cpu and v.is_cpu)
            or not (g.is_contiguous() and u.is_contiguous() and v.is_contiguous())
            or v.is_neg() or g.is_neg() or u.is_neg()):
        return None
    if native.lib() is None:
        return None
    x, gx, ux = numpy_view(v), numpy_view(g), numpy_view(u)
    if x is None or gx is None or ux is None:
        return None
    gx, ux, x = gx.reshape(-1), ux.reshape(-1), x.reshape(-1)
    idx = shared.dgc_select(gx, ux, x, ux, x, momentum, nesterov, k, sample_ratio, adapt_iters, offset,
                            np_kth_largest, _buffer)
    return None if idx is None else torch.from_numpy(idx)


_NUMPY_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                   np.dtype(np.int64): torch.int64}


def _buffer(n: int, dtype, role: str) -> np.ndarray:
    """A reused work array (``selection.scratch``) for the shared DGC pass."""
    return scratch.get(n, _NUMPY_TO_TORCH[np.dtype(dtype)], torch.device("cpu"), role).numpy()


def take_and_zero(v: torch.Tensor, u: Optional[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """DGC's send and masking: the values v[idx], then v[idx] <- 0 and (u given) u[idx] <- 0.
    One compiled loop over the k indices where it applies (indices outside v: nothing written,
    the torch calls then raise as they would), else ``index_select`` and
    ``index_fill_`` (several times faster than ``v[idx]``); the same result either way."""
    suffix = KERNEL_SUFFIX.get(v.dtype)
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
    values = gpu_select.take(v, idx, u=u)  # CUDA tensors: one launch (the Triton kernels)
    if values is not None:
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
