"""Roles from a traced forward (:mod:`geomopt.compile.trace`), over the module tree's.

Per tensor, what the trace saw decides (:func:`traced_role`):

* a lookup table is ``embedding``;
* a matrix operand (``matmul``, a full ``conv``) whose layer produces a prediction output with no
  parameterized layer after it is a ``head``; one that is a stem reading the model's raw input
  (a patchifying or 1-D convolution; a layer the module tree calls an embedding) is an
  ``embedding``; any other is a matrix of the body: the module tree's ``hidden``, ``expert`` or
  ``router``, else ``hidden``;
* a grouped convolution's kernel, an indexed table and a tensor used only elementwise are never a
  matrix role: the module tree's ``norm``, ``bias``, ``embedding`` or ``other`` where it says so
  (an elementwise use agrees with those), else ``other``.

A tensor of fewer than 2 dims, and a ``hidden`` one of a single row or column (a learned query
(1, 1, d) multiplied into a layer), is never a matrix: the module tree's role where it agrees
with an elementwise use, else ``other``. A tied tensor takes every role its uses give it
(``embedding+head``). Where the trace and the
module tree disagree the trace wins and the role keeps the module tree's verdict beside it
(``explain`` shows both, with the op that decided). A tensor the forward never reached keeps the
module tree's role, marked so. A layer's output cut into blocks (:mod:`geomopt.compile.trace`)
gives the weight's ``blocks``, over the attention-module heuristics, and a matmul that multiplies
a ≥ 3-D tensor matrix by matrix gives its ``batch``; the evidence names the ops the view came from.
"""

from __future__ import annotations

from typing import Optional

from geomopt.compile.match import ParamInfo
from geomopt.compile.roles.types import ROLES, Role, not_a_matrix
from geomopt.compile.trace.forward import TensorTrace, Trace

MATRIX_ROLES = frozenset({"hidden", "expert", "router", "head"})
_AGREES_ELEMENTWISE = frozenset({"norm", "bias", "embedding", "other"})
_BODY = ("expert", "router", "hidden")


def _op(use) -> str:
    return use.op.removeprefix("aten.") + (f", {use.detail}" if use.detail else "")


def traced_role(t: TensorTrace, inferred: Role) -> tuple[tuple[str, ...], str]:
    """(roles, evidence) for one tensor the trace reached."""
    roles: list[str] = []
    why: list[str] = []
    uses = t.uses
    if "lookup" in uses:
        roles.append("embedding")
        why.append(f"looked up ({_op(uses['lookup'])})")
    matrix = uses.get("matmul") or uses.get("conv")
    if matrix is not None:
        if t.head:
            roles.append("head")
            why.append(f"its layer ({_op(matrix)}) produces the output '{t.head}' with no parameterized layer after it")
        elif t.stem in ("patch", "audio") or (t.reads_input and "embedding" in inferred.roles):
            roles.append("embedding")
            kind = {"patch": "a patch stem", "audio": "an audio stem"}.get(t.stem or "", "an input layer")
            why.append(f"{kind}: {_op(matrix)} reads the model's raw input")
        else:
            body = next((r for r in _BODY if r in inferred.roles), "hidden")
            roles.append(body)
            what = f"a matrix operand ({_op(matrix)})" if "matmul" in uses else f"a convolution kernel ({_op(matrix)})"
            why.append(what + (f"; {inferred.evidence}" if body != "hidden" else ""))
    if roles:
        return tuple(r for r in ROLES if r in roles), "; ".join(why)
    use = uses.get("grouped_conv") or uses.get("indexed") or uses.get("elementwise")
    assert use is not None  # a reached tensor has a use
    what = {"grouped_conv": f"a grouped convolution's kernel ({_op(use)})",
            "indexed": f"an indexed table: rows gathered by index, then only elementwise ({_op(use)}); "
                       f"looked up, not a matrix",
            "elementwise": f"used only elementwise ({_op(use)})"}[use.family]
    if set(inferred.roles) <= _AGREES_ELEMENTWISE:
        return inferred.roles, f"{inferred.evidence}; traced: {what}"
    return ("other",), what


def _rows(p: ParamInfo, structure: Optional[dict]) -> int:
    """The weight's output count along which blocks lie (its rows in the operators' layout)."""
    shape = p.shape
    batch = (structure or {}).get("batch", 0)
    if (structure or {}).get("layout") == "in_out":
        return shape[batch + 1]
    conv1d = bool(p.modules and "Conv1D" in p.modules)
    return shape[batch + 1] if conv1d and len(shape) == batch + 2 else shape[batch]


def _expand(blocks, rows: int) -> Optional[list[int]]:
    if blocks is None:
        return None
    return [rows // blocks] * blocks if isinstance(blocks, int) else list(blocks)


def traced_structure(p: ParamInfo, t: TensorTrace, roles: tuple[str, ...], inferred: Optional[dict]) -> Optional[dict]:
    """The structure an ``auto`` view reads, with the trace's blocks over the inferred ones."""
    if not set(roles) & {"hidden", "expert"} or len(p.shape) < 2:
        return inferred
    base = dict(inferred or {"batch": 0})
    if t.batch and not base.get("batch") and len(p.shape) >= t.batch + 2:
        base["batch"] = t.batch  # the matrices a matmul's contraction shows (einsum over a stack)
    rows = _rows(p, base)
    blocks = t.blocks if t.blocks is not None and sum(t.blocks) == rows else None
    if blocks is None:
        base.pop("blocks", None)
    elif _expand(base.get("blocks"), rows) != blocks:
        base["blocks"] = blocks
    if base == {"batch": 0}:
        return None
    return base


def apply_trace(infos: list[ParamInfo], inferred: dict[str, Role], trace: Trace) -> dict[str, Role]:
    """Roles of ``infos`` from ``trace`` over the module tree's ``inferred`` roles."""
    out: dict[str, Role] = {}
    for p in infos:
        inf = inferred[p.name]
        t = trace.tensors.get(p.name)
        if t is None or not t.reached:
            out[p.name] = Role(inf.roles, inf.evidence, False, inf.structure, basis="module tree",
                               untraced=f"the traced forward ({trace.device}) never reached it")
            continue
        roles, evidence = traced_role(t, inf)
        flat = "a vector" if len(p.shape) < 2 else not_a_matrix(p.shape) if roles == ("hidden",) else None
        if flat and set(roles) & MATRIX_ROLES:  # a vector scaling a matrix (weight norm's g), a learned query
            roles, evidence = (inf.roles, f"{inf.evidence}; traced: {evidence}") if (
                set(inf.roles) <= _AGREES_ELEMENTWISE) else (("other",), f"{flat}; traced: {evidence}")
        structure = traced_structure(p, t, roles, inf.structure if set(roles) & MATRIX_ROLES else None)
        if structure and t.view_ops and ((t.blocks and structure.get("blocks") == t.blocks)
                                         or (t.batch and structure.get("batch") == t.batch)):
            evidence += f"; view from use: {', '.join(t.view_ops)}"
        differs = set(roles) != set(inf.roles)
        out[p.name] = Role(roles, evidence, False, structure, basis="trace",
                           inferred=f"{inf.name}: {inf.evidence}" if differs else None)
    return out


def untraced(inferred: dict[str, Role], why: str) -> dict[str, Role]:
    """The module tree's roles, each marked as decided without a trace and why."""
    return {n: Role(r.roles, r.evidence, r.guessed, r.structure, basis=r.basis, untraced=why)
            for n, r in inferred.items()}
