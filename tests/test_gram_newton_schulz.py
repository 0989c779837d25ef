"""gram_newton_schulz: Newton–Schulz's quintic iterated on the small Gram side (restarted Gram
Newton–Schulz, Dao AI Lab 2026). It is the same map as newton_schulz: equal to it in float64, equal
to an independent implementation (pytorch-optimizer's) in float32, the same optimizer step, and
everything that treats newton_schulz specially (pre-normalization default, working dtype, realized
reference, bf16 warning) treats it the same way. Its spec round-trips and its errors point at the
bad field."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import typed_fragments as typed
import geomopt
from geomopt.support import realized_reference
from geomopt.lint import lint_spec
from geomopt.geometry.forward import forward, input_dtype
from geomopt.geometry.gap import gap_reference
from geomopt.geometry.dtypes import POLYNOMIAL_APPROXES, compute_dtype, slow_bf16
from geomopt.geometry.prenorm import default_prenormalize
from geomopt.geometry.spectral import APPROX_OPS, gram_newton_schulz, newton_schulz
from geomopt.spec import SpecError, dump_spec, parse_spec
from geomopt.spec.geometries import GramNewtonSchulz, Spectral
from geomopt.spec.model import effective_prenormalize

F64 = torch.float64
MUON = (3.4445, -4.7750, 2.0315)
SHAPES = {"wide": (3, 16, 40), "tall": (2, 40, 16), "square": (4, 24, 24), "batched-wide": (2, 3, 8, 64)}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative Frobenius error over the matrices of a batch."""
    num = (got.double() - want.double()).norm(dim=(-2, -1))
    return (num / want.double().norm(dim=(-2, -1))).max().item()


# ---------------------------------------------------------------- (a) the same map as newton_schulz


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("steps, restarts", [(1, []), (3, []), (3, [2]), (5, []), (5, [2]), (5, [1, 3]),
                                             (8, []), (8, [2]), (8, [2, 4, 6]), (12, [2, 5, 9])])
def test_equals_newton_schulz_in_float64(shape, steps, restarts):
    """Measured ≤ 2e-11 relative (square, 8 steps, no restart: the Gram side squares the condition
    number, σ_min ≈ σ_max/n); ≤ 5e-14 on rectangular matrices."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(steps + len(restarts)), dtype=F64)
    want = newton_schulz(x, steps=steps)
    got = gram_newton_schulz(x, steps=steps, restarts=restarts)
    assert got.dtype == F64 and got.shape == x.shape
    assert _rel(got, want) < 1e-10


MAX = typed.prenorm({"kind": "max", "eps": 1e-7})


@pytest.mark.parametrize("prenorm", [None, MAX, typed.prenorm({"kind": "frobenius", "eps": 1e-3})])
def test_same_pre_normalization_coefficients_and_scale(prenorm):
    x = torch.randn(2, 12, 30, generator=torch.Generator().manual_seed(3), dtype=F64) * 7.0
    coeffs = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (1.875, -1.25, 0.375)]
    want = newton_schulz(x, steps=3, coefficients=coeffs, prenormalize=prenorm, scale=2.5)
    got = gram_newton_schulz(x, steps=3, coefficients=coeffs, prenormalize=prenorm, scale=2.5)
    assert _rel(got, want) < 1e-12
    one = gram_newton_schulz(x, steps=4, coefficients=[MUON], prenormalize=prenorm)  # one triple, reused
    assert _rel(one, newton_schulz(x, steps=4, prenormalize=prenorm)) < 1e-12


def test_dtypes_zero_matrix_and_restarts_past_the_end():
    x = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    assert gram_newton_schulz(x).dtype == torch.float32  # auto on CPU: float32
    assert gram_newton_schulz(x, out_dtype=F64).dtype == F64
    assert gram_newton_schulz(x, dtype="float64").dtype == torch.float32  # the input's dtype back
    assert gram_newton_schulz(torch.zeros(3, 4, 6)).abs().max() == 0
    # the default [2] (or any step at or past the last) does nothing for short iterations
    torch.testing.assert_close(gram_newton_schulz(x.double(), steps=2, restarts=[2, 7]),
                               gram_newton_schulz(x.double(), steps=2, restarts=[]), rtol=0, atol=0)


# ---------------------------------------------------------------- (b) pytorch-optimizer's implementation


@pytest.mark.parametrize("shape", [(4, 32, 96), (3, 96, 32), (2, 2, 16, 128), (64, 256)],
                         ids=["wide", "tall", "batched", "2d"])
@pytest.mark.parametrize("steps, restarts", [(3, ()), (5, ()), (5, (2,)), (5, (1, 3)), (8, (2,)), (8, (2, 4, 6))])
def test_matches_pytorch_optimizer_float32(shape, steps, restarts):
    """pytorch_optimizer's zero_power_via_gram_newton_schulz normalizes by D/max(‖D‖_F, eps)
    (geomopt's ``max`` pre-normalization) and restarts before its 0-based step index r, i.e. after
    r steps: geomopt's ``restarts``. Float32 both. Bound 1e-5 relative (measured ≤ 3.4e-6 over 10
    seeds, about both implementations' own float32 error against float64: ≤ 3.4e-6, ≤ 2.9e-6)."""
    matrix = pytest.importorskip("pytorch_optimizer.optimizer.utils.matrix")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(steps * 10 + len(restarts)))
    want = matrix.zero_power_via_gram_newton_schulz(x, num_steps=steps, eps=1e-7, safety_factor=1.0, weights=MUON,
                                                    dtype=torch.float32, reset_steps=restarts)
    got = gram_newton_schulz(x, steps=steps, restarts=list(restarts), prenormalize=MAX)
    assert got.dtype == want.dtype == torch.float32
    assert _rel(got, want) < 1e-5
    exact = newton_schulz(x.double(), steps=steps, prenormalize=MAX)
    assert _rel(got, exact) < 1e-5


def test_square_float32_restarts_keep_it_accurate():
    """Square matrices (σ down to ≈ σ_max/n) are the Gram route's hard case in float32: against
    float64 newton_schulz, 5 steps with the default restart measured ≤ 4.6e-6 (plain fp32 NS:
    1.2e-6); 8 steps need more restarts (one restart: 1.4e-3; after steps 2, 4, 6: 4.4e-6)."""
    x = torch.randn(2, 48, 48, generator=torch.Generator().manual_seed(0))
    for steps, restarts, bound in [(5, [2], 2e-5), (8, [2, 4, 6], 2e-5)]:
        assert _rel(gram_newton_schulz(x, steps=steps, restarts=restarts), newton_schulz(x.double(), steps=steps)) < bound


# ---------------------------------------------------------------- (c) end to end


def _spec(approx: dict) -> dict:
    hidden = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": approx, "scale": "muon_original"}
    return {"geomopt": 1, "name": "gns", "defaults": {"lr": 0.05, "direction": {"kind": "polyak", "alpha": 0.1}},
            "rules": [{"name": "hidden", "match": {"name": "**.weight", "ndim": 2}, "geometry": hidden},
                      {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "lr": 1e-3}]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 24), nn.Tanh(), nn.Linear(24, 80), nn.Tanh(), nn.Linear(80, 80), nn.Tanh(),
                         nn.Linear(80, 4))


@pytest.mark.parametrize("extra", [{}, {"steps": 6, "coefficients": [[3.0, -3.2, 1.2]]}],
                         ids=["default", "six-steps"])
def test_optimizer_step_matches_newton_schulz(extra):
    """Three steps of GeomOptimizer: wide, tall and square matrices, the same parameters up to
    float32 rounding (measured ≤ 6.5e-7 absolute with the defaults, ≤ 1.5e-6 with six steps of
    (3.0, −3.2, 1.2), on weights of size 0.1–0.3 after three steps at lr 0.05)."""
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    params = {}
    for kind in ("newton_schulz", "gram_newton_schulz"):
        model = _model()
        opt = geomopt.GeomOptimizer(model, _spec({"kind": kind, **extra}))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        params[kind] = {k: v.detach().clone() for k, v in model.named_parameters()}
    for name, want in params["newton_schulz"].items():
        torch.testing.assert_close(params["gram_newton_schulz"][name], want, rtol=1e-5, atol=2e-6)


def test_forward_op_folds_the_radius():
    d = torch.randn(6, 16, 40, generator=torch.Generator().manual_seed(4))
    geometry = typed.geometry({"kind": "spectral", "reference": {"kind": "indicator"},
                               "approx": GramNewtonSchulz().model_dump()})
    got = forward(d, geometry, radius=3.0, batch_dims=1)
    assert got.dtype == torch.float32
    assert _rel(got, 3.0 * newton_schulz(d.double())) < 1e-5  # fp32: measured 1.4e-6


# ---------------------------------------------------------------- treated as newton_schulz everywhere


def test_treated_like_newton_schulz():
    assert "gram_newton_schulz" in APPROX_OPS and "gram_newton_schulz" in POLYNOMIAL_APPROXES
    assert default_prenormalize("gram_newton_schulz") == default_prenormalize("newton_schulz")
    spectral = Spectral(reference={"kind": "indicator"}, approx={"kind": "gram_newton_schulz"})
    assert effective_prenormalize(spectral).model_dump() == {"kind": "frobenius", "eps": 1e-7}
    for steps in (3, 5, 8):
        assert realized_reference({"kind": "gram_newton_schulz", "steps": steps}) == \
            realized_reference({"kind": "newton_schulz", "steps": steps})
    cpu = torch.zeros(2, 2)
    cuda = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)  # what compute_dtype reads
    for like in (cpu, cuda):
        for dtype in ("auto", "float32", "bfloat16", "float64"):
            assert compute_dtype(like, "gram_newton_schulz", dtype) == compute_dtype(like, "newton_schulz", dtype)
    assert compute_dtype(cuda, "gram_newton_schulz") == torch.bfloat16
    approx = {"kind": "gram_newton_schulz", "dtype": "bfloat16"}
    geometry = typed.geometry({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": approx})
    assert input_dtype(geometry, cpu) == torch.bfloat16
    assert slow_bf16(typed.approx(approx), "cpu") == slow_bf16(typed.approx({**approx, "kind": "newton_schulz"}), "cpu")
    ns = typed.geometry({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}})
    gns = typed.geometry({"kind": "spectral", "reference": {"kind": "indicator"},
                          "approx": {"kind": "gram_newton_schulz"}})
    # its backward step does not depend on h: the realized barrier is measured
    stiefel = typed.constraint({"kind": "stiefel", "radius": 1.0})
    assert gap_reference(gns, stiefel) == gap_reference(ns, stiefel)
    assert gap_reference(ns, stiefel).model_dump() == realized_reference({"kind": "newton_schulz"})


def test_lint_go107_fires_as_for_newton_schulz():
    text = ("geomopt: 1\nname: t\nrules:\n  - name: hidden\n    match: \"**\"\n    geometry:\n      kind: spectral\n"
            "      reference: {kind: log_barrier}\n      approx: {kind: KIND, steps: 5}\n"
            "    constraint: {kind: frobenius_ball, radius: 1.0}\n")
    found = {}
    for kind in ("newton_schulz", "gram_newton_schulz"):
        found[kind] = [(d.code, d.line, d.col) for d in lint_spec(parse_spec(text.replace("KIND", kind)))
                       if d.code == "GO107"]
    assert found["gram_newton_schulz"] == found["newton_schulz"] == [("GO107", 8, 18)]


# ---------------------------------------------------------------- (d) the spec: YAML ↔ DSL

YAML = """geomopt: 1
name: gns
rules:
  - name: hidden
    match: {name: "**.weight", ndim: 2}
    geometry:
      kind: spectral
      reference: {kind: indicator}
      approx: {kind: gram_newton_schulz, steps: 6, coefficients: [[3.4445, -4.775, 2.0315]], restarts: [2, 4], dtype: float32}
  - name: plain
    match: "**.bias"
    geometry: {kind: spectral, reference: {kind: indicator}, approx: {kind: gram_newton_schulz}}
"""


def test_round_trips_yaml_and_dsl():
    spec = parse_spec(YAML)
    approx = spec.rules[0].geometry.approx
    assert approx == GramNewtonSchulz(steps=6, coefficients=[[3.4445, -4.775, 2.0315]], restarts=[2, 4], dtype="float32")
    assert spec.rules[1].geometry.approx == GramNewtonSchulz()
    dsl = dump_spec(spec, "dsl")
    assert "approx=gram_newton_schulz(steps=6, coefficients=[[3.4445, -4.775, 2.0315]], restarts=[2, 4], dtype=float32)" in dsl
    assert "approx=gram_newton_schulz" in dsl.split("rule plain", 1)[1]
    from_dsl = parse_spec(dsl, "dsl")
    assert from_dsl == spec
    assert parse_spec(dump_spec(from_dsl, "yaml")) == spec
    assert dump_spec(parse_spec(dump_spec(spec, "yaml")), "dsl") == dsl
    no_restart = parse_spec(YAML.replace("restarts: [2, 4]", "restarts: []"))
    assert no_restart.rules[0].geometry.approx.restarts == []
    assert parse_spec(dump_spec(no_restart, "dsl"), "dsl") == no_restart


# ---------------------------------------------------------------- (e) bad input → diagnostics at the field


def _first(text: str, fmt: str = "yaml"):
    with pytest.raises(SpecError) as err:
        parse_spec(text, fmt)
    d = err.value.diagnostics[0]
    return d.code, d.line, d.col, d.message


YAML_HEAD = ("geomopt: 1\nname: demo\nrules:\n  - name: hidden\n    match: {name: \"**.weight\", ndim: 2}\n"
             "    geometry:\n      kind: spectral\n      reference: {kind: indicator}\n      approx:\n"
             "        kind: gram_newton_schulz\n")
DSL_HEAD = 'geomopt 1\nname "demo"\nrule hidden match "**.weight" ndim=2:\n'


@pytest.mark.parametrize("fields, line, col, words", [
    # the value of the bad field (where NewtonSchulz's coefficients count points)
    ("        steps: 3\n        coefficients: [[3.4445, -4.7750, 2.0315], [3.4445, -4.7750, 2.0315]]\n",
     12, 23, ["coefficients", "1 or steps=3 triples, got 2"]),
    ("        steps: 3\n        restarts: [1, 3]\n", 12, 19, ["restarts", "below steps=3", "got 3"]),
    ("        restarts: [2, 2]\n", 11, 19, ["restarts", "distinct"]),
    ("        restarts: [0]\n", 11, 20, ["restarts[0]", "greater than or equal to 1"]),
    ("        restarts: 2\n", 11, 19, ["restarts", "valid list"]),
    ("        steps: 0\n", 11, 16, ["steps", "greater than or equal to 1"]),
    ("        restart: [2]\n", 11, 9, ["unknown field 'restart'", "did you mean 'restarts'"]),
])
def test_yaml_errors_point_at_the_field(fields, line, col, words):
    code, got_line, got_col, message = _first(YAML_HEAD + fields)
    assert code.startswith("GO0") and (got_line, got_col) == (line, col), (code, got_line, got_col, message)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("call, col, words", [
    ("gram_newton_schulz(steps=2, restarts=[2])", 78, ["below steps=2", "got 2"]),
    ("gram_newton_schulz(steps=3, coefficients=[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])", 82, ["1 or steps=3 triples"]),
])
def test_dsl_errors_point_at_the_field(call, col, words):
    text = DSL_HEAD + f"    geometry spectral(indicator, approx={call})\n"
    code, line, got_col, message = _first(text, "dsl")
    assert code == "GO005" and (line, got_col) == (4, col), (code, line, got_col, message)
    for word in words:
        assert word in message, message
