"""The two constraint steps that are retractions rather than the geometry's prox: ``stiefel`` with
``method: msign`` (X⁺ = r·msign(Y) by the rule's own spectral approximation: SPEL) and
``frobenius_sphere`` with ``method: project`` (X⁺ = r·Y/‖Y‖_F in every geometry: hyperball Muon),
against the step written out here in float64 (Newton–Schulz as a loop of matrix products, the
normalization as a division), not through the operators; and what the spec language says about
them (positions of bad values, lint, the DSL)."""

from __future__ import annotations

import pytest
import torch

import geomopt
from geomopt.compile.compiler import model_params
from geomopt.lint import lint_spec
from geomopt.spec import dump_spec, parse_spec
from geomopt.spec.diagnostics import SpecError

QUINTIC = [[4.0848, -6.8946, 2.9270], [3.9505, -6.3029, 2.6377], [3.7418, -5.5913, 2.3037],
           [2.8769, -3.1427, 1.2046], [2.8366, -3.0525, 1.2012]]


pytestmark = pytest.mark.usefixtures("float64_default")


def _ns(x: torch.Tensor, coefficients, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton–Schulz on the wide side: X/max(‖X‖_F, ε), then X ← aX + (bA + cA²)X, A = XXᵀ."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(float(x.norm()), eps)
    for a, b, c in coefficients:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def _spec(constraint: dict, geometry: dict | None = None, **rule) -> dict:
    geometry = geometry or {"kind": "spectral", "reference": {"kind": "indicator"},
                            "approx": {"kind": "newton_schulz", "coefficients": QUINTIC},
                            "prenormalize": {"kind": "max"}, "scale": "none"}
    return {"geomopt": 1, "name": "t",
            "rules": [{"name": "all", "match": "**", "geometry": geometry, "constraint": constraint, "lr": 0.05,
                       **rule}]}


def _one_step(spec: dict, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    p = torch.nn.Parameter(w.clone())
    opt = geomopt.GeomOptimizer([("w", p)], spec)
    p.grad = g.clone()
    opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(6, 4), (3, 7)])
@pytest.mark.parametrize("radius", [1.0, 2.5])
def test_msign_retracts_by_the_rules_newton_schulz(shape, radius):
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    got = _one_step(_spec({"kind": "stiefel", "radius": radius, "method": "msign"}, project_on_init=False), w, g)
    y = w - 0.05 * _ns(g, QUINTIC)
    want = radius * _ns(y, QUINTIC)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # a retraction, not the projection: Muon-style quintics leave σ near r, not on it
    exact = _one_step(_spec({"kind": "stiefel", "radius": radius, "method": "exact"}, project_on_init=False), w, g)
    assert float((got - exact).norm()) > 1e-3 * float(exact.norm())
    assert float((torch.linalg.svdvals(got) / radius - 1).abs().max()) < 0.35


def test_project_on_init_is_the_exact_projection_under_msign():
    """project_on_init puts the weights on the set by the Euclidean projection (r·UVᵀ), as for every
    constraint; the retraction is the step's backward only."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 5, generator=gen)
    p = torch.nn.Parameter(w.clone())
    geomopt.GeomOptimizer([("w", p)], _spec({"kind": "stiefel", "method": "msign"}))
    u, _, vh = torch.linalg.svd(w)
    torch.testing.assert_close(p.detach(), u @ vh, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reference", [{"kind": "indicator"}, {"kind": "power_barrier", "kappa": 4.0, "eps": 0.01}])
def test_project_is_the_euclidean_normalization_in_a_spectral_geometry(reference):
    gen = torch.Generator().manual_seed(2)
    w, g = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    geometry = {"kind": "spectral", "reference": reference, "approx": {"kind": "svd"}, "scale": "none"}
    got = _one_step(_spec({"kind": "frobenius_sphere", "radius": 2.0, "method": "project"}, geometry), w, g)
    w0 = 2.0 * w / w.norm()  # project_on_init puts W on the sphere first
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    if reference["kind"] == "indicator":
        d = u @ vh
    else:  # (h*)'(σ) of the κ = 4 power barrier: σ/(ε⁴ + σ⁴)^{1/4}
        d = (u * (s / (0.01**4 + s**4) ** 0.25)) @ vh
    y = w0 - 0.05 * d
    torch.testing.assert_close(got, 2.0 * y / y.norm(), rtol=1e-10, atol=1e-12)
    if reference["kind"] != "indicator":  # the geometry's prox is another point of the sphere
        prox = _one_step(_spec({"kind": "frobenius_sphere", "radius": 2.0}, geometry), w, g)
        assert float((prox - got).norm()) > 1e-6


def test_msign_needs_a_spectral_geometry_and_says_where():
    text = ('geomopt: 1\nname: t\nrules:\n  - name: a\n    match: "**"\n    geometry: {kind: euclidean}\n'
            '    constraint: {kind: stiefel, method: msign}\n')
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, "yaml", file="t.yaml")
    d = info.value.diagnostics[0]
    assert (d.file, d.line) == ("t.yaml", 7) and d.col > 1, d.format()
    assert "msign" in d.message and "euclidean" in d.message


@pytest.mark.parametrize("constraint,where", [
    ("{kind: stiefel, method: sign}", "7:41"),
    ("{kind: frobenius_sphere, method: msign}", "7:50"),
    ("{kind: spectral_ball, method: msign}", "7:47"),
])
def test_bad_methods_point_at_the_value(constraint, where):
    text = ('geomopt: 1\nname: t\nrules:\n  - name: a\n    match: "**"\n'
            '    geometry: {kind: spectral, reference: {kind: indicator}}\n'
            f'    constraint: {constraint}\n')
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, "yaml", file="t.yaml")
    d = info.value.diagnostics[0]
    assert (d.code, f"{d.line}:{d.col}") == ("GO005", where), d.format()


def test_lint_knows_project_needs_no_reference():
    """GO107 (the sphere's prox uses the declared reference, Newton–Schulz realizes another) holds
    for the prox and not for the Euclidean projection, which no reference enters."""
    spec = _spec({"kind": "frobenius_sphere"}, {"kind": "spectral", "reference": {"kind": "indicator"},
                                                "approx": {"kind": "newton_schulz"}})
    params = model_params(torch.nn.Linear(4, 8, bias=False))[0]
    assert "GO107" in [d.code for d in lint_spec(_validated(spec), params)]
    spec["rules"][0]["constraint"]["method"] = "project"
    assert "GO107" not in [d.code for d in lint_spec(_validated(spec), params)]


def _validated(spec: dict):
    from geomopt.spec.model import Spec

    return Spec.model_validate(spec)


@pytest.mark.parametrize("constraint", [{"kind": "stiefel", "method": "msign"},
                                        {"kind": "frobenius_sphere", "relative": True, "method": "project"}])
def test_methods_round_trip_through_the_dsl(constraint):
    spec = _validated(_spec(constraint))
    dsl = dump_spec(spec, "dsl")
    assert f"method={constraint['method']}" in dsl
    assert parse_spec(dsl, "dsl") == spec and parse_spec(dump_spec(parse_spec(dsl, "dsl"), "yaml")) == spec


@pytest.mark.parametrize("constraint", [{"kind": "stiefel", "method": "msign"},
                                        {"kind": "frobenius_sphere", "method": "project"}])
def test_diagnostics_measure_no_gap_for_a_retraction(constraint):
    """The stationarity gap pairs G with the prox's W; a retraction has none, and diagnostics say so."""
    geometry = {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 0.01},
                "approx": {"kind": "newton_schulz"}, "scale": "none"}
    p = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(3)))
    opt = geomopt.GeomOptimizer([("w", p)], _spec(constraint, geometry), track_gap=True)
    for k in range(2):
        p.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 + k))
        opt.step()
    d = opt.diagnostics()["all"]
    assert d["gap"] is None and "retraction" in d["gap_note"] and constraint["method"] in d["gap_note"]
