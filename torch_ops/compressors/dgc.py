"""Deep Gradient Compression (Lin et al., ICLR 2018) for PyTorch.

The math, per worker and tensor (u: momentum, v: accumulated velocity, both in ``ctx.state``;
the numpy oracle ``hvdcompress.reference.dgc`` spells out every step and the order of operations):

    g <- g * min(1, clip_norm / sqrt(N) / ||g||)          local gradient clipping (optional;
         clip_scope=tensor: each member tensor's norm; global: the whole local gradient's norm of
         the previous step, ``hvdcompress.clipping``, so groups still launch during backward)
    u <- m*u + g;  v <- v + u   (Nesterov: v <- v + g + m*u)   momentum correction
    I <- sampled-threshold top-k of |v|, k = ceil(density(epoch) * n)
    send (I, v[I]);  v[I] <- 0;  u[I] <- 0                 momentum factor masking
    result = (sum over ranks of the scattered values) / N

Because the momentum lives here, the wrapped optimizer must not apply its own: the
``DistributedOptimizer`` takes an SGD optimizer's momentum over (see ``adopt_momentum``), and
its ``weight_decay`` with it: the decay gets its own momentum, outside the exchange, added to the
exchanged result before the step (``TakesMomentum.before_step``; the oracle's
``weight_decay_step`` says why this placement, the paper's reference implementation's).
Tensors that are 1-D or smaller than ``min_sparse_numel`` are exchanged dense (allreduce of the
velocity u), so every parameter gets the same momentum SGD treatment. Each switch of the spec
(momentum_correction, clip_norm, momentum_masking, warmup_epochs) turns one technique off for
ablations; with momentum correction off, momentum is applied to the exchanged average instead.
"""

from __future__ import annotations

import math

import torch

from hvdcompress.clipping import GlobalNorm, clip_coefficient
from hvdcompress.momentum import check_dgc_under_adam
from hvdcompress.sampling import sample_offset, sample_stride
from hvdcompress.reference.dgc import dgc_density, dgc_sends_dense
from hvdcompress.spec import CompressionSpec, num_selected

from ..collectives import Allgather, Allreduce
from .base import Compressor, ExchangeContext, TakesMomentum
from .dgc_selection import accumulate_and_select, take_and_zero
from .sparse import scaled_sum


class DGCCompressor(TakesMomentum, Compressor):
    name = "dgc"
    summed = False

    @classmethod
    def adapt_optimizer(cls, spec: CompressionSpec, param_groups):
        """SGD's momentum taken over (``TakesMomentum``); an Adam-family optimizer (groups with ``betas``) is refused or warned about
        first (``hvdcompress.momentum.check_dgc_under_adam``)."""
        check_dgc_under_adam(spec, any("betas" in g for g in param_groups))
        return super().adapt_optimizer(spec, param_groups)

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec)
        p = spec.params
        self.m = p["momentum"]
        self.nesterov = p["nesterov"]
        self.correction = p["momentum_correction"]
        self.masking = p["momentum_masking"] and p["momentum_correction"]
        self.clip_norm = p["clip_norm"]
        self.clip_global = p["clip_scope"] == "global"
        self.global_norm = GlobalNorm()  # clip_scope=global: the whole local gradient's norm, one step late

    def global_state(self):
        return {"global_norm": self.global_norm.state()} if self.clip_global else {}

    def load_global_state(self, state) -> None:
        if self.clip_global:
            self.global_norm.load((state or {}).get("global_norm"))

    def density(self, epoch: int) -> float:
        return dgc_density(self.spec, epoch)

    def is_dense(self, shape) -> bool:
        return dgc_sends_dense(self.spec, tuple(shape))

    def _clip(self, g: torch.Tensor, ctx: ExchangeContext) -> torch.Tensor:
        """Local clipping (``hvdcompress.clipping``): per member tensor, or every member by the
        previous step's whole-gradient norm (this step's sums of squares are recorded for the next)."""
        if self.clip_norm is None:
            return g
        views = ctx.member_views(g)
        sumsq = [float(torch.sum(view.double() ** 2)) for _, view in views]
        if self.clip_global:
            coef = clip_coefficient(self.global_norm.norm_before(ctx.step), self.clip_norm, ctx.world_size)
            for (m, _), s in zip(views, sumsq):
                self.global_norm.record(ctx.step, m.name, s)
            return g if coef is None else g * torch.tensor(coef, dtype=g.dtype)
        out = g
        for (m, view), s in zip(views, sumsq):
            coef = clip_coefficient(math.sqrt(s), self.clip_norm, ctx.world_size)
            if coef is not None:
                out = out.clone() if out is g else out
                out[m.offset:m.offset + m.numel].mul_(torch.tensor(coef, dtype=g.dtype))
        return out

    def _state(self, ctx: ExchangeContext, name: str, like: torch.Tensor) -> torch.Tensor:
        t = ctx.state.get(name)
        if t is None:
            t = ctx.state[name] = torch.zeros_like(like)
        return t

    def _momentum_after(self, avg: torch.Tensor, ctx: ExchangeContext) -> torch.Tensor:
        """Momentum correction off: plain momentum on the exchanged average (same on all ranks)."""
        u = self._state(ctx, "u", avg)
        u.mul_(self.m).add_(avg)
        return avg + u * self.m if self.nesterov else u.clone()

    @property
    def can_send_dense(self) -> bool:
        return self.correction

    def dense_send(self, x, ctx):
        """Clipped like every exchange of this compressor, then ``TakesMomentum.dense_send``."""
        return super().dense_send(self._clip(x, ctx), ctx)

    def exchange(self, x: torch.Tensor, ctx: ExchangeContext):
        shape = ctx.shape or tuple(x.shape)
        g = self._clip(x, ctx)
        u = self._state(ctx, "u", g)
        if self.is_dense(shape):
            if self.correction:
                u.mul_(self.m).add_(g)
                send = g + u * self.m if self.nesterov else u.clone()
            else:
                send = g.clone()
            (total,) = yield (Allreduce(send),)
            total.mul_(ctx.scale)
            return total if self.correction else self._momentum_after(total, ctx)

        v = self._state(ctx, "v", g)
        p = self.spec.params
        k = num_selected(self.density(ctx.epoch), v.numel())
        offset = sample_offset(sample_stride(p["sample_ratio"]), v.numel(), p["seed"], ctx.step, ctx.key)
        # u <- m*u + g; v <- v + u (Nesterov: v + (g + m*u); no correction: v + g) chunk by chunk
        # (g, u, v read and u, v written once), then the sampled selection (one scan of v)
        idx = accumulate_and_select(g, u, v, self.m if self.correction else None, self.nesterov, k,
                                    p["sample_ratio"], p["adapt_iters"], offset)
        values = take_and_zero(v, u if self.masking else None, idx)  # v[idx]; v[idx] = 0 (u[idx] = 0)
        if p["fp16_values"]:
            values = values.to(torch.float16)
        wire_idx = idx.to(torch.int32) if v.numel() <= torch.iinfo(torch.int32).max else idx
        indices, gathered = yield (Allgather(wire_idx), Allgather(values))
        total = scaled_sum(indices, gathered.to(v.dtype), v, ctx.scale, ctx.out)
        return total if self.correction else self._momentum_after(total, ctx)


def adopt_momentum(spec: CompressionSpec, param_groups) -> CompressionSpec:
    """Move an SGD-style optimizer's momentum into the DGC spec, so it is applied once
    (``hvdcompress.momentum``; the groups then run with momentum 0)."""
    return DGCCompressor.adapt_optimizer(spec, param_groups)
