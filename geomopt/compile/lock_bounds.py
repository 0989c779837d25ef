"""The bounds a lock file's JSON is read within, checked before json.loads: nesting at most
:data:`MAX_LOCK_DEPTH` levels (json.loads recurses once per level) and numbers of at most
:data:`~geomopt.spec.source.MAX_INT_DIGITS` digits (``int`` refuses more), and where a string holds
half a surrogate pair (a name no file system or terminal can write). :mod:`geomopt.compile.lock`
reads lock files with them."""

from __future__ import annotations

import itertools
import re
from typing import Optional

from geomopt.spec.source import MAX_INT_DIGITS

MAX_LOCK_DEPTH = 16  # JSON levels; a lock nests 4 (the object, "tensors", an entry, its shape)


def lone_surrogate(value) -> bool:
    """Whether a parsed JSON value holds a string (or key) with a lone surrogate (depth bounded)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(lone_surrogate(k) or lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(map(lone_surrogate, value))


_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string (unrolled: linear, no backtracking)
_TOKEN = re.compile(_STRING + r"|[][{}]|-?\d+")
_DIGITS_AS_0 = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))  # every digit 0, all else a space
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _STEP)
SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # an escape of half a pair (or of a backslash and text: looked at)
_HIGH, _LOW = r"\\u[dD][89abAB][0-9a-fA-F]{2}", r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
# where: a \uD800-\uDFFF escape not in a high-low pair, after an even number of backslashes (an escape)
LONE_SURROGATE = re.compile(rf"(?<!\\)(?:\\\\)*(?:{_HIGH}(?!{_LOW})|(?<!{_HIGH}){_LOW})")


def may_be_unbounded(text: str) -> bool:
    """A quick look, in one pass at C speed but for the brackets: whether ``text`` has a digit run
    over :data:`~geomopt.spec.source.MAX_INT_DIGITS` or brackets nested deeper than
    :data:`MAX_LOCK_DEPTH`, strings included (a name's brackets or digits only send the text to
    :func:`json_bound_error`; closing brackets in a string that hide a depth leave json.loads to
    raise RecursionError, which :func:`geomopt.compile.lock.loads` also sends there)."""
    raw = text.encode("utf-8", "surrogatepass")
    if _LONG_RUN in raw.translate(_DIGITS_AS_0):
        return True
    brackets = raw.translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_LOCK_DEPTH


def json_bound_error(text: str) -> Optional[tuple[int, str]]:
    """(offset, what) of the first bracket nested deeper than :data:`MAX_LOCK_DEPTH` or number of
    more than :data:`~geomopt.spec.source.MAX_INT_DIGITS` digits outside the strings of ``text``,
    or None: json.loads recurses once per level (a RecursionError at a thousand) and converts
    digits with ``int`` (a ValueError past 4,300). One scan of the tokens, in Python: run where
    :func:`may_be_unbounded` says there may be something to find."""
    depth = 0
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token[0] in "[{":
            depth += 1
            if depth > MAX_LOCK_DEPTH:
                return m.start(), f"JSON nested too deeply (more than {MAX_LOCK_DEPTH} levels; a lock nests 4)"
        elif token[0] in "]}":
            depth -= 1
        elif token[0] != '"' and len(token.lstrip("-")) > MAX_INT_DIGITS:
            return m.start(), (f"a number of {len(token.lstrip('-')):,} digits (at most {MAX_INT_DIGITS:,}; a "
                               f"lock's numbers are tensor sizes)")
    return None
