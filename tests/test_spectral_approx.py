"""Spectral approximations: exact paths agree, polynomial paths match torch.optim.Muon and their
scalar maps, pre-normalization, realized references."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim._muon import _zeropower_via_newtonschulz

import typed_fragments as typed
from geomopt.geometry import make_reference, realized_reference
from geomopt.geometry.polynomial import compose_polynomials
from geomopt.geometry.prenorm import prenormalize
from geomopt.geometry.spectral import APPROX_OPS, apply_approx, gram_eigh, newton_schulz, polar_express, svd
from geomopt.support import (
    MUON_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    SPEEDRUN_COEFFICIENTS,
    newton_schulz_coefficients,
    polar_express_coefficients,
)

F64 = torch.float64
REFS = [
    {"kind": "log_barrier", "eps": 1e-2},
    {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3},
    {"kind": "quadratic"},
    {"kind": "indicator"},
]


def with_singular_values(s: torch.Tensor, m: int, n: int, seed: int = 0) -> torch.Tensor:
    """U·Diag(s)·Vᵀ with Haar-ish random orthogonal U (m×r), V (n×r), r = len(s), float64."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=F64))
    return (u * s) @ v.T


def rank_deficient(m: int, n: int, r: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g, dtype=F64) @ torch.randn(r, n, generator=g, dtype=F64)


# ---------------------------------------------------------------- exact paths


@pytest.mark.parametrize("ref", REFS, ids=lambda r: r["kind"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(7, 12, dtype=F64, generator=torch.Generator().manual_seed(1)),
        lambda: torch.randn(12, 7, dtype=F64, generator=torch.Generator().manual_seed(2)),
        lambda: torch.randn(3, 9, 9, dtype=F64, generator=torch.Generator().manual_seed(3)),
        lambda: rank_deficient(10, 6, 2),
        lambda: rank_deficient(5, 11, 3),
        lambda: torch.zeros(4, 6, dtype=F64),
    ],
    ids=["wide", "tall", "batched-square", "rank2-tall", "rank3-wide", "zero"],
)
def test_svd_equals_gram_eigh_float64(ref, make):
    d = make()
    r = make_reference(typed.reference(ref))
    torch.testing.assert_close(gram_eigh(d, r), svd(d, r), rtol=1e-7, atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 10),
    n=st.integers(1, 10),
    batch=st.lists(st.integers(1, 3), max_size=2),
    rank=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_svd_equals_gram_eigh_shapes(m, n, batch, rank, seed):
    g = torch.Generator().manual_seed(seed)
    r = min(rank, m, n)
    d = torch.randn(*batch, m, r, generator=g, dtype=F64) @ torch.randn(*batch, r, n, generator=g, dtype=F64)
    ref = make_reference(typed.reference({"kind": "log_barrier", "eps": 1e-3}))
    torch.testing.assert_close(gram_eigh(d, ref), svd(d, ref), rtol=1e-7, atol=1e-8)


def test_svd_maps_singular_values_by_dual_grad():
    """U·Diag((h*)'(σ))·Vᵀ: the output's singular values are (h*)'(σ) (h* increasing on σ ≥ 0)."""
    s = torch.tensor([3.0, 1.0, 0.2, 1e-3], dtype=F64)
    d = with_singular_values(s, 6, 9)
    ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": 4, "eps": 1e-2}))
    out = svd(d, ref)
    torch.testing.assert_close(torch.linalg.svdvals(out)[:4], ref.dual_grad(s), rtol=1e-12, atol=1e-14)
    assert torch.linalg.svdvals(out)[4:].max() < 1e-14  # rank is kept: (h*)'(0) = 0


def test_gram_eigh_defaults_to_float64_and_returns_input_dtype():
    d = torch.randn(20, 30)
    ref = make_reference(typed.reference({"kind": "indicator"}))
    out = gram_eigh(d, ref)
    assert out.dtype == torch.float32
    exact = svd(d.double(), ref)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-6)
    # fp32 Gram matrices lose √u·σ_max: visibly worse than the float64 default.
    err32 = (gram_eigh(d, ref, dtype="float32").double() - exact).abs().max()
    assert err32 > 10 * (out.double() - exact).abs().max()


@pytest.mark.parametrize("kind", ["svd", "gram_eigh"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exact_approximations_map_a_nonfinite_matrix_to_nan(kind, dtype):
    """A matrix holding a NaN or ±∞ (a NaN gradient under ``on_nonfinite: off``) maps to NaN, as
    through the polynomial iterations' matmuls, where LAPACK raised; the batch's finite matrices
    map as alone, bit for bit."""
    ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": 4, "eps": 1e-2}))
    d = torch.randn(3, 6, 4, dtype=dtype, generator=torch.Generator().manual_seed(2))
    d[1, 0, 3], d[2, 5, 0] = math.nan, -math.inf
    got = APPROX_OPS[kind](d, ref)
    assert torch.equal(got[:1], APPROX_OPS[kind](d[:1], ref))
    assert got[1:].isnan().all()


# ---------------------------------------------------------------- Newton–Schulz vs torch.optim.Muon


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (24, 24), (3, 50)])
def test_newton_schulz_default_matches_torch_muon_fp32(shape):
    """Muon's algorithm run in fp32 (its bf16 cast neutralized) vs our default on CPU (fp32)."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self.clone()):
        want = _zeropower_via_newtonschulz(g, MUON_COEFFICIENTS, 5, 1e-7)
    assert want.dtype == torch.float32
    got = newton_schulz(g)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (32, 32)])
def test_newton_schulz_bf16_reproduces_torch_muon(shape):
    """With dtype bfloat16 and torch's D/max(‖D‖, ε) pre-normalization the op sequence is Muon's."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    want = _zeropower_via_newtonschulz(g, MUON_COEFFICIENTS, 5, 1e-7).float()
    got = newton_schulz(g, dtype="bfloat16", prenormalize=typed.prenorm({"kind": "max", "eps": 1e-7}))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_newton_schulz_singular_values_end_in_muon_band():
    """Muon's quintic is non-convergent: σ (normalized σ ≥ 0.05) ends in ≈ [0.68, 1.13] (geomopt.geometry.spectral)."""
    s = torch.logspace(math.log10(0.05), 0, 12, dtype=F64)
    d = with_singular_values(s / s.norm(), 12, 20)
    out = torch.linalg.svdvals(newton_schulz(d))
    assert out.min() > 0.67 and out.max() < 1.14


def test_batched_and_transposed_iterations_agree(monkeypatch):
    g = torch.Generator().manual_seed(3)
    d = torch.randn(4, 9, 5, generator=g, dtype=F64)
    for fn in (newton_schulz, polar_express):
        batched = fn(d)
        torch.testing.assert_close(batched, torch.stack([fn(x) for x in d]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fn(d.mT), batched.mT, rtol=1e-12, atol=1e-12)
    # the iteration from the right (CUDA's form for tall matrices: no transposed copies) is the same map
    import geomopt.geometry.polynomial as spectral_module

    monkeypatch.setattr(spectral_module, "_MUON_ORDER_DEVICES", ())
    for fn in (newton_schulz, polar_express):
        torch.testing.assert_close(fn(d), torch.stack([fn(x) for x in d]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fn(d.mT).mT, fn(d), rtol=1e-12, atol=1e-12)
    monkeypatch.undo()
    torch.testing.assert_close(fn(d), batched, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [newton_schulz, polar_express], ids=lambda f: f.__name__)
@pytest.mark.parametrize("decades, bound", [(3, 1.05), (1, 2.5)])
@pytest.mark.parametrize("shape", [(96, 256), (256, 96), (128, 128)])
def test_copy_free_iteration_error_in_bf16(shape, decades, bound, fn, monkeypatch):
    """CUDA's form of the iteration (from the right for tall X; pre-normalization, a·I and the
    scale folded into the small factor) rounds differently from Muon's op sequence in bf16.
    Against the float64 iteration: no worse where σ spans three decades, as gradients' do
    (measured 0.84–0.97× Muon's error); up to 2.2× worse where σ spans one decade (measured
    1.4–2.2×: rounding a + (bA + cA²)ᵢᵢ to bf16 costs the diagonal its low bits, where Muon adds
    a·X in the product's fp32 epilogue at the price of copying X each step)."""
    import geomopt.geometry.polynomial as spectral_module

    m, n = shape
    s = torch.logspace(0, -decades, min(m, n), dtype=F64)
    errs = {"muon": 0.0, "free": 0.0}
    for seed in range(3):
        d = with_singular_values(s, m, n, seed=seed)
        exact = fn(d)
        muon_form = fn(d, dtype="bfloat16").double()
        monkeypatch.setattr(spectral_module, "_MUON_ORDER_DEVICES", ())
        free_form = fn(d, dtype="bfloat16").double()
        monkeypatch.undo()
        assert not torch.equal(free_form, muon_form)  # the other op sequence did run
        errs["muon"] += float((muon_form - exact).norm() / exact.norm())
        errs["free"] += float((free_form - exact).norm() / exact.norm())
    assert errs["free"] <= bound * errs["muon"], errs


@pytest.mark.parametrize("prenorm", [{"kind": "frobenius", "eps": 1e-7}, {"kind": "max", "eps": 1e-7},
                                     {"kind": "none"}], ids=lambda c: c["kind"])
@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (3, 6, 4), (2, 4, 9)])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_folded_iteration_is_the_same_map(prenorm, shape, steps, monkeypatch):
    """CUDA's form folds the pre-normalization (‖D‖²_F = tr A₁), the output scale and the output
    dtype into the small factors and the last product; in float64 it is the same map as the
    normalize-then-iterate form, for every pre-normalization, both orientations, batched or not."""
    import geomopt.geometry.polynomial as spectral_module

    g = torch.Generator().manual_seed(11)
    d = torch.randn(shape, generator=g, dtype=F64) * 3.0
    if prenorm["kind"] == "none":
        d = d / d.norm(dim=(-2, -1), keepdim=True)  # the iteration needs σ ≤ 1
    coeffs = newton_schulz_coefficients(steps)
    kw = dict(prenorm=typed.prenorm(prenorm), scale=-2.5, out_dtype=torch.float32)
    before = d.clone()
    want = spectral_module.odd_quintic_iteration(d, coeffs, **kw)
    monkeypatch.setattr(spectral_module, "_MUON_ORDER_DEVICES", ())
    got = spectral_module.odd_quintic_iteration(d, coeffs, **kw)
    assert got.dtype == want.dtype == torch.float32 and got.shape == d.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(d, before)  # the input is read, never written


def test_folded_iteration_leaves_its_input_alone(monkeypatch):
    import geomopt.geometry.polynomial as spectral_module

    monkeypatch.setattr(spectral_module, "_MUON_ORDER_DEVICES", ())
    d = torch.randn(3, 8, 5, dtype=torch.bfloat16)
    before = d.clone()
    newton_schulz(d, dtype="bfloat16")
    assert torch.equal(d, before)


def test_product_into_a_wider_dtype_where_bmm_cannot():
    """:func:`_bmm_into` writes fp32 from bf16 operands: natively where torch's bmm takes
    ``out_dtype`` (CUDA), else by rounding to bf16 and casting (CPU), which this checks."""
    from geomopt.geometry.polynomial import _OUT_DTYPE_BMM, _bmm_into

    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 6, 4, generator=g).bfloat16()
    b = torch.randn(2, 4, 5, generator=g).bfloat16()
    out = _bmm_into(a, b, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, (a @ b).float())
    assert _OUT_DTYPE_BMM[("cpu", torch.bfloat16, torch.float32)] is False
    assert _bmm_into(a, b, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["svd", "gram_eigh", "newton_schulz", "polar_express"])
def test_scale_and_out_dtype_fold_into_every_approximation(kind):
    """``apply_approx(..., scale=r, out_dtype=…)`` is r·∇φ*(x) in that dtype (the optimizer's
    radius, folded into σ maps and small factors instead of a pass over the result)."""
    g = torch.Generator().manual_seed(4)
    d = torch.randn(2, 6, 9, generator=g, dtype=torch.float32)
    ref = make_reference(typed.reference({"kind": "log_barrier", "eps": 1e-2}))
    plain = apply_approx(d, ref, typed.approx({"kind": kind}))
    scaled = apply_approx(d, ref, typed.approx({"kind": kind}), scale=-3.0, out_dtype=torch.float64)
    assert scaled.dtype == torch.float64
    torch.testing.assert_close(scaled, -3.0 * plain.double(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- Polar Express


def _normalized_spectrum_case(lo: float = 1e-3):
    s = torch.logspace(math.log10(lo), 0, 16, dtype=F64)
    s = s / s.norm()  # Frobenius pre-normalization then leaves σ unchanged (up to ε = 1e-7)
    return s, with_singular_values(s * 5.0, 16, 24, seed=4)  # any scale: pre-normalization removes it


@pytest.mark.parametrize("coefficients", ["polar_express", "speedrun"])
@pytest.mark.parametrize("steps", [1, 3, 5, 7])
def test_polar_express_acts_on_singular_values_by_the_scalar_map(coefficients, steps):
    s, d = _normalized_spectrum_case()
    out = polar_express(d, steps=steps, coefficients=coefficients)
    coeffs = polar_express_coefficients(steps, coefficients)
    want = compose_polynomials(coeffs, s / (1 + 1e-7 / 5.0)).abs().sort(descending=True).values
    torch.testing.assert_close(torch.linalg.svdvals(out), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "steps,lo,hi",
    [(5, 0.84, 1.13), (6, 0.99, 1.002), (7, 0.9999, 1.0000001), (8, 1 - 1e-9, 1 + 1e-9)],
)
def test_polar_express_maps_normalized_spectrum_into_a_band_around_one(steps, lo, hi):
    """σ ∈ [1e-3, 1] (after pre-normalization) lands in a band that tightens with the steps."""
    s, _ = _normalized_spectrum_case()
    sigma = torch.linspace(1e-3, 1, 5001, dtype=F64)
    y = compose_polynomials(polar_express_coefficients(steps), sigma)
    assert lo <= y.min() and y.max() <= hi
    d = with_singular_values(torch.logspace(-3, 0, 20, dtype=F64) * 0.2, 20, 30)
    out = torch.linalg.svdvals(polar_express(d, steps=steps))
    # the matrix path sees σ/‖D‖_F, some below 1e-3: only the top of the band is guaranteed
    assert out.max() <= hi


def test_polar_express_list_sources():
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8 and len(SPEEDRUN_COEFFICIENTS) == 5
    a0, b0, c0 = POLAR_EXPRESS_COEFFICIENTS[0]
    assert (a0 * 1.01, b0 * 1.01**3, c0 * 1.01**5) == pytest.approx((8.28721201814563, -23.595886519098837, 17.300387312530933))
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (1.875, -1.25, 0.375)  # the fixed point, unscaled
    # steps past the list repeat its last triple
    ten = polar_express_coefficients(10)
    assert ten[:8] == list(POLAR_EXPRESS_COEFFICIENTS) and ten[8:] == [POLAR_EXPRESS_COEFFICIENTS[-1]] * 2
    assert polar_express_coefficients(7, "speedrun")[5:] == [SPEEDRUN_COEFFICIENTS[-1]] * 2
    user = [[3.0, -3.2, 1.2], [2.0, -1.5, 0.5]]
    assert polar_express_coefficients(4, user) == [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5)]
    with pytest.raises(ValueError, match="unknown coefficient list"):
        polar_express_coefficients(5, "polar")


def test_newton_schulz_coefficient_forms():
    assert newton_schulz_coefficients(3) == [MUON_COEFFICIENTS] * 3
    assert newton_schulz_coefficients(2, [[1.5, -0.5, 0.0]]) == [(1.5, -0.5, 0.0)] * 2
    per_step = [[3.0, -3.0, 1.0], [2.0, -1.5, 0.5]]
    assert newton_schulz_coefficients(2, per_step) == [tuple(t) for t in per_step]
    with pytest.raises(ValueError, match="1 or steps=3"):
        newton_schulz_coefficients(3, per_step)
    # the cubic (1.5, −0.5) converges to the polar factor
    d = with_singular_values(torch.tensor([1.0, 0.6, 0.3], dtype=F64), 5, 7)
    out = newton_schulz(d, steps=30, coefficients=[[1.5, -0.5, 0.0]], prenormalize=typed.prenorm({"kind": "none"}))
    torch.testing.assert_close(torch.linalg.svdvals(out)[:3], torch.ones(3, dtype=F64), rtol=0, atol=1e-10)


# ---------------------------------------------------------------- realized references


@pytest.mark.parametrize(
    "approx,design_eps",
    [
        ({"kind": "polar_express", "steps": 5}, 1.05e-3),
        ({"kind": "polar_express", "steps": 6}, 5.8e-4),
        ({"kind": "polar_express", "steps": 7}, 3.2e-4),
        ({"kind": "newton_schulz", "steps": 5}, 2e-3),
    ],
)
def test_realized_reference_matches_design(approx, design_eps):
    got = realized_reference(approx)
    assert got["kind"] == "power_barrier" and got["kappa"] == 4.0
    assert got["eps"] == pytest.approx(design_eps, rel=0.15)


def test_realized_eps_is_the_inverse_slope_at_zero():
    for approx in ({"kind": "polar_express", "steps": 6, "coefficients": "speedrun"}, {"kind": "newton_schulz", "steps": 4}):
        coeffs = (polar_express_coefficients(6, "speedrun") if approx["kind"] == "polar_express" else newton_schulz_coefficients(4))
        x = torch.tensor([1e-12], dtype=F64)
        slope = (compose_polynomials(coeffs, x) / x).item()
        assert realized_reference(approx)["eps"] == pytest.approx(1 / slope, rel=1e-9)
    assert realized_reference({"kind": "svd"}) is None and realized_reference({"kind": "gram_eigh", "dtype": "auto"}) is None


# ---------------------------------------------------------------- pre-normalization


@pytest.mark.parametrize("kind", sorted(APPROX_OPS))
@pytest.mark.parametrize(
    "cfg,scale,magnitudes",
    [
        ({"kind": "frobenius", "eps": 1e-7}, lambda n: n + 1e-7, (1e-9, 1.0, 30.0)),
        ({"kind": "max", "eps": 1e-7}, lambda n: n.clamp(min=1e-7), (1e-9, 1.0, 30.0)),
        ({"kind": "max", "eps": 10.0}, lambda n: n.clamp(min=10.0), (1e-9, 1.0, 30.0)),
        # without pre-normalization the polynomial iterations need σ ≲ 1 to stay finite
        ({"kind": "none"}, lambda n: torch.ones_like(n), (1e-9, 0.05, 0.12)),
    ],
    ids=["frobenius", "max", "max-large-eps", "none"],
)
def test_prenormalize_is_the_same_map_for_every_approx(kind, cfg, scale, magnitudes):
    """Every approx applied with ``prenormalize`` equals it applied, without, to D/scale(‖D‖_F),
    norms per matrix of the batch."""
    g = torch.Generator().manual_seed(5)
    d = torch.randn(3, 6, 8, generator=g, dtype=F64) * torch.tensor(magnitudes, dtype=F64).view(3, 1, 1)
    norms = torch.linalg.vector_norm(d, dim=(-2, -1), keepdim=True)
    ref = make_reference(typed.reference({"kind": "log_barrier", "eps": 1e-2}))
    got = APPROX_OPS[kind](d, ref, prenormalize=typed.prenorm(cfg))
    want = APPROX_OPS[kind](d / scale(norms), ref, prenormalize=typed.prenorm({"kind": "none"}))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_prenormalize_defaults():
    d = torch.full((2, 3), 4.0, dtype=F64)
    # None = frobenius for the polynomial iterations, none for the exact paths
    torch.testing.assert_close(prenormalize(d, None, "polar_express"), d / (d.norm() + 1e-7))
    assert prenormalize(d, None, "svd") is d
    torch.testing.assert_close(prenormalize(d, typed.prenorm({"kind": "frobenius", "eps": 1e-3})),
                               d / (d.norm() + 1e-3))
    with pytest.raises(ValueError, match="Input tag 'spectral'.*expected tags: 'frobenius'"):
        typed.prenorm({"kind": "spectral"})  # refused where a dict enters, by the spec's model


def test_apply_approx_dispatch_and_errors():
    d = torch.randn(4, 5, dtype=F64)
    ref = make_reference(typed.reference({"kind": "indicator"}))
    torch.testing.assert_close(apply_approx(d, ref, None), svd(d, ref))
    torch.testing.assert_close(apply_approx(d, None, typed.approx({"kind": "polar_express", "steps": 6})),
                               polar_express(d, steps=6))
    with pytest.raises(ValueError, match="Input tag 'eig'.*expected tags: 'svd'"):
        typed.approx({"kind": "eig"})  # refused where a dict enters, by the spec's model
    with pytest.raises(ValueError, match="needs a reference"):
        apply_approx(d, None, typed.approx({"kind": "gram_eigh"}))


def test_module_docstring_table_of_realized_eps_is_current():
    """The ε table in geomopt.geometry.spectral's docstring equals what realized_reference computes."""
    import geomopt.geometry.spectral as spectral_module

    rows = {}
    for line in spectral_module.__doc__.splitlines():
        parts = line.split()
        if parts and parts[0] in ("polar_express", "speedrun", "newton_schulz") and "(" in parts[1]:
            rows[parts[0]] = [float(v) for v in parts[-4:]]  # table rows: "name (source)  ε5 ε6 ε7 ε8"
    assert set(rows) == {"polar_express", "speedrun", "newton_schulz"}
    for name, values in rows.items():
        for steps, shown in zip((5, 6, 7, 8), values):
            if name == "newton_schulz":
                approx = {"kind": "newton_schulz", "steps": steps, "coefficients": None}
            else:
                approx = {"kind": "polar_express", "steps": steps, "coefficients": name}
            assert realized_reference(approx)["eps"] == pytest.approx(shown, rel=5e-3)
