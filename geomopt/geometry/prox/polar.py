"""SVD-free polar iterations, and the polar methods of the stiefel and spectral_ball steps.

* :func:`polar`: the polar factor U·Vᵀ by cubic Newton–Schulz, plain or scaled
  (:func:`polar_steps`, :func:`scaled_polar_schedule`: step counts simulated on the host);
* :func:`_inverse_sqrt`: H^{−1/2} by the coupled Newton–Schulz iteration;
* :func:`_stiefel_polar` and :func:`_spectral_ball_polar`: the ``method: polar`` steps of
  :func:`geomopt.geometry.prox.spectral.spectral_projection` (:data:`POLAR`, by constraint kind;
  ``method: auto`` picks them by device and size, :func:`geomopt.geometry.method.resolve_method`),
  with their feasibility flag from a power-iteration estimate of the spectral distance
  (:func:`_spectral_norm_estimate`).
"""

from __future__ import annotations

import math

import torch

from geomopt.geometry.matrix import matrices, upcast, working_dtype
from geomopt.geometry.prox.common import per_element, too_far, unflat_rows
from geomopt.geometry.capture import refuse_in_capture

# ---------------------------------------------------------------- polar factor (SVD-free)


def polar(m: torch.Tensor, steps: int | None = None, *, scale: torch.Tensor | None = None, floor: float | None = None,
          gram: torch.Tensor | None = None, top: float | None = None) -> torch.Tensor:
    """Polar factor U·Vᵀ of a batch of matrices (..., m, n) by the cubic Newton–Schulz iteration
    X ← 1.5X − 0.5·X(XᵀX), which converges to the polar factor for σ(X) ∈ (0, √3) (zero singular
    values stay zero: a partial isometry for rank-deficient input). Batched matmuls in float32
    (float64 for float64 input), on the smaller Gram side.

    ``scale`` (broadcastable to (..., 1, 1)) normalizes the input, default ‖M‖_F (then σ ≤ 1).
    ``steps`` defaults to the count that lifts a normalized singular value ``floor`` (default
    2⁻²⁰ in fp32, 2⁻⁴⁰ in fp64) to 1 within the dtype's precision (:func:`polar_steps`).
    ``gram``: MᵀM (tall) or MMᵀ (wide) in the working dtype, when the caller has it (saves the
    first step's product).

    ``top``: the caller guarantees σ(M)/scale ≤ top and every singular value that matters is
    ≥ ``floor``·scale. Then each step is the scaled one, X ← f(αX) with f(x) = 1.5x − 0.5x³ and
    α = √(3/(1 + ℓ + ℓ²)) for the current lower end ℓ (the interval [ℓ, 1] maps onto [f(αℓ), 1],
    both ends equal: Chen & Chow's scaled Newton–Schulz), with α capped so that f(α) ≥ 1/2
    (numerical safety), which lifts ℓ by about 2.3 per step instead of 1.5: about half the steps
    from a small floor (:func:`scaled_polar_schedule`).
    ``steps`` is then ignored.
    """
    dtype = working_dtype(m.dtype)
    x = m.to(dtype)
    tall = x.shape[-2] >= x.shape[-1]
    if not tall:
        x = x.transpose(-2, -1)
    if scale is None:
        scale = torch.linalg.matrix_norm(x).unsqueeze(-1).unsqueeze(-1)
    scale = scale.to(dtype).clamp(min=torch.finfo(dtype).tiny)
    if top is not None:
        scale = scale * top  # σ/scale ≤ 1 from here on
    x = x / scale
    low = floor if floor is not None else (2.0**-40 if dtype == torch.float64 else 2.0**-20)
    if top is not None:
        alphas = scaled_polar_schedule(low / top, dtype)
    else:
        alphas = [1.0] * (polar_steps(low, dtype) if steps is None else steps)
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    if gram is not None:
        gram = (gram / (scale * scale)).reshape(-1, *gram.shape[-2:])
    for a in alphas:
        xtx = x.transpose(-2, -1) @ x if gram is None else gram
        gram = None
        x = torch.baddbmm(x, x, xtx, beta=1.5 * a, alpha=-0.5 * a**3)  # f(αX) = 1.5αX − 0.5α³·X(XᵀX), one pass
    x = x.reshape(*lead, *x.shape[-2:])
    return x if tall else x.transpose(-2, -1)


def scaled_polar_schedule(floor: float, dtype: torch.dtype) -> list[float]:
    """The α of each scaled Newton–Schulz step (see :func:`polar`) that brings every normalized
    singular value in [floor, 1] to within the dtype's precision of 1, then one plain step
    (α = 1) to settle rounding; simulated on the host (no device syncs)."""
    eps = torch.finfo(dtype).eps
    low = floor
    alphas: list[float] = []
    while 1 - low > eps and len(alphas) < 200:
        a = min(math.sqrt(3 / (1 + low + low * low)), _ALPHA_CAP)
        alphas.append(a)
        low = min(1.5 * a * low - 0.5 * (a * low) ** 3, 1.5 * a - 0.5 * a**3)
    return alphas + [1.0]


# α with f(α) = 1/2: the top of the spectrum never drops below 1/2, so no singular direction passes
# through magnitudes where rounding (~ε·‖X‖) would swamp it (full equioscillation, α → √3 for a
# small floor, maps σ = 1 to f(√3) = 0 and costs ~1e-11 in fp64).
_ALPHA_CAP = 1.5320888862379562


def polar_steps(floor: float, dtype: torch.dtype, top: float = 1.0) -> int:
    """Cubic Newton–Schulz steps that bring every normalized singular value in [floor, top]
    (top < √3) to within the dtype's precision of 1, simulated on the host (no device syncs)."""
    eps = torch.finfo(dtype).eps
    worst = 0
    for x in (floor, top):
        n = 0
        while abs(1 - x) > eps and n < 200:
            x = 1.5 * x - 0.5 * x**3
            n += 1
        worst = max(worst, n)
    return worst + 1


def _gershgorin(g: torch.Tensor) -> torch.Tensor:
    """max_i Σ_j |G_ij| per matrix of a batch: an upper bound on ‖G‖₂ for symmetric G."""
    return g.abs().sum(-1).amax(-1)


def _spectral_norm_estimate(e: torch.Tensor, iters: int = 12) -> torch.Tensor:
    """Lower estimate of σ_max(E) by power iteration on the small Gram matrix (one matmul over E,
    then q×q products: E is read once, not twice per iteration) from a fixed generic start (no
    SVD)."""
    small = e.transpose(-2, -1) @ e if e.shape[-2] >= e.shape[-1] else e @ e.transpose(-2, -1)
    n = small.shape[-1]
    v = 1 + torch.arange(n, dtype=e.dtype, device=e.device) / (n + 1) * 0.7  # deterministic, generic
    v = v.expand(e.shape[0], n).unsqueeze(-1)
    for _ in range(iters):
        w = small @ v
        v = w / torch.linalg.vector_norm(w, dim=-2, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)
    return (v.transpose(-2, -1) @ small @ v).reshape(e.shape[0]).clamp(min=0).sqrt()


# ---------------------------------------------------------------- the polar steps


def _stiefel_polar(y, t, ref, constraint, *, geometry, batch_dims):
    """SVD-free Stiefel step r·polar(Y): normalize by c = max(r + t, √(max_i Σ_j |G_ij|)/1.5), G
    the small Gram matrix — when X ∈ Stiefel(r), σ(Y) ∈ (r − t, r + t), and the second term (a
    Gershgorin bound on σ_max²) keeps σ/c ≤ 1.5 < √3 (convergence) for any Y — then iterate for
    the host-computed number of steps that lifts the smallest feasible σ/c to 1 in the working
    precision: cubic Newton–Schulz on Y (scaled, :func:`polar`) or Y·G^{−1/2} by the Gram
    matrix's inverse square root, whichever costs fewer FLOPs (:func:`_polar_by_cost`). Measured
    against the SVD on Y = X − tW, X ∈ Stiefel(r), ‖W‖₂ ≤ 0.99, t ∈ {0.3, 0.02, 0.001}·r
    (48×24, 24×48, 256×128, 128×512): tests/test_prox_polar.py asserts max-entry error ≤ 2e-6·r
    (fp32), ≤ 1e-13·r (fp64). The step count is the feasible case's (4 steps for t = 0.02r): Y far
    from Stiefel(r) — not a step from a feasible X — is flagged and left less converged (8e-2·r
    for a Gaussian 64×32 Y); in training the next step brings X back to ~3e-7
    (tests/test_optimizer.py). Use ``method: exact`` for arbitrary Y. The flag uses a
    power-iteration estimate of ‖Y − X⁺‖₂ (a lower bound: marginal infeasibility can go
    unflagged)."""
    r = constraint.radius
    mats = matrices(upcast(y), batch_dims)
    q = min(mats.shape[-2:])
    fro = torch.linalg.matrix_norm(mats)
    # Gershgorin on the small Gram G: σ_max² ≤ max_i Σ_j |G_ij| ≤ √q·σ_max², so c ≥ σ_max/1.5
    # for any Y, and c ≤ (r + t)·max(1, q^¼/1.5) when σ ≤ r + t (‖Y‖_F/1.5 would give √q/1.5)
    gram = mats.mT @ mats if mats.shape[-2] >= mats.shape[-1] else mats @ mats.mT  # mats: working dtype
    c = torch.clamp(_gershgorin(gram).sqrt() / 1.5, min=r + t)[:, None, None]
    # Feasible case: σ ∈ [lo, hi] (t widened by 1.2: Newton–Schulz forwards reach ‖W‖₂ ≈ 1.13).
    # The Gram rows of such a Y sum to at most r² + √q(2r·t' + t'²): where that keeps the guard
    # below r + t, c = r + t exactly and σ/c ∈ [lo, hi]/(r + t) (a few steps for small t);
    # otherwise c ≤ hi·q^¼/1.5 and σ/c ≤ 1.5.
    t1 = 1.2 * t
    lo, hi = r - t1, r + t1
    if lo <= 0:
        floor, top = 2.0 ** (-40 if mats.dtype == torch.float64 else -20), 1.5
    elif math.sqrt(r * r + math.sqrt(q) * (2 * r * t1 + t1 * t1)) <= 1.5 * (r + t):
        floor, top = lo / (r + t), hi / (r + t)
    else:
        floor, top = lo / max(r + t, hi * q ** 0.25 / 1.5), 1.5
    qf = _polar_by_cost(mats, gram, c, floor, top)
    zero = (fro == 0)[:, None, None]
    eye = torch.eye(mats.shape[-2], mats.shape[-1], dtype=mats.dtype, device=mats.device)
    xm = torch.where(zero, eye, qf).mul_(r)
    x = unflat_rows(xm, y)
    if not ref.bounded:
        return x, None
    dist = _spectral_norm_estimate(mats - xm)
    return x, per_element(too_far(dist, t, fro, y), y, batch_dims)


def _polar_by_cost(mats: torch.Tensor, gram: torch.Tensor, c: torch.Tensor, floor: float, top: float) -> torch.Tensor:
    """polar(M) for σ(M)/c ∈ [floor, top] by the cheaper of two iterations, counted in matmul
    FLOPs on the host: scaled cubic Newton–Schulz on M itself (:func:`polar`, 2mn² per step), or
    M·G^{−1/2} with the coupled Newton–Schulz inverse square root of the small Gram matrix
    (:func:`_inverse_sqrt` on G/c², spectrum in [floor², top²]: 3n³ per step, then one mn²
    product; n the small side). The second wins for elongated matrices near Stiefel (few steps,
    n ≪ m); from a small floor the cubic schedule is far shorter."""
    m, n = max(mats.shape[-2:]), min(mats.shape[-2:])
    cubic = 2 * m * n * n * len(scaled_polar_schedule(floor / top, mats.dtype)) - m * n * n
    gram_steps = _inverse_sqrt_steps(floor * floor, working_dtype(mats.dtype), top * top)
    if 3 * n**3 * gram_steps + m * n * n >= cubic:
        return polar(mats, scale=c, floor=floor, top=top, gram=gram)
    z = _inverse_sqrt(gram / (c * c), floor=floor * floor, top=top * top) / c
    return mats @ z if mats.shape[-2] >= mats.shape[-1] else z @ mats


def _spectral_ball_polar(y, t, ref, constraint, *, geometry, batch_dims):
    """SVD-free singular value clipping U·Diag(min(σ, r))·Vᵀ by matrix iterations on the small
    Gram matrix only.

    For tall Y (wide: transpose) with G = YᵀY = V·Diag(σ²)·Vᵀ:
        clip_r(Y) = r·Y·H^{−1/2},   H = r²I + ½(G − r²I)(I + S),   S = sign(G − r²I),
    since H = V·Diag(max(σ², r²))·Vᵀ, so r·H^{−1/2} = V·Diag(min(1, r/σ))·Vᵀ. S is the polar factor
    of the symmetric shift (:func:`polar`, scaled cubic Newton–Schulz); it is inexact only where
    |σ² − r²| is below its floor, and there H's eigenvalue lies between r² and σ², which moves
    the clipped σ by at most |σ − r|: the floor 2u·r²/c (c ≥ ‖G − r²I‖₂, Gershgorin) keeps that
    below u·r. H^{−1/2} comes from the coupled Newton–Schulz iteration (Y ← Y·T, Z ← T·Z,
    T = ½(3I − Z·Y), Y₀ = H/c_H, Z₀ = I, Z → (H/c_H)^{−1/2}), whose spectrum lies in
    [r²/c_H, 1]: a few steps near the ball, more for σ ≫ r. Directions with σ ≤ r (including
    σ = 0: rank-deficient Y) get H = r², a factor 1, exactly. Everything is n×n except the Gram
    matrix and the final product; the two step counts are set on the host from the largest scales
    in the batch (two host syncs per call). Measured against the SVD (tests/test_prox_polar.py):
    Gaussian 40×24, 24×40 and rank-5 40×24 matrices, max-entry error ≤ 2e-6·r (fp32), ≤ 1e-13·r
    (fp64); σ spread from 100r to 0.01r: ≤ 1e-4·r (fp32), ≤ 1e-12·r (fp64). The flag uses a
    power-iteration estimate of ‖Y − X⁺‖₂."""
    refuse_in_capture("iteration counts read from the matrices' scales on the host")
    r = constraint.radius
    mats = matrices(upcast(y), batch_dims)
    tall = mats.shape[-2] >= mats.shape[-1]
    a = mats if tall else mats.transpose(-2, -1)
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    shifted = a.transpose(-2, -1) @ a - (r * r) * eye
    c_s = _gershgorin(shifted)  # ≥ ‖G − r²I‖₂
    tiny = torch.finfo(a.dtype).tiny
    worst = max(float(c_s.amax()) if len(c_s) else 0.0, tiny)  # host sync 1: S's step count
    sgn = polar(shifted, scale=c_s.clamp(min=tiny)[:, None, None],
                floor=min(0.5, 2 * torch.finfo(a.dtype).eps * r * r / worst), top=1.0)
    excess = 0.25 * (shifted @ (eye + sgn))
    excess = excess + excess.transpose(-2, -1)  # ½(G − r²I)(I + S), symmetrized (they commute to rounding)
    c_h = r * r + _gershgorin(excess)  # ≥ ‖H‖₂, with H − r²I ⪰ 0 small near the ball
    floor = r * r / max(float(c_h.amax()) if len(c_h) else r * r, tiny)  # host sync 2: H^{−1/2}'s step count
    z = _inverse_sqrt((excess + (r * r) * eye) / c_h[:, None, None], floor=floor)
    xa = a @ (z * (r / c_h.sqrt())[:, None, None])
    xm = xa if tall else xa.transpose(-2, -1)
    x = unflat_rows(xm, y)
    if not ref.bounded:
        return x, None
    dist = _spectral_norm_estimate(mats - xm)
    return x, per_element(too_far(dist, t, torch.linalg.matrix_norm(mats), y), y, batch_dims)


def _inverse_sqrt(h: torch.Tensor, floor: float, top: float = 1.0) -> torch.Tensor:
    """H^{−1/2} for a batch of symmetric H with spectrum in [floor, top] (top < 2.5) by the coupled
    Newton–Schulz iteration Y ← Y·T, Z ← T·Z, T = ½(3I − Z·Y) from Y = H, Z = I (Higham, Functions
    of Matrices, §6.3; stable, unlike the uncoupled form): Y → H^{1/2}, Z → H^{−1/2}. A spectral
    value μ moves as e ← ¾e² + ¼e³ with e = 1 − μ·z²; the step count is simulated on the host."""
    steps = _inverse_sqrt_steps(floor, h.dtype, top)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    t = 1.5 * eye - 0.5 * h
    ym, z = h @ t, t
    for _ in range(steps - 1):
        t = 1.5 * eye - 0.5 * (z @ ym)
        ym, z = ym @ t, t @ z
    return z


def _inverse_sqrt_steps(floor: float, dtype: torch.dtype, top: float = 1.0) -> int:
    eps = torch.finfo(dtype).eps
    worst = 1
    for mu in (floor, top):
        y, z, n = mu, 1.0, 0
        while abs(1 - y * z) > eps and n < 100:
            t = 1.5 - 0.5 * z * y
            y, z, n = y * t, t * z, n + 1
        worst = max(worst, n)
    return worst + 1


POLAR = {"stiefel": _stiefel_polar, "spectral_ball": _spectral_ball_polar}
