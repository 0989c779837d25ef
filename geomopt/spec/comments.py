"""Comments of a spec file, so that ``geomopt fmt`` keeps them (in YAML, in the DSL, and across).

Both spellings comment with ``#`` to the end of the line. PyYAML and the DSL grammar drop
comments, so they are found in the source text (:func:`scan_yaml`: the gaps between PyYAML's
tokens, so a ``#`` inside a quoted or block string is text; :func:`scan_dsl`: outside ``"…"``
strings) and attached to the spec's *elements* by the positions the front ends record
(:class:`~geomopt.spec.source.SourceMap`). An element is a path:

* a mapping key: ``("defaults", "lr")``, ``("rules", 2, "geometry", "approx")`` (in the DSL a
  call's keyword argument; a geometry's positional reference is its ``reference``);
* a rule: ``("rules", 2)`` (YAML: its ``- name:`` line; DSL: its ``rule … match …:`` line).

How a comment attaches:

* own-line comments before the first element are the file's **header** (printed first);
* other own-line comments attach to the **next** element (``before``) and print, in order, on
  the lines just above it, indented as it is;
* a comment at the end of a line is **trailing** for the first element that starts on that line
  (``- name: x  # c`` is the rule's, ``approx: {…}  # c`` the ``approx`` key's); on a line where
  no element starts (a list or call continued over lines) it is the trailing comment of the
  nearest element above, or, if that already has one, a ``before`` comment of the next;
* own-line comments after the last element are the **footer** (printed last, after a blank line).

The printers (:mod:`geomopt.spec.printers`) print only elements that differ from defaults, and
some that YAML writes (``kind:``, a rule's ``name:``, ``rules:``) have no line in the DSL. So
before printing, :meth:`Comments.resolve` moves the comments of every element that is not
printed: to its nearest printed ancestor (a trailing comment stays trailing where that is free,
else goes above it), those of ``rules:`` to the first rule; a top-level key that is not printed
hands its comments to the next top-level element. Both printers print the same elements, so
YAML → DSL → YAML keeps every comment text on the same element, and printing is a fixed point.

The ``# yaml-language-server: $schema=…`` modeline (which editors read to validate a YAML spec
against ``schema/geomopt-1.schema.json``) is a header comment in both spellings: the printers
write it first, spelled ``# yaml-language-server: $schema=URL``, in YAML and in the DSL alike
(where it means nothing to the DSL, but is carried so that converting back restores it). Only
the header holds it: elsewhere that text is an ordinary comment. Blank lines are layout, not
content: the canonical form decides them.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Iterable, Optional

import yaml

from geomopt.spec.source import SourceMap

Path = tuple

MODELINE = re.compile(r"^#\s*yaml-language-server\s*:\s*\$schema\s*=\s*(\S+)\s*$")
_TOP = ("geomopt", "name", "description", "defaults", "roles", "rules")


@dataclasses.dataclass(frozen=True)
class Comment:
    """One ``#`` comment: where it starts (1-based), its text from ``#`` (right-stripped), and
    whether it stands alone on its line."""

    line: int
    col: int
    text: str
    own_line: bool


@dataclasses.dataclass
class Comments:
    """The comments of one spec file, attached to its elements (paths, see the module docstring).
    Texts keep their ``#``."""

    header: list = dataclasses.field(default_factory=list)
    before: dict = dataclasses.field(default_factory=dict)
    trailing: dict = dataclasses.field(default_factory=dict)
    footer: list = dataclasses.field(default_factory=list)
    #: ("before" | "trailing", path) → the source line of its first comment, so that comments
    #: moved together keep their order in the file
    lines: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.header or self.before or self.trailing or self.footer)

    def texts(self) -> list[str]:
        """Every comment text, header first (for checks that nothing was lost)."""
        out = list(self.header)
        for texts in self.before.values():
            out += texts
        out += list(self.trailing.values())
        return out + list(self.footer)

    def modeline(self) -> Optional[str]:
        """The header's ``$schema`` modeline, in its canonical spelling, or None."""
        for text in self.header:
            m = MODELINE.match(text)
            if m:
                return f"# yaml-language-server: $schema={m.group(1)}"
        return None

    def header_lines(self) -> list[str]:
        """The header as printed: the modeline first (canonical spelling), then the rest in order."""
        modeline = self.modeline()
        if modeline is None:
            return list(self.header)
        rest = list(self.header)
        rest.pop(next(i for i, t in enumerate(rest) if MODELINE.match(t)))
        return [modeline, *rest]

    def has_inside(self, path: Path) -> bool:
        """Whether an element strictly below ``path`` carries a comment."""
        n = len(path)
        return any(len(p) > n and p[:n] == path for p in (*self.before, *self.trailing))

    def resolve(self, printed: Iterable[Path]) -> "Comments":
        """These comments with every one on an element outside ``printed`` moved to an element
        that is printed (see the module docstring); ``printed`` lists elements in print order."""
        order = list(printed)
        keep = set(order)
        header, footer = list(self.header), list(self.footer)
        before: dict = {}
        trailing: dict = {}
        moved: list = []  # comments on elements not printed: (source line, path, texts, was trailing)
        for path, texts in self.before.items():
            if path in keep:
                before.setdefault(path, []).extend(texts)
            else:
                moved.append((self.lines.get(("before", path), 0), path, list(texts), False))
        for path, text in self.trailing.items():
            if path in keep:
                trailing[path] = text
            else:
                moved.append((self.lines.get(("trailing", path), 0), path, [text], True))
        moved.sort(key=lambda m: m[0])  # stable: insertion order where lines are unknown
        tail: list = []
        ahead: dict = {}  # comments moved onto a later element go above its own, in file order
        for _, path, texts, was_trailing in moved:
            target, ancestor = _home(path, keep, order)
            if target is None:
                tail += texts
            elif not ancestor:
                ahead.setdefault(target, []).extend(texts)
            elif was_trailing and len(texts) == 1 and target not in trailing:
                trailing[target] = texts[0]
            else:  # onto an ancestor: below (after) the ancestor's own comments
                before.setdefault(target, []).extend(texts)
        for target, texts in ahead.items():
            before[target] = texts + before.get(target, [])
        footer = tail + footer
        # before the first element is the header, in both spellings
        header += before.pop(("geomopt",), [])
        return Comments(header=header, before=before, trailing=trailing, footer=footer)


def _home(path: Path, keep: set, order: list) -> tuple:
    """(printed element, whether it is an ancestor) for a path not printed; (None, False): the footer."""
    if path == ("rules",):
        first = next((p for p in order if len(p) == 2 and p[0] == "rules"), None)
        return first, False
    for n in range(len(path) - 1, 0, -1):
        if path[:n] in keep:
            return path[:n], True
    # a top-level key that is not printed (an empty `defaults: {}`): the next top-level element
    at = _TOP.index(path[0]) if path and path[0] in _TOP else len(_TOP)
    for key in _TOP[at + 1:]:
        if (key,) in keep:
            return (key,), False
        if key == "rules":
            return _home(("rules",), keep, order)
    return None, False


# ---------------------------------------------------------------- finding comments


def scan_yaml(text: str) -> list[Comment]:
    """The comments of YAML text that PyYAML can scan (a ``#`` inside a quoted or block scalar is
    text, not a comment)."""
    tokens = list(yaml.scan(text, Loader=yaml.SafeLoader))
    found: dict = {}
    pos = 0
    for tok in sorted(tokens, key=lambda t: (t.start_mark.index, t.end_mark.index)):
        start, end = tok.start_mark.index, tok.end_mark.index
        if start > pos:
            _gap(text, pos, start, found)
        if end > start and (isinstance(tok, yaml.DirectiveToken) or
                            (isinstance(tok, yaml.ScalarToken) and tok.style in ("|", ">"))):
            # the scanner takes a comment on a directive's or a block scalar's indicator line
            line_end = text.find("\n", start, end)
            _gap(text, start, end if line_end < 0 else line_end, found, after_word=True)
        pos = max(pos, end)
    if pos < len(text):
        _gap(text, pos, len(text), found)
    return [found[k] for k in sorted(found)]


def _gap(text: str, start: int, end: int, found: dict, after_word: bool = False) -> None:
    """Comments in ``text[start:end]``, a stretch holding no token (or, ``after_word``, the rest of
    an indicator line, where a comment starts at a ``#`` after a space)."""
    i = start
    while i < end:
        at = text.find("#", i, end)
        if at < 0:
            return
        if after_word and at > start and text[at - 1] not in " \t":
            i = at + 1
            continue
        line_end = text.find("\n", at)
        line_end = len(text) if line_end < 0 else line_end
        _add(text, at, line_end, found)
        i = line_end + 1


def _add(text: str, at: int, line_end: int, found: dict) -> None:
    line_start = text.rfind("\n", 0, at) + 1
    line = text.count("\n", 0, at) + 1
    comment = Comment(line, at - line_start + 1, text[at:line_end].rstrip(), not text[line_start:at].strip())
    found[(line, comment.col)] = comment


def scan_dsl(text: str) -> list[Comment]:
    """The comments of DSL text (``#`` to the end of the line, outside ``"…"`` strings)."""
    found: dict = {}
    i, n, in_string = 0, len(text), False
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch in '"\n':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "#":
            line_end = text.find("\n", i)
            line_end = n if line_end < 0 else line_end
            _add(text, i, line_end, found)
            i = line_end
            continue
        i += 1
    return [found[k] for k in sorted(found)]


# ---------------------------------------------------------------- attaching comments


def anchors_of(source: SourceMap) -> list[tuple]:
    """The elements a parse recorded, as ``((line, col), path)`` sorted by position, outer first."""
    out = []
    for path, pos in source.keys.items():
        if path == ("rules",) and source.format == "dsl":  # the DSL has no `rules` line
            continue
        out.append((pos, path))
    for path, pos in source.values.items():
        if len(path) == 2 and path[0] == "rules" and isinstance(path[1], int):
            out.append((pos, path))
    return sorted(set(out), key=lambda a: (a[0], len(a[1])))


def attach(found: list[Comment], source: SourceMap) -> Comments:
    """Comments found in a file, attached to the elements of its parse (module docstring)."""
    anchors = anchors_of(source)
    out = Comments()
    if not anchors:
        out.header = [c.text for c in found]
        return out
    starts = [pos for pos, _ in anchors]
    by_line: dict = {}
    for pos, path in anchors:
        by_line.setdefault(pos[0], (pos, path))  # the first (outermost) element on each line

    def following(at: tuple) -> Optional[Path]:
        i = bisect.bisect_right(starts, at)
        return anchors[i][1] if i < len(anchors) else None

    for c in found:
        at = (c.line, c.col)
        if c.own_line:
            if at < starts[0]:
                out.header.append(c.text)
            else:
                _before(out, following(at), c)
            continue
        here = by_line.get(c.line)
        if here is not None and here[0] < at:
            target = here[1]
        else:  # no element starts on this line: the outermost one on the line of the nearest above
            i = bisect.bisect_left(starts, at) - 1
            target = by_line[starts[i][0]][1] if i >= 0 else None
        if target is not None and target not in out.trailing:
            out.trailing[target] = c.text
            out.lines[("trailing", target)] = c.line
        else:
            _before(out, following(at), c)
    return out


def _before(out: Comments, path: Optional[Path], c: Comment) -> None:
    if path is None:
        out.footer.append(c.text)
    else:
        out.before.setdefault(path, []).append(c.text)
        out.lines.setdefault(("before", path), c.line)


def collect(text: str, source: SourceMap) -> Comments:
    """The comments of spec ``text`` (parsed with ``source``), attached to its elements."""
    found = scan_dsl(text) if source.format == "dsl" else scan_yaml(text)
    return attach(found, source)
