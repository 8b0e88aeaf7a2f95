"""Top-k's and DGC's Triton kernels (imports triton; ``torch_ops.gpu.select`` launches them).

    at_least     every entry with |a| >= t (t read from device memory: no host round trip),
                 compacted into (index, |a|) lists: each program counts its passing entries,
                 reserves their places with one atomic add and writes them in index order;
                 with ADD, first a <- a + g in place (error feedback's compensation, fused)
    dgc_update   DGC's state update in one pass: u <- m*u + g; v <- v + u (Nesterov:
                 v <- v + (g + m*u)); without momentum v <- v + g

The lists come back in the order the programs reserved their places; the caller sorts them by
index (they hold about k entries), so the selection does not depend on that order. Launched
without FMA contraction: every float operation rounds as the torch ops' do.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def at_least(a_ptr, g_ptr, t_ptr, idx_ptr, mag_ptr, count_ptr, cap, n,
             ADD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    a = tl.load(a_ptr + i, mask=valid, other=0.0)
    if ADD:
        a = a + tl.load(g_ptr + i, mask=valid, other=0.0)
        tl.store(a_ptr + i, a, mask=valid)
    mag = tl.abs(a)
    hit = (mag >= tl.load(t_ptr)) & valid
    cnt = tl.sum(hit.to(tl.int32), 0)
    if cnt > 0:
        base = tl.atomic_add(count_ptr, cnt.to(tl.int64))
        at = base + tl.cumsum(hit.to(tl.int64), 0) - 1
        ok = hit & (at < cap)
        tl.store(idx_ptr + at, i, mask=ok)
        tl.store(mag_ptr + at, mag, mask=ok)


@triton.jit
def dgc_update(g_ptr, u_ptr, v_ptr, m_ptr, n, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    g = tl.load(g_ptr + i, mask=valid, other=0.0)
    v = tl.load(v_ptr + i, mask=valid, other=0.0)
    if MOMENTUM:
        m = tl.load(m_ptr)
        u = tl.load(u_ptr + i, mask=valid, other=0.0) * m + g
        tl.store(u_ptr + i, u, mask=valid)
        if NESTEROV:
            v = v + (g + u * m)
        else:
            v = v + u
    else:
        v = v + g
    tl.store(v_ptr + i, v, mask=valid)
