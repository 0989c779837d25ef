"""YAML front end: PyYAML's node tree (``yaml.compose``), resolved the YAML 1.2 way, with positions.

PyYAML resolves YAML 1.1: ``1e-3`` would load as a string, ``yes``/``on`` as booleans, ``10:30``
as 630, and duplicate keys silently overwrite. Here scalars resolve by the YAML 1.2 core schema
(floats with or without a dot, booleans only true/false), duplicate keys are errors, and only
safe tags are accepted.

Speed: libyaml (PyYAML's C parser) reads the text into events, from which :func:`_load_fast`
builds the data and positions :func:`_build` would make of the pure-Python loader's node tree
(ten times faster on a large spec). Input that is not one well-formed document, or on which the
two parsers could differ, goes to the pure-Python loader, whose messages are the reference: an
error reads the same whichever parser met the text first.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from geomopt.spec.diagnostics import SpecError, language_diagnostic
from geomopt.spec.source import MAX_DEPTH, MAX_NODES, Parsed, SourceMap, int_literal_error

try:
    from yaml._yaml import CParser as _CParser
except ImportError:  # PyYAML built without libyaml: the pure-Python loader does it all
    _CParser = None

_INT = re.compile(r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$")
_BOOL = re.compile(r"^(true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(~|null|Null|NULL|)$")

_T = "tag:yaml.org,2002:"


class _Resolver(yaml.resolver.BaseResolver):
    """YAML 1.2 core schema resolution (no sexagesimals, no yes/no/on/off)."""


for _tag, _regex, _first in (
    ("bool", _BOOL, "tTfF"),
    ("int", _INT, "-+0123456789"),
    ("float", _FLOAT, "-+0123456789."),
    ("null", _NULL, ["~", "n", "N", ""]),
):
    _Resolver.add_implicit_resolver(_T + _tag, _regex, list(_first))


class _Loader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer, _Resolver):
    def __init__(self, stream):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _Resolver.__init__(self)

    def compose_scalar_node(self, anchor):
        event = self.peek_event()
        if event.tag == "!":  # YAML 1.2: the non-specific tag makes a scalar a string (PyYAML re-resolves it)
            event.tag = _T + "str"
        return super().compose_scalar_node(anchor)


class YamlDumper(yaml.SafeDumper):
    """Dumper whose quoting agrees with the loader: a string that would load as a number, bool or
    null under YAML 1.2 (``"1e-3"``) is quoted."""


def _represent_str(dumper, value: str):
    # PyYAML writes NEL/LS/PS raw in plain and single-quoted scalars, where YAML reads them as line
    # breaks (folded to spaces); double quotes escape them (\N, \L, \P)
    style = '"' if any(c in value for c in "\x85\u2028\u2029\ufeff") else None
    return dumper.represent_scalar(_T + "str", value, style=style)


YamlDumper.add_representer(str, _represent_str)
YamlDumper.yaml_implicit_resolvers = {}
for _tag, _regex, _first in (
    ("bool", _BOOL, "tTfF"),
    ("int", _INT, "-+0123456789"),
    ("float", _FLOAT, "-+0123456789."),
    ("null", _NULL, ["~", "n", "N", ""]),
    # quote YAML 1.1 words too, so other tools read our files the same way
    ("bool", re.compile(r"^(yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF|y|Y|n|N)$"), "yYnNoO"),
    ("int", re.compile(r"^[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?$"), "-+0123456789"),  # 1.1 sexagesimal
):
    YamlDumper.add_implicit_resolver(_T + _tag, _regex, list(_first))


def _pos(mark) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1)


def parse_yaml(text: str, file: str = "<spec>") -> Parsed:
    """Text → plain data + :class:`SourceMap`; raises :class:`SpecError` on malformed YAML."""
    source = SourceMap(file=file, format="yaml")
    try:
        return Parsed(_load_fast(text, source), source)
    except _Fallback:
        source = SourceMap(file=file, format="yaml")
    root = _compose(text, file)
    if root is None or (isinstance(root, yaml.ScalarNode) and root.value == "" and root.style is None
                        and root.tag == _T + "null"):
        # no document, or only `---` / `...`: an empty plain scalar
        raise SpecError([language_diagnostic("GO009", "empty spec: expected a mapping with 'geomopt: 1', 'name' and "
                                                      "'rules'", file)])
    counter = [0]
    data = _build(root, (), source, counter, set())
    return Parsed(data, source)


class _Fallback(Exception):
    """Raised by :func:`_load_fast` for input only the pure-Python loader may judge."""


_EVENTS = yaml.events
# Where libyaml and PyYAML's scanner disagree (found by differential fuzzing), the fast path steps
# aside: a tab (PyYAML refuses one inside a plain scalar or before a token), a byte order mark after
# the start (columns differ), an empty scalar (libyaml may mark it elsewhere), '?' inside a plain
# scalar in a flow collection (PyYAML ends the scalar there), a comment right after a block
# scalar's indicators (libyaml accepts `|-#`).
_BLOCK_HEADER_COMMENT = re.compile(r"[|>][-+0-9]*#")
_STR, _MAP, _SEQ = _T + "str", _T + "map", _T + "seq"
_NONE = object()  # no pending mapping key; no cached scalar


def _load_fast(text: str, source: SourceMap):
    """What :func:`_build` makes of the pure-Python loader's node tree for ``text``, the same data
    and the same positions in ``source``, straight from libyaml's events: no node tree, no
    recursion. Raises :class:`_Fallback` wherever the pure-Python loader must decide: no libyaml,
    input on which the two parsers differ, any error (syntax, tag, duplicate or merge key, a key
    that is not a scalar, an alias to an unknown, open or repeated anchor, too deep, too many
    nodes), no document or several."""
    if _CParser is None or "\t" in text or text.find("\ufeff", 1) >= 0:
        raise _Fallback
    try:
        parser = _CParser(text)
    except ValueError:  # a lone surrogate cannot be encoded for libyaml
        raise _Fallback from None
    try:
        return _from_events(parser.get_event, source, text)
    except (yaml.YAMLError, ValueError):
        raise _Fallback from None
    finally:
        parser.dispose()


def _from_events(get_event, source: SourceMap, text: str):
    resolve = _Resolver().resolve
    scalar_event, alias_event = _EVENTS.ScalarEvent, _EVENTS.AliasEvent
    mapping_start, sequence_start = _EVENTS.MappingStartEvent, _EVENTS.SequenceStartEvent
    mapping_end, sequence_end = _EVENTS.MappingEndEvent, _EVENTS.SequenceEndEvent
    plain: dict = {}  # text → value of untagged plain scalars: specs repeat their kinds and numbers
    scalars: dict = {}  # (tag, text, implicit) → value of the others
    block_checked = False
    values: list = []  # (path, pos) of every value node, in the order _build records them
    keys: list = []  # (path, pos) of every mapping key
    anchors: dict = {}  # name → None while its collection is open, then what an alias copies
    stack: list = []  # the enclosing collections' states
    get_event()  # StreamStartEvent
    if get_event().__class__ is not _EVENTS.DocumentStartEvent:
        raise _Fallback  # no document: the reference says so
    root = _NONE
    container: Any = _NONE  # the open dict or list (_NONE until the root opens): Any, as the sentinel is an object
    path: tuple = ()
    key = _NONE
    mapping = flow = False
    while True:
        event = get_event()
        cls = event.__class__
        if cls is scalar_event:
            word, style = event.value, event.style
            if not style:
                if not word or (flow and "?" in word):
                    raise _Fallback
                if event.tag is None:
                    value = plain.get(word, _NONE)
                    if value is _NONE:
                        value = plain[word] = _scalar_value(event, scalars, resolve)
                else:
                    value = _scalar_value(event, scalars, resolve)
            else:
                if not block_checked and style in "|>":
                    if _BLOCK_HEADER_COMMENT.search(text):
                        raise _Fallback
                    block_checked = True
                value = _scalar_value(event, scalars, resolve)
            mark = event.start_mark
            pos = (mark.line + 1, mark.column + 1)
            anchor = event.anchor
            if mapping:
                if key is _NONE:  # a key: a plain word, said once
                    if anchor is not None or (word == "<<" and not style):
                        raise _Fallback
                    key = value if value.__class__ is str else word
                    if key in container:
                        raise _Fallback
                    keys.append((path + (key,), pos))
                    continue
                at = path + (key,)
            else:
                at = () if container is _NONE else path + (len(container),)
            values.append((at, pos))  # one per node: len(values) counts them as _build does
            if anchor is not None:
                if anchor in anchors:
                    raise _Fallback
                anchors[anchor] = (value, [((), pos)], [])
        elif cls is mapping_end or cls is sequence_end:
            value, own = container, path
            container, path, key, mapping, flow, anchor, v0, k0 = stack.pop()
            if anchor is not None:
                cut = len(own)
                anchors[anchor] = (value, [(p[cut:], q) for p, q in values[v0:]], [(p[cut:], q) for p, q in keys[k0:]])
        elif cls is mapping_start or cls is sequence_start:
            if mapping and key is _NONE:  # a mapping or a list as a key
                raise _Fallback
            at = () if container is _NONE else path + (key,) if mapping else path + (len(container),)
            opens_mapping = cls is mapping_start
            anchor = event.anchor
            # (deeper than MAX_DEPTH below this one: the reference decides which message)
            if (len(values) >= MAX_NODES or len(at) >= MAX_DEPTH
                    or event.tag not in (None, "!", _MAP if opens_mapping else _SEQ)
                    or (anchor is not None and anchor in anchors)):
                raise _Fallback
            mark = event.start_mark
            values.append((at, (mark.line + 1, mark.column + 1)))
            if anchor is not None:
                anchors[anchor] = None  # open: an alias to it inside it is recursive
            stack.append((container, path, key, mapping, flow, anchor, len(values) - 1, len(keys)))
            container, path, key, mapping, flow = ({} if opens_mapping else [], at, _NONE, opens_mapping,
                                                   event.flow_style)
            continue
        elif cls is alias_event:
            if mapping and key is _NONE:
                raise _Fallback
            stored = anchors.get(event.anchor)
            if stored is None:  # unknown, or open (recursive)
                raise _Fallback
            value, sub_values, sub_keys = stored
            at = () if container is _NONE else path + (key,) if mapping else path + (len(container),)
            if len(values) + len(sub_values) > MAX_NODES or len(at) + max(len(p) for p, _ in sub_values) > MAX_DEPTH:
                raise _Fallback
            values += [(at + p, q) for p, q in sub_values]
            keys += [(at + p, q) for p, q in sub_keys]
            if isinstance(value, (dict, list)):
                value = copy.deepcopy(value)  # _build makes a new one at each alias
        else:  # DocumentEndEvent
            if get_event().__class__ is not _EVENTS.StreamEndEvent or len(values) > MAX_NODES:
                raise _Fallback  # several documents, or too many nodes
            source.values, source.keys = dict(values), dict(keys)
            return root
        if container is _NONE:
            root = value
        elif mapping:
            container[key] = value
            key = _NONE
        else:
            container.append(value)


def _scalar_value(event, cache: dict, resolve):
    """A scalar event's value as :func:`_scalar` reads it (through ``cache``); :class:`_Fallback`
    where :func:`_scalar` raises."""
    tag, text = event.tag, event.value
    key = (tag, text, event.implicit)
    value = cache.get(key, _NONE)
    if value is _NONE:
        if tag is None:
            tag = resolve(yaml.ScalarNode, text, event.implicit)
        elif tag == "!":
            tag = _STR
        if tag != _STR and (tag not in _EXPLICIT or not _EXPLICIT[tag].match(text)):
            raise _Fallback
        value = cache[key] = _convert(tag, text)
    return value


def _compose(text: str, file: str):
    """The pure-Python loader's node tree (None for no document); the reference for every error."""
    loader = None
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except RecursionError:  # PyYAML composes recursively: "[[[[…" thousands deep
        where = (loader.line + 1, loader.column + 1) if loader is not None else (1, 1)
        raise SpecError([language_diagnostic("GO010", f"spec nested too deeply (more than {MAX_DEPTH} levels)", file,
                                             where)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or "malformed YAML"
        if exc.context_mark and ("end of stream" in problem or "<stream end>" in problem):
            # an unclosed quote or bracket: point where it opened, not at the end of the file
            mark = exc.context_mark
            problem = ("unterminated quoted string" if "quoted scalar" in (exc.context or "")
                       else f"{problem} (opened here, never closed)")
        if "\t" in problem or "'\\t'" in problem:
            problem += " (YAML indentation must use spaces, not tabs)"
        ctx = f" {exc.context}" if exc.context else ""
        raise SpecError([language_diagnostic("GO001", f"YAML syntax error: {problem}{ctx}", file,
                                             _pos(mark) if mark else (1, 1))]) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise SpecError([language_diagnostic("GO010", f"unreadable input: {exc.reason} "
                                                      f"(character #x{exc.character:04x}); a spec is plain UTF-8 text",
                                             file, (line, col))]) from None
    except yaml.YAMLError as exc:  # pragma: no cover - PyYAML raises Marked errors for text input
        raise SpecError([language_diagnostic("GO001", f"YAML error: {exc}", file)]) from None
    return root


def _build(node, path, source: SourceMap, counter, active: set):
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise SpecError([language_diagnostic("GO010", f"spec too large: more than {MAX_NODES} YAML nodes "
                                                      f"(aliases expanded)", source.file, _pos(node.start_mark))])
    if id(node) in active:  # `&a [*a]`: an alias inside its own anchor
        raise SpecError([language_diagnostic("GO005", "recursive YAML alias: the value anchored here contains "
                                                      "an alias to itself", source.file, _pos(node.start_mark))])
    if len(path) > MAX_DEPTH:
        raise SpecError([language_diagnostic("GO010", f"spec nested too deeply (more than {MAX_DEPTH} levels)",
                                             source.file, _pos(node.start_mark))])
    source.values[path] = _pos(node.start_mark)
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        expected = _T + ("map" if isinstance(node, yaml.MappingNode) else "seq")
        if node.tag != expected:  # `!!set {a}`, `!!python/object:… {}`, `!!str {}`
            raise SpecError([_tag_error(node, source)])
        active.add(id(node))
        try:
            return _collection(node, path, source, counter, active)
        finally:
            active.discard(id(node))
    return _scalar(node, source)


def _collection(node, path, source: SourceMap, counter, active: set):
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise SpecError([language_diagnostic("GO005", "mapping keys must be plain words", source.file,
                                                     _pos(key_node.start_mark))])
            if key_node.tag == _T + "merge" or (key_node.value == "<<" and key_node.style is None):
                raise SpecError([language_diagnostic("GO005", "merge keys (<<) are not supported: write the fields out",
                                                     source.file, _pos(key_node.start_mark))])
            key = _scalar(key_node, source)
            if not isinstance(key, str):
                key = str(key_node.value)
            if key in out:
                first = source.keys[path + (key,)]
                raise SpecError([language_diagnostic("GO002", f"duplicate key '{key}' (first given at line {first[0]}, "
                                                              f"column {first[1]}); YAML would silently keep the last: "
                                                              f"remove one", source.file, _pos(key_node.start_mark))])
            source.keys[path + (key,)] = _pos(key_node.start_mark)
            out[key] = _build(value_node, path + (key,), source, counter, active)
        return out
    return [_build(item, path + (i,), source, counter, active) for i, item in enumerate(node.value)]


def _tag_error(node, source: SourceMap):
    tag = "!!" + node.tag[len(_T):] if node.tag.startswith(_T) else node.tag
    what = {yaml.MappingNode: "a mapping", yaml.SequenceNode: "a list"}.get(type(node))
    if what and node.tag[len(_T):] in ("map", "seq", "str", "int", "float", "bool", "null"):
        message = f"YAML tag {tag} does not fit {what}: drop the tag"
    else:
        message = f"unsupported YAML tag {tag}: specs use plain scalars, lists and mappings (no tags)"
    return language_diagnostic("GO005", message, source.file, _pos(node.start_mark))


_EXPLICIT = {_T + "bool": _BOOL, _T + "int": _INT, _T + "float": _FLOAT, _T + "null": _NULL}


def _scalar(node, source: SourceMap):
    tag, value = node.tag, node.value
    if tag == _T + "str":  # quoted scalars resolve to str, and so does the non-specific tag "!"
        return value
    if tag not in _EXPLICIT:
        raise SpecError([_tag_error(node, source)])
    if not _EXPLICIT[tag].match(value):  # explicit `!!int 0b11`, `!!float abc`: not that type in YAML 1.2
        raise SpecError([language_diagnostic("GO005", f"{value!r} is not a valid !!{tag[len(_T):]} "
                                                      f"(YAML 1.2 core schema)", source.file, _pos(node.start_mark))])
    try:
        return _convert(tag, value)
    except ValueError as exc:  # an integer of thousands of digits
        raise SpecError([language_diagnostic("GO010", str(exc), source.file, _pos(node.start_mark))]) from None


def _convert(tag: str, value: str):
    """A scalar's text as a Python value, once its tag is known to fit it."""
    if tag == _STR:
        return value
    if tag == _T + "bool":
        return value.lower() == "true"
    if tag == _T + "int":  # ValueError for one of thousands of digits (the fast loader falls back on it)
        if value.startswith(("0o", "0x")):
            number = int(value[2:], 8 if value[1] == "o" else 16)  # linear in the digits: no bound in Python
            error = int_literal_error(number)
        else:
            error = int_literal_error(None, value.lstrip("+-"))
            number = 0 if error else int(value)
        if error:
            raise ValueError(error)
        return number
    if tag == _T + "float":
        v = value.lower()
        if v.endswith(".inf"):
            return float("-inf") if v.startswith("-") else float("inf")
        if v.endswith(".nan"):
            return float("nan")
        return float(value)
    return None  # null
