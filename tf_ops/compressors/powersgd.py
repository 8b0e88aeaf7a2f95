"""PowerSGD (Vogels et al. 2019) in TensorFlow ops: a translation of
``torch_ops.compressors.powersgd`` (the numpy oracle ``hvdcompress.reference.powersgd`` spells the
algorithm out), eagerly and inside ``tf.function``.

State per compressed tensor: flat variables ``residual`` (n*m entries, starting at -0.0 like every
residual here) and ``q`` (m*r entries: ``slot_numel``), zero until the first step draws the seeded
initial Q; a q that is all zero is (re)initialised inside the graph with ``tf.where``. Never merged
(``merge=LAYERWISE``).
"""

from __future__ import annotations

import tensorflow as tf

from hvdcompress.reference.powersgd import is_compressed, matrix_shape

from ..collectives import Allreduce
from .base import Compressor, scaled
from .packing import uniform


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """Gram-Schmidt (modified) on the columns, in order; a zero column stays zero."""
    cols = []
    for i in range(int(p.shape[1])):
        col = p[:, i]
        for j in range(i):
            col = col - tf.reduce_sum(cols[j] * col) * cols[j]
        norm = tf.sqrt(tf.reduce_sum(col * col))
        cols.append(tf.math.divide_no_nan(col, norm))
    return tf.stack(cols, axis=1)


class PowerSGDCompressor(Compressor):
    name = "powersgd"
    summed = True
    uses_step = True  # the initial Q is drawn from (seed, step, key)
    shared_slots = ("q",)  # the warm-started factor is the same on every rank

    def _compressed(self, shape) -> bool:
        return is_compressed(tuple(shape), self.spec["rank"])

    def state_slots(self, shape):
        if not self._compressed(shape):
            return ()
        return ("residual", "q") if self.spec["residual"] else ("q",)

    def initial_value(self, slot):
        return -0.0 if slot == "residual" else 0.0

    def slot_numel(self, slot, shape):
        n, m = matrix_shape(tuple(shape))
        return m * self.spec["rank"] if slot == "q" else n * m

    def exchange(self, x, ctx):
        p = self.spec.params
        r = p["rank"]
        shape = tuple(ctx.shape) if ctx.shape else (int(x.shape[0]),)
        if not self._compressed(shape):
            (total,) = yield (Allreduce(x),)
            return scaled(total, ctx.scale)
        n, m = matrix_shape(shape)
        st = ctx.state
        mat = tf.reshape(x, [n, m])
        if p["residual"]:
            mat = mat + tf.reshape(st["residual"].read_value(), [n, m])
        q = st["q"].read_value()
        fresh = tf.cast(uniform(m * r, p["seed"], ctx.step, ctx.key, 0) - 0.5, q.dtype)  # state's dtype
        q = tf.reshape(tf.where(tf.reduce_any(q != 0), q, fresh), [m, r])
        (psum,) = yield (Allreduce(tf.matmul(mat, q)),)
        phat = orthogonalize(psum)
        qloc = tf.matmul(mat, phat, transpose_a=True)
        if p["residual"]:
            st["residual"].assign(tf.reshape(mat - tf.matmul(phat, qloc, transpose_b=True), [-1]))
        (qsum,) = yield (Allreduce(qloc),)
        st["q"].assign(tf.reshape(qsum, [-1]))
        return scaled(tf.reshape(tf.matmul(phat, qsum, transpose_b=True), [-1]), ctx.scale)
