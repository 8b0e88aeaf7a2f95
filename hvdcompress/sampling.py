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


# --- the sampled-threshold rule of DGC, shared by every backend ---------------------------------
# Estimate the k-th largest |v| from a strided sample (a random offset, then every stride-th
# entry), select |v| >= thr; when more than ACCEPT_HIGH * k pass, keep the exact top-k among them;
# when fewer than ACCEPT_LOW * k pass, multiply thr by LOWER_FACTOR and try again (at most
# ``adapt_iters`` times). Ratios are compared in integers: 10*count vs 13*k and 8*k.
ACCEPT_HIGH_TENTHS = 13
ACCEPT_LOW_TENTHS = 8
LOWER_FACTOR = 0.8  # applied in float32


def sample_stride(sample_ratio: float) -> int:
    """Every ``stride``-th entry is sampled: round(1 / sample_ratio), at least 1."""
    return max(1, int(round(1.0 / sample_ratio)))


def sample_offset(stride: int, numel: int, seed: int, step: int, key: str) -> int:
    """The first sampled index, in [0, min(stride, numel)), identical on every rank."""
    span = max(1, min(stride, numel))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, key_hash(key), 1])))
    return int(rng.integers(span))


def sample_k(k: int, sample_size: int, numel: int) -> int:
    """How many of the sample's largest entries estimate the threshold: ceil(k * m / n), in [1, m]."""
    return max(1, min(sample_size, -(-k * sample_size // numel)))
