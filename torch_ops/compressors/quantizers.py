"""Quantizers with real bit packing in PyTorch: signsgd, efsignsgd, onebit, terngrad, qsgd.

Each sends one gathered uint8 tensor, ``[float32 scales as bytes | packed codes]``, and decodes
the gathered buffers rank by rank, summing in rank order. The numpy oracle
``hvdcompress.reference.quantizers`` defines every operation and its order; this module follows it
operation for operation (reductions in float64 rounded once to float32, float32 elsewhere), so the
payload bytes, results and residuals agree bit for bit. Scales are per member of ``ctx.members``
(``merge=PER_MEMBER``); per bucket of ``bucket`` entries for terngrad and qsgd; per column of each
member for ``onebit:scope=column``.

efsignsgd and onebit apply the wrapped SGD's momentum before compression (``TakesMomentum``: it is
taken over, the optimizer runs without): u = m*u + g in ``ctx.state["u"]``, and error feedback
compresses the velocity (the oracle's module doc says why).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Tuple

import torch

from hvdcompress.momentum import momentum_of
from hvdcompress.packing import bits_for_levels
from hvdcompress.reference.quantizers import SCALE_BYTES, Layout, column_spans, layout_for

from ..collectives import Allgather
from ..gpu import quant as gpu_quant
from . import quant_native
from .base import OneRoundCompressor, TakesMomentum
from .packing import pack, uniform, unpack


def bucket_reduce(v: torch.Tensor, lay: Layout, op: str) -> torch.Tensor:
    """Per segment: "max" (of v >= 0) or "sum" (in v's dtype), zero-padded buckets."""
    out = []
    for off, n, nb in lay.member_segments():
        if nb == 0:
            continue
        width = lay.bucket if lay.bucket else n
        if nb * width == n:  # no padding needed: a view
            grid = v[off:off + n].view(nb, width)
        else:
            grid = v.new_zeros(nb * width)
            grid[:n] = v[off:off + n]
            grid = grid.view(nb, width)
        out.append(grid.amax(dim=1) if op == "max" else grid.sum(dim=1))
    return torch.cat(out) if out else v.new_zeros(0)


def expand(scales: torch.Tensor, lay: Layout, numel: int) -> torch.Tensor:
    """Every entry's segment value (entries outside every member get 0); a broadcast view when
    one segment covers the tensor, an expanded view when its buckets tile it exactly."""
    if lay.spans == ((0, numel),):
        if lay.segments == 1:
            return scales.expand(numel)
        if lay.bucket and numel % lay.bucket == 0:
            return scales[:, None].expand(lay.segments, lay.bucket).reshape(-1)
    counts = torch.tensor(lay.counts, dtype=torch.int64, device=scales.device)
    if lay.spans == ((0, numel),):
        return torch.repeat_interleave(scales, counts, output_size=numel)
    out = scales.new_zeros(numel)
    i = 0
    for off, n, nb in lay.member_segments():
        out[off:off + n] = torch.repeat_interleave(scales[i:i + nb], counts[i:i + nb], output_size=n)
        i += nb
    return out


def sign_bits(a: torch.Tensor) -> torch.Tensor:
    return (a >= 0).to(torch.uint8)


class _Packed(OneRoundCompressor):
    summed = False
    bits = 1
    scales_per_segment = 0

    def layout(self, numel: int, ctx) -> Layout:
        return layout_for(ctx.members, numel, self.spec.params.get("bucket", 0))

    @abstractmethod
    def encode(self, a: torch.Tensor, lay: Layout, ctx) -> Tuple[torch.Tensor, torch.Tensor]:
        """(float32 scales, uint8 codes)."""

    @abstractmethod
    def decode(self, scales, codes, lay, numel, ctx) -> torch.Tensor:
        """The dense float tensor the payload stands for."""

    def compress(self, a, ctx):
        lay = self.layout(a.numel(), ctx)
        scales, codes = self.encode(a.to(torch.float32), lay, ctx)
        return (torch.cat([scales.contiguous().view(torch.uint8), pack(codes, self.bits)]),)

    def scale_count(self, lay: Layout, numel: int, ctx) -> int:
        """float32 scales at the head of a payload."""
        return lay.segments * self.scales_per_segment

    def _decode_buffer(self, buf, numel, ctx):
        lay = self.layout(numel, ctx)
        head = SCALE_BYTES * self.scale_count(lay, numel, ctx)
        scales = buf[:head].clone().view(torch.float32)
        return self.decode(scales, unpack(buf[head:], self.bits, numel), lay, numel, ctx)

    def decompress(self, payload, like, ctx):
        return self._decode_buffer(payload[0], like.numel(), ctx).to(like.dtype)

    def exchange(self, x, ctx):
        """The Triton kernels where they serve (``torch_ops.gpu``: CUDA float32), the compiled ones
        (``quant_native``: CPU float32), else the torch ops."""
        job = gpu_quant.plan(self, x, ctx) or quant_native.plan(self, x, ctx)
        if job is None:
            return (yield from super().exchange(x, ctx))
        (gathered,) = yield (Allgather(job.encode(), same_shape=True),)
        return job.decode_sum(gathered)

    def aggregate(self, results, like, ctx):
        parts = results[0].view(ctx.world_size, -1)
        total = self._decode_buffer(parts[0], like.numel(), ctx)
        for part in parts[1:]:  # rank order
            total += self._decode_buffer(part, like.numel(), ctx)
        return total.to(like.dtype)


class SignSGDCompressor(_Packed):
    name = "signsgd"

    def encode(self, a, lay, ctx):
        return a.new_zeros(0), sign_bits(a)

    def decode(self, scales, codes, lay, numel, ctx):
        return codes.to(torch.float32) * 2.0 - 1.0

    def aggregate(self, results, like, ctx):
        numel = like.numel()
        parts = results[0].view(ctx.world_size, -1)
        votes = torch.zeros(numel, dtype=torch.int32, device=like.device)
        for part in parts:
            votes += unpack(part, 1, numel).to(torch.int32) * 2 - 1
        return (torch.sign(votes).to(torch.float32) * float(ctx.world_size)).to(like.dtype)


class _MomentumInside(TakesMomentum):
    """The optimizer's momentum before compression: the exchange compresses the velocity
    u = m*u + g (Nesterov: g + m*u) with error feedback on it. With ``momentum_correction=false``
    nothing is taken over and the optimizer keeps its momentum."""

    @classmethod
    def adapt_optimizer(cls, spec, param_groups):
        return super().adapt_optimizer(spec, param_groups) if spec["momentum_correction"] else spec

    def after_load(self, param_groups) -> None:
        if self.spec["momentum_correction"]:
            super().after_load(param_groups)

    def before_step(self, param_groups, state) -> None:
        if self.spec["momentum_correction"]:
            super().before_step(param_groups, state)

    def exchange(self, x, ctx):
        m = momentum_of(self.spec)
        if m > 0.0:  # only with momentum_correction (the spec's check)
            u = ctx.state.get("u")
            if u is None:
                u = ctx.state["u"] = torch.zeros_like(x)
            mt = torch.tensor(m, dtype=x.dtype)  # m rounded to the gradient's dtype, as the oracle and TF
            u.mul_(mt).add_(x)
            # the exchange never writes its input, so u itself is passed on (no copy)
            x = x + u * mt if self.spec["nesterov"] else u
        return (yield from super().exchange(x, ctx))


class EFSignSGDCompressor(_MomentumInside, _Packed):
    name = "efsignsgd"
    scales_per_segment = 1

    def encode(self, a, lay, ctx):
        sums = bucket_reduce(a.abs().to(torch.float64), lay, "sum")
        counts = torch.tensor(lay.counts, dtype=torch.float64, device=a.device)
        return (sums / counts).to(torch.float32), sign_bits(a)

    def decode(self, scales, codes, lay, numel, ctx):
        s = expand(scales, lay, numel)
        return torch.where(codes == 1, s, -s)


class OneBitCompressor(_MomentumInside, _Packed):
    name = "onebit"
    scales_per_segment = 2

    def columns(self, numel, ctx):
        return column_spans(ctx.members, numel, ctx.shape) if self.spec["scope"] == "column" else None

    def scale_count(self, lay, numel, ctx) -> int:
        cols = self.columns(numel, ctx)
        return super().scale_count(lay, numel, ctx) if cols is None else 2 * sum(c for _, _, c in cols)

    def encode(self, a, lay, ctx):
        cols = self.columns(a.numel(), ctx)
        if cols is not None:
            return encode_columns(a, cols), sign_bits(a)
        bits = sign_bits(a)
        one = bits == 1
        a64 = a.to(torch.float64)
        zero = a64.new_zeros(())
        pos_sum = bucket_reduce(torch.where(one, a64, zero), lay, "sum")
        pos_n = bucket_reduce(bits.to(torch.float64), lay, "sum")
        neg_sum = bucket_reduce(torch.where(one, zero, a64), lay, "sum")
        neg_n = torch.tensor(lay.counts, dtype=torch.float64, device=a.device) - pos_n
        pos = torch.where(pos_n > 0, pos_sum / pos_n, zero).to(torch.float32)
        neg = torch.where(neg_n > 0, neg_sum / neg_n, zero).to(torch.float32)
        return torch.stack([pos, neg], dim=1).reshape(-1), bits

    def decode(self, scales, codes, lay, numel, ctx):
        cols = self.columns(numel, ctx)
        if cols is not None:
            return decode_columns(scales, codes, cols, numel)
        pn = scales.view(-1, 2)
        return torch.where(codes == 1, expand(pn[:, 0].contiguous(), lay, numel),
                           expand(pn[:, 1].contiguous(), lay, numel))


def encode_columns(a: torch.Tensor, cols) -> torch.Tensor:
    """Per column of every member: (mean of the entries >= 0, mean of the others), float64 sums
    rounded once to float32, 0 for an empty part; pairs in column order (the oracle's rule)."""
    out = []
    for off, rows, c in cols:
        part = a[off:off + rows * c].to(torch.float64).view(rows, c)
        one = part >= 0
        zero = part.new_zeros(())
        pos_n = one.sum(dim=0, dtype=torch.float64)
        neg_n = rows - pos_n
        pos_sum = torch.where(one, part, zero).sum(dim=0)
        neg_sum = torch.where(one, zero, part).sum(dim=0)
        pos = torch.where(pos_n > 0, pos_sum / pos_n, zero).to(torch.float32)
        neg = torch.where(neg_n > 0, neg_sum / neg_n, zero).to(torch.float32)
        out.append(torch.stack([pos, neg], dim=1).reshape(-1))
    return torch.cat(out) if out else a.new_zeros(0, dtype=torch.float32)


def decode_columns(scales: torch.Tensor, codes: torch.Tensor, cols, numel: int) -> torch.Tensor:
    """Every entry's column value for its bit (entries outside every member get 0)."""
    out = scales.new_zeros(numel)
    i = 0
    for off, rows, c in cols:
        pn = scales[2 * i:2 * (i + c)].view(c, 2)
        bits = codes[off:off + rows * c].view(rows, c)
        out[off:off + rows * c] = torch.where(bits == 1, pn[:, 0], pn[:, 1]).reshape(-1)
        i += c
    return out


class TernGradCompressor(_Packed):
    name = "terngrad"
    bits = 2
    scales_per_segment = 1

    def ternarize(self, a, s, lay, ctx):
        """2-bit codes of ``a`` for scales ``s``: keep |a| / s with probability, sign in the code."""
        mag = a.abs()
        se = expand(s, lay, a.numel())
        p = torch.where(se > 0, mag / se, mag.new_zeros(()))
        u = uniform(a.numel(), self.spec["seed"], ctx.step, ctx.key, ctx.rank, device=a.device)
        keep = u < p
        return torch.where(a >= 0, 1, 2).to(torch.uint8) * keep.to(torch.uint8)

    def encode(self, a, lay, ctx):
        s = bucket_reduce(a.abs(), lay, "max")
        return s, self.ternarize(a, s, lay, ctx)

    def decode(self, scales, codes, lay, numel, ctx):
        s = expand(scales, lay, numel)
        zero = s.new_zeros(())
        return torch.where(codes == 1, s, torch.where(codes == 2, -s, zero))

    def exchange(self, x, ctx):
        """With ``share_scale`` (Wen et al.'s scaler sharing): the scales are gathered first and
        every rank quantizes with their max over ranks; then the codes alone are gathered and
        the result is (the int32 sum of the ranks' +-1/0) * s. Otherwise one round."""
        if not self.spec["share_scale"]:
            return (yield from super().exchange(x, ctx))
        a = self.memory.compensate(x, ctx.state)
        a32 = a.to(torch.float32)
        numel = a.numel()
        lay = self.layout(numel, ctx)
        (gathered,) = yield (Allgather(bucket_reduce(a32.abs(), lay, "max"), same_shape=True),)
        s = gathered.view(ctx.world_size, -1).amax(dim=0) if lay.segments else gathered
        codes = self.ternarize(a32, s, lay, ctx)
        self.memory.update(lambda: a - self.decode(s, codes, lay, numel, ctx).to(a.dtype), ctx.state)
        (packed,) = yield (Allgather(pack(codes, self.bits), same_shape=True),)
        votes = torch.zeros(numel, dtype=torch.int32, device=a.device)
        for part in (packed.view(ctx.world_size, -1) if numel else ()):  # an integer sum: any order
            got = unpack(part, self.bits, numel)
            votes += (got == 1).to(torch.int32) - (got == 2).to(torch.int32)
        total = (votes.to(torch.float32) * expand(s, lay, numel)).to(a.dtype)
        if ctx.scale != 1.0:
            total.mul_(ctx.scale)
        return total


class QSGDCompressor(_Packed):
    name = "qsgd"
    scales_per_segment = 1

    def __init__(self, spec):
        super().__init__(spec)
        self.bits = bits_for_levels(2 * spec["levels"] + 1)

    def encode(self, a, lay, ctx):
        s = float(self.spec["levels"])
        sq = bucket_reduce(a.to(torch.float64).square(), lay, "sum")
        v = sq.sqrt().to(torch.float32)
        f = torch.where(v > 0, torch.full_like(v, s) / v, v.new_zeros(()))
        r = a.abs() * expand(f, lay, a.numel())
        low = torch.floor(r)
        u = uniform(a.numel(), self.spec["seed"], ctx.step, ctx.key, ctx.rank, device=a.device)
        level = torch.clamp_max(low + (u < (r - low)).to(torch.float32), s)
        signed = torch.where(a >= 0, level, -level)
        return v, (signed + s).to(torch.uint8)

    def decode(self, scales, codes, lay, numel, ctx):
        s = float(self.spec["levels"])
        w = scales * torch.tensor(1.0 / s, dtype=torch.float32)
        return (codes.to(torch.float32) - s) * expand(w, lay, numel)
