"""What torch users expect of any ``torch.optim.Optimizer`` (the contract PyTorch's generic optimizer
tests check: ``torch.testing._internal.common_optimizers``), where a geomopt spec needs a word of
translation. :class:`~geomopt.optim.GeomOptimizer`'s constructor and step call these:

* ``lr=`` / ``weight_decay=`` keywords (:func:`with_overrides`): they replace the spec's
  ``defaults:`` value, so every rule that does not set its own follows them; a rule that sets one
  keeps it (it was written for that rule: Adam's lr beside Muon's is not the same number).
* ``model.parameters()`` and param-group dicts (:func:`collect_params`), named for the spec's rules.
* ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the optimizer (:func:`copy_state`).
* gradients checked at ``step()`` before anything is written (:func:`check_gradient`): sparse
  ones stepped by elementwise SGD rules (as torch's SGD does) and refused elsewhere (as torch's
  AdamW does), wrong shapes, dtypes and devices and meta tensors refused with the tensor's name.
* complex parameters (:func:`check_complex`): stepped where the rule is elementwise, refused at
  construction elsewhere.
"""

from __future__ import annotations

import math
import warnings
from numbers import Real
from typing import Callable, Optional, Union

import torch

from geomopt.compile.compiler import model_params
from geomopt.compile.plan import ParamPlan
from geomopt.distributed.executors import LocalExecutor
from geomopt.optim.engine.tensors import FLAT_DTYPES
from geomopt.optim.units.decays import DECAYS
from geomopt.spec.model import Spec


def _checked(name: str, value, *, positive: bool) -> float:
    """``value`` as a float, or a clear error naming the keyword (a tensor ``lr``: its value)."""
    if isinstance(value, torch.Tensor):
        if name != "lr":  # torch's own wording, which its generic tests accept
            raise ValueError(f"{name} as a Tensor is not supported by GeomOptimizer's constructor ({name}= becomes "
                             f"the spec's defaults: value, a number): pass a float")
        if value.numel() != 1 or value.is_complex() or not value.is_floating_point():
            raise ValueError(f"Tensor lr must be 1-element and floating point, not of shape {tuple(value.shape)} "
                             f"and dtype {value.dtype}: pass torch.tensor(0.02) or a float")
        value = float(value.detach())  # read once, at construction
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"GeomOptimizer's {name}= must be a number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"GeomOptimizer's {name}= must be finite, not {value}")
    if positive and value <= 0:
        raise ValueError(f"GeomOptimizer's {name}= must be > 0, not {value} (to freeze tensors, leave them out "
                         f"of the optimizer or give them requires_grad=False)")
    if value < 0:
        raise ValueError(f"GeomOptimizer's {name}= must be >= 0, not {value}")
    return value


def tensor_lr(lr) -> Optional[torch.Tensor]:
    """The groups' ``lr`` where the constructor was given a tensor: a 0-d view of it (the same
    storage, so a scheduler's or the user's ``fill_`` reaches the step, as with torch's
    optimizers, whose groups all hold the ``lr`` tensor given); None for a float. Every rule that
    takes the spec's default lr holds it; the spec records its value (:func:`with_overrides`), so a
    float lr of the same value gives the same spec, hash and checkpoint."""
    if not isinstance(lr, torch.Tensor):
        return None
    return lr if lr.dim() == 0 else lr.view(())


def with_overrides(spec: Spec, lr: Union[float, torch.Tensor, None] = None,
                   weight_decay: Optional[float] = None) -> Spec:
    """``spec`` with ``lr`` / ``weight_decay`` (where given) as its ``defaults:`` values.

    Folded into the spec rather than into the param groups, so the spec the optimizer holds says
    what runs: ``dump_spec(opt.spec)``, the checkpoint's spec text and hash, and a load
    under other overrides (a spec change: refused unless ``allow_spec_change=True``, after which
    the new values win, as for an edited spec file) all agree with the groups' values."""
    values = {}
    if lr is not None:
        values["lr"] = _checked("lr", lr, positive=True)
    if weight_decay is not None:
        values["weight_decay"] = _checked("weight_decay", weight_decay, positive=False)
    if not values:
        return spec
    # model_copy keeps the source positions (warnings point at the spec's lines) and skips
    # validation, which _checked did for these two values
    return spec.model_copy(update={"defaults": spec.defaults.model_copy(update=values)})


class GeneratedNamesWarning(UserWarning):
    """The optimizer was given tensors without names: it named them ``param.<i>`` and guessed
    their roles from shapes alone (pass ``model=`` or ``model.named_parameters()`` instead)."""


def collect_params(params, model, roles: bool, example_inputs) -> tuple[list, dict, object, frozenset]:
    """(infos, tensors by name, what to label a routing lock with, the names generated here) for
    whatever torch users pass.

    An ``nn.Module`` or (name, tensor) pairs go to :func:`~geomopt.compile.compiler.model_params`
    as they are. Plain tensors (``model.parameters()``) and param-group dicts
    (``[{"params": [...]}, …]``, whose ``params`` may hold tensors or (name, tensor) pairs) are
    named: with ``model=``, by each tensor's name in that model (matched by identity: the roles
    then come from the model, traced, as for ``GeomOptimizer(model, spec)``); without, ``param.<i>``,
    ``i`` its position in the order given, which is the number torch's own ``state_dict()`` gives
    it, with roles guessed from shapes and one :class:`GeneratedNamesWarning`. Per-group options
    are refused: the optimizer's param groups are the spec's rules, whose tensors a group need not
    share, so a group's lr could not live in one of them."""
    if isinstance(params, torch.nn.Module) or isinstance(params, (str, bytes, dict)):
        if model is not None:
            raise TypeError("model= names the tensors of a parameter iterable (GeomOptimizer(model.parameters(), "
                            "spec, model=model)); with a model as the first argument, leave it out")
        return (*model_params(params, roles, example_inputs), params, frozenset())
    if isinstance(params, torch.Tensor):
        raise TypeError("GeomOptimizer takes a model, model.named_parameters(), model.parameters() or param-group "
                        "dicts, not a single tensor: wrap it in a list")
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"GeomOptimizer takes a model, model.named_parameters(), model.parameters() or param-group "
                        f"dicts, not {type(params).__name__}") from None
    if not any(isinstance(x, (torch.Tensor, dict)) for x in items):  # (name, tensor) pairs: named already
        if model is not None:
            raise TypeError("model= names plain tensors; these (name, tensor) pairs are named already: leave it out")
        return (*model_params(items, roles, example_inputs), items, frozenset())
    entries = _entries(items)
    if model is None:
        pairs = [(name or f"param.{i}", t) for i, (name, t) in enumerate(entries)]
        generated = frozenset(f"param.{i}" for i, (name, _) in enumerate(entries) if name is None)
        if generated:
            _warn_generated(len(generated))
        return (*model_params(pairs, roles, example_inputs), items, generated)
    return (*_in_model(entries, model, roles, example_inputs), model, frozenset())


def _warn_generated(generated: int) -> None:
    """One warning per optimizer (not per tensor), pointing at the caller's line."""
    warnings.warn(
        f"GeomOptimizer was given {generated} tensor(s) without names: they are named param.0, param.1, … in "
        f"the order given and their roles are guessed from shapes alone (an embedding looks like any other "
        f"matrix), so a spec that routes by name or role may route them differently than it would the model. "
        f"Pass model=model (names them by identity) or model.named_parameters()", GeneratedNamesWarning,
        stacklevel=4)


def _named(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)


class DuplicateParameterWarning(UserWarning):
    """A tensor was given twice in one parameter list or group (torch's optimizers warn so too):
    it is optimized once, under its first position."""


def _unique(ts: list, where: str) -> list:
    """``ts`` without repeats (by identity), the first of each kept; one warning when any repeat,
    in torch's words (torch keeps both and steps the tensor twice; here it steps once)."""
    seen: set = set()
    out = []
    for t in ts:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    if len(out) < len(ts):
        warnings.warn(f"optimizer contains a parameter group with duplicate parameters ({where}: "
                      f"{len(ts) - len(out)} repeat(s)): GeomOptimizer optimizes each tensor once, at its first "
                      f"position; give each tensor once", DuplicateParameterWarning, stacklevel=5)
    return out


def _entries(items: list) -> list[tuple[Optional[str], object]]:
    """(name or None, tensor) per tensor of a plain list or of param-group dicts, in order; a
    tensor repeated in a list or group is kept once (:func:`_unique`), one in two groups refused."""
    if all(isinstance(x, torch.Tensor) for x in items):
        return [(None, t) for t in _unique(items, "the parameter list")]
    if not all(isinstance(x, dict) for x in items):
        kinds = sorted({type(x).__name__ for x in items})
        raise TypeError(f"GeomOptimizer's parameters must be all tensors, all (name, tensor) pairs or all "
                        f"param-group dicts, not a mix of {', '.join(kinds)}")
    out: list[tuple[Optional[str], object]] = []
    seen: set = set()
    for k, group in enumerate(items):
        if "params" not in group:
            raise ValueError(f"param group {k} has no 'params' entry: give each group {{'params': [tensors]}}")
        other = sorted(str(key) for key in group if key != "params")
        if other:
            raise ValueError(
                f"param group {k} sets {', '.join(map(repr, other))}: GeomOptimizer's param groups are its spec's "
                f"rules, so per-group options do not apply. Set them on the spec's rule that matches these tensors "
                f"(match them by name with model=model or model.named_parameters()), or pass lr= / weight_decay= "
                f"to GeomOptimizer for every rule without its own")
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if all(isinstance(x, torch.Tensor) for x in ps):
            ps = _unique(ps, f"param group {k}")
        for j, x in enumerate(ps):
            name, t = x if _named(x) else (None, x)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"param group {k}'s params[{j}] is a {type(t).__name__}, not a tensor or a (name, "
                                f"tensor) pair")
            if id(t) in seen:
                raise ValueError(f"param group {k}'s params[{j}] appears in an earlier group too: give each tensor "
                                 f"to one group")
            seen.add(id(t))
            out.append((name, t))
    return out


def _in_model(entries: list, model, roles: bool, example_inputs) -> tuple[list, dict]:
    """The model's infos and tensors, kept to the ``entries``' tensors in their order."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model= must be the nn.Module the parameters belong to, not {type(model).__name__}")
    if any(name is not None for name, _ in entries):
        raise TypeError("model= names plain tensors; some of these come with names already: pass tensors only, "
                        "or leave model= out")
    infos, tensors = model_params(model, roles, example_inputs)
    name_of = {id(t): n for n, t in tensors.items()}
    index: dict[str, int] = {}
    for i, (_, t) in enumerate(entries):
        name = name_of.get(id(t))
        if name is None:
            raise ValueError(f"parameter {i} given to GeomOptimizer (shape {tuple(t.shape)}) is not a parameter of "
                             f"model= ({type(model).__name__}): pass the model these parameters belong to")
        index.setdefault(name, i)
    kept = sorted((i for i in infos if i.name in index), key=lambda i: index[i.name])
    return kept, {i.name: tensors[i.name] for i in kept}


#: what a copy rebuilds instead of copying: an LR scheduler's wrapper of the original's bound ``step``
#: (torch drops it too). The engine's runtime (CUDA graphs and their pinned flag, tied to the
#: original's memory; the step's scratch; the stacked-state caches, keyed by the original tensors'
#: ids) is left out by the engine itself (:meth:`~geomopt.optim.engine.engine.Engine.__getstate__`):
#: the copy restacks its state on its first step, as after load_state_dict, same values, same bits
REBUILT = ("step",)


def copy_state(opt) -> dict:
    """What ``copy.deepcopy`` and pickling (``pickle``, ``torch.save``) of the whole optimizer keep.

    torch.optim.Optimizer's own ``__getstate__`` keeps only ``defaults``, ``state`` and
    ``param_groups``: a copy of this optimizer would lose its plan and fail on its first step. Here
    everything is kept except what :data:`REBUILT` lists and the hooks, which torch's
    ``__setstate__`` starts empty (as for its own optimizers: hooks are often closures, which do
    not pickle). Copy or pickle the model in the same call (``copy.deepcopy((model, opt))``,
    ``torch.save({"model": model, "opt": opt})``) so the copy's parameters are the copied model's.
    A distributed optimizer (a process group inside) is refused: save its ``state_dict()``."""
    if not isinstance(opt.engine.executor, LocalExecutor):
        raise TypeError("a distributed GeomOptimizer holds its process group and cannot be copied or pickled: "
                        "save opt.state_dict() and build a new optimizer on each rank")
    return {k: v for k, v in opt.__dict__.items() if k not in REBUILT and not k.startswith("_optimizer_")}


def pickled_state(opt) -> dict:
    """What pickle writes (:func:`copy_state`): state entries that view rows of a stacked buffer
    become tensors of their own (pickle writes a view's whole storage, once per view)."""
    out = copy_state(opt)
    out["state"] = type(opt.state)(dict, {p: {k: _own(v) for k, v in st.items()} for p, st in opt.state.items()})
    return out


def _own(value):
    return value.clone() if isinstance(value, torch.Tensor) and value._base is not None else value


def check_complex(groups: list, plans: list, flat_rule: Callable[[dict, ParamPlan], bool]) -> None:
    """Complex parameters are stepped where the rule is elementwise (``flat_rule``: the flat path's
    rules, φ euclidean, anisotropic, isotropic or adam with no constraint, post-stage or tracking),
    as torch.optim does: parameter, gradient and state viewed as real (``torch.view_as_real``), so
    re and im are two real coordinates (ℂⁿ ≅ ℝ²ⁿ: |z|² = re² + im², an isotropic norm is the
    complex Frobenius norm). Everything else acts on the tensor as a matrix or through a set
    whose complex form is another map (a spectral lmo of a complex matrix needs its complex SVD,
    not one of the real view), so those are refused here, before anything is built, naming the
    tensor, its rule and what to do."""
    for group, gplans in zip(groups, plans):
        for p, pp in zip(group["params"], gplans):
            if not p.is_complex():
                continue
            if p.dtype not in FLAT_DTYPES:
                raise ValueError(f"tensor '{pp.name}' is {p.dtype}: geomopt steps complex64 and complex128 "
                                 f"parameters only; convert it (p.data = p.data.to(torch.complex64))")
            if not flat_rule(group, pp):
                raise ValueError(
                    f"tensor '{pp.name}' is complex ({p.dtype}) and its rule '{group['rule']}' is not elementwise "
                    f"(geometry {pp.geometry.kind}"
                    + (f", constraint {pp.constraint.kind}" if pp.constraint else "")
                    + (", post-stages" if pp.post else "") + f", direction {group['direction']}): complex "
                    f"parameters step only under euclidean, anisotropic, isotropic or adam geometry with no "
                    f"constraint, post-stage, cautious decay, STORM direction or track_gap/track_update. Route "
                    f"this tensor to such a rule, or optimize its real view (torch.view_as_real) as a real "
                    f"parameter")


def takes_sparse(group: dict, pp: ParamPlan) -> bool:
    """Whether a rule steps a sparse gradient: elementwise SGD (euclidean geometry, direction none
    or heavy ball, no constraint, post-stage or cautious decay), as torch.optim.SGD does. Its
    update is linear in the gradient entry by entry, so the densified gradient (duplicates summed,
    :func:`dense`) steps the parameter exactly as torch's SGD steps it from the sparse one: rows
    without a gradient move only by the momentum and the decay they would have under a zero
    gradient. Every other geometry acts on the whole tensor (a spectral map mixes all rows, Adam's
    moments would fill every row), so a sparse gradient buys nothing there and is refused."""
    return (pp.geometry.kind == "euclidean" and pp.constraint is None and not pp.post
            and DECAYS[pp.decay].in_place is not None and group["direction"] in ("none", "heavy_ball"))


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a strided tensor: a sparse one (which :func:`takes_sparse` rules accept)
    densified, its duplicate entries summed; a strided one as it is."""
    return grad if grad.layout == torch.strided else grad.to_dense()


def check_gradient(group: dict, pp: ParamPlan, p: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse a gradient the step cannot take, with the tensor's name and rule, while ``step()``
    gathers the gradients, before anything is written (every retry is refused alike, the state
    as it was): a parameter on the meta device (no data: materialize the model first), a sparse
    gradient where the rule is not elementwise SGD (:func:`takes_sparse`), and a gradient whose
    shape, dtype or device is not the parameter's (a complex gradient on a real parameter among
    them; autograd never makes one, an assignment through ``.data`` can). ``g``: ``p.grad``."""
    where = f"parameter {pp.name!r} (rule {group['rule']!r})"
    if p.is_meta or g.is_meta:
        raise RuntimeError(
            f"{where} is on the meta device, which holds no data to step: materialize the model first "
            f"(model.to_empty(device=...) and initialize its weights), then build the optimizer or load its state")
    if g.layout != torch.strided and not takes_sparse(group, pp):
        raise RuntimeError(
            f"{where} has a sparse gradient ({g.layout}): geomopt steps sparse gradients only under elementwise "
            f"SGD (euclidean geometry, direction none or heavy_ball, no constraint or post-stage), as torch.optim.SGD; "
            f"this rule's {pp.geometry.kind} geometry does not support sparse gradients (as torch.optim.AdamW "
            f"does not). Build its module with dense gradients (nn.Embedding(..., sparse=False)), route it to an "
            f"SGD rule, or leave the parameter to torch.optim.SparseAdam")
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise RuntimeError(
            f"{where} has a gradient of shape {tuple(g.shape)}, {g.dtype} on {g.device}, but the parameter is "
            f"{tuple(p.shape)}, {p.dtype} on {p.device}: a gradient must match its parameter (set p.grad to a "
            f"tensor like p, or let backward() compute it)")
