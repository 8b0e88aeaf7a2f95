"""Bit packing and the counter-based uniform generator in TensorFlow ops: mirrors of
``hvdcompress.packing`` and ``hvdcompress.rng`` (same layout, same numbers, bit for bit; see those
modules for the definitions). Vectorised, and usable inside ``tf.function``; ``step`` may be an
int64 tensor (the stream's base is then computed in TF int64 ops, the same arithmetic)."""

from __future__ import annotations

import tensorflow as tf

from hvdcompress.packing import check_bits, packed_size
from hvdcompress.rng import GOLDEN, M1, M2, MASK, SEED_SALT, key_hash, mix32, stream_base

_UNIT = 2.0 ** -24


def _shr(x, k):
    return tf.bitwise.right_shift(x, tf.constant(k, x.dtype))


def _mix32(x: tf.Tensor) -> tf.Tensor:
    """hvdcompress.rng.mix32 on int64 tensors."""
    m = tf.constant(MASK, tf.int64)
    x = tf.bitwise.bitwise_xor(x, _shr(x, 16))
    x = tf.bitwise.bitwise_and(x * tf.constant(M1, tf.int64), m)
    x = tf.bitwise.bitwise_xor(x, _shr(x, 15))
    x = tf.bitwise.bitwise_and(x * tf.constant(M2, tf.int64), m)
    return tf.bitwise.bitwise_xor(x, _shr(x, 15))


def tf_stream_base(seed: int, step, key: str, rank: int = 0):
    """``hvdcompress.rng.stream_base``: a Python int for a Python step, else an int64 tensor."""
    if not tf.is_tensor(step):
        return stream_base(seed, step, key, rank)
    h = tf.constant(mix32((int(seed) & MASK) ^ SEED_SALT), tf.int64)
    h = _mix32(tf.bitwise.bitwise_xor(h, tf.bitwise.bitwise_and(tf.cast(step, tf.int64), MASK)))
    h = _mix32(tf.bitwise.bitwise_xor(h, tf.constant(key_hash(key), tf.int64)))
    return _mix32(tf.bitwise.bitwise_xor(h, tf.constant(int(rank) & MASK, tf.int64)))


def uniform(n: int, seed: int, step, key: str, rank: int = 0) -> tf.Tensor:
    """n float32 uniforms on [0, 1), equal to ``hvdcompress.rng.uniform(n, seed, step, key, rank)``."""
    base = tf_stream_base(seed, step, key, rank)
    x = tf.range(n, dtype=tf.int64) * tf.constant(GOLDEN, tf.int64) + tf.cast(base, tf.int64)
    h = _mix32(tf.bitwise.bitwise_and(x, tf.constant(MASK, tf.int64)))
    return tf.cast(_shr(h, 8), tf.float32) * tf.constant(_UNIT, tf.float32)


def _merge_last2(t: tf.Tensor) -> tf.Tensor:
    """[..., a, b] -> [..., a * b] (a static shape where the input's is)."""
    if t.shape.is_fully_defined():
        dims = t.shape.as_list()
        return tf.reshape(t, dims[:-2] + [dims[-2] * dims[-1]])
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([shape[:-2], [shape[-2] * shape[-1]]], 0))


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """uint8 codes (each < 2**bits, flat) -> packed uint8 bytes (``hvdcompress.packing`` layout).

    A few ops whatever ``bits``: the codes in groups (8 // bits to a byte, or 8 to ``bits``
    bytes), each group's codes times their place values summed in one reduction (disjoint bits:
    the sum is the OR), then, for the widths that straddle bytes, the group's word cut into bytes."""
    bits = check_bits(bits)
    codes = tf.cast(tf.reshape(codes, [-1]), tf.uint8)
    n = int(codes.shape[0])
    nbytes = packed_size(n, bits)
    if bits == 8:
        return tf.identity(codes)
    per = 8 // bits if 8 % bits == 0 else 8
    groups = -(-n // per)
    grid = tf.reshape(tf.pad(codes, [[0, groups * per - n]]), [groups, per])
    if 8 % bits == 0:
        place = tf.constant([1 << (bits * j) for j in range(per)], tf.int32)
        return tf.cast(tf.reduce_sum(tf.cast(grid, tf.int32) * place, axis=1), tf.uint8)
    place = tf.constant([1 << (bits * j) for j in range(8)], tf.int64)
    word = tf.reduce_sum(tf.cast(grid, tf.int64) * place, axis=1)
    shifts = tf.constant([8 * i for i in range(bits)], tf.int64)
    cut = tf.bitwise.bitwise_and(tf.bitwise.right_shift(word[:, None], shifts), tf.constant(0xFF, tf.int64))
    return tf.reshape(tf.cast(cut, tf.uint8), [-1])[:nbytes]


def unpack(packed: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Packed bytes -> the first n uint8 codes, along the last axis (leading axes: one row of
    bytes per rank, unpacked together)."""
    bits = check_bits(bits)
    if len(packed.shape) == 0:
        raise ValueError("unpack: the packed bytes must have at least one axis")
    have = packed.shape[-1]
    if have is not None and int(have) < packed_size(n, bits):
        raise ValueError(f"unpack: {have} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return tf.identity(packed[..., :n])
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        src = packed[..., :-(-n // per)]
        shifts = tf.constant([bits * j for j in range(per)], tf.uint8)
        cols = tf.bitwise.bitwise_and(tf.bitwise.right_shift(src[..., None], shifts), tf.constant(mask, tf.uint8))
        return _merge_last2(cols)[..., :n]
    groups = -(-n // 8)
    nbytes = packed_size(n, bits)
    src = packed[..., :nbytes]
    pad = [[0, 0]] * (len(packed.shape) - 1) + [[0, groups * bits - nbytes]]
    if src.shape.is_fully_defined():
        shape = src.shape.as_list()[:-1] + [groups, bits]
    else:
        shape = tf.concat([tf.shape(src)[:-1], [groups, bits]], 0)
    grid = tf.cast(tf.reshape(tf.pad(src, pad), shape), tf.int64)
    place = tf.constant([1 << (8 * i) for i in range(bits)], tf.int64)
    word = tf.reduce_sum(grid * place, axis=-1)
    shifts = tf.constant([bits * j for j in range(8)], tf.int64)
    cols = tf.bitwise.bitwise_and(tf.bitwise.right_shift(word[..., None], shifts), tf.constant(mask, tf.int64))
    return tf.cast(_merge_last2(cols), tf.uint8)[..., :n]
