"""The compiled plan: one :class:`ParamPlan` per tensor, grouped into buckets.

Everything here is resolved and plain (dicts of spec fragments, floats): the optimizer executes a
plan without looking at the spec again.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from geomopt.compile.match import ParamInfo


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """How one tensor is optimized.

    ``geometry``/``constraint``/``direction``/``schedule`` (and each of ``post``) are plain spec fragments with defaults
    filled in (``prenormalize`` and ``layout`` resolved); ``radius`` is the geometry's radius times
    its scale preset for this shape; ``transpose`` means the ops act on the transposed tensor
    (``layout: in_out``, e.g. Hugging Face Conv1D).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    rule: str
    rule_index: int
    geometry: dict
    constraint: Optional[dict]
    direction: dict
    schedule: dict
    lr: float
    weight_decay: float
    radius: float
    transpose: bool
    on_nonfinite: str
    project_on_init: bool
    aliases: tuple[str, ...] = ()
    role: str = ""  # the tensor's role(s) ("" when the plan did not read roles)
    post: tuple = ()  # the rule's post-stages (spec fragments, in run order)
    decay: str = "decoupled"  # weight decay: decoupled or cautious

    @property
    def bucket(self) -> str:
        """Tensors with equal keys run as one batched call: same rule, ops, shape, dtype, device."""
        key = self.__dict__.get("_bucket")
        if key is None:  # computed once (the compiler seeds it from a per-rule cache)
            key = bucket_key(self.rule_index, ops_key(self.geometry, self.constraint, self.radius, self.transpose),
                             self.op_shape, self.dtype, self.device)
            object.__setattr__(self, "_bucket", key)
        return key

    @property
    def matrix_cost(self) -> Optional[float]:
        """Σ m·n·min(m, n) over the matrices of the tensor's view (None without a view): the
        distributed executors' work estimate. Computed once."""
        if "_cost" not in self.__dict__:
            from geomopt.geometry.view import cost

            object.__setattr__(self, "_cost", cost(self.geometry.get("view"), self.op_shape))
        return self.__dict__["_cost"]

    @property
    def approx(self) -> Optional[dict]:
        return self.geometry.get("approx")

    @property
    def op_shape(self) -> tuple[int, ...]:
        """The shape the operators see (transposed for ``layout: in_out``)."""
        if self.transpose and len(self.shape) >= 2:
            return (self.shape[1], self.shape[0], *self.shape[2:])
        return self.shape


def ops_key(geometry: dict, constraint: Optional[dict], radius: float, transpose: bool) -> str:
    return json.dumps([geometry, constraint, radius, transpose], sort_keys=True)


def bucket_key(rule_index: int, ops: str, op_shape: tuple[int, ...], dtype: str, device: str) -> str:
    return f"{rule_index}|{ops}|{op_shape}|{dtype}|{device}"


def op_layout(geometry: dict, p: ParamInfo) -> tuple[dict, bool, tuple[int, ...]]:
    """(geometry as the ops see it, transpose, op_shape) for tensor ``p``.

    ``layout: in_out`` (and ``auto`` on a Hugging Face ``Conv1D``, which stores (d_in, d_out))
    means the ops act on the transposed tensor, so the geometry they receive says ``out_in``."""
    layout = geometry.get("layout", "out_in")
    if layout == "auto":
        layout = "in_out" if p.modules and "Conv1D" in p.modules else "out_in"
    transpose = layout == "in_out" and len(p.shape) >= 2
    if "layout" in geometry and geometry["layout"] != "out_in":
        geometry = {**geometry, "layout": "out_in"}
    shape = p.shape
    return geometry, transpose, ((shape[1], shape[0], *shape[2:]) if transpose else shape)


def resolve_view(geometry: dict, op_shape: tuple[int, ...], structure: Optional[dict],
                 constraint: Optional[dict] = None) -> dict:
    """The geometry with its spec ``view`` resolved for one tensor (:func:`geomopt.geometry.view.resolve`;
    ``structure`` from the tensor's role), block radius factors and whether a ``relative``
    constraint scales with them. Raises ValueError when the view does not fit."""
    spec_view = geometry.get("view")
    if spec_view is None or "kind" not in spec_view:
        return geometry
    from geomopt.geometry.scale import block_factors
    from geomopt.geometry.view import resolve

    view = resolve(spec_view, op_shape, structure)
    if view is not None:
        view["factors"] = block_factors(geometry, op_shape, view)
        if view["factors"] and constraint is not None and constraint.get("relative"):
            view["scale_constraint"] = True
    return {**geometry, "view": view}


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
            r = rows.setdefault(p.rule, dict(rule=p.rule, tensors=0, elements=0, geometry=_geometry_text(p),
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
            rows.append((name, "×".join(map(str, p.shape)) or "scalar", p.role or "-", p.rule, _geometry_text(p),
                         view_text(p), constraint_text(p), f"{p.lr:g}",
                         f"{p.radius:.4g}" + (" ᵀ" if p.transpose else ""), str(bucket_ids[p.bucket])))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        tail = f"{len(self.params)} tensors in {len(bucket_ids)} buckets"
        if self.frozen:
            tail += f"; {len(self.frozen)} frozen (skipped): {', '.join(self.frozen[:5])}" + (" …" if len(self.frozen) > 5 else "")
        return "\n".join(lines + [tail])


def view_text(p: ParamPlan) -> str:
    """The matrices the operators see: "4 × 256×64" (experts), "3 × 64×64" (fused blocks),
    "64×576" (a conv kernel as one matrix); "-" for geometries that read no matrix."""
    if p.geometry["kind"] not in ("spectral", "rowwise", "columnwise", "anisotropic") or len(p.shape) < 2:
        return "-"
    from geomopt.geometry.view import describe

    return describe(p.geometry.get("view"), p.op_shape)


def _call_text(d: Optional[dict]) -> str:
    if not d:
        return "-"
    quiet = {("relative", False), ("dtype", "auto")}  # defaults say nothing
    args = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()
            if k != "kind" and not isinstance(v, (dict, list)) and v is not None and (k, v) not in quiet]
    return f"{d['kind']}({', '.join(args)})" if args else d["kind"]


def _geometry_text(p: ParamPlan) -> str:
    g = p.geometry
    text = g["kind"]
    if "reference" in g:
        text += f"[{_call_text(g['reference'])}]"
    if g.get("approx") is not None:
        text += f" via {_call_text({k: v for k, v in g['approx'].items() if k != 'coefficients'})}"
    if p.post:
        text += " + " + " + ".join(s["kind"] for s in p.post)
    return text


def resolved_methods(p: ParamPlan) -> list[str]:
    """What ``method: auto`` of the tensor's constraint runs as on its device, per distinct matrix
    shape of its view (:func:`geomopt.geometry.method.resolve_method`, the backward step's own
    rule); [] when the constraint has no auto method. Only the spectral geometry's step reads
    ``method`` (the others' projections are exact)."""
    c = p.constraint
    if not c or c.get("method") != "auto":
        return []
    if p.geometry["kind"] != "spectral":
        return ["exact"]
    from geomopt.geometry.method import resolve_method
    from geomopt.geometry.view import matrix_shapes

    return sorted({resolve_method(c, p.device, s) for s in matrix_shapes(p.geometry.get("view"), p.op_shape)})


def constraint_text(p: ParamPlan) -> str:
    """The tensor's constraint as a call, ``method=auto→exact`` (or ``→polar``) saying what auto
    resolves to on the tensor's device."""
    return _constraint_text(p.constraint, resolved_methods(p))


def _constraint_text(c: Optional[dict], methods=()) -> str:
    if c and c.get("method") == "auto":
        return _call_text({**c, "method": "auto" + ("→" + "/".join(sorted(methods)) if methods else "")})
    return _call_text(c)
