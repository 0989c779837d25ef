"""NVIDIA Emerging-Optimizers' Muon family, transcribed for the catalogue's comparisons
(tests/catalog_cases.py): the package (PyPI ``emerging-optimizers`` 0.3.0,
github.com/NVIDIA-NeMo/Emerging-Optimizers, Apache-2.0) needs Python ≥ 3.12, so its update rules are
written out here from its source, operation for operation and in the same order:

* ``OrthogonalizedOptimizer.step`` (orthogonalized_optimizer.py): decoupled decay
  ``p.add_(p, alpha=−λ·lr)``, momentum ``buf.lerp_(g, 1 − μ)``, Nesterov ``g.lerp(buf, μ)``, the
  orthogonalized update, then ``pre_weight_update_fn_inplace``, ``p.add_(u, alpha=−lr)``,
  ``post_weight_update_fn_inplace``;
* ``muon_utils.newton_schulz``: transpose to the wide side, ``F.normalize`` (X/max(‖X‖_F, 1e-7)),
  per step A = XXᵀ, B = bA + cA², X = aX + BX (``torch.addmm``), coefficient sets cycled; run in
  float32 here (the package's ``fp32_matmul_prec="highest"``; its default "medium" rounds to bf16);
* Turbo-Muon's AOL-rescaled Newton–Schulz (:func:`aol_newton_schulz`): the package ships its ``aol``
  coefficient set but not the AOL rescaling the set was fitted for, so that is transcribed from the
  authors' code (github.com/thib-s/flash-newton-schulz) in the package's op style;
* ``muon.Muon`` (``OrthogonalizedOptimizer`` with Muon's scale factor), ``polargrad.PolarGrad``,
  ``muon_hyperball.MuonHyperball`` (fixed ``hyperball_radius``), ``spel.Spel`` and
  ``adaptive_muon.AdaptiveMuon(moment2_method="namo")``.

Each class but ``TurboMuon`` was checked against the package itself (run under Python 3.11 with
``typing.override`` and ``absl.logging`` stubbed): identical to the last bit on the catalogue's
Llama, 6 steps. ``TurboMuon`` is ``muon.Muon`` with :func:`aol_newton_schulz` in place of
``newton_schulz``; the authors' code runs in bf16 with Triton kernels, so it was read, not run.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

#: muon_utils._COEFFICIENT_SETS: "simple" (Muon's triple) and "quintic" (modded-nanogpt's five)
SIMPLE = [(3.4445, -4.7750, 2.0315)]
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
#: "cans" (CANS, arXiv:2506.10935: Remez + adaptive-interval Chebyshev-type quintics), repeat_last
CANS = [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)]

#: "aol" (Turbo-Muon's four quintics, fitted to start from the AOL rescaling; the package takes them from
#: github.com/thib-s/flash-newton-schulz), cycled
AOL = [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169)]


def newton_schulz(x: torch.Tensor, coefficients, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """muon_utils.newton_schulz (2-D, float32, coefficient sets cycled)."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = F.normalize(x, p=2, dim=(-2, -1), eps=eps)
    for a, b, c in itertools.islice(itertools.cycle(coefficients), steps):
        A = X @ X.mT
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    return X.mT if transpose else X


def aol_newton_schulz(x: torch.Tensor, coefficients, steps: int = 4, eps: float = 1e-7) -> torch.Tensor:
    """Turbo-Muon's Newton–Schulz (Boissin et al. 2025, arXiv:2512.04632; ``NS_ours`` of
    github.com/thib-s/flash-newton-schulz, newton_schulz_triton.py): transpose to the wide side,
    A = XXᵀ, s = rsqrt(clamp_min(Σⱼ|A_ij|, ε)), X ← X·s (each row), A ← A·s·sᵀ reused by the first
    step (no Frobenius normalization), then per step B = bA + cA², X = aX + BX. Its Triton products
    (ns_line_1/2/3) are written as Emerging-Optimizers' ``torch.addmm`` steps (``baddbmm`` for a
    batch), in float32; coefficient sets cycled."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    mm_add = torch.baddbmm if x.ndim == 3 else torch.addmm
    A = x @ x.mT
    s = torch.rsqrt(torch.clamp_min(A.abs().sum(dim=-1, keepdim=False), min=eps))
    X = x * s.unsqueeze(-1)
    A = A * s.unsqueeze(-1) * s.unsqueeze(-2)
    for i, (a, b, c) in enumerate(itertools.islice(itertools.cycle(coefficients), steps)):
        if i > 0:
            A = X @ X.mT
        B = mm_add(A, A, A, alpha=c, beta=b)
        X = mm_add(X, B, X, alpha=1.0, beta=a)
    return X.mT if transpose else X


def shape_scaling(m: int, n: int) -> float:
    """muon.get_muon_scale_factor(mode="shape_scaling"): √max(1, m/n)."""
    return max(1, m / n) ** 0.5


class OrthogonalizedOptimizer:
    """The base step, on a list of 2-D parameters (one group)."""

    def __init__(self, params, *, lr: float, momentum: float, weight_decay: float, nesterov: bool,
                 coefficients, scale=lambda m, n: 1.0):
        self.params, self.lr, self.mu, self.wd, self.nesterov = list(params), lr, momentum, weight_decay, nesterov
        self.coefficients, self.scale = coefficients, scale
        self.state = {p: {"momentum_buffer": torch.zeros_like(p)} for p in self.params}

    def orthogonalize(self, g: torch.Tensor) -> torch.Tensor:
        return newton_schulz(g, self.coefficients) * self.scale(g.size(-2), g.size(-1))

    def pre(self, p, update):
        pass

    def post(self, p):
        pass

    def update(self, p, grad, pre_orth):
        return self.orthogonalize(pre_orth)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            grad, state = p.grad, self.state[p]
            if self.wd != 0.0:
                p.add_(p, alpha=-self.wd * self.lr)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - self.mu)
            pre_orth = grad.lerp(buf, self.mu) if self.nesterov else buf
            update = self.update(p, grad, pre_orth)
            self.pre(p, update)
            p.add_(update, alpha=-self.lr)
            self.post(p)


class TurboMuon(OrthogonalizedOptimizer):
    """Turbo-Muon: Muon's step (``muon.Muon``, Muon's scale factor) with the orthogonalization
    replaced by :func:`aol_newton_schulz` (``steps`` iterations, 4 by default)."""

    def __init__(self, params, *, steps: int = 4, **kw):
        super().__init__(params, **kw)
        self.steps = steps

    def orthogonalize(self, g):
        return aol_newton_schulz(g, self.coefficients, self.steps) * self.scale(g.size(-2), g.size(-1))


class PolarGrad(OrthogonalizedOptimizer):
    """polargrad.PolarGrad: NS(M) scaled by ⟨NS(M), M⟩ (≈ ‖M‖_*, the nuclear norm)."""

    def orthogonalize(self, g):
        orth = newton_schulz(g, self.coefficients)
        return orth * (orth * g).sum()


class MuonHyperball(OrthogonalizedOptimizer):
    """muon_hyperball.MuonHyperball with a fixed ``hyperball_radius`` R: parameters rescaled to
    ‖W‖_F = R when built; W ← R·normalize(W − lr·R·normalize(U))."""

    def __init__(self, params, *, radius: float, eps: float = 1e-8, **kw):
        super().__init__(params, **kw)
        self.radius, self.eps = radius, eps
        with torch.no_grad():
            for p in self.params:
                p.mul_(radius / p.norm().clamp_min(eps))

    def pre(self, p, update):
        update.mul_(self.radius / update.norm().clamp_min(self.eps))

    def post(self, p):
        p.mul_(self.radius / p.norm().clamp_min(self.eps))


class Spel(OrthogonalizedOptimizer):
    """spel.Spel: no scale factor on msign(M), then W ← msign(W) by the same Newton–Schulz."""

    def post(self, p):
        p.copy_(newton_schulz(p, self.coefficients))


class Namo(OrthogonalizedOptimizer):
    """adaptive_muon.AdaptiveMuon(moment2_method="namo"): v ← lerp(v, ‖G‖²_F, 1 − β₂) (v⁰ = 0),
    U = NS(M)·‖M‖_F/(√v + ε), then Muon's scale factor."""

    def __init__(self, params, *, beta2: float, eps: float, **kw):
        super().__init__(params, **kw)
        self.beta2, self.eps = beta2, eps
        for p in self.params:
            self.state[p]["moment2_buffer"] = torch.zeros(1, dtype=p.dtype)

    def update(self, p, grad, pre_orth):
        orth = newton_schulz(pre_orth, self.coefficients)
        moment2 = self.state[p]["moment2_buffer"]
        moment2.lerp_(torch.linalg.vector_norm(grad).square(), 1 - self.beta2)
        alpha = torch.linalg.vector_norm(pre_orth) / (moment2.sqrt() + self.eps)
        return orth * alpha * self.scale(orth.size(-2), orth.size(-1))


__all__ = ["AOL", "CANS", "MuonHyperball", "Namo", "OrthogonalizedOptimizer", "PolarGrad", "QUINTIC", "SIMPLE", "Spel",
           "TurboMuon", "aol_newton_schulz", "newton_schulz", "shape_scaling"]
