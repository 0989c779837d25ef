"""Name patterns, matched in time linear in the name: globs on dotted names and ``re:`` regexes.

A glob reads ``*`` (a run within one segment), ``**`` (across segments; ``**.`` also stands for no
segment at all, and so does a final ``.**``), ``?`` (one character, not a dot); other characters
are literal. ``re:…`` is a regular expression matched against the whole name: Python's syntax and
meaning (``\\d``, ``\\w``, ``\\s`` are Unicode classes), less what a linear-time engine cannot do
(backreferences, lookaround, atomic groups, possessive repeats, conditionals, ``(?#…)``, ``(?x)``),
with counted repeats up to 1000; ``\\b``, ``\\B``, and ``\\D``, ``\\W``, ``\\S`` inside a class, are ASCII.

Why two engines: Python's :mod:`re` backtracks, so a hostile pattern (``re:(a+)+$``, or a glob with
many ``**``, each a ``.*``) takes time exponential, or polynomial of high degree, in the name's
length. RE2 (``google-re2``) runs any pattern in time linear in the name, but a call costs about
ten times Python's. So a pattern whose Python form provably backtracks little (at most one
wildcard or repeat that may take many lengths, the others hemmed in by characters they cannot
match, as in ``**.weight``, ``layers.*.attn.*.weight`` or ``re:blocks\\.\\d+\\.mlp\\..*``) runs on
Python's engine, in O(len(name) · len(pattern)), and every other pattern on RE2. The two agree on
every such pattern (``tests/test_hostile_input.py`` compares them).

Which patterns are refused, with what to do: :func:`pattern_error`.
"""

from __future__ import annotations

import functools
import re
import unicodedata
import warnings
from typing import Any, Callable, Optional

from geomopt.spec.regex_cost import backtracks_little

MAX_REPEAT = 1000  # RE2's bound on a counted repeat ({n}, {m,n})

# glob tokens
_LIT, _ONE, _STAR, _DSTAR, _LEAD, _TRAIL = range(6)
_PY = {_ONE: r"[^.]", _STAR: r"[^.]*", _DSTAR: r".*", _LEAD: r"(?:.*\.)?", _TRAIL: r"(?:\..*)?"}


class NamePattern:
    """A compiled name pattern: ``fullmatch(name)`` is not None iff the whole name matches.

    ``engine``: ``"re"`` (Python's, for patterns it runs fast) or ``"re2"``."""

    __slots__ = ("pattern", "fullmatch", "engine")

    def __init__(self, pattern: str, fullmatch: Callable[[str], Any], engine: str):
        self.pattern, self.fullmatch, self.engine = pattern, fullmatch, engine

    def __repr__(self) -> str:
        return f"NamePattern({self.pattern!r}, engine={self.engine!r})"


class PatternError(ValueError):
    """A name pattern no engine will run; the message says why and what to write instead."""


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> NamePattern:
    """``pattern`` (a glob, or ``re:`` and a regex) compiled; raises :class:`PatternError`."""
    if _has_surrogate(pattern):
        raise PatternError(f"name pattern {_show(pattern)} holds a lone surrogate (not text): write the character "
                           f"itself")
    if pattern.startswith("re:"):
        return _compile_regex(pattern)
    tokens = _glob_tokens(pattern)
    plan = _glob_plan(tokens)
    if plan is None:
        return NamePattern(pattern, _glob_re2(pattern, tokens), "re2")
    python = re.compile("".join(re.escape(c) if k == _LIT else _PY[k] for k, c in tokens)).fullmatch
    if not plan:
        return NamePattern(pattern, python, "re")
    slow = _glob_re2(pattern, tokens)

    def fullmatch(name: str):  # see _glob_plan: a line break may make Python's engine rescan
        return python(name) if "\n" not in name else slow(name)

    return NamePattern(pattern, fullmatch, "re")


@functools.lru_cache(maxsize=4096)
def pattern_error(pattern: str) -> Optional[str]:
    """Why ``pattern`` is refused (one line: what is wrong and what to write), or None. A glob
    that Python's engine runs is not compiled here (lint without a model compiles nothing)."""
    if not pattern.startswith("re:") and not _has_surrogate(pattern) and _glob_plan(_glob_tokens(pattern)) is not None:
        return None
    try:
        compile_pattern(pattern)
    except PatternError as exc:
        return str(exc)
    return None


def _show(text: str, limit: int = 60) -> str:
    """``text`` quoted for a message, cut to about ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"… ({len(text)} characters)"


# ---------------------------------------------------------------- globs


def _glob_tokens(pattern: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    i, n = 0, len(pattern)
    while i < n:
        if pattern.startswith("**.", i):
            out.append((_LEAD, ""))  # zero or more leading segments
            i += 3
        elif pattern.startswith(".**", i) and i + 3 == n:
            out.append((_TRAIL, ""))  # zero or more trailing segments
            i += 3
        elif pattern.startswith("**", i):
            if not out or out[-1] != (_DSTAR, ""):  # `****` is `**`
                out.append((_DSTAR, ""))
            i += 2
        elif pattern[i] == "*":
            out.append((_STAR, ""))
            i += 1
        elif pattern[i] == "?":
            out.append((_ONE, ""))
            i += 1
        else:
            out.append((_LIT, pattern[i]))
            i += 1
    return out


def _glob_plan(tokens: list[tuple[int, str]]) -> Optional[bool]:
    """None where Python's engine could take more than O(len(name) · len(pattern)) on the glob
    (RE2 runs it); else whether names with a line break must go to RE2.

    A ``*`` followed by a literal dot, a final ``.**`` or nothing has one way to go on (to its
    segment's end). Any other ``*``, a ``**.`` or an inner ``**`` may end anywhere: one of them is
    allowed. After an inner ``**`` or such a ``*``, every place it may end restarts what follows,
    so no ``*`` may come before the next literal dot (it would rescan one segment from each);
    after ``**.`` (ending at dots only) each restart scans other segments. A final ``**`` or
    ``.**`` ends the match at once, unless a line break stops it (``.`` does not match one): then,
    after a wildcard that restarts it, it would rescan up to the line break from each restart."""
    n = len(tokens)
    loose = []
    for i, (kind, _) in enumerate(tokens):
        if kind == _LEAD or (kind == _DSTAR and i != n - 1):
            loose.append(i)
        elif kind == _STAR and i + 1 < n and tokens[i + 1] != (_LIT, ".") and tokens[i + 1][0] != _TRAIL:
            loose.append(i)
    if len(loose) > 1:
        return None
    if loose and tokens[loose[0]][0] != _LEAD:
        for kind, c in tokens[loose[0] + 1:]:
            if (kind, c) == (_LIT, "."):
                break
            if kind == _STAR:
                return None
    return bool(loose) and tokens[-1][0] in (_DSTAR, _TRAIL)


def _glob_re2(pattern: str, tokens: list[tuple[int, str]]) -> Callable[[str], Any]:
    rx = "".join(_re2_escape(c) if k == _LIT else _PY[k] for k, c in tokens)
    try:
        return _re2_fullmatch(rx)
    except _Re2Refused as exc:  # only size: a glob is literals and wildcards
        raise PatternError(f"name pattern {_show(pattern)} is too large for the matcher ({exc}): shorten it, "
                           f"or split it over several rules") from None


def _re2_escape(c: str) -> str:
    return c if c.isalnum() or c == "_" or not c.isascii() else f"\\x{{{ord(c):x}}}"


# ---------------------------------------------------------------- regexes


def _compile_regex(pattern: str) -> NamePattern:
    body = pattern[3:]
    show = f"bad regular expression {_show(body)}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # "possible nested set": RE2 reads [[:alpha:]] otherwise
        try:
            re.compile(body)
        except re.error as exc:
            raise PatternError(f"{show}: {exc}") from None
        except (OverflowError, ValueError):  # a count past sys.maxsize, or of more than 4,300 digits
            raise PatternError(f"{show}: a repeat count is too large (at most {MAX_REPEAT})") from None
        except RecursionError:
            raise PatternError(f"{show}: nested too deeply") from None
        except FutureWarning as exc:  # Python reads it one way now, RE2 (and a later Python) another
            raise PatternError(f"{show}: {exc}: escape the '[' or the doubled character (\\[, \\-) to mean it "
                               f"literally") from None
    try:
        fullmatch = _re2_fullmatch(_for_re2(body))
    except _Re2Refused as exc:
        if "too large" in str(exc) or "repetition size" in str(exc):
            hint = (f"name patterns run on RE2, which allows repeat counts up to {MAX_REPEAT} and patterns of "
                    f"bounded size: shorten it, or use + or *")
        else:
            hint = ("name patterns run on RE2, in time linear in the name, which has no backreferences, "
                    "lookaround, atomic groups, possessive repeats, conditionals, (?#…) comments or the flags "
                    "a, u, L, x: rewrite the pattern without them, or use a glob or several patterns")
        raise PatternError(f"{show}: RE2 refuses it ({exc}); {hint}") from None
    if backtracks_little(body):
        return NamePattern(pattern, re.compile(body).fullmatch, "re")
    return NamePattern(pattern, fullmatch, "re2")


def _for_re2(body: str) -> str:
    """Python's spelling of what RE2 spells otherwise: ``\\Z`` is ``\\z``; ``\\uXXXX``, ``\\N{NAME}``, a
    backslash before any character but a letter or digit, ``\\b`` in a class, are ``\\x{…}``;
    ``{,n}`` is ``{0,n}`` (RE2 reads ``{,n}`` as text), ``\\d``, ``\\w``, ``\\s`` are Unicode classes."""
    out, i, n, in_class = [], 0, len(body), False
    while i < n:
        c = body[i]
        if c == "\\":
            esc = body[i:i + 2]
            m = _UNICODE_ESCAPE.match(body, i)
            if m:  # \uXXXX, \UXXXXXXXX: RE2 spells them \x{…}
                out.append(f"\\x{{{m.group(1) or m.group(2)}}}")
                i = m.end()
                continue
            m = _NAMED_ESCAPE.match(body, i)
            if m:  # \N{NAME}
                out.append(f"\\x{{{ord(unicodedata.lookup(m.group(1))):x}}}")
                i = m.end()
                continue
            e = body[i + 1:i + 2]
            if e and not (e.isascii() and e.isalnum()):  # Python: any other character stands for itself
                esc = f"\\x{{{ord(e):x}}}"
            elif esc == "\\Z" and not in_class:
                esc = "\\z"
            elif esc == "\\b" and in_class:  # a backspace, in a class
                esc = "\\x{8}"
            out.append((_CLASS_IN_CLASS if in_class else _CLASS).get(esc, esc))
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            if body.startswith("^", i):
                out.append("^")
                i += 1
            if body.startswith("]", i):  # a ']' first in a class is literal
                out.append("\\]")
                i += 1
            continue
        elif c == "{":
            m = re.compile(r"\{,(\d*)\}").match(body, i)
            if m:
                out.append("{0," + m.group(1) + "}")
                i = m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


# Python's \d, \w, \s are Unicode classes (str.isdecimal, isalnum and '_', isspace); RE2's are
# ASCII: spelled out, they read as Python reads them (Unicode versions apart). \D, \W, \S inside
# a class, and \b, \B, stay RE2's (ASCII): a class cannot hold a negated class in RE2.
_SPACE = (r"\t\n\x{b}\f\r\x{1c}-\x{1f} \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}"
          r"\x{205f}\x{3000}")
_CLASS = {"\\d": "\\p{Nd}", "\\D": "\\P{Nd}", "\\w": "[\\p{L}\\p{N}_]", "\\W": "[^\\p{L}\\p{N}_]",
          "\\s": f"[{_SPACE}]", "\\S": f"[^{_SPACE}]"}
_CLASS_IN_CLASS = {"\\d": "\\p{Nd}", "\\w": "\\p{L}\\p{N}_", "\\s": _SPACE}
_UNICODE_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")
_NAMED_ESCAPE = re.compile(r"\\N\{([^}]*)\}")


class _Re2Refused(Exception):
    pass


def _re2_fullmatch(rx: str) -> Callable[[str], Any]:
    import re2  # optional dependency

    options = re2.Options()
    options.log_errors = False  # RE2 would print its refusal on stderr too
    try:
        compiled = re2.compile(rx, options)
    except re2.error as exc:
        why = exc.args[0] if exc.args else exc
        raise _Re2Refused(why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)) from None
    match = compiled.fullmatch

    def fullmatch(name: str):
        try:
            return match(name.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: one character still (the pattern holds none)
            return match("".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in name).encode("utf-8"))

    return fullmatch


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
