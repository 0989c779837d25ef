"""Forward ops: the preconditioner ρ·∇φ₁*(D) of the forward step Y = X − γ∇φ*(D) (paper eq. (2.1)).

One registered op per geometry kind (DESIGN's geometry table), each
``fn(d, geometry: dict, *, radius, batch_dims=0, state=None) -> Tensor`` with ``geometry`` the
``model_dump()`` of a spec geometry. The leading ``batch_dims`` dims of ``d`` index independent
tensors (the optimizer stacks same-shape tensors into one bucket), so every norm and every matrix
is per batch element. Ops compute in at least float32 (bf16 inputs are upcast) and return the
input dtype.
"""

from __future__ import annotations

import torch

from geomopt.geometry.reference import Reference, make_reference
from geomopt.geometry.registry import FORWARD_OPS, forward_op
from geomopt.geometry.spectral import apply_approx, matrix_view


def _work(d: torch.Tensor) -> torch.Tensor:
    # fp32 at least: bf16 norms and divisions would put ~0.4% noise on every entry.
    return d.to(torch.promote_types(d.dtype, torch.float32))


def _reference(geometry: dict) -> Reference:
    cfg = geometry.get("reference")
    if cfg is None:
        raise ValueError(f"geometry {geometry.get('kind')!r} needs a reference (log_barrier, power_barrier, indicator, quadratic)")
    return make_reference(cfg)


def _element_dims(d: torch.Tensor, batch_dims: int) -> tuple[int, ...]:
    return tuple(range(batch_dims, d.ndim))


@forward_op("euclidean")
def euclidean(d, geometry, *, radius, batch_dims=0, state=None):
    """φ = ½‖·‖²: ∇φ*(D) = ρD (SGD; DESIGN geometry table, row euclidean)."""
    return (_work(d) * radius).to(d.dtype)


@forward_op("isotropic")
def isotropic(d, geometry, *, radius, batch_dims=0, state=None):
    """φ = h∘‖·‖_F: ∇φ*(D) = ρ·(h*)'(‖D‖)·D/‖D‖ = ρ·[(h*)'(s)/s]·D, s = ‖D‖_F per batch element
    (paper Corollary 3.2(i), Example 2.3: log barrier gives D/(ε+‖D‖), normalized SGD). The factor
    (h*)'(s)/s is :meth:`Reference.iso_factor`, finite at s = 0, so D/‖D‖ is never formed."""
    x = _work(d)
    s = torch.linalg.vector_norm(x, dim=_element_dims(x, batch_dims), keepdim=True)
    return (x * (radius * _reference(geometry).iso_factor(s))).to(d.dtype)


@forward_op("anisotropic")
def anisotropic(d, geometry, *, radius, batch_dims=0, state=None):
    """φ(X) = Σ h(X_ij): ∇φ*(D)_ij = ρ·(h*)'(D_ij) (paper Example 2.3, separable; the indicator
    gives ρ·sign(D), Scion's Sign with ρ = 1/d_in)."""
    return (radius * _reference(geometry).dual_grad(_work(d))).to(d.dtype)


@forward_op("spectral")
def spectral(d, geometry, *, radius, batch_dims=0, state=None):
    """φ(X) = Σ h(σ_i(X)): ∇φ*(D) = ρ·U·Diag((h*)'(σ_i))·Vᵀ (paper Corollary 3.2(ii), Example 3.3;
    Muon-like). Each element is the matrix (shape[0], prod(rest)); ``split`` = k treats k equal
    blocks of dim 0 as separate matrices. ``approx`` picks svd / gram_eigh / newton_schulz /
    polar_express (:mod:`geomopt.geometry.spectral`), after ``prenormalize``."""
    x = _work(d)
    approx = geometry.get("approx") or {"kind": "svd"}
    ref = _reference(geometry) if approx.get("kind", "svd") in ("svd", "gram_eigh") else None
    mats = matrix_view(x, batch_dims, geometry.get("split"))
    out = apply_approx(mats, ref, approx, geometry.get("prenormalize"))
    return (radius * out).reshape(d.shape).to(d.dtype)


def _blockwise(d, geometry, radius, batch_dims, norm_dim: int):
    x = _work(d)
    mats = matrix_view(x, batch_dims)
    s = torch.linalg.vector_norm(mats, dim=norm_dim, keepdim=True)
    out = mats * (radius * _reference(geometry).iso_factor(s))
    return out.reshape(d.shape).to(d.dtype)


@forward_op("rowwise")
def rowwise(d, geometry, *, radius, batch_dims=0, state=None):
    """Isotropic per row of the (shape[0], prod(rest)) view, φ(X) = Σ_i h(‖X_i,:‖) (block-separable):
    row i ↦ ρ·[(h*)'(s_i)/s_i]·D_i,:, s_i = ‖D_i,:‖. Scion's RowNorm is the log barrier with
    ρ = 1/c, ε = 1e-8/c (DESIGN, Remark 2.5). Rows are rows of the stored tensor; ``layout`` only
    changes the ``scale`` preset (:mod:`geomopt.geometry.scale`)."""
    return _blockwise(d, geometry, radius, batch_dims, norm_dim=-1)


@forward_op("columnwise")
def columnwise(d, geometry, *, radius, batch_dims=0, state=None):
    """Isotropic per column of the (shape[0], prod(rest)) view: column j ↦ ρ·[(h*)'(s_j)/s_j]·D_:,j,
    s_j = ‖D_:,j‖ (Scion's ColNorm). Columns of the stored tensor, as in :func:`rowwise`."""
    return _blockwise(d, geometry, radius, batch_dims, norm_dim=-2)


@forward_op("adam")
def adam(d, geometry, *, radius, batch_dims=0, state=None):
    """Adam(W)'s update direction, outside the paper's theory (an escape hatch; lint says so):
    m ← β₁m + (1−β₁)d, v ← β₂v + (1−β₂)d², returns ρ·m/(bc₁·(√v/√bc₂ + ε)), bc_i = 1 − β_i^t,
    with the op order of torch.optim.AdamW's single-tensor path, so lr times this is AdamW's step
    (the caller applies lr and decoupled weight decay). ``state`` (required) holds ``exp_avg``,
    ``exp_avg_sq`` (float32 at least, even for bf16 tensors) and ``step``, created on first use.
    Elementwise, so ``batch_dims`` does not matter."""
    if state is None:
        raise ValueError("the adam forward op carries state: pass a dict (empty on the first step)")
    beta1, beta2 = (float(b) for b in geometry.get("betas", (0.9, 0.999)))
    eps = float(geometry.get("eps", 1e-8))
    g = _work(d)
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(g, memory_format=torch.preserve_format)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    step = state["step"].item()
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    # torch folds 1/bc₁ into the step size (lr/bc₁); here it scales the direction instead.
    return (exp_avg / denom * (radius / bias_correction1)).to(d.dtype)


def forward(
    d: torch.Tensor,
    geometry: dict,
    *,
    radius: float | None = None,
    batch_dims: int = 0,
    state: dict | None = None,
) -> torch.Tensor:
    """ρ·∇φ₁*(d) for a geometry dict (``model_dump()`` of a spec geometry); ``radius`` None reads
    ``geometry["radius"]`` (default 1)."""
    kind = geometry.get("kind")
    op = FORWARD_OPS.get(kind)
    if op is None:
        raise ValueError(f"unknown geometry kind {kind!r}; expected one of {', '.join(FORWARD_OPS)}")
    rho = float(geometry.get("radius", 1.0)) if radius is None else float(radius)
    return op(d, geometry, radius=rho, batch_dims=batch_dims, state=state)
