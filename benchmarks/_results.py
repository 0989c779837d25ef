"""Shared by the benchmark scripts: print a result table and, with a note, put it in
benchmarks/RESULTS.md (every figure there carries its device, date and torch version).

RESULTS.md holds the current figures only: one ``## `` section per benchmark, and under it the
newest record (a ``### `` heading, its tables and its note) of each configuration. A recorded
table replaces the record of the same configuration in its section, or is added at the section's
end; earlier figures live in git's history of the file."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
#: the section of the records taken on an accelerator, whichever script made them
GPU = "GPU"
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def section_for(device: str, cpu_section: str) -> str:
    """``cpu_section`` for a run on the CPU, else the accelerators' section."""
    return cpu_section if str(device).split(":")[0] == "cpu" else GPU


def emit(text: str, note: str | None, section: str) -> None:
    """Print ``text``; with a ``note``, record it (the note after it) in ``section`` of RESULTS.md."""
    if note:
        text += f"\n\n{note}"
    print(text)
    if note:
        record(section, text)


def config_key(lines: list[str]) -> tuple:
    """A record's configuration: its heading, and its first table's header and first column (the
    rows' names), with dates and commit hashes left out, so that a new run of the same workload on
    the same machine matches the record it supersedes."""
    table = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    rows: list[str] = []
    if table is not None:
        for line in lines[table:]:
            if not line.startswith("|"):
                break
            rows.append(line.split("|")[1].strip())
    del rows[1:2]  # the |---| line
    return tuple(_COMMIT.sub("<commit>", _DATE.sub("<date>", x)) for x in [lines[0], *rows])


def _records(lines: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each ``### `` record in ``lines``, to the next ``### `` or ``## `` heading."""
    starts = [i for i, line in enumerate(lines) if line.startswith("### ")]
    return [(s, next((j for j in range(s + 1, len(lines)) if lines[j].startswith(("## ", "### "))), len(lines)))
            for s in starts]


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def record(section: str, text: str, path: Path = RESULTS) -> None:
    """Put each ``### `` record of ``text`` in the ``## `` section of ``path`` whose title starts
    with ``section``: in place of the record of the same configuration (:func:`config_key`), else
    at the section's end; a section not there yet is added at the end of the file."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else ["# Benchmark results"]
    new = text.strip("\n").splitlines()
    if not new or not new[0].startswith("### "):
        raise ValueError(f"a record starts with its '### ' heading, not {new[:1]}")
    for start, end in _records(new):
        lines = _put(lines, section, _trim(new[start:end]))
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")


def _put(lines: list[str], section: str, rec: list[str]) -> list[str]:
    head = next((i for i, line in enumerate(lines) if line.startswith("## ") and line[3:].startswith(section)), None)
    if head is None:
        return _trim(lines) + ["", f"## {section}", "", *rec]
    end = next((j for j in range(head + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    key = config_key(rec)
    for start, stop in _records(lines[head:end]):
        if config_key(lines[head + start:head + stop]) == key:
            return lines[:head + start] + rec + [""] + lines[head + stop:]
    return _trim(lines[:end]) + ["", *rec, ""] + lines[end:]


def workload_key(row: str) -> tuple:
    """A dated table row's configuration: its machine cell and its workload cell without its
    parentheses (how roles were decided); the date, torch version, timings and note are what a newer
    run replaces."""
    cells = [c.strip() for c in row.split("|")]
    return cells[2], " ".join(re.sub(r"\([^)]*\)", " ", cells[4]).split())


def record_row(section: str, intro: list[str], row: str, key, path: Path = RESULTS) -> None:
    """Put ``row`` in the dated table of the ``## `` section ``section`` (one row per workload, no
    ``### `` records): in place of the rows whose ``key`` (a function of a row, e.g.
    :func:`workload_key`) is the same, else at the table's end; ``intro`` (what the section
    measures, then the table's header) starts a section not there yet."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else ["# Benchmark results"]
    head = next((i for i, line in enumerate(lines) if line == f"## {section}"), None)
    if head is None:
        lines = _trim(lines) + ["", f"## {section}", "", *intro]
        head = len(lines) - len(intro) - 2
    end = next((j for j in range(head + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    rows = [j for j in range(head, end) if lines[j].startswith("| 2")]
    same = [j for j in rows if key(lines[j]) == key(row)]
    if same:
        lines[same[0]] = row
        for j in reversed(same[1:]):
            del lines[j]
    else:  # after the last row, or the table's |---| line
        lines.insert(max(j for j in range(head, end) if lines[j].startswith("|")) + 1, row)
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")


def round_robin(rows: list, iters: int, warmup: int = 3) -> list[tuple[str, float]]:
    """(name, median ms) of each ``(name, fn)`` row, calling the rows in turn ``iters`` times after
    ``warmup`` untimed rounds: the machine's drift hits every row alike."""
    for _ in range(warmup):
        for _, fn in rows:
            fn()
    times: dict = {name: [] for name, _ in rows}
    for _ in range(iters):
        for name, fn in rows:
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return [(name, statistics.median(times[name])) for name, _ in rows]


def ratio_table(heading: str, what: str, against: str, rows: list) -> str:
    """A markdown table of ``(name, median ms)`` rows, each with its ratio to the first row's."""
    base = rows[0][1]
    lines = [heading, "", f"| {what} | step (ms, median) | × {against} |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.2f} | {ms / base:.3f} |" for name, ms in rows]
    return "\n".join(lines)
