"""1-bit Adam (Tang et al., arXiv 2102.02888) for PyTorch; the math, the warm-up and what stands
in for the paper's server are in the oracle, ``hvdcompress.reference.onebitadam``.

The exchange returns Adam's direction ``d = m_hat / (sqrt(v_hat) + eps)``; the moments ``m``,
``v`` and this rank's error ``residual`` are per-element state (saved in the optimizer's
``state_dict``; the frozen denominator is recomputed from ``v``). After the warm-up the first
moment, divided by the frozen denominator unless ``space=moment``, travels as ``onebit``'s packed
payload (its compressor, error feedback on). With ``optimizer=`` an Adam or AdamW optimizer is taken over
(``hvdcompress.momentum.take_over_adam``): its betas and eps move into the spec, and
``before_step`` applies AdamW's step for it, ``p = p*(1 - lr*wd) - lr*d``, with the group's current
learning rate and weight decay, then clears ``p.grad`` so the wrapped optimizer's own step leaves
the parameter alone (it keeps no moments of its own). SGD without momentum is accepted as it is:
its step on ``d`` is the same update. With ``warmup_codec`` the warm-up's gradient travels as the
``fp16`` or ``bf16`` compressor's exchange.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from hvdcompress.contract import ExchangeContext
from hvdcompress.momentum import is_adam_group, take_over_adam
from hvdcompress.reference.onebitadam import adam_constants, bias_corrections, inner_spec, warmup_spec
from hvdcompress.spec import CompressionSpec

from ..collectives import Allreduce
from .base import Compressor
from .dense import BF16Compressor, FP16Compressor
from .quantizers import OneBitCompressor


def _f32(value: float) -> torch.Tensor:
    """A Python float rounded once to float32 (as the oracle's np.float32 constants)."""
    return torch.tensor(value, dtype=torch.float32)


class FrozenVarianceAdam(Compressor):
    """The frozen-variance Adam of ``hvdcompress.reference.onebitadam`` with the first moment's
    codec given by a subclass: ``moment``, a one-round compressor with error feedback on, whose
    exchange keeps the residual in ``ctx.state`` (1-bit here, top-k in ``topkadam``)."""

    summed = False
    returns_update = True

    def __init__(self, spec: CompressionSpec, moment: Compressor):
        super().__init__(spec)
        self.moment = moment
        codec = spec["warmup_codec"]
        self.warmup = None if codec == "none" else {"fp16": FP16Compressor, "bf16": BF16Compressor}[codec](
            warmup_spec(spec))  # the warm-up's 16-bit exchange (the oracle's warmup_codec)

    @classmethod
    def adapt_optimizer(cls, spec: CompressionSpec, param_groups: List[Dict[str, Any]]) -> CompressionSpec:
        return take_over_adam(spec, param_groups)

    @property
    def can_send_dense(self) -> bool:
        return False  # the result is Adam's direction, not an average a dense group could send

    def before_step(self, param_groups: List[Dict[str, Any]], state: Dict[Any, Dict[str, Any]]) -> None:
        """AdamW's step on the exchanged direction for the Adam groups taken over (module doc)."""
        with torch.no_grad():
            for g in param_groups:
                if not is_adam_group(g):
                    continue
                lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    d = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    if wd:
                        p.mul_(_f32(1.0 - lr * wd))
                    p.sub_(d.to(p.dtype) * _f32(lr).to(p.dtype))
                    p.grad = None

    @staticmethod
    def _moment_state(ctx: ExchangeContext, key: str, like: torch.Tensor) -> torch.Tensor:
        t = ctx.state.get(key)
        if t is None:
            t = ctx.state[key] = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        return t

    def exchange(self, x: torch.Tensor, ctx: ExchangeContext):
        c = adam_constants(self.spec)
        b1, b2, eps = _f32(c["beta1"]), _f32(c["beta2"]), _f32(c["eps"])
        one_b1, one_b2 = _f32(1.0 - c["beta1"]), _f32(1.0 - c["beta2"])
        g = x.reshape(-1).to(torch.float32)
        m = self._moment_state(ctx, "m", g)
        v = self._moment_state(ctx, "v", g)
        f1, f2 = bias_corrections(self.spec, ctx.step)
        if ctx.step < self.spec["warmup_steps"]:
            if self.warmup is None:
                (total,) = yield (Allreduce(g.clone()),)
                mean = total * _f32(ctx.scale)
            else:
                mean = (yield from self.warmup.exchange(g.clone(), ctx)).to(torch.float32)
            m.mul_(b1).add_(mean * one_b1)
            v.mul_(b2).add_((mean * mean) * one_b2)
            denom = self._denominator(v, f2, eps)
        else:
            denom = self._denominator(v, f2, eps)  # v frozen: the same den at every step after the freeze
            local = m * b1 + g * one_b1  # a new tensor: x may be ctx.out, which the moment's exchange writes
            direction = self.spec["space"] == "direction"
            if direction:
                local.div_(denom)
            mean = yield from self.moment.exchange(local, ctx)
            m.copy_(mean * denom if direction else mean)
        return (m * _f32(f1)).div_(denom).to(x.dtype).view_as(x)

    @staticmethod
    def _denominator(v: torch.Tensor, f2: float, eps: torch.Tensor) -> torch.Tensor:
        """sqrt(v) * f2 + eps in float32, as the oracle's ``denominator``."""
        return v.double().sqrt_().float().mul_(_f32(f2)).add_(eps)  # float32 sqrt on CPU is not correctly rounded


class OneBitAdamCompressor(FrozenVarianceAdam):
    name = "onebitadam"

    def __init__(self, spec: CompressionSpec):
        super().__init__(spec, OneBitCompressor(inner_spec(spec)))
