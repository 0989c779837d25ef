"""``method: auto`` of stiefel and spectral_ball (the default): the rule of
:func:`geomopt.geometry.method.resolve_method` (exact on CPU, polar on CUDA where the smaller
matrix side > 32), the backward step's dispatch through it, bit-identity with ``exact`` on CPU,
the schema, fmt, plan printing, lint and the gap. No GPU needed: the rule takes the device."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import typed_fragments as typed
import geomopt
from geomopt.compile import compile_spec
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.explain import explain
from geomopt.compile.plan import constraint_text, resolved_methods
from geomopt.geometry import method
from typed_fragments import gap_reference, gap_unavailable
from geomopt.geometry.method import CUDA_BATCHED_EIGH_MAX, METHOD_KINDS, resolve_method
from geomopt.spec.constraints import Rank, SpectralBall, SpectralSphere, Stiefel
from geomopt.spec.schema import schema

# the module of the polar steps
prox_polar = importlib.import_module("geomopt.geometry.prox.polar")
ROOT = Path(__file__).resolve().parents[1]
SPECTRAL = {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 2e-3},
            "approx": {"kind": "newton_schulz"}}


def _spec(constraint: dict, geometry: dict = SPECTRAL) -> dict:
    return {"geomopt": 1, "name": "t", "defaults": {"lr": 0.02, "direction": {"kind": "polyak", "alpha": 0.1}},
            "rules": [{"name": "hidden", "match": "*.weight", "geometry": geometry, "constraint": constraint},
                      {"name": "rest", "match": "**", "geometry": {"kind": "adam"}}]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 16), nn.Linear(16, 8))


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize("cls", [Stiefel, SpectralBall])
def test_the_schema_default_is_auto(cls):
    assert cls().method == "auto"
    assert cls(method="exact").method == "exact" and cls(method="polar").method == "polar"
    prop = schema()["$defs"][cls.__name__]["properties"]["method"]
    retraction = ["msign"] if cls is Stiefel else []  # stiefel's retraction by the rule's approx (SPEL)
    assert prop["default"] == "auto" and prop["enum"] == ["auto", "exact", "polar", *retraction]
    assert "auto" in prop["description"] and "CUDA" in prop["description"] and "> 32" in prop["description"]


def test_the_committed_schema_shows_auto():
    committed = json.loads((ROOT / "schema" / "geomopt-1.schema.json").read_text(encoding="utf-8"))
    for cls in ("Stiefel", "SpectralBall"):
        assert committed["$defs"][cls]["properties"]["method"]["default"] == "auto"


def test_an_unknown_method_is_refused_with_the_choices():
    text = json.dumps(_spec({"kind": "stiefel", "method": "autox"}))
    with pytest.raises(geomopt.SpecError) as exc:
        geomopt.parse_spec(text)
    assert "'auto', 'exact', 'polar' or 'msign'" in str(exc.value)


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize("kind", METHOD_KINDS)
@pytest.mark.parametrize("shape", [(8, 4), (32, 32), (33, 33), (64, 64), (768, 768), (768, 3072), (4096, 16),
                                   (64, 16, 3, 3)])
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta", "mps"])
def test_auto_is_exact_off_cuda_at_every_size(kind, shape, device):
    assert resolve_method(typed.constraint({"kind": kind, "radius": 1.0, "method": "auto"}), device, shape) == "exact"
    # no method key reads as auto
    assert resolve_method(typed.constraint({"kind": kind, "radius": 1.0}), device, shape) == "exact"


@pytest.mark.parametrize("kind", METHOD_KINDS)
@pytest.mark.parametrize("shape, expected", [
    ((33, 33), "polar"), ((64, 48), "polar"), ((768, 768), "polar"), ((768, 3072), "polar"), ((3072, 768), "polar"),
    ((32, 32), "exact"), ((32, 4096), "exact"), ((4096, 32), "exact"), ((8, 4), "exact"), ((1, 1), "exact"),
    ((48, 16, 3, 3), "polar"),  # a conv kernel: 48 × 144
    ((16, 8, 3, 3), "exact"),   # 16 × 72
])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 0)])
def test_auto_on_cuda_is_polar_where_the_smaller_side_exceeds_32(kind, shape, expected, device):
    assert resolve_method(typed.constraint({"kind": kind, "radius": 1.0, "method": "auto"}), device, shape) == expected
    assert resolve_method(typed.constraint({"kind": kind, "radius": 1.0}), device, torch.Size(shape)) == expected


def test_the_threshold_is_torchs_batched_eigh_limit():
    assert CUDA_BATCHED_EIGH_MAX == 32
    assert "32" in method.AUTO_RULE and "CPU" in method.AUTO_RULE and "CUDA" in method.AUTO_RULE
    assert "32" in resolve_method.__doc__ and "RESULTS.md" in resolve_method.__doc__


@pytest.mark.parametrize("kind", METHOD_KINDS)
@pytest.mark.parametrize("forced", ["exact", "polar"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("shape", [(8, 4), (768, 768)])
def test_exact_and_polar_force_one(kind, forced, device, shape):
    assert resolve_method(typed.constraint({"kind": kind, "radius": 1.0, "method": forced}), device, shape) == forced


@pytest.mark.parametrize("constraint", [{"kind": "spectral_sphere", "radius": 1.0}, {"kind": "rank", "k": 2}],
                         ids=lambda c: c["kind"])
def test_kinds_without_a_polar_step_are_exact(constraint):
    assert resolve_method(typed.constraint(constraint), "cuda", (768, 768)) == "exact"


def test_the_method_kinds_are_the_polar_steps():
    assert set(METHOD_KINDS) == set(prox_polar.POLAR)
    assert set(METHOD_KINDS) == {name for name, cls in (("stiefel", Stiefel), ("spectral_ball", SpectralBall),
                                                         ("spectral_sphere", SpectralSphere), ("rank", Rank))
                                 if "method" in cls.model_fields}


# ---------------------------------------------------------------- the backward step's dispatch


@pytest.mark.parametrize("kind", METHOD_KINDS)
def test_the_backward_step_dispatches_through_resolve_method(kind, monkeypatch):
    """What the rule says is what runs: told "polar" (as on CUDA), auto runs the polar step bit for
    bit; the rule sees the tensor's device and the matrix shape the operator reads."""
    torch.manual_seed(0)
    x = torch.linalg.qr(torch.randn(3, 48, 40)).Q[:, :, :40] if kind == "stiefel" else torch.randn(3, 48, 40) * 0.05
    y = x + 0.01 * torch.randn(3, 48, 40)
    geo = {"kind": "spectral", "reference": {"kind": "indicator"}}
    seen = []

    def fake(constraint, device, shape):
        seen.append((constraint.method, torch.device(device).type, tuple(shape)))
        return "polar"

    polar, _ = typed.backward(y, 0.1, geo, {"kind": kind, "radius": 1.0, "method": "polar"}, batch_dims=1)
    monkeypatch.setattr(method, "resolve_method", fake)
    auto, _ = typed.backward(y, 0.1, geo, {"kind": kind, "radius": 1.0, "method": "auto"}, batch_dims=1)
    assert seen == [("auto", "cpu", (48, 40))]
    assert torch.equal(auto, polar)


@pytest.mark.parametrize("kind", METHOD_KINDS)
def test_auto_backward_step_on_cpu_is_the_exact_one(kind):
    torch.manual_seed(1)
    y = torch.randn(4, 40, 24)
    geo = {"kind": "spectral", "reference": {"kind": "indicator"}}
    exact, _ = typed.backward(y, 0.1, geo, {"kind": kind, "radius": 1.0, "method": "exact"}, batch_dims=1)
    for c in ({"kind": kind, "radius": 1.0, "method": "auto"}, {"kind": kind, "radius": 1.0}):
        assert torch.equal(typed.backward(y, 0.1, geo, c, batch_dims=1)[0], exact)


@pytest.mark.parametrize("kind", METHOD_KINDS)
def test_an_optimizer_step_with_auto_is_bit_identical_to_exact_on_cpu(kind):
    """Stacked buckets (two 48×48), a 48×64, a 16×48 and an 8×16: several steps, every parameter
    and the counters equal to the last bit; polar (the CUDA choice for n > 32) is not."""
    results = {}
    for meth in ("auto", "exact", "polar"):
        model = _model()
        opt = geomopt.GeomOptimizer(model, _spec({"kind": kind, "relative": True, "method": meth}))
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results[meth] = ([p.detach().clone() for p in model.parameters()],
                         {k: v["fallbacks"] for k, v in opt.diagnostics().items()})
    assert all(torch.equal(a, b) for a, b in zip(results["auto"][0], results["exact"][0]))
    assert results["auto"][1] == results["exact"][1]
    assert not all(torch.equal(a, b) for a, b in zip(results["polar"][0], results["exact"][0]))


# ---------------------------------------------------------------- fmt


@pytest.mark.parametrize("kind", METHOD_KINDS)
@pytest.mark.parametrize("fmt", ["yaml", "dsl"])
def test_fmt_omits_auto_and_round_trips_every_method(kind, fmt):
    for meth in ("auto", "exact", "polar"):
        spec = geomopt.parse_spec(json.dumps(_spec({"kind": kind, "method": meth})))
        text = geomopt.dump_spec(spec, fmt)
        assert ("method" in text) == (meth != "auto"), text
        back = geomopt.parse_spec(text, fmt)
        assert back.rules[0].constraint.method == meth
        assert back.model_dump() == spec.model_dump()
        assert geomopt.dump_spec(back, fmt) == text  # canonical: a fixed point
    implicit = geomopt.parse_spec(json.dumps(_spec({"kind": kind})))
    assert implicit.model_dump() == geomopt.parse_spec(json.dumps(_spec({"kind": kind, "method": "auto"}))).model_dump()


def test_fmt_cli_drops_an_explicit_auto_and_keeps_exact(tmp_path, capsys):
    from geomopt.cli.main import main

    src = ("geomopt: 1\nname: t\nrules:\n  - name: hidden\n    match: \"**\"\n"
           "    geometry: {kind: spectral, reference: {kind: indicator}}\n    constraint: {kind: stiefel, method: %s}\n")
    for meth, expect in (("auto", "constraint: {kind: stiefel}\n"), ("exact", "constraint: {kind: stiefel, method: exact}\n"),
                         ("polar", "constraint: {kind: stiefel, method: polar}\n")):
        path = tmp_path / f"{meth}.yaml"
        path.write_text(src % meth, encoding="utf-8")
        assert main(["fmt", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.endswith(expect), out


# ---------------------------------------------------------------- plan printing


def test_plan_table_and_summary_say_what_auto_resolves_to_on_cpu():
    plan = compile_spec(_spec({"kind": "stiefel", "relative": True}), _model())
    table = plan.table()
    hidden = [line for line in table.splitlines() if " hidden " in line]
    assert len(hidden) == 5 and all("method=auto→exact" in line for line in hidden)
    rows = {r["rule"]: r for r in plan.summary()}
    assert rows["hidden"]["constraint"].startswith("stiefel(radius=")
    assert rows["hidden"]["constraint"].endswith(", method=auto→exact)")
    assert rows["rest"]["constraint"] == "-"


def test_plan_printing_resolves_per_tensor_on_cuda():
    """The plan's device decides, with the view's matrix sizes: 48×64 → polar, 16×48 and 8×16 → exact."""
    plan = compile_spec(_spec({"kind": "spectral_ball"}), _model())
    cuda = [dataclasses.replace(p, device="cuda:0") for p in plan.params]
    text = {p.name: constraint_text(p) for p in cuda if p.rule == "hidden"}
    assert text == {"0.weight": "spectral_ball(radius=1, method=auto→polar)",
                    "1.weight": "spectral_ball(radius=1, method=auto→polar)",
                    "2.weight": "spectral_ball(radius=1, method=auto→polar)",
                    "3.weight": "spectral_ball(radius=1, method=auto→exact)",
                    "4.weight": "spectral_ball(radius=1, method=auto→exact)"}
    summary = {r["rule"]: r for r in type(plan)(cuda).summary()}
    assert summary["hidden"]["constraint"] == "spectral_ball(radius=1, method=auto→exact/polar)"


def test_plan_printing_shows_a_forced_method_as_written():
    for meth in ("exact", "polar"):
        plan = compile_spec(_spec({"kind": "stiefel", "method": meth}), _model())
        assert f"stiefel(radius=1, method={meth})" in plan.table()
        assert all(resolved_methods(p) == [] for p in plan.params)


def test_plan_printing_under_a_geometry_that_ignores_method():
    """Only the spectral geometry's step reads ``method``; the others project exactly."""
    geo = {"kind": "euclidean"}
    plan = compile_spec(_spec({"kind": "stiefel"}, geo), _model())
    cuda = dataclasses.replace(plan["0.weight"], device="cuda")
    assert constraint_text(cuda) == "stiefel(radius=1, method=auto→exact)"


def test_explain_says_what_auto_resolves_to_and_the_rule():
    model = _model()
    spec = geomopt.parse_spec(json.dumps(_spec({"kind": "stiefel"})))
    infos = model_params(model)[0]
    plan = compile_spec(spec, model)
    text = explain(spec, infos, plan.params, "0.weight")
    assert "backward   stiefel(radius=1, method=auto→exact)" in text
    assert f"method auto on cpu: {method.AUTO_RULE}; exact or polar forces one" in text
    forced = geomopt.parse_spec(json.dumps(_spec({"kind": "stiefel", "method": "polar"})))
    text = explain(forced, infos, compile_spec(forced, model).params, "0.weight")
    assert "method=polar" in text and "method auto" not in text


# ---------------------------------------------------------------- lint and the gap


@pytest.mark.parametrize("name", ["stiefel", "spectral-clip"])
def test_lint_finds_the_same_with_auto_exact_and_polar(name):
    """No lint rule reads ``method``: a shipped spec (auto by default) lints as it did with exact."""
    base = geomopt.load_spec(ROOT / "specs" / f"{name}.yaml")
    infos = model_params(_model())[0]
    data = base.model_dump()
    found = {}
    for meth in ("auto", "exact", "polar"):
        for rule in data["rules"]:
            if rule.get("constraint") and rule["constraint"]["kind"] in METHOD_KINDS:
                rule["constraint"]["method"] = meth
        spec = geomopt.parse_spec(json.dumps(data))
        found[meth] = sorted((d.code, d.message) for d in lint_spec(spec, infos) + lint_spec(spec))
    assert found["auto"] == found["exact"] == found["polar"]


@pytest.mark.parametrize("kind", METHOD_KINDS)
@pytest.mark.parametrize("reference", ["auto", "declared", "realized"])
def test_the_gap_reference_does_not_depend_on_the_method(kind, reference):
    """Exact or polar, the step is the h-independent set projection (polar approximates it), so
    the gap is measured against the same reference whatever auto resolves to."""
    out = {meth: (gap_reference(SPECTRAL, {"kind": kind, "radius": 1.0, "method": meth}, reference),
                  gap_unavailable(SPECTRAL, {"kind": kind, "radius": 1.0, "method": meth}, reference))
           for meth in ("auto", "exact", "polar")}
    assert out["auto"] == out["exact"] == out["polar"]


def test_the_tracked_gap_with_auto_equals_exact_on_cpu():
    gaps = {}
    for meth in ("auto", "exact"):
        model = _model()
        opt = geomopt.GeomOptimizer(model, _spec({"kind": "stiefel", "relative": True, "method": meth}), track_gap=True)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        gaps[meth] = {k: v.get("gap") for k, v in opt.diagnostics().items()}
    assert gaps["auto"] == gaps["exact"]
    assert any(g is not None for g in gaps["auto"].values())
