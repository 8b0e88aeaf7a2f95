"""Top-k, DGC's sampled threshold and DGC's fused step at the numpy level, shared by both backends.

Every function takes numpy arrays (a framework's CPU tensor seen in place: ``Tensor.numpy()`` in
PyTorch, what ``tf.numpy_function`` hands over in TensorFlow) and gives exactly what
``hvdcompress.reference`` gives (ties toward the lower index); the compiled kernels
(``hvdcompress.native.lib()``) do the scans when they are loaded, numpy otherwise.

``topk``           exact top-k from a candidate set {|x| >= t}, t from a strided sample a few
                   standard deviations below the k-th largest (``torch_ops.compressors.selection``'s
                   module doc says why this is exact); ``topk_any`` for any k
``mostly_zero``    the shortcut for a tensor that is mostly zeros
``ge``             every |x| >= t, chunk by chunk (or one compiled pass)
``sampled_select`` DGC's rule on a sample (``hvdcompress.sampling``)
``add_topk``       error feedback's r = r_in + g fused with the candidate scan (compiled kernels)
``dgc_select``     DGC's u/v update, its sample and candidates in one compiled pass, then the rule
``take_and_zero``  DGC's send and masking: v[idx], then v[idx] = 0 (and u[idx] = 0)

The state may be updated in place (``r_in is r``) or read from one buffer and written to another
(TensorFlow, whose variables are not written behind its back). ``kth`` is the k-th largest
function the callers use (numpy's partition by default; PyTorch passes its ``topk``-based one).
"""

from __future__ import annotations

import ctypes
import math
from typing import Callable, Optional, Tuple

import numpy as np

from ..sampling import ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, sample_k, sample_stride as dgc_stride
from . import lib as _lib

SAMPLE_SIZE = 32768   # top-k's threshold sample: at most this many entries ...
SAMPLE_EVERY = 64     # ... and every SAMPLE_EVERY-th entry up to that size
NP_CHUNK = 1 << 18    # entries per chunk of the numpy scan (|x| and the mask stay in cache)
NP_DIRECT_BELOW = 2048    # numpy: smaller tensors take one partition of the whole
NATIVE_DIRECT_BELOW = 1 << 15  # compiled kernels: smaller tensors take one pass over the whole
SUBSAMPLE = 8  # DGC's start threshold is estimated from every SUBSAMPLE-th entry of its sample

SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}

Kth = Callable[[np.ndarray, int], object]
Buffer = Callable[[int, object, str], np.ndarray]


def kth_largest(y: np.ndarray, k: int):
    """The k-th largest entry of y (0 < k <= y.size), as y's scalar type."""
    return np.partition(y, y.size - k)[y.size - k]


def _new(n: int, dtype, role: str) -> np.ndarray:
    return np.empty(n, dtype)


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _kernels(x: np.ndarray):
    """(library, dtype suffix) when the compiled kernels serve x (float32/float64), else None."""
    suffix = SUFFIX.get(x.dtype)
    if suffix is None:
        return None
    lib = _lib()
    return None if lib is None else (lib, suffix)


def _native_ge(kern, x: np.ndarray, t, cap: int) -> np.ndarray:
    """Indices (ascending) of every |x_i| >= t, one compiled pass (a second one if more than
    ``cap`` pass)."""
    lib, suffix = kern
    fn = getattr(lib, "hvdc_ge_" + suffix)
    n = x.size
    cap = max(1, min(n, cap))
    out = np.empty(cap, np.int64)
    c = fn(address(x), n, float(t), address(out), cap)
    if c > cap:
        out = np.empty(c, np.int64)
        fn(address(x), n, float(t), address(out), c)
    return out[:c]


def ge(x: np.ndarray, t, cap: int = 0) -> Tuple[np.ndarray, np.ndarray]:
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


def topk_sample_stride(n: int) -> int:
    """Top-k's threshold sample: every n/64-th entry (at least 512 entries, at most SAMPLE_SIZE,
    never more than every 8th)."""
    m = min(SAMPLE_SIZE, max(n // SAMPLE_EVERY, min(512, n // 8)))
    return max(1, n // max(m, 1))


def positions(y: np.ndarray, k: int, kth: Kth = kth_largest) -> np.ndarray:
    """Positions (ascending) of the k largest entries of y, ties toward the lower position
    (0 < k < y.size): every position > the k-th largest value w, then the first ones == w."""
    w = kth(y, k)
    keep = y >= w
    c = np.count_nonzero(keep)
    if c == k:  # no tie at the boundary
        return keep.nonzero()[0]
    if c < k:  # only with NaN in y, which the partition ranks above every number
        return positions_nan_last(y, k, kth)
    keep = y > w
    eq = (y == w).nonzero()[0]
    keep[eq[:k - np.count_nonzero(keep)]] = True  # the lowest positions equal to w
    return keep.nonzero()[0]


def positions_nan_last(y: np.ndarray, k: int, kth: Kth = kth_largest) -> np.ndarray:
    """``positions`` with NaN ranked below every number, as the oracle ranks it (NaN never
    takes the place of a number; NaN positions fill up from the lowest when there are fewer
    than k numbers)."""
    nan = np.isnan(y)
    num = (~nan).nonzero()[0]
    if k < num.size:
        return num[positions(y[num], k, kth)]
    return np.sort(np.concatenate([num, nan.nonzero()[0][:k - num.size]]))


def topk(x: np.ndarray, k: int, kth: Kth = kth_largest) -> np.ndarray:
    """``topk_indices`` (int64, ascending) of a flat array, 1 < k < x.size: see the module doc."""
    n = x.size
    if n < NP_DIRECT_BELOW:
        return positions(np.abs(x), k, kth)
    stride = topk_sample_stride(n)
    sample = np.abs(x[stride // 2::stride])
    m = sample.size
    ks = sample_k(k, m, n)
    for slack in (4, 16):  # the threshold: `slack` standard deviations below the estimate
        r = ks + int(slack * math.sqrt(ks)) + slack
        if 8 * r > m:  # a dense selection: a candidate set would be no cheaper than the whole
            break
        t = kth(sample, r)
        if t == 0:  # the sample is mostly zeros: the tensor's few nonzeros hold the answer
            found = mostly_zero(x, k, kth)
            if found is not None:
                return found
        if not t > 0:  # everything would pass
            break
        idx, mag = ge(x, t, 2 * (r * n // m) + 1024)
        if idx.size >= k:  # every entry of the answer has |x| >= the k-th largest >= t
            return idx if idx.size == k else idx[positions(mag, k, kth)]
    return positions(np.abs(x), k, kth)


def topk_any(x: np.ndarray, k: int, kth: Kth = kth_largest) -> np.ndarray:
    """``topk_indices`` (int64, ascending) for any k: none, all, the first largest |x| (NaN never
    before a number, as the oracle's order), or ``topk``."""
    n = x.size
    if k <= 0:
        return np.empty(0, np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 1:
        mag = np.abs(x)
        return np.array([np.argmax(np.where(mag != mag, mag.dtype.type(-1), mag))], np.int64)
    return topk(x, k, kth)


def mostly_zero(x: np.ndarray, k: int, kth: Kth = kth_largest) -> Optional[np.ndarray]:
    """``topk_indices`` of a tensor that is mostly zeros (a gradient that is zero, or nearly: a
    frozen or unused part of a model): its nonzero entries, when there are at least k, hold the
    answer; otherwise all of them and then the lowest-index zeros (|0| ties at the bottom). One
    scan instead of a top-k over the whole; None (the caller's general path) if a NaN is among
    the nonzeros."""
    nz = np.flatnonzero(x)
    if nz.size and np.isnan(x[nz]).any():
        return None
    if nz.size >= k:
        return nz if nz.size == k else nz[positions(np.abs(x[nz]), k, kth)]
    picked, need, lo = [nz], k - nz.size, 0
    while need > 0:
        zeros = np.flatnonzero(x[lo:lo + NP_CHUNK] == 0)[:need]
        picked.append(zeros + lo)
        need -= zeros.size
        lo += NP_CHUNK
    return np.sort(np.concatenate(picked))


def add_topk(g: np.ndarray, r_in: np.ndarray, r: np.ndarray, k: int, kth: Kth = kth_largest) -> Optional[np.ndarray]:
    """Error feedback's compensation and selection in one pass: r = r_in + g (r_in may be r: in
    place), then the k largest |r| (int64, ascending), for flat contiguous float32/float64 arrays
    of one dtype with n >= NATIVE_DIRECT_BELOW and 1 < k < n, when the compiled kernels are
    loaded. A candidate threshold from a strided sample of g + r_in is computed beforehand, so the
    addition and the candidate scan are one pass; the exact tie rule then runs among the
    candidates. Too few or too many candidates: ``topk`` on the updated r (same answer, one more
    scan). None, with r untouched, where it does not apply."""
    n = r.size
    kern = _kernels(r)
    if kern is None or g.dtype != r.dtype or r_in.dtype != r.dtype or n < NATIVE_DIRECT_BELOW or not (1 < k < n):
        return None
    lib, suffix = kern
    stride = topk_sample_stride(n)
    sample = np.abs(g[stride // 2::stride] + r_in[stride // 2::stride])  # g + r, as the update rounds it
    m = sample.size
    ks = sample_k(k, m, n)
    rr = ks + int(4 * math.sqrt(ks)) + 4  # the threshold 4 standard deviations below the estimate
    t = kth(sample, rr) if 8 * rr <= m else 0
    if not t > 0:  # a dense selection, or everything passes: no candidate set to gain from
        np.add(r_in, g, out=r)
        return topk(r, k, kth)
    cap = min(n, 2 * (rr * n // m) + 1024)
    out = np.empty(cap, np.int64)
    if r_in is r:
        c = getattr(lib, "hvdc_add_ge_" + suffix)(address(g), address(r), n, float(t), address(out), cap)
    else:
        c = getattr(lib, "hvdc_add_ge_to_" + suffix)(address(g), address(r_in), address(r), n, float(t),
                                                     address(out), cap)
    if c < k or c > cap:  # the sample misled (r is updated already): the general path
        return topk(r, k, kth)
    idx = out[:c]
    return idx if c == k else idx[positions(np.abs(r[idx]), k, kth)]


def sampled_select(x: np.ndarray, k: int, sample: np.ndarray, adapt_iters: int, kth: Kth = kth_largest) -> np.ndarray:
    """Indices (int64, ascending) chosen by DGC's sampled threshold on |x| from ``sample`` (|x| at
    the sampled positions): the threshold arithmetic in x's dtype, as the oracle's."""
    n = x.size
    if k <= 0:
        return np.empty(0, np.int64)
    thr = kth(sample, sample_k(k, sample.size, n))
    if thr != thr:  # NaN ranks first in the oracle's sorted sample: its threshold selects nothing
        return np.empty(0, np.int64)
    lower = x.dtype.type(LOWER_FACTOR)
    idx = None
    for it in range(adapt_iters + 1):
        if not thr > 0:  # |x| >= 0 everywhere: no filter to apply
            mag, idx = np.abs(x), np.arange(n)
        else:
            idx, mag = ge(x, thr)
        c = idx.size
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return idx[positions(mag, k, kth)]
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return idx
        thr = thr * lower
    return idx


def _start_threshold(lib, suffix, g, u_in, v_in, n, m, mode, k, offset, stride, sample, kth, buffer) -> float:
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
        sub_stride, ms = stride, sample.size
        r = sample_k(k, ms, n)
    buf = buffer(ms, v_in.dtype, "dgc_subsample") if sub_stride != stride else sample
    getattr(lib, "hvdc_dgc_sample_" + suffix)(address(g), address(u_in), address(v_in), n, m, mode, offset,
                                              sub_stride, address(buf))
    t0 = kth(buf, r)
    return float(t0) if t0 > 0 else float("inf")


def dgc_select(g: np.ndarray, u_in: np.ndarray, v_in: np.ndarray, u: np.ndarray, v: np.ndarray,
               momentum: Optional[float], nesterov: bool, k: int, sample_ratio: float, adapt_iters: int,
               offset: int, kth: Kth = kth_largest, buffer: Buffer = _new) -> Optional[np.ndarray]:
    """DGC's state update and selection in one compiled pass over g, u and v, for flat contiguous
    float32/float64 arrays of one dtype (``u_in is u`` and ``v_in is v``: in place; else the new
    state into u and v), k > 0; None (nothing written) without the kernels.

        momentum given:  u = m*u_in + g;  v = v_in + u   (nesterov: v = v_in + (g + m*u))
        momentum None:   v = v_in + g

    The pass (``dgc_pass``) updates u and v and, with v still in registers, writes DGC's sample
    of the new |v| and collects candidates {i : |v_i| >= t} with their |v|. It starts at t0, a few
    standard deviations below the k-th largest, estimated beforehand from an eighth of the sample
    computed at its positions as the update will compute them (``_start_threshold``), so about
    2-3k entries are collected. The list is capped at 8k + 4096 entries and tightens itself
    instead of overflowing (t raised to the (cap/2)-th largest collected, the list cut there:
    still exact for the final t). Then the rule runs: thr0 from the whole sample (exact), and the
    candidates while its threshold is >= the list's; when it needs a lower one (fewer than 0.8k
    passed thr0: the x0.8 adaptation, or an estimate that missed) v is scanned again, so the
    answer is always the rule's. ``buffer(n, dtype, role)`` gives work arrays (PyTorch reuses its
    own)."""
    kern = _kernels(v)
    if kern is None or k <= 0 or not (g.dtype == u.dtype == v.dtype == u_in.dtype == v_in.dtype):
        return None
    lib, suffix = kern
    sep = not (u_in is u and v_in is v)
    n = v.size
    dt = v.dtype.type
    mode, m = (0, 0.0) if momentum is None else ((2 if nesterov else 1), momentum)
    stride = dgc_stride(sample_ratio)
    sample = buffer(len(range(offset, n, stride)), v.dtype, "dgc_sample")
    cap = 8 * k + 4096
    if 4 * cap > n:  # a dense selection: no list, the rule scans v
        cap, t0 = 0, float("inf")
    else:
        t0 = _start_threshold(lib, suffix, g, u_in, v_in, n, m, mode, k, offset, stride, sample, kth, buffer)
    cidx = buffer(cap, np.int64, "dgc_idx")
    cmag = buffer(cap, v.dtype, "dgc_mag")
    work = buffer(cap, v.dtype, "dgc_work")
    t_have = (ctypes.c_float if suffix == "f32" else ctypes.c_double)()
    args = (n, m, mode, offset, stride, address(sample), t0, address(cidx), address(cmag), cap, address(work),
            ctypes.byref(t_have))
    if sep:
        c = getattr(lib, "hvdc_dgc_pass_to_" + suffix)(address(g), address(u_in), address(v_in), address(u),
                                                       address(v), *args)
    else:
        c = getattr(lib, "hvdc_dgc_pass_" + suffix)(address(g), address(u), address(v), *args)
    thr0 = kth(sample, sample_k(k, sample.size, n))
    lower = dt(LOWER_FACTOR)
    t_have = dt(t_have.value)  # the list holds exactly the indices with |v| >= t_have
    if cap == 0 or c < 0 or not thr0 > 0:  # no (usable) candidate list, or no filter: the rule on the updated v
        return sampled_select(v, k, sample, adapt_iters, kth)
    cidx, cmag = cidx[:c], cmag[:c]
    thr = thr0
    idx = None
    for it in range(adapt_iters + 1):  # the rule of sampled_select, on the candidates while thr >= t_have
        if not thr > 0:
            mag, idx = np.abs(v), np.arange(n)
        elif thr >= t_have:
            keep = cmag >= thr
            idx, mag = cidx[keep], cmag[keep]
        else:
            idx, mag = ge(v, thr, 2 * k + 1024)
        c = idx.size
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return idx[positions(mag, k, kth)]
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return idx
        thr = thr * lower
    return idx


def take_and_zero(v: np.ndarray, u: Optional[np.ndarray], idx: np.ndarray) -> np.ndarray:
    """DGC's send and masking on flat contiguous arrays: the values v[idx], then v[idx] = 0 and
    (u given) u[idx] = 0; one compiled loop over the indices where the kernels serve, else numpy."""
    kern = _kernels(v)
    idx = np.ascontiguousarray(idx, np.int64)
    if kern is not None and (u is None or u.dtype == v.dtype):
        lib, suffix = kern
        values = np.empty(idx.size, v.dtype)
        if getattr(lib, "hvdc_take_and_zero_" + suffix)(address(v), None if u is None else address(u), v.size,
                                                        address(idx), idx.size, address(values)) == idx.size:
            return values
    values = v[idx]
    v[idx] = 0
    if u is not None:
        u[idx] = 0
    return values
