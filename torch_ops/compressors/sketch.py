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

Speed and memory: the hashes (``hvdcompress.hashing``: simple tabulation + one multiply-shift) are
computed per chunk of ``CHUNK`` entries (whole 65536-entry blocks) from two short tables per row
(LOW: 65536 int64, HIGH: d / 65536), kept in a small LRU cache (``TABLE_CACHE_BYTES``) since a
tensor is hashed with the same keys every step, and used by both rounds. Per row and
chunk that is five passes over an int64 buffer (one broadcast xor, two multiplies, a mask, a
shift), then
one ``index_add_`` of v into the row's 2c signed cells (no sign multiply) to sketch, or one
``index_select`` from [S, -S] interleaved to estimate; the median of 5 (or 3) rows is a 10 (4)
min/max selection network. Nothing of size r x d is ever held; the estimates (d floats) are the
only dense temporary besides the state.

On CPU (float32, contiguous, the compiled library loaded: ``Native``) the kernels of
``kernels.cpp`` (through ``hvdcompress.native.sketch``, shared with TensorFlow) replace these ops:
one that updates u and v and adds v into each row's signed cells (the hashes computed inline from
the same tables; one sweep over v per group of rows whose cells stay in cache, the first fused
with the update), and ``candidates``: the P*k largest |estimate| from a threshold set on a sample
and the few entries that can pass it (a bitmask of the cells rules the others out), so the d
estimates are neither written nor scanned (every estimate, into a buffer kept between steps, is
the fallback). The result is built in ``ctx.out`` when it is offered. The torch ops stay the path of other devices and dtypes and of
``HVDCOMPRESS_NATIVE=0`` / the torch-only switch; both give the oracle's bits (tests/test_paths.py).

Bit-exactness: on CPU ``index_add_`` into a 1-D tensor adds serially, in index order, chunk after
chunk into the same cells, rounding every addition to the tensor's dtype -- the oracle's order and
rounding (``np.add.at``); tests check the table, candidates, selected indices, results and state
bit for bit. (``scatter_add_`` is not used: for float16 and bfloat16 it accumulates every cell in
float32 and rounds once at the end, a different table wherever a cell's partial sums round, and
in ties a different candidate set.) On a GPU it adds with atomics in no fixed order: the table
(and therefore, in near ties, the candidates) may differ from the oracle's in the last bits there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional, Tuple

import torch

from hvdcompress import hashing
from hvdcompress.native.sketch import Kernels as SketchKernels
from hvdcompress.reference.sketch import geometry
from hvdcompress.spec import CompressionSpec

from ..collectives import Allreduce
from ..gpu import sketch as gpu_sketch
from . import native
from .base import Compressor, ExchangeContext, TakesMomentum
from .selection import scratch, topk_indices

CHUNK = 1 << 19


TABLE_CACHE_BYTES = 64 << 20
_table_cache: "OrderedDict[tuple, tuple]" = OrderedDict()


def _tables(keys: tuple, d: int, device: torch.device):
    """The rows' (LOW, HIGH) tables as tensors, from a small LRU cache (a tensor is hashed with
    the same keys every step; the tables are a function of (keys, d) only)."""
    key = (keys, d, str(device))
    hit = _table_cache.get(key)
    if hit is not None:
        _table_cache.move_to_end(key)
        return hit
    pairs = [hashing.tables(rk, d) for rk in keys]
    hit = ([torch.from_numpy(lo).to(device) for lo, _ in pairs], [torch.from_numpy(hi).to(device) for _, hi in pairs])
    _table_cache[key] = hit
    nbytes = lambda entry: sum(t.numel() * 8 for half in entry for t in half)  # noqa: E731
    total = sum(nbytes(e) for e in _table_cache.values())
    while total > TABLE_CACHE_BYTES and len(_table_cache) > 1:
        total -= nbytes(_table_cache.popitem(last=False)[1])
    return hit


class Hashes:
    """The hash tables of every row for a tensor of ``d`` entries and ``cols`` columns, and the
    int64 buffer the signed cells y_j of one chunk are computed into."""

    def __init__(self, keys, d: int, cols: int, device="cpu", chunk: int = CHUNK):
        hashing.check_cols(cols)
        self.d, self.cols, self.rows = int(d), int(cols), len(keys)
        self.low, self.high = _tables(tuple(keys), self.d, torch.device(device))
        self.n_low = self.low[0].numel() if keys else min(self.d, hashing.BLOCK)
        self.blocks = max(1, int(chunk) // hashing.BLOCK)  # blocks per chunk
        self.n_high = -(-self.d // self.n_low) if self.d else 0
        self.buf = torch.empty(min(self.n_high, self.blocks) * self.n_low, dtype=torch.int64, device=device)

    def chunks(self) -> Iterator[Tuple[int, int, int, int]]:
        """(start, stop, first block, end block) of each chunk, in index order."""
        for b0 in range(0, self.n_high, self.blocks):
            b1 = min(self.n_high, b0 + self.blocks)
            yield b0 * self.n_low, min(self.d, b1 * self.n_low), b0, b1

    def cells(self, j: int, b0: int, b1: int, n: int) -> torch.Tensor:
        """y_j of the chunk's n entries: (((HIGH[b] xor LOW) * C3) & M) * 2c >> 32, into the buffer."""
        x = self.buf[:(b1 - b0) * self.n_low]
        torch.bitwise_xor(self.high[j][b0:b1, None], self.low[j][None, :], out=x.view(b1 - b0, self.n_low))
        return x[:n].mul_(hashing.C3).bitwise_and_(hashing.M32).mul_(2 * self.cols).bitwise_right_shift_(32)


def sketch_table(v: torch.Tensor, keys, cols: int, chunk: int = CHUNK, hashes: Hashes = None) -> torch.Tensor:
    """The r x c count sketch of flat v: the 2c signed cells of each row summed in index order,
    each addition rounded to v's dtype (``index_add_``, the module doc), folded as
    cell[2b] - cell[2b+1] (the oracle's ``sketch_table``)."""
    h = hashes if hashes is not None else Hashes(keys, v.numel(), cols, v.device, chunk)
    signed = torch.zeros(len(keys), 2 * cols, dtype=v.dtype, device=v.device)
    for start, stop, b0, b1 in h.chunks():
        vc = v[start:stop]
        for j in range(len(keys)):
            signed[j].index_add_(0, h.cells(j, b0, b1, stop - start), vc)
    return signed[:, 0::2] - signed[:, 1::2]


def lower_median_rows(rows: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Row (r-1)//2 of ``rows`` (r x n) sorted along dim 0, computed in place (``rows`` is
    overwritten): for r = 3 and r = 5 a median selection network of 4 and 10 elementwise min/max,
    else an odd-even transposition sorting network (r passes). Min/max pick an input, so this is
    exactly the oracle's value (only the sign of a zero may differ, and |est| is what counts).
    NaN sorts last, as in np.sort: ``fmin`` returns the other value, ``maximum`` the NaN."""
    r = rows.shape[0]
    mn, mx = torch.fmin, torch.maximum
    if r == 3:
        a, b, c = rows
        mn(a, b, out=tmp)
        mx(a, b, out=b)
        mn(b, c, out=b)
        return mx(tmp, b, out=a)  # max(min(a, b), min(max(a, b), c))
    if r == 5:
        a, b, c, d, e = rows
        mn(a, b, out=tmp)
        mx(a, b, out=b)
        mn(c, d, out=a)
        mx(c, d, out=d)
        mx(tmp, a, out=tmp)  # f: the larger of the two pairs' minima
        mn(b, d, out=b)  # g: the smaller of the two pairs' maxima ({f, g}: the middle two of a..d)
        mn(e, tmp, out=a)
        mx(e, tmp, out=tmp)
        mn(tmp, b, out=tmp)
        return mx(a, tmp, out=c)  # the median of (e, f, g)
    for p in range(r):
        for i in range(p % 2, r - 1, 2):
            a, b = rows[i], rows[i + 1]
            mn(a, b, out=tmp)
            mx(a, b, out=b)
            a.copy_(tmp)
    return rows[(r - 1) // 2]


def estimates(table: torch.Tensor, keys, d: int, chunk: int = CHUNK, hashes: Hashes = None) -> torch.Tensor:
    """Lower median over rows of s_j(i) * S[j, h_j(i)] for every i < d: entry y_j(i) of the
    row's [S, -S] interleaved (the oracle's ``estimates``)."""
    rows, cols = table.shape
    h = hashes if hashes is not None else Hashes(keys, d, cols, table.device, chunk)
    signed = torch.stack([table, -table], dim=2).reshape(rows, 2 * cols)
    out = torch.empty(d, dtype=table.dtype, device=table.device)
    width = h.buf.numel()
    per_row = torch.empty(rows, width, dtype=table.dtype, device=table.device)
    tmp = torch.empty(width, dtype=table.dtype, device=table.device)
    for start, stop, b0, b1 in h.chunks():
        n = stop - start
        pr = per_row[:, :n]
        for j in range(rows):
            torch.index_select(signed[j], 0, h.cells(j, b0, b1, n), out=pr[j])
        out[start:stop] = lower_median_rows(pr, tmp[:n])
    return out


def _f32(t: Optional[torch.Tensor], n: int) -> bool:
    return (t is not None and t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and not t.is_neg()
            and not t.requires_grad and t.numel() == n)


class Native:
    """The compiled path of one exchange (``hvdcompress.native.sketch``, shared with TensorFlow):
    the momentum and error update fused with the sketch (the hashes computed inline), and the
    candidates (the P*k largest |estimate|, ``Kernels.candidates``). Taken for float32 CPU
    contiguous tensors with the library loaded and the torch-only switch off; the same operations
    as the torch ops, so the same bits."""

    def __init__(self, lib, keys, d: int, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        self.kernels = SketchKernels(lib, keys, d, cols)

    @staticmethod
    def plan(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, keys, rows: int, cols: int) -> Optional["Native"]:
        n = x.numel()
        if not (_f32(x, n) and _f32(u, n) and _f32(v, n)) or not SketchKernels.serves(rows, n):
            return None
        lib = native.lib()
        return None if lib is None else Native(lib, keys, n, rows, cols)

    def update_sketch(self, g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, m: float) -> torch.Tensor:
        """u <- m*u + g; v <- v + u; the r x c count sketch of v."""
        table = torch.empty(self.rows, self.cols, dtype=torch.float32)
        self.kernels.update_sketch(g.data_ptr(), u.data_ptr(), v.data_ptr(), m, table.data_ptr())
        return table

    def candidates(self, table: torch.Tensor, d: int, count: int) -> torch.Tensor:
        """Indices (int64, ascending) of the ``count`` largest |lower median over rows of
        s_j(i) * S[j, h_j(i)]| (ties toward the lower index), from a threshold and the entries
        that pass it (every estimate only where that does not pay; into a reused buffer)."""
        table = table.contiguous()
        if not _f32(table, self.rows * self.cols):
            table = table.to(torch.float32).contiguous()
        est = lambda: scratch.get(d, torch.float32, torch.device("cpu"), "sketch.est").numpy()  # noqa: E731
        return torch.from_numpy(self.kernels.candidates(table.data_ptr(), count, est))


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
        if geo.dense:
            u.mul_(self.m).add_(x)
            (total,) = yield (Allreduce(u.clone()),)
            return total.mul_(ctx.scale)
        keys = hashing.row_keys(p["seed"], ctx.key, geo.rows)
        fast = Native.plan(x, u, v, keys, geo.rows, geo.cols) or \
            gpu_sketch.plan(x, u, v, keys, geo.rows, geo.cols, topk_indices)  # CUDA tensors: the Triton kernels
        if fast is not None:
            table = fast.update_sketch(x, u, v, self.m)
            (summed,) = yield (Allreduce(table.view(-1)),)
            cand = fast.candidates(summed.view(geo.rows, geo.cols), geo.d, geo.candidates)
        else:
            u.mul_(self.m).add_(x)
            v.add_(u)
            hashes = Hashes(keys, geo.d, geo.cols, v.device)
            table = sketch_table(v, keys, geo.cols, hashes=hashes)
            (summed,) = yield (Allreduce(table.view(-1)),)
            est = estimates(summed.view(geo.rows, geo.cols), keys, geo.d, hashes=hashes)
            del hashes
            cand = topk_indices(est, geo.candidates)
            del est
        (w,) = yield (Allreduce(v[cand]),)
        pos = topk_indices(w, geo.k)
        sel = cand[pos]
        u[sel] = 0
        v[sel] = 0
        # the result is zero but at the selected entries: built in the offered buffer when there
        # is one (total * scale: 0 * scale is 0, so only the selected values are scaled)
        out = ctx.out.view(-1) if ctx.out is not None and ctx.out.dtype == v.dtype and ctx.out.numel() == v.numel() \
            and ctx.out.device == v.device and ctx.out.is_contiguous() else None
        total = out.zero_() if out is not None else torch.zeros_like(v)
        vals = w[pos]
        total[sel] = vals.mul_(ctx.scale) if ctx.scale != 1.0 else vals
        return total
