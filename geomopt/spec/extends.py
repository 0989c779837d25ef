"""Spec inheritance (``extends``) and presets (shipped specs by name).

A spec may start from another: ``extends: muon`` names a shipped spec (a file stem in
``specs/``: :func:`shipped_specs`), ``extends: ../base.yaml`` a file (a relative path
resolves against the extending file's directory; against the working directory for a spec given
as text or as a dict). A bare word (no ``/``, no extension) is always a shipped name; anything
else is a path. A base may itself extend; it need not be a whole spec on its own.

:func:`resolve` merges the plain data of the base (resolved first) and of the child *before*
validation, carrying each value's position along, so the merged mapping is validated exactly as a
written spec is and every diagnostic points at the file, line and column its value came from.

Merge rules (the child wins):

* ``geomopt``, ``name`` and ``description`` belong to each file and are never inherited
  (``geomopt`` and ``name`` are required in the child as in any spec).
* ``defaults`` merge setting by setting, ``roles`` role by role (a role's pattern list is the
  child's whole).
* ``rules`` merge by rule name. A child rule named as a base rule *overrides* it, in the base rule's
  place: its fields merge into the base rule's one by one. A value with a ``kind`` (geometry,
  constraint, direction, decay, schedule, reference, approx, prenormalize, view, …) merges field by
  field when the child gives the same ``kind``, and is replaced whole otherwise (so an override of
  such a value always names its kind: ``geometry: {kind: spectral, scale: scion}``). ``match`` and
  every list (``post``, ``betas``, a role list) are replaced whole; a YAML ``null`` resets an
  optional field. ``remove: true`` (with the name and nothing else) drops the base rule.
* A child rule with a new name is appended after the base's rules, or placed with
  ``before: RULE`` or ``after: RULE`` (RULE: a rule of the base, removed or not). Several rules at
  one place keep the child's order. Giving both, or either on an override (which keeps its base
  rule's place), is an error.

Representation. The resolved :class:`~geomopt.spec.model.Spec` is the merged spec: its
``extends`` field keeps the base as written (excluded from ``model_dump()``, so it compares equal
to the same spec written out by hand), and its source map (:class:`MergedSourceMap`) keeps the
child's own parse, ``layer``: what ``geomopt fmt`` (:func:`geomopt.spec.printers.dump_spec`)
prints, ``extends``, ``before``, ``after`` and ``remove`` as written, while ``fmt --resolved``
prints the merged spec. Positions in a merged map are :class:`At`: (line, col) pairs that know
their file (:meth:`MergedSourceMap.locate`); its ``pos`` answers in the child's file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from geomopt.spec.diagnostics import SpecError, did_you_mean, language_diagnostic
from geomopt.spec.shipped import shipped_folder
from geomopt.spec.source import Parsed, SourceMap

SPEC_SUFFIXES = (".yaml", ".yml", ".geom")
MAX_EXTENDS_DEPTH = 256  # bases in one chain; a real one has two or three: more is a generated loop
PLACEMENT = ("before", "after", "remove")  # keys of a child's rule that the merge consumes
_OWN = ("geomopt", "name", "description", "extends")  # each file's own: never inherited


class At(tuple):
    """A (line, col) position that knows its file: a merged spec's values come from several."""

    file: str

    def __new__(cls, pos, file: str):
        self = super().__new__(cls, (pos[0], pos[1]))
        self.file = file
        return self

    def __reduce__(self):
        return (At, (tuple(self), self.file))


@dataclasses.dataclass
class MergedSourceMap(SourceMap):
    """The positions of a resolved spec (each an :class:`At`), and the child's own parse.

    :meth:`locate` gives a value's own position, in whichever file wrote it (validation reports
    there). :meth:`pos` stays in this map's ``file``, as every reader that pairs it with ``file``
    expects (lint): a value inherited from a base is placed at the child's ``extends``."""

    layer: Optional[Parsed] = None

    def locate(self, path, *, key: bool = False):
        return super().pos(path, key=key)

    def pos(self, path, *, key: bool = False):
        at = self.locate(path, key=key)
        if getattr(at, "file", self.file) == self.file:
            return at
        assert self.layer is not None  # a value from another file: a merged map, which keeps the child's parse
        return At(self.layer.source.pos(("extends",), key=True), self.file)


def layer_of(source: Optional[SourceMap]) -> Optional[Parsed]:
    """The extending file's own parse (``extends`` and overrides as written), or None."""
    return getattr(source, "layer", None)


# ---------------------------------------------------------------- presets


def shipped_specs() -> dict[str, Path]:
    """The shipped specs by name: file stem in ``specs/``, then in its ``catalog/`` (the
    published optimizers: ``normuon``, ``lion``, …) → its path (the YAML file where a spec ships in
    both spellings; the top folder's where both have the name)."""
    root = shipped_folder("specs")
    out: dict[str, Path] = {}
    for folder in (root, root / "catalog"):
        if not folder.is_dir():
            continue
        found = sorted((p for p in folder.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file()),
                       key=lambda p: (p.stem, SPEC_SUFFIXES.index(p.suffix)))
        for p in found:
            out.setdefault(p.stem, p)
    return out


def is_name(ref) -> bool:
    """Whether ``ref`` reads as a shipped spec's name: a string with no path separator, no line
    break and no extension."""
    return isinstance(ref, str) and bool(ref) and not any(c in ref for c in "/\\\n") and Path(ref).suffix == ""


def shipped_menu() -> str:
    """The sentence listing what may be named."""
    return f"shipped specs: {', '.join(shipped_specs())}; or a path to a .yaml, .yml or .geom file"


def find_spec(ref) -> Path:
    """The file ``ref`` names: a shipped spec by name (:func:`is_name`), else the path itself.
    Raises :class:`SpecError` (GO010) for a name that is not shipped."""
    if not is_name(ref):
        return Path(ref)
    shipped = shipped_specs()
    if ref in shipped:
        return shipped[ref]
    raise SpecError([language_diagnostic(
        "GO010", f"no spec file or shipped spec named {ref!r}{did_you_mean(ref, shipped)} ({shipped_menu()})", ref)])


# ---------------------------------------------------------------- resolution


def _error(code: str, message: str, source: SourceMap, path: tuple, key: bool = True) -> SpecError:
    pos = source.pos(path, key=key)
    return SpecError([language_diagnostic(code, message, getattr(pos, "file", source.file), pos)])


def resolve(parsed: Parsed, read: Callable[[Path], Parsed]) -> Parsed:
    """``parsed`` merged onto its bases (``parsed`` itself, checked, where it extends nothing).
    ``read(path)`` parses a base file (its root checked). Raises :class:`SpecError`.

    The chain is read first, child to base, then merged base first: a loop, not a recursion, so
    its length is bounded by :data:`MAX_EXTENDS_DEPTH` (an error at the ``extends`` that would
    pass it), not by Python's stack."""
    layers = [parsed]
    labels, seen = _own_chain(parsed.source)
    while isinstance(layers[-1].data, dict) and "extends" in layers[-1].data:
        child = layers[-1]
        if len(layers) > MAX_EXTENDS_DEPTH:
            raise _error("GO012", f"more than {MAX_EXTENDS_DEPTH} bases in a chain of 'extends' (from "
                         f"{parsed.source.file}): no spec needs so many; build on fewer bases", child.source,
                         ("extends",))
        target = _base_path(child)
        key = target.resolve()
        labels.append(str(target))
        if key in seen:
            raise _error("GO012", f"inheritance cycle: {' → '.join(labels)}: a spec cannot extend itself, directly or "
                         "through its bases; remove one of these 'extends'", child.source, ("extends",))
        seen.add(key)
        layers.append(read(target))
    _check_plain(layers[-1])
    merged = layers.pop()
    while layers:
        merged = _Merger(merged, layers.pop()).merge()
    return merged


def _own_chain(source: SourceMap) -> tuple[list, set]:
    """The chain's labels and resolved paths so far: the extending file's own, where it is a file."""
    own = Path(source.file)
    try:
        return ([source.file], {own.resolve()}) if own.is_file() else ([], set())
    except OSError:  # a name the system cannot look up (too long) is no file that a base could name
        return [], set()


def _base_path(parsed: Parsed) -> Path:
    """The file ``extends`` names (GO014 for a value that is no name, GO011 for one naming nothing)."""
    value, source = parsed.data["extends"], parsed.source
    if not isinstance(value, str) or not value.strip():
        shown = {bool: "a boolean", int: "a number", float: "a number", list: "a list",
                 dict: "a mapping"}.get(type(value), "null")
        shown = "an empty string" if isinstance(value, str) else shown
        raise _error("GO014", f"extends takes a spec to build on, as a string: a shipped name (e.g. \"muon\") or a "
                     f"path, not {shown}", source, ("extends",))
    if is_name(value):
        shipped = shipped_specs()
        if value in shipped:
            return shipped[value]
        raise _error("GO011", f"extends: no shipped spec named {value!r}{did_you_mean(value, shipped)} "
                     f"({shipped_menu()})", source, ("extends",))
    path = Path(value)
    if not path.is_absolute():
        own = Path(source.file)
        path = (own.parent if own.is_file() else Path()) / path
    if path.suffix.lower() not in SPEC_SUFFIXES:
        raise _error("GO011", f"extends: {value!r} is not a spec file (.yaml, .yml or .geom); a name without an "
                     f"extension is a shipped spec ({shipped_menu()})", source, ("extends",))
    try:
        found = path.is_file()
    except OSError as exc:  # a name too long for the system, a loop of links
        raise _error("GO011", f"extends: cannot read {value!r}: {exc.strerror or exc}; give the path of a .yaml, "
                     f".yml or .geom file", source, ("extends",)) from None
    if not found:
        raise _error("GO011", f"extends: no spec file {value!r} (looked for {path}; a relative path is read from the "
                     f"extending file's directory); {shipped_menu()}", source, ("extends",))
    return path


def _check_plain(parsed: Parsed) -> None:
    """A spec that extends nothing has no overrides to place: ``before``/``after``/``remove`` are errors."""
    rules = parsed.data.get("rules") if isinstance(parsed.data, dict) else None
    for i, rule in enumerate(rules if isinstance(rules, list) else ()):
        for key in PLACEMENT:
            if isinstance(rule, dict) and key in rule:
                raise _error("GO013", f"rules[{i}].{key}: '{key}' places a rule among the rules of a base: "
                             "only in a spec with 'extends: BASE'", parsed.source, ("rules", i, key))


class _Merger:
    """One child merged onto its (resolved) base: plain data and positions, built together."""

    def __init__(self, base: Parsed, child: Parsed):
        self.base, self.child = base, child
        self.out = MergedSourceMap(file=child.source.file, format=child.source.format, layer=child)

    def merge(self) -> Parsed:
        b, c = self.base.data, self.child.data
        self.place(self.child, (), ())
        out: dict = {}
        for k, v in b.items():
            if k in _OWN:
                continue
            if k == "rules" and k in c:
                out[k] = self.rules(v, c[k])
            elif k in c:
                out[k] = self.value(v, (k,), c[k], (k,), (k,), k)
            else:
                out[k] = self.take(self.base, (k,), v, (k,))
        for k, v in c.items():
            if k not in out:
                out[k] = self.rules([], v) if k == "rules" else self.take(self.child, (k,), v, (k,))
        return Parsed(out, self.out)

    def place(self, layer: Parsed, src: tuple, dst: tuple) -> None:
        """Record at ``dst`` the position (and key position) ``layer`` has at ``src``."""
        s = layer.source
        for have, put in ((s.values, self.out.values), (s.keys, self.out.keys)):
            pos = have.get(src)
            if pos is not None:
                put[dst] = pos if isinstance(pos, At) else At(pos, s.file)

    def take(self, layer: Parsed, src: tuple, value, dst: tuple):
        """A copy of ``value`` (at ``src`` in ``layer``) for ``dst``, its positions with it."""
        self.place(layer, src, dst)
        if isinstance(value, dict):
            return {k: self.take(layer, src + (k,), v, dst + (k,)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.take(layer, src + (i,), v, dst + (i,)) for i, v in enumerate(value)]
        return value

    def value(self, b, bp: tuple, c, cp: tuple, dp: tuple, field):
        """The base's ``b`` overridden by the child's ``c`` (module docstring: merge rules)."""
        if not (isinstance(b, dict) and isinstance(c, dict)) or field == "match" or c.get("kind") != b.get("kind"):
            return self.take(self.child, cp, c, dp)
        self.place(self.child, cp, dp)
        out = {}
        for k, v in b.items():
            out[k] = (self.value(v, bp + (k,), c[k], cp + (k,), dp + (k,), k) if k in c
                      else self.take(self.base, bp + (k,), v, dp + (k,)))
        for k, v in c.items():
            if k not in b:
                out[k] = self.take(self.child, cp + (k,), v, dp + (k,))
        return out

    def rules(self, base_rules, child_rules) -> list:
        """Rules merged by name: overrides in place, new rules placed or appended."""
        path = ("rules",)
        if not isinstance(child_rules, list) or not isinstance(base_rules, list):  # validation says what is wrong
            return self.take(self.child, path, child_rules, path)
        self.place(self.child, path, path)
        names: dict = {}
        for i, rule in enumerate(base_rules):
            if isinstance(rule, dict) and isinstance(rule.get("name"), str):
                names.setdefault(rule["name"], i)
        n = len(base_rules)
        own: list = [("base", i) for i in range(n)]
        before: list = [[] for _ in range(n)]
        after: list = [[] for _ in range(n)]
        tail: list = []
        seen: set = set()
        for j, rule in enumerate(child_rules):
            name = rule.get("name") if isinstance(rule, dict) else None
            if not isinstance(rule, dict) or not isinstance(name, str):
                tail.append(("new", j))  # validation reports the rule
                continue
            self._check_placement(rule, j)
            where = next((k for k in ("before", "after") if k in rule), None)
            if name in names and name not in seen:
                seen.add(name)
                i = names[name]
                if where is not None:
                    raise self._at(j, where, f"rule '{name}' overrides the base's rule of that name, which keeps its "
                                   f"place: '{where}' only places a new rule (to move a base rule, remove it and add a "
                                   f"rule under a new name)")
                if rule.get("remove") is True:
                    extra = [k for k in rule if k not in ("name", "remove")]
                    if extra:
                        raise self._at(j, "remove",
                                       f"rule '{name}' is removed: drop its other fields ({', '.join(extra)})")
                    own[i] = None
                else:
                    own[i] = ("over", i, j)
                continue
            seen.add(name)
            if rule.get("remove") is True:
                raise self._at(j, "remove", f"the base has no rule '{name}' to remove{did_you_mean(name, names)} "
                               f"(its rules: {', '.join(names) or 'none'})")
            if where is None:
                tail.append(("new", j))
                continue
            anchor = rule[where]
            if anchor not in names:
                raise self._at(j, where, f"the base has no rule '{anchor}'{did_you_mean(anchor, names)} (its rules: "
                               f"{', '.join(names) or 'none'})")
            (before if where == "before" else after)[names[anchor]].append(("new", j))
        order: list = []
        for i in range(n):
            order += before[i] + ([own[i]] if own[i] is not None else []) + after[i]
        out = []
        for k, item in enumerate(order + tail):
            dp = path + (k,)
            if item[0] == "base":
                out.append(self.take(self.base, path + (item[1],), base_rules[item[1]], dp))
            elif item[0] == "over":
                i, j = item[1], item[2]
                out.append(self.value(base_rules[i], path + (i,), _strip(child_rules[j]), path + (j,), dp, "rule"))
            else:
                rule = child_rules[item[1]]
                out.append(self.take(self.child, path + (item[1],), _strip(rule) if isinstance(rule, dict) else rule,
                                     dp))
        return out

    def _check_placement(self, rule: dict, j: int) -> None:
        for key in ("before", "after"):
            if key in rule and not isinstance(rule[key], str):
                raise self._at(j, key, f"expected the name of a rule of the base (a string), got {_show(rule[key])}")
        if "remove" in rule and not isinstance(rule["remove"], bool):
            raise self._at(j, "remove", f"expected true or false, got {_show(rule['remove'])}")
        if "before" in rule and "after" in rule:
            later = max(("before", "after"), key=lambda k: tuple(self.child.source.pos(("rules", j, k), key=True)))
            raise self._at(j, later, "give 'before' or 'after', not both: a new rule goes in one place")

    def _at(self, j: int, key: str, message: str) -> SpecError:
        return _error("GO013", f"rules[{j}].{key}: {message}", self.child.source, ("rules", j, key))


def _show(value) -> str:
    """A value as the spec spells it (``true``, ``null``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _strip(rule: dict) -> dict:
    return {k: v for k, v in rule.items() if k not in PLACEMENT}
