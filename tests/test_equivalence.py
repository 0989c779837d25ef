"""Equivalence of shipped specs with the optimizers they claim to be, each against the real thing:
torch.optim.Muon (bf16 Newton–Schulz) and a float64 reimplementation of its algorithm,
torch.optim.AdamW(fused=True) bit for bit (the flat elementwise path on CPU), and an independent reimplementation of Scion's
update rules (Pethick et al. 2025, github.com/LIONS-EPFL/scion) for uScion and Scion.

Measured differences are printed (``pytest -s``) so the report can quote them.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from geomopt.compile.fragments import plain
import geomopt
from geomopt.geometry.dtypes import BF16Warning
from optim_helpers import SPECS, gpt_batch, loss_of, mlp_batch, tiny_gpt, tiny_mlp

LR, WD, MOMENTUM = 0.02, 0.1, 0.95


class Hidden(nn.Module):
    """Only hidden 2-D weights (tall, square, wide). Role inference reads the last layer as the
    model's head, so the tests give all three the role hidden (:data:`HIDDEN_ROLES`): then
    muon.yaml's ``hidden`` rule owns them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 24, bias=False), nn.Linear(24, 24, bias=False),
                                     nn.Linear(24, 8, bias=False)])


HIDDEN_ROLES = {"hidden": ["layers.*.weight"]}


def muon_spec(approx_dtype: str | None = None) -> dict:
    """muon.yaml with :data:`HIDDEN_ROLES` (the spec's ``roles:``) and the Newton–Schulz dtype."""
    spec = geomopt.load_spec(SPECS / "muon.yaml").model_dump()
    spec["roles"] = HIDDEN_ROLES
    if approx_dtype is not None:
        for rule in spec["rules"]:
            if rule["name"] == "hidden":
                rule["geometry"]["approx"]["dtype"] = approx_dtype
    return spec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------- Muon


def test_muon_spec_reads_as_torch_muon():
    plan = geomopt.compile_spec(SPECS / "muon.yaml", Hidden(), roles=HIDDEN_ROLES)  # the Python API's roles=
    assert plan["layers.2.weight"].role == "hidden"
    assert geomopt.compile_spec(SPECS / "muon.yaml", Hidden())["layers.2.weight"].role == "head"  # inferred
    for p in plan:
        assert p.rule == "hidden"
        assert p.lr == LR and p.weight_decay == WD
        assert plain(p.direction) == {"kind": "polyak", "alpha": pytest.approx(1 - MOMENTUM), "nesterov": True, "init": "zero",
                                   "warmup_steps": 0, "warmup_alpha": None}
        assert p.radius == pytest.approx(math.sqrt(max(1.0, p.shape[0] / p.shape[1])))  # "original" adjustment


@pytest.mark.parametrize("approx_dtype, tol", [("bfloat16", 1e-5), ("float32", 0.05)], ids=["bf16-ns", "fp32-ns"])
def test_muon_matches_torch_optim_muon_one_step_updates(approx_dtype, tol):
    """Same point, same gradient, same momentum buffer: one-step updates agree. torch.optim.Muon
    always runs Newton–Schulz in bf16; muon.yaml does so on CUDA (``dtype: auto``) and here the
    test pins it (``dtype: bfloat16``): they agree to fp32 rounding of the final axpy (measured
    ≈ 1e-6). An fp32 Newton–Schulz (muon.yaml on a CPU) differs from it by bf16 rounding of the
    iteration (measured ≈ 2–3% relative)."""
    torch.manual_seed(0)
    model = Hidden()
    ref_model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)  # bf16 on purpose, on tiny matrices
        opt = geomopt.GeomOptimizer(model, muon_spec(approx_dtype))
    ref = torch.optim.Muon(ref_model.parameters(), lr=LR, weight_decay=WD, momentum=MOMENTUM, nesterov=True,
                           adjust_lr_fn="original")
    worst = worst_fro = 0.0
    for _ in range(3):
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters()):
                q.copy_(p)  # compare updates from the same point
        before = [p.detach().clone() for p in model.parameters()]
        for p, q in zip(model.parameters(), ref_model.parameters()):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q, x in zip(model.parameters(), ref_model.parameters(), before):
            ours, theirs = p.detach() - x, q.detach() - x
            assert theirs.abs().max() > 0
            worst = max(worst, _rel(ours, theirs))
            worst_fro = max(worst_fro, float((ours - theirs).norm() / theirs.norm()))
    print(f"\nmuon vs torch.optim.Muon ({approx_dtype} NS): max rel {worst:.3g}, rel fro {worst_fro:.3g}")
    assert worst <= tol


def _ns_float64(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch/optim/_muon.py ``_zeropower_via_newtonschulz`` in float64 (transpose tall, divide by
    max(‖·‖_F, eps), five quintic steps)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_muon_fp32_newton_schulz_matches_float64_reimplementation():
    """A spec with ``approx.dtype: float32`` against torch.optim.Muon's algorithm in float64 over
    five steps: the trajectories agree to 1e-5, and each step's update (from the same point) to
    1e-5 of lr·adjustment."""
    torch.manual_seed(1)
    model = Hidden()
    opt = geomopt.GeomOptimizer(model, muon_spec("float32"))
    params = [p.detach().double().clone() for p in model.parameters()]
    bufs = [torch.zeros_like(p) for p in params]
    worst_step = worst_traj = 0.0
    for _ in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        for i, (p, g, x) in enumerate(zip(params, grads, before)):
            g = g.double()
            bufs[i].lerp_(g, 1 - MOMENTUM)
            update = _ns_float64(g.lerp(bufs[i], MOMENTUM))
            adjusted = LR * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
            # the float64 step from the trajectory's own point, and from geomopt's point
            p.mul_(1 - LR * WD).add_(update, alpha=-adjusted)
            step_ref = x.double() * (1 - LR * WD) - adjusted * update
            ours = list(model.parameters())[i].detach().double()
            worst_step = max(worst_step, float((ours - step_ref).abs().max()) / adjusted)
            worst_traj = max(worst_traj, float((ours - p).abs().max()))
    print(f"\nmuon fp32 NS vs float64 Muon: per-step update err {worst_step:.3g}·lr_adj, trajectory {worst_traj:.3g}")
    assert worst_step <= 1e-5
    assert worst_traj <= 1e-5


def test_muon_spec_with_adamw_rules_matches_muon_plus_adamw():
    """On an MLP, muon.yaml = torch.optim.Muon on hidden weights (bf16 NS spec, fp32-rounding
    agreement) + AdamW on head/biases, bit for bit (head: lr 1e-3, wd 0.1; rest: lr 1e-3, wd 0)."""
    model = tiny_mlp(0, depth=3)
    ref_model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)
        opt = geomopt.GeomOptimizer(model, muon_spec("bfloat16"))
    names = dict(model.named_parameters())
    rules = {n: opt.plan[n].rule for n in names}
    assert rules["layers.0.weight"] == "hidden" and rules["head.weight"] == "head" and rules["head.bias"] == "rest"
    ref_params = dict(ref_model.named_parameters())
    muon = torch.optim.Muon([ref_params[n] for n in names if rules[n] == "hidden"], lr=LR, weight_decay=WD,
                            momentum=MOMENTUM, nesterov=True, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(
        [dict(params=[ref_params[n] for n in names if rules[n] == "head"], weight_decay=WD),
         dict(params=[ref_params[n] for n in names if rules[n] == "rest"], weight_decay=0.0)],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    batch = mlp_batch(0, d_in=8)
    worst = 0.0
    for _ in range(3):
        with torch.no_grad():  # hidden weights differ by fp32 rounding: restart both from ours
            for n in names:
                if rules[n] == "hidden":
                    ref_params[n].copy_(names[n])
        for m, o in ((model, opt), (ref_model, None)):
            m.zero_grad()
            loss_of(m, batch).backward()
        before = {n: p.detach().clone() for n, p in names.items()}
        opt.step()
        muon.step()
        adamw.step()
        for n, p in names.items():
            if rules[n] == "hidden":
                worst = max(worst, _rel(p.detach() - before[n], ref_params[n].detach() - before[n]))
            else:
                assert torch.equal(p, ref_params[n]), n
    print(f"\nmuon.yaml (bf16 NS) + AdamW on an MLP: hidden max rel {worst:.3g}; adam params bit-identical")
    assert worst <= 1e-5


# ---------------------------------------------------------------- AdamW


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_geometry_is_torch_adamw_bit_for_bit(weight_decay):
    spec = {"geomopt": 1, "name": "adamw", "defaults": {"lr": 3e-3, "weight_decay": weight_decay},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "adam", "betas": [0.9, 0.95], "eps": 1e-8}}]}
    model = tiny_mlp(3)
    ref_model = copy.deepcopy(model)
    opt = geomopt.GeomOptimizer(model, spec)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=weight_decay, fused=True)
    for k in range(6):
        batch = mlp_batch(k)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            loss_of(m, batch).backward()
            o.step()
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (k, n, float((p - q).abs().max()))
            assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    assert not torch.equal(model.head.weight, tiny_mlp(3).head.weight)  # it did move


# ---------------------------------------------------------------- Scion


def _ns_fp32(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Scion's zeropower_via_newtonschulz5 in fp32 (Scion runs it in bf16; the spec's ``auto`` is
    fp32 on CPU): X/(‖X‖_F + eps), transpose tall, five quintic steps."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    x = x / (x.norm() + eps)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _scion_lmo(kind: str, g: torch.Tensor, eps_per_unit: bool = False) -> torch.Tensor:
    """Scion's norms (LIONS-EPFL/scion, scion.py), written from their definitions: ColNorm and
    BiasRMS are g/(c‖g‖ + 1e-8). ``eps_per_unit`` uses 1e-8·c instead, i.e. ρ·g/(‖g‖ + 1e-8) with
    ρ = 1/c, which is what the specs' ``eps: 1.0e-8`` log barrier computes (Scion's exact
    ε is 1e-8/c, shape-dependent)."""
    eps = 1e-8
    if kind == "Spectral":  # normalized=True: scale √(d_out/d_in)
        d_out, d_in = g.shape
        return _ns_fp32(g) * math.sqrt(d_out / d_in)
    if kind == "SpectralQKV":  # the specs' view: auto reads a fused q, k, v weight as three matrices
        return torch.cat([_scion_lmo("Spectral", block) for block in g.chunk(3, dim=0)])
    if kind == "Sign":  # normalized=True: (1/d_in)·sign
        return torch.sign(g) / g.shape[1]
    if kind == "ColNormT":  # ColNorm(transpose=True), normalized=False
        gt = g.T
        c = 1 / math.sqrt(gt.size(0))
        rms = torch.sqrt(torch.sum(gt**2, dim=0, keepdim=True)) * c
        return (gt / (rms + (eps * c if eps_per_unit else eps))).T
    if kind == "BiasRMS":
        c = 1 / math.sqrt(g.shape[0])
        rms = torch.sqrt(torch.mean(g**2, dim=0, keepdim=True))
        return g / (rms + (eps * c if eps_per_unit else eps))
    raise ValueError(kind)


class ScionReference:
    """Scion's step: buf ← (1−α)buf + α·g (zeros at start); p ← (1−lr)p (constrained only);
    p ← p − lr·scale·lmo(buf)."""

    def __init__(self, model: nn.Module, *, lr: float, alpha: float, constrained: bool, eps_per_unit: bool):
        self.lr, self.alpha, self.constrained, self.eps_per_unit = lr, alpha, constrained, eps_per_unit
        self.items = []
        for name, p in model.named_parameters():
            if name.startswith("transformer.wte") or name.startswith("transformer.wpe"):
                kind, scale = "ColNormT", 1.0
            elif name == "lm_head.weight":
                kind, scale = "Sign", 10.0
            elif name.endswith("attn.c_attn.weight"):
                kind, scale = "SpectralQKV", 1.0
            elif name.endswith(".weight") and p.ndim == 2:
                kind, scale = "Spectral", 1.0
            else:
                kind, scale = "BiasRMS", 1.0
            self.items.append((name, p, kind, scale, torch.zeros_like(p)))

    @torch.no_grad()
    def step(self):
        for _, p, kind, scale, buf in self.items:
            buf.mul_(1 - self.alpha).add_(p.grad, alpha=self.alpha)
            update = scale * _scion_lmo(kind, buf, self.eps_per_unit)
            if self.constrained:
                p.mul_(1 - self.lr)
            p.add_(update, alpha=-self.lr)


@pytest.mark.parametrize("eps_per_unit, tol", [(True, 1e-5), (False, 1e-3)], ids=["spec-eps", "scion-eps"])
@pytest.mark.parametrize("spec_name, constrained", [("uscion", False), ("scion", True)])
def test_scion_specs_match_scion_update_rules(spec_name, constrained, eps_per_unit, tol):
    """Four steps of a small GPT (embeddings ColNorm(transpose), head Sign·10, hidden Spectral,
    norms/biases BiasRMS). With ε read as the specs write it the agreement is fp32 rounding; with
    Scion's literal 1e-8 inside c‖g‖ + 1e-8 the isotropic/columnwise tensors differ by
    ≈ 1e-8·(√n − 1)/‖d‖ relative (measured ≈ 3e-4 on LayerNorm weights with tiny gradients)."""
    model = tiny_gpt(0)
    ref_model = copy.deepcopy(model)
    opt = geomopt.GeomOptimizer(model, SPECS / f"{spec_name}.yaml")
    assert {g["rule"] for g in opt.param_groups} == {"embeddings", "head", "hidden", "rest"}
    ref = ScionReference(ref_model, lr=0.02, alpha=0.1, constrained=constrained, eps_per_unit=eps_per_unit)
    worst_abs = worst_rel = 0.0
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k in range(4):
        batch = gpt_batch(k)
        for m in (model, ref_model):
            m.zero_grad()
            loss_of(m, batch).backward()
        opt.step()
        ref.step()
        for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            moved = (q.detach() - start[n]).abs().max()
            assert moved > 0, n
            diff = float((p.detach() - q.detach()).abs().max())
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / float(moved))
    print(f"\n{spec_name} vs Scion reference ({'spec' if eps_per_unit else 'scion'} eps; 4 steps, GPT): "
          f"max abs {worst_abs:.3g}, max rel to the move {worst_rel:.3g}")
    assert worst_rel <= tol
