"""Which regexes Python's backtracking engine runs in time linear in the name, so that
:mod:`geomopt.spec.patterns` may run them there (a tenth of RE2's cost per call) instead of on RE2.

Two parts: a parser for a subset of the syntax (RE2 runs every pattern with Python's meaning,
:mod:`geomopt.spec.regex_re2`, so the subset is about speed only): literals, escaped punctuation,
``.``, ``\\d``, ``\\w``, ``\\D``, ``\\W``, simple classes, groups, ``|``, repeats, ``^`` first and
``$`` last; and a bound on how many ways the engine tries through the parsed pattern.
Anything outside the subset, or over the bound, goes to RE2.
"""

from __future__ import annotations

import re


def backtracks_little(body: str) -> bool:
    """Whether Python's engine matches the regex ``body`` (already compiled by both engines) in
    O(len(name) · len(pattern)), meaning what RE2 means by it."""
    tree = _subset(body)
    return tree is not None and _tame(tree)


# The subset, parsed into ("lit", c) | ("char", source) | ("anchor",) | ("seq", items) |
# ("alt", arms) | ("rep", node, lo, hi, lazy).


class _NotSubset(Exception):
    pass


_CLASS_ESCAPES = "dwDW"  # not \D, \W inside a class (_class)


def _subset(body: str):
    """``body`` parsed, or None where it leaves the subset (then RE2 runs it)."""
    try:
        node, i = _alt(body, 0, top=True)
    except (_NotSubset, IndexError):
        return None
    return node if i == len(body) else None


def _alt(p: str, i: int, top: bool = False):
    arms = []
    while True:
        seq, i = _seq(p, i, top)
        arms.append(seq)
        if i < len(p) and p[i] == "|":
            i += 1
            continue
        return (arms[0] if len(arms) == 1 else ("alt", arms)), i


def _seq(p: str, i: int, top: bool):
    items: list = []
    n = len(p)
    while i < n and p[i] not in "|)":
        atom, i = _atom(p, i, top and not items, top)
        if atom[0] == "anchor":
            items.append(atom)
            continue
        if i < n and p[i] in "*+?{":
            if p[i] == "{":
                m = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}").match(p, i)
                if not m:
                    raise _NotSubset
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                i = m.end()
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[p[i]]
                i += 1
            lazy = i < n and p[i] == "?"
            i += lazy
            if i < n and p[i] in "*+?{":
                raise _NotSubset  # possessive or repeated repeat
            atom = ("rep", atom, lo, hi, lazy)
        items.append(atom)
    return ("seq", items), i


def _atom(p: str, i: int, first: bool, top: bool):
    c = p[i]
    if c == "(":
        if p.startswith("(?:", i):
            i += 3
        elif p.startswith("(?P<", i):
            m = re.compile(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>").match(p, i)
            if not m:
                raise _NotSubset
            i = m.end()
        elif p.startswith("(?", i):
            raise _NotSubset
        else:
            i += 1
        node, i = _alt(p, i)
        if i >= len(p) or p[i] != ")":
            raise _NotSubset
        return node, i + 1
    if c == "[":
        return _class(p, i)
    if c == ".":
        return ("char", "."), i + 1
    if c == "\\":
        e = p[i + 1]
        if e in _CLASS_ESCAPES:
            return ("char", p[i:i + 2]), i + 2
        if e.isascii() and not e.isalnum() and e.isprintable() and e != " ":
            return ("lit", e), i + 2
        raise _NotSubset
    if c == "^" and first and top:
        return ("anchor",), i + 1
    if c == "$" and top and i == len(p) - 1:
        return ("anchor",), i + 1
    if c in "^$*+?{}]":
        raise _NotSubset
    return ("lit", c), i + 1


def _class(p: str, i: int):
    start, i = i, i + 1
    if p[i] == "^":
        i += 1
    if p[i] == "]":
        raise _NotSubset  # a literal ']' first: spelled alike, but keep it simple
    prev = ""
    while p[i] != "]":
        c = p[i]
        if c == "[" or (c in "&-|~" and prev == c):
            raise _NotSubset  # nested sets, set operations (Python warns), POSIX classes (RE2)
        if c == "\\":
            e = p[i + 1]
            if not (e in "dw" or (e.isascii() and not e.isalnum() and e.isprintable() and e != " ")):
                raise _NotSubset
            prev = ""
            i += 2
            continue
        prev = c
        i += 1
    return ("char", p[start:i + 1]), i + 1


_PATHS = 64  # alternatives (of `|` and `?`) a tame pattern may try at each place


def _tame(node) -> bool:
    try:
        degree, paths = _cost(node, top=True)
    except _NotSubset:
        return False
    return degree <= 1 and paths <= _PATHS


def _single(node) -> bool:
    return node[0] in ("lit", "char")


def _excludes(node, c: str) -> bool:
    """Whether the one-character pattern ``node`` cannot match ``c``."""
    if node[0] == "lit":
        return node[1] != c
    return re.fullmatch(node[1], c) is None


def _cost(node, top: bool = False) -> tuple[int, int]:
    """(degree, paths): the backtracking engine tries at most O(len(name)^degree · paths) ways
    through ``node``, each in O(len(pattern)); raises _NotSubset for a repeated group (which may
    try exponentially many)."""
    kind = node[0]
    if kind in ("lit", "char", "anchor"):
        return 0, 1
    if kind == "alt":
        costs = [_cost(arm, top) for arm in node[1]]
        return max(d for d, _ in costs), sum(p for _, p in costs)
    if kind == "rep":
        _, body, lo, hi, _lazy = node
        if lo == hi:  # a fixed count: no choice of its own
            d, p = _cost(body)
            return d * lo, (1 if p == 1 else p ** lo if lo < 8 else _PATHS + 1)
        if _single(body):
            return (0, 2) if hi is not None and hi <= 1 else (1, 1)
        if hi is not None and hi <= 1:
            d, p = _cost(body)
            return d, p + 1
        raise _NotSubset
    items = _flat(node[1])
    degree, paths = 0, 1
    for j, item in enumerate(items):
        if item[0] == "rep" and _steady(items, j, top):
            continue
        d, p = _cost(item)
        degree, paths = degree + d, paths * p
    return degree, paths


def _flat(items: list) -> list:
    out: list = []
    for item in items:
        out += _flat(item[1]) if item[0] == "seq" else [item]
    return out


def _steady(items: list, j: int, top: bool) -> bool:
    """A greedy repeat of one character class C between a character not in C (or the start) and
    a character not in C (or the end) has one way to go on, and the places it starts from hold
    disjoint runs of C: it adds nothing to the degree."""
    _, body, _lo, hi, lazy = items[j]
    if not _single(body) or lazy or (hi is not None and hi <= 1):
        return False
    before, after = items[:j], items[j + 1:]
    if before and before[-1][0] != "anchor":
        ok_before = before[-1][0] == "lit" and _excludes(body, before[-1][1])
    else:
        ok_before = top and all(it[0] == "anchor" for it in before)
    if after and after[0][0] != "anchor":
        ok_after = after[0][0] == "lit" and _excludes(body, after[0][1])
    else:
        ok_after = top and all(it[0] == "anchor" for it in after)
    return ok_before and ok_after
