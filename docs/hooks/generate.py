"""MkDocs hook: the pages that are generated from the code, never written by hand.

* ``reference/*.md``, the language reference: every kind of every field of a spec, read from the
  pydantic models (:mod:`geomopt.spec.model` and the kinds' modules: docstring, fields, defaults, bounds) and the
  registries of the units that run them (forward and backward operators, approximations,
  references, directions, schedules, post-stages: each unit's docstring is its formula and its
  place in the paper). Each kind has an example: a tiny spec that uses it, printed by
  :func:`geomopt.spec.printers.dump_spec` in YAML and in the DSL, both parsed back here.
* ``lint/GOxxx.md``, one page per lint rule in ruff's form: what it does and why it is bad (the
  rule's docstring: its first sentence, then the rest of its description), an example and what to
  use instead (one of the rule's ``-fail`` / ``-pass`` fixture pairs in ``tests/lint_fixtures/``,
  each with what ``geomopt lint`` reports for it, led by the docstring's "Bad:" / "Fixed:" /
  "Example:" prose), and how to suppress it; and ``lint/index.md``, the table of every code (the
  language's GO0xx codes too).
* In hand-written pages, ``<!-- generated:layout -->`` becomes the table of geomopt's packages
  and modules, each with the first sentence of its docstring.

A kind, field or rule the generator cannot document (a required field with no example value, a
rule docstring without its parts, a rule without a fixture pair that fires and is fixed) fails the
build: ``mkdocs build --strict`` runs in CI.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import pkgutil
import re
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # document this checkout's geomopt, whatever else is installed
    sys.path.insert(0, str(ROOT))
import geomopt  # noqa: E402,F401  (imported now: MkDocs restores sys.path after loading a hook)

if Path(geomopt.__file__).resolve().parent != ROOT / "geomopt":
    raise ImportError(f"the docs of {ROOT} would document geomopt from {geomopt.__file__}")

# ---------------------------------------------------------------- text helpers

_ROLE = re.compile(r":(?:func|mod|data|class|meth|attr|obj):`~?([^`]+)`")


def _short(name: str, tilde: bool) -> str:
    return name.rsplit(".", 1)[-1] if tilde else name


def md(text: str, lang: str = "text") -> str:
    """A docstring (reST-ish) as Markdown: ``code`` and :role:`x` become code spans, ``*`` outside
    code is escaped (formulas such as ∇φ*(D) are not emphasis), ``::`` literal blocks are fenced."""
    text = inspect.cleandoc(text or "")
    text = re.sub(r":(?:func|mod|data|class|meth|attr|obj):`(~?)([^`]+)`",
                  lambda m: f"``{_short(m[2], bool(m[1]))}``", text)
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            head = line.rstrip()[:-1].rstrip()
            head = head[:-1] if head.endswith(":") else head
            if head.strip():
                out.append(_inline(head + ":"))
            i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            out += ["", f"```{lang}", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
            continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out).strip()


def _inline(line: str) -> str:
    parts = re.split(r"(``.+?``)", line)
    for k, part in enumerate(parts):
        if part.startswith("``") and part.endswith("``") and len(part) > 4:
            inner = part[2:-2]
            parts[k] = f"`` {inner} ``" if "`" in inner else f"`{inner}`"
        else:
            parts[k] = part.replace("*", r"\*")
    return "".join(parts)


_SENTENCE = re.compile(r"(.+?(?<!\be\.g)(?<!\bi\.e)(?<!\bcf)(?<!\bet al)(?<!\bvs)\.)(\s|$)")


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph (abbreviations such as "e.g." do not end it)."""
    text = " ".join(inspect.cleandoc(text or "").split("\n\n")[0].split())
    m = _SENTENCE.match(text)
    return m[1] if m else text


_PAPER = re.compile(r"\b(?:Theorem|Corollary|Remark|Appendix|Example|Table|Section|Proposition|Lemma)\s+"
                    r"(?:[A-Z](?:\.\d+)*|\d+(?:\.\d+)*)(?:\([ivx]+\))?")
_CITE = re.compile(r"\b(?:[A-Z][A-Za-z'-]+ et al\.|(?:[A-Z][A-Za-z'-]+, )*[A-Z][A-Za-z'-]+ & [A-Z][A-Za-z'-]+|Dao AI Lab) \d{4}\b")


def sources(*docs: str) -> tuple[list[str], list[str]]:
    """(places in the paper, other works cited) named by ``docs``, in order of first mention."""
    paper, cited = [], []
    for doc in (" ".join((d or "").split()) for d in docs):
        for m in _PAPER.finditer(doc or ""):
            if m[0] not in paper:
                paper.append(m[0])
        for m in _CITE.finditer(doc or ""):
            if m[0] not in cited:
                cited.append(m[0])
    return paper, cited


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    def cell(c) -> str:
        return str(c).replace("|", r"\|").replace("\n", " ")

    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(cell(c) for c in r) + " |" for r in rows)]


def flow(value) -> str:
    """A default value as the spec writes it."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f"`{value}`"
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in value.items()) + "}`"
    return f"`{json.dumps(value)}`"


# ---------------------------------------------------------------- registries


def _find(*candidates: tuple[str, str]):
    """The first registry that exists among (module, attribute) candidates: the registries move
    between modules; a build that finds none of them fails."""
    for module, attr in candidates:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, attr):
            return getattr(mod, attr)
    raise LookupError(f"no registry found among {candidates}: update docs/hooks/generate.py")


def registries() -> dict:
    """Every registry the reference reads, filled (the op modules register on import)."""
    import geomopt.geometry  # noqa: F401  (registers the forward and backward operators)
    from geomopt.geometry import operators as greg

    if not greg.FORWARD_OPS and hasattr(greg, "_load"):
        greg._load()
    return {
        "forward": greg.FORWARD_OPS,
        "backward": greg.BACKWARD_OPS,
        "approx": _find(("geomopt.geometry.spectral", "APPROX_OPS"), ("geomopt.geometry.matrix", "APPROX_OPS")),
        "reference": _find(("geomopt.geometry.reference", "REFERENCES")),
        "direction": _find(("geomopt.optim.units.directions", "DIRECTIONS")),
        "schedule": _find(("geomopt.optim.units.schedules", "SCHEDULES")),
        "stage": _find(("geomopt.optim.units.stages", "STAGES")),
    }


def lint_rules() -> dict:
    """The lint rules by code."""
    from geomopt.lint import RULES

    return dict(RULES)


def _meta(registry, key) -> dict:
    return (getattr(registry, "meta", None) or {}).get(key) or {}


def _unit_doc(unit) -> str:
    fn = getattr(unit, "fn", unit)  # a Stage record holds its function
    return inspect.getdoc(fn) or ""


def _qualname(unit) -> str:
    fn = getattr(unit, "fn", unit)
    return f"{fn.__module__}.{fn.__qualname__}"


# ---------------------------------------------------------------- the language reference


def _members(union) -> list:
    """The model classes of a discriminated union (``Annotated[Union[...], Field(...)]``)."""
    args = typing.get_args(union)
    inner = args[0] if args and typing.get_origin(union) is typing.Annotated else union
    return list(typing.get_args(inner))


def model_doc(model, inherited: bool = True) -> str:
    """The docstring of a spec model: its own, or (``inherited``) its nearest spec-language
    base's; never pydantic's ``BaseModel`` docstring."""
    for cls in model.__mro__ if inherited else (model,):
        if not cls.__module__.startswith("geomopt."):
            break
        doc = cls.__dict__.get("__doc__")
        if doc:
            return inspect.cleandoc(doc)
    return ""


#: The set each constraint kind names (its model says how it is computed, where it says more).
#: A new constraint kind needs a line here, or the build fails.
SETS = {
    "l2_ball": "{X : ‖X‖₂ ≤ r}, the entries as one vector: the same set as `frobenius_ball`",
    "linf_ball": "{X : max_ij |X_ij| ≤ r}",
    "linf_sphere": "{X : max_ij |X_ij| = r}",
    "sign_set": "{X : every X_ij = ±r}",
    "frobenius_ball": "{X : ‖X‖_F ≤ r}",
    "frobenius_sphere": "{X : ‖X‖_F = r}",
    "spectral_ball": "{X : σ_max(X) ≤ r}, per matrix of the geometry's view",
    "spectral_sphere": "{X : σ_max(X) = r}, per matrix of the geometry's view",
    "stiefel": "{X : every σ_i(X) = r} (r times a semi-orthogonal matrix), per matrix of the view",
    "l0": "{X : at most k nonzero entries}",
    "rank": "{X : rank X ≤ k}, per matrix of the view",
}


def _kind(model) -> str:
    return model.model_fields["kind"].default


class Category:
    def __init__(self, slug, title, field, union, intro, example, registry=None, extra=None):
        self.slug, self.title, self.field, self.union, self.intro = slug, title, field, union, intro
        self.example, self.registry, self.extra = example, registry, extra

    @property
    def models(self):
        return _members(self.union)


def categories():
    from geomopt.spec.constraints import Constraint
    from geomopt.spec.geometries import Approx, Geometry, Prenormalize, Reference, View
    from geomopt.spec.model import effective_prenormalize
    from geomopt.spec.updates import Decay, Direction, PostStage, STAGE_ORDER, Schedule

    return [
        Category("geometries", "Geometries", "geometry", Geometry,
                 "A rule's `geometry` is φ = ρ⋆φ₁: how its steps are measured. The forward (preconditioner) step is "
                 "Y = X − γ·ρ·∇φ₁\\*(D); each kind's operator below computes ρ·∇φ₁\\*(D).",
                 lambda k: _rule(geometry=_geometry(k)), "forward", _geometry_extra),
        Category("references", "References", "reference", Reference,
                 "A geometry's `reference` is the scalar function h that φ is built from (separable over entries, "
                 "of the norm, of the singular values, of row or column norms). The forward map needs (h\\*)'; the "
                 "backward step needs h itself.",
                 lambda k: _rule(geometry={"kind": "spectral", "reference": _filled(k)}), "reference"),
        Category("approximations", "Approximations", "approx", Approx,
                 "A spectral geometry's `approx`: how U·Diag((h\\*)'(σ))·Vᵀ is computed. The polynomial iterations "
                 "realize their own map (the κ = 4 power barrier, whatever the declared reference), pre-normalize by "
                 "default and run in bf16 on CUDA under `dtype: auto`.",
                 lambda k: _rule(geometry={"kind": "spectral", "reference": {"kind": "indicator"}, "approx": _filled(k)}),
                 "approx"),
        Category("prenormalize", "Pre-normalization", "prenormalize", Prenormalize,
                 md(effective_prenormalize.__doc__),
                 lambda k: _rule(geometry={"kind": "spectral", "reference": {"kind": "indicator"},
                                           "approx": {"kind": "newton_schulz" if k != "none" else "svd"},
                                           "prenormalize": _filled(k)})),
        Category("views", "Views", "view", View,
                 "A matrix geometry's `view` (spectral, rowwise, columnwise, anisotropic): how a tensor is read as "
                 "matrices; scale presets and constraints act per matrix of the view. `view: auto` is shorthand for "
                 "`view: {kind: auto}`. `geomopt rule views` prints the same.",
                 lambda k: _rule(geometry={"kind": "spectral", "reference": {"kind": "indicator"}, "view": _filled(k)})),
        Category("constraints", "Constraints", "constraint", Constraint,
                 "A rule's `constraint` is g, the set the tensor stays in (or a proximal decay). The backward "
                 "(proximal) step is X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y); which operator computes it depends on the "
                 "(geometry, constraint) pair: each kind lists the geometries it has an operator for.",
                 lambda k: _rule(geometry=_geometry(_constraint_geometry(k)), constraint=_filled(k)), None,
                 _constraint_extra),
        Category("directions", "Directions", "direction", Direction,
                 "A rule's (or the defaults') `direction`: the estimate d of the gradient the forward step maps.",
                 lambda k: _rule(direction=_filled(k)), "direction", _direction_extra),
        Category("decay", "Weight decay", "decay", Decay,
                 "A rule's (or the defaults') `decay`: how `weight_decay` λ is applied, after the post-stages and "
                 "before the constraint. `decay: cautious` is shorthand for `decay: {kind: cautious}`.",
                 lambda k: _rule(weight_decay=0.1, decay=_filled(k))),
        Category("post-stages", "Post-stages", "post", PostStage,
                 "A rule's `post`: stages applied to the geometry's update U = ∇φ₁\\*(D), in this order, each at "
                 "most once: " + ", ".join(f"`{s}`" for s in STAGE_ORDER) + ". They act with ρ = 1; the rule's "
                 "radius ρ multiplies what they give.",
                 lambda k: _rule(geometry={"kind": "spectral", "reference": {"kind": "indicator"},
                                           "approx": {"kind": "newton_schulz"}}, post=[_filled(k)]), "stage",
                 _stage_extra),
        Category("schedules", "Schedules", "schedule", Schedule,
                 "A rule's (or the defaults') `schedule`: the step size γ (and the direction's α) per step, as "
                 "multipliers of the group's `lr` (so any torch LR scheduler composes on top).",
                 lambda k: _rule(schedule=_filled(k)), "schedule"),
    ]


#: values for required fields in the generated examples; a new required field needs one here
REQUIRED_EXAMPLES = {
    ("l0", "k"): 16,
    ("rank", "k"): 8,
    ("proximal_decay", "lam"): 0.1,
    ("theory", "horizon"): 1000,
    ("theory", "gamma_bar"): 1.0,
}


def _model_of(kind: str, union):
    for model in _members(union):
        if _kind(model) == kind:
            return model
    raise KeyError(kind)


def _filled(kind: str, union=None) -> dict:
    """``{kind: …}`` with every required field given an example value."""
    from geomopt.spec.constraints import Constraint
    from geomopt.spec.geometries import Approx, Geometry, Prenormalize, Reference, View
    from geomopt.spec.updates import Decay, Direction, PostStage, Schedule

    model = None
    for u in ([union] if union is not None else [Geometry, Reference, Approx, Prenormalize, View,
                                                  Constraint, Direction, Decay, PostStage, Schedule]):
        try:
            model = _model_of(kind, u)
            break
        except KeyError:
            continue
    out = {"kind": kind}
    for name, field in model.model_fields.items():
        if name == "kind" or not field.is_required():
            continue
        if name == "reference":
            out[name] = {"kind": "log_barrier", "eps": 1e-8}
        elif (kind, name) in REQUIRED_EXAMPLES:
            out[name] = REQUIRED_EXAMPLES[(kind, name)]
        else:
            raise LookupError(f"no example value for the required field {name!r} of kind {kind!r}: add one to "
                              f"REQUIRED_EXAMPLES in docs/hooks/generate.py")
    return out


def _geometry(kind: str) -> dict:
    from geomopt.spec.geometries import Geometry

    return _filled(kind, Geometry)


def _constraint_geometry(kind: str) -> str:
    from geomopt.support import BACKWARD_PAIRS

    for g in ("spectral", "anisotropic", "euclidean", "isotropic", "rowwise", "columnwise"):
        if (g, kind) in BACKWARD_PAIRS:
            return g
    raise LookupError(f"no geometry has a backward op for constraint {kind!r}")


def _rule(**fields) -> dict:
    rule = {"name": "demo", "match": {"name": "**.weight", "ndim": 2}}
    rule.setdefault("geometry", None)
    rule.update(fields)
    if rule["geometry"] is None:
        rule["geometry"] = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}
    return {"geomopt": 1, "name": "example", "rules": [rule]}


def example(data: dict) -> tuple[str, str]:
    """(YAML, DSL) of a spec given as plain data, each printed by dump_spec and parsed back."""
    import yaml

    from geomopt.spec import dump_spec, parse_spec

    spec = parse_spec(yaml.safe_dump(data, sort_keys=False))
    text_yaml, text_dsl = dump_spec(spec, "yaml"), dump_spec(spec, "dsl")
    if parse_spec(text_yaml) != spec or parse_spec(text_dsl, "dsl") != spec:
        raise AssertionError(f"the example does not round-trip through YAML and the DSL: {data}")
    return text_yaml, text_dsl


def tabs(text_yaml: str, text_dsl: str) -> list[str]:
    def indent(text: str) -> list[str]:
        return ["    " + line if line else "" for line in text.rstrip("\n").splitlines()]

    return ['=== "YAML"', "", "    ```yaml", *indent(text_yaml), "    ```", "", '=== "DSL"', "",
            "    ```text", *indent(text_dsl), "    ```", ""]


# -- field tables

#: where each spec-language type is documented (pydantic model name → page)
def _type_pages() -> dict:
    pages = {}
    for cat in categories():
        for model in cat.models:
            pages[model.__name__] = (cat.slug, cat.field)
    pages.update(Match=("match", "match"), Defaults=("hyper-parameters", "defaults"),
                 Rule=("hyper-parameters", "rule"), MaxLogitClip=("hyper-parameters", "qk_clip"))
    return pages


def render_type(prop: dict, defs: dict, pages: dict, here: str, article: bool = True) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        if name in pages:
            slug, what = pages[name]
            return f"[{what}]({slug}.md)" if slug != here else what
        return name
    if "discriminator" in prop:
        names = [o["$ref"].rsplit("/", 1)[-1] for o in prop["oneOf"]]
        slug, what = pages.get(names[0], (None, "kind"))
        what = what if article else f"{what} stages" if what == "post" else f"{what}s"
        link = f"[{what}]({slug}.md)" if slug and slug != here else what
        return f"a {link}" if article else link
    if "anyOf" in prop:
        alts = [a for a in prop["anyOf"] if a.get("type") != "null"]
        return " or ".join(render_type(a, defs, pages, here) for a in alts)
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return " | ".join(f"`{v}`" for v in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        n_min, n_max = prop.get("minItems"), prop.get("maxItems")
        count = f"{n_min} " if n_min is not None and n_min == n_max else ""
        items = render_type(prop.get("items", {}), defs, pages, here, article=False)
        more = f" (≥ {n_min})" if n_min and n_min != n_max else ""
        return f"list of {count}{items}{more}"
    if kind == "object":
        values = prop.get("additionalProperties")
        return "mapping" + (f" to {render_type(values, defs, pages, here)}" if isinstance(values, dict) else "")
    if kind in ("number", "integer"):
        word = ("int" if kind == "integer" else "number") + ("" if article else "s")
        bounds = []
        for key, sym in (("exclusiveMinimum", ">"), ("minimum", "≥"), ("exclusiveMaximum", "<"), ("maximum", "≤")):
            if key in prop:
                bounds.append(f"{sym} {prop[key]:g}")
        return word + (" " + ", ".join(bounds) if bounds else "")
    if kind == "string":
        return ("string" if article else "strings") + (f" (pattern `{prop['pattern']}`)" if "pattern" in prop else "")
    if kind == "boolean":
        return "bool"
    return json.dumps(prop)


def field_rows(model, here: str, skip=("kind",)) -> list[list[str]]:
    schema = model.model_json_schema()
    defs, props, required = schema.get("$defs", {}), schema.get("properties", {}), set(schema.get("required", []))
    pages = _type_pages()
    rows = []
    for name, field in model.model_fields.items():
        if name in skip or name not in props:
            continue
        prop = props[name]
        if name in required:
            default = "required"
        elif field.default_factory is not None:
            default = flow(field.default_factory())
        else:
            default = flow(field.default)
        rows.append([f"`{name}`", render_type(prop, defs, pages, here), default, md(prop.get("description", ""))])
    return rows


def fields_table(model, here: str, skip=("kind",)) -> list[str]:
    rows = field_rows(model, here, skip)
    if not rows:
        return ["No fields besides `kind`.", ""]
    return [*table(["field", "type", "default", "notes"], rows), ""]


# -- per-category extras


def _geometry_extra(kind: str, regs: dict) -> list[str]:
    from geomopt.support import supported_constraints

    constraints = supported_constraints(kind)
    out = ["**Constraints with a backward operator**: "
           + (", ".join(f"[`{c}`](constraints.md#{c})" for c in constraints) if constraints else "none") + "."]
    loc = _meta(regs["forward"], kind).get("locality")
    if loc:
        out.append(f"**Distributed**: the forward operator is `{loc}` ([design](../design.md#distributed-localities)).")
    return out + [""]


def _constraint_extra(kind: str, regs: dict) -> list[str]:
    from geomopt.support import BACKWARD_PAIRS

    rows = []
    for (g, c), op in BACKWARD_PAIRS.items():
        if c != kind:
            continue
        meta = _meta(regs["backward"], (g, c)).get("locality")
        loc = meta(g, c) if callable(meta) else meta
        rows.append([f"[`{g}`](geometries.md#{g})", f"[`{op}`](#op-{op})"] + ([f"`{loc}`"] if loc else []))
    head = ["geometry", "backward operator"] + (["locality"] if rows and len(rows[0]) == 3 else [])
    return [*table(head, rows), ""]


def _direction_extra(kind: str, regs: dict) -> list[str]:
    """What a direction declares (``geomopt.optim.units.declare.DirectionUnit``): its state, the
    kind of state it moves as across a spec change, its forms and the forms it refuses."""
    unit = regs["direction"].get(kind)
    if unit is None:
        return []
    state = ", ".join(f"`{s.key}`" + (f" ({s.moment} moment)" if s.moment else f" ({s.layout})") for s in unit.state)
    out = ["**State**: " + (state or "none") + ("." if not unit.state else
           f"; carried across a spec change as `{unit.migrates}`." if unit.migrates else
           "; not carried across a spec change.")]
    forms = [f for f in ("flat", "rows") if unit.has(f)]
    out.append("**Forms**: stacked" + "".join(f", `{f}`" for f in forms) + ". " + " ".join(
        f"**Refused {form}**: {why}." for form, why in unit.refuses) + f" **Distributed**: `{unit.locality}`.")
    return out + [""]


def _stage_extra(kind: str, regs: dict) -> list[str]:
    stage = regs["stage"].get(kind)
    if stage is None:
        return []
    out = []
    state = getattr(stage, "state", ()) or _meta(regs["stage"], kind).get("state", ())
    reads = getattr(stage, "reads", ()) or _meta(regs["stage"], kind).get("reads", ())
    out.append("**State**: " + (", ".join(f"`{s}`" for s in state) if state else "none") + ". **Reads besides U**: "
               + (", ".join(f"`{r}`" for r in reads) if reads else "nothing") + ".")
    locality = getattr(stage, "locality", None) or _meta(regs["stage"], kind).get("locality")
    if callable(locality):
        from geomopt.spec.updates import PostStage

        model = _model_of(kind, PostStage)
        cfgs = [model().model_dump()]
        if "axis" in model.model_fields:
            cfgs = [model(axis=a).model_dump() for a in typing.get_args(model.model_fields["axis"].annotation)]
        locs = {(c.get("axis") or ""): locality(c) for c in cfgs}
        text = ", ".join(f"`{v}`" + (f" (axis `{a}`)" if a else "") for a, v in locs.items())
        out.append(f"**Distributed**: {text}.")
    elif locality:
        out.append(f"**Distributed**: `{locality}`.")
    return out + [""]


def category_page(cat: Category, regs: dict) -> str:
    lines = [f"# {cat.title}", "", "*Generated from the spec models (`geomopt.spec`) and the registries; do not edit.*", "",
             cat.intro, ""]
    kinds = [_kind(mdl) for mdl in cat.models]
    inherited = cat.slug != "constraints"  # a constraint's base class documents `relative`, not the set

    def summary(kind, mdl) -> str:
        if cat.slug == "constraints" and kind != "proximal_decay":
            if kind not in SETS:
                raise LookupError(f"constraint kind {kind!r} has no set in SETS (docs/hooks/generate.py)")
            return md(SETS[kind].replace("`", "``"))
        return md(first_sentence(model_doc(mdl, inherited)))

    lines += [*table(["kind", "summary"], [[f"[`{k}`](#{k})", summary(k, mdl)] for k, mdl in zip(kinds, cat.models)]), ""]
    if cat.slug == "constraints":
        from geomopt.spec.constraints import _Radius

        lines += ["Sets with a `radius` also take `relative`: " + md(model_doc(_Radius)), ""]
    for kind, model in zip(kinds, cat.models):
        lines += [f"## `{kind}` {{#{kind}}}", ""]
        if cat.slug == "constraints" and kind in SETS:
            lines += ["The set " + summary(kind, model) + ".", ""]
        model_text = model_doc(model, inherited)
        unit = regs[cat.registry].get(kind) if cat.registry else None
        if model_text:
            lines += [md(model_text), ""]
        unit_doc = _unit_doc(unit) if unit is not None else ""
        if unit is not None and unit_doc and unit_doc.strip() != model_text.strip():
            lines += [f"**Operator** (`{_qualname(unit)}`):", "", md(unit_doc), ""]
        paper, cited = sources(model_text, unit_doc)
        if paper or cited:
            lines += ["**Sources**: " + "; ".join(
                ([f"the paper: {', '.join(paper)}"] if paper else []) + ([", ".join(cited)] if cited else [])) + ".", ""]
        if cat.extra:
            lines += cat.extra(kind, regs)
        lines += fields_table(model, cat.slug)
        lines += ["**Example**", "", *tabs(*example(cat.example(kind)))]
    if cat.slug == "constraints":
        lines += backward_ops_section(regs)
    return "\n".join(lines).rstrip() + "\n"


def backward_ops_section(regs: dict) -> list[str]:
    from geomopt.support import BACKWARD_TABLE

    lines = ["## Backward operators", "",
             "One operator per row of the paper's Table 1; each serves the (geometry, constraint) pairs listed.", ""]
    by_name = {}
    for (g, c), op in regs["backward"].items():
        by_name.setdefault(op.__name__, op)
    for name, (geometries, constraints) in BACKWARD_TABLE.items():
        op = by_name.get(name)
        lines += [f"### `{name}` {{#op-{name}}}", "",
                  f"Geometries: {', '.join(f'`{g}`' for g in geometries)}; constraints: "
                  f"{', '.join(f'`{c}`' for c in constraints)}.", ""]
        if op is not None:
            lines += [md(_unit_doc(op)), ""]
    return lines


def match_page() -> str:
    from geomopt.compile.roles.assign import role_docs
    from geomopt.spec.model import Match, ROLE_NAMES

    lines = ["# Match and roles", "", "*Generated from `geomopt.spec.model` and `geomopt.compile.roles`; do not edit.*", "",
             md(model_doc(Match)), "",
             "`match: \"pattern\"` is shorthand for `match: {name: \"pattern\"}`. Rules are ordered: the first rule "
             "that matches a parameter owns it. Tied parameters are planned once; frozen ones are skipped.", "",
             *fields_table(Match, "match", skip=())]
    examples = [
        ("a glob on dotted names", {"name": "transformer.h.*.attn.*.weight"}),
        ("a regular expression (full match)", {"name": "re:layers\\.\\d+\\.mlp\\..*"}),
        ("the owning module's class (or a base class)", {"module": "Linear", "ndim": 2}),
        ("roles inferred from the model", {"role": ["hidden", "expert"]}),
        ("dimensions and shape", {"ndim": [3, 4], "shape": ["*", "*", 3, 3]}),
    ]
    for what, match in examples:
        data = {"geomopt": 1, "name": "example", "rules": [
            {"name": "demo", "match": match, "geometry": {"kind": "euclidean"}}]}
        lines += [f"**Example: {what}**", "", *tabs(*example(data))]
    roles = {"geomopt": 1, "name": "example", "roles": {"head": ["proj_out.weight"]},
             "rules": [{"name": "head", "match": {"role": "head"}, "geometry": {"kind": "adam"}},
                       {"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}}]}
    lines += ["## Roles", "", "Roles: " + ", ".join(f"`{r}`" for r in ROLE_NAMES) + ". A spec's `roles:` gives "
              "tensors a role by name pattern, over what is inferred:", "", *tabs(*example(roles)),
              "How roles are inferred (`geomopt rule roles` prints the same):", "", md(role_docs()), ""]
    return "\n".join(lines).rstrip() + "\n"


def hyper_page() -> str:
    from geomopt.spec.model import Defaults, Hyper, RESOLVED_DEFAULTS, Rule, Spec
    from geomopt.spec.updates import MaxLogitClip

    lines = ["# Spec, rules and hyper-parameters", "",
             "*Generated from `geomopt.spec.model`; do not edit.*", "",
             "## Spec {#spec}", "", md(model_doc(Spec)), "", *fields_table(Spec, "hyper-parameters", skip=()),
             "## Rule {#rule}", "", md(model_doc(Rule)), "", *fields_table(Rule, "hyper-parameters", skip=()),
             "### `qk_clip` {#qk_clip}", "", md(model_doc(MaxLogitClip)), "",
             "The guide: [QK-clip](../guide/qk-clip.md).", "", *fields_table(MaxLogitClip, "hyper-parameters"),
             "## Defaults {#defaults}", "", md(model_doc(Defaults)), "",
             "Each of these is a setting of `defaults` and of every rule (a rule's value overrides the default):", "",
             *fields_table(Hyper, "hyper-parameters", skip=()),
             "Unset everywhere, a setting takes its built-in value:", "",
             *table(["setting", "built-in"], [[f"`{k}`", flow(v)] for k, v in RESOLVED_DEFAULTS.items()]), ""]
    data = {"geomopt": 1, "name": "example", "description": "every hyper-parameter once",
            "defaults": {"lr": 0.02, "weight_decay": 0.1, "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": True},
                         "decay": {"kind": "decoupled"}, "schedule": {"kind": "constant"}, "on_nonfinite": "skip",
                         "project_on_init": True},
            "rules": [{"name": "hidden", "match": {"role": "hidden"},
                       "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
                       "lr": 0.01, "on_nonfinite": "raise"},
                      {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "lr": 0.001, "weight_decay": 0.0}]}
    lines += ["**Example**", "", *tabs(*example(data))]
    return "\n".join(lines).rstrip() + "\n"


def reference_index(cats) -> str:
    lines = ["# Language reference", "",
             "*Generated from the spec models (`geomopt.spec`) and the registries; do not edit.*", "",
             "A spec is ordered rules; each rule matches parameters and says how they step. One step of a rule runs, "
             "in this fixed order: **direction** → **geometry** (the forward map ∇φ₁\\*) → **post-stages** → "
             "**weight decay** → **constraint** (the prox). Every `{kind: …}` value below is one of the kinds its "
             "page lists; in the DSL a call `kind(a=…)` is the mapping `{kind: …, a: …}` and a bare word is "
             "`{kind: word}`.", "",
             *table(["field", "page", "kinds"],
                    [[f"`{c.field}`", f"[{c.title}]({c.slug}.md)", ", ".join(f"`{_kind(mdl)}`" for mdl in c.models)]
                     for c in cats]
                    + [["`match`, `roles`", "[Match and roles](match.md)", "–"],
                       ["`lr`, `weight_decay`, …", "[Spec, rules and hyper-parameters](hyper-parameters.md)", "–"]]),
             "", "The same language as a JSON Schema: `geomopt schema` (committed as `schema/geomopt-1.schema.json`).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- lint rules

_MARK = re.compile(r"(?<![\w`])(Bad|Fixed|Example|Inside the theory):")


def parse_rule_doc(doc: str) -> dict:
    """A rule docstring as its parts: ``what`` (the first sentence), ``why`` (the rest of the
    description) and ``parts``, the (label, Markdown) pairs of its "Bad:", "Fixed:", "Example:"
    (and "Inside the theory:") texts in order. A docstring without a "Bad:" or "Example:" part, or
    without a why, is an error."""
    text = md(doc, lang="yaml")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    desc, rest = [], []
    for p in paragraphs:
        (rest if rest or _MARK.match(p) else desc).append(p)
    body = "\n\n".join(rest)
    marks = list(_MARK.finditer(body))
    if not marks or marks[0].start() != 0 or marks[0][1] not in ("Bad", "Example"):
        raise ValueError(f"a lint rule's docstring needs a 'Bad:' or 'Example:' part after its description: {doc[:80]!r}")
    parts = []
    for k, mark in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(body)
        chunk = body[mark.end():end].strip()
        parts.append((mark[1].lower(), chunk[:1].upper() + chunk[1:]))
    first = " ".join(desc[0].split()) if desc else ""
    m = _SENTENCE.match(first)
    what = m[1] if m else first
    why = (first[len(what):].strip() + "\n\n" + "\n\n".join(desc[1:])).strip()
    if not why:
        raise ValueError(f"a lint rule's docstring needs a why after its first sentence (what): {doc[:80]!r}")
    return {"what": what, "why": why, "parts": parts}


# -- the examples: a rule's lint fixtures (tests/lint_fixtures/, checked by tests/test_lint_fixtures.py)

FIXTURES = ROOT / "tests" / "lint_fixtures"
_HEADER = re.compile(r"#\s*(?P<key>expect|absent|target|message|select|ignore)\s*:\s*(?P<value>.*?)\s*$")


class Example:
    """A lint fixture as a page shows it: the spec without its test header, what it is linted
    against (the header's ``target``) and what ``geomopt lint`` reports for it."""

    def __init__(self, path: Path):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        header, n = {}, 0
        while n < len(lines) and (h := _HEADER.match(lines[n])):
            header.setdefault(h["key"], h["value"])
            n += 1
        self.path, self.header = path, header
        self.body = "".join(lines[n:])
        self.target = header.get("target", "none")
        self.lang = "yaml" if path.suffix == ".yaml" else "text"
        self.findings = lint_example(self.body, path.suffix, self.target)
        self.codes = {d.code for d in self.findings}


def fixture_module():
    """tests/lint_fixtures/models.py: the fixtures' own small models (``FACTORIES``) and
    ``target_params``, what a fixture's ``# target:`` lints against."""
    spec = importlib.util.spec_from_file_location("lint_fixture_models", FIXTURES / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fixture_models() -> dict:
    """The fixtures' own small models (tests/lint_fixtures/models.py: ``FACTORIES``)."""
    return fixture_module().FACTORIES


def lint_example(text: str, suffix: str, target: str) -> list:
    """``geomopt lint``'s findings for a spec ``text`` shown as ``example.yaml`` (or ``.geom``)."""
    from geomopt.lint import lint_spec
    from geomopt.spec import parse_spec

    params, from_checkpoint = fixture_module().target_params(target)
    spec = parse_spec(text, "dsl" if suffix == ".geom" else "yaml", file=f"example{suffix}")
    return lint_spec(spec, params, from_checkpoint=from_checkpoint, text=text)


def _target_order(target: str) -> int:
    from geomopt.models import MODELS

    return 0 if target == "none" else 1 if target in MODELS else 2 if target.startswith("checkpoint") else 3


def rule_examples(code: str) -> tuple[Example, Example]:
    """(bad, fixed): the rule's ``CODE[-variant]-fail`` fixture and the ``-pass`` one of the same
    name, where the bad one reports the code, the fixed one does not and reports nothing the bad one
    did not. Of those pairs: one that changes the spec (not only the model it is linted against),
    then the fewest other findings, the plain variant, a spec linted alone before one linted
    against a built-in model, a checkpoint or a fixture's model, YAML before the DSL."""
    pairs = []
    for fail in sorted(FIXTURES.glob(f"{code}*-fail.*")):
        fixed = fail.with_name(fail.name.replace("-fail.", "-pass."))
        if not fixed.exists():
            continue
        bad, good = Example(fail), Example(fixed)
        if {"select", "ignore"} & (set(bad.header) | set(good.header)):
            continue  # a case of rule selection, not of the rule
        if code in bad.codes and code not in good.codes and good.codes <= bad.codes:
            variant = fail.name != f"{code}-fail{fail.suffix}"
            rank = (bad.body == good.body, len(bad.codes), variant, _target_order(bad.target), fail.suffix != ".yaml")
            pairs.append(((*rank, fail.name), bad, good))
    if not pairs:
        raise ValueError(f"{code}: no pair of fixtures in tests/lint_fixtures/ ({code}[-variant]-fail and -pass) where "
                         "the failing one reports the code and the passing one fixes it")
    _, bad, good = min(pairs, key=lambda t: t[0])
    return bad, good


def _linted(ex: Example) -> str:
    """How the example is linted, as the sentence before its findings."""
    target = ex.target
    if target == "none":
        how = "Linted alone (`geomopt lint example" + ex.path.suffix + "`)"
    elif _target_order(target) == 1:
        how = f"Linted against the built-in `{target}` model (`--model {target}`)"
    elif _target_order(target) == 2:
        shapes = ", ".join(f"`{n}` ({s.replace('x', '×')})" for n, s in (w.split("=", 1) for w in target.split()[1:]))
        how = f"Linted against a checkpoint of {shapes} (`--checkpoint`: names and shapes only)"
    else:
        doc = first_sentence(inspect.getdoc(fixture_models()[target]) or "")
        doc = _inline(re.sub(r"\s*\(GO\d{3}[^)]*\)|:\s*GO\d{3}(?=\))", "", doc))  # less the codes it is there for
        how = f"Linted against a model (`--model pkg.module:factory`): {doc[:1].lower() + doc[1:]}"
    return how.rstrip(".") + "."


def example_lines(ex: Example, lead: str = "") -> list[str]:
    """An example spec with what ``geomopt lint`` reports for it."""
    lines = [lead, ""] if lead else []
    lines += [f"```{ex.lang}", *ex.body.rstrip("\n").splitlines(), "```", ""]
    if not ex.findings:
        return lines + [f"{_linted(ex)} `geomopt lint` reports nothing.", ""]
    return lines + [f"{_linted(ex)} `geomopt lint` reports:", "", "```text",
                    *(d.format() for d in ex.findings), "```", ""]


def suppress_text(rule) -> str:
    code = rule.code
    blocking = _find(("geomopt.compile.blocking", "BLOCKING"))
    if code in blocking:
        return (f"It cannot be: {code} is a blocking error (compile refuses the spec), so a "
                f"`# geomopt: disable={code}` comment does not silence it and is itself reported (GO123). "
                f"`geomopt lint --ignore {code}` leaves it out of lint's report; compile still refuses the spec.")
    if code == "GO123":
        return ("`# geomopt: disable-file=GO123` anywhere in the spec silences it in the whole file; "
                "`geomopt lint --ignore GO123` (`lint_spec(…, ignore=\"GO123\")`) leaves the rule out of a run.")
    return (f"Add `# geomopt: disable={code}` (or `disable={rule.name}`) at the end of the line `geomopt lint` points "
            "to, or on a line of its own directly above it; text after the codes is free, e.g. a reason "
            f"(`# geomopt: disable={code} -- why`). `# geomopt: disable-file={code}` silences it in the whole file, "
            f"and `geomopt lint --ignore {code}` (`lint_spec(…, ignore=\"{code}\")`) leaves the rule out of a run.")


def rule_page(rule) -> str:
    parts = parse_rule_doc(rule.doc)
    bad, fixed = rule_examples(rule.code)
    prose = {"bad": "", "fixed": ""}
    extra = []
    for label, chunk in parts["parts"]:
        if "```" in chunk and label in ("bad", "fixed"):
            continue  # a sketch of the fixture's spec: the page shows the spec itself
        if label in ("bad", "example") and not prose["bad"]:
            prose["bad"] = chunk
        elif label == "fixed" and not prose["fixed"]:
            prose["fixed"] = chunk
        else:
            extra += [f"## {label[:1].upper() + label[1:]}", "", chunk, ""]
    needs = getattr(rule, "needs_model", False)
    sources = ", ".join(f"`{ex.path.relative_to(ROOT).as_posix()}`" for ex in (bad, fixed))
    lines = [f"# {rule.code} {rule.name}", "",
             f"*Generated from the rule's docstring (`geomopt rule {rule.code}` prints it) and its lint fixtures "
             f"({sources}); do not edit.*", "",
             f"**Severity**: {rule.severity}. **Runs**: "
             + ("only when linting against a model or a checkpoint (`--model`, `--checkpoint`)." if needs
                else "on the spec alone, and against a model."), "",
             "## What it does", "", parts["what"], "",
             "## Why is this bad?", "", parts["why"], "",
             "## Example", "", *example_lines(bad, prose["bad"]),
             "## Use instead", "",
             *(["The same spec: what differs is the model (the finding is about the model, not the spec).", ""]
               if fixed.body == bad.body else []),
             *example_lines(fixed, prose["fixed"]),
             *extra,
             "## How to suppress it", "", suppress_text(rule), ""]
    return "\n".join(lines).rstrip() + "\n"


def lint_index(rules: dict) -> str:
    from geomopt.spec.diagnostics import LANGUAGE_CODES

    lines = ["# Lint rules", "", "*Generated from the lint rules and the language's codes; do not edit.*", "",
             "`geomopt lint SPEC… [--model NAME | --checkpoint FILE]` reports `path:line:col: severity CODE message`. "
             "Exit status: 0 clean, 1 errors (or warnings with `--strict`), 2 usage error or unreadable input. "
             "`geomopt rule CODE` prints a rule's page in the terminal; `geomopt rule` lists them all.", "",
             "## Rules", "",
             *table(["code", "name", "severity", "needs a model", "what it does"],
                    [[f"[{r.code}]({r.code}.md)", f"`{r.name}`", r.severity, "yes" if getattr(r, "needs_model", False) else "no",
                      parse_rule_doc(r.doc)["what"]] for r in (rules[c] for c in sorted(rules))]),
             "", "## Language codes", "",
             "Errors of the language itself (the file does not parse, or does not validate), reported with the "
             "file, line and column of the value:", "",
             *table(["code", "name", "meaning"],
                    [[c, f"`{n}`", d[0].upper() + d[1:] + "."] for c, (n, d) in LANGUAGE_CODES.items()]),
             ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- layout


def module_doc(path: Path) -> str:
    try:
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (SyntaxError, OSError):
        return ""


def layout() -> str:
    """Packages and modules of geomopt, with the first sentence of each docstring."""
    pkg = ROOT / "geomopt"
    rows = []
    for info in sorted(pkgutil.walk_packages([str(pkg)], "geomopt."), key=lambda i: i.name):
        if info.name.rsplit(".", 1)[-1].startswith("_") and not info.ispkg:
            continue
        rel = info.name.split(".")[1:]
        path = pkg.joinpath(*rel, "__init__.py") if info.ispkg else pkg.joinpath(*rel[:-1], rel[-1] + ".py")
        doc = module_doc(path)
        name = f"**`{info.name}`**" if info.ispkg else f"`{info.name}`"
        rows.append([name, md(first_sentence(doc)) if doc else ""])
    top = [["**`geomopt`**", md(first_sentence(module_doc(pkg / "__init__.py")))]]
    return "\n".join(table(["module", "what it holds"], top + rows))


# ---------------------------------------------------------------- pages and the hook


def pages() -> dict[str, str]:
    """Every generated page: path under docs/ → Markdown."""
    regs = registries()
    cats = categories()
    out = {"reference/index.md": reference_index(cats)}
    for cat in cats:
        out[f"reference/{cat.slug}.md"] = category_page(cat, regs)
    out["reference/match.md"] = match_page()
    out["reference/hyper-parameters.md"] = hyper_page()
    rules = lint_rules()
    out["lint/index.md"] = lint_index(rules)
    for code in sorted(rules):
        out[f"lint/{code}.md"] = rule_page(rules[code])
    return out


REFERENCE_NAV = ["index", "geometries", "references", "approximations", "prenormalize", "views", "constraints",
                 "directions", "decay", "post-stages", "schedules", "match", "hyper-parameters"]

_PAGES: dict[str, str] = {}


def on_config(config):
    """Fill the nav's "Language reference" and "Lint rules" sections with the generated pages (the
    reference's hand-written pages, listed in mkdocs.yml, after them)."""
    _PAGES.clear()
    _PAGES.update(pages())
    rules = sorted(p for p in _PAGES if p.startswith("lint/GO"))
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Language reference" in item:
            written = item["Language reference"] or []
            item["Language reference"] = [f"reference/{p}.md" for p in REFERENCE_NAV] + written
        if isinstance(item, dict) and "Lint rules" in item:
            item["Lint rules"] = ["lint/index.md", *rules]
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, text in _PAGES.items():
        files.append(File.generated(config, path, content=text))
    for png in sorted((ROOT / "examples" / "results").glob("*.png")):  # the examples' committed plots
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- generated:layout -->" in markdown:
        markdown = markdown.replace("<!-- generated:layout -->", layout())
    return markdown
