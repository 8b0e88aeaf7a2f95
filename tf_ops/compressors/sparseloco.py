"""SparseLoCo's codec in TensorFlow ops: top-k of a decaying error-feedback accumulator, each
value sent in ``bits`` bits. The rules, bit for bit, are ``hvdcompress.reference.sparseloco``'s;
the residual variable starts at -0.0 (``tf_ops.memory``), so the first step's accumulator is x."""

from __future__ import annotations

import tensorflow as tf

from hvdcompress.spec import num_selected

from ..collectives import Allgather
from .base import Compressor, scaled
from .packing import pack, unpack
from .selection import topk_indices, wire_index_dtype

SCALES = 2  # lo, step (float32)


def quantize(v: tf.Tensor, bits: int):
    """(scales [lo, step] float32, codes uint8) of the selected float32 values ``v`` (k >= 1)."""
    mag = tf.abs(v)
    levels = 2 ** (bits - 1)
    if levels == 1:
        k = tf.cast(tf.size(mag), tf.float64)
        lo = tf.cast(tf.reduce_sum(tf.cast(mag, tf.float64)) / k, tf.float32)
        step = tf.zeros([], tf.float32)
        j = tf.zeros_like(mag, tf.int32)
    else:
        lo = tf.reduce_min(mag)
        step = (tf.reduce_max(mag) - lo) / tf.constant(float(levels - 1), tf.float32)
        q = tf.clip_by_value(tf.round(tf.math.divide_no_nan(mag - lo, step)), 0.0, float(levels - 1))
        j = tf.where(step > 0, tf.cast(q, tf.int32), tf.zeros_like(mag, tf.int32))
    codes = tf.cast(2 * j + tf.cast(v < 0, tf.int32), tf.uint8)
    return tf.stack([lo, step]), codes


def dequantize(scales: tf.Tensor, codes: tf.Tensor) -> tf.Tensor:
    mag = tf.cast(tf.bitwise.right_shift(codes, 1), tf.float32) * scales[1] + scales[0]
    return tf.where(tf.bitwise.bitwise_and(codes, 1) == 1, -mag, mag)


class SparseLoCoCompressor(Compressor):
    name = "sparseloco"
    summed = False

    def state_slots(self, shape):
        return ("residual",) if self.spec["residual"] else ()

    def initial_value(self, slot):
        return -0.0

    @property
    def stateful(self) -> bool:
        return bool(self.spec["residual"])

    def exchange(self, x, ctx):
        p = self.spec.params
        n = int(x.shape[0])
        if n == 0:
            return tf.zeros_like(x)
        if p["residual"]:
            r = ctx.state["residual"]
            e = tf.cast(r * tf.cast(p["beta"], r.dtype), x.dtype) + x
        else:
            e = x
        k = num_selected(p["ratio"], n)
        # selection on e with NaN/inf as 0 (as the oracle): exactly k entries on every rank even then
        idx = topk_indices(tf.where(tf.math.is_finite(e), e, tf.zeros_like(e)), k)
        v = tf.gather(e, idx)
        scales, codes = quantize(tf.cast(v, tf.float32), p["bits"])
        if p["residual"]:
            rest = v - tf.cast(dequantize(scales, codes), e.dtype)
            ctx.state["residual"].assign(tf.tensor_scatter_nd_update(e, tf.cast(idx, tf.int64)[:, None], rest))
        head = tf.reshape(tf.bitcast(scales, tf.uint8), [-1])
        packed = tf.concat([head, pack(codes, p["bits"])], 0)
        indices, buffers = yield (Allgather(tf.cast(idx, wire_index_dtype(n)), True), Allgather(packed, True))
        parts = tf.reshape(buffers, [ctx.world_size, -1])
        width = 4 * SCALES
        out = tf.zeros([n], tf.float32)
        for rank in range(ctx.world_size):  # rank order
            sc = tf.reshape(tf.bitcast(tf.reshape(parts[rank][:width], [-1, 4]), tf.float32), [-1])
            vals = dequantize(sc, unpack(parts[rank][width:], p["bits"], k))
            at = tf.cast(indices[rank * k:(rank + 1) * k], tf.int64)[:, None]
            out = tf.tensor_scatter_nd_add(out, at, vals)
        return tf.cast(scaled(out, ctx.scale), x.dtype)
