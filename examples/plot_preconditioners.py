"""Polar Express against (h₄*)' and sign: the paper's Appendix F figure (fig:pe_approx_app).

Polar Express applies, to each singular value σ ∈ [0, 1] of the Frobenius-normalized direction,
the composition of its per-step odd quintics p(σ) = aσ + bσ³ + cσ⁵. The paper reads that map as the
preconditioner of the κ = 4 power barrier, (h₄*)'(σ) = σ/(ε⁴+σ⁴)^{1/4}, rather than as the matrix
sign (σ ↦ 1 for σ > 0), which no polynomial can follow near 0. This script plots the map for
5, 6 and 7 steps against (h₄*)' with ε ∈ {1e-3, 5e-4, 3e-4} and against sign, and prints, for 5–8
steps, the L2([0, 1]) deviation from each curve and the best-fit ε (1-D minimization in log ε).

What the numbers say (run the script for the table): for the authors' list (1.01 safety factor)
and for the speedrun list, at 5, 6, 7 and 8 steps, the map is closer in L2 to (h₄*)' at its
best-fit ε than to sign, so the paper's claim holds for every list and step count checked. The
margin is small at 5 steps (L2 ≈ 0.088 against 0.090 for the authors' list), where the distance to
either curve is dominated by the polynomial's equi-oscillation on [1e-3, 1]; from 6 steps on the
oscillation has died out and (h₄*)' is an order of magnitude closer. The claim needs the right ε:
at a panel's fixed ε a different step count can be farther from (h₄*)' than from sign (7 steps
against ε = 1e-3). The best-fit ε (≈ 9.7e-4, 5.8e-4, 3.2e-4, 1.7e-4 for 5–8 steps) is within ~10%
of the slope model ε = 1/∏aᵢ of :func:`geomopt.geometry.realized_reference`.

Run:  python examples/plot_preconditioners.py            # writes runs/preconditioners/preconditioners.png
      python examples/plot_preconditioners.py --record   # rewrites the committed examples/results/preconditioners.png
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from geomopt.geometry import realized_reference  # noqa: E402
from geomopt.geometry.polynomial import compose_polynomials
from geomopt.support import polar_express_coefficients  # noqa: E402

F64 = torch.float64
PANEL_EPS = (1e-3, 5e-4, 3e-4)
PANEL_STEPS = (5, 6, 7)


def grid(n_linear: int = 20_001, n_log: int = 4_001) -> torch.Tensor:
    """A fine grid of [0, 1]: uniform, plus log-spaced points down to 1e-9 to resolve the
    transition of width ~ε near 0."""
    pts = torch.cat([torch.linspace(0, 1, n_linear, dtype=F64), torch.logspace(-9, 0, n_log, dtype=F64)])
    return torch.unique(pts)


def pe_map(sigma: torch.Tensor, steps: int, coefficients: str = "polar_express") -> torch.Tensor:
    """The Polar Express scalar map p_steps ∘ … ∘ p_1 on σ."""
    return compose_polynomials(polar_express_coefficients(steps, coefficients), sigma)


def h4_dual_grad(sigma: torch.Tensor, eps: float) -> torch.Tensor:
    """(h₄*)'(σ) = σ/(ε⁴+σ⁴)^{1/4}, written σ/(m·(1+(min/max)⁴)^{1/4}) to avoid underflow."""
    m = sigma.clamp(min=eps)
    r = torch.minimum(sigma, torch.full_like(sigma, eps)) / m
    return sigma / (m * (1 + r**4) ** 0.25)


def sign_map(sigma: torch.Tensor) -> torch.Tensor:
    return torch.sign(sigma)


def l2_distance(f: torch.Tensor, g: torch.Tensor, sigma: torch.Tensor) -> float:
    """(∫₀¹ (f−g)² dσ)^{1/2} by the trapezoid rule on ``sigma``."""
    return math.sqrt(torch.trapezoid((f - g) ** 2, sigma).item())


def best_fit_eps(steps: int, coefficients: str = "polar_express", sigma: torch.Tensor | None = None,
                 lo: float = 1e-6, hi: float = 1e-1, iters: int = 40) -> tuple[float, float]:
    """argmin_ε ‖PE − (h₄*)'_ε‖_L2 by golden-section search in log ε; returns (ε, distance).
    The distance is unimodal in log ε here (one transition to fit)."""
    sigma = grid() if sigma is None else sigma
    pe = pe_map(sigma, steps, coefficients)

    def dist(log_eps: float) -> float:
        return l2_distance(pe, h4_dual_grad(sigma, math.exp(log_eps)), sigma)

    a, b = math.log(lo), math.log(hi)
    phi = (math.sqrt(5) - 1) / 2
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = dist(c), dist(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = dist(c)
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = dist(d)
    x = (a + b) / 2
    return math.exp(x), dist(x)


@dataclass
class Row:
    steps: int
    l2_sign: float
    l2_h4: dict[float, float]  # ε → distance, for PANEL_EPS
    best_eps: float
    l2_best: float
    slope_eps: float  # 1/∏aᵢ, realized_reference

    @property
    def closer_to_h4(self) -> bool:
        return self.l2_best < self.l2_sign


def summary(steps_list=(5, 6, 7, 8), coefficients: str = "polar_express") -> list[Row]:
    sigma = grid()
    rows = []
    for steps in steps_list:
        pe = pe_map(sigma, steps, coefficients)
        eps, best = best_fit_eps(steps, coefficients, sigma)
        rows.append(Row(
            steps=steps,
            l2_sign=l2_distance(pe, sign_map(sigma), sigma),
            l2_h4={e: l2_distance(pe, h4_dual_grad(sigma, e), sigma) for e in PANEL_EPS},
            best_eps=eps,
            l2_best=best,
            slope_eps=realized_reference({"kind": "polar_express", "steps": steps, "coefficients": coefficients})["eps"],
        ))
    return rows


def plot(out: Path, coefficients: str = "polar_express") -> None:
    from geomopt.cli.demo import save_figure

    plt = _common.pyplot()

    sigma = torch.logspace(-6, 0, 4000, dtype=F64)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, eps, steps in zip(axes, PANEL_EPS, PANEL_STEPS):
        ax.plot(sigma, pe_map(sigma, steps, coefficients), label=f"Polar Express, {steps} steps", lw=1.6)
        ax.plot(sigma, h4_dual_grad(sigma, eps), "--", label=r"$(h_4^*)'$, $\varepsilon$" + f" = {eps:g}", lw=1.6)
        ax.plot(sigma, sign_map(sigma), ":", color="k", label="sign", lw=1.2)
        ax.set_xscale("log")
        ax.set_xlabel(r"$\sigma$ (after Frobenius normalization)")
        ax.set_title(rf"$\varepsilon = {eps:g}$")
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mapped singular value")
    fig.suptitle("Polar Express fits $(h_4^*)'$ more closely than sign (paper, Appendix F)")
    save_figure(fig, out, dpi=130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coefficients", default="polar_express", choices=["polar_express", "speedrun"])
    _common.add_output_args(parser, "preconditioners", timed=False)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = _common.resolve_output(parser, args, "preconditioners") / "preconditioners.png"
    rows = summary(coefficients=args.coefficients)
    head = " ".join(f"L2 vs h4'(eps={e:g})" for e in PANEL_EPS)
    print(f"{'steps':>5}  {'L2 vs sign':>10}  {head}  {'best eps':>9}  {'L2 at best':>10}  {'1/prod a':>9}  closer to h4'")
    for r in rows:
        cols = "  ".join(f"{r.l2_h4[e]:>17.6f}" for e in PANEL_EPS)
        print(f"{r.steps:>5}  {r.l2_sign:>10.6f}  {cols}  {r.best_eps:>9.3e}  {r.l2_best:>10.6f}  {r.slope_eps:>9.3e}  {r.closer_to_h4}")
    plot(out, args.coefficients)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
