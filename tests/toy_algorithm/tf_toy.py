"""toysign in TensorFlow (see reference_toy)."""

import tensorflow as tf

from hvdcompress.contract import Allreduce
from tf_ops.compressors.base import Compressor


class ToySignCompressor(Compressor):
    name = "toysign"

    def state_slots(self, shape):
        return ("calls",)

    def slot_numel(self, slot, shape):
        return 1

    @property
    def stateful(self):
        return True

    def exchange(self, x, ctx):
        calls = ctx.state["calls"]
        calls.assign_add(tf.ones_like(calls))
        mx = tf.reshape(tf.reduce_max(tf.abs(x)), [1])
        (mx,) = yield (Allreduce(tf.cast(mx, tf.float32)),)
        (signs,) = yield (Allreduce(tf.cast(tf.sign(x), tf.float32)),)
        factor = (mx * tf.constant(ctx.scale, tf.float32)) * tf.constant(self.spec["gain"], tf.float32)
        return signs * factor
