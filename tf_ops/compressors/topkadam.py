"""Top-k Adam for TensorFlow: 1-bit Adam's frozen-variance Adam (``onebitadam``'s compressor, its
one allgather a step and its Keras rules) with the first moment sent as ``topk``'s payload, error
feedback on. The math is in the oracle, ``hvdcompress.reference.topkadam``.

After the warm-up a rank's uint8 buffer is topk's payload, its k indices' bytes then its k
float32 values' bytes (k is the same on every rank); the gathered buffers are read back into the
indices and values topk's own two gathers would give (rank order) and summed as topk does."""

from __future__ import annotations

import tensorflow as tf

from hvdcompress.reference.topkadam import inner_spec

from .base import selected_count
from .onebitadam import FrozenVarianceAdam
from .selection import wire_index_dtype
from .sparse import TopKCompressor


class TopKAdamCompressor(FrozenVarianceAdam):
    name = "topkadam"

    def __init__(self, spec):
        super().__init__(spec, TopKCompressor(inner_spec(spec)))

    def packed(self, local, ctx):
        a = self.moment.memory.compensate(local, ctx.state)
        sel = self.moment.select(a, ctx)
        payload = self.moment.compress(a, sel, ctx)
        self.moment.memory.update(lambda: self.moment.unsent(payload, a, sel, ctx), ctx.state)
        return tf.concat([tf.reshape(tf.bitcast(t, tf.uint8), [-1]) for t in payload], 0)

    def decoded_sum(self, gathered, local, ctx):
        n = int(local.shape[0])
        k = selected_count(self.moment.density(ctx), n)  # what ``select`` took, on every rank
        index = wire_index_dtype(n)
        width = tf.dtypes.as_dtype(index).size
        rows = tf.reshape(gathered, [ctx.world_size, k * (width + 4)])
        indices = tf.bitcast(tf.reshape(rows[:, :k * width], [-1, width]), index)
        values = tf.bitcast(tf.reshape(rows[:, k * width:], [-1, 4]), tf.float32)
        return self.moment.aggregate((indices, values), local, None, ctx)
