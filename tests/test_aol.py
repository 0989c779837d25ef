"""AOL pre-normalization (``prenormalize: aol``, Turbo-Muon's start of Newton–Schulz) and the named
Newton–Schulz coefficient sets: the arithmetic against float64 references of the same formula, the
three device forms of the iteration against each other, the transcription of Turbo-Muon's code
(tests/catalog_eo.py) bit for bit, and σ_max ≤ 1 after the rescaling."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomopt.geometry.polynomial import _folded_iteration, gram_quintic_iteration, odd_quintic_iteration
from geomopt.geometry.prenorm import prenormalize
from geomopt.geometry.spectral import gram_newton_schulz, newton_schulz
from geomopt.support import (MUON_COEFFICIENTS, NEWTON_SCHULZ_SETS, POLAR_EXPRESS_COEFFICIENTS, approx_coefficients,
                             newton_schulz_coefficients)

sys.path.insert(0, str(Path(__file__).parent))
import catalog_eo  # noqa: E402
import typed_fragments as typed  # noqa: E402

AOL = typed.prenorm({"kind": "aol", "eps": 1e-7})
TURBO_MUON = Path(__file__).resolve().parents[1] / "specs" / "catalog" / "turbo-muon.yaml"


def aol_reference(d: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """S·D (tall D: D·S) in float64, matrix by matrix and entry by entry from the definition
    s_i = max(Σⱼ |A_ij|, ε)^(−1/2), A the Gram matrix of the smaller side."""
    d64 = d.double()
    out = torch.empty_like(d64)
    for idx in itertools.product(*(range(k) for k in d.shape[:-2])):
        x = d64[idx]
        tall = x.shape[0] > x.shape[1]
        w = x.T if tall else x
        a = w @ w.T
        s = [1.0 / math.sqrt(max(sum(abs(float(a[i, j])) for j in range(a.shape[1])), eps)) for i in range(a.shape[0])]
        scaled = torch.tensor(s, dtype=torch.float64)[:, None] * w
        out[idx] = scaled.T if tall else scaled
    return out


def iterate_reference(d: torch.Tensor, coefficients, eps: float = 1e-7) -> torch.Tensor:
    """p_k(…p_1(S·D)) in float64 with every Gram matrix formed afresh: X ← aX + (bA + cA²)X."""
    x = aol_reference(d, eps)
    for a, b, c in coefficients:
        g = x @ x.mT
        x = a * x + (b * g + c * g @ g) @ x
    return x


@pytest.mark.parametrize("shape", [(3, 5, 9), (3, 9, 5), (2, 6, 6), (7, 4)])
def test_aol_rescaling_is_the_formula(shape):
    torch.manual_seed(0)
    d = torch.randn(*shape) * torch.logspace(-3, 3, shape[-1])  # columns of six decades
    torch.testing.assert_close(prenormalize(d, AOL).double(), aol_reference(d), rtol=2e-6, atol=0)
    d64 = d.double()
    torch.testing.assert_close(prenormalize(d64, AOL), aol_reference(d64), rtol=1e-13, atol=0)


def test_aol_eps_floors_the_row_sums():
    """A zero row stays zero (s = ε^(−1/2)); a row whose sum is below ε is scaled by ε^(−1/2), not more."""
    d = torch.zeros(3, 8, dtype=torch.float64)
    d[1] = 1e-6
    out = prenormalize(d, typed.prenorm({"kind": "aol", "eps": 1e-3}))
    assert torch.equal(out[0], torch.zeros(8, dtype=torch.float64))
    torch.testing.assert_close(out[1], d[1] / math.sqrt(1e-3), rtol=1e-14, atol=0)


@st.composite
def matrices(draw):
    b, m, n = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    seed, decades = draw(st.integers(0, 2**31 - 1)), draw(st.integers(-6, 6))
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(b, m, n, generator=g, dtype=torch.float64) * 10.0**decades
    if draw(st.booleans()):  # rank one, or a zero row and column
        d = d[..., :1] * d[..., :1, :] if draw(st.booleans()) else d.index_fill(-2, torch.tensor([0]), 0.0)
    return d


@settings(max_examples=80, deadline=None)
@given(matrices())
def test_aol_bounds_the_spectral_norm_by_one(d):
    """σ_max(S·D) ≤ 1 for every D (Prach & Lampert 2022, Theorem 1), in float64 and in float32."""
    assert torch.linalg.matrix_norm(prenormalize(d, AOL), ord=2).max() <= 1 + 1e-12
    assert torch.linalg.matrix_norm(prenormalize(d.float(), AOL).double(), ord=2).max() <= 1 + 1e-5


@pytest.mark.parametrize("shape", [(3, 5, 9), (3, 9, 5), (2, 6, 6), (2, 3, 4, 7)])
@pytest.mark.parametrize("steps", [1, 4, 5])
def test_every_form_of_the_iteration_is_the_reference(shape, steps):
    """The CPU op sequence, the folded (CUDA) form and the Gram form, restarted or not, with AOL and
    the ``aol`` set, equal the float64 reference (the first step's reuse of S·A·S included)."""
    torch.manual_seed(1)
    d = torch.randn(*shape, dtype=torch.float64)
    coeffs = newton_schulz_coefficients(steps, "aol")
    want = iterate_reference(d, coeffs) * -2.5
    kw = dict(prenorm=AOL, scale=-2.5, out_dtype=torch.float64)
    torch.testing.assert_close(odd_quintic_iteration(d, coeffs, **kw), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_folded_iteration(d, coeffs, AOL, -2.5, torch.float64), want, rtol=1e-10, atol=1e-12)
    for restarts in ((), (2,), (1, 3)):
        got = gram_quintic_iteration(d, coeffs, restarts=restarts, **kw)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    for zero_steps in (odd_quintic_iteration(d, [], prenorm=AOL), _folded_iteration(d, [], AOL, 1.0, torch.float64),
                       gram_quintic_iteration(d, [], prenorm=AOL)):
        torch.testing.assert_close(zero_steps, aol_reference(d), rtol=1e-13, atol=0)


@pytest.mark.parametrize("shape", [(16, 32), (32, 16), (24, 24), (3, 16, 32), (3, 32, 16)])
def test_newton_schulz_with_aol_is_turbo_muons_code_bit_for_bit(shape):
    """newton_schulz(steps=4, coefficients=aol, prenormalize=aol) in float32 on the CPU is the
    transcription of Turbo-Muon's iteration to the last bit; gram_newton_schulz is within fp32."""
    torch.manual_seed(2)
    d = torch.randn(*shape)
    want = catalog_eo.aol_newton_schulz(d, catalog_eo.AOL, 4)
    assert torch.equal(newton_schulz(d, steps=4, coefficients="aol", prenormalize=AOL), want)
    torch.testing.assert_close(gram_newton_schulz(d, steps=4, coefficients="aol", prenormalize=AOL), want,
                               rtol=0, atol=2e-6)
    # a different last coefficient is seen
    bumped = [*catalog_eo.AOL[:3], (2.7215, -3.0494, 1.3170)]
    assert not torch.equal(newton_schulz(d, steps=4, coefficients=bumped, prenormalize=AOL), want)


def test_aol_starts_closer_to_orthogonal_than_frobenius():
    """On square Gaussian matrices (σ down to ~σ_max/n) AOL's start has σ_min ≥ 2× the Frobenius
    start's, so four steps of the same ``aol`` set end nearer the polar factor UVᵀ."""
    torch.manual_seed(3)
    d = torch.randn(4, 256, 256, dtype=torch.float64)
    fro = typed.prenorm({"kind": "frobenius", "eps": 1e-7})
    smin = [torch.linalg.svdvals(prenormalize(d, cfg))[..., -1] for cfg in (AOL, fro)]
    assert bool((smin[0] >= 2 * smin[1]).all())
    u, _, vh = torch.linalg.svd(d)
    polar = u @ vh

    def err(cfg):
        return float((newton_schulz(d, steps=4, coefficients="aol", prenormalize=cfg) - polar).norm() / polar.norm())

    assert err(AOL) < 0.6 * err(fro)


def test_aol_overflow_and_nonfinite():
    """Entries past √max overflow the Gram matrix: their rows map to 0 (as frobenius maps the whole
    matrix to 0), never to NaN; a NaN in D stays NaN (the step's finite check catches it)."""
    d = torch.randn(4, 6)
    d[1] *= 1e30
    for fn in (lambda x: newton_schulz(x, steps=4, coefficients="aol", prenormalize=AOL),
               lambda x: _folded_iteration(x, newton_schulz_coefficients(4, "aol"), AOL, 1.0, torch.float32),
               lambda x: gram_newton_schulz(x, steps=4, coefficients="aol", prenormalize=AOL)):
        out = fn(d)
        assert torch.isfinite(out).all()
        assert torch.equal(out[1], torch.zeros(6))
        bad = d.clone()
        bad[0, 0] = math.nan
        assert torch.isnan(fn(bad)).any()


def test_named_coefficient_sets():
    """The package's sets and its iteration rule: simple, quintic and aol cycle, polar_express and
    cans repeat their last triple; polar_express is the 1.01 list to within 1e-4 (4 decimals)."""
    assert newton_schulz_coefficients(3, "simple") == [MUON_COEFFICIENTS] * 3 == newton_schulz_coefficients(3)
    assert newton_schulz_coefficients(5, "aol") == [*catalog_eo.AOL, catalog_eo.AOL[0]]
    assert newton_schulz_coefficients(7, "quintic") == [*catalog_eo.QUINTIC, *catalog_eo.QUINTIC[:2]]
    assert newton_schulz_coefficients(7, "cans") == [*catalog_eo.CANS, catalog_eo.CANS[-1], catalog_eo.CANS[-1]]
    pe = newton_schulz_coefficients(10, "polar_express")
    assert pe[8:] == [pe[7]] * 2
    assert max(abs(u - v) for p, q in zip(pe, POLAR_EXPRESS_COEFFICIENTS) for u, v in zip(p, q)) < 1e-4
    assert newton_schulz_coefficients(2, "cans") == list(NEWTON_SCHULZ_SETS["cans"][:2])
    assert approx_coefficients({"kind": "gram_newton_schulz", "steps": 4, "coefficients": "aol"}) == catalog_eo.AOL
    with pytest.raises(ValueError, match="unknown coefficient set 'turbo'"):
        newton_schulz_coefficients(4, "turbo")


def test_explain_and_the_dsl_show_the_set_and_aol(capsys):
    """``geomopt explain`` names the coefficient set and the pre-normalization of turbo-muon's
    hidden rule; the DSL writes both and reads them back."""
    from geomopt.cli.main import main

    assert main(["explain", "turbo-muon", "transformer.h.0.mlp.c_proj.weight", "--model", "gpt"]) == 0
    out = capsys.readouterr().out
    assert "via newton_schulz(steps=4, coefficients=aol); prenormalize aol(eps=1e-07)" in out
    assert main(["fmt", str(TURBO_MUON), "--to", "dsl"]) == 0
    assert "approx=newton_schulz(steps=4, coefficients=aol), prenormalize=aol" in capsys.readouterr().out
