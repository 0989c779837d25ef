"""Nothing silent: a wrapped model (torch.compile, DDP, activation checkpointing, FSDP1 names) plans
and checkpoints as the plain one; a rule that matches nothing warns when the optimizer is built; a
catch-all with nothing left to take is not called shadowed (GO103)."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

import geomopt
from geomopt.cli.main import main
from geomopt.compile import compile_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.params import params_from_checkpoint
from geomopt.lint import lint_spec
from geomopt.models import get_model
from lint_fixtures.models import lora_gpt, lora_mlp

# ---------------------------------------------------------------- names through wrappers

# name rules (and a module predicate) per built-in model: each rule owns tensors of the plain model
NAMED = {
    "gpt": ("transformer.h.*.attn.c_attn.weight", "transformer.h.0.**"),
    "mlp": ("layers.0.weight", "head.*"),
}


def _named_spec(model_name: str, module: bool = True) -> dict:
    """Name rules, and (``module``) a module predicate, each owning tensors of the plain model."""
    first, second = NAMED[model_name]
    linear = {"module": "Linear", "ndim": 2} if module else {"ndim": 2}
    return {"geomopt": 1, "name": "named", "rules": [
        {"name": "first", "match": first, "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}}},
        {"name": "second", "match": second, "geometry": {"kind": "adam"}},
        {"name": "linear", "match": linear, "geometry": {"kind": "adam"}, "lr": 0.01},
        {"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}},
    ]}


def _compiled(model):
    return torch.compile(model, backend="eager")


def _checkpointed(model):
    """Every linear layer (and the GPT's blocks) under activation checkpointing's wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear) or type(m).__name__ == "Block")
    return model


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo group for DDP (destroyed afterwards)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    yield
    dist.destroy_process_group()


def _ddp(model):
    return nn.parallel.DistributedDataParallel(model)


def _signature(plan):
    return [(p.name, p.rule, p.role, p.aliases) for p in plan]


@pytest.mark.parametrize("wrap", [_compiled, _checkpointed, _ddp], ids=["compile", "checkpoint", "ddp"])
@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_a_wrapped_model_plans_as_the_plain_one(wrap, model_name, request):
    if wrap is _ddp:
        request.getfixturevalue("process_group")
    for spec in ("muon", _named_spec(model_name)):
        plain = compile_spec(spec, get_model(model_name))
        if isinstance(spec, dict):
            assert {p.rule for p in plain} == {"first", "second", "linear", "rest"}
        wrapped_model = wrap(get_model(model_name))
        names = [n for n, _ in wrapped_model.named_parameters()]
        assert any(s in n for n in names for s in ("_orig_mod.", "module.", "_checkpoint_wrapped_module."))
        wrapped = compile_spec(spec, wrapped_model)
        assert _signature(wrapped) == _signature(plain)
        assert wrapped.params == plain.params and wrapped.frozen == plain.frozen


def test_module_predicates_and_roles_see_the_wrapped_layers():
    """A checkpointed Linear is still a Linear (not a CheckpointWrapper) to a module predicate and to
    role inference, with the same evidence."""
    plain = model_params(get_model("mlp"))[0]
    wrapped = model_params(_checkpointed(get_model("mlp")))[0]
    assert [(p.name, p.modules, p.role) for p in wrapped] == [(p.name, p.modules, p.role) for p in plain]
    assert all("Linear" in p.modules for p in wrapped if p.name.endswith("weight"))


def test_names_read_without_a_model_drop_wrapper_segments(tmp_path, process_group):
    """named_parameters() of a wrapped model, DDP's and a compiled model's state dict (as a checkpoint
    file) and FSDP1's names (built by hand: FSDP1 needs an accelerator) name the plain tensors."""
    model = get_model("gpt")
    plain = [n for n, _ in model.named_parameters()]
    spec = _named_spec("gpt", module=False)  # no module types without a model
    expected = _signature(compile_spec(spec, model.named_parameters()))
    assert _signature(compile_spec(spec, _compiled(model).named_parameters())) == expected
    assert _signature(compile_spec(spec, _ddp(model).named_parameters())) == expected
    fsdp1 = [("_fsdp_wrapped_module." + n.replace("attn.", "attn._fsdp_wrapped_module._fpw_module."), p)
             for n, p in model.named_parameters()]
    assert _signature(compile_spec(spec, fsdp1)) == expected
    for i, wrapped in enumerate((_compiled(model), _ddp(model))):
        path = tmp_path / f"wrapped{i}.pt"
        torch.save(wrapped.state_dict(), path)
        assert [p.name for p in params_from_checkpoint(path)] == plain


def _states_by_name(opt) -> dict:
    return {name: opt.state[p] for g in opt.param_groups for name, p in zip(g["param_names"], g["params"])
            if p in opt.state}


def _assert_same_state(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    for name, entry in saved.items():
        assert loaded[name].keys() == entry.keys(), name
        for key, value in entry.items():
            got = loaded[name][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), (name, key)
            else:
                assert got == value, (name, key)


def _trained_compiled_run():
    """(plain model, GeomOptimizer of muon built on its compiled wrapper after two steps)."""
    torch.manual_seed(0)
    model = get_model("gpt")
    opt = geomopt.GeomOptimizer(_compiled(model), "muon")
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return model, opt


def _plain_copy(model):
    torch.manual_seed(0)
    copy = get_model("gpt")
    copy.load_state_dict(model.state_dict())
    return copy


def test_a_compiled_run_state_loads_into_an_uncompiled_optimizer():
    model, opt = _trained_compiled_run()
    saved = _states_by_name(opt)
    assert len(saved) == len(opt.plan) and all(not n.startswith("_orig_mod") for n in saved)
    sd = opt.state_dict()
    same = geomopt.GeomOptimizer(_plain_copy(model), "muon")
    assert same.load_state_dict(sd) is None
    _assert_same_state(_states_by_name(same), saved)
    # another spec (muon with other values): migration by name keeps every tensor's state
    other_spec = geomopt.load_spec(geomopt.shipped_specs()["muon"])
    other_spec = other_spec.model_copy(update={"defaults": other_spec.defaults.model_copy(update={"lr": 0.03})})
    other = geomopt.GeomOptimizer(_plain_copy(model), other_spec)
    assert other.spec_hash != opt.spec_hash
    report = other.load_state_dict(sd, allow_spec_change=True)
    assert report.dropped == [] and sum(map(bool, report.kept.values())) == len(saved)
    _assert_same_state(_states_by_name(other), saved)


def test_state_named_through_a_wrapper_migrates_by_plain_names():
    """A state whose names carry wrapper segments (a torch optimizer built on a compiled model's
    named_parameters(); a geomopt checkpoint written before names were stripped) finds its tensors."""
    model, opt = _trained_compiled_run()
    saved = _states_by_name(opt)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["param_names"] = ["_orig_mod." + n for n in g["param_names"]]
    sd["geomopt"]["transposed"] = ["_orig_mod." + n for n in sd["geomopt"]["transposed"]]
    sd["geomopt"]["spec_hash"] = "0" * 16
    target = geomopt.GeomOptimizer(_plain_copy(model), "muon")
    report = target.load_state_dict(sd, allow_spec_change=True)
    assert report.dropped == [] and sum(map(bool, report.kept.values())) == len(saved)
    _assert_same_state(_states_by_name(target), saved)

    compiled = _compiled(get_model("mlp"))
    adamw = torch.optim.AdamW(compiled.named_parameters(), lr=1e-3)
    for p in compiled.parameters():
        p.grad = torch.ones_like(p)
    adamw.step()
    opt = geomopt.GeomOptimizer(get_model("mlp"), "adamw")
    report = opt.load_state_dict(adamw.state_dict(), allow_spec_change=True)
    assert report.dropped == [] and all(kept == ["adam"] for kept in report.kept.values())
    assert len(report.kept) == len(list(compiled.parameters()))


def test_one_real_step_through_a_compiled_forward():
    torch.manual_seed(0)
    model = get_model("mlp")
    compiled = _compiled(model)
    opt = geomopt.GeomOptimizer(compiled, _named_spec("mlp"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    assert {p.rule for p in opt.plan} == {"first", "second", "linear", "rest"}
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


# ---------------------------------------------------------------- unused rules warn


TYPO = """geomopt: 1
name: typo
rules:
  - name: hidden
    match: "layerz.*.weight"
    geometry: {kind: spectral, reference: {kind: indicator}}
  - {name: rest, match: "**", geometry: {kind: adam}}
"""


def _unused_warnings(model, spec) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        geomopt.GeomOptimizer(model, spec)
    return [w for w in caught if issubclass(w.category, geomopt.UnusedRuleWarning)]


def test_a_rule_matching_nothing_warns_once_at_construction():
    assert issubclass(geomopt.UnusedRuleWarning, UserWarning)
    (w,) = _unused_warnings(get_model("mlp"), TYPO)
    text = str(w.message)
    assert text.startswith("<string>:5:12: GO102 rule 'hidden'") and "layerz" in text
    assert "fix its match" in text and "disable=GO102" in text
    assert w.filename == __file__  # points at the caller's line
    # a spec given as a dict has no positions: the message names the spec instead
    (w,) = _unused_warnings(get_model("mlp"), yaml.safe_load(TYPO))
    assert str(w.message).startswith("spec 'typo': GO102 rule 'hidden'")


def test_a_suppressed_unused_rule_does_not_warn(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(TYPO.replace('"layerz.*.weight"', '"layerz.*.weight"  # geomopt: disable=GO102'))
    assert _unused_warnings(get_model("mlp"), str(path)) == []


def test_a_rule_idle_for_a_role_the_model_lacks_does_not_warn():
    model = get_model("mlp")
    codes = {(d.code, d.message.split("'")[1]) for d in lint_spec(geomopt.load_spec(
        geomopt.shipped_specs()["muon"]), model_params(model)[0]) if d.code in ("GO102", "GO113")}
    assert codes == {("GO113", "embeddings")}
    assert _unused_warnings(model, "muon") == []


@pytest.mark.parametrize("model_name", ["gpt", "mlp", "cnn"])
def test_shipped_specs_on_builtin_models_do_not_warn(model_name):
    for name in geomopt.shipped_specs():
        assert _unused_warnings(get_model(model_name), name) == [], name


# ---------------------------------------------------------------- roles decided without a trace


class Lookup(nn.Module):
    """A lookup table and an output projection held as bare parameters: only a trace tells them
    from hidden matrices."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))
        self.body = nn.Linear(8, 8)
        self.out = nn.Parameter(torch.randn(16, 8))

    def forward(self, ids):
        return self.body(F.embedding(ids, self.table)) @ self.out.T


def _role_warnings(model, spec, **kwargs) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = geomopt.GeomOptimizer(model, spec, **kwargs)
    return [w for w in caught if issubclass(w.category, geomopt.RolesGuessedWarning)], opt


def test_roles_decided_without_a_trace_warn_once_with_the_reason_and_the_fix():
    assert issubclass(geomopt.RolesGuessedWarning, UserWarning)
    (w,), opt = _role_warnings(Lookup(), "muon")
    text = str(w.message)
    assert "roles of 4 tensor(s) decided without a trace: no example inputs (Lookup has no example_inputs()" in text
    assert "'table' → hidden" in text and "example_inputs=" in text and "roles:" in text
    assert w.filename == __file__  # points at the caller's line
    assert {pp.name: pp.role for pp in opt.plan}["table"] == "hidden"  # what the warning is about
    # traced: the table is an embedding, the projection the head, and nothing warns
    ws, opt = _role_warnings(Lookup(), "muon", example_inputs=torch.zeros(2, 3, dtype=torch.long))
    assert ws == [] and {pp.name: pp.role for pp in opt.plan}["table"] == "embedding"
    assert {pp.name: pp.role for pp in opt.plan}["out"] == "head"


def test_pinned_roles_and_name_only_specs_do_not_warn():
    pinned = {"embedding": ["table"], "head": ["out"], "hidden": ["body.weight"], "bias": ["body.bias"]}
    assert _role_warnings(Lookup(), "muon", roles=pinned)[0] == []
    (w,), _ = _role_warnings(Lookup(), "muon", roles={"embedding": ["table"]})
    assert "roles of 3 tensor(s)" in str(w.message)  # only those left unpinned
    assert _role_warnings(Lookup(), "normalized-sgd")[0] == []  # matches by name: reads no role


def test_roles_guessed_from_names_warn_too():
    (w,), _ = _role_warnings(list(Lookup().named_parameters()), "muon")
    assert "guessed from names and shapes (no model to trace" in str(w.message)


# ---------------------------------------------------------------- GO103 and a catch-all with nothing left


@pytest.mark.parametrize("factory", [lora_gpt, lora_mlp], ids=["gpt", "mlp"])
def test_lora_models_lint_clean_strict_for_shipped_specs(factory):
    params = model_params(factory())[0]
    assert all(".lora_" in p.name for p in params if p.requires_grad)
    for name in geomopt.shipped_specs():
        bad = [d.format() for d in lint_spec(geomopt.load_spec(geomopt.shipped_specs()[name]), params)
               if d.severity in ("error", "warning")]
        assert bad == [], name


def test_lint_strict_cli_on_a_lora_model(capsys):
    assert main(["lint", "muon", "--model", "lint_fixtures.models:lora_gpt", "--strict"]) == 0
    assert "GO103" not in capsys.readouterr().out


def _go103(rules, model) -> list[str]:
    spec = {"geomopt": 1, "name": "t", "rules": [
        {"name": n, "match": m, "geometry": {"kind": "euclidean"}} for n, m in rules]}
    from geomopt.compile.compiler import as_spec

    return [d.message for d in lint_spec(as_spec(spec), model_params(model)[0]) if d.code == "GO103"]


def test_go103_reports_a_rule_below_a_broader_one_and_a_duplicate():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert _go103([("all", "**"), ("exact", "0.weight")], model) == [
        "rule 'exact' is shadowed: all 1 parameters it matches are owned by earlier rule(s) all; move it up or "
        "narrow them"]
    assert len(_go103([("w", "*.weight"), ("rest", "**"), ("again", "*.weight")], model)) == 1
    # partly under a broader rule, partly under a narrower one: still misplaced
    assert len(_go103([("zero", "0.*"), ("ndim", {"ndim": 2}), ("weights", "*.weight")], model)) == 1


def test_go103_spares_a_fallback_after_narrower_rules_that_take_everything():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False))
    assert _go103([("first", "0.weight"), ("second", "1.weight"), ("rest", "**")], model) == []
    assert _go103([("matrices", {"ndim": 2}), ("weights", "*.weight")], model) == []
