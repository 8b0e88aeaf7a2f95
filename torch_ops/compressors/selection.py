"""Which entries a sparsifier sends, in torch, matching ``hvdcompress.reference`` exactly.

``topk_indices``      the k largest |a|, ties toward the lower index, ascending (int64).
``threshold_indices`` every index with |a| >= threshold, ascending (int64).
``sampled_threshold_select``  DGC's threshold estimated from a strided sample of |v|, adapted
                      until between 0.8k and 1.3k entries pass (the rule lives in
                      ``hvdcompress.sampling``).
``accumulate_and_select``  DGC's state update (u = m*u + g; v += u) and that selection, fused.

How they stay near the cost of one read of the tensor (a full ``torch.topk`` is a partial sort;
on CPU ``torch.ge`` into bools and ``torch.nonzero`` cost more than a pass over the floats):

* **Exact top-k from a candidate set.** A threshold t from a strided sample, chosen a few
  standard deviations below the k-th largest (so t <= the k-th largest |a| with overwhelming
  probability), gives candidates C = {|a| >= t}. When |C| >= k, the k-th largest of |a| is >= t,
  so C holds every entry of the exact answer and the tie rule is applied among C alone (the k-th
  largest value w of C; every entry > w, then the lowest-index entries == w). When |C| < k (an
  unlucky sample, adversarial data), a lower threshold is tried once, then the full path runs:
  never a wrong answer, only a slower one. A sample that is mostly zeros (t = 0: a zero or
  nearly-zero gradient) takes the nonzero entries as the candidates (then the lowest-index zeros
  if they are fewer than k), instead of a top-k over the whole.
* **Scans with numpy on CPU** (``cpu_selection.py``, with the compiled kernels). {|a| >= t} is
  found chunk by chunk (|a| and the mask stay in cache) with numpy, reading the tensor's memory
  in place: numpy's compare and nonzero are several times faster than torch's, and a numpy call
  costs a fraction of a torch call, which decides the speed on small tensors.
* **Elsewhere (other devices, dtypes numpy lacks): block maxima.** One ``amax``/``amin`` per
  block of 32 or 64 entries gives each block's largest |a|; only blocks whose maximum passes are
  gathered and tested. Where most blocks pass, a word-wise scan: the bool mask read as int64
  words, ``nonzero`` over the words, then over the bytes of the nonzero ones.

Work buffers are reused across calls (allocating 100 MB afresh costs as much as a pass in page
faults); callers use the view they get before asking again (hooks run on one backward thread).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from hvdcompress.sampling import sample_k
from hvdcompress.native.select import topk_any as shared_topk_any
from hvdcompress.native.select import topk_sample_stride

from ..gpu import select as gpu_select
from . import cpu_selection
from .cpu_selection import (NATIVE_DIRECT_BELOW, ge_numpy, native_topk_small, np_positions, np_topk,
                            numpy_view)

CHUNK = 1 << 18       # entries per chunk of the fused DGC loop (stays in the core's cache)
DIRECT_BELOW = 4096   # torch: tensors smaller than this take the direct path (one topk)
BLOCKS_UNTIL = 0.35   # block filter while at most this fraction of the blocks passes

class _Scratch:
    """Reusable 1-D work buffers, one per (dtype, device, role), grown to the largest size asked
    for. Callers use the view they get before asking again (hooks run on one backward thread)."""

    def __init__(self):
        self._buffers = {}

    def get(self, n: int, dtype: torch.dtype, device: torch.device, role: str = "") -> torch.Tensor:
        key = (dtype, device, role)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


scratch = _Scratch()


def empty_indices(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


# -- exact top-k among a set -------------------------------------------------------------------
def _kth_largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry (0-dim), from a topk of the smaller side."""
    c = mag.numel()
    if 2 * k <= c:
        return torch.topk(mag, k, sorted=False).values.min()
    return torch.topk(mag, c - k + 1, largest=False, sorted=False).values.max()


def topk_positions(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the k largest entries of ``mag``, ties toward the lower position;
    0 < k < mag.numel(): every position > the k-th largest value w, then the first ones == w."""
    y = numpy_view(mag)
    if y is not None:
        return torch.from_numpy(np_positions(y, k))
    w = _kth_largest(mag, k)
    keep = mag > w
    need = k - int(keep.sum())
    eq = mag == w
    if int(eq.sum()) < need:  # only with NaN, which topk ranks above every number
        return _topk_positions_nan_last(mag, k)
    if int(eq.sum()) > need:
        firsts, found = [], 0
        step = max(CHUNK, 8 * need)
        for lo in range(0, mag.numel(), step):
            pos = torch.nonzero(eq[lo:lo + step]).view(-1)
            firsts.append(pos[:need - found] + lo)
            found += firsts[-1].numel()
            if found == need:
                break
        eq.zero_()
        eq[torch.cat(firsts)] = True
    return torch.nonzero(keep.logical_or_(eq)).view(-1)


def _topk_positions_nan_last(mag: torch.Tensor, k: int) -> torch.Tensor:
    """``topk_positions`` with NaN ranked below every number, as the oracle ranks it."""
    nan = torch.isnan(mag)
    num = torch.nonzero(~nan).view(-1)
    if k < num.numel():
        return num[topk_positions(mag[num], k)]
    return torch.cat([num, torch.nonzero(nan).view(-1)[:k - num.numel()]]).sort().values


def _argmax_first(a: torch.Tensor) -> torch.Tensor:
    """[index of the largest |a|] (the first among equals; NaN ranks last, as in the oracle), as a
    1-element int64 tensor."""
    x = numpy_view(a)
    if x is not None:
        return torch.from_numpy(shared_topk_any(x, 1))
    mag = a.abs()
    # argmax counts NaN as maximal: NaN as -1 puts it below every |a|; all NaN gives index 0
    return torch.argmax(torch.where(torch.isnan(mag), torch.full_like(mag, -1), mag)).view(1)


def _direct(a: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of a small tensor: one topk of k+1 (sorted) shows whether the k-th and (k+1)-th
    largest differ; if they do, topk's set is the only answer."""
    mag = a.abs()
    if k <= 64:
        vals, idx = torch.topk(mag, k + 1)
        lo = vals[k - 1:].tolist()
        if lo[0] > lo[1] and not math.isnan(vals[0].item()):  # topk ranks NaN first: the general path
            return idx[:k].sort().values
    return topk_positions(mag, k)


# -- the entries at or above a threshold --------------------------------------------------------
class Blocks(NamedTuple):
    """max |a| of each full block of ``size`` consecutive entries (the a.numel() % size tail apart)."""
    absmax: torch.Tensor
    size: int


def block_size(fraction: float) -> Optional[int]:
    """Entries per block for a filter that ``fraction`` of the entries pass (None: no block
    filter pays, scan the whole). Large blocks reduce faster, small ones pass less data on."""
    for size in (64, 32):
        if 1.0 - (1.0 - min(fraction, 1.0)) ** size <= (0.1 if size == 64 else BLOCKS_UNTIL):
            return size
    return None


def block_absmax(a: torch.Tensor, size: int) -> Blocks:
    """``Blocks`` of a flat contiguous tensor; chunk by chunk, so that the second reduction (amin
    after amax) reads the chunk from cache."""
    nb = a.numel() // size
    hi_all = a[:nb * size].view(nb, size)
    bmax = torch.empty(nb, dtype=a.dtype, device=a.device)
    bmin = scratch.get(nb, a.dtype, a.device, "bmin")
    rows = CHUNK // size
    for lo in range(0, nb, rows):
        part = hi_all[lo:lo + rows]
        torch.amax(part, 1, out=bmax[lo:lo + rows])
        torch.amin(part, 1, out=bmin[lo:lo + rows])
    return Blocks(torch.maximum(bmax, bmin.neg_(), out=bmax), size)


def _ge_from_blocks(a: torch.Tensor, t: torch.Tensor, blocks: Blocks
                    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(indices ascending, their |a|) of every |a_i| >= t, reading only the blocks whose maximum
    passes; None when so many pass that a scan of the whole is cheaper."""
    bmax, size = blocks
    nb = bmax.numel()
    sel = torch.nonzero(bmax >= t).view(-1)
    if sel.numel() > BLOCKS_UNTIL * nb:
        return None
    sub = a[:nb * size].view(nb, size).index_select(0, sel).abs_().view(-1)
    pos = torch.nonzero(sub >= t).view(-1)
    shift = size.bit_length() - 1
    idx = sel.index_select(0, pos >> shift).mul_(size).add_(pos & (size - 1))
    mag = sub.index_select(0, pos)
    if nb * size < a.numel():  # the tail, tested entry by entry
        tail = a[nb * size:].abs()
        ti = torch.nonzero(tail >= t).view(-1)
        idx = torch.cat((idx, ti + nb * size))
        mag = torch.cat((mag, tail.index_select(0, ti)))
    return idx, mag


def _ge_wordwise(a: torch.Tensor, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices ascending, their |a|) of every |a_i| >= t: one scan into a reused bool buffer,
    ``nonzero`` over it read as int64 words, then over the bytes of the nonzero words."""
    n = a.numel()
    mag = torch.abs(a, out=scratch.get(n, a.dtype, a.device, "mag"))
    padded = -(-n // 8) * 8
    mask = scratch.get(padded, torch.bool, a.device, "mask")
    torch.ge(mag, t, out=mask[:n])
    if padded > n:
        mask[n:] = False
    words = mask.view(torch.uint8).view(torch.int64)
    w = torch.nonzero(words).view(-1)
    pos = torch.nonzero(words.index_select(0, w).view(torch.uint8)).view(-1)
    idx = w.index_select(0, pos >> 3).mul_(8).add_(pos & 7)
    return idx, mag.index_select(0, idx)


def at_least(a: torch.Tensor, t: torch.Tensor, blocks: Optional[Blocks] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices ascending, their |a|) of every |a_i| >= t, exactly: through ``blocks`` when given
    and selective enough, else by a word-wise scan."""
    x = numpy_view(a)
    if x is not None:
        idx, mag = ge_numpy(x, float(t))
        return torch.from_numpy(idx), torch.from_numpy(mag)
    if blocks is not None:
        found = _ge_from_blocks(a, t, blocks)
        if found is not None:
            return found
    return _ge_wordwise(a, t)


def threshold_indices(a: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (int64, ascending) of every |a| >= threshold (compared in a's dtype)."""
    a = a.reshape(-1)
    x = numpy_view(a)
    if x is not None:
        return torch.from_numpy(ge_numpy(x, np.asarray(threshold, dtype=x.dtype))[0])
    t = torch.tensor(threshold, dtype=a.dtype, device=a.device)
    found = gpu_select.threshold(a, t)  # CUDA tensors: the Triton kernels (torch_ops.gpu)
    if found is not None:
        return found
    if a.numel() < DIRECT_BELOW:
        return torch.nonzero(a.abs() >= t).view(-1)
    return _ge_wordwise(a, t)[0]


# -- exact top-k -------------------------------------------------------------------------------
def topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |a| (ties toward the lower index), sorted ascending, as int64.

    The same set as ``hvdcompress.reference.topk_indices`` in every case; see the module doc for
    how it avoids a full top-k on large tensors."""
    if a.dim() != 1:
        a = a.reshape(-1)
    n = a.numel()
    if k >= n:
        return torch.arange(n, device=a.device)
    if k <= 0:
        return empty_indices(a.device)
    if k == 1:
        return _argmax_first(a)
    if n < NATIVE_DIRECT_BELOW:
        idx = native_topk_small(a, k)
        if idx is not None:
            return idx
    x = numpy_view(a)
    if x is not None:
        return torch.from_numpy(np_topk(x, k))
    if n < DIRECT_BELOW:
        return _direct(a, k)
    if not a.is_contiguous():
        a = a.contiguous()
    found = gpu_select.topk(a, k)  # CUDA tensors: the Triton kernels (torch_ops.gpu)
    if found is not None:
        return found
    stride = topk_sample_stride(n)
    sample = a[stride // 2::stride].abs()
    m = sample.numel()
    ks = sample_k(k, m, n)
    for slack in (4, 16):  # the threshold: `slack` standard deviations below the estimate
        r = ks + int(slack * math.sqrt(ks)) + slack
        if 8 * r > m:  # a dense selection: a candidate set would be no cheaper than the whole
            break
        t = torch.topk(sample, r, sorted=False).values.min()
        if not bool(t > 0):  # everything would pass
            break
        size = block_size(r / m)
        if size is not None:
            found = _ge_from_blocks(a, t, block_absmax(a, size))
            if found is None:  # far more candidates than the sample said: no cheaper than the whole
                break
            idx, mag = found
        else:
            idx, mag = _ge_wordwise(a, t)
        if idx.numel() >= k:  # every entry of the answer has |a| >= the k-th largest >= t
            return idx if idx.numel() == k else idx.index_select(0, topk_positions(mag, k))
    return topk_positions(a.abs(), k)


def add_and_topk(r: torch.Tensor, g: torch.Tensor, k: int) -> torch.Tensor:
    """Error feedback's compensation and selection: r <- r + g in place, then
    ``topk_indices(r, k)``; fused into one pass by ``cpu_selection.add_and_topk`` where the
    compiled kernels serve r and g."""
    added, found = gpu_select.add_and_topk(r, g, k)  # CUDA tensors: the Triton kernels
    if added:
        return topk_indices(r, k) if found is None else found
    found = cpu_selection.add_and_topk(r, g, k)
    return topk_indices(r.add_(g), k) if found is None else found
