"""Sparsifiers in TensorFlow: send a subset of entries.

topk       the k = ceil(density * numel) largest |a| (ties to the lower index); payload
           (indices int32, values), gathered.
threshold  every entry with |a| >= threshold; payload (indices int32, values), gathered; a rank
           may send nothing (an empty allgather contribution).
randomk    k entries at indices from ``hvdcompress.sampling.random_indices`` (seed, step, tensor
           name shared by all ranks), so the values alone are allreduced.

Gathered payloads are scatter-added in rank order: result[i] = sum over ranks of their value at
i (``tf.scatter_nd`` accumulates duplicates in the order of its indices: the concatenation's
order, i.e. rank order). The density is a tensor when it can change during training (warm-up).
"""

from __future__ import annotations

import warnings
from abc import abstractmethod

import numpy as np
import tensorflow as tf

from hvdcompress.native import select as shared
from hvdcompress.reference.sparse import randomk_momentum_warning

from . import host
from ..collectives import Allgather
from ..memory import Memory, ResidualMemory
from .base import OneRoundCompressor, selected_count
from .dgc import scaled_sum
from .selection import random_selection, threshold_indices, topk_indices, wire_index_dtype


def scatter(indices: tf.Tensor, values: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Dense tensor shaped like ``like`` holding the sum of ``values`` at ``indices``."""
    indices = tf.cast(indices, tf.int64)
    return tf.scatter_nd(indices[:, None], tf.cast(values, like.dtype), tf.shape(like, out_type=tf.int64))


class _GatheredSparse(OneRoundCompressor):
    summed = False

    @abstractmethod
    def select(self, a, ctx):
        """Indices (ascending, distinct) of the entries to send."""

    def compress(self, a, sel, ctx):
        return tf.cast(sel, wire_index_dtype(int(a.shape[0]))), tf.gather(a, sel)

    def decompress(self, payload, like, sel, ctx):
        return scatter(payload[0], payload[1], like)

    def aggregate(self, results, like, sel, ctx):
        return scatter(results[0], results[1], like)


class CompiledTopK:
    """Top-k with error feedback on the shared compiled kernels, in one host call: a = x + r and
    the candidate scan in one pass (``hvdcompress.native.select.add_topk``; without a residual
    ``topk`` on x), the exact tie rule among the candidates, the values taken and zeroed in the new
    residual (a buffer TensorFlow adopts when the variable is assigned). The TF ops' results bit
    for bit."""

    def __init__(self, n: int, residual):
        self.n, self.residual = n, residual
        self.buffers = host.Buffers()

    def _run(self, x, *rest):
        if self.residual is None:
            idx = shared.topk_any(x, int(rest[0]))
            return idx, x[idx]
        r_in, k = rest[0], int(rest[1])
        r = self.buffers.get(self.n, r_in.dtype)
        idx = shared.add_topk(x, r_in, r, k)
        if idx is None:  # k at an edge (or the kernels switched off after tracing): numpy
            np.add(r_in, x, out=r)
            idx = shared.topk_any(r, k)
        values = shared.take_and_zero(r, None, idx)
        bad = ~np.isfinite(values)
        if bad.any():  # the residual is a - a at a sent entry: NaN for inf and NaN (the oracle's)
            r[idx[bad]] = values[bad] - values[bad]
        return idx, values, r

    def __call__(self, x: tf.Tensor, k):
        """(indices int64, values); the residual assigned what is left of x + r."""
        r = self.residual
        inputs = [x] + ([r] if r is not None else []) + [tf.cast(k, tf.int64)]
        outputs = [(tf.int64, [None]), (x.dtype, [None])] + ([(x.dtype, [self.n])] if r is not None else [])
        results = host.call(self._run, inputs, outputs)
        if r is not None:
            r.assign(results[2], read_value=False)
        return results[0], results[1]


class TopKCompressor(_GatheredSparse):
    name = "topk"

    def select(self, a, ctx):
        return topk_indices(a, selected_count(self.density(ctx), int(a.shape[0])))

    def exchange(self, x, ctx):
        """The shared compiled kernels where they serve (``_compiled``), else the TF ops."""
        job = self._compiled(x, ctx)
        if job is None:
            return (yield from super().exchange(x, ctx))
        n = int(x.shape[0])
        idx, values = job(x, selected_count(self.density(ctx), n))
        same = self.spec.info.same_shape
        indices, gathered = yield (Allgather(tf.cast(idx, wire_index_dtype(n)), same), Allgather(values, same))
        return scaled_sum(indices, gathered, n, ctx.scale)

    def _compiled(self, x, ctx):
        """A ``CompiledTopK`` for float32/float64 tensors on CPU of at least
        ``NATIVE_DIRECT_BELOW`` entries (smaller ones: the TF ops), else None."""
        if type(self.memory) not in (Memory, ResidualMemory) or len(x.shape) != 1 or x.shape[0] is None:
            return None
        n = int(x.shape[0])
        if n < shared.NATIVE_DIRECT_BELOW:
            return None
        r = ctx.state.get("residual") if self.spec.params.get("residual", False) else None
        if self.spec.params.get("residual", False) and (r is None or r.dtype != x.dtype or tuple(r.shape) != (n,)):
            return None
        if host.kernels(x, dtypes=(tf.float32, tf.float64)) is None:
            return None
        return CompiledTopK(n, r)


class ThresholdCompressor(_GatheredSparse):
    name = "threshold"

    def select(self, a, ctx):
        return threshold_indices(a, self.spec["threshold"])


class RandomKCompressor(OneRoundCompressor):
    name = "randomk"
    summed = True
    uses_step = True

    def select(self, a, ctx):
        numel = int(a.shape[0])
        return random_selection(numel, selected_count(self.density(ctx), numel), self.spec["seed"],
                                ctx.step, ctx.key)

    @classmethod
    def adapt_optimizer(cls, spec, config):
        """Nothing is taken over; a warning when the optimizer has momentum (the oracle's module doc)."""
        momentum = config.get("momentum", 0.0)
        if isinstance(momentum, (int, float)) and momentum > 0:
            warnings.warn(randomk_momentum_warning(float(momentum)))
        return spec, config

    def compress(self, a, sel, ctx):
        values = tf.gather(a, sel)
        if self.spec["unbiased"]:  # n / k in double, rounded once (the oracle's unbiased_factor)
            k = tf.cast(tf.size(sel), tf.float64)
            f = tf.where(k > 0, tf.cast(int(a.shape[0]), tf.float64) / tf.maximum(k, 1.0), tf.constant(1.0, tf.float64))
            values = values * tf.cast(f, values.dtype)
        return (values,)

    def decompress(self, payload, like, sel, ctx):
        return scatter(sel, payload[0], like)

    def aggregate(self, results, like, sel, ctx):
        return scatter(sel, results[0], like)
