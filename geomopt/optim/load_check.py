"""Checks a state dict before :meth:`GeomOptimizer.load_state_dict` writes anything.

A load either installs the whole checkpoint or changes nothing: a refusal halfway (a counter
missing its key after the state was installed, a shape that fails on the next step) would leave
a mix of two runs that nobody can resume from. So every check here runs on the incoming dict
alone, reads the optimizer without writing to it, and raises :class:`CheckpointError` (a
ValueError) naming the tensor or key, what is wrong with it and what to do.

What is checked:

- the layout of the dict: ``state`` a dict of per-parameter dicts, ``param_groups`` a non-empty
  list of dicts whose ``params`` list each index once, every state entry belonging to a group;
  the ``geomopt`` section's spec hash and counters (``skipped``, ``fallbacks``, ``update_sq``);
- the values: state tensors are floating point and finite (momentum, Adam moments, a stage's
  second moment), second moments (``exp_avg_sq``, ``post_v``) are not negative, step counts are
  non-negative integers, a group's ``lr`` is a finite number ≥ 0 (0 is what a warmup or cosine
  schedule reaches; torch accepts it too), ``weight_decay``, ``radius`` and ``alpha`` are finite;
- under the same spec, that the state is this model's: the spec hash covers neither tensor names
  nor shapes, so the groups' rules and ``param_names`` must be this optimizer's, in its order,
  and each state tensor has the shape and dtype its step keeps (the operators' layout, float32
  at least; a STORM iterate ``prev`` like the parameter). A state from another spec or optimizer
  is checked for values only: its names and shapes are what migration reports on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from geomopt.compile.wrappers import strip_names
from geomopt.distributed.executors import is_dtensor
from geomopt.optim import stages as post_stages
from geomopt.optim.state_codec import BLOCK, MOMENTS, SCALE, STORED, scale_shape
from geomopt.optim.migrate import KINDS, VIEW_KEYS
from geomopt.optim.tensors import as_real, local

#: state keys that hold second moments (a mean of squares: never negative)
SECOND_MOMENTS = ("exp_avg_sq", "post_v", "post_g2", "max_exp_avg_sq")
#: state keys that count steps (geomopt's are ints; torch.optim's ``step`` may be a tensor)
STEP_KEYS = ("adam_step", post_stages.STAGE_STEP, "step")
#: the keys of a geomopt param group (a same-spec load installs the saved groups as they are)
GROUP_KEYS = ("rule", "lr", "weight_decay", "radius", "direction", "alpha", "nesterov", "init", "schedule",
              "on_nonfinite", "step")
_FIX = "save it again from a healthy run, or load an earlier checkpoint"


class CheckpointError(ValueError):
    """A state dict that ``GeomOptimizer.load_state_dict`` refuses; raised before anything is
    written, so parameters, optimizer state and param_groups are as they were."""


def check_layout(sd: Any) -> None:
    """The dict's shape (any source): what torch's loader and the migration index into."""
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"an optimizer state dict is a dict with 'state' and 'param_groups', not a "
                              f"{type(sd).__name__}: pass what opt.state_dict() returned")
    for key, kind in (("state", Mapping), ("param_groups", list)):
        if key not in sd:
            raise CheckpointError(f"the state dict has no '{key}' (it has {sorted(map(str, sd))}): it is not an "
                                  f"optimizer's state_dict(), or was cut; {_FIX}")
        if not isinstance(sd[key], kind):
            raise CheckpointError(f"the state dict's '{key}' is a {type(sd[key]).__name__}, not a "
                                  f"{kind.__name__}: {_FIX}")
    if not sd["param_groups"]:
        raise CheckpointError(f"the state dict has no param_groups: {_FIX}")
    seen: set = set()
    for i, g in enumerate(sd["param_groups"]):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise CheckpointError(f"param_groups[{i}] is not a dict with a 'params' list: {_FIX}")
        names = g.get("param_names")
        if names is not None and (not isinstance(names, (list, tuple)) or len(names) != len(g["params"])
                                  or not all(isinstance(n, str) for n in names)):
            raise CheckpointError(f"param_groups[{i}]['param_names'] is not a list of {len(g['params'])} names, "
                                  f"one per entry of its 'params': {_FIX}")
        for pid in g["params"]:
            if pid in seen:
                raise CheckpointError(f"parameter index {pid!r} is listed twice in param_groups: {_FIX}")
            seen.add(pid)
    for pid, entry in sd["state"].items():
        if pid not in seen:
            raise CheckpointError(f"state entry {pid!r} belongs to no parameter group (the groups list "
                                  f"{len(seen)} indices): {_FIX}")
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"state entry {pid!r} is a {type(entry).__name__}, not a dict of state: {_FIX}")


def check_meta(meta: Any) -> None:
    """The ``geomopt`` section (or the hash a torch.distributed.checkpoint's groups carry)."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("spec_hash"), str):
        raise CheckpointError("the state dict's 'geomopt' section has no spec_hash string (nor do its param_groups): "
                              f"it was not saved by GeomOptimizer.state_dict(), or was edited; {_FIX}")
    for key, ok, what in (("spec", lambda v: isinstance(v, str), "the spec's text"),
                          ("spec_groups", lambda v: isinstance(v, list) and all(isinstance(g, Mapping) for g in v),
                           "a list of dicts (one per group)"),
                          ("transposed", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                           "a list of tensor names"),
                          ("world_size", _is_int, "an int"), ("sharded", lambda v: isinstance(v, bool), "a bool"),
                          ("mesh", lambda v: isinstance(v, list), "a list"),
                          ("pending", lambda v: v is None or (
                              isinstance(v, Mapping) and isinstance(v.get("done"), list)
                              and all(isinstance(n, str) for n in v["done"]) and isinstance(v.get("groups"), list)
                              and all(_is_int(i) and i >= 0 for i in v["groups"])),
                           "None or {'done': [tensor names], 'groups': [group indices]} (an interrupted step)")):
        if key in meta and not ok(meta[key]):
            raise CheckpointError(f"geomopt['{key}'] is {_short(meta[key])}, not {what}: {_FIX}")
    counters = meta.get("counters", [])
    if not isinstance(counters, list):
        raise CheckpointError(f"geomopt['counters'] is a {type(counters).__name__}, not a list (one per group): "
                              f"{_FIX}")
    for i, c in enumerate(counters):
        where = f"geomopt['counters'][{i}]"
        if not isinstance(c, Mapping):
            raise CheckpointError(f"{where} is a {type(c).__name__}, not a dict: {_FIX}")
        for key, ok, what in (("skipped", lambda v: _is_int(v) and v >= 0, "an int ≥ 0"),
                              ("fallbacks", lambda v: isinstance(v, torch.Tensor) and v.numel() == 1
                               and not v.is_floating_point(), "a one-element integer tensor"),
                              ("update_sq", lambda v: isinstance(v, torch.Tensor) and v.numel() == 1
                               and v.is_floating_point(), "a one-element float tensor")):
            if key not in c:
                raise CheckpointError(f"{where} has no '{key}' (it has {sorted(c)}): a checkpoint of an older or "
                                      f"edited optimizer; {_FIX}, or drop geomopt['counters'] to restart them")
            if not ok(c[key]):
                raise CheckpointError(f"{where}['{key}'] is {_short(c[key])}, not {what}: {_FIX}")


def check_group_values(groups: list) -> None:
    """A geomopt group's numbers: a NaN lr would turn every parameter into NaN on the next step."""
    for i, g in enumerate(groups):
        where = f"param_groups[{i}] (rule '{g.get('rule', '?')}')"
        if "lr" not in g:
            raise CheckpointError(f"{where} has no 'lr': {_FIX}")
        for key in ("lr", "weight_decay", "radius", "alpha"):
            if key not in g:
                continue
            value = _number(g[key])
            if value is None:
                raise CheckpointError(f"{where}: '{key}' is {_short(g[key])}, not a number: {_FIX}")
            if not math.isfinite(value) or (key == "lr" and value < 0):
                raise CheckpointError(f"{where}: '{key}' is {value}; it must be finite{' and ≥ 0' * (key == 'lr')} "
                                      f"(a diverged run or a scheduler's bad value): set it in the dict, or load an "
                                      f"earlier checkpoint")
        step = _number(g["step"]) if "step" in g else 0  # an int, or a capturable step's device count
        if step is None or isinstance(g["step"], bool) or not math.isfinite(step) or step < 0 or step != int(step):
            raise CheckpointError(f"{where}: 'step' is {_short(g['step'])}, not an int ≥ 0: {_FIX}")


def check_entry(name: str, entry: Mapping, geomopt_keys: bool = True) -> None:
    """One tensor's saved state, any source: floating, finite tensors; non-negative second moments
    and step counts; in geomopt's keys (``geomopt_keys``), Adam's moments and step count present
    together (a partial kind fails on the next step, after the load)."""
    for key, value in entry.items():
        if key in STEP_KEYS:
            step = _number(value)
            if step is None or not math.isfinite(step) or step < 0 or step != int(step):
                raise CheckpointError(f"tensor '{name}': state '{key}' is {_short(value)}, not a step count "
                                      f"(an integer ≥ 0): {_FIX}")
            continue
        if not isinstance(value, torch.Tensor):
            if key in VIEW_KEYS or key in SECOND_MOMENTS or key == "prev" or key == "momentum_buffer":
                raise CheckpointError(f"tensor '{name}': state '{key}' is {_short(value)}, not a tensor: {_FIX}")
            continue
        if value.dtype == torch.uint8 and key in MOMENTS and key + SCALE in entry:  # int8 state: codes
            continue
        if not (value.is_floating_point() or value.is_complex()):  # complex: a complex parameter's state
            raise CheckpointError(f"tensor '{name}': state '{key}' has dtype {value.dtype}, not a floating dtype: "
                                  f"{_FIX}")
        data = as_real(local(value))  # this rank's shard of a DTensor; complex as (re, im)
        if not bool(torch.isfinite(data).all()):
            raise CheckpointError(f"tensor '{name}': state '{key}' holds {int((~torch.isfinite(data)).sum())} "
                                  f"non-finite value(s) (the run had diverged when it was saved): load an earlier "
                                  f"checkpoint")
        if key in SECOND_MOMENTS and bool((data < 0).any()):
            raise CheckpointError(f"tensor '{name}': second moment '{key}' holds {int((data < 0).sum())} negative "
                                  f"value(s) (a mean of squares is ≥ 0; its square root would be NaN): {_FIX}")
    # Adam's moments and step count move together (a stage's post_step also counts stages without
    # state, so it may stand alone)
    for keys in [KINDS["adam"]] if geomopt_keys else []:
        if any(k in entry for k in keys) and not all(k in entry for k in keys):
            raise CheckpointError(f"tensor '{name}': state has {[k for k in keys if k in entry]} without "
                                  f"{[k for k in keys if k not in entry]} (they are kept together): {_FIX}")


def check_same_spec(opt, sd: Mapping, same_rules: bool = True, unnamed=frozenset()) -> None:
    """Under the same spec the saved groups and state are installed as they are: they must be
    this optimizer's groups, tensors (by name, in order) and state shapes and dtypes.
    ``same_rules=False``: a state without names loaded by position across a spec change, whose
    rules may have been renamed. ``unnamed``: names generated for tensors given without one
    (``param.<i>``, on either side), which match any name at their position."""
    groups, saved = opt.param_groups, sd["param_groups"]
    if len(saved) != len(groups):
        raise CheckpointError(f"the state has {len(saved)} parameter group(s), this optimizer has {len(groups)} "
                              f"(rules {[g['rule'] for g in groups]}): it was saved on another model; build the "
                              f"optimizer on the model it was saved from")
    params, plans = [], []
    for i, (g, s, gplans) in enumerate(zip(groups, saved, opt._plans)):
        missing = [k for k in GROUP_KEYS if k not in s]
        if missing:
            raise CheckpointError(f"param_groups[{i}] (rule '{g['rule']}') lacks {missing}: {_FIX}")
        if (same_rules and s["rule"] != g["rule"]) or len(s["params"]) != len(g["params"]):
            raise CheckpointError(
                f"param_groups[{i}] holds {len(s['params'])} tensor(s) of rule '{s['rule']}', this optimizer's "
                f"holds {len(g['params'])} of rule '{g['rule']}': the state was saved on another model; build "
                f"the optimizer on the model it was saved from")
        if "param_names" in s:
            for got, pp in zip(strip_names(s["param_names"]), gplans):
                if got != pp.name and got not in unnamed and pp.name not in unnamed:
                    raise CheckpointError(
                        f"rule '{g['rule']}': the state's tensor '{got}' stands where this optimizer has "
                        f"'{pp.name}': it was saved on another model (the spec hash does not cover names); build "
                        f"the optimizer on the model it was saved from")
        params += g["params"]
        plans += gplans
    index = {pid: k for k, pid in enumerate(pid for s in saved for pid in s["params"])}
    for pid, entry in sd["state"].items():
        p, pp = params[index[pid]], plans[index[pid]]
        check_entry(pp.name, entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and key not in STEP_KEYS:
                _check_tensor(pp, p, key, value)


def _check_tensor(pp, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
    """A state tensor's shape and dtype as this optimizer's step keeps them."""
    shape = tuple(value.shape)
    if key.endswith(SCALE) and key[:-len(SCALE)] in MOMENTS:  # an int8 entry's block scales
        # shaped by the last dim, or one per block of the flattened tensor (as saved before scales had a shape)
        want: Any = scale_shape(tuple(pp.op_shape))
        if shape not in (want, (math.prod(pp.op_shape) // BLOCK,)) or value.dtype != torch.float32:
            raise CheckpointError(f"tensor '{pp.name}': state '{key}' is {value.dtype} {shape}, the block scales of "
                                  f"int8 state are float32 {want}: the state was edited or saved on another model")
        return
    if key == "prev":
        want = tuple(p.shape)
    elif key in VIEW_KEYS:
        want = tuple(p.shape) if is_dtensor(p) else tuple(pp.op_shape)
    elif key in post_stages.STAGE_STATE:  # a statistic: each dim whole, or summed out (1), or per block
        op = tuple(pp.op_shape)
        want = None if len(shape) == len(op) and all(1 <= s <= n for s, n in zip(shape, op)) else f"≤ {op}"
    else:
        want = None  # a key this version does not keep: left as it is
    if want is not None and shape != want:
        raise CheckpointError(f"tensor '{pp.name}' {tuple(p.shape)}: state '{key}' has shape {shape}, this "
                              f"optimizer keeps {want}: the state was saved on another model (or edited); build "
                              f"the optimizer on the model it was saved from")
    dtype = p.dtype if key == "prev" else torch.promote_types(p.dtype, torch.float32)
    if key in MOMENTS and value.dtype == STORED.get(pp.state_dtype):  # kept in the rule's state precision
        return
    if (key == "prev" or key in VIEW_KEYS or key in post_stages.STAGE_STATE) and value.dtype != dtype:
        raise CheckpointError(f"tensor '{pp.name}' ({p.dtype}): state '{key}' is {value.dtype}, this optimizer "
                              f"keeps {dtype}: cast it (e.g. sd['state'][i]['{key}'].to({dtype})) or load into a "
                              f"model of the saved dtype")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any):
    """A real number as a float (a one-element real tensor too); None for anything else."""
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def _short(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"
