"""A Python regular expression, meaning what Python's :mod:`re` means by it, spelled for RE2.

RE2 runs any pattern in time linear in the name, but reads some of Python's syntax otherwise. So
the pattern is parsed by Python's own parser (``re._parser``) and written out anew, construct by
construct, where the two differ:

- every character item (a literal, ``.``, a class, ``\\d``, ``\\w``, ``\\s`` and their negations,
  under the flags ``i``, ``s``, ``a`` in force there) becomes the set of characters Python's engine
  matches with it, found by running that engine over every code point, and is written as explicit
  RE2 ranges: Unicode classes, case folding and ASCII mode agree by construction, whatever either
  side's Unicode version;
- ``$`` without ``m`` holds at the end and before a final line break; RE2's only at the end. A name
  that does not end in ``\\n`` is matched with ``$`` as ``\\z``; a name ``t + "\\n"`` is matched,
  as ``t``, against the pattern's right quotient by ``"\\n"`` (:func:`_quotient`);
- ``\\Z`` is RE2's ``\\z``; ``^`` and ``\\A`` its ``\\A``; ``(?m)`` anchors its ``(?m:^)``, ``(?m:$)``;
- ``\\B`` on the empty name follows Python (false before 3.14, true since);
- a lone surrogate, which a Python name may hold and UTF-8 (RE2's input) cannot, and, where the
  pattern has a Unicode ``\\b`` or ``\\B`` (RE2's are ASCII), a non-ASCII word character, is
  replaced in the name by a character that every item of the pattern treats alike (:func:`_recoder`);
  a pattern that tells such a character apart from all others is refused;
- verbose mode, ``(?#…)`` comments, scoped and global flags (``a``, ``i``, ``m``, ``s``, ``u``,
  ``x``), lazy repeats (a full match exists or not either way), ``{,n}``: read by Python's parser;
- refused (:class:`Untranslatable`, with what to write instead): backreferences, lookaround,
  conditionals, atomic groups, possessive repeats, counted repeats over :data:`MAX_REPEAT`.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import functools
import re
from typing import Callable, Optional

try:
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

MAX_REPEAT = 1000  # RE2's bound on a counted repeat ({n}, {m,n})
_TOP = 0x10FFFF
_NEVER = r"[^\x00-\x{10ffff}]"  # RE2: a class of no character

Ranges = tuple[tuple[int, int], ...]  # disjoint, sorted, inclusive code point ranges


class Untranslatable(ValueError):
    """A regex RE2 cannot run with Python's meaning; the message says what and what to write."""


@dataclasses.dataclass(frozen=True)
class Re2Form:
    """What RE2 runs for one Python regex: ``plain`` for a name that does not end in a line
    break; ``before_newline`` (None: none matches) for ``t`` where the name is ``t + "\\n"``;
    ``recode`` (None: nothing to do) maps a name to one RE2 reads as Python reads the name;
    ``empty``: the answer for the empty name where it is not ``plain``'s."""

    plain: str
    before_newline: Optional[str]
    recode: Optional[Callable[[str], str]]
    empty: Optional[bool]


_REFUSED = {  # what Python's parser names it: what RE2 lacks, and what to write instead
    "GROUPREF": ("backreferences (\\1, (?P=name))", "spell the repeated part out"),
    "GROUPREF_EXISTS": ("conditionals (?(group)yes|no)", "write both cases as alternatives"),
    "ASSERT": ("lookaround (?=…), (?<=…)", "match what stands there"),
    "ASSERT_NOT": ("lookaround (?!…), (?<!…)", "use a negated class or alternatives"),
    "ATOMIC_GROUP": ("atomic groups (?>…)", "use a plain group (?:…)"),
    "POSSESSIVE_REPEAT": ("possessive repeats (*+, ++, ?+, {m,n}+)", "use plain repeats"),
}


def translate(body: str) -> Re2Form:
    """``body`` (a regex Python compiles) as RE2 runs it with Python's meaning; raises
    :class:`Untranslatable`."""
    parsed = _sre_parse.parse(body, 0)
    tree = _tree(parsed, parsed.state.flags)
    kinds = _leaves(tree, "at")
    if kinds & {"ub", "uB"} and kinds & {"ab", "aB"}:
        raise Untranslatable("it mixes Unicode and ASCII word boundaries (\\b with and without the a flag), "
                             "which RE2 cannot tell apart: use one kind")
    empty = None
    if kinds & {"ub", "uB", "ab", "aB"} and _PY_B_ON_EMPTY != _RE2_B_ON_EMPTY:
        empty = _nullable(tree, _AT_EMPTY)
    recode, redrawn = _recoder(tree, kinds)
    if redrawn:
        tree = _redraw(tree, redrawn)
    return Re2Form(_emit(tree, _PLAIN), _quotient(tree), recode, empty)


# ---------------------------------------------------------------- Python's parse -> a small tree
# ("set", ranges) | ("seq", nodes) | ("alt", nodes) | ("rep", node, lo, hi or None) | ("at", kind)


def _tree(sub, flags: int) -> tuple:
    out: list[tuple] = []
    for op, av in sub.data:
        name = op.name
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            out.append(("set", _charset(op, av, flags)))
        elif name == "BRANCH":
            out.append(("alt", tuple(_tree(arm, flags) for arm in av[1])))
        elif name == "SUBPATTERN":
            _, add, remove, inner = av
            out.append(_tree(inner, (flags | add) & ~remove))
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):  # lazy or not, a full match exists or not alike
            lo, hi, inner = av
            hi = None if hi == _sre.MAXREPEAT else hi
            if max(lo, hi or 0) > MAX_REPEAT:
                raise Untranslatable(f"a repeat count is too large (at most {MAX_REPEAT}): use + or *")
            out.append(("rep", _tree(inner, flags), lo, hi))
        elif name == "AT":
            out.append(("at", _at_kind(av.name, flags)))
        else:
            feature, hint = _REFUSED.get(name, (name, "use a glob or several patterns"))
            raise Untranslatable(f"RE2, which matches in time linear in the name, has no {feature}: rewrite "
                                 f"the pattern without them ({hint})")
    return out[0] if len(out) == 1 else ("seq", tuple(out))


def _at_kind(at: str, flags: int) -> str:
    multiline, ascii_ = flags & re.MULTILINE, flags & re.ASCII
    return {"AT_BEGINNING": "bol" if multiline else "start", "AT_BEGINNING_STRING": "start",
            "AT_END": "eol" if multiline else "dollar", "AT_END_STRING": "end",
            "AT_BOUNDARY": "ab" if ascii_ else "ub", "AT_NON_BOUNDARY": "aB" if ascii_ else "uB"}[at]


def _leaves(node: tuple, leaf: str) -> set:
    """The values of a tree's ``leaf`` nodes (``at``: the assertions' kinds; ``set``: the classes'
    ranges), through sequences, alternatives and repeats."""
    kind = node[0]
    if kind == leaf:
        return {node[1]}
    if kind in ("seq", "alt"):
        return set().union(*(_leaves(n, leaf) for n in node[1]))
    return _leaves(node[1], leaf) if kind == "rep" else set()


# ---------------------------------------------------------------- character items


def _charset(op, av, flags: int) -> Ranges:
    """The characters Python's engine matches with one item under ``flags``."""
    name = op.name
    folds = flags & re.IGNORECASE
    if name == "ANY":
        return ((0, _TOP),) if flags & re.DOTALL else ((0, 9), (11, _TOP))
    if name == "LITERAL" and not folds:
        return ((av, av),)
    if name == "NOT_LITERAL" and not folds:
        return _complement(((av, av),))
    if name == "IN" and not folds and all(o.name in ("LITERAL", "RANGE", "NEGATE") for o, _ in av):
        ranges = _normal([(a, a) if o.name == "LITERAL" else a for o, a in av if o.name != "NEGATE"])
        return _complement(ranges) if av and av[0][0].name == "NEGATE" else ranges
    return _brute(_item_text(op, av), flags & (re.IGNORECASE | re.ASCII))


_CATEGORY = {"CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s",
             "CATEGORY_NOT_SPACE": r"\S", "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W"}


def _item_text(op, av) -> str:
    """One character item written back in Python's syntax (every character as ``\\U`` escape)."""
    if op.name == "LITERAL":
        return _py_char(av)
    if op.name == "NOT_LITERAL":
        return f"[^{_py_char(av)}]"
    return "[" + "".join(_class_part(o.name, a) for o, a in av) + "]"


def _class_part(op: str, av) -> str:
    if op == "NEGATE":
        return "^"
    if op == "RANGE":
        return f"{_py_char(av[0])}-{_py_char(av[1])}"
    return _CATEGORY[av.name] if op == "CATEGORY" else _py_char(av)


def _py_char(c: int) -> str:
    return f"\\U{c:08x}"


@functools.lru_cache(maxsize=None)
def _every_character() -> str:
    """Every code point, lone surrogates included, in order (one string of 1,114,112)."""
    return array.array("I", range(_TOP + 1)).tobytes().decode("utf-32-le", "surrogatepass")


@functools.lru_cache(maxsize=4096)
def _brute(item: str, flags: int) -> Ranges:
    """The code points Python's engine matches with the one-character ``item``: its runs over
    every code point."""
    runs = re.compile(f"(?:{item})+", flags).finditer(_every_character())
    return tuple((m.start(), m.end() - 1) for m in runs)


def _normal(ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _TOP:
        out.append((start, _TOP))
    return tuple(out)


def _contains(ranges: Ranges, c: int) -> bool:
    i = bisect.bisect_right(ranges, (c, _TOP + 1)) - 1
    return i >= 0 and ranges[i][0] <= c <= ranges[i][1]


@functools.lru_cache(maxsize=4096)
def _re2_class(ranges: Ranges) -> str:
    """``ranges`` in RE2's syntax, less the surrogates (UTF-8 has none: :func:`_recoder`)."""
    parts = []
    for lo, hi in ranges:
        for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
            if a <= b:
                parts.append(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}")
    if not parts:
        return _NEVER
    if len(parts) == 2 and ranges[0][0] == ranges[0][1] and ranges[1][0] == ranges[1][1] == ranges[0][0] + 32 \
            and 65 <= ranges[0][0] <= 90:
        # RE2 reads the class [Kk] as the letter k under its case folding, which an alternation
        # around it then widens to all of k's (KELVIN SIGN too); two literals stay themselves
        return f"(?:{parts[0]}|{parts[1]})"
    return parts[0] if len(parts) == 1 and "-" not in parts[0] else "[" + "".join(parts) + "]"


# ---------------------------------------------------------------- writing RE2

# Anchors for a name that does not end in "\n" (its `$` is the end), and for the part of a name
# t + "\n" before that line break, read as t (there `\Z` never holds: the line break follows).
_PLAIN = {"start": r"\A", "dollar": r"\z", "end": r"\z", "bol": "(?m:^)", "eol": "(?m:$)",
          "ub": r"\b", "uB": r"\B", "ab": r"\b", "aB": r"\B"}
_BEFORE = {**_PLAIN, "end": _NEVER}
# Whether each anchor holds after a final line break (a name not empty), and in the empty name.
_PY_B_ON_EMPTY = re.fullmatch(r"\B", "") is not None  # False before Python 3.14
_RE2_B_ON_EMPTY = True
_AT_END = {"start": False, "dollar": True, "end": True, "bol": True, "eol": True,
           "ub": False, "uB": True, "ab": False, "aB": True}
_AT_EMPTY = {"start": True, "dollar": True, "end": True, "bol": True, "eol": True,
             "ub": False, "uB": _PY_B_ON_EMPTY, "ab": False, "aB": _PY_B_ON_EMPTY}


def _emit(node: tuple, anchors: dict[str, str]) -> str:
    kind = node[0]
    if kind == "set":
        return _re2_class(node[1])
    if kind == "at":
        return anchors[node[1]]
    if kind == "seq":
        return "".join(_emit(n, anchors) for n in node[1]) or "(?:)"
    if kind == "alt":
        return "(?:" + "|".join(_emit(n, anchors) for n in node[1]) + ")"
    _, inner, lo, hi = node
    return _repeat(_emit(inner, anchors), lo, hi)


def _repeat(text: str, lo: int, hi: Optional[int]) -> str:
    if hi == 0:
        return "(?:)"
    count = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
    if count is None:
        count = f"{{{lo},}}" if hi is None else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
    return f"(?:{text}){count}"


def _nullable(node: tuple, anchors: dict[str, bool]) -> bool:
    """Whether ``node`` matches the empty string where each anchor holds as ``anchors`` says."""
    kind = node[0]
    if kind == "set":
        return False
    if kind == "at":
        return anchors[node[1]]
    if kind == "seq":
        return all(_nullable(n, anchors) for n in node[1])
    if kind == "alt":
        return any(_nullable(n, anchors) for n in node[1])
    return node[2] == 0 or _nullable(node[1], anchors)


def _alternatives(options: list[str]) -> Optional[str]:
    return None if not options else options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def _quotient(node: tuple) -> Optional[str]:
    """RE2 for {t : ``node`` fully matches t + "\\n"} (None: no t), read on t: what comes before
    the final line break as :data:`_BEFORE` reads it, the one item that takes it, then only what
    matches nothing there (:data:`_AT_END`). Linear in the pattern's size, times its nesting of
    repeats."""
    kind = node[0]
    if kind == "set":
        return "" if _contains(node[1], 10) else None
    if kind == "at":
        return None
    if kind == "alt":
        return _alternatives([q for q in map(_quotient, node[1]) if q is not None])
    if kind == "seq":  # a b c: a (b (q(c) | q(b) if c fits the end) | q(a) if b c fit the end)
        acc, rest_fits = None, True
        for item in reversed(node[1]):
            options = [] if acc is None else [_emit(item, _BEFORE) + acc]
            q = _quotient(item)
            if q is not None and rest_fits:
                options.append(q)
            acc, rest_fits = _alternatives(options), rest_fits and _nullable(item, _AT_END)
        return acc
    _, inner, lo, hi = node  # the line break in iteration j: j - 1 before it, the rest match nothing
    q = _quotient(inner)
    if q is None or hi == 0:
        return None
    before_lo = 0 if _nullable(inner, _AT_END) else max(lo - 1, 0)
    before_hi = None if hi is None else hi - 1
    return (_repeat(_emit(inner, _BEFORE), before_lo, before_hi) if before_hi != 0 else "") + q


# ---------------------------------------------------------------- names RE2 cannot read as given


def _recoder(tree: tuple, kinds: set[str]) -> tuple[Optional[Callable[[str], str]], dict[Ranges, Ranges]]:
    """A map of names onto names RE2 reads as Python reads the originals (None: the identity),
    and the items' character sets as RE2 must hold them for the mapped names.

    What the pattern sees of a character: which of its items hold it, whether it is a line break,
    whether it is a word character (as its ``\\b`` says, if it has one). RE2 sees the same of every
    character but a lone surrogate (UTF-8 has none) and, where ``\\b`` is Unicode's, a non-ASCII
    word character (RE2's ``\\b`` is ASCII). Each such character is replaced by a stand-in RE2
    sees as the pattern sees the original: one of the characters the pattern sees alike, else a
    character borrowed from a group of several the pattern sees alike (its own occurrences then
    stand in for another of its group, and the items are redrawn to hold it as they hold what it
    stands for). The name's match is unchanged."""
    unicode_b = bool(kinds & {"ub", "uB"})
    sets = sorted(_leaves(tree, "set"))
    word: Ranges = ()  # the word characters \\b sees (none where the pattern has no \\b)
    if kinds & {"ub", "uB", "ab", "aB"}:
        word = _brute(r"\w", 0 if unicode_b else re.ASCII)
    cuts = {0, 10, 11, 128, 0xD800, 0xE000, _TOP + 1}
    for ranges in sets + [word, _brute(r"\w", re.ASCII) if unicode_b else ()]:
        for lo, hi in ranges:
            cuts.update((lo, hi + 1))
    bounds = sorted(cuts)
    fit: dict[tuple, list[int]] = {}  # per way of being seen: its characters RE2 sees so (piece starts)
    odd: list[tuple[int, int, tuple]] = []
    for lo, end in zip(bounds, bounds[1:]):  # each piece: every character alike for both engines
        seen = (tuple(_contains(r, lo) for r in sets), lo == 10, _contains(word, lo))
        if 0xD800 <= lo <= 0xDFFF or (unicode_b and lo >= 128 and seen[2]):
            odd.append((lo, end - 1, seen))
        else:
            fit.setdefault(seen, []).extend(range(lo, min(end, lo + 64)))
    if not odd:
        return None, {}
    borrowed: dict[int, tuple] = {}  # a borrowed character -> how the pattern sees what it stands for
    stand_in: dict[tuple, int] = {}
    for _, _, seen in odd:
        if seen in stand_in:
            continue
        if seen in fit:
            stand_in[seen] = fit[seen][0]
            continue
        lender = next((s for s, chars in fit.items() if len(chars) > 1 and s[1:] == seen[1:]), None)
        if lender is None:
            raise Untranslatable("it tells apart more kinds of word characters than RE2's \\b can: write (?a) "
                                 "for an ASCII \\b, or drop \\b")
        stand_in[seen] = fit[lender].pop()
        borrowed[stand_in[seen]] = seen
    starts = [lo for lo, _, _ in odd]
    targets = [chr(stand_in[seen]) for _, _, seen in odd]
    back = {chr(c): chr(fit[_seen_of(c, sets, word)][0]) for c in borrowed}
    pick = re.compile("[" + "".join(f"{_py_char(lo)}-{_py_char(hi)}" for lo, hi, _ in odd)
                      + "".join(_py_char(ord(c)) for c in back) + "]")

    def swap(m: re.Match) -> str:
        c = m.group()
        return back.get(c) or targets[bisect.bisect_right(starts, ord(c)) - 1]

    check = str.isascii if unicode_b and not back else is_text if not back else None

    def recode(name: str) -> str:
        return name if check is not None and check(name) else pick.sub(swap, name)

    redrawn = {}
    for i, ranges in enumerate(sets):
        points = [(c, seen[0][i]) for c, seen in borrowed.items()]
        if points:
            redrawn[ranges] = _normal([r for lo, hi in ranges for r in _minus(lo, hi, points)]
                                      + [(c, c) for c, inside in points if inside])
    return recode, redrawn


def _seen_of(c: int, sets: list[Ranges], word: Ranges) -> tuple:
    return tuple(_contains(r, c) for r in sets), c == 10, _contains(word, c)


def _minus(lo: int, hi: int, points: list[tuple[int, bool]]) -> list[tuple[int, int]]:
    out = []
    for c in sorted(p for p, _ in points if lo <= p <= hi):
        if lo < c:
            out.append((lo, c - 1))
        lo = c + 1
    return out + ([(lo, hi)] if lo <= hi else [])


def _redraw(node: tuple, redrawn: dict[Ranges, Ranges]) -> tuple:
    kind = node[0]
    if kind == "set":
        return ("set", redrawn.get(node[1], node[1]))
    if kind in ("seq", "alt"):
        return (kind, tuple(_redraw(n, redrawn) for n in node[1]))
    return ("rep", _redraw(node[1], redrawn), node[2], node[3]) if kind == "rep" else node


def is_text(name: str) -> bool:
    """Whether ``name`` is text UTF-8 can hold (no lone surrogate, which RE2 cannot read)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
