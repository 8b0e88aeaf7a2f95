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

import tensorflow as tf

from hvdcompress.reference.sparse import randomk_momentum_warning

from .base import OneRoundCompressor, selected_count
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


class TopKCompressor(_GatheredSparse):
    name = "topk"

    def select(self, a, ctx):
        return topk_indices(a, selected_count(self.density(ctx), int(a.shape[0])))


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
