"""GeomOptimizer: executes a compiled Plan as an ordinary ``torch.optim.Optimizer``.

One param_group per rule; ``lr``, ``weight_decay``, ``radius``, ``alpha`` (the direction's
α = 1 − β) live in the group, so torch LR schedulers, GradScaler and checkpoint tools work
unchanged. Per tensor, one step is (DESIGN, "Flow of data")::

    X ← X(1 − γ·wd)                       decoupled weight decay (torch's form)
    d ← direction(g)                      none / Polyak(+Nesterov) / STORM
    Y = X − γ·ρ·∇φ₁*(d)                   forward op of the geometry
    X⁺ = backward(Y)                      prox of the constraint (t = γρ)

written back in the parameter's dtype; state (directions, Adam moments) is kept in float32 at
least. γ is the group's ``lr`` shaped by the rule's schedule.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from typing import Callable, Optional, Union

import torch
from torch.optim import Optimizer

from geomopt.compile import as_spec, plan_from_infos
from geomopt.compile.params import params_from_model
from geomopt.compile.plan import ParamPlan, Plan
from geomopt.geometry.backward import backward
from geomopt.geometry.adam import adam_moments
from geomopt.geometry.forward import forward
from geomopt.optim.directions import DIRECTIONS
from geomopt.optim.schedules import SCHEDULES
from geomopt.spec.model import Spec
from geomopt.spec.printers import dump_spec



def _euclidean(pp: ParamPlan) -> dict:
    """The Euclidean geometry for P_C (project_on_init, the violation): spectral sets act per
    ``split`` block, as the rule's own backward step does."""
    return {"kind": "euclidean", "radius": 1.0, "split": pp.geometry.get("split")}


def spec_hash(spec: Spec) -> str:
    """Content hash of a spec (independent of spelling, comments and file format)."""
    return hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()[:16]


class NonFiniteGradientError(FloatingPointError):
    """A non-finite gradient under ``on_nonfinite: raise``; parameters and state are untouched."""


class GeomOptimizer(Optimizer):
    """``GeomOptimizer(model_or_named_parameters, spec)``: spec is a Spec, a path or a dict.

    ``track_gap``: keep W = (X⁺ − Y)/(γρ) after each step so :meth:`diagnostics` can report the
    stationarity gap against the next gradient (one extra tensor per parameter).

    STORM directions need ``step(closure)``: the closure computes the loss on the current batch
    and calls ``backward()`` (zeroing gradients in it is harmless: the optimizer sets them to None
    before each evaluation); the optimizer evaluates it at the previous iterate and at the current
    one (same batch), except on the first step.

    Non-finite gradients (any group) skip the whole step or raise, per rule (``on_nonfinite``),
    before anything is written.
    """

    def __init__(self, model_or_named_parameters, spec: Union[Spec, str, dict], *, track_gap: bool = False):
        self.spec = as_spec(spec)
        infos, tensors = params_from_model(model_or_named_parameters)
        self.plan: Plan = plan_from_infos(self.spec, infos)
        self.spec_hash = spec_hash(self.spec)
        self.track_gap = track_gap
        groups, self._plans = [], []
        for index, rule in enumerate(self.spec.rules):
            plans = [p for p in self.plan if p.rule_index == index]
            if not plans:
                continue
            first = plans[0]
            d = first.direction
            groups.append(dict(
                params=[tensors[p.name] for p in plans], rule=rule.name, lr=first.lr,
                weight_decay=first.weight_decay, radius=first.geometry["radius"], direction=d["kind"],
                alpha=d.get("alpha", 1.0), nesterov=d.get("nesterov", False), init=d.get("init", "zero"),
                schedule=first.schedule, on_nonfinite=first.on_nonfinite, step=0,
            ))
            self._plans.append(plans)
        super().__init__(groups, dict(lr=0.02, weight_decay=0.0))
        # what the spec set per group, saved with the state: after a spec change, values the new
        # spec changed win over the checkpoint's (load_state_dict)
        self._spec_groups = [{k: _copy(g[k]) for k in self._SPEC_KEYS} for g in self.param_groups]
        self._counters = [_new_counters() for _ in self.param_groups]
        self._needs_closure = any(g["direction"] == "storm" for g in self.param_groups)
        self._project_on_init()

    # ------------------------------------------------------------ set-up

    @torch.no_grad()
    def _project_on_init(self) -> None:
        """Project constrained tensors onto their set (DESIGN "Feasibility"), as Scion's init does,
        so every backward step is defined."""
        for group, plans in zip(self.param_groups, self._plans):
            for p, pp in zip(group["params"], plans):
                c = pp.constraint
                if c is None or not pp.project_on_init or c["kind"] == "proximal_decay":
                    continue
                x = _view(p, pp)
                xp, _ = backward(_upcast(x), 1.0, _euclidean(pp), c)
                x.copy_(xp)

    def _scale(self, pp: ParamPlan) -> float:
        return pp.radius / pp.geometry["radius"]

    # ------------------------------------------------------------ the step

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """One step for every parameter that has a gradient; returns the closure's loss.

        Non-finite gradients are checked in every group before anything is written: under
        ``on_nonfinite: raise`` (of a rule that has one) the step raises, otherwise the whole step
        is skipped and counted in the rules that had them; either way parameters and all
        optimizer state are left exactly as they were."""
        loss = None
        g_prev: dict = {}
        if self._needs_closure:
            if closure is None:
                raise RuntimeError(
                    "this spec uses a storm direction, which evaluates the gradient at the previous and the "
                    "current iterate on the same batch: call opt.step(closure) with a closure that zeroes the "
                    "gradients, computes the loss and calls backward()")
            g_prev = self._previous_gradients(closure)
            self.zero_grad(set_to_none=True)  # a closure that forgets zero_grad must not add g(x_{k-1})
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            work = [[(p, pp) for p, pp in zip(group["params"], plans) if p.grad is not None]
                    for group, plans in zip(self.param_groups, self._plans)]
            if self._skip_nonfinite(work, g_prev):
                return loss
            for gi, group in enumerate(self.param_groups):
                self._step_group(gi, group, work[gi], g_prev)
        return loss

    def _skip_nonfinite(self, work: list, g_prev: dict) -> bool:
        """True (and counted) when some gradient is non-finite; raises first where a rule says so."""
        flags = [torch.stack([torch.isfinite(p.grad).all() for p, _ in w]
                             + [torch.isfinite(g_prev[p]).all() for p, _ in w if g_prev.get(p) is not None]).all()
                 for w in work if w]
        if not flags or bool(torch.stack(flags).all()):  # one host sync per step
            return False
        bad_groups = []
        for gi, (group, w) in enumerate(zip(self.param_groups, work)):
            bad = [pp.name for p, pp in w if not torch.isfinite(p.grad).all()
                   or (g_prev.get(p) is not None and not torch.isfinite(g_prev[p]).all())]
            if bad:
                bad_groups.append(gi)
                if group["on_nonfinite"] == "raise":
                    raise NonFiniteGradientError(
                        f"non-finite gradient in rule '{group['rule']}' for {', '.join(bad[:5])}"
                        + (" …" if len(bad) > 5 else "")
                        + "; parameters and optimizer state are unchanged (set on_nonfinite: skip to skip such steps)")
        for gi in bad_groups:
            self._counters[gi]["skipped"] += 1
        return True

    def _previous_gradients(self, closure) -> dict:
        """g(x_{k−1}, ξ_k) for STORM: swap in the previous iterate, evaluate, swap back. Tensors
        without a previous iterate (first step, or never had a gradient) stay at the current one
        and get d = g on their first step (no second evaluation when no tensor has one)."""
        params = [p for g in self.param_groups for p in g["params"] if "prev" in self.state[p]]
        if not params:
            return {}  # first step: d⁰ = g(x₀, ξ₀), no second evaluation
        with torch.no_grad():
            current = [p.detach().clone() for p in params]
            for p in params:
                p.copy_(self.state[p]["prev"])
        try:
            self.zero_grad(set_to_none=True)
            with torch.enable_grad():
                closure()
            out = {p: (p.grad.detach().clone() if p.grad is not None else None) for p in params}
        finally:
            with torch.no_grad():
                for p, x in zip(params, current):
                    p.copy_(x)
        return out

    def _step_group(self, gi: int, group: dict, work: list, g_prev: dict) -> None:
        if not work:
            return
        counters = self._counters[gi]
        k = group["step"]
        gamma, alpha = SCHEDULES[group["schedule"]["kind"]](group, k)
        hyper = dict(group, alpha=alpha) if alpha is not None else group
        update_sq = torch.zeros((), device=work[0][0].device)
        for p, pp in work:
            state = self.state[p]
            x = _view(p, pp)
            g = _upcast(_view(p.grad, pp))
            if self._needs_closure:
                state["prev"] = p.detach().clone()
            prev = g_prev.get(p)
            d = DIRECTIONS[group["direction"]](g, state, hyper, g_prev=None if prev is None else _upcast(_view(prev, pp)))
            xw = _upcast(x) * (1 - gamma * group["weight_decay"]) if group["weight_decay"] else _upcast(x)
            rho = group["radius"] * self._scale(pp)
            if pp.geometry["kind"] == "adam":
                exp_avg, denom, bc1 = adam_moments(d, state, pp.geometry)
                y = xw.addcdiv(exp_avg, denom, value=-gamma / bc1)
            else:
                y = xw - gamma * forward(d, pp.geometry, radius=rho)
            x_new, fallback = backward(y, gamma, pp.geometry, pp.constraint, radius=rho) if pp.constraint else (y, None)
            if fallback is not None:
                counters["fallbacks"] = counters["fallbacks"] + fallback.sum().to(counters["fallbacks"].device)
            if self.track_gap and pp.constraint is not None and gamma * rho > 0:
                state["w"] = (x_new - y) / (gamma * rho)
            update_sq = update_sq + (x_new - _upcast(x)).square().sum().to(update_sq.device)
            x.copy_(x_new)
        counters["update_sq"] = update_sq
        group["step"] = k + 1

    # ------------------------------------------------------------ diagnostics

    @torch.no_grad()
    def diagnostics(self) -> dict[str, dict]:
        """Per rule: ``gap`` (stationarity-gap estimate, W of the last step paired with the current
        gradient; None where undefined or not tracked; NaN while a gradient is non-finite),
        ``dual_norm`` (ρ‖G‖_* where g ≡ 0),
        ``violation`` (max distance of a tensor to its constraint set), ``update_norm`` (of the last
        step), ``skipped`` and ``fallbacks`` (steps where the backward step was undefined and the
        Euclidean projection was used). Syncs with the device: call it every N steps."""
        from geomopt.geometry.gap import dual_norm, stationarity_gap

        out = {}
        for group, plans, counters in zip(self.param_groups, self._plans, self._counters):
            gap = dual = None
            violation = 0.0
            for p, pp in zip(group["params"], plans):
                rho = group["radius"] * self._scale(pp)
                g = None if p.grad is None else _upcast(_view(p.grad, pp))
                if pp.constraint is not None and pp.constraint["kind"] != "proximal_decay":
                    x = _upcast(_view(p, pp))
                    xp, _ = backward(x, 1.0, _euclidean(pp), pp.constraint)
                    violation = max(violation, float((x - xp).norm()))
                if g is None:
                    continue
                w = self.state[p].get("w")
                lmo_gap = pp.constraint is None and pp.geometry["kind"] != "adam"
                if not bool(torch.isfinite(g).all()):
                    # a non-finite gradient (a skipped step): no estimate, and no SVD of it
                    if lmo_gap:
                        dual = math.nan
                    elif w is not None:
                        gap = math.nan
                elif lmo_gap:
                    # g ≡ 0: the gap of the lmo method is ρ‖G‖_*
                    dual = (dual or 0.0) + rho * float(dual_norm(g, pp.geometry))
                elif w is not None:
                    val = stationarity_gap(g, w, pp.geometry, radius=rho)
                    if val is not None:
                        gap = (gap or 0.0) + float(val)
            out[group["rule"]] = dict(
                gap=gap, dual_norm=dual, violation=violation,
                update_norm=float(counters["update_sq"]) ** 0.5, skipped=counters["skipped"],
                fallbacks=int(counters["fallbacks"]),
            )
        return out

    # ------------------------------------------------------------ checkpoints

    # Group keys a spec sets (the rest, e.g. ``step`` or a scheduler's ``initial_lr``, is progress).
    _SPEC_KEYS = ("rule", "lr", "weight_decay", "radius", "direction", "alpha", "nesterov", "init", "schedule",
                  "on_nonfinite")

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["geomopt"] = dict(
            spec_hash=self.spec_hash, spec=dump_spec(self.spec, "yaml"),
            counters=[dict(c, fallbacks=c["fallbacks"].clone(), update_sq=c["update_sq"].clone()) for c in self._counters],
            spec_groups=[dict(g) for g in self._spec_groups],
        )
        return sd

    def load_state_dict(self, state_dict: dict, *, allow_spec_change: bool = False) -> None:
        """Load a checkpoint; refuses one saved under a different spec (saying what differs)
        unless ``allow_spec_change=True``. Then groups must still line up (as torch requires), the
        state (directions, moments, step counts) is resumed, and every group value that the new
        spec sets differently from the saved one (lr, weight_decay, radius, direction, …) follows
        the new spec; values it leaves alone resume as saved (e.g. an lr a scheduler changed)."""
        meta = state_dict.get("geomopt")
        if meta is None:
            if not allow_spec_change:
                raise ValueError("this optimizer state was not saved by GeomOptimizer (no spec hash); "
                                 "pass allow_spec_change=True to load it anyway")
        elif meta["spec_hash"] != self.spec_hash and not allow_spec_change:
            diff = difflib.unified_diff(meta["spec"].splitlines(), dump_spec(self.spec, "yaml").splitlines(),
                                        "saved spec", "current spec", lineterm="", n=1)
            lines = list(diff)[:40]
            raise ValueError(
                f"optimizer state was saved under spec '{_spec_name(meta['spec'])}' (hash {meta['spec_hash']}), "
                f"this optimizer runs '{self.spec.name}' (hash {self.spec_hash}); what differs:\n"
                + "\n".join(lines)
                + "\npass allow_spec_change=True to load it anyway")
        super().load_state_dict(state_dict)
        # torch.optim casts floating state to the parameter's dtype (it calls
        # Optimizer._process_value_according_to_param_policy directly, so an override is never
        # used); geomopt keeps float32 state for bf16 parameters: reload it with the device only.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is not None:
                self.state[p] = {k: _to_device(v, p.device) for k, v in saved.items()}
        if meta is not None and self.spec_hash != meta["spec_hash"]:
            old = meta.get("spec_groups") or [{}] * len(self.param_groups)
            for group, was, now in zip(self.param_groups, old, self._spec_groups):
                for key in self._SPEC_KEYS:
                    if key not in was or was[key] != now[key]:
                        group[key] = _copy(now[key])
        if meta is not None and len(meta.get("counters", [])) == len(self._counters):
            self._counters = [dict(c, fallbacks=c["fallbacks"].clone(), update_sq=c["update_sq"].clone()) for c in meta["counters"]]
        self._needs_closure = any(g["direction"] == "storm" for g in self.param_groups)


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _new_counters() -> dict:
    return dict(skipped=0, fallbacks=torch.zeros((), dtype=torch.int64), update_sq=torch.zeros(()))


def _spec_name(yaml_text: str) -> str:
    for line in yaml_text.splitlines():
        if line.startswith("name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 at least (bf16 gradients and state in float32; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _view(t: torch.Tensor, pp: ParamPlan) -> torch.Tensor:
    """The tensor as the operators see it (transposed for ``layout: in_out``)."""
    return t.transpose(0, 1) if pp.transpose else t
