"""A plain MLP classifier (e.g. 8×8 digits: 64 → 10)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, width: int = 128, depth: int = 3, d_out: int = 10):
        super().__init__()
        self.d_in = d_in
        dims = [d_in] + [width] * (depth - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], d_out)
        self.act = nn.GELU()

    def example_inputs(self) -> torch.Tensor:
        """One input row for one traced forward (roles from use: geomopt.compile.trace)."""
        return torch.zeros(1, self.d_in, device=next(self.parameters()).device)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x)
