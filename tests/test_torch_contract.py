"""What any torch.optim.Optimizer does (PyTorch's generic optimizer tests, common_optimizers /
TestOptimRenewed, are the reference), GeomOptimizer does too: ``lr=`` / ``weight_decay=``
keywords, plain parameter iterables and param-group dicts, deepcopy / pickle, and a clear refusal of
sparse gradients."""

from __future__ import annotations

import math

import pytest
import torch

import geomopt
from geomopt.models import get_model


def model_of(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return get_model(name)


def set_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def group_values(opt) -> dict:
    return {g["rule"]: (g["lr"], g["weight_decay"]) for g in opt.param_groups}


# ------------------------------------------------------------ lr= / weight_decay=

def test_lr_and_weight_decay_keywords_replace_the_spec_defaults_and_rules_keep_their_own():
    model = model_of("gpt")
    base = group_values(geomopt.GeomOptimizer(model, "muon"))
    opt = geomopt.GeomOptimizer(model, "muon", lr=1e-3, weight_decay=0.05)
    spec = geomopt.load_spec("muon")
    got = group_values(opt)
    assert set(got) == set(base)
    for rule in spec.rules:
        if rule.name not in got:
            continue
        lr = rule.lr if rule.lr is not None else 1e-3
        wd = rule.weight_decay if rule.weight_decay is not None else 0.05
        assert got[rule.name] == (lr, wd), rule.name
    # muon's hidden rule follows the keywords, its Adam rules keep their own lr
    assert got["hidden"] == (1e-3, 0.05) and base["hidden"] != got["hidden"]
    assert got["embeddings"][0] == base["embeddings"][0] == 0.001
    assert opt.spec.defaults.lr == 1e-3 and opt.spec.defaults.weight_decay == 0.05


def test_lr_keyword_steps_like_the_spec_with_that_default():
    a, b = model_of("mlp"), model_of("mlp")
    spec = geomopt.load_spec("sgd-momentum").model_dump(exclude_none=True)
    spec["defaults"] = {**spec.get("defaults", {}), "lr": 0.125}
    opt_a = geomopt.GeomOptimizer(a, "sgd-momentum", lr=0.125)
    opt_b = geomopt.GeomOptimizer(b, spec)
    for k in range(3):
        set_grads(a, k)
        set_grads(b, k)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert opt_a.spec_hash == opt_b.spec_hash


@pytest.mark.parametrize("kwargs, words", [
    (dict(lr=0.0), ("lr=", "> 0")), (dict(lr=-1.0), ("lr=", "> 0")), (dict(lr=math.nan), ("lr=", "finite")),
    (dict(lr=math.inf), ("lr=", "finite")), (dict(weight_decay=-0.1), ("weight_decay=", ">= 0")),
    (dict(weight_decay=math.nan), ("weight_decay=", "finite")),
])
def test_bad_lr_or_weight_decay_is_a_value_error_naming_it(kwargs, words):
    with pytest.raises(ValueError) as info:
        geomopt.GeomOptimizer(model_of("mlp"), "adamw", **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("kwargs", [dict(lr="0.1"), dict(weight_decay=True), dict(lr=[0.1])])
def test_lr_or_weight_decay_of_another_type_is_a_type_error_naming_it(kwargs):
    with pytest.raises(TypeError, match=f"{next(iter(kwargs))}="):
        geomopt.GeomOptimizer(model_of("mlp"), "adamw", **kwargs)
