"""A counter-based uniform generator computed identically in numpy, PyTorch and TensorFlow.

Stochastic rounding (TernGrad, QSGD) and PowerSGD's initial Q need random numbers that the numpy
oracle can reproduce bit for bit. Framework RNGs differ, so the numbers are a pure function of
(seed, step, tensor key, rank, index), computed with 32-bit integer hashing that every framework
can do exactly in int64 (every product stays below 2**63; results are masked to 32 bits):

    mix32(x):  x ^= x >> 16;  x = (x * 0x21F0AAAD) & M;  x ^= x >> 15;
               x = (x * 0x735A2D97) & M;  x ^= x >> 15                   (M = 0xFFFFFFFF)
    base     = mix32(mix32(mix32(mix32(seed ^ 0x9E3779B9) ^ step) ^ crc32(key)) ^ rank)
    h[i]     = mix32((i * 0x61C88647 + base) & M)          i = 0, 1, ... (the entry's index)
    u[i]     = float32(h[i] >> 8) * 2**-24                  uniform on [0, 1), 24 random bits

(mix32 is the xorshift-multiply shape of Wellons' "lowbias32", with both multipliers below 2**31
so that x * c < 2**63 for x < 2**32.) ``seed`` and ``rank`` are taken modulo 2**32, ``step``
too (the stream repeats after 2**32 steps). The per-entry part is 9 integer operations, with no
Python loop over entries. ``torch_ops.compressors.packing`` and ``tf_ops.compressors.packing``
mirror this module operation for operation (TF's ``step`` may be a tensor).
"""

from __future__ import annotations

import zlib

import numpy as np

MASK = 0xFFFFFFFF
M1 = 0x21F0AAAD
M2 = 0x735A2D97
GOLDEN = 0x61C88647  # odd, < 2**31: i * GOLDEN < 2**63 for i < 2**32
SEED_SALT = 0x9E3779B9
UNIT = np.float32(2.0 ** -24)


def key_hash(key: str) -> int:
    """crc32 of the tensor's name (the same on every rank and in every process)."""
    return zlib.crc32(key.encode("utf-8"))


def mix32(x):
    """The 32-bit mixer on Python ints or int64 numpy arrays (values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = (x * M1) & MASK
    x = x ^ (x >> 15)
    x = (x * M2) & MASK
    return x ^ (x >> 15)


def stream_base(seed: int, step: int, key: str, rank: int = 0) -> int:
    """The per-(seed, step, key, rank) constant every entry's hash starts from (a Python int)."""
    h = mix32((int(seed) & MASK) ^ SEED_SALT)
    h = mix32(h ^ (int(step) & MASK))
    h = mix32(h ^ key_hash(key))
    return mix32(h ^ (int(rank) & MASK))


def uniform(n: int, seed: int, step: int, key: str, rank: int = 0) -> np.ndarray:
    """n float32 uniforms on [0, 1) for entries 0..n-1 (see the module doc)."""
    base = stream_base(seed, step, key, rank)
    x = np.arange(n, dtype=np.int64)
    x *= GOLDEN
    x += base
    x &= MASK
    h = mix32(x)
    return (h >> 8).astype(np.float32) * UNIT
