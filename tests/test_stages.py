"""Update stages: each post-stage, cautious weight decay, the heavy-ball and Lion directions and
the momentum warmup, against computations written out here tensor by tensor in float64 (loops
over rows, columns, experts and blocks; SVD for nuclear norms), not through the stage code."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.distributed as dist

import geomopt
from geomopt.spec.diagnostics import SpecError
from geomopt.spec.geometries import FrobeniusPrenorm


# this module's references are float64 (tests that compare bits with torch use float32)
pytestmark = pytest.mark.usefixtures("float64_default")


def _spec(geometry: dict, post=None, **rule) -> dict:
    r = {"name": "all", "match": "**", "geometry": geometry, "lr": 0.1, **rule}
    if post is not None:
        r["post"] = post
    return {"geomopt": 1, "name": "t", "rules": [r]}


EUCLID = {"kind": "euclidean"}


def _run(spec, tensors: dict, grads: list[dict], **kw):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in tensors.items()}
    opt = geomopt.GeomOptimizer(list(params.items()), spec, **kw)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}, opt


def _grads(tensors: dict, steps: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()} for _ in range(steps)]


# ---------------------------------------------------------------- a stack cut across ranks


def test_a_context_cut_across_ranks_reads_the_whole_tensors_statistics(tmp_path):
    """One rank of a one-rank gloo group holding the whole tensor as its shard, rows cut by mesh
    dim 0: a dim is cut only by the mesh dims the shard names, and the sums, means and norms summed
    across the ranks (here the one) are the whole tensor's; a shard's rows are its block's indices."""
    from geomopt.optim.units.stages import Context, Shard

    t = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        mesh = types.SimpleNamespace(get_group=lambda m: dist.group.WORLD)
        ctx = Context(state={}, op_shape=(3, 5), shard=Shard(block=((0, 3), (0, 5)), cuts=((0,), ()), mesh=mesh))
        assert ctx.cut((1,)) and ctx.cut((1, 2)) and not ctx.cut((2,))
        torch.testing.assert_close(ctx.sum(t, (1,)), t.sum(1, keepdim=True))
        torch.testing.assert_close(ctx.mean(t, (1,)), t.mean(1, keepdim=True))
        torch.testing.assert_close(ctx.mean(t, (1, 2)), t.mean((1, 2), keepdim=True))
        torch.testing.assert_close(ctx.norm(t), torch.linalg.vector_norm(t, dim=(1, 2), keepdim=True))
    finally:
        dist.destroy_process_group()
    part = Context(state={}, op_shape=(6, 5), shard=Shard(block=((2, 3), (1, 4)), cuts=((), ()), mesh=None))
    assert part.rows(1, "cpu").tolist() == [2, 3, 4] and part.rows(2, "cpu").tolist() == [1, 2, 3, 4]
    assert Context(state={}, op_shape=(6, 5)).rows(2, "cpu").tolist() == list(range(5))


# ---------------------------------------------------------------- second moments, by brute force


def _second_moment_ref(us: list[torch.Tensor], axis: str, beta2: float, eps: float, bc: bool, rows_of=None):
    """Per step, v ← β₂v + (1−β₂)·mean(U²) by explicit loops over the (rows, cols) matrix
    ``rows_of(U)`` returns (list of matrices); returns the normalized U of each step."""
    v = None
    out = []
    for t, u in enumerate(us, start=1):
        mats = rows_of(u) if rows_of else [u.reshape(u.shape[0], -1)]
        stats = []
        for m in mats:
            if axis == "row":
                stats.append(torch.stack([m[i].pow(2).mean() for i in range(m.shape[0])]))
            elif axis == "column":
                stats.append(torch.stack([m[:, j].pow(2).mean() for j in range(m.shape[1])]))
            else:
                stats.append(m.pow(2))
        v = [(1 - beta2) * s for s in stats] if v is None else [beta2 * a + (1 - beta2) * s for a, s in zip(v, stats)]
        c = 1 - beta2 ** t if bc else 1.0
        res = []
        for m, a in zip(mats, v):
            d = (a / c).sqrt() + eps
            if axis == "row":
                res.append(m / d[:, None])
            elif axis == "column":
                res.append(m / d[None, :])
            else:
                res.append(m / d)
        out.append(res)
    return out


@pytest.mark.parametrize("axis", ["row", "column", "element"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_second_moment_of_a_plain_matrix(axis, bias_correction):
    w = {"w": torch.randn(6, 10)}
    grads = _grads(w, 4)
    post = [{"kind": "second_moment", "axis": axis, "beta2": 0.9, "eps": 1e-3, "bias_correction": bias_correction}]
    got, _ = _run(_spec(EUCLID, post), w, grads)
    ref = _second_moment_ref([g["w"] for g in grads], axis, 0.9, 1e-3, bias_correction)
    want = w["w"] - 0.1 * sum(r[0] for r in ref)
    torch.testing.assert_close(got["w"], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("axis", ["row", "column"])
def test_second_moment_reads_each_expert_and_block_as_its_own_matrix(axis):
    """A (E, out, in) expert weight (view batch 1) and a fused projection of unequal blocks: rows
    and columns are those of each expert's / each block's matrix."""
    experts = {"experts.w": torch.randn(3, 4, 5)}
    spec = _spec({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                  "view": {"kind": "matrix", "batch": 1}}, [{"kind": "second_moment", "axis": axis, "beta2": 0.5}])
    grads = _grads(experts, 2)
    got, _ = _run(spec, experts, grads)
    polar = [torch.linalg.svd(g["experts.w"], full_matrices=False) for g in grads]
    us = [U @ Vh for U, _, Vh in polar]
    ref = _second_moment_ref(us, axis, 0.5, 1e-8, False, rows_of=lambda u: list(u.unbind(0)))
    want = experts["experts.w"] - 0.1 * sum(torch.stack(r) for r in ref)
    torch.testing.assert_close(got["experts.w"], want, rtol=1e-9, atol=1e-10)

    fused = {"qkv.w": torch.randn(10, 4)}
    sizes = [6, 2, 2]
    spec = _spec({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                  "view": {"kind": "matrix", "blocks": sizes}}, [{"kind": "second_moment", "axis": axis, "beta2": 0.5}])
    grads = _grads(fused, 2, seed=1)
    got, _ = _run(spec, fused, grads)

    def polar_blocks(g):
        out = []
        for b in g.split(sizes, 0):
            U, _, Vh = torch.linalg.svd(b, full_matrices=False)
            out.append(U @ Vh)
        return torch.cat(out, 0)

    us = [polar_blocks(g["qkv.w"]) for g in grads]
    ref = _second_moment_ref(us, axis, 0.5, 1e-8, False, rows_of=lambda u: list(u.split(sizes, 0)))
    want = fused["qkv.w"] - 0.1 * sum(torch.cat(r, 0) for r in ref)
    # block-wise radius factors scale each block's lmo: only compare when the scale preset is none
    torch.testing.assert_close(got["qkv.w"], want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("axis", ["row", "column"])
def test_second_moment_reads_each_kernel_position_as_its_own_matrix(axis):
    """A conv kernel (out, in, kh) under ``trailing: batch``: one out × in matrix per position, whose
    rows and columns are the statistics' (not those of the out × in·kh matrix)."""
    conv = {"conv.w": torch.randn(4, 3, 2)}
    spec = _spec({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                  "view": {"kind": "matrix", "trailing": "batch"}}, [{"kind": "second_moment", "axis": axis,
                                                                      "beta2": 0.5}])
    grads = _grads(conv, 2, seed=2)
    got, _ = _run(spec, conv, grads)

    def positions(u):
        return [u[:, :, k] for k in range(u.shape[2])]

    us = []
    for g in grads:
        polar = [torch.linalg.svd(m, full_matrices=False) for m in positions(g["conv.w"])]
        us.append(torch.stack([U @ Vh for U, _, Vh in polar], -1))
    ref = _second_moment_ref(us, axis, 0.5, 1e-8, False, rows_of=positions)
    want = conv["conv.w"] - 0.1 * sum(torch.stack(r, -1) for r in ref)
    torch.testing.assert_close(got["conv.w"], want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("fresh", [False, True], ids=["in-place", "journaled"])
def test_stage_state_in_place_or_journaled_is_the_same_running_mean(fresh):
    """second_moment and norm_ratio called directly over three steps, their state updated in place
    (a multi-process step) or put in the state as a new tensor (a journaled one): the same
    v ← β₂v + (1−β₂)·x as the brute-force reference."""
    from geomopt.optim.units.stages import STAGES, Context

    gen = torch.Generator().manual_seed(3)
    us = [torch.randn(1, 4, 6, generator=gen) for _ in range(3)]
    gs = [torch.randn(1, 4, 6, generator=gen) for _ in range(3)]
    moment = {"kind": "second_moment", "axis": "row", "beta2": 0.8, "eps": 1e-3, "bias_correction": False}
    ratio = {"kind": "norm_ratio", "beta2": 0.8, "eps": 1e-3}
    state_m: dict = {}
    state_r: dict = {}
    want = _second_moment_ref([u[0] for u in us], "row", 0.8, 1e-3, False)
    v = 0.0
    for k, (u, g) in enumerate(zip(us, gs)):
        got = STAGES["second_moment"].fn(u.clone(), moment, Context(state=state_m, op_shape=(4, 6), fresh=fresh))
        torch.testing.assert_close(got[0], want[k][0], rtol=1e-12, atol=1e-12)
        ctx = Context(state=state_r, op_shape=(4, 6), gradient=g, direction=u, fresh=fresh)
        got = STAGES["norm_ratio"].fn(u.clone(), ratio, ctx)
        v = 0.8 * v + 0.2 * float(g.square().sum())
        torch.testing.assert_close(got, u * float(u.norm()) / (math.sqrt(v) + 1e-3), rtol=1e-12, atol=1e-12)


def test_second_moment_on_the_longer_side_of_a_square_matrix_is_per_row():
    """``axis: longer`` takes rows where m ≥ n: a square matrix's statistic is per row."""
    w = {"w": torch.randn(5, 5)}
    grads = _grads(w, 2, seed=4)
    post = [{"kind": "second_moment", "axis": "longer", "beta2": 0.9, "eps": 1e-3}]
    got, _ = _run(_spec(EUCLID, post), w, grads)
    ref = _second_moment_ref([g["w"] for g in grads], "row", 0.9, 1e-3, False)
    torch.testing.assert_close(got["w"], w["w"] - 0.1 * sum(r[0] for r in ref), rtol=1e-12, atol=1e-12)


def test_power_normalized_divides_by_the_top_singular_value_with_zero_rows():
    """D/σ₁(D) by the power iteration for a matrix with zero rows (σ = 3, 1, 0 and a clear gap: the
    estimate converges), against σ₁ from the SVD."""
    from geomopt.optim.units.stages import Context, _power_normalized

    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(1)))
    d = torch.zeros(4, 3)
    d[0, 0], d[1, 1] = 3.0, 1.0
    d = (d @ q).unsqueeze(0)
    got = _power_normalized(d, Context(state={}, op_shape=(4, 3)), 30)
    torch.testing.assert_close(got, d / torch.linalg.matrix_norm(d[0], ord=2), rtol=1e-12, atol=1e-12)


def test_cautious_drops_the_components_where_the_gradient_is_zero():
    """m = [U⊙G > 0]: a component whose gradient is exactly 0 does not agree with it and is dropped."""
    from geomopt.optim.units.stages import STAGES, Context

    u = torch.tensor([[[1.0, -2.0, 3.0, 0.5]]])
    g = torch.tensor([[[2.0, 0.0, 0.0, -1.0]]])
    got = STAGES["cautious"].fn(u, {"kind": "cautious"}, Context(state={}, op_shape=(1, 4), gradient=g))
    torch.testing.assert_close(got, torch.tensor([[[1.0 * 4 / 2, 0.0, 0.0, 0.0]]]), rtol=0, atol=0)


# ---------------------------------------------------------------- the scalar stages


def test_dual_scale_is_the_nuclear_norm_for_the_exact_polar_factor():
    """PolarGrad: X ← X − γ·‖G‖_*·U Vᵀ (the nuclear norm from the singular values, not from the
    stage's inner product)."""
    w = {"w": torch.randn(5, 8)}
    grads = _grads(w, 1)
    spec = _spec({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}, [{"kind": "dual_scale"}])
    got, _ = _run(spec, w, grads)
    U, S, Vh = torch.linalg.svd(grads[0]["w"], full_matrices=False)
    torch.testing.assert_close(got["w"], w["w"] - 0.1 * S.sum() * (U @ Vh), rtol=1e-12, atol=1e-12)


def test_dual_scale_on_sign_descent_is_the_l1_norm():
    w = {"w": torch.randn(7)}
    grads = _grads(w, 1)
    spec = _spec({"kind": "anisotropic", "reference": {"kind": "indicator"}}, [{"kind": "dual_scale"}])
    got, _ = _run(spec, w, grads)
    g = grads[0]["w"]
    torch.testing.assert_close(got["w"], w["w"] - 0.1 * g.abs().sum() * g.sign())


@pytest.mark.parametrize("target", [0.2, 3.0, "input", "polar", "unit"])
def test_rms_match_sets_the_norm(target):
    w = {"a": torch.randn(4, 9), "b": torch.randn(9, 4)}
    grads = _grads(w, 1)
    geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}
    post = [{"kind": "second_moment", "axis": "row", "beta2": 0.5}, {"kind": "rms_match", "target": target, "eps": 1e-30}]
    got, _ = _run(_spec(geometry, post), w, grads)
    for n in w:
        step = (w[n] - got[n]) / 0.1
        m, k = w[n].shape
        if target == "input":
            want = math.sqrt(min(m, k))  # ‖U Vᵀ‖_F of the geometry's exact polar factor
        elif target == "polar":
            want = math.sqrt(min(m, k))
        elif target == "unit":
            want = 1.0
        else:
            want = target * math.sqrt(m * k)
        assert float(step.norm()) == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("nesterov", [False, True])
def test_norm_ratio_is_namo_scale(nesterov):
    """NAMO (arXiv:2602.17080): U = polar(D)·‖D‖_F/(√v + ε), v ← β₂v + (1−β₂)‖G‖²_F per tensor, with D
    the direction the geometry is given (Polyak momentum, Nesterov or not), written out here with an
    SVD per step; the stage keeps one number per tensor."""
    w = {"a": torch.randn(5, 3), "b": torch.randn(4, 6)}
    grads = _grads(w, 4, seed=3)
    geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}
    direction = {"kind": "polyak", "alpha": 0.2, "nesterov": nesterov}
    post = [{"kind": "norm_ratio", "beta2": 0.9, "eps": 1e-3}]
    got, opt = _run(_spec(geometry, post, direction=direction), w, grads)
    for n in w:
        x, buf, v = w[n].clone(), torch.zeros_like(w[n]), 0.0
        for g in grads:
            g = g[n]
            buf = 0.8 * buf + 0.2 * g
            d = 0.8 * buf + 0.2 * g if nesterov else buf  # lerp(g, buf, 1 − α)
            v = 0.9 * v + 0.1 * float(g.pow(2).sum())
            uu, _, vh = torch.linalg.svd(d, full_matrices=False)
            x = x - 0.1 * (uu @ vh) * float(d.norm()) / (math.sqrt(v) + 1e-3)
        torch.testing.assert_close(got[n], x, rtol=1e-9, atol=1e-12)
    for p in opt.state:
        assert opt.state[p]["post_g2"].numel() == 1


def test_cautious_masks_disagreeing_components_and_rescales():
    w = {"w": torch.randn(6, 5)}
    grads = _grads(w, 3)
    spec = _spec(EUCLID, [{"kind": "cautious"}], direction={"kind": "polyak", "alpha": 0.3})
    got, _ = _run(spec, w, grads)
    x, d = w["w"].clone(), torch.zeros(6, 5)
    for g in grads:
        d = 0.7 * d + 0.3 * g["w"]
        mask = [[1.0 if float(d[i, j]) * float(g["w"][i, j]) > 0 else 0.0 for j in range(5)] for i in range(6)]
        mask = torch.tensor(mask)
        x = x - 0.1 * d * mask * (30 / (mask.sum() + 1))
    torch.testing.assert_close(got["w"], x, rtol=1e-12, atol=1e-12)


def test_cautious_weight_decay_decays_only_where_step_and_weight_agree():
    w = {"w": torch.randn(8, 3)}
    grads = _grads(w, 2)
    spec = _spec({"kind": "anisotropic", "reference": {"kind": "indicator"}}, weight_decay=0.5, decay="cautious")
    got, _ = _run(spec, w, grads)
    x = w["w"].clone()
    for g in grads:
        s = g["w"].sign()
        agree = (s * x >= 0).to(x.dtype)
        x = x - 0.1 * (s + 0.5 * agree * x)
    torch.testing.assert_close(got["w"], x, rtol=1e-12, atol=1e-12)
    plain, _ = _run(_spec({"kind": "anisotropic", "reference": {"kind": "indicator"}}, weight_decay=0.5), w, grads)
    assert not torch.equal(plain["w"], got["w"])


def test_stages_scale_the_unit_update_and_the_radius_still_sets_the_step():
    """Stages act with ρ = 1; the rule's radius multiplies their result."""
    w = {"w": torch.randn(4, 6)}
    grads = _grads(w, 1)
    post = [{"kind": "rms_match", "target": 0.5}]
    a, _ = _run(_spec(EUCLID, post), w, grads)
    b, _ = _run(_spec({"kind": "euclidean", "radius": 3.0}, post), w, grads)
    torch.testing.assert_close(w["w"] - b["w"], 3.0 * (w["w"] - a["w"]))


def test_adam_with_cautious_masking_is_c_adamw():
    """C-AdamW (Liang et al. 2024): AdamW's update masked where it disagrees with the gradient."""
    w = {"w": torch.randn(5, 4)}
    grads = _grads(w, 3)
    spec = _spec({"kind": "adam", "betas": [0.9, 0.99], "eps": 1e-8}, [{"kind": "cautious"}], weight_decay=0.1)
    got, _ = _run(spec, w, grads)
    x, m, v = w["w"].clone(), torch.zeros(5, 4), torch.zeros(5, 4)
    for t, g in enumerate(grads, start=1):
        g = g["w"]
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-8)
        mask = (u * g > 0).to(u.dtype)
        u = u * mask * (20 / (mask.sum() + 1))
        x = x * (1 - 0.1 * 0.1) - 0.1 * u
    torch.testing.assert_close(got["w"], x, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- directions


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_heavy_ball_is_torch_sgd_bit_for_bit(nesterov, dampening):
    torch.set_default_dtype(torch.float32)
    try:
        w = {"a": torch.randn(6, 4), "b": torch.randn(4)}
        grads = _grads(w, 5)
        spec = _spec(EUCLID, direction={"kind": "heavy_ball", "momentum": 0.9, "dampening": dampening,
                                        "nesterov": nesterov})
        got, _ = _run(spec, w, grads)
        ps = {n: torch.nn.Parameter(t.clone()) for n, t in w.items()}
        ref = torch.optim.SGD(ps.values(), lr=0.1, momentum=0.9, dampening=dampening, nesterov=nesterov)
        for g in grads:
            for n, p in ps.items():
                p.grad = g[n].clone()
            ref.step()
        assert all(torch.equal(got[n], ps[n].detach()) for n in w)
    finally:
        torch.set_default_dtype(torch.float64)


def test_lion_direction_with_sign_geometry():
    w = {"w": torch.randn(5, 3)}
    grads = _grads(w, 4)
    spec = _spec({"kind": "anisotropic", "reference": {"kind": "indicator"}}, weight_decay=0.2,
                 direction={"kind": "lion", "beta1": 0.8, "beta2": 0.95})
    got, _ = _run(spec, w, grads)
    x, m = w["w"].clone(), torch.zeros(5, 3)
    for g in grads:
        c = 0.8 * m + 0.2 * g["w"]
        x = x * (1 - 0.1 * 0.2) - 0.1 * c.sign()
        m = 0.95 * m + 0.05 * g["w"]
    torch.testing.assert_close(got["w"], x, rtol=1e-12, atol=1e-12)


def test_momentum_warmup_moves_alpha_linearly():
    """α_k = α₀ + (α − α₀)·min(k/K, 1): Polyak averages with that α, step by step."""
    w = {"w": torch.randn(4)}
    grads = _grads(w, 6)
    direction = {"kind": "polyak", "alpha": 0.05, "warmup_steps": 3, "warmup_alpha": 0.5}
    got, _ = _run(_spec(EUCLID, direction=direction), w, grads)
    x, d = w["w"].clone(), torch.zeros(4)
    for k, g in enumerate(grads):
        a = 0.5 + (0.05 - 0.5) * min(k / 3, 1.0)
        d = (1 - a) * d + a * g["w"]
        x = x - 0.1 * d
    torch.testing.assert_close(got["w"], x, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- state, checkpoints, bad input


def test_resume_with_stage_state_is_bit_exact():
    torch.set_default_dtype(torch.float32)
    try:
        w = {"a": torch.randn(6, 8), "b": torch.randn(6, 8), "c": torch.randn(8)}
        grads = _grads(w, 6)
        spec = {"geomopt": 1, "name": "t", "rules": [
            {"name": "m", "match": {"ndim": 2}, "lr": 0.05, "direction": {"kind": "polyak", "alpha": 0.05},
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
             "post": [{"kind": "second_moment", "axis": "element", "bias_correction": True},
                      {"kind": "rms_match", "target": "polar"}, {"kind": "cautious"}],
             "weight_decay": 0.1, "decay": "cautious"},
            {"name": "v", "match": "**", "geometry": {"kind": "adam"}, "post": [{"kind": "second_moment", "axis": "element"}]},
        ]}
        full, _ = _run(spec, w, grads)
        half, opt = _run(spec, w, grads[:3])
        sd = copy.deepcopy(opt.state_dict())
        assert {"post_v", "post_step"} <= set(sd["state"][0])
        params = {n: torch.nn.Parameter(t.clone()) for n, t in half.items()}
        fresh = geomopt.GeomOptimizer(list(params.items()), spec)
        fresh.load_state_dict(sd)
        for g in grads[3:]:
            for n, p in params.items():
                p.grad = g[n].clone()
            fresh.step()
        assert all(torch.equal(full[n], params[n].detach()) for n in w)
    finally:
        torch.set_default_dtype(torch.float64)


def test_spec_change_resets_the_second_moment_and_says_so():
    torch.set_default_dtype(torch.float32)
    try:
        w = {"a": torch.randn(6, 8)}
        post = [{"kind": "second_moment", "axis": "row"}]
        geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}
        _, opt = _run(_spec(geometry, post, direction={"kind": "polyak"}), w, _grads(w, 2))
        params = [("a", torch.nn.Parameter(w["a"].clone()))]
        other = geomopt.GeomOptimizer(params, _spec(geometry, [{"kind": "second_moment", "axis": "column"}],
                                                     direction={"kind": "polyak"}))
        report = other.load_state_dict(opt.state_dict(), allow_spec_change=True)
        assert report.kept["a"] == ["momentum"]
        assert any("second moment" in r for r in report.reset["a"])
        assert "post_v" not in other.state[params[0][1]]
    finally:
        torch.set_default_dtype(torch.float64)


def test_nonfinite_gradient_leaves_stage_state_untouched():
    torch.set_default_dtype(torch.float32)
    try:
        w = {"a": torch.randn(4, 5)}
        spec = _spec(EUCLID, [{"kind": "second_moment", "axis": "row"}], direction={"kind": "lion"})
        _, opt = _run(spec, w, _grads(w, 2))
        p = opt.param_groups[0]["params"][0]
        before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
        x = p.detach().clone()
        p.grad = torch.full_like(p, float("nan"))
        opt.step()
        assert torch.equal(p.detach(), x)
        assert all(torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
                   for k, v in before.items())
    finally:
        torch.set_default_dtype(torch.float64)


def test_row_stage_on_a_vector_is_refused_with_the_parameter_and_rule():
    spec = _spec(EUCLID, [{"kind": "second_moment", "axis": "row"}])
    with pytest.raises(SpecError) as info:
        geomopt.GeomOptimizer([("w", torch.nn.Parameter(torch.zeros(3, 2))), ("bias", torch.nn.Parameter(torch.zeros(3)))],
                              spec)
    d = info.value.diagnostics[0]
    assert d.code == "GO120" and "'bias'" in d.message and "rule 'all'" in d.message and "axis: element" in d.message


@pytest.mark.parametrize("post,code,where,hint", [
    ("[{kind: bogus}]", "GO004", "7:19",
     "contra, second_moment, axis_norm, dual_scale, norm_ratio, rms_match, cautious, trust_ratio"),
    ("[{kind: norm_ratio, beta2: 1.0}]", "GO005", "7:38", "less than 1"),
    ("[{kind: rms_match, target: units}]", "GO005", "7:38", "target"),
    ("[cautious, rms_match]", "GO005", "7:22", "must come before 'cautious'"),
    ("[rms_match, rms_match]", "GO005", "7:23", "appears twice"),
    ("[{kind: second_moment, axis: diagonal}]", "GO005", "7:40", "'row', 'column', 'longer' or 'element'"),
])
def test_bad_stages_point_at_the_stage(post, code, where, hint):
    text = f'geomopt: 1\nname: t\nrules:\n  - name: a\n    match: "**"\n    geometry: {{kind: euclidean}}\n    post: {post}\n'
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, "yaml", file="t.yaml")
    d = info.value.diagnostics[0]
    assert (d.code, f"{d.line}:{d.col}") == (code, where), d.format()
    assert hint in d.message, d.message


def test_bad_stage_in_the_dsl_points_at_the_stage():
    text = 'geomopt 1\nname "t"\nrule a match "**":\n    geometry euclidean\n    post=[cautious, second_moment]\n'
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, "dsl", file="t.geom")
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO005", 5, 21) and "must come before 'cautious'" in d.message


def test_every_stage_round_trips_through_the_dsl():
    from geomopt.spec.printers import dump_spec

    text = ('geomopt: 1\nname: t\ndefaults: {decay: cautious}\nrules:\n  - name: a\n    match: "**"\n'
            '    geometry: {kind: spectral, reference: {kind: indicator}}\n'
            '    post: [{kind: second_moment, axis: column, beta2: 0.9, eps: 1.0e-6, bias_correction: true}, dual_scale, '
            '{kind: norm_ratio, beta2: 0.9, eps: 1.0e-6}, {kind: rms_match, target: polar}, cautious, '
            '{kind: trust_ratio, coeff: 0.5, weight_decay: 0.01, denominator: sum, eps: 1.0e-6, clamp: 10.0}]\n'
            '    direction: {kind: polyak, alpha: 0.05, warmup_steps: 10, warmup_alpha: 0.2}\n'
            '  - {name: b, match: "**", geometry: {kind: euclidean}, direction: {kind: heavy_ball, nesterov: true}}\n'
            '  - {name: c, match: "**", geometry: {kind: euclidean}, direction: {kind: lion}, post: [{kind: rms_match, target: input}]}\n'
            '  - {name: d, match: "**", geometry: {kind: euclidean}, post: [{kind: rms_match, target: unit}]}\n')
    spec = geomopt.parse_spec(text, "yaml")
    dsl = dump_spec(spec, "dsl")
    assert geomopt.parse_spec(dsl, "dsl") == spec
    assert geomopt.parse_spec(dump_spec(geomopt.parse_spec(dsl, "dsl"), "yaml"), "yaml") == spec


def test_every_stage_kind_is_registered_with_its_state_locality_and_source():
    from geomopt.distributed import LOCAL, REDUCE
    from geomopt.optim.units.stages import STAGES
    from geomopt.spec.updates import STAGE_ORDER

    assert set(STAGES) == set(STAGE_ORDER)
    for kind, stage in STAGES.items():
        doc = stage.fn.__doc__ or ""
        assert "←" in doc and any(ch.isdigit() for ch in doc), kind  # a formula and a year
        cfg = {"axis": "row"} if kind == "second_moment" else {}
        assert stage.locality(cfg) in (LOCAL, REDUCE)
    assert STAGES["second_moment"].locality({"axis": "element"}) == LOCAL
    assert STAGES["second_moment"].state == ("post_v",)


def test_stages_after_a_bfloat16_polynomial_compute_in_float32():
    """Newton–Schulz with ``dtype: bfloat16`` is given a bf16 direction (Nesterov, written in the
    iteration's dtype) and gives a bf16 update; the second moment (float32 state) upcasts it: two
    steps are X − Σ U_t/(√v_t + ε), U_t the bf16 iteration of the Nesterov direction D_t of a conv
    kernel's (out, rest) matrix and v_t the row means of U_t² (β₂ = 0.5), written out here in
    float64."""
    from geomopt.geometry.spectral import newton_schulz

    w = {"w": torch.randn(4, 2, 3, 3, dtype=torch.float32)}
    grads = [{"w": g["w"].float()} for g in _grads(w, 2)]
    geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, "scale": "none",
                "approx": {"kind": "newton_schulz", "dtype": "bfloat16"}, "prenormalize": {"kind": "frobenius"}}
    post = [{"kind": "second_moment", "axis": "row", "beta2": 0.5, "eps": 1e-3}]
    direction = {"kind": "polyak", "alpha": 0.5, "nesterov": True}
    got, opt = _run(_spec(geometry, post, direction=direction), w, grads)
    want, buf, v = w["w"].double().reshape(4, -1), torch.zeros(4, 18), None
    for g in grads:
        g = g["w"].reshape(4, -1)
        buf = 0.5 * buf + 0.5 * g  # α = 1/2: exact in float32, as the optimizer's lerps
        u = newton_schulz(0.5 * buf + 0.5 * g, dtype="bfloat16", prenormalize=FrobeniusPrenorm()).double()
        m2 = u.pow(2).mean(1)
        v = 0.5 * m2 if v is None else 0.5 * v + 0.5 * m2
        want = want - 0.1 * u / (v.sqrt() + 1e-3)[:, None]
    assert got["w"].dtype == torch.float32 and opt.state[next(iter(opt.state))]["post_v"].dtype == torch.float32
    torch.testing.assert_close(got["w"].double(), want.reshape(4, 2, 3, 3), rtol=1e-5, atol=1e-5)
