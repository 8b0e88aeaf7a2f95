"""Top-k with low-bit values and decaying error feedback (SparseLoCo's outer-gradient codec),
declared and defined in numpy: the oracle.

    sparseloco  e = beta * r + x   (error feedback with decay; plain x without ``residual``)
                idx = the k = ceil(ratio * n) largest |e| (ties to the lower index, ascending;
                      NaN and inf count as 0, so every rank sends k entries even then)
                v = e[idx], quantized to ``bits`` bits per value:
                    one sign bit and a (bits - 1)-bit magnitude level j in [0, L), L = 2**(bits-1);
                    L = 1 (bits = 1): every magnitude decodes to lo = mean |v|, step = 0;
                    L > 1: lo = min |v|, step = (max |v| - lo) / (L - 1) (float32), and
                    j = rint((|v| - lo) / step) (0 when step = 0), clipped to [0, L - 1];
                    decoded |v| = lo + j * step; code = 2 * j + (v < 0)
                r = e, minus the decoded values at idx ("subtract what was sent")
                payload: indices (int32) and [float32 lo, step | codes packed ``bits`` wide],
                both allgathered; every rank decodes each rank's values and scatter-adds them in
                rank order, then scales (1/N for an average)

SparseLoCo (2025) sends 2-bit values of a top-k (1-3% density) of the error-feedback
accumulator of DiLoCo's pseudo-gradient, with beta about 0.95; it is written here as a compressor
like any other, so it also compresses gradients in ``DistributedOptimizer``. One pair of scales
per tensor: the spec is ``LAYERWISE`` (one exchange per tensor). float32 arithmetic, one IEEE
operation at a time (the mean in float64, rounded once), so the backends reproduce it bit for bit.
"""

from __future__ import annotations

import numpy as np

from ..packing import pack, packed_size, unpack
from ..spec import GATHERED, LAYERWISE, RATIO_RANGE, Param, Round, num_selected, register, residual_param
from ..wire import index_bytes, selected
from .oracle import Allgather, Oracle
from .selection import topk_indices

F32 = np.float32
SCALES = 2  # lo, step


def _wire(params, d, itemsize, world, density):
    frac = density if density is not None else params["ratio"]
    k = selected(frac, d)
    return (Round(GATHERED, 2, k * index_bytes(d) + np.where(d > 0, 4 * SCALES, 0) + np.ceil(k * params["bits"] / 8)),)


register("sparseloco", GATHERED, "top-k of the error-feedback accumulator e = beta * r + x with each "
         "value sent in ``bits`` bits (a sign and a uniform magnitude level between the smallest and the "
         "largest selected |e|), as (indices, packed codes + two float32 scales)",
         Param("ratio", float, 0.02, "fraction of entries sent", **RATIO_RANGE),
         Param("bits", int, 2, "bits per sent value (a sign bit and bits - 1 magnitude bits)", low=1, high=8),
         Param("beta", float, 0.95, "decay of the residual before the new tensor is added", low=0.0, high=1.0),
         residual_param(True), wire=_wire, merge=LAYERWISE, same_shape=True)


def payload_bytes(params, numel: int) -> int:
    """Bytes one rank sends for a tensor of ``numel`` entries (indices, scales, packed codes)."""
    k = num_selected(params["ratio"], numel)
    return int(k * index_bytes(numel) + (4 * SCALES if numel else 0) + packed_size(k, params["bits"]))


def quantize(v: np.ndarray, bits: int):
    """(scales [lo, step] float32, codes uint8) of the selected values ``v`` (module doc)."""
    v = v.astype(F32)
    mag = np.abs(v)
    levels = 2 ** (bits - 1)
    if v.size == 0:
        return np.zeros(SCALES, F32), np.zeros(0, np.uint8)
    if levels == 1:
        lo, step = F32(mag.astype(np.float64).mean()), F32(0)
        j = np.zeros(v.size, np.int64)
    else:
        lo = mag.min()
        step = F32((mag.max() - lo) / F32(levels - 1))
        if step > 0:
            j = np.clip(np.rint((mag - lo) / step), 0, levels - 1).astype(np.int64)
        else:
            j = np.zeros(v.size, np.int64)
    codes = (2 * j + (v < 0)).astype(np.uint8)
    return np.array([lo, step], F32), codes


def dequantize(scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    lo, step = F32(scales[0]), F32(scales[1])
    mag = lo + (codes >> 1).astype(F32) * step
    return np.where((codes & 1) == 1, -mag, mag).astype(F32)


class SparseLoCoOracle(Oracle):
    name = "sparseloco"

    def exchange(self, x, ctx):
        p = self.spec.params
        n = x.size
        if n == 0:
            if p["residual"]:
                ctx.state["residual"] = np.zeros(0, F32)
            return np.zeros(0, F32)
        r = ctx.state.get("residual")
        e = (F32(p["beta"]) * r + x).astype(F32) if (p["residual"] and r is not None) else x.astype(F32)
        # NaN/inf entries are selected as if 0, so every rank sends exactly k entries
        idx = topk_indices(np.where(np.isfinite(e), e, F32(0)), num_selected(p["ratio"], n))
        scales, codes = quantize(e[idx], p["bits"])
        if p["residual"]:
            rest = e.copy()
            rest[idx] = e[idx] - dequantize(scales, codes)
            ctx.state["residual"] = rest
        packed = np.concatenate([scales.view(np.uint8), pack(codes, p["bits"])])
        indices, buffers = yield (Allgather(idx.astype(np.int32), True), Allgather(packed, True))
        k = idx.size
        out = np.zeros(n, F32)
        for rank, buf in enumerate(buffers.reshape(ctx.world_size, -1)):
            head = 4 * SCALES
            vals = dequantize(np.ascontiguousarray(buf[:head]).view(F32), unpack(buf[head:], p["bits"], k))
            np.add.at(out, indices[rank * k:(rank + 1) * k].astype(np.int64), vals)
        return (out * F32(ctx.scale)).astype(F32)
