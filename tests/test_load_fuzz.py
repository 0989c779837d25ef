"""Fuzzing ``load_state_dict``: optimizer state dicts saved by several shipped specs and state
precisions, with values, types, keys, shapes and dtypes mutated, either load and then step to
finite parameters and state, or are refused with a :class:`CheckpointError` naming what was
mutated, leaving parameters and optimizer state bit for bit as they were; never another exception.

CI draws ``GEOMOPT_LOAD_FUZZ`` examples (default 40, a few seconds); ``GEOMOPT_LOAD_FUZZ=5000``
runs many more (hypothesis' seed: ``--hypothesis-seed``).
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import geomopt
from geomopt.optim import CheckpointError
from optim_helpers import gpt_batch, loss_of, tiny_gpt
from test_atomic_step import PRECISION
from test_load_validation import snapshot

N = int(os.environ.get("GEOMOPT_LOAD_FUZZ", "40"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))

#: the specs whose checkpoints are mutated: batched and flat programs, every state precision
SPECS = ["muon", "adamw-hybrid", "sign-descent", "prox-muon-frobenius", "int8", "bfloat16"]
_BASES: dict = {}


def base(spec: str):
    """(optimizer stepped twice, its state dict, the gradients of a third batch by name): built once."""
    if spec not in _BASES:
        model = tiny_gpt(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = geomopt.GeomOptimizer(model, geomopt.parse_spec(PRECISION.format(dtype=spec))
                                        if spec in ("int8", "bfloat16") else spec)
        grads = {}
        for k in range(3):
            model.zero_grad(set_to_none=True)
            loss_of(model, gpt_batch(k)).backward()
            if k < 2:
                opt.step()
            else:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        _BASES[spec] = (opt, copy.deepcopy(opt.state_dict()), grads)
    return _BASES[spec]


#: values a mutation puts anywhere: wrong types, out-of-range and non-finite numbers, tensors of
#: odd dtypes and shapes (magnitudes stay moderate: a spec may set lr = 1e30, which diverges as
#: any such run does)
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([10 ** 30, -(10 ** 30), 2 ** 63, 2 ** 31]),
    st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, 1e-30]),
    st.text(max_size=6), st.sampled_from(["polyak", "none", "heavy_ball", "lion", "storm", "dion", "magic",
                                          "skip", "raise", "off", "explode", "zero", "gradient", "yes"]),
    st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.sampled_from(["kind", "horizon"]),
                                                             st.sampled_from(["constant", "theory", 3, -1])),
    st.sampled_from([torch.tensor(0.5), torch.tensor(-1.0), torch.tensor(math.nan), torch.tensor(3),
                     torch.tensor(-2), torch.tensor(True), torch.zeros(2), torch.tensor(1 + 2j)]),
)
DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int32, torch.int64, torch.bool,
          torch.complex64]


def tensor_mutation(draw, t: torch.Tensor):
    """A tensor like ``t`` with its dtype, shape or values changed."""
    how = draw(st.sampled_from(["dtype", "shape", "values", "scale"]))
    if how == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
        return (t.float() * 100).to(dtype) if dtype in (torch.uint8, torch.int32, torch.int64) else t.to(dtype)
    if how == "shape":
        return torch.zeros(tuple(draw(st.lists(st.integers(0, 5), max_size=3))), dtype=t.dtype)
    if how == "scale":
        return t * draw(st.sampled_from([-1.0, 0.0, 2.0, 1e3]))
    out = t.clone()
    if out.numel():
        flat = out.view(-1)
        i = draw(st.integers(0, flat.numel() - 1))
        if out.dtype == torch.uint8:
            flat[i] = draw(st.integers(0, 255))
        elif out.is_floating_point():
            flat[i] = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 5.0]))
    return out


def nudged(draw, value):
    """A value of the same type moved a little (a number scaled, a bool flipped, a count moved by
    one, a tensor scaled by a positive factor): mostly still valid, so loads that succeed are drawn too."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + draw(st.sampled_from([-1, 1, 7]))
    if isinstance(value, float):
        return value * draw(st.sampled_from([0.5, 0.9, 1.1]))
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value * draw(st.sampled_from([0.5, 1.5]))
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return value + draw(st.sampled_from([-1, 1, 7]))
    return value


def mutate(draw, sd: dict) -> list:
    """One mutation of ``sd`` in place; returns the words a refusal may name it by (the key, the
    group's rule, the tensor)."""
    where = draw(st.sampled_from(["group", "group", "state", "state", "state", "counters", "meta", "drop"]))
    groups, state, meta = sd["param_groups"], sd["state"], sd["geomopt"]
    if not state:  # (an earlier mutation emptied it)
        where = "meta"
    if where == "group":
        g = draw(st.sampled_from(groups))
        key = draw(st.sampled_from(sorted(k for k in g if k not in ("params", "param_names")) + ["extra"]))
        how = draw(st.sampled_from(["drop", "value", "nudge", "nudge"]))
        if how == "drop" and key in g and key not in ("lr", "rule"):
            del g[key]
        elif how == "nudge" and key in g:
            g[key] = nudged(draw, g[key])
        else:
            g[key] = draw(VALUES)
        return [key, f"'{g.get('rule')}'", "param_groups"]
    if where in ("state", "drop"):
        names = {i: n for g in groups for i, n in zip(g["params"], g["param_names"])}
        pid = draw(st.sampled_from(sorted(state)))
        entry = state[pid]
        keys = sorted(entry)
        key = draw(st.sampled_from(keys + ["momentum_bufer", "step"]))
        if where == "drop" and key in entry:
            del entry[key]
        elif isinstance(entry.get(key), torch.Tensor) and draw(st.booleans()):
            entry[key] = tensor_mutation(draw, entry[key])
        elif key in entry and draw(st.booleans()):
            entry[key] = nudged(draw, entry[key])
        else:
            entry[key] = draw(VALUES)
        return [key, names[pid]]
    if where == "counters" and isinstance(meta.get("counters"), list) and meta["counters"] and all(
            isinstance(c, dict) for c in meta["counters"]):
        i = draw(st.integers(0, len(meta["counters"]) - 1))
        key = draw(st.sampled_from(["skipped", "fallbacks", "update_sq"]))
        meta["counters"][i][key] = draw(VALUES)
        return [key, "counters"]
    key = draw(st.sampled_from(["world_size", "sharded", "mesh", "spec_hash", "pending", "transposed",
                                "spec_groups", "counters"]))
    meta[key] = draw(VALUES)
    return [key] + ["hash"] * (key == "spec_hash")  # (a changed hash: "saved under spec … (hash …)")


def finite(opt) -> bool:
    """Parameters and every floating state tensor finite."""
    for g in opt.param_groups:
        for p in g["params"]:
            if not bool(torch.isfinite(p).all()):
                return False
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    return False
    return True


@FUZZ
@given(spec=st.sampled_from(SPECS), data=st.data())
def test_a_mutated_state_dict_loads_and_steps_finitely_or_is_refused_naming_it(spec, data):
    opt0, saved, grads = base(spec)
    opt = copy.deepcopy(opt0)
    sd = copy.deepcopy(saved)
    named: list = []
    for _ in range(data.draw(st.integers(1, 3))):
        named += mutate(data.draw, sd)
    before = snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except CheckpointError as err:
        event("refused")
        text = str(err)
        assert any(word in text for word in named), (named, text)
        assert "Traceback" not in text
        assert snapshot(opt) == before, named
        return
    event("loaded")
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            p.grad = grads[name].clone()
    opt.step()
    assert finite(opt), named
