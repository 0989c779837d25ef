"""Batched bucket execution equals per-tensor execution.

GeomOptimizer runs the same-shape tensors of a rule as one batched call (leading dim = tensor).
The reference here steps each tensor with its own optimizer (a bucket of one), on the same
gradients: elementwise geometries must agree exactly, spectral ones to matmul rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

import geomopt

SPECS = {
    "adam": ({"kind": "adam"}, None, 0.0),
    "sign": ({"kind": "anisotropic", "reference": {"kind": "indicator"}}, None, 0.0),
    "normalized": ({"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}}, {"kind": "l2_ball", "radius": 0.5}, 0.0),
    "rowwise-ball": ({"kind": "rowwise", "reference": {"kind": "log_barrier"}}, {"kind": "frobenius_ball", "radius": 0.4}, 1e-6),
    "muon": ({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}, None, 2e-6),
    "spectral-clip": ({"kind": "spectral", "reference": {"kind": "log_barrier"}, "approx": {"kind": "svd"}},
                      {"kind": "spectral_ball", "radius": 0.3}, 2e-6),
    "prox-frobenius": ({"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3},
                        "approx": {"kind": "svd"}}, {"kind": "frobenius_ball", "radius": 0.6}, 2e-6),
    "stiefel-polar": ({"kind": "spectral", "reference": {"kind": "log_barrier"}, "approx": {"kind": "svd"}},
                      {"kind": "stiefel", "radius": 0.5, "method": "polar"}, 2e-5),
}


def _spec(geometry, constraint):
    rule = {"name": "all", "match": "**", "geometry": geometry, "direction": {"kind": "polyak", "alpha": 0.2}}
    if constraint is not None:
        rule["constraint"] = constraint
    return {"geomopt": 1, "name": "t", "defaults": {"lr": 0.05, "weight_decay": 0.01}, "rules": [rule]}


@pytest.mark.parametrize("name", list(SPECS))
def test_batched_bucket_equals_per_tensor(name):
    geometry, constraint, tol = SPECS[name]
    torch.manual_seed(0)
    params = [(f"w{i}", torch.nn.Parameter(torch.randn(12, 8) * 0.1)) for i in range(5)]
    singles = [[(n, torch.nn.Parameter(p.detach().clone()))] for n, p in params]
    spec = _spec(geometry, constraint)
    batched = geomopt.GeomOptimizer(params, copy.deepcopy(spec))
    assert len(batched.engine.buckets[0]) == 1 and len(batched.engine.buckets[0][0]) == 5  # one bucket of five
    alone = [geomopt.GeomOptimizer(s, copy.deepcopy(spec)) for s in singles]
    for step in range(4):
        grads = [torch.randn(12, 8) for _ in params]
        for (_, p), g in zip(params, grads):
            p.grad = g.clone()
        for s, g in zip(singles, grads):
            s[0][1].grad = g.clone()
        batched.step()
        for opt in alone:
            opt.step()
    for (_, p), s in zip(params, singles):
        q = s[0][1]
        if tol == 0.0:
            assert torch.equal(p, q), name
        else:
            assert torch.allclose(p, q, rtol=0, atol=tol * q.abs().max().item()), (name, (p - q).abs().max())


def test_state_entries_are_views_of_the_bucket_buffer_and_survive_a_reload():
    """Steady state copies nothing: per-parameter momentum entries are rows of one stacked buffer;
    after load_state_dict (fresh tensors) the next step restacks and continues identically."""
    torch.manual_seed(1)
    make = lambda: [(f"w{i}", torch.nn.Parameter(torch.randn(6, 4))) for i in range(3)]
    spec = _spec({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}, None)
    a, b = make(), None
    b = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in a]
    opt_a, opt_b = geomopt.GeomOptimizer(a, spec), geomopt.GeomOptimizer(b, spec)
    grads = [[torch.randn(6, 4) for _ in range(3)] for _ in range(4)]

    def step(params, opt, gs):
        for (_, p), g in zip(params, gs):
            p.grad = g.clone()
        opt.step()

    for k in range(2):
        step(a, opt_a, grads[k])
        step(b, opt_b, grads[k])
    bufs = {opt_a.state[p]["d"]._base for _, p in a}
    assert len(bufs) == 1 and next(iter(bufs)) is not None
    opt_b.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    for k in range(2, 4):
        step(a, opt_a, grads[k])
        step(b, opt_b, grads[k])
    for (_, p), (_, q) in zip(a, b):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- the flat elementwise path

FLAT_VARIANTS = {
    "sign-polyak": ({"kind": "anisotropic", "reference": {"kind": "indicator"}}, {"kind": "polyak", "alpha": 0.2}),
    "sign-nesterov-init-gradient": ({"kind": "anisotropic", "reference": {"kind": "indicator"}},
                                    {"kind": "polyak", "alpha": 0.1, "nesterov": True, "init": "gradient"}),
    "sgd-none": ({"kind": "euclidean"}, {"kind": "none"}),
    "sgd-nesterov": ({"kind": "euclidean"}, {"kind": "polyak", "alpha": 0.1, "nesterov": True}),
    "power-barrier-in-out": ({"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 0.1},
                              "layout": "in_out"}, {"kind": "polyak", "alpha": 0.3}),
    "adam": ({"kind": "adam", "betas": [0.8, 0.95], "eps": 1e-6}, {"kind": "none"}),
    "adam-after-polyak": ({"kind": "adam"}, {"kind": "polyak", "alpha": 0.5}),
    "normalized-sgd": ({"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}}, {"kind": "polyak", "alpha": 0.1}),
    "isotropic-power-none": ({"kind": "isotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 0.5},
                              "scale": "scion"}, {"kind": "none"}),
    "log-barrier-scion-scale": ({"kind": "anisotropic", "reference": {"kind": "log_barrier", "eps": 0.05},
                                 "scale": "scion"}, {"kind": "polyak", "alpha": 0.3, "init": "gradient"}),
}


@pytest.mark.parametrize("name", list(FLAT_VARIANTS))
def test_flat_elementwise_path_equals_batched_path_bit_for_bit(name, monkeypatch):
    """An elementwise rule's tensors (all shapes) run as one flat foreach call; the batched
    per-bucket path (taken when the update norm is tracked) must give the same bits (isotropic:
    the same up to the order of the norm's sum), across steps where some tensors have no
    gradient and across a state_dict save / load. Adam here takes the unfused flat path (where a
    device has no fused AdamW kernel); the fused one is checked against torch's below."""
    from optim_helpers import gpt_batch, loss_of, tiny_gpt

    geometry, direction = FLAT_VARIANTS[name]
    ulps = geometry["kind"] == "isotropic"
    match = {"name": "**.weight", "ndim": 2} if geometry.get("layout") else "**"
    rules = [{"name": "all", "match": match, "geometry": geometry, "direction": direction}]
    if geometry.get("layout"):
        rules.append({"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}})
    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.01, "weight_decay": 0.1}, "rules": rules}
    flat_model, ref_model = tiny_gpt(0), tiny_gpt(0)
    flat = geomopt.GeomOptimizer(flat_model, copy.deepcopy(spec), implementation="foreach")
    ref = geomopt.GeomOptimizer(ref_model, copy.deepcopy(spec), track_update=True)
    for step in range(6):
        for model, opt in ((flat_model, flat), (ref_model, ref)):
            opt.zero_grad(set_to_none=True)
            loss_of(model, gpt_batch(step)).backward()
            if step == 2:  # the head misses a step: its direction buffer is kept aside
                model.lm_head.weight.grad = None
        assert any(prog.variant == "flat" for prog, _ in flat.engine.jobs(flat.param_groups, flat.state))
        assert not any(prog.variant == "flat" for prog, _ in ref.engine.jobs(ref.param_groups, ref.state))
        flat.step()
        ref.step()
        if step == 3:  # resume the flat one from its checkpoint (views rebuilt from loaded state)
            sd = copy.deepcopy(flat.state_dict())
            flat = geomopt.GeomOptimizer(flat_model, copy.deepcopy(spec), implementation="foreach")
            flat.load_state_dict(sd)
        for (n, p), q in zip(flat_model.named_parameters(), ref_model.parameters()):
            if ulps:  # per-tensor norms reduce in another order, or the fused kernel rounds its own way
                torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7, msg=f"{name} {step} {n}")
            else:
                assert torch.equal(p, q), (name, step, n)
    for p, q in zip(flat_model.parameters(), ref_model.parameters()):
        assert flat.state[p].keys() == ref.state[q].keys()
        for key, value in flat.state[p].items():
            if not torch.is_tensor(value):
                assert value == ref.state[q][key], key
            elif ulps:
                torch.testing.assert_close(value, ref.state[q][key], rtol=2e-6, atol=1e-7)
            else:
                assert torch.equal(value, ref.state[q][key]), key


@pytest.mark.parametrize("name", ["adam", "adam-after-polyak"])
def test_flat_adam_is_torch_fused_adamw_bit_for_bit(name):
    """On CPU the flat adam path calls torch's fused AdamW kernel: the parameters and moments
    equal torch.optim.AdamW(fused=True)'s bit for bit (fed the Polyak average as its gradient
    where the rule has one), across a step where a tensor has no gradient and a state_dict
    save / load."""
    from optim_helpers import gpt_batch, loss_of, tiny_gpt

    geometry, direction = FLAT_VARIANTS[name]
    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.01, "weight_decay": 0.1},
            "rules": [{"name": "all", "match": "**", "geometry": geometry, "direction": direction}]}
    model, ref_model = tiny_gpt(0), tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, copy.deepcopy(spec))
    betas = tuple(geometry.get("betas", (0.9, 0.999)))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, betas=betas, eps=geometry.get("eps", 1e-8),
                            weight_decay=0.1, fused=True)
    alpha = direction.get("alpha")
    avg = {q: torch.zeros_like(q) for q in ref_model.parameters()}
    for step in range(6):
        for m in (model, ref_model):
            m.zero_grad(set_to_none=True)
            loss_of(m, gpt_batch(step)).backward()
            if step == 2:
                m.lm_head.weight.grad = None
        if alpha is not None:  # the Polyak average d ← d + α(g − d), then AdamW on d
            for q in ref_model.parameters():
                if q.grad is not None:
                    q.grad = avg[q].lerp_(q.grad, alpha).clone()
        opt.step()
        ref.step()
        if step == 3:
            sd = copy.deepcopy(opt.state_dict())
            opt = geomopt.GeomOptimizer(model, copy.deepcopy(spec))
            opt.load_state_dict(sd)
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (name, step, n)
            assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]), (name, step, n)
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"]), (name, step, n)


def test_flat_path_keeps_no_allocation_per_step():
    """After the first step the flat path reuses its buffers (fresh memory costs page faults)."""
    model = torch.nn.Linear(64, 64)
    opt = geomopt.GeomOptimizer(model, _spec({"kind": "anisotropic", "reference": {"kind": "indicator"}}, None))
    model.weight.grad = torch.randn(64, 64)
    model.bias.grad = torch.randn(64)
    opt.step()
    buffers = {k: v.data_ptr() for k, v in opt.engine.rt.buffers.items()}
    opt.step()
    assert buffers and {k: v.data_ptr() for k, v in opt.engine.rt.buffers.items()} == buffers


def test_flat_adam_with_channels_last_weights_is_torch_adamw():
    """A channels_last conv weight (memory order ≠ logical order) cannot go through the fused
    kernel with flat, contiguous moments: the call takes the unfused ops, so the whole rule equals
    torch.optim.AdamW(foreach=False) bit for bit (and every entry moves as AdamW moves it)."""
    from geomopt.models import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN().to(memory_format=torch.channels_last)
    ref_model = copy.deepcopy(model)
    assert any(not p.is_contiguous() for p in model.parameters())
    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.01, "weight_decay": 0.1},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "adam"}}]}
    opt = geomopt.GeomOptimizer(model, spec)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    for step in range(3):
        x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(step)).to(memory_format=torch.channels_last)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            o.step()
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (step, n)


@pytest.mark.filterwarnings("ignore::geomopt.geometry.dtypes.BF16Warning")  # bf16 on purpose
def test_direction_written_in_the_forward_dtype_gives_the_same_bits(monkeypatch):
    """Nesterov's u is written straight in the dtype Newton–Schulz casts it to (bf16 here, as on
    CUDA): the same bits as writing it in fp32 and casting, over steps and a missed gradient."""
    from optim_helpers import step_in_lockstep, tiny_gpt

    import geomopt.optim.engine.bucket_step as optimizer_module

    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.02, "weight_decay": 0.1}, "rules": [
        {"name": "hidden", "match": {"name": "**.weight", "ndim": 2},
         "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": True},
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "scale": "muon_original",
                      "approx": {"kind": "newton_schulz", "steps": 5, "dtype": "bfloat16"}}},
        {"name": "rest", "match": "**", "geometry": {"kind": "adam"}}]}
    models = [tiny_gpt(0), tiny_gpt(0)]
    opts = [geomopt.GeomOptimizer(m, copy.deepcopy(spec)) for m in models]
    low = optimizer_module.input_dtype
    taken: list = []  # the scratch u the first optimizer takes (released at the end of each step)
    ws = opts[0].engine.rt.workspace
    take = ws.take
    monkeypatch.setattr(ws, "take", lambda slot, shape, dtype, device: taken.append((slot, dtype)) or
                        take(slot, shape, dtype, device))
    step_in_lockstep(models, opts, setup=lambda i: monkeypatch.setattr(
        optimizer_module, "input_dtype", low if i == 0 else lambda g, like: like.dtype))
    u = [dtype for slot, dtype in taken if slot == "u"]
    assert u and all(dtype == torch.bfloat16 for dtype in u)
