"""Models the lint fixtures are linted against, by the name a fixture's ``# target:`` header gives
(tests/lint_fixtures/README.md). The built-in models (``geomopt.models.MODELS``: mlp, cnn, gpt, …)
are named directly; these are the small ones a rule needs that the package does not ship."""

from __future__ import annotations

import torch
from torch import nn

from geomopt.models import GPT, GPTConfig


def frozen_gpt():
    """The built-in GPT with its position embedding frozen (GO110)."""
    model = GPT(GPTConfig())
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def tied_gpt():
    """The built-in GPT with its embedding tied to its head, as GPT-2's (GO111)."""
    return GPT(GPTConfig(tie_weights=True))


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 16, 8))
        self.w_out = nn.Parameter(torch.randn(4, 8, 16))


class MoE(nn.Module):
    """A mixture-of-experts block (router + 4 batched experts) and a head (GO116, GO117)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Module()
        self.block.gate = nn.Linear(8, 4, bias=False)
        self.block.experts = _Experts()
        self.block.proj = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)


class TwoHeads(nn.Module):
    """Two last layers reading the same features: both are heads (GO119)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 5)




class Scan(nn.Module):
    """A state-space-like block: a (8, 4) decay table used only through ``exp`` (the module tree
    calls it a hidden matrix; the trace sees an elementwise use: GO125), a projection and a head;
    it brings its own inputs for the trace."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(8, 4))
        self.proj = nn.Linear(4, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def example_inputs(self):
        return torch.zeros(2, 4)

    def forward(self, x):
        h = self.proj(x) * torch.exp(-self.A_log.exp()).sum(-1)
        return self.head(h)


FACTORIES = {
    "frozen-gpt": frozen_gpt,
    "tied-gpt": tied_gpt,
    "moe": MoE,
    "two-heads": TwoHeads,
    "scan": Scan,
    "linear-4x3": lambda: nn.Linear(4, 3),  # a weight and a 1-D bias (GO104)
    "qkv-64x192": lambda: nn.Linear(64, 192, bias=False),  # a fused q, k, v projection (GO104's view)
}
