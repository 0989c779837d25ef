"""Arithmetic of the math units that the other tests leave free (scripts/mutate.py's survivors),
checked against independent computations: torch.optim.AdamW and float64 closed forms."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from geomopt.geometry.adam import adam_moments, adam_multi_tensor
from geomopt.geometry.matrix import groups, matrices, split_like
import typed_fragments as typed
from typed_fragments import backward, stationarity_gap
from geomopt.geometry.view import cost as view_cost
from geomopt.geometry.view import count, describe
from geomopt.compile.fragments import View
from geomopt.geometry.reference import _z_minus_log1p, make_reference
from geomopt.geometry.polynomial import compose_polynomials, gram_quintic_iteration
from geomopt.geometry.prox.scalar import _box_tau, ball_magnitudes, sphere_magnitudes
from geomopt.geometry.prox.vector import VECTOR_PROJ
from geomopt.geometry.prox.polar import (_ALPHA_CAP, _inverse_sqrt, _inverse_sqrt_steps, polar, polar_steps,
                                         scaled_polar_schedule)


def _adamw_steps(xs, grads, *, lr, betas, eps, weight_decay):
    """torch.optim.AdamW (the single-tensor path) over the list of gradients per step."""
    params = [x.clone().requires_grad_(True) for x in xs]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_multi_tensor_is_adamw_over_steps(fused, weight_decay):
    """The flat path in both forms (foreach ops; torch's fused kernel) against torch.optim.AdamW,
    three steps, two tensors of a flat buffer, float64."""
    torch.manual_seed(0)
    xs0 = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    grads = [[torch.randn_like(x) for x in xs0] for _ in range(3)]
    lr, betas, eps = 0.05, (0.8, 0.95), 1e-6
    want = _adamw_steps(xs0, grads, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    xs = [x.clone() for x in xs0]
    n = sum(x.numel() for x in xs)
    m, v = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    scratch = {}

    def take(name, shape):
        return scratch.setdefault(name, torch.empty(shape, dtype=torch.float64))

    for step, us in enumerate(grads, start=1):
        adam_multi_tensor(xs, us, (m, split_like(m, xs)), (v, split_like(v, xs)), step, None, 0,
                          typed.geometry({"kind": "adam", "betas": list(betas), "eps": eps}), lr, weight_decay, fused,
                          take)
    for got, ref in zip(xs, want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)


def test_adam_moments_defaults_are_adamws():
    """Without betas and eps in the spec: torch.optim.AdamW's (0.9, 0.999) and 1e-8, in closed form
    over two steps (m, v and the denominator √v̂ + ε, bc₁)."""
    torch.manual_seed(1)
    g1, g2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    state: dict = {}
    adam_moments(g1, state, typed.geometry({"kind": "adam"}))
    m, denom, bc1 = adam_moments(g2, state, typed.geometry({"kind": "adam"}))
    b1, b2, eps = 0.9, 0.999, 1e-8
    m_ref = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v_ref = b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2
    torch.testing.assert_close(m, m_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(denom, v_ref.sqrt() / (1 - b2**2) ** 0.5 + eps, rtol=1e-12, atol=0)
    assert bc1 == pytest.approx(1 - b1**2, rel=1e-14)


# ---------------------------------------------------------------- polar: the host-side schedules


def _cubic(x: float, a: float = 1.0) -> float:
    """One scaled Newton–Schulz step on a singular value: f(aσ) = 1.5aσ − 0.5(aσ)³."""
    return 1.5 * a * x - 0.5 * (a * x) ** 3


def _grid(floor: float, n: int = 60) -> list[float]:
    return [floor * (1 / floor) ** (i / (n - 1)) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("floor", [2.0**-20, 1e-3, 0.3])
def test_polar_steps_are_the_fewest_that_bring_every_singular_value_to_one(dtype, floor):
    """polar_steps = (the fewest steps after which every σ in [floor, 1] is within ε of 1) + 1, by
    brute force over a grid of σ (the map is increasing on [0, 1] and fixes 1)."""
    eps = torch.finfo(dtype).eps
    k = polar_steps(floor, dtype)

    def after(x: float, n: int) -> float:
        for _ in range(n):
            x = _cubic(x)
        return x

    assert all(abs(1 - after(x, k - 1)) <= eps for x in _grid(floor))
    assert abs(1 - after(floor, k - 2)) > eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("floor", [2.0**-20, 1e-3, 0.3])
def test_the_scaled_schedule_brings_every_singular_value_to_one_and_no_sooner(dtype, floor):
    """Every σ in [floor, 1] ends within ε of 1 under the scaled steps (then α = 1); without the
    last scaled step the floor does not; every α is at most the cap that keeps f(α) ≥ 1/2, and
    below it the one that maps both ends of the remaining interval to the same value."""
    eps = torch.finfo(dtype).eps
    alphas = scaled_polar_schedule(floor, dtype)
    assert alphas[-1] == 1.0 and all(0 < a <= _ALPHA_CAP for a in alphas)
    assert _cubic(1.0, _ALPHA_CAP) == pytest.approx(0.5, abs=1e-12)

    def after(x: float, schedule: list[float]) -> float:
        for a in schedule:
            x = _cubic(x, a)
        return x

    assert all(abs(1 - after(x, alphas[:-1])) <= 2 * eps for x in _grid(floor))
    assert abs(1 - after(floor, alphas[:-2])) > eps
    # each α equalizes the images of the interval's ends, f(α·low) = f(α) (the equioscillation
    # step), unless capped; the interval's image by brute force over a grid
    low = floor
    for a in alphas[:-1]:
        assert a == _ALPHA_CAP or _cubic(low, a) == pytest.approx(_cubic(1.0, a), rel=1e-12)
        low = min(_cubic(x, a) for x in [low + (1 - low) * i / 400 for i in range(401)])


# ---------------------------------------------------------------- small units


def test_a_scalar_element_is_one_by_one():
    assert matrices(torch.tensor(3.0)).shape == (1, 1, 1)
    assert matrices(torch.zeros(5), batch_dims=1).shape == (5, 1, 1)
    assert matrices(torch.zeros(4)).shape == (1, 4, 1)


@pytest.mark.parametrize("scale", [1.0, -0.5, 3.0])
def test_gram_quintic_iteration_scales_its_output(scale):
    """scale·p_k(…p_1(X)) against the float64 map on the singular values (U·diag(p(σ))·Vᵀ)."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, dtype=torch.float64) * 0.3
    coefficients = [(3.4445, -4.7750, 2.0315)] * 4
    got = gram_quintic_iteration(x, coefficients, scale=scale)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    want = scale * u @ torch.diag_embed(compose_polynomials(coefficients, s)) @ vh
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reference", [{"kind": "log_barrier", "eps": 1e-3},
                                       {"kind": "power_barrier", "kappa": 2.0, "eps": 1e-3}])
def test_the_gap_takes_w_on_the_boundary_as_just_inside(reference):
    """|w| = 1 exactly (where a saturated barrier step rounds W) is h(1 − ε), finite: the same gap
    as W pulled to 1 − ε; past rounding (|w| = 1 + 1e-3) it is +∞."""
    eps = torch.finfo(torch.float64).eps
    geometry = {"kind": "anisotropic", "reference": reference, "radius": 0.7}
    g = torch.tensor([[0.3, -2.0, 0.5]], dtype=torch.float64)
    on = torch.tensor([[1.0, -1.0, 0.25]], dtype=torch.float64)
    inside = torch.tensor([[1 - eps, -(1 - eps), 0.25]], dtype=torch.float64)
    gap_on = stationarity_gap(g, on, geometry, batch_dims=1)
    assert torch.isfinite(gap_on).all()
    torch.testing.assert_close(gap_on, stationarity_gap(g, inside, geometry, batch_dims=1), rtol=1e-12, atol=0)
    past = stationarity_gap(g, on * (1 + 1e-3), geometry, batch_dims=1)
    assert torch.isinf(past).all()


# ---------------------------------------------------------------- the SVD-free Stiefel step's bounds


def _near_stiefel(shape, r, t, seed):
    """Y = X − tW, X ∈ Stiefel(r) (r·QR of a Gaussian), ‖W‖₂ = 0.99: float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(max(shape), min(shape), generator=g, dtype=torch.float64))[0]
    x = r * (q if shape[0] >= shape[1] else q.T)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x - t * 0.99 * w / torch.linalg.matrix_norm(w, ord=2)


@pytest.mark.parametrize("shape,t", [((48, 24), 0.04), ((24, 48), 0.04), ((256, 128), 0.6), ((48, 24), 2.0)])
def test_the_svd_free_stiefel_bounds_hold_the_singular_values(shape, t, monkeypatch):
    """The interval [floor, top] the Stiefel step hands its polar iteration holds σ(Y)/c (σ by the
    float64 SVD), below √3; near Stiefel (t = 0.02r) it is the feasible case's,
    σ/c ∈ [r − 1.2t, r + 1.2t]/(r + t), whose scaled schedule is 4 steps in float32 (the
    docstring's count)."""
    mod = importlib.import_module("geomopt.geometry.prox.polar")
    seen = []
    by_cost = mod._polar_by_cost
    monkeypatch.setattr(mod, "_polar_by_cost", lambda mats, gram, c, floor, top: seen.append((c, floor, top))
                        or by_cost(mats, gram, c, floor, top))
    r = 2.0  # the geometry's radius is 1: the step's t = γρ is γ
    y = torch.stack([_near_stiefel(shape, r, t, s) for s in range(2)])
    geometry = {"kind": "spectral", "reference": {"kind": "log_barrier", "eps": 1e-3}}
    backward(y, t, geometry, {"kind": "stiefel", "radius": r, "method": "polar"}, batch_dims=1)
    (c, floor, top), = seen
    ratio = torch.linalg.svdvals(y) / c.reshape(-1, 1)
    assert (ratio.amin(-1) >= floor * (1 - 1e-12)).all() and (ratio.amax(-1) <= top * (1 + 1e-12)).all()
    assert top < 3**0.5
    if (shape, t) == ((48, 24), 0.04):
        assert (floor, top) == pytest.approx(((r - 1.2 * t) / (r + t), (r + 1.2 * t) / (r + t)), rel=1e-12)
        assert len(scaled_polar_schedule(floor / top, torch.float32)) == 4


@pytest.mark.parametrize("floor,top", [(1e-3, 1.0), (0.25, 2.0), (0.9, 1.1)])
def test_the_coupled_inverse_square_root_matches_eigh(floor, top):
    """H^{−1/2} of symmetric H with spectrum spread over [floor, top], against Q·diag(λ^{−1/2})·Qᵀ
    of float64 eigenvectors: the host-counted steps reach float64 precision."""
    g = torch.Generator().manual_seed(4)
    q = torch.linalg.qr(torch.randn(2, 6, 6, generator=g, dtype=torch.float64))[0]
    lam = torch.logspace(math.log10(floor), math.log10(top), 6, dtype=torch.float64)
    h = q @ torch.diag_embed(lam.expand(2, 6)) @ q.mT
    want = q @ torch.diag_embed(lam.rsqrt().expand(2, 6)) @ q.mT
    torch.testing.assert_close(_inverse_sqrt(h, floor, top), want, rtol=0, atol=1e-11 / floor**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("floor,top", [(1e-3, 1.0), (0.25, 2.0), (0.9, 1.1), (1e-8, 1.0)])
def test_the_inverse_square_root_takes_the_steps_its_error_recurrence_needs(dtype, floor, top):
    """A spectral value μ's error e = 1 − μz² moves as e ← ¾e² + ¼e³ (the docstring's recurrence,
    from e₀ = 1 − μ): the host's step count is the steps that bring the worst end within ε, plus one."""
    eps = torch.finfo(dtype).eps

    def steps(mu: float) -> int:
        e, n = 1 - mu, 0
        while abs(e) > eps:
            e, n = 0.75 * e * e + 0.25 * e**3, n + 1
        return n

    need = max(steps(floor), steps(top), 1)
    assert need <= _inverse_sqrt_steps(floor, dtype, top) - 1 <= need + 1


# ---------------------------------------------------------------- post-stages on a bucket


@pytest.mark.parametrize("target", ["unit", 0.5])
def test_rms_match_sets_each_tensors_norm_in_a_shared_bucket(target):
    """Two tensors of one shape share a bucket (one stacked update): rms_match sets each one's
    step norm on its own — 1, or target·√(mn) — not the bucket's."""
    import geomopt

    gen = torch.Generator().manual_seed(5)
    params = {n: torch.nn.Parameter(torch.randn(4, 9, generator=gen, dtype=torch.float64)) for n in "ab"}
    before = {n: p.detach().clone() for n, p in params.items()}
    rule = {"name": "all", "match": "**", "lr": 0.1, "geometry": {"kind": "euclidean"},
            "post": [{"kind": "rms_match", "target": target, "eps": 1e-30}]}
    opt = geomopt.GeomOptimizer(list(params.items()), {"geomopt": 1, "name": "t", "rules": [rule]})
    for n, p in params.items():
        p.grad = torch.randn(4, 9, generator=gen, dtype=torch.float64) * (1.0 if n == "a" else 7.0)
    opt.step()
    want = 1.0 if target == "unit" else target * 6.0
    for n, p in params.items():
        assert float(((before[n] - p.detach()) / 0.1).norm()) == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_z_minus_log1p_against_fifty_digits(dtype):
    """g(z) = z − ln(1 + z) (the log barrier's h) on both sides of its series' |z| < 0.1, against
    Decimal arithmetic at 50 digits: a few ulps."""
    from decimal import Decimal, getcontext

    getcontext().prec = 50
    zs = [-0.99, -0.5, -0.0999, -0.05, -1e-3, -1e-6, 1e-6, 1e-3, 0.05, 0.0999, 0.5, 5.0]
    got = _z_minus_log1p(torch.tensor(zs, dtype=dtype)).double()
    want = torch.tensor([float(Decimal(z) - (1 + Decimal(z)).ln()) for z in zs], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=8 * torch.finfo(dtype).eps, atol=0)


def test_the_linf_sphere_projects_each_row_of_a_batch_on_its_own():
    """A (B, n) batch: a row reaching ‖v‖∞ ≥ r is clipped, one inside has its first largest entry
    moved to ±r (the nearest point of the sphere), each by its own norm."""
    v = torch.tensor([[0.5, -3.0, 1.0], [0.2, -0.7, 0.7]], dtype=torch.float64)
    got = VECTOR_PROJ["linf_sphere"](v, typed.constraint({"kind": "linf_sphere", "radius": 2.0}))
    want = torch.tensor([[0.5, -2.0, 1.0], [0.2, -2.0, 0.7]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_box_tau_solves_each_row_on_its_own():
    """τ with Σ max(α/(1+τ), α − 1)₊² = ρ² (the indicator's ball step), row by row of a batch:
    the defining equation in float64, and the same τ as each row alone."""
    # every row feasible and outside: Σ(α − 1)₊² < ρ² < Σα²
    alpha = torch.tensor([[3.0, 2.5, 0.4, 0.1], [2.2, 1.9, 1.8, 1.3], [3.5, 1.5, 1.1, 1.0]], dtype=torch.float64)
    rho2 = 9.0
    tau = _box_tau(alpha, rho2)
    total = torch.maximum(alpha / (1 + tau), alpha - 1).clamp(min=0).square().sum(-1)
    torch.testing.assert_close(total, torch.full_like(total, rho2), rtol=1e-12, atol=0)
    alone = torch.cat([_box_tau(alpha[i:i + 1], rho2) for i in range(len(alpha))])
    torch.testing.assert_close(tau, alone, rtol=0, atol=0)


# ---------------------------------------------------------------- views: counts, costs, descriptions

VIEW_CASES = [  # (view, shape, the matrices it holds, as (count, m, n) runs in block order)
    (None, (64, 192), [(1, 64, 192)]),
    (View(batch=1, blocks=None, trailing="cols"), (4, 256, 64), [(4, 256, 64)]),
    (View(batch=0, blocks=(64, 16, 16), trailing="cols"), (96, 64), [(1, 64, 64), (2, 16, 64)]),
    (View(batch=0, blocks=None, trailing="batch"), (8, 3, 2, 2), [(4, 8, 3)]),
]


@pytest.mark.parametrize("view,shape,runs", VIEW_CASES)
def test_a_views_count_cost_and_description_by_hand(view, shape, runs):
    """count = the matrices, cost = Σ m·n·min(m, n) over them (None without a view), describe =
    "k × m×n" runs joined by " + " (the docstring's examples), each from the matrices listed."""
    assert count(view, shape) == (1 if view is None else sum(k for k, _, _ in runs))
    want_cost = float(sum(k * m * n * min(m, n) for k, m, n in runs))
    assert view_cost(view, shape) == (None if view is None else want_cost)
    assert describe(view, shape) == " + ".join(f"{k} × {m}×{n}" if k > 1 else f"{m}×{n}" for k, m, n in runs)


def test_polar_of_a_stack_scales_each_matrix_by_its_own_norm():
    """A (3, 4, 2) stack of matrices of very different norms: each polar factor is its own U·Vᵀ (the
    SVD's, float64), so each matrix is divided by its own Frobenius norm before the iteration."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(3, 4, 2, dtype=torch.float64, generator=gen) * torch.tensor([1e-3, 1.0, 50.0],
                                                                                dtype=torch.float64)[:, None, None]
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    torch.testing.assert_close(polar(m, floor=1e-2), u @ vh, rtol=1e-10, atol=1e-10)


def test_the_groups_of_a_batch_of_scalars_are_one_by_one():
    """A batch of 0-d elements under a rowwise geometry: one group of one entry each."""
    x = torch.tensor([1.5, -2.0, 0.5])
    for kind in ("rowwise", "columnwise"):
        got = groups(x, 1, typed.geometry({"kind": kind, "reference": {"kind": "quadratic"}}))
        assert got.shape == (3, 1, 1) and torch.equal(got.reshape(3), x)


@pytest.mark.parametrize("step", ["ball", "sphere"])
@pytest.mark.parametrize("kind", ["log_barrier", "power_barrier"])
def test_the_ball_and_sphere_magnitudes_solve_their_optimality_conditions(step, kind):
    """The ℓ2-ball and sphere steps on magnitudes a (rows inside, outside and, for the sphere, inside
    the sphere), checked on their definition: a row inside the ball is kept; otherwise Σs² = r² and
    σ = s/t, α = a/t meet σ ± (h₁*)'(τσ) = α for one τ per row (+ inward, − outward), i.e.
    τ = h₁'(±(α − σ))/σ is the same for every entry (h₁' = ((h₁*)')⁻¹, the reference's own h')."""
    ref = make_reference(typed.reference({"kind": kind, "eps": 0.05} if kind == "log_barrier" else
                         {"kind": kind, "kappa": 4.0, "eps": 0.05}))
    a = torch.tensor([[0.3, 0.2, 0.1, 0.05], [1.2, 0.8, 0.5, 0.3], [1.6, 1.2, 0.4, 0.9]], dtype=torch.float64)
    t, r = 1.0, 1.0
    fn = ball_magnitudes if step == "ball" else sphere_magnitudes
    s, bad = fn(a, t, r, ref, torch.float64)
    assert bad is not None and not bad.any()
    for i in range(3):
        inside = float(a[i].norm()) <= r
        if inside and step == "ball":
            assert torch.equal(s[i], a[i])
            continue
        assert float(s[i].norm()) == pytest.approx(r, rel=1e-13)
        sigma, alpha = s[i] / t, a[i] / t
        sign = -1.0 if inside else 1.0  # the sphere pushes a row inside it outward
        tau = ref.dh(sign * (alpha - sigma)) / sigma
        assert bool((tau > 0).all())
        torch.testing.assert_close(tau, tau[0].expand_as(tau), rtol=1e-8, atol=0)


@pytest.mark.parametrize("excess,flagged", [(3.0, False), (400.0, True)])
def test_the_exact_spectral_steps_flag_past_rounding_at_the_largest_scale(excess, flagged):
    """The spectral ball's feasibility flag: max_i |x_i − σ_i| > t beyond rounding, the rounding being
    u·(σ_max + t) (Y = X − tW's error at Y's largest scale): σ₁ = r + t + excess·u·σ₁ with σ₁ ≈ 1000
    and the others small is within it at 3u·σ₁ (not flagged) and past it at 400u·σ₁ (flagged)."""
    u = torch.finfo(torch.float64).eps
    r, t = 1000.0, 1e-3
    sigma = torch.tensor([r + t + excess * u * r, 1.0, 0.5, 1e-3], dtype=torch.float64)
    q1, _ = torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    q2, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    y = (q1 * sigma) @ q2.T
    geo = {"kind": "spectral", "radius": 1.0, "reference": {"kind": "log_barrier", "eps": 1e-3}}
    _, bad = backward(y, t, geo, {"kind": "spectral_ball", "radius": r})
    assert bool(bad) == flagged


def test_psgd_steps_along_the_debiased_momentum_before_its_first_fit():
    """PSGD-Kron with its factors at the identity (before step ``every``): the update is the debiased
    momentum ĥ = m/(1 − μᵗ), m ← μm + (1 − μ)G (RMS below the 1.1 cap), written out here for two
    steps: G₁ then (μ(1 − μ)G₁ + (1 − μ)G₂)/(1 − μ²), times ρ."""
    from geomopt.geometry.learned import kronecker

    mu, rho = 0.9, 0.5
    geo = {"kind": "kronecker", "method": "psgd", "max_dim": 64, "momentum": mu, "every": 10, "precond_lr": 0.1}
    g = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.1
    state: dict = {}
    first = kronecker(g[0], typed.geometry(geo), radius=rho, state=state)
    second = kronecker(g[1], typed.geometry(geo), radius=rho, state=state)
    torch.testing.assert_close(first, rho * g[0], rtol=1e-12, atol=0)
    want = (mu * (1 - mu) * g[0] + (1 - mu) * g[1]) / (1 - mu**2)
    torch.testing.assert_close(second, rho * want, rtol=1e-12, atol=1e-15)


def test_the_newton_inverse_root_of_order_one_is_the_inverse():
    """p = 1, the smallest order the iteration takes: (A + εI)^(−1) against numpy's float64 inverse."""
    import numpy as np

    from geomopt.geometry.kron_root import inverse_root_newton

    b = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    a = b @ b.T + 0.5 * torch.eye(5, dtype=torch.float64)
    want = np.linalg.inv(a.numpy() + 1e-3 * np.eye(5))
    got = inverse_root_newton(a, 1, 1e-3)
    assert np.abs(got.numpy() - want).max() <= 1e-10 * np.abs(want).max()


def test_shampoos_roots_stay_the_identity_until_step_every():
    """Shampoo's roots start at the identity and are first computed at step ``every`` (both references'
    schedule): with every = 3 and no graft, steps 1 and 2 return G itself, step 3 a preconditioned G."""
    from geomopt.geometry.learned import kronecker

    geo = {"kind": "kronecker", "method": "shampoo", "max_dim": 64,
           "beta": 0.9, "every": 3, "exponent": None, "damping": 1e-12,
           "root": "eigh", "graft": "none", "eps": 1e-8, "betas": [0.9, 0.999]}
    g = torch.randn(3, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    state: dict = {}
    out = [kronecker(g[k], typed.geometry(geo), radius=1.0, state=state) for k in range(3)]
    assert torch.equal(out[0], g[0]) and torch.equal(out[1], g[1])
    assert (out[2] - g[2]).abs().max() > 1e-3


def test_an_auto_view_without_structure_is_the_plain_matrix():
    """``view: auto`` on a tensor the model says nothing of (no batch, no blocks): the plain matrix
    (None), a 3-D tensor included (rows × the rest, not a batch of matrices)."""
    from geomopt.compile.fragments import View
    from geomopt.geometry.view import resolve
    from geomopt.spec.geometries import AutoView

    for shape in ((4, 3), (4, 3, 2), (2, 4, 3, 2)):
        assert resolve(AutoView(), shape, {}) is None, shape
        assert resolve(AutoView(), shape, None) is None, shape
    assert resolve(AutoView(), (4, 3, 2), {"batch": 1}) == View(batch=1, trailing="cols", blocks=None)


@pytest.mark.parametrize("size", [1e-160, 1e-3, 1e150])
def test_gram_eigh_at_the_ends_of_float64_is_the_svds_map(size):
    """∇φ*(D) by the Gram matrix's eigh for D of entries near 1e-160 (the Gram matrix's products would
    underflow unscaled), 1e-3 and 1e150 (they would overflow): the SVD's map to 1e-9."""
    from geomopt.geometry.spectral import gram_eigh, svd

    d = torch.randn(2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8)) * size
    ref = make_reference(typed.reference({"kind": "log_barrier", "eps": 1e-3 * size}))
    want = svd(d, ref)
    torch.testing.assert_close(gram_eigh(d, ref), want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
    torch.testing.assert_close(gram_eigh(d.mT, ref), want.mT, rtol=1e-9, atol=1e-9 * float(want.abs().max()))


def test_soaps_factors_are_moving_averages_of_the_gradients_products():
    """SOAP's factors after three steps: L = Σ_k (1 − β)·β^(3−k)·G_k·G_kᵀ and R the same of G_kᵀ·G_k
    (the first step starts them from zero), written out in float64."""
    from geomopt.geometry.learned import kronecker

    beta = 0.8
    geo = {"kind": "kronecker", "method": "soap", "max_dim": 64, "beta": beta,
           "every": 10, "betas": [0.9, 0.99], "eps": 1e-8}
    g = torch.randn(3, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    state: dict = {}
    for k in range(3):
        kronecker(g[k], typed.geometry(geo), radius=1.0, state=state)
    left = sum((1 - beta) * beta ** (2 - k) * g[k] @ g[k].T for k in range(3))
    right = sum((1 - beta) * beta ** (2 - k) * g[k].T @ g[k] for k in range(3))
    torch.testing.assert_close(state["soap_left"].reshape(5, 5), left, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state["soap_right"].reshape(3, 3), right, rtol=1e-12, atol=1e-14)


def test_psgd_preconditions_with_diagonal_factors_on_a_square_matrix():
    """PSGD-Kron's P·G = Q_LᵀQ_L·G·Q_RᵀQ_R with both sides diagonal (longer than max_dim): Diag(l²)·G·Diag(r²),
    rows scaled by the left factor and columns by the right one, on a square G where a swap would still
    broadcast; and with triangular factors the same product of the matrices."""
    from geomopt.geometry.kron_psgd import precondition

    gen = torch.Generator().manual_seed(9)
    g = torch.randn(2, 4, 4, dtype=torch.float64, generator=gen)
    ql, qr = torch.rand(2, 4, dtype=torch.float64, generator=gen) + 0.5, torch.rand(2, 4, dtype=torch.float64,
                                                                                    generator=gen) + 0.5
    want = ql.square()[:, :, None] * g * qr.square()[:, None, :]
    torch.testing.assert_close(precondition(g, ql, qr), want, rtol=1e-12, atol=1e-14)
    tl = torch.triu(torch.rand(2, 4, 4, dtype=torch.float64, generator=gen)) + torch.eye(4, dtype=torch.float64)
    tr = torch.triu(torch.rand(2, 4, 4, dtype=torch.float64, generator=gen)) + torch.eye(4, dtype=torch.float64)
    torch.testing.assert_close(precondition(g, tl, tr), tl.mT @ tl @ g @ tr.mT @ tr, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (2, 3, 5)])
def test_shampoos_spectral_graft_has_the_norm_of_a_polar_factor(shape):
    """Shampoo's ``graft: spectral`` step has the Frobenius norm of U·Vᵀ of a full-rank m × n matrix,
    √min(m, n), per matrix, wide or tall."""
    from geomopt.geometry.learned import kronecker

    geo = {"kind": "kronecker", "method": "shampoo", "max_dim": 64,
           "beta": 0.9, "every": 1, "exponent": None, "damping": 1e-12,
           "root": "eigh", "graft": "spectral", "eps": 1e-8, "betas": [0.9, 0.999]}
    g = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = kronecker(g, typed.geometry(geo), radius=1.0, state={}, batch_dims=len(shape) - 2)
    norms = torch.linalg.matrix_norm(out.reshape(-1, *shape[-2:]))
    torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(min(shape[-2:]))), rtol=1e-12, atol=0)


def test_psgds_probe_is_the_steps_own_gaussian_draw():
    """The probe of step k is N(0, I) from a generator seeded with PROBE_SEED + k (the same on every
    rank and after a resume), drawn here from its own generator, shared by a stack's matrices."""
    from geomopt.geometry import kron_psgd

    g = torch.zeros(3, 4, 5, dtype=torch.float64)
    for step in (1, 2, 7):
        want = torch.randn(4, 5, generator=torch.Generator().manual_seed(kron_psgd.PROBE_SEED + step),
                           dtype=torch.float64)
        got = kron_psgd.probe(g, step)
        assert all(torch.equal(got[i], want) for i in range(3)), step


def test_shampoos_adam_graft_takes_the_second_beta_over_steps():
    """Shampoo grafted to Adam, betas (0.9, 0.5): each step moves each matrix by lr·‖E_t‖_F,
    E_t = G_t/(√(v_t/(1 − β₂ᵗ)) + ε), v_t = β₂·v + (1 − β₂)·G_t², written out in float64 (the first
    step's E is G/(|G| + ε) whatever β₂: only later steps tell β₂ from β₁)."""
    import geomopt

    gen = torch.Generator().manual_seed(11)
    grads = torch.randn(4, 2, 5, 3, generator=gen, dtype=torch.float64)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.float64)) for _ in range(2)])
    geometry = {"kind": "kronecker", "method": "shampoo", "every": 1, "damping": 1e-3, "graft": "adam",
                "betas": [0.9, 0.5], "eps": 1e-3}
    spec = {"geomopt": 1, "name": "k", "rules": [{"name": "all", "match": "**", "geometry": geometry}]}
    lr = 0.05
    opt = geomopt.GeomOptimizer(model, spec, lr=lr)
    v = torch.zeros_like(grads[0])
    for t, g in enumerate(grads, start=1):
        before = torch.stack([p.detach().clone() for p in model])
        for p, gi in zip(model, g):
            p.grad = gi.clone()
        opt.step()
        moved = torch.linalg.matrix_norm(torch.stack([p.detach() for p in model]) - before)
        v = 0.5 * v + 0.5 * g * g
        e = g / (torch.sqrt(v / (1 - 0.5 ** t)) + 1e-3)
        torch.testing.assert_close(moved, lr * torch.linalg.matrix_norm(e), rtol=1e-10, atol=0)
