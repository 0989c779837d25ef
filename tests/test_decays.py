"""Weight decays and the forward ops' forms are declared units: each decay's arithmetic in every form
it has against a float64 reference of its definition, and the engine's choices (flat call,
write-back, deferral; which geometries are elementwise) read off the declarations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from geomopt import GeomOptimizer
from geomopt.geometry.operators import FORWARD_OPS, elementwise_geometries, flat_refusal
from geomopt.optim.engine.program import flat_rule
from geomopt.optim.units.decays import DECAYS, DecayUnit
from geomopt.registry import LOCAL, REDUCE
from geomopt.spec.updates import Decay, kinds_of


def _reference(kind: str, x: torch.Tensor, s: torch.Tensor, factor: float) -> torch.Tensor:
    """The decays' definitions, in float64: X(1 − γλ), and cautiously only where S⊙X ≥ 0."""
    x, s = x.double(), s.double()
    if kind == "decoupled":
        return x * factor
    return torch.where(s * x >= 0, x * factor, x)


def _xs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, s = torch.randn(3, 5, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    s[0, 0, 0] = 0.0  # S⊙X = 0: the cautious decay applies there (≥ 0)
    return x, s


def test_every_decay_of_the_language_is_declared():
    assert set(DECAYS) == set(kinds_of(Decay))
    assert all(DECAYS[k].locality == LOCAL for k in DECAYS)


@pytest.mark.parametrize("kind", sorted(DECAYS))
def test_every_form_of_a_decay_is_its_float64_reference(kind):
    x, s = _xs()
    factor = 1 - 0.1 * 0.3
    want = _reference(kind, x, s, factor)
    got = DECAYS[kind].stacked(x, s, factor)
    torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=0)
    assert not torch.equal(got, x)  # it decays something
    if kind == "cautious":  # and, cautiously, not everything
        assert torch.equal(got[(s * x) < 0], x[(s * x) < 0]) and bool(((s * x) < 0).any())
        assert got[0, 0, 0] == x[0, 0, 0] * factor
    unit = DECAYS[kind]
    if unit.in_place is not None:
        views = [t.clone() for t in x.unbind(0)]
        unit.in_place(views, factor)
        assert torch.equal(torch.stack(views), got)  # the list form, bit for bit the stacked one


def test_a_decay_that_reads_the_step_has_no_in_place_form():
    with pytest.raises(ValueError, match="reads the step"):
        DecayUnit("bad", None, lambda x, s, f: x, in_place=lambda xs, f: None, reads_step=True)
    assert DECAYS["cautious"].why_not_in_place() == "cautious weight decay reads the update's sign per entry"
    assert DECAYS["decoupled"].why_not_in_place() is None


def _plan_group(decay: str, geometry: str = "euclidean"):
    spec = {"geomopt": 1, "name": "d", "defaults": {"weight_decay": 0.1, "decay": decay},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": geometry}
                       if geometry in ("euclidean", "adam") else
                       {"kind": geometry, "reference": {"kind": "log_barrier", "eps": 1e-8}}}]}
    opt = GeomOptimizer(nn.Linear(4, 3), spec, lr=0.1)
    return opt, opt.param_groups[0], opt.engine.plans[0][0]


def test_the_programs_read_the_decay_declarations(monkeypatch):
    opt, group, pp = _plan_group("cautious")
    opts = opt.engine.options
    assert flat_rule(group, pp, opts) == DECAYS["cautious"].why_not_in_place()
    progs = [p for ps in opt.engine.programs for p in ps]
    assert all(p.variant == "batched" and p.write == "stacked" for p in progs)
    assert any("cautious decay" in w for p in progs for w in p.why)
    # the choice follows the declaration, not the name: a cautious decay declared with an
    # in-place form (an arithmetic it does not have) would be offered the flat call
    monkeypatch.setitem(DECAYS, "cautious", dataclasses.replace(DECAYS["decoupled"], name="cautious"))
    assert flat_rule(group, pp, opts) is None
    opt, group, pp = _plan_group("decoupled")
    assert flat_rule(group, pp, opt.engine.options) is None


def test_a_cautious_step_is_its_reference():
    torch.manual_seed(0)
    opt, group, pp = _plan_group("cautious")
    params = list(opt.param_groups[0]["params"])
    x0 = [p.detach().double().clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, x, g in zip(params, x0, grads):
        # X⁺ = decay(X) − γ·G (euclidean geometry, radius 1, no direction), the decay cautious against S = G
        want = _reference("cautious", x, g, 1 - 0.1 * 0.1) - 0.1 * g.double()
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-6, atol=1e-7)


def test_the_elementwise_geometries_are_read_off_the_forward_ops():
    assert set(elementwise_geometries()) == {"euclidean", "anisotropic", "isotropic", "adam"}
    assert flat_refusal("spectral") == "spectral geometry is not elementwise"
    assert flat_refusal("isotropic") is None
    assert "sharded" in flat_refusal("isotropic", sharded=True)
    assert flat_refusal("anisotropic", sharded=True) is None
    # a forward op declared with the flat form is elementwise, and its locality says where
    FORWARD_OPS.add("toy_iso", lambda *a, **k: None, locality=REDUCE, forms=("flat",))
    try:
        assert "toy_iso" in elementwise_geometries()
        assert flat_refusal("toy_iso") is None and flat_refusal("toy_iso", sharded=True) is not None
    finally:
        del FORWARD_OPS["toy_iso"], FORWARD_OPS.meta["toy_iso"]
    assert "toy_iso" not in elementwise_geometries()
