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
* **Scans with numpy on CPU.** {|a| >= t} is found chunk by chunk (|a| and the mask stay in
  cache) with numpy, reading the tensor's memory in place: numpy's compare and nonzero are
  several times faster than torch's, and a numpy call costs a fraction of a torch call, which
  decides the speed on small tensors.
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

from . import native

CHUNK = 1 << 18       # entries per chunk of the fused DGC loop (stays in the core's cache)
DIRECT_BELOW = 4096   # torch: tensors smaller than this take the direct path (one topk)
SAMPLE_SIZE = 32768   # top-k's threshold sample: at most this many entries ...
SAMPLE_EVERY = 64     # ... and every SAMPLE_EVERY-th entry up to that size
NP_CHUNK = 1 << 18    # entries per chunk of the numpy scan (|x| and the mask stay in cache)
NP_PARTITION_UPTO = 4096  # k-th largest by numpy's partition up to this size, torch's topk above
NP_DIRECT_BELOW = 2048    # numpy: smaller tensors take one partition of the whole
BLOCKS_UNTIL = 0.35   # block filter while at most this fraction of the blocks passes
NATIVE_DIRECT_BELOW = 1 << 15  # compiled kernels: smaller tensors take one nth_element of the whole

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


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


_scratch = _Scratch()


def _empty(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def _numpy_view(a: torch.Tensor) -> Optional[np.ndarray]:
    """The tensor's memory as a numpy array (no copy), where numpy can read it: CPU, a float
    dtype numpy has, contiguous. Numpy's compare and nonzero are several times faster than
    torch's on CPU, and a numpy call costs a fraction of a torch call."""
    if not a.is_cpu or a.dtype not in _NUMPY_DTYPES or not a.is_contiguous() or a.is_neg():
        return None
    return (a.detach() if a.requires_grad else a).numpy()


_NATIVE_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_work = {}


def _kernels(x: np.ndarray):
    """(library, dtype suffix) when the compiled kernels serve x (float32/float64), else None."""
    suffix = _NATIVE_SUFFIX.get(x.dtype)
    if suffix is None:
        return None
    lib = native.lib()
    return None if lib is None else (lib, suffix)


def _ptr(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def _native_ge(kern, x: np.ndarray, t, cap: int) -> np.ndarray:
    """Indices (ascending) of every |x_i| >= t, one compiled pass (a second one if more than
    ``cap`` pass)."""
    lib, suffix = kern
    fn = getattr(lib, "hvdc_ge_" + suffix)
    n = x.size
    cap = max(1, min(n, cap))
    out = np.empty(cap, np.int64)
    c = fn(_ptr(x), n, float(t), _ptr(out), cap)
    if c > cap:
        out = np.empty(c, np.int64)
        fn(_ptr(x), n, float(t), _ptr(out), c)
    return out[:c]


_TORCH_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _native_topk_small(a: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """The k largest |a| (ties to the lower index), ascending, by the compiled kernel (a min-heap
    of k or an nth_element, then one scan), for a contiguous CPU float32/float64 tensor with
    0 < k < a.numel(); None where the kernel does not apply (other tensors, no library, a NaN).
    Pointers come from torch (numpy's are several times dearer to read on a tiny tensor)."""
    suffix = _TORCH_SUFFIX.get(a.dtype)
    if suffix is None or not a.is_cpu or not a.is_contiguous():
        return None
    lib = native.lib()
    if lib is None:
        return None
    n = a.numel()
    work = _work.get(a.dtype)
    if work is None or work[0].numel() < n:
        buf = torch.empty(max(n, NATIVE_DIRECT_BELOW), dtype=a.dtype)
        work = _work[a.dtype] = (buf, buf.data_ptr())
    out = torch.empty(k, dtype=torch.int64)
    c = getattr(lib, "hvdc_topk_small_" + suffix)(a.data_ptr(), n, k, out.data_ptr(), work[1])
    return out if c == k else None


def _ge_numpy(x: np.ndarray, t, cap: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(indices ascending, their |x|) of every |x_i| >= t (compared in x's dtype), chunk by chunk
    so that |x| and the mask stay in cache: one read of x (with the compiled kernels: one pass
    that writes the indices alone; ``cap`` the number expected)."""
    t = x.dtype.type(t)
    n = x.size
    kern = _kernels(x)
    if kern is not None:
        idx = _native_ge(kern, x, t, cap or max(1024, n // 64))
        return idx, np.abs(x[idx])
    if n <= NP_CHUNK:
        mag = np.abs(x)
        idx = (mag >= t).nonzero()[0]
        return idx, mag[idx]
    buf, mask = np.empty(NP_CHUNK, x.dtype), np.empty(NP_CHUNK, np.bool_)
    idxs, mags = [], []
    for lo in range(0, n, NP_CHUNK):
        xc = x[lo:lo + NP_CHUNK]
        b, m = buf[:xc.size], mask[:xc.size]
        np.abs(xc, out=b)
        np.greater_equal(b, t, out=m)
        pos = m.nonzero()[0]
        if pos.size:
            mags.append(b[pos])
            pos += lo
            idxs.append(pos)
    if not idxs:
        return np.empty(0, np.int64), np.empty(0, x.dtype)
    return np.concatenate(idxs), np.concatenate(mags)


def _sample_stride(n: int) -> int:
    """Top-k's threshold sample: every n/64-th entry (at least 512 entries, at most SAMPLE_SIZE,
    never more than every 8th)."""
    m = min(SAMPLE_SIZE, max(n // SAMPLE_EVERY, min(512, n // 8)))
    return max(1, n // max(m, 1))


def _np_kth_largest(y: np.ndarray, k: int):
    """The k-th largest entry of y (0 < k <= y.size), as y's scalar type."""
    c = y.size
    if c <= NP_PARTITION_UPTO:
        return np.partition(y, c - k)[c - k]
    t = torch.from_numpy(y)
    if 2 * k <= c:
        w = torch.topk(t, k, sorted=False).values.min()
    else:
        w = torch.topk(t, c - k + 1, largest=False, sorted=False).values.max()
    return y.dtype.type(w.item())


def _np_positions(y: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest entries of y, ties toward the lower position
    (0 < k < y.size): every position > the k-th largest value w, then the first ones == w."""
    w = _np_kth_largest(y, k)
    keep = y >= w
    if np.count_nonzero(keep) == k:  # no tie at the boundary
        return keep.nonzero()[0]
    keep = y > w
    eq = (y == w).nonzero()[0]
    keep[eq[:k - np.count_nonzero(keep)]] = True  # the lowest positions equal to w
    return keep.nonzero()[0]


def _np_topk(x: np.ndarray, k: int) -> np.ndarray:
    """``topk_indices`` in numpy (1 < k < x.size): see the module doc."""
    n = x.size
    if n < NP_DIRECT_BELOW:
        return _np_positions(np.abs(x), k)
    stride = _sample_stride(n)
    sample = np.abs(x[stride // 2::stride])
    m = sample.size
    ks = sample_k(k, m, n)
    for slack in (4, 16):  # the threshold: `slack` standard deviations below the estimate
        r = ks + int(slack * math.sqrt(ks)) + slack
        if 8 * r > m:  # a dense selection: a candidate set would be no cheaper than the whole
            break
        t = _np_kth_largest(sample, r)
        if t == 0:  # the sample is mostly zeros: the tensor's few nonzeros hold the answer
            found = _np_mostly_zero(x, k)
            if found is not None:
                return found
        if not t > 0:  # everything would pass
            break
        idx, mag = _ge_numpy(x, t, 2 * (r * n // m) + 1024)
        if idx.size >= k:  # every entry of the answer has |x| >= the k-th largest >= t
            return idx if idx.size == k else idx[_np_positions(mag, k)]
    return _np_positions(np.abs(x), k)


def _np_mostly_zero(x: np.ndarray, k: int) -> Optional[np.ndarray]:
    """``topk_indices`` of a tensor that is mostly zeros (a gradient that is zero, or nearly: a
    frozen or unused part of a model): its nonzero entries, when there are at least k, hold the
    answer; otherwise all of them and then the lowest-index zeros (|0| ties at the bottom). One
    scan instead of a top-k over the whole; None (the caller's general path) if a NaN is among
    the nonzeros."""
    nz = np.flatnonzero(x)
    if nz.size and np.isnan(x[nz]).any():
        return None
    if nz.size >= k:
        return nz if nz.size == k else nz[_np_positions(np.abs(x[nz]), k)]
    picked, need, lo = [nz], k - nz.size, 0
    while need > 0:
        zeros = np.flatnonzero(x[lo:lo + NP_CHUNK] == 0)[:need]
        picked.append(zeros + lo)
        need -= zeros.size
        lo += NP_CHUNK
    return np.sort(np.concatenate(picked))


# -- exact top-k among a set -------------------------------------------------------------------
def _kth_largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry (0-dim), from a topk of the smaller side."""
    c = mag.numel()
    if 2 * k <= c:
        return torch.topk(mag, k, sorted=False).values.min()
    return torch.topk(mag, c - k + 1, largest=False, sorted=False).values.max()


def _topk_positions(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the k largest entries of ``mag``, ties toward the lower position;
    0 < k < mag.numel(): every position > the k-th largest value w, then the first ones == w."""
    y = _numpy_view(mag)
    if y is not None:
        return torch.from_numpy(_np_positions(y, k))
    w = _kth_largest(mag, k)
    keep = mag > w
    need = k - int(keep.sum())
    eq = mag == w
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


def _argmax_first(a: torch.Tensor) -> torch.Tensor:
    """[index of the largest |a|] (the first among equals), as a 1-element int64 tensor."""
    x = _numpy_view(a)
    if x is not None:  # numpy's argmax: the first occurrence
        return torch.from_numpy(np.abs(x).argmax(keepdims=True).astype(np.int64, copy=False))
    return torch.argmax(a.abs()).view(1)  # documented: the first maximal value


def _direct(a: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of a small tensor: one topk of k+1 (sorted) shows whether the k-th and (k+1)-th
    largest differ; if they do, topk's set is the only answer."""
    mag = a.abs()
    if k <= 64:
        vals, idx = torch.topk(mag, k + 1)
        lo = vals[k - 1:].tolist()
        if lo[0] > lo[1]:
            return idx[:k].sort().values
    return _topk_positions(mag, k)


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
    bmin = _scratch.get(nb, a.dtype, a.device, "bmin")
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
    mag = torch.abs(a, out=_scratch.get(n, a.dtype, a.device, "mag"))
    padded = -(-n // 8) * 8
    mask = _scratch.get(padded, torch.bool, a.device, "mask")
    torch.ge(mag, t, out=mask[:n])
    if padded > n:
        mask[n:] = False
    words = mask.view(torch.uint8).view(torch.int64)
    w = torch.nonzero(words).view(-1)
    pos = torch.nonzero(words.index_select(0, w).view(torch.uint8)).view(-1)
    idx = w.index_select(0, pos >> 3).mul_(8).add_(pos & 7)
    return idx, mag.index_select(0, idx)


def _at_least(a: torch.Tensor, t: torch.Tensor, blocks: Optional[Blocks] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices ascending, their |a|) of every |a_i| >= t, exactly: through ``blocks`` when given
    and selective enough, else by a word-wise scan."""
    x = _numpy_view(a)
    if x is not None:
        idx, mag = _ge_numpy(x, float(t))
        return torch.from_numpy(idx), torch.from_numpy(mag)
    if blocks is not None:
        found = _ge_from_blocks(a, t, blocks)
        if found is not None:
            return found
    return _ge_wordwise(a, t)


def threshold_indices(a: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (int64, ascending) of every |a| >= threshold (compared in a's dtype)."""
    a = a.reshape(-1)
    x = _numpy_view(a)
    if x is not None:
        return torch.from_numpy(_ge_numpy(x, np.asarray(threshold, dtype=x.dtype))[0])
    t = torch.tensor(threshold, dtype=a.dtype, device=a.device)
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
        return _empty(a.device)
    if k == 1:
        return _argmax_first(a)
    if n < NATIVE_DIRECT_BELOW:
        idx = _native_topk_small(a, k)
        if idx is not None:
            return idx
    x = _numpy_view(a)
    if x is not None:
        return torch.from_numpy(_np_topk(x, k))
    if n < DIRECT_BELOW:
        return _direct(a, k)
    if not a.is_contiguous():
        a = a.contiguous()
    stride = _sample_stride(n)
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
            return idx if idx.numel() == k else idx.index_select(0, _topk_positions(mag, k))
    return _topk_positions(a.abs(), k)


def add_and_topk(r: torch.Tensor, g: torch.Tensor, k: int) -> torch.Tensor:
    """Error feedback's compensation and selection: r <- r + g in place, then
    ``topk_indices(r, k)``. With the compiled kernels (contiguous CPU float32/float64, a candidate
    threshold from a strided sample of g + r computed beforehand) the addition and the candidate
    scan are one pass; the exact tie rule then runs among the candidates. Too few or too many
    candidates: the general path on the updated r (same answer, one more scan)."""
    n = r.numel()
    suffix = _TORCH_SUFFIX.get(r.dtype)
    lib = native.lib() if suffix is not None else None
    if (lib is None or g.dtype != r.dtype or not (r.is_cpu and g.is_cpu) or n < NATIVE_DIRECT_BELOW
            or not (1 < k < n) or not (r.is_contiguous() and g.is_contiguous()) or r.dim() != 1):
        return topk_indices(r.add_(g), k)
    x, gx = _numpy_view(r), _numpy_view(g)
    if x is None or gx is None:
        return topk_indices(r.add_(g), k)
    stride = _sample_stride(n)
    sample = np.abs(gx[stride // 2::stride] + x[stride // 2::stride])  # g + r, as the update rounds it
    m = sample.size
    ks = sample_k(k, m, n)
    rr = ks + int(4 * math.sqrt(ks)) + 4  # the threshold 4 standard deviations below the estimate
    t = _np_kth_largest(sample, rr) if 8 * rr <= m else 0
    if not t > 0:  # a dense selection, or everything passes: no candidate set to gain from
        return topk_indices(r.add_(g), k)
    cap = min(n, 2 * (rr * n // m) + 1024)
    out = torch.empty(cap, dtype=torch.int64)
    c = getattr(lib, "hvdc_add_ge_" + suffix)(g.data_ptr(), r.data_ptr(), n, float(t), out.data_ptr(), cap)
    if c < k or c > cap:  # the sample misled (r is updated already): the general path
        return topk_indices(r, k)
    idx = out.numpy()[:c]
    return torch.from_numpy(idx if c == k else idx[_np_positions(np.abs(x[idx]), k)])


# -- DGC's sampled threshold -------------------------------------------------------------------
