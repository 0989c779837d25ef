"""Forward ops: the preconditioner ρ·∇φ₁*(D) of the forward step Y = X − γ∇φ*(D) (paper eq. (2.1)).

One registered op per geometry kind (docs: design.md, the math contracts), each
``fn(d, geometry: ResolvedGeometry, *, radius, batch_dims=0, state=None) -> Tensor`` with
``geometry`` a plan's resolved geometry (:mod:`geomopt.compile.fragments`: the spec model and
its concrete view), read by attribute. The leading
``batch_dims`` dims of ``d`` index independent tensors (the optimizer stacks same-shape tensors
into one bucket), so every norm and every matrix is per batch element. Ops compute in at least
float32 (bf16 inputs are upcast: :func:`geomopt.geometry.matrix.upcast`) and return ``out_dtype``
(default: the input dtype).

Each op declares its locality when it registers (:mod:`geomopt.geometry.operators`): elementwise
maps are ``LOCAL``, whole-tensor or row/column norms ``REDUCE``, the spectral map (a matrix
function) ``OWNER``.
"""

from __future__ import annotations

import torch

from geomopt.geometry.adam import adam_moments
from geomopt.geometry.matrix import by_rows, matrix_view, upcast
from geomopt.geometry.reference import Reference, make_reference
from geomopt.geometry.operators import FORWARD_OPS
from geomopt.registry import LOCAL, OWNER, REDUCE
from geomopt.geometry.dtypes import compute_dtype
from geomopt.geometry.spectral import apply_approx
from geomopt.geometry.view import apply as apply_view
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.spec.geometries import GramNewtonSchulz, NewtonSchulz, PolarExpress, Svd

_SVD = Svd()  # a spectral geometry's approx where none is given


def _reference(geometry: ResolvedGeometry) -> Reference:
    cfg = geometry.reference
    if cfg is None:
        raise ValueError(f"geometry {geometry.kind!r} needs a reference "
                         f"(log_barrier, power_barrier, indicator, quadratic)")
    return make_reference(cfg)


def _element_dims(d: torch.Tensor, batch_dims: int) -> tuple[int, ...]:
    return tuple(range(batch_dims, d.ndim))


@FORWARD_OPS.register("euclidean", locality=LOCAL, forms=("flat",))
def euclidean(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """φ = ½‖·‖²: ∇φ*(D) = ρD (SGD)."""
    return (upcast(d) * radius).to(out_dtype or d.dtype)


@FORWARD_OPS.register("isotropic", locality=REDUCE, forms=("flat",))
def isotropic(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """φ = h∘‖·‖_F: ∇φ*(D) = ρ·(h*)'(‖D‖)·D/‖D‖ = ρ·[(h*)'(s)/s]·D, s = ‖D‖_F per batch element
    (paper Corollary 3.2(i), Example 2.3: log barrier gives D/(ε+‖D‖), normalized SGD). The factor
    (h*)'(s)/s is :meth:`Reference.iso_factor`, finite at s = 0, so D/‖D‖ is never formed."""
    x = upcast(d)
    s = torch.linalg.vector_norm(x, dim=_element_dims(x, batch_dims), keepdim=True)
    return (x * (radius * _reference(geometry).iso_factor(s))).to(out_dtype or d.dtype)


@FORWARD_OPS.register("anisotropic", locality=LOCAL, forms=("flat",))
def anisotropic(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """φ(X) = Σ h(X_ij): ∇φ*(D)_ij = ρ·(h*)'(D_ij) (paper Example 2.3, separable; the indicator
    gives ρ·sign(D), Scion's Sign with ρ = 1/d_in)."""
    return (radius * _reference(geometry).dual_grad(upcast(d))).to(out_dtype or d.dtype)


@FORWARD_OPS.register("spectral", locality=OWNER)
def spectral(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """φ(X) = Σ h(σ_i(X)): ∇φ*(D) = ρ·U·Diag((h*)'(σ_i))·Vᵀ (paper Corollary 3.2(ii), Example 3.3;
    Muon-like). Each element is the matrix (shape[0], prod(rest)) (a ``view`` makes it several:
    :func:`forward`). ``approx`` picks svd / gram_eigh / newton_schulz / polar_express
    (:mod:`geomopt.geometry.spectral`), after ``prenormalize``."""
    approx = geometry.approx or _SVD
    ref = _reference(geometry) if approx.kind in ("svd", "gram_eigh") else None
    # no upcast here: each approximation casts to its own working dtype (spectral.compute_dtype),
    # and folds ρ into its result (a scaled σ map, or the last small factor of an iteration)
    mats = matrix_view(d, batch_dims)
    out = apply_approx(mats, ref, approx, geometry.prenormalize, scale=radius, out_dtype=out_dtype or d.dtype)
    return out.reshape(d.shape)


def input_dtype(geometry: ResolvedGeometry, like: torch.Tensor) -> torch.dtype:
    """The dtype the forward op first casts a direction like ``like`` to: a caller that writes the
    direction in it saves that pass (bit for bit the same step). bf16 for Newton–Schulz / Polar
    Express where they run in bf16; ``like.dtype`` otherwise."""
    approx = geometry.approx
    if geometry.kind != "spectral" or not isinstance(approx, (NewtonSchulz, GramNewtonSchulz, PolarExpress)):
        return like.dtype
    return compute_dtype(like, approx.kind, approx.dtype)


def _blockwise(d, geometry, radius, batch_dims, out_dtype):
    mats = matrix_view(upcast(d), batch_dims)
    # the groups: rows or columns of the stored matrix (geomopt.geometry.matrix.by_rows)
    s = torch.linalg.vector_norm(mats, dim=-1 if by_rows(geometry) else -2, keepdim=True)
    out = mats * (radius * _reference(geometry).iso_factor(s))
    return out.reshape(d.shape).to(out_dtype or d.dtype)


@FORWARD_OPS.register("rowwise", locality=REDUCE)
def rowwise(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """Isotropic per row (output unit) of the (d_out, d_in) matrix, φ(X) = Σ_i h(‖X_i,:‖)
    (block-separable): row i ↦ ρ·[(h*)'(s_i)/s_i]·D_i,:, s_i = ‖D_i,:‖. Scion's RowNorm is the log
    barrier with ρ = 1/c, ε = 1e-8/c (paper Remark 2.5). The matrix is the (shape[0], rest) view
    for ``layout: out_in`` and its transpose for ``in_out`` (stored columns are then the rows)."""
    return _blockwise(d, geometry, radius, batch_dims, out_dtype)


@FORWARD_OPS.register("columnwise", locality=REDUCE)
def columnwise(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """Isotropic per column (input unit) of the (d_out, d_in) matrix: column j ↦
    ρ·[(h*)'(s_j)/s_j]·D_:,j, s_j = ‖D_:,j‖ (Scion's ColNorm; on an ``in_out`` embedding
    (vocab, dim) it normalizes each stored row, Scion's ColNorm(transpose=True))."""
    return _blockwise(d, geometry, radius, batch_dims, out_dtype)


def elementwise_into(d: torch.Tensor, geometry: ResolvedGeometry, out: torch.Tensor) -> torch.Tensor:
    """∇φ₁*(d) (ρ = 1) of the euclidean or anisotropic geometry, written into ``out`` (which may
    be ``d``; the euclidean map returns ``d`` itself): the optimizer's flat path, which keeps its
    buffers and so never pays for fresh memory. Same values as :func:`euclidean` /
    :func:`anisotropic` with radius 1."""
    if geometry.kind == "euclidean":
        return d
    return _reference(geometry).dual_grad_into(d, out)


def elementwise_allocates(geometry: ResolvedGeometry, in_place: bool = False) -> bool:
    """Whether :func:`elementwise_into` allocates (the power barrier's (h*)'; the log barrier's over
    its own input, ``in_place``; never the sign or the identity)."""
    if geometry.kind == "euclidean":
        return False
    ref = _reference(geometry)
    return ref.into_allocates or (in_place and not ref.into_in_place)


def elementwise_in_place(geometry: ResolvedGeometry) -> bool:
    """Whether :func:`elementwise_into` writes over its input without allocating."""
    return geometry.kind == "euclidean" or _reference(geometry).into_in_place


def isotropic_factors(norms: torch.Tensor, geometry: ResolvedGeometry) -> torch.Tensor:
    """(h*)'(s)/s for the norms s = ‖D‖_F of several tensors: :func:`isotropic` without the
    multiplication by D (the optimizer's flat path folds it into its update)."""
    return _reference(geometry).iso_factor(norms)


@FORWARD_OPS.register("adam", locality=LOCAL, forms=("flat",))
def adam(d, geometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """Adam(W)'s update direction, outside the paper's theory (an escape hatch; lint says so):
    m ← β₁m + (1−β₁)d, v ← β₂v + (1−β₂)d², returns ρ·m/(bc₁·(√v/√bc₂ + ε)), bc_i = 1 − β_i^t
    (:func:`adam_moments`; the caller applies lr and decoupled weight decay). lr times this equals
    AdamW's step up to the rounding of one product (torch folds 1/bc₁ into lr); for bit-exact
    AdamW use :func:`adam_moments` with ``addcdiv`` as the optimizer does. ``state`` (required)
    is created on first use. Elementwise, so ``batch_dims`` does not matter."""
    if state is None:
        raise ValueError("the adam forward op carries state: pass a dict (empty on the first step)")
    exp_avg, denom, bias_correction1 = adam_moments(d, state, geometry)
    return (exp_avg / denom * (radius / bias_correction1)).to(out_dtype or d.dtype)


def forward(
    d: torch.Tensor,
    geometry: ResolvedGeometry,
    *,
    radius: float | None = None,
    batch_dims: int = 0,
    state: dict | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ρ·∇φ₁*(d) for a resolved geometry (its spec model and concrete view, read by attribute), in
    ``out_dtype`` (default: d's); ``radius`` None reads the geometry's ``radius``. A ``view``
    (:mod:`geomopt.geometry.view`) runs the op on each of its matrix stacks. A zero-size ``d``
    gives a zero-size result (no op runs; an adam ``state`` is left as it is)."""
    kind = geometry.kind
    op = FORWARD_OPS.get(kind)
    if op is None:
        raise ValueError(f"unknown geometry kind {kind!r}; expected one of {', '.join(FORWARD_OPS)}")
    rho = float(geometry.radius) if radius is None else float(radius)
    if d.numel() == 0:  # no entries (a dim of size 0): nothing to map, and no matrix to view
        return torch.empty_like(d, dtype=out_dtype or d.dtype)
    view = geometry.view
    if view is None or kind == "anisotropic" and not view.factors or FORWARD_OPS.meta[kind].get("reads_view"):
        # elementwise (anisotropic): only factors matter; reads_view: the op reads its view itself
        return op(d, geometry, radius=rho, batch_dims=batch_dims, state=state, out_dtype=out_dtype)
    plain = geometry.matrix
    out, _ = apply_view(d, batch_dims, view, lambda m, f: (
        op(m, plain, radius=rho * f, batch_dims=1, state=state, out_dtype=out_dtype), None))
    return out
