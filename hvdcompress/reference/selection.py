"""Which entries a sparsifier sends, defined so every implementation picks the same ones."""

from __future__ import annotations

import numpy as np

from ..sampling import index_dtype


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest |x|, ties broken toward the lower index; returned sorted ascending."""
    x = np.asarray(x).reshape(-1)
    if not 0 <= k <= x.size:
        raise ValueError(f"topk_indices: k must be in [0, {x.size}]; got {k}")
    order = np.lexsort((np.arange(x.size), -np.abs(x)))  # by |x| descending, then index ascending
    return np.sort(order[:k]).astype(index_dtype(x.size))


def threshold_indices(x: np.ndarray, threshold: float) -> np.ndarray:
    """Every index with |x| >= threshold, ascending."""
    x = np.asarray(x).reshape(-1)
    return np.flatnonzero(np.abs(x) >= np.asarray(threshold, dtype=x.dtype)).astype(index_dtype(x.size))
