"""Count-sketch hashes, COMPUTED from the index (never stored per entry), in numpy.

The count sketch (``hvdcompress.reference.sketch``) needs, for every row j of the table and
every index i of the tensor, a bucket h_j(i) in [0, c) and a sign s_j(i) in {-1, +1}, identical on
every rank and in every framework. A table of r x d int64 hashes would cost 1 GB for a 25M-entry
layer, so the hash is simple tabulation (Carter and Wegman; Patrascu and Thorup, "The power of
simple tabulation hashing", 2011) over two 16-bit characters of the index:

    x_j(i)  = HIGH_j[i >> 16] XOR LOW_j[i & 0xFFFF]      (32-bit; 3-independent)
    z_j(i)  = (x_j(i) * C3) & M                           (a bijection of 32-bit values)
    y_j(i)  = (z_j(i) * 2c) >> 32                         (one multiply-shift: y in [0, 2c))
    h_j(i)  = y >> 1;   s_j(i) = +1 if y is even else -1  (bucket and sign from the same value)

``y`` is the index of a *signed cell*: the table is built as 2c interleaved cells (even: the
positive entries of bucket b, odd: the negative ones), so sketching is one scatter-add of v with
no sign multiply, and S[j, b] = cell[2b] - cell[2b+1]. Simple tabulation is 3-independent, so
(h_j, s_j) are pairwise (indeed 3-wise) independent over indices, which is what the count sketch's
guarantees need; the bucket and sign are the top bits of one uniform 32-bit value. The odd
multiply z keeps that (a bijection of a uniform value) and breaks the XOR structure of tabulation:
without it x(i) XOR x(i + 65536) is one constant across a block, so the top bits of the two blocks
would be one fixed permutation of each other (with 2c a power of two, every pair at the same
offset would share its sign relation); the tests measure that pairs at the same offset in
neighbouring blocks collide and agree in sign at the rates of independent hashes.

The tables are short: LOW_j has min(d, 65536) entries, HIGH_j ceil(d / 65536), each filled by a
32-bit integer mixer of (table position XOR a per-row key):

    x ^= x >> 16;  x = (x * C1) & M;  x ^= x >> 15;  x = (x * C2) & M;  x ^= x >> 16

with M = 2**32 - 1 and odd multipliers C1, C2 below 2**31. Within a block of 65536 consecutive
indices HIGH_j is one constant, so a port computes x_j for a block with ONE xor of LOW_j, and
y_j with two multiplies, a mask and a shift. Every product fits in a signed int64 (a 32-bit value times
a multiplier below 2**31, or times 2c <= 2**31): numpy, torch and TensorFlow compute the same bits
with plain int64 ops (no unsigned types, no overflow); hence c <= 2**30.

The per-row keys are Python ints, mixed from (seed, crc32(tensor key), row) by the same mixer on
Python ints, so rows differ from each other, layers differ (a tensor's key names it), and every
rank, knowing the same seed and key, draws the same hashes.
"""

from __future__ import annotations

import zlib

import numpy as np

M32 = 0xFFFFFFFF
C1 = 0x7FEB352D  # odd, < 2**31
C2 = 0x31848BAB  # odd, < 2**31
C3 = 0x2545F491  # odd, < 2**31
SHIFTS = (16, 15, 16)
MAX_COLS = 2 ** 30  # 2c * x < 2**63 for any 32-bit x
BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
HIGH_SALT = 0x85EBCA6B


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
    """Row j's key in [0, 2**32): LOW_j is filled from it, HIGH_j from ``high_key(row_key)``."""
    x = mix32(seed & M32)
    x = mix32(x ^ ((seed >> 32) & M32))
    x = mix32(x ^ key_crc(key))
    x = mix32(x ^ (0x9E3779B9 * (row + 1) & M32))
    return x


def high_key(rowkey: int) -> int:
    return mix32(rowkey ^ HIGH_SALT)


def row_keys(seed: int, key: str, rows: int) -> tuple:
    return tuple(row_key(seed, key, j) for j in range(rows))


def mix32_array(i: np.ndarray, rowkey: int) -> np.ndarray:
    """The mixer of ``(i mod 2**32) XOR rowkey`` for an int64 array, as int64 in [0, 2**32)."""
    x = (np.asarray(i, dtype=np.int64) & M32) ^ np.int64(rowkey)
    x ^= x >> SHIFTS[0]
    x = (x * C1) & M32
    x ^= x >> SHIFTS[1]
    x = (x * C2) & M32
    x ^= x >> SHIFTS[2]
    return x


def table_sizes(d: int):
    """(len(LOW), len(HIGH)) for a tensor of d entries."""
    d = int(d)
    return min(d, BLOCK), max(1, -(-d // BLOCK))


def tables(rowkey: int, d: int):
    """(LOW, HIGH) of one row for a tensor of d entries, int64 in [0, 2**32)."""
    n_low, n_high = table_sizes(d)
    return mix32_array(np.arange(n_low), rowkey), mix32_array(np.arange(n_high), high_key(rowkey))


def check_cols(cols: int) -> None:
    if not 1 <= cols <= MAX_COLS:
        raise ValueError(f"hashing: cols must be in [1, {MAX_COLS}]; got {cols}")


def hash32(i: np.ndarray, rowkey: int) -> np.ndarray:
    """x_j(i) for an int64 index array (any indices >= 0), by the definition (gathers)."""
    i = np.asarray(i, dtype=np.int64)
    d = int(i.max()) + 1 if i.size else 1
    low, high = tables(rowkey, max(d, BLOCK))
    return high[i >> BLOCK_BITS] ^ low[i & (BLOCK - 1)]


def signed_cell(x: np.ndarray, cols: int) -> np.ndarray:
    """y = (((x * C3) & M) * 2c) >> 32 in [0, 2c): bucket y >> 1, sign -1 where y is odd."""
    check_cols(cols)
    return (((x * np.int64(C3)) & np.int64(M32)) * np.int64(2 * cols)) >> 32


def cells(rowkey: int, d: int, cols: int) -> np.ndarray:
    """y_j(i) for i = 0..d-1 (as the ports compute it: one xor per block of LOW with HIGH[b])."""
    low, high = tables(rowkey, d)
    x = (high[:, None] ^ low[None, :]).reshape(-1)[:d]
    return signed_cell(x, cols)


def bucket_sign(i: np.ndarray, rowkey: int, cols: int):
    """(h(i) as int64 in [0, cols), s(i) as float32 +-1) for one row, at any index array."""
    y = signed_cell(hash32(i, rowkey), cols)
    return y >> 1, (np.int64(1) - 2 * (y & 1)).astype(np.float32)
