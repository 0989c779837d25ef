"""The routing lock: which rule, role and matrix view each tensor gets, written to a file that CI
compares every later plan against.

Why: a spec routes tensors by role and name, and roles are inferred from the model's structure.
When a model's code, a transformers release or role inference changes, hidden matrices can drop
to a catch-all rule (Muon quietly becoming AdamW) and nothing fails: only a benchmark notices,
much later. A lock records the routing once (``geomopt plan SPEC --model … --lock FILE``);
``--check FILE`` and ``GeomOptimizer(…, expect=FILE)`` then refuse a plan that routes differently,
naming the tensors.

The file is JSON, one tensor per line, sorted by name (digits compared as numbers, so ``h.2``
comes before ``h.10``), without column padding: a routing change is a one-line change in a code
review, and adding a tensor does not touch the other lines. Its header records the format
version, the spec's name and hash, the model and the geomopt version that wrote it::

    {
      "geomopt-lock": 1,
      "spec": {"name": "muon", "hash": "3f1c0a9b2d4e5f60"},
      "model": "GPT",
      "geomopt": "0.1.0",
      "tensors": [
        {"name": "h.0.mlp.c_fc.weight", "shape": [256, 64], "role": "hidden", "rule": "hidden", "view": "256×64"},
        …
      ],
      "frozen": []
    }

Only routing is compared (the tensors, and per tensor its shape, role, rule and view): a spec edit
that changes an lr but no routing passes, and the header's differences (another spec, another
model) are said once above the diff, not counted as changes. ``view`` is the text of
:func:`geomopt.compile.plan.view_text` ("-" for a geometry that reads no matrix).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Optional, Union

from geomopt.version import __version__
from geomopt.compile.plan import Plan, view_text
from geomopt.compile.lock_bounds import (LONE_SURROGATE, SURROGATE, json_bound_error, lone_surrogate,
                                         may_be_unbounded)
from geomopt.spec.source import FileTooLarge, read_regular
from geomopt.spec.validate import gc_paused

LOCK_FORMAT = 1
FORMAT_KEY = "geomopt-lock"
WRITE_HINT = "write one with `geomopt plan SPEC --model … --lock FILE`"
READ_HINT = "give the file `geomopt plan SPEC --model … --lock FILE` wrote"
MAX_LOCK_BYTES = 32 << 20  # a lock line is about 110 bytes: some 300,000 tensors, six times a 60-layer MoE's
_HEADER_KEYS = (FORMAT_KEY, "spec", "model", "geomopt", "tensors")
_ENTRY_KEYS = ("name", "shape", "role", "rule", "view")
_ENTRY_SET = frozenset(_ENTRY_KEYS)


class LockError(ValueError):
    """A lock file that cannot be read: missing, not JSON, not a lock, a format this geomopt does
    not read, or an entry with missing or mistyped fields. The message names the file (and the
    line where it can)."""


class RoutingChangedError(ValueError):
    """The plan routes tensors differently from the lock it was expected to match (``expect=``).
    The message carries the diff; ``diff`` is the :class:`RoutingDiff`."""

    def __init__(self, message: str, diff: "RoutingDiff"):
        super().__init__(message)
        self.diff = diff


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one tensor goes: what a lock compares."""

    shape: tuple[int, ...]
    role: str
    rule: str
    view: str


@dataclasses.dataclass
class Lock:
    """A routing table with its header. ``routes``: tensor name → :class:`Route`; ``frozen``: the
    tensors the plan skipped (requires_grad False); ``file``: where it was read from, if read."""

    spec_name: str
    spec_hash: str
    model: Optional[str]
    version: str
    routes: dict[str, Route]
    frozen: tuple[str, ...] = ()
    file: Optional[str] = None


_DIGITS = re.compile(r"(\d+)")


def name_key(name: str) -> list:
    """Sort key of a tensor name: digit runs compare as numbers (``layers.2`` before ``layers.10``).
    re.split with a group alternates text and digits, so the types at each position agree. A run
    compares as (its length without leading zeros, those digits): the order of the numbers, in
    time linear in the run (``int`` of a run is quadratic, and refuses 4,300 digits)."""
    return [(len(t.lstrip("0")), t.lstrip("0")) if i % 2 else t for i, t in enumerate(_DIGITS.split(name))]


def model_label(model) -> Optional[str]:
    """The model's name for the header: its class, and the Hugging Face checkpoint it came from
    when it has one; None for an iterable of (name, tensor)."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    if not isinstance(model, torch.nn.Module):
        return None
    label = type(model).__name__
    source = getattr(getattr(model, "config", None), "_name_or_path", "")
    return f"{label} ({source})" if isinstance(source, str) and source else label


def lock_of(plan: Plan, spec_hash: str = "", model: Optional[str] = None) -> Lock:
    """The routing table of a compiled plan. ``spec_hash``: :func:`geomopt.optim.persist.checkpoint.spec_hash`
    of the plan's spec; ``model``: :func:`model_label` of the model (or a checkpoint's file name)."""
    routes = {p.name: Route(tuple(int(d) for d in p.shape), p.role, p.rule, view_text(p)) for p in plan.params}
    return Lock(plan.spec_name, spec_hash, model, __version__, routes, tuple(plan.frozen))


# ---------------------------------------------------------------- writing


def dumps(lock: Lock) -> str:
    """The lock's text: the header a key per line, then one tensor per line, sorted by :func:`name_key`."""
    def j(value) -> str:
        return json.dumps(value, ensure_ascii=False)

    rows = [j({"name": n, "shape": list(r.shape), "role": r.role, "rule": r.rule, "view": r.view})
            for n, r in sorted(lock.routes.items(), key=lambda item: name_key(item[0]))]
    frozen = [j(n) for n in sorted(lock.frozen, key=name_key)]
    return "\n".join([
        "{",
        f'  "{FORMAT_KEY}": {LOCK_FORMAT},',
        f'  "spec": {j({"name": lock.spec_name, "hash": lock.spec_hash})},',
        f'  "model": {j(lock.model)},',
        f'  "geomopt": {j(lock.version)},',
        f'  "tensors": {_block(rows)},',
        f'  "frozen": {_block(frozen)}',
        "}",
    ]) + "\n"


def _block(items: list[str]) -> str:
    return "[\n    " + ",\n    ".join(items) + "\n  ]" if items else "[]"


def write_lock(lock: Lock, path: Union[str, os.PathLike]) -> None:
    """Write ``lock`` to ``path`` (UTF-8). OSError propagates: the caller says what went wrong."""
    Path(path).write_text(dumps(lock), encoding="utf-8")


# ---------------------------------------------------------------- reading


def read_lock(path: Union[str, os.PathLike]) -> Lock:
    """Read and validate a lock file; raises :class:`LockError` naming the file for anything
    that is not a lock this geomopt reads. Read as a spec file is
    (:func:`geomopt.spec.source.read_regular`): a regular file only (a FIFO would block, a device
    never end), of at most :data:`MAX_LOCK_BYTES`, refused by its size before it is read."""
    file = os.fspath(path)
    try:
        data = read_regular(file, MAX_LOCK_BYTES)
    except FileNotFoundError:
        raise LockError(f"{file}: no such lock file; {WRITE_HINT}") from None
    except FileTooLarge as exc:
        raise LockError(f"{file}: lock too large ({exc.strerror}; the limit is {MAX_LOCK_BYTES}): "
                        f"{READ_HINT}") from None
    except OSError as exc:
        raise LockError(f"{file}: cannot read the lock: {exc.strerror or exc}; {READ_HINT}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise LockError(f"{file}: not a lock (not UTF-8 text); {WRITE_HINT}") from None
    return loads(text, file)


def loads(text: str, file: str = "<string>") -> Lock:
    """Parse and validate a lock's text (:func:`read_lock` without the file): bounded first
    (:func:`json_bound_error`), so that json.loads neither recurses past the stack nor converts a
    number of thousands of digits."""
    if not text.strip():
        raise LockError(f"{file}: empty file, not a lock; {WRITE_HINT}")
    if may_be_unbounded(text):
        _check_bounds(text, file)
    try:
        with gc_paused():
            data = json.loads(text)
    except RecursionError:  # brackets in strings hid the depth from the quick look; the scan finds it
        _check_bounds(text, file)
        raise LockError(f"{file}: JSON nested too deeply: not a lock; {READ_HINT}") from None
    except json.JSONDecodeError as exc:
        conflict = re.search(r"^(<<<<<<<|>>>>>>>|=======$)", text, re.M)
        if conflict:  # two branches changed the routing: the plan, not a hand merge, says which is right
            line = text.count("\n", 0, conflict.start()) + 1
            raise LockError(f"{file}:{line}: an unresolved merge conflict; rewrite the lock from the merged "
                            f"spec and model with `geomopt plan SPEC --model … --lock FILE`") from None
        raise LockError(f"{file}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); fix that line, or "
                        f"rewrite the lock with `geomopt plan SPEC --model … --lock FILE`") from None
    # json.loads keeps "\ud800" as a string that no output can print
    if "\\u" in text and SURROGATE.search(text) and lone_surrogate(data):
        lone = LONE_SURROGATE.search(text)
        where = f"{file}:{_line_col(text, lone.end() - 6)}" if lone else file
        raise LockError(f"{where}: a \\u escape that is half of a surrogate pair, no character: a lock's names and "
                        f"fields are text; {READ_HINT}")
    with gc_paused():
        return _Reader(text, file).lock(data)


def _check_bounds(text: str, file: str) -> None:
    bound = json_bound_error(text)
    if bound is not None:
        at, what = bound
        raise LockError(f"{file}:{_line_col(text, at)}: {what}: not a lock; {READ_HINT}")


def _line_col(text: str, at: int) -> str:
    return f"{text.count(chr(10), 0, at) + 1}:{at - (text.rfind(chr(10), 0, at) + 1) + 1}"


class _Reader:
    """Validation of a parsed lock, with the line of what is wrong where the text shows it (the
    writer puts each header key and each tensor on its own line)."""

    def __init__(self, text: str, file: str):
        self.file = file
        self.lines = text.splitlines()

    def where(self, needle: Optional[str] = None, last: bool = False) -> str:
        """``file:line`` of the first (``last``: the last) line holding ``needle``; the file alone
        when no line does (a lock reformatted by hand)."""
        hits = [i for i, line in enumerate(self.lines, 1) if needle is not None and needle in line]
        return f"{self.file}:{hits[-1 if last else 0]}" if hits else self.file

    def fail(self, message: str, needle: Optional[str] = None, last: bool = False) -> LockError:
        return LockError(f"{self.where(needle, last)}: {message}")

    def lock(self, data) -> Lock:
        if not isinstance(data, dict) or FORMAT_KEY not in data:
            raise self.fail(f'not a geomopt routing lock (no "{FORMAT_KEY}" key at the top); {WRITE_HINT}')
        fmt = data[FORMAT_KEY]
        if fmt != LOCK_FORMAT or isinstance(fmt, bool):
            newer = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > LOCK_FORMAT
            raise self.fail(f"lock format {fmt!r}, but this geomopt reads format {LOCK_FORMAT}: "
                            + ("upgrade geomopt, or " if newer else "") + "rewrite the lock with "
                            "`geomopt plan SPEC --model … --lock FILE`", f'"{FORMAT_KEY}"')
        missing = [k for k in _HEADER_KEYS if k not in data]
        if missing:
            raise self.fail(f"missing key(s) {', '.join(map(repr, missing))}; {WRITE_HINT}")
        unknown = sorted(set(data) - {*_HEADER_KEYS, "frozen"})
        if unknown:
            raise self.fail(f"unknown key(s) {', '.join(map(repr, unknown))} (a lock has "
                            f"{', '.join(_HEADER_KEYS)}, frozen)", f'"{unknown[0]}"')
        spec = data["spec"]
        if not (isinstance(spec, dict) and set(spec) == {"name", "hash"}
                and all(isinstance(v, str) for v in spec.values())):
            raise self.fail('"spec" must be {"name": TEXT, "hash": TEXT}', '"spec"')
        if data["model"] is not None and not isinstance(data["model"], str):
            raise self.fail('"model" must be text or null', '"model"')
        if not isinstance(data["geomopt"], str):
            raise self.fail('"geomopt" (the version that wrote the lock) must be text', '"geomopt"')
        if not isinstance(data["tensors"], list):
            raise self.fail('"tensors" must be a list of {"name", "shape", "role", "rule", "view"}', '"tensors"')
        frozen = data.get("frozen", [])
        if not (isinstance(frozen, list) and all(isinstance(n, str) for n in frozen)):
            raise self.fail('"frozen" must be a list of tensor names', '"frozen"')
        routes: dict[str, Route] = {}
        for k, entry in enumerate(data["tensors"]):
            name, route = self.entry(k, entry)
            if name in routes:
                raise self.fail(f"tensor {name!r} is listed twice", _name_needle(name), last=True)
            routes[name] = route
        return Lock(spec["name"], spec["hash"], data["model"], data["geomopt"], routes, tuple(frozen), self.file)

    def entry(self, k: int, entry) -> tuple[str, Route]:
        if not isinstance(entry, dict):
            raise self.bad_entry(k, entry, f"must be an object with keys {', '.join(_ENTRY_KEYS)}")
        if entry.keys() != _ENTRY_SET:
            missing = [key for key in _ENTRY_KEYS if key not in entry]
            unknown = sorted(set(entry) - set(_ENTRY_KEYS))
            problems = [f"{what} {', '.join(map(repr, keys))}" for what, keys in (("missing", missing),
                                                                                 ("unknown", unknown)) if keys]
            raise self.bad_entry(k, entry, f"{'; '.join(problems)} (an entry has {', '.join(_ENTRY_KEYS)})", ":")
        shape = entry["shape"]  # json.loads makes exact ints and lists: type() is isinstance without bool
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise self.bad_entry(k, entry, f"shape must be a list of sizes ([192, 64]), got {json.dumps(shape)}", ":")
        for key in ("name", "role", "rule", "view"):
            if not isinstance(entry[key], str):
                raise self.bad_entry(k, entry, f"{key} must be text, got {json.dumps(entry[key])}", ":")
        return entry["name"], Route(tuple(shape), entry["role"], entry["rule"], entry["view"])

    def bad_entry(self, k: int, entry, message: str, sep: str = "") -> LockError:
        """The error for entry ``k``, at its line where it has a name (looked up only now: a
        valid lock's entries cost no search)."""
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str):
            return self.fail(f"tensor {name!r}{sep} {message}", _name_needle(name))
        return self.fail(f"tensor entry #{k + 1}{sep} {message}")


def _name_needle(name: str) -> str:
    """How the writer spells a tensor's name in its entry (to find the entry's line)."""
    return f'"name": {json.dumps(name, ensure_ascii=False)}'


# ---------------------------------------------------------------- diff


@dataclasses.dataclass
class RoutingDiff:
    """What changed between a lock (``before``) and a plan's routing (``after``): tensors added
    and removed, tensors whose shape, role, rule or view changed; ``notes``: the headers'
    differences (spec, model, geomopt version), said once. False when the routing is the same."""

    before: Lock
    after: Lock
    added: list[str]
    removed: list[str]
    changed: list[str]
    notes: list[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def summary(self) -> str:
        where = self.before.file or "the lock"
        if not self:
            return f"routing unchanged: {len(self.after.routes)} tensors as in {where}"
        return (f"routing changed against {where}: {len(self.changed)} changed, {len(self.added)} added, "
                f"{len(self.removed)} removed (of {len(self.before.routes)} tensors in the lock)")

    def format(self, limit: int = 20) -> str:
        """The summary, the header notes, then one line per tensor grouped as changed, added,
        removed; at most ``limit`` lines a group, the rest counted."""
        lines = [self.summary()] + [f"note: {n}" for n in self.notes]
        b, a = self.before.routes, self.after.routes
        frozen_before, frozen_after = set(self.before.frozen), set(self.after.frozen)
        groups = (
            ("changed", "", self.changed, lambda n: [_changes(b[n], a[n])]),
            ("added", ", in the plan, not in the lock", self.added,
             lambda n: _cells(a[n]) + ["(frozen in the lock)"] * (n in frozen_before)),
            ("removed", ", in the lock, not in the plan", self.removed,
             lambda n: _cells(b[n]) + ["(now frozen)"] * (n in frozen_after)),
        )
        for title, meaning, names, cells in groups:
            if not names:
                continue
            rows = [[n, *cells(n)] for n in names[:limit]]
            widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
            lines.append(f"{title}: {len(names)} tensor(s){meaning}")
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
            if len(names) > limit:
                lines.append(f"  … and {len(names) - limit} more {title}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _shape_text(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"


def _cells(r: Route) -> list[str]:
    return [_shape_text(r.shape), f"role {r.role or '-'}", f"rule {r.rule}", f"view {r.view}"]


def _changes(before: Route, after: Route) -> str:
    parts = []
    for field in ("shape", "role", "rule", "view"):
        x, y = getattr(before, field), getattr(after, field)
        if x != y:
            if field == "shape":
                x, y = _shape_text(x), _shape_text(y)
            parts.append(f"{field} {x or '-'} → {y or '-'}")
    return ", ".join(parts)


def diff(before: Lock, after: Lock) -> RoutingDiff:
    """The routing difference from ``before`` (the lock) to ``after`` (the current plan's lock).

    Linear in the lock's size: each group keeps the order of the lock it comes from (a lock file
    is sorted, a plan nearly so) before it is sorted, and sorting a sorted list is one pass; the
    cyclic collector is paused while the lists are built (its passes scan every live tensor)."""
    with gc_paused():
        return _diff(before, after)


def _diff(before: Lock, after: Lock) -> RoutingDiff:
    b, a = before.routes, after.routes
    order = lambda names: sorted(names, key=name_key)  # noqa: E731
    notes = []
    if (before.spec_name, before.spec_hash) != (after.spec_name, after.spec_hash):
        notes.append(f"the lock was written for spec {before.spec_name!r} (hash {before.spec_hash or '?'}), "
                     f"this plan is spec {after.spec_name!r} (hash {after.spec_hash or '?'})")
    if before.model and after.model and before.model != after.model:
        notes.append(f"the lock was written for model {before.model}, this plan is for {after.model}")
    if before.version != after.version:
        notes.append(f"the lock was written by geomopt {before.version}, this is {after.version}")
    return RoutingDiff(before, after, added=order(n for n in a if n not in b),
                       removed=order(n for n in b if n not in a),
                       changed=order(n for n, r in b.items() if n in a and a[n] != r), notes=notes)


def check_routing(plan: Plan, expect: Union[Lock, str, os.PathLike], *, spec_hash: str = "",
                  model: Optional[str] = None) -> RoutingDiff:
    """Compare ``plan`` with ``expect`` (a :class:`Lock` or a lock file's path); raises
    :class:`RoutingChangedError` (with the diff) when the routing differs, :class:`LockError`
    when the file cannot be read. Returns the (empty) diff, whose notes say what else differs."""
    if isinstance(expect, (str, os.PathLike)):
        expect = read_lock(expect)
    elif not isinstance(expect, Lock):
        raise TypeError(f"expect must be a lock file's path or a geomopt.compile.lock.Lock, "
                        f"not {type(expect).__name__}")
    d = diff(expect, lock_of(plan, spec_hash, model))
    if d:
        raise RoutingChangedError(
            f"spec {plan.spec_name!r} routes tensors differently from the expected lock:\n{d.format()}\n"
            f"If the change is intended, rewrite the lock (`geomopt plan SPEC --model … --lock FILE`).", d)
    return d
