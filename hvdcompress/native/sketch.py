"""The count sketch's compiled kernels at the numpy level, shared by both backends.

``kernels.cpp``'s ``sk_update_sketch`` updates the momentum and error (u = m*u + g; v = v + u) and
adds v into every row's signed cells in one pass, the hashes computed inline from the rows' two
short tables (``hvdcompress.hashing``); ``sk_estimates_abs`` writes |lower median over rows of
s_j(i) * S[j, h_j(i)]| of every entry. Both follow ``hvdcompress.reference.sketch`` (cells summed
in index order), so the table and the estimates are the oracle's bit for bit.

The sketch pass sweeps v once per row (the first sweep fused with the u/v update) when the rows'
cells together would not stay in cache: random additions into cells that miss the cache cost far
more than reading v again.

``Kernels.candidates`` gives the P*k largest |estimate| (``topk_indices``' set: ties toward the
lower index) without writing or scanning d estimates: a threshold t from the |estimates| of a
strided sample (``sk_estimates_abs_at``, ``select.topk``'s sample and slack), then the entries with
|estimate| >= t (``sk_estimates_ge``: an entry needs a majority of its rows' cells with |S| >= t,
tested on a bitmask of c bits a row that stays in cache, before its estimate is computed); the
exact rule among those. Too few or too many pass: the next slack, then every estimate and
``select.topk_any``.

``Kernels(lib, keys, d, cols)`` holds the tables (cached across steps: a tensor is hashed with the
same keys every step) and takes raw addresses of float32 buffers: PyTorch passes its tensors'
``data_ptr()`` and updates u and v in place, TensorFlow passes numpy arrays and has the new state
written to other buffers.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np

from .. import hashing
from ..sampling import sample_k
from . import select

MAX_ROWS = 32  # the kernels' limit
TABLE_CACHE_BYTES = 64 << 20
_cache: "OrderedDict[tuple, tuple]" = OrderedDict()


def row_tables(keys: tuple, d: int):
    """(LOW, HIGH) of every row as uint32 arrays (rows x len), from a small LRU cache."""
    key = (tuple(keys), int(d))
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    pairs = [hashing.tables(rk, d) for rk in keys]
    hit = (np.ascontiguousarray(np.stack([lo for lo, _ in pairs]).astype(np.uint32)),
           np.ascontiguousarray(np.stack([hi for _, hi in pairs]).astype(np.uint32)))
    _cache[key] = hit
    total = sum(a.nbytes + b.nbytes for a, b in _cache.values())
    while total > TABLE_CACHE_BYTES and len(_cache) > 1:
        a, b = _cache.popitem(last=False)[1]
        total -= a.nbytes + b.nbytes
    return hit


class Kernels:
    """One tensor's sketch on the compiled kernels (rows <= MAX_ROWS, d >= 1)."""

    def __init__(self, lib, keys, d: int, cols: int):
        hashing.check_cols(cols)
        self.lib, self.d, self.rows, self.cols = lib, int(d), len(keys), int(cols)
        self.low, self.high = row_tables(tuple(keys), d)

    @staticmethod
    def serves(rows: int, d: int) -> bool:
        return 1 <= rows <= MAX_ROWS and d >= 1

    def update_sketch(self, g: int, u: int, v: int, m: float, table: int,
                      u_in: Optional[int] = None, v_in: Optional[int] = None) -> None:
        """u = m*u + g; v = v + u (read from u_in / v_in when given, else in place), and the
        rows x cols count sketch of the new v into the float32 buffer at ``table``."""
        m = float(np.float32(m))
        if u_in is None:
            rc = self.lib.hvdc_sk_update_sketch(g, u, v, self.d, m, self.low.ctypes.data, self.high.ctypes.data,
                                                self.rows, self.cols, table)
        else:
            rc = self.lib.hvdc_sk_update_sketch_to(g, u_in, v_in, u, v, self.d, m, self.low.ctypes.data,
                                                   self.high.ctypes.data, self.rows, self.cols, table)
        if rc != 0:
            raise RuntimeError("sketch: the compiled kernel refused its arguments")

    def estimates_abs(self, table: int, out: int) -> None:
        """|estimate| of every entry from the float32 rows x cols table at ``table`` into ``out``."""
        rc = self.lib.hvdc_sk_estimates_abs(table, self.d, self.low.ctypes.data, self.high.ctypes.data, self.rows,
                                            self.cols, out)
        if rc != 0:
            raise RuntimeError("sketch: the compiled kernel refused its arguments")

    def estimates_abs_at(self, table: int, start: int, stride: int, m: int) -> np.ndarray:
        """|estimate| of the m entries start, start + stride, ... (float32)."""
        out = np.empty(m, np.float32)
        rc = self.lib.hvdc_sk_estimates_abs_at(table, self.d, self.low.ctypes.data, self.high.ctypes.data,
                                               self.rows, self.cols, start, stride, m, out.ctypes.data)
        if rc != 0:
            raise RuntimeError("sketch: the compiled kernel refused its arguments")
        return out

    def estimates_ge(self, table: int, t: float, cap: int):
        """(indices ascending, their |estimate|) of every entry with |estimate| >= t > 0, or None
        where so many cells pass t that computing every estimate is cheaper."""
        cap = max(1, min(self.d, int(cap)))
        while True:
            idx, mag = np.empty(cap, np.int64), np.empty(cap, np.float32)
            c = self.lib.hvdc_sk_estimates_ge(table, self.d, self.low.ctypes.data, self.high.ctypes.data, self.rows,
                                              self.cols, float(t), idx.ctypes.data, mag.ctypes.data, cap)
            if c == -2:
                return None
            if c < 0:
                raise RuntimeError("sketch: the compiled kernel refused its arguments")
            if c <= cap:
                return idx[:c], mag[:c]
            cap = c

    def candidates(self, table: int, count: int, est: Optional[Callable[[], np.ndarray]] = None) -> np.ndarray:
        """Indices (int64, ascending) of the ``count`` largest |estimate| from the float32 rows x
        cols table at ``table``, ties toward the lower index (the oracle's ``topk_indices`` of the
        estimates). ``est``: gives a float32 buffer of d entries for the fallback (every estimate)."""
        n, count = self.d, int(count)
        if 1 < count < n and n >= select.NATIVE_DIRECT_BELOW:
            stride = select.topk_sample_stride(n)
            m = (n - stride // 2 - 1) // stride + 1
            sample = self.estimates_abs_at(table, stride // 2, stride, m)
            ks = sample_k(count, m, n)
            for slack in (4, 16):  # the threshold: `slack` standard deviations below the estimate
                r = ks + int(slack * math.sqrt(ks)) + slack
                if 8 * r > m:  # a dense selection: no cheaper than every estimate
                    break
                t = select.kth_largest(sample, r)
                if not t > 0:  # zeros (or NaN) in the sample: every estimate
                    break
                found = self.estimates_ge(table, t, 2 * (r * n // m) + 1024)
                if found is None:
                    break
                idx, mag = found
                if idx.size >= count:  # the answer's |estimate| are all >= the count-th largest >= t
                    return idx if idx.size == count else idx[select.positions(mag, count)]
        buf = est() if est is not None else np.empty(n, np.float32)
        self.estimates_abs(table, buf.ctypes.data)
        nan = np.isnan(buf)
        if 1 < count < n and nan.any():  # NaN ranks last (the oracle's order), below every number
            buf[nan] = -1
            return select.positions(buf, count)
        return select.topk_any(buf, count)
