"""Dense codecs, declared and defined in numpy: none, fp16, bf16.

    none   {"values": a}             allreduced
    fp16   {"values": fp16(a)}       allreduced in fp16 (the sum rounds to fp16 after each add)
    bf16   {"codes": bf16(a) int16}  allgathered, decoded and summed in fp32 in rank order
"""

from __future__ import annotations

import numpy as np

from ..spec import GATHERED, SUMMED, register, residual_param
from ..wire import dense as dense_wire
from .codecs import bf16_decode, bf16_encode, fp16_decode, fp16_encode
from .oneround import OneRoundOracle

register("none", SUMMED, "dense allreduce, no compression (what Horovod does by default)",
         wire=dense_wire(SUMMED, None), horovod_codec=True)
register("fp16", SUMMED, "cast to IEEE half precision, allreduce in fp16, cast back",
         residual_param(False), wire=dense_wire(SUMMED, 2, half=True), horovod_codec=True)
register("bf16", GATHERED, "round to bfloat16 (nearest even), allgather the 16-bit codes, sum in fp32",
         residual_param(False), wire=dense_wire(GATHERED, 2), horovod_codec=True, same_shape=True)


class NoneOracle(OneRoundOracle):
    name = "none"
    summed = True
    fields = ("values",)

    def payload(self, a, ctx):
        return {"values": a.copy()}

    def decompress(self, payload, numel, dtype, ctx):
        return payload["values"].astype(dtype)

    def aggregate(self, results, numel, dtype, ctx):
        return results[0].astype(dtype)


class FP16Oracle(OneRoundOracle):
    name = "fp16"
    summed = True
    fields = ("values",)

    def payload(self, a, ctx):
        return {"values": fp16_encode(a)}

    def decompress(self, payload, numel, dtype, ctx):
        return fp16_decode(payload["values"], dtype)

    def aggregate(self, results, numel, dtype, ctx):
        return fp16_decode(results[0], dtype)


class BF16Oracle(OneRoundOracle):
    name = "bf16"
    summed = False
    fields = ("codes",)

    def payload(self, a, ctx):
        return {"codes": bf16_encode(a)}

    def decompress(self, payload, numel, dtype, ctx):
        return bf16_decode(payload["codes"], dtype)

    def aggregate(self, results, numel, dtype, ctx):
        total = np.zeros(numel, dtype=dtype)
        for part in results[0].reshape(ctx.world_size, numel):  # rank order
            total = total + bf16_decode(part, dtype)
        return total
