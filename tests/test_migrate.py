"""State migration (load_state_dict with allow_spec_change=True): by parameter name, each tensor
keeps the kinds of state its new rule uses (Adam moments, momentum) where shapes fit, the rest is
reset, and a report says which; torch.optim.AdamW / Adam / Muon states load the same way. Checked
against the torch optimizers themselves: after a switch, the next step equals theirs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.nn import functional as F

import geomopt
from optim_helpers import SPECS, mlp_batch, tiny_mlp, train


def _spec(*rules, name="s") -> dict:
    return {"geomopt": 1, "name": name, "rules": list(rules)}


HIDDEN = {"name": "hidden", "match": {"name": "layers.*.weight"}, "lr": 0.02,
          "direction": {"kind": "polyak", "alpha": 0.1},
          "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}}
REST_ADAM = {"name": "rest", "match": "**", "lr": 0.01, "geometry": {"kind": "adam", "betas": [0.9, 0.95]}}


def _state_of(opt, name):
    for group, plans in zip(opt.param_groups, opt.engine.plans):
        for p, pp in zip(group["params"], plans):
            if pp.name == name:
                return p, opt.state.get(p, {})
    raise KeyError(name)


def test_a_spec_with_more_rules_keeps_what_still_applies():
    model = tiny_mlp(0, depth=3)
    opt = geomopt.GeomOptimizer(model, _spec(HIDDEN, REST_ADAM))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    train(model, opt, 3, mlp_batch, scheduler=sched)
    sd = opt.state_dict()

    # three rules: biases leave adam for a momentum rule, the last layer's weight leaves the spectral rule for adam
    biases = {"name": "biases", "match": "**.bias", "lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.1},
              "geometry": {"kind": "anisotropic", "reference": {"kind": "indicator"}}}
    last = dict(REST_ADAM, name="last", match={"name": "layers.1.weight"})
    twin = copy.deepcopy(model)
    new = geomopt.GeomOptimizer(twin, _spec(biases, last, HIDDEN, REST_ADAM))
    report = new.load_state_dict(sd, allow_spec_change=True)

    assert report.kept["layers.0.weight"] == ["momentum"] and report.reset["layers.0.weight"] == []
    assert report.kept["layers.0.bias"] == [] and report.reset["layers.0.bias"][0].startswith("adam (rule 'biases'")
    assert report.kept["layers.1.weight"] == [] and "rule 'last' uses the direction none" in report.reset["layers.1.weight"][0]
    assert "layers.0.bias: reset adam" in str(report)
    p_old, s_old = _state_of(opt, "layers.0.weight")
    p_new, s_new = _state_of(new, "layers.0.weight")
    assert torch.equal(s_old["d"], s_new["d"]) and s_new["d"].data_ptr() != s_old["d"].data_ptr()
    assert _state_of(new, "layers.0.bias")[1] == {} and _state_of(new, "layers.1.weight")[1] == {}
    # groups by rule name: 'rest' resumes the lr the scheduler left, 'hidden' too (the spec left it alone)
    groups = {g["rule"]: g for g in new.param_groups}
    saved = {g["rule"]: g for g in sd["param_groups"]}
    assert groups["rest"]["lr"] == saved["rest"]["lr"] == pytest.approx(0.01 * 0.125)
    assert groups["hidden"]["lr"] == saved["hidden"]["lr"] and groups["last"]["lr"] == 0.01
    assert groups["biases"]["params"] and groups["biases"]["param_names"] == ["layers.0.bias", "layers.1.bias", "head.bias"]
    # and it trains on
    losses = train(twin, new, 3, mlp_batch, start=3)
    assert all(map(torch.isfinite, map(torch.tensor, losses)))


def _adamw_spec(lr=1e-3, wd=0.01, betas=(0.9, 0.999)):
    return _spec({"name": "all", "match": "**", "lr": lr, "weight_decay": wd,
                  "geometry": {"kind": "adam", "betas": list(betas), "eps": 1e-8}}, name="adamw")


def _loss(model, k):
    x, y = mlp_batch(k)
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("named", [True, False], ids=["named_parameters", "parameters"])
def test_adamw_mid_training_then_a_spec_continues_adamw_exactly(named):
    model = tiny_mlp(1)
    adamw = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=1e-3, weight_decay=0.01)
    for k in range(3):
        adamw.zero_grad()
        _loss(model, k).backward()
        adamw.step()
    twin = copy.deepcopy(model)
    opt = geomopt.GeomOptimizer(twin, _adamw_spec())
    report = opt.load_state_dict(adamw.state_dict(), allow_spec_change=True)
    assert report.source == "torch.optim.Adam(W)"
    assert all(kinds == ["adam"] for kinds in report.kept.values()) and len(report.kept) == 4
    # one more step each on the same batch: geomopt's adam rule continues torch's moments
    for m, o in ((model, adamw), (twin, opt)):
        o.zero_grad()
        _loss(m, 3).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7, msg=name)
    assert _state_of(opt, "layers.0.weight")[1]["adam_step"] == 4


def test_adamw_into_muon_spec_on_a_hugging_face_model_keeps_the_adam_routed_moments():
    transformers = pytest.importorskip("transformers")  # a test dependency: always installed here
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=16))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    adamw = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    for _ in range(2):
        adamw.zero_grad()
        model(ids, labels=ids).loss.backward()
        adamw.step()
    opt = geomopt.GeomOptimizer(model, SPECS / "muon.yaml")
    report = opt.load_state_dict(adamw.state_dict(), allow_spec_change=True)
    rules = {pp.name: pp.rule for pp in opt.plan}
    by_rule = {}
    for name, rule in rules.items():
        by_rule.setdefault(rule, set()).update(report.kept[name] or ["reset"])
    assert by_rule["hidden"] == {"reset"} and by_rule["rest"] == {"adam"} and by_rule["embeddings"] == {"adam"}
    saved = adamw.state_dict()["state"]
    names = [n for g in adamw.state_dict()["param_groups"] for n in g["param_names"]]
    for i, name in enumerate(names):
        p, st = _state_of(opt, name) if name in rules else (None, None)
        if p is None or rules[name] == "hidden":
            continue
        assert torch.equal(st["exp_avg"], saved[i]["exp_avg"]) and st["adam_step"] == 2
    # Conv1D weights ((in, out), read transposed by the spectral rule) got no Adam moments and step fine
    assert "c_attn" in " ".join(n for n in rules if rules[n] == "hidden")
    model(ids, labels=ids).loss.backward()
    opt.step()


def test_muon_momentum_becomes_the_spec_momentum_in_the_operators_layout():
    """torch.optim.Muon's momentum_buffer is the EMA d of a polyak direction (buf.lerp_(g, 1 − β)):
    after the switch, one more step on the same gradient leaves the same buffer in both, also for
    a weight the spec reads transposed (layout: in_out)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4))
    muon = torch.optim.Muon([w], lr=0.02, momentum=0.95)
    grads = [torch.randn(6, 4) for _ in range(3)]
    for g in grads[:2]:
        w.grad = g.clone()
        muon.step()
    for layout in ("out_in", "in_out"):
        twin = torch.nn.Parameter(w.detach().clone())
        spec = _spec({"name": "m", "match": "**", "lr": 0.02, "direction": {"kind": "polyak", "alpha": 0.05},
                      "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "layout": layout,
                                   "approx": {"kind": "svd"}}})
        opt = geomopt.GeomOptimizer([("w", twin)], spec)
        report = opt.load_state_dict(muon.state_dict(), allow_spec_change=True)
        assert report.kept == {"w": ["momentum"]} and report.source == "torch.optim.Muon"
        d = opt.state[twin]["d"]
        expect = muon.state[w]["momentum_buffer"]
        torch.testing.assert_close(d.T if layout == "in_out" else d, expect, rtol=0, atol=0)
        twin.grad = grads[2].clone()
        opt.step()
        d = opt.state[twin]["d"]
        torch.testing.assert_close(d.T if layout == "in_out" else d, expect.lerp(grads[2], 0.05), rtol=0, atol=1e-7)


def test_unsupported_or_unmappable_states_say_what_to_do():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, _spec(HIDDEN, REST_ADAM))
    train(model, opt, 2, mlp_batch)

    other = tiny_mlp(0)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    _loss(other, 0).backward()
    sgd.step()
    with pytest.raises(ValueError, match="torch.optim.SGD .*AdamW, Adam and Muon"):
        opt.load_state_dict(sgd.state_dict(), allow_spec_change=True)

    two_groups = torch.optim.AdamW([{"params": list(other.parameters())[:2]},
                                    {"params": list(other.parameters())[2:], "weight_decay": 0.0}])
    _loss(other, 0).backward()
    two_groups.step()
    with pytest.raises(ValueError, match="2 parameter groups and no parameter names.*named_parameters"):
        opt.load_state_dict(two_groups.state_dict(), allow_spec_change=True)

    bigger = tiny_mlp(0, width=32)
    adam = torch.optim.Adam(bigger.parameters())
    _loss(bigger, 0).backward()
    adam.step()
    report = opt.load_state_dict(adam.state_dict(), allow_spec_change=True, model=bigger)
    # names line up (same architecture), shapes do not: every moment is reset with the shapes said
    assert "saved shape (32,), the tensor is (16,)" in " ".join(report.reset["layers.0.bias"])
    with pytest.raises(ValueError, match="not of a geomopt spec: pass allow_spec_change=True"):
        opt.load_state_dict(adam.state_dict())



def test_refusals_leave_the_optimizer_untouched():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, _spec(HIDDEN, REST_ADAM))
    train(model, opt, 2, mlp_batch)
    snap = {pp.name: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
            for g, plans in zip(opt.param_groups, opt.engine.plans) for p, pp in zip(g["params"], plans)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    other = tiny_mlp(0)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    _loss(other, 0).backward()
    sgd.step()
    two = torch.optim.AdamW([{"params": list(other.parameters())[:2]}, {"params": list(other.parameters())[2:]}])
    two.step()
    for bad in (sgd.state_dict(), two.state_dict()):
        with pytest.raises(ValueError):
            opt.load_state_dict(bad, allow_spec_change=True)
    with pytest.raises(ValueError):
        opt.load_state_dict(torch.optim.Adam(other.parameters()).state_dict())  # no allow_spec_change
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    for g, plans in zip(opt.param_groups, opt.engine.plans):
        for p, pp in zip(g["params"], plans):
            now = opt.state[p]
            assert now.keys() == snap[pp.name].keys()
            assert all(torch.equal(now[k], v) if torch.is_tensor(v) else now[k] == v for k, v in snap[pp.name].items())


def test_the_report_is_logged(caplog):
    model = tiny_mlp(0)
    adam = torch.optim.Adam(model.named_parameters())
    _loss(model, 0).backward()
    adam.step()
    opt = geomopt.GeomOptimizer(model, _spec(HIDDEN, REST_ADAM))
    with caplog.at_level(logging.INFO, logger="geomopt"):
        report = opt.load_state_dict(adam.state_dict(), allow_spec_change=True)
    assert str(report) in caplog.text and "reset adam (rule 'hidden' uses the spectral geometry" in caplog.text


def test_torch_muon_and_adamw_pair_loads_with_two_calls():
    """The usual torch setup, Muon on the hidden matrices and AdamW on the rest: loading one state
    and then the other leaves every tensor with what its own optimizer saved (a torch optimizer's
    state fills the tensors it names and leaves the others alone)."""
    model = tiny_mlp(0)
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if p.ndim == 2 and not n.startswith("head")]
    rest = [(n, p) for n, p in named if (n, p) not in hidden]
    muon = torch.optim.Muon(hidden, lr=0.02, momentum=0.95)
    adamw = torch.optim.AdamW(rest, lr=1e-3)
    for step in range(2):
        muon.zero_grad()
        adamw.zero_grad()
        _loss(model, step).backward()
        muon.step()
        adamw.step()
    assert {n for n, _ in hidden} == {"layers.0.weight"}
    spec = _spec({"name": "hidden", "match": {"name": "layers.*.weight"}, "direction": {"kind": "polyak", "alpha": 0.05},
                  "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}},
                 REST_ADAM)
    opt = geomopt.GeomOptimizer(model, spec)
    first = opt.load_state_dict(muon.state_dict(), allow_spec_change=True)
    second = opt.load_state_dict(adamw.state_dict(), allow_spec_change=True)
    assert set(first.kept) == {n for n, _ in hidden} and set(second.kept) == {n for n, _ in rest}
    for name, p in hidden:
        assert torch.equal(opt.state[p]["d"], muon.state[p]["momentum_buffer"]), name
    for name, p in rest:
        assert torch.equal(opt.state[p]["exp_avg"], adamw.state[p]["exp_avg"]), name
        assert opt.state[p]["adam_step"] == 2
    _loss(model, 3).backward()
    opt.step()
