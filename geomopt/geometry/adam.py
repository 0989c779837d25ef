"""Adam(W)'s moments, shared by the ``adam`` forward op and the optimizer's exact AdamW path."""

from __future__ import annotations

import torch

from geomopt.geometry.matrix import working_dtype


def adam_moments(g: torch.Tensor, state: dict, geometry: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Update m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g² in ``state`` (float32 at least) and return
    (m, √v/√bc₂ + ε, bc₁) with bc_i = 1 − β_i^t, in torch.optim.AdamW's single-tensor op order, so
    ``x.addcdiv(m, denom, value=-lr/bc₁)`` is AdamW's step bit for bit."""
    beta1, beta2 = (float(b) for b in geometry.get("betas", (0.9, 0.999)))
    eps = float(geometry.get("eps", 1e-8))
    if "exp_avg" not in state:
        state["adam_step"] = 0
        dtype = working_dtype(g.dtype)
        state["exp_avg"] = torch.zeros_like(g, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(g, dtype=dtype, memory_format=torch.preserve_format)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["adam_step"] += 1  # a Python int: no host sync for the bias corrections
    step = state["adam_step"]
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    return exp_avg, denom, bias_correction1
