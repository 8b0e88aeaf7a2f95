"""Dense codecs in TensorFlow: every entry is sent, possibly in fewer bits.

none  allreduce the gradient itself.
fp16  x -> half; the halves are summed on the wire (as Horovod's Compression.fp16); -> x.dtype.
bf16  x -> bfloat16 (round to nearest, ties to even: ``tf.cast`` does exactly what the numpy
      oracle's bit arithmetic does); the 16-bit codes travel as int16, are gathered, decoded and
      summed in x.dtype in rank order, so the sum does not lose bf16's 8-bit mantissa a second time.
"""

from __future__ import annotations

import tensorflow as tf

from .base import OneRoundCompressor


# Codecs for Horovod's own Compression protocol (``hvdcompress.horovod_interop``): Horovod's
# optimizers call ``compress(tensor)``, allreduce the payload and call ``decompress(payload, ctx)``.
# Non-floating tensors pass through unchanged, as in Horovod's own FP16Compressor.

class NoneCodec:
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Codec:
    """As ``horovod.tensorflow.Compression.fp16``: half on the wire, summed in half by Horovod."""

    @staticmethod
    def compress(tensor):
        if not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tensor, tf.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class BF16Codec:
    """Horovod 0.28.1 cannot carry bfloat16: round to bfloat16 (``tf.cast``: nearest even, as our
    ``bf16``), send the rounded values as float32 (4 bytes per entry), cast the sum back."""

    @staticmethod
    def compress(tensor):
        if not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tf.cast(tensor, tf.bfloat16), tf.float32), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class NoneCompressor(OneRoundCompressor):
    name = "none"
    horovod_codec = NoneCodec
    summed = True

    def compress(self, a, sel, ctx):
        return (a,)

    def decompress(self, payload, like, sel, ctx):
        return payload[0]

    def aggregate(self, results, like, sel, ctx):
        return results[0]


class FP16Compressor(OneRoundCompressor):
    name = "fp16"
    horovod_codec = FP16Codec
    summed = True

    def compress(self, a, sel, ctx):
        return (tf.cast(a, tf.float16),)

    def decompress(self, payload, like, sel, ctx):
        return tf.cast(payload[0], like.dtype)

    def aggregate(self, results, like, sel, ctx):
        return tf.cast(results[0], like.dtype)


class BF16Compressor(OneRoundCompressor):
    name = "bf16"
    horovod_codec = BF16Codec
    summed = False

    def compress(self, a, sel, ctx):
        return (tf.bitcast(tf.cast(a, tf.bfloat16), tf.int16),)

    def decompress(self, payload, like, sel, ctx):
        return tf.cast(tf.bitcast(payload[0], tf.bfloat16), like.dtype)

    def aggregate(self, results, like, sel, ctx):
        parts = tf.reshape(results[0], [ctx.world_size, -1])
        total = self.decompress((parts[0],), like, sel, ctx)
        for r in range(1, ctx.world_size):  # rank order: the same float sum everywhere
            total = total + self.decompress((parts[r],), like, sel, ctx)
        return total
