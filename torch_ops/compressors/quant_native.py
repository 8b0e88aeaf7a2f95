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

from functools import lru_cache
from typing import Optional, Tuple

import numpy as np
import torch

from hvdcompress.packing import bits_for_levels, packed_size
from hvdcompress.reference.quantizers import SCALE_BYTES, column_spans, member_spans
from hvdcompress.rng import stream_base

from . import native

KINDS = {"signsgd": 0, "efsignsgd": 1, "onebit": 2, "terngrad": 3, "qsgd": 4}
SCALES = {"signsgd": 0, "efsignsgd": 1, "onebit": 2, "terngrad": 1, "qsgd": 1}


@lru_cache(maxsize=64)
def _column_dims(cols: Tuple[Tuple[int, int, int], ...], numel: int) -> Optional[torch.Tensor]:
    """(rows, columns) per member (int64, flat) when the members tile [0, numel) in order, else None."""
    at, out = 0, []
    for off, rows, c in cols:
        if off != at:
            return None
        at += rows * c
        out += [rows, c]
    if at != numel:
        return None
    return torch.tensor(out, dtype=torch.int64)


@lru_cache(maxsize=64)
def _segments(spans: Tuple[Tuple[int, int], ...], numel: int, bucket: int) -> Optional[torch.Tensor]:
    """The segment lengths (int64) when the members tile [0, numel) in order, else None."""
    at, out = 0, []
    for off, n in spans:
        if off != at:
            return None
        at += n
        if n == 0:
            continue
        if bucket:
            full, rest = divmod(n, bucket)
            out.append(np.full(full, bucket, np.int64))
            if rest:
                out.append(np.array([rest], np.int64))
        else:
            out.append(np.array([n], np.int64))
    if at != numel:
        return None
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, np.int64))


def _usable(t: Optional[torch.Tensor], numel: int) -> bool:
    return (t is not None and t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and not t.is_neg()
            and not t.requires_grad and t.numel() == numel)


class Job:
    """One exchange on the compiled path: ``encode`` then, with the gathered buffer, ``decode_sum``."""

    def __init__(self, lib, kind: int, name: str, x, rin, rout, segs, levels: int, base: int, ctx, state, dims=None):
        self.lib, self.kind, self.name, self.x, self.rin, self.rout = lib, kind, name, x, rin, rout
        self.segs, self.levels, self.base, self.ctx, self.state = segs, levels, base, ctx, state
        self.dims = dims  # (rows, columns) per member for onebit per column, else None
        bits = 1 if kind <= 2 else (2 if kind == 3 else bits_for_levels(2 * levels + 1))
        if dims is not None:
            self.part = SCALE_BYTES * 2 * int(dims[1::2].sum()) + packed_size(x.numel(), 1)
        else:
            self.part = SCALE_BYTES * SCALES[name] * segs.numel() + packed_size(x.numel(), bits)

    def encode(self) -> torch.Tensor:
        out = torch.empty(self.part, dtype=torch.uint8)
        n = self.x.numel()
        rin = self.rin.data_ptr() if self.rin is not None else None
        rout = self.rout.data_ptr() if self.rout is not None else None
        if self.dims is not None:
            rc = self.lib.hvdc_q1c_encode(self.x.data_ptr(), rin, rout, n, self.dims.data_ptr(), self.dims.numel() // 2,
                                          out.data_ptr(), self.part)
        else:
            rc = self.lib.hvdc_q_encode(self.kind, self.x.data_ptr(), rin, rout, n, self.segs.data_ptr(),
                                        self.segs.numel(), self.levels, self.base, out.data_ptr(), self.part)
        if rc != 0:
            raise RuntimeError(f"{self.name}: the compiled encoder refused its arguments")
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
        scale = float(np.float32(ctx.scale))
        if self.dims is not None:
            rc = self.lib.hvdc_q1c_decode_sum(gathered.data_ptr(), self.part, world, n, self.dims.data_ptr(),
                                              self.dims.numel() // 2, scale, out.data_ptr())
        else:
            rc = self.lib.hvdc_q_decode_sum(self.kind, gathered.data_ptr(), self.part, world, n, self.segs.data_ptr(),
                                            self.segs.numel(), self.levels, scale, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"{self.name}: the compiled decoder refused its arguments")
        return out


def plan(comp, x: torch.Tensor, ctx) -> Optional[Job]:
    """A ``Job`` when the compiled kernels serve this exchange of ``comp``, else None."""
    from ..memory import Memory, ResidualMemory

    name = comp.name
    params = comp.spec.params
    if name not in KINDS or params.get("share_scale") or type(comp.memory) not in (Memory, ResidualMemory):
        return None  # scaler sharing (two rounds): the torch ops
    n = x.numel()
    if not _usable(x, n) or x.dim() != 1:
        return None
    lib = native.lib()
    if lib is None:
        return None
    dims = None
    if params.get("scope", "tensor") == "column":
        dims = _column_dims(column_spans(ctx.members, n, ctx.shape), n)
        if dims is None:
            return None
        segs = None
    else:
        segs = _segments(member_spans(ctx.members, n), n, int(params.get("bucket", 0)))
        if segs is None:
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
    levels = int(params.get("levels", 0))
    base = stream_base(params["seed"], ctx.step, ctx.key, ctx.rank) if "seed" in params else 0
    return Job(lib, KINDS[name], name, x, rin, rout, segs, levels, base, ctx, ctx.state, dims)
