"""Gradients are checked before anything is written: a gradient of the wrong shape, dtype or
device (a complex one on a real parameter among them), a parameter on the meta device, and a
sparse gradient where the rule is not elementwise SGD are refused at ``step()`` with the tensor's
name, every retry alike, the parameters and the state as they were; elementwise SGD rules step a
sparse gradient as its dense form (as torch.optim.SGD does)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import geomopt
from geomopt.models import get_model


def model_and_opt(spec: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = get_model("gpt").to(dtype)
    return model, geomopt.GeomOptimizer(model, spec)


def set_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def snapshot(model, opt):
    return copy.deepcopy(({n: p.detach() for n, p in model.named_parameters()}, opt.state_dict()))


def assert_same(a, b) -> None:
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert sa["param_groups"] == sb["param_groups"] or str(sa["param_groups"]) == str(sb["param_groups"])
    assert sa["state"].keys() == sb["state"].keys()
    for i, st in sa["state"].items():
        assert st.keys() == sb["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]) if isinstance(v, torch.Tensor) else v == sb["state"][i][k]


def bad_shape(p):
    return torch.randn(p.shape[::-1] if p.dim() > 1 else (p.shape[0] + 1,))


def bad_dtype(p):
    return torch.randn(p.shape, dtype=torch.float64)


def complex_grad(p):
    return torch.randn(p.shape, dtype=torch.complex64)


# the last tensor a step reaches (the model's last parameter, in the last rule's bucket), so a
# check made while stepping would have written every other tensor first
@pytest.mark.parametrize("spec", ["muon", "adamw", "sgd-momentum"])
@pytest.mark.parametrize("make", [bad_shape, bad_dtype, complex_grad], ids=["shape", "dtype", "complex"])
def test_a_mismatched_gradient_is_refused_before_anything_is_written(spec, make):
    model, opt = model_and_opt(spec)
    set_grads(model, 0)
    opt.step()  # state exists
    set_grads(model, 1)
    name, p = list(model.named_parameters())[-1]
    p.grad.data = make(p)  # through .data: autograd's assignment check does not see it
    before = snapshot(model, opt)
    for _ in range(2):  # every retry refused alike
        words = re.escape(f"'{name}'") + ".*" + re.escape(f"gradient of shape {tuple(p.grad.shape)}")
        with pytest.raises(RuntimeError, match=words):
            opt.step()
        assert_same(before, snapshot(model, opt))
        assert opt.pending_step is None


def test_a_model_on_the_meta_device_is_refused_saying_meta():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = geomopt.GeomOptimizer(model, "adamw")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="'0.weight'.*meta device.*materialize"):
        opt.step()


@pytest.mark.parametrize("spec", ["adamw", "sgd-momentum"])
def test_meta_state_is_refused_saying_meta(spec):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = geomopt.GeomOptimizer(model, spec)
    set_grads(model, 0)
    opt.step()
    sd = opt.state_dict()
    meta = dict(sd, state={i: {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                           for i, st in sd["state"].items()})
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="meta device"):
        opt.load_state_dict(meta)
    assert_same(before, snapshot(model, opt))
    with torch.device("meta"):
        on_meta = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="meta device"):
        geomopt.GeomOptimizer(on_meta, spec).load_state_dict(sd)


# ------------------------------------------------------------ sparse gradients

def sparse_of(dense_grad: torch.Tensor) -> torch.Tensor:
    """An uncoalesced sparse tensor whose dense form is ``dense_grad``: each nonzero row split in
    two entries (a quarter and the rest), the other rows absent."""
    rows = torch.nonzero(dense_grad.abs().sum(1)).flatten()
    idx = torch.cat([rows, rows])
    vals = torch.cat([dense_grad[rows] / 4, dense_grad[rows] - dense_grad[rows] / 4])
    return torch.sparse_coo_tensor(idx[None], vals, dense_grad.shape, check_invariants=True)


@pytest.mark.parametrize("direction", [{"kind": "none"}, {"kind": "heavy_ball", "momentum": 0.9, "dampening": 0.1},
                                       {"kind": "heavy_ball", "momentum": 0.9, "nesterov": True}],
                         ids=["plain", "momentum", "nesterov"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_sgd_steps_a_sparse_gradient_as_torch_sgd_does(direction, wd):
    """An embedding's sparse gradient (some rows touched, duplicates uncoalesced) under an SGD rule:
    the same parameters, bit for bit, as the dense gradient under geomopt and as torch.optim.SGD
    from the sparse gradient (float64; geomopt's decay is decoupled, torch's (1 − γλ) form)."""
    spec = {"geomopt": 1, "name": "sgd", "defaults": {"lr": 0.1, "weight_decay": wd},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"}, "direction": direction}]}
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 3, generator=g, dtype=torch.float64)
    ps = [torch.nn.Parameter(x0.clone()) for _ in range(3)]
    sparse_opt = geomopt.GeomOptimizer([("emb", ps[0])], spec)
    dense_opt = geomopt.GeomOptimizer([("emb", ps[1])], spec)
    mom = direction.get("momentum", 0.0)
    ref = torch.optim.SGD([ps[2]], lr=0.1, momentum=mom, dampening=direction.get("dampening", 0.0),
                          nesterov=direction.get("nesterov", False))
    for k in range(6):
        d = torch.zeros(8, 3, dtype=torch.float64)
        rows = torch.randperm(8, generator=g)[:3]
        d[rows] = torch.randn(3, 3, generator=g, dtype=torch.float64)
        ps[0].grad, ps[1].grad, ps[2].grad = sparse_of(d), d.clone(), sparse_of(d)
        sparse_opt.step()
        dense_opt.step()
        with torch.no_grad():
            ps[2].mul_(1 - 0.1 * wd)
        ref.step()
        assert ps[0].grad.is_sparse  # the caller's gradient is left as it was
        assert torch.equal(ps[0], ps[1]), k
        torch.testing.assert_close(ps[0], ps[2], rtol=1e-14, atol=1e-14)
    assert not ps[0].equal(x0)


@pytest.mark.parametrize("spec", ["adamw", "muon"])
def test_a_sparse_gradient_names_the_rule_that_cannot_take_it(spec):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    opt = geomopt.GeomOptimizer(model, spec)
    model(torch.tensor([1, 2, 3])).sum().backward()
    with pytest.raises(RuntimeError, match=r"'0\.weight' \(rule '\w+'\) has a sparse gradient.*elementwise SGD"):
        opt.step()
