"""Which entries a sparsifier sends, in torch, matching ``hvdcompress.reference`` exactly.

``topk_indices``: the k largest |a|, ties toward the lower index, ascending.
``sampled_threshold_select``: DGC's threshold estimated from a strided sample of |v|, adapted
until between 0.8k and 1.3k entries pass (the rule lives in ``hvdcompress.sampling``). It makes
three passes over the tensor (|v|, >= thr, nonzero) instead of a full top-k, into work buffers
that are reused across calls (allocating 100 MB afresh costs as much as a pass in page faults).
"""

from __future__ import annotations

import torch

from hvdcompress.sampling import (ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, sample_k,
                                  sample_stride)


class _Scratch:
    """Reusable 1-D work buffers, one per (dtype, device), grown to the largest size asked for.
    Callers use the view they get before asking again (hooks run on one backward thread)."""

    def __init__(self):
        self._buffers = {}

    def get(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get((dtype, device))
        if buf is None or buf.numel() < n:
            buf = self._buffers[(dtype, device)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


_scratch = _Scratch()


def topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |a| (ties toward the lower index), sorted ascending, as int64."""
    if k >= a.numel():
        return torch.arange(a.numel(), device=a.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=a.device)
    mag = a.abs()
    kth, idx = torch.topk(mag, k, sorted=False)
    thr = kth.min()
    n_above = int((mag > thr).sum())
    n_at = int((mag == thr).sum())
    if n_above + n_at == k:  # no tie at the boundary: topk's set is the only answer
        return idx.sort().values
    # ties at the threshold: all strictly larger, then the lowest-index entries equal to it
    above = torch.nonzero(mag > thr).view(-1)
    at = torch.nonzero(mag == thr).view(-1)[: k - n_above]
    return torch.cat((above, at)).sort().values


def sampled_threshold_select(v: torch.Tensor, k: int, sample_ratio: float, adapt_iters: int,
                             offset: int) -> torch.Tensor:
    """Indices (int64, ascending) chosen by DGC's sampled threshold on |v|."""
    n = v.numel()
    mag = torch.abs(v, out=_scratch.get(n, v.dtype, v.device))
    mask = _scratch.get(n, torch.bool, v.device)
    sample = mag[offset::sample_stride(sample_ratio)]
    ks = sample_k(k, sample.numel(), n)
    thr = torch.topk(sample, ks, sorted=False).values.min()
    lower = torch.tensor(LOWER_FACTOR, dtype=mag.dtype)
    for it in range(adapt_iters + 1):
        idx = torch.nonzero(torch.ge(mag, thr, out=mask)).view(-1)
        c = idx.numel()
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return idx[topk_indices(mag[idx], k)]
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return idx
        thr = thr * lower
    return idx
