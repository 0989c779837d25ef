"""The plan is frozen and typed: spec models with their per-tensor values resolved, a typed view,
fragments shared by a rule's plans, and an engine that reads them by attribute, never by a string
key."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pydantic
import pytest
import torch
from torch import nn

from geomopt import GeomOptimizer
from geomopt.compile.compiler import compile_spec
from geomopt.compile.fragments import ResolvedGeometry, View, plain
from geomopt.compile.plan import ops_digest
from geomopt.spec.base import SpecModel

ROOT = Path(__file__).resolve().parents[1]

SPEC = """
geomopt: 1
name: typed
rules:
  - name: qkv
    match: {name: "qkv.weight"}
    geometry: {kind: spectral, reference: {kind: indicator}, scale: scion, view: {kind: matrix, blocks: [16, 8, 8]}}
    constraint: {kind: spectral_ball, radius: 2.0, relative: true}
  - name: hidden
    match: {ndim: 2}
    geometry: {kind: spectral, reference: {kind: indicator}, scale: scion, layout: in_out}
    direction: {kind: polyak, alpha: 0.9, nesterov: true}
    post: [{kind: norm_ratio}]
  - name: rest
    match: "**"
    geometry: {kind: adam}
"""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 32, bias=False)
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(8, 12)


def _plan():
    return compile_spec(SPEC, Net())


def test_fragments_are_frozen_typed_models():
    plan = _plan()
    qkv, a = plan["qkv.weight"], plan["a.weight"]
    assert isinstance(qkv.geometry, ResolvedGeometry) and isinstance(qkv.geometry.view, View)
    assert qkv.geometry.view.blocks == (16, 8, 8)
    # the blocks' radius factors over block 0's (scion: √(d_out/d_in)): √(8/8) / √(16/8)
    assert qkv.geometry.view.factors == pytest.approx((1.0, 2 ** -0.5, 2 ** -0.5))
    assert qkv.geometry.view.scale_constraint  # a relative radius scales with the blocks
    for fragment in (qkv.constraint, a.direction, a.schedule, *a.post):
        assert isinstance(fragment, SpecModel)
    assert a.direction.kind == "polyak" and a.direction.alpha == 0.9 and a.post[0].kind == "norm_ratio"
    # the resolved values: layout in_out → the ops see out_in on the transpose; a relative
    # radius in units of ρ (scion on the 16×8 block 0: √2)
    assert a.geometry.spec.layout == "out_in" and a.transpose
    assert qkv.constraint.radius == pytest.approx(2.0 * 2 ** 0.5) and qkv.constraint.relative is False
    with pytest.raises(pydantic.ValidationError):
        a.direction.alpha = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        qkv.geometry.view = None  # type: ignore[misc]


def test_a_rules_plans_share_their_fragments():
    plan = _plan()
    a, b = plan["a.weight"], plan["b.weight"]
    assert a.geometry is b.geometry and a.direction is b.direction and a.post is b.post
    assert plan["a.bias"].geometry is plan["b.bias"].geometry


def test_plain_is_the_json_form_and_the_digest_reads_it():
    plan = _plan()
    qkv = plan["qkv.weight"]
    g = plain(qkv.geometry)
    assert g["kind"] == "spectral" and g["view"] == {"batch": 0, "trailing": "cols", "blocks": [16, 8, 8],
                                                     "factors": list(qkv.geometry.view.factors),
                                                     "scale_constraint": True}
    # read by name, the resolved geometry answers as its plain form does
    assert all(plain(qkv.geometry[k]) == v for k, v in g.items())
    assert ops_digest(qkv.geometry, qkv.constraint, qkv.radius, qkv.transpose) == ops_digest(
        g, plain(qkv.constraint), qkv.radius, qkv.transpose)
    changed = dataclasses.replace(qkv.geometry, view=dataclasses.replace(qkv.geometry.view, factors=(1.0, 1.0, 1.0)))
    assert ops_digest(changed, qkv.constraint, qkv.radius, qkv.transpose) != ops_digest(
        qkv.geometry, qkv.constraint, qkv.radius, qkv.transpose)


def test_a_step_runs_on_typed_plans():
    torch.manual_seed(0)
    net = Net()
    opt = GeomOptimizer(net, SPEC, lr=0.01)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, net.parameters()))
    assert all(torch.isfinite(p).all() for p in net.parameters())


_KIND_LOOKUP = "a string-keyed read of a fragment's kind"


def _kind_lookups(path: Path) -> list[str]:
    """``x["kind"]`` and ``x.get("kind")`` in a module (the source positions)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "kind":
            out.append(f"{path.name}:{node.lineno}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"):
            out.append(f"{path.name}:{node.lineno}")
    return out


STEP_PATH = sorted((ROOT / "geomopt" / "optim").rglob("*.py")) + sorted((ROOT / "geomopt" / "geometry").rglob("*.py"))


@pytest.mark.parametrize("path", STEP_PATH, ids=lambda p: str(p.relative_to(ROOT / "geomopt")))
def test_the_step_path_reads_no_kind_by_string(path):
    """The engine and the arithmetic units read typed fragments by attribute (a param group's
    ``schedule``, plain data by torch's contract, is validated into its model first:
    geomopt.optim.units.schedules.typed_schedule)."""
    found = _kind_lookups(path)
    assert not found, f"{_KIND_LOOKUP} on the step path: {found}"


def test_the_kind_lookup_finder_finds_one():
    """The finder above is not blind: it sees both spellings."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text('def f(g):\n    return g["kind"], g.get("kind")\n')
        assert _kind_lookups(p) == ["m.py:2", "m.py:2"]


# ---------------------------------------------------------------- a step reads nothing by name

#: shipped specs whose steps cover every forward kind, the polynomial approximations with each
#: pre-normalization (AOL: turbo-muon), views, the backward steps (projections, a retraction, a
#: prox under a barrier, proximal decay) and the kronecker methods
STEP_SPECS = ["muon", "adamw-hybrid", "scion", "uscion", "stiefel", "hyperball", "prox-muon-frobenius",
              "sign-descent", "spectral-clip", "catalog/shampoo", "catalog/soap", "catalog/psgd-kron",
              "catalog/turbo-muon", "catalog/muon-hyperball", "catalog/lion", "catalog/normuon"]

THEORY = """
geomopt: 1
name: theory
defaults:
  direction: {kind: polyak, alpha: 0.1}
  schedule: {kind: theory, horizon: 100, gamma_bar: 0.5}
rules:
  - name: hidden
    match: {ndim: 2}
    geometry: {kind: spectral, reference: {kind: indicator}, approx: {kind: newton_schulz}, view: auto}
    constraint: {kind: spectral_ball, radius: 3.0}
  - name: rest
    match: "**"
    geometry: {kind: isotropic, reference: {kind: log_barrier, eps: 1.0e-8}}
"""

#: the post-stages read their own fields by name (geomopt.optim.units.stages: ``cfg["target"]``),
#: never a kind: the only reads by name a step may make
_POST_STAGES = {"norm_ratio", "rms_match", "second_moment", "cautious", "trust_ratio", "row_norm", "contra",
                "power_normalize"}


def _spec_text(name: str) -> str:
    return THEORY if name == "theory" else (ROOT / "specs" / f"{name}.yaml").read_text()


@pytest.fixture
def name_reads(monkeypatch):
    """Every read of a fragment by name (``fragment["x"]``, ``.get``, ``in``, ``keys``, ``items``) on
    the spec models, the resolved geometries and the views, as (class, key), while ``reading[0]``."""
    reads: list = []
    reading = [False]

    def watch(cls, method):
        original = getattr(cls, method)

        def watched(self, *args, **kwargs):
            if reading[0]:
                reads.append((type(self).__name__, args[0] if args else method))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, watched)

    for cls in (SpecModel, ResolvedGeometry, View):
        for method in ("__getitem__", "get", "__contains__", "keys", "items"):
            if method in vars(cls):
                watch(cls, method)
    return reads, reading


@pytest.mark.parametrize("name", STEP_SPECS + ["theory"])
def test_a_step_reads_no_fragment_by_name(name, name_reads):
    """Two steps (the first creates the state) of a spec on a small GPT read every fragment by
    attribute: no kind, and no field of a geometry, constraint, approximation, pre-normalization,
    reference, schedule or view, is read by name."""
    from optim_helpers import gpt_batch, loss_of, tiny_gpt

    reads, reading = name_reads
    torch.manual_seed(0)
    model = tiny_gpt(0)
    opt = GeomOptimizer(model, _spec_text(name))
    post = {s.kind for r in opt.spec.rules for s in (r.post or ())}
    for k in range(2):
        opt.zero_grad()
        loss_of(model, gpt_batch(k)).backward()
        reading[0] = True
        try:
            opt.step()
        finally:
            reading[0] = False
    assert all(torch.isfinite(p).all() for p in model.parameters())
    kinds = [r for r in reads if r[1] == "kind"]
    assert not kinds, f"a step of {name} looked up a kind by name: {kinds}"
    others = [r for r in reads if not (post and r[0] in _post_models(post))]
    assert not others, f"a step of {name} read fragments by name: {sorted(set(others))}"


def _post_models(kinds: set) -> set:
    """The class names of the post-stage models of ``kinds`` (their fields are read by name)."""
    from geomopt.spec.model import Rule

    union = Rule.model_fields["post"].annotation
    models = {m for m in _members(union)}
    return {m.__name__ for m in models if m.model_fields["kind"].default in kinds}


def _members(tp) -> set:
    """The pydantic models inside a (nested) annotation."""
    import typing

    out = set()
    stack = [tp]
    while stack:
        t = stack.pop()
        if isinstance(t, type) and issubclass(t, pydantic.BaseModel):
            out.add(t)
        else:
            stack.extend(typing.get_args(t))
    return out


def test_the_name_read_watch_sees_a_kind_read(name_reads, monkeypatch):
    """The watch above is not blind: a kind read by name on a plan's fragment during a step is
    seen (the polynomial iteration's pre-normalization read as ``cfg["kind"]``)."""
    import geomopt.geometry.spectral as spectral
    from optim_helpers import gpt_batch, loss_of, tiny_gpt

    reads, reading = name_reads
    model = tiny_gpt(0)
    opt = GeomOptimizer(model, "muon")
    original = spectral.odd_quintic_iteration

    def by_name(x, coefficients, *, prenorm=None, **kwargs):
        assert prenorm is not None and prenorm["kind"] == "max"  # the spelling the step path forbids
        return original(x, coefficients, prenorm=prenorm, **kwargs)

    monkeypatch.setattr(spectral, "odd_quintic_iteration", by_name)
    loss_of(model, gpt_batch(0)).backward()
    reading[0] = True
    opt.step()
    reading[0] = False
    assert ("MaxPrenorm", "kind") in reads


def test_a_group_schedule_the_spec_refuses_is_refused_before_the_step():
    """A param group's ``schedule`` is plain data (saved in the state dict, editable): the step
    validates it into the spec's model when it changes, so a bad edit gets the spec's message and
    nothing moves; a good edit is what the next step runs."""
    from optim_helpers import gpt_batch, loss_of, tiny_gpt

    model = tiny_gpt(0)
    opt = GeomOptimizer(model, THEORY)
    loss_of(model, gpt_batch(0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    group = opt.param_groups[0]
    group["schedule"] = {"kind": "theory", "horizon": 100}
    with pytest.raises(ValueError, match="rule 'hidden': schedule.theory.gamma_bar: Field required"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert group["step"] == 0
    group["schedule"]["gamma_bar"] = 0.25  # edited in place: read again
    opt.step()
    assert opt.engine.schedules[0].gamma_bar == 0.25 and group["step"] == 1
