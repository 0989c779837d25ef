"""Backward (proximal) steps against independent computations.

One table of (geometry, reference, constraint, shape, brute-force solver) rows: each backward op's
X⁺ must lie in C and reach an objective g(X⁺) + (γ⋆φ)(X⁺ − Y) no worse than a brute-force
minimization (scipy SLSQP over the entries, Powell over an SVD parametrization for spectral sets,
or enumeration of the combinatorial sets), with the barrier written directly from h in float64.
For the indicator reference the objective is ½‖Z − Y‖² on C ∩ (Y + t·dom φ₁), the selection
the ops document. Then property tests (hypothesis). The polar, Gram–eigh and scalar solves' own
accuracy tests are in tests/test_prox_polar.py, test_prox_spectral_map.py and test_prox_scalar.py.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.optimize as so
import scipy.special as sp
import torch
from hypothesis import given, settings, strategies as st

from typed_fragments import backward
from geomopt.geometry.operators import BACKWARD_OPS

LOG = {"kind": "log_barrier", "eps": 1e-3}
POW4 = {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3}
POW2 = {"kind": "power_barrier", "kappa": 2.0, "eps": 0.5}
IND = {"kind": "indicator"}
QUAD = {"kind": "quadratic"}


# ---------------------------------------------------------------- the objective, from h directly


def h_np(ref: dict, u: np.ndarray) -> np.ndarray:
    """h(u) in float64, +∞ off the domain (barriers)."""
    a = np.abs(u)
    if ref["kind"] == "quadratic":
        return 0.5 * a * a
    with np.errstate(invalid="ignore", divide="ignore"):
        if ref["kind"] == "log_barrier":
            val = -ref["eps"] * (np.log1p(-np.minimum(a, 1)) + a)
        else:  # power barrier: ε(x²/2)·₂F₁(2/κ, 1/κ; 1 + 2/κ; |x|^κ) (geomopt.geometry.reference)
            k = ref["kappa"]
            val = ref["eps"] * a * a / 2 * sp.hyp2f1(2 / k, 1 / k, 1 + 2 / k, np.minimum(a, 1) ** k)
    return np.where(a < 1, val, np.inf)


def geometry_norms(gkind: str, d: np.ndarray) -> np.ndarray:
    """The quantities φ₁ applies h to: entries, ‖·‖_F, σ, or row/column norms."""
    if gkind == "anisotropic":
        return d.ravel()
    if gkind in ("isotropic", "euclidean"):
        return np.array([np.linalg.norm(d)])
    if gkind == "spectral":
        return np.linalg.svd(d.reshape(d.shape[0], -1), compute_uv=False)
    if gkind == "rowwise":
        return np.linalg.norm(d.reshape(d.shape[0], -1), axis=1)
    if gkind == "columnwise":
        return np.linalg.norm(d.reshape(d.shape[0], -1), axis=0)
    raise KeyError(gkind)


def prox_objective(z, y, t, gkind, ref):
    """(t⋆φ₁)(Z − Y) (g = δ_C is enforced by the solver); indicator: ½‖Z − Y‖² on the closed
    domain t·dom φ₁ (the documented selection)."""
    d = z - y
    if gkind == "euclidean":
        return 0.5 * float(np.sum(d * d)) / t
    v = geometry_norms(gkind, d) / t
    if ref["kind"] == "indicator":
        return 0.5 * float(np.sum(d * d)) if np.max(np.abs(v)) <= 1 + 1e-9 else np.inf
    return t * float(np.sum(h_np(ref, v)))


# ---------------------------------------------------------------- set membership and points in C


def in_set(x: np.ndarray, c: dict, tol: float = 1e-8) -> bool:
    k = c["kind"]
    r = c.get("radius", 1.0)
    s = np.linalg.svd(x.reshape(x.shape[0], -1), compute_uv=False) if x.ndim >= 2 else None
    if k in ("l2_ball", "frobenius_ball"):
        return np.linalg.norm(x) <= r * (1 + tol)
    if k == "frobenius_sphere":
        return abs(np.linalg.norm(x) - r) <= tol * r
    if k == "linf_ball":
        return np.abs(x).max() <= r * (1 + tol)
    if k == "linf_sphere":
        return abs(np.abs(x).max() - r) <= tol * r
    if k == "sign_set":
        return np.allclose(np.abs(x), r, rtol=tol, atol=0)
    if k == "l0":
        return np.count_nonzero(x) <= c["k"]
    if k == "spectral_ball":
        return s[0] <= r * (1 + tol)
    if k == "spectral_sphere":
        return abs(s[0] - r) <= tol * r
    if k == "stiefel":
        return np.allclose(s, r, rtol=tol * 10, atol=0)
    if k == "rank":
        return np.all(s[c["k"]:] <= tol * max(1.0, s[0]))
    raise KeyError(k)


def random_orthogonal(rng, n):
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def point_in(c: dict, shape, rng) -> np.ndarray:
    """A point of C, mostly on its boundary so that the steps are active."""
    k, r = c["kind"], c.get("radius", 1.0)
    v = rng.standard_normal(shape)
    if k in ("l2_ball", "frobenius_ball", "frobenius_sphere"):
        return r * v / np.linalg.norm(v)
    if k in ("linf_ball", "linf_sphere"):
        x = rng.uniform(-r, r, shape)
        x.flat[rng.integers(x.size)] = r
        return x
    if k == "sign_set":
        return r * np.where(v < 0, -1.0, 1.0)
    if k == "l0":
        x = v.copy()
        x.flat[rng.permutation(x.size)[c["k"]:]] = 0
        return x
    m, n = shape[0], int(np.prod(shape[1:]))
    q = min(m, n)
    u, w = random_orthogonal(rng, m)[:, :q], random_orthogonal(rng, n)[:, :q]
    s = {"stiefel": lambda: np.full(q, r), "spectral_ball": lambda: np.r_[r, rng.uniform(0, r, q - 1)],
         "spectral_sphere": lambda: np.r_[r, rng.uniform(0, r, q - 1)],
         "rank": lambda: np.r_[rng.uniform(0.5, 2, c["k"]), np.zeros(q - c["k"])]}[k]()
    return ((u * s) @ w.T).reshape(shape)


def direction(gkind: str, shape, rng, size: float = 0.9) -> np.ndarray:
    """W with ‖W‖ < 1 in the norm whose unit ball is dom φ₁, so Y = X − tW meets the domain."""
    v = rng.standard_normal(shape)
    if gkind == "anisotropic":
        return rng.uniform(-size, size, shape)
    if gkind in ("isotropic", "euclidean"):
        return size * v / np.linalg.norm(v)
    if gkind == "spectral":
        m = v.reshape(shape[0], -1)
        u, s, vt = np.linalg.svd(m, full_matrices=False)
        return ((u * rng.uniform(0, size, s.shape)) @ vt).reshape(shape)
    m = v.reshape(shape[0], -1)
    axis = 1 if gkind == "rowwise" else 0
    return (size * m / np.linalg.norm(m, axis=axis, keepdims=True) * rng.uniform(0.2, 1, (1,))).reshape(shape)


# ---------------------------------------------------------------- brute-force solvers


def domain_constraints(gkind, y, t, ref):
    """SLSQP constraints keeping Z − Y strictly inside t·dom φ₁ (closed for the indicator)."""
    if ref["kind"] == "quadratic" or gkind == "euclidean":
        return None, []
    margin = 1.0 if ref["kind"] == "indicator" else 1 - 1e-9
    if gkind == "anisotropic":
        return so.Bounds((y - margin * t).ravel(), (y + margin * t).ravel()), []
    if gkind == "isotropic":
        return None, [{"type": "ineq", "fun": lambda z: (margin * t) ** 2 - np.sum((z - y.ravel()) ** 2)}]
    axis = 1 if gkind == "rowwise" else 0
    return None, [{"type": "ineq",
                   "fun": lambda z: (margin * t) ** 2 - np.sum((z.reshape(y.shape) - y) ** 2, axis=axis).ravel()}]


def set_constraints(c, shape):
    k, r = c["kind"], c.get("radius", 1.0)
    if k in ("l2_ball", "frobenius_ball"):
        return [{"type": "ineq", "fun": lambda z: r * r - z @ z}], None
    if k == "frobenius_sphere":
        return [{"type": "eq", "fun": lambda z: z @ z - r * r}], None
    if k == "linf_ball":
        return [], (-r, r)
    raise KeyError(k)


def brute_slsqp(y, t, gkind, ref, c, rng, starts=6):
    """min over Z ∈ C of the objective by SLSQP from random starts (convex sets and spheres)."""
    bounds, dom = domain_constraints(gkind, y, t, ref)
    cons, box = set_constraints(c, y.shape)
    lo, hi = np.full(y.size, -np.inf), np.full(y.size, np.inf)
    if bounds is not None:
        lo, hi = np.maximum(lo, bounds.lb), np.minimum(hi, bounds.ub)
    if box is not None:
        lo, hi = np.maximum(lo, box[0]), np.minimum(hi, box[1])

    def f(z):
        val = prox_objective(z.reshape(y.shape), y, t, gkind, ref)
        return val if np.isfinite(val) else 1e12

    best = np.inf
    for _ in range(starts):
        z0 = y.ravel() + t * 0.5 * rng.uniform(-1, 1, y.size) / math.sqrt(y.size)
        z0 = np.clip(z0, np.where(np.isfinite(lo), lo, -1e9), np.where(np.isfinite(hi), hi, 1e9))
        res = so.minimize(f, z0, method="SLSQP", bounds=so.Bounds(lo, hi), constraints=cons + dom,
                          options={"ftol": 1e-14, "maxiter": 500})
        z = res.x.reshape(y.shape)
        ok = in_set(z, c, tol=1e-7) and all(np.all(d["fun"](res.x) >= -1e-9) for d in dom)
        if ok:
            best = min(best, prox_objective(z, y, t, gkind, ref))
    return best


def brute_enumerate(y, t, gkind, ref, c, rng):
    """Combinatorial sets: sign patterns, supports, which coordinate sits at ±r (others clipped)."""
    k, r, n = c["kind"], c.get("radius", 1.0), y.size
    cands = []
    if k == "sign_set":
        cands = [r * np.array(s).reshape(y.shape) for s in itertools.product((-1.0, 1.0), repeat=n)]
    elif k == "l0":
        for supp in itertools.combinations(range(n), c["k"]):
            z = np.zeros(n)
            z[list(supp)] = y.ravel()[list(supp)]
            cands.append(z.reshape(y.shape))
    elif k == "linf_sphere":
        for j, s in itertools.product(range(n), (-r, r)):
            z = np.clip(y.ravel(), -r, r)
            z[j] = s
            cands.append(z.reshape(y.shape))
    return min(prox_objective(z, y, t, gkind, ref) for z in cands)


def _rotation3(a):
    """Rodrigues: expm of the skew matrix with axis-angle vector a."""
    th = float(np.linalg.norm(a))
    k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    if th < 1e-12:
        return np.eye(3) + k
    return np.eye(3) + math.sin(th) / th * k + (1 - math.cos(th)) / th**2 * (k @ k)


def brute_spectral(y, t, gkind, ref, c, rng, starts=6):
    """Powell + Nelder–Mead over Z = U₀R·Diag(s)·(V₀P)ᵀ: R ∈ SO(3), P ∈ SO(2) rotations relative to
    Y's frame (U₀, V₀) and s parametrized inside C, so every matrix of a 3×2 orthogonally invariant
    set is reachable; starts are random rotations (up to ~1 rad, the domain ‖Z − Y‖₂ < t is a
    neighbourhood of Y) and random s."""
    m, n = y.shape
    k, r = c["kind"], c.get("radius", 1.0)
    u0, _, v0t = np.linalg.svd(y)
    u0, v0 = u0 * np.linalg.det(u0), v0t.T * np.linalg.det(v0t)  # proper rotations

    def build(p):
        u = (u0 @ _rotation3(p[:3]))[:, :n]
        v = v0 @ np.array([[math.cos(p[3]), -math.sin(p[3])], [math.sin(p[3]), math.cos(p[3])]])
        q = p[4:]
        s = {
            "stiefel": lambda: np.array([r, r * math.copysign(1, q[0])]),
            "spectral_ball": lambda: r * np.tanh(q),
            "spectral_sphere": lambda: np.array([r, r * math.tanh(q[1])]),
            "rank": lambda: np.array([q[0], 0.0]),
            "frobenius_ball": lambda: r * math.tanh(q[0]) * np.array([math.cos(q[1]), math.sin(q[1])]),
            "frobenius_sphere": lambda: r * np.array([math.cos(q[1]), math.sin(q[1])]),
        }[k]()
        return (u * s) @ v.T

    def f(p):
        z = build(p)
        val = prox_objective(z, y, t, gkind, ref)
        # Off the domain: a finite penalty that slopes towards it, so the search can enter.
        return val if np.isfinite(val) else 1e3 * (1 + geometry_norms(gkind, z - y).max() / t)

    best = np.inf
    for _ in range(starts):
        p0 = np.r_[rng.uniform(-0.6, 0.6, 4), rng.uniform(-2, 2, 2)]
        res = so.minimize(f, p0, method="Powell", options={"xtol": 1e-8, "ftol": 1e-12, "maxfev": 1500})
        if np.isfinite(prox_objective(build(res.x), y, t, gkind, ref)):  # polish inside the domain
            res = so.minimize(f, res.x, method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-16, "maxfev": 1500})
        best = min(best, prox_objective(build(res.x), y, t, gkind, ref))
    return best


def brute_grid(y, t, gkind, ref, c, rng):
    """2-entry vectors: a fine grid of C (circle, disk, square)."""
    k, r = c["kind"], c.get("radius", 1.0)
    th = np.linspace(0, 2 * np.pi, 200001)
    if k == "frobenius_sphere":
        pts = r * np.stack([np.cos(th), np.sin(th)], 1)
    elif k in ("l2_ball", "frobenius_ball"):
        rad = np.linspace(0, r, 801)
        pts = (rad[:, None, None] * np.stack([np.cos(th[::200]), np.sin(th[::200])], 1)[None]).reshape(-1, 2)
    else:  # linf_ball
        g = np.linspace(-r, r, 1201)
        pts = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    d = (pts - y.ravel()) / t
    if gkind == "anisotropic":
        if ref["kind"] == "indicator":
            vals = np.where(np.abs(d).max(1) <= 1, 0.5 * t * t * (d * d).sum(1), np.inf)
        else:
            vals = t * h_np(ref, d).sum(1)
    else:
        nd = np.linalg.norm(d, axis=1)
        vals = 0.5 * t * nd * nd if gkind == "euclidean" else t * h_np(ref, nd) if ref["kind"] != "indicator" \
            else np.where(nd <= 1, 0.5 * t * t * nd * nd, np.inf)
    return float(vals.min())


# ---------------------------------------------------------------- the table

BALL, SPH = {"kind": "l2_ball", "radius": 1.0}, {"kind": "frobenius_sphere", "radius": 1.0}
FBALL = {"kind": "frobenius_ball", "radius": 1.0}
CASES = [
    # (geometry kind, reference, constraint, shape, solver)
    ("anisotropic", LOG, BALL, (2,), brute_grid),
    ("anisotropic", LOG, BALL, (5,), brute_slsqp),
    ("anisotropic", POW4, BALL, (4,), brute_slsqp),
    ("anisotropic", POW2, FBALL, (2, 2), brute_slsqp),
    ("anisotropic", IND, BALL, (4,), brute_slsqp),
    ("anisotropic", QUAD, BALL, (4,), brute_slsqp),
    ("anisotropic", LOG, SPH, (2,), brute_grid),
    ("anisotropic", LOG, SPH, (4,), brute_slsqp),
    ("anisotropic", POW4, SPH, (4,), brute_slsqp),
    ("anisotropic", IND, SPH, (4,), brute_slsqp),
    ("anisotropic", LOG, {"kind": "linf_ball", "radius": 0.8}, (2,), brute_grid),
    ("anisotropic", LOG, {"kind": "linf_sphere", "radius": 0.8}, (4,), brute_enumerate),
    ("anisotropic", POW4, {"kind": "sign_set", "radius": 0.5}, (4,), brute_enumerate),
    ("anisotropic", LOG, {"kind": "l0", "k": 2}, (5,), brute_enumerate),
    ("isotropic", LOG, SPH, (2,), brute_grid),
    ("isotropic", POW4, BALL, (4,), brute_slsqp),
    ("isotropic", LOG, {"kind": "linf_ball", "radius": 0.8}, (4,), brute_slsqp),
    ("isotropic", LOG, {"kind": "l0", "k": 2}, (5,), brute_enumerate),
    ("isotropic", LOG, {"kind": "sign_set", "radius": 0.5}, (4,), brute_enumerate),
    ("isotropic", LOG, {"kind": "stiefel", "radius": 1.0}, (3, 2), brute_spectral),
    ("euclidean", QUAD, SPH, (4,), brute_slsqp),
    ("euclidean", QUAD, {"kind": "linf_sphere", "radius": 0.8}, (4,), brute_enumerate),
    ("euclidean", QUAD, {"kind": "spectral_ball", "radius": 0.7}, (3, 2), brute_spectral),
    ("euclidean", QUAD, {"kind": "rank", "k": 1}, (3, 2), brute_spectral),
    ("spectral", LOG, {"kind": "stiefel", "radius": 1.0}, (3, 2), brute_spectral),
    ("spectral", LOG, {"kind": "spectral_ball", "radius": 0.7}, (3, 2), brute_spectral),
    ("spectral", POW4, {"kind": "spectral_sphere", "radius": 0.7}, (3, 2), brute_spectral),
    ("spectral", LOG, {"kind": "rank", "k": 1}, (3, 2), brute_spectral),
    ("spectral", LOG, FBALL, (3, 2), brute_spectral),
    ("spectral", POW4, FBALL, (3, 2), brute_spectral),
    ("spectral", IND, FBALL, (3, 2), brute_spectral),
    ("spectral", LOG, SPH, (3, 2), brute_spectral),
    ("spectral", POW2, SPH, (3, 2), brute_spectral),
    ("rowwise", LOG, FBALL, (3, 2), brute_slsqp),
    ("columnwise", POW4, FBALL, (3, 2), brute_slsqp),
    ("rowwise", LOG, SPH, (3, 2), brute_slsqp),
]


def _geometry(gkind, ref, radius=1.0):
    g = {"kind": gkind, "radius": radius}
    if gkind != "euclidean":
        g["reference"] = ref
    return g


@pytest.mark.parametrize("gkind,ref,c,shape,solver", CASES,
                         ids=[f"{g}-{r['kind']}-{c['kind']}-{'x'.join(map(str, s))}" for g, r, c, s, _ in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_backward_matches_brute_force(gkind, ref, c, shape, solver, seed):
    rng = np.random.default_rng(seed + 17 * len(shape))
    gamma, rho = 0.35, 1.0
    t = gamma * rho
    x0 = point_in(c, shape, rng)
    y = x0 - t * direction(gkind, shape, rng)
    x, fallback = backward(torch.tensor(y), gamma, _geometry(gkind, ref, rho), c)
    x = x.numpy()
    assert fallback is None or not bool(fallback.any()), "constructed Y meets C + t·int dom φ₁"
    assert in_set(x, c), f"X⁺ not in {c}"
    ours = prox_objective(x, y, t, gkind, ref)
    brute = solver(y, t, gkind, ref, c, rng)
    assert np.isfinite(ours) and np.isfinite(brute)
    assert ours <= brute + 1e-7 * (1 + abs(brute)), (ours, brute)


OUTWARD = [
    # spheres with ‖Y‖ < r: entries / singular values (zeros included) must grow
    ("anisotropic", LOG, (2,), [0.3, 0.0], brute_grid),
    ("anisotropic", POW4, (4,), [0.3, 0.0, -0.1, 0.0], brute_slsqp),
    ("anisotropic", IND, (4,), [0.3, 0.0, -0.1, 0.0], brute_slsqp),
    ("spectral", LOG, (3, 2), [[0.3, 0.0], [0.0, 0.0], [0.0, 0.0]], brute_spectral),
    ("spectral", POW4, (3, 2), [[0.0, 0.2], [0.1, 0.0], [0.0, 0.0]], brute_spectral),
    ("spectral", IND, (3, 2), [[0.3, 0.0], [0.0, 0.0], [0.0, 0.0]], brute_spectral),
    ("rowwise", LOG, (3, 2), [[0.3, 0.1], [0.0, 0.0], [0.0, -0.2]], brute_slsqp),
]


@pytest.mark.parametrize("gkind,ref,shape,y,solver", OUTWARD, ids=[f"{g}-{r['kind']}" for g, r, *_ in OUTWARD])
def test_sphere_outward_matches_brute_force(gkind, ref, shape, y, solver):
    y, t = np.array(y, dtype=np.float64).reshape(shape), 0.35
    c = {"kind": "frobenius_sphere", "radius": 0.6}
    x, fb = backward(torch.tensor(y), t, _geometry(gkind, ref), c)
    x = x.numpy()
    assert not bool(fb) and in_set(x, c) and np.linalg.norm(y) < 0.6
    ours, brute = prox_objective(x, y, t, gkind, ref), solver(y, t, gkind, ref, c, np.random.default_rng(0))
    assert np.isfinite(brute) and ours <= brute + 1e-7 * (1 + abs(brute)), (ours, brute)


# ---------------------------------------------------------------- fallback where C misses Y + t·dom φ₁

FALLBACKS = [
    # (geometry kind, reference, constraint, Y, γ) with C ∩ (Y + t·dom φ₁) = ∅, t = γ
    ("anisotropic", LOG, BALL, [3.0, 3.0, -3.0, 3.0], 0.5),                # Σ(|y|−t)₊² > r²
    ("anisotropic", IND, SPH, [0.01, -0.02, 0.0, 0.03], 0.1),             # Σ(|y|+t)² < r²
    ("anisotropic", POW4, {"kind": "sign_set", "radius": 1.0}, [0.0, 1.0, 1.0, 3.0], 0.5),
    ("anisotropic", LOG, {"kind": "linf_sphere", "radius": 2.0}, [0.1, -0.2, 0.3, 0.0], 0.5),
    ("anisotropic", LOG, {"kind": "l0", "k": 1}, [2.0, 1.0, -3.0, 0.1], 0.5),
    ("isotropic", LOG, BALL, [3.0, 0.0, 0.0, 4.0], 1.0),
    ("spectral", LOG, {"kind": "stiefel", "radius": 1.0}, [[3.0, 0.0], [0.0, 0.2], [0.0, 0.0]], 0.5),
    ("spectral", POW4, FBALL, [[3.0, 0.0], [0.0, 2.0], [0.0, 0.0]], 0.5),
    ("spectral", LOG, SPH, [[0.01, 0.0], [0.0, 0.0], [0.0, 0.0]], 0.2),
    ("rowwise", LOG, FBALL, [[3.0, 0.0], [0.0, 4.0], [1.0, 1.0]], 0.5),
]


@pytest.mark.parametrize("gkind,ref,c,y,gamma", FALLBACKS, ids=[f"{g}-{c['kind']}" for g, _, c, _, _ in FALLBACKS])
def test_fallback_is_flagged_and_euclidean(gkind, ref, c, y, gamma):
    y = torch.tensor(y, dtype=torch.float64)
    x, fallback = backward(y, gamma, _geometry(gkind, ref), c)
    assert fallback is not None and bool(fallback)
    x_euc, none = backward(y, gamma, _geometry("euclidean", QUAD), c if c["kind"] not in ("l2_ball",) else c)
    if gkind in ("rowwise",):
        # the Euclidean projection onto the Frobenius ball
        x_euc = y * min(1.0, c["radius"] / float(y.norm()))
    assert none is None
    torch.testing.assert_close(x, x_euc, rtol=1e-10, atol=1e-12)


def test_quadratic_reference_and_euclidean_never_fall_back():
    y = torch.full((4,), 5.0, dtype=torch.float64)
    for gkind in ("anisotropic", "isotropic", "euclidean"):
        assert backward(y, 0.1, _geometry(gkind, QUAD), BALL)[1] is None


# ---------------------------------------------------------------- properties

REGISTERED_SETS = sorted({(g, c) for g, c in BACKWARD_OPS if c != "proximal_decay"})


def _constraint(kind, radius=0.9, k=2, **extra):
    return {"kind": kind, "k": k, **extra} if kind in ("l0", "rank") else {"kind": kind, "radius": radius, **extra}


finite = st.floats(-3, 3, allow_nan=False, width=64)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(REGISTERED_SETS), st.lists(finite, min_size=6, max_size=6), st.floats(0.05, 0.8),
       st.sampled_from(["log_barrier", "power_barrier"]))
def test_set_steps_independent_of_eps(pair, vals, gamma, rkind):
    """h_ε = ε·h₁ rescales the objective only: every projection onto a set is ε-free."""
    gkind, ckind = pair
    if gkind == "euclidean":
        return
    y = torch.tensor(vals, dtype=torch.float64).reshape(3, 2)
    outs = []
    for eps in (1e-8, 1e-3, 1.0):
        ref = {"kind": rkind, "eps": eps} if rkind == "log_barrier" else {"kind": rkind, "kappa": 3.0, "eps": eps}
        x, fb = backward(y, gamma, _geometry(gkind, ref), _constraint(ckind))
        outs.append((x, fb))
    for x, fb in outs[1:]:
        torch.testing.assert_close(x, outs[0][0], rtol=1e-7, atol=1e-9)
        assert (fb is None) == (outs[0][1] is None) and (fb is None or bool(fb) == bool(outs[0][1]))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(REGISTERED_SETS), st.lists(finite, min_size=24, max_size=24), st.floats(0.05, 0.8),
       st.sampled_from([LOG, POW4, IND, QUAD]))
def test_batched_equals_per_tensor_and_in_set(pair, vals, gamma, ref):
    gkind, ckind = pair
    y = torch.tensor(vals, dtype=torch.float64).reshape(2, 2, 3, 2)  # batch (2, 2) of 3×2 tensors
    c = _constraint(ckind, k=1)
    geo = _geometry(gkind, ref)
    xb, fb = backward(y, gamma, geo, c, batch_dims=2)
    assert xb.shape == y.shape and (fb is None or fb.shape == (2, 2))
    for i, j in itertools.product(range(2), range(2)):
        x1, f1 = backward(y[i, j], gamma, geo, c)
        torch.testing.assert_close(xb[i, j], x1, rtol=1e-9, atol=1e-10)
        assert (f1 is None) == (fb is None) and (f1 is None or bool(f1) == bool(fb[i, j]))
        assert in_set(xb[i, j].numpy(), c, tol=1e-7)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["stiefel", "spectral_ball", "spectral_sphere", "rank", "frobenius_ball", "frobenius_sphere"]),
       st.lists(finite, min_size=12, max_size=12), st.floats(0.05, 0.8))
def test_view_blocks_equal_per_block(ckind, vals, gamma):
    y = torch.tensor(vals, dtype=torch.float64).reshape(4, 3)
    c = _constraint(ckind, k=1)
    geo = {**_geometry("spectral", LOG), "view": {"kind": "matrix", "blocks": 2}}
    x, fb = backward(y, gamma, geo, c)
    for blk in range(2):
        xb, fbb = backward(y[2 * blk: 2 * blk + 2], gamma, _geometry("spectral", LOG), c)
        torch.testing.assert_close(x[2 * blk: 2 * blk + 2], xb, rtol=1e-9, atol=1e-10)
        assert not bool(fbb) or bool(fb)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([k for g, k in REGISTERED_SETS if g == "euclidean"]), st.lists(finite, min_size=6, max_size=6))
def test_euclidean_projection_idempotent(ckind, vals):
    y = torch.tensor(vals, dtype=torch.float64).reshape(3, 2)
    c = _constraint(ckind)
    geo = _geometry("euclidean", QUAD)
    x, _ = backward(y, 0.3, geo, c)
    xx, _ = backward(x, 0.3, geo, c)
    torch.testing.assert_close(xx, x, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4)])
@pytest.mark.parametrize("rank", [None, 1])
def test_stiefel_wide_tall_rank_deficient(shape, rank):
    rng = np.random.default_rng(3)
    y = rng.standard_normal(shape)
    if rank is not None:
        u, s, vt = np.linalg.svd(y, full_matrices=False)
        s[rank:] = 0
        y = (u * s) @ vt
    r = 1.7
    x, _ = backward(torch.tensor(y), 0.2, _geometry("spectral", LOG), {"kind": "stiefel", "radius": r})
    x = x.numpy()
    q = min(shape)
    gram = x.T @ x if shape[0] >= shape[1] else x @ x.T
    np.testing.assert_allclose(gram, r * r * np.eye(q), atol=1e-12)
    # ‖X − Y‖² = Σ(σ_i − r)²: the Euclidean distance from Y to Stiefel(r) (optimal, any completion)
    s = np.linalg.svd(y, compute_uv=False)
    np.testing.assert_allclose(np.sum((x - y) ** 2), np.sum((s - r) ** 2), rtol=1e-12)


def test_zero_input_deterministic_points():
    r = 2.0
    z = torch.zeros(3, 2, dtype=torch.float64)
    eye = torch.eye(3, 2, dtype=torch.float64)
    x, _ = backward(z, 0.5, _geometry("spectral", LOG, 1.0), {"kind": "stiefel", "radius": r})
    torch.testing.assert_close(x, r * eye)
    x, fb = backward(z, 2.0, _geometry("spectral", LOG, 1.0), {"kind": "frobenius_sphere", "radius": r})
    torch.testing.assert_close(x, r / math.sqrt(2) * eye)
    assert not bool(fb)
    for gkind in ("anisotropic", "euclidean", "isotropic"):
        x, _ = backward(z, 2.0, _geometry(gkind, LOG), {"kind": "frobenius_sphere", "radius": r})
        torch.testing.assert_close(x, torch.full_like(z, r / math.sqrt(6)))
    x, _ = backward(z, 2.0, _geometry("anisotropic", LOG), {"kind": "sign_set", "radius": r})
    torch.testing.assert_close(x, torch.full_like(z, r))
    x, _ = backward(torch.zeros(4), 2.0, _geometry("anisotropic", LOG), {"kind": "linf_sphere", "radius": r})
    assert x.tolist() == [r, 0.0, 0.0, 0.0]


def test_ties_keep_first_index():
    y = torch.tensor([1.0, -2.0, 2.0, 0.5])
    x, _ = backward(y, 1.0, _geometry("anisotropic", LOG), {"kind": "l0", "k": 1})
    assert x.tolist() == [0.0, -2.0, 0.0, 0.0]


def test_dtypes_round_trip():
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for c in (BALL, SPH, {"kind": "stiefel", "radius": 1.0}):
            x, _ = backward(y.to(dtype), 0.3, _geometry("spectral", POW4), c)
            assert x.dtype == dtype and torch.isfinite(x).all()


def test_proximal_decay_uses_gamma():
    y = torch.randn(3, 4, dtype=torch.float64)
    for gkind in ("euclidean", "isotropic", "anisotropic", "spectral", "rowwise", "columnwise"):
        x, fb = backward(y, 0.2, _geometry(gkind, LOG, radius=7.0), {"kind": "proximal_decay", "lam": 0.5})
        torch.testing.assert_close(x, y / 1.1)
        assert fb is None


def test_unsupported_pair_names_alternatives():
    with pytest.raises(ValueError, match="anisotropic geometry supports: .*l2_ball"):
        backward(torch.zeros(3), 0.1, _geometry("anisotropic", LOG), {"kind": "stiefel", "radius": 1.0})
    # an unknown kind is refused where a dict enters, by the spec's model
    with pytest.raises(ValueError, match="Input tag 'frobenius_bal'.*expected tags: .*'frobenius_ball'"):
        backward(torch.zeros(3), 0.1, _geometry("spectral", LOG), {"kind": "frobenius_bal", "radius": 1.0})
    y = torch.ones(3)
    x, fb = backward(y, 0.1, _geometry("spectral", LOG), None)
    assert x is y and fb is None


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["stiefel", "spectral_ball", "frobenius_ball", "frobenius_sphere"]),
       st.lists(finite, min_size=24, max_size=24), st.floats(0.05, 0.8))
def test_view_batch_equals_per_expert(ckind, vals, gamma):
    """An (E, out, in) tensor under ``batch: 1`` is E matrices, each with its own constraint."""
    y = torch.tensor(vals, dtype=torch.float64).reshape(2, 4, 3)
    c = _constraint(ckind, k=1)
    x, fb = backward(y, gamma, {**_geometry("spectral", LOG), "view": {"kind": "matrix", "batch": 1}}, c)
    for e in range(2):
        xe, fe = backward(y[e], gamma, _geometry("spectral", LOG), c)
        torch.testing.assert_close(x[e], xe, rtol=1e-9, atol=1e-10)
        assert not bool(fe) or bool(fb)


def test_view_unequal_blocks_scale_a_relative_constraint():
    """Blocks of different sizes carry their radius factors: block i's step is the plain step with
    t·fᵢ, and its set radius times fᵢ when the constraint was ``relative``."""
    y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 3
    c = {"kind": "spectral_ball", "radius": 0.5}
    view = {"batch": 0, "trailing": "cols", "blocks": [4, 2, 2], "factors": [1.0, 0.25, 0.25], "scale_constraint": True}
    x, _ = backward(y, 0.3, {**_geometry("spectral", LOG), "view": view}, c, radius=2.0)
    geo = _geometry("spectral", LOG)
    want = torch.cat([backward(y[:4], 0.3, geo, c, radius=2.0)[0],
                      backward(y[4:6], 0.3, geo, {**c, "radius": 0.125}, radius=0.5)[0],
                      backward(y[6:], 0.3, geo, {**c, "radius": 0.125}, radius=0.5)[0]])
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)
    assert float(torch.linalg.matrix_norm(x[4:6], ord=2)) <= 0.125 + 1e-9
