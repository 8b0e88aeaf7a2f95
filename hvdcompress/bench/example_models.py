"""Small models for the examples and the convergence benchmarks (data from hvdcompress.datasets)."""

from __future__ import annotations

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


def for_dataset(name: str) -> nn.Module:
    if name == "digits":
        return DigitsCNN()
    if name == "mnist1d":
        return MNIST1DCNN()
    raise ValueError(f"model: no model for data set {name!r}; accepted: digits, mnist1d")
