"""Three 2026 Muon variants transcribed for the catalogue's comparisons (tests/catalog_cases.py), each
from its authors' code, operation for operation, with Newton–Schulz in float32 (both codes cast to
bf16, their CUDA setting; geomopt's ``dtype: auto`` is float32 on a CPU):

* :class:`MuonPlus`: Muon+ (Zhang et al. 2026, arXiv:2602.21545), the Muon branch of ``MuonPlus`` in
  github.com/K1seki221/MuonPlus (utils/optim/muon_plus.py): SGD-style momentum b ← μb + g with
  Nesterov g + μb, Keller Jordan's Newton–Schulz (5 steps of (3.4445, −4.7750, 2.0315) on
  X/(‖X‖_F + 1e-7), on the wide side), then ``apply_post_polar_norm``: rows and/or columns divided by
  √(Σ u² + 1e-7) in the mode's order, then W ← W(1 − lr·λ) − lr·√(fan_out/fan_in)·U.
* :class:`NorMuonH`: the NorMuonH of modded-nanogpt's track-3 record 20260430_normuonh
  (github.com/KellerJordan/modded-nanogpt, records/track_3_optimization/results/20260430_normuonh, the
  code its logs print): lerp momentum with Nesterov, 12 steps of the cubic (2, −1.5, 0.5) on
  X/(‖X‖_F + 1e-7), ×√max(1, m/n), v ← lerp(v, mean(U²) over the longer side's rows or columns,
  1 − β₂), U·rsqrt(max(v, 1e-10)), then W ← R·normalize(W − lr·R·normalize(U)) with R = ‖W‖_F.
* :class:`ContraMuon`: Contra-Muon (Nilin 2026, github.com/nilin/contra-muon) as its first code runs
  it, ``muon_update`` of modded-nanogpt PR #275 (records/track_3_optimization/results/20260501_contra_muon,
  train_gpt_simple_contra_muon_2.py) without the two techniques that record stacks on it (NorMuon-lite's
  row variance and the u/w floor, other entries' business): lerp momentum with Nesterov, N = M/σ₁(M) by
  5 power iterations from the all-ones vector, U = the record's Newton–Schulz (as NorMuonH's),
  U ← (U − CONTRA/2·N)·‖U‖_F/‖U − CONTRA/2·N‖_F, ×√max(1, m/n), W ← W − lr·U (no weight decay).
"""

from __future__ import annotations

import torch


def _newton_schulz(g: torch.Tensor, coefficients: tuple, steps: int) -> torch.Tensor:
    """The iteration both codes run: on the wide side, X/(‖X‖_F + 1e-7), X ← aX + (bA + cA²)X."""
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.float().mT if tall else g.float()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _unit(u: torch.Tensor, axis: str) -> torch.Tensor:
    dim = -1 if axis == "row" else -2  # a row's entries lie along the last dim, a column's along the first
    return u / torch.sqrt((u * u).sum(dim=dim, keepdim=True) + 1e-7)


class MuonPlus:
    """MuonPlus's Muon branch on a list of 2-D parameters (``norm_mode`` "row", "col", "row_col" or
    "col_row")."""

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float = 0.95, nesterov: bool = True,
                 norm_mode: str = "row_col", ns_steps: int = 5):
        self.params, self.lr, self.wd, self.mu, self.nesterov = list(params), lr, weight_decay, momentum, nesterov
        self.axes = {"row": ("row",), "col": ("column",), "row_col": ("row", "column"),
                     "col_row": ("column", "row")}[norm_mode]
        self.ns_steps = ns_steps
        self.state = {p: {"momentum_buffer": torch.zeros_like(p)} for p in self.params}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            buf = self.state[p]["momentum_buffer"]
            buf.mul_(self.mu).add_(p.grad)
            d = p.grad.add(buf, alpha=self.mu) if self.nesterov else buf
            u = _newton_schulz(d, (3.4445, -4.7750, 2.0315), self.ns_steps)
            for axis in self.axes:
                u = _unit(u, axis)
            fan_out, fan_in = p.shape[:2]
            p.mul_(1 - self.lr * self.wd)
            p.add_(u, alpha=-self.lr * (fan_out / fan_in) ** 0.5)


class NorMuonH:
    """The record's NorMuonH on a list of 2-D parameters; with ``radius`` the matrices are first
    rescaled to that Frobenius norm (the record's R is each matrix's norm as it stands)."""

    def __init__(self, params, *, lr: float, momentum: float = 0.95, beta2: float = 0.95, eps: float = 1e-10,
                 radius: float | None = None):
        self.params, self.lr, self.mu, self.beta2, self.eps = list(params), lr, momentum, beta2, eps
        self.state = {}
        with torch.no_grad():
            for p in self.params:
                if radius is not None:
                    p.mul_(radius / p.norm())
                m, n = p.shape
                self.state[p] = {"momentum": torch.zeros_like(p), "v": torch.zeros((m, 1) if m >= n else (1, n))}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            st = self.state[p]
            st["momentum"].lerp_(p.grad, 1 - self.mu)
            d = p.grad.lerp(st["momentum"], self.mu)
            m, n = p.shape
            u = _newton_schulz(d, (2.0, -1.5, 0.5), 12) * max(1, m / n) ** 0.5
            st["v"].lerp_((u * u).mean(dim=-1 if m >= n else -2, keepdim=True), 1 - self.beta2)
            u = u * st["v"].clamp_min(self.eps).rsqrt()
            r = p.norm()
            moved = p - self.lr * u * r / u.norm().clamp_min(1e-10)
            p.copy_(moved / moved.norm().clamp_min(1e-10) * r)


def _op_normalized(g: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """PR #275's scale_to_unit_operator_norm: g/σ₁, σ₁ by 5 power iterations from the all-ones vector."""
    x = g.float()
    v = torch.ones(x.size(-1))
    v = v / v.norm().clamp(min=eps)
    for _ in range(5):
        u = x @ v
        u = u / u.norm().clamp(min=eps)
        v = x.mT @ u
        v = v / v.norm().clamp(min=eps)
    return g / (x @ v).norm().clamp(min=eps)


class ContraMuon:
    """PR #275's Contra-Muon step (``contra``: its CONTRA_MUON, of which half is subtracted) on a list
    of 2-D parameters."""

    def __init__(self, params, *, lr: float, contra: float = 0.4, momentum: float = 0.95):
        self.params, self.lr, self.contra, self.mu = list(params), lr, contra, momentum
        self.state = {p: {"momentum": torch.zeros_like(p)} for p in self.params}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            st = self.state[p]
            st["momentum"].lerp_(p.grad, 1 - self.mu)
            d = p.grad.lerp(st["momentum"], self.mu)
            normalized = _op_normalized(d)
            u = _newton_schulz(d, (2.0, -1.5, 0.5), 12)
            norm = u.norm()
            u = u - self.contra / 2 * normalized
            u = u * norm / u.norm().clamp(min=1e-10)
            p.add_(u * max(1, p.size(-2) / p.size(-1)) ** 0.5, alpha=-self.lr)


__all__ = ["ContraMuon", "MuonPlus", "NorMuonH"]
