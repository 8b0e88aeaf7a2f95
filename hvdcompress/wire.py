"""Helpers for the per-round wire cost an algorithm declares (``spec.register(..., wire=)``).

Vectorised over arrays of tensor sizes ``d`` (element counts), as the cost model calls them.
"""

from __future__ import annotations

import numpy as np

from .spec import GATHERED, SUMMED, Round


def selected(fraction, d) -> np.ndarray:
    """k = ceil(fraction * d) (at least 1 of a non-empty tensor), as ``spec.num_selected``."""
    d = np.asarray(d, dtype=float)
    x = fraction * d
    k = np.ceil(x - 1e-9 * x)
    return np.where(d > 0, np.clip(k, 1, d), 0)


def index_bytes(d) -> np.ndarray:
    """int32 indices while they fit, int64 beyond (``sampling.index_dtype``)."""
    return np.where(np.asarray(d) <= np.iinfo(np.int32).max, 4, 8)


def dense(kind: str, bytes_per_entry: float, half: bool = False):
    """A one-round rule: every entry, ``bytes_per_entry`` bytes, by ``kind`` (``half``: summed as
    16-bit floats, ``Round.half``)."""
    def rule(params, d, itemsize, world, density):
        return (Round(kind, 1, d * (itemsize if bytes_per_entry is None else bytes_per_entry), half),)
    return rule


def sparse_gathered(params, d, itemsize, world, density, value_bytes=None):
    """(indices, values) allgathered: two collectives, k entries of index + value bytes. The
    fraction is the measured density when given, else the spec's ratio, else 1 (an upper bound)."""
    frac = density if density is not None else params.get("ratio", 1.0)
    k = selected(frac, d)
    vb = itemsize if value_bytes is None else value_bytes
    return (Round(GATHERED, 2, k * (vb + index_bytes(d))),)


def sparse_summed(params, d, itemsize, world, density):
    """Values at shared indices, allreduced: one collective of k values."""
    return (Round(SUMMED, 1, selected(params["ratio"], d) * itemsize),)
