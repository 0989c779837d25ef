"""What any torch.optim.Optimizer does (PyTorch's generic optimizer tests, common_optimizers /
TestOptimRenewed, are the reference), GeomOptimizer does too: ``lr=`` / ``weight_decay=``
keywords, plain parameter iterables and param-group dicts, deepcopy / pickle, and a clear refusal of
sparse gradients where the rule is not elementwise SGD (tests/test_gradient_checks.py: the SGD ones)."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch

import geomopt
from geomopt.models import get_model
from geomopt.optim.contract.torch_api import GeneratedNamesWarning


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


def _step_both_and_compare(a, opt_a, b, opt_b, steps: int = 3):
    """Three steps of two optimizers on the same gradients; the models end bit for bit equal."""
    for k in range(steps):
        set_grads(a, k)
        set_grads(b, k)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_lr_keyword_steps_like_the_spec_with_that_default():
    a, b = model_of("mlp"), model_of("mlp")
    spec = geomopt.load_spec("sgd-momentum").model_dump(exclude_none=True)
    spec["defaults"] = {**spec.get("defaults", {}), "lr": 0.125}
    opt_a = geomopt.GeomOptimizer(a, "sgd-momentum", lr=0.125)
    opt_b = geomopt.GeomOptimizer(b, spec)
    _step_both_and_compare(a, opt_a, b, opt_b)
    assert opt_a.spec_hash == opt_b.spec_hash


def test_a_checkpoint_remembers_the_keywords_and_other_keywords_are_a_spec_change():
    model = model_of("mlp")
    opt = geomopt.GeomOptimizer(model, "sgd-momentum", lr=1e-3)
    set_grads(model, 0)
    opt.step()
    sd = opt.state_dict()
    assert "lr: 0.001" in sd["geomopt"]["spec"]
    geomopt.GeomOptimizer(model, "sgd-momentum", lr=1e-3).load_state_dict(sd)  # the same spec: resumes
    other = geomopt.GeomOptimizer(model, "sgd-momentum", lr=2e-3)
    with pytest.raises(ValueError, match="lr: 0.002"):  # the diff shows what changed
        other.load_state_dict(sd)
    other.load_state_dict(sd, allow_spec_change=True)
    assert [g["lr"] for g in other.param_groups] == [2e-3]  # the new value wins, as for an edited spec


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


# ------------------------------------------------------------ model.parameters() and param groups

def routes(opt) -> list:
    return [(g["rule"], g["param_names"]) for g in opt.param_groups]


def test_plain_parameters_are_named_in_order_with_one_warning_that_says_what_to_do():
    model = model_of("mlp")
    with pytest.warns(GeneratedNamesWarning) as caught:
        opt = geomopt.GeomOptimizer(model.parameters(), "adamw-hybrid")
    assert len([w for w in caught if issubclass(w.category, GeneratedNamesWarning)]) == 1
    text = str(caught[0].message)
    assert "model=" in text and "named_parameters()" in text and "guessed" in text
    assert caught[0].filename == __file__  # points at the caller's line
    # the roles guessed from shapes are warned about once too, saying how to give the model
    roles = [str(w.message) for w in caught if issubclass(w.category, geomopt.RolesGuessedWarning)]
    assert len(roles) == 1 and "guessed from names and shapes" in roles[0] and "model=" in roles[0]
    params = list(model.parameters())
    names = {n: p for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    assert names == {f"param.{i}": p for i, p in enumerate(params)}
    # roles guessed from shapes: every matrix (the head too) to the spectral rule, vectors to Adam;
    # with model= the head is known for what it does and goes to Adam
    got = {g["rule"]: {p.ndim for p in g["params"]} for g in opt.param_groups}
    assert got == {"hidden": {2}, "rest": {1}}
    named = dict(routes(geomopt.GeomOptimizer(model.parameters(), "adamw-hybrid", model=model)))
    assert "head.weight" in named["rest"]


def test_plain_parameters_step_like_the_named_optimizer():
    a, b = model_of("mlp"), model_of("mlp")
    with pytest.warns(GeneratedNamesWarning):
        opt_a = geomopt.GeomOptimizer(a.parameters(), "sgd-momentum")
    opt_b = geomopt.GeomOptimizer(b, "sgd-momentum")
    _step_both_and_compare(a, opt_a, b, opt_b)


def test_model_keyword_names_plain_parameters_by_identity_and_routes_like_the_model(recwarn):
    model = model_of("gpt")
    opt = geomopt.GeomOptimizer(model.parameters(), "muon", model=model)
    assert not [w for w in recwarn if issubclass(w.category, GeneratedNamesWarning)]
    assert routes(opt) == routes(geomopt.GeomOptimizer(model, "muon"))
    assert {g["rule"] for g in opt.param_groups} >= {"embeddings", "head", "hidden"}  # roles from the model


def test_param_group_dicts_cover_their_tensors_only():
    model = model_of("gpt")
    blocks = list(model.transformer.h.parameters())
    opt = geomopt.GeomOptimizer([{"params": blocks}, {"params": model.lm_head.parameters()}], "muon", model=model)
    given = {id(p) for p in blocks} | {id(p) for p in model.lm_head.parameters()}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == given
    names = dict(model.named_parameters())
    for g in opt.param_groups:
        assert all(names[n] is p for n, p in zip(g["param_names"], g["params"]))
    assert "lm_head.weight" in dict(routes(opt))["head"]


def test_param_group_dicts_without_model_get_generated_names_in_torch_order():
    model = model_of("mlp")
    first, second = list(model.layers.parameters()), list(model.head.parameters())
    with pytest.warns(GeneratedNamesWarning):
        opt = geomopt.GeomOptimizer([{"params": first}, {"params": second}], "adamw")
    names = {n: p for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    assert names == {f"param.{i}": p for i, p in enumerate(first + second)}


def test_param_group_dicts_of_named_pairs_keep_their_names_without_a_warning(recwarn):
    model = model_of("mlp")
    opt = geomopt.GeomOptimizer([{"params": list(model.named_parameters())}], "adamw")
    assert not [w for w in recwarn if issubclass(w.category, GeneratedNamesWarning)]
    assert {n for g in opt.param_groups for n in g["param_names"]} == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("key", ["lr", "weight_decay", "betas"])
def test_per_group_options_are_refused_saying_where_they_go(key):
    model = model_of("mlp")
    with pytest.raises(ValueError) as info:
        geomopt.GeomOptimizer([{"params": list(model.layers.parameters())},
                               {"params": list(model.head.parameters()), key: 0.1}], "adamw", model=model)
    text = str(info.value)
    assert "param group 1" in text and repr(key) in text and "rule" in text


def test_bad_parameter_inputs_are_clear_errors():
    model, other = model_of("mlp"), model_of("mlp", seed=1)
    with pytest.raises(ValueError, match="not a parameter of model="):
        geomopt.GeomOptimizer(other.parameters(), "adamw", model=model)
    with pytest.raises(TypeError, match="model= names"):
        geomopt.GeomOptimizer(model, "adamw", model=model)
    with pytest.raises(TypeError, match="mix"):
        geomopt.GeomOptimizer([next(model.parameters()), {"params": []}], "adamw")
    with pytest.raises(ValueError, match="earlier group"):
        ps = list(model.parameters())
        geomopt.GeomOptimizer([{"params": ps}, {"params": ps[:1]}], "adamw", model=model)
    with pytest.raises(ValueError, match="no 'params'"):
        geomopt.GeomOptimizer([{"lr": 0.1}], "adamw", model=model)


# ------------------------------------------------------------ deepcopy, pickle, torch.save

def trained(spec: str, model_name: str):
    """A model and its optimizer two steps in (state exists), with an LR scheduler attached
    (which patches the optimizer's step: the copy must not call the original's)."""
    model = model_of(model_name)
    opt = geomopt.GeomOptimizer(model, spec)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for k in range(2):
        set_grads(model, k)
        opt.step()
        sched.step()
    return model, opt


def round_trips(model, opt) -> dict:
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    return {"deepcopy": copy.deepcopy((model, opt)), "pickle": pickle.loads(pickle.dumps((model, opt))),
            "torch.save": torch.load(buf, weights_only=False)}


@pytest.mark.parametrize("spec", ["muon", "adamw", "sgd-momentum", "adamw-hybrid"])
@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_a_copied_or_unpickled_optimizer_steps_bit_for_bit_like_the_original(spec, model_name):
    model, opt = trained(spec, model_name)
    copies = round_trips(model, opt)
    for how, (m, o) in copies.items():
        assert o.param_groups[0]["params"][0] is not opt.param_groups[0]["params"][0], how
        assert {id(p) for g in o.param_groups for p in g["params"]} <= {id(p) for p in m.parameters()}, how
        assert o.spec == opt.spec and o.plan.spec_name == opt.plan.spec_name, how
    before = [p.detach().clone() for p in model.parameters()]
    for k in range(2, 5):
        for m, o in [(model, opt), *copies.values()]:
            set_grads(m, k)
            o.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for how, (m, o) in copies.items():
        for (name, a), b in zip(model.named_parameters(), m.parameters()):
            assert torch.equal(a, b), (how, name)
        assert [g["step"] for g in o.param_groups] == [g["step"] for g in opt.param_groups], how


def test_the_original_is_untouched_by_stepping_its_copy():
    model, opt = trained("muon", "mlp")
    params = [p.detach().clone() for p in model.parameters()]
    state = {n: {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for n, p in model.named_parameters()}
    m, o = copy.deepcopy((model, opt))
    set_grads(m, 7)
    o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for n, p in model.named_parameters():
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[n].items()), n
    assert not all(torch.equal(a, b) for a, b in zip(params, m.parameters()))


def test_pickled_state_entries_own_their_memory():
    """Batched steps keep a bucket's state stacked, each tensor's entry a view of its row; pickle
    would write the whole stack once per view. Unpickled, each entry holds its own values only."""
    model, opt = trained("sgd-momentum", "gpt")
    views = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v._base is not None]
    assert views  # what makes the test meaningful: stacked state exists
    _, o = pickle.loads(pickle.dumps((model, opt)))
    for st in o.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k


# ------------------------------------------------------------ sparse gradients

def snapshot(model, opt) -> tuple:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
             for n, p in model.named_parameters()}
    return params, state, [g["step"] for g in opt.param_groups]


def assert_same(a: tuple, b: tuple) -> None:
    (pa, sa, ga), (pb, sb, gb) = a, b
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    assert sa.keys() == sb.keys() and ga == gb
    for n in sa:
        assert sa[n].keys() == sb[n].keys(), n
        for k in sa[n]:
            x, y = sa[n][k], sb[n][k]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (n, k)


@pytest.mark.parametrize("spec", ["muon", "adamw", "adamw-hybrid"])
def test_a_sparse_gradient_is_refused_naming_the_tensor_before_anything_is_written(spec):
    model = model_of("gpt")
    opt = geomopt.GeomOptimizer(model, spec)
    set_grads(model, 0)
    opt.step()  # dense: state exists (momentum, moments) that a sparse step would have to update
    model.transformer.wte.sparse = True
    idx = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # refused every time, the state as it was
        opt.zero_grad()
        model(idx, idx)[1].backward()
        assert model.transformer.wte.weight.grad.is_sparse
        before = snapshot(model, opt)
        with pytest.raises(RuntimeError) as info:
            opt.step()
        text = str(info.value)
        assert "'transformer.wte.weight'" in text and "does not support sparse gradients" in text
        assert_same(before, snapshot(model, opt))


def test_a_sparse_gradient_on_the_first_step_is_refused_too():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    opt = geomopt.GeomOptimizer(model, "adamw")
    model(torch.tensor([1, 2, 3])).sum().backward()
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"'0.weight' \(rule '\w+'\) has a sparse gradient"):
        opt.step()
    assert_same(before, snapshot(model, opt))
