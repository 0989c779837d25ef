"""geomopt.geometry.polynomial's arithmetic against float64 computed here from D itself: the fused
first factor C₀ = scale·f·(aI + b·f²A + c·f⁴A²) (f from ‖D‖_F by the frobenius or the max
pre-normalization) and its overflow branch, the folded iteration with and without it against the
polynomial map of D's singular values, the scalar map against the polynomials expanded, and the
helpers' exact copies."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from geomopt.geometry import polynomial
from geomopt.spec.geometries import AolPrenorm, FrobeniusPrenorm, MaxPrenorm, NoPrenorm

FROBENIUS, MAX = FrobeniusPrenorm(eps=1e-3), MaxPrenorm(eps=1e-3)
#: a triple whose three coefficients differ in size and sign, so no swap of two terms is the same
ABC = (2.5, -1.25, 0.375)
MUON = (3.4445, -4.7750, 2.0315)


def _stack(shape: tuple, norms: tuple, seed: int) -> torch.Tensor:
    """A float32 stack of len(norms) matrices of ``shape`` with those Frobenius norms."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(len(norms), *shape, generator=gen, dtype=torch.float64)
    d = d / torch.linalg.matrix_norm(d, keepdim=True) * torch.tensor(norms, dtype=torch.float64)[:, None, None]
    return d.float()


def _f64(d: torch.Tensor, cfg) -> torch.Tensor:
    """f of each matrix in float64 from its ‖D‖_F: 1/(‖D‖ + ε) (frobenius), 1/max(‖D‖, ε) (max)."""
    norm = torch.linalg.matrix_norm(d.double())
    return 1 / (norm + cfg.eps) if cfg.kind == "frobenius" else 1 / norm.clamp(min=cfg.eps)


def _gram(d: torch.Tensor) -> torch.Tensor:
    """The small side's Gram matrix (wide: DDᵀ, tall: DᵀD)."""
    return d.mT @ d if d.shape[-2] > d.shape[-1] else d @ d.mT


def _first64(d: torch.Tensor, abc: tuple, scale: float, cfg) -> torch.Tensor:
    """C₀ = scale·f·(aI + b·f²A + c·f⁴A²) in float64 from D."""
    a, b, c = abc
    g = _gram(d.double())
    f = _f64(d, cfg)[:, None, None]
    eye = torch.eye(g.shape[-1], dtype=torch.float64)
    return scale * f * (a * eye + b * f ** 2 * g + c * f ** 4 * (g @ g))


def _first(d: torch.Tensor, abc: tuple, scale: float, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """first_factor_into run eagerly on D's float32 Gram matrix: (C₀, tr A)."""
    gram = _gram(d)
    out, sq = torch.full_like(gram, float("nan")), torch.full((len(d),), float("nan"))
    polynomial.first_factor_into(out, sq, gram, gram @ gram, *abc, scale, prenorm=cfg)
    return out, sq


def _hook(gram, gram2, abc, scale, prenorm):
    """The fused step's first-factor hook, eager (fused.first_factor compiles the same function)."""
    out, sq = torch.empty_like(gram), torch.empty(gram.shape[0])
    polynomial.first_factor_into(out, sq, gram, gram2, *abc, scale, prenorm=prenorm)
    return out


@pytest.mark.parametrize("cfg", [FROBENIUS, MAX], ids=["frobenius", "max"])
@pytest.mark.parametrize("shape", [(5, 9), (9, 5)], ids=["wide", "tall"])
def test_the_first_factor_is_the_float64_formula_from_d(cfg, shape):
    """Three matrices of norms 3, 0.02 and 0.0005 (ε = 1e-3: the max form's floor taken for the
    last, and ε weighs in the frobenius f of the last two): C₀ within float32 rounding of the float64
    formula, per matrix; tr A = ‖D‖²_F per matrix; the scale multiplies the whole factor."""
    d = _stack(shape, (3.0, 0.02, 0.0005), seed=0)
    for scale in (1.0, -0.75):
        got, sq = _first(d, ABC, scale, cfg)
        want = _first64(d, ABC, scale, cfg)
        for i in range(len(d)):
            err = (got[i].double() - want[i]).abs().max() / want[i].abs().max()
            assert err < 1e-5, (i, scale, err.item())
        torch.testing.assert_close(sq.double(), torch.linalg.matrix_norm(d.double()) ** 2, rtol=1e-5, atol=0)


def test_a_matrix_past_the_squares_range_gets_a_zero_factor_and_an_infinite_trace():
    """Entries past √max (float32): ‖D‖²_F overflows, f = 0, and C₀ of that matrix is exactly 0
    (NaN from ∞·0 zeroed), tr A is +∞ (the bucket's finiteness test), and the finite matrices of
    the same batch keep their own factor."""
    d = _stack((4, 6), (2.0, 1.0, 0.5), seed=1)
    d[1, 0, 0] = 1e20
    for cfg in (FROBENIUS, MAX):
        got, sq = _first(d, MUON, 1.0, cfg)
        assert torch.isinf(sq[1]) and sq[1] > 0 and torch.isfinite(sq[[0, 2]]).all()
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        want = _first64(d[[0, 2]], MUON, 1.0, cfg)
        assert ((got[[0, 2]].double() - want).abs().max() / want.abs().max()) < 1e-5


def _mapped64(d: torch.Tensor, coefficients: list, scale: float, f: torch.Tensor | None) -> torch.Tensor:
    """scale·U·p_k(…p_1(f·Σ))·Vᵀ in float64, the polynomials expanded from their coefficients (not
    through compose_polynomials)."""
    d64 = d.double() * (1.0 if f is None else f[:, None, None])
    u, sigma, vh = torch.linalg.svd(d64, full_matrices=False)
    for a, b, c in coefficients:
        sigma = a * sigma + b * sigma ** 3 + c * sigma ** 5
    return scale * u @ torch.diag_embed(sigma) @ vh


@pytest.mark.parametrize("cfg", [FROBENIUS, MAX, NoPrenorm()], ids=["frobenius", "max", "none"])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6)], ids=["wide", "tall"])
@pytest.mark.parametrize("hook", [False, True], ids=["folded", "first-factor"])
def test_the_folded_iteration_is_the_float64_polynomial_map(cfg, shape, hook):
    """_folded_iteration (inside folded(), with the fused first-factor hook or without) on a stack
    of three matrices: scale·p₃(p₂(p₁(f·D))) of the float64 SVD within float32 rounding, each
    matrix with its own f; the result in the out dtype asked; an empty schedule is scale·f·D."""
    norms = (1.0, 0.8, 0.6) if cfg.kind == "none" else (4.0, 0.3, 0.002)  # none: σ within p's range
    d = _stack(shape, norms, seed=2)
    coefficients = [MUON, ABC, (1.875, -1.25, 0.375)]
    f = None if cfg.kind == "none" else _f64(d, cfg)
    for scale, out_dtype in ((1.0, torch.float32), (-1.5, torch.float64)):
        with polynomial.folded(_hook if hook else None):
            got = polynomial.odd_quintic_iteration(d.clone(), coefficients, prenorm=cfg, scale=scale,
                                                   out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == d.shape
        want = _mapped64(d, coefficients, scale, f)
        assert (got.double() - want).abs().max() < 2e-5 * abs(scale), (scale, (got.double() - want).abs().max())
        with polynomial.folded(_hook if hook else None):
            empty = polynomial.odd_quintic_iteration(d.clone(), [], prenorm=cfg, scale=scale, out_dtype=out_dtype)
        torch.testing.assert_close(empty.double(), _mapped64(d, [], scale, f), rtol=1e-6, atol=1e-7)


def _aol64(d: torch.Tensor, eps: float) -> torch.Tensor:
    """S·D (wide) or D·S (tall) in float64, S = diag(max(Σⱼ |A_ij|, ε))^(−1/2) of the small side's A."""
    d64 = d.double()
    s = _gram(d64).abs().sum(-1).clamp(min=eps).rsqrt()
    return d64 * s[:, None, :] if d.shape[-2] > d.shape[-1] else d64 * s[:, :, None]


FORMS = {"muon-order": polynomial.odd_quintic_iteration,
         "folded": lambda x, coefficients, **kw: _in_folded(x, coefficients, **kw),
         "gram": lambda x, coefficients, **kw: polynomial.gram_quintic_iteration(x, coefficients, restarts=(1,), **kw)}


def _in_folded(x, coefficients, **kw):
    with polynomial.folded():
        return polynomial.odd_quintic_iteration(x, coefficients, **kw)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("cfg", [FROBENIUS, NoPrenorm(), AolPrenorm(eps=1e-3)], ids=["frobenius", "none", "aol"])
@pytest.mark.parametrize("steps", [0, 2], ids=["no-step", "two-steps"])
def test_every_form_scales_its_result_by_any_scale(form, cfg, steps):
    """The CPU's torch-Muon order, the folded form and the Gram form (restarted after its first
    step): scale·p₂(p₁(D̂)) for scales 1, 2, 0 and −1.5 (0: exactly zero; 2: not taken for 1), D̂ the
    frobenius, AOL or no pre-normalization of D in float64, an empty schedule included (scale·D̂),
    on a wide stack and a tall 2-D matrix."""
    coefficients = [MUON, ABC][:steps]
    for d in (_stack((6, 10), (1.0, 0.7), seed=4), _stack((10, 6), (0.9,), seed=5)[0]):
        stack = d if d.ndim == 3 else d[None]
        if cfg.kind == "aol":
            hat = _aol64(stack, cfg.eps)
        elif cfg.kind == "frobenius":
            hat = stack.double() * _f64(stack, cfg)[:, None, None]
        else:
            hat = stack.double()
        for scale in (1.0, 2.0, 0.0, -1.5):
            got = FORMS[form](d.clone(), coefficients, prenorm=cfg, scale=scale)
            want = _mapped64(hat, coefficients, scale, None).reshape(d.shape)
            assert got.shape == d.shape and got.dtype == d.dtype
            if scale == 0.0:
                assert torch.equal(got, torch.zeros_like(got)), (form, cfg.kind)
            else:
                err = ((got.double() - want).abs().max() / abs(scale)).item()
                assert err < 2e-5, (form, cfg.kind, scale, err)


@pytest.mark.parametrize("shape", [(7, 300), (16, 40), (40, 16)])
def test_a_matrix_runs_torch_muons_op_sequence_bit_for_bit(shape):
    """On the CPU a 2-D matrix takes torch.optim.Muon's op sequence (D/max(‖D‖, ε), addmm with β and
    α, a tall matrix transposed): the same bits as ``_zeropower_via_newtonschulz`` in bfloat16, and in
    float32 with its bfloat16 cast made a copy (a batched product of one matrix rounds (7, 300)
    differently in float32)."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    cfg = MaxPrenorm(eps=1e-7)
    got = polynomial.odd_quintic_iteration(g.bfloat16(), [MUON] * 5, prenorm=cfg)
    assert torch.equal(got, _zeropower_via_newtonschulz(g, MUON, 5, 1e-7))
    with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self.clone()):
        want = _zeropower_via_newtonschulz(g, MUON, 5, 1e-7)
    assert want.dtype == torch.float32
    assert torch.equal(polynomial.odd_quintic_iteration(g, [MUON] * 5, prenorm=cfg), want)


def test_the_scalar_map_is_the_polynomials_expanded():
    """compose_polynomials: p_k ∘ … ∘ p_1(σ), p(x) = ax + bx³ + cx⁵, against the powers written out."""
    sigma = torch.linspace(-1.2, 1.2, 41, dtype=torch.float64)
    coefficients = [MUON, ABC, (0.5, 2.0, -3.0)]
    want = sigma
    for a, b, c in coefficients:
        want = a * want + b * want.pow(3) + c * want.pow(5)
    torch.testing.assert_close(polynomial.compose_polynomials(coefficients, sigma), want, rtol=1e-13, atol=1e-13)


def test_the_transposed_copy_and_the_typed_product_are_exact():
    """_transposed_copy: x.mT matrix by matrix, contiguous, the same bits (a stack with two leading
    dims, non-square); _bmm_into: a @ b in the out dtype, the same bits as the product cast."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 7, generator=gen)
    t = polynomial._transposed_copy(x)
    assert t.shape == (2, 3, 7, 4) and t.is_contiguous() and torch.equal(t, x.mT)
    a, b = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 5, 2, generator=gen)
    assert torch.equal(polynomial._bmm_into(a, b, torch.float32), a @ b)
    wide = polynomial._bmm_into(a, b, torch.float64)
    assert wide.dtype == torch.float64 and torch.equal(wide, (a @ b).double())
