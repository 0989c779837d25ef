"""Declared units: every direction in every form it declares against one float64 reference of that
direction, the state a direction writes is the state it declares, and the tables derived from the
declarations (state keys, group keys, migration kinds) follow a new declaration with no other edit."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field

from geomopt.optim.units import state_keys
from geomopt.optim.units.directions import DIRECTIONS, polyak_ahead, polyak_rows
from geomopt.optim.units.declare import COUNT, FIRST, OP, SECOND, STAT, WEIGHT, DirectionUnit, StateKey
from geomopt.registry import Registry
from geomopt.spec.base import SpecModel

STEPS = 4
SHAPE = (3, 5, 4)  # a bucket of three 5×4 tensors


def _group(kind: str, **kw) -> dict:
    base = dict(direction=kind, alpha=0.3, nesterov=False, init="zero", momentum=0.8, dampening=0.25,
                beta1=0.7, beta2=0.95, warmup_steps=0, warmup_alpha=None)
    return {**base, **kw}


def _reference(kind: str, group: dict, gs: list, g_prevs: list) -> tuple[list, torch.Tensor]:
    """(the direction at each step, the final state d) in float64, written from each method's
    definition (not from geomopt's functions)."""
    a, out, d = group["alpha"], [], None
    for k, g in enumerate(gs):
        if kind == "none":
            out.append(g)
            continue
        if kind == "polyak":
            if d is None and group["init"] == "gradient":
                d = g.clone()
                out.append(g.clone())  # Nesterov's look-ahead of d⁰ = g⁰ is g
                continue
            d = (1 - a) * (torch.zeros_like(g) if d is None else d) + a * g
            out.append(a * g + (1 - a) * d if group["nesterov"] else d)
        elif kind == "heavy_ball":
            mu, tau = group["momentum"], group["dampening"]
            d = g.clone() if d is None else mu * d + (1 - tau) * g
            out.append(g + mu * d if group["nesterov"] else d)
        elif kind == "lion":
            m = torch.zeros_like(g) if d is None else d
            out.append(group["beta1"] * m + (1 - group["beta1"]) * g)
            d = group["beta2"] * m + (1 - group["beta2"]) * g
        elif kind == "storm":
            d = g.clone() if d is None else g + (1 - a) * (d - g_prevs[k])
            out.append(d)
    return out, d


CASES = [("none", {}), ("polyak", {}), ("polyak", {"nesterov": True}), ("polyak", {"init": "gradient"}),
         ("polyak", {"init": "gradient", "nesterov": True}), ("heavy_ball", {}),
         ("heavy_ball", {"nesterov": True}), ("lion", {}), ("storm", {})]


def _grads(seed: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    gs = [torch.randn(SHAPE, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
    return gs, [g + 0.1 * torch.randn(SHAPE, generator=gen, dtype=torch.float64) for g in gs]


def _scratch(shape, like):
    return torch.empty(shape, dtype=like.dtype)


def _run(form: str, kind: str, group: dict, gs: list, g_prevs: list, fresh: bool) -> tuple[list, torch.Tensor]:
    """Each step's direction and the final state d, as ``form`` computes them."""
    state: dict = {}
    out = []
    for k, g in enumerate(gs):
        if form == "stacked":
            later: list = []
            d = DIRECTIONS[kind].fn(g.clone(), state, group, g_prev=g_prevs[k] if k else None, inplace=True,
                                    fresh=later if fresh else None)
            d = d.clone()
            for update in later:
                update()
        elif form == "flat":  # the list form over a bucket's tensors, then the look-ahead over u = g
            meta = DIRECTIONS.meta[kind]
            first = "d" not in state
            if first:
                state["d"] = torch.zeros(SHAPE, dtype=g.dtype)
            ds, rows = list(state["d"].unbind(0)), list(g.unbind(0))
            meta["foreach"](ds, rows, group, first)
            d = state["d"] if kind != "none" else g
            if group["nesterov"]:
                u = g.clone()
                meta["lookahead"](u, state["d"], group)
                d = u
            d = d.clone()
        elif form == "rows":
            later = []
            d = polyak_rows(list(g.unbind(0)), state, group, _scratch, fresh=later if fresh else None).clone()
            for update in later:
                update()
        else:  # ahead: u first, the state's write put off to commit()
            u, commit = polyak_ahead(list(g.unbind(0)), state, group, _scratch, fresh=fresh)
            d = u.clone()
            commit()
        out.append(d)
    return out, state.get("d")


def _forms(kind: str) -> list[str]:
    unit = DIRECTIONS[kind]
    return (["stacked"] + ["flat"] * unit.has("flat") + ["rows", "ahead"] * unit.has("rows"))


@pytest.mark.parametrize("fresh", [False, True], ids=["in-place", "journaled"])
@pytest.mark.parametrize("kind,extra", CASES, ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in e.items())}"
                                                   for k, e in CASES])
def test_every_form_of_a_direction_is_its_float64_reference(kind, extra, fresh):
    group = _group(kind, **extra)
    gs, g_prevs = _grads(len(kind) + len(extra))
    want, want_d = _reference(kind, group, gs, g_prevs)
    forms = _forms(kind)
    assert "stacked" in forms and (kind not in ("polyak", "heavy_ball", "none") or "flat" in forms)
    for form in forms:
        if form == "flat" and fresh:
            continue  # the flat path binds new buffers itself (geomopt.optim.engine.flat)
        got, got_d = _run(form, kind, group, gs, g_prevs, fresh)
        for k, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{kind} {form}: step {k}")
        if want_d is not None:
            torch.testing.assert_close(got_d, want_d, rtol=1e-12, atol=1e-12, msg=f"{kind} {form}: state d")


@pytest.mark.parametrize("kind,extra", [("polyak", {"nesterov": True}), ("heavy_ball", {"nesterov": True})])
def test_a_direction_not_in_place_leaves_the_gradient_and_is_its_reference(kind, extra):
    """The stacked form without ``inplace``: a new tensor each step, the gradient left as it was."""
    group = _group(kind, **extra)
    gs, g_prevs = _grads(7)
    want, _ = _reference(kind, group, gs, g_prevs)
    state: dict = {}
    for k, g in enumerate(gs):
        before = g.clone()
        d = DIRECTIONS[kind].fn(g, state, group, g_prev=None, inplace=False)
        torch.testing.assert_close(d, want[k], rtol=1e-12, atol=1e-12, msg=f"{kind}: step {k}")
        assert torch.equal(g, before)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_look_ahead_keeps_its_own_copy_of_the_first_gradient(rows):
    """``init: gradient`` in the look-ahead form: d⁰ = g⁰ is the state's own tensor, also for a bucket
    of one tensor (whose stack is a view of its gradient), so a gradient zeroed in place after the
    step (``zero_grad(set_to_none=False)``) leaves d as it was."""
    gs = list(torch.randn(rows, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rows)).unbind(0))
    want = torch.stack(gs).clone()
    state: dict = {}
    u, commit = polyak_ahead(gs, state, _group("polyak", init="gradient"), _scratch)
    torch.testing.assert_close(u, want, rtol=0, atol=0)
    commit()
    for g in gs:
        g.zero_()
    torch.testing.assert_close(state["d"], want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", [k for k in DIRECTIONS if k != "dion"] + ["dion"])
def test_a_direction_writes_only_the_state_it_declares(kind):
    group = _group(kind, rank=2, mu=0.9, eps=1e-8)
    gs, g_prevs = _grads(7)
    state: dict = {}
    for k, g in enumerate(gs[:2]):
        DIRECTIONS[kind].fn(g.clone(), state, group, g_prev=g_prevs[k] if k else None)
    declared = {s.key for s in DIRECTIONS[kind].state}
    written = set(state)
    if DIRECTIONS[kind].keeps_prev:
        written.add("prev")  # the optimizer keeps the previous iterate for it (bucket_step)
    assert written == declared, (kind, written, declared)


def test_derived_tables_follow_the_declarations():
    # every declared key lands in the tables its declaration puts it in, and nowhere else
    for key, decl in state_keys.STATE.items():
        assert (key in state_keys.MOMENTS) == (decl.moment is not None)
        assert (key in state_keys.COUNTS) == (decl.layout == COUNT)
        assert (key in state_keys.STACKED) == (decl.layout not in (COUNT, WEIGHT))
        assert (key in state_keys.VIEW_KEYS) == (decl.layout == OP)
        assert (key in state_keys.WEIGHT_KEYS) == (decl.layout == WEIGHT)
    assert state_keys.WEIGHT_KEYS == ("weight_error",) and state_keys.KINDS["compensation"] == ("weight_error",)
    assert state_keys.MOMENTS["d"] and not state_keys.MOMENTS["exp_avg_sq"]
    # the migration kinds: the adam geometry's three keys move together; heavy ball's sum has no kind
    assert state_keys.KINDS["adam"] == ("exp_avg", "exp_avg_sq", "adam_step")
    assert DIRECTIONS["heavy_ball"].migrates is None and DIRECTIONS["polyak"].migrates == "momentum"
    # every direction's coefficients reach its group: a group key or a derived direction key
    for unit in DIRECTIONS.values():
        for c in unit.coefficients:
            assert c in state_keys.GROUP_KEYS or c in state_keys.direction_keys(), (unit.name, c)


def test_a_new_declaration_reaches_every_derived_table():
    """A toy unit, declared once in registries of its own: the tables derived from them hold it."""
    state = Registry("state key")
    state.update(state_keys.STATE)
    state.add("toy_v", StateKey("toy_v", layout=STAT, moment=SECOND))
    state.add("toy_m", StateKey("toy_m", moment=FIRST))
    state.add("toy_step", StateKey("toy_step", layout=COUNT))
    assert state_keys.moments(state)["toy_m"] is True and state_keys.moments(state)["toy_v"] is False
    assert {"toy_v", "toy_m", "toy_v_absmax", "toy_m_absmax", "toy_v_ec", "toy_m_ec"} <= set(state_keys.stacked(state))
    assert "toy_step" not in state_keys.stacked(state) and "toy_step" in state_keys.keys_in(COUNT, state)
    assert state_keys.keys_in(STAT, state)[-1] == "toy_v"

    class Toy(SpecModel):
        kind: str = "toy"
        alpha: float = 0.5  # a group key already: not a direction key
        toy_gain: float = Field(default=2.0, gt=0)

    directions = Registry("direction")
    directions.update(DIRECTIONS)
    directions.add("toy", DirectionUnit("toy", lambda g, *a, **k: g, Toy, (StateKey("toy_m", moment=FIRST),),
                                        "toy", ("flat",)))
    keys = state_keys.direction_keys(directions)
    assert "toy_gain" in keys and "alpha" not in keys
    assert set(state_keys.direction_keys()) < set(keys)
    assert directions["toy"].has("flat") and not directions["toy"].has("rows")


def test_a_declaration_is_checked():
    with pytest.raises(ValueError, match="layout"):
        StateKey("x", layout="diagonal")
    with pytest.raises(ValueError, match="moment"):
        StateKey("x", moment="third")
    with pytest.raises(ValueError, match="unknown form"):
        DirectionUnit("x", lambda g: g, SpecModel, forms=("fused",))
    from geomopt.optim.units.declare import declare

    with pytest.raises(ValueError, match="declared twice, differently"):
        declare(None, StateKey("d", layout=STAT))  # the momentum is declared in the operators' layout
