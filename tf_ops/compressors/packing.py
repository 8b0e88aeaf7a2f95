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


def _shl(x, k):
    return tf.bitwise.left_shift(x, tf.constant(k, x.dtype))


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


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """uint8 codes (each < 2**bits) -> packed uint8 bytes (``hvdcompress.packing`` layout)."""
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
        out = grid[:, 0]
        for j in range(1, per):
            out = tf.bitwise.bitwise_or(out, _shl(grid[:, j], bits * j))
        return out
    wide = tf.cast(grid, tf.int64)
    word = wide[:, 0]
    for j in range(1, 8):
        word = tf.bitwise.bitwise_or(word, _shl(wide[:, j], bits * j))
    cols = [tf.bitwise.bitwise_and(_shr(word, 8 * i), tf.constant(0xFF, tf.int64)) for i in range(bits)]
    return tf.reshape(tf.cast(tf.stack(cols, axis=1), tf.uint8), [-1])[:nbytes]


def unpack(packed: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Packed bytes -> the first n uint8 codes."""
    bits = check_bits(bits)
    packed = tf.reshape(packed, [-1])
    if packed.shape[0] is not None and int(packed.shape[0]) < packed_size(n, bits):
        raise ValueError(f"unpack: {packed.shape[0]} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return tf.identity(packed[:n])
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        m = -(-n // per)
        src = packed[:m]
        cols = [tf.bitwise.bitwise_and(_shr(src, bits * j), tf.constant(mask, tf.uint8)) for j in range(per)]
        return tf.reshape(tf.stack(cols, axis=1), [-1])[:n]
    groups = -(-n // 8)
    src = packed[:min(packed_size(n, bits), groups * bits)]
    grid = tf.cast(tf.reshape(tf.pad(src, [[0, groups * bits - packed_size(n, bits)]]), [groups, bits]), tf.int64)
    word = grid[:, 0]
    for i in range(1, bits):
        word = tf.bitwise.bitwise_or(word, _shl(grid[:, i], 8 * i))
    cols = [tf.bitwise.bitwise_and(_shr(word, bits * j), tf.constant(mask, tf.int64)) for j in range(8)]
    return tf.reshape(tf.cast(tf.stack(cols, axis=1), tf.uint8), [-1])[:n]
