"""A refused ``load_state_dict`` changes nothing: the whole incoming state dict is checked
(:mod:`geomopt.optim.persist.load_check`) before anything is written. Each case saves a stepped
optimizer's state (GPT, shipped specs muon and adamw-hybrid), corrupts one thing in a deep copy,
and asserts the load raises a CheckpointError naming the tensor or key, and that parameters,
every state tensor, param_groups and counters are bit for bit what they were."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import geomopt
from geomopt.compile.compiler import as_spec
from geomopt.models import GPT, GPTConfig, get_model
from geomopt.optim import CheckpointError

SPECS = ["muon", "adamw-hybrid"]


def batch(k: int):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def build(spec: str, seed: int = 0, model=None, steps: int = 1):
    torch.manual_seed(seed)
    model = get_model("gpt") if model is None else model
    opt = geomopt.GeomOptimizer(model, spec)
    run(model, opt, 0, steps)
    return model, opt


def run(model, opt, start: int, steps: int) -> None:
    for k in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        model(*batch(k))[1].backward()
        opt.step()


def bits(t: torch.Tensor) -> tuple:
    """A tensor's dtype, shape and bytes (bitwise: -0.0 and 0.0 differ, NaNs compare)."""
    t = t.detach()
    return t.dtype, tuple(t.shape), bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def frozen(value):
    if isinstance(value, torch.Tensor):
        return bits(value)
    if isinstance(value, dict):
        return {k: frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [frozen(v) for v in value]
    return value


def snapshot(opt) -> dict:
    """Everything a load writes: parameters, per-parameter state (by position), param_groups
    (the parameters by identity), counters."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return dict(
        params=[bits(p) for p in params],
        state=[frozen(dict(opt.state[p])) if p in opt.state else None for p in params],
        state_keys=len(opt.state),
        groups=[frozen({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
        group_params=[[id(p) for p in g["params"]] for g in opt.param_groups],
        counters=frozen(opt.engine.counters),
    )


def refused(opt, sd, *needles, **kw) -> str:
    """Load ``sd``: it must raise CheckpointError naming every needle and change nothing."""
    before = snapshot(opt)
    with pytest.raises(CheckpointError) as err:
        opt.load_state_dict(sd, **kw)
    text = str(err.value)
    for needle in needles:
        assert needle in text, (needle, text)
    assert snapshot(opt) == before
    return text


def entry(sd, key: str):
    """(tensor name, state entry) of the first saved tensor whose state holds ``key``."""
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    for i, st in sd["state"].items():
        if key in st:
            return names[i], st
    raise AssertionError(f"no state holds {key}")


def group_of(sd, rule: str) -> dict:
    return next(g for g in sd["param_groups"] if g["rule"] == rule)


@pytest.fixture(params=SPECS)
def stepped(request):
    model, opt = build(request.param)
    opt.shipped = request.param  # the shipped spec's name, to build more optimizers of it
    return opt, opt.state_dict()


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_counters_without_fallbacks(stepped):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    del sd["geomopt"]["counters"][1]["fallbacks"]
    refused(opt, sd, "geomopt['counters'][1]", "'fallbacks'")
    sd = copy.deepcopy(saved)
    sd["geomopt"]["counters"][0]["update_sq"] = 0.5
    refused(opt, sd, "geomopt['counters'][0]['update_sq']")


@pytest.mark.parametrize("key", ["d", "exp_avg", "exp_avg_sq"])
def test_wrong_shape(stepped, key):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, key)
    st[key] = torch.zeros(*st[key].shape, 2)
    refused(opt, sd, f"'{name}'", f"'{key}'", "shape")


@pytest.mark.parametrize("key", ["d", "exp_avg"])
def test_wrong_dtype(stepped, key):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, key)
    st[key] = st[key].double()
    refused(opt, sd, f"'{name}'", f"'{key}'", "torch.float64")
    st[key] = st[key].to(torch.int32)
    refused(opt, sd, f"'{name}'", f"'{key}'", "torch.int32")


@pytest.mark.parametrize("key,bad", [("d", math.nan), ("d", math.inf), ("exp_avg", -math.inf),
                                     ("exp_avg_sq", math.nan)])
def test_non_finite_momentum_or_moments(stepped, key, bad):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, key)
    st[key].view(-1)[3] = bad
    refused(opt, sd, f"'{name}'", f"'{key}'", "non-finite")


def test_negative_second_moment(stepped):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, "exp_avg_sq")
    st["exp_avg_sq"].view(-1)[0] = -1e-3
    refused(opt, sd, f"'{name}'", "'exp_avg_sq'", "negative")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.01, torch.tensor(math.nan), "0.02", None])
def test_bad_lr(stepped, bad):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    group_of(sd, "hidden")["lr"] = bad
    refused(opt, sd, "rule 'hidden'", "'lr'")


def test_bad_step_counts(stepped):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, "adam_step")
    st["adam_step"] = -1
    refused(opt, sd, f"'{name}'", "'adam_step'")
    st["adam_step"] = 1.5
    refused(opt, sd, f"'{name}'", "'adam_step'")
    del st["adam_step"]  # torch's name and form for the count: a bad one is named as given
    for bad in (-1, 1.5, torch.tensor(-1.0), torch.tensor([1.0, 2.0]), torch.tensor(math.nan)):
        st["step"] = bad
        refused(opt, sd, f"'{name}'", "'step'")
    sd = copy.deepcopy(saved)
    group_of(sd, "rest")["step"] = "1"
    refused(opt, sd, "rule 'rest'", "'step'")


def test_another_models_state_under_the_same_spec(stepped):
    """The spec hash does not cover tensor names or shapes: a state saved on a wider or deeper
    GPT under the same spec is refused, not installed."""
    opt, _ = stepped
    for config, needle in ((GPTConfig(n_embd=32), "shape"), (GPTConfig(n_layer=3), "tensor(s)")):
        _, other = build(opt.shipped, model=GPT(config))
        assert other.spec_hash == opt.spec_hash
        refused(opt, copy.deepcopy(other.state_dict()), needle, "model it was saved from")


def test_names_that_are_not_this_models(stepped):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    names = group_of(sd, "hidden")["param_names"]
    names[0], names[1] = names[1], names[0]
    refused(opt, sd, f"'{names[0]}'", f"'{names[1]}'", "another model")


@pytest.mark.parametrize("corrupt,needle", [
    (lambda sd: sd.pop("state"), "'state'"),
    (lambda sd: sd.pop("param_groups"), "'param_groups'"),
    (lambda sd: sd.__setitem__("state", [1, 2]), "'state'"),
    (lambda sd: sd.__setitem__("param_groups", []), "no param_groups"),
    (lambda sd: sd["param_groups"][0].pop("params"), "param_groups[0]"),
    (lambda sd: sd["param_groups"][1]["param_names"].pop(), "param_groups[1]['param_names']"),
    (lambda sd: sd["param_groups"][0].pop("direction"), "'direction'"),
    (lambda sd: sd["param_groups"][0].pop("lr"), "'lr'"),
    (lambda sd: sd["state"].__setitem__(999, {}), "state entry 999"),
    (lambda sd: sd["state"].__setitem__(next(iter(sd["state"])), torch.zeros(3)), "not a dict"),
    (lambda sd: sd["geomopt"].pop("spec_hash"), "spec_hash"),
    (lambda sd: sd["geomopt"].__setitem__("counters", {"skipped": 0}), "geomopt['counters']"),
    (lambda sd: sd["geomopt"]["counters"].__setitem__(0, None), "geomopt['counters'][0]"),
    (lambda sd: sd["geomopt"].__setitem__("spec_groups", "hidden"), "geomopt['spec_groups']"),
    (lambda sd: sd["geomopt"].__setitem__("transposed", [0]), "geomopt['transposed']"),
    (lambda sd: entry(sd, "exp_avg")[1].pop("exp_avg_sq"), "'exp_avg_sq'"),
    (lambda sd: entry(sd, "d")[1].__setitem__("d", [0.0] * 4), "'d'"),
])
def test_malformed_dicts(stepped, corrupt, needle):
    """Missing keys and wrong types: a CheckpointError naming the key, never a bare KeyError or
    AttributeError from halfway through the load."""
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    corrupt(sd)
    refused(opt, sd, needle)


def test_not_a_dict(stepped):
    opt, _ = stepped
    refused(opt, [("state", {})], "not a list")


def test_a_torch_optimizers_state_is_checked_too():
    """Migration (allow_spec_change=True) checks the values it carries over: a NaN AdamW moment
    or a negative second moment is refused before any tensor's state is replaced."""
    model, opt = build("muon")
    torch.manual_seed(0)
    twin = get_model("gpt")
    adamw = torch.optim.AdamW(twin.named_parameters())
    twin(*batch(0))[1].backward()
    adamw.step()
    for key, bad, needle in (("exp_avg", math.nan, "non-finite"), ("exp_avg_sq", -1.0, "negative"),
                             ("step", math.nan, "step count")):
        sd = copy.deepcopy(adamw.state_dict())
        st = sd["state"][5]
        if key == "step":
            st[key] = torch.tensor(bad)
        else:
            st[key].view(-1)[0] = bad
        refused(opt, sd, sd["param_groups"][0]["param_names"][5], f"'{key}'", needle, allow_spec_change=True)


def test_another_optimizers_state_is_a_checkpoint_error(stepped):
    """torch.optim.SGD's momentum is not an average of gradients: refused with the same error
    type as every other refusal, and nothing changes."""
    opt, _ = stepped
    twin = get_model("gpt")
    sgd = torch.optim.SGD(twin.named_parameters(), lr=0.1, momentum=0.9)
    twin(*batch(0))[1].backward()
    sgd.step()
    refused(opt, sgd.state_dict(), "torch.optim.SGD", allow_spec_change=True)


def test_a_valid_state_still_loads_and_resumes_bit_for_bit(stepped):
    """The checks refuse nothing a healthy run saves: a refused load, then the valid one, then two
    more steps match the run that never stopped."""
    opt, _ = stepped
    spec = opt.shipped
    straight, straight_opt = build(spec, steps=3)
    model, first = build(spec, steps=1)
    sd = copy.deepcopy(first.state_dict())
    weights = copy.deepcopy(model.state_dict())

    torch.manual_seed(7)
    resumed = get_model("gpt")
    resumed.load_state_dict(weights)
    opt2 = geomopt.GeomOptimizer(resumed, spec)
    bad = copy.deepcopy(sd)
    del bad["geomopt"]["counters"][0]["fallbacks"]
    refused(opt2, bad, "'fallbacks'")
    assert opt2.load_state_dict(sd) is None
    run(resumed, opt2, 1, 2)
    assert [bits(p) for p in resumed.parameters()] == [bits(p) for p in straight.parameters()]
    got, want = snapshot(opt2), snapshot(straight_opt)
    for key in ("params", "state", "state_keys", "groups", "counters"):
        assert got[key] == want[key], key


def test_hooks_run_once_and_a_tensor_lr_stays_a_tensor(stepped):
    opt, saved = stepped
    calls = {"pre": 0, "post": 0}

    def pre(optimizer, sd):
        calls["pre"] += 1

    def post(optimizer):
        calls["post"] += 1

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(post)
    sd = copy.deepcopy(saved)
    group_of(sd, "hidden")["lr"] = torch.tensor(0.015)
    opt.load_state_dict(sd)
    assert calls == {"pre": 1, "post": 1}
    lr = group_of(opt.state_dict(), "hidden")["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.015)
    assert lr is not group_of(sd, "hidden")["lr"]  # a copy, as torch's loader makes


def test_a_pre_hook_that_breaks_the_dict_is_refused(stepped):
    """What a pre-hook returns is checked like the dict it was given."""
    opt, saved = stepped
    opt.register_load_state_dict_pre_hook(lambda optimizer, sd: {"state": sd["state"]})
    refused(opt, copy.deepcopy(saved), "'param_groups'")


def test_a_pre_hook_may_repair_the_dict_before_it_is_checked(stepped):
    """The layout is checked after the pre-hooks (as torch's loader indexes after them): a hook
    that turns another format into this one loads."""
    opt, saved = stepped
    wrapped = {"legacy": copy.deepcopy(saved)}
    opt.register_load_state_dict_pre_hook(lambda optimizer, sd: sd["legacy"] if "legacy" in sd else None)
    assert opt.load_state_dict(wrapped) is None
    assert snapshot(opt)["state"] == [frozen(dict(st)) if st is not None else None for st in
                                      (saved["state"].get(i) for g in saved["param_groups"] for i in g["params"])]


def test_a_tensor_lr_survives_a_spec_change_unshared():
    """Under a spec change the groups the new spec leaves alone resume as saved: a tensor lr stays
    a tensor and is a copy, not the saved dict's tensor (loading must not alias the checkpoint)."""
    _, opt = build("muon")
    sd = copy.deepcopy(opt.state_dict())
    group_of(sd, "rest")["lr"] = torch.tensor(0.0005)
    _, other = build("adamw-hybrid", steps=0)
    other.load_state_dict(sd, allow_spec_change=True)
    lr = group_of(other.state_dict(), "rest")["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.0005)
    lr.add_(1.0)
    assert group_of(sd, "rest")["lr"].item() == pytest.approx(0.0005)


def spec_message(field: tuple, value) -> str:
    """What validating a spec whose field at ``field`` (a path under the rule ``hidden``) holds
    ``value`` says: the message a checkpoint's group value must repeat."""
    rule: dict = {"name": "hidden", "match": "**", "geometry": {"kind": "euclidean"}}
    node = rule
    for part in field[:-1]:
        node = node.setdefault(part, {"kind": "polyak"} if part == "direction" else {})
    node[field[-1]] = value
    with pytest.raises(geomopt.SpecError) as err:
        as_spec({"geomopt": 1, "name": "x", "rules": [rule]})
    text = str(err.value)
    return text.split(": ", 2)[2].split(", got")[0]  # the message after the position and the field


@pytest.mark.parametrize("key, bad, field", [
    ("radius", -1.0, ("geometry", "radius")),  # the rule would step uphill
    ("radius", 0.0, ("geometry", "radius")),
    ("weight_decay", -5.0, ("weight_decay",)),
    ("alpha", 2.0, ("direction", "alpha")),
    ("alpha", 0.0, ("direction", "alpha")),
    ("nesterov", "yes", ("direction", "nesterov")),
    ("init", "ones", ("direction", "init")),
    ("on_nonfinite", "explode", ("on_nonfinite",)),
    ("lr", -1.0, ("lr",)),
])
def test_a_group_value_is_validated_as_the_spec_field_it_came_from(stepped, key, bad, field):
    """A checkpoint's group values pass the spec's own validators (the same message a spec with
    that value gets), and a refusal names the rule and key and changes nothing."""
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    group_of(sd, "hidden")[key] = bad
    refused(opt, sd, "rule 'hidden'", f"'{key}'", spec_message(field, bad))


@pytest.mark.parametrize("key, bad, needle", [
    ("direction", "magic", "not a direction"),
    ("direction", 3, "not a direction"),
    ("schedule", {"kind": "cosine"}, "'schedule'"),
    ("schedule", None, "no value"),
    ("step", 10 ** 30, "2⁶³"),
    ("step", -1, "outside"),
    ("step", 2.0, "not an int"),
    ("warmup_steps", -3, "greater than or equal to 0"),
    ("warmup_alpha", 0.5, "needs both warmup_steps"),  # without its steps: Polyak's cross-field rule, on 'direction'
    ("rule", 7, "'rule'"),
])
def test_a_groups_kind_schedule_and_count_are_checked(stepped, key, bad, needle):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    group_of(sd, "hidden")[key] = bad
    named = "direction" if key == "warmup_alpha" else key
    refused(opt, sd, "param_groups[0]" if key == "rule" else "rule 'hidden'", f"'{named}'", needle)


def test_a_direction_coefficient_is_validated_by_its_kinds_model():
    spec = {"geomopt": 1, "name": "hb", "rules": [
        {"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
         "direction": {"kind": "heavy_ball", "momentum": 0.9}}]}
    _, opt = build(spec)
    saved = opt.state_dict()
    for key, bad in (("momentum", 1.5), ("momentum", -0.1), ("dampening", 2.0), ("nesterov", 1)):
        sd = copy.deepcopy(saved)
        sd["param_groups"][0][key] = bad
        refused(opt, sd, "rule 'all'", f"'{key}'")
    sd = copy.deepcopy(saved)
    sd["param_groups"][0]["momentum"] = 0.5  # in range: loads, and the step reads it
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("where, bad, needle", [
    ("update_sq", torch.tensor(math.nan), "finite"),
    ("update_sq", torch.tensor(-1.0), "≥ 0"),
    ("fallbacks", torch.tensor(-2), "≥ 0"),
    ("fallbacks", torch.tensor(True), "integer"),
    ("skipped", 2 ** 63, "2⁶³"),
])
def test_counters_are_checked_by_type_and_range(stepped, where, bad, needle):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    sd["geomopt"]["counters"][0][where] = bad
    refused(opt, sd, f"geomopt['counters'][0]['{where}']", needle)


def test_world_size_is_a_count_of_ranks(stepped):
    """A world size is an int ≥ 1 (replicated state, saved unsharded, loads at any world size)."""
    opt, saved = stepped
    for bad in (0, -2, 1.0, "2"):
        sd = copy.deepcopy(saved)
        sd["geomopt"]["world_size"] = bad
        refused(opt, sd, "geomopt['world_size']")


def test_an_unknown_state_key_is_refused(stepped):
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, "d")
    st["momentum_bufer"] = torch.zeros(3)
    refused(opt, sd, f"'{name}'", "'momentum_bufer'", "not a key this optimizer keeps")
    sd = copy.deepcopy(saved)
    name, st = entry(sd, "adam_step")
    st["adam_step"] = 10 ** 30
    refused(opt, sd, f"'{name}'", "'adam_step'", "2⁶³")


def test_a_step_count_may_be_an_int_or_an_integer_tensor(stepped):
    """Adam's count loads as a Python int or a one-element integer tensor (torch keeps its
    ``step`` as a tensor), and the run goes on from it."""
    opt, saved = stepped
    sd = copy.deepcopy(saved)
    name, st = entry(sd, "adam_step")
    st["adam_step"] = torch.tensor(st["adam_step"], dtype=torch.int64)
    opt.load_state_dict(sd)


INT8 = {"geomopt": 1, "name": "int8", "rules": [
    {"name": "hidden", "match": {"role": "hidden"}, "state": "int8", "direction": {"kind": "polyak", "alpha": 0.1},
     "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}},
    {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "state": "int8"}]}


@pytest.fixture(scope="module")
def encoded_stepped():
    """dtype → (an optimizer of INT8's rules in that precision stepped twice, its state dict), built
    once per precision."""
    built: dict = {}

    def get(dtype: str):
        if dtype not in built:
            model, opt = build(dict(INT8, name=dtype, rules=[dict(r, state=dtype) for r in INT8["rules"]]), steps=2)
            built[dtype] = opt, copy.deepcopy(opt.state_dict())
        return built[dtype]

    return get


@pytest.mark.parametrize("dtype, corrupt, key, needle", [
    ("int8", lambda st: st["d_absmax"].view(-1).__setitem__(0, -1.0), "d_absmax", "negative"),
    ("int8", lambda st: st.__setitem__("d", st["d"].float()), "'d'", "uint8 codes"),
    ("int8", lambda st: st.pop("d"), "d_absmax", "no codes"),
    ("int8", lambda st: st.pop("d_absmax"), "'d'", "torch.uint8"),
    ("int8", lambda st: st.__setitem__("d_absmax", st["d_absmax"].reshape(-1)[:1].clone()), "d_absmax",
     "block scales"),
    ("int8", lambda st: st.__setitem__("d_absmax", -1.3), "d_absmax", "not a tensor"),
    ("int8", lambda st: st.__setitem__("d_absmax", None), "d_absmax", "not a tensor"),
    # int8-ec: int8's entries and a correction beside them
    ("int8-ec", lambda st: st.__setitem__("d_ec", st["d_ec"].float()), "d_ec", "uint8 (two 4-bit values to a byte)"),
    ("int8-ec", lambda st: st.__setitem__("d_ec", st["d_ec"].reshape(-1)[:8].clone()), "d_ec", "two to a byte"),
    ("int8-ec", lambda st: (st.pop("d_absmax"), st.pop("d")), "d_ec", "no int8 codes"),
    ("int8-ec", lambda st: st.pop("d"), "d_absmax", "no codes"),
])
def test_int8_state_is_checked_by_its_declared_types_and_ranges(encoded_stepped, dtype, corrupt, key, needle):
    opt, saved = encoded_stepped(dtype)
    sd = copy.deepcopy(saved)
    name, st = entry(sd, "d_absmax")
    corrupt(st)
    refused(opt, sd, f"'{name}'", key, needle)
    opt.load_state_dict(copy.deepcopy(saved))  # the intact one loads


def test_a_direction_changed_in_the_checkpoint_needs_its_coefficients_and_an_optimizer_built_for_it(stepped):
    """A group's direction may differ from the spec's (a user may switch it between steps), with
    the coefficients it reads; a STORM direction needs an optimizer built for it."""
    opt, saved = stepped
    for kind, needle in (("lion", "['beta1', 'beta2']"), ("heavy_ball", "['momentum', 'dampening']"),
                         ("storm", "not built for")):
        sd = copy.deepcopy(saved)
        group_of(sd, "hidden")["direction"] = kind
        refused(opt, sd, "rule 'hidden'", "'direction'", needle)
    sd = copy.deepcopy(saved)
    group_of(sd, "hidden").update(direction="lion", beta1=0.9, beta2=0.99)
    opt.load_state_dict(sd)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.param_groups[0]["direction"] == "lion" and all(bool(torch.isfinite(p).all()) for p in params)
