"""A small CNN for 8×8 (digits) or 32×32 images."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 1, width: int = 32, n_classes: int = 10):
        super().__init__()
        self.in_channels = in_channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, n_classes)

    def example_inputs(self) -> torch.Tensor:
        """One 8×8 image for one traced forward (roles from use: geomopt.compile.trace)."""
        return torch.zeros(1, self.in_channels, 8, 8, device=next(self.parameters()).device)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))
