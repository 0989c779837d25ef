"""The ``kronecker`` geometry (Shampoo, SOAP, PSGD-Kron) as a spec: GeomOptimizer steps a bucket of
matrices beside pytorch-optimizer's ``Shampoo``, ``SOAP`` and ``Kron`` on the same gradients (the parameters agree
within a tight bound, and leave it when one coefficient is changed), resumes bit for bit from a
checkpoint, skips a non-finite gradient without touching its factors, keeps its factors float32
under a low state precision, and is refused, with why, where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import pytorch_optimizer
import torch
from torch import nn

import geomopt
from geomopt.spec.diagnostics import SpecError
from catalog_cases import kron_step_probes  # Kron's probes replaced by ours
from geomopt.geometry import kron_psgd
from test_kron import _gap, _peer  # the peers stepped from zero on the same gradients

F64 = torch.float64
STEPS, BUCKET = 6, 3


def _spec(**geometry) -> dict:
    return {"geomopt": 1, "name": "k", "defaults": {"on_nonfinite": "skip"},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "kronecker", **geometry}}]}


class Stack(nn.Module):
    """BUCKET matrices of one shape (one bucket), float64."""

    def __init__(self, shape):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=F64)) for _ in range(BUCKET)])


def _grads(shape, seed):
    return torch.randn(STEPS, BUCKET, *shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ours(grads, lr, direction=None, **geometry) -> torch.Tensor:
    model = Stack(grads.shape[2:])
    spec = _spec(**geometry)
    if direction is not None:
        spec["defaults"]["direction"] = direction
    opt = geomopt.GeomOptimizer(model, spec, lr=lr)
    for g in grads:
        for p, gi in zip(model.ws, g):
            p.grad = gi.clone()
        opt.step()
    return torch.stack([p.detach() for p in model.ws])


@pytest.mark.parametrize("shape", [(6, 6), (4, 7)])
def test_shampoo_steps_as_pytorch_optimizers_shampoo(shape):
    """pytorch-optimizer's ``Shampoo`` (the sum of D·Dᵀ from ε·I, exponent −1/4, roots every step):
    β = 1 (the sum), damping ε, every 1."""
    grads = _grads(shape, seed=1)
    lr, eps = 0.1, 1e-3
    peer = _peer(pytorch_optimizer.Shampoo, grads, lr=lr, matrix_eps=eps, preconditioning_compute_steps=1)
    ours = dict(method="shampoo", beta=1.0, damping=eps, every=1)
    bound = 1e-12
    assert _gap(_ours(grads, lr, **ours), peer) < bound
    assert _gap(_ours(grads, lr, **ours, root="newton"), peer) < bound
    for change in ({"beta": 0.99}, {"damping": 1.1e-3}, {"exponent": 2}, {"every": 2}):
        assert _gap(_ours(grads, lr, **{**ours, **change}), peer) > 100 * bound, change


@pytest.mark.parametrize("every", [2, 100])
def test_soap_steps_as_pytorch_optimizers_soap(every):
    """pytorch-optimizer's ``SOAP`` (no update on the first step, Adam in the eigenbases, bases
    refreshed every ``every`` steps with a float32 QR: the 1e-6 bound where a refresh happens)."""
    grads = _grads((6, 6), seed=3)
    lr, betas, beta, eps = 0.01, (0.9, 0.95), 0.8, 1e-3
    peer = _peer(pytorch_optimizer.SOAP, grads, lr=lr, betas=betas, shampoo_beta=beta, eps=eps,
                 precondition_frequency=every, weight_decay=0.0)
    ours = dict(method="soap", betas=list(betas), beta=beta, eps=eps, every=every)
    bound = 1e-12 if every > STEPS else 1e-6
    assert _gap(_ours(grads, lr, **ours), peer) < bound
    for change in ({"betas": [0.9, 0.96]}, {"eps": 1.2e-3}, {"every": 3}):
        assert _gap(_ours(grads, lr, **{**ours, **change}), peer) > 100 * bound, change


def test_one_sided_keeps_no_factor_above_max_dim():
    """A side longer than max_dim keeps an empty entry and steps as the identity there: Shampoo on
    a 5 × 12 matrix with max_dim 8 is L^(−1/2)·D, checked against an explicit float64 computation."""
    torch.manual_seed(0)
    model = Stack((5, 12))
    opt = geomopt.GeomOptimizer(model, _spec(method="shampoo", beta=1.0, damping=1e-3, every=1, max_dim=8), lr=0.1)
    g = torch.randn(BUCKET, 5, 12, dtype=F64)
    for p, gi in zip(model.ws, g):
        p.grad = gi.clone()
    opt.step()
    state = opt.state[model.ws[0]]
    assert state["shampoo_left"].shape == (5, 5)
    for key in ("shampoo_right", "shampoo_right_root", "shampoo_graft"):  # one empty entry (…, 0) per matrix
        assert state[key].shape == (0,), key
    lam, q = torch.linalg.eigh(g[0] @ g[0].T + 1e-3 * torch.eye(5, dtype=F64))
    want = -0.1 * (q @ torch.diag(lam ** -0.5) @ q.T @ g[0])
    torch.testing.assert_close(model.ws[0].detach(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("every", [1, 2])
def test_psgd_steps_as_pytorch_optimizers_kron(every, monkeypatch):
    """pytorch-optimizer's ``Kron`` (update probability 1/every: its counter fits at steps every,
    2·every, …; ``balance_prob`` 1: balanced at every fit, as ours) on the same gradients, its probes
    replaced by ours for the same step (it draws from torch's default generator; ours are seeded by the
    step), its float32 triangular solves kept in float64."""
    from pytorch_optimizer.optimizer import psgd as peer_module

    grads = 5 * _grads((5, 7), seed=9)
    lr, momentum = 0.02, 0.9
    monkeypatch.setattr(peer_module, "update_precondition", kron_step_probes(every)(peer_module.update_precondition))
    monkeypatch.setattr(peer_module, "solve_triangular_right", lambda x, a: torch.linalg.solve_triangular(
        a, x.reshape(-1, x.size(-1)), upper=True, left=False).reshape_as(x))
    peer = _peer(pytorch_optimizer.Kron, grads, lr=lr, momentum=momentum, balance_prob=1.0,
                 pre_conditioner_update_probability=1 / every, precondition_dtype=F64)
    ours = dict(method="psgd", momentum=momentum, every=every)
    bound = 1e-13  # measured: 4e-16
    assert _gap(_ours(grads, lr, direction={"kind": "none"}, **ours), peer) < bound
    for change in ({"momentum": 0.91}, {"precond_lr": 0.11}, {"every": every + 1}):
        assert _gap(_ours(grads, lr, direction={"kind": "none"}, **{**ours, **change}), peer) > 100 * bound, change
    monkeypatch.setattr(kron_psgd, "PROBE_SEED", kron_psgd.PROBE_SEED + 1)  # other probes
    assert _gap(_ours(grads, lr, direction={"kind": "none"}, **ours), peer) > 100 * bound


def test_psgd_probes_are_the_steps_and_leave_torchs_generator_alone():
    """Every matrix of a stack gets the step's probe, in its dtype; another step draws another; a step
    of the optimizer does not move torch's default generator."""
    g = torch.zeros(3, 4, 5, dtype=F64)
    v = kron_psgd.probe(g, 7)
    assert v.shape == g.shape and v.dtype == F64 and all(torch.equal(v[i], v[0]) for i in range(3))
    assert torch.equal(kron_psgd.probe(g[0], 7), v[0]) and not torch.equal(kron_psgd.probe(g, 8)[0], v[0])
    assert abs(v[0].mean().item()) < 1 and 0.3 < v[0].std().item() < 3
    model = Stack((4, 5))
    opt = geomopt.GeomOptimizer(model, _spec(method="psgd", every=1), lr=0.01)
    for p, gi in zip(model.ws, _grads((4, 5), seed=14)[0]):
        p.grad = gi.clone()
    before = torch.get_rng_state()
    opt.step()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("geometry", [dict(method="shampoo", every=2, graft="adam"),
                                      dict(method="soap", every=2), dict(method="psgd", every=2)])
def test_a_checkpoint_resumes_bit_for_bit(geometry):
    """PSGD's probes are the step's: a resume draws them again, whatever torch's generator did."""
    grads = _grads((6, 5), seed=4)
    straight = _ours(grads, 0.05, **geometry)
    model = Stack((6, 5))
    opt = geomopt.GeomOptimizer(model, _spec(**geometry), lr=0.05)
    half = STEPS // 2
    for i, g in enumerate(grads):
        if i == half:  # a fresh optimizer from the checkpoint
            saved = opt.state_dict()
            torch.manual_seed(13)  # the default generator elsewhere
            opt = geomopt.GeomOptimizer(model, _spec(**geometry), lr=0.05)
            opt.load_state_dict(saved)
        for p, gi in zip(model.ws, g):
            p.grad = gi.clone()
        opt.step()
    assert torch.equal(torch.stack([p.detach() for p in model.ws]), straight)


@pytest.mark.parametrize("method", ["shampoo", "psgd"])
def test_a_non_finite_gradient_leaves_the_factors_as_they_were(method):
    grads = _grads((4, 4), seed=5)
    model = Stack((4, 4))
    opt = geomopt.GeomOptimizer(model, _spec(method=method, every=1), lr=0.05)
    for g in grads[:2]:
        for p, gi in zip(model.ws, g):
            p.grad = gi.clone()
        opt.step()
    before = {k: v.clone() for k, v in opt.state[model.ws[1]].items()}
    x = [p.detach().clone() for p in model.ws]
    for p, gi in zip(model.ws, grads[2]):
        p.grad = gi.clone()
    model.ws[0].grad[0, 0] = float("nan")
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(x, model.ws))
    assert all(torch.equal(before[k], v) for k, v in opt.state[model.ws[1]].items())


@pytest.mark.parametrize("method", ["soap", "psgd"])
def test_factors_stay_float32_under_a_low_state_precision(method):
    spec = _spec(method=method, every=1)
    spec["rules"][0]["state"] = {"dtype": "bfloat16"}
    model = nn.Linear(6, 4, bias=False)
    opt = geomopt.GeomOptimizer(model, spec, lr=0.01)
    for _ in range(3):
        model.weight.grad = torch.randn_like(model.weight)
        opt.step()
    state = opt.state[model.weight]
    assert torch.isfinite(model.weight).all()
    if method == "soap":
        assert state["soap_exp_avg"].dtype == state["soap_exp_avg_sq"].dtype == torch.bfloat16
        assert state["soap_left"].dtype == state["soap_left_basis"].dtype == torch.float32
    else:
        assert state["psgd_momentum"].dtype == torch.bfloat16
        assert state["psgd_left"].dtype == state["psgd_right"].dtype == torch.float32


def test_where_it_cannot_run_it_says_why():
    model = nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"capturable=True cannot run this spec: rule 'all' has the kronecker "
                                         r"geometry \(its roots and bases are recomputed on a schedule the host"):
        geomopt.GeomOptimizer(model, _spec(), lr=0.01, capturable=True)
    with pytest.raises((SpecError, pydantic.ValidationError), match="graft belongs to method shampoo"):
        geomopt.GeomOptimizer(model, _spec(method="soap", graft="adam"), lr=0.01)
    with pytest.raises((SpecError, pydantic.ValidationError), match="momentum belongs to method psgd, not soap"):
        geomopt.GeomOptimizer(model, _spec(method="soap", momentum=0.5), lr=0.01)
    with pytest.raises((SpecError, pydantic.ValidationError), match="beta, betas belong to method shampoo or soap"):
        geomopt.GeomOptimizer(model, _spec(method="psgd", beta=0.9, betas=[0.9, 0.9]), lr=0.01)
    with pytest.raises(SpecError, match="at least 2 dimensions"):
        geomopt.GeomOptimizer(nn.Linear(4, 4), _spec(), lr=0.01)  # the bias


def test_a_dump_validates_again_and_only_a_stray_value_is_refused():
    from geomopt.spec.geometries import Kronecker

    for method in ("shampoo", "soap", "psgd"):
        g = Kronecker(method=method, every=3)
        assert Kronecker.model_validate(g.model_dump()) == g
    assert Kronecker(method="soap", graft="none").graft == "none"  # the default, written out
    with pytest.raises(pydantic.ValidationError, match="damping belongs to method shampoo"):
        Kronecker(method="soap", damping=1e-3)


@pytest.mark.parametrize("graft", ["adagrad", "adam", "spectral"])
def test_a_graft_gives_each_matrix_the_other_maps_step_length(graft):
    """After one step from zero, each matrix moved by lr·‖E‖_F, E the graft's map of the gradient,
    written out in float64: AdaGrad's and Adam's (bias-corrected) G/(|G| + ε) at the first step, the
    spectral map's √min(m, n) (an orthogonal factor of full rank); the orientation stays Shampoo's."""
    grads = _grads((6, 4), seed=6)[:1]
    lr, eps = 0.05, 1e-3
    moved = _ours(grads, lr, method="shampoo", every=1, damping=1e-3, graft=graft, eps=eps)
    g = grads[0]
    want = (torch.full((BUCKET,), 4.0).sqrt() if graft == "spectral"
            else torch.linalg.matrix_norm(g / (g.abs() + eps)))
    torch.testing.assert_close(torch.linalg.matrix_norm(moved), lr * want.to(F64), rtol=1e-10, atol=0)
    plain = _ours(grads, lr, method="shampoo", every=1, damping=1e-3)
    cos = (moved * plain).sum((-2, -1)) / (torch.linalg.matrix_norm(moved) * torch.linalg.matrix_norm(plain))
    torch.testing.assert_close(cos, torch.ones(BUCKET, dtype=F64), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- views: experts and fused blocks

EXPERTS = 3


def _viewed(grads, lr, view, **geometry) -> tuple[torch.Tensor, dict]:
    """Our kronecker geometry through ``view`` on a bucket of BUCKET tensors (the shape of
    ``grads``' rows), from zeros; the parameters and the first tensor's state."""
    model = Stack(grads.shape[2:])
    opt = geomopt.GeomOptimizer(model, _spec(view=view, **geometry), lr=lr)
    for g in grads:
        for p, gi in zip(model.ws, g):
            p.grad = gi.clone()
        opt.step()
    return torch.stack([p.detach() for p in model.ws]), opt.state[model.ws[0]]


SHAMPOO_PEER = dict(method="shampoo", beta=1.0, damping=1e-3, every=1)  # pytorch-optimizer's Shampoo's form


@pytest.mark.parametrize("root", ["eigh", "newton"])
def test_experts_each_take_their_own_shampoo(root):
    """An (E, m, n) expert tensor under view batch: 1 is E matrices, each stepped as pytorch-optimizer's
    Shampoo steps it alone (each its own 2-D parameter, float64); without the view, the (m, E·n) matrix
    is one Shampoo, which the bound refuses; the factors are stored (E, m, m) per tensor."""
    grads = _grads((EXPERTS, 5, 4), seed=8)
    lr = 0.1
    peer = _peer(pytorch_optimizer.Shampoo, grads.reshape(STEPS, BUCKET * EXPERTS, 5, 4), lr=lr, matrix_eps=1e-3,
                 preconditioning_compute_steps=1).reshape(BUCKET, EXPERTS, 5, 4)
    ours, state = _viewed(grads, lr, {"kind": "matrix", "batch": 1}, **SHAMPOO_PEER, root=root)
    bound = 1e-12
    assert _gap(ours, peer) < bound
    assert state["shampoo_left"].shape == (EXPERTS, 5, 5) and state["shampoo_right_root"].shape == (EXPERTS, 4, 4)
    assert _gap(_ours(grads, lr, **SHAMPOO_PEER, root=root), peer) > 100 * bound
    assert _gap(_viewed(grads, lr, {"kind": "matrix", "batch": 1}, **{**SHAMPOO_PEER, "damping": 1.1e-3})[0],
                peer) > 100 * bound


def test_fused_blocks_each_take_their_own_shampoo_and_soap():
    """A fused (3·s, n) projection (q, k, v) under view blocks: 3 is three s × n matrices, each
    stepped as the peers step it alone: pytorch-optimizer's Shampoo and SOAP (its float32 QR: the
    1e-6 bound)."""
    s, n = 4, 5
    grads = _grads((3 * s, n), seed=9)
    alone = grads.reshape(STEPS, BUCKET * 3, s, n)
    view = {"kind": "matrix", "blocks": 3}
    peer = _peer(pytorch_optimizer.Shampoo, alone, lr=0.1, matrix_eps=1e-3, preconditioning_compute_steps=1)
    ours, state = _viewed(grads, 0.1, view, **SHAMPOO_PEER)
    assert _gap(ours, peer.reshape(BUCKET, 3 * s, n)) < 1e-12
    assert state["shampoo_left"].shape == (3, s, s) and state["shampoo_right"].shape == (3, n, n)
    lr, betas, beta, eps = 0.01, (0.9, 0.95), 0.8, 1e-3
    peer = _peer(pytorch_optimizer.SOAP, alone, lr=lr, betas=betas, shampoo_beta=beta, eps=eps,
                 precondition_frequency=2, weight_decay=0.0).reshape(BUCKET, 3 * s, n)
    soap = dict(method="soap", betas=list(betas), beta=beta, eps=eps, every=2)
    ours, state = _viewed(grads, lr, view, **soap)
    assert _gap(ours, peer) < 1e-6
    assert state["soap_exp_avg"].shape == (3 * s, n)  # a moment keeps the tensor's layout
    assert _gap(_ours(grads, lr, **soap), peer) > 1e-3


def test_a_viewed_checkpoint_resumes_bit_for_bit():
    grads = _grads((EXPERTS, 4, 3), seed=10)
    view = {"kind": "matrix", "batch": 1}
    geometry = dict(method="psgd", every=2)
    straight, _ = _viewed(grads, 0.05, view, **geometry)
    model = Stack((EXPERTS, 4, 3))
    opt = geomopt.GeomOptimizer(model, _spec(view=view, **geometry), lr=0.05)
    for i, g in enumerate(grads):
        if i == STEPS // 2:
            saved = opt.state_dict()
            opt = geomopt.GeomOptimizer(model, _spec(view=view, **geometry), lr=0.05)
            opt.load_state_dict(saved)
        for p, gi in zip(model.ws, g):
            p.grad = gi.clone()
        opt.step()
    assert torch.equal(torch.stack([p.detach() for p in model.ws]), straight)


def test_a_view_it_cannot_read_is_refused_at_its_path():
    model = nn.Linear(4, 6, bias=False)
    with pytest.raises(SpecError, match=r"rules\[0\]\.geometry\.view|blocks \[4, 2\] are of different sizes") as err:
        geomopt.GeomOptimizer(model, _spec(view={"kind": "matrix", "blocks": [4, 2]}), lr=0.01)
    assert "blocks [4, 2] are of different sizes" in str(err.value)
    conv = nn.Conv2d(2, 3, 3, bias=False)
    with pytest.raises(SpecError, match="reads views with trailing: cols only"):
        geomopt.GeomOptimizer(conv, _spec(view={"kind": "matrix", "trailing": "batch"}), lr=0.01)


@pytest.mark.parametrize("name", ["shampoo", "scalable-shampoo", "soap", "psgd-kron"])
@pytest.mark.filterwarnings("ignore::geomopt.RolesGuessedWarning")
def test_the_catalogues_kronecker_specs_give_each_expert_its_own_factors(name):
    """The catalogue's kronecker specs on a mixture of experts (4 batched experts (4, 16, 8) and
    (4, 8, 16)): rule experts reads each expert as its own matrix (view: auto), so lint has no GO117;
    a hidden matrix is one matrix; after a step each expert has its own 16 × 16 and 8 × 8 factors
    (without the view: one pair of 4 × 4 and 128 × 128 for all four)."""
    from geomopt.compile.compiler import model_params
    from geomopt.lint import lint_spec
    from lint_fixtures.models import MoE

    torch.manual_seed(0)
    model = MoE()
    spec = geomopt.load_spec(Path(__file__).resolve().parents[1] / "specs" / "catalog" / f"{name}.yaml")
    opt = geomopt.GeomOptimizer(model, spec)
    experts = [p for p in opt.plan if p.role == "expert"]
    assert sorted(p.name for p in experts) == ["block.experts.w_in", "block.experts.w_out"]
    assert all(p.rule == "experts" and p.geometry.view.batch == 1 for p in experts)
    assert [p.geometry.view for p in opt.plan if p.name == "block.proj.weight"] == [None]
    assert not [d for d in lint_spec(spec, model_params(model)[0]) if d.code == "GO117"]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    method = spec.rules[0].geometry.method
    state = opt.state[model.block.experts.w_in]
    assert state[f"{method}_left"].shape == (4, 16, 16) and state[f"{method}_right"].shape == (4, 8, 8)


@pytest.mark.parametrize("method", ["shampoo", "soap", "psgd"])
def test_a_step_journals_the_refreshed_state_only_when_it_changes_it(method, monkeypatch):
    """Shampoo's roots, SOAP's bases and PSGD's factors change only on the steps that refresh them
    (every 2 here): a step journals them (copies them to restore if it fails) on exactly the steps
    that change them, and a fault at any request of a step of either kind leaves every tensor as
    before the step or as one clean step leaves it, a retry completing it (test_atomic_step's check)."""
    from geomopt.geometry.learned import REFRESHED
    from geomopt.optim.engine import bucket_step
    from test_atomic_step import build, check_every_fault, grads_of

    spec = {"geomopt": 1, "name": "k", "rules": [
        {"name": "hidden", "match": {"role": "hidden"},
         "geometry": {"kind": "kronecker", "method": method, "every": 2}},
        {"name": "rest", "match": "**", "geometry": {"kind": "adam"}}]}
    model, opt = build(spec)
    grads = [grads_of(model, k) for k in range(5)]
    journaled: list = []
    original = bucket_step.journal
    monkeypatch.setattr(bucket_step, "journal", lambda ts: original(journaled.extend(ts) or journaled[-len(ts):]))
    hidden = opt.param_groups[0]["params"]
    seen = set()
    for k, g in enumerate(grads):
        for name, p in model.named_parameters():
            p.grad = g[name].clone()
        before = {key: opt.state[hidden[0]].get(key, torch.empty(0)).clone() for key in REFRESHED[method]}
        journaled.clear()
        opt.step()
        storages = {t.untyped_storage().data_ptr() for t in journaled}
        for key in REFRESHED[method]:
            entry = opt.state[hidden[0]][key]
            changed = k > 0 and not torch.equal(entry, before[key])
            assert (entry.untyped_storage().data_ptr() in storages) == changed, (k, key)
            seen.add(changed)
    assert seen == {True, False}
    monkeypatch.setattr(bucket_step, "journal", original)
    model, opt = build(spec)
    for steps in (3, 4):  # a step that refreshes nothing (3: Shampoo, PSGD) and one that refreshes
        check_every_fault(opt, grads[:steps])


@pytest.mark.parametrize("every", [1, 2, 3, 5])
@pytest.mark.parametrize("method", ["shampoo", "soap", "psgd"])
def test_the_state_a_step_leaves_unchanged_is_the_refreshed_one_off_its_schedule(method, every):
    """``unchanged_by_step`` against the schedule counted out: after ``count`` steps, the next (count + 1)
    refreshes where every divides it, and leaves the refreshed entries alone elsewhere; nothing before a first
    step or for another geometry."""
    from geomopt.compile.fragments import ResolvedGeometry
    from geomopt.geometry.learned import REFRESHED, unchanged_by_step
    from geomopt.spec.geometries import Adam, Kronecker

    geometry = ResolvedGeometry(Kronecker(method=method, every=every))
    assert unchanged_by_step(geometry, {}) == ()
    for count in range(12):
        refreshes = (count + 1) % every == 0
        assert unchanged_by_step(geometry, {f"{method}_step": count}) == (() if refreshes else REFRESHED[method])
    assert unchanged_by_step(ResolvedGeometry(Adam()), {f"{method}_step": 1}) == ()
