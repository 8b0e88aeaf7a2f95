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

The hashes (``hvdcompress.hashing``) are int64 TF ops, computed per row over the whole tensor
(no per-entry table is kept between steps; within one exchange each row's temporaries are O(d)).
The table of each row is ``tf.math.unsorted_segment_sum``, which on CPU adds every cell's entries
in index order, as the oracle's ``np.add.at`` (checked bit for bit by the tests); on a GPU its
atomics add in no fixed order, so the table may differ in the last bits there.
"""

from __future__ import annotations


import tensorflow as tf

from hvdcompress.hashing import C1, C2, M32, SHIFTS, row_keys
from hvdcompress.reference.sketch import geometry
from hvdcompress.spec import CompressionSpec

from ..collectives import Allreduce
from .base import Compressor, ExchangeContext, scaled, TakesMomentum
from .selection import topk_indices


def _i64(x: int) -> tf.Tensor:
    return tf.constant(x, tf.int64)


def bucket_sign(idx: tf.Tensor, rowkey: int, cols: int, dtype):
    """(bucket int64 in [0, cols), sign +-1 in ``dtype``) of int64 indices for one row."""
    xor, shr, band = tf.bitwise.bitwise_xor, tf.bitwise.right_shift, tf.bitwise.bitwise_and
    x = xor(idx, _i64(rowkey))
    x = xor(x, shr(x, _i64(SHIFTS[0])))
    x = band(x * _i64(C1), _i64(M32))
    x = xor(x, shr(x, _i64(SHIFTS[1])))
    x = band(x * _i64(C2), _i64(M32))
    x = xor(x, shr(x, _i64(SHIFTS[2])))
    sign = tf.cast(_i64(1) - _i64(2) * band(x, _i64(1)), dtype)
    bucket = shr(shr(x, _i64(1)) * _i64(cols), _i64(31))
    return bucket, sign


def sketch_table(v: tf.Tensor, keys, cols: int) -> tf.Tensor:
    """The r x c count sketch of flat v (each cell summed in index order)."""
    idx = tf.range(tf.size(v, out_type=tf.int64), dtype=tf.int64)
    rows = []
    for rk in keys:
        bucket, sign = bucket_sign(idx, rk, cols, v.dtype)
        rows.append(tf.math.unsorted_segment_sum(v * sign, bucket, cols))
    return tf.stack(rows)


def estimates(table: tf.Tensor, keys, d: int) -> tf.Tensor:
    """Lower median over rows of s_j(i) * S[j, h_j(i)] for every i < d."""
    idx = tf.range(d, dtype=tf.int64)
    cols = int(table.shape[1])
    per_row = []
    for j, rk in enumerate(keys):
        bucket, sign = bucket_sign(idx, rk, cols, table.dtype)
        per_row.append(tf.gather(table[j], bucket) * sign)
    return lower_median(per_row)


def lower_median(rows):
    """Element (r-1)//2 of the r tensors sorted elementwise: an odd-even transposition network of
    tf.minimum / tf.maximum (exactly the sorted values; only the sign of a zero may differ)."""
    rows = list(rows)
    r = len(rows)
    for p in range(r):
        for i in range(p % 2, r - 1, 2):
            rows[i], rows[i + 1] = tf.minimum(rows[i], rows[i + 1]), tf.maximum(rows[i], rows[i + 1])
    return rows[(r - 1) // 2]


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
        u_new = u * m + x
        if geo.dense:
            u.assign(u_new)
            (total,) = yield (Allreduce(u_new),)
            return scaled(total, ctx.scale)
        v_new = v + u_new
        keys = row_keys(p["seed"], ctx.key, geo.rows)
        table = sketch_table(v_new, keys, geo.cols)
        (summed,) = yield (Allreduce(tf.reshape(table, [-1])),)
        est = estimates(tf.reshape(summed, [geo.rows, geo.cols]), keys, n)
        cand = topk_indices(est, geo.candidates)
        (w,) = yield (Allreduce(tf.gather(v_new, cand)),)
        pos = topk_indices(w, geo.k)
        at = tf.gather(cand, pos)[:, None]
        zeros = tf.zeros([geo.k], x.dtype)
        u.assign(tf.tensor_scatter_nd_update(u_new, at, zeros))
        v.assign(tf.tensor_scatter_nd_update(v_new, at, zeros))
        total = tf.scatter_nd(at, tf.gather(w, pos), [n])
        return scaled(total, ctx.scale)
