"""Name patterns, matched in time linear in the name: globs on dotted names and ``re:`` regexes.

A glob reads ``*`` (a run within one segment), ``**`` (across segments, line breaks included;
``**.`` also stands for no segment at all, and so does a final ``.**``), ``?`` (one character, not
a dot); other characters are literal. ``re:…`` is a regular expression matched against the whole
name (``re.fullmatch``) with Python's syntax and meaning, or refused: RE2 runs it as
:mod:`geomopt.spec.regex_re2` writes it, which refuses what a linear-time engine cannot do
(backreferences, lookaround, atomic groups, possessive repeats, conditionals) and counted repeats
over 1000.

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
import warnings
from typing import Any, Callable, Optional

from geomopt.spec.regex_cost import backtracks_little
from geomopt.spec.regex_re2 import MAX_REPEAT, Untranslatable, is_text, translate

# glob tokens
_LIT, _ONE, _STAR, _DSTAR, _LEAD, _TRAIL = range(6)
_PY = {_ONE: r"[^.]", _STAR: r"[^.]*", _DSTAR: r"(?s:.*)", _LEAD: r"(?:(?s:.*)\.)?", _TRAIL: r"(?:\.(?s:.*))?"}


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
    if not is_text(pattern):
        raise PatternError(f"name pattern {_show(pattern)} holds a lone surrogate (not text): write the character "
                           f"itself")
    if pattern.startswith("re:"):
        return _compile_regex(pattern)
    tokens = _glob_tokens(pattern)
    python = _glob_regex(tokens)
    if _glob_fast(tokens):
        return NamePattern(pattern, re.compile(python).fullmatch, "re")
    return NamePattern(pattern, _re2_matcher(pattern, python), "re2")


@functools.lru_cache(maxsize=4096)
def pattern_error(pattern: str) -> Optional[str]:
    """Why ``pattern`` is refused (one line: what is wrong and what to write), or None. A glob
    that Python's engine runs is not compiled here (lint without a model compiles nothing)."""
    if not pattern.startswith("re:") and is_text(pattern) and _glob_fast(_glob_tokens(pattern)):
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


def _glob_regex(tokens: list[tuple[int, str]]) -> str:
    """The glob as a Python regex (``**`` crosses line breaks: a ModuleDict key may hold one)."""
    return "".join(re.escape(c) if k == _LIT else _PY[k] for k, c in tokens)


def _glob_fast(tokens: list[tuple[int, str]]) -> bool:
    """Whether Python's engine runs the glob in O(len(name) · len(pattern)) (else RE2 runs it).

    A ``*`` followed by a literal dot, a final ``.**`` or nothing has one way to go on (to its
    segment's end); so has a final ``**`` (to the name's end: ``**`` crosses line breaks too). Any
    other ``*``, a ``**.`` or an inner ``**`` may end anywhere: one of them is allowed. After an
    inner ``**`` or such a ``*``, every place it may end restarts what follows, so no ``*`` may
    come before the next literal dot (it would rescan one segment from each); after ``**.``
    (ending at dots only) each restart scans other segments."""
    n = len(tokens)
    loose = []
    for i, (kind, _) in enumerate(tokens):
        if kind == _LEAD or (kind == _DSTAR and i != n - 1):
            loose.append(i)
        elif kind == _STAR and i + 1 < n and tokens[i + 1] != (_LIT, ".") and tokens[i + 1][0] != _TRAIL:
            loose.append(i)
    if len(loose) > 1:
        return False
    if loose and tokens[loose[0]][0] != _LEAD:
        for kind, c in tokens[loose[0] + 1:]:
            if (kind, c) == (_LIT, "."):
                break
            if kind == _STAR:
                return False
    return True


# ---------------------------------------------------------------- regexes


def _compile_regex(pattern: str) -> NamePattern:
    body = pattern[3:]
    show = f"bad regular expression {_show(body)}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # "possible nested set": a later Python reads it otherwise
        try:
            re.compile(body)
        except re.error as exc:
            raise PatternError(f"{show}: {exc}") from None
        except (OverflowError, ValueError):  # a count past sys.maxsize, or of more than 4,300 digits
            raise PatternError(f"{show}: a repeat count is too large (at most {MAX_REPEAT})") from None
        except RecursionError:
            raise PatternError(f"{show}: nested too deeply") from None
        except FutureWarning as exc:  # Python reads it one way now, a later Python another
            raise PatternError(f"{show}: {exc}: escape the '[' or the doubled character (\\[, \\-) to mean it "
                               f"literally") from None
    fullmatch = _re2_matcher(pattern, body)
    if backtracks_little(body):
        return NamePattern(pattern, re.compile(body).fullmatch, "re")
    return NamePattern(pattern, fullmatch, "re2")


def _re2_matcher(pattern: str, body: str) -> Callable[[str], Any]:
    """RE2's full match of the Python regex ``body`` (:mod:`geomopt.spec.regex_re2`), with Python's
    meaning, in time linear in the name; raises :class:`PatternError`."""
    show = f"bad regular expression {_show(body)}" if pattern.startswith("re:") else f"name pattern {_show(pattern)}"
    try:
        form = translate(body)
        plain = _re2_compile(form.plain)
        before_newline = None if form.before_newline is None else _re2_compile(form.before_newline)
    except Untranslatable as exc:
        raise PatternError(f"{show}: {exc}") from None
    except RecursionError:
        raise PatternError(f"{show}: nested too deeply") from None
    except _Re2Refused as exc:  # only size: every construct RE2 lacks is refused by translate
        raise PatternError(f"{show}: too large for RE2 ({exc}), which allows repeat counts up to {MAX_REPEAT} "
                           f"and patterns of bounded size: shorten it, use + or *, or split it over several "
                           f"rules") from None
    recode, empty = form.recode, form.empty

    def fullmatch(name: str):
        if recode is not None:
            name = recode(name)  # keeps line breaks where they are
        if name.endswith("\n"):  # Python's `$` holds before a final line break too
            return None if before_newline is None else before_newline(name[:-1].encode("utf-8"))
        if empty is not None and not name:
            return name if empty else None  # "" is falsy: compare with None
        return plain(name.encode("utf-8"))

    return fullmatch


class _Re2Refused(Exception):
    pass


def _re2_compile(rx: str) -> Callable[[bytes], Any]:
    import re2  # optional dependency

    options = re2.Options()
    options.log_errors = False  # RE2 would print its refusal on stderr too
    try:
        return re2.compile(rx, options).fullmatch
    except re2.error as exc:
        why = exc.args[0] if exc.args else exc
        raise _Re2Refused(why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)) from None
