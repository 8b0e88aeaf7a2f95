"""Sparsifiers: send a subset of entries.

topk       the k = ceil(ratio * numel) largest |a|; ties go to the lower index (so every
           implementation picks the same set); payload (indices int32, values), gathered.
threshold  every entry with |a| >= threshold; payload (indices, values), gathered; a rank may
           send nothing.
randomk    k entries at indices from ``hvdcompress.sampling.random_indices`` (seed, step and
           tensor name shared by all ranks), so the values alone are allreduced; ``unbiased``
           scales them by n/k.

Gathered payloads are scatter-added in rank order: result[i] = sum over ranks of their value at i.
Indices on the wire are sorted ascending.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod

import numpy as np
import torch

from hvdcompress.reference.sparse import randomk_momentum_warning, unbiased_factor
from hvdcompress.sampling import index_dtype, random_indices
from hvdcompress.spec import num_selected

from ..collectives import Allgather
from ..gpu import select as gpu_select
from ..memory import ResidualMemory
from .base import OneRoundCompressor
from .selection import add_and_topk, threshold_indices, topk_indices


def _torch_index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if index_dtype(numel).itemsize == 4 else torch.int64


class _GatheredSparse(OneRoundCompressor):
    summed = False

    @abstractmethod
    def select(self, a: torch.Tensor) -> torch.Tensor:
        """Indices (int64, ascending, distinct) of the entries to send."""

    def compress(self, a, ctx):
        idx = self.select(a)
        return idx.to(_torch_index_dtype(a.numel())), a[idx]

    def decompress(self, payload, like, ctx):
        out = torch.zeros_like(like)
        out[payload[0].long()] = payload[1]
        return out

    def unsent(self, payload, a, ctx):
        # a = g + r already lives in the residual's buffer (ResidualMemory.compensate): zero the
        # sent entries there; only the first step, whose a is the gradient itself, copies
        r = a if a is ctx.state.get("residual") else a.clone()
        return r.index_fill_(0, payload[0].long(), 0)

    def aggregate(self, results, like, ctx):
        indices, values = results
        return torch.zeros_like(like).index_add_(0, indices.long(), values)


def scaled_sum(indices: torch.Tensor, values: torch.Tensor, like: torch.Tensor, scale: float,
               out=None) -> torch.Tensor:
    """The dense sum of the gathered (index, value) pairs, times ``scale``: ``zeros.index_add_``,
    then only the entries some rank sent are scaled (each to ``sum * scale``, the same rounding as
    scaling the whole tensor, whose other entries stay 0) instead of a pass over all of it. Built
    in ``out`` (``ExchangeContext.out``) when it fits ``like``, else in a new tensor."""
    indices = indices.long()
    fits = out is not None and out.shape == like.shape and out.dtype == like.dtype
    total = (out.zero_() if fits else torch.zeros_like(like)).index_add_(0, indices, values)
    if scale != 1.0:
        total[indices] = total[indices] * scale  # repeated indices write the same value
    return total


class TopKCompressor(_GatheredSparse):
    name = "topk"

    def select(self, a):
        return topk_indices(a, num_selected(self.spec["ratio"], a.numel()))

    def exchange(self, x, ctx):
        """With a residual to add, the compensation a = g + r (in r's buffer, as
        ``ResidualMemory.compensate`` does) and the selection run as one pass (``add_and_topk``);
        otherwise, and on the first step, the generic one-round exchange."""
        r = ctx.state.get("residual") if isinstance(self.memory, ResidualMemory) else None
        if r is None or r.shape != x.shape or r.dtype != x.dtype:
            return (yield from super().exchange(x, ctx))
        idx = add_and_topk(r, x, num_selected(self.spec["ratio"], r.numel()))
        payload = gpu_select.take(r, idx, _torch_index_dtype(r.numel()))  # CUDA: one launch, r[idx] zeroed
        if payload is not None:
            self.memory.update(lambda: r, ctx.state)
        else:
            payload = (idx.to(_torch_index_dtype(r.numel())), r[idx])
            self.memory.update(lambda: self.unsent(payload, r, ctx), ctx.state)
        results = yield (Allgather(payload[0], True), Allgather(payload[1], True))
        return scaled_sum(results[0], results[1], r, ctx.scale, ctx.out)


class ThresholdCompressor(_GatheredSparse):
    name = "threshold"

    def select(self, a):
        return threshold_indices(a, self.spec["threshold"])


class RandomKCompressor(OneRoundCompressor):
    name = "randomk"
    summed = True

    _cached = (None, None)

    def _indices(self, a, ctx) -> torch.Tensor:
        # compress, decompress (residual) and aggregate need the same indices: draw them once
        tag = (ctx.key, ctx.step, a.numel())
        if self._cached[0] != tag:
            idx = random_indices(a.numel(), num_selected(self.spec["ratio"], a.numel()),
                                 self.spec["seed"], ctx.step, ctx.key)
            self._cached = (tag, torch.from_numpy(idx).to(device=a.device, dtype=torch.int64))
        return self._cached[1]

    @classmethod
    def adapt_optimizer(cls, spec, param_groups):
        """Nothing is taken over; a warning when the optimizer has momentum (the oracle's module doc)."""
        momenta = sorted({float(g.get("momentum", 0.0)) for g in param_groups} - {0.0})
        if momenta:
            warnings.warn(randomk_momentum_warning(momenta[-1]))
        return spec

    def compress(self, a, ctx):
        idx = self._indices(a, ctx)
        if self.spec["unbiased"]:
            return (a[idx] * torch.tensor(unbiased_factor(a.numel(), idx.numel(), np.float64).item(), dtype=a.dtype),)
        return (a[idx],)

    def decompress(self, payload, like, ctx):
        out = torch.zeros_like(like)
        out[self._indices(like, ctx)] = payload[0]
        return out

    def unsent(self, payload, a, ctx):
        r = a if a is ctx.state.get("residual") else a.clone()  # see _GatheredSparse.unsent
        return r.index_fill_(0, self._indices(a, ctx), 0)

    def aggregate(self, results, like, ctx):
        return self.decompress(results, like, ctx)
