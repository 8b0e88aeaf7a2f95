"""Count-sketch hashes, COMPUTED from the index (never stored per entry), in numpy.

The count sketch (``hvdcompress.reference.sketch``) needs, for every row j of the table and
every index i of the tensor, a bucket h_j(i) in [0, c) and a sign s_j(i) in {-1, +1}, identical on
every rank and in every framework. A table of r x d int64 hashes would cost 1 GB for a 25M-entry
layer, so they are computed on the fly by a 32-bit integer mixer, vectorised over an index array:

    x  = i XOR rowkey_j                       (i taken modulo 2**32)
    x ^= x >> 16;  x = (x * C1) & M;  x ^= x >> 15;  x = (x * C2) & M;  x ^= x >> 16
    s_j(i) = +1 if the lowest bit of x is 0 else -1
    h_j(i) = ((x >> 1) * c) >> 31             (the top 31 bits scaled to [0, c), no modulo)

with M = 2**32 - 1 and odd multipliers C1, C2 below 2**31, so every product of a 32-bit value
and a multiplier fits in a signed int64: numpy, torch and TensorFlow compute the same bits with
plain int64 multiply / xor / shift / and (no unsigned types, no overflow). ``c`` must be < 2**31.

``rowkey_j`` is a Python int, mixed from (seed, crc32(tensor key), row) by the same mixer on
Python ints, so the rows differ from each other, layers differ from each other (a tensor's key
names it), and every rank, knowing the same seed and key, draws the same hashes.
"""

from __future__ import annotations

import zlib

import numpy as np

M32 = 0xFFFFFFFF
C1 = 0x7FEB352D  # odd, < 2**31
C2 = 0x31848BAB  # odd, < 2**31
SHIFTS = (16, 15, 16)
MAX_COLS = 2 ** 31 - 1


def mix32(x: int) -> int:
    """The mixer on one Python int in [0, 2**32) (a bijection of 32-bit values)."""
    x &= M32
    x ^= x >> SHIFTS[0]
    x = (x * C1) & M32
    x ^= x >> SHIFTS[1]
    x = (x * C2) & M32
    x ^= x >> SHIFTS[2]
    return x


def key_crc(key: str) -> int:
    return zlib.crc32(key.encode("utf-8"))


def row_key(seed: int, key: str, row: int) -> int:
    """The per-row constant XORed into every index before mixing, in [0, 2**32)."""
    x = mix32(seed & M32)
    x = mix32(x ^ ((seed >> 32) & M32))
    x = mix32(x ^ key_crc(key))
    x = mix32(x ^ (0x9E3779B9 * (row + 1) & M32))
    return x


def row_keys(seed: int, key: str, rows: int) -> tuple:
    return tuple(row_key(seed, key, j) for j in range(rows))


def mix32_array(i: np.ndarray, rowkey: int) -> np.ndarray:
    """The mixer of ``(i mod 2**32) XOR rowkey`` for an int64 index array, as int64 in [0, 2**32)."""
    x = (np.asarray(i, dtype=np.int64) & M32) ^ np.int64(rowkey)
    x ^= x >> SHIFTS[0]
    x = (x * C1) & M32
    x ^= x >> SHIFTS[1]
    x = (x * C2) & M32
    x ^= x >> SHIFTS[2]
    return x


def bucket_sign(i: np.ndarray, rowkey: int, cols: int):
    """(h(i) as int64 in [0, cols), s(i) as float32 +-1) for one row."""
    if not 1 <= cols <= MAX_COLS:
        raise ValueError(f"hashing: cols must be in [1, {MAX_COLS}]; got {cols}")
    x = mix32_array(i, rowkey)
    bucket = ((x >> 1) * np.int64(cols)) >> 31
    sign = (np.int64(1) - 2 * (x & 1)).astype(np.float32)
    return bucket, sign
