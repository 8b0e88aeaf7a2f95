"""Dense codecs: every entry is sent, possibly in fewer bits.

none  allreduce the gradient itself, in place (Horovod's default path).
fp16  x -> half; the halves are summed on the wire (Horovod's Compression.fp16); -> x.dtype.
bf16  x -> bfloat16 (nearest even); the 16-bit codes are gathered and summed in fp32, in rank
      order, so the sum does not lose bf16's 8-bit mantissa a second time.
"""

from __future__ import annotations

import torch

from .base import ExchangeContext, OneRoundCompressor


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
    """As ``horovod.torch.Compression.fp16``: half on the wire, summed in half by Horovod."""

    @staticmethod
    def compress(tensor):
        if not tensor.dtype.is_floating_point:
            return tensor, None
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class BF16Codec:
    """Horovod 0.28.1 cannot carry bfloat16: round to bfloat16 (nearest even, as our ``bf16``),
    send the rounded values as float32 (4 bytes per entry), cast the sum back."""

    @staticmethod
    def compress(tensor):
        if not tensor.dtype.is_floating_point:
            return tensor, None
        return tensor.to(torch.bfloat16).to(torch.float32), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class NoneCompressor(OneRoundCompressor):
    name = "none"
    horovod_codec = NoneCodec
    summed = True

    def compress(self, a, ctx):
        return (a,)

    def decompress(self, payload, like, ctx):
        return payload[0]

    def aggregate(self, results, like, ctx):
        return results[0]


class FP16Compressor(OneRoundCompressor):
    name = "fp16"
    horovod_codec = FP16Codec
    summed = True

    def compress(self, a, ctx):
        return (a.to(torch.float16),)

    def decompress(self, payload, like, ctx):
        return payload[0].to(like.dtype)

    def aggregate(self, results, like, ctx):
        return results[0].to(like.dtype)


class BF16Compressor(OneRoundCompressor):
    name = "bf16"
    horovod_codec = BF16Codec
    summed = False

    def compress(self, a, ctx):
        return (a.to(torch.bfloat16).view(torch.int16),)

    def decompress(self, payload, like, ctx):
        return payload[0].view(torch.bfloat16).to(like.dtype)

    def aggregate(self, results, like, ctx: ExchangeContext):
        parts = results[0].view(torch.bfloat16).view(ctx.world_size, -1)
        total = parts[0].to(like.dtype)
        for part in parts[1:]:  # rank order: the same float sum on every rank and in the oracle
            total += part.to(like.dtype)
        return total
