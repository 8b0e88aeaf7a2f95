"""The count sketch's Triton kernels (imports triton; ``torch_ops.gpu.sketch`` launches them).

Every entry's signed cell in each row is computed inline from the row's two short tables
(``hvdcompress.hashing``: y = ((((HIGH[i >> 16] ^ LOW[i & 0xFFFF]) * C3) & M) * 2c) >> 32, in
int64 as every port computes it), entries along the first axis of a block and rows along the
second (R, the rows padded to a power of two).

    update_sketch  u <- m*u + g; v <- v + u, then v added into each row's signed cell with
                   atomic adds (one pass over g, u, v; the cells' sums are the table's, in an
                   order the atomics choose: float rounding may differ from the oracle's
                   index-order sums in the last bits, as the torch ops' index_add_ on a GPU)
    estimates      each entry's lower median over rows of s_j(i) * S[j, h_j(i)]: the rows'
                   values as order-preserving int32 keys (NaN above +inf, as np.sort puts it
                   last; the padding rows above every key), each row ranked among the rows
                   (R x R comparisons), the key of rank (r - 1) // 2
"""

from __future__ import annotations

import triton
import triton.language as tl

C3 = tl.constexpr(0x2545F491)
M32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _cells(i, rows, low_ptr, high_ptr, n_low, n_high, cols2):
    """y_j(i) (int64) for entries i ([B, 1]) and rows ([1, R])."""
    lo = tl.load(low_ptr + rows * n_low + (i & 0xFFFF))
    hi = tl.load(high_ptr + rows * n_high + (i >> 16))
    z = ((hi ^ lo) * C3) & M32
    return (z * cols2) >> 32


@triton.jit
def update_sketch(g_ptr, u_ptr, v_ptr, m_ptr, cells_ptr, low_ptr, high_ptr, n, r, n_low, n_high, cols2,
                  R: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    m = tl.load(m_ptr)
    u = tl.load(u_ptr + i, mask=valid, other=0.0) * m + tl.load(g_ptr + i, mask=valid, other=0.0)
    v = tl.load(v_ptr + i, mask=valid, other=0.0) + u
    tl.store(u_ptr + i, u, mask=valid)
    tl.store(v_ptr + i, v, mask=valid)
    rows = tl.arange(0, R)[None, :].to(tl.int64)
    ok = valid[:, None] & (rows < r)
    y = _cells(tl.where(valid, i, 0)[:, None], tl.where(rows < r, rows, 0), low_ptr, high_ptr, n_low, n_high, cols2)
    tl.atomic_add(cells_ptr + rows * cols2 + y, tl.broadcast_to(v[:, None], (BLOCK, R)), mask=ok)


@triton.jit
def estimates(table_ptr, out_ptr, low_ptr, high_ptr, n, r, n_low, n_high, cols2,
              R: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    rows = tl.arange(0, R)[None, :].to(tl.int64)
    live = rows < r
    y = _cells(tl.where(valid, i, 0)[:, None], tl.where(live, rows, 0), low_ptr, high_ptr, n_low, n_high, cols2)
    s = tl.load(table_ptr + rows * (cols2 // 2) + (y >> 1), mask=valid[:, None] & live, other=0.0)
    val = tl.where((y & 1) == 1, -s, s)
    bits = val.to(tl.int32, bitcast=True)
    bits = tl.where(val != val, 0x7FC00000, bits)  # one NaN, sorted above +inf
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(live, key, 0x7FFFFFFF)
    # each row's rank among the rows (ties by row), then the key ranked (r - 1) // 2
    ri = tl.arange(0, R)[None, :, None]
    rj = tl.arange(0, R)[None, None, :]
    ki = key[:, :, None]
    kj = key[:, None, :]
    before = (ki < kj) | ((ki == kj) & (ri < rj))
    rank = tl.sum(before.to(tl.int32), axis=1)
    mid = tl.sum(tl.where(rank == (r - 1) // 2, key, 0), axis=1)
    back = mid ^ ((mid >> 31) & 0x7FFFFFFF)
    tl.store(out_ptr + i, back.to(tl.float32, bitcast=True), mask=valid)
