"""The ``trust_ratio`` post-stage (LARS, LAMB) against its formula written out here per tensor in
float64 — each tensor's norms from its own entries, the Adam moments of the LAMB form by hand —
not through the stage code; a coefficient changed by 1% must miss the reference."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

import geomopt
from geomopt.optim.units.stages import STAGES, Context, Shard
from test_stages_variants import _run  # the spec's optimizer stepped on the given gradients

pytestmark = pytest.mark.usefixtures("float64_default")

LR = 0.1


def _spec(geometry: dict, stage: dict) -> dict:
    return {"geomopt": 1, "name": "t",
            "rules": [{"name": "all", "match": "**", "geometry": geometry, "lr": LR, "post": [stage]}]}


def _tensors() -> dict:
    """Two tensors of one shape (one stacked bucket), one of another shape, a zero one (the guard:
    ratio 1) and one of norm ~30 (past a clamp of 10)."""
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 6, generator=gen), "b": torch.randn(4, 6, generator=gen),
            "c": torch.randn(5, generator=gen), "zero": torch.zeros(3, 5),
            "big": 6.0 * torch.randn(5, 5, generator=gen)}


def _grads(tensors: dict, steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()} for _ in range(steps)]


def _fro(t: torch.Tensor) -> float:
    return math.sqrt(sum(float(v) ** 2 for v in t.reshape(-1)))


def _ratio(x: torch.Tensor, u: torch.Tensor, coeff: float, lam: float, denominator: str, eps: float,
           clamp) -> torch.Tensor:
    """r·(U + λX), r = η·min(‖X‖, c)/(N + ε) (1 where ‖X‖ or N is 0), norms as sums of squares."""
    w = u + lam * x
    xn = _fro(x)
    n = _fro(u) + lam * xn if denominator == "sum" else _fro(w)
    if clamp is not None:
        xn = min(xn, clamp)
    r = coeff * xn / (n + eps) if xn > 0 and n > 0 else 1.0
    return r * w


LARS = {"kind": "trust_ratio", "coeff": 0.02, "weight_decay": 0.1, "denominator": "sum"}
LAMB = {"kind": "trust_ratio", "coeff": 0.5, "weight_decay": 0.05, "denominator": "update", "eps": 1e-4,
        "clamp": 10.0}
ADAM = {"kind": "adam", "betas": [0.8, 0.9], "eps": 1e-3}


def _lars_ref(tensors, grads, coeff=0.02, lam=0.1):
    """LARS (You et al. 2017, Alg. 1) without momentum: X ← X − lr·η‖X‖/(‖G‖ + λ‖X‖)·(G + λX)."""
    out = {}
    for n, x in tensors.items():
        x = x.clone()
        for g in grads:
            x = x - LR * _ratio(x, g[n], coeff, lam, "sum", 0.0, None)
        out[n] = x
    return out


def _lamb_ref(tensors, grads, coeff=0.5, lam=0.05, betas=(0.8, 0.9)):
    """LAMB (You et al. 2020, Alg. 2): m̂/(√v̂ + ε) + λX, scaled by η·min(‖X‖, 10)/(‖·‖ + ε)."""
    b1, b2 = betas
    out = {}
    for n, x in tensors.items():
        x, m, v = x.clone(), torch.zeros_like(x), torch.zeros_like(x)
        for t, g in enumerate(grads, 1):
            g = g[n]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            r = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + 1e-3)
            x = x - LR * _ratio(x, r, coeff, lam, "update", 1e-4, 10.0)
        out[n] = x
    return out


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[n], want[n], rtol=1e-10, atol=1e-12) for n in want)


def test_lars_form_is_the_float64_reference():
    tensors = _tensors()
    grads = _grads(tensors, 3)
    got = _run(_spec({"kind": "euclidean"}, LARS), tensors, grads)
    want = _lars_ref(tensors, grads)
    for n in tensors:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)
    # the zero tensor's first step took the ratio 1: −lr·(G + λ·0), then the ratio from its new norm
    assert not torch.equal(got["zero"], -LR * grads[0]["zero"])


def test_lamb_form_is_the_float64_reference():
    tensors = _tensors()
    grads = _grads(tensors, 4)
    got = _run(_spec(ADAM, LAMB), tensors, grads)
    want = _lamb_ref(tensors, grads)
    for n in tensors:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)
    assert _fro(tensors["big"]) > 10.0  # the clamp acted


@pytest.mark.parametrize("form,change", [
    ("lars", {"coeff": 0.0202}), ("lars", {"lam": 0.101}),
    ("lamb", {"coeff": 0.505}), ("lamb", {"lam": 0.0505}), ("lamb", {"betas": (0.808, 0.9)}),
])
def test_a_coefficient_changed_by_one_percent_misses_the_reference(form, change):
    """The checks above can fail: the same run against the reference with one coefficient 1% off."""
    tensors = _tensors()
    grads = _grads(tensors, 3)
    if form == "lars":
        got, want = _run(_spec({"kind": "euclidean"}, LARS), tensors, grads), _lars_ref(tensors, grads, **change)
    else:
        got, want = _run(_spec(ADAM, LAMB), tensors, grads), _lamb_ref(tensors, grads, **change)
    assert not _close(got, want)


def test_a_zero_update_leaves_the_tensor_and_stays_finite():
    """A zero gradient, no decay: N = 0, the ratio is 1 (not 0/0), and the step is 0."""
    x = {"w": torch.randn(3, 4)}
    got = _run(_spec({"kind": "euclidean"}, {"kind": "trust_ratio"}), x, [{"w": torch.zeros(3, 4)}])
    assert torch.equal(got["w"], x["w"])


def test_the_stage_reads_the_parameter_before_the_step():
    """One step from X with G: η‖X‖/‖G‖·G, not the norm of X after a decay or the step."""
    x, g = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 2.0]])
    spec = _spec({"kind": "euclidean"}, {"kind": "trust_ratio", "coeff": 0.5})
    spec["rules"][0]["weight_decay"] = 0.5  # the rule's decoupled decay, after the stages
    got = _run(spec, {"w": x}, [{"w": g}])
    torch.testing.assert_close(got["w"], x * (1 - LR * 0.5) - LR * 0.5 * 5.0 / 2.0 * g, rtol=0, atol=1e-15)


def test_sharded_norms_are_the_whole_tensors(tmp_path):
    """The stage on a stack whose rows are cut across ranks (a one-rank gloo group holding the
    whole tensor as its shard): ‖X‖ and ‖U‖ summed over the mesh, the same as unsharded."""
    gen = torch.Generator().manual_seed(2)
    u, x = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 5, generator=gen)
    for cfg in (dict(LARS, eps=0.0, clamp=None), LAMB):
        want = STAGES["trust_ratio"].fn(u.clone(), cfg, Context(state={}, op_shape=(3, 5), param=x))
        store = dist.FileStore(str(tmp_path / cfg["denominator"]), 1)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
        try:
            mesh = types.SimpleNamespace(get_group=lambda m: dist.group.WORLD)
            ctx = Context(state={}, op_shape=(3, 5), param=x,
                          shard=Shard(block=((0, 3), (0, 5)), cuts=((0,), ()), mesh=mesh))
            assert ctx.cut((1, 2))
            got = STAGES["trust_ratio"].fn(u.clone(), cfg, ctx)
        finally:
            dist.destroy_process_group()
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
        for k in range(2):
            torch.testing.assert_close(got[k], _ratio(x[k], u[k], cfg["coeff"], cfg["weight_decay"],
                                                      cfg["denominator"], cfg.get("eps", 0.0), cfg.get("clamp")))


def test_explain_shows_the_stage_with_its_fields(capsys):
    from geomopt.cli.main import main

    main(["explain", "lars", "transformer.h.0.attn.c_attn.weight", "--model", "gpt"])
    out = capsys.readouterr().out
    assert "post       trust_ratio(coeff=0.001, weight_decay=0.0005, denominator=sum, eps=0)" in out, out


def test_dsl_round_trip():
    from geomopt.spec.printers import dump_spec

    text = ('geomopt: 1\nname: t\nrules:\n  - name: a\n    match: "**"\n    geometry: {kind: adam}\n'
            '    post: [{kind: trust_ratio, coeff: 0.5, weight_decay: 0.01, denominator: sum, eps: 1.0e-6, '
            'clamp: 10.0}]\n')
    spec = geomopt.parse_spec(text, "yaml")
    dsl = dump_spec(spec, "dsl")
    assert "trust_ratio(" in dsl
    assert geomopt.parse_spec(dsl, "dsl") == spec
    assert geomopt.parse_spec(dump_spec(spec, "yaml"), "yaml") == spec


@pytest.mark.parametrize("stage,want", [
    ({"kind": "trust_ratio"}, [3.0 - LR * 3.0, -4.0 - LR * 4.0]),  # η|x|/|g|·g: a step of |x| per scalar
    ({"kind": "rms_match", "target": "unit", "eps": 1e-30}, [3.0 - LR, -4.0 - LR]),
])
def test_zero_dim_tensors_in_one_bucket_take_their_own_norms(stage, want):
    """Two 0-d parameters share a bucket (a stack of shape [2]): each one's norm is its |entry|,
    not the stack's."""
    x = {"a": torch.tensor(3.0), "b": torch.tensor(-4.0)}
    got = _run(_spec({"kind": "euclidean"}, stage), x, [{"a": torch.tensor(1.0), "b": torch.tensor(2.0)}])
    torch.testing.assert_close([got["a"], got["b"]], [torch.tensor(w) for w in want], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "capturable"])
def test_a_non_finite_gradient_leaves_parameters_and_state(capturable):
    """LAMB's form (Adam's moments as state): a NaN in a gradient skips the step, parameters and
    moments as they were, with the device's flag as with the host's test."""
    tensors = _tensors()
    params = {n: torch.nn.Parameter(t.clone()) for n, t in tensors.items()}
    opt = geomopt.GeomOptimizer(list(params.items()), _spec(ADAM, LAMB), capturable=capturable)
    grads = _grads(tensors, 2)
    for n, p in params.items():
        p.grad = grads[0][n].clone()
    opt.step()
    x = {n: p.detach().clone() for n, p in params.items()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for n, p in params.items()}
    for n, p in params.items():
        p.grad = grads[1][n].clone()
    params["a"].grad[0, 0] = math.nan
    opt.step()
    for n, p in params.items():
        assert torch.equal(p.detach(), x[n]), n
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[n].items()), n
