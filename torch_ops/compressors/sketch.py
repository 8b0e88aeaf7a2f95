"""Sketched-SGD (Ivkin et al., NeurIPS 2019) for PyTorch: count sketch + heavy-hitter second round.

The math and the order of operations are the numpy oracle's (``hvdcompress.reference.sketch``):

    u <- m*u + g;  v <- v + u
    round 1: Allreduce of the r x c count sketch of v     (r*c floats)
    est = lower median over rows of s_j(i) * S[j, h_j(i)];  C = top P*k |est| (ties: lower index)
    round 2: Allreduce of v[C]                             (P*k floats)
    I = top k of |summed v[C]|;  result[I] = summed * scale;  u[I] = v[I] = 0

Tensors under ``min_sketch_numel`` entries, or whose sketch is not smaller than they are, are
sent dense (Allreduce of u: momentum SGD). The momentum lives here, so the wrapped SGD's momentum
is taken over (``adapt_optimizer``), as DGC does.

Speed and memory: the hashes h_j, s_j (``hvdcompress.hashing``) are recomputed from the indices
in chunks of ``CHUNK`` entries (int64 work buffers of that size, reused), once to build the sketch
and once to estimate -- nothing of size r x d is ever held. The estimates (d floats) are the only
dense temporary besides the state. Eager torch spends one pass over a chunk per integer op of the
hash; ``HVDCOMPRESS_SKETCH_COMPILE=1`` fuses them with torch.compile (see below; opt-in because
the first compilation takes tens of seconds).

Bit-exactness: the table is built with ``index_add_``, which on CPU adds a 1-D source into its
destination serially, in index order, chunk after chunk into the same table -- the oracle's order
(``np.add.at``); tests check the table, candidates, selected indices, results and state bit for
bit. On a GPU ``index_add_`` adds with atomics in no fixed order: the table (and therefore, in
near ties, the candidates) may differ from the oracle's in the last bits there.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch

from hvdcompress.hashing import C1, C2, M32, SHIFTS, row_keys
from hvdcompress.reference.sketch import geometry
from hvdcompress.spec import CompressionSpec

from ..collectives import Allreduce
from .base import Compressor, ExchangeContext, TakesMomentum
from .selection import topk_indices

CHUNK = 1 << 17
COMPILE_ENV = "HVDCOMPRESS_SKETCH_COMPILE"


# --- optional fused path (torch.compile) ------------------------------------------------------
# Eager torch makes one pass over a chunk per integer op of the hash (~20 per row). With
# HVDCOMPRESS_SKETCH_COMPILE=1 (or ``use_compiled(True)``) the hash, the signed weights and the
# whole estimate (gathers + median network) of a chunk are fused by torch.compile (inductor, one
# compilation with dynamic shapes, ~25-35 s on first use). Integer ops and the +-1 products are
# exact, so the fused path gives the same bits (checked by the benchmark and an opt-in test).
def _hash_fused(idx, rk, cols):
    x = torch.bitwise_xor(idx, rk)
    x = x ^ (x >> SHIFTS[0])
    x = (x * C1) & M32
    x = x ^ (x >> SHIFTS[1])
    x = (x * C2) & M32
    x = x ^ (x >> SHIFTS[2])
    return ((x >> 1) * cols) >> 31, 1 - 2 * (x & 1)


def _weights_fused(idx, rk, cols, v):
    bucket, sign = _hash_fused(idx, rk, cols)
    return bucket, v * sign.to(v.dtype)


def _estimate_fused(idx, rks, cols, table):
    vals = []
    for j in range(table.shape[0]):
        bucket, sign = _hash_fused(idx, rks[j], cols)
        vals.append(table[j][bucket] * sign.to(table.dtype))
    r = len(vals)
    for p in range(r):
        for i in range(p % 2, r - 1, 2):
            vals[i], vals[i + 1] = torch.minimum(vals[i], vals[i + 1]), torch.maximum(vals[i], vals[i + 1])
    return vals[(r - 1) // 2]


_compiled = {"on": None, "weights": None, "estimate": None}


def use_compiled(flag: bool) -> None:
    """Turn the torch.compile fused path on or off for this process (default: the environment)."""
    _compiled["on"] = bool(flag)


def _fused():
    if _compiled["on"] is None:
        _compiled["on"] = os.environ.get(COMPILE_ENV, "0") not in ("", "0", "false", "no")
    if not _compiled["on"]:
        return None
    if _compiled["weights"] is None:
        _compiled["weights"] = torch.compile(_weights_fused, dynamic=True)
        _compiled["estimate"] = torch.compile(_estimate_fused, dynamic=True)
    return _compiled["weights"], _compiled["estimate"]


class _Hasher:
    """Computes (bucket, sign) of a chunk of indices for one row into reused int64 buffers."""

    def __init__(self, n: int, device):
        self.x = torch.empty(n, dtype=torch.int64, device=device)
        self.tmp = torch.empty(n, dtype=torch.int64, device=device)
        self.sign = torch.empty(n, dtype=torch.float32, device=device)

    def __call__(self, idx: torch.Tensor, rowkey: int, cols: int, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        n = idx.numel()
        x, tmp = self.x[:n], self.tmp[:n]
        torch.bitwise_xor(idx, rowkey, out=x)  # idx < 2**32 (tensors of fewer than 4G entries)
        torch.bitwise_right_shift(x, SHIFTS[0], out=tmp)
        x.bitwise_xor_(tmp).mul_(C1).bitwise_and_(M32)
        torch.bitwise_right_shift(x, SHIFTS[1], out=tmp)
        x.bitwise_xor_(tmp).mul_(C2).bitwise_and_(M32)
        torch.bitwise_right_shift(x, SHIFTS[2], out=tmp)
        x.bitwise_xor_(tmp)
        # sign = 1 - 2*(x & 1); bucket = ((x >> 1) * cols) >> 31
        sign = self.sign[:n] if dtype == torch.float32 else torch.empty(n, dtype=dtype, device=x.device)
        torch.bitwise_and(x, 1, out=tmp)
        sign.copy_(tmp).mul_(-2.0).add_(1.0)
        x.bitwise_right_shift_(1).mul_(cols).bitwise_right_shift_(31)
        return x, sign


def sketch_table(v: torch.Tensor, keys, cols: int, chunk: int = CHUNK) -> torch.Tensor:
    """The r x c count sketch of flat v (cells added in index order, as the oracle)."""
    d = v.numel()
    table = torch.zeros(len(keys), cols, dtype=v.dtype, device=v.device)
    fused = _fused()
    if fused is not None:
        rks = torch.tensor(keys, dtype=torch.int64, device=v.device)
        c = torch.tensor(cols, dtype=torch.int64, device=v.device)
        for start in range(0, d, chunk):
            idx = torch.arange(start, min(d, start + chunk), dtype=torch.int64, device=v.device)
            for j in range(len(keys)):
                bucket, w = fused[0](idx, rks[j], c, v[start:start + chunk])
                table[j].index_add_(0, bucket, w)
        return table
    h = _Hasher(min(chunk, max(d, 1)), v.device)
    w = torch.empty(min(chunk, max(d, 1)), dtype=v.dtype, device=v.device)
    for start in range(0, d, chunk):
        stop = min(d, start + chunk)
        idx = torch.arange(start, stop, dtype=torch.int64, device=v.device)
        vc = v[start:stop]
        for j, rk in enumerate(keys):
            bucket, sign = h(idx, rk, cols, v.dtype)
            torch.mul(vc, sign, out=w[:stop - start])
            table[j].index_add_(0, bucket, w[:stop - start])
    return table


def lower_median_rows(rows: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Row (r-1)//2 of ``rows`` (r x n) sorted along dim 0, in place: an odd-even transposition
    sorting network of elementwise min/max (r passes), which returns exactly the oracle's sorted
    values (min/max pick an input; only the sign of a zero may differ, and |est| is what counts).
    ~10x faster than ``kthvalue`` along a short dim."""
    r = rows.shape[0]
    for p in range(r):
        for i in range(p % 2, r - 1, 2):
            a, b = rows[i], rows[i + 1]
            torch.minimum(a, b, out=tmp)
            torch.maximum(a, b, out=b)
            a.copy_(tmp)
    return rows[(r - 1) // 2]


def estimates(table: torch.Tensor, keys, d: int, chunk: int = CHUNK) -> torch.Tensor:
    """Lower median over rows of s_j(i) * S[j, h_j(i)] for every i < d."""
    rows, cols = table.shape
    out = torch.empty(d, dtype=table.dtype, device=table.device)
    fused = _fused()
    if fused is not None:
        rks = torch.tensor(keys, dtype=torch.int64, device=table.device)
        c = torch.tensor(cols, dtype=torch.int64, device=table.device)
        for start in range(0, d, chunk):
            idx = torch.arange(start, min(d, start + chunk), dtype=torch.int64, device=table.device)
            out[start:start + chunk] = fused[1](idx, rks, c, table)
        return out
    h = _Hasher(min(chunk, max(d, 1)), table.device)
    per_row = torch.empty(rows, min(chunk, max(d, 1)), dtype=table.dtype, device=table.device)
    tmp = torch.empty(min(chunk, max(d, 1)), dtype=table.dtype, device=table.device)
    for start in range(0, d, chunk):
        stop = min(d, start + chunk)
        n = stop - start
        idx = torch.arange(start, stop, dtype=torch.int64, device=table.device)
        pr = per_row[:, :n]
        for j, rk in enumerate(keys):
            bucket, sign = h(idx, rk, cols, table.dtype)
            torch.index_select(table[j], 0, bucket, out=pr[j])
            pr[j].mul_(sign)
        out[start:stop] = lower_median_rows(pr, tmp[:n])
    return out


class SketchCompressor(TakesMomentum, Compressor):
    name = "sketch"
    summed = True

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec)
        self.m = spec["momentum"]

    def _state(self, ctx: ExchangeContext, name: str, like: torch.Tensor) -> torch.Tensor:
        t = ctx.state.get(name)
        if t is None:
            t = ctx.state[name] = torch.zeros_like(like)
        return t

    def exchange(self, x: torch.Tensor, ctx: ExchangeContext):
        p = self.spec.params
        u = self._state(ctx, "u", x)
        v = self._state(ctx, "v", x)
        geo = geometry(p, x.numel())
        u.mul_(self.m).add_(x)
        if geo.dense:
            (total,) = yield (Allreduce(u.clone()),)
            return total.mul_(ctx.scale)
        v.add_(u)
        keys = row_keys(p["seed"], ctx.key, geo.rows)
        table = sketch_table(v, keys, geo.cols)
        (summed,) = yield (Allreduce(table.view(-1)),)
        est = estimates(summed.view(geo.rows, geo.cols), keys, geo.d)
        cand = topk_indices(est, geo.candidates)
        del est
        (w,) = yield (Allreduce(v[cand]),)
        pos = topk_indices(w, geo.k)
        sel = cand[pos]
        total = torch.zeros_like(v)
        total[sel] = w[pos]
        u[sel] = 0
        v[sel] = 0
        return total.mul_(ctx.scale)
