"""Models for the benchmark harness (``hvdcompress bench``), with synthetic inputs.

``vgg`` and ``mlp`` are the *large* models: enough parameters (6.4M and 12.6M) that a dense
fp32 gradient exchange (26 and 50 MB per step) dominates the step on a 100 Mbit/s link. ``deep``
is a *small deep* model: few parameters (0.33M) spread over many layers (100 parameter tensors),
the case where per-tensor start-up costs and merge scheduling matter.

Every model is built by :func:`build` from its name and comes with :func:`synthetic_batch`, which
makes a fixed random batch of matching inputs and class labels (no data set, no download).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch import nn

NUM_CLASSES = 10


def _vgg() -> nn.Module:
    """VGG-style CNN for 3x32x32 images: 6 conv layers (64-64-128-128-256-256, 3x3, ReLU, max-pool
    after each pair) and a 4096-1024-1024-10 classifier: 6.4M parameters in 18 tensors."""
    layers = []
    c_in = 3
    for c_out in (64, 128, 256):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True),
                   nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        c_in = c_out
    return nn.Sequential(*layers, nn.Flatten(),
                         nn.Linear(256 * 4 * 4, 1024), nn.ReLU(inplace=True),
                         nn.Linear(1024, 1024), nn.ReLU(inplace=True),
                         nn.Linear(1024, NUM_CLASSES))


def _mlp() -> nn.Module:
    """MLP on flattened 3x32x32 inputs: 3072-2048-2048-1024-10: 12.6M parameters in 8 tensors."""
    return nn.Sequential(nn.Flatten(),
                         nn.Linear(3 * 32 * 32, 2048), nn.ReLU(inplace=True),
                         nn.Linear(2048, 2048), nn.ReLU(inplace=True),
                         nn.Linear(2048, 1024), nn.ReLU(inplace=True),
                         nn.Linear(1024, NUM_CLASSES))


class _DeepBlock(nn.Module):
    """x + W2 relu(W1 LayerNorm(x)): one residual block of the deep model."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _deep(width: int = 64, blocks: int = 16) -> nn.Module:
    """16 residual blocks of width 64 between an input and an output layer (input 3x32x32
    flattened): 0.33M parameters in 100 tensors."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width),
                         *[_DeepBlock(width) for _ in range(blocks)],
                         nn.Linear(width, NUM_CLASSES))


MODELS: Dict[str, Callable[[], nn.Module]] = {"vgg": _vgg, "mlp": _mlp, "deep": _deep}
INPUT_SHAPE: Tuple[int, ...] = (3, 32, 32)


def build(name: str, seed: int = 0, scale: float = 1.0) -> nn.Module:
    """The model called ``name`` (one of :data:`MODELS`), initialised from ``seed``; or, for
    ``emulated:<profile>``, the GPU-like emulated model of that profile with tensors ``scale``
    times smaller (``hvdcompress.bench.emulated``)."""
    if name.startswith("emulated:"):
        from .emulated import build_emulated
        return build_emulated(name.split(":", 1)[1], seed=seed, scale=scale)
    if name not in MODELS:
        raise ValueError(f"model: unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    torch.manual_seed(seed)
    return MODELS[name]()


def synthetic_batch(batch_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch: inputs of shape (batch_size, 3, 32, 32) and labels in [0, 10)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch_size,) + INPUT_SHAPE, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=gen)
    return x, y


def count_parameters(model: nn.Module) -> Tuple[int, int]:
    """(number of parameters, number of parameter tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)
