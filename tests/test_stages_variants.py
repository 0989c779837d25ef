"""The post-stages of the 2026 Muon variants (Muon+'s ``axis_norm``, NorMuonH's ``second_moment``
with ``axis: longer``, Contra-Muon's ``contra``) against computations written out here in float64
(loops over rows, columns and blocks; SVD for polar factors and σ₁), not through the stage code."""

from __future__ import annotations

import pytest
import torch

import geomopt
from geomopt.spec.diagnostics import SpecError

pytestmark = pytest.mark.usefixtures("float64_default")

SVD = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}


def _spec(geometry: dict, post, **rule) -> dict:
    return {"geomopt": 1, "name": "t", "rules": [{"name": "all", "match": "**", "geometry": geometry, "lr": 0.1,
                                                   "post": post, **rule}]}


def _run(spec, tensors: dict, grads: list[dict]):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in tensors.items()}
    opt = geomopt.GeomOptimizer(list(params.items()), spec)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _grads(tensors: dict, steps: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()} for _ in range(steps)]


def _polar(m: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ vh


def _unit(m: torch.Tensor, axis: str, eps: float) -> torch.Tensor:
    out = m.clone()
    if axis == "row":
        for i in range(m.shape[0]):
            out[i] = m[i] / (m[i].pow(2).sum() + eps).sqrt()
    else:
        for j in range(m.shape[1]):
            out[:, j] = m[:, j] / (m[:, j].pow(2).sum() + eps).sqrt()
    return out


# ---------------------------------------------------------------- axis_norm (Muon+)


@pytest.mark.parametrize("order", [["row"], ["column"], ["row", "column"], ["column", "row"]])
def test_axis_norm_normalizes_rows_and_columns_in_order(order):
    w = {"w": torch.randn(6, 9)}
    grads = _grads(w, 2)
    got = _run(_spec(SVD, [{"kind": "axis_norm", "order": order, "eps": 1e-3}]), w, grads)
    want = w["w"].clone()
    for g in grads:
        u = _polar(g["w"])
        for axis in order:
            u = _unit(u, axis, 1e-3)
        want = want - 0.1 * u
    torch.testing.assert_close(got["w"], want, rtol=1e-12, atol=1e-12)
    if order[-1] == "row":  # the last normalization holds exactly (up to ε)
        last = _unit(_polar(grads[-1]["w"]), "row", 0.0)
        assert torch.allclose(last.norm(dim=1), torch.ones(6))


def test_axis_norm_reads_each_block_as_its_own_matrix():
    """A fused projection of unequal blocks: each block's columns are normalized on their own."""
    sizes = [6, 2, 2]
    fused = {"qkv.w": torch.randn(10, 4)}
    spec = _spec({**SVD, "view": {"kind": "matrix", "blocks": sizes}},
                 [{"kind": "axis_norm", "order": ["column", "row"], "eps": 1e-7}])
    grads = _grads(fused, 2, seed=1)
    got = _run(spec, fused, grads)
    want = fused["qkv.w"].clone()
    for g in grads:
        blocks = [_unit(_unit(_polar(b), "column", 1e-7), "row", 1e-7) for b in g["qkv.w"].split(sizes, 0)]
        want = want - 0.1 * torch.cat(blocks, 0)
    torch.testing.assert_close(got["qkv.w"], want, rtol=1e-10, atol=1e-12)


def test_axis_norm_lists_each_axis_once():
    text = ('geomopt: 1\nname: t\nrules:\n  - name: a\n    match: "**"\n    geometry: {kind: euclidean}\n'
            '    post: [{kind: axis_norm, order: [row, row]}]\n')
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, "yaml", file="t.yaml")
    assert "at most once" in info.value.diagnostics[0].message


def test_axis_norm_on_a_vector_is_refused_with_the_parameter_and_rule():
    spec = _spec({"kind": "euclidean"}, [{"kind": "axis_norm", "order": ["column"]}])
    with pytest.raises(SpecError) as info:
        geomopt.GeomOptimizer([("w", torch.nn.Parameter(torch.zeros(3, 2))),
                               ("bias", torch.nn.Parameter(torch.zeros(3)))], spec)
    d = info.value.diagnostics[0]
    assert d.code == "GO120" and "'bias'" in d.message and "axis_norm" in d.message


# ---------------------------------------------------------------- second_moment axis longer (NorMuonH)


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (6, 6)])
def test_second_moment_longer_is_per_row_when_tall_else_per_column(shape):
    w = {"w": torch.randn(*shape)}
    grads = _grads(w, 3)
    got = _run(_spec(SVD, [{"kind": "second_moment", "axis": "longer", "beta2": 0.9, "eps": 1e-3}]), w, grads)
    rows = shape[0] >= shape[1]
    v, want = None, w["w"].clone()
    for g in grads:
        u = _polar(g["w"])
        stat = (torch.stack([u[i].pow(2).mean() for i in range(shape[0])])[:, None] if rows
                else torch.stack([u[:, j].pow(2).mean() for j in range(shape[1])])[None, :])
        v = 0.1 * stat if v is None else 0.9 * v + 0.1 * stat
        want = want - 0.1 * u / (v.sqrt() + 1e-3)
    torch.testing.assert_close(got["w"], want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- contra (Contra-Muon)


def test_contra_with_enough_power_steps_subtracts_the_spectrally_normalized_direction():
    """With 100 power iterations σ₁ is exact to rounding: U ← (1 + c)·polar(D) − c·D/σ₁(D)."""
    w = {"w": torch.randn(7, 4)}
    grads = _grads(w, 2)
    got = _run(_spec(SVD, [{"kind": "contra", "coeff": 0.5, "power_steps": 100}]), w, grads)
    want = w["w"].clone()
    for g in grads:
        d = g["w"]
        want = want - 0.1 * (1.5 * _polar(d) - 0.5 * d / torch.linalg.svdvals(d)[0])
    torch.testing.assert_close(got["w"], want, rtol=1e-9, atol=1e-10)


def test_contra_power_iteration_starts_from_ones_and_runs_power_steps():
    w = {"w": torch.randn(5, 6)}
    grads = _grads(w, 1, seed=3)
    got = _run(_spec(SVD, [{"kind": "contra", "coeff": 0.25, "power_steps": 2}]), w, grads)
    d = grads[0]["w"]
    v = torch.ones(6) / 6 ** 0.5
    for _ in range(2):
        u = d @ v
        u = u / u.norm()
        v = d.T @ u
        v = v / v.norm()
    sigma = (d @ v).norm()
    assert sigma < torch.linalg.svdvals(d)[0]  # two steps: not yet σ₁, so the test reads the estimate
    want = w["w"] - 0.1 * (1.25 * _polar(d) - 0.25 * d / sigma)
    torch.testing.assert_close(got["w"], want, rtol=1e-12, atol=1e-12)


def test_contra_reads_each_expert_as_its_own_matrix():
    experts = {"experts.w": torch.randn(3, 4, 5)}
    spec = _spec({**SVD, "view": {"kind": "matrix", "batch": 1}},
                 [{"kind": "contra", "coeff": 1.0, "power_steps": 100}, {"kind": "rms_match", "target": "input"}])
    grads = _grads(experts, 1, seed=2)
    got = _run(spec, experts, grads)
    d = grads[0]["experts.w"]
    polar = torch.stack([_polar(m) for m in d.unbind(0)])
    u = torch.stack([2 * p - m / torch.linalg.svdvals(m)[0] for p, m in zip(polar.unbind(0), d.unbind(0))])
    u = u * polar.norm() / (u.norm() + 1e-8)
    torch.testing.assert_close(got["experts.w"], experts["experts.w"] - 0.1 * u, rtol=1e-9, atol=1e-10)


def test_contra_reads_each_block_as_its_own_matrix_and_a_vector_as_one_column():
    sizes = [6, 2, 2]
    fused = {"qkv.w": torch.randn(10, 4), "b": torch.randn(5)}
    spec = {"geomopt": 1, "name": "t", "rules": [
        {"name": "m", "match": "qkv.w", "geometry": {**SVD, "view": {"kind": "matrix", "blocks": sizes}}, "lr": 0.1,
         "post": [{"kind": "contra", "coeff": 0.5, "power_steps": 100}]},
        {"name": "v", "match": "b", "geometry": {"kind": "euclidean"}, "lr": 0.1,
         "post": [{"kind": "contra", "coeff": 0.5, "power_steps": 3}]}]}
    grads = _grads(fused, 1, seed=4)
    got = _run(spec, fused, grads)
    blocks = [1.5 * _polar(b) - 0.5 * b / torch.linalg.svdvals(b)[0] for b in grads[0]["qkv.w"].split(sizes, 0)]
    torch.testing.assert_close(got["qkv.w"], fused["qkv.w"] - 0.1 * torch.cat(blocks, 0), rtol=1e-9, atol=1e-10)
    g = grads[0]["b"]
    torch.testing.assert_close(got["b"], fused["b"] - 0.1 * (1.5 * g - 0.5 * g / g.norm()), rtol=1e-12, atol=1e-12)
