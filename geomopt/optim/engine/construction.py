"""What building the optimizer does besides its groups and programs: the warnings a spec earns on
this model (bf16 matrix iterations on a CPU that emulates them, rules that match nothing, roles
decided without a trace) and the projection of constrained tensors onto their sets, so every
backward step is defined."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from geomopt.compile.plan import Plan
from geomopt.compile.roles.types import TRACE_FIX
from geomopt.distributed.executors import is_dtensor
from geomopt.geometry.dtypes import BF16Warning, slow_bf16
from geomopt.geometry.operators import FORWARD_OPS
from geomopt.geometry.prox import backward
from geomopt.lint.coverage import UnusedRuleWarning
from geomopt.lint.roles import RolesGuessedWarning, untraced, untraced_text
from geomopt.lint.runner import lint_spec
from geomopt.optim.contract.diagnostics import euclidean_geometry
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.units.state_keys import owner_state
from geomopt.optim.engine.tensors import full, in_set, op_view, upcast
from geomopt.spec.model import Spec
from geomopt.spec.validate import source_of


def warn_slow_bf16(spec: Spec, plan: Plan, tensors: dict) -> None:
    """One warning when rules ask for bf16 matrix iterations on a CPU that emulates bf16."""
    slow = sorted({pp.rule for pp in plan if slow_bf16(pp.geometry.approx, tensors[pp.name].device)})
    if slow:
        warnings.warn(
            f"rule(s) {', '.join(map(repr, slow))} of spec '{spec.name}' run their matrix iteration in "
            f"bfloat16 on a CPU without native bf16 matmuls, which emulates them: about 100x slower than float32 "
            f"(a 512³ matmul ran at 1.2 against 119 GFLOP/s on an AVX2 CPU), so a step can take seconds. "
            f"Set the approx's "
            f"dtype to auto (bf16 on CUDA, float32 on CPU) or float32", BF16Warning, stacklevel=3)


def warn_unused_rules(spec: Spec, infos: list) -> None:
    """One :class:`~geomopt.lint.coverage.UnusedRuleWarning` per rule that matches no tensor:
    lint's GO102 finding, so what lint calls idle (GO113, a role the model lacks) stays quiet
    and a ``# geomopt: disable=GO102`` comment on the rule silences it here too."""
    source = source_of(spec)
    for d in lint_spec(spec, infos, select="GO102"):
        if d.code != "GO102":
            continue  # GO123: a suppression comment of GO102 that silenced nothing
        where = f"{d.file}:{d.line}:{d.col}" if source is not None and source.values else f"spec '{spec.name}'"
        warnings.warn(
            f"{where}: GO102 {d.message} of this model, so it optimizes nothing (a misspelled pattern, or tensors "
            f"that are named otherwise): fix its match (`geomopt lint SPEC --model …` and `geomopt explain` show "
            f"the model's names) or delete the rule; to keep it, put `# geomopt: disable=GO102` on its line",
            UnusedRuleWarning, stacklevel=3)


def warn_guessed_roles(infos: list) -> None:
    """One :class:`~geomopt.lint.roles.RolesGuessedWarning` when any tensor's role was decided
    without a trace (lint's GO124, and roles guessed from names and shapes), with the reason and
    the fix. Roles are read only where the spec routes by them, so a spec matching by name alone
    never warns."""
    by_reason = untraced(infos, guessed=True)
    if by_reason:
        warnings.warn(f"GeomOptimizer: {untraced_text(by_reason)}. A spec routing by role may misroute them (a "
                      f"lookup table or an output layer orthogonalized as a hidden matrix): {TRACE_FIX}",
                      RolesGuessedWarning, stacklevel=3)


@torch.no_grad()
def project_on_init(groups: list, plans: list, executor) -> None:
    """Project constrained tensors onto their set (geomopt.geometry.backward: feasibility), as Scion's init does,
    so every backward step is defined. A tensor already in the set (within rounding:
    :func:`in_set`) is left bit for bit as it is, so weights loaded before the optimizer is
    built resume exactly. A sharded tensor is projected whole (on every rank, once) and each
    rank keeps its shard."""
    for group, gplans in zip(groups, plans):
        for p, pp in zip(group["params"], gplans):
            c = pp.constraint
            if c is None or not pp.project_on_init or c.kind == "proximal_decay" or not p.numel():
                continue
            x = op_view(full(p), pp)
            xu = upcast(x)
            xp, _ = backward(xu, 1.0, euclidean_geometry(pp), c)
            if in_set(xu, xp, x.dtype):
                continue  # already feasible (a resumed run's weights): keep every bit
            x.copy_(xp)
            if is_dtensor(p):
                block = executor.layouts[id(p)].slices(executor.rank)
                p.to_local().copy_(op_view(x, pp)[block])  # _view is its own inverse


def _geometry_refusal(gplans: list, form: str) -> tuple[str, Optional[str]]:
    """(the rule's geometry kind, why its forward op refuses ``form``, or None): the registration's
    ``refuses`` (the kronecker geometry under ``capturable``)."""
    kind = gplans[0].geometry.kind
    return kind, dict(FORWARD_OPS.meta[kind].get("refuses", ())).get(form)


def check_sharded(groups: list, plans: list, opts) -> None:
    """A direction or a geometry that refuses the ``sharded`` form (Dion, whose power iteration and
    QR need each matrix whole: :class:`~geomopt.optim.units.declare.DirectionUnit`; a geometry's
    forward op by its registration) is refused on sharded (DTensor) tensors, with its declared
    reason; so is a moments' precision other than float32 for a geometry whose state each matrix's
    owner keeps whole (the kronecker geometry's: :mod:`geomopt.optim.engine.owned`, which encodes its
    factors only). Replicated tensors (DDP) step whole on every rank."""
    if not opts.sharded:
        return
    for g, gplans in zip(groups, plans):
        why = DIRECTIONS[g["direction"]].why_not("sharded")
        if why:
            raise ValueError(f"rule '{g['rule']}' has a {g['direction']} direction, which cannot run on sharded "
                             f"(DTensor) parameters: {why}")
        kind, why = _geometry_refusal(gplans, "sharded")
        if why:
            raise ValueError(f"rule '{g['rule']}' has the {kind} geometry, which cannot run on sharded (DTensor) "
                             f"parameters: {why}; keep its tensors whole on each rank (DDP) or step it in one process")
        if owner_state(gplans[0].geometry, True) and gplans[0].state_dtype != "float32":
            raise ValueError(f"rule '{g['rule']}' has the {kind} geometry with state: {gplans[0].state_dtype}: on "
                             f"sharded (DTensor) parameters each matrix's owner keeps its moments whole, in float32 "
                             f"(its factors may be bfloat16: state: {{factors: bfloat16}}); set state: float32 for "
                             f"this rule, or keep its tensors whole on each rank (DDP)")


def check_capturable(groups: list, plans: list, opts) -> None:
    """What ``capturable=True`` cannot do, refused at construction with what to do instead: a
    step decided on the host (several processes, STORM's second evaluation, ``on_nonfinite:
    raise``, a momentum warmup read from the step count, QK-clip's maxima)."""
    if not opts.capturable:
        return
    why = []
    if not opts.local:
        why.append("it runs in one process (under torch.distributed the executors exchange on the host)")
    for g, gplans in zip(groups, plans):
        refused = DIRECTIONS[g["direction"]].why_not("capturable")
        if refused:
            why.append(f"rule '{g['rule']}' has a {g['direction']} direction ({refused})")
        kind, refused = _geometry_refusal(gplans, "capturable")
        if refused:
            why.append(f"rule '{g['rule']}' has the {kind} geometry ({refused})")
        if g["on_nonfinite"] == "raise":
            why.append(f"rule '{g['rule']}' has on_nonfinite: raise (raising needs the host to read the flag); "
                       f"use skip")
        if any(pp.qk_clip for pp in gplans):
            why.append(f"rule '{g['rule']}' has qk_clip (its monitor's maxima are read after the step)")
        if g.get("warmup_steps"):
            why.append(f"rule '{g['rule']}' has a momentum warmup (α read from the step count on the host)")
        if any(pp.state_dtype != "float32" for pp in gplans):
            why.append(f"rule '{g['rule']}' keeps its state in {gplans[0].state_dtype} (encoded anew each step)")
        if gplans[0].compensation != "none":
            why.append(f"rule '{g['rule']}' has compensation {gplans[0].compensation} (its bf16 weights are decoded "
                       f"into float32 tensors of their own each step, which a captured step cannot follow)")
    if why:
        raise ValueError("capturable=True cannot run this spec: " + "; ".join(why))
