"""Roles: what each tensor does in its model, so one spec routes any architecture.

A role is one of ``embedding``, ``head``, ``router``, ``expert``, ``norm``, ``bias``, ``hidden``
(a matrix of the body) and ``other`` (everything else: vectors, and tensors the forward uses only
elementwise, as a grouped convolution's kernel or as an indexed table). Rules match
it with ``match: {role: …}``. Each tensor also gets the **evidence** for its role, a **guessed**
flag (roles read from names and shapes only, as for a checkpoint) and a **structure** — what an
``auto`` matrix view reads (:mod:`geomopt.geometry.view`): ``{"batch": 1}`` for batched expert
weights (E, out, in) and for a stack a matmul multiplies matrix by matrix (``einsum`` over a
(3, 64, 64) tensor), ``{"blocks": [...]}`` for fused projections (sizes along the output axis: the
cuts of a layer's output, a weight split before its matmuls, two summed layers' gates).

From a model, roles are decided by what each tensor does in one traced forward (meta device
first, else one tiny forward that leaves the model as it was; inputs from ``example_inputs=``, the
model's ``example_inputs()`` or a Hugging Face config): the rules below the op families. Where no
trace runs (no inputs, a failing forward, sharded parameters) or the forward never reaches a
tensor, the module tree decides, and none of it is silent: ``GeomOptimizer`` warns once
(``RolesGuessedWarning``), ``plan``, ``explain`` and ``init`` say so, lint notes it (GO124).

Inference from the module tree: every registered *module rule* below, in order, claims modules of the
model; a parameter takes the role of the first claim on its owning module or an ancestor (the
module rules' docstrings are the documentation). Then, per parameter: a norm module's parameters
are ``norm``; otherwise a parameter named ``bias`` (``*_bias``, an RNN's ``bias_ih_l0``) is
``bias``; otherwise the claim; otherwise ``hidden`` (≥ 2 dims), except a grouped convolution's
kernel (a ``Conv*d`` with ``groups > 1``) and a single row or column, which are ``other`` like
vectors. A tensor tied under several names has the roles of each.

From names and shapes alone (a checkpoint, or a list of (name, tensor)): :func:`guess_roles`,
every role marked as a guess.

A spec's ``roles:`` (and ``roles=`` of the Python API) give tensors a role by name pattern, over
everything inferred.
"""

# The docstring above is also the text of `geomopt rule roles` (role_docs). The parts live by concept:
# the records (Role, Claim) in roles.types, inference from the module tree (the module rules) in
# roles.infer, a tensor's structure for the auto view in roles.structure, guessing from names and
# shapes in roles.guess, roles from the trace in roles.traced; this module overrides and assigns roles.

from __future__ import annotations

from typing import Optional

from geomopt.compile.match import ParamInfo, any_name, glob_regex
from geomopt.compile.roles.guess import guess_roles
from geomopt.compile.roles.infer import MODULE_RULES
from geomopt.compile.roles.types import ROLES, Role

__all__ = ["assign", "ensure_roles", "override", "role_docs"]


# ---------------------------------------------------------------- overrides and assignment


def override(roles: dict[str, Role], infos: list[ParamInfo], patterns: dict[str, list[str]], where: str) -> None:
    """Give the tensors matching ``patterns`` (role → name patterns, glob or ``re:``) that role,
    in place; ``where`` names the source in the evidence."""
    for role, pats in patterns.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        for pat in pats:
            fm = glob_regex(pat).fullmatch
            for p in infos:
                if any_name(fm, p):
                    old = roles.get(p.name)
                    roles[p.name] = Role((role,), f"{where}: {pat!r}", False, old.structure if old else None,
                                         basis=where)


def assign(infos: list[ParamInfo], roles: dict[str, Role]) -> None:
    """Store each tensor's role on its :class:`ParamInfo` (in place: infos are plain records)."""
    for p in infos:
        object.__setattr__(p, "role", roles.get(p.name))


def ensure_roles(infos: list[ParamInfo], spec_roles: Optional[dict] = None, extra: Optional[dict] = None) -> None:
    """Give every tensor without a role a guessed one, then apply the spec's ``roles:`` and the
    caller's ``roles=`` (in that order: the caller wins)."""
    missing = [p for p in infos if p.role is None]
    if not missing and not spec_roles and not extra:
        return  # roles inferred from the model, nothing to add
    roles = {p.name: p.role for p in infos if p.role is not None}
    if missing:
        roles.update(guess_roles(missing))
    if spec_roles:
        override(roles, infos, spec_roles, "spec roles")
    if extra:
        override(roles, infos, extra, "roles=")
    assign(infos, roles)


def role_docs() -> str:
    """The inference rules, for ``geomopt rule roles``."""
    # the tracer needs torch: off the lint path
    from geomopt.compile.roles import traced
    from geomopt.compile.trace.families import family_docs

    parts = [__doc__.strip(), (traced.__doc__ or "").strip(), "Op families (what the traced forward sees):",
             family_docs(), "Module rules, in order (without a trace, and beside it):"]
    for _, fn in MODULE_RULES:
        parts.append("  " + " ".join((fn.__doc__ or "").split()))
    parts.append("From names and shapes:\n" + "\n".join("  " + line.strip() for line in
                                                         (guess_roles.__doc__ or "").strip().splitlines()[1:]))
    return "\n\n".join(parts) + "\n"
