"""Float codecs in numpy: fp16 (IEEE half) and bf16 (the upper 16 bits of fp32, nearest-even)."""

from __future__ import annotations

import numpy as np


def fp16_encode(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def fp16_decode(codes: np.ndarray, dtype=np.float32) -> np.ndarray:
    return codes.astype(dtype)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16, nearest with ties to even (as torch and TF do); int16 codes.

    bits + 0x7FFF + (bit 16 of bits) carries into the upper half exactly when the lower half is
    above one half ulp, or exactly one half and the upper half is odd. NaNs stay NaNs (which NaN code is not specified).
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(x)
    rounded = np.where(nan, (bits >> 16) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16).view(np.int16)


def bf16_decode(codes: np.ndarray, dtype=np.float32) -> np.ndarray:
    bits = codes.view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).astype(dtype)
