"""Odd tensors: zero-size parameters, parameters holding NaN, and extreme-but-valid reference values.

* Zero-size tensors (a dim of size 0; 0-D scalars are not zero-size) are accepted under every
  shipped spec and every rule of it, step as a no-op (no state, the other tensors step exactly as
  without them) and checkpoints round-trip.
* ``diagnostics()`` never raises on a parameter, a gradient or a W that holds NaN: that tensor's
  numbers are NaN (and a NaN is not lost in a maximum), for every (geometry, constraint) pair.
* A valid spec never turns finite gradients into non-finite parameters: every reference kind with
  its parameters at the validator's bounds (ε from the smallest positive float64 to the largest,
  κ from 1 to the largest float64), under every geometry that reads one, on gradients with zero
  rows, columns and tensors, subnormal and near-overflow entries, in float32 and bfloat16; with a
  bounded reference (barriers, indicator) the step is also within its bound γρ per entry.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import geomopt
from geomopt.support import BACKWARD_PAIRS, supported_constraints
from geomopt.compile import as_spec
import typed_fragments as typed
from typed_fragments import backward, forward
from geomopt.geometry.reference import make_reference, working_eps
from geomopt.geometry.scale import radius_scale
from optim_helpers import SPECS

ALL_SPECS = sorted(SPECS.glob("*.yaml")) + sorted((SPECS / "catalog").glob("*.yaml"))
ZERO_SHAPES = [(0,), (8, 0), (0, 8), (2, 0, 3)]
F64_MAX = 1.7976931348623157e308
F64_MIN = 5e-324  # the smallest positive float64: the validator's lower bound (eps > 0)


def _id(v) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _spec_id(path) -> str:
    return f"{path.parent.name}/{path.stem}" if path.parent.name == "catalog" else path.stem


def _optimizer(params, spec, **kw) -> geomopt.GeomOptimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU without native bf16, lint-level notes
        return geomopt.GeomOptimizer(params, spec, **kw)


def _step(opt, params: list, grads: list) -> None:
    """One step with these gradients, through a closure (STORM evaluates it twice)."""
    def closure():
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return torch.zeros(())

    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step(closure)


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- zero-size tensors


def _analog(shape: tuple) -> tuple:
    """The shape with its zero dims made 3: what the rule sees for a tensor with entries."""
    return tuple(3 if s == 0 else s for s in shape)


@pytest.mark.parametrize("shape", ZERO_SHAPES, ids=_id)
@pytest.mark.parametrize("path", ALL_SPECS, ids=_spec_id)
def test_zero_size_tensor_under_shipped_spec(path, shape):
    """The spec as shipped (roles guessed from names and shapes): the zero-size tensor is built, steps
    as a no-op twice, shows in diagnostics without a value of its own, and the checkpoint loads into
    a fresh optimizer that then steps as the original does."""
    def params():
        torch.manual_seed(0)
        return [("w", torch.nn.Parameter(torch.zeros(shape))), ("b", torch.nn.Parameter(torch.randn(4, 3)))]

    named = params()
    ps = [p for _, p in named]
    opt = _optimizer(named, path, track_update=True)
    grads = [torch.zeros(shape), torch.randn(4, 3, generator=_rng(1))]
    _step(opt, ps, grads)
    _step(opt, ps, grads)
    assert ps[0].shape == shape and ps[0].numel() == 0
    assert opt.state[ps[0]] == {}
    assert all(isinstance(v, dict) for v in opt.diagnostics().values())

    again = params()
    opt2 = _optimizer(again, path, track_update=True)
    with torch.no_grad():
        again[1][1].copy_(ps[1])
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[again[0][1]] == {}
    _step(opt, ps, grads)
    _step(opt2, [p for _, p in again], grads)
    assert torch.equal(again[1][1], ps[1])
    assert again[0][1].shape == shape


def _rules():
    """(spec path, rule name, the spec reduced to that rule matching every tensor; without its
    ``qk_clip``, which acts on attention modules' logits only: tests/test_qk_clip.py)."""
    out = []
    for path in ALL_SPECS:
        spec = as_spec(path).model_dump(exclude_none=True)
        for rule in spec["rules"]:
            step = {k: v for k, v in rule.items() if k != "qk_clip"}
            out.append((path, rule["name"], {**spec, "rules": [{**step, "match": "**"}]}))
    return out


RULES = _rules()


@pytest.mark.parametrize("shape", ZERO_SHAPES, ids=_id)
@pytest.mark.parametrize("path,rule,spec", RULES, ids=[f"{_spec_id(p)}:{r}" for p, r, _ in RULES])
def test_zero_size_tensor_under_every_rule(path, rule, spec, shape):
    """Every rule of every shipped spec on a zero-size tensor next to one with entries (its zero dims
    made 3): construction, two steps and a checkpoint round trip; the zero-size tensor never changes
    nor gets state, and the other tensor ends bit for bit where it ends without it. Where the rule's
    geometry refuses a tensor of that rank (a matrix geometry on a vector), it refuses the zero-size
    one as well, with the same error."""
    analog = _analog(shape)

    def build(with_empty: bool):
        torch.manual_seed(0)
        v = torch.nn.Parameter(torch.randn(analog))
        named = ([("w", torch.nn.Parameter(torch.zeros(shape)))] if with_empty else []) + [("v", v)]
        return named, _optimizer(named, spec)

    try:
        ref_named, ref_opt = build(False)
    except Exception as exc:  # the geometry does not apply to this rank: the zero-size tensor alone is refused alike
        with pytest.raises(type(exc)):
            _optimizer([("w", torch.nn.Parameter(torch.zeros(shape)))], spec)
        return
    named, opt = build(True)
    w, v = named[0][1], named[1][1]
    g = [torch.randn(analog, generator=_rng(k)) for k in range(3)]
    for k in range(2):
        _step(opt, [w, v], [torch.zeros(shape), g[k]])
        _step(ref_opt, [ref_named[0][1]], [g[k]])
    assert w.shape == shape and opt.state[w] == {}
    assert torch.equal(v, ref_named[0][1])
    opt.diagnostics()  # no exception with the zero-size tensor in a rule

    named2, opt2 = build(True)
    with torch.no_grad():
        named2[1][1].copy_(v)
    opt2.load_state_dict(opt.state_dict())
    _step(opt, [w, v], [torch.zeros(shape), g[2]])
    _step(opt2, [named2[0][1], named2[1][1]], [torch.zeros(shape), g[2]])
    assert torch.equal(named2[1][1], v) and opt2.state[named2[0][1]] == {}


GEOMETRIES = [
    {"kind": "euclidean"},
    {"kind": "isotropic", "reference": {"kind": "log_barrier"}, "scale": "scion"},
    {"kind": "anisotropic", "reference": {"kind": "indicator"}, "scale": "scion"},
    {"kind": "rowwise", "reference": {"kind": "log_barrier"}, "scale": "scion"},
    {"kind": "columnwise", "reference": {"kind": "log_barrier"}, "scale": "scion"},
    {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"},
     "scale": "muon_original"},
    {"kind": "spectral", "reference": {"kind": "power_barrier"}, "approx": {"kind": "gram_eigh"},
     "scale": "match_rms_adamw"},
]


@pytest.mark.parametrize("shape", [s for s in ZERO_SHAPES if len(s) >= 2], ids=_id)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g['kind']}-{g.get('scale', '')}")
def test_zero_size_operators(geometry, shape):
    """The operators themselves: every scale preset gives a finite radius for a zero-size shape, the
    forward op returns an empty tensor of the shape and dtype asked for, and every backward step the
    geometry has returns its (empty) input."""
    assert math.isfinite(radius_scale(typed.preset_geometry(geometry), shape))
    d = torch.zeros(shape)
    out = forward(d, {**geometry, "radius": 1.0}, out_dtype=torch.bfloat16)
    assert out.shape == d.shape and out.dtype == torch.bfloat16
    for kind in supported_constraints(geometry["kind"]):
        constraint = {"kind": kind, "k": 1} if kind in ("l0", "rank") else (
            {"kind": kind, "lam": 1.0} if kind == "proximal_decay" else {"kind": kind, "radius": 1.0})
        x, fallback = backward(d, 0.1, {**geometry, "radius": 1.0}, constraint)
        assert x.shape == shape and fallback is None


# ---------------------------------------------------------------- diagnostics of a NaN


def _constraint(kind: str) -> dict:
    if kind in ("l0", "rank"):
        return {"kind": kind, "k": 2}
    if kind == "proximal_decay":
        return {"kind": kind, "lam": 0.5}
    return {"kind": kind, "radius": 2.0}


def _geometry(kind: str) -> dict:
    if kind in ("euclidean",):
        return {"kind": kind}
    if kind == "spectral":
        return {"kind": kind, "reference": {"kind": "log_barrier", "eps": 1e-3}, "approx": {"kind": "svd"}}
    return {"kind": kind, "reference": {"kind": "log_barrier", "eps": 1e-3}}


PAIRS = sorted(BACKWARD_PAIRS) + [(g, None) for g in ("isotropic", "anisotropic", "spectral", "rowwise",
                                                        "columnwise")]


@pytest.mark.parametrize("where", ["param", "w", "grad"])
@pytest.mark.parametrize("gkind,ckind", PAIRS, ids=[f"{g}-{c}" for g, c in PAIRS])
def test_diagnostics_report_nan_instead_of_raising(gkind, ckind, where):
    """A rule whose tensor holds a NaN (in the parameter, in W of the last step, or in the gradient)
    next to a healthy rule with the same operators: diagnostics() returns, the sick rule's numbers
    that read the NaN are NaN (violation for the parameter, gap or dual_norm for W and the
    gradient), and the healthy rule's are not NaN (a gap may be +∞ there: W outside dom φ₁)."""
    rule = {"geometry": _geometry(gkind), "lr": 0.05, "weight_decay": 0.0, "project_on_init": True}
    if ckind is not None:
        rule["constraint"] = _constraint(ckind)
    spec = {"geomopt": 1, "name": "nan", "rules": [{**rule, "name": "sick", "match": "sick"},
                                                   {**rule, "name": "well", "match": "well"}]}
    torch.manual_seed(0)
    sick, well = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 4))
    opt = _optimizer([("sick", sick), ("well", well)], spec, track_gap=True)
    g = torch.randn(6, 4, generator=_rng(3))
    _step(opt, [sick, well], [g, g])
    sick.grad, well.grad = g.clone(), g.clone()
    if where == "param":
        with torch.no_grad():
            sick[1, 2] = math.nan
    elif where == "w":
        if "w" not in opt.state[sick]:
            assert ckind is None or ckind == "proximal_decay" and gkind == "euclidean"  # no W is kept
            return
        opt.state[sick]["w"][1, 2] = math.nan
    else:
        sick.grad[1, 2] = math.nan
    out = opt.diagnostics()
    bad, ok = out["sick"], out["well"]
    constrained = ckind is not None and ckind != "proximal_decay"
    if where == "param" and constrained:
        assert math.isnan(bad["violation"])
    if constrained:
        assert math.isfinite(ok["violation"])
    if where in ("w", "grad"):
        numbers = [bad["gap"], bad["dual_norm"]]
        assert any(v is not None and math.isnan(v) for v in numbers), out
        assert not any(v is not None and math.isnan(v) for v in (ok["gap"], ok["dual_norm"])), out
    if where == "w":
        assert "non-finite" in bad["gap_note"]


def test_diagnostics_violation_nan_is_not_lost_in_the_maximum():
    """Two tensors in one rule, the NaN in the first: the rule's violation (a maximum over its
    tensors) is NaN, not the second tensor's distance (Python's max drops a NaN it compares first)."""
    spec = {"geomopt": 1, "name": "max", "rules": [{"name": "r", "match": "**", "geometry": {"kind": "euclidean"},
                                                    "constraint": {"kind": "frobenius_ball", "radius": 1.0},
                                                    "project_on_init": False}]}
    a, b = torch.nn.Parameter(torch.full((3, 3), 5.0)), torch.nn.Parameter(torch.full((3, 3), 5.0))
    opt = _optimizer([("a", a), ("b", b)], spec)
    assert opt.diagnostics()["r"]["violation"] == pytest.approx(15.0 - 1.0)  # ‖5·1₃ₓ₃‖ = 15
    with torch.no_grad():
        a[0, 0] = math.nan
    assert math.isnan(opt.diagnostics()["r"]["violation"])


EXTREME_GAP_REFERENCES = ([{"kind": "log_barrier", "eps": e} for e in (F64_MIN, 1e-300, F64_MAX)]
                          + [{"kind": "power_barrier", "kappa": k, "eps": e} for k in (1.0, 4.0, F64_MAX)
                             for e in (F64_MIN, F64_MAX)])


@pytest.mark.parametrize("reference", EXTREME_GAP_REFERENCES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
def test_diagnostics_at_extreme_eps_are_numbers(reference):
    """The stationarity gap of a rule whose reference sits at the bounds of ε and κ, one step after
    finite gradients, is a number ≥ 0 (+∞ allowed: W outside dom φ₁), not NaN: h and h* read ε as
    the working dtype holds it (h*(y) = |y| to rounding where |y|/ε overflows)."""
    for gkind in ("isotropic", "anisotropic", "rowwise", "spectral"):
        for constraint in ({"kind": "frobenius_ball", "radius": 1.0}, {"kind": "proximal_decay", "lam": 0.5}):
            geometry = {"kind": gkind, "reference": reference}
            spec = {"geomopt": 1, "name": "gap", "rules": [{"name": "r", "match": "**", "geometry": geometry,
                                                            "constraint": constraint, "lr": 0.1}]}
            p = torch.nn.Parameter(torch.randn(6, 4, generator=_rng(0)) * 0.1)
            opt = _optimizer([("w", p)], spec, track_gap=True)
            _step(opt, [p], [torch.randn(6, 4, generator=_rng(1))])
            p.grad = torch.randn(6, 4, generator=_rng(2))
            gap = opt.diagnostics()["r"]["gap"]
            assert gap is not None and gap >= 0, (gkind, constraint["kind"], gap)


# ---------------------------------------------------------------- extreme reference values

EPS = [F64_MIN, 1e-300, 1e-40, 1e-8, 1e30, F64_MAX]
KAPPA = [1.0, 4.0, F64_MAX]
REFERENCES = ([{"kind": "quadratic"}, {"kind": "indicator"}]
              + [{"kind": "log_barrier", "eps": e} for e in EPS]
              + [{"kind": "power_barrier", "kappa": k, "eps": e} for k in KAPPA for e in EPS])
REFERENCE_GEOMETRIES = (
    [{"kind": k} for k in ("isotropic", "anisotropic", "rowwise", "columnwise")]
    + [{"kind": "spectral", "approx": {"kind": a}} for a in ("svd", "gram_eigh", "newton_schulz",
                                                             "gram_newton_schulz", "polar_express")]
    + [{"kind": "spectral", "approx": {"kind": "gram_eigh", "dtype": "float32"}},
       {"kind": "spectral", "approx": {"kind": "svd"}, "prenormalize": {"kind": "frobenius", "eps": F64_MIN}},
       {"kind": "spectral", "approx": {"kind": "newton_schulz"}, "prenormalize": {"kind": "max", "eps": F64_MIN}},
       {"kind": "spectral", "approx": {"kind": "gram_newton_schulz"},
        "prenormalize": {"kind": "frobenius", "eps": F64_MAX}}])
POLYNOMIAL = ("newton_schulz", "gram_newton_schulz", "polar_express")
SHAPE = (4, 3)


def _gradients() -> dict:
    """Finite gradients of SHAPE that have broken operators: zeros, a zero row, a zero column,
    subnormal, tiny, huge and near-overflow entries, and a mix of them in one tensor."""
    base = torch.randn(SHAPE, generator=_rng(0))
    out = {"zero": torch.zeros(SHAPE)}
    out["zero row"] = base.clone().index_fill_(0, torch.tensor([1]), 0.0)
    out["zero column"] = base.clone().index_fill_(1, torch.tensor([0]), 0.0)
    for v in (1e-45, 1e-40, 1e-30, 1e30, torch.finfo(torch.float32).max):
        out[f"±{v:.3g}"] = base.sign() * v
    mixed = base.clone()
    mixed[0] = torch.finfo(torch.float32).max
    mixed[1] = 1e-45
    mixed[:, 0] = 0.0
    out["mixed"] = mixed
    return out


GRADIENTS = _gradients()


def _bound(geometry: dict, reference: dict) -> float | None:
    """max |∇φ₁*(D)_ij| over every D for the rule's map: 1 for a bounded reference (barriers,
    indicator: (h*)' ≤ 1 in every geometry's norm, which bounds the entries), the composed
    polynomial's maximum (< 1.25) for the matrix iterations, None for the quadratic (unbounded)."""
    if (geometry.get("approx") or {}).get("kind") in POLYNOMIAL:
        return 1.25
    return None if reference["kind"] == "quadratic" else 1.0


def _one_step(geometry: dict, reference: dict, grad: torch.Tensor, dtype, *, track_update: bool,
              constraint: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rule = {"name": "r", "match": "**", "geometry": {**geometry, "reference": reference}, "lr": 0.1,
            "weight_decay": 0.0}
    if constraint is not None:
        rule["constraint"] = constraint
    x0 = (torch.randn(SHAPE, generator=_rng(1)) * 0.1).to(dtype)
    p = torch.nn.Parameter(x0.clone())
    opt = _optimizer([("w", p)], {"geomopt": 1, "name": "extreme", "rules": [rule]}, track_update=track_update)
    _step(opt, [p], [grad.to(dtype)])
    return x0, p.detach()


@pytest.mark.parametrize("reference", REFERENCES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
@pytest.mark.parametrize("geometry", REFERENCE_GEOMETRIES,
                         ids=lambda g: "-".join([g["kind"], *((g.get("approx") or {}).values()),
                                                 *([f"prenorm-{g['prenormalize']['kind']}"] if "prenormalize" in g
                                                   else [])]))
def test_extreme_references_keep_parameters_finite(geometry, reference):
    """One step (lr 0.1, ρ = 1) from finite parameters on every gradient of GRADIENTS: finite
    parameters, in float32 (the flat path for the elementwise rules, and the batched one with
    track_update) and bfloat16; in float32 each entry moves by at most γρ·(the map's bound) for the
    bounded references and the polynomial iterations, by at most γρ·|D| for the quadratic."""
    for name, grad in GRADIENTS.items():
        for dtype, track in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
            x0, x1 = _one_step(geometry, reference, grad, dtype, track_update=track)
            assert torch.isfinite(x1).all(), (name, dtype, track, x1)
            if dtype != torch.float32:
                continue
            moved = (x1 - x0).abs()
            bound = _bound(geometry, reference)
            limit = 0.1 * (bound if bound is not None else grad.abs().max().item()) * (1 + 1e-5)
            assert moved.max().item() <= limit + 1e-6 * x0.abs().max().item(), (name, track, moved.max())


ADAM_LIKE = [
    {"geometry": {"kind": "adam", "eps": e}} for e in (F64_MIN, 1e-40, F64_MAX)] + [
    {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
     "post": [{"kind": "second_moment", "axis": axis, "eps": e}, {"kind": "rms_match", "target": t, "eps": e}]}
    for e in (F64_MIN, F64_MAX) for axis, t in (("row", "input"), ("element", 0.2))]


@pytest.mark.parametrize("rule", ADAM_LIKE, ids=lambda r: "-".join(
    [r["geometry"]["kind"], *(s["kind"] for s in r.get("post", [])),
     str(r["geometry"].get("eps", r.get("post", [{}])[0].get("eps")))]))
def test_extreme_eps_of_adam_and_post_stages_keep_parameters_finite(rule):
    """The other ε of the language (Adam's, the second-moment and RMS-matching post-stages'), at the
    validator's bounds, on every gradient of GRADIENTS for two steps: finite parameters whichever
    path runs Adam (torch's fused kernel, the foreach ops, the batched path for bfloat16), and with
    a floor at √tiny the Adam step stays within γ·(1 − β₁)/√(1 − β₂)·(1 + rounding) per entry."""
    spec = {"geomopt": 1, "name": "eps", "rules": [{"name": "r", "match": "**", "lr": 0.1, "weight_decay": 0.0,
                                                    **rule}]}
    for name, grad in GRADIENTS.items():
        for dtype, implementation in ((torch.float32, "auto"), (torch.float32, "foreach"), (torch.bfloat16, "auto")):
            x0 = (torch.randn(SHAPE, generator=_rng(1)) * 0.1).to(dtype)
            p = torch.nn.Parameter(x0.clone())
            opt = _optimizer([("w", p)], spec, implementation=implementation)
            for _ in range(2):
                _step(opt, [p], [grad.to(dtype)])
            assert torch.isfinite(p).all(), (name, dtype, implementation, p)
            if rule["geometry"]["kind"] == "adam" and dtype == torch.float32:
                # |m̂|/(√v̂ + ε) ≤ 1/√(1 − β₂) over two steps (β = 0.9, 0.999), per step of lr 0.1
                assert (p.detach() - x0).abs().max() <= 2 * 0.1 * 1 / math.sqrt(1 - 0.999) * 1.001, name


BOUNDED = [{"kind": "indicator"}] + [{"kind": "log_barrier", "eps": e} for e in (F64_MIN, F64_MAX)] + [
    {"kind": "power_barrier", "kappa": k, "eps": e} for k in (1.0, F64_MAX) for e in (F64_MIN, F64_MAX)]
CONSTRAINED = [(g, c) for g in REFERENCE_GEOMETRIES[:6] for c in supported_constraints(g["kind"])]


@pytest.mark.parametrize("geometry,ckind", CONSTRAINED,
                         ids=[f"{g['kind']}-{(g.get('approx') or {}).get('kind', '')}-{c}" for g, c in CONSTRAINED])
def test_extreme_references_with_constraints_keep_parameters_finite(geometry, ckind):
    """The backward steps read the reference too (κ in their scalar solves, the barrier's domain in
    their feasibility test): with the bounded references at the bounds of ε and κ, one constrained
    step keeps the parameters finite on every gradient of GRADIENTS, in float32 and bfloat16."""
    for reference in BOUNDED:
        for name, grad in GRADIENTS.items():
            for dtype in (torch.float32, torch.bfloat16):
                _, x1 = _one_step(geometry, reference, grad, dtype, track_update=False, constraint=_constraint(ckind))
                assert torch.isfinite(x1).all(), (reference, name, dtype, x1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_working_eps_floors_and_limits(dtype):
    """The floors of :func:`working_eps` and the maps they make safe: ε below the dtype's smallest
    normal number maps y as ε = tiny does, which equals the ε → 0 limit sign(y) to rounding wherever
    tiny is at most half an ulp of |y| (|y| ≥ 2²⁴·tiny in float32); ε above its largest value maps
    to 0 there; a group whose squares underflowed is not blown up by the isotropic factor."""
    info = torch.finfo(dtype)
    assert working_eps(1e-300, dtype) == max(1e-300, info.tiny)
    assert working_eps(1e-300, dtype, norm=True) == max(1e-300, math.sqrt(info.tiny))
    assert working_eps(0.5, dtype) == 0.5
    assert working_eps(F64_MAX, torch.float32) == math.inf
    half_ulp = 2 / info.eps * info.tiny  # from here on, tiny is at most half an ulp of |y|: y/(tiny + |y|) = sign(y)
    y = torch.tensor([0.0, 1e-45, -1e-40, half_ulp, -1.0, info.max], dtype=dtype)
    for ref in ({"kind": "log_barrier", "eps": F64_MIN}, {"kind": "power_barrier", "kappa": 4.0, "eps": F64_MIN}):
        h = make_reference(typed.reference(ref))
        out = h.dual_grad(y)
        assert torch.isfinite(out).all() and out.abs().max() <= 1
        limit = (y.abs() >= half_ulp) & (y.abs() <= 1)
        torch.testing.assert_close(out[limit], torch.sign(y[limit]), rtol=2 * info.eps, atol=0)
        assert out[0] == 0
        torch.testing.assert_close(out[-1].double(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-5, atol=0)
        s = y.abs()
        assert torch.isfinite(h.iso_factor(s)).all() and (h.iso_factor(s) * s).max() <= 1 + 4 * info.eps
        # the isotropic factor's floor √tiny: a norm that lost its entries' squares (s = 0) leaves them
        # below 1 after the factor, not blown up by 1/ε
        tiny_group = torch.full((3,), 1e-20 if dtype == torch.float32 else 1e-160, dtype=dtype)
        norm = torch.linalg.vector_norm(tiny_group)
        assert (tiny_group * h.iso_factor(norm)).abs().max() <= 1
        h_big = make_reference(typed.reference({**ref, "eps": F64_MAX}))
        if dtype == torch.float32:  # ε past float32's range is +∞ there: the map is 0
            assert torch.equal(h_big.dual_grad(y), torch.zeros_like(y))
        else:  # float64 holds ε: y/ε (to its rounding, ≤ 1)
            big = h_big.dual_grad(y)
            assert torch.isfinite(big).all() and big.abs().max() <= 1 and big[-2] == -1.0 / F64_MAX
