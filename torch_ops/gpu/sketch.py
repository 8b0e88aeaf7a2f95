"""The count sketch on the Triton kernels: the update + table in one pass, the estimates in one.

``plan(x, u, v, keys, rows, cols, topk)`` returns a ``Sketch`` (the same two methods as the
compressor's compiled CPU path: ``update_sketch`` and ``candidates``) when the kernels serve the
exchange (``torch_ops.gpu.serves``; float32 contiguous tensors), else None. ``topk`` is the
caller's exact top-k (``torch_ops.compressors.selection.topk_indices``), which picks the
candidates from the estimates (on the Triton kernels too, for a CUDA tensor).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from hvdcompress import hashing

from . import serves

BLOCK = 512  # entries per program of the update
RANKED = 8192  # entries x rows x rows per program of the estimates


@lru_cache(maxsize=16)
def _tables(keys: tuple, d: int, device: str):
    """The rows' (LOW, HIGH) tables stacked, (rows, len) int64, on the device."""
    pairs = [hashing.tables(rk, d) for rk in keys]
    low = torch.from_numpy(np.stack([lo for lo, _ in pairs])).to(device)
    high = torch.from_numpy(np.stack([hi for _, hi in pairs])).to(device)
    return low, high


def _f32(t: Optional[torch.Tensor], like: torch.Tensor) -> bool:
    return (t is not None and t.device == like.device and t.dtype == torch.float32 and t.is_contiguous()
            and not t.is_neg() and t.numel() == like.numel())


class Sketch:
    def __init__(self, keys, d: int, rows: int, cols: int, device, topk):
        self.d, self.rows, self.cols, self.device, self.topk = d, rows, cols, device, topk
        self.low, self.high = _tables(tuple(keys), d, str(device))
        self.pad = max(2, 1 << max(0, (rows - 1).bit_length()))  # rows padded to a power of two

    def _args(self):
        return self.low, self.high, self.d, self.rows, self.low.shape[1], self.high.shape[1], 2 * self.cols

    def update_sketch(self, g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, m: float) -> torch.Tensor:
        """u <- m*u + g; v <- v + u; the r x c count sketch of v."""
        from . import sketch_kernels as K

        signed = torch.zeros(self.rows, 2 * self.cols, dtype=torch.float32, device=self.device)
        mt = torch.tensor([m], dtype=torch.float32, device=self.device)
        K.update_sketch[(max(1, -(-self.d // BLOCK)),)](g, u, v, mt, signed, *self._args(), R=self.pad, BLOCK=BLOCK,
                                                        enable_fp_fusion=False)
        return signed[:, 0::2] - signed[:, 1::2]

    def candidates(self, table: torch.Tensor, d: int, count: int) -> torch.Tensor:
        """Indices (int64, ascending) of the ``count`` largest |estimate| (ties toward the lower index)."""
        from . import sketch_kernels as K

        table = table.to(torch.float32).contiguous()
        est = torch.empty(d, dtype=torch.float32, device=self.device)
        block = max(16, RANKED // (self.pad * self.pad))
        K.estimates[(max(1, -(-d // block)),)](table, est, *self._args(), R=self.pad, BLOCK=block)
        return self.topk(est, count)


def plan(x, u, v, keys, rows: int, cols: int, topk) -> Optional[Sketch]:
    """A ``Sketch`` when the Triton kernels serve this exchange, else None."""
    if not serves(x) or x.dim() != 1 or not (_f32(x, x) and _f32(u, x) and _f32(v, x)):
        return None
    return Sketch(keys, x.numel(), rows, cols, x.device, topk)
