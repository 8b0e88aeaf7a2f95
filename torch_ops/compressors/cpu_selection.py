"""Top-k and threshold scans over CPU memory: numpy reading the tensor in place, and the optional
compiled kernels (``native.py``). ``selection.py`` calls these first for contiguous CPU float
tensors and keeps the torch-only paths (other devices and dtypes); every function here gives
the same answer as ``hvdcompress.reference.selection`` (ties toward the lower index).

``_np_topk``      exact top-k from a candidate set {|x| >= t}, t from a strided sample a few
                  standard deviations below the k-th largest (see ``selection``'s module doc)
``_np_mostly_zero``  the shortcut for a tensor that is mostly zeros
``_ge_numpy``     every |x| >= t, chunk by chunk (or one compiled pass)
``add_and_topk``  error feedback's r += g fused with the candidate scan (compiled kernels)
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

from hvdcompress.sampling import sample_k

from . import native

SAMPLE_SIZE = 32768   # top-k's threshold sample: at most this many entries ...
SAMPLE_EVERY = 64     # ... and every SAMPLE_EVERY-th entry up to that size
NP_CHUNK = 1 << 18    # entries per chunk of the numpy scan (|x| and the mask stay in cache)
NP_PARTITION_UPTO = 4096  # k-th largest by numpy's partition up to this size, torch's topk above
NP_DIRECT_BELOW = 2048    # numpy: smaller tensors take one partition of the whole
NATIVE_DIRECT_BELOW = 1 << 15  # compiled kernels: smaller tensors take one nth_element of the whole

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def _numpy_view(a: torch.Tensor) -> Optional[np.ndarray]:
    """The tensor's memory as a numpy array (no copy), where numpy can read it: CPU, a float
    dtype numpy has, contiguous. Numpy's compare and nonzero are several times faster than
    torch's on CPU, and a numpy call costs a fraction of a torch call. None under
    ``native.torch_only()`` (the branch CUDA tensors take)."""
    if native.torch_only() or not a.is_cpu or a.dtype not in _NUMPY_DTYPES or not a.is_contiguous() or a.is_neg():
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


def add_and_topk(r: torch.Tensor, g: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """Error feedback's compensation and selection in one pass: r <- r + g in place, then the
    k largest |r| (ascending), for contiguous 1-D CPU float32/float64 r and g of one dtype with
    n >= NATIVE_DIRECT_BELOW and 1 < k < n, when the compiled kernels are loaded. A candidate
    threshold from a strided sample of g + r is computed beforehand, so the addition and the
    candidate scan are one pass; the exact tie rule then runs among the candidates. Too few or
    too many candidates: the numpy path on the updated r (same answer, one more scan).
    None, with r untouched, where it does not apply."""
    n = r.numel()
    suffix = _TORCH_SUFFIX.get(r.dtype)
    lib = native.lib() if suffix is not None else None
    if (lib is None or g.dtype != r.dtype or not (r.is_cpu and g.is_cpu) or n < NATIVE_DIRECT_BELOW
            or not (1 < k < n) or not (r.is_contiguous() and g.is_contiguous()) or r.dim() != 1):
        return None
    x, gx = _numpy_view(r), _numpy_view(g)
    if x is None or gx is None:
        return None
    stride = _sample_stride(n)
    sample = np.abs(gx[stride // 2::stride] + x[stride // 2::stride])  # g + r, as the update rounds it
    m = sample.size
    ks = sample_k(k, m, n)
    rr = ks + int(4 * math.sqrt(ks)) + 4  # the threshold 4 standard deviations below the estimate
    t = _np_kth_largest(sample, rr) if 8 * rr <= m else 0
    if not t > 0:  # a dense selection, or everything passes: no candidate set to gain from
        r.add_(g)
        return torch.from_numpy(_np_topk(x, k))
    cap = min(n, 2 * (rr * n // m) + 1024)
    out = torch.empty(cap, dtype=torch.int64)
    c = getattr(lib, "hvdc_add_ge_" + suffix)(g.data_ptr(), r.data_ptr(), n, float(t), out.data_ptr(), cap)
    if c < k or c > cap:  # the sample misled (r is updated already): the general path
        return torch.from_numpy(_np_topk(x, k))
    idx = out.numpy()[:c]
    return torch.from_numpy(idx if c == k else idx[_np_positions(np.abs(x[idx]), k)])
