"""Kronecker-factored geometries (geomopt.geometry.kron, kron_root, kron_psgd): each function
against an independent float64 computation (explicit sums, scipy's fractional matrix power, the
defining identity X^p·(A + εI) = I, the explicit Kronecker product, PSGD's criterion), a stack
against its matrices one by one (bit for bit), and Shampoo, SOAP and PSGD-Kron run step for step
beside pytorch-optimizer's ``Shampoo``, ``ScalableShampoo``, ``SOAP`` and ``Kron`` on the same
gradients (and, for Kron, the same probes): the parameters agree within a tight bound, and leave it
when one coefficient of ours is changed."""

from __future__ import annotations

import pytest
import pytorch_optimizer
import scipy.linalg
import torch

from geomopt.geometry import kron, kron_psgd
from geomopt.geometry.kron_root import inverse_root_eigh, inverse_root_newton
from geomopt.optim.units import state_keys
from geomopt.optim.units.declare import COUNT, FIRST, SECOND, StateKey

F64 = torch.float64


def _psd(n: int, cond: float = 10.0, seed: int = 0, batch: tuple = ()) -> torch.Tensor:
    """Symmetric positive definite matrices with eigenvalues log-spaced in [1/cond, 1] (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=gen, dtype=F64))
    lam = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=F64)
    return (q * lam) @ q.mT


def _random_spectra(count: int, n: int, power: float, seed: int, floor: float = 0.0) -> torch.Tensor:
    """``count`` symmetric positive definite n × n matrices (float64): random eigenvectors, eigenvalues
    uᵖᵒʷᵉʳ with u uniform in [0, 1), at least ``floor``: conditions spread over decades, unlike :func:`_psd`'s."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(count, n, n, generator=gen, dtype=F64))
    lam = (torch.rand(count, n, generator=gen, dtype=F64) ** power).clamp_min(floor)
    return (q * lam.unsqueeze(-2)) @ q.mT


def _largest_entry_growth(b: torch.Tensor, p: int) -> float:
    """The largest ratio max|M_{k+1} − I| / max|M_k − I| (while above 1e-8) of the coupled Newton
    iteration's M_k = X_k^p·B, M₀ = (p + 1)/(2‖B‖_F)·B, M_{k+1} = (((p + 1)I − M_k)/p)^p·M_k, in float64."""
    eye = torch.eye(b.shape[-1], dtype=F64)
    m = b * (p + 1) / (2 * torch.linalg.matrix_norm(b))
    err, worst = (m - eye).abs().max().item(), 0.0
    for _ in range(40):
        m = torch.linalg.matrix_power(((p + 1) * eye - m) / p, p) @ m
        new = (m - eye).abs().max().item()
        worst = max(worst, new / err) if err > 1e-8 else worst
        err = new
    return worst


def _scipy_root(a: torch.Tensor, p: float, eps: float) -> torch.Tensor:
    """(A + εI)^(−1/p) by scipy's Schur-based fractional power (no eigh), float64."""
    m = a.to(F64).numpy() + eps * torch.eye(a.shape[-1], dtype=F64).numpy()
    return torch.from_numpy(scipy.linalg.fractional_matrix_power(m, -1.0 / p).real.copy())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.to(F64) - b.to(F64)).abs().max() / b.to(F64).abs().max()).item()


# ---------------------------------------------------------------- factors, orders, schedule


def test_factors_are_the_explicit_sums_and_a_long_side_keeps_none():
    gen = torch.Generator().manual_seed(1)
    gs = torch.randn(4, 3, 5, 9, generator=gen, dtype=F64)  # 4 steps of a stack of 3 matrices 5 × 9
    left, right = kron.init_factors((3, 5, 9), max_dim=6, eps=0.5, dtype=F64)
    assert right is None and left.shape == (3, 5, 5)
    beta, w = 0.9, 0.1
    for g in gs:
        kron.update_factors(g, left, right, beta=beta, weight=w)
    expect = 0.5 * beta**4 * torch.eye(5, dtype=F64) + sum(
        w * beta ** (3 - t) * gs[t] @ gs[t].mT for t in range(4))
    assert _rel(left, expect) < 1e-14
    left, right = kron.init_factors((5, 9), dtype=F64)
    kron.update_factors(gs[0, 0], left, right, beta=1.0, weight=1.0)
    assert _rel(right, gs[0, 0].mT @ gs[0, 0]) < 1e-14
    left, right = kron.init_factors((5, 9), max_dim=5, dtype=F64)  # a side of max_dim keeps its factor
    assert left is not None and left.shape == (5, 5) and right is None


def test_root_order_and_refresh_schedule():
    a = torch.eye(2)
    assert kron.root_order(a, a) == 4 and kron.root_order(a, None) == 2 and kron.root_order(None, a, 6) == 6
    assert [t for t in range(1, 8) if kron.refresh_due(t, 3)] == [3, 6]


# ---------------------------------------------------------------- inverse roots


@pytest.mark.parametrize("cond", [10.0, 1e6])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_eigh_root_against_scipy_and_the_defining_identity(cond, p):
    a, eps = _psd(7, cond, seed=2), 1e-7
    x = inverse_root_eigh(a, p, eps)
    ref = _scipy_root(a, p, eps)
    assert _rel(x, ref) < 1e-9
    ident = torch.linalg.matrix_power(x, p) @ (a + eps * torch.eye(7, dtype=F64))
    torch.testing.assert_close(ident, torch.eye(7, dtype=F64), rtol=0, atol=1e-8)


def test_eigh_root_of_float32_is_computed_in_float64_and_clamps_negative_eigenvalues():
    a32 = _psd(6, 1e6, seed=3).float()
    ref = _scipy_root(a32.double(), 4, 1e-6)
    x = inverse_root_eigh(a32, 4, 1e-6)
    assert x.dtype == torch.float32
    assert _rel(x, ref) < 2e-7  # only the final rounding to float32
    # a rank-deficient factor whose rounding made an eigenvalue slightly negative
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(5), dtype=F64))
    lam = torch.tensor([3.0, 1.0, 0.5, 0.0, 0.0, -1e-12], dtype=F64)
    b = (q * lam) @ q.mT
    x = inverse_root_eigh(b, 2, 1e-3)
    ref = (q * (lam.clamp_min(0) + 1e-3) ** -0.5) @ q.mT
    assert torch.isfinite(x).all() and _rel(x, ref) < 1e-10


def _spy_eigh(monkeypatch) -> list:
    """torch.linalg.eigh recorded: the (dtype, number of matrices) of each call."""
    calls: list = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda x: calls.append((x.dtype, x.shape[0])) or eigh(x))
    return calls


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3])
def test_eigh_root_of_float32_takes_float32_where_its_error_is_small_and_float64_elsewhere(monkeypatch, scale):
    """A stack of float32 factors with κ = 10, 30 and 1e6: the first two are rooted in float32
    (u₃₂·κ ≤ FLOAT32_ROOT_TOL), within a few u₃₂·κ of the float64 root; the third in float64,
    within the final rounding; each matrix gets the bits it gets alone. The factors (and ε) scaled by
    1e-3 or 1e3 take the same routes: the choice reads κ, a ratio of eigenvalues, not their size."""
    conds = (10.0, 30.0, 1e6)
    a = (scale * torch.stack([_psd(40, c, seed=9 + i) for i, c in enumerate(conds)])).float()
    eps = 1e-9 * scale
    calls = _spy_eigh(monkeypatch)
    x = inverse_root_eigh(a, 4, eps)
    assert calls == [(torch.float32, 2), (F64, 1)]
    for i, c in enumerate(conds):
        ref = _scipy_root(a[i].double(), 4, eps)
        err = _rel(x[i], ref)
        assert err < (4 * 2.0**-24 * c if c < 1e3 else 2e-7), (c, err)
        assert torch.equal(inverse_root_eigh(a[i], 4, eps), x[i])
    assert _rel(x[1], _scipy_root(a[1].double(), 4, eps)) > 2e-7  # float32's error, not the final rounding's
    # the damping counts: with ε = 0.05 the third factor's κ is about 20, and float32 takes it
    calls.clear()
    inverse_root_eigh(a[2], 4, 0.05 * scale)
    assert calls == [(torch.float32, 1)]


def test_the_eigenvalues_check_the_float32_route_after_the_precheck(monkeypatch):
    """With the Cholesky precheck passing every factor, the float32 eigenvalues alone choose the
    route: u₃₂·κ = tol/2 stays in float32, u₃₂·κ = 2·tol goes to float64 (6 × 6, eigenvalues
    log-spaced, so no pair of them but the extremes has the ratio κ), and u₃₂·κ = tol exactly (a
    2 × 2 diagonal factor, whose float32 eigenvalues are exact) stays in float32, the bound included."""
    from geomopt.geometry import kron_root
    monkeypatch.setattr(kron_root, "_well_conditioned", lambda a3, eps: torch.ones(a3.shape[0], dtype=torch.bool))
    at_tol = kron_root.FLOAT32_ROOT_TOL / 2.0**-24
    a = torch.stack([_psd(6, at_tol / 2, seed=30), _psd(6, 2 * at_tol, seed=31)]).float()
    calls = _spy_eigh(monkeypatch)
    x = inverse_root_eigh(a, 2)
    assert calls == [(torch.float32, 2), (F64, 1)]
    assert 2e-7 < _rel(x[0], _scipy_root(a[0].double(), 2, 0.0)) < 4 * 2.0**-24 * at_tol / 2
    assert _rel(x[1], _scipy_root(a[1].double(), 2, 0.0)) < 2e-7
    calls.clear()
    edge = torch.diag(torch.tensor([torch.tensor(kron_root.FLOAT32_ROOT_TOL).float().item() * 2.0**24, 1.0]))
    assert 2.0**-24 * edge[0, 0].item() == torch.tensor(kron_root.FLOAT32_ROOT_TOL).float().item()
    inverse_root_eigh(edge, 2)
    assert calls == [(torch.float32, 1)]


def test_the_float32_precheck_is_the_conditioning_bound():
    """_well_conditioned passes a factor iff λ_min + ε > ‖A + εI‖_F·u₃₂/tol (up to float32's rounding)."""
    from geomopt.geometry.kron_root import FLOAT32_ROOT_TOL, _well_conditioned
    a = torch.stack([_psd(30, c, seed=20) for c in (10.0, 30.0, 1e3, 1e7)]).float()
    lam = torch.linalg.eigvalsh(a.double())
    bound = torch.linalg.matrix_norm(a.double()) * 2.0**-24 / FLOAT32_ROOT_TOL
    assert torch.equal(_well_conditioned(a, 0.0), lam[:, 0] > bound)
    assert _well_conditioned(a, 0.0).tolist() == [True, True, False, False]


@pytest.mark.parametrize("cond", [10.0, 1e6])
@pytest.mark.parametrize("p", [2, 4])
def test_newton_root_converges_to_the_eigh_root(cond, p):
    a, eps = _psd(8, cond, seed=6), 1e-9
    ref = _scipy_root(a, p, eps)
    assert _rel(inverse_root_newton(a, p, eps), ref) < 1e-10
    errs = [_rel(inverse_root_newton(a, p, eps, max_iters=k), ref) for k in (5, 15, 25, 60)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-10
    x32 = inverse_root_newton(a.float(), p, eps)
    assert x32.dtype == torch.float32 and _rel(x32, ref) < (1e-6 if cond < 1e3 else 5e-3)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_newton_root_of_factors_of_any_spectrum_against_scipy(p):
    """60 factors 5 × 5 of random spectra (κ up to 1e6): every root within 1e-9 of scipy's, p = 1
    (the inverse) and p = 8 (M₀'s error above 1) included. For p = 3 and 4 some of them have the
    largest entry of M_k − I grow by more than max_error_ratio while the iteration converges: only
    the Frobenius norm, which cannot grow but by rounding, may stop it (the largest entry did: roots
    off by 98%)."""
    a = _random_spectra(60, 5, 4.0, seed=0, floor=1e-6)
    x = inverse_root_newton(a, p)
    for i in range(a.shape[0]):
        assert _rel(x[i], _scipy_root(a[i], p, 0.0)) < 1e-9, i
    if p in (3, 4):
        assert max(_largest_entry_growth(f, p) for f in a) > 1.2


@pytest.mark.parametrize("p", [1, 2, 4])
def test_newton_root_starts_from_the_scaled_identity(p):
    """The iteration's start (Guo and Higham's scaling): no iteration gives X₀ = z^(1/p)·I, one gives
    X₁ = X₀·((p + 1)·I − z·B)/p, with B = A + εI and z = (p + 1)/(2‖B‖_F), in float64."""
    a, eps = _psd(5, 100.0, seed=12), 1e-3
    eye = torch.eye(5, dtype=F64)
    b = a + eps * eye
    z = (p + 1) / (2 * torch.linalg.matrix_norm(b))
    x0 = z ** (1.0 / p) * eye
    torch.testing.assert_close(inverse_root_newton(a, p, eps, max_iters=0), x0, rtol=1e-15, atol=0)
    x1 = x0 @ ((p + 1) * eye - z * b) / p
    torch.testing.assert_close(inverse_root_newton(a, p, eps, max_iters=1), x1, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("p", [2, 4])
def test_newton_root_stops_at_its_documented_default_tolerance(dtype, tol, p):
    """``tol`` defaults to 1e-12 in float64 and 1e-6 in float32: the default gives the bits of that
    tolerance given explicitly, and among 256 factors of random spectra some stop at a different
    iteration with twice the tolerance (their error lands in between), so the default decides bits."""
    a = _random_spectra(256, 3, 3.0, seed=1).to(dtype)
    got = inverse_root_newton(a, p)
    assert torch.equal(got, inverse_root_newton(a, p, tol=tol))
    assert not torch.equal(got, inverse_root_newton(a, p, tol=2 * tol))


def test_roots_refuse_bad_orders_and_shapes():
    with pytest.raises(ValueError, match="positive integer"):
        inverse_root_newton(torch.eye(3), 2.5)
    with pytest.raises(ValueError, match="positive integer"):
        inverse_root_newton(torch.eye(3), 0)
    with pytest.raises(ValueError, match="square"):
        inverse_root_eigh(torch.ones(4, 2, 3), 2)
    with pytest.raises(ValueError, match="positive"):
        inverse_root_eigh(torch.eye(3), 0)
    with pytest.raises(ValueError, match="square"):
        inverse_root_eigh(torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match="'eigh' or 'newton'"):
        kron.refresh_roots(torch.eye(2), None, torch.eye(2), None, p=2, method="svd")


# ---------------------------------------------------------------- direction, graft, SOAP pieces


def test_shampoo_direction_is_the_two_sided_product_and_one_sided_uses_the_identity():
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(4, 6, generator=gen, dtype=F64)
    lr_, rr = _psd(4, seed=8), _psd(6, seed=9)
    assert _rel(kron.shampoo_direction(g, lr_, rr), lr_ @ g @ rr) < 1e-14
    assert _rel(kron.shampoo_direction(g, lr_, None), lr_ @ g) < 1e-14
    d = kron.shampoo_direction(g, None, None)
    assert torch.equal(d, g) and d.data_ptr() != g.data_ptr()


def test_graft_takes_the_other_directions_frobenius_norm_per_matrix():
    gen = torch.Generator().manual_seed(10)
    d = torch.randn(3, 5, 4, generator=gen, dtype=F64)
    g = torch.randn(3, 5, 4, generator=gen, dtype=F64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    for e in (g / (g.abs() + 1e-3), u @ vh):  # a diagonal (Adam-like) and Muon's orthogonalized direction
        out = kron.graft(d.clone(), e)
        for i in range(3):
            assert abs(out[i].norm() - e[i].norm()) < 1e-12 * e[i].norm()
            cos = (out[i] * d[i]).sum() / (out[i].norm() * d[i].norm())
            assert abs(cos - 1) < 1e-13
    # Muon's direction has Frobenius norm √rank
    out = kron.graft(d.clone(), u @ vh)
    torch.testing.assert_close(out.norm(dim=(-2, -1)), torch.full((3,), 2.0, dtype=F64), rtol=1e-12, atol=0)


def test_rotate_and_unrotate_are_inverse_and_the_bases_are_eigenbases():
    left, right = _psd(5, seed=11), _psd(3, seed=12)
    ql, qr = kron.soap_bases(left, right)
    for f, q in ((left, ql), (right, qr)):
        lam = torch.linalg.eigvalsh(f).flip(-1)  # decreasing
        torch.testing.assert_close(q.mT @ f @ q, torch.diag(lam), rtol=0, atol=1e-13)
    x = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(kron.unrotate(kron.rotate(x, ql, qr), ql, qr), x, rtol=0, atol=1e-14)
    torch.testing.assert_close(kron.rotate(x, ql, None), ql.mT @ x, rtol=0, atol=0)


def test_soap_refresh_is_subspace_iteration_and_reorders_the_second_moment():
    """Repeated refreshes on fixed factors converge to their eigenbases (power iteration with
    QR), and the rotated second moment's rows and columns follow the estimated eigenvalues."""
    left, right = _psd(5, cond=1e3, seed=14), _psd(4, cond=1e3, seed=15)
    gen = torch.Generator().manual_seed(16)
    ql, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=F64))
    qr_, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=F64))
    v = torch.rand(5, 4, generator=gen, dtype=F64)
    v0 = v.clone()
    rows = torch.argsort((ql * (left @ ql)).sum(0), descending=True)
    cols = torch.argsort((qr_ * (right @ qr_)).sum(0), descending=True)
    kron.soap_refresh(left, right, ql, qr_, v)
    assert torch.equal(v, v0[rows][:, cols])
    for q in (ql, qr_):  # a float64 QR for float64 factors
        assert q.dtype == F64
        torch.testing.assert_close(q.mT @ q, torch.eye(q.shape[0], dtype=F64), rtol=0, atol=1e-14)
    for _ in range(60):
        kron.soap_refresh(left, right, ql, qr_, v)
    for f, q in ((left, ql), (right, qr_)):
        lam = torch.linalg.eigvalsh(f).flip(-1)
        off = q.mT @ f @ q - torch.diag(torch.diagonal(q.mT @ f @ q))
        assert off.abs().max() < 1e-5
        torch.testing.assert_close(torch.diagonal(q.mT @ f @ q), lam, rtol=1e-5, atol=0)


def test_soap_direction_is_adam_in_the_rotated_basis():
    """Against Adam written out in float64 on the rotated gradients: with fixed bases, SOAP's
    direction is Q_L·adam(Q_Lᵀ G_t Q_R)·Q_Rᵀ (m is linear, so keeping it unrotated changes nothing)."""
    gen = torch.Generator().manual_seed(17)
    gs = torch.randn(5, 4, 6, generator=gen, dtype=F64)
    ql, qr = kron.soap_bases(_psd(4, seed=18), _psd(6, seed=19))
    m, v = torch.zeros(4, 6, dtype=F64), torch.zeros(4, 6, dtype=F64)
    b1, b2, eps = 0.9, 0.95, 1e-3
    mr, vr = torch.zeros(4, 6, dtype=F64), torch.zeros(4, 6, dtype=F64)
    for t, g in enumerate(gs, 1):
        d = kron.soap_direction(g, m, v, ql, qr, betas=(b1, b2), eps=eps, step=t)
        gr = ql.mT @ g @ qr
        mr, vr = b1 * mr + (1 - b1) * gr, b2 * vr + (1 - b2) * gr**2
        ref = ql @ (mr / (vr.sqrt() + eps)) @ qr.mT * (1 - b2**t) ** 0.5 / (1 - b1**t)
        assert _rel(d, ref) < 1e-12


# ---------------------------------------------------------------- a stack is its matrices


def test_a_stack_gives_each_matrix_the_bits_it_gets_alone():
    gen = torch.Generator().manual_seed(20)
    g = torch.randn(3, 4, 6, generator=gen)
    a = _psd(4, 1e4, seed=21, batch=(3,)).float()
    for fn in (lambda x: inverse_root_eigh(x, 4, 1e-6), lambda x: inverse_root_newton(x, 4, 1e-6)):
        stacked = fn(a)
        assert all(torch.equal(stacked[i], fn(a[i])) for i in range(3))
    left, right = kron.init_factors((3, 4, 6), eps=1e-3)
    singles = [kron.init_factors((4, 6), eps=1e-3) for _ in range(3)]
    kron.update_factors(g, left, right, beta=0.9, weight=0.1)
    for i, (sl, sr) in enumerate(singles):
        kron.update_factors(g[i], sl, sr, beta=0.9, weight=0.1)
        assert torch.equal(left[i], sl) and torch.equal(right[i], sr)
    lroot, rroot = inverse_root_eigh(left, 4), inverse_root_eigh(right, 4)
    d = kron.shampoo_direction(g, lroot, rroot)
    e = torch.sign(g)
    kron.graft(d, e)
    ql, qr = kron.soap_bases(left, right)
    m, v = torch.zeros_like(g), torch.zeros_like(g)
    sd = kron.soap_direction(g, m, v, ql, qr, betas=(0.9, 0.95), eps=1e-8, step=1)
    kron.soap_refresh(left, right, ql, qr, v)
    for i, (sl, sr) in enumerate(singles):
        di = kron.graft(kron.shampoo_direction(g[i], inverse_root_eigh(sl, 4), inverse_root_eigh(sr, 4)), e[i])
        assert torch.equal(d[i], di)
        qli, qri = kron.soap_bases(sl, sr)
        mi, vi = torch.zeros_like(g[i]), torch.zeros_like(g[i])
        sdi = kron.soap_direction(g[i], mi, vi, qli, qri, betas=(0.9, 0.95), eps=1e-8, step=1)
        kron.soap_refresh(sl, sr, qli, qri, vi)
        assert torch.equal(sd[i], sdi) and torch.equal(v[i], vi) and torch.equal(ql[i], qli)


# ---------------------------------------------------------------- the declared state


def test_state_declarations():
    for keys in (state_keys.SHAMPOO_STATE, state_keys.SOAP_STATE, state_keys.PSGD_STATE):
        assert all(isinstance(k, StateKey) for k in keys) and len({k.key for k in keys}) == len(keys)
        assert sum(k.layout == COUNT for k in keys) == 1
    assert [k.key for k in state_keys.SHAMPOO_STATE if k.moment] == []
    assert {k.key: k.moment for k in state_keys.SOAP_STATE if k.moment} == {"soap_exp_avg": FIRST,
                                                                      "soap_exp_avg_sq": SECOND}
    assert {k.key: k.moment for k in state_keys.PSGD_STATE if k.moment} == {"psgd_momentum": FIRST}
    assert state_keys.KINDS["psgd"] == tuple(k.key for k in state_keys.PSGD_STATE)


# ---------------------------------------------------------------- beside pytorch-optimizer

STEPS = 6
#: (shape, max_dim): square, wide, and one-sided (the 12-long side above max_dim keeps no factor)
SHAPES = {"square": ((6, 6), None), "wide": ((4, 7), None), "one-sided": ((5, 12), 8)}
BUCKET = 3  # the peer steps 3 parameters of a shape, ours one stack of 3


def _grads(shape, seed=0) -> torch.Tensor:
    return torch.randn(STEPS, BUCKET, *shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _peer(cls, grads: torch.Tensor, **hp) -> torch.Tensor:
    """The peer's parameters after stepping on ``grads`` (steps × bucket × shape), from zeros."""
    ps = [torch.zeros(grads.shape[2:], dtype=F64, requires_grad=True) for _ in range(grads.shape[1])]
    opt = cls(ps, **hp)
    for g in grads:
        for p, gi in zip(ps, g):
            p.grad = gi.clone()
        opt.step()
    return torch.stack([p.detach() for p in ps])


def _gap(ours: torch.Tensor, peer: torch.Tensor) -> float:
    """max |ours − peer| over max |peer| (both runs start from zero: the displacement)."""
    assert torch.isfinite(ours).all() and peer.abs().max() > 0
    return _rel(ours, peer)


def _shampoo(grads, *, lr, beta, weight, eps, every, max_dim=None, order=None, init_eps=0.0, roots_init=1.0,
             graft_eps=None, momentum=0.0, method="eigh") -> torch.Tensor:
    """Our Shampoo on ``grads``: factors (ε₀·I at the start), roots every ``every`` steps, the
    direction grafted to AdaGrad's (``graft_eps``: its ε; None: no grafting), heavy-ball momentum."""
    shape = grads.shape[1:]
    x = torch.zeros(shape, dtype=F64)
    left, right = kron.init_factors(shape, max_dim, eps=init_eps, dtype=F64)
    lroot, rroot = kron.init_factors(shape, max_dim, eps=roots_init, dtype=F64)
    p = kron.root_order(left, right, order)
    acc, buf = torch.zeros_like(x), torch.zeros_like(x)
    for t, g in enumerate(grads, 1):
        kron.update_factors(g, left, right, beta=beta, weight=weight)
        if kron.refresh_due(t, every):
            kron.refresh_roots(left, right, lroot, rroot, p=p, eps=eps, method=method)
        d = kron.shampoo_direction(g, lroot, rroot)
        if graft_eps is not None:
            acc.addcmul_(g, g)
            kron.graft(d, g / (acc.sqrt() + graft_eps))
        buf.mul_(momentum).add_(d)
        x.sub_(buf, alpha=lr)
    return x


def _soap(grads, *, lr, betas, shampoo_beta, eps, every, max_dim=None, bases=None) -> torch.Tensor:
    """Our SOAP on ``grads`` in the reference's schedule: the first gradient only starts the
    factors and their eigenbases (``bases``: these instead); from the second on, t counts the
    moment updates, and the bases are refreshed after the factors' update when t is due."""
    shape = grads.shape[1:]
    x = torch.zeros(shape, dtype=F64)
    left, right = kron.init_factors(shape, max_dim, dtype=F64)
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    ql = qr = None
    for t, g in enumerate(grads):
        if t == 0:
            kron.update_factors(g, left, right, beta=shampoo_beta, weight=1 - shampoo_beta)
            ql, qr = kron.soap_bases(left, right) if bases is None else (b.clone() for b in bases)
            continue
        x.sub_(kron.soap_direction(g, m, v, ql, qr, betas=betas, eps=eps, step=t), alpha=lr)
        kron.update_factors(g, left, right, beta=shampoo_beta, weight=1 - shampoo_beta)
        if kron.refresh_due(t, every):
            kron.soap_refresh(left, right, ql, qr, v)
    return x


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("shape", ["square", "wide"])
def test_shampoo_matches_pytorch_optimizer_shampoo(shape, every):
    """pytorch-optimizer's ``Shampoo``: the sum form, started at ε·I (our damping ε of the root:
    the same matrix), exponent −1/4, the roots every ``every`` steps starting from zero (no step
    before the first refresh)."""
    grads = _grads(SHAPES[shape][0], seed=1)
    lr, eps = 0.1, 1e-3
    peer = _peer(pytorch_optimizer.Shampoo, grads, lr=lr, matrix_eps=eps, preconditioning_compute_steps=every)
    ours = dict(lr=lr, beta=1.0, weight=1.0, eps=eps, every=every, roots_init=0.0)
    bound = 1e-12  # measured: 5e-14 (eigh), 2e-13 (Newton)
    assert _gap(_shampoo(grads, **ours), peer) < bound
    assert _gap(_shampoo(grads, **{**ours, "method": "newton"}), peer) < bound
    for change in ({"beta": 0.99}, {"eps": 1.1e-3}, {"order": 2}, {"every": every + 1}):
        assert _gap(_shampoo(grads, **{**ours, **change}), peer) > 100 * bound, change


@pytest.mark.parametrize("shape", ["square", "wide", "one-sided"])
def test_shampoo_matches_pytorch_optimizer_scalable_shampoo(shape):
    """pytorch-optimizer's ``ScalableShampoo`` (roots by SVD): moving-average factors started at
    ε·I (the damping decays as β₂ᵗ·ε: our factors start at ε·I and the roots take no damping),
    roots every 2 steps from the identity, grafted to AdaGrad's direction, heavy-ball momentum;
    one-sided: the peer preconditions the first dimension only, we drop the side above max_dim."""
    (dims, max_dim) = SHAPES[shape]
    grads = _grads(dims, seed=2)
    lr, (beta1, beta2), eps, diag_eps, every = 0.05, (0.5, 0.9), 1e-3, 1e-4, 2
    one_sided = pytorch_optimizer.optimizer.utils.partition.PreConditionerType.INPUT
    peer = _peer(pytorch_optimizer.ScalableShampoo, grads, lr=lr, betas=(beta1, beta2), matrix_eps=eps,
                 diagonal_eps=diag_eps, start_preconditioning_step=1, preconditioning_compute_steps=every,
                 block_size=64, shape_interpretation=False, nesterov=False, use_svd=True,
                 graft_type=pytorch_optimizer.optimizer.utils.graft.LayerWiseGrafting.ADAGRAD,
                 pre_conditioner_type=one_sided if max_dim else 0)
    ours = dict(lr=lr, beta=beta2, weight=1 - beta2, eps=0.0, init_eps=eps, every=every, max_dim=max_dim,
                graft_eps=diag_eps, momentum=beta1)
    bound = 1e-12  # measured: 1e-15
    assert _gap(_shampoo(grads, **ours), peer) < bound
    for change in ({"beta": 0.95, "weight": 0.05}, {"init_eps": 1.1e-3}, {"order": 6}, {"every": 3}):
        assert _gap(_shampoo(grads, **{**ours, **change}), peer) > 100 * bound, change


def _peer_soap_bases(grads, **hp):
    """The peer's SOAP bases (Q_L, Q_R) after its first step, stacked (None: a side not kept)."""
    ps = [torch.zeros(grads.shape[2:], dtype=F64, requires_grad=True) for _ in range(grads.shape[1])]
    opt = pytorch_optimizer.SOAP(ps, **hp)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()
    qs = [opt.state[p]["Q"] for p in ps]
    return tuple(torch.stack([q[i] for q in qs]) if len(qs[0][i]) else None for i in range(2))


@pytest.mark.parametrize("every", [2, 100])
@pytest.mark.parametrize("shape", ["square", "wide", "one-sided"])
def test_soap_matches_pytorch_optimizer_soap(shape, every):
    """pytorch-optimizer's ``SOAP``: the first step only starts the factors and bases, m kept in
    the gradient's basis, v' in the rotated one, ε before the bias correction, the bases refreshed
    every 2 steps (one power iteration and a QR in float32, whose rounding of inputs that differ in
    their last bits is the whole gap: with no refresh in the run, 1e-14), a side above max_dim
    unrotated."""
    (dims, max_dim) = SHAPES[shape]
    grads = _grads(dims, seed=3)
    lr, betas, shampoo_beta, eps = 0.01, (0.9, 0.95), 0.8, 1e-3
    hp = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps, precondition_frequency=every,
              max_precondition_dim=max_dim or 10000, weight_decay=0.0)
    peer = _peer(pytorch_optimizer.SOAP, grads, **hp)
    ours = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps, every=every, max_dim=max_dim)
    if shape == "wide":
        # the first factor of a non-square gradient has a null space (Gᵀ·G of a 4 × 7 G has rank 4),
        # where eigh's basis is arbitrary and decided by rounding, and the rotated second moment
        # depends on it: both runs start from the peer's first bases
        ours["bases"] = _peer_soap_bases(grads[:1], **hp)
        assert _gap(_soap(grads, **{**ours, "bases": None}), peer) > 1e-3
    bound = 1e-12 if every > STEPS else 1e-6  # measured: 4e-15; 2e-7 (float32 QR)
    assert _gap(_soap(grads, **ours), peer) < bound
    changes = [{"betas": (0.9, 0.96)}, {"eps": 1.2e-3}, {"every": 3}]
    if every <= STEPS:  # the factors' β reaches the bases only through a refresh (eigh ignores a scale)
        changes.append({"shampoo_beta": 0.85})
    for change in changes:
        assert _gap(_soap(grads, **{**ours, **change}), peer) > 10 * bound, change


# ---------------------------------------------------------------- PSGD-Kron


def test_psgd_probe_is_one_matrix_draw_given_to_every_matrix_of_a_stack():
    """A stack's probe is the draw one matrix of its shape gets at that step, for every matrix; another
    step draws anew."""
    g = torch.zeros(3, 4, 5, dtype=F64)
    v, alone = kron_psgd.probe(g, 7), kron_psgd.probe(g[0], 7)
    assert v.shape == (3, 4, 5) and all(torch.equal(v[i], alone) for i in range(3))
    assert not torch.equal(alone, kron_psgd.probe(g[0], 8))


def test_psgd_norm_lower_bound_is_between_the_spectral_norm_over_root_k_and_it():
    """Against float64 ‖A‖₂ (eigenvalues) on symmetric PSD matrices and Kron's own function on each
    matrix of the stack (the same ops: bit for bit up to the stack's reductions)."""
    from pytorch_optimizer.optimizer.utils.psgd import norm_lower_bound as peer

    a = _psd(7, 1e3, seed=30, batch=(4,)) * 5.0
    bound = kron_psgd.norm_lower_bound(a).flatten()
    two = torch.linalg.eigvalsh(a)[:, -1]
    assert (bound <= two * (1 + 1e-14)).all() and (bound >= two / 7**0.5).all()
    for i in range(4):
        assert abs(bound[i].item() - peer(a[i].clone()).item()) <= 1e-15 * two[i].item()


def _lower_bound_cases() -> torch.Tensor:
    """(b, 6, 6) float64 matrices, not symmetric, that part the bound's ops: random ones of either sign, one
    whose largest column outweighs its largest row and its transpose (the other branch), ties between the
    two (a permutation matrix, a circulant, one whose two power steps differ), a rank-one x·yᵀ, a single
    entry, a scale near float64's largest and smallest, a diagonal and zero."""
    gen = torch.Generator().manual_seed(35)
    k = 6
    rand = torch.randn(6, k, k, generator=gen, dtype=F64)
    col = torch.randn(k, k, generator=gen, dtype=F64) * 0.1
    col[:, 2] = torch.arange(1.0, k + 1, dtype=F64)  # one heavy column
    x, y = torch.randn(2, k, 1, generator=gen, dtype=F64)
    perm = torch.eye(k, dtype=F64)[torch.randperm(k, generator=gen)] * torch.linspace(1, 2, k, dtype=F64)
    circ = torch.stack([torch.roll(torch.arange(1.0, k + 1, dtype=F64), s) for s in range(k)])
    tie = torch.zeros(k, k, dtype=F64)  # largest column and row of equal norm, their power steps apart
    tie[:4, :4] = torch.tensor([[1, -2, -2, -2], [0, 2, -1, 1], [1, 1, -1, 2], [-1, 0, 1, -2]], dtype=F64)
    one = torch.zeros(k, k, dtype=F64)
    one[1, 4] = -3.0
    mixed = rand[0] + rand[0].T + torch.triu(rand[1], 1) * 0.3
    return torch.stack([*rand, col, col.T, perm, circ, tie, x @ y.T, one, rand[2] * 1e300, rand[3] * 1e-300,
                        torch.diag(torch.linspace(-2, 1, k, dtype=F64)), mixed, torch.zeros(k, k, dtype=F64)])


def test_psgd_norm_lower_bound_holds_on_general_and_adversarial_matrices():
    """On matrices not symmetric (the fit passes a symmetric T₁ + T₂; the function's contract is any (b, k, k)):
    the bound lies between ‖A‖₂/√k and ‖A‖₂ (float64 ‖A‖₂ by torch.linalg.matrix_norm(ord=2), an SVD; 0 on the
    zero matrix), is the one power step from the largest column or row written out here (s·‖M·x̂‖ with
    x = Mᵀ·M[:, j]: M = Â and j its largest column, or M = Âᵀ and j Â's largest row where that is not smaller),
    and is Kron's own function's on each matrix; a stack's and one matrix's bounds are the same bits."""
    from pytorch_optimizer.optimizer.utils.psgd import norm_lower_bound as peer

    a = _lower_bound_cases()
    k = a.shape[-1]
    bound = kron_psgd.norm_lower_bound(a)
    assert bound.shape == (a.shape[0], 1, 1)
    bound = bound.flatten()
    two = torch.linalg.matrix_norm(a, ord=2)
    assert bound[-1] == 0 and two[-1] == 0
    assert (bound <= two * (1 + 1e-14)).all() and (bound >= two / k**0.5 * (1 - 1e-14)).all()
    for i in range(a.shape[0]):
        s = a[i].abs().max()
        hat = a[i] / s if s > 0 else a[i]
        cols, rows = (hat * hat).sum(0), (hat * hat).sum(1)
        m = hat if cols.max() > rows.max() else hat.T  # the largest column of Â, or of Âᵀ (Â's largest row)
        x = m.T @ m[:, cols.argmax() if m is hat else rows.argmax()]
        direct = s * torch.linalg.vector_norm(m @ (x / x.norm())) if s > 0 else s
        assert abs(bound[i] - direct) <= 1e-14 * two[i], i
        assert abs(bound[i] - peer(a[i].clone())) <= 1e-15 * two[i], i
        assert torch.equal(kron_psgd.norm_lower_bound(a[i:i + 1]).flatten(), bound[i:i + 1])


def test_psgd_precondition_is_the_kronecker_product_of_the_factors_grams():
    """P·G = Q_LᵀQ_L·G·Q_RᵀQ_R against the explicit (QᵀQ ⊗ ...) product on vec(G), a diagonal side
    as diag(q)²."""
    gen = torch.Generator().manual_seed(31)
    g = torch.randn(2, 4, 5, generator=gen, dtype=F64)
    ql = torch.triu(torch.randn(2, 4, 4, generator=gen, dtype=F64))
    qr = torch.randn(2, 5, generator=gen, dtype=F64)
    d = kron_psgd.precondition(g, ql, qr)
    for i in range(2):
        big = torch.kron(ql[i].T @ ql[i], torch.diag(qr[i] ** 2))  # row-major vec: P_L ⊗ P_R
        assert _rel(d[i].flatten(), big @ g[i].flatten()) < 1e-14


def test_psgd_fit_is_a_relative_gradient_step_on_the_criterion():
    """One fit step from Q = I with η: the triangular factor moves by −η·triu(A·Aᵀ − B·Bᵀ)/‖·‖ (A = G,
    B = V at the identity), and a small step lowers PSGD's criterion hᵀPh + vᵀP⁻¹v on the pair
    (written out with the explicit Kronecker product)."""
    gen = torch.Generator().manual_seed(32)
    g, v = torch.randn(2, 3, 4, 5, generator=gen, dtype=F64)
    ql, qr = kron_psgd.init_factors((3, 4, 5), dtype=F64)
    kron_psgd.fit(g, v, ql, qr, lr=0.1)
    t1, t2 = g @ g.mT, v @ v.mT
    lb = kron_psgd.norm_lower_bound(t1 + t2)
    torch.testing.assert_close(ql, torch.eye(4, dtype=F64) - 0.1 * torch.triu(t1 - t2) / lb, rtol=0, atol=1e-15)

    def criterion(ql, qr, i):
        p = torch.kron(ql[i].T @ ql[i], qr[i].T @ qr[i])
        h, w = g[i].flatten(), v[i].flatten()
        return (h @ p @ h + w @ torch.linalg.solve(p, w)).item()

    ql, qr = kron_psgd.init_factors((3, 4, 5), dtype=F64)
    before = [criterion(ql, qr, i) for i in range(3)]
    kron_psgd.fit(g, v, ql, qr, lr=0.01)
    assert all(criterion(ql, qr, i) < before[i] for i in range(3))


@pytest.mark.parametrize("scale", [1.0, 1e-19])
def test_psgd_fit_is_its_formula_written_out_with_its_guard(scale):
    """One fit step from random factors (Q_L triangular, Q_R diagonal: its side of 5 above max_dim 4) against
    the docstring's formula written out in float64 with explicit inverses: Q_L ← Q_L − η·triu(AAᵀ − BBᵀ)/(‖AAᵀ +
    BBᵀ‖ + tiny)·Q_L, q_R ← q_R − η·(t₁ − t₂)·q_R/(max|t₁ + t₂| + tiny) (t the column sums of A∘A, B∘B); at a
    scale of 1e-19 the terms are ~1e-38, of tiny's order, so the guard's sign and size show."""
    gen = torch.Generator().manual_seed(36)
    g, v = torch.randn(2, 3, 4, 5, generator=gen, dtype=F64) * scale
    ql = torch.eye(4, dtype=F64) + 0.3 * torch.triu(torch.randn(3, 4, 4, generator=gen, dtype=F64))
    qr = 1 + 0.3 * torch.rand(3, 5, generator=gen, dtype=F64)
    a = ql @ g @ torch.diag_embed(qr)
    b = torch.linalg.inv(ql).mT @ v @ torch.diag_embed(1 / qr)
    t1, t2 = a @ a.mT, b @ b.mT
    lr, tiny = 0.1, kron_psgd.TINY
    left = ql - lr * torch.triu(t1 - t2) / (kron_psgd.norm_lower_bound(t1 + t2) + tiny) @ ql
    c1, c2 = (a * a).sum(-2), (b * b).sum(-2)
    right = qr - lr * (c1 - c2) * qr / ((c1 + c2).abs().amax(-1, keepdim=True) + tiny)
    assert kron_psgd.diagonal(5, 4) and not kron_psgd.diagonal(4, 4)
    before = ql.clone(), qr.clone()
    kron_psgd.fit(g, v, ql, qr, lr=lr)
    assert _rel(ql, left) < 1e-12 and _rel(qr, right) < 1e-12
    assert _rel(ql, before[0]) > 1e-3 and _rel(qr, before[1]) > 1e-3  # a step the comparison sees


def test_psgd_balance_leaves_the_preconditioner_unchanged():
    """Q_L·c and Q_R/c with c = √(‖Q_R‖_max/‖Q_L‖_max) > 0 written out (a negative c would leave P and every
    fit the same, and flip the stored factors' signs), both largest entries then equal, P unchanged."""
    gen = torch.Generator().manual_seed(33)
    ql = torch.triu(torch.randn(2, 4, 4, generator=gen, dtype=F64)) * 100
    qr = torch.triu(torch.randn(2, 5, 5, generator=gen, dtype=F64)) / 100
    g = torch.randn(2, 4, 5, generator=gen, dtype=F64)
    before = kron_psgd.precondition(g, ql, qr)
    nl, nr = ql.abs().amax((-2, -1)), qr.abs().amax((-2, -1))
    c = (nr / nl).sqrt().view(-1, 1, 1)  # the docstring's c = √(‖Q_R‖_max/‖Q_L‖_max) > 0
    expected_l, expected_r = ql * c, qr / c
    kron_psgd.balance(ql, qr, g)
    assert _rel(kron_psgd.precondition(g, ql, qr), before) < 1e-14
    torch.testing.assert_close(ql.abs().amax((-2, -1)), qr.abs().amax((-2, -1)), rtol=1e-15, atol=0)
    torch.testing.assert_close(ql, expected_l, rtol=1e-14, atol=0)
    torch.testing.assert_close(qr, expected_r, rtol=1e-14, atol=0)


def test_psgd_a_stack_gives_each_matrix_the_bits_it_gets_alone():
    gen = torch.Generator().manual_seed(34)
    g, v = torch.randn(2, 3, 4, 6, generator=gen)
    for max_dim in (None, 5):
        ql, qr = kron_psgd.init_factors((3, 4, 6), max_dim)
        singles = [kron_psgd.init_factors((4, 6), max_dim) for _ in range(3)]
        for _ in range(2):
            kron_psgd.balance(ql, qr, g)
            kron_psgd.fit(g, v, ql, qr, lr=0.1)
            for i, (sl, sr) in enumerate(singles):
                kron_psgd.balance(sl, sr, g[i])
                kron_psgd.fit(g[i], v[i], sl, sr, lr=0.1)
        d = kron_psgd.cap_rms(kron_psgd.precondition(g, ql, qr))
        for i, (sl, sr) in enumerate(singles):
            assert torch.equal(ql[i], sl) and torch.equal(qr[i], sr)
            assert torch.equal(d[i], kron_psgd.cap_rms(kron_psgd.precondition(g[i], sl, sr)))


def _peer_kron(grads, probes, *, precision=F64, **hp) -> torch.Tensor:
    """pytorch-optimizer's ``Kron`` on ``grads`` from zeros, its probes replaced by ``probes`` (one per
    parameter and fit, in its order: its ``update_precondition`` is wrapped), its triangular solves
    kept in the parameters' dtype (it casts them to float32)."""
    from pytorch_optimizer.optimizer import psgd as peer

    draws = iter(probes.flatten(0, 1))
    update, solve = peer.update_precondition, peer.solve_triangular_right
    peer.update_precondition = lambda qs, ex, v, g, step, eps: update(qs, ex, next(draws), g, step, eps)
    peer.solve_triangular_right = lambda x, a: torch.linalg.solve_triangular(
        a, x.reshape(-1, x.size(-1)), upper=True, left=False).reshape_as(x)
    try:
        return _peer(pytorch_optimizer.Kron, grads, precondition_dtype=precision, **hp)
    finally:
        peer.update_precondition, peer.solve_triangular_right = update, solve


def _psgd(grads, probes, *, lr, momentum, precond_lr, every, max_dim=None, cap=kron_psgd.RMS_CAP) -> torch.Tensor:
    """Our PSGD-Kron on ``grads`` with ``probes`` (one per fit): debiased momentum, the factors balanced
    and fitted at steps every, 2·every, …, the update P·m̂ with its RMS capped."""
    x = torch.zeros(grads.shape[1:], dtype=F64)
    ql, qr = kron_psgd.init_factors(x.shape, max_dim, dtype=F64)
    m, fits = torch.zeros_like(x), iter(probes)
    for t, g in enumerate(grads, 1):
        m.mul_(momentum).add_(g, alpha=1 - momentum)
        h = m / (1 - momentum**t)
        if kron.refresh_due(t, every):
            kron_psgd.balance(ql, qr, h)
            kron_psgd.fit(h, next(fits), ql, qr, lr=precond_lr)
        x.sub_(kron_psgd.cap_rms(kron_psgd.precondition(h, ql, qr), cap), alpha=lr)
    return x


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("shape", ["square", "wide", "one-sided", "row"])
def test_psgd_matches_pytorch_optimizer_kron(shape, every):
    """pytorch-optimizer's ``Kron`` with a fixed update probability 1/every (its counter then fits at
    steps every, 2·every, …: our ``every``), ``max_size_triangular`` = max_dim (the 12-long side of the
    one-sided case keeps a diagonal factor; a 1 × 5 row's side of 1 is diagonal in both), the same probes
    (its draws replaced by ours), balancing at every fit (``balance_prob`` 1) or never (0: it leaves P
    unchanged, so the two agree within the same bound); gradients of RMS 5, so the cap acts."""
    dims, max_dim = SHAPES[shape] if shape != "row" else ((1, 5), None)
    grads = 5 * _grads(dims, seed=7)  # P·m̂ starts near m̂: RMS ≈ 5, above the cap of 1.1
    probes = torch.randn(STEPS // every, BUCKET, *dims, generator=torch.Generator().manual_seed(8), dtype=F64)
    lr, momentum = 0.02, 0.9
    hp = dict(lr=lr, momentum=momentum, pre_conditioner_update_probability=1 / every,
              max_size_triangular=max_dim or 8192)
    ours = dict(lr=lr, momentum=momentum, precond_lr=0.1, every=every, max_dim=max_dim)
    bound = 1e-13  # measured: 4e-16
    got = _psgd(grads, probes, **ours)
    for balance in (1.0, 0.0):
        assert _gap(got, _peer_kron(grads, probes, balance_prob=balance, **hp)) < bound
    peer = _peer_kron(grads, probes, balance_prob=1.0, **hp)
    for change in ({"momentum": 0.91}, {"precond_lr": 0.11}, {"cap": 1.2}):
        assert _gap(_psgd(grads, probes, **{**ours, **change}), peer) > 100 * bound, change
    if every == 1:
        assert _gap(_psgd(grads, probes[::2], **{**ours, "every": 2}), peer) > 100 * bound
