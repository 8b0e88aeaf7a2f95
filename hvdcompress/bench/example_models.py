"""Small models for the examples and the convergence benchmarks (data from hvdcompress.datasets)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class DigitsCNN(nn.Module):
    """For 1x8x8 digits: two 3x3 convolutions and two dense layers, about 38k parameters."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class MNIST1DCNN(nn.Module):
    """For 1x40 MNIST-1D sequences: three 1-D convolutions and two dense layers, about 90k parameters."""

    def __init__(self, num_classes: int = 10, length: int = 40):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv1d(32, 32, 3, padding=1)
        self.conv3 = nn.Conv1d(32, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * (length // 2), 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool1d(F.relu(self.conv3(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class CharTransformer(nn.Module):
    """A small causal character-level transformer (GPT-style, pre-norm): byte embeddings plus
    learned positions, ``layers`` blocks of ``heads``-head self-attention and a 4x MLP, a tied
    output layer over ``vocab`` codes. With the defaults (128 codes, width 128, 2 layers, context
    64) about 0.42M parameters in 28 tensors. ``forward(x)`` takes (batch, T) int64 codes and
    returns (batch, T, vocab) logits; ``loss(x, y)`` the mean next-character cross-entropy."""

    def __init__(self, vocab: int = 128, width: int = 128, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.position, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.norm(h) @ self.embed.weight.t()

    def loss(self, x, y):
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def char_batches(text, batch: int, context: int, seed: int):
    """An endless stream of (x, y) int64 batches of ``batch`` random windows of ``text`` (uint8
    codes): y is x shifted by one character. ``seed`` makes each rank's stream its own."""
    import numpy as np

    rng = np.random.default_rng(seed)
    data = torch.from_numpy(text.astype(np.int64))
    while True:
        start = torch.from_numpy(rng.integers(0, len(text) - context - 1, size=batch))
        idx = start[:, None] + torch.arange(context + 1)[None]
        win = data[idx]
        yield win[:, :-1], win[:, 1:]


def char_eval_loss(model, text, context: int, windows: int = 64) -> float:
    """Mean next-character cross-entropy (nats) over ``windows`` evenly spaced windows of ``text``."""
    import numpy as np

    data = torch.from_numpy(text.astype(np.int64))
    starts = torch.linspace(0, len(text) - context - 2, windows).long()
    idx = starts[:, None] + torch.arange(context + 1)[None]
    win = data[idx].to(next(model.parameters()).device)
    with torch.no_grad():
        return float(model.loss(win[:, :-1], win[:, 1:]))


def for_dataset(name: str) -> nn.Module:
    if name == "digits":
        return DigitsCNN()
    if name == "mnist1d":
        return MNIST1DCNN()
    raise ValueError(f"model: no model for data set {name!r}; accepted: digits, mnist1d")
