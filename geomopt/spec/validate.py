"""Plain data + positions → :class:`Spec`, every pydantic error mapped back to ``file:line:col``."""

from __future__ import annotations

import contextlib
import gc
import re
import types
import typing
from pathlib import Path as FsPath
from typing import Any, Union

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from geomopt.spec.diagnostics import Diagnostic, SpecError, did_you_mean, language_diagnostic
from geomopt.spec.extends import find_spec, resolve, shipped_menu
from geomopt.spec.model import ROLE_NAMES, Spec
from geomopt.spec.patterns import pattern_error
from geomopt.spec.source import MAX_BYTES, FileTooLarge, NotRegularFile, Parsed, SourceMap, read_regular
from geomopt.spec.yaml_front import parse_yaml

def source_of(spec: Spec) -> SourceMap | None:
    """The positions a spec was parsed with (None for specs built in Python)."""
    return spec.source


def validate(parsed: Parsed) -> Spec:
    """Plain data + positions → :class:`Spec`: a spec that ``extends`` another is merged onto it
    first (:mod:`geomopt.spec.extends`), then validated as any spec; raises :class:`SpecError`."""
    check_root(parsed)
    parsed = resolve(parsed, _read_base)
    data, source = parsed.data, parsed.source
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        found = _diagnostics(exc, data, source)
        raise SpecError(sorted(found, key=lambda d: (d.file != source.file, d.file, d.line, d.col))) from None
    return spec.with_source(source)


def check_root(parsed: Parsed) -> Parsed:
    """One file's root is a mapping that reads language version 1 (or says no version)."""
    data, source = parsed.data, parsed.source
    if not isinstance(data, dict):
        what = {list: "a list", str: "a string", bool: "a boolean", int: "a number",
                float: "a number"}.get(type(data), "null")
        raise SpecError([language_diagnostic("GO005", f"a spec is a mapping with 'geomopt: 1', 'name' and 'rules', "
                                                      f"not {what}", source.file, source.pos(()))])
    version = data.get("geomopt")
    if "geomopt" in data and (version != 1 or isinstance(version, bool)):  # True == 1 in Python
        wanted = "geomopt 1" if source.format == "dsl" else "geomopt: 1"
        raise SpecError([language_diagnostic("GO008", f"unsupported language version {_show(version)}: "
                                                      f"this release reads '{wanted}'",
                                             source.file, source.pos(("geomopt",)))])
    return parsed


def _read_base(path: FsPath) -> Parsed:
    """A base spec file's plain data (``extends``), its root checked."""
    return check_root(read_spec(path))


def _at(source: SourceMap, path, *, key: bool = False):
    """Where ``path`` was written: for a merged spec, in the file that wrote it (``locate``)."""
    locate = getattr(source, "locate", None)
    return locate(path, key=key) if locate is not None else source.pos(path, key=key)


def _diag(code: str, message: str, source: SourceMap, pos) -> Diagnostic:
    """A language diagnostic at ``pos``, in the file that position is in (a merged spec's
    positions carry their file: :class:`geomopt.spec.extends.At`)."""
    return language_diagnostic(code, message, getattr(pos, "file", source.file), pos)


def _diagnostics(exc: ValidationError, data, source: SourceMap) -> list[Diagnostic]:
    found = []
    for err in exc.errors(include_url=False):
        path, model, union_at = _walk(err["loc"], data)
        found.append((err, path, model, union_at))
    # A plain union reports every member: for `coefficients: [[1, 2, 3, 4]]` both "should be
    # 'polar_express' or 'speedrun'" (at the list) and "at most 3 items" (inside it). The member
    # that got further into the value is the one the user meant: drop the others' errors.
    deeper = {u for _, p, _, u in found if u is not None and len(p) > len(u)}
    # `blocks: []` fails both members of `int | list[int]` where it stands: the member of the
    # value's own shape (list or not) says what is wrong ("at least 1 item", not "valid integer").
    fits = {u for e, p, _, u in found if u is not None and p == u and _fits(e, data, p)}
    # `geometri:` makes both "unknown field 'geometri'; did you mean 'geometry'?" and "missing
    # 'geometry'" (reported earlier, at the mapping): the first says it all.
    extra: dict = {}
    for err, path, _, _ in found:
        if err["type"] == "extra_forbidden" and path:
            extra.setdefault(path[:-1], []).append(str(path[-1]))
    out, seen = [], set()
    for err, path, model, union_at in found:
        if union_at is not None and path == union_at and (union_at in deeper
                                                          or (union_at in fits and not _fits(err, data, path))):
            continue
        if err["type"] == "missing" and path and did_you_mean(path[-1], extra.get(path[:-1], [])):
            continue
        diag = _one(err, path, model, data, source)
        key = (diag.line, diag.col, diag.code)
        if key not in seen:  # one problem, one finding (unions report each member)
            seen.add(key)
            out.append(diag)
    return out


def _fits(err: ErrorDetails, data, path: tuple) -> bool:
    """Whether the union member ``err`` came from has the value's shape (a list member, a list)."""
    member = next((s for s in err["loc"] if isinstance(s, str) and _is_member_tag(s)), "")
    return isinstance(_get(data, path), list) == member.startswith("list[")


def _one(err: ErrorDetails, path: tuple, model, data, source: SourceMap) -> Diagnostic:
    etype, msg = err["type"], err["msg"]
    where = _where(path)
    if err["loc"][-1:] == ("[key]",):  # a mapping's key failed (only `roles` constrains its keys)
        role = path[-1]
        if path[:1] == ("roles",):
            return _diag("GO005", f"roles: unknown role {_show(role)}{_roles_hint(role)}", source,
                         _at(source, path, key=True))
        return _diag("GO005", f"{_where(path[:-1]) or 'spec'}: key {_show(role)}: {friendly(etype, msg)}", source,
                     _at(source, path, key=True))
    if etype == "duplicate_rule_name":
        ctx = err["ctx"]
        first, here = _at(source, ("rules", ctx["first"], "name")), _at(source, ("rules", ctx["index"], "name"))
        first_file = getattr(first, "file", source.file)
        of = f" of {first_file}" if first_file != getattr(here, "file", source.file) else ""
        return _diag("GO005", f"duplicate rule name '{ctx['name']}' (first given at line {first[0]}, "
                              f"column {first[1]}{of}): rule names must be unique", source, here)
    if etype == "stage_order":
        return _diag("GO005", f"{where}: {msg}", source, _at(source, path + (err["ctx"]["index"], "kind")))
    if etype == "extra_forbidden":
        field = path[-1]
        allowed = sorted(model.model_fields) if model else []
        hint = did_you_mean(field, allowed)
        listed = f" ({where[:-len(str(field))].rstrip('.') or 'spec'} fields: {', '.join(allowed)})" if allowed else ""
        return _diag("GO003", f"unknown field '{field}'{hint}{listed}", source, _at(source, path, key=True))
    if etype == "union_tag_invalid":
        tag = err["ctx"]["tag"]
        expected = [t.strip(" '") for t in err["ctx"]["expected_tags"].split(",")]
        what = _field_name(path)
        return _diag("GO004", f"unknown {what} kind '{tag}'{did_you_mean(tag, expected)} "
                              f"(expected one of: {', '.join(expected)})", source, _at(source, path + ("kind",)))
    if etype == "union_tag_not_found":
        hint = (" (an override names its kind: the base's kind to merge into its value, another to replace it)"
                if hasattr(source, "locate") else "")
        return _diag("GO006", f"{_field_name(path)} needs a 'kind'{hint}", source, _at(source, path))
    if etype == "missing":
        parent = path[:-1]
        return _diag("GO006", f"missing required field '{path[-1]}' in {_where(parent) or 'the spec'}", source,
                     _at(source, parent, key=True))
    if path and path[-1] == "name" and len(path) >= 2 and path[-2] == "match" and etype == "value_error":
        return _diag("GO007", msg.removeprefix("Value error, "), source, _at(source, path))
    if path == ("roles",) and etype == "value_error":  # checked over the whole mapping: point at the pattern
        return _diag("GO007", f"roles: {msg.removeprefix('Value error, ')}", source,
                     _at(source, _bad_role_pattern(data) or path))
    value = _get(data, path)
    got = "" if isinstance(value, (dict, list)) or value is _MISSING else f", got {_show(value)}"
    msg = msg.removeprefix("Value error, ")
    if etype == "literal_error" and path and path[-1] == "kind":
        return _diag("GO004", f"{msg}{got}", source, _at(source, path))
    if etype == "literal_error" and isinstance(value, str) and "role" in path[-2:]:  # `role: hedd`, `role: [hedd]`
        return _diag("GO005", f"{where}: unknown role {_show(value)}{_roles_hint(value)}", source, _at(source, path))
    if etype == "literal_error" and isinstance(value, str):  # `scale: scoin`
        choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        got += did_you_mean(value, choices)
    return _diag("GO005", f"{where or 'spec'}: {friendly(etype, msg)}{got}", source, _at(source, path))


def _bad_role_pattern(data) -> tuple | None:
    """The path of the first pattern under ``roles`` that the matcher refuses."""
    for role, patterns in data["roles"].items():
        for i, pattern in enumerate(patterns):
            if isinstance(pattern, str) and pattern_error(pattern) is not None:
                return ("roles", role, i)
    return None


def _roles_hint(word: str) -> str:
    return f"{did_you_mean(word, ROLE_NAMES)} (roles: {', '.join(ROLE_NAMES)})"


def friendly(etype: str, msg: str) -> str:
    """A validation error's message as a spec's diagnostic (and a checkpoint's refusal) says it."""
    if etype == "bool_type":
        return "expected true or false"
    if etype in ("float_type", "int_type") and "bool" not in msg:
        return msg[0].lower() + msg[1:]
    return msg[0].lower() + msg[1:] if msg else etype


_MISSING = object()


def _show(value) -> str:
    """A value as the spec spells it (``true``, not Python's ``True``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value)


def _get(data, path):
    for p in path:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


def _walk(loc: tuple, data) -> tuple[tuple, Any, tuple | None]:
    """Drop pydantic's union/tag segments from ``loc`` by walking the data alongside, and find
    the model class that owns the last step (for listing allowed fields). The third result is the
    path of the first plain (non-discriminated) union on the way, or None."""
    path: list = []
    node: Any = data
    models: list = [Spec]
    union_at = None
    for seg in loc:
        if isinstance(node, dict) and seg in node:
            models = _next_models(models, seg, node)
            node = node[seg]
            path.append(seg)
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            models = _item_models(models)
            node = node[seg]
            path.append(seg)
        elif seg == "[key]":  # the key of the entry just walked into failed: the path stays there
            continue
        elif isinstance(node, dict) and isinstance(seg, str) and node.get("kind") == seg:  # discriminator tag
            models = [m for m in models if _kind_of(m) == seg] or models
        elif isinstance(seg, str) and _is_member_tag(seg):  # which union member: not a place in the data
            if union_at is None:
                union_at = tuple(path)
        else:  # a missing or extra key: the final segment
            if isinstance(seg, (str, int)):
                path.append(seg)
            break
    return tuple(path), _owner_for(loc, data, path), union_at


def _is_member_tag(seg: str) -> bool:
    """pydantic's labels for union members (``int``, ``constrained-int``, ``literal['a','b']``,
    ``list[float]``); field names are identifiers, so they never look like these."""
    return "[" in seg or "-" in seg or seg in ("str", "int", "float", "bool", "list", "dict", "none")


def _kind_of(model) -> str | None:
    f = getattr(model, "model_fields", {}).get("kind")
    return f.default if f is not None else None


def _unwrap(tp) -> list:
    """Model classes (or list item types) reachable from an annotation."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        out = []
        for a in typing.get_args(tp):
            out.extend(_unwrap(a))
        return out
    if origin is list:
        return [("list", typing.get_args(tp)[0])]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return []


def _next_models(models, key, node):
    out = []
    for m in models:
        if isinstance(m, type) and issubclass(m, BaseModel) and key in m.model_fields:
            out.extend(_unwrap(m.model_fields[key].annotation))
    kind = node[key].get("kind") if isinstance(node.get(key), dict) else None
    if kind is not None:
        out = [m for m in out if not (isinstance(m, type) and _kind_of(m) not in (None, kind))] or out
    return out


def _item_models(models):
    out = []
    for m in models:
        if isinstance(m, tuple) and m[0] == "list":
            out.extend(_unwrap(m[1]))
    return out


def _owner_for(loc, data, path):
    """The model class whose fields the mapping at ``path[:-1]`` should have."""
    models: list = [Spec]
    node = data
    for seg in path[:-1]:
        if isinstance(node, dict):
            models = _next_models(models, seg, node)
        else:
            models = _item_models(models)
        node = node[seg]
    if isinstance(node, dict) and "kind" in node:
        models = [m for m in models if _kind_of(m) == node["kind"]] or models
    return next((m for m in models if isinstance(m, type) and issubclass(m, BaseModel)), None)


def _where(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _field_name(path) -> str:
    for p in reversed(path):
        if isinstance(p, str):
            return p
    return "spec"


# ---------------------------------------------------------------- public entry points


def parse_text(text: str, format: str = "yaml", *, file: str = "<spec>") -> Parsed:
    """Spec text (``format`` "yaml" or "dsl") → plain data + positions, not yet validated;
    raises :class:`SpecError` for text that is no spec (too large, binary, malformed)."""
    if format not in ("yaml", "dsl"):
        raise ValueError(f"format must be 'yaml' or 'dsl', got {format!r}")
    text = text.removeprefix("\ufeff")  # a byte order mark: editors on Windows write one
    if len(text) > MAX_BYTES:
        raise SpecError([language_diagnostic("GO010", f"spec too large ({len(text)} characters; "
                                                      f"the limit is {MAX_BYTES})", file)])
    if "\x00" in text:
        at = text.index("\x00")
        line = text.count("\n", 0, at) + 1
        raise SpecError([language_diagnostic("GO010", "binary input (NUL byte): a spec is plain UTF-8 text", file,
                                             (line, at - (text.rfind("\n", 0, at) + 1) + 1))])
    if format == "yaml":
        return parse_yaml(text, file)
    from geomopt.spec.dsl_front import parse_dsl  # lark (the DSL's parser) loads only for DSL text

    return parse_dsl(text, file)


def parse_spec(text: str, format: str = "yaml", *, file: str = "<spec>") -> Spec:
    """Parse spec text (``format`` "yaml" or "dsl"); raises :class:`SpecError` with positions.
    A relative ``extends`` path is read from the working directory (or ``file``'s directory,
    where ``file`` is a file)."""
    with gc_paused():
        return validate(parse_text(text, format, file=file))


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while many small acyclic objects are built: the
    collector's passes, which their allocation triggers, took two thirds of a 1 MB YAML spec's
    parse (and most of its lint), and half the compile of a 10,000-tensor model (each pass scans
    every live tensor). Reference counting frees everything as usual; the previous state is
    restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def format_of(path: str | FsPath) -> str:
    suffix = FsPath(path).suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix == ".geom":
        return "dsl"
    raise SpecError([language_diagnostic("GO010", f"unknown spec extension {suffix or '(none)'!r}: "
                                                  f"use .yaml, .yml or .geom", str(path))])


def read_spec(path: str | FsPath) -> Parsed:
    """A ``.yaml``/``.yml`` or ``.geom`` file's plain data + positions, not yet validated."""
    return parse_text(read_spec_text(path), format_of(path), file=str(path))


def read_spec_text(path: str | FsPath) -> str:
    """A spec file's text, as written (a byte order mark kept): only a regular file (links
    followed: not a directory, FIFO or device), refused by its size before it is read, and at most
    :data:`MAX_BYTES` + 1 bytes read; raises :class:`SpecError` (GO010)."""
    format_of(path)
    try:
        raw = read_regular(path, MAX_BYTES)
    except FileTooLarge as exc:
        message = f"spec too large ({exc.strerror}; the limit is {MAX_BYTES}): split it, or build on a base spec with "
        message += "'extends'"
        raise SpecError([language_diagnostic("GO010", message, str(path))]) from None
    except OSError as exc:
        menu = f" ({shipped_menu()})" if isinstance(exc, FileNotFoundError) else ""
        what = "; give a .yaml, .yml or .geom file" if isinstance(exc, NotRegularFile) else ""
        raise SpecError([language_diagnostic("GO010", f"cannot read spec: {exc.strerror or exc}{what}{menu}",
                                             str(path))]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError([language_diagnostic("GO010", "not UTF-8 text (binary file?): a spec is plain UTF-8 text",
                                             str(path), (line, col))]) from None


def load_spec(path: str | FsPath) -> Spec:
    """Read a ``.yaml``/``.yml`` or ``.geom`` file, or a shipped spec by name (``"muon"``:
    :func:`geomopt.spec.extends.shipped_specs`); raises :class:`SpecError`."""
    with gc_paused():
        return validate(read_spec(find_spec(path)))
