"""Which entries a sparsifier sends, in TensorFlow ops, matching ``hvdcompress.reference`` exactly.

``topk_indices``        the k largest |a|, ties toward the lower index, ascending. ``tf.math.top_k``
                        is specified to put the lower index first among equal values, so its first
                        k are exactly the oracle's set (k may be a tensor). On large tensors it runs
                        on a candidate set, as in ``torch_ops.compressors.selection``: a threshold t
                        a few standard deviations below the k-th largest |a| of a strided sample,
                        the entries with |a| >= t found through per-block maxima (only blocks whose
                        maximum passes are read), top_k among them when there are at least k (then
                        the k-th largest |a| is >= t, so they hold the whole answer), else the full
                        top_k (``tf.cond``: exact in every case, only slower when the sample misled).
``threshold_indices``   every index with |a| >= threshold, ascending.
``random_selection``    ``hvdcompress.sampling.random_indices`` (seed, step, tensor name), run on
                        the host with ``tf.numpy_function`` when the step is a tensor -- never TF's
                        RNG, so every rank and every framework draws the same indices.
``sampled_threshold_select``  DGC's rule (``hvdcompress.sampling``): estimate the k-th largest |v|
                        from a strided sample; select |v| >= thr; above 1.3k selected take the exact
                        top-k among them, below 0.8k lower thr by x0.8 and count again, at most
                        ``adapt_iters`` times. The adaptation is a ``tf.while_loop`` that carries
                        the candidates it found; on large tensors they are found through the
                        block maxima.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import tensorflow as tf

from hvdcompress.sampling import (ACCEPT_HIGH_TENTHS, ACCEPT_LOW_TENTHS, LOWER_FACTOR, index_dtype,
                                  random_indices, sample_offset, sample_stride)

Count = Union[int, tf.Tensor]

BLOCK = 32            # entries per block of the block-maximum filter
DIRECT_BELOW = 4096   # tensors smaller than this take one full top_k
SAMPLE_SIZE = 32768   # target size of top-k's threshold sample
BLOCKS_UNTIL = 0.35   # block filter while at most this fraction of the blocks passes


def wire_index_dtype(numel: int) -> tf.DType:
    """int32 indices on the wire while they fit, int64 beyond (the oracle's rule)."""
    return tf.as_dtype(index_dtype(numel))


def _cond(pred, true_fn, false_fn):
    """``tf.cond``, or a plain branch when the predicate is known in Python."""
    if isinstance(pred, (bool, np.bool_)):
        return true_fn() if pred else false_fn()
    return tf.cond(pred, true_fn, false_fn)


def _nan_last(mag: tf.Tensor) -> tf.Tensor:
    """Magnitudes (>= 0) with NaN as -1: ``top_k`` ranks NaN above every number, the oracle
    below."""
    return tf.where(tf.math.is_nan(mag), tf.constant(-1, mag.dtype), mag)


def _full_topk(mag: tf.Tensor, k: Count) -> tf.Tensor:
    return tf.sort(tf.math.top_k(_nan_last(mag), k, sorted=True).indices)


def _exact_among(idx: tf.Tensor, mag: tf.Tensor, k: Count) -> tf.Tensor:
    """The k of ``idx`` (ascending) with the largest ``mag``, ties toward the lower index, still
    ascending: every entry above the k-th largest value w, then the first ones equal to w (no
    sorted top_k, no sort)."""
    mag = _nan_last(mag)
    w = tf.reduce_min(tf.math.top_k(mag, k, sorted=False).values)
    above = mag > w
    need = tf.cast(k, tf.int32) - tf.reduce_sum(tf.cast(above, tf.int32))
    at = tf.equal(mag, w)
    keep = above | (at & (tf.cumsum(tf.cast(at, tf.int32)) <= need))
    return tf.gather(idx, tf.where(keep)[:, 0])


def _block_absmax(a: tf.Tensor, n: int) -> tf.Tensor:
    """max |a| over each full block of BLOCK entries (the n % BLOCK tail apart)."""
    blocks = tf.reshape(a[:n // BLOCK * BLOCK], [n // BLOCK, BLOCK])
    return tf.maximum(tf.reduce_max(blocks, 1), -tf.reduce_min(blocks, 1))


def _at_least(a: tf.Tensor, n: int, t: tf.Tensor, bmax: tf.Tensor):
    """(indices int64 ascending, their |a|) of every |a_i| >= t, exactly: through the blocks
    whose maximum passes, or over the whole tensor when too many blocks pass."""
    nb = n // BLOCK
    read = (bmax >= t) | tf.math.is_nan(bmax)  # a block whose maximum is NaN may hide numbers >= t

    def by_blocks():
        sel = tf.where(read)[:, 0]
        sub = tf.abs(tf.gather(tf.reshape(a[:nb * BLOCK], [nb, BLOCK]), sel))
        rc = tf.where(sub >= t)  # row-major: ascending
        idx = tf.gather(sel, rc[:, 0]) * BLOCK + rc[:, 1]
        mag = tf.gather_nd(sub, rc)
        if nb * BLOCK < n:
            tail = tf.abs(a[nb * BLOCK:])
            ti = tf.where(tail >= t)[:, 0]
            idx = tf.concat([idx, ti + nb * BLOCK], 0)
            mag = tf.concat([mag, tf.gather(tail, ti)], 0)
        return idx, mag

    def whole():
        mag = tf.abs(a)
        idx = tf.where(mag >= t)[:, 0]
        return idx, tf.gather(mag, idx)

    passing = tf.reduce_sum(tf.cast(read, tf.int32))
    return tf.cond(passing <= int(BLOCKS_UNTIL * nb), by_blocks, whole)


def topk_indices(a: tf.Tensor, k: Count) -> tf.Tensor:
    """Indices (int32, ascending) of the k largest |a|, ties toward the lower index."""
    if isinstance(k, int) and k == 0:
        return tf.zeros([0], tf.int32)
    n = a.shape[0]
    if n is None or n < DIRECT_BELOW:
        return _full_topk(tf.abs(a), k)
    stride = max(16, n // SAMPLE_SIZE)
    sample = tf.abs(a[stride // 2::stride])
    m = len(range(stride // 2, n, stride))
    if isinstance(k, int):
        ks = max(1, min(m, -(-k * m // n)))
        r = ks + int(4 * math.sqrt(ks)) + 4
        k64 = tf.constant(k, tf.int64)
    else:
        k64 = tf.cast(k, tf.int64)
        ks = tf.maximum(tf.constant(1, tf.int64), tf.minimum(tf.constant(m, tf.int64), (k64 * m + n - 1) // n))
        r = ks + tf.cast(4.0 * tf.sqrt(tf.cast(ks, tf.float64)), tf.int64) + 4

    def full():
        return _full_topk(tf.abs(a), k)

    def sampled():
        t = tf.reduce_min(tf.math.top_k(sample, tf.cast(tf.minimum(r, m), tf.int32), sorted=False).values)

        def candidates():
            idx, mag = _at_least(a, n, t, _block_absmax(a, n))
            # at least k candidates: the k-th largest |a| is >= t, so they hold the answer
            return tf.cond(tf.size(idx, out_type=tf.int64) >= k64,
                           lambda: tf.cast(_exact_among(idx, mag, k), tf.int32), full)

        return tf.cond(t > 0, candidates, full)

    return _cond(8 * r <= m, sampled, full)


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
    n = int(v.shape[0])
    k = tf.cast(k, tf.int64)
    sample = tf.abs(v[tf.cast(offset, tf.int64)::sample_stride(sample_ratio)])
    m = tf.size(sample, out_type=tf.int64)
    ks = tf.maximum(tf.constant(1, tf.int64), tf.minimum(m, (k * m + n - 1) // n))  # ceil(k*m/n)
    thr0 = tf.reduce_min(tf.math.top_k(sample, tf.cast(ks, tf.int32), sorted=False).values)
    lower = tf.constant(LOWER_FACTOR, v.dtype)
    if n < DIRECT_BELOW:
        mag = tf.abs(v)

        def at_least(thr):
            idx = tf.where(mag >= thr)[:, 0]
            return idx, tf.gather(mag, idx)
    else:  # every |v| >= thr lies in a block whose maximum is >= thr
        bmax = _block_absmax(v, n)

        def at_least(thr):
            return _at_least(v, n, thr, bmax)

    def accepted(it, count):
        return ((10 * count > ACCEPT_HIGH_TENTHS * k) | (10 * count >= ACCEPT_LOW_TENTHS * k)
                | tf.equal(it, adapt_iters))

    def body(it, thr, count, done, idx, mag):
        idx, mag = at_least(thr)
        count = tf.size(idx, out_type=tf.int64)
        done = accepted(it, count)
        return it + 1, tf.where(done, thr, thr * lower), count, done, idx, mag

    # the accepted candidates are carried out of the loop (not found again)
    _, thr, count, _, idx, mag = tf.while_loop(
        lambda it, thr, count, done, idx, mag: tf.logical_not(done), body,
        (tf.constant(0), thr0, tf.constant(0, tf.int64), tf.constant(False), tf.zeros([0], tf.int64),
         tf.zeros([0], v.dtype)),
        shape_invariants=(tf.TensorShape([]), thr0.shape, tf.TensorShape([]), tf.TensorShape([]),
                          tf.TensorShape([None]), tf.TensorShape([None])))
    return tf.cond(10 * count > ACCEPT_HIGH_TENTHS * k,
                   lambda: _exact_among(idx, mag, tf.cast(k, tf.int32)),
                   lambda: idx)
