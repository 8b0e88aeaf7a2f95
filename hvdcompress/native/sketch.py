"""The count sketch's compiled kernels at the numpy level, shared by both backends.

``kernels.cpp``'s ``sk_update_sketch`` updates the momentum and error (u = m*u + g; v = v + u) and
adds v into every row's signed cells in one pass, the hashes computed inline from the rows' two
short tables (``hvdcompress.hashing``); ``sk_estimates_abs`` writes |lower median over rows of
s_j(i) * S[j, h_j(i)]| of every entry. Both follow ``hvdcompress.reference.sketch`` (cells summed
in index order), so the table and the estimates are the oracle's bit for bit.

``Kernels(lib, keys, d, cols)`` holds the tables (cached across steps: a tensor is hashed with the
same keys every step) and takes raw addresses of float32 buffers: PyTorch passes its tensors'
``data_ptr()`` and updates u and v in place, TensorFlow passes numpy arrays and has the new state
written to other buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np

from .. import hashing

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
