"""DSL front end: ``grammars/geomopt.lark`` (LALR) → the same plain data as the YAML front end.

Spelling (whitespace and newlines are free; ``#`` starts a comment)::

    geomopt 1
    name "prox-muon"
    defaults lr=0.02 direction=polyak(alpha=0.05, nesterov=true)
    roles head=["**.proj_out.weight"] router=["**.gate.weight"]
    rule hidden match role=[hidden, expert] ndim=2:
        geometry   spectral(power_barrier(kappa=4, eps=1e-3), approx=polar_express(steps=5), view=auto)
        constraint frobenius_ball(radius=0.5)

A call ``kind(a=…, …)`` is the mapping ``{kind: …, a: …}``; a bare word where a kind is expected
(``direction=none``, ``spectral(indicator)``, ``view=auto``) is ``{kind: word}``; a geometry's one
positional argument is its ``reference``; elsewhere a bare word is a string (``role=hidden``).
``roles role=[patterns…]`` is the spec's ``roles`` mapping.

A spec that builds on another (:mod:`geomopt.spec.extends`) says ``extends "muon"``; its rules
may then leave out ``match`` (``rule hidden:`` overrides the base rule ``hidden``) and take
``before=RULE``, ``after=RULE`` or ``remove=true`` as they take any setting.

Comments are dropped here, as the grammar ignores them; :mod:`geomopt.spec.comments` finds them
in the text and attaches them by the positions recorded here, so that ``geomopt fmt`` keeps them.
"""

from __future__ import annotations

import functools
import json
import re

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from geomopt.spec.diagnostics import SpecError, did_you_mean, language_diagnostic
from geomopt.spec.base import KIND_FIELDS
from geomopt.spec.shipped import shipped_folder
from geomopt.spec.source import MAX_DEPTH, Parsed, SourceMap, int_literal_error

_KEYWORDS = {
    "GEOMOPT": "geomopt", "NAME": "name", "DESCRIPTION": "description", "DEFAULTS": "defaults", "ROLES": "roles",
    "RULE": "rule", "MATCH": "match", "GEOMETRY": "geometry", "CONSTRAINT": "constraint", "LR": "lr",
    "WEIGHT_DECAY": "weight_decay", "DECAY": "decay", "POST": "post", "DIRECTION": "direction", "SCHEDULE": "schedule",
    "ON_NONFINITE": "on_nonfinite", "PROJECT_ON_INIT": "project_on_init", "QK_CLIP": "qk_clip", "STATE": "state",
    "TRUE": "true",
    "FALSE": "false", "EXTENDS": "extends", "BEFORE": "before", "AFTER": "after", "REMOVE": "remove",
}
_SHOWN = {
    "IDENT": "a name", "STRING": "a string", "SIGNED_NUMBER": "a number", "INT": "an integer",
    "EQUAL": "'='", "COLON": "':'", "COMMA": "','", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'",
    "$END": "end of input",
}


class _WholeWords:
    """Post-lexer that keeps IDENT lexable in every parser state. lark's contextual lexer only
    tries the terminals a state accepts, so where a keyword but no name is allowed it would read
    `lrr=1` as `lr` `r` and `rulex` as `rule` `x`; with IDENT always tried, a word is lexed whole
    and a misspelled keyword becomes one clear "unexpected name" error."""

    always_accept = ("IDENT",)

    def process(self, stream):
        return stream


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    text = (shipped_folder("grammars") / "geomopt.lark").read_text(encoding="utf-8")
    return Lark(text, parser="lalr", maybe_placeholders=False, postlex=_WholeWords())


# keywords of spec inheritance (geomopt.spec.extends): not listed among what a syntax error expects
# where others are, so messages speak of what most specs write (a misspelling still gets its hint)
_INHERITANCE = {"EXTENDS", "BEFORE", "AFTER", "REMOVE"}


def _expected(names) -> str:
    names = set(names or ())
    words = set(_KEYWORDS) - {"TRUE", "FALSE"}
    if "IDENT" in names and words <= names:  # where any field name goes: "a name" covers the keywords
        names -= words
    if names - _INHERITANCE:
        names -= _INHERITANCE
    shown = sorted(_KEYWORDS.get(n, _SHOWN.get(n, n)) for n in names)
    return ", ".join(shown)


def _parser_expected(exc) -> set:
    """What the parser (not the lexer) would accept where it stopped. A token the contextual lexer
    cannot place arrives with the lexer's view, in which keywords hide inside IDENT."""
    state = getattr(exc, "state", None)
    if state is None:
        return set(exc.expected or ())
    try:
        return {n for n in state.parse_conf.parse_table.states[state.position] if n.isupper() or n == "$END"}
    except (AttributeError, KeyError, IndexError, TypeError):
        return set(exc.expected or ())


def _describe(token) -> str:
    if token.type == "$END":
        return "end of input"
    return f"{token.type.lower() if token.type in _KEYWORDS else 'token'} {str(token)!r}"


def parse_dsl(text: str, file: str = "<spec>") -> Parsed:
    """Text → plain data + :class:`SourceMap`; raises :class:`SpecError` with positions."""
    source = SourceMap(file=file, format="dsl")
    if not text.strip() or all(ln.strip().startswith("#") or not ln.strip() for ln in text.splitlines()):
        raise SpecError([language_diagnostic("GO009", "empty spec: expected 'geomopt 1', a name and rules", file)])
    try:
        tree = _parser().parse(text)
    except UnexpectedCharacters as exc:
        # lark declares pos_in_stream = None on UnexpectedInput; the lexer sets it to the int it stopped at
        at: int = exc.pos_in_stream  # type: ignore[assignment]
        ch = text[at] if at < len(text) else ""
        if ch == '"':
            message = "unterminated string: a string closes with '\"' on the same line (write \\n for a line break)"
        else:
            message = f"unexpected character {ch!r}; expected {_expected(exc.allowed)}"
        raise SpecError([language_diagnostic("GO001", message, file, (exc.line, exc.column))]) from None
    except UnexpectedToken as exc:
        tok = exc.token
        exc.expected = _parser_expected(exc)
        if {"MATCH", "COLON"} <= exc.expected:  # after `rule NAME`: ':' alone is an override (extends) only
            exc.expected -= {"COLON"}
        line, col = (exc.line, exc.column) if tok.type != "$END" else _end(text)
        if set(exc.expected) == {"EQUAL"}:  # `match "*"` then `geometry …`: the ':' is missing
            # lark declares pos_in_stream = None on UnexpectedInput; here it is the lexed token's start (an int)
            end: int = exc.pos_in_stream  # type: ignore[assignment]
            prev = _BODY_WORD.search(text, 0, end)
            if prev:
                line, col = (text.count("\n", 0, prev.start(1)) + 1,
                             prev.start(1) - (text.rfind("\n", 0, prev.start(1)) + 1) + 1)
                raise SpecError([language_diagnostic("GO001", f"expected ':' before '{prev.group(1)}': a rule's match "
                                                              f"ends with ':' (or a match field needs '=value')",
                                                     file, (line, col))]) from None
        # a misspelled keyword (`geometyr`, `lrr=`) lexes as a name: say which keyword it resembles
        hint = did_you_mean(tok, [_KEYWORDS[n] for n in exc.expected if n in _KEYWORDS]) if tok.type == "IDENT" else ""
        if "COLON" in exc.expected and not hint:
            hint = " (a rule's match ends with ':')"
        raise SpecError([language_diagnostic("GO001", f"unexpected {_describe(tok)}; "
                                                      f"expected one of {_expected(exc.expected)}{hint}",
                                             file, (line, col))]) from None
    except UnexpectedEOF as exc:
        raise SpecError([language_diagnostic("GO001", f"unexpected end of input; "
                                                      f"expected one of {_expected(exc.expected)}",
                                             file, _end(text))]) from None
    except UnexpectedInput as exc:  # pragma: no cover - the three above cover LALR
        raise SpecError([language_diagnostic("GO001", f"syntax error: {exc}", file, (exc.line, exc.column))]) from None
    return Parsed(_Walker(source).start(tree), source)


_BODY_WORD = re.compile(r"(?<![\w\-])(geometry|constraint|lr|weight_decay|decay|direction|post|schedule|on_nonfinite"
                        r"|project_on_init|qk_clip|state|before|after|remove)\s*$")


def _end(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    return (len(lines), len(lines[-1]) + 1)


def _pos(item) -> tuple[int, int]:
    """Where a token or a subtree starts (a subtree: its first token; the parser keeps no
    positions of its own for trees, which would cost a third of a large spec's parse)."""
    while not isinstance(item, Token):
        item = item.children[0]
    assert item.line is not None and item.column is not None  # the lexer positions every token it makes
    return (item.line, item.column)


class _Walker:
    """Parse tree → plain data, recording each value's and key's position as it goes."""

    def __init__(self, source: SourceMap):
        self.source = source

    def error(self, code, message, item):
        raise SpecError([language_diagnostic(code, message, self.source.file, _pos(item))])

    def string(self, tok) -> str:
        try:
            value = json.loads(tok, strict=False)
        except json.JSONDecodeError as exc:
            self.error("GO001", f"bad string literal: {exc.msg} "
                                "(strings use JSON escapes: \\\\, \\\", \\n, \\uXXXX)", tok)
        if any("\ud800" <= ch <= "\udfff" for ch in value):  # "\ud800" alone: not text (YAML refuses it too)
            self.error("GO001", "bad string literal: lone surrogate escape "
                                "(write a \\uXXXX pair, or the character itself)", tok)
        return value

    def integer(self, tok) -> int:
        error = int_literal_error(None, str(tok).lstrip("+-"))
        if error:
            self.error("GO010", error, tok)
        return int(tok)

    def put(self, out: dict, path, key: str, key_item, value_item, value):
        if key in out:
            first = self.source.keys[path + (key,)]
            self.error("GO002", f"duplicate key '{key}' (first given at line {first[0]}, column {first[1]}): "
                                "remove one", key_item)
        self.source.keys[path + (key,)] = _pos(key_item)
        out[key] = value

    def start(self, tree: Tree) -> dict:
        version, *statements = tree.children
        self.extends = any(st.data == "extends_stmt" for st in statements)
        out: dict = {}
        self.source.values[()] = (1, 1)
        tok = version.children[1]
        assert isinstance(tok, Token)  # the grammar's version statement: GEOMOPT INT
        self.source.values[("geomopt",)] = _pos(tok)
        self.put(out, (), "geomopt", version.children[0], tok, self.integer(tok))
        rules: list[dict] = []
        for st in statements:
            kind = st.data
            if kind == "name_stmt":
                self.source.values[("name",)] = _pos(st.children[1])
                self.put(out, (), "name", st.children[0], st.children[1], self.string(st.children[1]))
            elif kind == "extends_stmt":
                self.put(out, (), "extends", st.children[0], st.children[1], self.value(st.children[1], ("extends",)))
            elif kind == "description_stmt":
                self.source.values[("description",)] = _pos(st.children[1])
                self.put(out, (), "description", st.children[0], st.children[1], self.string(st.children[1]))
            elif kind == "defaults_stmt":
                path = ("defaults",)
                self.source.values[path] = _pos(st)
                defaults: dict = {}
                for setting in st.children[1:]:
                    self.item(defaults, path, setting)
                self.put(out, (), "defaults", st.children[0], st, defaults)
            elif kind == "roles_stmt":
                path = ("roles",)
                self.source.values[path] = _pos(st)
                roles: dict = {}
                for entry in st.children[1:]:
                    role, _eq, value = entry.children
                    self.put(roles, path, str(role), role, value, self.value(value, path + (str(role),)))
                self.put(out, (), "roles", st.children[0], st, roles)
            else:
                if "rules" not in out:
                    out["rules"] = rules
                    self.source.keys[("rules",)] = _pos(st)
                    self.source.values[("rules",)] = _pos(st)
                rules.append(self.rule(st, ("rules", len(rules))))
        return out

    def rule(self, tree: Tree, path) -> dict:
        rule_kw, ident, *rest = tree.children
        self.source.values[path] = _pos(tree)
        out: dict = {}
        self.source.values[path + ("name",)] = _pos(ident)
        self.put(out, path, "name", ident, ident, str(ident))
        items = iter(rest)
        # no match: an override of a base rule (geomopt.spec.extends)
        if isinstance(rest[0], Token) and rest[0].type == "COLON":
            if not self.extends:
                self.error("GO001", "unexpected token ':'; expected one of match (a rule without a match only "
                           "overrides a base rule, in a spec with 'extends')", rest[0])
            next(items)
        else:
            self.match(out, path, items)
        for item in items:
            self.item(out, path, item)
        return out

    def match(self, out: dict, path, items) -> None:
        """``match …:``: the match items up to the colon."""
        match_kw = next(items)
        match: dict = {}
        mpath = path + ("match",)
        self.source.values[mpath] = _pos(match_kw)
        self.source.keys[mpath] = _pos(match_kw)
        out["match"] = match
        for item in items:
            if isinstance(item, Token) and item.type == "COLON":
                break
            if item.data == "match_pattern":
                tok = item.children[0]
                self.source.values[mpath + ("name",)] = _pos(tok)
                self.put(match, mpath, "name", tok, tok, self.string(tok))
            else:
                key_tree, _eq, value = item.children
                key = str(key_tree.children[0])
                self.put(match, mpath, key, key_tree, value, self.value(value, mpath + (key,), key))

    def item(self, out: dict, path, tree: Tree) -> None:
        """``geometry …`` / ``constraint …`` / ``lr=…``: one field of a rule or of defaults."""
        head = tree.children[0]
        key_tok = head.children[0] if isinstance(head, Tree) else head
        key = str(key_tok)
        value = tree.children[-1]
        self.put(out, path, key, key_tok, value, self.value(value, path + (key,), key))

    def value(self, item, path, field: str | None = None):
        if len(path) > MAX_DEPTH:
            self.error("GO010", f"spec nested too deeply (more than {MAX_DEPTH} levels)", item)
        self.source.values[path] = _pos(item)
        if isinstance(item, Token):  # a terminal standing alone
            return str(item)
        kind = item.data
        if kind == "call":
            return self.call(item, path, field)
        if kind == "list":
            values = [c for c in item.children if not (isinstance(c, Token) and c.type in ("LSQB", "RSQB", "COMMA"))]
            item_field = field if field == "post" else None  # a list of stages: bare words name kinds
            return [self.value(v, path + (i,), item_field) for i, v in enumerate(values)]
        tok = item.children[0]
        if kind == "string":
            return self.string(tok)
        if kind == "number":
            text = str(tok)
            return self.integer(tok) if text.lstrip("+-").isdigit() else float(text)
        if kind == "true":
            return True
        if kind == "false":
            return False
        if field in KIND_FIELDS:  # bare word naming a kind
            self.source.values[path + ("kind",)] = _pos(tok)
            return {"kind": str(tok)}
        return str(tok)

    def call(self, item: Tree, path, field) -> dict:
        ident = item.children[0]
        out: dict = {}
        self.source.values[path + ("kind",)] = _pos(ident)
        out["kind"] = str(ident)
        args = [c for c in item.children[1:] if isinstance(c, Tree)]
        positional = [a for a in args if a.data == "positional"]
        if positional:
            if field != "geometry" or len(positional) > 1 or args[0].data != "positional":
                self.error("GO005", "positional argument not allowed here: write name=value "
                                    "(only a geometry takes one, its reference, first)", positional[-1])
            ref = positional[0].children[0]
            self.source.keys[path + ("reference",)] = _pos(ref)
            out["reference"] = self.value(ref, path + ("reference",), "reference")
        for arg in args:
            if arg.data == "keyword":
                key_tree, _eq, value = arg.children
                key = str(key_tree.children[0])
                if key == "kind":
                    self.error("GO005", "'kind' is the call's name: write kind(…) instead of kind=…", key_tree)
                self.put(out, path, key, key_tree, value, self.value(value, path + (key,), key))
        if field == "state":  # ``state bfloat16(compensation=int8)``: the call's name is the dtype
            self.source.values[path + ("dtype",)] = self.source.values.pop(path + ("kind",))
            out = {"dtype": out.pop("kind"), **out}
        return out
