"""GeomOptimizer(fuse=True) runs a rule's post-stages by rows where each has a statistics form
(NorMuon's second moment by rows, the norm match): one compiled read of U gives its per-row sums of
squares, the stages turn them into one factor per row (updating their state as their units do), and
the compiled write-back applies it. The step tracks the eager one within float32 rounding, the
factor is the float64 stages' own, a checkpoint resumes bit for bit, a non-finite gradient changes
nothing, and a chain without the form runs its eager stages."""

from __future__ import annotations

import math

import pytest
import torch
from optim_helpers import tiny_gpt
from test_capturable import _grads  # every model's gradients of one batch (NaN-poisoned on request)
from test_fused import assert_a_poisoned_step_skips, step_scheduled

import geomopt
from geomopt.optim.engine import fused
from geomopt.optim.units import stages
from geomopt.spec.updates import Cautious, RmsMatch, SecondMoment

PROX_NORMUON = {"geomopt": 1, "name": "prox-normuon", "extends": "normuon", "rules": [
    {"name": "hidden", "weight_decay": 0.0, "constraint": {"kind": "proximal_decay", "lam": 0.1}}]}


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles its own functions (torch's recompile limit is per code object)."""
    torch._dynamo.reset()
    yield


def _hidden_state(opt) -> list:
    """The hidden rule's tensors' post_v, in parameter order."""
    return [opt.state[p]["post_v"] for g in opt.param_groups if g["rule"] == "hidden" for p in g["params"]]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("spec, capturable, tol", [
    ("normuon", False, 1e-5), ("normuon-rms", False, 1e-5), ("normuon", True, 1e-5),
    (PROX_NORMUON, False, 1e-5), ("normuon-hyperball", False, 5e-5)],
    ids=["normuon", "normuon-rms", "normuon-capturable", "prox-normuon", "normuon-hyperball"])
def test_the_fused_post_stages_track_the_eager_ones_with_their_state(spec, capturable, tol, monkeypatch):
    """Five steps under a learning rate that changes every step: every parameter and every
    second moment (relative to its size) within float32 rounding of the eager step's, amplified
    as muon's is by the folded iteration (tests/test_fused.py). normuon-rms: a number as the RMS
    target; prox-normuon: the factor in the compiled prox write-back; normuon-hyperball: its wide
    matrices' second moment is per column (no row form: their eager stages run) and its sphere's
    prox needs Y (the factor applied in one pass before the stacked write-back); its twelve
    Newton–Schulz steps amplify the folded form's ulps more (3e-5 here after five steps, 1.5e-5
    with its stages run eagerly under fuse: the same order)."""
    models = [tiny_gpt(0), tiny_gpt(0)]
    eager = geomopt.GeomOptimizer(models[0], spec, capturable=capturable)
    fuse = geomopt.GeomOptimizer(models[1], spec, capturable=capturable, fuse=True)
    by_rows, row_factor = [], stages.row_factor
    monkeypatch.setattr(stages, "row_factor", lambda *a: by_rows.append(a[0].shape) or row_factor(*a))
    for step in range(5):
        step_scheduled(models, (eager, fuse), step)
        gap = max((p - q).abs().max().item() for p, q in zip(models[0].parameters(), models[1].parameters()))
        v_gap = max(_close(b, a) for a, b in zip(_hidden_state(eager), _hidden_state(fuse)))
        assert gap <= tol and v_gap <= 1e-5, (step, gap, v_gap)
    assert len(by_rows) >= 5  # the stages ran by rows (each step, at least one bucket)
    moved = max((p - tiny_gpt(0).state_dict()[n]).abs().max().item() for n, p in models[1].named_parameters())
    assert moved > 1e-3


def _normuon_ref(us: list, beta2: float, eps: float) -> list:
    """NorMuon's post-stages in float64 by hand (the official preserve_norm form): per row
    v ← β₂v + (1−β₂)·mean_j U²_ij, U' = U/(√v + ε), U'' = U'·‖U‖_F/(‖U'‖_F + ε)."""
    v, out = torch.zeros(us[0].shape[0], 1, dtype=torch.float64), []
    for u in us:
        v = beta2 * v + (1 - beta2) * (u * u).mean(dim=1, keepdim=True)
        scaled = u / (v.sqrt() + eps)
        out.append((scaled * (u.norm() / (scaled.norm() + eps)), v.clone()))
    return out


def test_the_row_factor_is_the_float64_stages_with_their_state():
    """fused.post_by_rows on float32 updates of a bucket of two 12 × 7 matrices, three steps: F·U
    and the second moment against the float64 reference above (a few float32 ulps), and against
    the eager stages run in float64 on the same updates."""
    post = [SecondMoment(kind="second_moment", axis="row", beta2=0.9, eps=1e-10),
            RmsMatch(kind="rms_match", target="input", eps=1e-10)]
    gen = torch.Generator().manual_seed(0)
    us = [torch.randn(2, 12, 7, generator=gen) * torch.logspace(-2, 1, 12).reshape(1, 12, 1) for _ in range(3)]
    refs = [_normuon_ref([u[i].double() for u in us], 0.9, 1e-10) for i in range(2)]
    fused_state: dict = {}
    eager_state: dict = {}
    for k, u in enumerate(us):
        ctx = stages.Context(state=fused_state, op_shape=(12, 7), step=k + 1, fresh=True)
        same, factor = fused.post_by_rows(u, post, ctx)
        assert same is u and factor.shape == (2, 12, 1)
        eager = stages.run(u.double(), post, stages.Context(state=eager_state, op_shape=(12, 7), step=k + 1,
                                                            fresh=True))
        for i in range(2):
            want, v = refs[i][k]
            assert _close((factor[i] * u[i]).double(), want) <= 1e-6
            assert _close(fused_state["post_v"][i].double(), v) <= 1e-6
            assert _close(eager[i], want) <= 1e-12  # the eager units are the reference's formula
    assert fused_state["post_v"].dtype == torch.float32


def test_a_chain_without_a_row_form_runs_its_eager_stages():
    """A stage that reads the gradient, a second moment per column, a tensor cut across ranks or
    a vector: no row form (row_dims None), and post_by_rows gives the eager stages' result, no
    factor."""
    moment = SecondMoment(kind="second_moment", axis="row")
    ctx = stages.Context(state={}, op_shape=(4, 6))
    assert stages.row_dims([moment], ctx) == (2,)
    assert stages.row_dims([moment, RmsMatch(kind="rms_match", target="unit")], ctx) == (2,)
    assert stages.row_dims([SecondMoment(kind="second_moment", axis="column")], ctx) is None
    assert stages.row_dims([SecondMoment(kind="second_moment", axis="longer")], ctx) is None  # 4 < 6: columns
    assert stages.row_dims([SecondMoment(kind="second_moment", axis="longer")],
                           stages.Context(state={}, op_shape=(6, 4))) == (2,)
    assert stages.row_dims([moment], stages.Context(state={}, op_shape=(4,))) is None
    cut = stages.Context(state={}, op_shape=(4, 6), shard=stages.Shard(((0, 2), (0, 6)), ((0,), ()), None))
    assert stages.row_dims([moment], cut) is None
    gen = torch.Generator().manual_seed(1)
    u, g = torch.randn(1, 4, 6, generator=gen), torch.randn(1, 4, 6, generator=gen)
    chain = [moment, Cautious(kind="cautious")]
    got, factor = fused.post_by_rows(u, chain, stages.Context(state={}, op_shape=(4, 6), gradient=g, fresh=True))
    want = stages.run(u, chain, stages.Context(state={}, op_shape=(4, 6), gradient=g, fresh=True))
    assert factor is None and torch.equal(got, want)


def test_a_checkpoint_resumes_the_fused_step_bit_for_bit():
    """Four fused steps in one go, and two, a state_dict, a fresh fused optimizer on a copy of the
    model that loads it and two more: the same bits in parameters and second moments."""
    models = [tiny_gpt(0), tiny_gpt(0)]
    whole = geomopt.GeomOptimizer(models[0], "normuon", fuse=True)
    first = geomopt.GeomOptimizer(models[1], "normuon", fuse=True)
    for step in range(2):
        _grads(models, step)
        whole.step()
        first.step()
    resumed_model = tiny_gpt(1)
    resumed_model.load_state_dict(models[1].state_dict())
    resumed = geomopt.GeomOptimizer(resumed_model, "normuon", fuse=True)
    resumed.load_state_dict(first.state_dict())
    models = [models[0], resumed_model]
    for step in range(2, 4):
        _grads(models, step)
        whole.step()
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), resumed_model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(_hidden_state(whole), _hidden_state(resumed)))


def test_a_non_finite_gradient_leaves_the_fused_post_stages_untouched():
    models = [tiny_gpt(0)]
    opt = geomopt.GeomOptimizer(models[0], "normuon", fuse=True)
    _grads(models, 0)
    opt.step()
    assert _hidden_state(opt) and all(math.isfinite(v.sum().item()) for v in _hidden_state(opt))
    assert_a_poisoned_step_skips(opt, models)


def test_the_dispatcher_says_which_post_stages_run_by_rows():
    """describe() names the row form per bucket: every normuon bucket under fuse, no adamuon one
    (a per-entry moment), none without fuse."""
    model = tiny_gpt(0)
    said = "fuse: the post-stages by rows"
    normuon = geomopt.GeomOptimizer(model, "normuon", fuse=True)
    hidden = sum(len(progs) for g, progs in zip(normuon.param_groups, normuon.engine.programs) if g["rule"] == "hidden")
    assert hidden and normuon.describe().count(said) == hidden
    assert said not in geomopt.GeomOptimizer(model, "adamuon", fuse=True).describe()
    assert said not in geomopt.GeomOptimizer(model, "normuon").describe()
