"""Top-k and DGC's selection on the Triton kernels: a sampled threshold, one compacting pass.

``topk(a, k)`` / ``add_and_topk(r, g, k)``: the exact top-k (ties toward the lower index, NaN
last: ``hvdcompress.reference.topk_indices``) without a ``torch.topk`` over the tensor. A
threshold t from a strided sample, a few standard deviations below the estimated k-th largest
|a|, gives candidates {|a| >= t} in one pass; when at least k pass, the answer lies among them.
For float32 (``_topk_keys``): one launch takes the sample (``sample_abs``, with error feedback
of r + g), one ``torch.topk`` of the sample gives its r largest, one launch takes their least as
t and compacts the candidates as int64 keys (|a|'s bits, then the reversed index: the k largest
keys are the oracle's top-k, ties included; with error feedback the pass also does r <- r + g),
and one host sync reads their count (whether they hold the answer); then a ``topk`` and a
``sort`` of the keys give the indices. Float64 takes ``at_least`` and the tie rule on (index,
|a|) lists. When too few (or far too many) candidates pass they return None (``add_and_topk``:
after the addition, which the caller's torch branch then must not repeat -- it runs
``topk_indices`` on r) and the torch ops decide.

``threshold(a, t)``: every |a| >= t, the threshold compressor's selection, in one pass and one
host sync (the payload's size is the data's).

``accumulate_and_select(...)``: DGC's update in one pass (``dgc_update``), then the oracle's
sampled-threshold rule (``hvdcompress.sampling``): the same sample, threshold and adaptation as
the torch branch, so the same indices; float32 by candidate keys, one launch and one host sync
per adaptation step (the threshold computed in the launch).

Buffers reused across calls (the sample, the counter, the keys) assume the kernels of one device
run on one stream, one exchange after another (as every front end launches them).

Every function returns None where the kernels do not serve (``torch_ops.gpu.serves``; float32 or
float64 contiguous tensors), and the caller runs the torch ops.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

from hvdcompress.sampling import ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, sample_k, sample_stride

from . import serves

BLOCK = 1024
SAMPLE = 1 << 14  # top-k's sample: about this many entries, every n // SAMPLE-th


def _fits(*ts) -> bool:
    first = ts[0]
    return (serves(first) and first.dtype in (torch.float32, torch.float64)
            and all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous() and not t.is_neg()
                    and t.numel() == first.numel() for t in ts))


_room = {}  # per device: the most candidates an uncapped pass has found (its next guess of room)


def at_least(a: torch.Tensor, t: torch.Tensor, g: Optional[torch.Tensor] = None,
             cap: Optional[int] = None, mags: bool = True) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(indices ascending, their |a|, count) of every |a_i| >= t (a 0-dim tensor on a's
    device); with ``g``, a <- a + g first, in the same pass. With ``cap``, the lists hold at most
    cap entries (count says how many passed); without, the room is the most an earlier pass on
    this device found (at least 4,096), and the pass is rerun (without the addition) with room
    for all when that was short. ``mags=False``: the |a| list is left unsorted (not needed)."""
    from . import select_kernels as K

    n = a.numel()
    room = min(n, cap if cap is not None else max(4096, _room.get(a.device, 0)))
    t = t.reshape(1).to(a.dtype)
    grid = (max(1, -(-n // BLOCK)),)
    add = g is not None
    while True:
        idx = torch.empty(max(room, 1), dtype=torch.int64, device=a.device)
        mag = torch.empty(max(room, 1), dtype=a.dtype, device=a.device)
        count = torch.zeros(1, dtype=torch.int64, device=a.device)
        K.at_least[grid](a, g if add else a, t, idx, mag, count, room, n, ADD=add, BLOCK=BLOCK,
                         enable_fp_fusion=False)
        c = int(count.item())  # the host sync: how many passed (the payload's size)
        if cap is None and c > _room.get(a.device, 0):
            _room[a.device] = c
        if c <= room or cap is not None:
            break
        room, add = c, False
    kept = min(c, room)
    idx, mag = idx[:kept], mag[:kept]
    if kept > 1:
        if not mags:
            return torch.sort(idx).values, mag, c
        order = torch.sort(idx).indices
        idx, mag = idx.index_select(0, order), mag.index_select(0, order)
    return idx, mag, c


def _top_among(idx: torch.Tensor, mag: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of ``mag`` (no NaN), ties toward the lower index; idx ascending."""
    c = idx.numel()
    if c == k:
        return idx
    w = torch.topk(mag, k, sorted=False).values.min()
    keep = mag > w
    eq = mag == w
    need = k - keep.sum()
    return idx[keep | (eq & (torch.cumsum(eq, 0) <= need))]


def _candidate_threshold(sample: torch.Tensor, k: int, n: int, slack: int) -> Optional[torch.Tensor]:
    m = sample.numel()
    ks = sample_k(k, m, n)
    r = ks + int(slack * math.sqrt(ks)) + slack
    if 8 * r > m:  # a dense selection: a candidate set would be no cheaper than the whole
        return None
    return torch.topk(sample, r, sorted=False).values.min()


class _Work:
    """Per-device buffers reused by every selection (kernels on one stream run one after
    another): the sample, the counter, the candidates' keys (grown to the largest cap asked)."""

    def __init__(self, device):
        self.sample = torch.empty(2 * SAMPLE + 1, dtype=torch.float32, device=device)
        self.count = torch.zeros(2, dtype=torch.int64, device=device)  # (candidates, whether t > 0)
        self.keys = torch.empty(0, dtype=torch.int64, device=device)

    def keys_for(self, cap: int) -> torch.Tensor:
        if self.keys.numel() < cap:
            self.keys = torch.empty(cap, dtype=torch.int64, device=self.count.device)
        return self.keys


_work = {}


def _work_on(device) -> _Work:
    w = _work.get(device)
    if w is None:
        w = _work[device] = _Work(device)
    return w


def _topk_keys(a: torch.Tensor, k: int, g: Optional[torch.Tensor]) -> Tuple[bool, Optional[torch.Tensor]]:
    """Float32 top-k by candidate keys (``at_least_keys``): one sample launch, one ``topk`` of
    the sample, one compacting launch, one host sync (the candidates' count: whether they hold
    the answer), then the k largest keys. (whether g was added, the indices or None)."""
    from . import select_kernels as K

    n = a.numel()
    stride = max(1, n // SAMPLE)
    start = stride // 2
    m = len(range(start, n, stride))
    w = _work_on(a.device)
    sample = w.sample[:m]
    add = g is not None
    K.sample_abs[(-(-m // BLOCK),)](a, g if add else a, sample, w.count, start, stride, m, ADD=add, BLOCK=BLOCK)
    added = False
    ks = sample_k(k, m, n)
    cap = max(4 * k, 4096)
    keys = w.keys_for(cap)
    for slack in (4, 16):
        r = ks + int(slack * math.sqrt(ks)) + slack
        if 8 * r > m:  # a dense selection: a candidate set would be no cheaper than the whole
            break
        if slack != 4:
            w.count.zero_()
        tv = torch.topk(sample, r, sorted=False).values
        K.at_least_keys[(max(1, -(-n // BLOCK)),)](a, g if add else a, tv, r, 1.0, 0, keys, w.count, cap, n,
                                                  ADD=add and not added, BLOCK=BLOCK,
                                                  TB=max(16, 1 << (r - 1).bit_length()), enable_fp_fusion=False)
        added = added or add
        c = w.count.tolist()[0]  # the one host sync: whether the candidates hold the answer
        if c > cap:  # far more candidates than the sample said (or t <= 0: every entry passed)
            break
        if c >= k:
            return added, _indices_of(keys[:c], k)
    return added, None


def _indices_of(keys: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
    """The indices (int64, ascending) of the k largest candidate keys (all of them: k None)."""
    if k is not None and keys.numel() > k:
        keys = torch.topk(keys, k, sorted=False).values
    low = torch.sort(torch.bitwise_and(keys, 0xFFFFFFFF), descending=True).values
    return 0xFFFFFFFF - low


def _topk(a: torch.Tensor, k: int, g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a.dtype == torch.float32 and a.numel() < (1 << 31):
        added, found = _topk_keys(a, k, g)
        if g is not None and not added:
            a.add_(g)
        return found
    n = a.numel()
    stride = max(1, n // SAMPLE)
    if g is None:
        sample = a[stride // 2::stride].abs()
    else:  # the sample of a + g, before the pass adds it
        sample = (a[stride // 2::stride] + g[stride // 2::stride]).abs()
    sample = torch.where(torch.isnan(sample), -1.0, sample)  # NaN ranks last (topk would put it first)
    added = False
    for slack in (4, 16):
        t = _candidate_threshold(sample, k, n, slack)
        if t is None or not bool(t > 0):
            break
        idx, mag, c = at_least(a, t, None if added else g, cap=max(4 * k, 4096))
        added = added or g is not None
        if c > idx.numel():  # far more candidates than the sample said
            break
        if c >= k:
            return _top_among(idx, mag, k)
    if g is not None and not added:
        a.add_(g)
    return None


def topk(a: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """The exact top-k indices (int64 ascending) of a 1-D tensor, or None (module doc)."""
    if not (0 < k < a.numel()) or a.dim() != 1 or not _fits(a):
        return None
    return _topk(a, k, None)


def threshold(a: torch.Tensor, t: torch.Tensor) -> Optional[torch.Tensor]:
    """Indices (int64, ascending) of every |a| >= t (0-dim, a's dtype) in one pass, or None."""
    if a.dim() != 1 or not a.is_contiguous() or not _fits(a):
        return None
    return at_least(a, t, mags=False)[0]


def add_and_topk(r: torch.Tensor, g: torch.Tensor, k: int) -> Tuple[bool, Optional[torch.Tensor]]:
    """(whether r <- r + g was done, the top-k of r or None): with None after the addition, the
    caller finds the top-k of r by the torch ops, without adding again."""
    if not (0 < k < r.numel()) or r.dim() != 1 or g.shape != r.shape or not _fits(r, g):
        return False, None
    return True, _topk(r, k, g)


def take(v: torch.Tensor, idx: torch.Tensor, wire_dtype: Optional[torch.dtype] = None,
         u: Optional[torch.Tensor] = None):
    """The values v[idx] and then v[idx] <- 0 (u given: u[idx] <- 0 too) in one launch, for
    distinct int64 indices; with ``wire_dtype``, (indices in that dtype, values). None where the
    kernels do not serve (the caller's torch ops: ``index_select`` and ``index_fill_``)."""
    if (v.dim() != 1 or idx.dim() != 1 or idx.dtype != torch.int64 or not idx.is_contiguous()
            or idx.device != v.device or not _fits(v, *(() if u is None else (u,)))):
        return None
    from . import select_kernels as K

    k = idx.numel()
    vals = torch.empty(k, dtype=v.dtype, device=v.device)
    wire = None if wire_dtype is None else torch.empty(k, dtype=wire_dtype, device=v.device)
    if k:
        K.take_zero[(-(-k // BLOCK),)](idx, v, v if u is None else u, vals if wire is None else wire, vals, k,
                                       HAS_U=u is not None, WIRE=wire is not None, BLOCK=BLOCK)
    return vals if wire is None else (wire, vals)


def accumulate_and_select(g, u, v, momentum, nesterov, k, sample_ratio, adapt_iters, offset
                          ) -> Tuple[bool, Optional[torch.Tensor]]:
    """(whether DGC's update was done, the selected indices or None): with None after the
    update, the caller selects from v by the torch ops (the same rule), without updating again."""
    n = v.numel()
    if k <= 0 or v.dim() != 1 or g.dim() != 1 or not _fits(v, g, *(() if momentum is None else (u,))):
        return False, None
    from . import select_kernels as K

    m = torch.tensor(0.0 if momentum is None else momentum, dtype=v.dtype, device=v.device).reshape(1)
    K.dgc_update[(max(1, -(-n // BLOCK)),)](g, v if momentum is None else u, v, m, n, MOMENTUM=momentum is not None,
                                            NESTEROV=bool(nesterov), BLOCK=BLOCK, enable_fp_fusion=False)
    sample = v[offset::sample_stride(sample_ratio)].abs()
    ks = sample_k(k, sample.numel(), n)
    if v.dtype == torch.float32 and n < (1 << 31) and ks <= MAX_TV:
        return True, _dgc_keys(v, k, torch.topk(sample, ks, sorted=False).values, ks, adapt_iters)
    thr = torch.topk(sample, ks, sorted=False).values.min()
    lower = torch.tensor(LOWER_FACTOR, dtype=v.dtype, device=v.device)
    idx = None
    for it in range(adapt_iters + 1):
        if not bool(thr > 0):  # every entry passes: the torch ops' exact top-k of the whole
            return True, None
        idx, mag, c = at_least(v, thr, cap=None)
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return True, _top_among(idx, mag, k)
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return True, idx
        thr = thr * lower
    return True, idx


MAX_TV = 4096  # the most sample values the compacting kernel takes the least of


def _dgc_keys(v: torch.Tensor, k: int, tv: torch.Tensor, ks: int, adapt_iters: int) -> Optional[torch.Tensor]:
    """DGC's sampled-threshold rule on float32 v by candidate keys: per adaptation one compacting
    launch (the threshold, min(tv) * LOWER_FACTOR^it, computed in it) and one host sync (the
    count, and whether the threshold is > 0: None when not, the torch ops then decide)."""
    from . import select_kernels as K

    n = v.numel()
    w = _work_on(v.device)
    lower = float(np.float32(LOWER_FACTOR))
    tb = max(16, 1 << (ks - 1).bit_length())
    for it in range(adapt_iters + 1):
        room = min(n, max(4096, 2 * k, _room.get(("keys", v.device), 0)))
        while True:
            keys = w.keys_for(room)
            w.count.zero_()
            K.at_least_keys[(max(1, -(-n // BLOCK)),)](v, v, tv, ks, lower, it, keys, w.count, room, n, ADD=False,
                                                      BLOCK=BLOCK, TB=tb, enable_fp_fusion=False)
            c, positive = w.count.tolist()  # the one host sync of this adaptation step
            if not positive:  # every entry passes: the torch ops' exact top-k of the whole
                return None
            if c <= room:
                break
            room = _room[("keys", v.device)] = c
        if 10 * c > ACCEPT_HIGH_TENTHS * k:
            return _indices_of(keys[:c], k)
        if 10 * c >= ACCEPT_LOW_TENTHS * k or it == adapt_iters:
            return _indices_of(keys[:c])
    return None
