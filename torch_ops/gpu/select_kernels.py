"""Top-k's and DGC's Triton kernels (imports triton; ``torch_ops.gpu.select`` launches them).

    sample_abs   |a + g| at a strided sample (NaN as -1), and the counter zeroed
    at_least_keys  top-k's candidates (float32): every |a| >= t, t the least of the sample's r
                 largest, compacted as int64 keys ordered as the oracle ranks (|a|, then the
                 lower index); with ADD, a <- a + g first
    at_least     every entry with |a| >= t (t read from device memory: no host round trip),
                 compacted into (index, |a|) lists: each program counts its passing entries,
                 reserves their places with one atomic add and writes them in index order;
                 with ADD, first a <- a + g in place (error feedback's compensation, fused)
    take_zero    the sent values v[idx] (and the wire's indices), then v[idx] <- 0 (and u[idx])
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
def sample_abs(a_ptr, g_ptr, out_ptr, count_ptr, start, stride, m, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """out[j] = |a + g| at entry start + j * stride (j < m), NaN as -1 (ranked below every
    number); program 0 also zeroes the counter the compacting pass that follows adds to."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < m
    i = start + j * stride
    a = tl.load(a_ptr + i, mask=valid, other=0.0)
    if ADD:
        a = a + tl.load(g_ptr + i, mask=valid, other=0.0)
    mag = tl.abs(a)
    tl.store(out_ptr + j, tl.where(mag == mag, mag, -1.0), mask=valid)
    if pid == 0:
        tl.store(count_ptr, 0)


@triton.jit
def at_least_keys(a_ptr, g_ptr, tv_ptr, nt, lower, times, keys_ptr, count_ptr, cap, n,
                  ADD: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr):
    """Float32 candidates: t = min(tv[0:nt]) (a sample's r largest: t is the r-th), times
    ``lower`` ``times`` times (DGC's adaptation, each product rounded as a float32 multiply),
    then every |a_i| >= t compacted as one int64 key (|a_i|'s bits << 32 | 0xFFFFFFFF - i): the
    larger key is the larger |a|, among equal ones the lower index, so the k largest keys are
    the exact top-k with the oracle's tie rule. With ADD, a <- a + g first, in place. Program 0
    writes whether t > 0 into count_ptr[1] (read with the count: one host sync)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, TB)
    t = tl.min(tl.load(tv_ptr + offs, mask=offs < nt, other=float("inf")), 0)
    for _ in range(times):
        t = t * lower
    if pid == 0:
        tl.store(count_ptr + 1, (t > 0).to(tl.int64))
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    a = tl.load(a_ptr + i, mask=valid, other=0.0)
    if ADD:
        a = a + tl.load(g_ptr + i, mask=valid, other=0.0)
        tl.store(a_ptr + i, a, mask=valid)
    mag = tl.abs(a)
    hit = (mag >= t) & valid
    cnt = tl.sum(hit.to(tl.int32), 0)
    if cnt > 0:
        base = tl.atomic_add(count_ptr, cnt.to(tl.int64))
        at = base + tl.cumsum(hit.to(tl.int64), 0) - 1
        key = (mag.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0xFFFFFFFF - i)
        tl.store(keys_ptr + at, key, mask=hit & (at < cap))


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
def take_zero(idx_ptr, v_ptr, u_ptr, wire_ptr, vals_ptr, k, HAS_U: tl.constexpr, WIRE: tl.constexpr,
              BLOCK: tl.constexpr):
    """The sent values v[idx] (and, with WIRE, the indices in the wire's dtype), then v[idx] <- 0
    (and u[idx] <- 0): the indices are distinct, so each entry is read and zeroed by one thread."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < k
    i = tl.load(idx_ptr + j, mask=valid, other=0)
    val = tl.load(v_ptr + i, mask=valid, other=0.0)
    tl.store(vals_ptr + j, val, mask=valid)
    if WIRE:
        tl.store(wire_ptr + j, i.to(wire_ptr.dtype.element_ty), mask=valid)
    tl.store(v_ptr + i, tl.zeros_like(val), mask=valid)
    if HAS_U:
        tl.store(u_ptr + i, tl.zeros_like(val), mask=valid)


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
