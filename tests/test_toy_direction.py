"""A new direction is one declaration plus its spec model: a test-only direction, added here and
nowhere else, parses, validates, steps on every form (flat, batched, capturable, sharded) as its
float64 reference, and checkpoints and resumes bit for bit, with no other edit to geomopt."""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

import pytest
import torch
import torch.distributed as dist
from pydantic import Field

import geomopt
from geomopt.optim.units.directions import DIRECTIONS, MOMENTUM, direction
from geomopt.spec.base import SpecModel
from geomopt.spec.model import extend_directions

STEPS = 4
LR = 0.1
SHAPES = {"a.weight": (6, 3), "b.weight": (4, 6), "c.bias": (5,)}


class Toy(SpecModel):
    """d ← μd + g, d⁰ = 0 (μ = ``gain``): a test-only direction."""

    kind: Literal["toy"] = "toy"
    gain: Annotated[float, Field(ge=0, lt=1)] = 0.5


def toy_update(d, g, group: dict):
    """The toy's arithmetic, once: d ← μd + g on a tensor or on lists of tensors (in place)."""
    if isinstance(d, list):
        torch._foreach_mul_(d, group["gain"])
        torch._foreach_add_(d, g)
        return d
    return d.mul_(group["gain"]).add_(g)


def toy(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    d = state.get("d")
    if d is None:
        d = state["d"] = torch.zeros_like(g)
    elif fresh is not None:  # the state stays as it was until the bucket commits: a new d
        d = state["d"] = d.clone()
    return toy_update(d, g, group)


@pytest.fixture
def toy_direction():
    """The declaration, made for one test and taken back after it."""
    extend_directions(add=Toy)
    direction("toy", Toy, state=(MOMENTUM,), foreach=lambda ds, gs, group, first: toy_update(ds, gs, group))(toy)
    yield
    DIRECTIONS.pop("toy")
    DIRECTIONS.meta.pop("toy")
    extend_directions(remove="toy")


SPEC = f"""
geomopt: 1
name: toy
rules:
  - name: all
    match: "**"
    geometry: {{kind: euclidean}}
    direction: {{kind: toy, gain: 0.7}}
    lr: {LR}
"""


def _grads() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()} for _ in range(STEPS)]


def _start() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}


def _reference() -> dict:
    """X ← X − γd, d ← 0.7d + g, in float64 from the definition."""
    x, d = _start(), {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for g in _grads():
        for n in x:
            d[n] = 0.7 * d[n] + g[n]
            x[n] = x[n] - LR * d[n]
    return x


def _run(params: dict, opt, grads: list, wrap=lambda t: t) -> None:
    for g in grads:
        for n, p in params.items():
            p.grad = wrap(g[n].clone())
        opt.step()


def _build(spec, params: dict, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # roles guessed from names: the spec routes by name only
        return geomopt.GeomOptimizer(list(params.items()), spec, **kw)


@pytest.mark.parametrize("form", ["flat", "batched", "capturable"])
def test_a_declared_direction_steps_on_every_form_as_its_reference(toy_direction, form):
    spec = geomopt.parse_spec(SPEC)
    assert spec.rules[0].direction.kind == "toy" and spec.rules[0].direction.gain == 0.7
    params = {n: torch.nn.Parameter(x.clone()) for n, x in _start().items()}
    opt = _build(spec, params, track_update=form == "batched", capturable=form == "capturable")
    variants = {p.variant for progs in opt.engine.programs for p in progs}
    assert variants == {"flat" if form == "flat" else "batched"}, opt.describe()
    assert opt.param_groups[0]["gain"] == 0.7  # its coefficient lives in the group, as every direction's
    _run(params, opt, _grads())
    want = _reference()
    for n, p in params.items():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-12, atol=1e-12, msg=f"{form}: {n}")


def test_a_declared_direction_checkpoints_and_resumes_bit_for_bit(toy_direction):
    spec = geomopt.parse_spec(SPEC)
    grads = _grads()
    whole = {n: torch.nn.Parameter(x.clone()) for n, x in _start().items()}
    _run(whole, _build(spec, whole), grads)
    first = {n: torch.nn.Parameter(x.clone()) for n, x in _start().items()}
    opt = _build(spec, first)
    _run(first, opt, grads[:2])
    saved = opt.state_dict()
    assert saved["param_groups"][0]["gain"] == 0.7 and "d" in saved["state"][0]
    resumed = {n: torch.nn.Parameter(p.detach().clone()) for n, p in first.items()}
    again = _build(spec, resumed)
    assert again.load_state_dict(saved) is None
    _run(resumed, again, grads[2:])
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)
    # a refused value names its key, by the direction's own model
    bad = dict(saved, param_groups=[dict(saved["param_groups"][0], gain=1.5)])
    with pytest.raises(geomopt.optim.CheckpointError, match="'gain'"):
        again.load_state_dict(bad)
    # the DSL and the JSON Schema know it too
    assert "toy" in geomopt.dump_spec(spec, "dsl")
    from geomopt.spec.schema import schema_text

    assert '"toy"' in schema_text()


def test_a_declared_direction_steps_sharded(toy_direction, tmp_path):
    """On DTensor parameters (one rank, gloo), the sharded executor runs it as the reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
        params = {n: torch.nn.Parameter(shard(x.clone())) for n, x in _start().items()}
        opt = _build(geomopt.parse_spec(SPEC), params)
        assert type(opt.engine.executor).__name__ == "ShardedExecutor"
        _run(params, opt, _grads(), wrap=shard)
        want = _reference()
        for n, p in params.items():
            torch.testing.assert_close(p.detach().full_tensor(), want[n], rtol=1e-12, atol=1e-12, msg=n)
    finally:
        dist.destroy_process_group()


def test_the_language_is_as_it_was_without_the_declaration():
    """Taken back, the kind is unknown again (the fixture leaves nothing behind)."""
    assert "toy" not in DIRECTIONS
    with pytest.raises(geomopt.SpecError, match="toy"):
        geomopt.parse_spec(SPEC)



class Halved(SpecModel):
    """d ← d + (α/2)(g − d), d⁰ = 0: a test-only direction whose list form takes its one coefficient as
    a weight (a tensor under ``fuse`` and ``capturable``)."""

    kind: Literal["halved"] = "halved"
    alpha: Annotated[float, Field(gt=0, le=1)] = 0.5
    init: Literal["zero"] = "zero"
    nesterov: Literal[False] = False


def halved_update(ds: list, gs: list, hyper: dict, first: bool) -> None:
    for d, g in zip(ds, gs):
        d.lerp_(g, hyper["alpha"] / 2)


def halved(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    d = state.get("d")
    d = state["d"] = torch.zeros_like(g) if d is None else (d.clone() if fresh is not None else d)
    halved_update([d], [g], group, False)
    return d


def test_the_declared_weighted_form_decides_a_compiled_flat_step(toy_direction):
    """fuse compiles a flat rule's whole step only for a direction declaring the ``weighted`` form (its
    list form's coefficient a weight that may be a tensor), read from the declaration, not from its
    name: the toy declares no such form and steps eagerly; a test-only weighted direction, declared
    here and nowhere else, compiles and steps as its float64 reference."""
    params = {n: torch.nn.Parameter(x.clone().float()) for n, x in _start().items()}
    toy_opt = _build(geomopt.parse_spec(SPEC), params, fuse=True)
    assert not DIRECTIONS["toy"].has("weighted")
    assert {(p.variant, p.compiled) for progs in toy_opt.engine.programs for p in progs} == {("flat", False)}
    extend_directions(add=Halved)
    direction("halved", Halved, state=(MOMENTUM,), weighted=True, foreach=halved_update)(halved)
    try:
        spec = geomopt.parse_spec(SPEC.replace("{kind: toy, gain: 0.7}", "{kind: halved, alpha: 0.6}"))
        opt = _build(spec, params, fuse=True)
        assert {(p.variant, p.compiled) for progs in opt.engine.programs for p in progs} == {("flat", True)}
        _run(params, opt, [{n: g.float() for n, g in gs.items()} for gs in _grads()])
    finally:
        DIRECTIONS.pop("halved")
        DIRECTIONS.meta.pop("halved")
        extend_directions(remove="halved")
    x, d = _start(), {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for g in _grads():
        for n in x:
            d[n] = d[n] + 0.3 * (g[n] - d[n])
            x[n] = x[n] - LR * d[n]
    for n, p in params.items():
        torch.testing.assert_close(p.detach().double(), x[n], rtol=1e-6, atol=1e-6, msg=n)
