"""The quantizers' compiled CPU path: one encode call and one decode + sum call per exchange.

``kernels.cpp``'s ``q_encode`` reads the gradient (and the error-feedback residual) and writes
the whole payload, ``[float32 scales | packed codes]``, and the new residual; ``q_decode_sum``
turns the gathered payloads of every rank into their sum in rank order, times the average's
scale, writing each output entry once. Both follow ``hvdcompress.reference.quantizers``
operation for operation, so the bytes and results are the oracle's (and the torch path's) bit
for bit. ``plan`` says when the kernels serve an exchange: float32 CPU contiguous tensors whose
members tile the flat tensor, the library loaded, the torch-only switch off (``native``);
otherwise it returns None and the caller runs the torch ops.

``onebit:scope=column`` takes its own pair of entry points (``q1c_encode``, ``q1c_decode_sum``):
the members as (rows, columns), a (pos, neg) pair per column, the column sums in the oracle's
float64 order (``kernels.cpp`` says which), the signs and residual in a second pass.

The input is what the memory compensates: the gradient as the compressor receives it, with the
residual added inside the kernel (``a = x + r``), so a preamble that transforms the gradient
first (a momentum taken over from the optimizer) composes by handing its result in as ``x``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hvdcompress.native.quant import Codec, codec
from hvdcompress.rng import stream_base

from . import native


def _usable(t: Optional[torch.Tensor], numel: int) -> bool:
    return (t is not None and t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and not t.is_neg()
            and not t.requires_grad and t.numel() == numel)


class Job:
    """One exchange on the compiled path: ``encode`` then, with the gathered buffer, ``decode_sum``."""

    def __init__(self, lib, layout: Codec, x, rin, rout, base: int, ctx, state):
        self.lib, self.layout, self.x, self.rin, self.rout = lib, layout, x, rin, rout
        self.base, self.ctx, self.state = base, ctx, state
        self.name, self.part = layout.name, layout.part

    def encode(self) -> torch.Tensor:
        out = torch.empty(self.part, dtype=torch.uint8)
        rin = self.rin.data_ptr() if self.rin is not None else None
        rout = self.rout.data_ptr() if self.rout is not None else None
        self.layout.encode(self.lib, self.x.data_ptr(), rin, rout, self.base, out.data_ptr())
        if self.rout is not None:
            self.state["residual"] = self.rout
        return out

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        ctx, n = self.ctx, self.x.numel()
        world = ctx.world_size
        gathered = gathered.contiguous()
        if gathered.numel() != world * self.part:
            raise ValueError(f"{self.name}: gathered {gathered.numel()} bytes, expected {world} x {self.part}")
        out = ctx.out.view(-1) if _usable(ctx.out, n) else torch.empty(n, dtype=torch.float32)
        self.layout.decode_sum(self.lib, gathered.data_ptr(), world, ctx.scale, out.data_ptr())
        return out


def plan(comp, x: torch.Tensor, ctx) -> Optional[Job]:
    """A ``Job`` when the compiled kernels serve this exchange of ``comp``, else None."""
    from ..memory import Memory, ResidualMemory

    params = comp.spec.params
    if type(comp.memory) not in (Memory, ResidualMemory):
        return None
    n = x.numel()
    if not _usable(x, n) or x.dim() != 1:
        return None
    layout = codec(comp.name, params, ctx.members, ctx.shape, n)
    if layout is None:
        return None  # scaler sharing (two rounds), members with gaps: the torch ops
    lib = native.lib()
    if lib is None:
        return None
    rin = rout = None
    if params.get("residual", False):
        r = ctx.state.get("residual")
        if r is None:
            rout = torch.empty(n, dtype=torch.float32)
        elif _usable(r, n) and r.shape == x.shape and r.data_ptr() != x.data_ptr():
            rin = rout = r
        else:
            return None  # the general path checks it (or adds in another dtype)
    base = stream_base(params["seed"], ctx.step, ctx.key, ctx.rank) if "seed" in params else 0
    return Job(lib, layout, x, rin, rout, base, ctx, ctx.state)
