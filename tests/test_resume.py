"""state_dict()/load_state_dict(): a run resumed in a NEW PROCESS from a checkpoint is bit-identical
to the uninterrupted run (torch.equal on parameters and every state tensor); the state records the
spec's hash; a different spec is refused with a message saying what differs, unless
``allow_spec_change=True``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import geomopt
from geomopt.optim import spec_hash
from optim_helpers import ROOT, SPECS, gpt_batch, mlp_batch, tiny_gpt, tiny_mlp, train

STORM_SPEC = {
    "geomopt": 1, "name": "storm-ball",
    "rules": [
        {"name": "hidden", "match": {"name": "layers.*.weight", "ndim": 2}, "lr": 0.5,
         "direction": {"kind": "storm"}, "schedule": {"kind": "storm"},
         "geometry": {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 0.05},
                      "approx": {"kind": "svd"}},
         "constraint": {"kind": "frobenius_ball", "radius": 2.0}},
        {"name": "rest", "match": "**", "lr": 0.01, "direction": {"kind": "storm", "alpha": 0.3},
         "geometry": {"kind": "adam", "betas": [0.9, 0.95]}, "weight_decay": 0.1},
    ],
}

# name → (model kind, dtype, spec, closure?, scheduler?, track_gap)
CASES = {
    "muon-gpt-lambdalr": ("gpt", "float32", str(SPECS / "muon.yaml"), False, True, False),
    "scion-gpt-bf16": ("gpt", "bfloat16", str(SPECS / "scion.yaml"), False, False, False),
    "stiefel-mlp": ("mlp", "float32", str(SPECS / "stiefel.yaml"), False, True, False),
    "hyperball-mlp": ("mlp", "float32", str(SPECS / "hyperball.yaml"), False, False, False),
    "prox-frobenius-mlp": ("mlp", "float32", str(SPECS / "prox-muon-frobenius.yaml"), False, False, False),
    "spectral-clip-gpt": ("gpt", "float32", str(SPECS / "spectral-clip.yaml"), False, False, False),
    "storm-mlp-closure-gap": ("mlp", "float32", STORM_SPEC, True, False, True),
}
BEFORE, AFTER = 3, 3
CONSTRAINED = ["stiefel-mlp", "hyperball-mlp", "prox-frobenius-mlp", "spectral-clip-gpt"]
# every case resumes as "build the optimizer, then load the weights and its state"; the constrained
# ones also as "load the weights, then build the optimizer (which projects on init), then load
# its state": a feasible tensor must keep its bits through that projection
RESUMES = list(CASES) + [f"{name}@weights-first" for name in CONSTRAINED]

# The worker runs in a fresh interpreter: rebuild (different init seed, so loading must do all
# the work), load the checkpoint, continue, save.
WORKER = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, {tests!r})
    import geomopt
    from optim_helpers import gpt_batch, mlp_batch, tiny_gpt, tiny_mlp, train
    from test_resume import build, CASES, BEFORE, AFTER

    for name in json.loads(sys.argv[1]):
        case, _, order = name.partition("@")
        ckpt = torch.load(sys.argv[2] + "/" + case + ".pt", weights_only=True)
        if order == "weights-first":
            model, opt, sched, batch_fn, closure = build(case, seed=123, weights=ckpt["model"])
        else:
            model, opt, sched, batch_fn, closure = build(case, seed=123)
            model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        if sched is not None:
            sched.load_state_dict(ckpt["sched"])
        train(model, opt, AFTER, batch_fn, start=BEFORE, closure=closure, scheduler=sched)
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict(), "diag": opt.diagnostics()}},
                   sys.argv[2] + "/" + name + ".out.pt")
''')


def build(name: str, seed: int = 0, weights: dict | None = None):
    """The case's model, optimizer, scheduler, batches and closure flag; ``weights``: a model state
    loaded before the optimizer is built."""
    kind, dtype, spec, closure, scheduled, track_gap = CASES[name]
    dtype = getattr(torch, dtype)
    if kind == "gpt":
        model, batch_fn = tiny_gpt(seed, dtype=dtype), gpt_batch
    else:
        model, batch_fn = tiny_mlp(seed, dtype=dtype, depth=3), lambda k: mlp_batch(k, dtype=dtype)
    if weights is not None:
        model.load_state_dict(weights)
    opt = geomopt.GeomOptimizer(model, spec, track_gap=track_gap)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.3 * k)) if scheduled else None
    return model, opt, sched, batch_fn, closure


def _state_tensors(sd: dict) -> dict:
    out = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            out[(pid, k)] = v
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Uninterrupted runs here; resumed runs in one subprocess for all cases."""
    tmp = tmp_path_factory.mktemp("resume")
    straight = {}
    for name in CASES:
        model, opt, sched, batch_fn, closure = build(name)
        train(model, opt, BEFORE, batch_fn, closure=closure, scheduler=sched)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict() if sched else None}, tmp / f"{name}.pt")
        train(model, opt, AFTER, batch_fn, start=BEFORE, closure=closure, scheduler=sched)
        straight[name] = (model, opt)
    proc = subprocess.run([sys.executable, "-c", WORKER.format(tests=str(ROOT / "tests")), json.dumps(RESUMES),
                           str(tmp)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return straight, {name: torch.load(tmp / f"{name}.out.pt", weights_only=True) for name in RESUMES}


@pytest.mark.parametrize("name", RESUMES)
def test_resume_in_new_process_is_bit_identical(resumed, name):
    straight, out = resumed
    model, opt = straight[name.partition("@")[0]]
    got = out[name]
    for (n, a), b in zip(model.state_dict().items(), got["model"].values()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    mine, theirs = _state_tensors(opt.state_dict()), _state_tensors(got["opt"])
    assert mine.keys() == theirs.keys() and mine
    for key, a in mine.items():
        b = theirs[key]
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and torch.equal(a, b), key
        else:
            assert a == b, key
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in got["opt"]["param_groups"]]
    assert opt.diagnostics() == got["diag"]


def test_bf16_state_stays_float32_through_a_checkpoint():
    model, opt, _, batch_fn, _ = build("scion-gpt-bf16")
    train(model, opt, 2, batch_fn)
    sd = opt.state_dict()
    model2, opt2, _, _, _ = build("scion-gpt-bf16", seed=5)
    opt2.load_state_dict(sd)
    for p in (p for g in opt2.param_groups for p in g["params"]):
        assert p.dtype == torch.bfloat16 and opt2.state[p]["d"].dtype == torch.float32


def test_state_records_the_spec_hash():
    spec = geomopt.load_spec(SPECS / "uscion.yaml")
    opt = geomopt.GeomOptimizer(tiny_mlp(0), spec)
    sd = opt.state_dict()
    assert sd["geomopt"]["spec_hash"] == spec_hash(spec)
    # the hash is of the content, not the spelling
    assert spec_hash(geomopt.parse_spec(geomopt.dump_spec(spec, format="dsl"), format="dsl")) == spec_hash(spec)
    other = spec.model_dump()
    other["defaults"]["lr"] = 0.03
    assert spec_hash(geomopt.compile.as_spec(other)) != spec_hash(spec)


def _two_rules(hidden_lr: float, rest_alpha: float = 0.1) -> dict:
    return {"geomopt": 1, "name": "two",
            "rules": [{"name": "hidden", "match": {"name": "layers.*.weight"}, "lr": hidden_lr,
                       "direction": {"kind": "polyak", "alpha": 0.1},
                       "geometry": {"kind": "spectral", "reference": {"kind": "indicator"},
                                    "approx": {"kind": "newton_schulz"}}},
                      {"name": "rest", "match": "**", "lr": 0.01, "direction": {"kind": "polyak", "alpha": rest_alpha},
                       "geometry": {"kind": "anisotropic", "reference": {"kind": "indicator"}}}]}


def test_loading_under_a_different_spec_is_refused_then_allowed():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, _two_rules(0.02))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    train(model, opt, 2, mlp_batch, scheduler=sched)
    sd = opt.state_dict()
    saved_rest_lr = sd["param_groups"][1]["lr"]
    assert saved_rest_lr == pytest.approx(0.01 * 0.25)

    fresh = geomopt.GeomOptimizer(tiny_mlp(0), _two_rules(0.05))
    before = [p.detach().clone() for p in fresh.param_groups[0]["params"]]
    with pytest.raises(ValueError) as err:
        fresh.load_state_dict(sd)
    text = str(err.value)
    assert "allow_spec_change=True" in text and spec_hash(fresh.spec) in text
    assert "0.02" in text and "0.05" in text and "lr" in text  # says what differs
    assert not fresh.state  # nothing loaded
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.param_groups[0]["params"]))

    fresh.load_state_dict(sd, allow_spec_change=True)
    hidden, rest = fresh.param_groups
    assert hidden["lr"] == 0.05  # the new spec changed it: the new value wins
    assert rest["lr"] == saved_rest_lr  # unchanged by the spec: resumes as the scheduler left it
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["d"], fresh.state[q]["d"])
    # and the same spec loads without the flag
    same = geomopt.GeomOptimizer(tiny_mlp(0), _two_rules(0.02))
    same.load_state_dict(sd)
    assert same.param_groups[1]["lr"] == saved_rest_lr
