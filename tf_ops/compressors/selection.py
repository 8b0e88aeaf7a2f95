"""Which entries a sparsifier sends, in TensorFlow ops, matching ``hvdcompress.reference`` exactly.

``topk_indices``        the k largest |a|, ties toward the lower index, ascending. ``tf.math.top_k``
                        is specified to put the lower index first among equal values, so its first
                        k are exactly the oracle's set (k may be a tensor).
``threshold_indices``   every index with |a| >= threshold, ascending.
``random_selection``    ``hvdcompress.sampling.random_indices`` (seed, step, tensor name), run on
                        the host with ``tf.numpy_function`` when the step is a tensor -- never TF's
                        RNG, so every rank and every framework draws the same indices.
``sampled_threshold_select``  DGC's rule (``hvdcompress.sampling``): estimate the k-th largest |v|
                        from a strided sample; select |v| >= thr; above 1.3k selected take the exact
                        top-k among them, below 0.8k lower thr by x0.8 and count again, at most
                        ``adapt_iters`` times. The adaptation is a ``tf.while_loop`` over counts.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import tensorflow as tf

from hvdcompress.sampling import (ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, index_dtype,
                                  random_indices, sample_offset, sample_stride)

Count = Union[int, tf.Tensor]


def wire_index_dtype(numel: int) -> tf.DType:
    """int32 indices on the wire while they fit, int64 beyond (the oracle's rule)."""
    return tf.as_dtype(index_dtype(numel))


def topk_indices(a: tf.Tensor, k: Count) -> tf.Tensor:
    """Indices (int32, ascending) of the k largest |a|, ties toward the lower index."""
    if isinstance(k, int) and k == 0:
        return tf.zeros([0], tf.int32)
    return tf.sort(tf.math.top_k(tf.abs(a), k, sorted=True).indices)


def threshold_indices(a: tf.Tensor, threshold: float) -> tf.Tensor:
    """Indices (int64, ascending) of every |a| >= threshold (compared in a's dtype)."""
    return tf.where(tf.abs(a) >= tf.cast(threshold, a.dtype))[:, 0]


def _host_scalar(fn, args, dtype) -> tf.Tensor:
    out = tf.numpy_function(fn, args, dtype, stateful=False)
    out.set_shape([])
    return out


def random_selection(numel: int, k: Count, seed: int, step, key: str) -> tf.Tensor:
    """``random_indices(numel, k, seed, step, key)`` as a tensor; step and k may be tensors."""
    if not tf.is_tensor(step) and not tf.is_tensor(k):
        return tf.constant(random_indices(numel, int(k), seed, int(step), key))

    def draw(step_, k_):
        return random_indices(numel, int(k_), seed, int(step_), key)

    idx = tf.numpy_function(draw, [tf.cast(step, tf.int64), tf.cast(k, tf.int64)],
                            wire_index_dtype(numel), stateful=False)
    idx.set_shape([k] if isinstance(k, int) else [None])
    return idx


def sampling_offset(stride: int, numel: int, seed: int, step, key: str) -> Count:
    """``sample_offset`` for a Python or tensor step."""
    if not tf.is_tensor(step):
        return sample_offset(stride, numel, seed, int(step), key)
    return _host_scalar(lambda s: np.int64(sample_offset(stride, numel, seed, int(s), key)),
                        [tf.cast(step, tf.int64)], tf.int64)


def sampled_threshold_select(v: tf.Tensor, k: Count, sample_ratio: float, adapt_iters: int,
                             offset: Count) -> tf.Tensor:
    """Indices (int64, ascending) chosen by DGC's sampled threshold on |v| (v flat)."""
    mag = tf.abs(v)
    n = int(v.shape[0])
    k = tf.cast(k, tf.int64)
    sample = mag[tf.cast(offset, tf.int64)::sample_stride(sample_ratio)]
    m = tf.size(sample, out_type=tf.int64)
    ks = tf.maximum(tf.constant(1, tf.int64), tf.minimum(m, (k * m + n - 1) // n))  # ceil(k*m/n)
    thr0 = tf.reduce_min(tf.math.top_k(sample, tf.cast(ks, tf.int32), sorted=False).values)
    lower = tf.constant(LOWER_FACTOR, mag.dtype)

    def accepted(it, count):
        return ((10 * count > ACCEPT_HIGH_TENTHS * k) | (10 * count >= ACCEPT_LOW_TENTHS * k)
                | tf.equal(it, adapt_iters))

    def body(it, thr, count, done):
        count = tf.reduce_sum(tf.cast(mag >= thr, tf.int64))
        done = accepted(it, count)
        return it + 1, tf.where(done, thr, thr * lower), count, done

    _, thr, count, _ = tf.while_loop(
        lambda it, thr, count, done: tf.logical_not(done), body,
        (tf.constant(0), thr0, tf.constant(0, tf.int64), tf.constant(False)))
    idx = tf.where(mag >= thr)[:, 0]
    return tf.cond(10 * count > ACCEPT_HIGH_TENTHS * k,
                   lambda: tf.gather(idx, topk_indices(tf.gather(mag, idx), tf.cast(k, tf.int32))),
                   lambda: idx)
