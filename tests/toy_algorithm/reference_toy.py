"""toysign: a made-up two-round compressor, declared and defined in numpy.

    round 1: allreduce of this rank's max |x| (one float)
    round 2: allreduce of sign(x) (one float per entry)
    result = (summed signs) * (summed max |x| * scale)

State that is not elementwise: "calls", a 1-element counter of this key's exchanges, so the
algorithm declares merge=LAYERWISE (its tensors are never merged; schedule "auto" = layerwise).
"""

import numpy as np

from hvdcompress.contract import LAYERWISE, Allreduce
from hvdcompress.reference.oracle import Oracle
from hvdcompress.spec import SUMMED, Param, Round, register


def _wire(params, d, itemsize, world, density):
    return (Round(SUMMED, 1, np.full_like(d, 4.0)), Round(SUMMED, 1, d * 4.0))


register("toysign", SUMMED, "toy: signs scaled by the summed max |x| (two rounds)",
         Param("gain", float, 1.0, "multiplies the result", low=0.0, low_open=True),
         wire=_wire, merge=LAYERWISE)


class ToySignOracle(Oracle):
    name = "toysign"

    def exchange(self, x, ctx):
        calls = ctx.state.setdefault("calls", np.zeros(1, np.float32))
        calls += 1
        (mx,) = yield (Allreduce(np.abs(x).max(initial=0.0).reshape(1).astype(np.float32)),)
        (signs,) = yield (Allreduce(np.sign(x).astype(np.float32)),)
        factor = (mx * np.float32(ctx.scale)) * np.float32(self.spec["gain"])
        return signs * factor
