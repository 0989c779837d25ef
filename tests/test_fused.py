"""GeomOptimizer(fuse=True): the elementwise tail compiled by torch.compile (inductor, on the CPU
here) steps as the eager step does, to within float32 rounding of the momentum; a schedule compiles
nothing again; a non-finite gradient leaves every value as it was; the choice is the dispatcher's
and says so."""

from __future__ import annotations

import pytest
import torch
from optim_helpers import tiny_gpt
from test_capturable import _grads  # every model's gradients of one batch (NaN-poisoned on request)

import geomopt

SGD_NESTEROV = {"geomopt": 1, "name": "sgd-nesterov", "defaults": {"lr": 0.05, "weight_decay": 0.1},
                "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
                           "direction": {"kind": "polyak", "alpha": 0.1, "nesterov": True}}]}
SIGN_DECAY = {"geomopt": 1, "name": "sign-decay", "defaults": {"lr": 0.01, "weight_decay": 0.1},
              "rules": [{"name": "all", "match": "**", "geometry": {"kind": "anisotropic",
                                                                     "reference": {"kind": "indicator"}},
                         "direction": {"kind": "polyak", "alpha": 0.1}}]}


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles its own functions (torch's recompile limit is per code object)."""
    torch._dynamo.reset()
    yield


def _pair(spec):
    models = [tiny_gpt(0), tiny_gpt(0)]
    return models, [geomopt.GeomOptimizer(models[0], spec), geomopt.GeomOptimizer(models[1], spec, fuse=True)]


def _gap(a, b) -> float:
    """The largest |difference| over two optimizers' parameters and momenta."""
    gaps = [(p - q).abs().max().item() for p, q in zip(a.param_groups[0]["params"] + a.param_groups[-1]["params"],
                                                       b.param_groups[0]["params"] + b.param_groups[-1]["params"])]
    gaps += [(a.state[p]["d"] - b.state[q]["d"]).abs().max().item()
             for ga, gb in zip(a.param_groups, b.param_groups) for p, q in zip(ga["params"], gb["params"])
             if "d" in a.state[p]]
    return max(gaps)


@pytest.mark.parametrize("spec, tol", [("sign-descent", 1e-6), (SIGN_DECAY, 1e-6), (SGD_NESTEROV, 1e-6),
                                       ("muon", 1e-5)], ids=["sign-descent", "sign-decay", "sgd-nesterov", "muon"])
def test_the_fused_step_tracks_the_eager_step_within_float32_rounding(spec, tol):
    """Five steps under a learning rate that changes every step (the coefficients are graph
    inputs): parameters and momenta stay within a few float32 ulps of the eager step's (inductor
    rounds its lerp as its own code does). muon's Newton–Schulz, eager in both, amplifies an ulp
    of its input u: its bound is ten times wider."""
    models, (eager, fused) = _pair(spec)
    assert any(p.compiled for progs in fused.engine.programs for p in progs)
    assert not any(p.compiled for progs in eager.engine.programs for p in progs)
    for step in range(5):
        _grads(models, step)
        for opt in (eager, fused):
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.9
            opt.step()
        assert _gap(eager, fused) <= tol, step
    moved = max((p - tiny_gpt(0).state_dict()[n]).abs().max().item() for n, p in models[1].named_parameters())
    assert moved > 1e-3  # the steps did something the comparison could miss


def test_a_schedule_compiles_nothing_again():
    """After the first two steps (the first starts the momentum: its own graph), a learning rate
    and a momentum coefficient changed at every step run the same compiled code."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    models, (_, fused) = _pair(SIGN_DECAY)
    models = models[1:]
    for step in range(2):
        _grads(models, step)
        fused.step()
    frames = counters["stats"]["unique_graphs"]
    for step in range(2, 6):
        _grads(models, step)
        fused.param_groups[0]["lr"] *= 0.5
        fused.param_groups[0]["alpha"] = 0.1 + 0.01 * step
        fused.step()
    assert counters["stats"]["unique_graphs"] == frames > 0


@pytest.mark.parametrize("spec", ["sign-descent", "muon"])
def test_a_non_finite_gradient_leaves_the_fused_step_untouched(spec):
    models, (_, fused) = _pair(spec)
    models = models[1:]
    _grads(models, 0)
    fused.step()
    before = [p.detach().clone() for p in models[0].parameters()]
    state = [v.clone() for st in fused.state.values() for v in st.values() if torch.is_tensor(v)]
    _grads(models, 1, poison=True)
    fused.step()
    assert all(torch.equal(a, p) for a, p in zip(before, models[0].parameters()))
    assert all(torch.equal(a, b) for a, b in
               zip(state, [v for st in fused.state.values() for v in st.values() if torch.is_tensor(v)]))
    assert sum(fused.diagnostics()[g["rule"]]["skipped"] for g in fused.param_groups) > 0


def test_the_dispatcher_says_what_is_compiled_and_compiles_capturable_steps_with_the_flag_inside():
    model = tiny_gpt(0)
    text = geomopt.GeomOptimizer(model, "muon", fuse=True).describe()
    assert "batched · in-place · compiled" in text and "fuse: the look-ahead read row by row in one pass" in text
    sign = geomopt.GeomOptimizer(model, "sign-descent", fuse=True).describe()
    assert "flat · foreach · compiled" in sign
    captured = geomopt.GeomOptimizer(model, "sign-descent", fuse=True, capturable=True)
    assert all(p.compiled for progs in captured.engine.programs for p in progs)
    assert "flat · foreach · compiled · check device" in captured.describe()
    assert "(compiled: selected inside the loop, no copy of G)" in captured.describe()
    hidden = geomopt.GeomOptimizer(model, "muon", fuse=True, capturable=True).describe()
    assert "batched · in-place · compiled · direction rows · check device" in hidden
    adam = geomopt.GeomOptimizer(model, "adamw-hybrid", fuse=True)
    assert not any(p.compiled for progs in adam.engine.programs for p in progs if p.variant == "flat")
