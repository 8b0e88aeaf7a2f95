"""The seeded index scheme shared by every backend.

Random-k must pick the *same* indices on every rank (so the values can be allreduced) and in every
framework (so torch and TensorFlow agree with the numpy oracle). Rather than trusting each
framework's RNG, the scheme is fixed here, in numpy, and the backends call it:

    indices = sort(PCG64(SeedSequence([seed, step, crc32(key)])).choice(numel, k, replace=False))

``key`` names the tensor (the parameter name), ``step`` is the optimizer's exchange counter, so the
selection changes every step and differs between tensors, yet is identical across ranks.
The cost is O(k) on the host, independent of the tensor's size.
"""

from __future__ import annotations

import zlib

import numpy as np


def key_hash(key: str) -> int:
    """A stable 32-bit integer for a tensor name (Python's hash() is salted per process)."""
    return zlib.crc32(key.encode("utf-8"))


def index_dtype(numel: int) -> np.dtype:
    """int32 indices on the wire while they fit, int64 beyond 2**31 - 1 elements."""
    return np.dtype(np.int32) if numel <= np.iinfo(np.int32).max else np.dtype(np.int64)


def random_indices(numel: int, k: int, seed: int, step: int, key: str) -> np.ndarray:
    """k distinct indices in [0, numel), sorted ascending, identical on every rank."""
    if not 0 <= k <= numel:
        raise ValueError(f"random_indices: k must be in [0, numel={numel}]; got {k}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, key_hash(key)])))
    idx = rng.choice(numel, size=k, replace=False, shuffle=False)
    idx.sort()
    return idx.astype(index_dtype(numel), copy=False)
