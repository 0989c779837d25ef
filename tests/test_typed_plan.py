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


ENGINE = sorted((ROOT / "geomopt" / "optim").rglob("*.py"))


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: str(p.relative_to(ROOT / "geomopt" / "optim")))
def test_the_engine_reads_no_kind_by_string(path):
    """The engine reads typed fragments by attribute. The one exception: a torch param group's
    ``schedule`` (a plain dict by torch's contract: it is saved in the state dict)."""
    found = [f for f in _kind_lookups(path) if f not in _ALLOWED]
    assert not found, f"{_KIND_LOOKUP} in the engine: {found}"


def _group_schedule_lines() -> set[str]:
    out = set()
    for path in ENGINE:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if '["schedule"]["kind"]' in line:
                out.add(f"{path.name}:{i}")
    return out


_ALLOWED = _group_schedule_lines()


def test_the_kind_lookup_finder_finds_one():
    """The finder above is not blind: it sees both spellings."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text('def f(g):\n    return g["kind"], g.get("kind")\n')
        assert _kind_lookups(p) == ["m.py:2", "m.py:2"]
