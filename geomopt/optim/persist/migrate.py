"""State migration: carry optimizer state over to a different spec, by parameter name.

A checkpoint saved under one spec (or by ``torch.optim.AdamW`` / ``Adam`` / ``Muon``) is loaded
into an optimizer running another spec. Each tensor's saved state is translated into geomopt's
kinds of state, and a kind is kept where the tensor's new rule uses it and its shape still fits:

==================  =================================  =================================
kind                geomopt keys                       torch.optim keys
==================  =================================  =================================
Adam moments        exp_avg, exp_avg_sq, adam_step     exp_avg, exp_avg_sq, step (Adam, AdamW)
momentum            d (a Polyak average of gradients,  momentum_buffer (Muon: buf.lerp_(g, 1 − β))
                    or Lion's m)
STORM estimate      d and prev                         —
gap memory W        w                                  —
second moment       post_v, post_step                  —
gradient-norm EMA   post_g2, post_step                 —
==================  =================================  =================================

A kind moves as a unit (moments without their step count would be bias-corrected wrongly; a
STORM estimate without its previous iterate cannot be continued). W always restarts: it belongs
to the old rule's backward step and is measured again after the next one; so does a post-stage's
second moment (its shape follows the stage's axis and the tensor's view, and it re-forms in about
1/(1−β₂) steps); and a rule with heavy-ball momentum starts its buffer fresh (a sum of gradients,
not an average, so an average does not move into it). Everything else starts
fresh, and the :class:`MigrationReport` says, per tensor, what was kept and what was reset.

Names come from the saved groups' ``param_names`` (geomopt writes them; torch optimizers built
from ``model.named_parameters()`` do too), or, for a torch optimizer built from
``model.parameters()``, from the model's parameter order. They are read without wrapper segments
(:mod:`geomopt.compile.wrappers`), as the plan's are, so a state saved from a compiled or DDP model
(or by an older geomopt, whose names kept ``_orig_mod.``) finds its tensors in a plain one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.compile.wrappers import strip_names
from geomopt.distributed.executors import is_dtensor
from geomopt.optim.units.compensation import DTYPES, KEY, compensated
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.persist.state_codec import decode_entry
from geomopt.optim.units.state_keys import KINDS, VIEW_KEYS, geometry_kind, owner_state
from geomopt.optim.engine.tensors import count_tensor

# torch.optim state keys → geomopt's, per source optimizer
_TORCH = {
    "adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": "adam_step"},
    "muon": {"momentum_buffer": "d"},
}


def kinds_used(pp: ParamPlan, direction: str) -> tuple[str, ...]:
    """The kinds of state a rule's step keeps for this tensor."""
    geometry = geometry_kind(pp.geometry)  # adam's moments, a kronecker method's factors
    out = [] if geometry is None else [geometry]
    kind = DIRECTIONS[direction].migrates  # as the direction declares (heavy ball's sum: none)
    weights = ["compensation"] if compensated(pp, pp.dtype) else []
    return tuple(out + ([kind] if kind else []) + weights)


def kinds_held(state: dict) -> tuple[str, ...]:
    """The kinds of state a saved entry holds: each kind whose keys it has, but a kind whose keys
    another held kind's include (d with prev is a STORM estimate, with dion_q Dion's; alone it is
    momentum)."""
    out = [k for k, keys in KINDS.items() if all(key in state for key in keys)]
    return tuple(k for k in out if not any(set(KINDS[k]) < set(KINDS[o]) for o in out))


@dataclasses.dataclass
class MigrationReport:
    """What :meth:`GeomOptimizer.load_state_dict` did with a state from another spec or optimizer:
    per tensor name, the kinds of state kept and reset (with why), and the saved tensors that
    this optimizer does not have."""

    source: str  # "geomopt", "torch.optim.AdamW", ...
    kept: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    reset: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # name → ["kind: why"]
    dropped: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"state from {self.source}: kept for {sum(map(bool, self.kept.values()))} tensor(s), "
                 f"reset for {sum(map(bool, self.reset.values()))}, dropped {len(self.dropped)}"]
        for name in sorted(set(self.kept) | set(self.reset)):
            kept, reset = self.kept.get(name, []), self.reset.get(name, [])
            if kept or reset:
                parts = ([f"kept {', '.join(kept)}"] if kept else []) + [f"reset {r}" for r in reset]
                lines.append(f"  {name}: " + "; ".join(parts))
        if self.dropped:
            lines.append(f"  no such tensor here (dropped): {', '.join(self.dropped)}")
        return "\n".join(lines)


def source_of(state_dict: dict) -> str:
    """Which optimizer saved a state dict: ``geomopt``, ``adam`` (Adam, AdamW) or ``muon``; a
    ValueError for anything else."""
    groups = state_dict.get("param_groups") or []
    if "geomopt" in state_dict or (groups and "spec_hash" in groups[0]):
        return "geomopt"
    keys = set().union(*(s.keys() for s in state_dict.get("state", {}).values()))
    group_keys = set().union(*(g.keys() for g in groups)) if groups else set()
    if "momentum_buffer" in keys and {"ns_steps", "ns_coefficients"} & group_keys:
        return "muon"
    if {"exp_avg", "exp_avg_sq"} <= keys and "betas" in group_keys:
        return "adam"
    if not keys and "betas" in group_keys:
        return "adam"  # an Adam that has not stepped yet
    what = ("torch.optim.SGD (its momentum b ← μb + g is not an average of gradients)"
            if "momentum_buffer" in keys else f"an optimizer with state keys {sorted(keys)}")
    raise ValueError(f"cannot load the state of {what}: geomopt loads its own state and that of "
                     f"torch.optim.AdamW, Adam and Muon")


def saved_names(state_dict: dict, model_names: list[str] | None, trainable: list[str] | None) -> list[str]:
    """The parameter name of each saved index, in index order: the groups' ``param_names``
    (wrapper segments stripped), or the model's parameter order for a single-group state saved
    without names."""
    groups = state_dict["param_groups"]
    count = sum(len(g["params"]) for g in groups)
    if all("param_names" in g for g in groups):
        return strip_names(n for g in groups for n in g["param_names"])
    if len(groups) > 1:
        raise ValueError(
            f"this state has {len(groups)} parameter groups and no parameter names, so which tensor each entry "
            f"belongs to is unknown: build the source optimizer from model.named_parameters() (its state_dict "
            f"then carries the names) and save again")
    for names in (model_names, trainable):
        if names is not None and len(names) == count:
            return names
    have = "" if model_names is None else f" and the model has {len(model_names)} ({len(trainable or [])} trainable)"
    raise ValueError(
        f"this state holds {count} parameter(s) and no names{have}: pass model= (the model the source "
        f"optimizer was built on, with model.parameters() in the same order), or build the source optimizer "
        f"from model.named_parameters()")


def translate(entry: dict, source: str) -> dict:
    """A saved per-tensor state in geomopt's keys (torch.optim's ``step`` tensor becomes the
    int64 count tensor);
    keys with no geomopt counterpart (e.g. AMSGrad's ``max_exp_avg_sq``) are left out."""
    if source == "geomopt":
        return decode_entry(entry)  # state kept in bf16 or int8 moves as float32
    out = {}
    for key, value in entry.items():
        ours = _TORCH[source].get(key)
        if ours == "adam_step":
            out[ours] = count_tensor(value.item() if isinstance(value, torch.Tensor) else value)
        elif ours is not None:
            out[ours] = value
    return out


def migrate_state(saved: dict[str, dict], targets: list[tuple], source: str,
                  transposed: set[str] | None = None) -> tuple[dict, MigrationReport]:
    """New per-tensor state for ``targets`` [(name, tensor, ParamPlan, direction kind)] from
    ``saved`` {name: geomopt-keyed state}. ``transposed``: names whose saved state is in the
    transposed (operator) layout; None: as each tensor's plan says (a checkpoint without layouts).
    Builds new tensors only (copies on the parameter's device): nothing is written until the caller
    installs the result."""
    report = MigrationReport({"geomopt": "a geomopt checkpoint of another spec", "adam": "torch.optim.Adam(W)",
                              "muon": "torch.optim.Muon"}[source])
    state: dict = {}
    names = set()
    for name, p, pp, direction in targets:
        names.add(name)
        entry = saved.get(name)
        if entry is None:
            continue
        was_t = source == "geomopt" and (pp.transpose if transposed is None else name in transposed)
        new, kept, reset = {}, [], []
        used = kinds_used(pp, direction)
        for kind in kinds_held(entry):
            if kind == "gap":
                reset.append("w (the gap's W: measured again after the next step)")
                continue
            if kind in ("second_moment", "norm_ratio"):
                reset.append(f"{'second moment' if kind == 'second_moment' else 'gradient-norm EMA'} "
                             "(a post-stage's v restarts after a spec change)")
                continue
            into = kind if kind in used else "momentum" if kind == "storm" and "momentum" in used else None
            if into is None:
                reset.append(f"{kind} ({_why_not(kind, pp, direction)})")
                continue
            if set(KINDS[into]) & set(owner_state(pp.geometry, is_dtensor(p))):
                reset.append(f"{kind} (kept whole by the owner of the sharded tensor's matrix: it starts there)")
                continue
            if kind == "compensation":  # the weight's lost bits: carried only in the form this rule keeps
                value = entry[KEY]
                want = DTYPES[pp.compensation]
                if value.dtype != want or tuple(value.shape) != tuple(p.shape):
                    reset.append(f"compensation (saved {value.dtype} {tuple(value.shape)}, rule '{pp.rule}' keeps "
                                 f"{want} {tuple(p.shape)}: the weight keeps its bf16 value)")
                else:
                    new[KEY] = value.detach().to(device=p.device, copy=True)
                    kept.append(kind)
                continue
            moved: Optional[dict] = {}
            for key in KINDS[into]:
                value = entry[key]
                if isinstance(value, torch.Tensor) and key != "adam_step":
                    # geomopt keeps VIEW_KEYS of unsharded tensors in the operators' layout;
                    # torch.optim and sharded (DTensor) state are laid out like the parameter
                    viewed = key in VIEW_KEYS and not is_dtensor(value)
                    if viewed and was_t:
                        value = value.transpose(0, 1)
                    if tuple(value.shape) != tuple(p.shape):
                        moved = None
                        reset.append(f"{kind} (saved shape {tuple(value.shape)}, the tensor is {tuple(p.shape)})")
                        break
                    if viewed and pp.transpose:
                        value = value.transpose(0, 1)
                    value = value.detach().to(device=p.device, dtype=torch.promote_types(value.dtype, torch.float32),
                                              copy=True)
                moved[key] = value  # type: ignore[index]  # None only after the break above
            if moved:
                new.update(moved)
                kept.append(into if into == kind else "momentum (the d of the STORM estimate)")
        if new:
            state[p] = new
        report.kept[name], report.reset[name] = kept, reset
    report.dropped = sorted(set(saved) - names)
    return state, report


def _why_not(kind: str, pp: ParamPlan, direction: str) -> str:
    if kind == "adam":
        return f"rule '{pp.rule}' uses the {pp.geometry.kind} geometry, not adam"
    if kind == "compensation":
        return f"rule '{pp.rule}' keeps no compensation for this tensor (its weight keeps its bf16 value)"
    if kind == "momentum" and direction == "storm":
        return f"rule '{pp.rule}' uses storm, whose estimate also needs the previous iterate"
    return f"rule '{pp.rule}' uses the direction {direction}"
