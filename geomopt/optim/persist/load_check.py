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
from geomopt.optim.persist.codes import BLOCK, scale_shape, side_shape
from geomopt.optim.persist.state_codec import STORED
from geomopt.optim.units.state_keys import (CORRECTION, COUNTS, GROUP_KEYS, KINDS, MOMENTS, PARAM_KEYS, SCALE,
                                            SECOND_MOMENTS, STACKED, STAT_KEYS, VIEW_KEYS, WEIGHT_KEYS, owner_state)
from geomopt.optim.units.compensation import DTYPES, compensated, step_dtype
from geomopt.optim.engine.tensors import as_real, local

#: tensor state that is never negative: the declared second moments, and torch.optim's AMSGrad maximum
NONNEGATIVE = (*SECOND_MOMENTS, "max_exp_avg_sq")
#: state keys that count steps (geomopt's are ints; torch.optim's ``step`` may be a tensor)
STEP_KEYS = (*COUNTS, "step")
#: every key of a tensor's state this optimizer keeps: its stacked state and step counts
KEPT = (*STACKED, *COUNTS, *WEIGHT_KEYS)
FIX = "save it again from a healthy run, or load an earlier checkpoint"


class CheckpointError(ValueError):
    """A state dict that ``GeomOptimizer.load_state_dict`` refuses; raised before anything is
    written, so parameters, optimizer state and param_groups are as they were."""


def check_not_meta(params: list, state: Mapping) -> None:
    """Refuse, before anything is loaded, a state whose tensors are on the meta device (shapes
    without data: a checkpoint written from a model that was never materialized) or a state
    loaded into an optimizer whose parameters are: either way there is nothing to resume."""
    bad = [f"state[{i!r}][{k!r}]" for i, st in state.items() if isinstance(st, Mapping)
           for k, v in st.items() if isinstance(v, torch.Tensor) and v.is_meta]
    if bad:
        more = " …" if len(bad) > 3 else ""
        raise CheckpointError(f"optimizer state {', '.join(bad[:3])}{more} is on the meta device "
                              f"(a shape without data): save the state of a materialized model's optimizer")
    if state and any(p.is_meta for p in params):
        raise CheckpointError("this optimizer's parameters are on the meta device (no data): materialize the "
                              "model (model.to_empty(device=...) and initialize it) and build the optimizer, then "
                              "load its state")


def check_layout(sd: Any) -> None:
    """The dict's shape (any source): what torch's loader and the migration index into."""
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"an optimizer state dict is a dict with 'state' and 'param_groups', not a "
                              f"{type(sd).__name__}: pass what opt.state_dict() returned")
    for key, kind in (("state", Mapping), ("param_groups", list)):
        if key not in sd:
            raise CheckpointError(f"the state dict has no '{key}' (it has {sorted(map(str, sd))}): it is not an "
                                  f"optimizer's state_dict(), or was cut; {FIX}")
        if not isinstance(sd[key], kind):
            raise CheckpointError(f"the state dict's '{key}' is a {type(sd[key]).__name__}, not a "
                                  f"{kind.__name__}: {FIX}")
    if not sd["param_groups"]:
        raise CheckpointError(f"the state dict has no param_groups: {FIX}")
    seen: set = set()
    for i, g in enumerate(sd["param_groups"]):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise CheckpointError(f"param_groups[{i}] is not a dict with a 'params' list: {FIX}")
        names = g.get("param_names")
        if names is not None and (not isinstance(names, (list, tuple)) or len(names) != len(g["params"])
                                  or not all(isinstance(n, str) for n in names)):
            raise CheckpointError(f"param_groups[{i}]['param_names'] is not a list of {len(g['params'])} names, "
                                  f"one per entry of its 'params': {FIX}")
        for pid in g["params"]:
            if pid in seen:
                raise CheckpointError(f"parameter index {pid!r} is listed twice in param_groups: {FIX}")
            seen.add(pid)
    for pid, entry in sd["state"].items():
        if pid not in seen:
            raise CheckpointError(f"state entry {pid!r} belongs to no parameter group (the groups list "
                                  f"{len(seen)} indices): {FIX}")
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"state entry {pid!r} is a {type(entry).__name__}, not a dict of state: {FIX}")


def check_meta(meta: Any) -> None:
    """The ``geomopt`` section (or the hash a torch.distributed.checkpoint's groups carry)."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("spec_hash"), str):
        raise CheckpointError("the state dict's 'geomopt' section has no spec_hash string (nor do its param_groups): "
                              f"it was not saved by GeomOptimizer.state_dict(), or was edited; {FIX}")
    for key, ok, what in (("spec", lambda v: isinstance(v, str), "the spec's text"),
                          ("spec_groups", lambda v: isinstance(v, list) and all(isinstance(g, Mapping) for g in v),
                           "a list of dicts (one per group)"),
                          ("transposed", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                           "a list of tensor names"),
                          ("world_size", lambda v: _is_int(v) and v >= 1, "an int ≥ 1"),
                          ("sharded", lambda v: isinstance(v, bool), "a bool"),
                          ("mesh", lambda v: isinstance(v, list), "a list"),
                          ("pending", lambda v: v is None or (
                              isinstance(v, Mapping) and isinstance(v.get("done"), list)
                              and all(isinstance(n, str) for n in v["done"]) and isinstance(v.get("groups"), list)
                              and all(_is_int(i) and i >= 0 for i in v["groups"])),
                           "None or {'done': [tensor names], 'groups': [group indices]} (an interrupted step)")):
        if key in meta and not ok(meta[key]):
            raise CheckpointError(f"geomopt['{key}'] is {shown(meta[key])}, not {what}: {FIX}")
    counters = meta.get("counters", [])
    if not isinstance(counters, list):
        raise CheckpointError(f"geomopt['counters'] is a {type(counters).__name__}, not a list (one per group): "
                              f"{FIX}")
    for i, c in enumerate(counters):
        where = f"geomopt['counters'][{i}]"
        if not isinstance(c, Mapping):
            raise CheckpointError(f"{where} is a {type(c).__name__}, not a dict: {FIX}")
        for key, ok, what in (("skipped", lambda v: _is_int(v) and count_error(v) is None, "an int in [0, 2⁶³)"),
                              ("fallbacks", lambda v: isinstance(v, torch.Tensor) and v.numel() == 1
                               and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool
                               and count_error(v) is None, "a one-element integer tensor ≥ 0"),
                              ("update_sq", lambda v: isinstance(v, torch.Tensor) and v.numel() == 1
                               and v.is_floating_point() and math.isfinite(v.item()) and v.item() >= 0,
                               "a one-element float tensor, finite and ≥ 0 (a sum of squares)")):
            if key not in c:
                raise CheckpointError(f"{where} has no '{key}' (it has {sorted(c)}): a checkpoint of an older or "
                                      f"edited optimizer; {FIX}, or drop geomopt['counters'] to restart them")
            if not ok(c[key]):
                raise CheckpointError(f"{where}['{key}'] is {shown(c[key])}, not {what}: {FIX}")


#: the largest count a step counter holds: torch keeps counts as int64 tensors
COUNT_MAX = 2 ** 63 - 1


def count_error(value: Any, floats: bool = False):
    """What is wrong with ``value`` as a step count (a Python int, or a one-element integer or
    integral float tensor, as torch's ``step``, in [0, 2⁶³); ``floats``: an integral Python float
    too, as torch's own ``step`` once was); None when it is one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return "not a one-element real tensor"
        number = value.item()
    elif (isinstance(value, int) or (floats and isinstance(value, float))) and not isinstance(value, bool):
        number = value
    else:
        return "not an int"
    if not math.isfinite(number) or number != int(number):
        return "not an integer"
    if not 0 <= int(number) <= COUNT_MAX:
        return "outside [0, 2⁶³ − 1], the range of a step count"
    return None


def check_entry(name: str, entry: Mapping, geomopt_keys: bool = True) -> None:
    """One tensor's saved state, any source: floating, finite tensors; non-negative second moments
    and step counts; in geomopt's keys (``geomopt_keys``), Adam's moments and step count present
    together (a partial kind fails on the next step, after the load)."""
    for key, value in entry.items():
        if key in STEP_KEYS:
            error = count_error(value, floats=key == "step")
            if error is not None:
                raise CheckpointError(f"tensor '{name}': state '{key}' is {shown(value)}, not a step count "
                                      f"(an integer ≥ 0): {error}: {FIX}")
            continue
        if not isinstance(value, torch.Tensor):
            if key in STACKED or key in NONNEGATIVE or key == "momentum_buffer":  # (int8 block scales too)
                raise CheckpointError(f"tensor '{name}': state '{key}' is {shown(value)}, not a tensor: {FIX}")
            continue
        if key in MOMENTS and key + SCALE in entry:  # int8 state: codes (any byte is a code)
            if value.dtype != torch.uint8:
                raise CheckpointError(f"tensor '{name}': state '{key}' is {value.dtype} beside its block scales "
                                      f"'{key + SCALE}': int8 state keeps uint8 codes there: {FIX}")
            continue
        if key.endswith(SCALE) and key[:-len(SCALE)] in MOMENTS and key[:-len(SCALE)] not in entry:
            raise CheckpointError(f"tensor '{name}': state '{key}' (int8 block scales) has no codes "
                                  f"'{key[:-len(SCALE)]}' beside it: {FIX}")
        if key in WEIGHT_KEYS:  # a compensated weight's lost bits: checked against its rule (_check_tensor)
            continue
        moment = key[:-len(CORRECTION)]
        if key.endswith(CORRECTION) and moment in MOMENTS:  # int8-ec's 4-bit corrections (any byte is two)
            if moment + SCALE not in entry:
                raise CheckpointError(f"tensor '{name}': state '{key}' (int8-ec corrections) has no int8 codes "
                                      f"'{moment}' and block scales '{moment + SCALE}' beside it: {FIX}")
            if value.dtype != torch.uint8:
                raise CheckpointError(f"tensor '{name}': state '{key}' is {value.dtype}: int8-ec keeps its "
                                      f"corrections as uint8 (two 4-bit values to a byte): {FIX}")
            continue
        if not (value.is_floating_point() or value.is_complex()):  # complex: a complex parameter's state
            raise CheckpointError(f"tensor '{name}': state '{key}' has dtype {value.dtype}, not a floating dtype: "
                                  f"{FIX}")
        data = as_real(local(value))  # this rank's shard of a DTensor; complex as (re, im)
        if not bool(torch.isfinite(data).all()):
            raise CheckpointError(f"tensor '{name}': state '{key}' holds {int((~torch.isfinite(data)).sum())} "
                                  f"non-finite value(s) (the run had diverged when it was saved): load an earlier "
                                  f"checkpoint")
        if (key in NONNEGATIVE or key.endswith(SCALE)) and bool((data < 0).any()):
            what = "block scales" if key.endswith(SCALE) else "second moment"
            why = "a block's largest magnitude" if key.endswith(SCALE) else "a mean of squares"
            raise CheckpointError(f"tensor '{name}': {what} '{key}' holds {int((data < 0).sum())} negative "
                                  f"value(s) ({why} is ≥ 0): {FIX}")
    # Adam's moments and step count move together (a stage's post_step also counts stages without
    # state, so it may stand alone)
    for keys in [KINDS["adam"]] if geomopt_keys else []:
        if any(k in entry for k in keys) and not all(k in entry for k in keys):
            raise CheckpointError(f"tensor '{name}': state has {[k for k in keys if k in entry]} without "
                                  f"{[k for k in keys if k not in entry]} (they are kept together): {FIX}")


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
    for i, (g, s, gplans) in enumerate(zip(groups, saved, opt.engine.plans)):
        missing = [k for k in GROUP_KEYS if k not in s]
        if missing:
            raise CheckpointError(f"param_groups[{i}] (rule '{g['rule']}') lacks {missing}: {FIX}")
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
        unknown = [k for k in entry if k not in KEPT]
        if unknown:
            raise CheckpointError(f"tensor '{pp.name}': state '{unknown[0]}' is not a key this optimizer keeps "
                                  f"({', '.join(KEPT)}): the state was edited or saved by another optimizer; drop "
                                  f"the key, or load it with allow_spec_change=True to carry over what fits")
        _check_owner(opt, pp, p, entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and key not in STEP_KEYS:
                _check_tensor(pp, p, key, value)


def _check_owner(opt, pp, p: torch.Tensor, entry: Mapping) -> None:
    """State a sharded tensor's matrix owner keeps alone (the kronecker geometry's) is in the entry
    of that rank only: elsewhere it is another rank's state."""
    held = [k for k in owner_state(pp.geometry, is_dtensor(p)) if k in entry]
    rt, executor = opt.engine.rt, opt.engine.executor
    owner = None if rt is None else rt.owners.get(id(p))
    if held and owner is not None and owner != executor.rank:
        raise CheckpointError(f"tensor '{pp.name}': state '{held[0]}' is kept by the rank that owns the tensor's "
                              f"matrix (rank {owner} of the step's process group), and this is rank "
                              f"{executor.rank}: the state dict was saved "
                              f"by another rank; load each rank's own optimizer.state_dict()")


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
    if key in WEIGHT_KEYS:  # a compensated bf16 weight's lost bits: the parameter's shape, the rule's dtype
        kind = DTYPES[pp.compensation] if compensated(pp, p.dtype) else None
        if kind is None or shape != tuple(p.shape) or value.dtype != kind:
            keeps = f"keeps {kind} {tuple(p.shape)}" if kind is not None else "keeps none (no compensation here)"
            raise CheckpointError(f"tensor '{pp.name}' ({p.dtype}): state '{key}' is {value.dtype} {shape}, this "
                                  f"optimizer {keeps}: the state was saved with another compensation or model; load "
                                  f"it with allow_spec_change=True to carry over what fits")
        return
    if key.endswith(CORRECTION) and key[:-len(CORRECTION)] in MOMENTS:  # an int8-ec entry's corrections
        want = side_shape(key, tuple(pp.op_shape))
        if shape != want:
            raise CheckpointError(f"tensor '{pp.name}': state '{key}' has shape {shape}, the corrections of "
                                  f"int8-ec state are uint8 {want} (two to a byte): the state was edited or saved "
                                  f"on another model")
        return
    if key in PARAM_KEYS:
        want = tuple(p.shape)
    elif key in VIEW_KEYS:  # a sharded tensor's: laid out like it, unless its matrix's owner keeps it whole
        sharded = is_dtensor(p)
        want = tuple(p.shape) if sharded and key not in owner_state(pp.geometry, sharded) else tuple(pp.op_shape)
    elif key in STAT_KEYS:  # a statistic: each dim whole, or summed out (1), or per block
        op = tuple(pp.op_shape)
        want = None if len(shape) == len(op) and all(1 <= s <= n for s, n in zip(shape, op)) else f"≤ {op}"
    else:  # a step count (checked above)
        want = None
    if want is not None and shape != want:
        raise CheckpointError(f"tensor '{pp.name}' {tuple(p.shape)}: state '{key}' has shape {shape}, this "
                              f"optimizer keeps {want}: the state was saved on another model (or edited); build "
                              f"the optimizer on the model it was saved from")
    work = step_dtype(pp, p.dtype)
    dtype = work if key in PARAM_KEYS else torch.promote_types(work, torch.float32)
    if key in MOMENTS and value.dtype == STORED.get(pp.state_dtype):  # kept in the rule's state precision
        return
    if (key in PARAM_KEYS or key in VIEW_KEYS or key in STAT_KEYS) and value.dtype != dtype:
        raise CheckpointError(f"tensor '{pp.name}' ({p.dtype}): state '{key}' is {value.dtype}, this optimizer "
                              f"keeps {dtype}: cast it (e.g. sd['state'][i]['{key}'].to({dtype})) or load into a "
                              f"model of the saved dtype")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def as_number(v: Any):
    """A real number as a float (a one-element real tensor too); None for anything else."""
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def shown(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"
