"""The compiled plan: one :class:`ParamPlan` per tensor, grouped into buckets.

Everything here is resolved and frozen (the spec's typed models with their defaults filled and
their per-tensor values resolved: :mod:`geomopt.compile.fragments`; floats): the optimizer executes
a plan without looking at the spec again. The resolution itself (layout, view, radius, relative
constraints, pre-normalization) is :mod:`geomopt.compile.resolve`, shared with the functional API.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from geomopt.compile.fragments import ResolvedGeometry, plain
from geomopt.spec.constraints import Constraint
from geomopt.spec.updates import Direction, MaxLogitClip, PostStage, Schedule
from geomopt.support import MATRIX_GEOMETRIES

@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """How one tensor is optimized.

    ``geometry``/``constraint``/``direction``/``schedule`` (and each of ``post``) are the spec's
    frozen models with every default filled in (the geometry's ``prenormalize``, ``layout`` and
    ``view`` resolved for this tensor: :func:`geomopt.compile.resolve.resolve`); ``radius`` is the
    geometry's radius times its scale preset for this shape; ``transpose`` means the ops act on the
    transposed tensor (``layout: in_out``, e.g. Hugging Face Conv1D). A plan is frozen: edit one
    with ``dataclasses.replace``, which computes its ``bucket`` again.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    rule: str
    rule_index: int
    geometry: ResolvedGeometry
    constraint: Optional[Constraint]
    direction: Direction
    schedule: Schedule
    lr: float
    weight_decay: float
    radius: float
    transpose: bool
    on_nonfinite: str
    project_on_init: bool
    aliases: tuple[str, ...] = ()
    role: str = ""  # the tensor's role(s) ("" when the plan did not read roles)
    post: tuple[PostStage, ...] = ()  # the rule's post-stages, in run order
    decay: str = "decoupled"  # weight decay: decoupled or cautious
    #: the rule's QK-clip after the step (``{kind: max_logit, tau, alpha}``; geomopt.optim.engine.qkclip), or None
    qk_clip: Optional[MaxLogitClip] = None
    #: the precision its state is kept in between steps: float32, bfloat16 or int8 (geomopt.optim.persist.state_codec)
    state_dtype: str = "float32"
    #: what is kept of a bfloat16 parameter's rounding error: none, int8 or int16 (geomopt.optim.units.compensation)
    compensation: str = "none"
    #: the precision a learned metric's factors are kept in: float32 or bfloat16 (the rule's ``state: {factors: …}``)
    factor_dtype: str = "float32"
    #: tensors with equal keys run as one batched call: same rule, operators, op shape, dtype and
    #: device (computed at construction, from ``ops`` where the planner passes it)
    bucket: str = dataclasses.field(init=False, compare=False)
    #: the digest of (geometry, constraint, radius, transpose, post) when the caller has it (the
    #: planner computes it once per rule and shape); None: computed here
    ops: dataclasses.InitVar[Optional[str]] = None

    def __post_init__(self, ops: Optional[str]) -> None:
        if ops is None:
            ops = ops_digest(self.geometry, self.constraint, self.radius, self.transpose, self.post)
        object.__setattr__(self, "bucket", f"{self.rule_index}|{ops}|{self.op_shape}|{self.dtype}|{self.device}")

    @property
    def matrix_cost(self) -> Optional[float]:
        """Σ m·n·min(m, n) over the matrices of the tensor's view (None without a view): the
        distributed executors' work estimate. Computed once."""
        if "_cost" not in self.__dict__:
            from geomopt.geometry.view import cost  # geomopt.geometry loads torch: off the lint path

            object.__setattr__(self, "_cost", cost(self.geometry.view, self.op_shape))
        return self.__dict__["_cost"]

    @property
    def radius_factor(self) -> float:
        """The tensor's factor on its group's radius: its scale preset for this shape (ρ = the group's
        radius × factor)."""
        return self.radius / self.geometry.radius

    @property
    def op_shape(self) -> tuple[int, ...]:
        """The shape the operators see (transposed for ``layout: in_out``)."""
        if self.transpose and len(self.shape) >= 2:
            return (self.shape[1], self.shape[0], *self.shape[2:])
        return self.shape


def ops_digest(geometry, constraint, radius: float, transpose: bool, post: tuple = ()) -> str:
    """A short digest of what a tensor's operators compute (equal for equal fragments)."""
    text = json.dumps([plain(geometry), plain(constraint), radius, transpose, plain(post)], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclasses.dataclass
class Plan:
    params: list[ParamPlan]
    frozen: list[str] = dataclasses.field(default_factory=list)
    spec_name: str = ""

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, name: str) -> ParamPlan:
        """The plan of a tensor by any of its names."""
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def buckets(self) -> dict[str, list[ParamPlan]]:
        out: dict[str, list[ParamPlan]] = {}
        for p in self.params:
            out.setdefault(p.bucket, []).append(p)
        return out

    def summary(self) -> list[dict]:
        """One row per rule: tensors, elements, geometry, approx, constraint."""
        rows: dict[str, dict] = {}
        for p in self.params:
            r = rows.setdefault(p.rule, dict(rule=p.rule, tensors=0, elements=0, geometry=geometry_text(p),
                                             constraint=p.constraint, lr=p.lr, _methods=set()))
            r["tensors"] += 1
            n = 1
            for d in p.shape:
                n *= d
            r["elements"] += n
            r["_methods"].update(resolved_methods(p))
        for r in rows.values():  # a rule's tensors may resolve method: auto differently (sizes)
            r["constraint"] = _constraint_text(r["constraint"], r.pop("_methods"))
        return list(rows.values())

    def table(self) -> str:
        """A text table: one line per tensor."""
        bucket_ids = {k: i for i, k in enumerate(self.buckets())}
        head = ("parameter", "shape", "role", "rule", "geometry", "view", "constraint", "lr", "radius", "bucket")
        rows = [head]
        for p in self.params:
            name = p.name + (f" (= {', '.join(p.aliases)})" if p.aliases else "")
            rows.append((name, "×".join(map(str, p.shape)) or "scalar", p.role or "-", p.rule, geometry_text(p),
                         view_text(p), constraint_text(p), f"{p.lr:g}",
                         f"{p.radius:.4g}" + (" ᵀ" if p.transpose else ""), str(bucket_ids[p.bucket])))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        tail = f"{len(self.params)} tensors in {len(bucket_ids)} buckets"
        if self.frozen:
            tail += (f"; {len(self.frozen)} frozen (skipped): {', '.join(self.frozen[:5])}"
                     + (" …" if len(self.frozen) > 5 else ""))
        return "\n".join(lines + [tail])


def view_text(p: ParamPlan) -> str:
    """The matrices the operators see: "4 × 256×64" (experts), "3 × 64×64" (fused blocks),
    "64×576" (a conv kernel as one matrix); "-" for geometries that read no matrix."""
    if p.geometry.kind not in (*MATRIX_GEOMETRIES, "anisotropic") or len(p.shape) < 2:
        return "-"
    from geomopt.geometry.view import describe  # geomopt.geometry loads torch: off the lint path

    return describe(p.geometry.view, p.op_shape)


def call_text(fragment) -> str:
    """``kind(field=value, …)`` of a fragment's scalar fields (defaults that say nothing left out)."""
    if not fragment:
        return "-"
    d = plain(fragment)
    quiet = {("relative", False), ("dtype", "auto")}  # defaults say nothing
    args = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()
            if k != "kind" and not isinstance(v, (dict, list)) and v is not None and (k, v) not in quiet]
    return f"{d['kind']}({', '.join(args)})" if args else d["kind"]


def geometry_text(p: ParamPlan) -> str:
    g = p.geometry
    text = g.kind
    if "reference" in g:
        text += f"[{call_text(g['reference'])}]"
    if "method" in g:  # a learned metric's method (kronecker: shampoo or soap)
        text += f"[{g['method']}]"
    if g.approx is not None:
        # a named coefficient set is shown, a list of triples is not (too long for the line)
        approx = {k: v for k, v in plain(g.approx).items() if k != "coefficients" or isinstance(v, str)}
        text += f" via {call_text(approx)}"
    if p.post:
        text += " + " + " + ".join(s.kind for s in p.post)
    return text


def resolved_methods(p: ParamPlan) -> list[str]:
    """What ``method: auto`` of the tensor's constraint runs as on its device, per distinct matrix
    shape of its view (:func:`geomopt.geometry.method.resolve_method`, the backward step's own
    rule); [] when the constraint has no auto method. Only the spectral geometry's step reads
    ``method`` (the others' projections are exact)."""
    c = p.constraint
    if not c or c.get("method") != "auto":
        return []
    if p.geometry.kind != "spectral":
        return ["exact"]
    # geomopt.geometry loads torch: off the lint path
    from geomopt.geometry.method import resolve_method
    from geomopt.geometry.view import matrix_shapes

    return sorted({resolve_method(c, p.device, s) for s in matrix_shapes(p.geometry.view, p.op_shape)})


def constraint_text(p: ParamPlan) -> str:
    """The tensor's constraint as a call, ``method=auto→exact`` (or ``→polar``) saying what auto
    resolves to on the tensor's device."""
    return _constraint_text(p.constraint, resolved_methods(p))


def _constraint_text(c: Optional[Constraint], methods=()) -> str:
    if c and c.get("method") == "auto":
        return call_text({**plain(c), "method": "auto" + ("→" + "/".join(sorted(methods)) if methods else "")})
    return call_text(c)
