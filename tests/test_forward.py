"""Forward ops ρ·∇φ₁*(D) against float64 brute force (autograd of φ₁*), batching, views,
dtypes, the adam op against torch.optim.AdamW, radius presets and applicability checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim._muon import _adjust_lr

import typed_fragments as typed
from typed_fragments import forward
from geomopt.functional import forward_step
from geomopt.geometry import check_applicable, make_reference, radius_scale
from geomopt.geometry.adam import adam_moments
from geomopt.spec.diagnostics import SpecError
from geomopt.geometry.operators import FORWARD_OPS
from geomopt.geometry.spectral import newton_schulz, polar_express

F64 = torch.float64
LOG = {"kind": "log_barrier", "eps": 1e-2}
POW = {"kind": "power_barrier", "kappa": 4.0, "eps": 5e-2}
IND = {"kind": "indicator"}
QUAD = {"kind": "quadratic"}


def randn(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------- brute force: ∇ of φ₁* by autograd


def _conj_spectral(ref, d):
    return ref.conj(torch.linalg.svdvals(d.reshape(d.shape[0], -1))).sum()


def _conj_isotropic(ref, d):
    return ref.conj(torch.linalg.vector_norm(d)).sum()


def _conj_anisotropic(ref, d):
    return ref.conj(d).sum()


def _conj_rowwise(ref, d):
    return ref.conj(torch.linalg.vector_norm(d.reshape(d.shape[0], -1), dim=1)).sum()


def _conj_columnwise(ref, d):
    return ref.conj(torch.linalg.vector_norm(d.reshape(d.shape[0], -1), dim=0)).sum()


def _conj_euclidean(ref, d):
    return 0.5 * (d * d).sum()


def brute_force(phi_conj, ref_cfg, d, radius):
    """ρ·∇φ₁*(D) by autograd of φ₁* (the paper's dual reference function), float64."""
    ref = make_reference(typed.reference(ref_cfg)) if ref_cfg else None
    x = d.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(phi_conj(ref, x), x)
    return radius * g


GEOMETRY_TABLE = [
    # (geometry dict, φ₁*, shape)
    ({"kind": "euclidean"}, _conj_euclidean, (4, 5)),
    ({"kind": "isotropic", "reference": LOG}, _conj_isotropic, (4, 5)),
    ({"kind": "isotropic", "reference": POW}, _conj_isotropic, (7,)),
    ({"kind": "isotropic", "reference": IND}, _conj_isotropic, (3, 2, 2)),
    ({"kind": "anisotropic", "reference": LOG}, _conj_anisotropic, (4, 5)),
    ({"kind": "anisotropic", "reference": POW}, _conj_anisotropic, (6,)),
    ({"kind": "anisotropic", "reference": QUAD}, _conj_anisotropic, (2, 3)),
    ({"kind": "spectral", "reference": LOG}, _conj_spectral, (5, 8)),
    ({"kind": "spectral", "reference": POW, "approx": {"kind": "gram_eigh"}}, _conj_spectral, (8, 5)),
    ({"kind": "spectral", "reference": IND}, _conj_spectral, (6, 3, 2, 2)),  # conv weight
    ({"kind": "spectral", "reference": QUAD, "approx": {"kind": "gram_eigh", "dtype": "float64"}}, _conj_spectral, (4, 4)),
    ({"kind": "rowwise", "reference": LOG}, _conj_rowwise, (5, 6)),
    ({"kind": "rowwise", "reference": POW}, _conj_rowwise, (3, 2, 4)),
    ({"kind": "columnwise", "reference": LOG}, _conj_columnwise, (5, 6)),
    ({"kind": "columnwise", "reference": IND}, _conj_columnwise, (4, 3, 2)),
]


def _gid(row):
    g = row[0]
    return "-".join([g["kind"], g.get("reference", {}).get("kind", ""), g.get("approx", {}).get("kind", "")])


@pytest.mark.parametrize("row", GEOMETRY_TABLE, ids=[_gid(r) for r in GEOMETRY_TABLE])
@pytest.mark.parametrize("radius", [1.0, 0.37])
def test_forward_equals_gradient_of_dual_reference(row, radius):
    geometry, phi_conj, shape = row
    d = randn(*shape, seed=len(shape)) * 0.3
    want = brute_force(phi_conj, geometry.get("reference"), d, radius)
    got = forward(d, geometry, radius=radius)
    assert got.shape == d.shape and got.dtype == d.dtype
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_spectral_argmax_definition():
    """∇φ*(D) = argmax_X ⟨D, X⟩ − φ(X), checked by perturbing the claimed maximizer (φ(X) = Σh(σ_i))."""
    ref = make_reference(typed.reference(POW))
    d = randn(3, 4, seed=11)
    x = forward(d, {"kind": "spectral", "reference": POW})

    def objective(z):
        return (d * z).sum() - ref.h(torch.linalg.svdvals(z)).sum()

    best = objective(x)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        z = x + 1e-3 * torch.randn(3, 4, generator=g, dtype=F64)
        if torch.linalg.svdvals(z).max() < 1:
            assert objective(z) <= best + 1e-15


# ---------------------------------------------------------------- batching, views, dtypes

BATCHABLE = [r[0] for r in GEOMETRY_TABLE] + [
    {"kind": "spectral", "reference": IND, "approx": {"kind": "newton_schulz"}},
    {"kind": "spectral", "reference": IND, "approx": {"kind": "polar_express", "steps": 6}, "prenormalize": {"kind": "max", "eps": 1e-7}},
    {"kind": "spectral", "reference": LOG, "view": {"kind": "matrix", "blocks": 2}},
]


@pytest.mark.parametrize("geometry", BATCHABLE, ids=lambda g: f"{g['kind']}-{g.get('approx', {}).get('kind', '')}")
def test_batched_equals_per_tensor(geometry):
    shape = (4, 6)
    d = randn(2, 3, *shape, seed=3) * torch.tensor([1e-3, 1.0, 20.0], dtype=F64).view(1, 3, 1, 1)
    for batch_dims, flat in ((1, d[0]), (2, d)):
        got = forward(flat, geometry, radius=0.5, batch_dims=batch_dims)
        per = torch.stack([forward(x, geometry, radius=0.5) for x in flat.reshape(-1, *shape)]).reshape(flat.shape)
        torch.testing.assert_close(got, per, rtol=1e-10, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(["isotropic", "anisotropic", "spectral", "rowwise", "columnwise"]),
    batch=st.integers(1, 3),
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=3),
    seed=st.integers(0, 1000),
)
def test_batched_equals_per_tensor_shapes(kind, batch, shape, seed):
    geometry = {"kind": kind, "reference": LOG}
    d = randn(batch, *shape, seed=seed)
    got = forward(d, geometry, batch_dims=1)
    per = torch.stack([forward(x, geometry) for x in d])
    torch.testing.assert_close(got, per, rtol=1e-10, atol=1e-12)


APPROXES = [{"kind": "svd"}, {"kind": "gram_eigh"}, {"kind": "newton_schulz"}, {"kind": "polar_express"}]


def _view(**fields) -> dict:
    return {"kind": "matrix", **fields}


@pytest.mark.parametrize("approx", APPROXES)
def test_view_blocks_equal_per_block(approx):
    """blocks = 3 on a fused (3·4, 5) QKV weight = each (4, 5) block on its own (conv view too);
    unequal blocks [6, 3, 3] (grouped-query q, k, v) likewise, each with its own radius factor."""
    geometry = {"kind": "spectral", "reference": LOG, "approx": approx}
    for shape in ((12, 5), (12, 2, 3)):
        d = randn(*shape, seed=9)
        got = forward(d, {**geometry, "view": _view(blocks=3)}, radius=2.0)
        blocks = torch.cat([forward(b, geometry, radius=2.0) for b in d.chunk(3, dim=0)])
        torch.testing.assert_close(got, blocks, rtol=1e-10, atol=1e-12)
    d = randn(12, 5, seed=10)
    view = {"batch": 0, "trailing": "cols", "blocks": [6, 3, 3], "factors": [1.0, 0.5, 0.5]}
    got = forward(d, {**geometry, "view": view}, radius=2.0)
    want = torch.cat([forward(d[:6], geometry, radius=2.0), forward(d[6:9], geometry, radius=1.0),
                      forward(d[9:], geometry, radius=1.0)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("approx", APPROXES)
def test_view_batch_is_one_matrix_per_expert(approx):
    """batch = 1 on (E, out, in) expert weights = each expert's matrix on its own, stacked in one
    call (batched with other tensors too); the flattened (E, out·in) reading differs."""
    geometry = {"kind": "spectral", "reference": LOG, "approx": approx}
    d = randn(2, 4, 6, 5, seed=11)  # two tensors of 4 experts
    got = forward(d, {**geometry, "view": _view(batch=1)}, radius=1.5, batch_dims=1)
    want = torch.stack([torch.stack([forward(e, geometry, radius=1.5) for e in t]) for t in d])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(forward(d[0], geometry, radius=1.5), want[0])


def test_view_trailing_batch_is_one_matrix_per_kernel_position():
    """trailing = batch on a conv kernel (out, in, kh, kw): one out × in matrix per position."""
    geometry = {"kind": "spectral", "reference": LOG}
    d = randn(6, 4, 3, 2, seed=12)
    got = forward(d, {**geometry, "view": _view(trailing="batch")})
    want = torch.empty_like(d)
    for i in range(3):
        for j in range(2):
            want[:, :, i, j] = forward(d[:, :, i, j], geometry)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "view,shape,message",
    [
        (_view(blocks=3), (10, 4), "blocks=3 does not divide the rows .* divisors of 10: \\[2, 5, 10\\]"),
        (_view(blocks=[4, 4]), (10, 4), "sum to 8, but the rows .* number 10"),
        (_view(batch=1), (10, 4), "batch=1 needs at least 3 dims"),
        (_view(blocks=3), (12, 4), None),
    ],
)
def test_view_that_does_not_fit_says_why(view, shape, message):
    from geomopt.geometry.view import resolve

    spec_view = typed.view(view)
    if message is None:
        assert resolve(spec_view, shape).blocks == (4, 4, 4)
    else:
        with pytest.raises(ValueError, match=message):
            resolve(spec_view, shape)


@pytest.mark.parametrize("kind", ["rowwise", "columnwise"])
def test_in_out_layout_is_the_transposed_matrix(kind):
    """``layout: in_out`` stores (d_in, d_out): the op is the out_in op on the transpose."""
    d = randn(5, 8, seed=12)
    geometry = {"kind": kind, "reference": LOG}
    got = forward(d, {**geometry, "layout": "in_out"})
    torch.testing.assert_close(got, forward(d.T, geometry).T)
    other = "columnwise" if kind == "rowwise" else "rowwise"
    torch.testing.assert_close(got, forward(d, {**geometry, "kind": other}))


def test_conv_weight_is_viewed_as_out_by_rest():
    d = randn(6, 3, 2, 2, seed=4)
    geometry = {"kind": "spectral", "reference": LOG}
    torch.testing.assert_close(forward(d, geometry), forward(d.reshape(6, 12), geometry).reshape(d.shape))
    rows = {"kind": "rowwise", "reference": LOG}
    torch.testing.assert_close(forward(d, rows), forward(d.reshape(6, 12), rows).reshape(d.shape))


def test_polynomial_approximations_through_forward():
    d = randn(6, 10, seed=2)
    ns = {"kind": "spectral", "reference": IND, "approx": {"kind": "newton_schulz", "steps": 5}}
    torch.testing.assert_close(forward(d, ns, radius=3.0), 3.0 * newton_schulz(d))
    pe = {"kind": "spectral", "reference": IND, "approx": {"kind": "polar_express", "steps": 7, "coefficients": "speedrun"}}
    torch.testing.assert_close(forward(d, pe), polar_express(d, steps=7, coefficients="speedrun"))
    # an explicit prenormalize on the exact path makes it the same map as on the polynomial path
    svd_pre = {"kind": "spectral", "reference": LOG, "prenormalize": {"kind": "frobenius", "eps": 1e-7}}
    dn = d / (d.norm() + 1e-7)
    torch.testing.assert_close(forward(d, svd_pre), forward(dn, {"kind": "spectral", "reference": LOG}))


@pytest.mark.parametrize("geometry", [r[0] for r in GEOMETRY_TABLE[1:]] + [BATCHABLE[-3]], ids=lambda g: g["kind"])
def test_low_precision_inputs_compute_in_fp32(geometry):
    d = randn(4, 6, seed=1, dtype=torch.float32)
    if geometry["kind"] == "isotropic" and geometry["reference"] is POW:
        d = d.flatten()
    out = forward(d.bfloat16(), geometry)
    assert out.dtype == torch.bfloat16
    want = forward(d.bfloat16().float(), geometry).bfloat16()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_zero_direction_is_finite():
    for geometry in BATCHABLE:
        out = forward(torch.zeros(4, 6, dtype=F64), geometry)
        assert torch.isfinite(out).all() and (out == 0).all()


def test_radius_defaults_to_the_geometry_field():
    d = randn(3, 4)
    geometry = {"kind": "spectral", "reference": LOG, "radius": 2.5}
    torch.testing.assert_close(forward(d, geometry), 2.5 * forward(d, geometry, radius=1.0))
    torch.testing.assert_close(forward(d, {"kind": "euclidean"}), d)


def test_dispatch_errors():
    assert set(FORWARD_OPS) == {"euclidean", "isotropic", "anisotropic", "spectral", "rowwise", "columnwise", "adam",
                                "kronecker"}
    # a kind the spec lacks, or a missing reference, is refused where a dict enters (the spec's message)
    with pytest.raises(SpecError, match="geometry: Input tag 'spectrl'.*expected tags.*'spectral'"):
        forward_step(torch.ones(2, 2), {"kind": "spectrl"})
    with pytest.raises(SpecError, match="geometry.isotropic.reference: Field required"):
        forward_step(torch.ones(2, 2), {"kind": "isotropic"})
    with pytest.raises(ValueError, match="at least 2 dims"):
        forward(torch.ones(3), {"kind": "spectral", "reference": IND})
    with pytest.raises(ValueError, match="carries state"):
        forward(torch.ones(3), {"kind": "adam"})
    with pytest.raises(ValueError, match="carries state"):
        forward(torch.ones(3, 3), {"kind": "kronecker", "method": "shampoo"})


# ---------------------------------------------------------------- adam vs torch.optim.AdamW


@pytest.mark.parametrize("betas,eps", [((0.9, 0.999), 1e-8), ((0.9, 0.95), 1e-6), ((0.0, 0.5), 1e-3)])
def test_adam_op_reproduces_adamw(betas, eps):
    """Same moments bit for bit; X − lr·(op output) tracks AdamW (weight_decay 0) to fp32 rounding of
    the parameter (torch folds 1/bc₁ into lr, so the last product rounds differently)."""
    lr = 3e-3
    p0 = randn(8, 5, seed=0, dtype=torch.float32)
    ref_param = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref_param], lr=lr, betas=betas, eps=eps, weight_decay=0.0)
    p, state = p0.clone(), {}
    geometry = {"kind": "adam", "betas": list(betas), "eps": eps}
    for k in range(8):
        grad = randn(8, 5, seed=100 + k, dtype=torch.float32) * 10.0 ** (k % 3 - 1)
        ref_param.grad = grad.clone()
        opt.step()
        p.add_(forward(grad, geometry, state=state), alpha=-lr)
        torch_state = opt.state[ref_param]
        assert torch.equal(state["exp_avg"], torch_state["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], torch_state["exp_avg_sq"])
        assert state["adam_step"] == torch_state["step"].item() == k + 1
        ulp = torch.finfo(torch.float32).eps * ref_param.detach().abs().clamp(min=1.0)
        assert ((p - ref_param.detach()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_moments_with_addcdiv_is_adamw_bit_for_bit(weight_decay):
    lr, betas = 1e-2, (0.9, 0.95)
    p0 = randn(6, 7, seed=2, dtype=torch.float32)
    ref_param = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref_param], lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)
    p, state = p0.clone(), {}
    for k in range(6):
        grad = randn(6, 7, seed=50 + k, dtype=torch.float32)
        ref_param.grad = grad.clone()
        opt.step()
        exp_avg, denom, bc1 = adam_moments(grad, state, typed.geometry({"kind": "adam", "betas": list(betas)}))
        p = (p * (1 - lr * weight_decay)).addcdiv(exp_avg, denom, value=-lr / bc1)
        assert torch.equal(p, ref_param.detach())


def test_adam_radius_scales_the_direction():
    g = randn(4, seed=1, dtype=torch.float32)
    a = forward(g, {"kind": "adam"}, state={})
    b = forward(g, {"kind": "adam"}, radius=0.5, state={})
    torch.testing.assert_close(b, 0.5 * a)


# ---------------------------------------------------------------- radius presets

MUON_SHAPES = [(64, 16), (16, 64), (32, 32), (3, 1), (1, 7)]


@pytest.mark.parametrize("shape", MUON_SHAPES)
@pytest.mark.parametrize("preset", ["muon_original", "match_rms_adamw"])
def test_muon_presets_match_torch_adjust_lr(shape, preset):
    geometry = {"kind": "spectral", "reference": IND, "scale": preset}
    torch_name = {"muon_original": "original", "match_rms_adamw": "match_rms_adamw"}[preset]
    scale = radius_scale(typed.preset_geometry(geometry), shape)
    assert scale == pytest.approx(_adjust_lr(1.0, torch_name, torch.Size(shape)), rel=1e-15)
    # in_out storage reads the transposed shape
    flipped = {**geometry, "layout": "in_out"}
    assert radius_scale(typed.preset_geometry(flipped), shape[::-1]) == pytest.approx(scale, rel=1e-15)


def _scion_colnorm(g):  # LIONS-EPFL/scion ColNorm(normalized=False).lmo
    rms = 1 / math.sqrt(g.size(0)) * torch.sqrt(torch.sum(g**2, dim=0, keepdim=True))
    return g / (rms + 1e-8)


def _scion_rownorm(g):  # RowNorm(normalized=True).lmo
    rms = torch.sqrt(torch.sum(g**2, dim=-1, keepdim=True)) * math.sqrt(g.size(-1))
    return g / (rms + 1e-8)


def _scion_biasrms(g):  # BiasRMS.lmo
    rms = torch.sqrt(torch.mean(g**2, dim=0, keepdim=True))
    return g / (rms + 1e-8)


def _scion_sign(g):  # Sign(normalized=True).lmo
    return (1 / g.shape[1]) * torch.sign(g)


@pytest.mark.parametrize(
    "geometry,scion_lmo,shape,layout_shape",
    [
        ({"kind": "columnwise", "scale": "scion"}, _scion_colnorm, (6, 10), None),
        ({"kind": "rowwise", "scale": "scion"}, _scion_rownorm, (6, 10), None),
        ({"kind": "isotropic", "scale": "scion"}, _scion_biasrms, (9,), None),
        ({"kind": "anisotropic", "scale": "scion", "reference": IND}, _scion_sign, (6, 10), None),
        # Scion's ColNorm(transpose=True) on an embedding (vocab, dim) = columnwise, layout in_out
        ({"kind": "columnwise", "scale": "scion", "layout": "in_out"}, lambda g: _scion_colnorm(g.T).T, (10, 6), None),
        ({"kind": "rowwise", "scale": "scion", "layout": "in_out"}, lambda g: _scion_rownorm(g.T).T, (10, 6), None),
    ],
    ids=["ColNorm", "RowNorm", "BiasRMS", "Sign", "ColNorm-transpose", "RowNorm-transpose"],
)
def test_scion_presets_reproduce_scion_lmos(geometry, scion_lmo, shape, layout_shape):
    """Scion's g/(c‖g‖ + 1e-8) is the isotropic log barrier with ρ = 1/c, ε = 1e-8/c (paper Remark 2.5)."""
    g = randn(*shape, seed=6)
    rho = radius_scale(typed.preset_geometry(geometry), shape)
    if "reference" not in geometry:
        geometry = {**geometry, "reference": {"kind": "log_barrier", "eps": 1e-8 * rho}}
    torch.testing.assert_close(forward(g, geometry, radius=rho), scion_lmo(g), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "geometry,shape,want",
    [
        ({"kind": "spectral", "scale": "scion"}, (64, 16), math.sqrt(4)),
        ({"kind": "spectral", "scale": "scion", "layout": "in_out"}, (64, 16), math.sqrt(1 / 4)),
        ({"kind": "spectral", "scale": "scion"}, (32, 4, 3, 3), math.sqrt(32 / 36)),
        ({"kind": "spectral", "scale": "scion", "view": _view(blocks=3)}, (48, 16), 1.0),  # per (16, 16) block
        ({"kind": "spectral", "scale": "muon_original", "view": _view(blocks=2)}, (64, 16), math.sqrt(2)),
        ({"kind": "spectral", "scale": "scion", "view": _view(batch=1)}, (4, 64, 16), 2.0),  # per expert
        ({"kind": "anisotropic", "scale": "scion"}, (10, 4), 1 / 4),
        ({"kind": "anisotropic", "scale": "scion", "layout": "in_out"}, (10, 4), 1 / 10),
        ({"kind": "columnwise", "scale": "scion"}, (10, 4), math.sqrt(10)),
        ({"kind": "columnwise", "scale": "scion", "layout": "in_out"}, (10, 4), math.sqrt(4)),
        ({"kind": "rowwise", "scale": "scion"}, (10, 4), 1 / math.sqrt(4)),
        ({"kind": "rowwise", "scale": "scion", "layout": "in_out"}, (10, 4), 1 / math.sqrt(10)),
        ({"kind": "spectral", "scale": "none"}, (10, 4), 1.0),
        ({"kind": "euclidean"}, (10, 4), 1.0),
        ({"kind": "adam"}, (10, 4), 1.0),
    ],
)
def test_radius_scale_table(geometry, shape, want):
    assert radius_scale(typed.preset_geometry(geometry), shape) == pytest.approx(want, rel=1e-15)


def test_unknown_preset_is_an_error():
    # refused where the dict enters, by the spec's model
    with pytest.raises(ValueError, match="spectral.scale\n.*Input should be 'none', 'scion'"):
        radius_scale(typed.preset_geometry({"kind": "spectral", "scale": "scoin"}), (3, 3))


# ---------------------------------------------------------------- applicability


@pytest.mark.parametrize(
    "geometry,shape,message",
    [
        ({"kind": "spectral"}, (7,), "spectral geometry needs a tensor with at least 2 dimensions.*got shape \\(7,\\).*vectors"),
        ({"kind": "rowwise"}, (), "rowwise geometry needs .* scalars"),
        ({"kind": "columnwise"}, (5,), "columnwise geometry needs"),
        ({"kind": "spectral"}, (3, 4, 5), None),
        ({"kind": "anisotropic"}, (7,), None),
        ({"kind": "isotropic"}, (), None),
        ({"kind": "adam"}, (2, 2), None),
    ],
)
def test_check_applicable(geometry, shape, message):
    got = check_applicable(typed.preset_geometry(geometry), shape)
    if message is None:
        assert got is None
    else:
        assert got is not None and __import__("re").search(message, got), got


def test_a_pre_normalization_by_norm_is_one_factor_of_the_squared_norm_and_no_other_is():
    """prenorm.by_norm (what lets the folded iteration carry the pre-normalization in its first
    factor) holds exactly for the kinds whose D̂ is D times prenorm_factor(‖D‖²_F) per matrix."""
    from geomopt.geometry.prenorm import by_norm, prenorm_factor, prenormalize
    from geomopt.spec.geometries import AolPrenorm, FrobeniusPrenorm, MaxPrenorm, NoPrenorm
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    x[1] *= 1e-3
    sq = (x * x).sum(dim=(-2, -1))
    for cfg in (FrobeniusPrenorm(), MaxPrenorm(), AolPrenorm(), NoPrenorm()):
        f = prenorm_factor(sq, cfg) if not isinstance(cfg, AolPrenorm) else None
        one_factor = f is not None and torch.allclose(prenormalize(x, cfg), x * f[:, None, None], rtol=1e-12, atol=0)
        assert by_norm(cfg) == one_factor, cfg
