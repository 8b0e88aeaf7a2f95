"""PyTorch codecs for Horovod's own Compression protocol (``hvdcompress.horovod_interop``).

``hvd.DistributedOptimizer(opt, compression=hvc.Compression.fp16)`` calls a spec's
``compress(tensor)``, allreduces the payload and calls ``decompress(payload, ctx)``; the spec
forwards to the codec below for its name. Non-floating tensors pass through unchanged, as in
Horovod's own FP16Compressor.
"""

from __future__ import annotations

import torch


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


CODECS = {"none": NoneCodec, "fp16": FP16Codec, "bf16": BF16Codec}
