"""Checkpoints: ``state_dict`` with what the spec set (hash, text, per-group values, counters),
``load_state_dict`` that resumes bit for bit under the same spec and carries state over by name
under another (:mod:`geomopt.optim.persist.migrate`), refusing what cannot load with what to do."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Optional

import torch

from geomopt.compile.wrappers import strip, unwrap
from geomopt.distributed.executors import is_dtensor
from geomopt.optim.engine.atomic import PendingStep
from geomopt.optim.persist.group_check import check_built_for, check_group_values
from geomopt.optim.persist.load_check import (CheckpointError, check_entry, check_layout, check_meta, check_not_meta,
                                              check_same_spec)
from geomopt.optim.persist.migrate import MigrationReport, migrate_state, saved_names, source_of, translate
from geomopt.optim.engine.engine import Owner, copy_counters, copy_value
from geomopt.optim.units.state_keys import COUNTS, direction_keys
from geomopt.optim.engine.tensors import count_tensor
from geomopt.spec.model import Spec
from geomopt.spec.printers import dump_spec

log = logging.getLogger("geomopt")


def spec_hash(spec: Spec) -> str:
    """Content hash of a spec (independent of spelling, comments and file format)."""
    return hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Loaded:
    """What a load installs, built before anything is written: torch's ``state`` and the groups
    (``replace``: installed as new groups; else written into the optimizer's, a migration), the
    counters (None: kept), the interrupted step, and a migration's report."""

    state: dict
    groups: list
    counters: Optional[list]
    pending: Optional[PendingStep]
    report: Optional[MigrationReport] = None
    replace: bool = True


def saved_meta(opt: Owner) -> dict:
    """What a state dict saves beside torch's (``"geomopt"``): the spec and its hash, the layout it
    was saved on, the counters, what the spec set per group, transposed tensors, an interrupted
    step and the names made up for unnamed tensors. Adam's step count is saved as it is kept, the
    int64 tensor ``adam_step`` (:data:`ADAM_STEP`)."""
    engine = opt.engine
    return dict(
        spec_hash=opt.spec_hash, spec=dump_spec(opt.spec, "yaml"),
        world_size=engine.executor.world, sharded=engine.options.sharded, mesh=mesh_signature(opt),
        counters=[copy_counters(c) for c in engine.counters],
        spec_groups=[dict(g) for g in engine.spec_groups],
        transposed=[pp.name for plans in engine.plans for pp in plans if pp.transpose],
        pending=None if engine.pending is None else engine.pending.to_dict(),
        generated_names=sorted(engine.generated_names),
    )


def mesh_signature(opt: Owner) -> list:
    """The meshes and placements of the sharded parameters ("2x2 (Replicate(), Shard(dim=0))" …)."""
    return sorted({"x".join(map(str, p.device_mesh.shape)) + f" {tuple(p.placements)}"
                   for g in opt.param_groups for p in g["params"] if is_dtensor(p)})

def load(opt: Owner, state_dict: dict, *, allow_spec_change: bool = False, model=None) -> Loaded:
    """Load a checkpoint; refuses one saved under a different spec (saying what differs)
    unless ``allow_spec_change=True``.

    Under the same spec the state resumes as torch does, bit for bit. Under another spec it
    is carried over by parameter name (:mod:`geomopt.optim.persist.migrate`): each tensor keeps the
    kinds of state (Adam moments, momentum) its new rule uses where the shapes still fit, the
    rest is reset, and the returned :class:`MigrationReport` (also logged) says which. Groups
    are matched by rule name: a value the new spec sets differently (lr, weight_decay, radius,
    direction, …) follows the new spec; a value it leaves alone resumes as saved (e.g. an lr
    a scheduler changed). The ``state_dict()`` of ``torch.optim.AdamW``, ``Adam`` and ``Muon``
    loads the same way (``allow_spec_change=True``); ``model``: the model that optimizer was
    built on, when it was given ``model.parameters()`` (no names) and is not this optimizer's
    model. A torch optimizer's state fills the tensors it names and leaves the others' state as
    it is, so a Muon + AdamW pair loads with two calls, one per optimizer.

    The whole dict is checked before anything is written (:mod:`geomopt.optim.persist.load_check`):
    a refused load raises :class:`CheckpointError` (a ValueError) naming the tensor or key,
    and leaves parameters, state, param_groups and counters bit for bit as they were: this
    returns what to install (:class:`Loaded`), and the optimizer installs it.
    ``state_dict``: after the optimizer's load pre-hooks."""
    engine = opt.engine
    check_layout(state_dict)  # after the hooks: one may turn another format into this one
    check_not_meta([p for g in opt.param_groups for p in g["params"]], state_dict["state"])
    try:
        source = source_of(state_dict)
    except ValueError as err:  # another optimizer's state (torch.optim.SGD, …)
        raise CheckpointError(str(err)) from None
    meta = state_dict.get("geomopt")
    if source == "geomopt":  # torch's step tensors (state_dict()) or ints (older checkpoints)
        state_dict = dict(state_dict, state={i: import_steps(st) if isinstance(st, Mapping) else st
                                             for i, st in state_dict["state"].items()})
    if source != "geomopt":
        if not allow_spec_change:
            raise CheckpointError(
                f"this is the state of {'torch.optim.Muon' if source == 'muon' else 'torch.optim.Adam(W)'}, "
                f"not of a geomopt spec: pass allow_spec_change=True to carry its state over by parameter name "
                f"(load_state_dict returns what was kept and reset)")
        return _migrate(opt, state_dict, source, None, model)
    if meta is None:
        # torch.distributed.checkpoint keeps only "state" and "param_groups": the groups carry the hash
        meta = dict(spec_hash=state_dict["param_groups"][0].get("spec_hash"))
    check_meta(meta)
    check_group_values(state_dict["param_groups"])
    if meta["spec_hash"] != opt.spec_hash and not allow_spec_change:
        if isinstance(meta.get("spec"), str):
            diff = difflib.unified_diff(meta["spec"].splitlines(), dump_spec(opt.spec, "yaml").splitlines(),
                                        "saved spec", "current spec", lineterm="", n=1)
            saved = f"'{spec_name(meta['spec'])}' (hash {meta['spec_hash']})"
            what = "; what differs:\n" + "\n".join(list(diff)[:40])
        else:
            saved, what = f"hash {meta['spec_hash']}", ""
        raise CheckpointError(
            f"optimizer state was saved under spec {saved}, this optimizer runs '{opt.spec.name}' "
            f"(hash {opt.spec_hash}){what}\npass allow_spec_change=True to carry the state over by "
            f"parameter name")
    saved_mesh = meta.get("mesh", mesh_signature(opt))
    if (meta.get("sharded") or engine.options.sharded) and (meta.get("world_size", engine.executor.world)
                                                     != engine.executor.world or saved_mesh != mesh_signature(opt)):
        where = f"{meta.get('world_size', '?')} rank(s)" + (f" (mesh {', '.join(saved_mesh)})"
                                                            if saved_mesh else "")
        here = f"{engine.executor.world}" + (f" (mesh {', '.join(mesh_signature(opt))})"
                                             if mesh_signature(opt) else "")
        raise CheckpointError(
            f"this optimizer state was saved {'sharded over' if meta.get('sharded') else 'on'} {where} and this "
            f"run has {here}: sharded state (FSDP2, HSDP, TP) loads only on the mesh it was saved on. Save and "
            f"load with torch.distributed.checkpoint (get_state_dict / set_state_dict), which reshards")
    if meta["spec_hash"] != opt.spec_hash and all("param_names" in g for g in state_dict["param_groups"]):
        return _migrate(opt, state_dict, source, meta, model)
    # names are optional, as in torch: generated ones (param.<i>, either side) match by position
    check_same_spec(opt, state_dict, same_rules=meta["spec_hash"] == opt.spec_hash,
                    unnamed=set(engine.generated_names) | set(meta.get("generated_names", ())))
    check_built_for(opt, state_dict["param_groups"])
    # everything is checked: build, then install at once (torch's loader is not called: it would
    # run the pre-hooks a second time, and it casts floating state to the parameter's dtype,
    # where geomopt keeps float32 state for bf16 parameters)
    groups = copy.deepcopy(state_dict["param_groups"])  # a tensor lr stays a tensor, as in torch
    saved_ids = [i for g in groups for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    state: defaultdict = defaultdict(dict)
    for pid, p in zip(saved_ids, params):
        saved = state_dict["state"].get(pid)
        if saved is not None:  # counts stay on the CPU, as torch keeps step (a capturable step's: the device)
            state[p] = {k: to_device(v, "cpu" if k in COUNTS and not engine.options.capturable else p.device)
                        for k, v in saved.items()}
    for group, new in zip(opt.param_groups, groups):
        new["params"] = group["params"]
        new["param_names"] = group.get("param_names")  # this optimizer's names: its plans' (they route)
        new["spec_hash"] = opt.spec_hash
        for key in direction_keys():  # a checkpoint from before groups held them: the spec's values
            if key in group:
                new.setdefault(key, copy_value(group[key]))
    if opt.spec_hash != meta["spec_hash"]:
        old = meta.get("spec_groups") or [{}] * len(groups)
        for group, was, now in zip(groups, old, engine.spec_groups):
            follow_spec(group, was, now)
    counters = meta.get("counters", [])
    return Loaded(state, groups, [copy_counters(c) for c in counters] if len(counters) == len(engine.counters)
                  else None, restored_pending(meta.get("pending"), opt.param_groups))

def follow_spec(group: dict, was: dict, now: dict) -> None:
    """After a spec change: the group values the new spec sets differently follow it."""
    for key in now:
        if key not in was or was[key] != now[key]:
            group[key] = copy_value(now[key])

def _migrate(opt: Owner, state_dict: dict, source: str, meta: Optional[dict], model) -> Loaded:
    """Carry a state over by parameter name (:mod:`geomopt.optim.persist.migrate`); everything is
    built first and installed at the end, so a failure leaves the optimizer as it was."""
    if model is not None:
        named = [(strip(n), q) for n, q in unwrap(model).named_parameters()]
        order = ([n for n, _ in named], [n for n, q in named if q.requires_grad])
    else:
        order = opt.engine.order
    try:
        names = saved_names(state_dict, *order)
    except ValueError as err:  # entries that cannot be told apart by name
        raise CheckpointError(str(err)) from None
    renamed = dict(zip((n for g in state_dict["param_groups"] for n in g.get("param_names", ())), names))
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for name, i in zip(names, ids):
        if i in state_dict["state"]:
            check_entry(name, state_dict["state"][i], source == "geomopt")
    saved = {name: translate(state_dict["state"][i], source) for name, i in zip(names, ids)
             if i in state_dict["state"]}
    groups = [dict(g) for g in opt.param_groups]
    counters = list(opt.engine.counters)
    if meta is not None:  # a geomopt checkpoint: groups and counters follow their rule's name
        by_rule = {g.get("rule"): i for i, g in enumerate(state_dict["param_groups"])}
        spec_groups = meta.get("spec_groups") or [{}] * len(state_dict["param_groups"])
        for k, (group, now) in enumerate(zip(groups, opt.engine.spec_groups)):
            i = by_rule.get(group["rule"])
            if i is None:
                continue
            kept = {key: copy_value(v) for key, v in state_dict["param_groups"][i].items()
                    if key not in ("params", "param_names", "spec_hash")}
            groups[k] = dict(group, **kept)
            follow_spec(groups[k], spec_groups[i], now)
            if len(meta.get("counters", [])) == len(state_dict["param_groups"]):
                counters[k] = copy_counters(meta["counters"][i])
    targets = [(pp.name, p, pp, group["direction"])
               for group, plans in zip(groups, opt.engine.plans) for p, pp in zip(group["params"], plans)]
    transposed = ({renamed.get(n, strip(n)) for n in meta["transposed"]}
                  if meta is not None and "transposed" in meta else None)
    state, report = migrate_state(saved, targets, source, transposed)
    if meta is None:
        # a torch optimizer's state covers the tensors it optimized: the others keep what they
        # hold, so torch.optim.Muon's state and then AdamW's (the usual pair) load one after the other
        state = {**{p: st for name, p, _, _ in targets if name not in saved and (st := opt.state.get(p))},
                 **state}
    log.info("%s", report)
    # a carried-over state starts afresh: no interrupted step
    return Loaded(state, groups, counters, None, report, replace=False)


#: Adam's step count, kept and saved as a 0-dim int64 CPU tensor (:func:`~geomopt.optim.engine.tensors.count_tensor`:
#: exact at any count; the host reads it for the bias corrections 1 − βᵗ without waiting on a
#: device). Not under torch's name ``step`` (a float32 tensor there): torch.distributed.checkpoint's
#: flattened optimizer state (what torchtitan saves) maps each saved key to the optimizer's
#: in-memory key, so the saved key must be the one the step reads. A ``step`` (torch's name, a
#: tensor or a number) loads as ``adam_step``, and an int count (as older checkpoints saved it) as
#: the tensor.
ADAM_STEP, TORCH_STEP = "adam_step", "step"


def _count(value):
    """``value`` as a count (an int), or None when it is not one (the load's checks name it)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.is_meta:
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() or value < 0:
        return None
    return int(value) if value < 2**63 else None  # past int64: not a count the state can keep


def import_steps(entry: Mapping) -> Mapping:
    """A saved entry's step counts as the state keeps them (count tensors): a ``step`` (torch's
    name for the count: a tensor or a number that is a count, e.g. a state dict converted by
    torch-side tools) becomes ``adam_step`` (where the entry has none); an ``adam_step`` or
    ``post_step`` saved as an int (older checkpoints) or another number becomes the tensor. A value that is not a
    count stays as it is, for the load's checks to name."""
    if TORCH_STEP in entry and ADAM_STEP not in entry and _count(entry[TORCH_STEP]) is not None:
        entry = {(ADAM_STEP if k == TORCH_STEP else k): v for k, v in entry.items()}
    return {k: count_tensor(_count(v)) if k in COUNTS and not _is_count_tensor(v) and _count(v) is not None
            else v for k, v in entry.items()}


def _is_count_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.dim() == 0




def to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value






def spec_name(yaml_text: str) -> str:
    for line in yaml_text.splitlines():
        if line.startswith("name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def restored_pending(saved: Optional[dict], groups: list) -> Optional[PendingStep]:
    """The interrupted step a checkpoint recorded (:mod:`geomopt.optim.engine.atomic`), on this
    optimizer's tensors; refused when it names a tensor or group this optimizer lacks."""
    if saved is None:
        return None
    by_name = {n: p for g in groups for n, p in zip(g["param_names"], g["params"])}
    unknown = [n for n in saved["done"] if n not in by_name] + [str(i) for i in saved["groups"] if i >= len(groups)]
    if unknown:
        raise CheckpointError(f"geomopt['pending'] names {', '.join(unknown[:5])}, which this optimizer does not "
                              f"have: the checkpoint of an interrupted step belongs to another model or spec")
    return PendingStep(done={id(by_name[n]) for n in saved["done"]}, names=list(saved["done"]),
                       groups=set(saved["groups"]))
