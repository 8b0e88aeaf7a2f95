"""Bit packing of small unsigned codes into bytes, vectorised: the numpy core, mirrored by
``torch_ops.compressors.packing`` and ``tf_ops.compressors.packing`` (same layout, bit for bit).

Layout: a little-endian bit stream. Code i (``bits`` wide, 1 <= bits <= 8) occupies stream bits
[bits*i, bits*(i+1)), least significant bit first; stream bit k is bit (k mod 8) of byte k // 8.
n codes take ceil(n * bits / 8) bytes; the unused high bits of the last byte are zero.

Two vectorised paths, the same stream:
  bits in {1, 2, 4, 8}  8/bits codes per byte, combined in uint8 (8/bits shifted adds)
  other widths (3, 5, 6, 7)  8 codes per ``bits`` bytes: the 8 codes of a group are combined into
                             one int64 word (8*bits <= 56 bits), whose low ``bits`` bytes are kept
Unpacking reverses either. No Python loop runs over entries (only over the <= 8 codes of a group).
"""

from __future__ import annotations

import numpy as np


def check_bits(bits: int) -> int:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 1 <= int(bits) <= 8:
        raise ValueError(f"packing: bits must be an int in [1, 8]; got {bits!r}")
    return int(bits)


def packed_size(n: int, bits: int) -> int:
    """Bytes that n codes of ``bits`` bits take: ceil(n * bits / 8)."""
    return (int(n) * check_bits(bits) + 7) // 8


def bits_for_levels(levels: int) -> int:
    """Bits of a code taking ``levels`` distinct values: ceil(log2(levels)), at least 1."""
    return max(1, int(levels - 1).bit_length())


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (each < 2**bits) -> packed uint8 bytes (module doc)."""
    bits = check_bits(bits)
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    n = codes.size
    nbytes = packed_size(n, bits)
    if bits == 8:
        return codes.copy()
    if 8 % bits == 0:
        per = 8 // bits
        padded = np.zeros(-(-n // per) * per, dtype=np.uint8)
        padded[:n] = codes
        grid = padded.reshape(-1, per)
        out = grid[:, 0].copy()
        for j in range(1, per):
            out |= grid[:, j] << np.uint8(bits * j)
        return out
    padded = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
    padded[:n] = codes
    grid = padded.reshape(-1, 8)
    word = grid[:, 0].astype(np.int64)
    for j in range(1, 8):
        word |= grid[:, j].astype(np.int64) << (bits * j)
    out = np.empty((grid.shape[0], bits), dtype=np.uint8)
    for i in range(bits):
        out[:, i] = (word >> (8 * i)) & 0xFF
    return out.reshape(-1)[:nbytes]


def unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Packed bytes -> the first n uint8 codes."""
    bits = check_bits(bits)
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    if packed.size < packed_size(n, bits):
        raise ValueError(f"unpack: {packed.size} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return packed[:n].copy()
    mask = np.uint8((1 << bits) - 1)
    if 8 % bits == 0:
        per = 8 // bits
        m = -(-n // per)
        src = packed[:m]
        out = np.empty((m, per), dtype=np.uint8)
        for j in range(per):
            out[:, j] = (src >> np.uint8(bits * j)) & mask
        return out.reshape(-1)[:n]
    groups = -(-n // 8)
    padded = np.zeros(groups * bits, dtype=np.uint8)
    take = min(packed.size, groups * bits)
    padded[:take] = packed[:take]
    grid = padded.reshape(groups, bits)
    word = grid[:, 0].astype(np.int64)
    for i in range(1, bits):
        word |= grid[:, i].astype(np.int64) << (8 * i)
    out = np.empty((groups, 8), dtype=np.uint8)
    for j in range(8):
        out[:, j] = (word >> (bits * j)) & int(mask)
    return out.reshape(-1)[:n]
