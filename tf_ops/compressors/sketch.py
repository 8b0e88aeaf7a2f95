"""Sketched-SGD (Ivkin et al., NeurIPS 2019) in TensorFlow ops: count sketch + heavy-hitter round.

Operation for operation the numpy oracle's (``hvdcompress.reference.sketch``; u, v are flat
variables in ``ctx.state``):

    u <- m*u + g;  v <- v + u
    round 1: Allreduce of the r x c count sketch of v     (r*c floats)
    est = lower median over rows of s_j(i) * S[j, h_j(i)];  C = top P*k |est| (ties: lower index)
    round 2: Allreduce of v[C]                             (P*k floats)
    I = top k of |summed v[C]|;  result[I] = summed * scale;  u[I] = v[I] = 0

Tensors under ``min_sketch_numel`` entries, or whose sketch is not smaller than they are, are
sent dense (Allreduce of u). The sizes are static (from the tensor's static size), so the
exchange traces once; nothing depends on ``ctx.step``. The momentum lives here, so the Keras
``DistributedOptimizer`` takes an SGD optimizer's momentum over (``adapt_optimizer``).

The hashes (``hvdcompress.hashing``: simple tabulation + one multiply-shift) are int64 TF ops:
per row two short tables (65536 and d / 65536 entries) are mixed, one broadcast xor gives x for
the whole tensor, two multiplies, a mask and a shift the signed cell y (no per-entry table is kept between
steps; within one exchange each row's temporaries are O(d)). Each row's 2c signed cells are
``tf.math.unsorted_segment_sum`` of v by y, which on CPU adds every cell's entries in index order,
as the oracle's ``np.add.at`` (checked bit for bit by the tests); on a GPU its atomics add in no
fixed order, so the table may differ in the last bits there.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvdcompress import hashing
from hvdcompress.hashing import C1, C2, M32, SHIFTS, row_keys
from hvdcompress.native.sketch import Kernels
from hvdcompress.reference.sketch import geometry
from hvdcompress.spec import CompressionSpec

from . import host
from ..collectives import Allreduce
from .base import Compressor, ExchangeContext, scaled, TakesMomentum
from .dgc import scaled_sum
from .selection import topk_indices


def _i64(x: int) -> tf.Tensor:
    return tf.constant(x, tf.int64)


def mix32(x: tf.Tensor, key: int) -> tf.Tensor:
    """``hashing.mix32_array`` in int64 TF ops: the mixer of (x XOR key), x in [0, 2**32)."""
    xor, shr, band = tf.bitwise.bitwise_xor, tf.bitwise.right_shift, tf.bitwise.bitwise_and
    x = xor(x, _i64(key))
    x = xor(x, shr(x, _i64(SHIFTS[0])))
    x = band(x * _i64(C1), _i64(M32))
    x = xor(x, shr(x, _i64(SHIFTS[1])))
    x = band(x * _i64(C2), _i64(M32))
    return xor(x, shr(x, _i64(SHIFTS[2])))


def cells(rowkey: int, d: int, cols: int) -> tf.Tensor:
    """y_j(i) = (((HIGH[i >> 16] xor LOW[i & 0xFFFF]) * C3 & M) * 2c) >> 32 for i < d (``hashing.cells``);
    the two short tables are computed here, so a traced graph holds no per-entry constants."""
    hashing.check_cols(cols)
    n_low, n_high = hashing.table_sizes(d)
    low = mix32(tf.range(n_low, dtype=tf.int64), rowkey)
    high = mix32(tf.range(n_high, dtype=tf.int64), hashing.high_key(rowkey))
    x = tf.reshape(tf.bitwise.bitwise_xor(high[:, None], low[None, :]), [-1])[:d]
    return _signed_cell(x, cols)


def _signed_cell(x: tf.Tensor, cols: int) -> tf.Tensor:
    z = tf.bitwise.bitwise_and(x * _i64(hashing.C3), _i64(M32))
    return tf.bitwise.right_shift(z * _i64(2 * cols), _i64(32))


def bucket_sign(idx: tf.Tensor, rowkey: int, cols: int, dtype):
    """(bucket int64 in [0, cols), sign +-1 in ``dtype``) of int64 indices for one row
    (``hashing.bucket_sign``; by gathers from the tables, for tests and tools)."""
    hashing.check_cols(cols)
    band, shr = tf.bitwise.bitwise_and, tf.bitwise.right_shift
    low = mix32(tf.range(hashing.BLOCK, dtype=tf.int64), rowkey)
    n_high = tf.reduce_max(shr(idx, _i64(hashing.BLOCK_BITS))) + 1
    high = mix32(tf.range(n_high, dtype=tf.int64), hashing.high_key(rowkey))
    x = tf.bitwise.bitwise_xor(tf.gather(high, shr(idx, _i64(hashing.BLOCK_BITS))),
                               tf.gather(low, band(idx, _i64(hashing.BLOCK - 1))))
    y = _signed_cell(x, cols)
    return shr(y, _i64(1)), tf.cast(_i64(1) - _i64(2) * band(y, _i64(1)), dtype)


def sketch_table(v: tf.Tensor, keys, cols: int) -> tf.Tensor:
    """The r x c count sketch of flat v: each row's 2c signed cells summed in index order
    (``unsorted_segment_sum``), folded as cell[2b] - cell[2b+1] (the oracle's ``sketch_table``)."""
    d = int(v.shape[0])
    rows = []
    for rk in keys:
        signed = tf.reshape(tf.math.unsorted_segment_sum(v, cells(rk, d, cols), 2 * cols), [cols, 2])
        rows.append(signed[:, 0] - signed[:, 1])
    return tf.stack(rows)


def estimates(table: tf.Tensor, keys, d: int) -> tf.Tensor:
    """Lower median over rows of s_j(i) * S[j, h_j(i)] for every i < d: entry y_j(i) of the
    row's [S, -S] interleaved (the oracle's ``estimates``)."""
    cols = int(table.shape[1])
    signed = tf.reshape(tf.stack([table, -table], axis=2), [len(keys), 2 * cols])
    return lower_median([tf.gather(signed[j], cells(rk, d, cols)) for j, rk in enumerate(keys)])


def lower_median(rows):
    """Element (r-1)//2 of the r tensors sorted elementwise: an odd-even transposition network of
    tf.minimum / tf.maximum (exactly the sorted values; only the sign of a zero may differ)."""
    rows = list(rows)
    r = len(rows)
    for p in range(r):
        for i in range(p % 2, r - 1, 2):
            rows[i], rows[i + 1] = tf.minimum(rows[i], rows[i + 1]), tf.maximum(rows[i], rows[i + 1])
    return rows[(r - 1) // 2]


class CompiledSketch:
    """The sketch's first two stages on the shared compiled kernels (``hvdcompress.native.sketch``),
    two host calls: ``update_sketch`` (u = m*u + g; v = v + u into new buffers, and the count
    sketch of v, in one pass per row group) and ``candidates`` (the top P*k |estimate|:
    ``hvdcompress.native.sketch.Kernels.candidates``, from a threshold and the entries that pass it,
    or every estimate in a reused buffer). The TF ops' results bit for bit."""

    def __init__(self, lib, keys, n: int, rows: int, cols: int, m: float):
        self.kernels = Kernels(lib, keys, n, cols)
        self.n, self.rows, self.cols, self.m = n, rows, cols, m
        self.buffers = host.Buffers()

    def _update(self, g, u_in, v_in):
        n = self.n
        u, v = self.buffers.get(n, np.float32), self.buffers.get(n, np.float32)
        table = host.empty(self.rows * self.cols, np.float32)
        a = host.address
        self.kernels.update_sketch(a(g), a(u), a(v), self.m, a(table), a(u_in), a(v_in))
        return table, u, v

    def update_sketch(self, g, u: tf.Variable, v: tf.Variable):
        """(flat table, new u, new v) as tensors; the variables are not assigned yet."""
        n, size = self.n, self.rows * self.cols
        return host.call(self._update, [g, u, v], [(tf.float32, [size]), (tf.float32, [n]), (tf.float32, [n])])

    def _candidates(self, table, count):
        table = np.ascontiguousarray(table, np.float32)
        return (self.kernels.candidates(host.address(table), int(count), lambda: self.buffers.get(self.n, np.float32)),)

    def candidates(self, summed: tf.Tensor, count: int) -> tf.Tensor:
        """Indices (int64, ascending) of the ``count`` largest |estimate| from the summed table."""
        return host.call(self._candidates, [summed, tf.constant(count, tf.int64)], [(tf.int64, [count])])[0]


class SketchCompressor(TakesMomentum, Compressor):
    name = "sketch"
    summed = True

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec)
        self.m = spec["momentum"]

    @property
    def has_density(self) -> bool:
        return False  # k is fixed by the spec (no warm-up schedule)

    def state_slots(self, shape):
        return ("u", "v")

    @property
    def stateful(self) -> bool:
        return True

    def exchange(self, x: tf.Tensor, ctx: ExchangeContext):
        p = self.spec.params
        n = int(x.shape[0])
        geo = geometry(p, n)
        m = tf.cast(self.m, x.dtype)
        u, v = ctx.state["u"], ctx.state["v"]
        if geo.dense:
            u_new = u * m + x
            u.assign(u_new)
            (total,) = yield (Allreduce(u_new),)
            return scaled(total, ctx.scale)
        keys = row_keys(p["seed"], ctx.key, geo.rows)
        fast = self._compiled(x, u, v, keys, geo)
        if fast is not None:
            table, u_new, v_new = fast.update_sketch(x, u, v)
            (summed,) = yield (Allreduce(table),)
            cand = fast.candidates(summed, geo.candidates)
        else:
            u_new = u * m + x
            v_new = v + u_new
            table = sketch_table(v_new, keys, geo.cols)
            (summed,) = yield (Allreduce(tf.reshape(table, [-1])),)
            est = estimates(tf.reshape(summed, [geo.rows, geo.cols]), keys, n)
            cand = topk_indices(est, geo.candidates)
        (w,) = yield (Allreduce(tf.gather(v_new, cand)),)
        pos = topk_indices(w, geo.k)
        at = tf.gather(cand, pos)
        zeros = tf.zeros([geo.k], x.dtype)
        u.assign(tf.tensor_scatter_nd_update(u_new, at[:, None], zeros), read_value=False)
        v.assign(tf.tensor_scatter_nd_update(v_new, at[:, None], zeros), read_value=False)
        return scaled_sum(at, tf.gather(w, pos), n, ctx.scale)

    def _compiled(self, x, u, v, keys, geo):
        """A ``CompiledSketch`` for float32 tensors on CPU (the kernels' rows limit), else None."""
        n = int(x.shape[0])
        if not Kernels.serves(geo.rows, n) or tuple(u.shape) != (n,) or tuple(v.shape) != (n,):
            return None
        lib = host.kernels(x, u, v)
        return None if lib is None else CompiledSketch(lib, keys, n, geo.rows, geo.cols, self.m)
