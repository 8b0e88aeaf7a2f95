"""Shared test vectors: the inputs on which the numpy oracle, torch_ops and tf_ops must agree.

Every case is generated from a fixed seed, so each implementation sees the same gradients, rank by
rank and step by step. Gradients are heavy-tailed and rounded to 3 decimals, so magnitudes tie
often and the tie-breaking rule (lower index first) is exercised.
"""

from __future__ import annotations

import zlib
from typing import List

import numpy as np

# every compressor, with and without error feedback, at a few densities
SPECS = [
    "none", "fp16", "fp16:residual=true", "bf16", "bf16:residual=true",
    "topk:ratio=0.01", "topk:ratio=0.1,residual=false", "topk:ratio=1.0",
    "randomk:ratio=0.05,seed=3", "randomk:ratio=0.2,residual=false",
    "threshold:threshold=1.5", "threshold:threshold=0.5,residual=false",
]

# DGC: each technique on and off (min_sparse_numel=256 makes the 37x11 case sparse, the 64 case dense)
DGC_SPECS = [
    "dgc:ratio=0.02,warmup_epochs=2,min_sparse_numel=256",
    "dgc:ratio=0.01,nesterov=true,clip_norm=1.0,warmup_epochs=0,min_sparse_numel=256",
    "dgc:ratio=0.02,momentum_correction=false,warmup_epochs=0,min_sparse_numel=256",
    "dgc:ratio=0.02,momentum_masking=false,fp16_values=true,sample_ratio=0.05,warmup_epochs=0,min_sparse_numel=256",
]

SHAPES = [(37, 11), (64,)]
STEPS = 4
KEY = "layer.w"


def seed_of(text: str, world: int, shape) -> int:
    return zlib.crc32(f"{text}|{world}|{shape}".encode())


def gradients(text: str, world: int, shape, steps: int = STEPS) -> List[List[np.ndarray]]:
    """grads[step][rank], float32, the same on every call."""
    rng = np.random.default_rng(seed_of(text, world, shape))
    return [[np.round(rng.standard_t(3, size=shape), 3).astype(np.float32) for _ in range(world)]
            for _ in range(steps)]


def epoch_of(step: int) -> int:
    """Two steps per epoch, so warm-up schedules move during a case."""
    return step // 2
