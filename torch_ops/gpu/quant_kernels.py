"""The quantizers' Triton kernels (imports triton; ``torch_ops.gpu.quant`` launches them).

Layout (``hvdcompress.reference.quantizers``): segments tile the flat tensor (a bucket of a
member, or the member); the payload is ``[float32 scales | codes packed BITS per entry]`` in
``hvdcompress.packing``'s little-endian bit stream. An entry finds its segment from the member
table (``moff``: each non-empty member's offset, ``mfirst``: its first segment) by a binary
search of LOG steps, then ``(i - offset) // bucket`` inside the member.

    seg_reduce     pass 1: per chunk of a segment (the work list), the float64 partial sums of
                   the segment's reduction (efsignsgd: sum |a|; onebit: sum and count of the
                   entries >= 0, sum of the others; qsgd: sum a^2) or its max |a| (terngrad);
                   the segment's last chunk to finish then sums its partials in order: the
                   float32 scales into the payload and the factor pass 2 uses (qsgd: levels /
                   norm). One launch: the finish needs no launch of its own
    codes          pass 2: codes, packed 8 entries at a time, and the residual a - decoded
    col_reduce     onebit:scope=column's pass 1: per tile of a member's rows x columns, the
                   columns' partials; the column block's last tile writes the columns' scales
    decode_sum     every rank's decoded payload summed in rank order, times the average's scale

Every float operation is the oracle's, in its order (launched without FMA contraction; float32
divisions correctly rounded by ``div_rn``, float64 ones are on every target). The float64 sums
add in another order than numpy's: their float32 roundings are the oracle's unless a float64 sum
lies within float64 rounding of a float32 tie.
"""

from __future__ import annotations

import triton
import triton.language as tl

SIGN = tl.constexpr(0)
EFSIGN = tl.constexpr(1)
ONEBIT = tl.constexpr(2)
TERN = tl.constexpr(3)
QSGD = tl.constexpr(4)
GOLDEN = tl.constexpr(0x61C88647)
M1 = tl.constexpr(0x21F0AAAD)
M2 = tl.constexpr(0x735A2D97)


@triton.jit
def _a_at(x_ptr, r_ptr, idx, m, HAS_R: tl.constexpr):
    """a = x + r (r + x: the residual memory's order, the same float32 sum) at idx."""
    a = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        a = tl.load(r_ptr + idx, mask=m, other=0.0) + a
    return a


@triton.jit
def _segment_of(i, moff_ptr, mfirst_ptr, nm, bucket, LOG: tl.constexpr, BUCKETED: tl.constexpr,
                mcols_ptr=None, COLUMNS: tl.constexpr = False):
    """Each entry's segment: the last member whose offset is <= i, then its bucket (COLUMNS:
    its column, the member viewed as (rows, mcols))."""
    lo = tl.zeros(i.shape, dtype=tl.int32)
    for step in tl.static_range(LOG):
        cand = lo + (1 << (LOG - 1 - step))
        off = tl.load(moff_ptr + cand, mask=cand < nm, other=0x7FFFFFFFFFFFFFFF)
        lo = tl.where(off <= i, cand, lo)
    seg = tl.load(mfirst_ptr + lo)
    if COLUMNS:
        seg = seg + (i - tl.load(moff_ptr + lo)) % tl.load(mcols_ptr + lo)
    elif BUCKETED:
        seg = seg + (i - tl.load(moff_ptr + lo)) // bucket
    return seg


@triton.jit
def _uniform(i, base):
    """hvdcompress.rng.uniform's entry i of the stream whose constant is base (uint32)."""
    h = i.to(tl.uint32) * GOLDEN + tl.cast(base, tl.uint32)
    h = h ^ (h >> 16)
    h = h * M1
    h = h ^ (h >> 15)
    h = h * M2
    h = h ^ (h >> 15)
    return (h >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _finish(part_ptr, p0, p1, cnt, s, scales_ptr, factor_ptr, levels, KIND: tl.constexpr, FB: tl.constexpr):
    """Segment s's partials p0..p1-1 (written by other programs: volatile loads) in order: its
    float32 scales into the payload and the factor the codes pass uses (qsgd: levels / norm)."""
    offs = tl.arange(0, FB)
    if KIND == ONEBIT:
        ps = tl.zeros((FB,), dtype=tl.float64)
        pn = tl.zeros((FB,), dtype=tl.float64)
        ns = tl.zeros((FB,), dtype=tl.float64)
        for j in range(p0, p1, FB):
            m = j + offs < p1
            ps += tl.load(part_ptr + 3 * (j + offs), mask=m, other=0.0, volatile=True)
            pn += tl.load(part_ptr + 3 * (j + offs) + 1, mask=m, other=0.0, volatile=True)
            ns += tl.load(part_ptr + 3 * (j + offs) + 2, mask=m, other=0.0, volatile=True)
        psum = tl.sum(ps, 0)
        pcnt = tl.sum(pn, 0)
        nsum = tl.sum(ns, 0)
        ncnt = cnt.to(tl.float64) - pcnt
        pos = tl.where(pcnt > 0, psum / tl.maximum(pcnt, 1.0), 0.0).to(tl.float32)
        neg = tl.where(ncnt > 0, nsum / tl.maximum(ncnt, 1.0), 0.0).to(tl.float32)
        tl.store(scales_ptr + 2 * s, pos)
        tl.store(scales_ptr + 2 * s + 1, neg)
    elif KIND == TERN:
        acc = tl.zeros((FB,), dtype=tl.float64)
        nan = tl.zeros((FB,), dtype=tl.int32)
        for j in range(p0, p1, FB):
            v = tl.load(part_ptr + j + offs, mask=j + offs < p1, other=0.0, volatile=True)
            nan += (v != v).to(tl.int32)
            acc = tl.maximum(acc, v)
        mx = tl.where(tl.sum(nan, 0) > 0, float("nan"), tl.max(acc, 0)).to(tl.float32)
        tl.store(scales_ptr + s, mx)
        tl.store(factor_ptr + s, mx)
    else:
        acc = tl.zeros((FB,), dtype=tl.float64)
        for j in range(p0, p1, FB):
            acc += tl.load(part_ptr + j + offs, mask=j + offs < p1, other=0.0, volatile=True)
        total = tl.sum(acc, 0)
        if KIND == EFSIGN:
            mean = total / cnt.to(tl.float64).to(tl.float32)
            tl.store(scales_ptr + s, mean)
            tl.store(factor_ptr + s, mean)
        else:  # QSGD: the norm, and levels / norm (0 for a zero norm)
            v = tl.sqrt(total).to(tl.float32)
            f = tl.where(v > 0, tl.math.div_rn(levels, tl.where(v > 0, v, 1.0)), 0.0)
            tl.store(scales_ptr + s, v)
            tl.store(factor_ptr + s, f)


@triton.jit
def seg_reduce(x_ptr, r_ptr, wstart_ptr, wlen_ptr, wseg_ptr, pstart_ptr, count_ptr, part_ptr, done_ptr,
               scales_ptr, factor_ptr, levels,
               KIND: tl.constexpr, HAS_R: tl.constexpr, CHUNK: tl.constexpr, FB: tl.constexpr):
    """Pass 1, one launch: each program reduces one chunk of a segment (the work list) into its
    partials; the segment's last program to finish (a counter per segment, reset by it for the
    next launch) sums the segment's partials in order (``_finish``)."""
    w = tl.program_id(0)
    start = tl.load(wstart_ptr + w)
    ln = tl.load(wlen_ptr + w)
    offs = tl.arange(0, CHUNK)
    m = offs < ln
    a = _a_at(x_ptr, r_ptr, start + offs, m, HAS_R)
    if KIND == EFSIGN:
        tl.store(part_ptr + w, tl.sum(tl.abs(a).to(tl.float64), 0))
    elif KIND == ONEBIT:
        a64 = a.to(tl.float64)
        pos = (a >= 0) & m
        tl.store(part_ptr + 3 * w, tl.sum(tl.where(pos, a64, 0.0), 0))
        tl.store(part_ptr + 3 * w + 1, tl.sum(pos.to(tl.float64), 0))
        tl.store(part_ptr + 3 * w + 2, tl.sum(tl.where(pos, 0.0, a64), 0))
    elif KIND == TERN:
        mag = tl.abs(a)
        nan = tl.sum((mag != mag).to(tl.int32), 0) > 0
        mx = tl.where(nan, float("nan"), tl.max(mag, 0))
        tl.store(part_ptr + w, mx.to(tl.float64))
    else:
        a64 = a.to(tl.float64)
        tl.store(part_ptr + w, tl.sum(a64 * a64, 0))
    tl.debug_barrier()  # every thread's partial stored before the counter says so
    s = tl.load(wseg_ptr + w)
    p0 = tl.load(pstart_ptr + s)
    p1 = tl.load(pstart_ptr + s + 1)
    seen = tl.atomic_add(done_ptr + s, 1, sem="acq_rel")
    if seen == p1 - p0 - 1:
        _finish(part_ptr, p0, p1, tl.load(count_ptr + s), s, scales_ptr, factor_ptr, levels, KIND, FB)
        tl.atomic_xchg(done_ptr + s, 0)


@triton.jit
def col_reduce(x_ptr, r_ptr, woff_ptr, wcols_ptr, wcol0_ptr, wrow0_ptr, wrlen_ptr, wcb_ptr,
               cbw_ptr, cbcol_ptr, cbrows_ptr, part_ptr, done_ptr, scales_ptr,
               HAS_R: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
    """onebit:scope=column, pass 1 in one launch: each program reduces a tile of RB rows x CB
    columns of a member (viewed as (rows, cols)) into per-column float64 partials (sum and count
    of the entries >= 0, sum of the others); the column block's last tile to finish sums the
    tiles' partials in row order and writes each column's (pos, neg) means into the payload."""
    w = tl.program_id(0)
    off = tl.load(woff_ptr + w)
    cols = tl.load(wcols_ptr + w)
    col0 = tl.load(wcol0_ptr + w)
    row0 = tl.load(wrow0_ptr + w)
    rlen = tl.load(wrlen_ptr + w)
    rr = tl.arange(0, RB)[:, None]
    cc = tl.arange(0, CB)[None, :]
    m = (rr < rlen) & (col0 + cc < cols)
    idx = off + (row0 + rr).to(tl.int64) * cols + col0 + cc
    a = _a_at(x_ptr, r_ptr, idx, m, HAS_R)
    a64 = a.to(tl.float64)
    pos = (a >= 0) & m
    ck = tl.arange(0, CB)
    base = part_ptr + 3 * (w.to(tl.int64) * CB + ck)
    tl.store(base, tl.sum(tl.where(pos, a64, 0.0), 0))
    tl.store(base + 1, tl.sum(pos.to(tl.float64), 0))
    tl.store(base + 2, tl.sum(tl.where(pos, 0.0, a64), 0))
    tl.debug_barrier()  # every thread's partials stored before the counter says so
    cb = tl.load(wcb_ptr + w)
    w0 = tl.load(cbw_ptr + cb)
    w1 = tl.load(cbw_ptr + cb + 1)
    seen = tl.atomic_add(done_ptr + cb, 1, sem="acq_rel")
    if seen == w1 - w0 - 1:
        ps = tl.zeros((CB,), dtype=tl.float64)
        pn = tl.zeros((CB,), dtype=tl.float64)
        ns = tl.zeros((CB,), dtype=tl.float64)
        for j in range(w0, w1):
            at = part_ptr + 3 * (j * CB + ck)
            ps += tl.load(at, volatile=True)
            pn += tl.load(at + 1, volatile=True)
            ns += tl.load(at + 2, volatile=True)
        ncnt = tl.load(cbrows_ptr + cb).to(tl.float64) - pn
        pmean = tl.where(pn > 0, ps / tl.maximum(pn, 1.0), 0.0).to(tl.float32)
        nmean = tl.where(ncnt > 0, ns / tl.maximum(ncnt, 1.0), 0.0).to(tl.float32)
        c = tl.load(cbcol_ptr + cb) + ck
        live = col0 + ck < cols
        tl.store(scales_ptr + 2 * c, pmean, mask=live)
        tl.store(scales_ptr + 2 * c + 1, nmean, mask=live)
        tl.atomic_xchg(done_ptr + cb, 0)


@triton.jit
def codes(x_ptr, r_ptr, rout_ptr, out_ptr, scales_ptr, factor_ptr, moff_ptr, mfirst_ptr, mcols_ptr, nm, bucket,
          n, nbytes, base, levels, inv_levels,
          KIND: tl.constexpr, BITS: tl.constexpr, HAS_R: tl.constexpr, WRITE_R: tl.constexpr,
          LOG: tl.constexpr, BUCKETED: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    a = _a_at(x_ptr, r_ptr, i, valid, HAS_R)
    nonneg = a >= 0
    if KIND == SIGN:
        code = nonneg.to(tl.int32)
    else:
        seg = _segment_of(i, moff_ptr, mfirst_ptr, nm, bucket, LOG, BUCKETED, mcols_ptr, COLUMNS)
        if KIND == EFSIGN:
            sv = tl.load(factor_ptr + seg, mask=valid, other=0.0)
            code = nonneg.to(tl.int32)
            dec = tl.where(nonneg, sv, -sv)
        elif KIND == ONEBIT:
            pos = tl.load(scales_ptr + 2 * seg, mask=valid, other=0.0)
            neg = tl.load(scales_ptr + 2 * seg + 1, mask=valid, other=0.0)
            code = nonneg.to(tl.int32)
            dec = tl.where(nonneg, pos, neg)
        elif KIND == TERN:
            se = tl.load(factor_ptr + seg, mask=valid, other=0.0)
            mag = tl.abs(a)
            p = tl.where(se > 0, tl.math.div_rn(mag, tl.where(se > 0, se, 1.0)), 0.0)
            keep = _uniform(i, base) < p
            code = tl.where(keep, tl.where(nonneg, 1, 2), 0)
            dec = tl.where(code == 1, se, tl.where(code == 2, -se, 0.0))
        else:
            f = tl.load(factor_ptr + seg, mask=valid, other=0.0)
            r = tl.abs(a) * f
            low = tl.floor(r)
            level = tl.minimum(low + (_uniform(i, base) < (r - low)).to(tl.float32), levels,
                               propagate_nan=tl.PropagateNan.ALL)
            signed = tl.where(nonneg, level, -level)
            code = tl.where(signed == signed, signed + levels, 0.0).to(tl.int32)  # NaN: code 0, as the cast
            w = tl.load(scales_ptr + seg, mask=valid, other=0.0) * inv_levels
            dec = (code.to(tl.float32) - levels) * w
        if WRITE_R:
            tl.store(rout_ptr + i, a - dec, mask=valid)
    code = tl.where(valid, code, 0)
    if BITS == 8:
        tl.store(out_ptr + i, code.to(tl.uint8), mask=valid)
    else:
        grid = tl.reshape(code.to(tl.int64), (BLOCK // 8, 8))
        word = tl.sum(grid << (tl.arange(0, 8) * BITS).to(tl.int64)[None, :], axis=1)
        k = tl.arange(0, 8)
        byte = (word[:, None] >> (8 * k[None, :]).to(tl.int64)) & 0xFF
        g = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        at = g[:, None] * BITS + k[None, :]
        tl.store(out_ptr + at, byte.to(tl.uint8), mask=(k[None, :] < BITS) & (at < nbytes))


@triton.jit
def _code_at(buf_ptr, i, valid, nbytes, BITS: tl.constexpr):
    """Entry i's code in the packed stream at buf_ptr (nbytes long)."""
    if BITS == 8:
        return tl.load(buf_ptr + i, mask=valid, other=0).to(tl.int32)
    bit = i * BITS
    k0 = bit >> 3
    word = tl.load(buf_ptr + k0, mask=valid, other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may straddle two bytes
        word = word | (tl.load(buf_ptr + k0 + 1, mask=valid & (k0 + 1 < nbytes), other=0).to(tl.int32) << 8)
    return (word >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _scale_at(pay_ptr, j, valid):
    """The float32 scale j at the head of a payload (pay_ptr: its first byte; the payload need
    not be 4-byte aligned in the gathered buffer, so the scale is read byte by byte)."""
    at = 4 * j
    word = tl.load(pay_ptr + at, mask=valid, other=0).to(tl.int32)
    word = word | (tl.load(pay_ptr + at + 1, mask=valid, other=0).to(tl.int32) << 8)
    word = word | (tl.load(pay_ptr + at + 2, mask=valid, other=0).to(tl.int32) << 16)
    word = word | (tl.load(pay_ptr + at + 3, mask=valid, other=0).to(tl.int32) << 24)
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _decoded(pay_ptr, head, i, seg, valid, nbytes, levels, inv_levels, KIND: tl.constexpr, BITS: tl.constexpr):
    """One rank's decoded value of entry i (pay_ptr: its payload, scales then codes from byte head)."""
    code = _code_at(pay_ptr + head, i, valid, nbytes, BITS)
    if KIND == EFSIGN:
        s = _scale_at(pay_ptr, seg, valid)
        d = tl.where(code == 1, s, -s)
    elif KIND == ONEBIT:
        d = tl.where(code == 1, _scale_at(pay_ptr, 2 * seg, valid), _scale_at(pay_ptr, 2 * seg + 1, valid))
    elif KIND == TERN:
        s = _scale_at(pay_ptr, seg, valid)
        d = tl.where(code == 1, s, tl.where(code == 2, -s, 0.0))
    else:
        w = _scale_at(pay_ptr, seg, valid) * inv_levels
        d = (code.to(tl.float32) - levels) * w
    return d


@triton.jit
def decode_sum(buf_ptr, out_ptr, moff_ptr, mfirst_ptr, mcols_ptr, nm, bucket, n, part, head, world, levels,
               inv_levels, mult, KIND: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr, LOG: tl.constexpr,
               BUCKETED: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    """out = (sum over ranks, in rank order, of each rank's decoded payload) * mult; signsgd: the
    sign of the vote times world. ``buf_ptr``: the gathered payloads, world x part bytes."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    nbytes = part - head
    if KIND == SIGN:
        votes = tl.zeros((BLOCK,), dtype=tl.int32)
        for r in range(0, world):
            votes += 2 * _code_at(buf_ptr + r * part, i, valid, nbytes, BITS) - 1
        sgn = tl.where(votes > 0, 1.0, tl.where(votes < 0, -1.0, 0.0))
        total = sgn * tl.cast(world, tl.float32)
    else:
        seg = _segment_of(i, moff_ptr, mfirst_ptr, nm, bucket, LOG, BUCKETED, mcols_ptr, COLUMNS)
        total = _decoded(buf_ptr, head, i, seg, valid, nbytes, levels, inv_levels, KIND, BITS)
        for r in range(1, world):
            total = total + _decoded(buf_ptr + r * part, head, i, seg, valid, nbytes, levels, inv_levels, KIND, BITS)
    if SCALE:
        total = total * mult
    tl.store(out_ptr + i, total, mask=valid)
