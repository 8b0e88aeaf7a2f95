"""What a merged group of gradient tensors looks like to a compressor (shared by both backends).

A group of several tensors is exchanged as one flat tensor. Compressors that treat tensors by
shape (DGC sends 1-D tensors dense) are told ``merged_shape``: the member's own shape for a group
of one; ``(numel,)`` when every member is 1-D (biases, norms); ``(1, numel)`` otherwise, so a group
holding a weight matrix is treated as a matrix, its biases included.
"""

from __future__ import annotations

from typing import Sequence, Tuple


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def merged_shape(shapes: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    """The shape a compressor is told for a group of tensors of ``shapes`` (module doc)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if len(shapes) == 1:
        return shapes[0]
    total = sum(numel(s) for s in shapes)
    return (total,) if all(len(s) <= 1 for s in shapes) else (1, total)
