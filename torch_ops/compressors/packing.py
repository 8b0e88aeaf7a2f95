"""Bit packing and the counter-based uniform generator in PyTorch: mirrors of
``hvdcompress.packing`` and ``hvdcompress.rng`` (same layout, same numbers, bit for bit; see
those modules for the definitions). Vectorised: no Python loop over entries."""

from __future__ import annotations

import torch

from hvdcompress.packing import check_bits, packed_size
from hvdcompress.rng import GOLDEN, M1, M2, MASK, stream_base

_UNIT = 2.0 ** -24


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """hvdcompress.rng.mix32 on an int64 tensor, in place (values in [0, 2**32))."""
    x.bitwise_xor_(x >> 16)
    x.mul_(M1).bitwise_and_(MASK)
    x.bitwise_xor_(x >> 15)
    x.mul_(M2).bitwise_and_(MASK)
    x.bitwise_xor_(x >> 15)
    return x


def uniform(n: int, seed: int, step: int, key: str, rank: int = 0, device=None) -> torch.Tensor:
    """n float32 uniforms on [0, 1), equal to ``hvdcompress.rng.uniform(n, seed, step, key, rank)``."""
    x = torch.arange(n, dtype=torch.int64, device=device)
    x.mul_(GOLDEN).add_(stream_base(seed, step, key, rank)).bitwise_and_(MASK)
    h = _mix32_(x)
    return (h >> 8).to(torch.float32).mul_(_UNIT)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (each < 2**bits) -> packed uint8 bytes (``hvdcompress.packing`` layout)."""
    bits = check_bits(bits)
    codes = codes.reshape(-1).to(torch.uint8)
    n = codes.numel()
    nbytes = packed_size(n, bits)
    if bits == 8:
        return codes.clone()
    per = 8 // bits if 8 % bits == 0 else 8
    groups = -(-n // per)
    padded = torch.zeros(groups * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    grid = padded.view(groups, per)
    if 8 % bits == 0:
        out = grid[:, 0].clone()
        for j in range(1, per):
            out.bitwise_or_(grid[:, j] << (bits * j))
        return out
    word = grid[:, 0].to(torch.int64)
    for j in range(1, 8):
        word.bitwise_or_(grid[:, j].to(torch.int64) << (bits * j))
    out = torch.empty((groups, bits), dtype=torch.uint8, device=codes.device)
    for i in range(bits):
        out[:, i] = (word >> (8 * i)).bitwise_and_(0xFF)
    return out.view(-1)[:nbytes]


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Packed bytes -> the first n uint8 codes."""
    bits = check_bits(bits)
    packed = packed.reshape(-1)
    if packed.numel() < packed_size(n, bits):
        raise ValueError(f"unpack: {packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return packed[:n].clone()
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        m = -(-n // per)
        src = packed[:m]
        out = torch.empty((m, per), dtype=torch.uint8, device=packed.device)
        for j in range(per):
            out[:, j] = (src >> (bits * j)).bitwise_and_(mask)
        return out.view(-1)[:n]
    groups = -(-n // 8)
    padded = torch.zeros(groups * bits, dtype=torch.uint8, device=packed.device)
    take = min(packed.numel(), groups * bits)
    padded[:take] = packed[:take]
    grid = padded.view(groups, bits)
    word = grid[:, 0].to(torch.int64)
    for i in range(1, bits):
        word.bitwise_or_(grid[:, i].to(torch.int64) << (8 * i))
    out = torch.empty((groups, 8), dtype=torch.uint8, device=packed.device)
    for j in range(8):
        out[:, j] = (word >> (bits * j)).bitwise_and_(mask)
    return out.view(-1)[:n]
