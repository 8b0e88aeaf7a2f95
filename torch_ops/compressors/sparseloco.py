"""SparseLoCo's codec in PyTorch: top-k of a decaying error-feedback accumulator, each value sent
in ``bits`` bits. The rules, bit for bit, are ``hvdcompress.reference.sparseloco``'s."""

from __future__ import annotations

import torch

from hvdcompress.spec import num_selected

from ..collectives import Allgather
from .base import Compressor
from .packing import pack, unpack
from .selection import topk_indices

SCALES = 2  # lo, step (float32)


def quantize(v: torch.Tensor, bits: int):
    """(scales [lo, step] float32, codes uint8) of the selected values ``v``."""
    mag = v.abs()
    levels = 2 ** (bits - 1)
    if v.numel() == 0:
        return (torch.zeros(SCALES, dtype=torch.float32, device=v.device),
                torch.zeros(0, dtype=torch.uint8, device=v.device))
    if levels == 1:
        lo, step = mag.double().mean().float(), torch.zeros((), dtype=torch.float32, device=v.device)
        j = torch.zeros(v.numel(), dtype=torch.int64, device=v.device)
    else:
        lo = mag.min()
        step = (mag.max() - lo) / float(levels - 1)
        if bool(step > 0):
            j = torch.round((mag - lo) / step).clamp_(0, levels - 1).to(torch.int64)
        else:
            j = torch.zeros(v.numel(), dtype=torch.int64, device=v.device)
    codes = (2 * j + (v < 0).to(torch.int64)).to(torch.uint8)
    return torch.stack([lo.reshape(()), step.reshape(())]).to(torch.float32), codes


def dequantize(scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    mag = (codes >> 1).to(torch.float32).mul_(scales[1]).add_(scales[0])
    return torch.where((codes & 1) == 1, -mag, mag)


class SparseLoCoCompressor(Compressor):
    name = "sparseloco"
    summed = False

    def exchange(self, x, ctx):
        """In x's dtype: e, the selection and the residual; the values are quantized in float32
        and the result is summed in float32, then cast back to x's dtype."""
        p = self.spec.params
        n = x.numel()
        if n == 0:
            if p["residual"]:
                ctx.state["residual"] = torch.zeros_like(x)
            return torch.zeros_like(x)
        r = ctx.state.get("residual")
        if p["residual"] and r is not None:
            e = r.mul_(p["beta"]).add_(x) if r.dtype == x.dtype else (r * p["beta"] + x).to(x.dtype)
        else:
            e = x.clone()
        # selection on e with NaN/inf as 0: every rank sends exactly k entries even then (the
        # optimizer's non-finite guard makes the result NaN); the same set as e's when e is finite
        sel = e if bool(torch.isfinite(e.sum())) else torch.nan_to_num(e, nan=0.0, posinf=0.0, neginf=0.0)
        idx = topk_indices(sel, num_selected(p["ratio"], n))
        scales, codes = quantize(e[idx].to(torch.float32), p["bits"])
        if p["residual"]:
            e[idx] = e[idx] - dequantize(scales, codes).to(e.dtype)  # subtract what was sent
            ctx.state["residual"] = e
        packed = torch.cat([scales.view(torch.uint8), pack(codes, p["bits"])])
        indices, buffers = yield (Allgather(idx.to(torch.int32), True), Allgather(packed, True))
        k = idx.numel()
        out = torch.zeros(n, dtype=torch.float32, device=x.device)
        head = 4 * SCALES
        for rank, buf in enumerate(buffers.view(ctx.world_size, -1)):
            vals = dequantize(buf[:head].clone().view(torch.float32), unpack(buf[head:], p["bits"], k))
            out.index_add_(0, indices[rank * k:(rank + 1) * k].long(), vals)
        if ctx.scale != 1.0:
            out.mul_(ctx.scale)
        return out.to(x.dtype)
